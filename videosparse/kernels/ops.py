"""`torch.library` custom op around block-sparse attention, so torch.compile sees one opaque node.

Dynamo does not trace into a custom op: the backend choice, the Triton host code and the torch
reference loop run eagerly at run time, while the graph around them (projections, RoPE, layout
gathers, plan builders) compiles. The fake (meta) implementation only gives output shapes.
"""

from __future__ import annotations

import torch

from ..plan import Plan
from .autograd import attention_backward, kernel_head_dim, refuse_double_backward
from .dispatch import check_inputs, select_backend


@torch.library.custom_op("videosparse::block_sparse_attention", mutates_args=())
def block_sparse_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_index: torch.Tensor,
    kv_count: torch.Tensor,
    block_m: int,
    block_n: int,
    k_mean: torch.Tensor | None,
    v_sum: torch.Tensor | None,
    tile_len: torch.Tensor | None,
    order: torch.Tensor | None,
    valid_keys: torch.Tensor | None,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, S, D] in q's dtype, lse fp32 [B, H, S]) for the plan given by its tensors."""
    # an index slot as the public function gives: a plan with no index columns (Kmax 0) read out of bounds
    plan = Plan(kv_index, kv_count, block_m, block_n, k_mean, v_sum, tile_len, order, valid_keys).with_index_slot()
    check_inputs(q, k, v)               # as the public function does: the op may also be called directly
    plan.check_structure(q, k, v, where="compiled call")    # traced, the public function could not check it
    impl = select_backend(q, k, v, plan, backend)
    out, lse = impl(q, k, v, plan, scale, True)
    return out.contiguous(), lse.contiguous()


@block_sparse_attention_op.register_fake
def _(q, k, v, kv_index, kv_count, block_m, block_n, k_mean, v_sum, tile_len, order, valid_keys, scale, backend):
    B, H, S, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, S), dtype=torch.float32)


@torch.library.custom_op("videosparse::block_sparse_attention_backward", mutates_args=())
def block_sparse_attention_backward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kv_index: torch.Tensor,
    kv_count: torch.Tensor,
    block_m: int,
    block_n: int,
    k_mean: torch.Tensor | None,
    v_sum: torch.Tensor | None,
    tile_len: torch.Tensor | None,
    valid_keys: torch.Tensor | None,
    scale: float,
    d_out: torch.Tensor,
    d_lse: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv, dk_mean, dv_sum; the last two empty without correction) of `autograd.
    attention_backward` (the Triton kernels at `head_dim`, or with 0 the torch reference's row recompute, which
    reads no out, lse), as one opaque node for torch.compile."""
    plan = Plan(kv_index, kv_count, block_m, block_n, k_mean, v_sum, tile_len, None, valid_keys)
    dq, dk, dv, dk_mean, dv_sum = attention_backward(q, k, v, out, lse, plan, scale, d_out, d_lse, head_dim)

    def centroid_grad(grad, centroid):      # each output its own tensor (outputs of a custom op may not alias)
        if grad is not None:
            return grad.contiguous()
        return torch.zeros_like(centroid) if centroid is not None else q.new_empty(0)

    return (dq.contiguous(), dk.contiguous(), dv.contiguous(), centroid_grad(dk_mean, k_mean),
            centroid_grad(dv_sum, v_sum))


@block_sparse_attention_backward_op.register_fake
def _(q, k, v, out, lse, kv_index, kv_count, block_m, block_n, k_mean, v_sum, tile_len, valid_keys, scale, d_out,
      d_lse, head_dim):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            k_mean.new_empty(k_mean.shape) if k_mean is not None else q.new_empty(0),
            v_sum.new_empty(v_sum.shape) if v_sum is not None else q.new_empty(0))


def _keep_inputs(ctx, inputs, output):
    q, k, v, kv_index, kv_count, block_m, block_n, k_mean, v_sum, tile_len, order, valid_keys, scale, backend = inputs
    out, lse = output
    ctx.block_m, ctx.block_n, ctx.scale = block_m, block_n, scale
    # whether the Triton backward serves the backend that ran the forward (asked as the op asks, from the inputs'
    # metadata only)
    plan = Plan(kv_index, kv_count, block_m, block_n, k_mean, v_sum, tile_len, order, valid_keys)
    try:
        ctx.head_dim = kernel_head_dim(q, plan, select_backend(q, k, v, plan, backend))
    except Exception:                       # a backend check that needs real data: the reference's backward
        ctx.head_dim = 0
    # out and lse only for the Triton backward: the reference's row recompute reads neither (an activation-sized
    # tensor per layer less to keep)
    kept = (out, lse) if ctx.head_dim else (None, None)
    ctx.save_for_backward(q, k, v, *kept, kv_index, kv_count, k_mean, v_sum, tile_len, valid_keys)


def _backward(ctx, grad_out, grad_lse):
    """`autograd.attention_backward` as the op's own custom op, whichever backend ran the forward (all compute the
    reference's function; the kernels have no backward of their own)."""
    refuse_double_backward()
    q, k, v, out, lse, kv_index, kv_count, k_mean, v_sum, tile_len, valid_keys = ctx.saved_tensors
    if out is None:                         # not kept for the reference's backward, which does not read them
        out, lse = q.new_empty(0), q.new_empty(0, dtype=torch.float32)
    if grad_out is None:
        grad_out = torch.zeros_like(q)
    if grad_lse is None:
        grad_lse = q.new_zeros(q.shape[:3], dtype=torch.float32)
    dq, dk, dv, dk_mean, dv_sum = block_sparse_attention_backward_op(
        q, k, v, out, lse, kv_index, kv_count, ctx.block_m, ctx.block_n, k_mean, v_sum, tile_len, valid_keys,
        ctx.scale, grad_out, grad_lse, ctx.head_dim)
    return (dq, dk, dv, None, None, None, None, dk_mean if k_mean is not None else None,
            dv_sum if v_sum is not None else None, None, None, None, None, None)


torch.library.register_autograd("videosparse::block_sparse_attention", _backward, setup_context=_keep_inputs)


def run_op(q, k, v, plan: Plan, scale: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return block_sparse_attention_op(q, k, v, plan.kv_index, plan.kv_count, plan.block_m, plan.block_n,
                                     plan.k_mean, plan.v_sum, plan.tile_len, plan.order, plan.valid_keys, float(scale),
                                     backend)
