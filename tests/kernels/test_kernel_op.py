"""The custom op that makes block-sparse attention one opaque node under torch.compile."""

import pytest
import torch

from videosparse.kernels import block_sparse_attention
from videosparse.kernels.ops import block_sparse_attention_op
from videosparse.sol.centroids import tile_centroids_torch

from helpers import NoAutogradBackend, random_plan, rel_err


def test_opcheck_with_and_without_correction():
    q, k, v = (torch.randn(2, 3, 300, 64) for _ in range(3))
    p = random_plan(2, 3, 300, 64, 64, 0.3, seed=4)
    base = (q, k, v, p.kv_index, p.kv_count, 64, 64)
    torch.library.opcheck(block_sparse_attention_op, (*base, None, None, None, None, None, 0.125, "reference"))
    torch.library.opcheck(block_sparse_attention_op, (*base, *tile_centroids_torch(k, v, 64), None, None, 0.125,
                                                      "reference"))
    order = torch.randperm(p.kv_count.numel()).to(torch.int32)      # any permutation of the rows
    torch.library.opcheck(block_sparse_attention_op, (*base, None, None, None, order, None, 0.125, "reference"))
    capped = p.with_valid_keys(torch.tensor([250, 170], dtype=torch.int32))     # a key-padding limit per item
    torch.library.opcheck(block_sparse_attention_op, (q, k, v, capped.kv_index, capped.kv_count, 64, 64,
                                                      *tile_centroids_torch(k, v, 64), None, capped.valid_keys,
                                                      0.125, "reference"))


def test_fullgraph_compile_matches_eager():
    q, k, v = (torch.randn(1, 2, 333, 64) for _ in range(3))
    p = random_plan(1, 2, 333, 128, 128, 0.5, seed=5)
    p = p.with_correction(*tile_centroids_torch(k, v, 128))

    def f(q, k, v):
        return block_sparse_attention(q, k, v, p, return_lse=True, validate=False)

    out, lse = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    ref, ref_lse = f(q, k, v)
    assert rel_err(out, ref) == 0.0 and torch.equal(lse, ref_lse)
    # the default validate=True reads the plan on the host: it stands aside while Dynamo traces
    out = torch.compile(lambda q, k, v: block_sparse_attention(q, k, v, p), backend="aot_eager", fullgraph=True)(q, k, v)
    assert rel_err(out, ref) == 0.0


