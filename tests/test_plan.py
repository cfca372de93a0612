import dataclasses

import pytest
import torch

from videosparse.kernels import block_sparse_attention
from videosparse.plan import Plan, dense_plan, plan_from_mask, row_budgets, topk_plan

from helpers import random_plan


def test_plan_from_mask_round_trip():
    mask = torch.rand(2, 3, 9, 11) < 0.3
    mask[..., 0] = True
    p = plan_from_mask(mask, 64, 64)
    assert p.kv_index.dtype == torch.int32 and p.kv_count.dtype == torch.int32
    assert torch.equal(p.to_dense_mask(11), mask)
    p.validate(torch.zeros(2, 3, 9 * 64 - 5, 16), torch.zeros(2, 3, 11 * 64 - 1, 16))


@pytest.mark.parametrize("density,rows,cols", [(0.1, 37, 37), (0.25, 8, 8), (1.0, 5, 5), (0.034, 100, 100)])
def test_row_budgets_spread_evenly(density, rows, cols):
    b = row_budgets(density, rows, cols)
    assert b.min() >= 1 and b.max() <= cols
    assert b.max() - b.min() <= 1 or density * cols < 1
    if density * cols >= 1:
        assert abs(b.sum().item() - density * cols * rows) < 1


def test_topk_plan_diagonal_budget_and_globals():
    B, H, Mv, G = 2, 3, 20, 2
    scores = torch.randn(B, H, Mv, Mv)
    scores[..., 7] = float("-inf")          # an empty column is never chosen
    p = topk_plan(scores, 0.25, num_global_tiles=G, block=64)
    N = Mv + G
    mask = p.to_dense_mask(N)
    budget = row_budgets(0.25, Mv, Mv)
    assert mask[:, :, torch.arange(Mv), torch.arange(Mv)].all()              # diagonal forced
    assert mask[:, :, :Mv, Mv:].all() and mask[:, :, Mv:].all()               # globals both ways
    assert not mask[:, :, [i for i in range(Mv) if i != 7], 7].any()
    assert torch.equal(mask[:, :, :Mv, :Mv].sum(-1), budget.expand(B, H, Mv))
    # the chosen non-diagonal tiles are the highest-scoring ones
    s = scores.masked_fill(torch.eye(Mv, dtype=torch.bool), float("inf"))
    kth = s.sort(-1, descending=True).values.gather(-1, (budget - 1).expand(B, H, Mv)[..., None])
    assert (s[mask[:, :, :Mv, :Mv]] >= kth.expand_as(s)[mask[:, :, :Mv, :Mv]]).all()
    p.validate(torch.zeros(B, H, N * 64 - 3, 8), torch.zeros(B, H, N * 64 - 3, 8))


@pytest.mark.parametrize("density", [0.13, 0.25, 0.5, 0.02])
@pytest.mark.parametrize("select_dtype", [torch.float32, torch.float16])
def test_topk_plan_picks_the_top_budget_per_row(density, select_dtype):
    """Uneven budgets (kmax and kmax - 1 per row) keep exactly each row's best tiles, in fp16 selection too."""
    B, H, M = 2, 3, 23
    g = torch.Generator().manual_seed(5)
    scores = torch.stack([torch.randperm(M * M, generator=g).float().view(M, M) / 8 for _ in range(B * H)])
    scores = scores.view(B, H, M, M)                      # distinct, exactly representable in fp16
    scores[0, 1, :, 4] = float("-inf")
    mask = topk_plan(scores, density, select_dtype=select_dtype).to_dense_mask(M)
    budget = row_budgets(density, M, M)
    s = scores.masked_fill(torch.eye(M, dtype=torch.bool), float("inf"))
    order = s.argsort(-1, descending=True)
    ranked_keep = torch.arange(M) < budget[:, None]
    expected = torch.zeros_like(mask).scatter_(-1, order, ranked_keep.expand(B, H, M, M)) & (s > float("-inf"))
    assert torch.equal(mask, expected)


def test_topk_density_one_is_dense():
    p = topk_plan(torch.randn(1, 2, 6, 6), 1.0)
    d = dense_plan(1, 2, 6 * 128)
    assert torch.equal(p.kv_index, d.kv_index) and torch.equal(p.kv_count, d.kv_count)


