"""SolMethod: plans through the method interface, τ caching, configs, and the Veda hybrid."""

import logging
import math

import pytest
import torch

from videosparse import SolConfig, VedaConfig
from videosparse.kernels import block_sparse_attention
from videosparse.layout import head_tiling
from videosparse.method import ModelInfo
from videosparse.sol.centroids import tile_centroids, tile_means_torch
from videosparse.sol.method import SolMethod, packs_full_width
from videosparse.sol.threshold import routing_zscores, sol_mask

INFO = ModelInfo("WanTransformer3DModel", 2, 2, 64, (1, 2, 2))


def _inputs(layout, B=1, H=2, D=64, shift=0.0):
    S = layout.seq_len
    return tuple(torch.randn(B, H, S, D) + shift for _ in range(3))


@pytest.mark.parametrize("text_len", [0, 70])
def test_density_config_calibrates_once_per_layer_and_shape(text_len):
    layout = head_tiling((8, 16, 16), [(4, 4, 4), (2, 4, 8)], 2, block=64, text_len=text_len)
    method = SolMethod(SolConfig(block=64, density=0.2), INFO)
    q, k, v = _inputs(layout)
    plan = method.plan(q, k, v, layout, layer=0)
    plan.validate(q, k, v)
    N = layout.num_tiles
    assert abs(plan.density(N) - 0.2) <= 0.01
    cal = method.calibrations()
    assert len(cal) == 1 and abs(next(iter(cal.values()))["density"] - plan.density(N)) < 1e-12
    tau = method.layer_state(0)[(2, layout.seq_len, 64, layout.num_video_tiles, layout.num_global_tiles,
                                 layout.grid)][0]
    # a second call of the same layer and shape reuses τ: its plan is "z > cached τ" on the new data
    q2, k2, v2 = _inputs(layout, shift=0.1)
    plan2 = method.plan(q2, k2, v2, layout, layer=0)
    assert len(method.calibrations()) == 1 and next(iter(method.layer_state(0).values()))[0] is tau
    Mv = layout.num_video_tiles
    z2 = routing_zscores(tile_means_torch(q2, 64)[:, :, :Mv], tile_centroids(k2, v2, 64)[0][:, :, :Mv], 0.125, 1)
    assert torch.equal(plan2.to_dense_mask(N), sol_mask(z2, tau, layout.num_global_tiles))
    # another layer, or another shape, calibrates again
    method.plan(q, k, v, layout, layer=1)
    small = head_tiling((4, 16, 16), (4, 4, 4), 2, block=64)
    method.plan(*_inputs(small), small, layer=0)
    assert len(method.calibrations()) == 3
    # a grid with the same token count (portrait vs landscape) is another shape too
    portrait = head_tiling((4, 16, 16 * 2), (4, 4, 4), 2, block=64)
    landscape = head_tiling((4, 16 * 2, 16), (4, 4, 4), 2, block=64)
    method.plan(*_inputs(portrait), portrait, layer=0)
    method.plan(*_inputs(landscape), landscape, layer=0)
    assert len(method.calibrations()) == 5


def test_tau_config_is_used_as_given_and_correction_flag():
    layout = head_tiling((8, 8, 16), (4, 4, 4), 2, block=64)
    q, k, v = _inputs(layout)
    N = layout.num_tiles
    z = routing_zscores(tile_means_torch(q, 64), tile_centroids(k, v, 64)[0], 0.125, 1)
    for tau in (0.5, 1.5):
        plan = SolMethod(SolConfig(block=64, tau=tau), INFO).plan(q, k, v, layout, 0)
        assert torch.equal(plan.to_dense_mask(N), z > tau) and plan.has_correction
    lo, hi = (SolMethod(SolConfig(block=64, tau=t), INFO).plan(q, k, v, layout, 0).density(N) for t in (0.5, 1.5))
    assert lo > hi
    plain = SolMethod(SolConfig(block=64, tau=1.0, correction=False), INFO)
    plan = plain.plan(q, k, v, layout, 0)
    assert not plan.has_correction and plain.calibrations() == {}


