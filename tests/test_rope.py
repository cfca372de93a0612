"""RoPE fused with the tile-order gather (Wan's interleaved, rotate-half, diffusers' pairs on a range of rows): Triton
kernel (interpreter) vs rope-then-gather in torch.

The Triton cases run in one child process under TRITON_INTERPRET=1 (see tests/helpers.py); GPU tests
(marked `gpu`) check a Wan 1.3B-size layer.
"""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import InterpreterCases, interpreter_child

# name: B, grid, tiles (one shape or one per head), H, D, x dtype, freqs dtype, x strided
CASES = {
    "fp32-partial-tiles": (2, (3, 5, 7), (2, 4, 4), 2, 32, "float32", "float64", False),
    "fp16-heads-tiled": (1, (4, 6, 5), ((2, 4, 4), (4, 4, 2), (2, 4, 4)), 3, 64, "float16", "float32", False),
    "fp32-strided-x": (2, (2, 4, 9), (2, 4, 4), 2, 16, "float32", "float32", True),
    "bf16-d128": (1, (3, 4, 6), (2, 4, 4), 2, 128, "bfloat16", "bfloat16", False),
    "half-gqa-heads-tiled": (1, (3, 4, 5), ((2, 4, 4), (4, 4, 2), (2, 4, 4), (4, 4, 2)), 4, 64, "bfloat16", "bfloat16",
                             False),
    "half-strided-x": (2, (2, 4, 9), (2, 4, 4), 2, 32, "float32", "float32", True),
    "interleaved-gqa": (1, (3, 5, 7), (2, 4, 4), 4, 32, "float16", "float32", False),
    "interleaved-any-tables": (2, (3, 5, 7), ((2, 4, 4), (4, 4, 2)), 2, 32, "float32", "float32", False),
    "pairs-text-after": (2, (3, 5, 7), (2, 4, 4), 2, 32, "bfloat16", "float32", False),
    "pairs-text-before-heads-tiled": (1, (4, 6, 5), ((2, 4, 4), (4, 4, 2)), 2, 64, "float16", "float32", True),
    "pairs-all-rows-gqa": (1, (3, 4, 5), (2, 4, 4), 4, 16, "float32", "float64", False),
    "head-pairs-text-after-heads-tiled": (2, (3, 5, 7), ((2, 4, 4), (4, 4, 2)), 2, 32, "bfloat16", "float32", False),
    "head-pairs-gqa-strided-x": (1, (3, 4, 5), (2, 4, 4), 4, 64, "float16", "float32", True),
    "head-pairs-shared-tables": (1, (3, 4, 5), (2, 4, 4), 3, 32, "float32", "float32", False),
    "half-3-sections-d96-heads-tiled": (1, (3, 5, 7), ((2, 4, 4), (4, 4, 2)), 2, 96, "bfloat16", "float32", False),
    "half-3-sections-d48-strided-x": (2, (2, 4, 9), (2, 4, 4), 2, 48, "float32", "float32", True),
}
# name: (style, output heads per head of x, text rows before / after the rotated rows) where not ("interleaved", 1)
VARIANTS = {"half-gqa-heads-tiled": ("half", 2, 0, 0), "half-strided-x": ("half", 1, 0, 0),
            "interleaved-gqa": ("interleaved", 4, 0, 0), "interleaved-any-tables": ("interleaved_any", 1, 0, 0),
            "pairs-text-after": ("pairs", 1, 0, 37),
            "pairs-text-before-heads-tiled": ("pairs", 1, 21, 0), "pairs-all-rows-gqa": ("pairs", 2, 0, 0),
            "head-pairs-text-after-heads-tiled": ("head_pairs", 1, 0, 19),
            "head-pairs-gqa-strided-x": ("head_pairs", 2, 0, 0), "half-3-sections-d96-heads-tiled": ("half3", 1, 0, 0),
            "head-pairs-shared-tables": ("head_pairs_shared", 1, 0, 0),
            "half-3-sections-d48-strided-x": ("half3", 1, 0, 0)}


