"""Rotary embeddings, alone and fused with the tile-order gather.

Four styles. Wan's interleaved RoPE, given as a plain tuple of tables (freqs_cos, freqs_sin):
`apply_interleaved_rope` is the math of diffusers' `WanAttnProcessor` (pairs (x[2i], x[2i+1]) rotated by
cos[2i] / sin[2i+1]). Rotate-half RoPE (Cosmos, Qwen-style mRoPE), given as `HalfRope(cos, sin)`:
x * cos + rotate_half(x) * sin with rotate_half(x) = [-x[D/2:], x[:D/2]] (`apply_half_rope`; with `sections` that in
each of equal parts of D, Allegro's t / h / w channels). diffusers'
`apply_rotary_emb(use_real=True)` with pairs (HunyuanVideo, CogVideoX, EasyAnimate), given as `PairRope(cos, sin,
start)`: x * cos + [-x[2i+1], x[2i]] * sin on the rows [start, start + len(cos)) only (the video rows of a joint
[video; text] or [text; video] sequence; the text rows are not rotated). Angles per pair (Mochi's per head,
Kandinsky's 2 x 2 rotations shared by the heads), given as `HeadPairRope(cos, sin)` [R, H or 1, D/2]: pair i of head
h of row r rotated by (cos, sin)[r, h, i], rows [0, R) only (`apply_head_pair_rope`).

`apply_rope` takes any of them; the dense path and every fallback use it. `rope_gather` is the same rotation fused
with the token gather of a `TileLayout`: one Triton pass reads x (B, S, H, D) in diffusers' order and writes RoPE(x)
(B, H, S, D) in tile order, computing in fp32 and rounding once; it can also repeat grouped-query KV heads (`groups`).
In eager mode it replaces about a dozen elementwise kernels per tensor (the stock RoPE builds several full-size
temporaries in the dtype of the rotary table) plus the gather's own copy; under torch.compile Inductor fuses the torch
form itself, so the fused kernel is not used there.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from ._autodiff import carries_tangent
from ._helper_backend import check_backend, use_triton
from .validation import int_at_least

def apply_interleaved_rope(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved RoPE on x [B, S, H, D], exactly as `WanAttnProcessor` applies it.

    Args:
        x: [B, S, H, D].
        freqs_cos, freqs_sin: broadcastable to [B, S, H, D] (Wan's are [1, S, 1, D]), any float dtype.
    """
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class HalfRope(NamedTuple):
    """Rotate-half rotary tables cos, sin, broadcastable to x [B, S, H, D] ([1, S, 1, D] for the fused gather); with
    `sections` > 1 each of that many equal parts of D is rotated on its own (Allegro: t, h, w)."""

    cos: torch.Tensor
    sin: torch.Tensor
    sections: int = 1


def apply_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sections: int = 1) -> torch.Tensor:
    """Rotate-half RoPE on x [B, S, H, D]: x * cos + [-x[D/2:], x[:D/2]] * sin (as Cosmos 3's processor), or that in
    each of `sections` equal parts of D (as diffusers' `apply_rotary_emb_allegro`, sections=3)."""
    if isinstance(sections, bool) or not isinstance(sections, int) or sections < 1:
        raise ValueError(f"sections={sections!r} must be an int >= 1 (equal parts of the head dim rotated apart).")
    if sections > 1:
        if x.shape[-1] % (2 * sections):
            raise ValueError(f"sections={sections} does not split head dim {x.shape[-1]} into equal even parts.")
        parts = zip(x.chunk(sections, -1), cos.chunk(sections, -1), sin.chunk(sections, -1))
        return torch.cat([apply_half_rope(*part) for part in parts], dim=-1)
    half = x.shape[-1] // 2
    return (x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin).type_as(x)


_MOVED_TABLES: list = [None]   # the last tables moved: (weak refs to them, device, their versions, the copies)