def test_dense_plan_over_another_key_length():
    """dense_plan(..., key_len=Sk): every query tile lists every key tile of Sk keys (queries over a shorter or a
    longer key set); the plan validates against such inputs; a key length below 1 is refused."""
    q, k = torch.zeros(1, 2, 300, 16), torch.zeros(1, 2, 37, 16)
    plan = dense_plan(1, 2, 300, key_len=37)
    plan.validate(q, k, k)
    assert plan.kv_index.shape == (1, 2, 3, 1) and plan.kv_count.eq(1).all()
    longer = dense_plan(1, 2, 37, key_len=300)
    assert longer.kv_index.shape == (1, 2, 1, 3)
    assert torch.equal(longer.kv_index[0, 0, 0], torch.arange(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="key_len=0"):
        dense_plan(1, 2, 300, key_len=0)
    for bad, match in ((dict(batch=-1), "batch=-1 must be an int >= 0"), (dict(seq_len=2.5), "seq_len=2.5"),
                       (dict(seq_len=0), r"key_len=0 .*defaults to seq_len"), (dict(heads=True), "heads=True")):
        with pytest.raises(ValueError, match=match):
            dense_plan(**{**dict(batch=1, heads=2, seq_len=300), **bad})
    assert dense_plan(1, 2, 0, key_len=5).kv_count.shape == (1, 2, 0)        # no queries: a valid, empty plan


def test_validate_rejects_bad_plans():
    q = torch.zeros(1, 2, 300, 16)
    good = random_plan(1, 2, 300, 128, 128, 0.5)
    good.validate(q, q)
    bad_range = Plan(good.kv_index.clone(), good.kv_count.clone(), 128, 128)
    bad_range.kv_index[0, 0, 0, 0] = 3
    bad_range.kv_count[0, 0, 0] = 1
    with pytest.raises(ValueError, match="outside"):
        bad_range.validate(q, q)
    unsorted = Plan(torch.tensor([[[[1, 0, 2]] * 3] * 2], dtype=torch.int32),
                    torch.full((1, 2, 3), 3, dtype=torch.int32), 128, 128)
    with pytest.raises(ValueError, match="increasing"):
        unsorted.validate(q, q)
    over = Plan(good.kv_index, good.kv_count + 5, 128, 128)
    with pytest.raises(ValueError, match="kv_count"):
        over.validate(q, q)
    with pytest.raises(ValueError, match="expected"):
        good.validate(torch.zeros(1, 2, 600, 16), q)
    with pytest.raises(ValueError, match="int32"):
        Plan(good.kv_index.long(), good.kv_count, 128, 128).validate(q, q)
    # more key-tile slots than key tiles (3 here), as a plan packed at a fixed width for a longer sequence: the
    # kernels read only kv_count slots, so it is valid (review 59: validate refused it, while the docstrings said the
    # slots past the count are ignored) and runs as the trimmed plan; a count past the key tiles is refused
    index = torch.zeros(1, 2, 3, 5, dtype=torch.int32)
    index[..., :3] = torch.arange(3, dtype=torch.int32)
    wide = Plan(index, torch.tensor([[[2, 3, 1], [3, 3, 0]]], dtype=torch.int32), 128, 128)
    wide.validate(q, q)
    trimmed = dataclasses.replace(wide, kv_index=wide.kv_index[..., :3].contiguous())
    x = torch.randn(1, 2, 300, 16, generator=torch.Generator().manual_seed(0))     # (the kernels: interpreter tests)
    torch.testing.assert_close(block_sparse_attention(x, x, x, wide), block_sparse_attention(x, x, x, trimmed),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="strictly increasing"):     # 4 distinct tiles of 3 cannot be
        dataclasses.replace(wide, kv_count=torch.full((1, 2, 3), 4, dtype=torch.int32)).validate(q, q)


def test_topk_plan_builds_no_host_tensors_after_the_first_call(monkeypatch):
    """The budget and diagonal constants are cached: a host list copied to the GPU on every call
    synchronised the stream once per layer (GPU idle ~33 ms per Wan 1.3B forward)."""
    scores = torch.randn(1, 2, 30, 30)
    first = topk_plan(scores, 0.2)
    calls = []
    real_tensor, real_eye = torch.tensor, torch.eye
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: calls.append("tensor") or real_tensor(*a, **k))
    monkeypatch.setattr(torch, "eye", lambda *a, **k: calls.append("eye") or real_eye(*a, **k))
    again = topk_plan(scores, 0.2)
    assert calls == []
    assert torch.equal(again.kv_index, first.kv_index) and torch.equal(again.kv_count, first.kv_count)


