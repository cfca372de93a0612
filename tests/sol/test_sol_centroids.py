"""Centroids: the fused Triton kernel (under the interpreter on CPU) against the torch path, and dispatch."""

import sys

import pytest
import torch

from videosparse.sol.centroids import tile_centroids, tile_centroids_torch, tile_means_torch, tile_stats

from helpers import InterpreterCases, interpreter_child, rel_err


CASES = [(dtype, S, block, D) for dtype in ("float32", "float16", "bfloat16")
         for S, block, D in ((300, 64, 64), (257, 128, 128), (128, 64, 40), (64, 64, 64))]


def _interpreter_checks() -> dict:
    """Run in a fresh interpreter with TRITON_INTERPRET=1: the Triton kernel against the torch path.

    Triton decides between compiled and interpreted kernels when a function is decorated, for its
    own standard library too, so the interpreter cannot be switched on inside a process that has
    already imported triton: these checks run as a subprocess (see `checks`).
    """
    from videosparse.sol.triton_centroids import tile_stats_triton

    torch.manual_seed(0)
    out = {}
    for dtype, S, block, D in CASES:
        B, H = 2, 3
        q, k, v = (torch.randn(B, H, S, D).to(getattr(torch, dtype)) for _ in range(3))
        q_mean, k_mean, v_sum, tile_len = tile_stats_triton(q, k, v, block)
        ref_k, ref_v, ref_len = tile_centroids_torch(k, v, block)
        ref_q = tile_means_torch(q, block)
        out[f"{dtype}-{S}-{block}-{D}"] = {
            "errors": [rel_err(got, ref) for got, ref in ((q_mean, ref_q), (k_mean, ref_k), (v_sum, ref_v))],
            "fp32": all(t.dtype == torch.float32 for t in (q_mean, k_mean, v_sum)),
            "shapes": all(a.shape == b.shape for a, b in ((q_mean, ref_q), (k_mean, ref_k), (v_sum, ref_v))),
            "tile_len": tile_len.dtype == torch.int32 and torch.equal(tile_len, ref_len),
        }
    # (B, S, H, D) viewed as (B, H, S, D): non-contiguous strides, and no q
    kk = torch.randn(2, 200, 3, 64).transpose(1, 2)
    vv = torch.randn(2, 200, 3, 64).transpose(1, 2)
    q_mean, k_mean, v_sum, _ = tile_stats_triton(None, kk, vv, 64)
    ref_k, ref_v, _ = tile_centroids_torch(kk.contiguous(), vv.contiguous(), 64)
    out["strided"] = {"q_none": q_mean is None, "contiguous_input": kk.is_contiguous(),
                      "errors": [rel_err(k_mean, ref_k), rel_err(v_sum, ref_v)]}
    bad = []
    for args in ((None, kk, vv[:, :, :199], 64), (None, kk, vv, 48)):
        try:
            tile_stats_triton(*args)
            bad.append("no error")
        except ValueError as err:
            bad.append(str(err))
    out["bad"] = bad
    # backend="triton" runs the kernel on CPU tensors under the interpreter ("auto" stays torch there), through
    # `tile_stats` and through SolConfig(backend="triton") on a tiny Wan (review find: it refused CPU tensors)
    q2, k2, v2 = (torch.randn(1, 2, 130, 64) for _ in range(3))
    forced = tile_stats(q2, k2, v2, 64, backend="triton")
    ref = (tile_means_torch(q2, 64), *tile_centroids_torch(k2, v2, 64))
    out["forced"] = {"errors": [rel_err(a, b) for a, b in zip(forced[:3], ref[:3])]}
    import videosparse
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    tr = build_tiny_wan_pipeline().transformer
    kw = dict(hidden_states=torch.randn(1, 4, 3, 16, 24), timestep=torch.tensor([500]),
              encoder_hidden_states=torch.randn(1, 8, 32))
    sol = {}
    for backend in ("reference", "triton"):
        session = videosparse.apply(tr, videosparse.SolConfig(density=0.6, dense_steps=0, block=64,
                                                              backend=backend))["transformer"]
        with torch.no_grad():
            sol[backend] = tr(**kw).sample
        sol[backend + "_kernel"] = session.stats()["kernel_backend"]
        videosparse.remove(tr)
    out["sol"] = {"rel": rel_err(sol["triton"], sol["reference"]), "kernel": sol["triton_kernel"]}
    return out


INTERPRETER_CASES = InterpreterCases(__file__, ["checks"], timeout=300)


@pytest.fixture(scope="module")
def checks(interpreter_results) -> dict:
    res = interpreter_results["checks"]
    assert "error" not in res, res["error"]
    return res


@pytest.mark.parametrize("case", [f"{d}-{S}-{b}-{D}" for d, S, b, D in CASES])
def test_triton_tile_stats_equal_torch(checks, case):
    r = checks[case]
    assert r["fp32"] and r["shapes"] and r["tile_len"]
    assert max(r["errors"]) < 1e-6, r["errors"]


def test_triton_strided_inputs_without_q(checks):
    r = checks["strided"]
    assert r["q_none"] and not r["contiguous_input"]
    assert max(r["errors"]) < 1e-6, r["errors"]


def test_forced_triton_runs_on_cpu_under_the_interpreter(checks):
    assert max(checks["forced"]["errors"]) < 1e-6
    sol = checks["sol"]
    assert sol["kernel"] == "triton_generic" and sol["rel"] < 1e-5, sol


def test_triton_rejects_bad_shapes(checks):
    shape_err, block_err = checks["bad"]
    assert "one shape" in shape_err and "power of two" in block_err


def test_tile_means_partial_last_tile():
    x = torch.arange(5.0).view(1, 1, 5, 1).expand(1, 1, 5, 2)
    m = tile_means_torch(x, 2)
    assert torch.equal(m[0, 0, :, 0], torch.tensor([0.5, 2.5, 4.0]))


def test_dispatch_on_cpu_uses_torch_and_names_reasons():
    k, v, q = (torch.randn(1, 2, 130, 64) for _ in range(3))
    got = tile_centroids(k, v, 64)
    ref = tile_centroids_torch(k, v, 64)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    q_mean, *rest = tile_stats(q, k, v, 64, backend="reference")
    assert torch.equal(q_mean, tile_means_torch(q, 64)) and all(torch.equal(a, b) for a, b in zip(rest, ref))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cannot run tile centroids here: the Triton kernels need a CUDA GPU"):
            tile_centroids(k, v, 64, backend="triton")
    with pytest.raises(ValueError, match="choose one of"):
        tile_centroids(k, v, 64, backend="cuda")
    for bad in (0, -64, 64.0, True):        # ZeroDivisionError, a view's RuntimeError, pad's TypeError before
        with pytest.raises(ValueError, match="block_n=.* must be a positive int"):
            tile_centroids(k, v, bad)
        with pytest.raises(ValueError, match="block=.* must be a positive int"):
            tile_stats(q, k, v, bad)


@pytest.mark.gpu
def test_dispatch_on_cuda_matches_torch():
    q, k, v = (torch.randn(1, 4, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    got = tile_stats(q, k, v, 64)
    ref = (tile_means_torch(q, 64), *tile_centroids_torch(k, v, 64))
    for a, b in zip(got[:3], ref[:3]):
        assert rel_err(a, b) < 1e-5
    assert torch.equal(got[3], ref[3])


if __name__ == "__main__":
    interpreter_child(sys.argv[1:], lambda name: _interpreter_checks())
