"""EasyAnimate (`EasyAnimateTransformer3DModel`; `EasyAnimatePipeline`, `EasyAnimateInpaintPipeline`,
`EasyAnimateControlPipeline`): sparse self-attention processor and model facts.

Every block's `attn1` (`EasyAnimateAttnProcessor2_0`, the block's only attention) is joint self-attention over
[text; video], text first, like CogVideoX: the MMDiT blocks (the first `mmdit_layers`, every block of the published
V5.1 configs) project the text with the `add_*_proj` layers and their own qk-norm and concatenate it before the
video; the other blocks concatenate the text before the video and project both with to_q/k/v. Per-head LayerNorm
qk-norm, then RoPE (`apply_rotary_emb`, (cos, sin) tables, pairs interleaved) on the video part only. The block never
gives `attn1` a mask: the text the pipelines pad to `max_sequence_length` is attended in full, padded tokens too (the
prompt mask only goes to the text encoder), so every text token is a global tile.

Token order: the forward runs a Conv2d (kernel p x p) on every frame of hidden_states (B, C, F, H, W), then
`flatten(2, 4)` of (B, C', F, H/p, W/p), so token `t * H' * W' + h * W' + w` is patch (t, h, w): time-major, no
temporal patching. `EasyAnimateRotaryPosEmbed` (`get_3d_rotary_pos_embed`) flattens its tables the same way. The text
is `text_proj(encoder_hidden_states)`, followed by `text_proj_t5(encoder_hidden_states_t5)` when given. The inpaint
(mask + masked video) and control latents are concatenated as channels before the patch embedding: no extra tokens.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_easyanimate import (
    EasyAnimateAttnProcessor2_0,
)

from .base import (
    MASK_REASON,
    SparseAttentionMixin,
    project_heads,
    project_joint_outputs,
    project_text_heads,
    rope_after_text,
)
from .forward_args import forward_arg
from .grids import video_grid


class EasyAnimateSparseAttnProcessor(SparseAttentionMixin, EasyAnimateAttnProcessor2_0):
    """`EasyAnimateAttnProcessor2_0` whose joint [text; video] self-attention runs through videosparse.

    Projections, qk-norm and RoPE are diffusers' own; only the attention call changes. Calls the model never makes
    (with an attention mask, or without text) go to the stock processor, warned once per layer.
    """

    _stock = EasyAnimateAttnProcessor2_0

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        reason = (MASK_REASON if attention_mask is not None
                  else "no text was given (encoder_hidden_states is None)" if encoder_hidden_states is None else None)
        if reason is not None:
            return self._to_stock(reason, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        text_len = encoder_hidden_states.shape[1]
        if attn.add_q_proj is None:                  # not an MMDiT block: the text goes through to_q/k/v too
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        query, key, value = project_heads(hidden_states, attn.heads, attn.to_q, attn.to_k, attn.to_v,
                                          attn.norm_q, attn.norm_k)            # [B, S, H, D]
        if attn.add_q_proj is not None:
            enc_query, enc_key, enc_value = project_text_heads(attn, encoder_hidden_states)
            query = torch.cat([enc_query, query], dim=1)
            key = torch.cat([enc_key, key], dim=1)
            value = torch.cat([enc_value, value], dim=1)
        query, rope = rope_after_text(attn, query, text_len, image_rotary_emb)

        hidden_states = self.attend(query, key, value, rope=rope).flatten(2, 3).to(query.dtype)
        encoder_hidden_states, hidden_states = hidden_states[:, :text_len], hidden_states[:, text_len:]
        return project_joint_outputs(attn, hidden_states, encoder_hidden_states)


def easyanimate_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int]:
    """Video grid after patching of hidden_states (B, C, F, H, W) and the text tokens before it (all of them: the
    model attends to the padded ones too), the T5 tokens included when `encoder_hidden_states_t5` is given."""
    text = forward_arg(args, kwargs, "encoder_hidden_states", 3)
    text_t5 = forward_arg(args, kwargs, "encoder_hidden_states_t5", 4)
    return video_grid(module, args, kwargs), text.shape[1] + (text_t5.shape[1] if text_t5 is not None else 0)
