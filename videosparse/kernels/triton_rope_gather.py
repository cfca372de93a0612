"""Triton kernel: RoPE (Wan's interleaved pairs, rotate-half, diffusers' `apply_rotary_emb` pairs or Mochi's per-head
pairs, on a range of rows) fused with the gather into tile order, optionally repeating grouped-query KV heads (see
`videosparse.rope`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import COMPILE_OPTIONS, on_input_device

BLOCK_T = 32   # tokens per program; each program walks every head of its tokens


def launch_warps(D: int, sections: int = 1) -> int:
    """Warps per program: 8 elements (16 bytes) per thread of a [BLOCK_T, half a section] tile, at most 4 (Allegro's
    sections of 32 give 2)."""
    return max(1, min(4, BLOCK_T * (D // sections // 2) // 256))


# STYLE: how a row is rotated (see `videosparse.rope`)
INTERLEAVED = tl.constexpr(0)   # Wan's pairs: cos[2i], sin[2i + 1] for both members of pair i
HALF = tl.constexpr(1)          # rotate-half: x * cos + [-x[D/2:], x[:D/2]] * sin (in each of SECTIONS parts of D)
PAIRS = tl.constexpr(2)         # diffusers' apply_rotary_emb(use_real=True): x * cos + [-x[2i+1], x[2i]] * sin
HEAD_PAIRS = tl.constexpr(3)    # Mochi's, Kandinsky's: pair i of head h rotated by (cos, sin)[row, h or 0, i]
STYLES = {"interleaved": INTERLEAVED.value, "half": HALF.value, "pairs": PAIRS.value, "head_pairs": HEAD_PAIRS.value}


@triton.jit
def _pair_tables(cos_ptr, sin_ptr, row, stride_cs, stride_ss, m, D: tl.constexpr, STYLE: tl.constexpr):
    """The tables of pairs (2i, 2i + 1) at table rows `row`, fp32 [BLOCK, D/2] x 4: (cos even, cos odd, sin even,
    sin odd); Wan's interleaved style reads cos[2i] and sin[2i + 1] for both members of a pair. Rows outside `m` get
    cos 1, sin 0 (not rotated)."""
    d = tl.arange(0, D)
    cos = tl.load(cos_ptr + row[:, None] * stride_cs + d[None, :], mask=m, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + row[:, None] * stride_ss + d[None, :], mask=m, other=0.0).to(tl.float32)
    c_even, c_odd = tl.split(tl.reshape(cos, [cos.shape[0], D // 2, 2]))
    s_even, s_odd = tl.split(tl.reshape(sin, [sin.shape[0], D // 2, 2]))
    if STYLE == INTERLEAVED:
        return c_even, c_even, s_odd, s_odd
    return c_even, c_odd, s_even, s_odd


@triton.jit
def _head_pair_tables(cos_ptr, sin_ptr, row, stride_cs, stride_ss, m, D: tl.constexpr):
    """One angle per pair at table rows `row` (the head's tables): fp32 [BLOCK, D/2] x 4 as `_pair_tables` gives
    them (cos, cos, sin, sin); rows outside `m` get cos 1, sin 0."""
    dh = tl.arange(0, D // 2)
    cos = tl.load(cos_ptr + row[:, None] * stride_cs + dh[None, :], mask=m, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + row[:, None] * stride_ss + dh[None, :], mask=m, other=0.0).to(tl.float32)
    return cos, cos, sin, sin


@triton.jit
def _half_tables(cos_ptr, sin_ptr, row, stride_cs, stride_ss, m, D: tl.constexpr):
    """cos and sin at table rows `row`, each as its two halves: fp32 [BLOCK, D/2] x 4 (cos lo, cos hi, sin lo, hi);
    rows outside `m` get cos 1, sin 0."""
    dh = tl.arange(0, D // 2)
    c_row = cos_ptr + row[:, None] * stride_cs + dh[None, :]
    s_row = sin_ptr + row[:, None] * stride_ss + dh[None, :]
    c1 = tl.load(c_row, mask=m, other=1.0).to(tl.float32)
    c2 = tl.load(c_row + D // 2, mask=m, other=1.0).to(tl.float32)
    s1 = tl.load(s_row, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + D // 2, mask=m, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _tables(cos_ptr, sin_ptr, src, valid, rot_start, rot_rows, stride_cs, stride_ss, D: tl.constexpr,
            STYLE: tl.constexpr):
    """The four fp32 [BLOCK, D/2] tables of tokens `src` (`_pair_tables`, `_head_pair_tables` or `_half_tables`);
    table row src - rot_start for the rotated rows [rot_start, rot_start + rot_rows), identity elsewhere."""
    row = src - rot_start
    rotated = valid & (row >= 0) & (row < rot_rows)
    row = tl.where(rotated, row, 0)
    m = rotated[:, None]
    if STYLE == HEAD_PAIRS:
        return _head_pair_tables(cos_ptr, sin_ptr, row, stride_cs, stride_ss, m, D)
    if STYLE == HALF:
        return _half_tables(cos_ptr, sin_ptr, row, stride_cs, stride_ss, m, D)
    return _pair_tables(cos_ptr, sin_ptr, row, stride_cs, stride_ss, m, D, STYLE)


@triton.jit
def _rope_gather_kernel(
    x_ptr, perm_ptr, cos_ptr, sin_ptr, out_ptr,
    S, H, perm_stride_h, stride_xb, stride_xs, stride_xh, stride_cs, stride_ss, stride_ch, GROUPS, rot_start,
    rot_rows, D: tl.constexpr, BLOCK: tl.constexpr, PER_HEAD: tl.constexpr, STYLE: tl.constexpr,
    SECTIONS: tl.constexpr = 1,
):
    # program (token block, batch): out[b, h, t] = rope(x[b, perm[h, t], h // GROUPS]) for BLOCK positions t, every
    # output head h. Pairs (interleaved, PAIRS, HEAD_PAIRS): split and re-joined in registers, rows read and written
    # whole (coalesced); rotate-half: the two halves of each of the SECTIONS parts of D (Allegro: 3, its t / h / w
    # channels) are loaded and stored separately. HEAD_PAIRS tables have one head per head of x (stride_ch), or one
    # for all (stride_ch 0).
    DS: tl.constexpr = D // SECTIONS
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    t = pid_t * BLOCK + tl.arange(0, BLOCK)
    valid = t < S
    m = valid[:, None]
    if not PER_HEAD:   # one order for all heads
        src = tl.load(perm_ptr + t, mask=valid, other=0).to(tl.int64)
        if STYLE != HEAD_PAIRS and SECTIONS == 1:   # tables shared by the heads: loaded once per token block
            c1, c2, s1, s2 = _tables(cos_ptr, sin_ptr, src, valid, rot_start, rot_rows, stride_cs, stride_ss, D,
                                     STYLE)
    for h in range(H):
        if PER_HEAD:
            src = tl.load(perm_ptr + h * perm_stride_h + t, mask=valid, other=0).to(tl.int64)
        if (PER_HEAD or STYLE == HEAD_PAIRS) and SECTIONS == 1:
            th = (h // GROUPS) * stride_ch
            c1, c2, s1, s2 = _tables(cos_ptr + th, sin_ptr + th, src, valid, rot_start, rot_rows, stride_cs,
                                     stride_ss, D, STYLE)
        x_row = x_ptr + b * stride_xb + src[:, None] * stride_xs + (h // GROUPS) * stride_xh
        out_row = out_ptr + ((b * H + h) * S + t[:, None]) * D
        if STYLE == HALF:
            dh = tl.arange(0, DS // 2)
            if SECTIONS > 1:   # (as `_tables`, clamped: a select or cast of the mask here trips Triton 3.6's sm_90
                row = src - rot_start               # layout passes)
                rotated = (valid & (row >= 0) & (row < rot_rows))[:, None]
                row = tl.minimum(tl.maximum(row, 0), rot_rows - 1)
            for k in tl.static_range(SECTIONS):
                if SECTIONS > 1:    # several tables per row: loaded per section (they stay in L1 / L2)
                    c1, c2, s1, s2 = _half_tables(cos_ptr + k * DS, sin_ptr + k * DS, row, stride_cs, stride_ss,
                                                  rotated, DS)
                lo = k * DS + dh[None, :]
                x1 = tl.load(x_row + lo, mask=m, other=0.0).to(tl.float32)
                x2 = tl.load(x_row + lo + DS // 2, mask=m, other=0.0).to(tl.float32)
                tl.store(out_row + lo, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=m)
                tl.store(out_row + lo + DS // 2, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=m)
        else:   # pairs (x1, x2) = (x[2i], x[2i + 1]); tables (cos even, cos odd, sin even, sin odd)
            d = tl.arange(0, D)
            x = tl.load(x_row + d[None, :], mask=m, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, [BLOCK, D // 2, 2]))
            out = tl.reshape(tl.join(x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), [BLOCK, D])
            tl.store(out_row + d[None, :], out.to(out_ptr.dtype.element_ty), mask=m)


@on_input_device
def rope_gather_triton(x: torch.Tensor, perm: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
                       style: str = "interleaved", start: int = 0, groups: int = 1, sections: int = 1) -> torch.Tensor:
    """x [B, S, Hx, D], perm int64 [S] or [Hx * groups, S], freqs [1, R, 1, D], [R, D] or ([R, Hx or 1, D/2],
    "head_pairs") for the rows [start, start + R) -> RoPE(x) [B, Hx * groups, S, D] in tile order (other rows
    unrotated); output head h reads x's head h // groups. style: "interleaved" (Wan's), "half" (rotate-half), "pairs"
    (diffusers' `apply_rotary_emb`) or "head_pairs" (Mochi's); sections: "half" in each of that many equal parts of
    D."""
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
    head_tables = style == "head_pairs"
    cos = freqs_cos if head_tables else freqs_cos.reshape(-1, D)
    sin = freqs_sin if head_tables else freqs_sin.reshape(-1, D)
    if head_tables and cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    out = torch.empty((B, H, S, D), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(S, BLOCK_T), B)
    _rope_gather_kernel[grid](
        x, perm, cos, sin, out,
        S, H, perm_stride_h, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), sin.stride(0),
        cos.stride(1) if head_tables and cos.shape[1] > 1 else 0, groups, start, cos.shape[0],
        D=D, BLOCK=BLOCK_T, PER_HEAD=per_head, STYLE=STYLES[style], SECTIONS=sections,
        num_warps=launch_warps(D, sections), **COMPILE_OPTIONS,
    )
    return out