def test_work_order_runs_long_rows_first_then_the_rest_in_row_order():
    """Without a program count (launches of one program per row): rows over twice the mean non-empty length first
    (longest first, ties in row order), the others in (b, h, m) order, empty rows last; a permutation either
    way."""
    from videosparse.plan import row_budget_list, work_order

    budgets = torch.tensor(row_budget_list(0.1, 256, 256), dtype=torch.int32)
    assert set(budgets.tolist()) == {25, 26}
    counts = budgets.repeat(2, 3, 1)                      # a top-k plan: no long rows -> (b, h, m) order
    assert torch.equal(work_order(counts), torch.arange(2 * 3 * 256, dtype=torch.int32))

    g = torch.Generator().manual_seed(0)
    counts = torch.randint(1, 40, (2, 5, 37), generator=g, dtype=torch.int32)
    counts[0, 1, :4] = 0
    counts[1, 3, 5] = 250
    counts[0, 4, 30] = 300
    counts[0, 0, 7] = 250
    order = work_order(counts)
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(counts.numel()))
    order = order.long()
    assert order[:3].tolist() == [4 * 37 + 30, 7, (5 + 3) * 37 + 5]            # the long rows, longest first
    assert order[-4:].tolist() == [37, 38, 39, 40]                              # empty rows last, in order
    middle = order[3:-4]
    assert (middle[1:] > middle[:-1]).all() and (counts.reshape(-1)[middle] > 0).all()   # the rest in row order
    assert work_order(torch.tensor([[[5, 5], [1, 9]], [[0, 0], [7, 3]]], dtype=torch.int32)).tolist() == \
        [0, 1, 2, 3, 6, 7, 4, 5]
    assert work_order(torch.zeros(1, 2, 3, dtype=torch.int32)).tolist() == list(range(6))


def _balanced_order_written_out(base: list[int], cost: list[int], programs: int) -> list[int]:
    """The balanced work order's rule in plain Python, on the rows of `base` (costs by row): the partial last
    wave goes to programs 0..r-1 as it is and is counted first; then per wave the costliest row (the earlier
    entry among equals) to the least-loaded program (the lower program among equals)."""
    cost = [cost[i] for i in base]
    n = len(cost)
    full = n // programs
    order = list(range(n))
    load = [0] * programs
    for j in range(n - full * programs):
        load[j] = cost[full * programs + j]
    for w in range(full):
        rows = sorted(range(w * programs, (w + 1) * programs), key=lambda i: (-cost[i], i))
        cols = sorted(range(programs), key=lambda p: (load[p], p))
        for i, p in zip(rows, cols):
            order[w * programs + p] = i
            load[p] += cost[i]
    return [base[i] for i in order]


def test_balanced_work_order_keeps_waves_head_major_and_evens_out_the_programs():
    """work_order(kv_count, programs): the base order's waves (`work_order(kv_count)`) dealt by the written-out
    rule (costs kv_count + ROW_FIXED_COST), so every wave holds its own rows; on rows of log-normal length the
    most-loaded program carries far less than under the base, (b, h, m) or longest-first order."""
    import math

    from videosparse.plan import ROW_FIXED_COST, work_order

    g = torch.Generator().manual_seed(0)
    for shape, programs in (((2, 3, 37), 5), ((1, 4, 9), 7), ((1, 1, 5), 8), ((1, 2, 12), 6), ((1, 12, 256), 132)):
        counts = torch.randint(0, 40, shape, generator=g, dtype=torch.int32)
        counts.view(-1)[::7] *= 4
        order, base = work_order(counts, programs), work_order(counts)
        assert order.dtype == torch.int32
        want = _balanced_order_written_out(base.tolist(), [c + ROW_FIXED_COST for c in counts.reshape(-1).tolist()],
                                           programs)
        assert order.tolist() == want, (shape, programs)
        for w in range(math.ceil(counts.numel() / programs)):
            wave = slice(w * programs, (w + 1) * programs)
            assert sorted(order[wave].tolist()) == sorted(base[wave].tolist())
    ties = torch.full((1, 2, 10), 3, dtype=torch.int32)
    assert work_order(ties, 4).tolist() == _balanced_order_written_out(list(range(20)), [5] * 20, 4)

    def busiest(order, cost, programs):
        loads = torch.zeros(programs)
        for j, i in enumerate(order.tolist()):
            loads[j % programs] += cost[i]
        return float(loads.max())

    counts = torch.exp(torch.randn(1, 12, 256, generator=g) * 0.7 + math.log(20)).round().clamp(1, 256).int()
    cost = (counts.reshape(-1) + ROW_FIXED_COST).tolist()
    ideal = sum(cost) / 132
    balanced = busiest(work_order(counts, 132), cost, 132)
    assert balanced < 1.06 * ideal
    assert balanced < 0.9 * busiest(work_order(counts), cost, 132)
    assert balanced < 0.8 * busiest(torch.arange(counts.numel()), cost, 132)
    assert balanced < 0.9 * busiest(torch.sort(counts.reshape(-1), descending=True, stable=True).indices, cost, 132)
    with pytest.raises(ValueError, match="programs"):
        work_order(counts, 0)


