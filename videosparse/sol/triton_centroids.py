"""Fused Triton kernel: per tile the mean query, mean key and value sum, in one pass over q, k, v.

Layout (top to bottom, like Triton's fused-attention tutorial): the kernel, then the host wrapper.
The torch path (`videosparse.sol.centroids.tile_centroids_torch`) defines the semantics; the
dispatching functions live in `videosparse.sol.centroids`.

One program handles one (tile, batch*head) pair: it streams the tile's real tokens in chunks of
CHUNK rows, accumulates in fp32 and writes one fp32 row per output. Runs under
`TRITON_INTERPRET=1` on CPU tensors (loads are upcast to fp32 before any arithmetic, so bf16 is
correct there too).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..kernels._triton_utils import COMPILE_OPTIONS, on_input_device
from ..layout import tile_lengths


@triton.jit
def _tile_stats_kernel(
    Q, K, V,
    QMean, KMean, VSum,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    H, S, D,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_Q: tl.constexpr,
):
    tl.static_assert(BLOCK_N % CHUNK == 0)
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    start = tile.to(tl.int64) * BLOCK_N
    n_real = tl.minimum(S - start, BLOCK_N).to(tl.float32)

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    q_base = Q + b * stride_qb + h * stride_qh

    k_acc = tl.zeros([CHUNK, BLOCK_D], dtype=tl.float32)
    v_acc = tl.zeros([CHUNK, BLOCK_D], dtype=tl.float32)
    q_acc = tl.zeros([CHUNK, BLOCK_D], dtype=tl.float32)
    for c in tl.static_range(0, BLOCK_N, CHUNK):
        offs_s = start + c + tl.arange(0, CHUNK).to(tl.int64)
        m = (offs_s[:, None] < S) & d_ok[None, :]
        k = tl.load(k_base + offs_s[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=m, other=0.0)
        v = tl.load(v_base + offs_s[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=m, other=0.0)
        k_acc += k.to(tl.float32)
        v_acc += v.to(tl.float32)
        if HAS_Q:
            q = tl.load(q_base + offs_s[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=m, other=0.0)
            q_acc += q.to(tl.float32)

    out = b * stride_ob + h * stride_oh + tile.to(tl.int64) * stride_on + offs_d * stride_od
    tl.store(KMean + out, tl.sum(k_acc, axis=0) / n_real, mask=d_ok)
    tl.store(VSum + out, tl.sum(v_acc, axis=0), mask=d_ok)
    if HAS_Q:
        tl.store(QMean + out, tl.sum(q_acc, axis=0) / n_real, mask=d_ok)


@on_input_device
def tile_stats_triton(
    q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, block: int, *, chunk: int | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean query, mean key, value sum and real length of every tile, in one fused pass.

    Args:
        q: [B, H, S, D] or None (skip the query means); k, v: [B, H, S, D] in tile order, any float
            dtype, any strides, on a CUDA device (or on CPU under `TRITON_INTERPRET=1`).
        block: tokens per tile (a power of two, e.g. 64 or 128).
        chunk, num_warps: rows per load step (default ~4K elements per tensor) and warps per program
            (`scripts/sweep_trippool.py --kernel tile_stats` times the choices).

    Returns:
        q_mean fp32 [B, H, N, D] (or None), k_mean fp32 [B, H, N, D], v_sum fp32 [B, H, N, D],
        tile_len int32 [N], with N = ceil(S / block); the last tile is averaged over its real tokens.
    """
    if k.dim() != 4 or k.shape != v.shape or (q is not None and q.shape != k.shape):
        raise ValueError(
            f"q, k, v must all be (B, H, S, D) of one shape; got q {None if q is None else tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block={block} must be a positive power of two (64 or 128 in videosparse).")
    B, H, S, D = k.shape
    N = math.ceil(S / block)
    out_shape = (B, H, N, D)
    k_mean = torch.empty(out_shape, dtype=torch.float32, device=k.device)
    v_sum = torch.empty(out_shape, dtype=torch.float32, device=k.device)
    q_mean = torch.empty(out_shape, dtype=torch.float32, device=k.device) if q is not None else None
    if N > 0 and B * H > 0:
        qq = q if q is not None else k
        block_d = triton.next_power_of_2(D)
        if chunk is None:
            chunk = max(1, min(block, 4096 // block_d))   # ~4K elements per tensor and chunk
        _tile_stats_kernel[(N, B * H)](
            qq, k, v,
            q_mean if q_mean is not None else k_mean, k_mean, v_sum,
            *qq.stride(), *k.stride(), *v.stride(), *k_mean.stride(),
            H, S, D,
            BLOCK_N=block, BLOCK_D=block_d, CHUNK=chunk, HAS_Q=q is not None,
            num_warps=num_warps, **COMPILE_OPTIONS,
        )
    return q_mean, k_mean, v_sum, tile_lengths(S, block, k.device)
