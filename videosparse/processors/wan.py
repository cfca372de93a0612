"""The Wan family: Wan 2.1 / 2.2 (`WanTransformer3DModel`), Wan VACE (`WanVACETransformer3DModel`), SkyReels V2
(`SkyReelsV2Transformer3DModel`), Wan 2.2 Animate (`WanAnimateTransformer3DModel`), ChronoEdit
(`ChronoEditTransformer3DModel`) and AnyFlow (`AnyFlowTransformer3DModel`): sparse self-attention processors and
model facts.

They share one attention layout (diffusers copies Wan's processor into SkyReels V2, Wan Animate and ChronoEdit, and
VACE's blocks use Wan's own): qkv projections, qk-norm across heads, interleaved RoPE from (freqs_cos,
freqs_sin) tables, video tokens only (text and image context enter by cross-attention). One mixin
serves them; each model's class only names its stock processor and projection helper.

Wan Animate's video tokens are one grid too: the pose latents are added in place to the patched frames 1..T, so
hidden_states (B, 2C+4, T+1, H, W) gives (T+1, H/ph, W/pw) tokens, time-major. Its face adapter
(`WanAnimateFaceBlockAttnProcessor`, video queries against per-frame motion tokens) is a cross-attention and stays
stock.

ChronoEdit is Wan 2.1 I2V with its own copy of the processor and a RoPE that differs only in the positions: a
2-frame latent (input image, edited image: the pipeline without temporal reasoning, or after its reasoning steps,
which keep latent frames [0, -1]) takes temporal positions 0 and `rope_temporal_skip_len - 1`; otherwise 0..F-1.
No token is dropped from the sequence: hidden_states (B, C, F, H, W) always gives (F, H/ph, W/pw) tokens,
time-major, so the grid is read as for Wan (it shrinks from F to 2 frames mid-run under temporal reasoning).

AnyFlow (the bidirectional flow-map model) is the Wan 2.1 backbone with its own attention module: plain q/k/v
projections, qk-norm across heads, and RoPE as complex frequencies ({"query", "key"}: [1, 1, S, D/2]) applied in
float64 in (B, H, S, D) layout; its forward takes hidden_states (B, F, C, H, W), frames first, and patches it as
Wan does (F, H/ph, W/pw tokens, time-major). Its self-attention has no mask: full attention over the grid. The
FAR causal model (`AnyFlowFARTransformer3DModel`, a separate class with a flex BlockMask, a KV cache and
compressed-frame tokens) is not served.
"""

from __future__ import annotations

from diffusers.models.transformers import (
    transformer_anyflow,
    transformer_chronoedit,
    transformer_skyreels_v2,
    transformer_wan,
    transformer_wan_animate,
)

from .base import SparseAttentionMixin
from .context import forward_arg


class _WanFamilySparseAttention(SparseAttentionMixin):
    """The shared `__call__`: self-attention through videosparse, everything else to the stock processor.

    Projections and qk-norm are diffusers' own and RoPE is its math (`apply_interleaved_rope`); on
    sparse calls the rotation is fused into the tile-order gather. Only the attention call changes. Calls
    with encoder states (cross-attention, image context) go to the stock processor untouched. A model whose RoPE
    is not Wan's tables (AnyFlow) applies its own in `_project`.
    """

    _qkv = None                        # the stock processor's module's `_get_qkv_projections`

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or getattr(attn, "add_k_proj", None) is not None:
            return self._stock.__call__(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value, rope = self._project(attn, hidden_states, rotary_emb)
        hidden_states = self.attend(query, key, value, attention_mask, rope=rope)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)

    def _project(self, attn, hidden_states, rotary_emb):
        """q, k, v [B, S, H, D] after qk-norm, and the rotary tables still to apply to q and k (None: applied)."""
        query, key, value = type(self)._qkv(attn, hidden_states, None)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        return query, key, value.unflatten(2, (attn.heads, -1)), rotary_emb


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


class ChronoEditSparseAttnProcessor(_WanFamilySparseAttention, transformer_chronoedit.WanAttnProcessor):
    """ChronoEdit's own `WanAttnProcessor` (a module-local copy of Wan's) whose self-attention runs through
    videosparse; served on the blocks' `attn1` only (attn2 takes the text and the CLIP image context)."""

    _stock = transformer_chronoedit.WanAttnProcessor
    _qkv = staticmethod(transformer_chronoedit._get_qkv_projections)


class AnyFlowSparseAttnProcessor(_WanFamilySparseAttention, transformer_anyflow.AnyFlowAttnProcessor):
    """`AnyFlowAttnProcessor` (bidirectional self-attention) whose attention runs through videosparse.

    The projections are its module's plain to_q / to_k / to_v, and RoPE is diffusers' `apply_rotary_emb` of
    the AnyFlow module (complex, float64), applied to q, k [B, S, H, D] with the frequencies moved to that layout.
    """

    _stock = transformer_anyflow.AnyFlowAttnProcessor
    _qkv = staticmethod(lambda attn, x, _: (attn.to_q(x), attn.to_k(x), attn.to_v(x)))

    def _project(self, attn, hidden_states, rotary_emb):
        query, key, value, _ = super()._project(attn, hidden_states, None)
        if rotary_emb is not None:
            query = transformer_anyflow.apply_rotary_emb(query, rotary_emb["query"].transpose(1, 2))
            key = transformer_anyflow.apply_rotary_emb(key, rotary_emb["key"].transpose(1, 2))
        return query, key, value, None


def wan_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int]:
    """Video grid after patching from the forward's hidden_states (B, C, F, H, W); no joint text."""
    hidden_states = forward_arg(args, kwargs, "hidden_states", 0)
    _, _, F, H, W = hidden_states.shape
    pt, ph, pw = module.config.patch_size
    return (F // pt, H // ph, W // pw), 0


def anyflow_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int]:
    """Video grid after patching from AnyFlow's hidden_states (B, F, C, H, W), frames first; no joint text."""
    hidden_states = forward_arg(args, kwargs, "hidden_states", 0)
    _, F, _, H, W = hidden_states.shape
    pt, ph, pw = module.config.patch_size
    return (F // pt, H // ph, W // pw), 0