def test_opcheck_with_non_contiguous_q():
    """The fake implementation gives the real outputs' (contiguous) strides whatever q's are."""
    q = torch.randn(2, 300, 3, 64).transpose(1, 2)
    k, v = (torch.randn(2, 3, 300, 64) for _ in range(2))
    p = random_plan(2, 3, 300, 64, 64, 0.3, seed=6)
    torch.library.opcheck(block_sparse_attention_op, (q, k, v, p.kv_index, p.kv_count, 64, 64, None, None, None,
                                                      None, None, 0.125, "reference"),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.fixture
def forward_only_backend():
    """A registered non-reference backend (like the Triton ones: no autograd inside), removed afterwards."""
    from videosparse.kernels import dispatch

    dispatch.register_backend("forward_only_probe", NoAutogradBackend("forward_only_probe"), before=None)
    yield "forward_only_probe"
    dispatch._REGISTRY.pop("forward_only_probe")
    dispatch.AUTO_ORDER.remove("forward_only_probe")


@pytest.mark.parametrize("correction", [False, True])
def test_a_kernel_without_a_backward_trains_with_the_reference_backward(forward_only_backend, correction):
    """A backend with no autograd of its own (the Triton / Gluon kernels) takes the reference's row-recomputing
    backward: a loss on out and lse gives the reference backend's gradients exactly (the backward reads q, k, v and
    the plan only), the correction's through the centroids to k and v included. It raised before (forward-only)."""
    g = torch.Generator().manual_seed(7)
    base = [torch.randn(2, 2, 200, 64, generator=g) for _ in range(3)]
    w = torch.randn(2, 2, 200, 64, generator=g)
    p = random_plan(2, 2, 200, 64, 64, 0.5, seed=7).with_valid_keys(torch.tensor([200, 150], dtype=torch.int32))
    grads = {}
    for backend in (forward_only_backend, "reference"):
        q, k, v = (t.clone().requires_grad_() for t in base)
        plan = p.with_correction(*tile_centroids_torch(k, v, 64)) if correction else p
        out, lse = block_sparse_attention(q, k, v, plan, backend=backend, return_lse=True)
        assert type(out.grad_fn).__name__ == "RecomputingAttentionBackward"
        ((out * w).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
        grads[backend] = [t.grad for t in (q, k, v)]
    for got, want in zip(grads[forward_only_backend], grads["reference"]):
        assert torch.equal(got, want)
    if correction:                  # the centroid terms reached k and v: without them the gradients differ
        q, k, v = (t.clone().requires_grad_() for t in base)
        plan = p.with_correction(*tile_centroids_torch(k.detach(), v.detach(), 64))
        out, lse = block_sparse_attention(q, k, v, plan, backend=forward_only_backend, return_lse=True)
        ((out * w).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
        assert rel_err(v.grad, grads["reference"][2]) > 1e-3
    q, k, v = (t.clone().requires_grad_() for t in base)
    with torch.no_grad():
        assert not block_sparse_attention(q, k, v, p, backend=forward_only_backend).requires_grad


def test_centroids_alone_requiring_grad_get_gradients_through_a_kernel(forward_only_backend):
    """Frozen q, k, v with learned centroids (only k_mean / v_sum require grad): a backend without autograd of its
    own still records the call and gives the reference backend's centroid gradients (mutation testing: checking only
    q, k, v for requires_grad left the output without a grad_fn, and backward raised)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=g) for _ in range(3))
    k_mean, v_sum, tile_len = tile_centroids_torch(k, v, 64)
    p = random_plan(1, 2, 256, 64, 64, 0.3, seed=3)
    grads = {}
    for backend in (forward_only_backend, "reference"):
        km, vs = k_mean.clone().requires_grad_(), v_sum.clone().requires_grad_()
        out = block_sparse_attention(q, k, v, p.with_correction(km, vs, tile_len), backend=backend)
        assert out.requires_grad
        out.square().sum().backward()
        grads[backend] = (km.grad, vs.grad)
    for got, want in zip(grads[forward_only_backend], grads["reference"]):
        assert got is not None and rel_err(got, want) < 1e-6


@pytest.mark.parametrize("backend,correction", [("reference", True), ("auto", True), ("reference", False),
                                                ("forward_only_probe", True)])
def test_gradients_through_the_op_under_compile(backend, correction, request):
    """The reference's row-recomputing backward is the op's backward under torch.compile (it raised before, so a
    compiled training step could not run sparse), also where a backend without autograd (a kernel) ran the forward;
    the op passes opcheck's autograd checks with gradients, with and without correction (review find: without, its
    two empty centroid gradients were one tensor, which a custom op may not return twice)."""
    if backend == "forward_only_probe":
        request.getfixturevalue("forward_only_backend")
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 333, 64, generator=g, requires_grad=True) for _ in range(3))
    p = random_plan(2, 2, 333, 128, 128, 0.5, seed=5).with_valid_keys(torch.tensor([333, 200], dtype=torch.int32))

    def f(q, k, v):
        plan = p.with_correction(*tile_centroids_torch(k, v, 128)) if correction else p
        out, lse = block_sparse_attention(q, k, v, plan, return_lse=True, validate=False, backend=backend, scale=0.3)
        return out.square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()

    # a scale of the caller's (not 1/sqrt(D)): the op's backward must take it (mutation testing: it survived)
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-5
    km, vs, tl = tile_centroids_torch(k.detach(), v.detach(), 128) if correction else (None, None, None)
    torch.library.opcheck(block_sparse_attention_op, (q, k, v, p.kv_index, p.kv_count, 128, 128,
                                                      km.requires_grad_() if correction else None,
                                                      vs.requires_grad_() if correction else None, tl, None,
                                                      p.valid_keys, 0.125, backend))


def test_a_float_scale_traces_under_compile_with_dynamic_floats():
    """torch 2.13 traces Python floats as SymFloat (specialize_float=False): `scale` passes through unchecked there
    (the eager check of a finite number would break a fullgraph compile)."""
    from videosparse.plan import dense_plan

    def attend(q, k, v, scale):
        return block_sparse_attention(q, k, v, dense_plan(1, 2, 70, key_len=75), scale=scale, backend="reference",
                                      validate=False)

    q, k, v = torch.randn(1, 2, 70, 32), torch.randn(1, 2, 75, 32), torch.randn(1, 2, 75, 32)
    torch._dynamo.reset()
    compiled = torch.compile(attend, dynamic=True, fullgraph=True, backend="aot_eager")
    for scale in (0.2, 0.3):
        assert torch.allclose(compiled(q, k, v, scale), attend(q, k, v, scale), atol=1e-6)


def test_the_generic_kernel_on_cpu_without_the_interpreter_names_only_the_interpreter():
    """Review find: besides the missing interpreter it also called fp32 unsupported, which it is not there."""
    from videosparse.kernels import triton_generic
    from videosparse.plan import dense_plan

    if triton_generic.INTERPRETED:
        pytest.skip("this process runs the Triton interpreter")
    q = torch.randn(1, 1, 200, 64)
    why = " ".join(triton_generic.GenericBackend().not_supported_reasons(q, q, q, dense_plan(1, 1, 200, 64, 64)))
    assert "TRITON_INTERPRET=1" in why and "dtype" not in why, why


@pytest.mark.parametrize("correction", [False, True])
def test_a_backward_called_under_autocast_gives_the_gradients_of_one_called_outside(correction):
    """Training loops often call backward inside `torch.autocast`: the reference's backward ran its products in bf16
    there, and its fp32 sums raised on the bf16 terms (review find, through a tiny Wan training step)."""
    g = torch.Generator().manual_seed(4)
    base = [torch.randn(1, 2, 200, 64, generator=g).bfloat16() for _ in range(3)]
    p = random_plan(1, 2, 200, 64, 64, 0.5, seed=4)
    grads = []
    for inside in (False, True):
        q, k, v = (t.clone().requires_grad_() for t in base)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plan = p.with_correction(*tile_centroids_torch(k, v, 64)) if correction else p
            loss = block_sparse_attention(q, k, v, plan, backend="reference").float().square().sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append([t.grad for t in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_the_op_called_directly_takes_a_plan_without_index_columns():
    """Review find: the op itself (not the public function) gave the Triton kernels a plan with Kmax = 0, whose first
    index they read out of bounds (a segfault under the interpreter). In a child process: the interpreter is read at
    import."""
    import subprocess
    import sys

    code = """
import torch
from videosparse.kernels.ops import block_sparse_attention_op
q = k = v = torch.randn(1, 2, 40, 64)
out, lse = block_sparse_attention_op(q, k, v, torch.zeros(1, 2, 2, 0, dtype=torch.int32),
                                     torch.zeros(1, 2, 2, dtype=torch.int32), 32, 32, None, None, None, None, None,
                                     0.125, "triton")
assert out.abs().max() == 0 and torch.isneginf(lse).all()
print("ok")
"""
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_sol_plan_path_compiles_with_gradients_on_q_alone():
    """Review find: with only q recording gradients (LoRA on to_q alone), torch.compile took the centroid op (no
    backward) and marked its outputs differentiable; the correction's backward then ran into it. q_mean only routes:
    it is detached."""
    from videosparse.sol.centroids import tile_stats
    from videosparse.sol.threshold import calibrate_tau, routing_zscores, sol_plan_from_zscores

    def step(q, k, v):
        q_mean, k_mean, v_sum, tile_len = tile_stats(q, k, v, 32)
        z = routing_zscores(q_mean, k_mean, 1 / 8, 1)
        tau, _ = calibrate_tau(z, 0.5, 0)
        plan = sol_plan_from_zscores(z, tau, 0, 32, width=z.shape[-1]).with_correction(k_mean, v_sum, tile_len)
        return block_sparse_attention(q, k, v, plan, validate=False).square().sum()

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 96, 64, generator=g, requires_grad=True)
    k, v = torch.randn(1, 2, 96, 64, generator=g), torch.randn(1, 2, 96, 64, generator=g)
    step(q, k, v).backward()
    eager, q.grad = q.grad.clone(), None
    torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v).backward()
    torch.testing.assert_close(q.grad, eager)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_op_keeps_no_out_or_lse_for_the_reference_backward(compiled):
    """The reference's row-recomputing backward reads q, k, v and the plan only: the op keeps no out (the size of
    q) and lse for it, eagerly or compiled, and its gradients stay the reference backend's."""
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(1, 2, 1024, 64, generator=g) for _ in range(3)]
    p = random_plan(1, 2, 1024, 128, 128, 0.5, seed=3)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def f(q, k, v):
        out, lse = block_sparse_attention(q, k, v, p, return_lse=True, validate=False, backend="reference")
        return out.sum() + lse.sum()       # saves neither for its own backward

    leaves = [t.clone().requires_grad_() for t in base]
    want = torch.autograd.grad(f(*leaves), leaves)
    q, k, v = (t.detach().clone().requires_grad_() for t in base)
    torch._dynamo.reset()
    run = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run(q, k, v)
    # q, k, v and the plan's index tensors; out would add q's size again (lse, 8 KB, fits under the slack)
    assert sum(saved.values()) < 4 * q.numel() * 4
    for got, w in zip(torch.autograd.grad(loss, (q, k, v)), want):
        assert rel_err(got, w) < 1e-5


