"""The token grid of a forward and the tokens around it, from its arguments: the helpers the model families' grid
functions share (`ModelSpec.grid_fn`).

- `patched_grid`, `video_grid`: the grid after the patch embedding;
- `patch_tokens`, `HistoryPart`, `history_tokens`: history latents put before the video (FramePack, Helios);
- `PaddedText`, `valid_text_length`: text whose padded tail is masked (HunyuanVideo, Mochi, Motif, Cosmos 3);
- `coords_grid`, `check_coords`: the grid that per-token coordinates span (LTX-Video, LTX-2, MiniMax-H3).
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .forward_args import forward_arg
from .registry import patch_size_of


def patched_grid(module, frames: int, height: int, width: int) -> tuple[int, int, int]:
    """The token grid of a latent of frames x height x width after the transformer's patch embedding: each size
    floor-divided by its patch size from `module.config` (`registry.patch_size_of`: pt is 1 where the config patches
    no time)."""
    pt, ph, pw = patch_size_of(module.config)
    return frames // pt, height // ph, width // pw


def video_grid(module, args, kwargs) -> tuple[int, int, int]:
    """The token grid of a forward whose hidden_states are (B, C, F, H, W): (F, H, W) after its patch embedding
    (`patched_grid`)."""
    hidden_states = forward_arg(args, kwargs, "hidden_states", 0)
    _, _, F, H, W = hidden_states.shape
    return patched_grid(module, F, H, W)


def patch_tokens(latents: torch.Tensor, kernel, pad=None) -> int:
    """Tokens a Conv3d patch embedding with `kernel` makes of latents (B, C, F, H, W), after padding each of F, H, W
    up to a multiple of `pad` when given (the history latents of FramePack and Helios)."""
    sizes = latents.shape[2:] if pad is None else [-(-n // p) * p for n, p in zip(latents.shape[2:], pad)]
    return math.prod(n // k for n, k in zip(sizes, kernel))


class HistoryPart(NamedTuple):
    """One part of the history that a forward puts before its video (FramePack, Helios), as `history_tokens` counts
    it: named by the forward's arguments (with their positions, read where an argument is not named)."""

    latents: str                # the argument holding its latents (B, C, F, H, W)
    latents_at: int
    indices: str                # the argument holding its frame indices: the part is counted when both are given
    indices_at: int
    embedding: str              # the path in the transformer of its patch embedding (a Conv3d)
    pad: tuple[int, int, int] | str | None = None   # F, H, W padded to a multiple of this first ("kernel": its kernel)


def history_tokens(module, args: tuple, kwargs: dict, parts: tuple[HistoryPart, ...]) -> int:
    """Tokens of the history `parts` that a forward of `module` puts before its video: each part given with its frame
    indices, through a patch embedding the module has, counted as `patch_tokens` of its latents."""
    total = 0
    for part in parts:
        latents = forward_arg(args, kwargs, part.latents, part.latents_at)
        embedding = functools.reduce(lambda owner, name: getattr(owner, name, None), part.embedding.split("."), module)
        if latents is None or embedding is None or forward_arg(args, kwargs, part.indices, part.indices_at) is None:
            continue
        pad = embedding.kernel_size if part.pad == "kernel" else part.pad
        total += patch_tokens(latents, embedding.kernel_size, pad)
    return total


@dataclass(frozen=True)
class PaddedText:
    """The text tokens of a forward whose padded tail is masked (what a grid function returns for HunyuanVideo,
    Mochi, ...): `total` in the sequence, the first `valid[b]` of item b valid (int32 [B], on the model's device).

    A sparse forward covers all `total` (one layout, whatever the prompt) and masks the padded keys in the kernel
    (`Plan.valid_keys`), so that prompts of other lengths run the same shapes and, under torch.compile, the same
    graph. Dense configs and observed forwards serve each item's valid prefix instead (`lengths`)."""

    total: int
    valid: torch.Tensor
    pad_to_tile: bool = False   # the forward holds only the valid rows (total == valid): the processor pads them
    #                             to the layout's length, the sequence rounded up to whole tiles (Cosmos 3's prompt)

    def lengths(self) -> int | tuple[int, ...]:
        """The valid text tokens as host ints: one when the batch agrees, else one per item (e.g. a prompt and a
        shorter negative prompt batched for classifier-free guidance). Syncs the host."""
        lengths = tuple(int(n) for n in self.valid.tolist())
        return lengths[0] if len(set(lengths)) == 1 else lengths


