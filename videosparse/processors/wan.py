"""The Wan family: Wan 2.1 / 2.2 (`WanTransformer3DModel`), Wan VACE (`WanVACETransformer3DModel`), SkyReels V2
(`SkyReelsV2Transformer3DModel`) and Wan 2.2 Animate (`WanAnimateTransformer3DModel`): sparse self-attention
processors and model facts.

The four share one attention layout (diffusers copies Wan's processor into SkyReels V2 and Wan Animate, and
VACE's blocks use Wan's own): qkv projections, qk-norm across heads, interleaved RoPE from (freqs_cos,
freqs_sin) tables, video tokens only (text and image context enter by cross-attention). One mixin
serves them; each model's class only names its stock processor and projection helper.

Wan Animate's video tokens are one grid too: the pose latents are added in place to the patched frames 1..T, so
hidden_states (B, 2C+4, T+1, H, W) gives (T+1, H/ph, W/pw) tokens, time-major. Its face adapter
(`WanAnimateFaceBlockAttnProcessor`, video queries against per-frame motion tokens) is a cross-attention and stays
stock.
"""

from __future__ import annotations

from diffusers.models.transformers import transformer_skyreels_v2, transformer_wan, transformer_wan_animate

from .base import SparseAttentionMixin
from .context import forward_arg


class _WanFamilySparseAttention(SparseAttentionMixin):
    """The shared `__call__`: self-attention through videosparse, everything else to the stock processor.

    Projections and qk-norm are diffusers' own and RoPE is its math (`apply_interleaved_rope`); on
    sparse calls the rotation is fused into the tile-order gather. Only the attention call changes. Calls
    with encoder states (cross-attention, image context) go to the stock processor untouched.
    """

    _qkv = None                        # the stock processor's module's `_get_qkv_projections`

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attn.add_k_proj is not None:
            return self._stock.__call__(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = type(self)._qkv(attn, hidden_states, None)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        hidden_states = self.attend(query, key, value, attention_mask, rope=rotary_emb)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


class WanSparseAttnProcessor(_WanFamilySparseAttention, transformer_wan.WanAttnProcessor):
    """`WanAttnProcessor` whose self-attention runs through videosparse (Wan 2.1 / 2.2 and Wan VACE)."""

    _stock = transformer_wan.WanAttnProcessor
    _qkv = staticmethod(transformer_wan._get_qkv_projections)


class SkyReelsV2SparseAttnProcessor(_WanFamilySparseAttention, transformer_skyreels_v2.SkyReelsV2AttnProcessor):
    """`SkyReelsV2AttnProcessor` whose self-attention runs through videosparse.

    Diffusion forcing with `causal_block_size > 1` (`num_frame_per_block`) passes a block-causal mask to
    every self-attention call; those calls run dense (one warning per layer), never a wrong result.
    """

    _stock = transformer_skyreels_v2.SkyReelsV2AttnProcessor
    _qkv = staticmethod(transformer_skyreels_v2._get_qkv_projections)


class WanAnimateSparseAttnProcessor(_WanFamilySparseAttention, transformer_wan_animate.WanAttnProcessor):
    """Wan Animate's own `WanAttnProcessor` (a module-local copy of Wan's) whose self-attention runs through
    videosparse; served on the blocks' `attn1` only."""

    _stock = transformer_wan_animate.WanAttnProcessor
    _qkv = staticmethod(transformer_wan_animate._get_qkv_projections)


def wan_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int]:
    """Video grid after patching from the forward's hidden_states (B, C, F, H, W); no joint text."""
    hidden_states = forward_arg(args, kwargs, "hidden_states", 0)
    _, _, F, H, W = hidden_states.shape
    pt, ph, pw = module.config.patch_size
    return (F // pt, H // ph, W // pw), 0