@pytest.mark.parametrize("correction", [False, True])
def test_the_plan_is_kept_through_the_saved_tensor_hooks(correction):
    """Review 55: the eager autograd Function kept the plan (index, count, centroids, order) as a ctx attribute, out
    of reach of the saved-tensor hooks that activation checkpointing (and `save_on_cpu`) use to drop or move what a
    backward keeps: it stayed alive between the forward and its backward. Every plan tensor goes through them now,
    and the gradients are unchanged."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 300, 32, generator=g, requires_grad=True) for _ in range(3))
    base = random_plan(1, 2, 300, 64, 64, 0.5, seed=4)

    def loss_of():
        plan = base.with_correction(*tile_centroids_torch(k, v, 64)) if correction else base
        return block_sparse_attention(q, k, v, plan, backend="reference").square().sum(), plan

    want = torch.autograd.grad(loss_of()[0], (q, k, v))
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t.clone(), lambda t: t):
        loss, plan = loss_of()
    kept = {t.untyped_storage().data_ptr() for t in packed}
    names = ["kv_index", "kv_count"] + (["k_mean", "v_sum", "tile_len"] if correction else [])
    for name in names:
        assert getattr(plan, name).untyped_storage().data_ptr() in kept, name
    for got, w in zip(torch.autograd.grad(loss, (q, k, v)), want):
        assert torch.equal(got, w)


@pytest.mark.parametrize("path", ["eager", "op"])
def test_a_second_derivative_is_refused_not_silently_incomplete(path):
    """Review find: a gradient penalty, `autograd.grad(penalty, k)` after `autograd.grad(loss, q, create_graph=True)`,
    returned None for k (0.77 off the stock model's parameter gradients on a tiny Wan) without an error: the
    gradients are computed outside autograd, and `once_differentiable` raised only where the second pass ran through
    its error node. Any backward with create_graph=True now raises, naming videosparse (under torch.compile
    AOTAutograd refuses double backward itself, before videosparse's backward runs)."""
    from videosparse.kernels.ops import run_op

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 200, 32, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    p = random_plan(1, 2, 200, 64, 64, 0.5, seed=2)

    def loss(q, k, v):
        if path == "op":
            return run_op(q, k, v, p, 0.17, "reference")[0].square().sum()
        return block_sparse_attention(q, k, v, p, backend="reference").square().sum()

    with pytest.raises(RuntimeError, match="videosparse's block-sparse attention is not twice differentiable"):
        gq, = torch.autograd.grad(loss(q, k, v), q, create_graph=True)
        torch.autograd.grad(gq.square().sum(), k)
    assert torch.autograd.grad(loss(q, k, v), q)[0].shape == q.shape       # a first derivative as before


def test_q_in_the_heads_last_layout_is_named_in_the_error():
    """Review 59: q, k, v given as (B, S, H, D) (diffusers' dispatch layout) failed with a kv_index shape message that
    did not say the layout the kernel takes."""
    from videosparse.plan import dense_plan

    q = torch.randn(1, 256, 2, 64)
    with pytest.raises(ValueError, match=r"q looks like \(B, S, H, D\): pass q.transpose\(1, 2\)"):
        block_sparse_attention(q, q, q, dense_plan(1, 2, 256))
    with pytest.raises(ValueError, match=r"q, k, v are \(B, H, S, D\)\.$"):        # another mismatch: no such hint
        block_sparse_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), dense_plan(1, 3, 256))


