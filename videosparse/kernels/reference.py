"""Torch reference of block-sparse attention: the semantics every backend must match.

For query row r in query tile i, with S_i = the key tiles listed in the plan for (b, h, i):

    exact logits   s_rc = q_r . k_c * scale            for every real key c of a tile in S_i
    proxy logits   s_rj = q_r . k_mean_j * scale        for every key tile j not in S_i
                                                        (only when the plan carries correction)
    out_r = (sum_c exp(s_rc - m) v_c + sum_j exp(s_rj - m) v_sum_j)
          / (sum_c exp(s_rc - m)     + sum_j exp(s_rj - m) len_j)
    lse_r = m + log(denominator)                        (natural log, fp32)

i.e. every skipped tile's keys are replaced by its mean key (zero-order correction). Keys past
the sequence end (the partial last tile) are masked; with `plan.valid_keys`, also the keys of item b at
positions >= valid_keys[b], and skipped tiles that start there do not enter the correction. A row with
no keys at all returns 0 and lse = -inf. Computation runs in fp32 (fp64 for fp64 inputs), one query tile
row at a time, so memory stays O(S*D) per head plus one tile row.
"""

from __future__ import annotations

import math

import torch

from ..plan import Plan


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention in plain torch.

    Args:
        q: [B, H, S, D]; k, v: [B, H, Sk, D]; any float dtype, any device.
        plan: the `Plan` (block_m query rows, block_n keys per tile).
        scale: softmax scale.
        return_lse: also return the row log-sum-exp, fp32 [B, H, S].

    Returns:
        out [B, H, S, D] in q's dtype (and lse).
    """
    B, H, S, D = q.shape
    Sk = k.shape[2]
    plan = plan.with_index_slot()
    bm, bn = plan.block_m, plan.block_n
    Mq, Nk = math.ceil(S / bm), math.ceil(Sk / bn)
    if Nk == 0:                                  # no keys: every row is empty (0, lse -inf), as in the kernels
        out = q.new_zeros(q.shape)
        lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    pad = Nk * bn - Sk
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad)).to(cd).view(B, H, Nk, bn * D)
    vp = torch.nn.functional.pad(v, (0, 0, 0, pad)).to(cd).view(B, H, Nk, bn * D)
    limit = torch.full((B,), Sk, device=q.device) if plan.valid_keys is None else plan.valid_keys.long().clamp_max(Sk)
    key_real = (torch.arange(Nk * bn, device=q.device) < limit[:, None]).view(B, 1, Nk, bn)   # [B, 1, Nk, bn]
    kmax = plan.kv_index.shape[-1]
    slot = torch.arange(kmax, device=q.device)
    if plan.has_correction:
        k_mean = plan.k_mean.to(cd)
        v_sum = plan.v_sum.to(cd)
        tile_len = plan.tile_len.to(device=q.device, dtype=cd)
        v_mean = v_sum / tile_len[:, None].clamp_min(1)
        log_len = tile_len.clamp_min(1).log()

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    for i in range(Mq):
        r0, r1 = i * bm, min(S, (i + 1) * bm)
        qi = q[:, :, r0:r1].to(cd)                                          # [B, H, r, D]
        slot_valid = slot < plan.kv_count[:, :, i, None]                    # [B, H, K]
        idx = torch.where(slot_valid, plan.kv_index[:, :, i].long(), 0)     # [B, H, K]
        g = idx[..., None].expand(B, H, kmax, bn * D)
        kt = torch.gather(kp, 2, g).view(B, H, kmax * bn, D)
        vt = torch.gather(vp, 2, g).view(B, H, kmax * bn, D)
        real = torch.gather(key_real.expand(B, H, Nk, bn), 2, idx[..., None].expand(B, H, kmax, bn))
        keep = (slot_valid[..., None] & real).view(B, H, 1, kmax * bn)
        logits = (qi @ kt.transpose(-1, -2)) * scale
        logits = logits.masked_fill(~keep, float("-inf"))
        # keys that do not count (unlisted slots, padding, past valid_keys) carry no values: 0 * inf or NaN there
        # must not reach the row
        values = vt.masked_fill(~keep.transpose(-1, -2), 0.0)
        if plan.has_correction:
            chosen = torch.zeros(B, H, Nk + 1, dtype=torch.bool, device=q.device)
            chosen.scatter_(-1, torch.where(slot_valid, idx, Nk), True)
            chosen[:, :, :Nk] |= (torch.arange(Nk, device=q.device) * bn >= limit[:, None])[:, None]  # past the keys
            proxy = (qi @ k_mean.transpose(-1, -2)) * scale + log_len      # [B, H, r, Nk]
            proxy = proxy.masked_fill(chosen[:, :, None, :Nk], float("-inf"))
            logits = torch.cat([logits, proxy], -1)
            values = torch.cat([values, v_mean.masked_fill(chosen[:, :, :Nk, None], 0.0)], -2)
        m = logits.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(logits - m)
        denom = p.sum(-1, keepdim=True)
        o = (p @ values) / denom.clamp_min(torch.finfo(cd).tiny)
        out[:, :, r0:r1] = o.to(q.dtype)
        lse[:, :, r0:r1] = (m + denom.log()).squeeze(-1).float()
    return (out, lse) if return_lse else out