def tables_on(tables: tuple[torch.Tensor, ...], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """`tables` on `device`. A model that builds its RoPE tables on the CPU (EasyAnimate) passes the same tensors to
    every layer of a forward, and diffusers copies them to the GPU in every layer, a host sync each; here one
    asynchronous copy serves while the same, unmodified tensors come back (the next forward's tables are copied
    again). Inference tensors (tables built under `torch.inference_mode`) have no version counter: they match by
    identity alone (outside inference mode they cannot change in place)."""
    device = torch.device(device)
    if all(t.device == device for t in tables):
        return tables
    if torch.compiler.is_compiling():
        return tuple(t.to(device) for t in tables)
    key = tuple(None if t.is_inference() else t._version for t in tables)
    cached = _MOVED_TABLES[0]
    if (cached is not None and cached[1] == device and len(cached[0]) == len(tables)
            and all(ref() is t for ref, t in zip(cached[0], tables)) and cached[2] == key):
        return cached[3]
    # to a GPU from pageable memory: staged, no stream sync; to the CPU a non-blocking copy could be read too early
    moved = tuple(t.to(device, non_blocking=device.type == "cuda") for t in tables)
    _MOVED_TABLES[0] = (tuple(weakref.ref(t) for t in tables), device, key, moved)
    return moved


class PairRope(NamedTuple):
    """diffusers' `apply_rotary_emb(use_real=True)` tables cos, sin [R, D] (pairs (x[2i], x[2i+1]), any float dtype)
    for the rows [start, start + R) of x [B, S, H, D]; the other rows are not rotated."""

    cos: torch.Tensor
    sin: torch.Tensor
    start: int = 0


def apply_pair_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int = 0) -> torch.Tensor:
    """diffusers' `apply_rotary_emb(..., sequence_dim=1)` on the rows [start, start + len(cos)) of x [B, S, H, D],
    the other rows as they are (bit-equal to the stock processors that rotate only their video rows)."""
    from diffusers.models.embeddings import apply_rotary_emb

    stop = start + cos.shape[0]
    if start < 0 or stop > x.shape[1]:
        raise ValueError(f"PairRope covers rows [{start}, {stop}) but x has {x.shape[1]} rows.")
    rotated = apply_rotary_emb(x[:, start:stop], (cos, sin), sequence_dim=1)
    if start == 0 and stop == x.shape[1]:
        return rotated
    return torch.cat([x[:, :start], rotated, x[:, stop:]], dim=1)


class HeadPairRope(NamedTuple):
    """Rotary angles per pair, cos, sin [R, H, D/2] (Mochi's, one set per head; fp32) or [R, 1, D/2] (Kandinsky's 2 x 2
    rotations, shared by the heads), for the rows [0, R) of x [B, S, H, D]: pair (x[2i], x[2i+1]) of head h rotated by
    (cos, sin)[row, h, i]; the other rows are not rotated."""

    cos: torch.Tensor
    sin: torch.Tensor