@pytest.mark.parametrize("globals_", [0, 3])
@pytest.mark.parametrize("density", [0.07, 0.3, 1.0])
def test_builders_attach_the_work_order_the_kernels_would_sort(monkeypatch, globals_, density):
    """topk_plan and dense_plan carry `order` from their row budgets: equal to the kernels' `work_order` of
    kv_count for the device's persistent grid (none on CPU; 5 programs stand in for a GPU's SMs), so the kernels
    skip computing it; cached across calls."""
    from videosparse import plan as plan_mod
    from videosparse.plan import work_order

    for programs in (None, 5):
        monkeypatch.setattr(plan_mod, "device_programs", lambda device, p=programs: p)
        monkeypatch.setattr(plan_mod, "_ORDERS", {})
        plan = topk_plan(torch.randn(2, 3, 25, 25), density, num_global_tiles=globals_)
        assert plan.order.dtype == torch.int32 and torch.equal(plan.order, work_order(plan.kv_count, programs))
        assert topk_plan(torch.randn(2, 3, 25, 25), density, num_global_tiles=globals_).order is plan.order
        dense = dense_plan(2, 3, 1000)
        assert torch.equal(dense.order, work_order(dense.kv_count, programs))
        q = torch.zeros(2, 3, 1000, 16)
        dense.validate(q, q)


def test_validate_rejects_an_order_that_is_not_a_permutation():
    q = torch.zeros(1, 2, 300, 16)
    good = dense_plan(1, 2, 300)
    Plan(good.kv_index, good.kv_count, order=good.order.flip(0).contiguous()).validate(q, q)   # any permutation
    with pytest.raises(ValueError, match="permutation of 0..5"):
        Plan(good.kv_index, good.kv_count, order=torch.zeros(6, dtype=torch.int32)).validate(q, q)
    with pytest.raises(ValueError, match=r"int32 \[6\]"):
        Plan(good.kv_index, good.kv_count, order=good.order.long()).validate(q, q)
    with pytest.raises(ValueError, match=r"int32 \[6\]"):
        Plan(good.kv_index, good.kv_count, order=good.order[:5]).validate(q, q)
    negative = torch.arange(6, dtype=torch.int32)
    negative[0] = -1                     # bincount of the clamped order alone would count -1 as 0
    with pytest.raises(ValueError, match="permutation"):
        Plan(good.kv_index, good.kv_count, order=negative).validate(q, q)


def test_block_sizes_must_be_positive_ints():
    q = torch.zeros(1, 2, 300, 16)
    good = dense_plan(1, 2, 300)
    for bad in (0, -64, 32.0, True):
        with pytest.raises(ValueError, match="positive int"):
            Plan(good.kv_index, good.kv_count, bad, 128).validate(q, q)
        with pytest.raises(ValueError, match="positive int"):
            topk_plan(torch.randn(1, 2, 4, 4), 0.5, block=bad)
        with pytest.raises(ValueError, match="positive int"):
            plan_from_mask(torch.ones(1, 2, 3, 3, dtype=torch.bool), 128, bad)
        with pytest.raises(ValueError, match="positive int"):
            dense_plan(1, 2, 300, bad)
    with pytest.raises(ValueError, match="num_global_tiles"):
        topk_plan(torch.randn(1, 2, 4, 4), 0.5, num_global_tiles=-1)
    with pytest.raises(ValueError, match="no video tiles"):
        topk_plan(torch.randn(1, 2, 0, 0), 0.5, num_global_tiles=2)


