"""`torch.library` custom op around block-sparse attention, so torch.compile sees one opaque node.

Dynamo does not trace into a custom op: the backend choice, the Triton host code and the torch
reference loop run eagerly at run time, while the graph around them (projections, RoPE, layout
gathers, plan builders) compiles. The fake (meta) implementation only gives output shapes.
"""

from __future__ import annotations

import torch

from ..plan import Plan
from .dispatch import select_backend


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
    plan = Plan(kv_index, kv_count, block_m, block_n, k_mean, v_sum, tile_len, order, valid_keys)
    impl = select_backend(q, k, v, plan, backend)
    out, lse = impl(q, k, v, plan, scale, True)
    return out.contiguous(), lse.contiguous()


@block_sparse_attention_op.register_fake
def _(q, k, v, kv_index, kv_count, block_m, block_n, k_mean, v_sum, tile_len, order, valid_keys, scale, backend):
    B, H, S, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, S), dtype=torch.float32)


def _no_backward(ctx, grad_out, grad_lse):
    raise NotImplementedError(FORWARD_ONLY)


def _keep_nothing(ctx, inputs, output):
    pass


FORWARD_ONLY = ("videosparse's block-sparse attention kernels are forward-only (no backward pass): run them "
                "under torch.no_grad() / torch.inference_mode(), or, for gradients, call them eagerly (outside "
                "torch.compile) with backend='reference'.")
torch.library.register_autograd("videosparse::block_sparse_attention", _no_backward, setup_context=_keep_nothing)


def run_op(q, k, v, plan: Plan, scale: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return block_sparse_attention_op(q, k, v, plan.kv_index, plan.kv_count, plan.block_m, plan.block_n,
                                     plan.k_mean, plan.v_sum, plan.tile_len, plan.order, plan.valid_keys, float(scale),
                                     backend)