@pytest.mark.parametrize("tau", [1e39, 1e300, -1e300])
def test_a_finite_tau_past_float32_keeps_the_band(tau):
    """A Python float past fp32's range rounded to +inf against the fp32 z-scores, and +inf > +inf dropped the forced
    band: empty rows, all-zero output without the correction (review find). τ is clamped to z's range."""
    layout = head_tiling((8, 8, 16), (4, 4, 4), 2, block=64)
    q, k, v = _inputs(layout)
    N = layout.num_tiles
    i = torch.arange(N)
    band = (i[:, None] - i[None]).abs() <= 1
    plan = SolMethod(SolConfig(block=64, tau=tau, correction=False), INFO).plan(q, k, v, layout, 0)
    mask = plan.to_dense_mask(N)
    assert mask[..., band].all() and bool((plan.kv_count > 0).all())
    assert torch.equal(mask, band.expand_as(mask)) if tau > 0 else bool(mask.all())


@pytest.mark.parametrize("backend", ["gluon_hopper", "hopper", "triton_generic"])
def test_a_kernel_named_alone_plans_as_auto(backend):
    """SolConfig(backend=<one kernel>) indexed a table of auto / triton / reference and raised KeyError on its first
    plan (review find); the centroids follow "auto" for a kernel named alone, as Veda's preparation does."""
    layout = head_tiling((4, 8, 16), (4, 4, 4), 2, block=64)
    q, k, v = _inputs(layout)
    ref = SolMethod(SolConfig(block=64, tau=0.5), INFO).plan(q, k, v, layout, 0)
    plan = SolMethod(SolConfig(block=64, tau=0.5, backend=backend), INFO).plan(q, k, v, layout, 0)
    assert torch.equal(plan.to_dense_mask(layout.num_tiles), ref.to_dense_mask(layout.num_tiles))
    assert torch.equal(plan.k_mean, ref.k_mean)


def test_plan_runs_on_reference_and_correction_matches_naive():
    from helpers import naive_attention, rel_err

    layout = head_tiling((4, 8, 10), (1, 4, 16), 2, block=64, text_len=30)    # partial + global tiles
    q, k, v = (t.double() for t in _inputs(layout))
    plan = SolMethod(SolConfig(block=64, density=0.4, tiling=(1, 4, 16)), INFO).plan(q, k, v, layout, 0)
    out = block_sparse_attention(q, k, v, plan.with_correction(plan.k_mean.double(), plan.v_sum.double(),
                                                               plan.tile_len))
    ref = naive_attention(q, k, v, plan, correction=True)
    assert rel_err(out, ref) < 1e-6


def test_static_width_plans_equal_tight_plans():
    layout = head_tiling((8, 8, 16), (4, 4, 4), 2, block=64)
    q, k, v = _inputs(layout)
    tight = SolMethod(SolConfig(block=64, tau=1.0), INFO).plan(q, k, v, layout, 0)
    static = SolMethod(SolConfig(block=64, tau=1.0), INFO)
    static.static_width = True
    wide = static.plan(q, k, v, layout, 0)
    assert wide.kv_index.shape[-1] == layout.num_tiles
    assert torch.equal(wide.kv_count, tight.kv_count)
    assert torch.equal(wide.kv_index[..., : tight.kv_index.shape[-1]], tight.kv_index)


def test_plans_pack_to_full_width_only_where_fast_kernels_run_them():
    """No host sync on CUDA at fp16/bf16 (the fast kernels read kv_count; the width only pads); tight plans
    elsewhere, where the reference backend's cost grows with the width; the attribute overrides both."""
    half, single = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    assert not packs_full_width(None, half) and not packs_full_width(None, single)
    assert packs_full_width(True, single) and not packs_full_width(False, half)
    layout = head_tiling((8, 8, 16), (4, 4, 4), 2, block=64)
    q, k, v = _inputs(layout)
    assert SolMethod(SolConfig(block=64, tau=1.0), INFO).plan(q, k, v, layout, 0).kv_index.shape[-1] < layout.num_tiles


