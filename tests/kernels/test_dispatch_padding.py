"""Head dims the Triton kernels do not take run zero-padded (`dispatch.PaddedHeadDim`): the padding itself, on CPU with
the reference as the inner backend (the Triton kernels under it: interpreter cases in test_triton_interpreter.py and
GPU cases in test_gpu_kernels.py)."""

import pytest
import torch

from helpers import random_plan, rel_err
from videosparse.kernels import reference_attention, select_backend
from videosparse.kernels.dispatch import PaddedHeadDim, get_backend
from videosparse.sol.centroids import tile_centroids_torch


@pytest.mark.parametrize("D,target,correction", [(96, 128, True), (80, 128, False), (48, 64, True)])
def test_padded_run_equals_the_unpadded_one(D, target, correction):
    g = torch.Generator().manual_seed(D)
    q, k, v = (torch.randn(2, 3, 200, D, generator=g, dtype=torch.float64) for _ in range(3))
    plan = random_plan(2, 3, 200, 64, 64, 0.4, seed=D)
    if correction:
        plan = plan.with_correction(*tile_centroids_torch(k, v, 64))
    padded = PaddedHeadDim(get_backend("reference"), target)
    assert padded.name == f"reference+pad{target}"
    out, lse = padded(q, k, v, plan, D ** -0.5, True)
    ref, ref_lse = reference_attention(q, k, v, plan, D ** -0.5, return_lse=True)
    assert out.shape == q.shape and rel_err(out, ref) < 1e-12
    assert torch.allclose(lse, ref_lse, atol=1e-12)
    assert rel_err(padded(q, k, v, plan, D ** -0.5, False), ref) < 1e-12


def test_auto_on_cpu_keeps_the_reference_for_any_head_dim():
    q = torch.randn(1, 2, 100, 96)
    assert select_backend(q, q, q, random_plan(1, 2, 100, 64, 64, 0.5)).name == "reference"


def test_a_backend_module_without_the_named_object_counts_as_unavailable(monkeypatch):
    """A registered "module:attr" whose import raises AttributeError (e.g. a Triton whose Gluon lacks a name the
    kernel module reads at import) is a backend that cannot run, not a crash of every dispatch."""
    from videosparse.kernels import dispatch

    monkeypatch.setitem(dispatch._REGISTRY, "gone", "videosparse.kernels.dispatch:NO_SUCH_BACKEND")
    assert get_backend("gone") is None


def test_the_triton_hopper_kernel_runs_by_name_only(monkeypatch):
    """Preempted (another process on the GPU), the Triton Hopper kernel's automatic warp specialization gave NaN rows
    on the H200 (scripts/probe_preemption.py): auto never takes it, "triton" takes it after the generic kernel (which
    accepts all it does), and its name still reaches it, with one warning per process."""
    import warnings

    from videosparse.kernels import dispatch, triton_hopper

    assert "hopper" not in dispatch.AUTO_ORDER
    assert dispatch.AUTO_ORDER.index("gluon_hopper") < dispatch.AUTO_ORDER.index("triton_generic")
    assert dispatch.TRITON_BACKENDS.index("triton_generic") < dispatch.TRITON_BACKENDS.index("hopper")
    monkeypatch.setattr(triton_hopper, "INTERPRETED", False)
    monkeypatch.setattr(triton_hopper.HopperBackend, "warned", False)
    monkeypatch.setattr(triton_hopper, "hopper_attention", lambda *args: "hopper ran")
    with pytest.warns(RuntimeWarning, match="returns NaN rows when the GPU preempts it"):
        assert get_backend("hopper")(None, None, None, None, 0.1, False) == "hopper ran"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_backend("hopper")(None, None, None, None, 0.1, False) == "hopper ran"


def test_register_backend_by_name_only(monkeypatch):
    from videosparse.kernels import dispatch

    monkeypatch.setattr(dispatch, "AUTO_ORDER", list(dispatch.AUTO_ORDER))
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    dispatch.register_backend("named_only", get_backend("reference"), auto=False)
    assert "named_only" not in dispatch.AUTO_ORDER
    q = torch.randn(1, 1, 10, 8)
    assert select_backend(q, q, q, random_plan(1, 1, 10, 64, 64, 1.0), "named_only").name == "reference"
    dispatch.register_backend("named_only", get_backend("reference"))      # registered again for auto: it joins
    assert dispatch.AUTO_ORDER.index("named_only") == dispatch.AUTO_ORDER.index("reference") - 1


def test_auto_pads_a_head_dim_only_for_backends_in_its_own_order(monkeypatch):
    """On CUDA, `auto` runs a head dim the kernels do not take zero-padded on one of its own Triton backends; a
    backend registered by name only ("hopper", which returned NaN rows under preemption on the H200) stays out,
    padded or not (mutation testing: taking any Triton backend survived). Fakes stand in for CUDA tensors here."""
    import types

    from videosparse.kernels import dispatch
    from videosparse.plan import dense_plan

    class FakeCuda:                  # shape and device of a CUDA tensor: all that the choice reads
        shape = (1, 2, 100, 96)
        device = types.SimpleNamespace(type="cuda")

        def new_empty(self, *size):
            return types.SimpleNamespace(shape=size, device=self.device)

    class Fake:
        def __init__(self, name, takes_d128):
            self.name, self.takes_d128 = name, takes_d128

        def not_supported_reasons(self, q, k, v, plan):
            return [] if self.takes_d128 and q.shape[-1] == 128 else ["head dim"]

    monkeypatch.setitem(dispatch._REGISTRY, "in_auto", Fake("in_auto", False))
    monkeypatch.setitem(dispatch._REGISTRY, "by_name_only", Fake("by_name_only", True))
    monkeypatch.setattr(dispatch, "AUTO_ORDER", ["in_auto", "reference"])
    monkeypatch.setattr(dispatch, "TRITON_BACKENDS", ["in_auto", "by_name_only"])
    q = FakeCuda()
    assert dispatch.select_backend(q, q, q, dense_plan(1, 2, 100)).name == "reference"
    assert dispatch.select_backend(q, q, q, dense_plan(1, 2, 100), backend="triton").name == "by_name_only+pad128"
    monkeypatch.setitem(dispatch._REGISTRY, "in_auto", Fake("in_auto", True))
    assert dispatch.select_backend(q, q, q, dense_plan(1, 2, 100)).name == "in_auto+pad128"
