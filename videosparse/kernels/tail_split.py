"""Splitting the last, partly filled wave of a persistent kernel's work items across the idle SMs.

A persistent grid of P programs takes work items u = pid, pid + P, ... With N items of about equal length
(top-k plans give every query tile the same count) the last wave holds only r = N mod P items, so P - r SMs
idle for a whole item: at 12 x 32,768 (3,072 items on 132 SMs) 24 item-times for 23.3 items of work, 3% of
the kernel. Here the last r items of the order (`plan.work_order`: the base order's last rows) are cut into
`parts` consecutive runs of their key-tile list; each run is a work unit of its own that writes a normalised
partial output and its LSE to a slot of a workspace, and `combine_parts` merges the parts of each item
(LSE-weighted, exact: softmax over disjoint key sets). Work unit u, for N_full = N - r:

    u <  N_full:  item order[u], all its tiles (and, with the zero-order correction, its centroid chunks)
    u >= N_full:  v = u - N_full, item order[N_full + v // parts], part p = v % parts: tiles
                  [p * n // parts, (p + 1) * n // parts) of its n, the centroid chunks with the last part;
                  output rows to workspace slot v (128 rows, fp32) and lse_part[v]

`work_units` is the same rule in torch (the host-side spec the CPU tests check the kernel's rule against).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import COMPILE_OPTIONS

MIN_PART_TILES = 2   # a part should average at least this many of the plan's Kmax tiles (fixed cost per unit)
# What a split must take off the last wave, in key tiles x head dim: the merge costs a launch (~10-15 us on the
# H200 with the partial stores), so the gate asks ~30 us of saved tiles (16 key tiles at head dim 128, 32 at
# 64). An interleaved A/B at 12 x 32,768 (benchmarks/ab_gluon_tail_split_h200.json): split +1.7% at density 0.1
# (Kmax 26: 17 tiles saved) and +2.2% dense at d128, but -0.5% at 0.05 (9 tiles) and -1.8% at d64, 0.05.
AUTO_MIN_SAVED = 2048


def tail_split(n_items: int, programs: int, kmax: int, min_saved_tiles: float = 0.0) -> tuple[int, int]:
    """(n_full, parts): the items before n_full run whole; the last n_items - n_full are each cut into `parts`
    units so that the last wave fills up to `programs` SMs. parts == 1: no split (the last wave is full, or
    over half full, or the items are too short to cut, or a split would save fewer than `min_saved_tiles` of
    Kmax key tiles from the last wave; `AUTO_MIN_SAVED / head_dim` is the gate the kernel uses by default)."""
    if n_items <= 0 or programs <= 0:
        return max(n_items, 0), 1
    rest = n_items % programs
    if rest == 0:
        return n_items, 1
    parts = min(programs // rest, max(1, kmax // MIN_PART_TILES))
    if parts < 2 or kmax * (1 - 1 / parts) < min_saved_tiles:
        return n_items, 1
    return n_items - rest, parts


def work_units(order: torch.Tensor, kv_count: torch.Tensor, n_full: int, parts: int):
    """The units of `tail_split` as tensors (host reference of the kernel's rule): (item, lo, n, last, slot)
    int64 [N_full + (N - N_full) * parts] each; last = 1 where the unit carries the item's centroid chunks,
    slot = -1 for whole items."""
    order = order.long()
    counts = kv_count.reshape(-1).long()
    n_items = order.numel()
    u = torch.arange(n_full + (n_items - n_full) * parts, device=order.device)
    tail = u >= n_full
    v = torch.where(tail, u - n_full, 0)
    k = torch.where(tail, parts, 1)
    part = v % k
    item = order[torch.where(tail, n_full + v // k, u)]
    total = counts[item]
    lo = part * total // k
    n = (part + 1) * total // k - lo
    return item, lo, n, (part == k - 1).long(), torch.where(tail, v, -1)


@triton.jit
def _combine_kernel(O_PART, LSE_PART, O, LSE, ORDER, N_FULL, PARTS, MQ, S, HEAD_DIM: tl.constexpr,
                    BLOCK_R: tl.constexpr, STORE_LSE: tl.constexpr):
    """Program (i, rb): rows rb*BLOCK_R .. of split item order[N_FULL + i]: merge its PARTS partial outputs
    (fp32, normalised) by their natural-log LSEs; rows that saw no key give 0 and -inf; rows past S dropped."""
    i = tl.program_id(0)
    rb = tl.program_id(1)
    item = tl.load(ORDER + N_FULL + i)
    bh = item // MQ
    mt = item % MQ
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, HEAD_DIM)
    base = (i * PARTS).to(tl.int64) * 128
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for p in range(PARTS):
        m = tl.maximum(m, tl.load(LSE_PART + base + p * 128 + r))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    for p in range(PARTS):
        w = tl.exp(tl.load(LSE_PART + base + p * 128 + r) - m_safe)
        acc += w[:, None] * tl.load(O_PART + (base + p * 128 + r)[:, None] * HEAD_DIM + d[None, :])
        den += w
    seen = den != 0.0                      # NaN rows stay NaN
    out = acc / tl.where(seen, den, 1.0)[:, None]
    rows = mt * 128 + r
    keep = rows < S
    tl.store(O + (bh.to(tl.int64) * S + rows)[:, None] * HEAD_DIM + d[None, :], out.to(O.dtype.element_ty),
             mask=keep[:, None])
    if STORE_LSE:
        tl.store(LSE + bh.to(tl.int64) * S + rows, tl.where(seen, m_safe + tl.log(tl.where(seen, den, 1.0)),
                                                              float("-inf")), mask=keep)


def combine_parts(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                  order: torch.Tensor, n_full: int, parts: int, num_query_tiles: int):
    """Merge the parts of the split items into out [B, H, S, D] (and lse fp32 [B, H, S] when given), in place.

    o_part fp32 [units * 128, D] and lse_part fp32 [units * 128] (natural log) hold the split units in slot
    order (`work_units`); 128-row query tiles; order int32 [B*H*Mq] is the kernel's work order."""
    n_split = order.numel() - n_full
    if n_split <= 0:
        return
    S, D = out.shape[-2], out.shape[-1]
    block_r = 32 if D > 64 else 64
    _combine_kernel[(n_split, 128 // block_r)](o_part, lse_part, out, lse if lse is not None else lse_part, order,
                                               n_full, parts, num_query_tiles, S, HEAD_DIM=D, BLOCK_R=block_r,
                                               STORE_LSE=lse is not None, **COMPILE_OPTIONS)


def combine_parts_torch(o_part, lse_part, out, lse, order, n_full: int, parts: int, num_query_tiles: int):
    """`combine_parts` in torch ops (the reference its kernel is tested against)."""
    n_split = order.numel() - n_full
    if n_split <= 0:
        return
    B, H, S, D = out.shape
    lp = lse_part.view(n_split, parts, 128)
    m = lp.amax(1, keepdim=True)
    w = torch.exp(lp - torch.where(torch.isinf(m), 0.0, m))
    den = w.sum(1)
    o = (w[..., None] * o_part.view(n_split, parts, 128, D)).sum(1) / torch.where(den > 0, den, 1.0)[..., None]
    l_out = torch.where(den > 0, torch.where(torch.isinf(m[:, 0]), 0.0, m[:, 0]) + torch.log(den), float("-inf"))
    items = order[n_full:].long()
    bh, mt = items // num_query_tiles, items % num_query_tiles
    rows = mt[:, None] * 128 + torch.arange(128, device=out.device)
    keep = rows < S
    flat_out = out.view(B * H, S, D)
    bh_rows = bh[:, None].expand_as(rows)
    flat_out[bh_rows[keep], rows[keep]] = o[keep].to(out.dtype)
    if lse is not None:
        lse.view(B * H, S)[bh_rows[keep], rows[keep]] = l_out[keep]