@pytest.mark.gpu
def test_plans_on_cuda_are_full_width_and_equal_tight_ones():
    layout = head_tiling((8, 8, 16), (4, 4, 4), 2, block=64)
    q, k, v = (t.cuda().bfloat16() for t in _inputs(layout))
    wide = SolMethod(SolConfig(block=64, tau=1.0), INFO).plan(q, k, v, layout, 0)
    tight_method = SolMethod(SolConfig(block=64, tau=1.0), INFO)
    tight_method.static_width = False
    tight = tight_method.plan(q, k, v, layout, 0)
    assert wide.kv_index.shape[-1] == layout.num_tiles > tight.kv_index.shape[-1]
    assert torch.equal(wide.kv_count, tight.kv_count)
    assert torch.equal(wide.kv_index[..., : tight.kv_index.shape[-1]], tight.kv_index)
    from helpers import rel_err

    # the width can change how the kernel cuts its last wave (tail_split reads it), so up to bf16 rounding
    out_wide, out_tight = (block_sparse_attention(q, k, v, p).float() for p in (wide, tight))
    assert rel_err(out_wide, out_tight) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("correction", [False, True])
def test_sol_hot_path_on_cuda_never_syncs_the_host(correction):
    """After the calibrating first call, a Sol plan and its kernel call queue GPU work only: a host sync per
    layer left the H200 idle for a fifth of an eager Wan 1.3B forward (docs/results.md, "Sol without host syncs")."""
    layout = head_tiling((8, 16, 16), (4, 4, 8), 2, block=128)
    q, k, v = (t.cuda().bfloat16() for t in _inputs(layout, D=128))
    method = SolMethod(SolConfig(block=128, density=0.3, correction=correction), ModelInfo(
        "WanTransformer3DModel", 2, 2, 128, (1, 2, 2)))
    block_sparse_attention(q, k, v, method.plan(q, k, v, layout, 0), validate=False)     # calibrates, compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        block_sparse_attention(q, k, v, method.plan(q, k, v, layout, 0), validate=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_unreachable_density_warns_once(caplog):
    layout = head_tiling((4, 4, 16), (1, 4, 16), 2, block=64)                 # 4 tiles: band alone is 10/16
    method = SolMethod(SolConfig(block=64, density=0.2, tiling=(1, 4, 16)), INFO)
    with caplog.at_level(logging.WARNING, logger="videosparse.sol.method"):
        for _ in range(2):       # the session calls on_layout eagerly for every new layout (outside any graph)
            method.on_layout(3, layout)
        plans = [method.plan(*_inputs(layout), layout, 3) for _ in range(2)]
    assert sum("below the density" in r.message for r in caplog.records) == 1
    dense_layer = SolMethod(SolConfig(block=64, density=0.2, tiling=(1, 4, 16), dense_layers=(3,)), INFO)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="videosparse.sol.method"):
        dense_layer.on_layout(3, layout)                 # a dense layer never runs sparse: nothing to warn about
    assert not any("below the density" in r.message for r in caplog.records)
    assert plans[0].density(4) == 10 / 16             # calibration call: only the band
    assert plans[1].density(4) >= 10 / 16


def test_errors():
    with pytest.raises(TypeError, match="SolConfig"):
        SolMethod(VedaConfig(), INFO)
    layout = head_tiling((4, 8, 8), (1, 4, 16), 2, block=64)
    q, k, v = _inputs(layout)
    with pytest.raises(ValueError, match="block=128"):
        SolMethod(SolConfig(tau=1.0, block=128), INFO).plan(q, k, v, layout, 0)


