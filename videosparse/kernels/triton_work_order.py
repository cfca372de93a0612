"""Triton kernels: the balanced work order of `videosparse.plan.work_order` in two launches.

The persistent kernels deal their work items by a static stride (program p takes the order's entries p, p + P,
p + 2P, ...), so each wave of P consecutive entries gives every program one item. `work_order` permutes each
wave of its base order (long rows first, then (b, h, m)) so that its costliest item goes to the least-loaded
program. Two launches:

1. `_wave_items_kernel`, one program per full wave, all waves at once: the wave's item costs sorted descending,
   as int32 keys (cost << LANE_BITS | ~lane).
2. `_balanced_order_kernel`, one program that walks the waves in sequence (they depend on each other through
   the loads): per wave one sort of the programs' loads (ascending), int32 keys (load << LANE_BITS | program),
   and a scatter of the wave's entries. The loads are kept relative to their minimum: after each wave their
   spread is at most the largest item cost (greedy pairing of costs descending with loads ascending never
   widens a spread beyond max(spread, cost)), so they fit the key beside the lane bits.

~23 waves at 12 x 32,768 (3,072 rows on 132 SMs), ~180 at 40 x 75,600. Ties (the torch path's,
`plan._balanced_positions`): among equal costs the earlier entry first, among equal loads the lower program
first. Costs above `cost_limit(programs)` (over 10^5 key tiles per row) are clamped, and negative ones taken as 0:
the order stays a valid permutation of each wave, only its balance would differ from the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import COMPILE_OPTIONS, on_input_device

MAX_PROGRAMS = 1 << 12   # far beyond any GPU's SM count


def _block(programs: int) -> int:
    """Lanes per wave: programs rounded up to a power of two (at least 16)."""
    return max(triton.next_power_of_2(programs), 16)


def _lane_bits(programs: int) -> int:
    return _block(programs).bit_length() - 1


def cost_limit(programs: int) -> int:
    """The largest row cost the kernels keep exactly for a grid of `programs` (half of what an int32 key holds
    beside the lane bits: a relative load is at most twice the largest cost)."""
    return ((1 << (31 - _lane_bits(programs))) - 1) // 2


@triton.jit
def _wave_items_kernel(BASE, COST, ITEM_KEY, PROGRAMS, COST_OFFSET, COST_MAX, LANE_BITS: tl.constexpr,
                       BLOCK: tl.constexpr):
    # wave w = program id: ITEM_KEY[w * PROGRAMS + i] = the wave's i-th costliest entry as cost << LANE_BITS | ~lane
    lane = tl.arange(0, BLOCK)
    live = lane < PROGRAMS
    base = tl.program_id(0) * PROGRAMS
    row = tl.load(BASE + base + lane, mask=live, other=0)
    cost = tl.minimum(tl.maximum(tl.load(COST + row, mask=live, other=0) + COST_OFFSET, 0), COST_MAX).to(tl.int32)
    key = tl.where(live, (cost << LANE_BITS) | (BLOCK - 1 - lane), -1)
    key = tl.sort(key, descending=True)                  # costliest first, the earlier entry among equals
    tl.store(ITEM_KEY + base + lane, key, mask=live)


@triton.jit
def _balanced_order_kernel(BASE, COST, ITEM_KEY, ORDER, N, FULL, PROGRAMS, COST_OFFSET, COST_MAX,
                           LANE_BITS: tl.constexpr, BLOCK: tl.constexpr):
    # entries j of the base order BASE (rows); COST indexed by row; ITEM_KEY from _wave_items_kernel
    lane = tl.arange(0, BLOCK)
    live = lane < PROGRAMS
    lane_mask = BLOCK - 1
    dead = 0x7FFFFFFF                                    # sorts after every live key
    tail = FULL * PROGRAMS
    in_tail = lane < N - tail                            # the last, partial wave: programs 0..r-1, rows as they are
    row = tl.load(BASE + tail + lane, mask=in_tail, other=0)
    tl.store(ORDER + tail + lane, row, mask=in_tail)
    load = tl.minimum(tl.maximum(tl.load(COST + row, mask=in_tail, other=0) + COST_OFFSET, 0), COST_MAX)
    load = tl.where(in_tail, load, 0)
    load = load.to(tl.int32)
    load_key = tl.where(live, (load << LANE_BITS) | lane, dead)
    for w in range(FULL):
        base = w * PROGRAMS
        item_key = tl.load(ITEM_KEY + base + lane, mask=live, other=0)
        col_key = tl.sort(load_key)                      # least loaded first, the lower program among equals
        col = col_key & lane_mask
        item = lane_mask - (item_key & lane_mask)
        tl.store(ORDER + base + col, tl.load(BASE + base + item, mask=live), mask=live)
        load = (col_key >> LANE_BITS) + (item_key >> LANE_BITS)
        load -= tl.min(tl.where(live, load, dead), axis=0)
        load_key = tl.where(live, (load << LANE_BITS) | col, dead)


@on_input_device
def balanced_order(base: torch.Tensor, cost: torch.Tensor, programs: int, *, cost_offset: int = 0,
                   num_warps: int = 4) -> torch.Tensor:
    """int32 [N]: the rows of `base` (int32 or int64 [N], a permutation) with each wave of `programs` entries
    permuted to balance the programs, from the rows' costs (int32 or int64 [N] by row, non-negative; each
    plus `cost_offset`); see the module docstring and `plan.work_order`. num_warps: of the sequential kernel;
    on the H200 4 warps took 41 / 260 / 483 us at 3,072 / 23,640 / 44,592 rows, 8 warps 46 / 264 / 489, 2 warps
    59 / 404 / 753 (`scripts/ab_work_order.py --cost` -> benchmarks/work_order_cost_h200.json)."""
    if not 1 <= programs <= MAX_PROGRAMS:
        raise ValueError(f"programs must be in [1, {MAX_PROGRAMS}]; got {programs}.")
    if cost.numel() != base.numel() or cost.device != base.device:
        raise ValueError(f"cost ({cost.numel()} entries on {cost.device}) must have one entry per row of base "
                         f"({base.numel()} on {base.device}).")
    if cost_offset < 0:
        raise ValueError(f"cost_offset={cost_offset} must be >= 0.")
    base, cost = base.reshape(-1).contiguous(), cost.reshape(-1).contiguous()
    n = base.numel()
    order = torch.empty(n, dtype=torch.int32, device=base.device)
    if not n:
        return order
    full = n // programs
    item_key = torch.empty(max(full * programs, 1), dtype=torch.int32, device=base.device)
    meta = dict(LANE_BITS=_lane_bits(programs), BLOCK=_block(programs))
    limit = cost_limit(programs)
    if full:
        _wave_items_kernel[(full,)](base, cost, item_key, programs, cost_offset, limit, **meta,
                                    num_warps=min(8, max(1, meta["BLOCK"] // 32)), **COMPILE_OPTIONS)
    _balanced_order_kernel[(1,)](base, cost, item_key, order, n, full, programs, cost_offset, limit, **meta,
                                 num_warps=num_warps, **COMPILE_OPTIONS)
    return order
