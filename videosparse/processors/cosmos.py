"""NVIDIA Cosmos (`CosmosTransformer3DModel`: Cosmos 1.0 Diffusion, Cosmos-Predict2, Cosmos-Predict2.5 and
Cosmos-Transfer2.5): sparse self-attention processor and model facts.

Every block's `attn1` is video-only self-attention with `CosmosAttnProcessor2_0`, in every config; `attn2` is the
cross-attention to the text (`CosmosAttnProcessor2_0`, or `CosmosAttnProcessor2_5` on a `CosmosAttention` that also
attends to image context when `img_context_dim_in` is set, Transfer2.5) and keeps its stock processor.

Token order: `CosmosPatchEmbed` reshapes hidden_states (B, C, T, H, W) into (T/pt, pt, H/ph, ph, W/pw, pw) patches,
permutes them to (B, T', H', W', C * pt * ph * pw) and the forward flattens (T', H', W'), so token
`t * H' * W' + h * W' + w` is patch (t, h, w): time-major. The RoPE tables of `CosmosRotaryPosEmbed` are flattened
the same way. The condition mask and the padding mask the pipelines pass are concatenated as channels, the text and
image context enter through `attn2` (the forward's `attention_mask` is the text mask, given to `attn2` only), and
controlnet residuals are added to the tokens: nothing changes the sequence of `attn1`, which the model calls without
a mask.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_cosmos import CosmosAttnProcessor2_0

from ..rope import HalfRope
from .base import MASK_REASON, SparseAttentionMixin, project_output
from .grids import video_grid


class CosmosSparseAttnProcessor(SparseAttentionMixin, CosmosAttnProcessor2_0):
    """`CosmosAttnProcessor2_0` whose self-attention runs through videosparse.

    Projections and the per-head RMSNorm of q and k are diffusers' own; the RoPE (`apply_rotary_emb(...,
    use_real=True, use_real_unbind_dim=-2)`, the rotate-half rotation) goes to `attend` as a `HalfRope`, fused into the
    tile-order gather on sparse calls. The stock processor's `repeat_interleave(query.size(3) // key.size(3), dim=3)`
    of k and v is a factor of 1 for every `CosmosTransformer3DModel` (its q and k are split into the same heads), so
    it is left out. Calls with encoder states (cross-attention) go to the stock processor
    untouched, and so does a call with an attention mask (the model never gives `attn1` one; warned once per layer).
    """

    _stock = CosmosAttnProcessor2_0

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        stock = (attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if encoder_hidden_states is not None:
            return self._to_stock(None, *stock)
        if attention_mask is not None:
            return self._to_stock(MASK_REASON, *stock)
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))                  # [B, S, H, D]
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        query, key = attn.norm_q(query), attn.norm_k(key)
        # diffusers' apply_rotary_emb(use_real=True, use_real_unbind_dim=-2) is the rotate-half RoPE (in fp32)
        rope = None if image_rotary_emb is None else HalfRope(*(t[None, :, None] for t in image_rotary_emb))
        return project_output(attn, self.attend(query, key, value, rope=rope), query)


def cosmos_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int]:
    """Token grid after patching from the forward's hidden_states (B, C, T, H, W) and `patch_size`; no joint text."""
    return video_grid(module, args, kwargs), 0
