"""Zero-order correction on structured synthetic attention: lower error at equal density, Sol and top-k."""


import pytest

from videosparse import SolConfig, VedaConfig
from videosparse.kernels import block_sparse_attention
from videosparse.layout import head_tiling
from videosparse.method import ModelInfo
from videosparse.plan import dense_plan
from videosparse.sol.method import SolMethod
from videosparse.veda.method import VedaMethod

from helpers import rel_err
from sol_data import structured_qkv

B, H, D, BLOCK = 1, 2, 64, 64
LAYOUT = head_tiling((12, 16, 16), (1, 4, 16), H, block=BLOCK)          # 48 video tiles of 64 tokens
INFO = ModelInfo("WanTransformer3DModel", 1, H, D, (1, 2, 2))


def errors(density: float, spread: float, seed: int) -> dict[str, float]:
    """Relative L2 error vs dense of top-k (untrained Veda: mean-pooled q·k) and Sol at top-k's density."""
    q, k, v = structured_qkv(B, H, LAYOUT.num_tiles, BLOCK, D, spread=spread, seed=seed)
    S = q.shape[2]
    dense = block_sparse_attention(q, k, v, dense_plan(B, H, S, BLOCK, BLOCK))
    topk = VedaMethod(VedaConfig(density=density, block=BLOCK, tiling=(1, 4, 16), correction=True), INFO)
    plan_topk = topk.plan(q, k, v, LAYOUT, 0)
    realized = plan_topk.density(LAYOUT.num_tiles)
    plan_sol = SolMethod(SolConfig(block=64, density=realized, tiling=(1, 4, 16)), INFO).plan(q, k, v, LAYOUT, 0)
    out = {"density_topk": realized, "density_sol": plan_sol.density(LAYOUT.num_tiles)}
    for name, plan in (("topk", plan_topk), ("sol", plan_sol)):
        out[name] = rel_err(block_sparse_attention(q, k, v, plan.without_correction()), dense)
        out[name + "+corr"] = rel_err(block_sparse_attention(q, k, v, plan), dense)
    return out


@pytest.mark.parametrize("density", [0.1, 0.2])
@pytest.mark.parametrize("spread,seed", [(0.3, 0), (0.8, 2)])
def test_correction_lowers_error_for_sol_and_topk(density, spread, seed):
    e = errors(density, spread, seed)
    assert abs(e["density_sol"] - e["density_topk"]) <= 0.01
    assert e["topk+corr"] < e["topk"], e
    assert e["sol+corr"] < e["sol"], e


def test_correction_gain_is_large_when_clusters_are_tight():
    # tokens close to their tile mean: the centroid stands in for the skipped keys almost exactly
    e = errors(0.2, 0.5, 3)
    assert e["topk+corr"] < 0.75 * e["topk"] and e["sol+corr"] < 0.75 * e["sol"], e


if __name__ == "__main__":
    for density in (0.1, 0.2):
        for spread, seed in ((0.3, 0), (0.5, 1), (0.8, 2)):
            e = errors(density, spread, seed)
            print(f"density {density} spread {spread}: " + ", ".join(f"{k} {v:.4f}" for k, v in e.items()))