def valid_text_length(valid: torch.Tensor | None, total: int) -> int | PaddedText:
    """The text tokens of a forward from the per-item valid lengths [B] (None = all `total` valid): `total`, or a
    `PaddedText` (no host sync here)."""
    if valid is None:
        return total
    return PaddedText(total, valid.to(torch.int32))


# checks of video_coords already made: (id, question) -> (weak reference, version, answer)
_CHECKED_COORDS: dict[tuple, tuple] = {}


def coords_grid(video_coords: torch.Tensor, seq_len: int, video_len: int | None = None,
                start: int = 0) -> tuple[tuple[int, int, int] | None, str | None]:
    """The (T, H, W) grid that the `video_len` tokens from `start` (default: all `seq_len`) of `video_coords` span when
    they are that grid in time-major order, else (None, why): LTX-Video's (B, 3, S) positions or LTX-2's
    (B, 3, S, 2) patch bounds. Cached (`cached_coords_check`)."""
    video_len = seq_len - start if video_len is None else video_len
    return cached_coords_check(video_coords, ("grid", seq_len, video_len, start),
                         lambda: check_coords(video_coords, seq_len, video_len, start))


def check_coords(video_coords: torch.Tensor, seq_len: int, video_len: int | None = None,
                 start: int = 0) -> tuple[tuple[int, int, int] | None, str | None]:
    """`coords_grid` without the cache. video_coords: (B, 3, S, 2) patch bounds [start, end) or (B, 3, S)
    positions; the RoPE uses the midpoints of the bounds, and so does this check. Syncs the host up to five times
    (two `torch.equal`, three `torch.unique`): callers cache the result per coordinates tensor."""
    if video_coords.dim() not in (3, 4) or tuple(video_coords.shape[1:3]) != (3, seq_len) or (
            video_coords.dim() == 4 and video_coords.shape[3] != 2):
        return None, (f"video_coords of shape {tuple(video_coords.shape)} does not give (frame, height, width) "
                      f"coordinates for each of the {seq_len} tokens (expected (B, 3, {seq_len}) or "
                      f"(B, 3, {seq_len}, 2))")
    coords = video_coords.mean(dim=3) if video_coords.dim() == 4 else video_coords
    coords = coords[:, :, start:start + (seq_len - start if video_len is None else video_len)]
    first = coords[0]
    if not torch.equal(coords, first.expand_as(coords)):
        return None, "video_coords differ across the batch; sparse attention needs one token grid per forward"
    axes = [torch.unique(first[i]) for i in range(3)]            # sorted
    grid = tuple(len(a) for a in axes)
    expected = torch.stack(torch.meshgrid(*axes, indexing="ij")).flatten(1)
    if grid[0] * grid[1] * grid[2] != coords.shape[2] or not torch.equal(expected, first):
        return None, ("video_coords do not form one time-major (frame, height, width) grid over the sequence "
                      "(the condition pipelines put the tokens of keyframe conditions beside the video); sparse "
                      "attention needs one")
    return grid, None


def cached_coords_check(video_coords: torch.Tensor, question: tuple, check):
    """check() for `video_coords`, cached per tensor and question while the tensor is alive and unmodified (its
    version counter unchanged; inference tensors, which have none, are checked every time): the pipelines build
    their coordinates once and pass the same tensor at every step, and a check syncs the host."""
    if video_coords.is_inference():          # no version counter: an in-place change could not be seen
        return check()
    key = (id(video_coords), *question)
    hit = _CHECKED_COORDS.get(key)
    if hit is not None and hit[0]() is video_coords and hit[1] == video_coords._version:
        return hit[2]
    found = check()
    if len(_CHECKED_COORDS) >= 16:
        _CHECKED_COORDS.clear()
    _CHECKED_COORDS[key] = (weakref.ref(video_coords), video_coords._version, found)
    return found
