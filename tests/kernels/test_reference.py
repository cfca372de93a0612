import re

import pytest
import torch

from videosparse.kernels import block_sparse_attention
from videosparse.plan import dense_plan
from videosparse.sol.centroids import tile_centroids_torch

from helpers import naive_attention, random_plan, rel_err


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("S,bm,bn", [(300, 64, 64), (257, 128, 128), (191, 64, 128), (128, 128, 64)])
@pytest.mark.parametrize("density", [0.2, 0.6])
def test_reference_equals_naive_masked_softmax(D, S, bm, bn, density):
    B, H = 2, 3
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(3))
    plan = random_plan(B, H, S, bm, bn, density, seed=S + D)
    out, lse = block_sparse_attention(q, k, v, plan, return_lse=True, backend="reference")
    ref = naive_attention(q, k, v, plan)
    assert rel_err(out, ref) < 1e-12
    assert lse.shape == (B, H, S) and lse.dtype == torch.float32 and torch.isfinite(lse).all()


@pytest.mark.parametrize("S,block", [(300, 64), (257, 128), (512, 128)])
def test_reference_correction_equals_mean_key_replacement(S, block):
    B, H, D = 2, 2, 64
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(3))
    plan = random_plan(B, H, S, block, block, 0.3, seed=S)
    k_mean, v_sum, tile_len = tile_centroids_torch(k, v, block)
    plan = plan.with_correction(k_mean.double(), v_sum.double(), tile_len)
    out = block_sparse_attention(q, k, v, plan, backend="reference")
    ref = naive_attention(q, k, v, plan, correction=True)
    assert rel_err(out, ref) < 1e-6   # k_mean goes through fp32 in tile_centroids_torch


@pytest.mark.parametrize("S", [256, 200])                 # whole tiles, and a partial last one
def test_strided_inputs_as_diffusers_holds_them(S):
    """q, k, v as (B, S, H, D) storage seen as (B, H, S, D): the same forward and gradients as contiguous copies."""
    g = torch.Generator().manual_seed(S)
    q, k, v = (torch.randn(2, S, 3, 64, dtype=torch.float64, generator=g).transpose(1, 2).requires_grad_()
               for _ in range(3))
    plan = random_plan(2, 3, S, 64, 64, 0.4, seed=S)
    plan = plan.with_correction(*tile_centroids_torch(k.detach(), v.detach(), 64))
    out = block_sparse_attention(q, k, v, plan, backend="reference")
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    qc, kc, vc = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    ref = block_sparse_attention(qc, kc, vc, plan, backend="reference")
    assert torch.equal(out, ref)
    for got, want in zip(grads, torch.autograd.grad(ref.square().sum(), (qc, kc, vc))):
        assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize("B,H", [(0, 2), (1, 0)])
def test_no_batch_items_or_no_heads_give_empty_outputs_and_gradients(B, H):
    q, k, v = (torch.randn(B, H, 100, 64, requires_grad=True) for _ in range(3))
    out, lse = block_sparse_attention(q, k, v, dense_plan(B, H, 100), return_lse=True, backend="reference")
    assert out.shape == q.shape and lse.shape == (B, H, 100)
    assert all(g.shape == q.shape for g in torch.autograd.grad(out.sum(), (q, k, v)))


def test_the_reference_computes_in_fp32_inside_an_autocast_region():
    """Under CPU bf16 autocast (a model trained with mixed precision) the reference's matmuls stay fp32, as its
    docstring says and as the Triton kernels compute: the same output as outside the region."""
    q, k, v = (torch.randn(1, 2, 200, 64) for _ in range(3))
    plan = random_plan(1, 2, 200, 64, 64, 0.5, seed=3)
    want = block_sparse_attention(q, k, v, plan, backend="reference")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = block_sparse_attention(q, k, v, plan, backend="reference")
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-6


