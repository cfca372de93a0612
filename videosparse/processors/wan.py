"""The Wan family: Wan 2.1 / 2.2 (`WanTransformer3DModel`), Wan VACE (`WanVACETransformer3DModel`), SkyReels V2
(`SkyReelsV2Transformer3DModel`), Wan 2.2 Animate (`WanAnimateTransformer3DModel`), Wan-Animate-2
(`WanAnimate2Transformer3DModel`), ChronoEdit (`ChronoEditTransformer3DModel`) and AnyFlow
(`AnyFlowTransformer3DModel`): sparse self-attention processors and model facts.

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

Wan-Animate-2 runs each segment as two kinds of forward of one transformer (`kv_cache_mode`). The forward takes
hidden_states and condition_latents as lists of (C, F, H, W) latents, one per batch item, concatenates each pair
along C and patches it with a Conv3d, `flatten(2)`: (F/pt, H/ph, W/pw) tokens, time-major; every item must hold
`seq_len` of them (no padding). The blocks' self-attention is `self_attn` (`WanAnimate2AttnProcessor`: Wan's qkv
projections and qk-norm across heads; RoPE from complex float64 tables, applied per item by `rope_apply` over the
item's (F, H, W), with a temporal stride and the `refer_offset_*` shift for the reference stream); `cross_attn`
(`WanAnimate2CrossAttnProcessor`: the text and the CLIP image context) stays stock.
* The reference-extraction pass ("extract": the driving-video segment, once per segment, modulated at timestep 1)
  is unmasked self-attention over its grid: served sparse. It caches every layer's pre-RoPE K/V. The pipeline
  passes it the schedule's first timestep, so the context hook counts it as step 0 (dense within the dense steps).
* The generation pass ("cached": every denoising step; the grid is the reference image's latent frame then the
  segment's frames) attends from each generation token to every generation token plus the cached reference tokens
  of one frame (generation frame f to reference frame f - 1), through a flex `BlockMask` over 128-padded buffers.
  Those reference keys are keys of one frame's queries only (not global tiles), so the generation part is served
  sparse and the reference part added densely per frame, merged by log-sum-exp (`WanAnimate2SparseAttnProcessor`).

AnyFlow (the bidirectional flow-map model) is the Wan 2.1 backbone with its own attention module: plain q/k/v
projections, qk-norm across heads, and RoPE as complex frequencies ({"query", "key"}: [1, 1, S, D/2]) applied in
float64 in (B, H, S, D) layout; its forward takes hidden_states (B, F, C, H, W), frames first, and patches it as
Wan does (F, H/ph, W/pw tokens, time-major). Its self-attention has no mask: full attention over the grid. The
FAR causal model (`AnyFlowFARTransformer3DModel`, a separate class with a flex BlockMask, a KV cache and
compressed-frame tokens) is not served.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers import (
    transformer_anyflow,
    transformer_chronoedit,
    transformer_skyreels_v2,
    transformer_wan,
    transformer_wan_animate,
    transformer_wan_animate_2,
)

from ..rope import apply_interleaved_rope
from .base import SparseAttentionMixin, dense_with_lse, merge_attention, project_output
from .forward_args import forward_arg
from .grids import patched_grid, video_grid


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
            return self._to_stock(None, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value, rope = self._project(attn, hidden_states, rotary_emb)
        return project_output(attn, self.attend(query, key, value, attention_mask, rope=rope), query)

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


class WanAnimate2SparseAttnProcessor(_WanFamilySparseAttention, transformer_wan_animate_2.WanAnimate2AttnProcessor):
    """`WanAnimate2AttnProcessor` whose self-attention runs through videosparse in both passes; served on the blocks'
    `self_attn` only.

    Extraction pass (kv_cache_mode="extract"): the K/V cache gets the same pre-RoPE projections as in stock; then
    `attend`, with the pass's RoPE as Wan's fp32 tables (`wan_animate2_rope`; stock's `rope_apply` does the same
    rotation in float64, ~8 passes over q and over k), fused into the tile-order gather on sparse calls.

    Generation pass (kv_cache_mode="cached"): stock attends from generation frame f to every generation token and
    to reference frame f - 1 (f >= 1) through a flex BlockMask over 128-padded buffers. Here the generation part
    runs through `attend(..., return_lse=True)` (sparse over the generation grid, or dense on the kernel in dense
    steps and layers), the reference part densely per frame on the kernel (`dense_with_lse`: the queries of frame
    f against the hw reference keys of frame f - 1, a 1/F share of the dense work), and the two are merged by
    their log-sum-exp (`merge_attention`): the stock result, sparse in its generation part only. The layer's
    density counts the generation part. Served when the segment fills the geometry the mask was built for (the
    pipeline's calls do): F = origin frames + 1 generation frames of origin hw tokens, origin-frames reference
    frames of as many tokens; other geometries (where stock's zero padding also counts as keys) and a parallel
    config keep the stock call. Under the dense config both parts run dense on the kernel.
    """

    _stock = transformer_wan_animate_2.WanAnimate2AttnProcessor
    _qkv = staticmethod(transformer_wan_animate_2._get_qkv_projections)
    timed_entry = "attend_pass"        # the generation pass's reference part and merge run outside `attend`

    def __call__(self, attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode, rope_stride=1,
                 reference_rotary_emb=None, reference_grid_sizes=None, reference_rope_stride=1, attention_mask=None,
                 origin_latent_frames=None, origin_latent_hw=None):
        reason = self._unserved(kv_cache_mode)
        if reason is not None:
            return self._to_stock(
                reason, attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode, rope_stride,
                reference_rotary_emb, reference_grid_sizes, reference_rope_stride, attention_mask,
                origin_latent_frames, origin_latent_hw)
        query, key, value, _ = self._project(attn, hidden_states, None)
        hidden_states = self.attend_pass(query, key, value, rotary_emb, rope_stride, kv_cache, kv_cache_mode,
                                         reference_rotary_emb, reference_rope_stride)
        return project_output(attn, hidden_states, query)

    def attend_pass(self, query, key, value, rotary_emb, rope_stride, kv_cache, kv_cache_mode, reference_rotary_emb,
                    reference_rope_stride):
        """A served call's whole attention from its pre-RoPE projections q, k, v [B, S, H, D] -> [B, S, H, D]: the
        extraction pass's `attend`, or the generation pass's RoPE, reference-frame part and merge (what
        `AttentionTimer` times)."""
        grid = self.session.context.grid
        rope = wan_animate2_rope(rotary_emb, grid, rope_stride)
        if kv_cache_mode == "extract":
            kv_cache.store(key, value)
            return self.attend(query, key, value, rope=rope)
        key_ref, value_ref = kv_cache.get()
        key_ref = apply_interleaved_rope(
            key_ref, *wan_animate2_rope(reference_rotary_emb, (grid[0] - 1, *grid[1:]), reference_rope_stride))
        query, key = apply_interleaved_rope(query, *rope), apply_interleaved_rope(key, *rope)
        return self._generation_attention(query, key, value, key_ref, value_ref, grid[1] * grid[2])

    def _unserved(self, kv_cache_mode) -> str | None:
        """Why a call keeps the stock processor (None: served, also under the dense config): an unknown mode (stock
        raises), what `wan_animate2_grid` found in the context hook (items of different grids; a generation
        geometry off the mask's), a parallel config (the model has no context-parallel plan in diffusers, and the
        RoPE tables here span the whole sequence)."""
        if kv_cache_mode not in ("extract", "cached"):
            return f"kv_cache_mode={kv_cache_mode!r}"
        if getattr(self, "_parallel_config", None) is not None:
            return "Wan-Animate-2 under a parallel config keeps the stock processor"
        return self.session.context.unsupported

    def _generation_attention(self, q, k, v, k_ref, v_ref, hw: int):
        """q, k, v [B, F*hw, H, D] of the generation tokens, k_ref, v_ref [B, (F-1)*hw, H, D] of the reference
        frames -> [B, F*hw, H, D]: generation frame f attends to all of q's keys and to reference frame f - 1."""
        out, lse = self.attend(q, k, v, return_lse=True)
        B, S, H, D = q.shape
        frames = S // hw - 1
        if frames == 0:
            return out
        per_frame = (lambda x: x[:, :frames * hw].reshape(B * frames, hw, H, D))
        out_ref, lse_ref = dense_with_lse(per_frame(q[:, hw:]), per_frame(k_ref), per_frame(v_ref),
                                          self._kernel_choice)
        merged, _ = merge_attention(out[:, hw:], lse[:, hw:], out_ref.reshape(B, frames * hw, H, D),
                                    lse_ref.reshape(B, frames * hw, H))
        return torch.cat([out[:, :hw], merged], dim=1)


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
    return video_grid(module, args, kwargs), 0


def wan_animate2_rope(freqs: torch.Tensor, grid: tuple[int, int, int], stride: int = 1):
    """Wan-Animate-2's RoPE as Wan's rotary tables (freqs_cos, freqs_sin), fp32 [1, F*H*W, 1, D], for
    `apply_interleaved_rope` and the fused tile-order gather: the complex position table `freqs` [positions, D/2]
    (the forward's, with the pass's offsets) laid over the grid (F, H, W) time-major, frames `stride` apart, split
    over (t, h, w) as diffusers' `rope_apply` splits it; that function computes the same rotation in float64."""
    F, H, W = grid
    c = freqs.shape[1]
    t, h, w = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    table = torch.cat([t[: F * stride: stride].view(F, 1, 1, -1).expand(F, H, W, -1),
                       h[:H].view(1, H, 1, -1).expand(F, H, W, -1),
                       w[:W].view(1, 1, W, -1).expand(F, H, W, -1)], dim=-1).reshape(1, F * H * W, 1, c)
    return (table.real.float().repeat_interleave(2, dim=-1), table.imag.float().repeat_interleave(2, dim=-1))


def wan_animate2_grid(module, args, kwargs):
    """Video grid after patching of this pass's latents from Wan-Animate-2's hidden_states, a list of (C, F, H, W)
    (one per batch item; each must hold `seq_len` tokens); no joint text. For a generation pass also why its
    geometry is not served (None when it is): the items and the reference grid must agree, and the segment must
    fill the geometry that the forward builds the block mask for (`origin_len // 4 + 1` reference frames, that + 1
    generation frames, `origin_area` pixels / 256 tokens per frame; else stock's zero padding counts as keys)."""
    hidden_states = forward_arg(args, kwargs, "hidden_states", 0)
    _, F, H, W = hidden_states[0].shape
    grid = patched_grid(module, F, H, W)
    if len({tuple(u.shape[1:]) for u in hidden_states}) > 1:
        return grid, 0, "Wan-Animate-2's batch items have grids of different sizes; the call keeps the stock processor"
    if forward_arg(args, kwargs, "kv_cache_mode", 5) != "cached":
        return grid, 0, None
    ref_grids = forward_arg(args, kwargs, "reference_grid_sizes", 9).tolist()
    origin_len, origin_area = forward_arg(args, kwargs, "origin_len", 10), forward_arg(args, kwargs, "origin_area", 11)
    frames_ref, hw = origin_len // 4 + 1, origin_area[0] * origin_area[1] // 256
    reference = ref_grids[0]
    if any(g != reference for g in ref_grids):
        return grid, 0, "Wan-Animate-2's batch items have reference grids of different sizes; the call keeps stock"
    if (grid[0], grid[1] * grid[2], reference[0], reference[1] * reference[2]) != (frames_ref + 1, hw, frames_ref, hw):
        return grid, 0, (f"Wan-Animate-2's generation grid {grid} with reference grid {tuple(reference)} does not "
                         f"fill the block mask's geometry ({frames_ref + 1} generation and {frames_ref} reference "
                         f"frames of {hw} tokens); the generation pass keeps the stock processor")
    return grid, 0, None


def wan_animate2_attention_shape(config) -> tuple[int, int]:
    """(heads, head dim) of Wan-Animate-2's self-attention, from its `num_heads` and `dim`."""
    return int(config.num_heads), int(config.dim) // int(config.num_heads)


def anyflow_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int]:
    """Video grid after patching from AnyFlow's hidden_states (B, F, C, H, W), frames first; no joint text."""
    hidden_states = forward_arg(args, kwargs, "hidden_states", 0)
    _, F, _, H, W = hidden_states.shape
    return patched_grid(module, F, H, W), 0
