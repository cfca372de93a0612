"""Triton kernel: Wan's interleaved RoPE fused with the gather into tile order (see `videosparse.rope`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 64   # tokens per program


@triton.jit
def _rope_gather_kernel(
    x_ptr, perm_ptr, cos_ptr, sin_ptr, out_ptr,
    S, perm_stride_h, stride_xb, stride_xs, stride_xh, stride_cs, stride_ss,
    HALF: tl.constexpr, BLOCK: tl.constexpr,
):
    # program (token block, head, batch): out[b, h, t] = rope(x[b, perm[h, t], h]) for BLOCK positions t
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    H = tl.num_programs(1)
    t = pid_t * BLOCK + tl.arange(0, BLOCK)
    valid = t < S
    src = tl.load(perm_ptr + h * perm_stride_h + t, mask=valid, other=0).to(tl.int64)
    pair = 2 * tl.arange(0, HALF)
    m = valid[:, None]
    x_row = x_ptr + b.to(tl.int64) * stride_xb + src[:, None] * stride_xs + h * stride_xh + pair[None, :]
    x1 = tl.load(x_row, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + 1, mask=m, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + src[:, None] * stride_cs + pair[None, :], mask=m, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + src[:, None] * stride_ss + pair[None, :] + 1, mask=m, other=0.0).to(tl.float32)
    out_row = out_ptr + ((b.to(tl.int64) * H + h) * S + t[:, None]) * (2 * HALF) + pair[None, :]
    tl.store(out_row, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(out_row + 1, (x1 * sin + x2 * cos).to(out_ptr.dtype.element_ty), mask=m)


def rope_gather_triton(x: torch.Tensor, perm: torch.Tensor, freqs_cos: torch.Tensor,
                       freqs_sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D], perm int64 [S] or [H, S], freqs [1, S, 1, D] -> RoPE(x) [B, H, S, D] in tile order."""
    B, S, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if perm.dim() == 1 and perm.shape[0] == S:
        perm_stride_h = 0
    elif perm.shape == (H, S):
        perm_stride_h = S
    else:
        raise ValueError(f"perm has shape {tuple(perm.shape)}; expected ({S},) or ({H}, {S}).")
    perm = perm.contiguous()
    cos = freqs_cos.reshape(S, D)
    sin = freqs_sin.reshape(S, D)
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    out = torch.empty((B, H, S, D), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(S, BLOCK_T), H, B)
    _rope_gather_kernel[grid](
        x, perm, cos, sin, out,
        S, perm_stride_h, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), sin.stride(0),
        HALF=D // 2, BLOCK=BLOCK_T, num_warps=4,
    )
    return out