def test_dense_plan_equals_sdpa_fp32_and_lse():
    B, H, S, D = 1, 2, 333, 64
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    out, lse = block_sparse_attention(q, k, v, dense_plan(B, H, S), return_lse=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert rel_err(out, ref) < 1e-5
    ref_lse = torch.logsumexp((q @ k.transpose(-1, -2)) / D**0.5, -1)
    assert (lse - ref_lse).abs().max() < 1e-4


def test_bad_inputs_are_rejected():
    q = torch.randn(1, 2, 100, 64)
    plan = dense_plan(1, 2, 100)
    with pytest.raises(ValueError, match="dtypes differ"):
        block_sparse_attention(q, q.double(), q, plan)
    with pytest.raises(ValueError, match="shape"):
        block_sparse_attention(q[0], q, q, plan)
    with pytest.raises(ValueError, match="backend"):
        block_sparse_attention(q, q, q, plan, backend="cuda-magic")
    with pytest.raises(ValueError, match="floating point"):
        block_sparse_attention(q.long(), q.long(), q.long(), plan)
    # validate=False skips only the plan's checks (host reads): q, k, v and scale are still checked
    with pytest.raises(ValueError, match="shapes do not match"):
        block_sparse_attention(q, q[:, :1], q[:, :1], plan, validate=False)
    with pytest.raises(ValueError, match="dtypes differ"):
        block_sparse_attention(q, q.half(), q.half(), plan, validate=False)
    # another head dim in k and v, or k and v on another device: named, before any kernel reads them
    with pytest.raises(ValueError, match=r"shapes do not match: q \(1, 2, 100, 64\), k \(1, 2, 100, 32\)"):
        block_sparse_attention(q, q[..., :32], q[..., :32], plan, validate=False)
    meta = q.to("meta")
    with pytest.raises(ValueError, match="q, k, v are on different devices: cpu, meta, meta"):
        block_sparse_attention(q, meta, meta, plan, validate=False)
    # a scale <= 0 too: the kernels take a row's running max as max(q.k) x scale (at -3 the Triton kernel gave NaN)
    for bad in ("0.1", float("nan"), float("inf"), torch.ones(2), 0.0, -3.0, torch.tensor(-0.125)):
        with pytest.raises(ValueError, match="scale=.* must be a finite number > 0"):
            block_sparse_attention(q, q, q, plan, scale=bad)
    ref = block_sparse_attention(q, q, q, plan, scale=0.2)
    for same in (torch.tensor(0.2), torch.tensor(0.2, dtype=torch.float64).numpy()[()]):
        assert torch.equal(block_sparse_attention(q, q, q, plan, scale=same), ref)
    k_mean, v_sum, tile_len = tile_centroids_torch(q, q, 128)
    for name in ("k_mean", "v_sum"):
        parts = dict(k_mean=k_mean, v_sum=v_sum, tile_len=tile_len)
        parts[name] = parts[name].clone()
        parts[name].view(-1)[0] = float("nan")
        bad_plan = dense_plan(1, 2, 100).with_correction(**parts)
        with pytest.raises(ValueError, match=f"{name} holds non-finite values"):
            block_sparse_attention(q, q, q, bad_plan)
    # token counts are integers, the centroids floats (review find: 0.5 or True tokens per tile passed)
    for parts, msg in (({"tile_len": tile_len.float() - 0.5}, "tile_len must be int32 or int64"),
                       ({"tile_len": tile_len.bool()}, "tile_len must be int32 or int64"),
                       ({"k_mean": k_mean.long()}, "k_mean must be a floating-point tensor")):
        bad_plan = dense_plan(1, 2, 100).with_correction(**{**dict(k_mean=k_mean, v_sum=v_sum, tile_len=tile_len),
                                                            **parts})
        with pytest.raises(ValueError, match=msg):
            block_sparse_attention(q, q, q, bad_plan)


def test_a_plan_without_index_columns_gives_empty_rows():
    """Kmax = 0 (every row empty) is a valid plan: zeros and lse -inf, on every backend (the front end gives
    the kernels one unused column to read)."""
    from videosparse.plan import Plan

    q = torch.randn(1, 2, 300, 64)
    plan = Plan(torch.zeros(1, 2, 3, 0, dtype=torch.int32), torch.zeros(1, 2, 3, dtype=torch.int32))
    out, lse = block_sparse_attention(q, q, q, plan, return_lse=True)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    # no keys at all (Sk = 0): the same, where the reference used to fail in torch.gather
    empty = torch.zeros(1, 2, 0, 64)
    out, lse = block_sparse_attention(q, empty, empty, plan, return_lse=True, backend="reference")
    assert out.shape == q.shape and bool((out == 0).all()) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("correction", [False, True])
def test_keys_that_do_not_count_carry_no_values(correction):
    """Values of keys the reference drops (past `valid_keys`, in tiles a row does not list) never reach the output,
    even as inf or NaN (0 * inf would); with the correction too (its centroids from the clean keys)."""
    from videosparse.plan import Plan

    B, H, S, D = 2, 1, 200, 64
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(3))
    index = torch.tensor([[1], [0]], dtype=torch.int32).expand(B, H, 2, 1)  # row 0 lists tile 1 only, row 1 tile 0
    plan = Plan(index.contiguous(), torch.ones(B, H, 2, dtype=torch.int32), 128, 128)
    plan = plan.with_valid_keys(torch.tensor([150, 200], dtype=torch.int32))
    if correction:
        plan = plan.with_correction(*(t.double() if t.is_floating_point() else t
                                      for t in tile_centroids_torch(k, v, 128)))
    clean = block_sparse_attention(q, k, v, plan, backend="reference")
    v_bad, k_bad = v.clone(), k.clone()
    v_bad[0, :, 150:], k_bad[0, :, 150:] = float("nan"), float("inf")   # item 0's padding
    v_bad[1, :, 3] = float("inf")                                        # tile 0 of item 1: unlisted by its row 0
    out = block_sparse_attention(q, k_bad, v_bad, plan, backend="reference", validate=False)
    assert torch.equal(out[0], clean[0]) and torch.equal(out[1, :, :128], clean[1, :, :128])