def test_a_plan_of_other_shapes_is_refused_with_validate_off_and_under_compile():
    """Review 54: with validate=False, and under torch.compile (where validate is skipped), no plan check ran: a plan
    built for another batch, length or head count (or an order of another length, centroids of another shape) made
    the Triton kernel write past its output (a crash in the interpreter) or leave rows unwritten. The metadata checks
    (`Plan.check_structure`) run on every call."""
    import dataclasses

    from videosparse.plan import dense_plan

    q, k, v = (torch.randn(1, 2, 100, 64) for _ in range(3))
    k_mean, v_sum, tile_len = tile_centroids_torch(k, v, 32)
    right = dense_plan(1, 2, 100, 32, 32)
    wrong = {"batch": (dense_plan(2, 2, 100, 32, 32), "kv_index has shape (2, 2, 4, 4); expected (1, 2, 4, Kmax)"),
             "length": (dense_plan(1, 2, 200, 32, 32), "expected (1, 2, 4, Kmax)"),
             "heads": (dense_plan(1, 1, 100, 32, 32), "expected (1, 2, 4, Kmax)"),
             "order": (dataclasses.replace(right, order=right.order[:-1]), "order must be int32 [8]"),
             "centroids": (right.with_correction(k_mean[:, :1], v_sum[:, :1], tile_len),
                           "k_mean has shape (1, 1, 4, 64); expected (1, 2, 4, 64)")}
    compiled = torch.compile(lambda q, k, v, plan: block_sparse_attention(q, k, v, plan, backend="reference"),
                             backend="aot_eager", fullgraph=True)
    for plan, msg in wrong.values():
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            block_sparse_attention(q, k, v, plan, backend="reference", validate=False)
        with pytest.raises(ValueError, match="compiled call"):
            compiled(q, k, v, plan)
    torch.testing.assert_close(compiled(q, k, v, right), block_sparse_attention(q, k, v, right, validate=False))


