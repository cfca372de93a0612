"""Triton or torch for the helper kernels: TripPool and the teacher heat (veda), the tile centroids (sol) and the
fused RoPE gather (rope).

Each helper takes a backend from `HELPER_BACKENDS`: "auto" (Triton on CUDA where it fits, torch elsewhere), "triton"
(also on CPU tensors under TRITON_INTERPRET=1; a ValueError listing the reasons where it cannot run) or "torch".
`helper_backend` maps a config's attention backend to the helpers' one, the same for every method. Imports only torch
(triton only to ask whether it is installed), so the layers below the kernels can use it.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

HELPER_BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """TRITON_INTERPRET is set (Triton then runs kernels on CPU tensors in its interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def helper_backend(config_backend: str) -> str:
    """The helper kernels' backend for a config's attention backend (`videosparse.config.BACKENDS`): "reference" ->
    "torch" (the whole call in torch), "triton" -> "triton" (Triton throughout, or an error saying why not), anything
    else ("auto", or one attention kernel named alone) -> "auto"."""
    return {"reference": "torch", "triton": "triton"}.get(config_backend, "auto")


def triton_unavailable(device: torch.device | str) -> str | None:
    """Why the Triton helper kernels cannot run on `device`, or None when they can (CUDA, or any device under
    TRITON_INTERPRET=1)."""
    if torch.device(device).type == "cuda" or interpreting():
        return None
    return (f"the Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 set before videosparse is imported "
            f"(fp16 / bf16 on CPU); the tensors are on {device}")


def check_backend(backend: str, what: str, backends: Sequence[str] = HELPER_BACKENDS) -> None:
    """ValueError naming `backend` and the choices unless it is one of `backends`."""
    if backend not in backends:
        raise ValueError(f"backend={backend!r} is not supported for {what}; choose one of {tuple(backends)}.")


def use_triton(x: torch.Tensor, backend: str, reasons: Sequence[str] = (), *, what: str,
               backends: Sequence[str] = HELPER_BACKENDS) -> bool:
    """Whether the Triton kernel computing `what` runs on `x` under `backend`.

    Args:
        x: an input tensor (its device decides).
        backend: one of `backends`; "torch" (and "reference" where `backends` has it) never runs Triton.
        reasons: why this kernel cannot take these inputs (its own limits: head dim, block, strides, ...).
        what: the computation, for the error ("tile centroids").
        backends: the backend names this helper takes.

    Returns:
        True for Triton; False for torch ("auto" where a reason, the device or a missing triton rules Triton out).

    Raises:
        ValueError: a backend not in `backends`, or "triton" where it cannot run (every reason named).
    """
    check_backend(backend, what, backends)
    if backend in ("torch", "reference"):
        return False
    reasons = list(reasons)
    device = triton_unavailable(x.device) if backend == "triton" else (
        None if x.is_cuda else f"the tensors are on {x.device}; 'auto' runs Triton on CUDA only")
    if device:
        reasons.insert(0, device)
    if not reasons:
        try:
            import triton  # noqa: F401
        except ImportError:
            reasons.append("triton is not installed (pip install triton)")
    if reasons and backend == "triton":
        raise ValueError(f"backend='triton' cannot run {what} here: {'; '.join(reasons)}; use 'auto' or 'torch' there.")
    return not reasons