@pytest.mark.parametrize("S,block", [(300, 64), (333, 128)])
@pytest.mark.parametrize("correction", [False, True])
def test_valid_keys_equal_attention_over_each_items_key_prefix(S, block, correction):
    """`Plan.valid_keys` (a key-padding limit per batch item, as a tensor): item b attends as if its keys ended
    at valid_keys[b], i.e. exactly the plan on k[:, :, :valid_keys[b]] (partial last tile), skipped tiles past
    the limit adding nothing to the correction. Limits inside a tile, on a tile boundary, and all keys."""
    from videosparse.plan import Plan

    B, H, D = 3, 2, 64
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(3))
    limits = [S - 37, 2 * block, S]
    plan = random_plan(B, H, S, block, block, 0.5, seed=S)
    k_mean, v_sum, tile_len = (t.double() if t.is_floating_point() else t for t in tile_centroids_torch(k, v, block))
    capped = plan.with_valid_keys(torch.tensor(limits, dtype=torch.int32))
    assert bool((capped.kv_count <= plan.kv_count).all()) and bool((capped.kv_count < plan.kv_count).any())
    if correction:
        capped = capped.with_correction(k_mean, v_sum, tile_len)
    out, lse = block_sparse_attention(q, k, v, capped, return_lse=True, backend="reference")
    for b, n in enumerate(limits):
        nk = -(-n // block)
        item = Plan(capped.kv_index[b:b + 1], capped.kv_count[b:b + 1], block, block)
        if correction:   # the tiles of the prefix, centroids as given (a crossing tile is listed or corrected as is)
            item = item.with_correction(k_mean[b:b + 1, :, :nk], v_sum[b:b + 1, :, :nk], tile_len[:nk])
        want, want_lse = block_sparse_attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], item,
                                                return_lse=True, backend="reference", validate=False)
        assert rel_err(out[b:b + 1], want) < 1e-12, b
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse[b:b + 1]), finite)
        assert float((lse[b:b + 1] - want_lse)[finite].abs().max()) < 1e-6


def test_arguments_of_the_wrong_type_are_type_errors_naming_them():
    """Review find: a numpy q, a plan of None or a dict, or an int for valid_keys ended in an AttributeError from deep
    inside ('no attribute dim' / 'validate' / 'dtype'); each is a TypeError naming the argument and its type."""
    q = torch.randn(1, 2, 100, 64)
    plan = dense_plan(1, 2, 100)
    for args, match in (((q.numpy(), q, q, plan), "q must be a torch.Tensor .* got ndarray"),
                        ((q, q, [1.0], plan), "v must be a torch.Tensor .* got list"),
                        ((q, q, q, None), r"plan must be a videosparse.plan.Plan .* got NoneType"),
                        ((q, q, q, {"kv_index": plan.kv_index, "kv_count": plan.kv_count}), "got dict")):
        for validate in (True, False):
            with pytest.raises(TypeError, match=match):
                block_sparse_attention(*args, validate=validate)
    for bad in (200, [100]):
        with pytest.raises(TypeError, match=re.escape(f"valid_keys={bad!r} must be an int32 tensor [1]")):
            plan.with_valid_keys(bad)


