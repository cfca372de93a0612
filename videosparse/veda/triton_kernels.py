"""Triton kernels of Veda's tile preparation: TripPool features and teacher tile scores.

Layout follows Triton's fused-attention tutorial: the inner loops as helpers, the kernels, then the
host wrappers (which validate and launch). Dispatch (Triton on CUDA, torch elsewhere) lives in
`videosparse.veda.trippool` and `videosparse.veda.teacher`; this module imports Triton at import
time and is only imported lazily from there.

Under the interpreter (`TRITON_INTERPRET=1`, CPU tensors) bf16 arithmetic is wrong, so every
loaded tile is upcast to fp32 when `UPCAST` is set (the wrappers set it under the interpreter).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..kernels._triton_utils import COMPILE_OPTIONS, on_input_device
from .teacher import teacher_num_tiles
from .._helper_backend import interpreting as _interpreting

LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------------
# TripPool: per tile [mean | max | min] of q and k, one launch over both.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _trippool_kernel(
    Q, K, QF, KF,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_fb, stride_fh, stride_fn, stride_ff,
    H, S,
    BLOCK: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
):
    """grid = (num_tiles, B*H, 2): program (tile, b*H+h, 0) pools q's tile into QF, (.., 1) k's into KF.

    The tile is streamed in CHUNK-row pieces into elementwise fp32 accumulators (sum, max, min); the
    cross-thread reductions run once at the end.
    """
    tl.static_assert(BLOCK % CHUNK == 0)
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    if tl.program_id(2) == 0:
        X = Q + b * stride_qb + h * stride_qh
        stride_xs = stride_qs
        stride_xd = stride_qd
        OUT = QF
    else:
        X = K + b * stride_kb + h * stride_kh
        stride_xs = stride_ks
        stride_xd = stride_kd
        OUT = KF
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    start = tile * BLOCK
    acc_sum = tl.zeros([CHUNK, BLOCK_D], dtype=tl.float32)
    acc_max = tl.full([CHUNK, BLOCK_D], float("-inf"), dtype=tl.float32)
    acc_min = tl.full([CHUNK, BLOCK_D], float("inf"), dtype=tl.float32)
    for r0 in tl.static_range(0, BLOCK, CHUNK):
        rows = start + r0 + tl.arange(0, CHUNK)
        m2 = (rows < S)[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xs + cols[None, :] * stride_xd, mask=m2,
                    other=0.0).to(tl.float32)
        acc_sum += x
        acc_max = tl.maximum(acc_max, tl.where(m2, x, float("-inf")))
        acc_min = tl.minimum(acc_min, tl.where(m2, x, float("inf")))
    n = tl.minimum(S - start, BLOCK).to(tl.float32)
    o = OUT + b * stride_fb + h * stride_fh + tile.to(tl.int64) * stride_fn
    tl.store(o + cols * stride_ff, tl.sum(acc_sum, 0) / n, mask=cmask)
    tl.store(o + (D + cols) * stride_ff, tl.max(acc_max, 0), mask=cmask)
    tl.store(o + (2 * D + cols) * stride_ff, tl.min(acc_min, 0), mask=cmask)


@on_input_device
def trippool_triton(q: torch.Tensor, k: torch.Tensor | None, block: int, num_tiles: int | None = None, *,
                    chunk: int | None = None, num_warps: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TripPool of q (and k) in one launch.

    Args:
        q, k: [B, H, S, D] in tile order, fp32/fp16/bf16, same shape; k may be None.
        block: tokens per tile (a power of two >= 16).
        num_tiles: pool only the first `num_tiles` tiles (default all, ceil(S / block)).
        chunk, num_warps: rows per load step and warps per program. The defaults (one warp; 1,024 elements per
            step at head dim 128, 2,048 at 64) are the best of a sweep on the H200 (`scripts/sweep_trippool.py` ->
            `benchmarks/sweep_trippool_h200.json`, bf16 q and k): 40 x 75,600 x 128 in 421 us (3.7 TB/s) against
            797 us with the earlier 4 warps and 2,048 elements per step, 12 x 32,760 x 128 in 64 vs 124 us,
            32 x 6,144 x 64 in 27 vs 34 us. A program is one tile; more tiles in flight per SM beat wider programs.

    Returns:
        (qf, kf): fp32 [B, H, num_tiles, 3*D] each ([mean | max | min]; the partial last tile is
        pooled over its real tokens); kf is None when k is None.
    """
    B, H, S, D = q.shape
    if k is not None and k.shape != q.shape:
        raise ValueError(f"k has shape {tuple(k.shape)}; expected q's shape {tuple(q.shape)}.")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two >= 16 for the Triton TripPool kernel.")
    N = math.ceil(S / block)
    n = N if num_tiles is None else int(num_tiles)
    if not 0 < n <= N:
        raise ValueError(f"num_tiles={num_tiles} must lie in [1, {N}] for S={S}, block={block}.")
    qf = torch.empty(B, H, n, 3 * D, dtype=torch.float32, device=q.device)
    kf = torch.empty_like(qf) if k is not None else qf
    kk = k if k is not None else q
    block_d = triton.next_power_of_2(D)
    if chunk is None:       # 3 fp32 accumulators of CHUNK x BLOCK_D per program
        chunk = max(1, min(block, (2048 if block_d <= 64 else 1024) // block_d))
    _trippool_kernel[(n, B * H, 2 if k is not None else 1)](
        q, kk, qf, kf,
        *q.stride(), *kk.stride(), *qf.stride(),
        H, S,
        BLOCK=block, D=D, BLOCK_D=block_d, CHUNK=chunk,
        num_warps=num_warps, **COMPILE_OPTIONS,
    )
    return qf, (kf if k is not None else None)


# ---------------------------------------------------------------------------------------------------
# Teacher: heat[i, j] = max_{r in tile i, c in tile j} exp(q_r.k_c*scale - lse_r), no P.V, no S x S.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _qk_tile(q, K_base, stride_ks, stride_kd, j, Sk, cols_d,
             BLOCK_N: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr):
    """Logits (in log2 units when q was pre-scaled) of q [BLOCK_M, D] against key tile j; -inf past Sk."""
    kcols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = kcols < Sk
    kt = tl.load(K_base + cols_d[:, None] * stride_kd + kcols[None, :].to(tl.int64) * stride_ks,
                 mask=kmask[None, :], other=0.0)
    if UPCAST:
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    return tl.where(kmask[None, :], s, float("-inf"))


@triton.jit
def _teacher_kernel(
    Q, K, LSE, HEAT,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_lb, stride_lh, stride_ls,
    stride_hb, stride_hh, stride_hm, stride_hn,
    H, S, Sk, NK_ALL, NK_OUT, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    HAS_LSE: tl.constexpr, UPCAST: tl.constexpr,
):
    """grid = (num query tiles, B*H). Pass 1 (unless HAS_LSE): row LSE over all NK_ALL key tiles
    (QK only, online, log2 units). Pass 2: heat over the first NK_OUT key tiles."""
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < S
    cols_d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None].to(tl.int64) * stride_qs
                + cols_d[None, :] * stride_qd, mask=rmask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    K_base = K + b * stride_kb + h * stride_kh
    if HAS_LSE:
        lse = tl.load(LSE + b * stride_lb + h * stride_lh + rows.to(tl.int64) * stride_ls, mask=rmask, other=0.0)
        lse2 = lse * 1.4426950408889634                    # natural log -> log2 units
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        for j in range(0, NK_ALL):
            s = _qk_tile(q, K_base, stride_ks, stride_kd, j, Sk, cols_d, BLOCK_N, D, UPCAST) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m_i = m_new
        lse2 = m_i + tl.log2(l_i)
    lse2 = tl.where(rmask, lse2, float("inf"))             # pad rows never win the max
    H_base = HEAT + b * stride_hb + h * stride_hh + i.to(tl.int64) * stride_hm
    for j in range(0, NK_OUT):
        s = _qk_tile(q, K_base, stride_ks, stride_kd, j, Sk, cols_d, BLOCK_N, D, UPCAST) * qk_scale
        best = tl.max(tl.max(s - lse2[:, None], 1), 0)
        tl.store(H_base + j * stride_hn, tl.exp2(best))


