"""Helpers shared by the GPU benchmark scripts: timing, relative error, environment versions."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch


def require_cuda(script: str) -> None:
    """Exit with "<script> needs a CUDA GPU." where there is none (instead of a traceback from the first launch)."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{Path(script).name} needs a CUDA GPU.")


def bench(fn, *, warmup: int = 20, rep: int = 100) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def host_us(fn, calls: int = 20) -> float:
    """Host (Python + launch) microseconds per fn() call: `calls` calls issued back to back after a sync, without
    one between them (the GPU queue does not fill at these counts)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    per_call = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return per_call


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def versions() -> dict:
    """torch, triton, CUDA and Python versions for the JSON."""
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}
