"""Token order: from diffusers' time-major video tokens to tile order and back.

diffusers flattens video tokens as ``index = t*H*W + h*W + w`` (after patching). A `TileLayout`
groups them into 3D tiles of shape (pt, ph, pw) with ``pt*ph*pw == block``: tiles are enumerated
block-major, the tokens inside a tile (t, h, w)-major. The grid is padded to whole tiles, the pad
slots are dropped and the real tokens compacted, so the sequence keeps its length S and only the
last tile is partial. Text tokens of joint-attention models (before or after the video in the
original sequence) are placed after the video tokens; every tile that holds a text token is a
*global* tile (always attended, its queries attend densely).

`HeadTiling` lets the heads of one layer use different tile shapes: one gather/scatter for all
heads, each head with its own permutation.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import torch

from ._autodiff import carries_tangent
from .validation import check_tile, int_at_least, int_triple, one_per_head
from .rope import apply_rope, check_groups, rope_gather

TEXT_POSITIONS = ("before", "after")
#: A per-head tiling keeps its [heads, tokens] orders (perm and inverse, int64) up to this size (6.3 MB at Wan 1.3B
#: 480P); larger ones (48 MB at Wan 14B 720P) keep one order per distinct tile shape and expand the index per call.
KEEP_HEAD_ORDERS_BYTES = 16 * 2**20


def _normal_tensors():
    """A context in which new tensors are normal ones even inside `torch.inference_mode`: the cached index tensors
    outlive the call that builds them, and an inference tensor could not be saved for a later call's backward."""
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():     # (Dynamo traces no such query)
        return torch.inference_mode(False)
    return contextlib.nullcontext()