def test_valid_keys_are_checked():
    from videosparse.plan import Plan

    q = torch.randn(2, 2, 300, 64)
    plan = dense_plan(2, 2, 300, 64, 64)
    for bad, match in ((torch.tensor([300, 0], dtype=torch.int32), r"\[1, Sk=300\]"),
                       (torch.tensor([301, 10], dtype=torch.int32), r"\[1, Sk=300\]"),
                       (torch.tensor([300], dtype=torch.int32), "int32 \\[2\\]"),
                       (torch.tensor([300, 10]), "int32 \\[2\\]")):
        with pytest.raises(ValueError, match=match):
            block_sparse_attention(q, q, q, Plan(plan.kv_index, plan.kv_count, 64, 64, valid_keys=bad))
    # listing a tile that starts past the limit is an error (with_valid_keys drops them)
    with pytest.raises(ValueError, match="past valid_keys"):
        block_sparse_attention(q, q, q, Plan(plan.kv_index, plan.kv_count, 64, 64,
                                             valid_keys=torch.tensor([300, 100], dtype=torch.int32)))
    capped = plan.with_valid_keys(torch.tensor([300, 100], dtype=torch.int32))
    assert capped.kv_count[0].eq(5).all() and capped.kv_count[1].eq(2).all()
    block_sparse_attention(q, q, q, capped)
    # the query tiles past the limit skipped too: their rows come out zero (lse -inf), the others as before
    skipped = plan.with_valid_keys(torch.tensor([300, 100], dtype=torch.int32), skip_padded_queries=True)
    assert skipped.kv_count[0].eq(5).all() and skipped.kv_count[1].tolist() == [[2, 2, 0, 0, 0]] * 2
    assert plan.order is not None and capped.order is plan.order and skipped.order is None     # rows emptied: resort
    # a limit on a tile boundary: the tile that starts at it holds no valid query either (mutation testing)
    edge = plan.with_valid_keys(torch.tensor([300, 128], dtype=torch.int32), skip_padded_queries=True)
    assert edge.kv_count[1].tolist() == [[2, 2, 0, 0, 0]] * 2
    out, lse = block_sparse_attention(q, q, q, skipped, return_lse=True)
    ref = block_sparse_attention(q, q, q, capped)
    assert torch.equal(out[1, :, :128], ref[1, :, :128]) and bool((out[1, :, 128:] == 0).all())
    assert bool(torch.isneginf(lse[1, :, 128:]).all())
    with pytest.raises(ValueError, match="int32 \\[2\\]"):
        plan.with_valid_keys(torch.tensor([3, 4, 5], dtype=torch.int32))


def _empty_rows(plan):
    """The plan with its odd query-tile rows emptied (kv_count 0)."""
    from dataclasses import replace

    count = plan.kv_count.clone()
    count[..., 1::2] = 0
    return replace(plan, kv_count=count)