def test_a_plan_for_other_query_tiles_is_not_taken_for_the_heads_last_layout():
    """Mutation find: the (B, S, H, D) hint needs the plan's dim 1 to match q's dim 2 *and* differ from q's heads; a
    q with as many tokens as heads and a plan of the right heads but other query tiles got the transpose hint."""
    from videosparse.plan import dense_plan

    q = torch.randn(1, 4, 4, 64)                   # B, H, S = 1, 4, 4: one query tile, the plan has 2
    with pytest.raises(ValueError, match=r"kv_index has shape \(1, 4, 2, 2\); .* q, k, v are \(B, H, S, D\)\.$"):
        block_sparse_attention(q, q, q, dense_plan(1, 4, 256))


def test_auto_on_the_cpu_says_nothing_of_the_gpu_reference(caplog):
    """Mutation find: the note that "auto" found no kernel is for a GPU (on the CPU the reference is the path, not a
    fallback); dropping the q.is_cuda check said it on every CPU call."""
    import logging

    from videosparse.kernels import _REFERENCE_ON_CUDA_NOTED

    _REFERENCE_ON_CUDA_NOTED.clear()
    q, k, v = (torch.randn(1, 2, 300, 64) for _ in range(3))
    with caplog.at_level(logging.WARNING, logger="videosparse.kernels"):
        block_sparse_attention(q, k, v, random_plan(1, 2, 300, 128, 128, 0.5))
    assert not [r for r in caplog.records if "found no kernel" in r.getMessage()]
    assert not _REFERENCE_ON_CUDA_NOTED


def test_the_reference_on_gpu_note_is_said_once_per_head_dim(caplog):
    """Mutation find: the note is once per (dtype, head dim, tiles); a key without the head dim said nothing for a
    second head dim (the GPU test uses one). The helper is called directly: it only formats and remembers."""
    import logging

    from videosparse.kernels import _REFERENCE_ON_CUDA_NOTED, _note_reference_on_cuda

    _REFERENCE_ON_CUDA_NOTED.clear()
    plan = random_plan(1, 2, 300, 128, 128, 0.5)
    with caplog.at_level(logging.WARNING, logger="videosparse.kernels"):
        for D in (64, 64, 192, 64, 192):
            _note_reference_on_cuda(torch.randn(1, 2, 300, D), plan)
    said = [r.getMessage() for r in caplog.records if "found no kernel" in r.getMessage()]
    assert len(said) == 2 and "head dim 64, 128x128" in said[0] and "head dim 192, 128x128" in said[1], said
    _REFERENCE_ON_CUDA_NOTED.clear()