def _cache_key(device: torch.device | str) -> str:
    """The cache key of `device`: a bare "cuda" names the current GPU, as a tensor moved there lands on it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def tile_lengths(seq_len: int, block: int, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """[ceil(seq_len / block)] real tokens per tile: block, the last tile what is left. Built on `device` by
    tensor ops (writing one element from a Python number would copy it from the host and sync a CUDA stream)."""
    n = math.ceil(seq_len / block)
    return (seq_len - block * torch.arange(n, device=device)).clamp_(max=block).to(dtype)


def _tile_permutation(grid: tuple[int, int, int], tile: tuple[int, int, int]) -> torch.Tensor:
    """Video-token permutation: position in tile order -> time-major index. int64 [T*H*W]."""
    T, H, W = grid
    pt, ph, pw = tile
    nT, nH, nW = math.ceil(T / pt), math.ceil(H / ph), math.ceil(W / pw)
    t = torch.arange(nT * pt).view(nT, pt, 1, 1, 1, 1)
    h = torch.arange(nH * ph).view(1, 1, nH, ph, 1, 1)
    w = torch.arange(nW * pw).view(1, 1, 1, 1, nW, pw)
    # axes (tile_t, in_t, tile_h, in_h, tile_w, in_w), reordered below to tile-major then in-tile
    idx = t * (H * W) + h * W + w
    valid = (t < T) & (h < H) & (w < W)
    idx = idx.permute(0, 2, 4, 1, 3, 5).reshape(-1)
    valid = valid.expand(nT, pt, nH, ph, nW, pw).permute(0, 2, 4, 1, 3, 5).reshape(-1)
    return idx[valid]


@dataclass(frozen=True)
class TileLayout:
    """Tile order of one layer's tokens for one tile shape.

    Args:
        grid: (T, H, W) of the video tokens after patching.
        tile: (pt, ph, pw) with pt*ph*pw == block.
        block: tokens per tile (128 or 64).
        text_len: number of text tokens in the same sequence (joint attention), 0 if none.
        text_position: "before" (CogVideoX) or "after" (HunyuanVideo) the video tokens.
        text_slot: the sequence has a text part even when `text_len` is 0 (an item whose prompt is all padding,
            served by its valid prefix alone): the partial last video tile is then a global tile, as it is beside
            text, so that the item gets the tiles it gets when its padded text is in the sequence.

    Attributes (derived):
        seq_len: S = T*H*W + text_len.
        perm: int64 [S], position in tile order -> index in the original sequence.
        inv: int64 [S], the inverse permutation.
        num_tiles: ceil(S / block).
        num_video_tiles: tiles made of video tokens only (the rest are global tiles).
    """

    grid: tuple[int, int, int]
    tile: tuple[int, int, int] = (4, 4, 8)
    block: int = 128
    text_len: int = 0
    text_position: str = "after"
    text_slot: bool = False
    _device_cache: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        grid = _grid(self.grid)
        block = int_at_least(self.block, 1, "block", "tokens per tile")
        tile = check_tile(self.tile, block, "tile")
        text_len = int_at_least(self.text_len, 0, "text_len", "text tokens in the sequence")
        if self.text_position not in TEXT_POSITIONS:
            raise ValueError(f"text_position={self.text_position!r} must be one of {TEXT_POSITIONS}.")
        for name, value in (("grid", grid), ("tile", tile), ("block", block), ("text_len", text_len)):
            object.__setattr__(self, name, value)

    @property
    def num_video_tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def seq_len(self) -> int:
        return self.num_video_tokens + self.text_len

    @property
    def num_tiles(self) -> int:
        return math.ceil(self.seq_len / self.block)

    @property
    def num_video_tiles(self) -> int:
        n = self.num_video_tokens
        return math.ceil(n / self.block) if self.text_len == 0 and not self.text_slot else n // self.block

    @property
    def num_global_tiles(self) -> int:
        return self.num_tiles - self.num_video_tiles

    @property
    def padding_fraction(self) -> float:
        """Fraction of pad slots if the grid were padded to whole tiles (used to exclude shapes)."""
        padded = math.prod(math.ceil(g / p) * p for g, p in zip(self.grid, self.tile))
        return 1.0 - self.num_video_tokens / padded

    @cached_property
    def perm(self) -> torch.Tensor:
        with _normal_tensors():
            video = _tile_permutation(self.grid, self.tile)
            n, L = self.num_video_tokens, self.text_len
            if L == 0:
                return video
            if self.text_position == "before":
                return torch.cat([video + L, torch.arange(L)])
            return torch.cat([video, torch.arange(n, n + L)])

    @cached_property
    def inv(self) -> torch.Tensor:
        with _normal_tensors():
            inv = torch.empty_like(self.perm)
            inv[self.perm] = torch.arange(self.perm.numel())
            return inv

    @cached_property
    def tile_len(self) -> torch.Tensor:
        """int32 [num_tiles]: real tokens per tile (block, except the last tile)."""
        with _normal_tensors():
            return tile_lengths(self.seq_len, self.block)

    def indices(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(perm, inv) on `device`, cached."""
        key = _cache_key(device)
        if key not in self._device_cache:
            with _normal_tensors():
                self._device_cache[key] = (self.perm.to(key), self.inv.to(key))
        return self._device_cache[key]

    def gather(self, x: torch.Tensor, rope=None, groups: int = 1) -> torch.Tensor:
        """(B, S, H, D) in the original order -> (B, H * groups, S, D) contiguous in tile order.

        rope: optional rotary tables, any `videosparse.rope.apply_rope` takes (Wan's tuple, `HalfRope`, `PairRope`,
        `HeadPairRope`); returns the gather of `apply_rope(x, rope)`, fused into one pass where `rope_gather` applies.
        groups: output heads per head of x (grouped-query KV heads repeated: output head h is x's head h // groups).
        """
        groups = check_groups(groups)
        _check_seq(x, self.seq_len, "x")
        perm, _ = self.indices(x.device)
        fused, x = _rope_first(x, perm, rope, groups)
        if fused is not None:
            return fused
        xt = x.transpose(1, 2)
        wide = _wide_view(xt)
        out = wide[:, :, perm].view(x.dtype) if wide is not None else xt[:, :, perm]
        return out if groups == 1 else out.repeat_interleave(groups, dim=1)

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """(B, H, S, D) in tile order -> (B, S, H, D) in the original order (contiguous in eager mode when a row of D
        elements is a whole number of 16-byte words, else a transposed view)."""
        _check_seq(y, self.seq_len, "y", dim=2)
        perm, inv = self.indices(y.device)
        B, H, S, D = y.shape
        out = y.new_empty(B, S, H, D)
        wide_out, wide_y = _wide_view(out.transpose(1, 2)), _wide_view(y)
        if wide_out is not None and wide_y is not None:
            wide_out[:, :, perm] = wide_y       # writes (B, S, H, D) contiguous: no copy before flatten
            return out
        return y[:, :, inv].transpose(1, 2)


