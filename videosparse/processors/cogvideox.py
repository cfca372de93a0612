"""CogVideoX 1.0 / 1.5 (`CogVideoXTransformer3DModel`): sparse self-attention processor and model facts.

Every block's `attn1` attends over the joint sequence [text; video] (the text, 226 tokens for the
published checkpoints, comes first); RoPE, when the model uses it, covers the video part only.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0

from .base import MASK_REASON, SparseAttentionMixin, project_heads, project_output, rope_after_text
from .forward_args import forward_arg
from .grids import patched_grid


class CogVideoXSparseAttnProcessor(SparseAttentionMixin, CogVideoXAttnProcessor2_0):
    """`CogVideoXAttnProcessor2_0` whose joint self-attention runs through videosparse.

    Projections and qk-norm are diffusers' own; the RoPE of the video rows goes to `attend` as a `PairRope` (fused into
    the tile-order gather on sparse calls). A call with an
    attention mask (the model itself never passes one) goes to the stock processor.
    """

    _stock = CogVideoXAttnProcessor2_0

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            return self._to_stock(MASK_REASON, attn, hidden_states, encoder_hidden_states, attention_mask,
                                  image_rotary_emb)
        text_len = encoder_hidden_states.size(1)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        query, key, value = project_heads(hidden_states, attn.heads, attn.to_q, attn.to_k, attn.to_v,
                                          attn.norm_q, attn.norm_k)            # [B, S, H, D]
        query, rope = rope_after_text(attn, query, text_len, image_rotary_emb)
        hidden_states = project_output(attn, self.attend(query, key, value, rope=rope), query)
        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_len, hidden_states.size(1) - text_len], dim=1)
        return hidden_states, encoder_hidden_states


def cogvideox_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int]:
    """Video grid after patching from hidden_states (B, F, C, H, W), and the text length (text first).

    CogVideoX 1.5 patches time too (`patch_size_t`); its pipeline pads the latent frames to a multiple. ConsisID's
    config has no `patch_size_t` (spatial patches only).
    """
    hidden_states = forward_arg(args, kwargs, "hidden_states", 0)
    text = forward_arg(args, kwargs, "encoder_hidden_states", 1)
    _, F, _, H, W = hidden_states.shape
    return patched_grid(module, F, H, W), text.shape[1]