def test_veda_hybrid_adds_dispatched_correction(monkeypatch):
    import videosparse.sol.centroids as centroids
    from videosparse.veda.method import VedaMethod

    asked = []
    real = centroids.tile_centroids_torch      # what the dispatching tile_centroids runs eagerly on CPU
    monkeypatch.setattr(centroids, "tile_centroids_torch", lambda k, v, block: asked.append(block) or real(k, v, block))
    layout = head_tiling((4, 8, 16), (1, 4, 16), 2, block=64, text_len=20)
    q, k, v = _inputs(layout)
    plan = VedaMethod(VedaConfig(density=0.3, block=64, tiling=(1, 4, 16), correction=True), INFO).plan(
        q, k, v, layout, 0)
    ref = tile_centroids(k, v, 64)
    assert plan.has_correction and asked          # went through the dispatching tile_centroids
    assert all(torch.equal(a, b) for a, b in zip((plan.k_mean, plan.v_sum, plan.tile_len), ref))
    plain = VedaMethod(VedaConfig(density=0.3, block=64, tiling=(1, 4, 16)), INFO).plan(q, k, v, layout, 0)
    assert not plain.has_correction and torch.equal(plain.kv_index, plan.kv_index)


def test_a_method_of_the_users_own_takes_its_configs_tiling_or_the_blocks_default():
    """`SparseMethod.tile_shapes` for a config without `tile_shape` (a method of the user's own): its `tiling`, and the
    block's default where that is None, as the built-in configs read it."""
    import dataclasses

    from videosparse.method import ModelInfo, SparseMethod

    @dataclasses.dataclass(frozen=True)
    class MyConfig:
        block: int = 128
        tiling: tuple | None = None

    info = ModelInfo("WanTransformer3DModel", 2, 2, 64, (1, 2, 2))
    assert SparseMethod(MyConfig(), info).tile_shapes(0, 2) == (4, 4, 8)
    assert SparseMethod(MyConfig(block=64), info).tile_shapes(0, 2) == (4, 4, 4)
    assert SparseMethod(MyConfig(tiling=(2, 8, 8)), info).tile_shapes(0, 2) == (2, 8, 8)


@pytest.mark.parametrize("density, expected", [(1.0, -math.inf), (1e-4, math.inf)])
def test_calibrations_report_the_sentinel_thresholds_as_infinities(density, expected):
    """Every tile kept (density 1) or only the always-exact ones (a density under the band's floor): τ sits at the
    float32 limit inside, which the report gives as -inf / +inf, not as 3.4e38."""
    layout = head_tiling((8, 16, 16), (4, 4, 4), 2, block=64)
    method = SolMethod(SolConfig(block=64, density=density), INFO)
    q, k, v = _inputs(layout)
    plan = method.plan(q, k, v, layout, layer=0)
    (cal,) = method.calibrations().values()
    assert cal["tau"] == expected
    assert cal["density"] == pytest.approx(plan.density(layout.num_tiles), abs=1e-12)


def test_calibrations_report_finite_thresholds_as_they_are():
    """Mutation find: only τ at the float32 limit is reported as ±inf; a finite τ past another format's range
    (fp16's 65504) is reported as is (a limit read from fp16 turned 1e5 into inf)."""
    method = SolMethod(SolConfig(block=64, density=0.2), INFO)
    limit = torch.finfo(torch.float32).max
    for tau in (1e5, -1e5, 0.25, 1e30):
        method.layer_state(0)[("shape", tau)] = (torch.tensor(tau), torch.tensor(0.2, dtype=torch.float64))
    method.layer_state(0)[("shape", "limit")] = (torch.tensor(limit), torch.tensor(0.0, dtype=torch.float64))
    cal = method.calibrations()
    for tau in (1e5, -1e5, 0.25, 1e30):
        assert cal[(0, "shape", tau)]["tau"] == float(torch.tensor(tau)), tau
    assert cal[(0, "shape", "limit")]["tau"] == float("inf")
