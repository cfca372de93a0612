"""Backend selection for `block_sparse_attention` (xformers-style: each backend gives reasons).

Every backend declares what it supports through `not_supported_reasons(q, k, v, plan) -> list[str]`.
`backend="auto"` takes the first backend in `AUTO_ORDER` with no reasons (on CPU tensors it skips the
Triton backends: the interpreter is for tests); `"triton"` takes the first Triton backend with none;
`"reference"` forces the torch reference. When nothing fits, the error lists every backend's reasons. A head dim
the Triton kernels do not take (96, 80, ...) runs on one of them zero-padded to the next one they do
(`PaddedHeadDim`), on CUDA under "auto" and anywhere under "triton", before the reference would be chosen.
Triton modules are imported lazily, so the package imports without Triton.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch

from ..plan import Plan
from .reference import reference_attention


class Backend(Protocol):
    name: str

    def not_supported_reasons(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan) -> list[str]: ...

    def __call__(self, q, k, v, plan: Plan, scale: float, return_lse: bool): ...


@dataclass(frozen=True)
class _ReferenceBackend:
    name: str = "reference"

    def not_supported_reasons(self, q, k, v, plan) -> list[str]:
        return []

    def __call__(self, q, k, v, plan, scale, return_lse):
        return reference_attention(q, k, v, plan, scale, return_lse)


KERNEL_HEAD_DIMS = (64, 128)    # head dims the Triton kernels take; others below 128 run zero-padded to the next


@dataclass(frozen=True)
class PaddedHeadDim:
    """A Triton backend run on q, k, v zero-padded along the head dim to `head_dim`, for head dims the kernels do not
    take (Allegro's 96): the pad adds nothing to q.k, so scores, softmax and LSE are those of the real head dim (the
    caller's scale, 1/sqrt(real D) by default), and the output's pad columns (zero) are dropped. Costs the pad's
    copies and (head_dim / D - 1) more tensor work."""

    inner: Backend
    head_dim: int

    @property
    def name(self) -> str:
        return f"{self.inner.name}+pad{self.head_dim}"

    def not_supported_reasons(self, q, k, v, plan) -> list[str]:
        return self.inner.not_supported_reasons(*(padded_stand_in(x, self.head_dim) for x in (q, k, v)), plan)

    def __call__(self, q, k, v, plan, scale, return_lse):
        D = q.shape[-1]
        pad = (0, self.head_dim - D)
        q, k, v = (torch.nn.functional.pad(x, pad) for x in (q, k, v))
        result = self.inner(q, k, v, padded_centroids(plan, pad), scale, return_lse)
        if return_lse:
            return result[0][..., :D], result[1]
        return result[..., :D]


def padded_centroids(plan: Plan, pad: tuple[int, int]) -> Plan:
    """The plan with its correction centroids zero-padded along the head dim (`pad` as `torch.nn.functional.pad`
    takes it); a plan without correction as it is."""
    if not plan.has_correction:
        return plan
    return plan.with_correction(torch.nn.functional.pad(plan.k_mean, pad), torch.nn.functional.pad(plan.v_sum, pad),
                                plan.tile_len)


def padded_stand_in(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A small contiguous tensor like x with the padded head dim, for a backend's `not_supported_reasons` (they look
    at device, dtype, head dim and contiguity, not at the length: a limit on the length reads it from the plan)."""
    return x.new_empty(1, 1, 1, head_dim)


# name -> "module:attribute" of a Backend instance (imported on first use) or the instance itself.
_REGISTRY: dict[str, object] = {"reference": _ReferenceBackend()}
AUTO_ORDER: list[str] = ["reference"]
TRITON_BACKENDS: list[str] = []


def register_backend(name: str, target: str | Backend, *, before: str | None = "reference", triton: bool = False,
                     auto: bool = True) -> None:
    """Register a backend under `name` (an instance, or "module:attr" imported lazily).

    It is inserted in the auto order before `before` (None appends); with auto=False only its name (and, with
    triton=True, `backend="triton"` after the Triton backends registered before it) reaches it.
    """
    _REGISTRY[name] = target
    if name in AUTO_ORDER:
        AUTO_ORDER.remove(name)
    if auto:
        AUTO_ORDER.insert(AUTO_ORDER.index(before) if before in AUTO_ORDER else len(AUTO_ORDER), name)
    if triton and name not in TRITON_BACKENDS:
        TRITON_BACKENDS.append(name)


def backend_names() -> list[str]:
    """Every name `block_sparse_attention(backend=...)` takes: 'auto', 'triton' and the registered backends."""
    return ["auto", "triton", *_REGISTRY]


def get_backend(name: str) -> Backend | None:
    """The backend instance, or None when its module cannot be imported (e.g. no Triton)."""
    target = _REGISTRY[name]
    if isinstance(target, str):
        module, attr = target.split(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):      # e.g. a Triton whose Gluon lacks a name the kernel module uses
            return None
        _REGISTRY[name] = target
    return target  # type: ignore[return-value]


def select_backend(q, k, v, plan: Plan, backend: str = "auto") -> Backend:
    """The backend that will run these inputs; ValueError listing every candidate's reasons."""
    if backend == "auto":
        candidates = AUTO_ORDER
    elif backend == "triton":
        candidates = TRITON_BACKENDS
    elif backend in _REGISTRY:
        candidates = [backend]
    else:
        raise ValueError(f"backend={backend!r} is not known; choose 'auto', 'triton' or one of {sorted(_REGISTRY)}.")
    reasons: dict[str, list[str]] = {}
    for name in candidates:
        if name == "reference" and backend == "auto" and (padded := _padded_backend(q, k, v, plan, backend)):
            return padded
        if backend == "auto" and name in TRITON_BACKENDS and q.device.type == "cpu":
            # the Triton interpreter is a test vehicle, never an automatic choice
            reasons[name] = ["auto never runs the Triton interpreter on CPU (use backend='triton')"]
            continue
        impl = get_backend(name)
        if impl is None:
            reasons[name] = ["its module could not be imported (is triton installed? pip install triton)"]
            continue
        why = impl.not_supported_reasons(q, k, v, plan)
        if not why:
            return impl
        reasons[name] = why
    if backend == "triton" and (padded := _padded_backend(q, k, v, plan, backend)):
        return padded
    detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in reasons.items()) or "no backend registered"
    raise ValueError(f"no backend for backend={backend!r} supports these inputs ({detail}).")


