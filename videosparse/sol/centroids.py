"""Per key tile: mean key, value sum and real length (inputs of Sol routing and the zero-order correction)."""

from __future__ import annotations

import math

import torch

from .._autodiff import carries_tangent
from .._helper_backend import use_triton
from ..layout import tile_lengths
from ..validation import check_block


def tile_centroids_torch(
    k: torch.Tensor, v: torch.Tensor, block_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centroids of key tiles in tile order.

    Args:
        k, v: [B, H, S, D] in tile order (any float dtype).
        block_n: tokens per key tile.

    Returns:
        k_mean fp32 [B, H, Nk, D], v_sum fp32 [B, H, Nk, D], tile_len int32 [Nk] (on k's device);
        the last tile may be partial and is averaged over its real tokens only.
    """
    B, H, S, D = k.shape
    Nk = math.ceil(S / block_n)
    pad = Nk * block_n - S
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(B, H, Nk, block_n, D)
    vp = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(B, H, Nk, block_n, D)
    tile_len = tile_lengths(S, block_n, k.device)
    k_mean = kp.sum(3, dtype=torch.float32) / tile_len[:, None].float()
    v_sum = vp.sum(3, dtype=torch.float32)
    return k_mean, v_sum, tile_len


def tile_means_torch(x: torch.Tensor, block: int) -> torch.Tensor:
    """Mean of every tile of x over its real tokens.

    Args:
        x: [B, H, S, D] in tile order (any float dtype).
        block: tokens per tile; the last tile may be partial.

    Returns:
        fp32 [B, H, ceil(S / block), D].
    """
    B, H, S, D = x.shape
    N = math.ceil(S / block)
    pad = N * block - S
    xp = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(B, H, N, block, D)
    lens = tile_lengths(S, block, x.device, torch.float32)
    return xp.sum(3, dtype=torch.float32) / lens[:, None]


CENTROID_BACKENDS = ("auto", "triton", "torch", "reference")


def _records_gradient(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether autograd records k or v, or forward-mode AD gives them a tangent: then the centroids come from torch
    (differentiable, so the correction's gradients and tangents reach k and v), whatever the backend (the Triton
    kernel has neither)."""
    return (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)) or carries_tangent(k, v)


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    """Whether the fused Triton kernel runs for `x` under `backend` ("reference" means torch;
    `videosparse._helper_backend.use_triton`)."""
    reasons = [f"head dim {x.shape[-1]} > 256"] if x.shape[-1] > 256 else []
    return use_triton(x, backend, reasons, what="tile centroids", backends=CENTROID_BACKENDS)


def tile_centroids(
    k: torch.Tensor, v: torch.Tensor, block_n: int, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centroids of key tiles in tile order: the fused Triton kernel on CUDA, torch elsewhere and wherever autograd
    records k or v.

    Args:
        k, v: [B, H, S, D] in tile order (any float dtype).
        block_n: tokens per key tile.
        backend: "auto" (Triton on CUDA, torch otherwise), "triton" (ValueError where it cannot
            run), or "torch" / "reference".

    Returns:
        k_mean fp32 [B, H, Nk, D], v_sum fp32 [B, H, Nk, D], tile_len int32 [Nk], as
        `tile_centroids_torch`.
    """
    check_block("block_n", block_n)
    if _records_gradient(k, v):
        return tile_centroids_torch(k, v, block_n)
    if backend == "auto" and torch.compiler.is_compiling():
        return tile_centroids_op(k, v, block_n)     # one opaque node (eagerly the op's dispatch costs host time)
    if _use_triton(k, backend):
        from .triton_centroids import tile_stats_triton

        _, k_mean, v_sum, tile_len = tile_stats_triton(None, k, v, block_n)
        return k_mean, v_sum, tile_len
    return tile_centroids_torch(k, v, block_n)


def tile_stats(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything Sol needs per tile in one pass: mean query, mean key, value sum, real length.

    Args:
        q, k, v: [B, H, S, D] in tile order (any float dtype), one shape.
        block: tokens per tile (block_m == block_n).
        backend: as in `tile_centroids`.

    Returns:
        q_mean fp32 [B, H, N, D] (no gradient: it only routes), k_mean fp32 [B, H, N, D], v_sum fp32 [B, H, N, D],
        tile_len int32 [N].
    """
    check_block("block", block)
    # q detached: a q that records gradients (LoRA on to_q alone) would otherwise, under torch.compile, mark the op's
    # outputs as differentiable, and the correction's backward would run into the op, which has no backward
    q = q.detach()
    if _records_gradient(k, v):
        return (tile_means_torch(q, block), *tile_centroids_torch(k, v, block))
    if backend == "auto" and torch.compiler.is_compiling():
        return tile_stats_op(q, k, v, block)        # one opaque node (eagerly the op's dispatch costs host time)
    if _use_triton(k, backend):
        from .triton_centroids import tile_stats_triton

        return tile_stats_triton(q, k, v, block)  # type: ignore[return-value]
    return (tile_means_torch(q, block), *tile_centroids_torch(k, v, block))


# ---------------------------------------------------------------- custom ops ("auto": torch on CPU, Triton on CUDA)
@torch.library.custom_op("videosparse::tile_centroids", mutates_args=())
def tile_centroids_op(k: torch.Tensor, v: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tile_centroids_torch(k, v, block_n)


@tile_centroids_op.register_kernel("cuda")
def _tile_centroids_cuda(k, v, block_n):
    if _use_triton(k, "auto"):
        from .triton_centroids import tile_stats_triton

        _, k_mean, v_sum, tile_len = tile_stats_triton(None, k, v, block_n)
        return k_mean, v_sum, tile_len
    return tile_centroids_torch(k, v, block_n)


@tile_centroids_op.register_fake
def _tile_centroids_fake(k, v, block_n):
    B, H, S, D = k.shape
    n = math.ceil(S / block_n)
    return (k.new_empty((B, H, n, D), dtype=torch.float32), v.new_empty((B, H, n, D), dtype=torch.float32),
            k.new_empty((n,), dtype=torch.int32))


@torch.library.custom_op("videosparse::tile_stats", mutates_args=())
def tile_stats_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (tile_means_torch(q, block), *tile_centroids_torch(k, v, block))


@tile_stats_op.register_kernel("cuda")
def _tile_stats_cuda(q, k, v, block):
    if _use_triton(k, "auto"):
        from .triton_centroids import tile_stats_triton

        return tile_stats_triton(q, k, v, block)
    return (tile_means_torch(q, block), *tile_centroids_torch(k, v, block))


@tile_stats_op.register_fake
def _tile_stats_fake(q, k, v, block):
    B, H, S, D = k.shape
    n = math.ceil(S / block)
    return (q.new_empty((B, H, n, D), dtype=torch.float32), *_tile_centroids_fake(k, v, block))
