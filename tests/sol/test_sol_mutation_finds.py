"""Tests from a mutation pass over Sol's routing threshold and centroids (`videosparse/sol/threshold.py`,
`videosparse/sol/centroids.py`): each guards a behaviour that a one-line change of the shipped code broke while the
rest of the suite still passed."""

import math
import os

import pytest
import torch

from videosparse.sol.centroids import tile_centroids, tile_centroids_op, tile_stats, tile_stats_op
from videosparse.sol.threshold import band_mask, calibrate_tau, forced_pairs, gaussian_fit, pack_mask, routing_scores
from videosparse.sol.threshold import routing_zscores, sol_mask, sol_plan_from_zscores, sol_threshold


def _zscores_fp64(q_mean, k_mean, band):
    """z_ij = (s_ij - a_i) / b_i written out in fp64 (population variance of the key centroids), band forced +inf.
    The softmax scale cancels; rows with b_i == 0 are not expected here."""
    q, k = q_mean.double(), k_mean.double()
    mu = k.mean(2, keepdim=True)
    var = (k - mu).square().mean(2)
    d = q @ (k - mu).transpose(-1, -2)
    b = (q.square() * var[:, :, None]).sum(-1, keepdim=True).sqrt()
    z = d / b
    M, N = z.shape[-2:]
    return z.masked_fill(band_mask(max(M, N), band)[:M, :N], math.inf)


def _check_zscores(z, ref):
    forced = torch.isinf(ref)
    assert torch.equal(torch.isposinf(z), forced), "only the band may be +inf"
    assert torch.isfinite(z[~forced]).all()
    assert torch.allclose(z[~forced].double(), ref[~forced], rtol=1e-4, atol=1e-4)


def test_zscores_scale_each_query_row_on_its_own():
    """Mutation find: the query means are brought to max-abs ~1 per query tile (dims (3,)), not per head; scaled per
    head, a row at 1e-24 next to one at 1e20 underflowed (b_i = 0: its z-scores +-inf, a whole row kept or dropped).
    The grid is not square (7 query x 9 key tiles): a band mask sized by the query tiles alone did not broadcast."""
    gen = torch.Generator().manual_seed(11)
    q_mean = torch.randn(1, 2, 7, 24, generator=gen)
    k_mean = torch.randn(1, 2, 9, 24, generator=gen) + 0.3
    rows = torch.tensor([1e20, 1e-24, 1.0, 1e-24, 1e20, 3e-20, 1.0]).view(1, 1, 7, 1)
    z = routing_zscores(q_mean * rows, k_mean, 0.125, band=1)
    assert z.shape == (1, 2, 7, 9) and z.dtype == torch.float32
    _check_zscores(z, _zscores_fp64(q_mean, k_mean, band=1))     # z is invariant to a positive scale of a row


@pytest.mark.parametrize("which", ["q", "k"])
def test_zscores_of_subnormal_inputs_stay_finite(which):
    """Mutation find: `_unit_max_abs` clamps the power-of-two exponent to [-126, 127]; unclamped, inputs at ~2^-130
    (fp32 subnormals) were multiplied by 2^130 = inf in fp32, and every z-score came out NaN."""
    gen = torch.Generator().manual_seed(12)
    q_mean = torch.randn(2, 1, 6, 20, generator=gen)
    k_mean = torch.randn(2, 1, 5, 20, generator=gen)
    tiny = 2.0 ** -130
    if which == "q":
        q_mean = q_mean * tiny
    else:
        k_mean = k_mean * tiny
    assert q_mean.abs().max() < torch.finfo(torch.float32).tiny or k_mean.abs().max() < torch.finfo(torch.float32).tiny
    z = routing_zscores(q_mean, k_mean, 0.2, band=0)
    _check_zscores(z, _zscores_fp64(q_mean, k_mean, band=0))       # fp64 of the (subnormal) inputs themselves


def test_threshold_and_scores_upcast_half_precision_means_to_fp32():
    """Mutation find: `sol_threshold` and `routing_scores` compute in fp32 from bf16 means too (as documented: fp32
    out); without the upcast the squares of q̄ were rounded to bf16 (threshold off by ~1e-3 relative) and the scores
    came back in bf16."""
    gen = torch.Generator().manual_seed(19)
    q_mean = (torch.randn(1, 2, 5, 40, generator=gen) + 0.4).bfloat16()
    k_mean = (torch.randn(1, 2, 7, 40, generator=gen) * 0.7 + 0.2).bfloat16()
    scale, tau = 1 / math.sqrt(40), 2.0
    q, k = q_mean.double(), k_mean.double()
    mu, var = gaussian_fit(k_mean)
    thr = sol_threshold(q_mean, mu, var, tau, scale)
    mu64, var64 = k.mean(2), k.var(2, unbiased=False)
    ref = scale * ((q * mu64[:, :, None]).sum(-1) + tau * (q.square() * var64[:, :, None]).sum(-1).sqrt())
    assert thr.dtype == torch.float32 and torch.allclose(thr.double(), ref, rtol=2e-6, atol=1e-6)
    s = routing_scores(q_mean, k_mean, scale)
    assert s.dtype == torch.float32 and s.shape == (1, 2, 5, 7)
    assert torch.allclose(s.double(), (q @ k.transpose(-1, -2)) * scale, rtol=2e-6, atol=1e-6)


