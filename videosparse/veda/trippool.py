"""TripPool: per-tile [mean | max | min] features of q or k in tile order.

`trippool_qk` is the entry point: one fused Triton launch for q and k on CUDA (see
`videosparse.veda.triton_kernels`), the torch path `trippool_torch` elsewhere. Both pool a partial
last tile over its real tokens only.
"""

from __future__ import annotations

import math

import torch

from .._helper_backend import use_triton
from ..layout import tile_lengths
from ..validation import check_block

def trippool_torch(x: torch.Tensor, block: int, num_tiles: int | None = None) -> torch.Tensor:
    """Pool every tile of x into [mean | max | min] (torch reference and CPU path).

    Args:
        x: [B, H, S, D] in tile order, any float dtype.
        block: tokens per tile; the last tile may be partial (pooled over its real tokens).
        num_tiles: pool only the first `num_tiles` tiles (e.g. the video tiles); default all.

    Returns:
        fp32 [B, H, N, 3*D].
    """
    B, H, S, D = x.shape
    check_block("block", block)
    N = math.ceil(S / block)
    n = N if num_tiles is None else int(num_tiles)
    if not 0 < n <= N:
        raise ValueError(f"num_tiles={num_tiles} must lie in [1, {N}] for S={S}, block={block}.")
    pad = N * block - S
    xp = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).view(B, H, N, block, D)
    xp = xp[:, :, :n]
    lens = tile_lengths(S, block, x.device, torch.float32)[:n]
    real = torch.arange(block, device=x.device) < lens[:, None]
    mask = real[None, None, :, :, None]
    mean = xp.sum(3) / lens[:, None]
    mx = xp.masked_fill(~mask, float("-inf")).amax(3)
    mn = xp.masked_fill(~mask, float("inf")).amin(3)
    return torch.cat([mean, mx, mn], -1)


def _use_triton(x: torch.Tensor, block: int, backend: str, what: str = "TripPool") -> bool:
    """Whether the Veda Triton kernel (TripPool, or the teacher: `what`) runs on `x` under `backend`
    (`videosparse._helper_backend.use_triton`; the kernels take blocks that are powers of two >= 16)."""
    reasons = [] if block >= 16 and not block & (block - 1) else [f"block={block} is not a power of two >= 16"]
    return use_triton(x, backend, reasons, what=what)


def trippool_qk(q: torch.Tensor, k: torch.Tensor, block: int, num_tiles: int | None = None, *,
                backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """TripPool features of q and k (one fused pass on CUDA).

    Args:
        q, k: [B, H, S, D] in tile order (same shape), fp32/fp16/bf16.
        block: tokens per tile.
        num_tiles: pool only the first `num_tiles` tiles (default all).
        backend: "auto" (Triton on CUDA, torch elsewhere), "triton" (also on CPU under
            TRITON_INTERPRET=1) or "torch".

    Returns:
        (qf, kf), fp32 [B, H, n, 3*D] each: [mean | max | min] per tile, detached.
    """
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape; got {tuple(q.shape)} and {tuple(k.shape)}.")
    check_block("block", block)
    q, k = q.detach(), k.detach()
    n = num_tiles if num_tiles is not None else math.ceil(q.shape[2] / block)
    if backend == "auto" and torch.compiler.is_compiling():
        return trippool_qk_op(q, k, block, n)      # one opaque node; eagerly its dispatch would cost ~0.2 ms of host
    if _use_triton(q, block, backend):
        from .triton_kernels import trippool_triton

        qf, kf = trippool_triton(q, k, block, n)
        return qf, kf  # type: ignore[return-value]
    return trippool_torch(q, block, n), trippool_torch(k, block, n)


@torch.library.custom_op("videosparse::trippool_qk", mutates_args=())
def trippool_qk_op(q: torch.Tensor, k: torch.Tensor, block: int, num_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`trippool_qk(backend="auto")` as a custom op: torch on CPU, the fused Triton kernel on CUDA."""
    return trippool_torch(q, block, num_tiles), trippool_torch(k, block, num_tiles)


@trippool_qk_op.register_kernel("cuda")
def _trippool_qk_cuda(q, k, block, num_tiles):
    if _use_triton(q, block, "auto"):
        from .triton_kernels import trippool_triton

        return trippool_triton(q, k, block, num_tiles)
    return trippool_torch(q, block, num_tiles), trippool_torch(k, block, num_tiles)


@trippool_qk_op.register_fake
def _trippool_qk_fake(q, k, block, num_tiles):
    B, H, _, D = q.shape
    return q.new_empty((B, H, num_tiles, 3 * D), dtype=torch.float32), k.new_empty((B, H, num_tiles, 3 * D),
                                                                                   dtype=torch.float32)
