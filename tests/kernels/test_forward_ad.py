"""Inputs no kernel serves correctly: forward-mode AD (JVPs, as continuous-time consistency distillation takes them
through the transformer), tensor subclasses, and torch.func transforms on the sparse path (review 55: the layouts'
fast gather and every kernel dropped the tangents silently, 3.3e-2 off the stock JVP at density 1; torch.func.grad
failed inside the stats counters with functorch's words).

The kernels are stood in for on the CPU by a backend with no autograd of its own and a gradient-free centroid
"kernel" (`helpers.NoAutogradBackend`, `helpers.gradient_free_centroid_kernel`), as on CUDA."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import videosparse
from videosparse.kernels import block_sparse_attention, dispatch, reference_attention
from videosparse.kernels.probe import probe_kernel
from videosparse.models.tiny_wan import build_tiny_wan_pipeline
from videosparse.sol.centroids import tile_centroids, tile_centroids_torch

from helpers import NoAutogradBackend, gradient_free_centroid_kernel, random_plan, rel_err


class CountingBackend(NoAutogradBackend):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return super().__call__(*args)


@pytest.fixture
def kernel_stand_in(monkeypatch):
    """A gradient-free backend first in the auto order and a gradient-free centroid kernel: what CUDA runs."""
    probe = CountingBackend("no_autograd_probe")
    gradient_free_centroid_kernel(monkeypatch)
    monkeypatch.setattr(dispatch, "_REGISTRY", {**dispatch._REGISTRY, probe.name: probe})
    monkeypatch.setattr(dispatch, "AUTO_ORDER", [probe.name, *dispatch.AUTO_ORDER])
    probe_kernel.cache_clear()
    yield probe
    probe_kernel.cache_clear()


@pytest.mark.parametrize("correction", [False, True])
@pytest.mark.parametrize("S, block", [(300, 64), (200, 32)])
def test_a_jvp_through_the_kernel_equals_the_one_of_the_torch_reference(kernel_stand_in, correction, S, block):
    """The tangent of out (and of the lse) under forward AD equals the JVP that reverse mode gives for the reference
    with its centroids taken from k, v (torch.autograd.functional.jvp, the double-backward trick), in fp64."""
    g = torch.Generator().manual_seed(S + correction)
    B, H, D = 2, 2, 32
    q, k, v, tq, tk, tv = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(6))
    plan = random_plan(B, H, S, block, block, 0.4, seed=S)

    def reference(q, k, v):
        p = plan.with_correction(*tile_centroids_torch(k, v, block)) if correction else plan
        return reference_attention(q, k, v, p, D ** -0.5, return_lse=True)

    (want_out, want_lse), (want_tout, want_tlse) = torch.autograd.functional.jvp(reference, (q, k, v), (tq, tk, tv))
    with fwAD.dual_level():
        qd, kd, vd = fwAD.make_dual(q, tq), fwAD.make_dual(k, tk), fwAD.make_dual(v, tv)
        p = plan.with_correction(*tile_centroids(kd, vd, block)) if correction else plan
        out, lse = block_sparse_attention(qd, kd, vd, p, return_lse=True, backend="auto")
        (out, t_out), (lse, t_lse) = fwAD.unpack_dual(out), fwAD.unpack_dual(lse)
    assert t_out is not None and t_lse is not None
    assert rel_err(out, want_out) < 1e-12 and rel_err(lse, want_lse) < 1e-12
    assert rel_err(t_out, want_tout) < 1e-10 and rel_err(t_lse, want_tlse) < 1e-10
    assert kernel_stand_in.calls == 0
    block_sparse_attention(q, k, v, plan, backend="auto")   # without tangents: the kernel (the reference is for AD)
    assert kernel_stand_in.calls == 1


def test_a_tensor_subclass_takes_the_torch_reference(kernel_stand_in):
    """Quantized activations come as tensor subclasses (optimum-quanto's W8A8): a kernel would read their storage, not
    their values (review 55). They run on the torch reference, through the subclass's own ops."""
    class Tagged(torch.Tensor):
        pass

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 200, 32, generator=g) for _ in range(3))
    plan = random_plan(1, 2, 200, 64, 64, 0.5, seed=1)
    want = reference_attention(q, k, v, plan, 32 ** -0.5)
    got = block_sparse_attention(q.as_subclass(Tagged), k, v, plan, backend="auto")
    assert kernel_stand_in.calls == 0 and torch.equal(got.as_subclass(torch.Tensor), want)
    block_sparse_attention(q, k, v, plan, backend="auto")
    assert kernel_stand_in.calls == 1