@pytest.mark.parametrize("B,H,S,Sk,D,bm,bn,density,correction,valid,empty", [
    (1, 1, 100, 100, 16, 32, 32, 0.5, False, False, False),
    (2, 3, 301, 301, 32, 64, 64, 0.3, False, False, False),
    (2, 2, 257, 190, 16, 64, 32, 0.4, True, False, False),       # more queries than keys, bm != bn
    (2, 2, 300, 300, 64, 64, 64, 0.3, True, True, False),
    (2, 2, 300, 300, 16, 64, 64, 0.6, True, False, True),
])
def test_the_lean_backward_equals_autograd_through_the_reference(B, H, S, Sk, D, bm, bn, density, correction, valid,
                                                                 empty):
    """RecomputingAttention's backward (each row recomputed) gives autograd's gradients through the reference loop,
    for q, k, v and, with correction, through the centroids to k and v, from a loss on out and on lse."""
    from videosparse.kernels.dispatch import get_backend
    from videosparse.kernels.autograd import RecomputingAttention
    from videosparse.kernels.reference import reference_attention
    from videosparse.sol.centroids import tile_centroids_torch

    g = torch.Generator().manual_seed(B * 1000 + S)
    q = torch.randn(B, H, S, D, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(B, H, Sk, D, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    plan = random_plan(B, H, S, bm, bn, density, seed=S, sk=Sk)
    if empty:
        plan = _empty_rows(plan)
    if correction:
        plan = plan.with_correction(*tile_centroids_torch(k, v, bn))
    if valid:
        plan = plan.with_valid_keys(torch.tensor([Sk - 37, Sk // 2][:B], dtype=torch.int32), False)
    w_out = torch.randn(B, H, S, D, dtype=torch.float64, generator=g)
    w_lse = torch.randn(B, H, S, dtype=torch.float64, generator=g)

    def loss(out, lse):
        return (out * w_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * w_lse).sum()

    expected = torch.autograd.grad(loss(*reference_attention(q, k, v, plan, 0.3, return_lse=True)), (q, k, v),
                                   retain_graph=True)
    out, lse = RecomputingAttention.apply(q, k, v, plan.k_mean, plan.v_sum, plan, 0.3, get_backend("reference"))
    assert torch.equal(out, reference_attention(q, k, v, plan, 0.3))
    for got, want in zip(torch.autograd.grad(loss(out, lse), (q, k, v)), expected):
        assert rel_err(got, want) < 1e-12


def test_the_reference_backend_keeps_o_s_d_for_backward_and_ignores_keys_that_do_not_count():
    """Review find: gradients through backend='reference' kept every row's tiles and probabilities, 1.5 GB for one
    head pair at 8,192 tokens (Wan 1.3B at 480P: ~15 GB per layer); the backend saves q, k, v only now. Non-finite
    keys past valid_keys reach no gradient."""
    q, k, v = (torch.randn(1, 2, 2048, 64, requires_grad=True) for _ in range(3))
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block_sparse_attention(q, k, v, dense_plan(1, 2, 2048, 128, 128), backend="reference")
    assert type(out.grad_fn).__name__ == "RecomputingAttentionBackward"
    assert sum(saved.values()) <= 3 * q.numel() * 4 + 4096
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 1500:], v2[:, :, 1500:] = float("nan"), float("inf")
    k2.requires_grad_(), v2.requires_grad_()
    plan = dense_plan(1, 2, 2048, 128, 128).with_valid_keys(torch.tensor([1500], dtype=torch.int32), False)
    out, lse = block_sparse_attention(q, k2, v2, plan, backend="reference", return_lse=True)
    grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k2, v2))
    assert all(t[:, :, :1500].isfinite().all() for t in grads) and grads[0].isfinite().all()


@pytest.mark.parametrize("learned", ["k_mean", "v_sum"])
def test_one_learned_centroid_gets_its_gradient(learned):
    """Mutation find (session 66): the lean backward gated d_k_mean on v_sum's needs_input_grad, so a learned k_mean
    beside a fixed v_sum got no gradient; each alone must get autograd's through the reference loop."""
    from videosparse.kernels.reference import reference_attention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 200, 32, generator=g, dtype=torch.float64) for _ in range(3))
    k_mean, v_sum, tile_len = tile_centroids_torch(k, v, 32)
    plan = random_plan(1, 2, 200, 64, 32, 0.4, seed=5)
    grads = []
    for attend in (lambda p: block_sparse_attention(q, k, v, p, scale=0.3, backend="reference", return_lse=True),
                   lambda p: reference_attention(q, k, v, p, 0.3, return_lse=True)):
        km, vs = k_mean.clone().requires_grad_(learned == "k_mean"), v_sum.clone().requires_grad_(learned == "v_sum")
        out, lse = attend(plan.with_correction(km, vs, tile_len))
        (out.square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
        grads.append(km.grad if learned == "k_mean" else vs.grad)
    assert grads[0] is not None and rel_err(grads[0], grads[1]) < 1e-10
