"""Sol routing: threshold against an explicit fp64 formula, masks, packing, density calibration."""

import math

import pytest
import torch

from videosparse.plan import plan_from_mask
from videosparse.sol.centroids import tile_centroids_torch, tile_means_torch
from videosparse.sol.threshold import (
    band_mask,
    calibrate_tau,
    forced_pairs,
    gaussian_fit,
    pack_mask,
    routing_scores,
    routing_zscores,
    sol_mask,
    sol_plan_from_zscores,
    sol_threshold,
)

from sol_data import structured_qkv


def _fp64_threshold(q_mean, k_mean, tau, scale):
    """thr_i = scale * (q̄_i·μ + τ sqrt(Σ_d q̄_{i,d}² σ²_d)), written out channel by channel in fp64."""
    qm, km = q_mean.double(), k_mean.double()
    B, H, M, D = qm.shape
    N = km.shape[2]
    thr = torch.empty(B, H, M, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            mu = [sum(km[b, h, j, d].item() for j in range(N)) / N for d in range(D)]
            var = [sum((km[b, h, j, d].item() - mu[d]) ** 2 for j in range(N)) / N for d in range(D)]
            for i in range(M):
                qi = qm[b, h, i].tolist()
                mean = sum(qi[d] * mu[d] for d in range(D))
                std = math.sqrt(sum(qi[d] ** 2 * var[d] for d in range(D)))
                thr[b, h, i] = scale * (mean + tau * std)
    return thr


@pytest.mark.parametrize("tau", [-0.5, 0.0, 1.3, 2.5])
def test_threshold_equals_fp64_formula(tau):
    B, H, M, D = 2, 2, 9, 16
    q_mean = torch.randn(B, H, M, D) + 0.3
    k_mean = torch.randn(B, H, M, D) * torch.rand(D) + 0.5   # per-channel spread and offset
    scale = 1 / math.sqrt(D)
    mu, var = gaussian_fit(k_mean)
    thr = sol_threshold(q_mean, mu, var, tau, scale)
    ref = _fp64_threshold(q_mean, k_mean, tau, scale)
    assert thr.dtype == torch.float32 and thr.shape == (B, H, M)
    assert torch.allclose(thr.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # the mask from z-scores is exactly "statistic > threshold" (band forced), away from exact ties
    s = (q_mean.double() @ k_mean.double().transpose(-1, -2)) * scale
    want = (s > ref[..., None]) | band_mask(M, 1)
    got = routing_zscores(q_mean, k_mean, scale, band=1) > tau
    clear = (s - ref[..., None]).abs() > 1e-4
    assert torch.equal(got[clear], want[clear])
    assert clear.float().mean() > 0.95


def test_method_mask_equals_fp64_formula_on_tokens():
    """From raw tokens (partial last tile, text tiles) to the plan, against fp64 done by hand."""
    from videosparse import SolConfig
    from videosparse.layout import head_tiling
    from videosparse.method import ModelInfo
    from videosparse.sol.method import SolMethod

    B, H, D, block, tau, band = 1, 2, 32, 64, 0.8, 1
    layout = head_tiling((3, 8, 12), (1, 4, 16), H, block=block, text_len=100)   # 288 video + 100 text
    S = layout.seq_len
    q, k, v = (torch.randn(B, H, S, D) + 0.2 for _ in range(3))
    method = SolMethod(SolConfig(tau=tau, block=block, tiling=(1, 4, 16), band=band), ModelInfo("x", 1, H, D, (1, 2, 2)))
    plan = method.plan(q, k, v, layout, layer=0)
    N, Mv = layout.num_tiles, layout.num_video_tiles
    assert (N, Mv) == (7, 4)
    tiles = [slice(i * block, min(S, (i + 1) * block)) for i in range(N)]
    qm = torch.stack([q[:, :, t].double().mean(2) for t in tiles], 2)
    km = torch.stack([k[:, :, t].double().mean(2) for t in tiles], 2)
    scale = 1 / math.sqrt(D)
    thr = _fp64_threshold(qm[:, :, :Mv], km[:, :, :Mv], tau, scale)
    s = (qm[:, :, :Mv] @ km[:, :, :Mv].transpose(-1, -2)) * scale
    want = torch.ones(B, H, N, N, dtype=torch.bool)
    want[:, :, :Mv, :Mv] = (s > thr[..., None]) | band_mask(Mv, band)
    assert (s - thr[..., None]).abs().min() > 1e-5                      # no near-ties in this draw
    assert torch.equal(plan.to_dense_mask(N), want)
    assert plan.has_correction
    ref_k, ref_v, ref_len = tile_centroids_torch(k, v, block)
    assert torch.equal(plan.k_mean, ref_k) and torch.equal(plan.v_sum, ref_v) and torch.equal(plan.tile_len, ref_len)


def test_degenerate_rows_and_band():
    q_mean = torch.randn(1, 1, 6, 8)
    q_mean[0, 0, 2] = 0.0                       # b_i == 0 and s_ij == a_i: at the mean, z = 0
    k_mean = torch.randn(1, 1, 6, 8)
    z = routing_zscores(q_mean, k_mean, 0.125, band=0)
    assert (z[0, 0, 2, [0, 1, 3, 4, 5]] == 0).all() and torch.isposinf(z[0, 0, 2, 2])
    z2 = routing_zscores(q_mean, k_mean, 0.125, band=2)
    assert torch.isposinf(z2[0, 0][band_mask(6, 2)]).all()
    assert torch.isfinite(z2[0, 0][~band_mask(6, 2) & (torch.arange(6)[:, None] != 2)]).all()


@pytest.mark.parametrize("G", [0, 3])
def test_pack_mask_equals_sorting_builder(G):
    mask = torch.rand(2, 3, 17, 17) < 0.3
    mask[..., 0] = True
    z = torch.where(mask[..., :14, :14], 1.0, -1.0)
    full = sol_mask(z, 0.0, G) if G else mask
    for width in (None, full.shape[-1]):
        got = pack_mask(full, 64, 64, width=width)
        ref = plan_from_mask(full, 64, 64)
        k = ref.kv_index.shape[-1]
        assert torch.equal(got.kv_count, ref.kv_count)
        assert torch.equal(got.kv_index[..., :k], ref.kv_index) and not got.kv_index[..., k:].any()
    if G:
        assert full[:, :, 14:].all() and full[:, :, :, 14:].all()
    with pytest.raises(ValueError, match="width=0"):
        pack_mask(full, 64, 64, width=0)
    with pytest.raises(ValueError, match="bool"):
        pack_mask(full.int(), 64, 64)


def _plan_density(z, tau, G, block=64):
    N = z.shape[-1] + G
    return sol_plan_from_zscores(z, tau, G, block).density(N)


@pytest.mark.parametrize("density", [0.05, 0.15, 0.3, 0.6])
@pytest.mark.parametrize("kind", ["random", "structured"])
@pytest.mark.parametrize("G", [0, 2])
def test_calibration_within_001(density, kind, G):
    B, H, N, D, block = 1, 4, 60, 64, 64
    if kind == "random":
        q, k, _ = (torch.randn(B, H, N * block, D) for _ in range(3))
    else:
        q, k, _ = structured_qkv(B, H, N, block, D, seed=1)
    qm, km = tile_means_torch(q, block), tile_centroids_torch(k, k, block)[0]
    z = routing_zscores(qm, km, 1 / math.sqrt(D), band=1)
    tau, realized = calibrate_tau(z, density, G)
    got = _plan_density(z, tau, G)
    floor = forced_pairs(N, G, 1) / (N + G) ** 2
    assert abs(got - realized.item()) < 1e-12
    assert abs(got - max(density, floor)) <= 0.01, (got, density, floor)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("density", [0.3, 0.5, 0.8])      # (the forced tiles alone: 0.24)
def test_calibration_with_padded_key_tiles_counts_the_tiles_computed(density, skip):
    """Review find: with padded text (HunyuanVideo, Mochi) the calibration counted all N x N tile pairs, padded text
    tiles kept, while the plan drops them (`Plan.with_valid_keys`): density 0.3 gave 0.266 computed. Given the valid
    key tiles, the calibrated density is that of the computed pairs, equal to the plan's after dropping them."""
    B, H, Mv, G, block = 2, 3, 30, 4, 64
    z = torch.randn(B, H, Mv, Mv, generator=torch.Generator().manual_seed(5)).masked_fill(band_mask(Mv, 1), math.inf)
    valid_keys = torch.tensor([Mv * block + 70, Mv * block + 1], dtype=torch.int32)    # 2 and 1 valid text tiles
    key_tiles = (valid_keys.long() + block - 1) // block
    tau, realized = calibrate_tau(z, density, G, valid_key_tiles=key_tiles, skip_padded_queries=skip)
    plan = sol_plan_from_zscores(z, tau, G, block).with_valid_keys(valid_keys, skip)
    query_tiles = key_tiles if skip else torch.full_like(key_tiles, Mv + G)
    computed = plan.kv_count.sum().item() / (H * (query_tiles * key_tiles).sum().item())
    assert abs(computed - realized.item()) < 1e-12
    assert abs(computed - density) < 0.01, (computed, density)
    with pytest.raises(ValueError, match=r"valid_key_tiles has shape \(3,\); expected \(2,\)"):
        calibrate_tau(z, density, G, valid_key_tiles=torch.ones(3, dtype=torch.long))


def test_calibration_below_forced_density_keeps_only_forced_tiles():
    z = torch.randn(1, 2, 6, 6).masked_fill(band_mask(6, 1), float("inf"))
    tau, realized = calibrate_tau(z, 0.05, 1)
    plan_mask = sol_mask(z, tau, 1)
    forced = torch.ones(7, 7, dtype=torch.bool)
    forced[:6, :6] = band_mask(6, 1)
    assert torch.equal(plan_mask, forced.expand(1, 2, 7, 7))
    assert abs(realized.item() - forced_pairs(6, 1, 1) / 49) < 1e-12


@pytest.mark.parametrize("band", [0, 1, 3, 5, 6, 10**12])
def test_forced_pairs_counts_the_band_mask(band):
    """Globals plus the band's pairs, as `band_mask` marks them; a band wider than the grid costs no loop over it."""
    for Mv, G in [(0, 2), (1, 0), (6, 1), (7, 3)]:
        band_pairs = int(band_mask(Mv, min(band, Mv)).sum()) if Mv else 0
        assert forced_pairs(Mv, G, band) == (Mv + G) ** 2 - Mv * Mv + band_pairs, (Mv, G, band)


@pytest.mark.parametrize("density", [0.2, 0.5, 1.0, 0.01])
def test_calibrated_tau_sits_in_the_middle_of_its_gap(density):
    """The bisection ends on the marginal score itself; τ is moved to the middle of the gap between the
    finite scores around it, so that the same scores recomputed with other rounding give the same tiles
    (a batch of two used to flip tiles of its first item against that item alone). With no score below
    (density 1) or above (below the forced density) τ is -/+ the largest float, for any later input too."""
    torch.manual_seed(3)
    z = routing_zscores(torch.randn(2, 3, 40, 32), torch.randn(2, 3, 40, 32), 0.2, band=1)
    tau, realized = calibrate_tau(z, density, 1)
    finite = z[torch.isfinite(z)]
    kept, left = finite[finite > tau], finite[finite <= tau]
    assert abs(_plan_density(z, tau, 1) - realized.item()) < 1e-12
    big = torch.finfo(torch.float32).max
    if not left.numel():
        assert tau.item() == -big and density == 1.0
    elif not kept.numel():
        assert tau.item() == big and density < forced_pairs(40, 1, 1) / 41**2
    else:
        a, b = left.max(), kept.min()
        assert torch.allclose(tau, 0.5 * (a + b)), (a, tau, b)
    for rel in (1e-6, -1e-6):                            # the same scores with other rounding: same mask
        z2 = z * (1 + rel)
        assert torch.equal(sol_mask(z2, tau, 1), sol_mask(z, tau, 1))


def test_calibration_density_one_and_bad_density():
    z = torch.randn(1, 2, 10, 10)
    tau, realized = calibrate_tau(z, 1.0, 0)
    assert (z > tau).all() and realized.item() == 1.0
    # every centroid equal (zero variance): the density target is still reachable
    z0 = routing_zscores(torch.randn(1, 2, 10, 8), torch.ones(1, 2, 10, 8), 0.125, band=0)
    tau0, realized0 = calibrate_tau(z0, 1.0, 0)
    assert (z0 > tau0).all() and realized0.item() == 1.0
    with pytest.raises(ValueError, match="density=0"):
        calibrate_tau(z, 0.0, 0)


def test_routing_scores_shift_by_threshold_mean():
    q_mean, k_mean = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8)
    s = routing_scores(q_mean, k_mean, 0.5)
    mu, var = gaussian_fit(k_mean)
    # mean over key tiles of the statistic equals the τ = 0 threshold
    assert torch.allclose(s.mean(-1), sol_threshold(q_mean, mu, var, 0.0, 0.5), atol=1e-5)


@pytest.mark.parametrize("num_tiles", [6, 7, 11])
def test_equal_centroids_fit_zero_variance_and_give_zero_zscores(num_tiles):
    """Equal key centroids: var and z exactly 0 off the band (a plain mean's rounding gave var ~1e-16 and z-scores of
    noise over +-2, so a fixed tau kept random whole rows)."""
    k_mean = torch.full((1, 2, num_tiles, 8), 0.1)
    q_mean = torch.randn(1, 2, num_tiles, 8, generator=torch.Generator().manual_seed(0))
    mu, var = gaussian_fit(k_mean)
    assert torch.equal(var, torch.zeros_like(var)) and torch.allclose(mu, torch.full_like(mu, 0.1))
    z = routing_zscores(q_mean, k_mean, 0.35, band=0)
    off = ~torch.eye(num_tiles, dtype=torch.bool)
    assert torch.equal(z[..., off], torch.zeros_like(z[..., off]))
    assert bool(torch.isinf(z[..., ~off]).all())


@pytest.mark.parametrize("which, factor", [("q", 1e20), ("q", 1e-24), ("k", 1e-24), ("k", 1e20)])
def test_zscores_keep_their_tiles_at_extreme_input_scales(which, factor):
    """z = (s - a) / b does not change when q or k is scaled; its fp32 squares overflowed past |q|·σ ~ 1e19 (every z
    0: only the band kept) and underflowed under ~1e-23 (z = +-inf: 41 of 64 tiles kept even at tau = -3.4e38)."""
    gen = torch.Generator().manual_seed(0)
    q_mean, k_mean = torch.randn(2, 2, 8, 64, generator=gen), torch.randn(2, 2, 8, 64, generator=gen)
    z = routing_zscores(q_mean, k_mean, 0.125, band=0)
    scaled = routing_zscores(q_mean * (factor if which == "q" else 1), k_mean * (factor if which == "k" else 1),
                             0.125, band=0)
    assert torch.isfinite(scaled).sum() == torch.isfinite(z).sum() == 2 * 2 * 8 * 7
    assert torch.allclose(scaled, z, rtol=1e-4, atol=1e-5)
    assert sol_plan_from_zscores(scaled, -3.4e38, 0, 64).kv_count.min() == 8     # tau -> -inf keeps every tile
    # no tiles at all: empty z-scores, as before the scaling (its max over an empty dim raised)
    assert routing_zscores(q_mean[:, :, :0], k_mean[:, :, :0], 0.125, band=0).shape == (2, 2, 0, 0)
    assert routing_zscores(q_mean, k_mean[:, :, :0], 0.125, band=0).shape == (2, 2, 8, 0)


def test_threshold_helpers_refuse_a_negative_global_tile_count_and_a_non_square_z():
    z = torch.zeros(1, 2, 5, 5)
    for call in (lambda: sol_mask(z, 0.0, -1), lambda: forced_pairs(5, -1, 0),
                 lambda: calibrate_tau(z, 0.5, -2), lambda: sol_plan_from_zscores(z, 0.0, -1, 64)):
        with pytest.raises(ValueError, match="num_global_tiles=-[12] must be an int >= 0"):
            call()
    with pytest.raises(ValueError, match="z must be \\[B, H, Mv, Mv\\]; got \\(1, 2, 5, 4\\)"):
        calibrate_tau(z[..., :4], 0.5, 0)