@on_input_device
def teacher_heat_triton(q: torch.Tensor, k: torch.Tensor, block: int, *, lse: torch.Tensor | None = None,
                        scale: float | None = None, num_tiles: int | None = None) -> torch.Tensor:
    """Teacher tile scores in one fused kernel (see `videosparse.veda.teacher.teacher_heat`).

    Args:
        q: [B, H, S, D]; k: [B, H, Sk, D]; fp32/fp16/bf16, D a power of two in [16, 256].
        block: tokens per tile (query and key), a power of two >= 16.
        lse: optional fp32 [B, H, S] natural-log row LSE of the dense attention; computed in the
            kernel (a QK-only first pass) when None.
        scale: softmax scale, default 1/sqrt(D).
        num_tiles: heat for the first `num_tiles` query and key tiles only (e.g. the video tiles);
            the LSE still runs over all keys.

    Returns:
        fp32 [B, H, n, n] heat in (0, 1].
    """
    B, H, S, D = q.shape
    Sk = k.shape[2]
    if k.shape[:2] != q.shape[:2] or k.shape[3] != D:
        raise ValueError(f"k has shape {tuple(k.shape)}; expected ({B}, {H}, Sk, {D}).")
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"head dim D={D} must be a power of two in [16, 256] for the Triton teacher kernel.")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two >= 16 for the Triton teacher kernel.")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    Nk = math.ceil(Sk / block)
    n = teacher_num_tiles(S, Sk, block, num_tiles)
    if lse is not None and tuple(lse.shape) != (B, H, S):
        raise ValueError(f"lse has shape {tuple(lse.shape)}; expected ({B}, {H}, {S}).")
    heat = torch.empty(B, H, n, n, dtype=torch.float32, device=q.device)
    lse_arg = lse.float() if lse is not None else heat
    lse_strides = lse_arg.stride() if lse is not None else (0, 0, 0)
    upcast = _interpreting() or q.dtype == torch.float32
    _teacher_kernel[(n, B * H)](
        q, k, lse_arg, heat,
        *q.stride(), *k.stride(), *lse_strides, *heat.stride(),
        H, S, Sk, Nk, n, scale * LOG2E,
        BLOCK_M=block, BLOCK_N=block, D=D, HAS_LSE=lse is not None, UPCAST=upcast,
        num_warps=8 if block * D >= 128 * 128 else 4, num_stages=2, **COMPILE_OPTIONS,
    )
    return heat


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time compile for sm_90 (works on a CPU-only machine): for CI checks of the generated code.
# ---------------------------------------------------------------------------------------------------


