"""Block-sparse attention kernels and their dispatch.

`block_sparse_attention(q, k, v, plan)` runs a `Plan` on the best backend for the inputs:
Hopper Gluon kernel (explicit warp-specialized schedule, 128x128 tiles) -> generic Triton kernel -> torch reference.
The Hopper Triton kernel (TMA + Triton's automatic warp specialization) never runs under "auto", only by name or under
backend="triton" after the other two decline: on Triton 3.6 it returns NaN rows for the items in flight when the GPU
preempts it (another process sharing the GPU).
Gradients: every backend's forward takes one backward that recomputes the probabilities (`autograd.py`; eagerly,
and under torch.compile through the custom op's autograd in ops.py): the Triton backward kernels after a Triton
forward, the torch reference's row loop otherwise.
"""

from __future__ import annotations

import logging
import math

import torch

from .._autodiff import carries_tangent
from ..config import TRITON_KERNELS
from ..plan import Plan
from .autograd import RecomputingAttention, records_gradient, refuse_grad_and_vmap
from .dispatch import check_inputs, get_backend, register_backend, select_backend
from .reference import reference_attention

logger = logging.getLogger(__name__)

__all__ = ["block_sparse_attention", "reference_attention", "register_backend", "select_backend"]

# Triton backends (`videosparse.config.TRITON_KERNELS`), imported on first use (the package imports without triton).
# Auto order: gluon_hopper -> triton_generic -> reference; backend="triton" tries gluon_hopper -> triton_generic ->
# hopper (on CPU, under TRITON_INTERPRET=1, gluon_hopper declines: Gluon has no interpreter). "hopper" stays out of
# auto: preempted, its automatic warp specialization gives NaN (triton_hopper.py; scripts/probe_preemption.py).
for _name, (_module, _auto) in TRITON_KERNELS.items():
    register_backend(_name, f"videosparse.kernels.{_module}:BACKEND", before="reference", triton=True, auto=_auto)
