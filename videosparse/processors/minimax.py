"""MiniMax-H3 (`MiniMaxH3Transformer3DModel`; `MiniMaxH3ModularPipeline`, workflows t2va / fl2va / ref2va): sparse
self-attention processor and model facts.

MiniMax-H3 runs one stack of blocks over one packed 1-D sequence that holds every modality; there is no
cross-attention. Every block's `attn` (`MiniMaxH3Attention`, `MiniMaxH3AttnProcessor`) is full self-attention over the
whole sequence: q/k/v projections (or the fused `to_qkv`), per-head RMSNorm of q and k, then a 3-axis rotate-half RoPE
(`_apply_rotary_emb`) on the leading 2 x 3 x rope_freq_dim channels of every head of every row, at the row's own
(t, h, w) coordinate (`position_ids` [S, 3], one row each). The token refiner's `attn` (`token_refiner.refiner_blocks`)
is text-only, without RoPE, and keeps its stock processor.

Token order. The forward receives each modality's rows separately and scatters them into the packed sequence with
`index_copy` at `text_indices`, `video_indices` and `audio_indices`; `token_tags` (0 video, 1 text, 2 audio:
`MINIMAX_H3_MODALITY_NUM` = 3) only select each row's AdaLN modulation, they do not change the attention. The pipeline
lays the sequence out as [text | keyframe conditions | target audio | target video] (t2va, fl2va) or
[text | reference blocks (each its audio rows, then its video rows) | target audio | target video] (ref2va): the
generated video is always the trailing rows. Video rows come from `patchify_video_latents`, which splits latents
(B, C, F, H, W) into (F/pt, H/ph, W/pw) patches and flattens them frame-major, then row-major (time-major:
row t * H' * W' + h * W' + w), with `position_ids` the matching time-major meshgrid (non-uniform time steps,
aspect-normalised h and w); the audio rows are channel-major (2 x 40 latents per second) and the text rows are the
Qwen3-VL hidden states (a keyframe's vision block inside them is tagged as video). At the released defaults (768 x
1344, 124 frames) that is 37 x 24 x 42 = 37,296 video rows after 414 audio rows and the text.

So `minimax_grid` takes the trailing video rows as the (T, H, W) grid when their `position_ids` are one time-major
meshgrid, and everything before them (text, conditions / references, audio) is served like joint text before the
video (`text_position="before"`, global tiles: every video query attends to them, they attend densely to everything).
A sequence whose trailing rows are not such a grid keeps the stock processor for the whole forward (one warning per
layer). The model packs one request into one attention document: no padding and no attention mask (the batch axis only
replicates the layout), so a call given a mask keeps the stock processor too, with one warning per layer.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor, _apply_rotary_emb

from .base import SparseAttentionMixin, project_heads, project_output
from .forward_args import forward_arg
from .grids import check_coords


class MiniMaxH3SparseAttnProcessor(SparseAttentionMixin, MiniMaxH3AttnProcessor):
    """`MiniMaxH3AttnProcessor` whose self-attention over the packed sequence runs through videosparse.

    Projections (separate or fused), the per-head q/k RMSNorm and the rotary embedding are diffusers' own; only the
    attention call changes. Calls with a mask, and every call of a forward whose video is not the trailing grid
    (`minimax_grid` says why), go to the stock processor, warned once per layer.
    """

    _stock = MiniMaxH3AttnProcessor

    def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
        problem = self._stock_reason(attention_mask)         # (MiniMax-H3 passes no mask)
        if problem is not None:
            return self._to_stock(problem, attn, hidden_states, rotary_emb, attention_mask)
        if attn.fused_projections:
            query, key, value = (x.unflatten(-1, (attn.heads, -1)) for x in attn.to_qkv(hidden_states).chunk(3, -1))
            query, key = attn.norm_q(query), attn.norm_k(key)
        else:
            query, key, value = project_heads(hidden_states, attn.heads, attn.to_q, attn.to_k, attn.to_v,
                                              attn.norm_q, attn.norm_k)
        if rotary_emb is not None:
            query = _apply_rotary_emb(query, *rotary_emb)
            key = _apply_rotary_emb(key, *rotary_emb)
        return project_output(attn, self.attend(query, key, value), query)


def minimax_video_timestep(module, args, kwargs) -> torch.Tensor | None:
    """The generated video's timestep (`ModelSpec.step_timestep`): the forward's `timestep` holds the distinct values
    of all rows, rising from 0 (noise) to 1, with keyframe conditions pinned at max(t, 0.999) and reference audio at 1,
    so its largest entry stays put from step to step; the last video row's entry (the generated video) is the step's."""
    timestep = forward_arg(args, kwargs, "timestep", 3)
    rows = forward_arg(args, kwargs, "timestep_indices", 4)
    video = forward_arg(args, kwargs, "video_indices", 7)
    if timestep is None or rows is None or video is None or not video.numel() or not timestep.dim():
        return timestep
    return timestep[rows[video.max()]]


def minimax_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int, str | None]:
    """The (T, H, W) grid of the trailing video rows of the packed sequence, the rows before them (text, conditions,
    audio: served as global tiles before the video), and why the forward must run stock (None when it can run
    sparse; else the grid is (1, 1, S), only to keep the layouts well-formed). Syncs the host a few times."""
    positions = forward_arg(args, kwargs, "position_ids", 6)
    video = forward_arg(args, kwargs, "video_indices", 7)
    seq_len = positions.shape[0]
    is_video = torch.zeros(seq_len, dtype=torch.int32, device=video.device).index_fill_(0, video, 1)
    tail = int(is_video.flip(0).cumprod(0).sum())           # video rows at the end of the sequence
    grid, problem = None, "the packed sequence does not end with video rows"
    if tail:
        grid, problem = check_coords(positions.T[None], seq_len, tail, seq_len - tail)
        if problem is not None:
            problem = f"the {tail} video rows that end the packed sequence are not one time-major (t, h, w) grid"
    if problem is not None:
        return (1, 1, seq_len), 0, problem + "; sparse attention needs the generated video as its trailing rows"
    return grid, seq_len - tail, None
