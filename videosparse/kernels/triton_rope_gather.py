"""Triton kernel: RoPE (Wan's interleaved pairs, or rotate-half) fused with the gather into tile order, optionally
repeating grouped-query KV heads (see `videosparse.rope`)."""

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
def _half_tables(cos_ptr, sin_ptr, src, stride_cs, stride_ss, m, D: tl.constexpr):
    """cos and sin rows of tokens `src`, each as its two halves: fp32 [BLOCK, D/2] x 4 (cos lo, cos hi, sin lo, hi)."""
    dh = tl.arange(0, D // 2)
    c_row = cos_ptr + src[:, None] * stride_cs + dh[None, :]
    s_row = sin_ptr + src[:, None] * stride_ss + dh[None, :]
    c1 = tl.load(c_row, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + D // 2, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(s_row, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + D // 2, mask=m, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rope_gather_kernel(
    x_ptr, perm_ptr, cos_ptr, sin_ptr, out_ptr,
    S, H, perm_stride_h, stride_xb, stride_xs, stride_xh, stride_cs, stride_ss, GROUPS,
    D: tl.constexpr, BLOCK: tl.constexpr, PER_HEAD: tl.constexpr, HALF: tl.constexpr,
):
    # program (token block, batch): out[b, h, t] = rope(x[b, perm[h, t], h // GROUPS]) for BLOCK positions t, every
    # output head h. Interleaved: the pairs (2i, 2i + 1) are split and re-joined in registers, rows read and written
    # whole (coalesced); rotate-half: the two halves are loaded and stored separately.
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    t = pid_t * BLOCK + tl.arange(0, BLOCK)
    valid = t < S
    m = valid[:, None]
    d = tl.arange(0, D)
    dh = tl.arange(0, D // 2)
    if not PER_HEAD:   # one order for all heads: tables loaded once per token block
        src = tl.load(perm_ptr + t, mask=valid, other=0).to(tl.int64)
        if HALF:
            c1, c2, s1, s2 = _half_tables(cos_ptr, sin_ptr, src, stride_cs, stride_ss, m, D)
        else:
            c, s = _rotation_tables(cos_ptr, sin_ptr, src, stride_cs, stride_ss, m, D)
    for h in range(H):
        if PER_HEAD:
            src = tl.load(perm_ptr + h * perm_stride_h + t, mask=valid, other=0).to(tl.int64)
            if HALF:
                c1, c2, s1, s2 = _half_tables(cos_ptr, sin_ptr, src, stride_cs, stride_ss, m, D)
            else:
                c, s = _rotation_tables(cos_ptr, sin_ptr, src, stride_cs, stride_ss, m, D)
        x_row = x_ptr + b * stride_xb + src[:, None] * stride_xs + (h // GROUPS) * stride_xh
        out_row = out_ptr + ((b * H + h) * S + t[:, None]) * D
        if HALF:
            x1 = tl.load(x_row + dh[None, :], mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(x_row + D // 2 + dh[None, :], mask=m, other=0.0).to(tl.float32)
            tl.store(out_row + dh[None, :], (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=m)
            tl.store(out_row + D // 2 + dh[None, :], (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=m)
        else:
            x = tl.load(x_row + d[None, :], mask=m, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, [BLOCK, D // 2, 2]))
            out = tl.reshape(tl.join(x1 * c - x2 * s, x1 * s + x2 * c), [BLOCK, D])
            tl.store(out_row + d[None, :], out.to(out_ptr.dtype.element_ty), mask=m)


def rope_gather_triton(x: torch.Tensor, perm: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
                       half: bool = False, groups: int = 1) -> torch.Tensor:
    """x [B, S, Hx, D], perm int64 [S] or [Hx * groups, S], freqs [1, S, 1, D] -> RoPE(x) [B, Hx * groups, S, D] in
    tile order; output head h reads x's head h // groups. half: rotate-half RoPE, else Wan's interleaved pairs."""
    B, S, Hx, D = x.shape
    H = Hx * groups
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
        S, H, perm_stride_h, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), sin.stride(0), groups,
        D=D, BLOCK=BLOCK_T, PER_HEAD=per_head, HALF=half, num_warps=4,
    )
    return out