def _rope_first(x: torch.Tensor, perm: torch.Tensor, rope, groups: int = 1) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(RoPE(x) already gathered by `perm` (and its heads repeated `groups` times) when the fused kernel applies, else
    None; x, rotated when `rope` is given and the fused kernel did not apply). rope: any `apply_rope` takes, or None."""
    if rope is None:
        return None, x
    fused = rope_gather(x, perm, rope, groups=groups)
    return (fused, x) if fused is not None else (None, apply_rope(x, rope))


def _wide_view(x: torch.Tensor) -> torch.Tensor | None:
    """x reinterpreted with 16-byte elements along its last dim (same memory), or None.

    The token gather/scatter moves whole D-vectors; with 16-byte elements torch's index kernels move
    8 bf16 values per element instead of one (~3x faster on the H200 at Wan sizes). Eager only:
    under torch.compile Inductor writes its own gather kernel and complex dtypes would get in its way.
    Not while autograd records x, nor when forward-mode AD gives it a tangent: the dtype-changing view is not
    differentiable and would cut the graph (drop the tangent). Plain tensors only: a tensor subclass (a quantized
    activation, optimum-quanto's W8A8) may view its payload instead and report another shape.
    """
    if (torch.compiler.is_compiling() or type(x) is not torch.Tensor or x.stride(-1) != 1 or x.is_complex()
            or (x.requires_grad and torch.is_grad_enabled()) or carries_tangent(x)):
        return None
    try:
        return x.view(torch.complex128)
    except RuntimeError:  # last dim or strides not a multiple of 16 bytes
        return None


def _check_seq(x: torch.Tensor, seq_len: int, name: str, dim: int = 1) -> None:
    if x.dim() != 4 or x.shape[dim] != seq_len:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}; expected 4 dims with {seq_len} tokens in dim {dim} "
            "(the layout's T*H*W + text_len)."
        )


@dataclass(frozen=True)
class HeadTiling:
    """Per-head tile shapes for one layer: one gather/scatter with a permutation per head.

    Args:
        grid, block, text_len, text_position, text_slot: as in `TileLayout`.
        tiles: one (pt, ph, pw) per head.

    Every head has the same number of tiles and the same global tiles, so one `Plan` covers all heads.
    """

    grid: tuple[int, int, int]
    tiles: tuple[tuple[int, int, int], ...]
    block: int = 128
    text_len: int = 0
    text_position: str = "after"
    text_slot: bool = False
    _device_cache: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        try:
            tiles = tuple(int_triple(t) for t in self.tiles)
        except TypeError:
            raise ValueError(f"tiles={self.tiles!r} must be one (pt, ph, pw) per head.") from None
        if any(t is None or min(t) < 1 for t in tiles):
            bad = next(t for t, ok in zip(self.tiles, tiles) if ok is None or min(ok) < 1)
            raise ValueError(f"tile shape {bad!r} must be three positive ints (pt, ph, pw).")
        if not tiles:
            raise ValueError("tiles must name one tile shape per head; got none.")
        object.__setattr__(self, "grid", _grid(self.grid))
        object.__setattr__(self, "tiles", tiles)
        self.layouts            # each shape's TileLayout checks it against the block, text_len, ... now

    @cached_property
    def layouts(self) -> dict[tuple[int, int, int], TileLayout]:
        return {
            t: TileLayout(self.grid, t, self.block, self.text_len, self.text_position, self.text_slot)
            for t in dict.fromkeys(self.tiles)
        }

    @property
    def first(self) -> TileLayout:
        return self.layouts[self.tiles[0]]

    @property
    def uniform(self) -> bool:
        return len(self.layouts) == 1

    def __getattr__(self, name: str):
        # seq_len, num_tiles, num_video_tiles, tile_len... are the same for every head.
        if name in ("seq_len", "num_tiles", "num_video_tiles", "num_global_tiles", "tile_len", "num_video_tokens"):
            return getattr(self.first, name)
        raise AttributeError(name)

    def warm(self, device: torch.device | str) -> None:
        """Build the index tensors on `device` now (outside any compiled graph)."""
        if self.uniform:
            self.first.indices(device)
        else:
            self._head_order(device)

    def select_heads(self, heads: slice) -> "HeadTiling":
        """The tiling of heads `heads` only (one rank's heads under Ulysses context parallelism), cached."""
        if heads.step not in (None, 1):
            raise ValueError(f"heads={heads!r}: select a contiguous run of heads (step 1).")
        key = ("heads", heads.start, heads.stop)
        if key not in self._device_cache:
            self._device_cache[key] = HeadTiling(self.grid, self.tiles[heads], self.block, self.text_len,
                                                 self.text_position, self.text_slot)
        return self._device_cache[key]

    def _shape_indices(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(perm, inv) int64 [shapes, S], one row per distinct tile shape, and each head's row int64 [H], on `device`,
        cached. Only these stay: 2.4 MB at Wan 14B 720P for two shapes, where [H, S] orders would take 48 MB."""
        key = _cache_key(device)
        if key not in self._device_cache:
            with _normal_tensors():
                shapes = list(self.layouts)
                perm = torch.stack([self.layouts[t].perm for t in shapes])
                inv = torch.stack([self.layouts[t].inv for t in shapes])
                row = torch.tensor([shapes.index(t) for t in self.tiles])
                self._device_cache[key] = (perm.to(key), inv.to(key), row.to(key))
        return self._device_cache[key]

    def head_indices(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(perm, inv) as int64 [H, S] on `device`, expanded from the cached per-shape orders on each call."""
        perm, inv, row = self._shape_indices(device)
        return perm.index_select(0, row), inv.index_select(0, row)

    def _head_order(self, device: torch.device | str, inverse: bool = False) -> torch.Tensor:
        """int64 [H, S]: `head_indices`' perm (or inv) alone. Kept (built outside any compiled graph by `warm`)
        while the pair takes at most `KEEP_HEAD_ORDERS_BYTES`, else expanded for each call (24 MB at Wan 14B 720P:
        1.4% more time in the gathers and scatter there, on an H100, benchmarks/head_tiling_h100.json)."""
        perm, inv, row = self._shape_indices(device)
        if 2 * perm.element_size() * len(self.tiles) * self.seq_len > KEEP_HEAD_ORDERS_BYTES:
            return (inv if inverse else perm).index_select(0, row)
        key = (_cache_key(device), "heads")
        if key not in self._device_cache:
            with _normal_tensors():
                self._device_cache[key] = (perm.index_select(0, row), inv.index_select(0, row))
        return self._device_cache[key][int(inverse)]

    def gather(self, x: torch.Tensor, rope=None, groups: int = 1) -> torch.Tensor:
        """(B, S, H / groups, D) original order -> (B, H, S, D) contiguous, each head in its own tile order
        (`rope` and `groups` as in `TileLayout.gather`)."""
        groups = check_groups(groups)
        if x.dim() == 4 and x.shape[2] * groups != len(self.tiles):
            raise ValueError(f"x has {x.shape[2]} heads (x {groups} groups) but the tiling names {len(self.tiles)} "
                             "tile shapes.")
        if self.uniform:
            return self.first.gather(x, rope, groups)
        _check_seq(x, self.seq_len, "x")
        perm = self._head_order(x.device)
        fused, x = _rope_first(x, perm, rope, groups)
        if fused is not None:
            return fused
        if groups > 1:
            x = x.repeat_interleave(groups, dim=2)
        B, S, H, D = x.shape
        xt = x.transpose(1, 2)
        wide = _wide_view(xt)
        if wide is not None:
            return torch.gather(wide, 2, perm[None, :, :, None].expand(B, H, S, wide.shape[-1])).view(x.dtype)
        return torch.gather(xt, 2, perm[None, :, :, None].expand(B, H, S, D))

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """(B, H, S, D) per-head tile order -> (B, S, H, D) original order."""
        if y.dim() != 4 or y.shape[1] != len(self.tiles) or y.shape[2] != self.seq_len:
            raise ValueError(f"y has shape {tuple(y.shape)}; expected (B, {len(self.tiles)}, {self.seq_len}, D) (heads "
                             "and tokens of this tiling).")
        if self.uniform:
            return self.first.scatter(y)
        B, H, S, D = y.shape
        out = y.new_empty(B, S, H, D)
        wide_out, wide_y = _wide_view(out.transpose(1, 2)), _wide_view(y)
        if wide_out is not None and wide_y is not None:
            perm = self._head_order(y.device)
            wide_out.scatter_(2, perm[None, :, :, None].expand(B, H, S, wide_y.shape[-1]), wide_y)
            return out
        inv = self._head_order(y.device, inverse=True)
        return torch.gather(y, 2, inv[None, :, :, None].expand(B, H, S, D)).transpose(1, 2)


def _grid(values) -> tuple[int, int, int]:
    """`values` as the (T, H, W) of a video grid, or a ValueError naming it."""
    grid = int_triple(values)
    if grid is None or min(grid) < 1:
        raise ValueError(f"grid={values!r} must be three positive ints (T, H, W).")
    return grid


def head_tiling(
    grid: Sequence[int],
    tiles: Sequence[int] | Sequence[Sequence[int]],
    num_heads: int,
    block: int = 128,
    text_len: int = 0,
    text_position: str = "after",
    text_slot: bool = False,
) -> HeadTiling:
    """A `HeadTiling` from one shape for all heads or one shape per head."""
    per_head = tuple(one_per_head(tiles, num_heads))     # HeadTiling checks each shape
    return HeadTiling(grid, per_head, block, text_len, text_position, text_slot)
