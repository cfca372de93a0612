"""Triton kernel: the balanced work order of `videosparse.plan.work_order` in one launch.

The persistent kernels deal their work items by a static stride (program p takes the order's entries p, p + P,
p + 2P, ...), so each wave of P consecutive entries gives every program one item. `work_order` permutes each
wave of its base order (long rows first, then (b, h, m)) so that its longest item goes to the least-loaded
program; the waves depend on each other through the loads, so one program walks them in sequence: per wave one
sort of the wave's item costs (descending) and one of the programs' loads (ascending), both as packed int64
keys in registers, and a scatter of the wave's entries. ~23 waves at 12 x 32,768 (3,072 rows on 132 SMs), ~180
at 40 x 75,600.

Ties (the torch path's, `plan._balanced_positions`): among equal costs the earlier entry first, among equal
loads the lower program first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PROGRAMS = 1 << 12   # the keys keep a program / lane index in 16 bits; far beyond any GPU's SM count


@triton.jit
def _balanced_order_kernel(BASE, COST, ORDER, N, FULL, PROGRAMS, BLOCK: tl.constexpr):
    # entries j of the base order BASE (rows); COST indexed by row
    lane = tl.arange(0, BLOCK)
    live = lane < PROGRAMS
    tail = FULL * PROGRAMS
    in_tail = lane < N - tail                      # the last, partial wave: programs 0..r-1, rows as they are
    row = tl.load(BASE + tail + lane, mask=in_tail, other=0)
    tl.store(ORDER + tail + lane, row, mask=in_tail)
    load = tl.load(COST + row, mask=in_tail, other=0).to(tl.int64)
    big = tl.full([BLOCK], 1 << 62, tl.int64)
    load_key = tl.where(live, (load << 16) | lane.to(tl.int64), big)
    for w in range(FULL):
        base = w * PROGRAMS
        row = tl.load(BASE + base + lane, mask=live, other=0)
        cost = tl.load(COST + row, mask=live, other=0).to(tl.int64)
        item_key = tl.where(live, (cost << 16) | (0xFFFF - lane).to(tl.int64), -1)
        item_key = tl.sort(item_key, descending=True)      # longest first, the lower row among equals
        col_key = tl.sort(load_key)                         # least loaded first, the lower program among equals
        item = 0xFFFF - (item_key & 0xFFFF)
        col = col_key & 0xFFFF
        tl.store(ORDER + base + col, tl.load(BASE + base + item, mask=live), mask=live)
        load_key = tl.where(live, (((col_key >> 16) + (item_key >> 16)) << 16) | col, big)


def balanced_order(base: torch.Tensor, cost: torch.Tensor, programs: int, *, num_warps: int = 8) -> torch.Tensor:
    """int32 [N]: the rows of `base` (int32 [N], a permutation) with each wave of `programs` entries permuted
    to balance the programs, from the rows' costs (int32 or int64 [N] by row, non-negative, < 2^40); see the
    module docstring and `plan.work_order`. num_warps: 8 measured fastest of 1/2/4/8 on the H200 (77 / 568 / 1,067 us at
    3,072 / 23,640 / 44,592 rows; benchmarks/work_order_kernel_cost_h200.json)."""
    if not 1 <= programs <= MAX_PROGRAMS:
        raise ValueError(f"programs must be in [1, {MAX_PROGRAMS}]; got {programs}.")
    base, cost = base.reshape(-1).contiguous(), cost.reshape(-1).contiguous()
    n = base.numel()
    order = torch.empty(n, dtype=torch.int32, device=base.device)
    if n:
        _balanced_order_kernel[(1,)](base, cost, order, n, n // programs, programs,
                                     BLOCK=triton.next_power_of_2(programs), num_warps=num_warps)
    return order
