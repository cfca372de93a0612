"""Triton kernel: the row-wise top-k selection of `videosparse.plan.topk_plan` in one launch.

The torch path of `topk_plan` takes ~25 small kernels (NaN and diagonal fixes, a radix top-k, masks, a sort
of the picks, counts), i.e. ~0.45-0.7 ms of host time per call on the H200's host and ~1 ms of GPU time at the
Wan 14B shape. Here one program per plan row loads the row's scores, finds the value of its budget-th best
key tile by a 32-step bisection over order-preserving integer keys of the fp32 scores, and writes the chosen
columns in ascending order (a prefix sum places them), then the global tiles, then zeros.

Selection rule (the torch path's, with its ties made deterministic): the diagonal tile is always kept and
counts towards the row's budget; NaN and -inf scores are never chosen (a row with fewer finite columns keeps
fewer); among equal scores at the budget boundary the lower column wins. Rows after the video rows (global
tiles) keep every tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import COMPILE_OPTIONS, on_input_device

MAX_TILES = 8192        # video tiles per row this kernel takes (one row in registers); the torch path beyond


@triton.jit
def _topk_rows_kernel(S, BUDGET, IDX, CNT, MV, G, W, NV_P2: tl.constexpr, W_P2: tl.constexpr):
    # program = one plan row (b*H + h) * (MV + G) + r of the [B, H, MV + G, W] index
    pid = tl.program_id(0)
    n_rows = MV + G
    bh = pid // n_rows
    r = pid % n_rows
    out = IDX + pid.to(tl.int64) * W
    w = tl.arange(0, W_P2)
    if r >= MV:                                   # a global row attends to every tile (W == MV + G then)
        tl.store(out + w, w, mask=w < W)
        tl.store(CNT + pid, n_rows)
    else:
        cols = tl.arange(0, NV_P2)
        x = tl.load(S + (bh.to(tl.int64) * MV + r) * MV + cols, mask=cols < MV, other=float("-inf"))
        x = tl.where(x == 0.0, 0.0, x.to(tl.float32))   # -0.0 as +0.0: a tie between them goes to the lower column
        cand = (x > float("-inf")) & (cols != r)  # NaN compares false: never chosen; the diagonal is forced
        b = tl.minimum(tl.load(BUDGET + r).to(tl.int32) - 1, tl.sum(cand.to(tl.int32), 0))
        b = tl.minimum(b, W - G - 1)              # never past the row's width (a width below max(budget) + G)
        # fp32 -> uint32 keys in the same order: flip every bit of negatives, the sign bit of the rest
        bits = x.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)) ^ -2147483648
        u = key.to(tl.uint32, bitcast=True)
        # the largest t with #{cand: u >= t} >= b, built bit by bit from the top: the b-th largest key
        t = tl.zeros((), tl.uint32)
        bit = tl.full((), 1 << 31, tl.uint32)
        for _ in range(32):
            trial = t | bit
            t = tl.where(tl.sum((cand & (u >= trial)).to(tl.int32), 0) >= b, trial, t)
            bit = bit >> 1
        above = cand & (u > t)
        ties = cand & (u == t)
        extra = b - tl.sum(above.to(tl.int32), 0)
        sel = above | (ties & (tl.cumsum(ties.to(tl.int32), 0) <= extra)) | (cols == r)
        pos = tl.cumsum(sel.to(tl.int32), 0) - 1
        n = tl.sum(sel.to(tl.int32), 0)
        tl.store(out + pos, cols, mask=sel)
        g = w - n                                 # the global tiles after the picks, zeros after them
        tl.store(out + w, tl.where(g < G, MV + g, 0), mask=(w >= n) & (w < W))
        tl.store(CNT + pid, n + G)


def topk_num_warps(num_tiles: int) -> int:
    """Warps per row: one up to 1,024 tiles, then one per 1,024. The bisection is a chain of row reductions, so
    more rows in flight beat wider rows: on the H200 40 x 591 rows took 272 / 296 / 335 / 432 / 709 us with
    1 / 2 / 4 / 8 / 16 warps, 24 x 929 rows 263 / 281 / 317 / 409 / 670 us, and 2 x 32 x 48 or 2 x 12 x 256 rows
    23-30 us with 1 or 2 warps (`scripts/bench_veda_plan.py` repeats the sweep at its shape)."""
    return min(16, max(1, triton.next_power_of_2(num_tiles) // 1024))


@on_input_device
def topk_rows_triton(scores: torch.Tensor, budget: torch.Tensor, width: int, num_global_tiles: int = 0, *,
                     num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`budget[r]` key tiles of every row r of `scores`, packed left in ascending order.

    Args:
        scores: float [B, H, Mv, Mv] (any float dtype; compared in fp32), Mv <= `MAX_TILES`.
        budget: int [Mv], tiles per video row including the forced diagonal, each >= 1.
        width: index columns (>= max(budget) + num_global_tiles, else a row keeps only width - G tiles; Mv + G
            when there are global tiles).
        num_global_tiles: G tiles after the video tiles: every video row also keeps them (after its picks),
            and their G rows keep every tile.
        num_warps: warps per row (default `topk_num_warps`).

    Returns:
        kv_index int32 [B, H, Mv + G, width] (0 past each row's count), kv_count int32 [B, H, Mv + G].
    """
    if scores.dim() != 4 or scores.shape[-1] != scores.shape[-2] or scores.shape[-1] > MAX_TILES:
        raise ValueError(f"scores {tuple(scores.shape)} must be [B, H, Mv, Mv] with Mv <= {MAX_TILES}.")
    B, H, Mv, _ = scores.shape
    G = num_global_tiles
    if isinstance(G, bool) or not isinstance(G, int) or G < 0:
        raise ValueError(f"num_global_tiles={G!r} must be an int >= 0.")
    if tuple(budget.shape) != (Mv,) or budget.device != scores.device or budget.is_floating_point():
        raise ValueError(f"budget ({tuple(budget.shape)}, {budget.dtype} on {budget.device}) must be an int tensor "
                         f"[{Mv}] on {scores.device}.")
    if not (G + 1 <= width <= Mv + G) or (G and width != Mv + G):
        raise ValueError(f"width={width} must be in [{G + 1}, {Mv + G}] (and {Mv + G} with {G} global tiles).")
    N = Mv + G
    scores = scores.contiguous()
    idx = torch.empty(B, H, N, width, dtype=torch.int32, device=scores.device)
    count = torch.empty(B, H, N, dtype=torch.int32, device=scores.device)
    nv_p2 = triton.next_power_of_2(Mv)
    _topk_rows_kernel[(B * H * N,)](scores, budget, idx, count, Mv, num_global_tiles, width, NV_P2=nv_p2,
                                    W_P2=triton.next_power_of_2(width), num_warps=num_warps or topk_num_warps(Mv),
                                    **COMPILE_OPTIONS)
    return idx, count