def test_calibrate_tau_refuses_a_tensor_density_that_is_not_0dim():
    """Mutation find: a tensor density must be 0-dim (one target for the whole call); without the check a [1] tensor
    went through the bisection and gave a tau of shape [1] instead of an error."""
    z = torch.randn(1, 2, 6, 6, generator=torch.Generator().manual_seed(13))
    with pytest.raises(ValueError, match=r"density has shape \(1,\); a tensor density must be 0-dim"):
        calibrate_tau(z, torch.tensor([0.5], dtype=torch.float64), 0)
    tau, realized = calibrate_tau(z, torch.tensor(0.5, dtype=torch.float64), 0)
    tau_f, realized_f = calibrate_tau(z, 0.5, 0)
    assert tau.shape == () and torch.equal(tau, tau_f) and torch.equal(realized, realized_f)


def test_threshold_helpers_refuse_a_bool_global_tile_count():
    """Mutation find: `num_global_tiles=True` is refused (a bool is an int in Python); without the bool check it was
    taken as one global tile by `sol_mask`, `forced_pairs` and `calibrate_tau`."""
    z = torch.zeros(1, 1, 4, 4)
    for call in (lambda: sol_mask(z, 0.0, True), lambda: forced_pairs(4, True, 0),
                 lambda: calibrate_tau(z, 0.5, True), lambda: sol_plan_from_zscores(z, 0.0, False, 64)):
        with pytest.raises(ValueError, match="num_global_tiles=(True|False) must be an int >= 0"):
            call()


def test_sol_mask_keeps_a_tile_only_strictly_above_tau():
    """Mutation find: a tile is kept iff z > tau, strictly: with `z >= tau` every pair of a degenerate row (zero query
    mean: z = 0 off the band) was kept at tau = 0, and a score equal to tau passed."""
    q_mean = torch.randn(1, 1, 5, 8, generator=torch.Generator().manual_seed(14))
    q_mean[0, 0, 3] = 0.0
    k_mean = torch.randn(1, 1, 5, 8, generator=torch.Generator().manual_seed(15))
    z = routing_zscores(q_mean, k_mean, 0.35, band=0)
    assert (z[0, 0, 3, [0, 1, 2, 4]] == 0).all()
    mask = sol_mask(z, 0.0, 0)
    assert torch.equal(mask, z > 0) and mask[0, 0, 3].tolist() == [False, False, False, True, False]
    zz = torch.tensor([-1.5, 0.25, 0.75, 2.0]).view(1, 1, 2, 2)
    assert sol_mask(zz, 0.75, 1)[0, 0].tolist() == [[False, False, True], [False, True, True], [True, True, True]]
    assert sol_mask(zz, torch.tensor(0.25), 0)[0, 0].tolist() == [[False, False], [True, True]]


@pytest.mark.parametrize("tau", [math.inf, torch.tensor(math.inf), 1e39])
def test_sol_mask_keeps_the_forced_pairs_at_an_infinite_tau(tau):
    """Mutation find: tau is clamped to fp32's finite range, so the forced (+inf) band pairs and the global tiles stay
    at any tau; unclamped, tau = inf (or a Python float past fp32's max) dropped the band: `+inf > inf` is False."""
    z = torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(16)).masked_fill(band_mask(6, 1), math.inf)
    want = torch.ones(7, 7, dtype=torch.bool)
    want[:6, :6] = band_mask(6, 1)
    assert torch.equal(sol_mask(z, tau, 1), want.expand(2, 1, 7, 7))
    plan = sol_plan_from_zscores(z, tau, 1, 64)
    assert plan.kv_count.sum().item() == 2 * forced_pairs(6, 1, 1)


def test_pack_mask_refuses_a_width_past_the_key_tiles():
    """Mutation find: `width` must lie in [1, N]; without the upper bound a width of N + 1 packed rows wider than there
    are key tiles."""
    mask = torch.tensor([True, False, True, True, False]).view(1, 1, 1, 5)
    with pytest.raises(ValueError, match=r"width=6 must lie in \[1, N=5\]"):
        pack_mask(mask, 64, 64, width=6)
    assert pack_mask(mask, 64, 64, width=5).kv_index[0, 0, 0].tolist() == [0, 2, 3, 0, 0]


def test_pack_mask_spills_tiles_past_a_too_small_width():
    """Mutation find: with a width below a row's count, the tiles past it go to the spill slot (the count stays the true
    one, so `Plan.validate` reports kv_count > Kmax); without the `pos < width` guard the scatter indexed past its
    buffer and raised a RuntimeError."""
    mask = torch.tensor([[True, False, True, True, False], [False, True, False, False, False]]).view(1, 1, 2, 5)
    plan = pack_mask(mask, 64, 64, width=1)
    assert plan.kv_count[0, 0].tolist() == [3, 1]
    assert plan.kv_index[0, 0].tolist() == [[0], [1]]
    plan2 = pack_mask(mask, 64, 64, width=2)
    assert plan2.kv_index[0, 0].tolist() == [[0, 2], [1, 0]]


