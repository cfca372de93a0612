"""Host side of the Gluon kernel's tail split (`videosparse.kernels.tail_split`): which items are cut, and how.

The merge of the parts is checked under the Triton interpreter (test_triton_interpreter.py, SPLIT_CASES) and
the kernel's own units on the GPU (test_gpu_kernels.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.parametrize("n_items,programs,kmax,expected", [
    (3072, 132, 26, (3036, 3)),     # Wan 1.3B 480P, 12 heads x 256 query tiles at density 0.1: 36 left, 3 parts
    (3072, 132, 256, (3036, 3)),    # the same, dense
    (23640, 132, 60, (23628, 11)),  # Wan 14B 720P: 12 left on 132 SMs
    (22272, 132, 93, (22272, 1)),   # HunyuanVideo-like: 96 left (over half full): no split
    (264, 132, 30, (264, 1)),       # whole waves
    (3072, 132, 3, (3072, 1)),      # 3-tile items: too short to cut (parts of under 2 tiles)
    (1, 132, 256, (0, 128)),        # one long item spread over 128 SMs (2 tiles each)
    (0, 132, 1, (0, 1)),
])
def test_tail_split_fills_the_last_wave(n_items, programs, kmax, expected):
    from videosparse.kernels.tail_split import tail_split

    n_full, parts = tail_split(n_items, programs, kmax)
    assert (n_full, parts) == expected
    assert n_full % programs == 0 or n_full == n_items
    assert (n_items - n_full) * parts <= programs


@pytest.mark.parametrize("kmax,head_dim,split", [(26, 128, True), (13, 128, False), (26, 64, False), (256, 64, True)])
def test_the_default_gate_splits_only_when_enough_work_leaves_the_last_wave(kmax, head_dim, split):
    """12 x 32,768 on 132 SMs (3 parts possible): density 0.1 at d128 saves 17 tiles of the last wave (split);
    0.05 (Kmax 13) and d64 at 0.1 save too little for the merge's launch."""
    from videosparse.kernels.tail_split import AUTO_MIN_SAVED, tail_split

    assert (tail_split(3072, 132, kmax, AUTO_MIN_SAVED / head_dim)[1] > 1) is split


def test_work_units_cut_each_split_item_into_consecutive_runs():
    from videosparse.kernels.tail_split import work_units

    counts = torch.tensor([9, 7, 5, 0, 3], dtype=torch.int32)
    order = torch.tensor([0, 1, 2, 4, 3], dtype=torch.int32)       # longest first
    item, lo, n, last, slot = work_units(order, counts, 3, 3)      # items 4 (3 tiles) and 3 (empty) in 3 parts
    assert item.tolist() == [0, 1, 2, 4, 4, 4, 3, 3, 3]
    assert lo.tolist() == [0, 0, 0, 0, 1, 2, 0, 0, 0]
    assert n.tolist() == [9, 7, 5, 1, 1, 1, 0, 0, 0]
    assert last.tolist() == [1, 1, 1, 0, 0, 1, 0, 0, 1]
    assert slot.tolist() == [-1, -1, -1, 0, 1, 2, 3, 4, 5]


def test_a_split_that_saves_exactly_the_gate_is_taken():
    """Mutation find: the gate is "fewer than min_saved_tiles: no split", so a split saving exactly the gate runs.
    182 items on 132 SMs leave 50 (2 parts); Kmax 32 in 2 parts saves 16 tiles, the d128 gate (2048 / 128)."""
    from videosparse.kernels.tail_split import AUTO_MIN_SAVED, tail_split

    assert AUTO_MIN_SAVED / 128 == 16
    assert tail_split(182, 132, 32, AUTO_MIN_SAVED / 128) == (132, 2)
    assert tail_split(182, 132, 32, 16.5) == (182, 1)     # just over the gate: no split