def test_correction_tensors_are_checked():
    from videosparse.sol.centroids import tile_centroids_torch

    q = torch.randn(1, 2, 300, 16)
    plan = dense_plan(1, 2, 300).with_correction(*tile_centroids_torch(q, q, 128))
    plan.validate(q, q)
    k_mean, v_sum, tile_len = plan.k_mean, plan.v_sum, plan.tile_len.clone()
    tile_len[1] = 0                      # a zero-length tile would still count once (lengths are clamped to 1)
    with pytest.raises(ValueError, match="tile_len values must be >= 1"):
        Plan(plan.kv_index, plan.kv_count, k_mean=k_mean, v_sum=v_sum, tile_len=tile_len).validate(q, q)
    for tile, tokens in ((0, 400), (2, 128)):     # more than a tile has; the last of 300 keys holds 44 (review find)
        tile_len = plan.tile_len.clone()
        tile_len[tile] = tokens
        with pytest.raises(ValueError, match="more tokens than a key tile has"):
            Plan(plan.kv_index, plan.kv_count, k_mean=k_mean, v_sum=v_sum, tile_len=tile_len).validate(q, q)


def test_plan_to_moves_every_tensor_and_keeps_dtypes_and_fields():
    """`Plan.to(device)` moves the indices, counts, correction inputs, order and key limits, keeps their dtypes and
    the tile sizes; on the device they are already on, the tensors are the same objects."""
    from videosparse.sol.centroids import tile_centroids_torch

    q = torch.randn(2, 2, 300, 16, dtype=torch.float64)
    plan = topk_plan(torch.randn(2, 2, 5, 5), 0.5, block=64).with_correction(*tile_centroids_torch(q, q, 64))
    plan = plan.with_valid_keys(torch.tensor([300, 200], dtype=torch.int32))
    same = plan.to("cpu")
    tensors = ("kv_index", "kv_count", "k_mean", "v_sum", "tile_len", "order", "valid_keys")
    assert all(getattr(same, n) is getattr(plan, n) for n in tensors if getattr(plan, n) is not None)
    moved = plan.to(torch.device("meta"))
    for n in tensors:
        before, after = getattr(plan, n), getattr(moved, n)
        assert (before is None) == (after is None), n
        if before is not None:
            assert after.device.type == "meta" and after.dtype == before.dtype and after.shape == before.shape, n
    assert (moved.block_m, moved.block_n) == (64, 64) and plan.kv_index.device.type == "cpu"


def test_nan_scores_never_displace_the_forced_diagonal():
    scores = torch.randn(1, 2, 6, 6)
    scores[0, 0, 1] = float("nan")       # topk ranks NaN above the +inf of the diagonal
    plan = topk_plan(scores, 0.2)
    mask = plan.to_dense_mask(6)
    assert bool(mask.diagonal(dim1=-2, dim2=-1).all())
    assert int(plan.kv_count.min()) >= 1
    nan_plan = topk_plan(torch.full((1, 2, 6, 6), float("nan")), 0.4)
    assert torch.equal(nan_plan.to_dense_mask(6), torch.eye(6, dtype=torch.bool).expand(1, 2, 6, 6))


@pytest.mark.parametrize("big, select_dtype", [(float("inf"), torch.float32), (1e5, torch.float16)])
def test_infinite_scores_never_displace_the_forced_diagonal(big, select_dtype):
    """+inf scores, or finite ones that fp16 selection saturates to +inf, tie with the +inf that forces the diagonal
    unless they are clamped below it (the fused CUDA kernel leaves the diagonal out of its ranking instead)."""
    scores = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    scores[..., 5:] = big
    plan = topk_plan(scores, 0.25, select_dtype=select_dtype)
    assert bool(plan.to_dense_mask(8).diagonal(dim1=-2, dim2=-1).all())
    assert plan.kv_count.tolist() == [[[2] * 8] * 2]


def test_row_order_under_compile_is_an_arange_for_rows_of_one_or_two_lengths(monkeypatch):
    """In a compiled graph the builders give rows of one or two adjacent lengths (top-k plans) an arange (no
    per-call order in the kernel op) and nothing (the op computes the order) otherwise."""
    from videosparse import plan as plan_mod

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    budgets = plan_mod.row_budget_list(0.1, 256, 256)
    assert torch.equal(plan_mod.row_order(budgets, 6, "cpu"), torch.arange(6 * 256, dtype=torch.int32))
    assert plan_mod.row_order(budgets + [258, 258], 6, "cpu") is None            # global-tile rows: the op orders
    assert plan_mod.row_order([3, 5], 2, "cpu") is None and plan_mod.row_order([0, 1], 2, "cpu") is None
    assert topk_plan(torch.randn(2, 3, 25, 25), 0.2).order.tolist() == list(range(2 * 3 * 25))
    assert topk_plan(torch.randn(2, 3, 25, 25), 0.2, num_global_tiles=2).order is None


