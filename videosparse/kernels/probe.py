"""Can a fast backend serve a layer's attention, and which one? Asked once per shape, outside the hot path."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..plan import dense_plan
from .dispatch import select_backend


class KernelProbe(NamedTuple):
    """The backend that would run (None when none fits) and the reason to run dense instead (None: go)."""

    backend: str | None
    problem: str | None


@functools.lru_cache(maxsize=64)
def probe_kernel(backend: str, device: torch.device | str, dtype: torch.dtype, num_heads: int, head_dim: int,
                 block: int, correction: bool) -> KernelProbe:
    """Which kernel `backend` picks for these inputs, and whether the sparse path should use it.

    On CUDA, `backend="auto"` ending at the torch reference counts as a problem (it would be far
    slower than dense attention); on CPU the reference is the path. An explicit backend that cannot
    serve the inputs is a problem too.
    """
    device = torch.device(device)
    q = torch.empty(1, num_heads, block, head_dim, device=device, dtype=dtype)
    plan = dense_plan(1, num_heads, block, block, block, device=device)
    if correction:
        zeros = torch.zeros(1, num_heads, 1, head_dim, device=device, dtype=torch.float32)
        plan = plan.with_correction(zeros, zeros, torch.full((1,), block, dtype=torch.int32, device=device))
    try:
        impl = select_backend(q, q, q, plan, backend)
    except ValueError as err:
        return KernelProbe(None, str(err))
    if impl.name == "reference" and device.type == "cuda" and backend == "auto":
        return KernelProbe(impl.name, f"no fast kernel serves dtype {dtype}, head dim {head_dim} on {device}")
    return KernelProbe(impl.name, None)
