"""Triton kernel: Wan's interleaved RoPE fused with the gather into tile order (see `videosparse.rope`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32   # tokens per program; each program walks every head of its tokens


@triton.jit
def _rotation_tables(cos_ptr, sin_ptr, src, stride_cs, stride_ss, m, D: tl.constexpr):
    """cos[src, 2i] and sin[src, 2i+1] as fp32 [BLOCK, D/2] (full rows loaded, then de-interleaved)."""
    d = tl.arange(0, D)
    cos = tl.load(cos_ptr + src[:, None] * stride_cs + d[None, :], mask=m, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + src[:, None] * stride_ss + d[None, :], mask=m, other=0.0).to(tl.float32)
    c_even, _ = tl.split(tl.reshape(cos, [cos.shape[0], D // 2, 2]))
    _, s_odd = tl.split(tl.reshape(sin, [sin.shape[0], D // 2, 2]))
    return c_even, s_odd


@triton.jit
def _rope_gather_kernel(
    x_ptr, perm_ptr, cos_ptr, sin_ptr, out_ptr,
    S, H, perm_stride_h, stride_xb, stride_xs, stride_xh, stride_cs, stride_ss,
    D: tl.constexpr, BLOCK: tl.constexpr, PER_HEAD: tl.constexpr,
):
    # program (token block, batch): out[b, h, t] = rope(x[b, perm[h, t], h]) for BLOCK positions t, every h.
    # Rows are read and written whole (coalesced); the pairs are split and re-joined in registers.
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    t = pid_t * BLOCK + tl.arange(0, BLOCK)
    valid = t < S
    m = valid[:, None]
    d = tl.arange(0, D)
    if not PER_HEAD:   # one order for all heads: tables loaded once per token block
        src = tl.load(perm_ptr + t, mask=valid, other=0).to(tl.int64)
        c, s = _rotation_tables(cos_ptr, sin_ptr, src, stride_cs, stride_ss, m, D)
    for h in range(H):
        if PER_HEAD:
            src = tl.load(perm_ptr + h * perm_stride_h + t, mask=valid, other=0).to(tl.int64)
            c, s = _rotation_tables(cos_ptr, sin_ptr, src, stride_cs, stride_ss, m, D)
        x = tl.load(x_ptr + b * stride_xb + src[:, None] * stride_xs + h * stride_xh + d[None, :],
                    mask=m, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [BLOCK, D // 2, 2]))
        out = tl.reshape(tl.join(x1 * c - x2 * s, x1 * s + x2 * c), [BLOCK, D])
        tl.store(out_ptr + ((b * H + h) * S + t[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=m)


def rope_gather_triton(x: torch.Tensor, perm: torch.Tensor, freqs_cos: torch.Tensor,
                       freqs_sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D], perm int64 [S] or [H, S], freqs [1, S, 1, D] -> RoPE(x) [B, H, S, D] in tile order."""
    B, S, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    per_head = perm.dim() == 2
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
    grid = (triton.cdiv(S, BLOCK_T), B)
    _rope_gather_kernel[grid](
        x, perm, cos, sin, out,
        S, H, perm_stride_h, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), sin.stride(0),
        D=D, BLOCK=BLOCK_T, PER_HEAD=per_head, num_warps=4,
    )
    return out
