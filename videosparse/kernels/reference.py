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

Gradients: autograd through `reference_attention` keeps every row's gathered tiles and probabilities (memory
grows with density * S^2); `reference_attention_backward` recomputes each row from q, k, v instead (as
FlashAttention does), so it too needs O(S*D) memory plus one tile row (`autograd.RecomputingAttention` runs it).
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..plan import Plan


class _Rows:
    """The operands of one query tile row: the listed K/V tiles gathered (and, with correction, the centroids of
    the other tiles), their masks and the row's logits, shared by the forward and the backward."""

    def __init__(self, q, k, v, plan: Plan, scale: float) -> None:
        B, H, S, D = q.shape
        Sk = k.shape[2]
        self.plan, self.scale, self.S = plan, scale, S
        self.bm, self.bn = plan.block_m, plan.block_n
        self.Mq, self.Nk = math.ceil(S / self.bm), math.ceil(Sk / self.bn)
        self.cd = cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        bn, Nk = self.bn, self.Nk
        pad = Nk * bn - Sk
        # reshape, not view: with no padding F.pad keeps a strided k / v's strides (e.g. a (B, S, H, D) transpose)
        self.kp = torch.nn.functional.pad(k, (0, 0, 0, pad)).to(cd).reshape(B, H, Nk, bn * D)
        self.vp = torch.nn.functional.pad(v, (0, 0, 0, pad)).to(cd).reshape(B, H, Nk, bn * D)
        self.limit = limit = torch.full((B,), Sk, device=q.device) if plan.valid_keys is None else \
            plan.valid_keys.long().clamp_max(Sk)
        self.key_real = (torch.arange(Nk * bn, device=q.device) < limit[:, None]).view(B, 1, Nk, bn)  # [B,1,Nk,bn]
        self.kmax = plan.kv_index.shape[-1]
        self.slot = torch.arange(self.kmax, device=q.device)
        if plan.has_correction:
            self.k_mean = plan.k_mean.to(cd)
            self.tile_len = plan.tile_len.to(device=q.device, dtype=cd)
            self.v_mean = plan.v_sum.to(cd) / self.tile_len[:, None].clamp_min(1)
            self.log_len = self.tile_len.clamp_min(1).log()

    def rows(self, i: int) -> tuple[int, int]:
        return i * self.bm, min(self.S, (i + 1) * self.bm)

    def row(self, i: int, q: torch.Tensor) -> dict:
        """Row i's qi [B, H, r, D], gather index g, key mask keep [B, H, 1, K*bn], masked logits [B, H, r, K*bn (+
        Nk)], values [B, H, K*bn (+ Nk), D] (zero where a key does not count) and, with correction, `chosen`
        [B, H, Nk + 1] (the tiles that are not proxies)."""
        B, H = q.shape[:2]
        kmax, bn, Nk, plan = self.kmax, self.bn, self.Nk, self.plan
        r0, r1 = self.rows(i)
        qi = q[:, :, r0:r1].to(self.cd)                                     # [B, H, r, D]
        slot_valid = self.slot < plan.kv_count[:, :, i, None]               # [B, H, K]
        idx = torch.where(slot_valid, plan.kv_index[:, :, i].long(), 0)     # [B, H, K]
        g = idx[..., None].expand(B, H, kmax, bn * q.shape[-1])
        kt = torch.gather(self.kp, 2, g).view(B, H, kmax * bn, q.shape[-1])
        vt = torch.gather(self.vp, 2, g).view(B, H, kmax * bn, q.shape[-1])
        real = torch.gather(self.key_real.expand(B, H, Nk, bn), 2, idx[..., None].expand(B, H, kmax, bn))
        keep = (slot_valid[..., None] & real).view(B, H, 1, kmax * bn)
        logits = (qi @ kt.transpose(-1, -2)) * self.scale
        logits = logits.masked_fill(~keep, float("-inf"))
        # keys that do not count (unlisted slots, padding, past valid_keys) carry no values: 0 * inf or NaN there
        # must not reach the row
        values = vt.masked_fill(~keep.transpose(-1, -2), 0.0)
        out = dict(qi=qi, g=g, keep=keep, kt=kt, logits=logits, values=values)
        if plan.has_correction:
            chosen = torch.zeros(B, H, Nk + 1, dtype=torch.bool, device=q.device)
            chosen.scatter_(-1, torch.where(slot_valid, idx, Nk), True)
            chosen[:, :, :Nk] |= (torch.arange(Nk, device=q.device) * bn >= self.limit[:, None])[:, None]  # past keys
            proxy = (qi @ self.k_mean.transpose(-1, -2)) * self.scale + self.log_len      # [B, H, r, Nk]
            proxy = proxy.masked_fill(chosen[:, :, None, :Nk], float("-inf"))
            out["logits"] = torch.cat([logits, proxy], -1)
            out["values"] = torch.cat([values, self.v_mean.masked_fill(chosen[:, :, :Nk, None], 0.0)], -2)
            out["chosen"] = chosen[:, :, :Nk]
        return out


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
    with autocast_off(q.device):                             # fp32 as documented, also inside an autocast region
        return _reference_attention(q, k, v, plan, scale, return_lse)


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """A region with autocast off on `device` (nothing to do on a device type autocast does not know: meta)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _reference_attention(q, k, v, plan: Plan, scale: float, return_lse: bool):
    B, H, S, D = q.shape
    plan = plan.with_index_slot()
    if math.ceil(k.shape[2] / plan.block_n) == 0 or B * H == 0:   # no keys (or no rows): 0, lse -inf, as the kernels
        out = q.new_zeros(q.shape)
        lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    rows = _Rows(q, k, v, plan, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    for i in range(rows.Mq):
        r0, r1 = rows.rows(i)
        row = rows.row(i, q)
        logits = row["logits"]
        m = logits.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(logits - m)
        denom = p.sum(-1, keepdim=True)
        o = (p @ row["values"]) / denom.clamp_min(torch.finfo(rows.cd).tiny)
        out[:, :, r0:r1] = o.to(q.dtype)
        lse[:, :, r0:r1] = (m + denom.log()).squeeze(-1).float()
    return (out, lse) if return_lse else out


def reference_attention_backward(q, k, v, plan: Plan, scale: float, d_out: torch.Tensor | None,
                                 d_lse: torch.Tensor | None) -> tuple:
    """Gradients of `reference_attention`'s (out, lse) for q, k, v and the plan's k_mean, v_sum (None without
    correction), each query tile row recomputed; d_out [B, H, S, D], d_lse [B, H, S] (None: zero)."""
    B, H, S, D = q.shape
    plan = plan.with_index_slot()
    if math.ceil(k.shape[2] / plan.block_n) == 0 or B * H == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None
    rows = _Rows(q, k, v, plan, scale)
    cd, Sk, Nk, bn = rows.cd, k.shape[2], rows.Nk, rows.bn
    dq = torch.zeros(q.shape, dtype=cd, device=q.device)
    dkp, dvp = torch.zeros_like(rows.kp), torch.zeros_like(rows.vp)      # [B, H, Nk, bn * D]
    correction = plan.has_correction
    if correction:
        dk_mean = torch.zeros(B, H, Nk, D, dtype=cd, device=q.device)
        dv_mean = torch.zeros(B, H, Nk, D, dtype=cd, device=q.device)
    exact = rows.kmax * bn
    for i in range(rows.Mq):
        r0, r1 = rows.rows(i)
        row = rows.row(i, q)
        # the row's lse again in the compute dtype (the forward's is fp32); a row with no keys (lse -inf) has no
        # probabilities: P = 0 there, not exp(-inf + inf)
        row_lse = torch.logsumexp(row["logits"], -1, keepdim=True)
        p = torch.exp(row["logits"] - torch.where(torch.isfinite(row_lse), row_lse, 0.0))
        p = torch.where(torch.isfinite(row_lse), p, 0.0)                    # [B, H, r, K*bn (+ Nk)]
        values = row["values"]
        do = d_out[:, :, r0:r1].to(cd) if d_out is not None else torch.zeros_like(row["qi"])
        o = p @ values
        dp = do @ values.transpose(-1, -2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        if d_lse is not None:
            ds = ds + p * d_lse[:, :, r0:r1, None].to(cd)
        # keys that do not count may hold anything (NaN past valid_keys): zero them for dq, as P is zero there
        keys = row["kt"].masked_fill(~row["keep"].transpose(-1, -2), 0.0)
        ds_exact = ds[..., :exact]
        dq[:, :, r0:r1] = (ds_exact @ keys) * scale
        tiles = (B, H, rows.kmax, -1)
        dkp.scatter_add_(2, row["g"], ((ds_exact.transpose(-1, -2) @ row["qi"]) * scale).reshape(tiles))
        dvp.scatter_add_(2, row["g"], (p[..., :exact].transpose(-1, -2) @ do).reshape(tiles))
        if correction:
            ds_proxy, chosen = ds[..., exact:], row["chosen"][:, :, :, None]
            dq[:, :, r0:r1] += (ds_proxy @ rows.k_mean.masked_fill(chosen, 0.0)) * scale
            dk_mean += (ds_proxy.transpose(-1, -2) @ row["qi"]) * scale
            dv_mean += p[..., exact:].transpose(-1, -2) @ do
    dk = dkp.view(B, H, Nk * bn, D)[:, :, :Sk].to(k.dtype)
    dv = dvp.view(B, H, Nk * bn, D)[:, :, :Sk].to(v.dtype)
    d_k_mean = d_v_sum = None
    if correction:
        d_k_mean = dk_mean.to(plan.k_mean.dtype)
        d_v_sum = (dv_mean / rows.tile_len[:, None].clamp_min(1)).to(plan.v_sum.dtype)
    return dq.to(q.dtype), dk, dv, d_k_mean, d_v_sum