def _inputs(B, grid, H, D, dtype, fdtype, strided, seed, half=False):
    g = torch.Generator().manual_seed(seed)
    S = grid[0] * grid[1] * grid[2]
    if strided:   # (B, H, S, D) storage viewed as (B, S, H, D): non-contiguous token and head strides
        x = torch.randn(B, H, S, D, generator=g).to(dtype).transpose(1, 2)
    else:
        x = torch.randn(B, S, H, D, generator=g).to(dtype)
    if half:      # any tables: the two halves of a row need not repeat each other (the kernel reads both)
        angle = torch.randn(1, S, 1, D, generator=g, dtype=torch.float64) * 3
        return x, angle.cos().to(fdtype), angle.sin().to(fdtype)
    angle = torch.randn(1, S, 1, D // 2, generator=g, dtype=torch.float64) * 3
    cos = angle.cos().repeat_interleave(2, -1).to(fdtype)    # Wan's tables repeat each frequency twice
    sin = angle.sin().repeat_interleave(2, -1).to(fdtype)
    return x, cos, sin


def _layout(grid, tiles, H):
    from videosparse.layout import head_tiling

    return head_tiling(grid, tiles, H, block=32)


def _pair_inputs(B, grid, H, D, dtype, fdtype, strided, seed, before, after):
    """x [B, before + S + after, H, D] and diffusers-style pair tables [S, D] for its S middle rows: any tables
    (the two members of a pair need not share cos / sin; the kernel reads both)."""
    x, cos, sin = _inputs(B, (1, 1, before + grid[0] * grid[1] * grid[2] + after), H, D, dtype, fdtype, strided, seed,
                          half=True)
    S = grid[0] * grid[1] * grid[2]
    return x, cos[0, before:before + S, 0], sin[0, before:before + S, 0]


def _run_case(name: str) -> dict:
    from videosparse.layout import head_tiling
    from videosparse.rope import HalfRope, HeadPairRope, PairRope, apply_rope, rope_gather

    B, grid, tiles, H, D, dtype, fdtype, strided = CASES[name]
    style, groups, before, after = VARIANTS.get(name, ("interleaved", 1, 0, 0))
    args = (B, grid, H // groups, D, getattr(torch, dtype), getattr(torch, fdtype), strided, sum(map(ord, name)))
    if style == "pairs":
        x, cos, sin = _pair_inputs(*args, before, after)
        rope, tables = PairRope(cos, sin, before), PairRope(cos.float(), sin.float(), before)
        layout = head_tiling(grid, tiles, H, block=32, text_len=before + after,
                             text_position="before" if before else "after")
    elif style in ("head_pairs", "head_pairs_shared"):   # Mochi: one angle per pair and head of x, for the video
        x, _, _ = _pair_inputs(*args, 0, after)            # rows (text after); Kandinsky: [R, 1, D/2], all heads
        # Mutation find: shared tables must be read with head stride 0 (the stride of their size-1 head dim moved
        # head h >= 1 onto another row's angles); every other case had per-head tables
        heads = 1 if style == "head_pairs_shared" else x.shape[2]
        angle = torch.randn(x.shape[1] - after, heads, D // 2, generator=torch.Generator().manual_seed(3)) * 3
        cos, sin = angle.cos().to(getattr(torch, fdtype)), angle.sin().to(getattr(torch, fdtype))
        rope, tables = HeadPairRope(cos, sin), HeadPairRope(cos.float(), sin.float())
        layout = head_tiling(grid, tiles, H, block=32, text_len=after)
    elif style == "half3":         # Allegro: rotate-half in each third of the head dim
        x, cos, sin = _inputs(*args, half=True)
        rope, tables = HalfRope(cos, sin, sections=3), HalfRope(cos.float(), sin.float(), sections=3)
        layout = _layout(grid, tiles, H)
    else:              # "interleaved_any": tables whose two columns of a pair differ (Wan's repeat each value)
        x, cos, sin = _inputs(*args, half=style in ("half", "interleaved_any"))
        rope = HalfRope(cos, sin) if style == "half" else (cos, sin)
        tables = HalfRope(cos.float(), sin.float()) if style == "half" else (cos.float(), sin.float())
        layout = _layout(grid, tiles, H)
    perm = layout.first.indices("cpu")[0] if layout.uniform else layout.head_indices("cpu")[0]
    out = rope_gather(x, perm, rope, backend="triton", groups=groups)
    # reference: the stock math in fp32 (the kernel rounds once at the end), then the torch gather of the repeated heads
    ref = layout.gather(apply_rope(x.float(), tables).repeat_interleave(groups, dim=2))
    err = float((out.float() - ref).norm() / ref.norm())
    S = x.shape[1]
    unrotated = torch.cat([torch.arange(before), torch.arange(S - after, S)])
    kept = layout.scatter(out)[:, unrotated]        # rows outside a PairRope's range: x itself, bit for bit
    return {"rel_l2": err, "shape_ok": tuple(out.shape) == (B, H, S, D),
            "dtype_ok": out.dtype == x.dtype, "contiguous": out.is_contiguous(),
            "unrotated_exact": torch.equal(kept, x[:, unrotated].repeat_interleave(groups, dim=2))}


# ---------------------------------------------------------------- parent side (pytest)
INTERPRETER_CASES = InterpreterCases(__file__, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_rope_gather_triton_equals_rope_then_gather(interpreter_results, name):
    res = interpreter_results[name]
    assert "error" not in res, res.get("error")
    assert res["shape_ok"] and res["dtype_ok"] and res["contiguous"] and res["unrotated_exact"]
    tol = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[CASES[name][5]]
    assert res["rel_l2"] < tol, res


def test_layout_gather_with_rope_equals_rope_then_gather_on_cpu():
    """The torch fallback of `gather(x, rope)` (CPU) is exactly the stock rotation followed by the gather."""
    from videosparse.rope import apply_interleaved_rope

    for tiles, H in (((2, 4, 4), 2), (((2, 4, 4), (4, 4, 2)), 2)):
        x, cos, sin = _inputs(2, (3, 5, 6), H, 16, torch.float32, torch.float64, False, 0)
        layout = _layout((3, 5, 6), tiles, H)
        torch.testing.assert_close(layout.gather(x, (cos, sin)), layout.gather(apply_interleaved_rope(x, cos, sin)),
                                   rtol=0, atol=0)


def test_half_rope_and_repeated_heads_in_the_cpu_gather():
    """On the CPU (torch path): `apply_half_rope` is Cosmos 3's rotation; the layouts' gather with a `HalfRope` and
    `groups` equals rotate, repeat the heads, then gather (one order for all heads and one per head); a head count
    that does not fit the tiling is refused."""
    from diffusers.models.transformers.transformer_cosmos3 import _rotate_half

    from videosparse.layout import head_tiling
    from videosparse.rope import HalfRope, apply_half_rope

    g = torch.Generator().manual_seed(5)
    grid, D = (2, 3, 7), 16
    S = grid[0] * grid[1] * grid[2]
    x = torch.randn(2, S, 2, D, generator=g, dtype=torch.float64)
    cos, sin = torch.randn(2, 1, S, 1, D, generator=g, dtype=torch.float64)
    rotated = apply_half_rope(x, cos, sin)
    assert torch.allclose(rotated, x * cos + _rotate_half(x) * sin)
    for tiles in ((1, 3, 4), ((1, 3, 4), (2, 3, 2), (1, 3, 4), (2, 3, 2))):
        layout = head_tiling(grid, tiles, 4, block=12)
        ref = layout.gather(rotated.repeat_interleave(2, dim=2))
        assert torch.equal(layout.gather(x, HalfRope(cos, sin), groups=2), ref)
        assert torch.equal(layout.gather(x, groups=2), layout.gather(x.repeat_interleave(2, dim=2)))
    with pytest.raises(ValueError, match="x has 2 heads"):
        head_tiling(grid, ((1, 3, 4), (2, 3, 2), (1, 3, 4)), 3, block=12).gather(x)


def test_apply_interleaved_rope_rotates_pairs():
    """Pair (x0, x1) by angle a -> (x0 cos a - x1 sin a, x0 sin a + x1 cos a); norms are kept. With tables whose two
    columns of a pair differ (Wan's repeat each value), cos comes from the even and sin from the odd columns, as in
    diffusers' WanAttnProcessor (mutation testing: reading sin from the even columns survived with Wan's tables)."""
    from videosparse.rope import apply_interleaved_rope

    x, cos, sin = _inputs(1, (2, 2, 2), 3, 8, torch.float64, torch.float64, False, 1)
    out = apply_interleaved_rope(x, cos, sin)
    c, s = cos[..., 0::2], sin[..., 0::2]
    torch.testing.assert_close(out[..., 0::2], x[..., 0::2] * c - x[..., 1::2] * s)
    torch.testing.assert_close(out[..., 1::2], x[..., 0::2] * s + x[..., 1::2] * c)
    torch.testing.assert_close(out.unflatten(-1, (-1, 2)).norm(dim=-1), x.unflatten(-1, (-1, 2)).norm(dim=-1))
    x, cos, sin = _inputs(1, (2, 2, 2), 3, 8, torch.float64, torch.float64, False, 2, half=True)   # any tables
    out = apply_interleaved_rope(x, cos, sin)
    c, s = cos[..., 0::2], sin[..., 1::2]
    torch.testing.assert_close(out[..., 0::2], x[..., 0::2] * c - x[..., 1::2] * s)
    torch.testing.assert_close(out[..., 1::2], x[..., 0::2] * s + x[..., 1::2] * c)


def test_rope_gather_dispatch_and_errors():
    from videosparse.rope import HalfRope, PairRope, apply_rope, rope_gather

    x, cos, sin = _inputs(1, (2, 2, 2), 2, 8, torch.float32, torch.float32, False, 2)
    perm = torch.arange(8)
    assert rope_gather(x, perm, (cos, sin)) is None              # auto on CPU: the caller's torch path
    assert rope_gather(x, perm, (cos, sin), backend="torch") is None
    with pytest.raises(ValueError, match="backend='cuda'"):
        rope_gather(x, perm, (cos, sin), backend="cuda")
    x6, cos6, sin6 = _inputs(1, (2, 2, 2), 2, 6, torch.float32, torch.float32, False, 2)
    with pytest.raises(ValueError, match="head dim 6"):
        rope_gather(x6, perm, (cos6, sin6), backend="triton")
    with pytest.raises(ValueError, match="x is torch.float64; the fused kernel computes in fp32"):   # auto: torch
        rope_gather(x.double(), perm, (cos.double(), sin.double()), backend="triton")
    with pytest.raises(ValueError, match=r"freqs_cos has shape \(1, 4, 1, 8\)"):
        rope_gather(x, perm, (cos[:, :4], sin), backend="triton")
    with pytest.raises(ValueError, match=r"freqs_cos has shape \(6, 8\), not \(R, 8\) with 3 \+ R <= 8"):
        rope_gather(x, perm, PairRope(cos[0, :6, 0], sin[0, :6, 0], 3), backend="triton")
    with pytest.raises(ValueError, match=r"PairRope covers rows \[3, 9\) but x has 8 rows"):
        apply_rope(x, PairRope(cos[0, :6, 0], sin[0, :6, 0], 3))
    # a negative start (a slice from the end would rotate other rows, or none, without a word): both paths refuse it
    with pytest.raises(ValueError, match=r"PairRope covers rows \[-2, 4\) but x has 8 rows"):
        apply_rope(x, PairRope(cos[0, :6, 0], sin[0, :6, 0], -2))
    with pytest.raises(ValueError, match=r"freqs_cos has shape \(6, 8\), not \(R, 8\) with -2 \+ R <= 8"):
        rope_gather(x, perm, PairRope(cos[0, :6, 0], sin[0, :6, 0], -2), backend="triton")
    with pytest.raises(ValueError, match="sections=3 does not split head dim 8"):
        apply_rope(x, HalfRope(cos, sin, sections=3))
    with pytest.raises(ValueError, match="sections=3 does not split head dim 8"):
        rope_gather(x, perm, HalfRope(cos, sin, sections=3), backend="triton")
    for groups in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"groups={groups!r} must be an int >= 1"):
            rope_gather(x, perm, (cos, sin), groups=groups)
    # while autograd records x the fused kernel (no backward) stands aside: auto gives the torch path on CUDA too
    with pytest.raises(ValueError, match="autograd records x"):
        rope_gather(x.clone().requires_grad_(), perm, (cos, sin), backend="triton")


@pytest.mark.parametrize("per_head,style,groups", [(False, "interleaved", 1), (True, "interleaved", 1),
                                                    (False, "half", 4), (True, "half", 1), (False, "pairs", 1),
                                                    (True, "pairs", 2), (False, "head_pairs", 1),
                                                    (False, "half3", 1)])
def test_rope_gather_kernel_compiles_to_16_byte_accesses_for_sm90(per_head, style, groups):
    """AOT for sm_90 on CPU: with 16-divisible strides (what the JIT sees at Wan sizes) rows move as
    16-byte vectors, in every style, with and without repeated KV heads (groups 1 is folded as a launch folds it); a
    change that falls back to 2-byte accesses costs ~10x on the GPU."""
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from videosparse.kernels.triton_rope_gather import STYLES, _rope_gather_kernel, launch_warps

    names = _rope_gather_kernel.arg_names
    sig = {n: "constexpr" for n in names}
    sig.update({n: "*bf16" for n in ("x_ptr", "cos_ptr", "sin_ptr", "out_ptr")}, perm_ptr="*i64")
    ints = ("S", "H", "perm_stride_h", "stride_xb", "stride_xs", "stride_xh", "stride_cs", "stride_ss")
    sig.update({n: "i32" for n in ints + ("stride_ch", "rot_start", "rot_rows")})
    aligned = ("x_ptr", "perm_ptr", "cos_ptr", "sin_ptr", "out_ptr") + ints[3:]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    sections = 3 if style == "half3" else 1      # Allegro: head dim 96, rotate-half in each third
    constants = dict(D=128 // 4 * 3 if sections == 3 else 128, BLOCK=32, PER_HEAD=per_head,
                     STYLE=STYLES[style.rstrip("3")], SECTIONS=sections)
    if groups == 1:
        constants["GROUPS"] = 1
    else:
        sig["GROUPS"] = "i32"
    src = ASTSource(_rope_gather_kernel, sig, constants, attrs=attrs)
    warps = launch_warps(constants["D"], sections)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["ptx"]
    assert re.search(r"ld\.global\S*\.v4", ptx) and re.search(r"st\.global\S*\.v4", ptx)
    assert not re.search(r"st\.global\.b16", ptx), "the output rows are stored 2 bytes at a time"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_rope_gather_at_wan_size(dtype):
    from videosparse.layout import TileLayout
    from videosparse.rope import apply_interleaved_rope

    grid, H, D = (21, 30, 52), 12, 128
    S = grid[0] * grid[1] * grid[2]
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, S, H * D, device="cuda", generator=g, dtype=dtype).unflatten(2, (H, D))
    angle = torch.rand(1, S, 1, D // 2, device="cuda", generator=g, dtype=torch.float64) * 50
    cos, sin = angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)
    layout = TileLayout(grid, (4, 4, 8))
    out = layout.gather(x, (cos, sin))
    ref = layout.gather(apply_interleaved_rope(x.double(), cos, sin))
    err = float((out.double() - ref).norm() / ref.norm())
    assert out.dtype == dtype and err < (4e-3 if dtype == torch.bfloat16 else 5e-4), err


@pytest.mark.gpu
def test_gpu_rope_gather_half_with_repeated_heads_at_cosmos3_size():
    """Cosmos 3's generation rows at 720p (44,160 video + 256 text rows): rotate-half RoPE of 8 KV heads x 128 fused
    with the gather and the repeat to 32 heads, against rotate, repeat, gather in float64."""
    from videosparse.layout import TileLayout
    from videosparse.rope import HalfRope, apply_half_rope

    grid, text, H, groups, D = (48, 23, 40), 256, 32, 4, 128
    S = grid[0] * grid[1] * grid[2] + text
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, S, H // groups, D, device="cuda", generator=g, dtype=torch.bfloat16)
    angle = torch.rand(1, S, 1, D // 2, device="cuda", generator=g, dtype=torch.float64) * 50
    cos, sin = (torch.cat([t, t], -1).to(torch.bfloat16) for t in (angle.cos(), angle.sin()))
    layout = TileLayout(grid, (4, 4, 8), text_len=text)
    out = layout.gather(x, HalfRope(cos, sin), groups=groups)
    ref = layout.gather(apply_half_rope(x.double(), cos.double(), sin.double()).repeat_interleave(groups, dim=2))
    err = float((out.double() - ref).norm() / ref.norm())
    assert out.shape == (1, H, S, D) and err < 4e-3, err


@pytest.mark.gpu
@pytest.mark.parametrize("grid,H,D,text,position", [((33, 45, 80), 24, 128, 256, "after"),      # HunyuanVideo 720P
                                                    ((13, 30, 45), 48, 64, 226, "before")])     # CogVideoX 5B
def test_gpu_rope_gather_pairs_on_the_video_rows_at_real_size(grid, H, D, text, position):
    """diffusers' `apply_rotary_emb` pairs on the video rows of a joint sequence (text rows unrotated) fused with the
    gather, against rotate-then-gather in float64."""
    from videosparse.layout import TileLayout
    from videosparse.rope import PairRope, apply_rope

    video = grid[0] * grid[1] * grid[2]
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, video + text, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    angle = torch.rand(video, D // 2, device="cuda", generator=g, dtype=torch.float64) * 50
    cos, sin = angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)
    start = text if position == "before" else 0
    layout = TileLayout(grid, (4, 4, 8), text_len=text, text_position=position)
    out = layout.gather(x, PairRope(cos.float(), sin.float(), start))
    ref = layout.gather(apply_rope(x.double(), PairRope(cos, sin, start)))
    err = float((out.double() - ref).norm() / ref.norm())
    assert out.shape == (1, H, video + text, D) and err < 4e-3, err
    text_rows = slice(0, text) if position == "before" else slice(video, video + text)
    assert torch.equal(layout.scatter(out)[:, text_rows], x[:, text_rows])     # not rotated, bit for bit


@pytest.mark.gpu
def test_gpu_rope_gather_head_pairs_at_mochi_size():
    """Mochi's per-head pair angles on the video rows (256 text rows after, unrotated) fused with the gather, against
    rotate-then-gather in float64."""
    from videosparse.layout import TileLayout
    from videosparse.rope import HeadPairRope, apply_rope

    grid, H, D, text = (28, 30, 53), 24, 128, 256
    video = grid[0] * grid[1] * grid[2]
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, video + text, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    angle = torch.rand(video, H, D // 2, device="cuda", generator=g, dtype=torch.float64) * 50
    layout = TileLayout(grid, (4, 4, 8), text_len=text)
    out = layout.gather(x, HeadPairRope(angle.cos().float(), angle.sin().float()))
    ref = layout.gather(apply_rope(x.double(), HeadPairRope(angle.cos(), angle.sin())))
    err = float((out.double() - ref).norm() / ref.norm())
    assert out.shape == (1, H, video + text, D) and err < 4e-3, err
    assert torch.equal(layout.scatter(out)[:, video:], x[:, video:])


if __name__ == "__main__":
    interpreter_child(sys.argv[1:], _run_case)


def test_tables_on_copies_host_tables_once_while_they_come_back_unchanged():
    """EasyAnimate builds its RoPE tables on the CPU and passes the same tensors to every layer: one copy per
    forward (each copy to a GPU would sync the host), a new one for new or modified tables."""
    from videosparse.rope import tables_on

    cos, sin = torch.randn(6, 4), torch.randn(6, 4)
    assert tables_on((cos, sin), "cpu") == (cos, sin)                   # already there: as given
    first = tables_on((cos, sin), "meta")
    assert all(t.device.type == "meta" for t in first)
    assert all(a is b for a, b in zip(tables_on((cos, sin), "meta"), first))      # the next layers: the same copy
    # the same tables for another device (a model split over two GPUs; cpu:0 is not the tables' `cpu`): not the
    # copy made for the first (mutation testing: a cache keyed without the device survived)
    other = tables_on((cos, sin), torch.device("cpu", 0))
    assert all(t.device.type == "cpu" for t in other) and torch.equal(other[0], cos)
    first = tables_on((cos, sin), "meta")
    cos.add_(1)                                                                     # modified in place: copied again
    again = tables_on((cos, sin), "meta")
    assert not any(a is b for a, b in zip(again, first))
    fresh = tables_on((cos.clone(), sin.clone()), "meta")                           # the next forward's new tables
    assert not any(a is b for a, b in zip(fresh, again))


def test_tables_on_takes_inference_tensors():
    """Tables built under torch.inference_mode (a pipeline called inside it) have no version counter: matched by
    identity, not a RuntimeError in every layer."""
    from videosparse.rope import tables_on

    with torch.inference_mode():
        cos, sin = torch.randn(6, 4), torch.randn(6, 4)
        first = tables_on((cos, sin), "meta")
        assert all(a is b for a, b in zip(tables_on((cos, sin), "meta"), first))
    assert all(a is b for a, b in zip(tables_on((cos, sin), "meta"), first))


def test_half_rope_sections_must_be_a_positive_int():
    """Review find: sections of 0, -1 or True were taken as 1 by the torch path."""
    from videosparse.rope import apply_half_rope

    x = torch.randn(1, 4, 2, 12)
    for sections in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match="sections=.* must be an int >= 1"):
            apply_half_rope(x, x, x, sections)