def _jvp(transformer, kwargs, tangent):
    """(output, its tangent) of the transformer's forward along `tangent` of the latents, with SDPA on its math
    backend (the CPU flash kernel has no forward AD)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with fwAD.dual_level(), sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        out = transformer(**{**kwargs, "hidden_states": fwAD.make_dual(kwargs["hidden_states"], tangent)}).sample
        primal, tan = fwAD.unpack_dual(out)
        return primal.clone(), tan.clone()


@pytest.mark.parametrize("method", ["veda", "sol"])
def test_a_jvp_through_the_sparse_transformer_equals_the_stock_one_at_density_1(kernel_stand_in, method):
    """The tiny Wan at density 1 (every tile exact) computes stock attention, so its JVP equals the stock JVP; before,
    the tile-order gather's fast view and the kernel dropped the attention's tangents (3.3e-2 off)."""
    pipe = build_tiny_wan_pipeline()
    tr = pipe.transformer
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 4, 3, 16, 24, generator=g), timestep=torch.tensor([500]),
              encoder_hidden_states=torch.randn(1, 8, 32, generator=g))
    tangent = torch.randn(kw["hidden_states"].shape, generator=g)
    want, want_tan = _jvp(tr, kw, tangent)
    config = (videosparse.VedaConfig(density=1.0, dense_steps=0, block=64, tiling=(1, 4, 16)) if method == "veda" else
              videosparse.SolConfig(tau=-1e9, band=0, dense_steps=0, block=64, tiling=(1, 4, 16)))
    session = videosparse.apply(tr, config)["transformer"]
    got, got_tan = _jvp(tr, kw, tangent)
    stats = session.stats()
    videosparse.remove(tr)
    assert stats["layers"][0]["sparse_calls"] == 1 and stats["density"] == 1.0
    assert rel_err(got, want) < 1e-5 and rel_err(got_tan, want_tan) < 1e-5


def test_a_jvp_through_the_compiled_sparse_transformer_equals_the_stock_one(kernel_stand_in):
    """Under torch.compile (Dynamo), where tangents cannot be looked at while tracing, an open dual level sends the
    calls to the torch paths too (the review of the eager fix: the kernel's custom op dropped the tangent silently,
    2.8e-2 off)."""
    torch._dynamo.reset()
    tr = build_tiny_wan_pipeline().transformer
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 4, 3, 16, 24, generator=g), timestep=torch.tensor([500]),
              encoder_hidden_states=torch.randn(1, 8, 32, generator=g))
    tangent = torch.randn(kw["hidden_states"].shape, generator=g)
    want, want_tan = _jvp(tr, kw, tangent)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, dense_steps=0, block=64, tiling=(1, 4, 16)))
    try:
        got, got_tan = _jvp(torch.compile(tr, backend="eager"), kw, tangent)
    finally:
        videosparse.remove(tr)
        torch._dynamo.reset()
    assert rel_err(got, want) < 1e-5 and rel_err(got_tan, want_tan) < 1e-5


def test_torch_func_transforms_are_refused_by_name():
    """torch.func.grad / jvp through the sparse path: a RuntimeError that names videosparse and the ways that work
    (functorch's own error named an in-place update of a captured tensor); the stock path is untouched."""
    tr = build_tiny_wan_pipeline().transformer
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 3, 16, 24, generator=g)
    text = torch.randn(1, 8, 32, generator=g)

    def loss(x):
        return tr(hidden_states=x, timestep=torch.tensor([500]), encoder_hidden_states=text).sample.square().mean()

    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, dense_steps=0, block=64, tiling=(1, 4, 16)))
    for transform in (lambda: torch.func.grad(loss)(x), lambda: torch.func.jvp(loss, (x,), (torch.ones_like(x),))):
        with pytest.raises(RuntimeError, match="does not run under torch.func transforms .*forward_ad"):
            transform()
    assert loss(x).isfinite()                       # the session still serves plain calls
    videosparse.remove(tr)
    assert torch.func.grad(loss)(x).shape == x.shape


def test_the_kernel_entry_names_grad_and_vmap_and_runs_jvp():
    """Review 59: torch.func.grad / vmap called on `block_sparse_attention` itself (no processors) failed with
    functorch's words (an autograd.Function without setup_context; a BatchedTensor's storage); torch.func.jvp runs
    there and equals forward-mode AD through the reference."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 100, 32, generator=g, dtype=torch.float64) for _ in range(3))
    plan = random_plan(1, 2, 100, 32, 32, 0.5)

    def attend(q):
        return block_sparse_attention(q, k[:1], v[:1], plan)

    with pytest.raises(RuntimeError, match=r"does not run under torch.func.grad \(vjp, jacrev\).*backward\(\)"):
        torch.func.grad(lambda q: attend(q).square().sum())(q[:1])
    with pytest.raises(RuntimeError, match=r"does not run under torch.func.vmap \(jacfwd, hessian\).*dim 0"):
        torch.func.vmap(lambda q: attend(q[None])[0])(q)
    tangent = torch.randn(q[:1].shape, generator=g, dtype=torch.float64)
    _, jvp_out = torch.func.jvp(attend, (q[:1],), (tangent,))
    _, expected = torch.func.jvp(lambda q: reference_attention(q, k[:1], v[:1], plan, q.shape[-1] ** -0.5), (q[:1],),
                                 (tangent,))
    assert rel_err(jvp_out, expected) < 1e-12
