"""The small Triton kernels of the eager plan path against their torch versions, under the Triton interpreter
(CPU, in a child process: see helpers): the fused top-k selection (`videosparse.kernels.triton_topk`) against
the torch path of `topk_plan` and a plain reference, the layer counters (`kernels.triton_counters`) and the
balanced work order (`kernels.triton_work_order`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers import InterpreterCases, interpreter_child

# name: B, H, Mv, G, density (None: random per-row budgets), extra
CASES = {
    "odd-budgets": (1, 2, 13, 0, None, ""),             # every budget from 1 to Mv
    "plan-density-0.3": (2, 1, 11, 0, 0.3, "special"),  # NaN, -inf rows, +inf entries
    "plan-global-tiles": (1, 2, 9, 2, 0.4, "special"),
    "plan-dense": (1, 1, 6, 1, 1.0, ""),
    "ties": (1, 2, 12, 0, None, "ties"),                # integer scores: the lower column wins a boundary tie
    "fp16-scores": (1, 1, 10, 0, 0.5, "fp16"),
    "signed-zeros": (1, 2, 12, 0, None, "zeros"),       # -0.0 ties +0.0: the lower column still wins
    "narrow-width": (1, 2, 10, 0, None, "narrow"),      # width 4 < max(budget): rows keep their best 4 tiles
}


def _scores(B, H, M, extra, g):
    s = torch.randn(B, H, M, M, generator=g)
    if extra == "ties":
        s = torch.randint(0, 3, (B, H, M, M), generator=g).float()
    if extra == "special":
        s[0, 0, 1, 3] = float("nan")
        s[0, 0, 2, :] = float("-inf")          # only the diagonal is left to keep
        s[-1, -1, 0, 2] = float("inf")
        s[-1, -1, 3, 3] = float("nan")         # a NaN diagonal is still forced
    if extra == "fp16":
        s = s.half()
    if extra == "zeros":
        s = torch.tensor([-0.0, 0.0, 1.0])[torch.randint(0, 3, (B, H, M, M), generator=g)]
    return s


def reference_rows(scores: torch.Tensor, budget: list[int], width: int, G: int):
    """The selection rule written out row by row: diagonal forced, NaN / -inf never, the best finite or +inf
    scores up to the budget, ties to the lower column; then the global tiles; global rows keep every tile."""
    B, H, M, _ = scores.shape
    N = M + G
    idx = torch.zeros(B, H, N, width, dtype=torch.int32)
    cnt = torch.zeros(B, H, N, dtype=torch.int32)
    s = scores.float()
    for b in range(B):
        for h in range(H):
            for r in range(N):
                if r >= M:
                    picks = list(range(N))
                else:
                    cand = [c for c in range(M) if c != r and s[b, h, r, c] > float("-inf")]
                    cand.sort(key=lambda c: (-float(s[b, h, r, c]), c))
                    picks = sorted(cand[:budget[r] - 1] + [r]) + list(range(M, N))
                idx[b, h, r, :len(picks)] = torch.tensor(picks, dtype=torch.int32)
                cnt[b, h, r] = len(picks)
    return idx, cnt


def _run_counters_case() -> dict:
    from videosparse.kernels.triton_counters import record_sparse_triton
    from videosparse.processors.session import LayerStats

    g = torch.Generator().manual_seed(1)
    torch_stats, triton_counts = LayerStats(), torch.zeros(5, dtype=torch.int64)
    for shape in ((2, 3, 5), (1, 40, 591), (3, 1, 1111)):       # one block, several blocks, a partial block
        kv_count = torch.randint(0, 50, shape, generator=g, dtype=torch.int32)
        torch_stats.record_sparse(kv_count, 77)
        record_sparse_triton(triton_counts, kv_count, 77)
    return {"counts_equal": bool(torch.equal(torch_stats.counts, triton_counts)), "counts": triton_counts.tolist()}


def _run_work_order_case() -> dict:
    """The balanced work order's Triton kernels against plan.work_order's torch path (which test_plan checks
    against the written-out rule): partial last waves, fewer rows than programs, ties, long and empty rows, and
    costs up to the kernels' limit."""
    from videosparse.kernels.triton_work_order import balanced_order, cost_limit
    from videosparse.plan import ROW_FIXED_COST, _balanced_positions, work_order

    g = torch.Generator().manual_seed(3)
    equal = []
    for shape, programs in (((1, 1, 5), 8), ((2, 3, 37), 5), ((1, 4, 12), 6), ((1, 2, 60), 7), ((1, 1, 0), 3)):
        counts = torch.randint(0, 30, shape, generator=g, dtype=torch.int32)
        counts.view(-1)[::9] = 90                                   # long rows: the base order puts them first
        counts.view(-1)[1::11] = 0
        base = work_order(counts).contiguous()
        got = balanced_order(base, counts, programs, cost_offset=ROW_FIXED_COST)        # int32 base and counts
        equal.append(got.dtype == torch.int32 and torch.equal(got, work_order(counts, programs)))
    ties = torch.full((1, 3, 10), 4, dtype=torch.int32)
    equal.append(torch.equal(balanced_order(work_order(ties), ties.reshape(-1) + ROW_FIXED_COST, 4),
                             work_order(ties, 4)))
    # costs up to the kernels' limit over many waves (72 and 120; the second's int32 keys of absolute loads would
    # overflow after about 16, checked): the loads they keep relative to their minimum stay exact
    for programs, high in ((5, 200_000), (3, cost_limit(3))):
        cost = torch.randint(0, high, (360,), generator=g)
        base = torch.randperm(360, generator=g)
        want = base[_balanced_positions(cost[base], programs)].to(torch.int32)
        equal.append(torch.equal(balanced_order(base, cost, programs), want))           # int64 base and costs
    # negative costs count as 0: still a permutation of every wave (they sorted among the dead lanes)
    base, cost = torch.randperm(40, generator=g), torch.randint(-50, 50, (40,), generator=g)
    got = balanced_order(base, cost, 6)
    waves = [slice(i, i + 6) for i in range(0, 40, 6)]
    equal.append(all(sorted(got[w].tolist()) == sorted(base[w].tolist()) for w in waves))
    equal.append(torch.equal(got, balanced_order(base, cost.clamp_min(0), 6)))
    return {"equal": equal}