def apply_head_pair_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Angles per pair on the first cos.shape[0] rows of x [B, S, H, D], as the stock `MochiAttnProcessor2_0`
    rotates (its helper is local to its `__call__`; Kandinsky's 2 x 2 rotations give the same bits): each pair rotated
    in fp32, each rotated half rounded to x's dtype, the pairs interleaved back; the other rows as they are."""
    rows = cos.shape[0]
    if rows > x.shape[1]:
        raise ValueError(f"HeadPairRope covers rows [0, {rows}) but x has {x.shape[1]} rows.")
    pairs = x[:, :rows].float().unflatten(-1, (-1, 2))
    first, second = pairs[..., 0], pairs[..., 1]
    rotated = (first * cos - second * sin).to(x.dtype), (first * sin + second * cos).to(x.dtype)
    rotated = torch.stack(rotated, dim=-1).flatten(-2)
    return rotated if rows == x.shape[1] else torch.cat([rotated, x[:, rows:]], dim=1)


def apply_rope(x: torch.Tensor, rope) -> torch.Tensor:
    """x [B, S, H, D] rotated by `rope`: a `HalfRope`, a `PairRope`, a `HeadPairRope`, or Wan's interleaved tables
    (freqs_cos, freqs_sin)."""
    if isinstance(rope, HalfRope):
        return apply_half_rope(x, *rope)
    if isinstance(rope, PairRope):
        return apply_pair_rope(x, *rope)
    if isinstance(rope, HeadPairRope):
        return apply_head_pair_rope(x, *rope)
    return apply_interleaved_rope(x, *rope)


def _tables(rope) -> tuple[str, torch.Tensor, torch.Tensor, int, int]:
    """(style, cos, sin, first rotated row, sections) of `rope`; cos / sin as given (their shape checked by
    `_fused_reason`)."""
    if isinstance(rope, HalfRope):
        return "half", rope.cos, rope.sin, 0, rope.sections
    if isinstance(rope, PairRope):
        return "pairs", rope.cos, rope.sin, rope.start, 1
    if isinstance(rope, HeadPairRope):
        return "head_pairs", rope.cos, rope.sin, 0, 1
    freqs_cos, freqs_sin = rope
    return "interleaved", freqs_cos, freqs_sin, 0, 1


def _fused_reason(x: torch.Tensor, style: str, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
                  start: int, sections: int = 1) -> str | None:
    """Why the fused kernel cannot take these inputs (None: it can). Tables: [1, S, 1, D] (Wan's, `HalfRope`),
    [R, D] with start + R <= S (`PairRope`) or [R, H or 1, D/2] with R <= S (`HeadPairRope`)."""
    B, S, H, D = x.shape
    half = D // 2
    if x.requires_grad and torch.is_grad_enabled():
        return "autograd records x and the fused kernel has no backward pass (the torch path has one)"
    if type(x) is not torch.Tensor:
        return f"x is a {type(x).__name__} (a tensor subclass, e.g. quantized activations), not a plain tensor"
    if carries_tangent(x, freqs_cos, freqs_sin):
        return "forward-mode AD gives x or the tables a tangent, which the fused kernel would drop (the torch path " \
            "carries it)"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"x is {x.dtype}; the fused kernel computes in fp32 and takes fp16, bf16 or fp32"
    if isinstance(sections, bool) or not isinstance(sections, int) or sections < 1 or D % (2 * sections):
        return f"sections={sections!r} does not split head dim {D} into equal parts of even width"
    part = D // sections // 2
    if part < 1 or part & (part - 1):
        return (f"head dim {D} is not twice a power of two" if sections == 1 else
                f"head dim {D} in {sections} sections is not {sections} x twice a power of two")
    for name, f in (("freqs_cos", freqs_cos), ("freqs_sin", freqs_sin)):
        if style == "pairs":
            if f.dim() != 2 or f.shape[1] != D or start < 0 or start + f.shape[0] > S:
                return f"{name} has shape {tuple(f.shape)}, not (R, {D}) with {start} + R <= {S}"
        elif style == "head_pairs":
            if f.dim() != 3 or f.shape[0] > S or f.shape[1] not in (1, H) or f.shape[2] != half:
                return f"{name} has shape {tuple(f.shape)}, not (R, {H} or 1, {half}) with R <= {S}"
        elif f.dim() != 4 or f.shape[0] != 1 or f.shape[1] != S or f.shape[2] != 1 or f.shape[3] != D:
            return f"{name} has shape {tuple(f.shape)}, not (1, {S}, 1, {D})"
        if f.device != x.device:
            return f"{name} is on {f.device}, x on {x.device}"
    return None


def check_groups(groups) -> int:
    """`groups` (output heads per head of x, grouped-query KV heads) as a Python int >= 1 (numpy and 0-dim torch
    integers taken), else a ValueError naming it."""
    return int_at_least(groups, 1, "groups", "output heads per head of x")


def rope_gather(x: torch.Tensor, perm: torch.Tensor, rope, *, backend: str = "auto",
                groups: int = 1) -> torch.Tensor | None:
    """RoPE(x) in tile order, in one pass; None when the fused kernel does not apply (the caller falls back).

    Args:
        x: [B, S, H, D] (any strides with a unit last dim), fp32/fp16/bf16.
        perm: int64 [S] (one order for all heads) or [H * groups, S] (one per output head): tile position -> token.
        rope: Wan's interleaved tables (freqs_cos, freqs_sin) [1, S, 1, D], a `HalfRope` [1, S, 1, D], a
            `PairRope` [R, D] or a `HeadPairRope` [R, H or 1, D/2] (see `apply_rope`).
        backend: "auto" (the Triton kernel on CUDA in eager mode, else None), "triton" (also on CPU
            under TRITON_INTERPRET=1; a clear error when the inputs do not fit) or "torch" (None).
        groups: output heads per head of x (grouped-query KV heads repeated: output head h reads x's h // groups).

    Returns:
        [B, H * groups, S, D] contiguous in x's dtype, or None.
    """
    check_backend(backend, "rope_gather")
    groups = check_groups(groups)
    if backend == "torch" or (backend == "auto" and (not x.is_cuda or torch.compiler.is_compiling()
                                                     or x.stride(-1) != 1)):
        return None
    style, freqs_cos, freqs_sin, start, sections = _tables(rope)
    reason = _fused_reason(x, style, freqs_cos, freqs_sin, start, sections)
    if not use_triton(x, backend, [reason] if reason else [], what="rope_gather"):
        return None
    from .kernels.triton_rope_gather import rope_gather_triton

    return rope_gather_triton(x, perm, freqs_cos, freqs_sin, style=style, start=start, groups=groups,
                              sections=sections)
