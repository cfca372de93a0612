"""Gradients of block-sparse attention: one autograd Function for every backend's forward.

The kernels have no autograd of their own; all backends compute the reference's function, so the forward of any of
them takes one backward, which recomputes the probabilities from q, k and the lse instead of keeping them:
the Triton backward kernels (`triton_backward.py`) when a Triton backend ran the forward and they take the inputs,
else the torch reference's row loop (`reference.reference_attention_backward`: any device, dtype and head dim).
"""

from __future__ import annotations

import torch

from ..plan import Plan
from .dispatch import TRITON_BACKENDS
from .reference import reference_attention_backward


def records_gradient(q, k, v, plan: Plan) -> bool:
    """Whether autograd records a gradient for any of q, k, v or the plan's centroids."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (q, k, v, plan.k_mean, plan.v_sum))


def kernel_backward(q: torch.Tensor, plan: Plan, forward: str) -> bool:
    """Whether the Triton backward serves a forward that ran on the backend named `forward`: a Triton backend, and
    inputs the backward kernels take (`triton_backward.not_supported_reasons`)."""
    if forward not in TRITON_BACKENDS:
        return False
    try:
        from . import triton_backward
    except ImportError:
        return False
    return not triton_backward.not_supported_reasons(q, plan)


def attention_backward(q, k, v, out, lse, plan: Plan, scale: float, d_out, d_lse, kernel: bool) -> tuple:
    """(dq, dk, dv, d_k_mean, d_v_sum) for the forward's (out, lse) (the last two None without correction): with
    the Triton kernels when `kernel`, else the torch reference's row recompute (which needs no out, lse)."""
    if kernel:
        from .triton_backward import triton_attention_backward

        return triton_attention_backward(q, k, v, out, lse, plan, scale, d_out, d_lse)
    return reference_attention_backward(q, k, v, plan, scale, d_out, d_lse)


class RecomputingAttention(torch.autograd.Function):
    """Block-sparse attention whose backward recomputes the probabilities (no S^2 state kept for it).

    apply(q, k, v, k_mean, v_sum, plan, scale, run) -> (out, lse); k_mean, v_sum: the plan's correction centroids
    (None without correction), passed apart so that their gradients reach the tensors they were computed from;
    run(q, k, v, plan, scale, True) -> (out, lse): a `dispatch.Backend`. Keeps q, k, v (and out, lse for the
    Triton backward). Gradients for q, k, v, k_mean, v_sum, through out and lse; not twice differentiable.
    """

    @staticmethod
    def forward(ctx, q, k, v, k_mean, v_sum, plan: Plan, scale: float, run):
        out, lse = run(q, k, v, plan, scale, True)
        ctx.kernel = kernel_backward(q, plan, run.name)
        ctx.save_for_backward(q, k, v, *((out, lse) if ctx.kernel else ()))
        ctx.plan, ctx.scale = plan, scale             # the plan holds k_mean, v_sum for the backward
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_lse):
        q, k, v, *outputs = ctx.saved_tensors
        out, lse = outputs if ctx.kernel else (None, None)
        dq, dk, dv, d_k_mean, d_v_sum = attention_backward(q, k, v, out, lse, ctx.plan, ctx.scale, d_out, d_lse,
                                                           ctx.kernel)
        return (dq, dk, dv, d_k_mean if ctx.needs_input_grad[3] else None,
                d_v_sum if ctx.needs_input_grad[4] else None, None, None, None)