def _run_case(name: str) -> dict:
    if name == "counters":
        return _run_counters_case()
    if name == "work-order":
        return _run_work_order_case()
    import videosparse.plan as plan_mod
    from videosparse.kernels.triton_topk import topk_rows_triton
    from videosparse.plan import row_budget_list, topk_plan

    B, H, M, G, density, extra = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    s = _scores(B, H, M, extra, g)
    if density is None:
        budget = torch.randperm(M, generator=g) + 1
    else:
        budget = torch.tensor(row_budget_list(density, M, M))
    width = int(budget.max()) if G == 0 else M + G
    kept = budget.tolist()
    if extra == "narrow":
        # Mutation find: a width below max(budget) caps every row at width - G tiles (diagonal included) and
        # nothing is written past a row's width columns; before only width == max(budget) + G was run
        width = 4
        kept = [min(b, width - G) for b in kept]
    idx, cnt = topk_rows_triton(s, budget, width, G)
    ref_idx, ref_cnt = reference_rows(s, kept, width, G)
    res = {"rows_match_reference": bool(torch.equal(idx, ref_idx) and torch.equal(cnt, ref_cnt))}
    if density is not None and extra != "fp16":
        want = topk_plan(s, density, num_global_tiles=G)              # the torch path (CPU)
        plan_mod._fused_topk = lambda scores: True                   # topk_plan's CUDA branch, here on CPU
        got = topk_plan(s, density, num_global_tiles=G)
        res["plan_matches_torch_path"] = bool(torch.equal(got.kv_index, want.kv_index)
                                              and torch.equal(got.kv_count, want.kv_count)
                                              and torch.equal(got.order, want.order))
        torch.library.opcheck(plan_mod._topk_rows_op, (s, budget, width, G))   # the op torch.compile sees
        res["opcheck"] = True
    return res