def test_validation_names_the_entry_and_helpers_refuse_a_short_key_count():
    """Review finds: the errors named no entry; `to_dense_mask(n)` with n at or below the largest kept index dropped
    those tiles silently (or failed in torch's scatter), `density(n)` returned more than 1."""
    q = torch.randn(1, 2, 512, 64)
    idx = torch.tensor([[[[0, 1, 2, 3]] * 4] * 2], dtype=torch.int32)
    cnt = torch.full((1, 2, 4), 4, dtype=torch.int32)
    bad = idx.clone()
    bad[0, 1, 2, 3] = 9
    with pytest.raises(ValueError, match=r"kv_index\[0, 1, 2, 3\] = 9 lies outside \[0, 4\)"):
        Plan(bad, cnt).validate(q, q)
    bad = idx.clone()
    bad[0, 0, 3, 2] = 1
    with pytest.raises(ValueError, match=r"row \[0, 0, 3\] has 1 then 1 at entries 1, 2"):
        Plan(bad, cnt).validate(q, q)
    plan = Plan(idx, cnt)
    assert plan.to_dense_mask(4).all() and plan.density(4) == 1.0
    for n in (3, 2):
        with pytest.raises(ValueError, match=f"num_key_tiles={n}, but the plan keeps key tiles 0..3"):
            plan.to_dense_mask(n)
    with pytest.raises(ValueError, match="num_key_tiles=2, but a row of the plan keeps 4 tiles"):
        plan.density(2)
    k_mean = torch.zeros(1, 2, 5, 64)               # review 54: density(0) took the 5 tiles of tile_len instead
    with_len = plan.with_correction(k_mean, k_mean, torch.full((5,), 128))
    assert with_len.density() == 0.8
    for n in (0, -1, 2.5):
        with pytest.raises(ValueError, match=f"num_key_tiles={n} must be an int >= 1"):
            with_len.density(n)
    empty = Plan(torch.zeros(1, 0, 4, 1, dtype=torch.int32), torch.zeros(1, 0, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="no query-tile rows"):
        empty.density(4)


def test_validate_names_a_field_that_is_no_tensor():
    """A list or None where a tensor belongs: a TypeError naming the field (it was an AttributeError)."""
    from dataclasses import replace

    q = torch.randn(1, 2, 128, 64)
    plan = dense_plan(1, 2, 128, 64, 64)
    for field, value in (("kv_index", plan.kv_index.tolist()), ("kv_count", None), ("valid_keys", [128]),
                         ("order", [0, 1, 2, 3])):
        with pytest.raises(TypeError, match=f"Plan.{field} must be a tensor"):
            replace(plan, **{field: value}).validate(q, q, q)


def test_structure_check_refuses_k_and_v_that_do_not_fit_q_or_each_other():
    """Code review find: `check_structure` took v and never read it, and the custom op, called directly, checked no
    more: a v with fewer keys than k reached the kernels (the reference failed in a reshape; a Triton kernel would
    read past v's end). The metadata check now names the shapes, on the op's path too."""
    q = torch.randn(1, 2, 300, 64)
    k = torch.randn(1, 2, 300, 64)
    plan = dense_plan(1, 2, 300)
    for kk, vv in ((k, k[:, :, :150]), (k[:, :1], k[:, :1]), (k[..., :32], k[..., :32])):
        with pytest.raises(ValueError, match=r"shapes do not match: q \(1, 2, 300, 64\), k"):
            plan.validate(q, kk, vv)
        with pytest.raises(ValueError, match="shapes do not match"):
            plan.check_structure(q, kk, vv)
    import videosparse.kernels.ops  # noqa: F401  (registers the op)

    with pytest.raises(ValueError, match="shapes do not match"):
        torch.ops.videosparse.block_sparse_attention(q, k, k[:, :, :150], plan.kv_index, plan.kv_count, 128, 128,
                                                     None, None, None, None, None, 0.125, "reference")
    plan.validate(q, k, k.clone())                     # v may be any tensor of k's shape
