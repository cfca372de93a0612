"""Gradients of block-sparse attention: one autograd Function for every backend's forward.

The kernels have no autograd of their own; all backends compute the reference's function, so the forward of any of
them takes one backward, which recomputes the probabilities from q, k and the lse instead of keeping them:
the Triton backward kernels (`triton_backward.py`) when a Triton backend ran the forward (zero-padded to a head dim
they take, too) and they take the inputs, else the torch reference's row loop (`reference.
reference_attention_backward`: any device, dtype and head dim).
"""

from __future__ import annotations

import dataclasses

import torch

from ..plan import Plan
from .dispatch import TRITON_BACKENDS, Backend, PaddedHeadDim, padded_centroids, padded_stand_in
from .reference import autocast_off, reference_attention_backward


def records_gradient(q, k, v, plan: Plan) -> bool:
    """Whether autograd records a gradient for any of q, k, v or the plan's centroids."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (q, k, v, plan.k_mean, plan.v_sum))


def _functorch_transform():
    """The innermost `torch.func` transform the call runs under (a `TransformType`), or None (also while torch.compile
    traces, which handles transforms itself)."""
    if torch.compiler.is_compiling():
        return None
    top = torch._C._functorch.peek_interpreter_stack()
    return None if top is None else top.key()


def refuse_functorch_transforms() -> None:
    """RuntimeError inside a `torch.func` transform (grad, jvp, vmap, ...): the sparse path counts its calls in the
    session's device counters in place, which functorch refuses with an error that does not name videosparse, and
    its kernels have no transform rules. `torch.autograd.forward_ad` serves JVPs, `backward()` gradients."""
    if _functorch_transform() is not None:
        raise RuntimeError(
            "videosparse's sparse attention does not run under torch.func transforms (grad, jvp, vmap, ...). For a "
            "JVP (consistency distillation) use torch.autograd.forward_ad.dual_level() / make_dual, which the "
            "sparse path carries (through the torch reference attention); for gradients, loss.backward(); or run "
            "such steps with the stock processors (videosparse.remove(...)).")


def refuse_grad_and_vmap() -> None:
    """RuntimeError naming the alternatives where `block_sparse_attention` itself runs under `torch.func.grad` (vjp,
    jacrev) or `vmap` (jacfwd, hessian): its autograd Function and kernels have no functorch rules, and functorch's
    own errors name neither. `torch.func.jvp` runs (on the torch reference, as forward-mode AD does)."""
    kind, transforms = _functorch_transform(), torch._C._functorch.TransformType
    if kind in (transforms.Grad, transforms.Vmap):
        name = "grad (vjp, jacrev)" if kind == transforms.Grad else "vmap (jacfwd, hessian)"
        raise RuntimeError(
            f"videosparse's block_sparse_attention does not run under torch.func.{name}: for gradients call "
            "backward() or torch.autograd.grad on its output; for a batch, stack the inputs along dim 0 (B); "
            "torch.func.jvp and torch.autograd.forward_ad run (on the torch reference path).")


def refuse_double_backward() -> None:
    """RuntimeError in a backward that records its own graph (`create_graph=True`: gradient penalties, gradgradcheck):
    the gradients are computed outside autograd, so a second derivative through them would silently lack the
    attention's terms where the second pass asks only for other inputs (`torch.autograd.grad(penalty, params)`)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "videosparse's block-sparse attention is not twice differentiable: a backward with create_graph=True "
            "(a gradient penalty, gradgradcheck, higher-order gradients) would miss the attention's second-order "
            "terms. Run such steps without videosparse (videosparse.remove(...), or the stock processors) or with "
            "create_graph=False.")


def kernel_head_dim(q: torch.Tensor, plan: Plan, forward: Backend) -> int:
    """The head dim the Triton backward runs at for a forward on `forward`, or 0 for the torch reference's backward:
    q's, after a Triton backend; the padded one after a Triton backend run zero-padded (`PaddedHeadDim`); each only
    where the backward kernels take the inputs (`triton_backward.not_supported_reasons`)."""
    inner, head_dim = (forward.inner, forward.head_dim) if isinstance(forward, PaddedHeadDim) else \
        (forward, q.shape[-1])
    if inner.name not in TRITON_BACKENDS:
        return 0
    try:
        from . import triton_backward
    except ImportError:
        return 0
    stand_in = q if head_dim == q.shape[-1] else padded_stand_in(q, head_dim)
    return 0 if triton_backward.not_supported_reasons(stand_in, plan) else head_dim