def test_topk_and_work_order_kernels_refuse_bad_arguments_before_launch():
    from videosparse.kernels.triton_topk import MAX_TILES, topk_rows_triton
    from videosparse.kernels.triton_work_order import MAX_PROGRAMS, balanced_order

    s, budget = torch.zeros(1, 1, 4, 4), torch.full((4,), 2)
    for args, match in (((budget, 5, 0), "width=5 must be in \\[1, 4\\]"),
                        ((budget, 3, 2), "width=3 must be in \\[3, 6\\] \\(and 6 with 2 global"),
                        ((budget[:1], 2, 0), "budget \\(\\(1,\\).*must be an int tensor \\[4\\]"),
                        ((budget.float(), 2, 0), "must be an int tensor"),
                        ((budget, 2, -1), "num_global_tiles=-1 must be an int >= 0")):
        with pytest.raises(ValueError, match=match):
            topk_rows_triton(s, *args)
    with pytest.raises(ValueError, match="scores \\(4, 4\\) must be"):
        topk_rows_triton(s[0, 0], budget, 2)
    # Mutation find: rows of more than MAX_TILES video tiles are refused by name (meta tensors: no memory)
    big = torch.empty(1, 1, MAX_TILES + 1, MAX_TILES + 1, device="meta")
    with pytest.raises(ValueError, match=f"scores \\(1, 1, {MAX_TILES + 1}, {MAX_TILES + 1}\\) .*Mv <= {MAX_TILES}"):
        topk_rows_triton(big, torch.empty(MAX_TILES + 1, dtype=torch.int32, device="meta"), 1)
    base = torch.arange(6, dtype=torch.int32)
    with pytest.raises(ValueError, match="cost \\(5 entries on cpu\\) must have one entry per row of base \\(6"):
        balanced_order(base, torch.ones(5, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="cost_offset=-1 must be >= 0"):
        balanced_order(base, torch.ones(6, dtype=torch.int32), 2, cost_offset=-1)
    # Mutation find: a program count outside [1, MAX_PROGRAMS] is refused, not divided by or launched
    for programs in (0, -1, MAX_PROGRAMS + 1):
        with pytest.raises(ValueError, match=f"programs must be in \\[1, {MAX_PROGRAMS}\\]; got {programs}"):
            balanced_order(base, torch.ones(6, dtype=torch.int32), programs)


INTERPRETER_CASES = InterpreterCases(__file__, [*CASES, "counters", "work-order"])


@pytest.mark.parametrize("name", list(CASES))
def test_fused_topk_matches_the_selection_rule(interpreter_results, name):
    res = interpreter_results[name]
    assert "error" not in res, res.get("error")
    assert res["rows_match_reference"]
    if CASES[name][4] is not None and CASES[name][5] != "fp16":
        assert res["plan_matches_torch_path"] and res["opcheck"]


def test_counters_kernel_matches_layer_stats(interpreter_results):
    res = interpreter_results["counters"]
    assert "error" not in res, res.get("error")
    assert res["counts_equal"] and res["counts"][0] == 3 and res["counts"][1] == 0


def test_work_order_kernel_matches_the_torch_path(interpreter_results):
    res = interpreter_results["work-order"]
    assert "error" not in res, res.get("error")
    assert res["equal"] == [True] * 10


@pytest.mark.parametrize("capability", [90, 80])
def test_work_order_kernel_compiles_for_the_gpu(capability):
    """AOT on CPU: the balanced-order kernels (int32 sorts in registers) lower to cubins for sm_90 and sm_80 at
    the launch's settings, within the static shared memory of a block."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from videosparse.kernels._triton_utils import COMPILE_OPTIONS
    from videosparse.kernels.triton_work_order import _balanced_order_kernel, _wave_items_kernel

    meta = dict(LANE_BITS=8, BLOCK=256)
    sequential = dict(BASE="*i64", COST="*i32", ITEM_KEY="*i32", ORDER="*i32", N="i32", FULL="i32", PROGRAMS="i32",
                      COST_OFFSET="i32", COST_MAX="i32", LANE_BITS="constexpr", BLOCK="constexpr")
    waves = dict(BASE="*i64", COST="*i32", ITEM_KEY="*i32", PROGRAMS="i32", COST_OFFSET="i32", COST_MAX="i32",
                 LANE_BITS="constexpr", BLOCK="constexpr")
    for fn, sig in ((_balanced_order_kernel, sequential), (_wave_items_kernel, waves)):
        k = triton.compile(ASTSource(fn, sig, meta), target=GPUTarget("cuda", capability, 32),
                           options=dict(num_warps=8, **COMPILE_OPTIONS))
        assert k.asm["cubin"] and k.metadata.shared <= 48 * 1024


def test_reference_rows_is_the_torch_path_rule():
    """The written-out rule equals topk_plan's torch path where it has no ties (so the kernel test means it)."""
    from videosparse.plan import row_budget_list, topk_plan

    g = torch.Generator().manual_seed(0)
    for B, H, M, G, density in ((2, 2, 17, 0, 0.25), (1, 3, 12, 3, 0.5)):
        s = _scores(B, H, M, "special", g)
        plan = topk_plan(s, density, num_global_tiles=G)
        idx, cnt = reference_rows(s, row_budget_list(density, M, M), plan.kv_index.shape[-1], G)
        assert torch.equal(plan.kv_index, idx) and torch.equal(plan.kv_count, cnt)


@pytest.mark.gpu
@pytest.mark.parametrize("B, H, M, G, density", [(1, 40, 591, 0, 0.1), (2, 12, 256, 0, 0.05), (1, 24, 929, 0, 0.25),
                                                  (2, 48, 139, 2, 0.1), (1, 2, 8192, 0, 0.01), (1, 32, 48, 0, 0.05)])
def test_fused_topk_on_cuda_matches_the_torch_path(monkeypatch, B, H, M, G, density):
    import videosparse.plan as plan_mod

    s = torch.randn(B, H, M, M, device="cuda")
    s[:, :, :, M // 3] = float("-inf")        # a padded column, never chosen
    assert plan_mod._fused_topk(s)
    got = plan_mod.topk_plan(s, density, num_global_tiles=G)
    monkeypatch.setattr(plan_mod, "_fused_topk", lambda scores: False)
    want = plan_mod.topk_plan(s, density, num_global_tiles=G)
    assert torch.equal(got.kv_index, want.kv_index) and torch.equal(got.kv_count, want.kv_count)
    assert torch.equal(got.order, want.order)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, programs", [((1, 40, 591), 132), ((2, 12, 256), 132), ((1, 48, 139), 78),
                                             ((1, 1, 100), 132)])
def test_work_order_on_cuda_matches_cpu(shape, programs):
    from videosparse.plan import work_order

    counts = torch.exp(torch.randn(shape) * 0.7 + 3).round().clamp(0, 400).int()
    counts.view(-1)[::13] = 0
    assert torch.equal(work_order(counts.cuda(), programs).cpu(), work_order(counts, programs))


@pytest.mark.gpu
def test_layer_counters_on_cuda_match_cpu():
    from videosparse.processors.session import LayerStats

    cpu, gpu = LayerStats("cpu"), LayerStats("cuda")
    for shape in ((2, 32, 48), (1, 40, 591), (2, 12, 257)):
        kv_count = torch.randint(1, 60, shape, dtype=torch.int32)
        cpu.record_sparse(kv_count, 99)
        gpu.record_sparse(kv_count.cuda(), 99)           # the Triton kernel
    gpu.record_dense()
    cpu.record_dense()
    assert gpu.as_dict() == cpu.as_dict()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    interpreter_child(sys.argv[1:], _run_case)
