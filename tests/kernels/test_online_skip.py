"""The Hopper kernel's online-skip option (benchmarks only) under the Triton interpreter (CPU).

Online skip drops a listed key tile when all of its scores lie more than a gap below the running max
of every row of the query tile. The cases check: (1) with a gap no score reaches, the output equals
the kernel without the option, also with a partial last tile; (2) on planted scores (one hot key tile
listed first, the others 1, 4 or 6 units lower) the kernel drops exactly the tiles a torch emulation
of the rule drops, and the result differs from exact attention by what those tiles held.
Like test_triton_interpreter.py, the kernel runs in a child process with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from helpers import InterpreterCases, interpreter_child

HERE = Path(__file__).resolve().parent
CASES = ("huge-gap-equals-plain", "huge-gap-partial-tile", "planted-matches-emulation")


def _emulate_skip(q, k, v, plan, scale, gap):
    """Torch model of the rule: per query tile, listed tiles in order; skip when every row's tile max is
    more than `gap` below its running max. Returns (out fp64 [B,H,S,D], skipped count, listed count).
    Needs S a multiple of the tile sizes (the kernel's partial query tile reads neighbouring rows)."""
    B, H, S, D = q.shape
    bm, bn = plan.block_m, plan.block_n
    out = torch.zeros(B, H, S, D, dtype=torch.float64)
    skipped = listed = 0
    for b in range(B):
        for h in range(H):
            for mt in range(S // bm):
                qt = q[b, h, mt * bm:(mt + 1) * bm].double()
                m = torch.full((bm,), -math.inf, dtype=torch.float64)
                l = torch.zeros(bm, dtype=torch.float64)
                acc = torch.zeros(bm, D, dtype=torch.float64)
                for j in plan.kv_index[b, h, mt, :int(plan.kv_count[b, h, mt])].tolist():
                    listed += 1
                    s = qt @ k[b, h, j * bn:(j + 1) * bn].double().T * scale
                    if float((s.max(1).values - m).max()) <= -gap:
                        skipped += 1
                        continue
                    m_new = torch.maximum(m, s.max(1).values)
                    p = torch.exp(s - m_new[:, None])
                    alpha = torch.exp(m - m_new)
                    l = l * alpha + p.sum(1)
                    acc = acc * alpha[:, None] + p @ v[b, h, j * bn:(j + 1) * bn].double()
                    m = m_new
                out[b, h, mt * bm:(mt + 1) * bm] = acc / l[:, None]
    return out, skipped, listed


def _planted(B, H, S, D, block, g):
    """q, k, v whose key tile 0 scores highest for every query; tile j sits offset[j] units lower."""
    u = torch.randn(D, generator=g)
    u = u / u.norm()
    a = 4.0 * D ** 0.25                                   # scale * a * a = 16 for scale 1/sqrt(D)
    q = a * u + 0.02 * torch.randn(B, H, S, D, generator=g)
    n_tiles = S // block
    offsets = torch.tensor([0.0] + [(-1.0, -4.0, -6.0)[j % 3] for j in range(1, n_tiles)])
    coef = a * (1.0 + offsets / 16.0)                      # scale * a * coef = 16 + offset
    k = coef.repeat_interleave(block)[:, None] * u + 0.02 * torch.randn(B, H, S, D, generator=g)
    v = torch.randn(B, H, S, D, generator=g)
    return q, k, v


def _run_case(name: str) -> dict:
    from helpers import random_plan, rel_err

    from videosparse.kernels import reference_attention
    from videosparse.kernels.triton_hopper import hopper_attention
    from videosparse.plan import Plan

    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if name.startswith("huge-gap"):
        B, H, D, block = 2, 2, 64, 64
        S = 256 if name == "huge-gap-equals-plain" else 301
        q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
        plan = random_plan(B, H, S, block, block, 0.5, seed=S)
        plan.validate(q, k, v)
        plain = hopper_attention(q, k, v, plan, D ** -0.5, warp_specialize=False)
        skip = hopper_attention(q, k, v, plan, D ** -0.5, warp_specialize=False, online_skip=1e4)
        return {"max_abs_diff": float((plain - skip).abs().max())}
    B, H, S, D, block, gap = 1, 2, 512, 64, 64, 2.0
    q, k, v = _planted(B, H, S, D, block, g)
    plan = random_plan(B, H, S, block, block, 0.6, seed=7)
    # tile 0 listed (first, as kv_index is sorted) for every query tile
    idx, cnt = plan.kv_index.clone(), plan.kv_count.clone()
    for b, h, m in torch.nonzero(torch.ones_like(cnt, dtype=torch.bool)).tolist():
        tiles = sorted(set(idx[b, h, m, :int(cnt[b, h, m])].tolist()) | {0})[:idx.shape[-1]]
        idx[b, h, m, :len(tiles)] = torch.tensor(tiles)
        cnt[b, h, m] = len(tiles)
    plan = Plan(idx, cnt, block, block)
    plan.validate(q, k, v)
    scale = D ** -0.5
    out = hopper_attention(q, k, v, plan, scale, warp_specialize=False, online_skip=gap)
    emulated, skipped, listed = _emulate_skip(q, k, v, plan, scale, gap)
    exact = reference_attention(q.double(), k.double(), v.double(), plan, scale)
    return {"rel_err_vs_emulation": rel_err(out, emulated), "rel_diff_vs_exact": rel_err(emulated, exact),
            "skipped": skipped, "listed": listed}


INTERPRETER_CASES = InterpreterCases(__file__, list(CASES))


@pytest.mark.parametrize("name", ["huge-gap-equals-plain", "huge-gap-partial-tile"])
def test_online_skip_with_unreachable_gap_changes_nothing(interpreter_results, name):
    res = interpreter_results[name]
    assert "error" not in res, res.get("error")
    assert res["max_abs_diff"] == 0.0


def test_online_skip_drops_exactly_the_tiles_of_the_rule(interpreter_results):
    res = interpreter_results["planted-matches-emulation"]
    assert "error" not in res, res.get("error")
    assert res["skipped"] > res["listed"] // 3          # the planted offsets -4 and -6 are skipped
    assert res["rel_diff_vs_exact"] > 1e-3              # so the result is not exact attention ...
    assert res["rel_err_vs_emulation"] < 1e-5           # ... but exactly what the rule keeps


def test_online_skip_and_eight_warps_need_warp_specialization_off():
    pytest.importorskip("triton")
    from videosparse.kernels.triton_hopper import hopper_attention
    from videosparse.plan import dense_plan

    q = torch.zeros(1, 1, 128, 64)
    with pytest.raises(ValueError, match="warp_specialize=False"):
        hopper_attention(q, q, q, dense_plan(1, 1, 128), 0.125, online_skip=5.0)
    with pytest.raises(ValueError, match="online_skip=-1.0"):
        hopper_attention(q, q, q, dense_plan(1, 1, 128), 0.125, warp_specialize=False, online_skip=-1.0)
    with pytest.raises(ValueError, match="num_warps=8"):
        hopper_attention(q, q, q, dense_plan(1, 1, 128), 0.125, num_warps=8)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    interpreter_child(sys.argv[1:], _run_case)