def attention_backward(q, k, v, out, lse, plan: Plan, scale: float, d_out, d_lse, head_dim: int) -> tuple:
    """(dq, dk, dv, d_k_mean, d_v_sum) for the forward's (out, lse) (the last two None without correction): with
    the Triton kernels at `head_dim` (q, k, v, out, d_out and the centroids zero-padded to it when it is larger
    than theirs: the pad adds nothing to any product, and the pad columns of the gradients are dropped), or, with
    head_dim 0, the torch reference's row recompute (which reads no out, lse). Autocast is off inside (a backward
    called under it, as a training loop may, would run the products in its dtype: the reference's fp32 sums took
    bf16 terms and raised)."""
    with autocast_off(q.device):
        return _attention_backward(q, k, v, out, lse, plan, scale, d_out, d_lse, head_dim)


def _attention_backward(q, k, v, out, lse, plan: Plan, scale: float, d_out, d_lse, head_dim: int) -> tuple:
    if not head_dim:
        return reference_attention_backward(q, k, v, plan, scale, d_out, d_lse)
    from .triton_backward import triton_attention_backward

    D = q.shape[-1]
    if head_dim == D:
        return triton_attention_backward(q, k, v, out, lse, plan, scale, d_out, d_lse)
    pad = (0, head_dim - D)
    q, k, v, out = (torch.nn.functional.pad(t, pad) for t in (q, k, v, out))
    d_out = None if d_out is None else torch.nn.functional.pad(d_out, pad)
    grads = triton_attention_backward(q, k, v, out, lse, padded_centroids(plan, pad), scale, d_out, d_lse)
    return tuple(None if g is None else g[..., :D] for g in grads)


_PLAN_TENSORS = tuple(f.name for f in dataclasses.fields(Plan) if f.name not in ("block_m", "block_n"))


class RecomputingAttention(torch.autograd.Function):
    """Block-sparse attention whose backward recomputes the probabilities (no S^2 state kept for it).

    apply(q, k, v, k_mean, v_sum, plan, scale, run) -> (out, lse); k_mean, v_sum: the plan's correction centroids
    (None without correction), passed apart so that their gradients reach the tensors they were computed from;
    run(q, k, v, plan, scale, True) -> (out, lse): a `dispatch.Backend`. Keeps q, k, v (and out, lse for the
    Triton backward). Gradients for q, k, v, k_mean, v_sum, through out and lse; not twice differentiable (a
    backward with create_graph=True raises: `refuse_double_backward`).
    """

    @staticmethod
    def forward(ctx, q, k, v, k_mean, v_sum, plan: Plan, scale: float, run):
        out, lse = run(q, k, v, plan, scale, True)
        ctx.head_dim = kernel_head_dim(q, plan, run)
        # the plan's tensors through save_for_backward too (not as a ctx attribute): activation checkpointing's
        # saved-tensor hooks then drop them between the forward and its backward as they drop q, k, v
        ctx.save_for_backward(q, k, v, out if ctx.head_dim else None, lse if ctx.head_dim else None,
                              *(getattr(plan, name) for name in _PLAN_TENSORS))
        ctx.blocks, ctx.scale = (plan.block_m, plan.block_n), scale
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        refuse_double_backward()
        q, k, v, out, lse, *plan_tensors = ctx.saved_tensors
        plan = Plan(**dict(zip(_PLAN_TENSORS, plan_tensors)), block_m=ctx.blocks[0], block_n=ctx.blocks[1])
        dq, dk, dv, d_k_mean, d_v_sum = attention_backward(q, k, v, out, lse, plan, ctx.scale, d_out, d_lse,
                                                           ctx.head_dim)
        return (dq, dk, dv, d_k_mean if ctx.needs_input_grad[3] else None,
                d_v_sum if ctx.needs_input_grad[4] else None, None, None, None)
