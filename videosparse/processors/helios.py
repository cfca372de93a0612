"""Helios (`HeliosTransformer3DModel`; `HeliosPipeline`, `HeliosPyramidPipeline`): sparse self-attention processor and
model facts.

Helios is the Wan 2.1 backbone with its own attention module and processor (`HeliosAttnProcessor`): q/k/v
projections, qk-norm across heads, an interleaved RoPE from one table [B, S, 2D] (cos | sin, each repeated over the
pairs, `apply_rotary_emb_transposed`), and no attention mask: the blocks call `attn1` with `attention_mask=None`.
The text enters by cross-attention (`attn2`, stock; with `guidance_cross_attn` only the video tokens take it).

Token order of `attn1`: [long history; mid history; short history; video]. The forward patches hidden_states
(B, C, F, H, W) with `patch_embedding` ((F, H/ph, W/pw) tokens, time-major) and then prepends each history part it
is given with its frame indices: the short history (`patch_short`, kernel = patch size), before it the mid history
(padded to whole (2, 4, 4) latents, `patch_mid`, kernel 2 x patch), before that the long history (padded to whole
(4, 8, 8), `patch_long`, kernel 4 x patch), each time-major and with RoPE at its own frame indices (the mid / long
tables average-pooled). The pipelines always pass all three (zeros before anything is generated): at the defaults
(history sizes 16 / 2 / 1 + the first frame, 9 latent frames per chunk, 384 x 640) that is 8,640 video tokens and
1,920 + 240 + 240 history tokens. The history comes before the video, so it is served like joint text before it
(`text_position="before"`): global tiles that every video query attends to, over full attention. With
`is_amplify_history` the keys of the history tokens are multiplied by a learned per-head (or scalar) scale before the
attention call; the processor does the same, so the attention is the stock one.

No call of Helios has a causal or block mask or a KV cache (the chunks are generated one after another, each a full
forward over [history; chunk]); a call given a mask all the same keeps the stock processor, with one warning per layer.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers import transformer_helios

from .base import MASK_REASON
from .grids import HistoryPart, history_tokens, video_grid
from .parallel import UlyssesShard, ulysses_shard
from .wan import _WanFamilySparseAttention

# the history parts the forward puts before the video: the mid and long latents padded (`pad_for_3d_conv`) to whole
# (2, 4, 4) and (4, 8, 8) latents before their patch embeddings
_HISTORY = (
    HistoryPart("latents_history_short", 7, "indices_latents_history_short", 4, "patch_short"),
    HistoryPart("latents_history_mid", 8, "indices_latents_history_mid", 5, "patch_mid", (2, 4, 4)),
    HistoryPart("latents_history_long", 9, "indices_latents_history_long", 6, "patch_long", (4, 8, 8)),
)


class HeliosSparseAttnProcessor(_WanFamilySparseAttention, transformer_helios.HeliosAttnProcessor):
    """`HeliosAttnProcessor` whose self-attention (`attn1`) runs through videosparse.

    Projections and qk-norm are Wan's (the shared mixin), the RoPE is diffusers' `apply_rotary_emb_transposed` and the
    history keys are scaled as in stock; only the attention call changes. Cross-attention calls go to the stock
    processor untouched.
    """

    _stock = transformer_helios.HeliosAttnProcessor
    _qkv = staticmethod(transformer_helios._get_qkv_projections)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 original_context_length=None):
        stock = (attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, original_context_length)
        if encoder_hidden_states is not None or attn.is_cross_attention or attn.add_k_proj is not None:
            return self._to_stock(None, *stock)
        if attention_mask is not None:          # (Helios passes none; a causal or block mask is not served)
            return self._to_stock(MASK_REASON, *stock)
        # the video's token count rides with the rotary table into `_project`, which scales the history keys
        return super().__call__(attn, hidden_states, None, attention_mask, (rotary_emb, original_context_length))

    def _project(self, attn, hidden_states, rotary):
        rotary_emb, original_context_length = rotary
        query, key, value, _ = super()._project(attn, hidden_states, None)
        if rotary_emb is not None:
            query = transformer_helios.apply_rotary_emb_transposed(query, rotary_emb)
            key = transformer_helios.apply_rotary_emb_transposed(key, rotary_emb)
        if attn.is_amplify_history:
            history = self._local_history(hidden_states.shape[1], original_context_length)
            if history > 0:
                scale = 1.0 + torch.sigmoid(attn.history_key_scale) * (attn.max_scale - 1.0)
                if attn.history_scale_mode == "per_head":
                    scale = scale.view(1, 1, -1, 1)
                key = torch.cat([key[:, :history] * scale, key[:, history:]], dim=1)
        return query, key, value, None

    def _local_history(self, rows: int, video_tokens: int) -> int:
        """How many of this call's `rows` (the first ones) are history tokens: all rows but the video's
        `video_tokens`; under Ulysses context parallelism the rows are this rank's contiguous 1/P of the sequence,
        so the history rows are those of the whole sequence's history that fall in it (stock diffusers subtracts the
        video from the shard's length, scaling no history key on any rank: 0.28 rel L2 off the single-GPU output)."""
        shard = ulysses_shard(getattr(self, "_parallel_config", None))
        if not isinstance(shard, UlyssesShard):
            return rows - video_tokens
        return min(max(rows * shard.world - video_tokens - shard.rank * rows, 0), rows)


def helios_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int]:
    """Video grid after patching from the forward's hidden_states (B, C, F, H, W), and the history tokens before the
    video (served as joint text before it): each part given with its frame indices, as the forward counts it."""
    return video_grid(module, args, kwargs), history_tokens(module, args, kwargs, _HISTORY)