def _centroids_plain(k, v, block):
    """Mean key, value sum and real length of every tile, one tile at a time in fp64."""
    S = k.shape[2]
    tiles = [slice(s, min(S, s + block)) for s in range(0, S, block)]
    k_mean = torch.stack([k[:, :, t].double().mean(2) for t in tiles], 2)
    v_sum = torch.stack([v[:, :, t].double().sum(2) for t in tiles], 2)
    return k_mean, v_sum, [t.stop - t.start for t in tiles]


@pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="the refusal below needs the interpreter off")
def test_centroids_of_a_v_that_records_gradients_come_from_torch_with_the_gradient():
    """Mutation find: wherever autograd records k OR v the centroids come from torch (differentiable), whatever the
    backend; checking k alone sent a v that records gradients to the Triton kernel (no gradient; on CPU the forced
    "triton" backend then refused the call)."""
    gen = torch.Generator().manual_seed(17)
    k = torch.randn(1, 2, 130, 24, generator=gen)
    v = torch.randn(1, 2, 130, 24, generator=gen).requires_grad_()
    k_mean, v_sum, tile_len = tile_centroids(k, v, 64, backend="triton")
    ref_k, ref_v, ref_len = _centroids_plain(k, v.detach(), 64)
    assert tile_len.tolist() == ref_len == [64, 64, 2]
    assert torch.allclose(k_mean.double(), ref_k, atol=1e-6) and torch.allclose(v_sum.double(), ref_v, atol=1e-5)
    assert v_sum.requires_grad
    v_sum.sum().backward()
    assert torch.equal(v.grad, torch.ones_like(v))
    q = torch.randn(1, 2, 130, 24, generator=gen)
    out = tile_stats(q, k, v, 64, backend="triton")
    assert out[2].requires_grad and torch.allclose(out[1].double(), ref_k, atol=1e-6)
    with pytest.raises(ValueError, match="cannot run tile centroids here"):      # nothing recorded: Triton, refused
        tile_centroids(k, v.detach(), 64, backend="triton")


def test_tile_stats_query_means_carry_no_gradient():
    """Mutation find: `tile_stats` detaches q (its mean only routes, and under torch.compile a q that records gradients
    made the op's outputs differentiable, with no backward); without it q_mean carried a grad_fn."""
    gen = torch.Generator().manual_seed(18)
    q = torch.randn(2, 1, 100, 12, generator=gen).requires_grad_()
    k, v = torch.randn(2, 1, 100, 12, generator=gen), torch.randn(2, 1, 100, 12, generator=gen)
    for kk in (k, k.clone().requires_grad_()):           # the plain path and the one for k recording gradients
        q_mean, k_mean, v_sum, tile_len = tile_stats(q, kk, v, 32, backend="torch")
        assert not q_mean.requires_grad and q_mean.grad_fn is None
        ref_q = torch.stack([q.detach()[:, :, s:s + 32].double().mean(2) for s in range(0, 100, 32)], 2)
        assert torch.allclose(q_mean.double(), ref_q, atol=1e-6) and tile_len.tolist() == [32, 32, 32, 4]
    assert k_mean.requires_grad


@pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="the refusal below needs the interpreter off")
def test_triton_centroids_take_head_dim_256():
    """Mutation find: the centroid kernel takes head dims up to 256 inclusive; `>= 256` refused 256 (on CUDA it then
    fell back to torch). On CPU the forced "triton" backend names why it cannot run: the head dim only past 256."""
    for D, named in ((256, False), (257, True)):
        k = torch.zeros(1, 1, 8, D)
        with pytest.raises(ValueError, match="cannot run tile centroids here") as err:
            tile_centroids(k, k, 4, backend="triton")
        assert (f"head dim {D} > 256" in str(err.value)) == named, str(err.value)


def test_centroid_ops_fake_shapes_count_the_partial_last_tile():
    """Mutation find: the fake (meta) kernels of the centroid custom ops, which torch.compile traces with, give
    ceil(S / block) tiles like the real ones; `S // block` dropped the partial last tile from the traced shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = tile_centroids_op(torch.randn(1, 2, 130, 16), torch.randn(1, 2, 130, 16), 64)
    with FakeTensorMode():
        q, k, v = (torch.empty(1, 2, 130, 16) for _ in range(3))
        fake = tile_centroids_op(k, v, 64)
        stats = tile_stats_op(q, k, v, 64)
    assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real] == [(1, 2, 3, 16), (1, 2, 3, 16), (3,)]
    assert [tuple(t.shape) for t in stats] == [(1, 2, 3, 16)] * 3 + [(3,)]
    assert [t.dtype for t in stats] == [torch.float32] * 3 + [torch.int32]
