"""Allegro (`AllegroTransformer3DModel`): sparse self-attention processor and model facts.

Every block's `attn1` is video-only self-attention (`AllegroAttnProcessor2_0`, called without encoder states);
`attn2` is the cross-attention to the T5 text (the same stock class, called with the text and its key mask) and
keeps its stock processor. The processor applies the 3D RoPE (`apply_rotary_emb_allegro`: head dim split in
three thirds for t, h, w, each rotated by half-split, positions looked up per token) to self-attention only.

Token order: the forward moves the frames into the batch, (B, C, F, H, W) -> (B * F, C, H, W), patches each frame
with the 2D `PatchEmbed` (conv of stride `patch_size`, then `flatten(2).transpose(1, 2)`: h-major) and flattens
(F, H' * W') back, so token `t * H' * W' + h * W' + w` is patch (t, h, w): time-major. `AllegroPipeline` builds
the RoPE positions with `cartesian_prod(grid_t, grid_h, grid_w)`, the same order. No token joins the sequence.
The patch embedding never patches time; the grid takes the forward's own `F // patch_size_t`, the token frames at
the published `patch_size_t=1` (another value gives a sequence that does not match the grid: dense, one warning).

Head dim: the published model has 24 heads of 96 (a multiple of 6, which its RoPE needs); the GPU kernels take 64
and 128, so on CUDA they run q, k, v zero-padded to 128 (`kernels.dispatch.PaddedHeadDim`, a third more tensor work);
the CPU reference serves 96 as it is.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import AllegroAttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb_allegro

from ..rope import HalfRope
from .base import MASK_REASON, SparseAttentionMixin, project_output
from .grids import video_grid


class AllegroSparseAttnProcessor(SparseAttentionMixin, AllegroAttnProcessor2_0):
    """`AllegroAttnProcessor2_0` whose self-attention runs through videosparse.

    Projections run in (B, H, S, D) layout as diffusers does; the RoPE goes to `attend` as a three-section
    `HalfRope` (fused into the tile-order gather on sparse calls). Calls with
    encoder states (cross-attention, `attn2`) go to the stock processor untouched, and so does a call with an
    attention mask (the forward's optional video mask, which `AllegroPipeline` never passes; warned once per layer).
    Allegro's `attn1` has no spatial or group norm, residual connection or output rescale, so those stock steps are
    left out.
    """

    _stock = AllegroAttnProcessor2_0

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 image_rotary_emb=None):
        stock = (attn, hidden_states, encoder_hidden_states, attention_mask, temb, image_rotary_emb)
        if encoder_hidden_states is not None:
            return self._to_stock(None, *stock)
        if attention_mask is not None:
            return self._to_stock(MASK_REASON, *stock)
        query, key, value = (proj(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)   # [B, H, S, D]
                             for proj in (attn.to_q, attn.to_k, attn.to_v))
        rope = None if image_rotary_emb is None else allegro_half_rope(*image_rotary_emb)
        if rope is None and image_rotary_emb is not None:
            query = apply_rotary_emb_allegro(query, *image_rotary_emb)
            key = apply_rotary_emb_allegro(key, *image_rotary_emb)
        hidden_states = self.attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), rope=rope)
        return project_output(attn, hidden_states, query)


def allegro_half_rope(freqs, positions) -> HalfRope | None:
    """Allegro's RoPE (`apply_rotary_emb_allegro(x, freqs, positions)`: t, h, w tables [P, D/6] looked up at each
    token's positions [1, S], rotate-half in each third of the head dim) as one `HalfRope` [1, S, 1, D] with three
    sections, which `attend` applies (fused into the tile-order gather on sparse calls); None when the positions are
    given per batch item."""
    if any(p.dim() != 2 or p.shape[0] != 1 for p in positions):
        return None
    cos, sin = (torch.cat([torch.nn.functional.embedding(p[0], table[i]) for p, table in zip(positions, freqs)], -1)
                for i in (0, 1))
    # in fp32 as diffusers' (it rotates tokens.float()), also where a caller cast the tables to the model's dtype
    return HalfRope(cos.float()[None, :, None], sin.float()[None, :, None], sections=len(freqs))


def allegro_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int]:
    """Token grid after patching from the forward's hidden_states (B, C, F, H, W), as the forward computes it; no
    joint text."""
    return video_grid(module, args, kwargs), 0
