"""`videosparse._helper_backend.use_triton` for tensors on a GPU, where the choice between Triton and torch is made
(on this CPU test machine a stand-in with `is_cuda` and `device` is enough: that is all the choice reads), and the
parsing of TRITON_INTERPRET."""

import sys
import types

import pytest
import torch

from videosparse._helper_backend import interpreting, triton_unavailable, use_triton
from videosparse.sol.centroids import CENTROID_BACKENDS

ON_GPU = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))


@pytest.fixture
def triton_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))


def test_triton_runs_on_a_gpu_unless_a_reason_or_the_backend_rules_it_out(triton_installed):
    assert use_triton(ON_GPU, "auto", what="x") is True
    assert use_triton(ON_GPU, "triton", what="x") is True
    # a limit of the kernel (head dim, block, strides): 'auto' falls back to torch, 'triton' names it
    assert use_triton(ON_GPU, "auto", ["head dim 6"], what="x") is False
    with pytest.raises(ValueError, match=r"^backend='triton' cannot run x here: head dim 6; use 'auto' or 'torch'"):
        use_triton(ON_GPU, "triton", ["head dim 6"], what="x")
    # 'torch', and 'reference' where the helper takes it, never run Triton
    assert use_triton(ON_GPU, "torch", what="x") is False
    assert use_triton(ON_GPU, "reference", what="tile centroids", backends=CENTROID_BACKENDS) is False
    with pytest.raises(ValueError, match=r"^backend='reference' is not supported for x; choose one of "):
        use_triton(ON_GPU, "reference", what="x")


def test_a_missing_triton_falls_back_to_torch_or_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)          # `import triton` raises ImportError
    assert use_triton(ON_GPU, "auto", what="x") is False
    with pytest.raises(ValueError, match=r"cannot run x here: triton is not installed \(pip install triton\)"):
        use_triton(ON_GPU, "triton", what="x")


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("0", False), ("", False), (None, False)])
def test_triton_interpret_is_on_for_any_value_but_empty_and_0(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() is on
    assert (triton_unavailable("cpu") is None) is on
    assert triton_unavailable(torch.device("cuda")) is None
