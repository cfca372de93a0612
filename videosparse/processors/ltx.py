"""LTX-Video (`LTXVideoTransformer3DModel`): sparse self-attention processor and model facts.

Every block's `attn1` is video-only self-attention (the text enters through `attn2`, cross-attention,
which keeps its stock processor). The transformer receives already packed tokens (B, S, C), in the
time-major order of `LTXPipeline._pack_latents` (`index = f*H*W + h*W + w`), and the token grid as forward
arguments: `num_frames, height, width` (`LTXPipeline`, `LTXImageToVideoPipeline`), or only `video_coords`
[B, 3, S], the (t, h, w) coordinate of every token (`LTXConditionPipeline`). The RoPE tables are built
from exactly these, one coordinate per token, so the token grid is (num_frames, height, width).

`LTXConditionPipeline` prepends the tokens of conditions placed at `frame_index > 0` to the video (a latent
frame of the video's height x width each); `ltx_grid` checks that `video_coords` is a time-major (t, h, w) grid
over the whole sequence or over the tokens after such a prefix, whose tokens are then served like joint text
before the video (global tiles), and otherwise makes the forward run dense (one warning per layer).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor, apply_rotary_emb

from .base import SparseAttentionMixin, project_output
from .context import sequence_length
from .forward_args import forward_arg
from .grids import cached_coords_check, coords_grid


class LTXVideoSparseAttnProcessor(SparseAttentionMixin, LTXVideoAttnProcessor):
    """`LTXVideoAttnProcessor` whose self-attention runs through videosparse.

    Projections, the across-heads RMSNorm of q and k (on the flattened [B, S, C], before the split into
    heads) and LTX's RoPE (also on [B, S, C]) are diffusers' own; only the attention call changes. Calls
    with encoder states (cross-attention) go to the stock processor untouched, and so do the calls of a
    forward whose tokens are not one grid (`ltx_grid` says why; warned once per layer) and a call with an
    attention mask (the model never gives `attn1` one).
    """

    _stock = LTXVideoAttnProcessor

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        stock = (attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if encoder_hidden_states is not None:
            return self._to_stock(None, *stock)
        problem = self._stock_reason(attention_mask)
        if problem is not None:     # not one token grid (see `ltx_grid`) or masked: no layout, no observer records
            return self._to_stock(problem, *stock)
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(hidden_states))
        value = attn.to_v(hidden_states)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb)
            key = apply_rotary_emb(key, image_rotary_emb)
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        return project_output(attn, self.attend(query, key, value), query)


def grid_after_conditions(video_coords: torch.Tensor, seq_len: int) -> tuple[tuple[int, int, int], int] | None:
    """(grid, prefix) when the tokens after the first `prefix` form one time-major grid and the first ones are
    whole latent frames of condition tokens (`LTXConditionPipeline` puts the tokens of conditions at frame_index > 0
    before the video, each a latent frame of the video's height x width); the smallest such prefix, else None.
    Cached (`cached_coords_check`); a search syncs the host (two `torch.unique`, then a `coords_grid` check per
    candidate prefix)."""
    def search():
        if video_coords.dim() != 3 or tuple(video_coords.shape[1:]) != (3, seq_len):
            return None
        first = video_coords[0]
        frame = len(torch.unique(first[1])) * len(torch.unique(first[2]))    # tokens per latent frame
        for prefix in range(frame, seq_len, frame):
            grid, problem = coords_grid(video_coords, seq_len, start=prefix)
            if problem is None:
                return grid, prefix
        return None

    return cached_coords_check(video_coords, ("prefix", seq_len), search)


def ltx_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int, str | None]:
    """Token grid of a forward, the condition tokens before the video, and why the forward must run dense (None
    when it can run sparse).

    The grid is (num_frames, height, width) of the forward's arguments (the pipelines pass the latent
    sizes; LTX-Video's patch sizes are 1), or the grid that `video_coords` spans when given (they then
    define the RoPE, and `LTXConditionPipeline` passes nothing else). The condition tokens that
    `LTXConditionPipeline` puts before the video (conditions at frame_index > 0) are served like joint text before
    it (global tiles) when the tokens after them form the grid (`grid_after_conditions`). Any other sequence runs
    dense; the grid returned then is (1, 1, S), only to keep the layouts well-formed.
    """
    hidden_states = forward_arg(args, kwargs, "hidden_states", 0)
    video_coords = forward_arg(args, kwargs, "video_coords", 8)
    sizes = [forward_arg(args, kwargs, name, i) for i, name in ((4, "num_frames"), (5, "height"), (6, "width"))]
    seq_len = sequence_length(module, hidden_states)      # all ranks' tokens under context parallelism
    if video_coords is not None:
        grid, problem = coords_grid(video_coords, seq_len)
        if problem is not None and (split := grid_after_conditions(video_coords, seq_len)) is not None:
            return split[0], split[1], None
    elif any(s is None for s in sizes):
        grid, problem = None, "num_frames, height and width were not all given (and no video_coords)"
    else:
        grid, problem = tuple(int(s) for s in sizes), None
        if grid[0] * grid[1] * grid[2] != seq_len:
            grid, problem = None, (f"the sequence has {seq_len} tokens, not num_frames x height x width = "
                                   f"{' x '.join(map(str, sizes))}")
    return (grid or (1, 1, seq_len)), 0, problem
