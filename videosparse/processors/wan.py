"""Wan 2.1 / 2.2 (`WanTransformer3DModel`): sparse self-attention processor and model facts."""

from __future__ import annotations

from diffusers.models.transformers.transformer_wan import WanAttnProcessor, _get_qkv_projections

from .base import SparseAttentionMixin
from .context import forward_arg


class WanSparseAttnProcessor(SparseAttentionMixin, WanAttnProcessor):
    """`WanAttnProcessor` whose self-attention runs through videosparse.

    Projections and qk-norm are diffusers' own and RoPE is its math (`apply_interleaved_rope`); on
    sparse calls the rotation is fused into the tile-order gather. Only the attention call changes. Calls with
    encoder states (cross-attention, image context) go to the stock processor untouched.
    """

    def __init__(self, session, layer: int, original=None) -> None:
        WanAttnProcessor.__init__(self)
        self._init_sparse(session, layer, original)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attn.add_k_proj is not None:
            return WanAttnProcessor.__call__(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        hidden_states = self.attend(query, key, value, attention_mask, rope=rotary_emb)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


def wan_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int]:
    """Video grid after patching from the forward's hidden_states (B, C, F, H, W); Wan has no joint text."""
    hidden_states = forward_arg(args, kwargs, "hidden_states", 0)
    _, _, F, H, W = hidden_states.shape
    pt, ph, pw = module.config.patch_size
    return (F // pt, H // ph, W // pw), 0