del _name, _module, _auto


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Tile-sparse attention: each query tile attends exactly to the key tiles its plan lists.

    Args:
        q: [B, H, S, D]; k, v: [B, H, Sk, D], any strides (the Hopper kernels take contiguous inputs only, so
            `auto` sends strided ones to the generic Triton kernel); bf16/fp16 on GPU (fp32/fp64 on the
            reference path). The Triton kernels take D in {64, 128}; other D below 128 run on them zero-padded
            to the next (`dispatch.PaddedHeadDim`).
        plan: a `videosparse.plan.Plan` (with optional zero-order correction tensors; the Triton kernels take its
            fp32 centroids rounded to q's dtype for their GEMMs, the reference keeps fp32: lse ~5e-5 apart in fp16).
        scale: softmax scale, default 1/sqrt(D).
        return_lse: also return the fp32 row log-sum-exp [B, H, S].
        backend: "auto", "triton" or "reference" (or a registered backend name).
        validate: check the plan's values against the inputs first (`Plan.validate`: ValueError on any mismatch;
            this reads the plan's tensors on the host, so it is skipped while torch.compile traces the call). Turn
            off in hot loops once a plan is known to be good: indices and counts are then trusted. The checks that
            read only metadata run either way, compiled too (`Plan.check_structure`: the plan's shapes, dtypes and
            devices against q, k; and q, k, v themselves and `scale`), so a plan built for another batch, query
            length or head count is an error, never a write out of bounds (its counts and indices are trusted: one
            for a longer key sequence is caught only when it carries centroids).

    Returns:
        out [B, H, S, D] in q's dtype, and lse when `return_lse` (a row that attends to nothing, its plan listing no
        key tile and carrying no correction: out 0, lse -inf). Where autograd records q, k, v or the plan's
        centroids, both carry a backward that recomputes the probabilities (O(S*D) memory): the Triton kernels'
        after a Triton forward that they take, else the torch reference's.

    Example:
        >>> import torch
        >>> from videosparse.kernels import block_sparse_attention
        >>> from videosparse.plan import dense_plan
        >>> q = k = v = torch.randn(1, 2, 300, 64)
        >>> out = block_sparse_attention(q, k, v, dense_plan(1, 2, 300))
    """
    check_inputs(q, k, v)
    refuse_grad_and_vmap()
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a videosparse.plan.Plan (e.g. from dense_plan, plan_from_mask or topk_plan); "
                        f"got {type(plan).__name__}.")
    if not torch.compiler.is_compiling():       # compiled: the op checks the structure when it runs (ops.py)
        if validate:
            plan.validate(q, k, v)
        else:
            plan.check_structure(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else _softmax_scale(scale)
    plan = plan.with_index_slot()       # Kmax = 0: one unused column keeps every kernel's index reads in bounds
    # inputs no kernel serves correctly take the torch reference: forward-mode AD (a JVP; it differentiates in both
    # modes, eagerly and compiled), and tensor subclasses (quantized activations: a kernel would read their storage,
    # not their values; the reference goes through their own ops)
    tangent = carries_tangent(q, k, v, plan.k_mean, plan.v_sum)
    if tangent or (not torch.compiler.is_compiling() and any(type(t) is not torch.Tensor for t in (q, k, v))):
        if tangent and not torch.compiler.is_compiling():
            _note_forward_ad(backend)
        out, lse = reference_attention(q, k, v, plan, scale, return_lse=True)
        return (out, lse) if return_lse else out
    if torch.compiler.is_compiling():
        # one opaque node for torch.compile (see ops.py); the backend is chosen when it runs
        from .ops import run_op

        out, lse = run_op(q, k, v, plan, scale, backend)
        return (out, lse) if return_lse else out
    impl = select_backend(q, k, v, plan, backend)
    if backend == "auto" and q.is_cuda and impl is get_backend("reference"):
        _note_reference_on_cuda(q, plan)
    if records_gradient(q, k, v, plan):
        # the backend's forward, a backward that recomputes the probabilities (the kernels have none of their own)
        out, lse = RecomputingAttention.apply(q, k, v, plan.k_mean, plan.v_sum, plan, scale, impl)
        return (out, lse) if return_lse else out
    return impl(q, k, v, plan, scale, return_lse)


_FORWARD_AD_NOTED: list[bool] = [False]
_REFERENCE_ON_CUDA_NOTED: set[tuple] = set()


def _note_reference_on_cuda(q: torch.Tensor, plan: Plan) -> None:
    """Say once per (dtype, head dim, tile sizes) that "auto" found no kernel on a GPU and runs the torch reference
    (the processors never get here: they run such layers dense, with their own warning)."""
    key = (q.dtype, q.shape[-1], plan.block_m, plan.block_n)
    if key not in _REFERENCE_ON_CUDA_NOTED:
        _REFERENCE_ON_CUDA_NOTED.add(key)
        logger.warning("videosparse: backend='auto' found no kernel for %s, head dim %d, %dx%d tiles on %s and runs "
                       "the torch reference attention (correct, much slower). The kernels take bf16 / fp16, head dims "
                       "up to 128 and 16- to 128-token tiles; backend='triton' raises with what each one lacks.",
                       q.dtype, q.shape[-1], plan.block_m, plan.block_n, q.device)


def _note_forward_ad(backend: str) -> None:
    """Say once per process that forward-mode AD runs the torch reference attention (slower than the kernels)."""
    if not _FORWARD_AD_NOTED[0]:
        _FORWARD_AD_NOTED[0] = True
        logger.warning("videosparse: forward-mode AD (a JVP) carries tangents through the sparse attention on the "
                       "torch reference path (backend=%r is used for the calls without tangents): correct, slower "
                       "than the kernels.", backend)


def _softmax_scale(scale) -> float:
    """`scale` as a finite positive Python float (a 0-dim tensor or numpy scalar too: the kernels take a number). Under
    torch.compile a float or SymFloat passes as it is (a check there would break the graph)."""
    if torch.compiler.is_compiling() and isinstance(scale, (float, torch.SymFloat)):
        return scale
    try:
        value = None if isinstance(scale, (str, bytes, bool)) else float(scale)
    except (TypeError, ValueError, RuntimeError):
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale={scale!r} must be a finite number > 0 (the softmax scale; None for 1/sqrt(D)): "
                         "the kernels take a row's running max as max(q.k) x scale.")
    return value