def compile_for_sm90(kernel: str, *, head_dim: int = 128, block: int = 128, dtype: str = "bf16",
                     has_lse: bool = False, seq_len: int = 75600, heads: int = 40):
    """Compile `kernel` ("trippool" or "teacher") for sm_90 as a launch on contiguous [1, heads, seq_len,
    head_dim] tensors would (`kernels._triton_utils.launch_signature`: Triton's own specialization of the
    argument values, e.g. unit strides folded in and multiples of 16 marked).
    Returns the `CompiledKernel` (`.asm["ptx"]`, `.metadata`).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..kernels._triton_utils import launch_signature, stride_arg_names

    ptr = "*" + dtype
    S, D = seq_len, head_dim
    n = math.ceil(S / block)
    qk_strides = (heads * S * D, S * D, D, 1) * 2
    if kernel == "trippool":
        fn = _trippool_kernel
        pointers = dict(Q=ptr, K=ptr, QF="*fp32", KF="*fp32")
        strides = qk_strides + (heads * n * 3 * D, n * 3 * D, 3 * D, 1)
        values = dict(zip(stride_arg_names(fn), strides), H=heads, S=S)
        constants = dict(BLOCK=block, D=D, BLOCK_D=triton.next_power_of_2(D),
                         CHUNK=max(1, min(block, 2048 // triton.next_power_of_2(D))))
        options = dict(num_warps=4)
    elif kernel == "teacher":
        fn = _teacher_kernel
        pointers = dict(Q=ptr, K=ptr, LSE="*fp32", HEAT="*fp32")
        lse_strides = (heads * S, S, 1) if has_lse else (0, 0, 0)
        strides = qk_strides + lse_strides + (heads * n * n, n * n, n, 1)
        values = dict(zip(stride_arg_names(fn), strides), H=heads, S=S, Sk=S, NK_ALL=n, NK_OUT=n, qk_scale=0.125)
        constants = dict(BLOCK_M=block, BLOCK_N=block, D=D, HAS_LSE=has_lse, UPCAST=False)
        options = dict(num_warps=8 if block * D >= 128 * 128 else 4, num_stages=2)
    else:
        raise ValueError(f"kernel={kernel!r} must be 'trippool' or 'teacher'.")
    signature, constants, attrs = launch_signature(fn.arg_names, pointers, values, constants)
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(options, **COMPILE_OPTIONS))