def _padded_backend(q, k, v, plan: Plan, backend: str) -> PaddedHeadDim | None:
    """For a head dim the Triton backends do not take (below the largest they do): the first of them, in `backend`'s
    order, that takes the inputs zero-padded to the next head dim they do (`PaddedHeadDim`); None otherwise. "auto"
    asks only on CUDA (on CPU the reference serves any head dim)."""
    D = q.shape[-1]
    target = next((d for d in KERNEL_HEAD_DIMS if d > D), None)
    if D in KERNEL_HEAD_DIMS or target is None or (backend == "auto" and q.device.type != "cuda"):
        return None
    for name in TRITON_BACKENDS:
        if backend == "auto" and name not in AUTO_ORDER:     # a backend registered out of auto ("hopper") stays out
            continue
        impl = get_backend(name)
        if impl is not None and not (padded := PaddedHeadDim(impl, target)).not_supported_reasons(q, k, v, plan):
            return padded
    return None


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shape/dtype/device checks shared by every backend."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (B, H, S, D); got {type(t).__name__}.")
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected (B, H, S, D).")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
            "expected q (B, H, S, D) and k, v (B, H, Sk, D)."
        )
    if q.shape[3] < 1:
        raise ValueError(f"q, k, v have head dim {q.shape[3]}; it must be >= 1.")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}.")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must be floating point (bf16, fp16, fp32 or fp64); got {q.dtype}.")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}.")


