"""Kandinsky 5.0 (`Kandinsky5Transformer3DModel`: Video Lite 2B, Video Pro 19B, Image Lite; `Kandinsky5T2VPipeline`,
`Kandinsky5I2VPipeline`, `Kandinsky5T2IPipeline`, `Kandinsky5I2IPipeline`) and Kandinsky 6
(`Kandinsky6Transformer3DModel`, below): sparse self-attention processors and model facts.

Blocks: `text_transformer_blocks.<i>` (`Kandinsky5TransformerEncoderBlock`, the text refiner) run self-attention over
the Qwen text tokens only, with a 1D RoPE; `visual_transformer_blocks.<i>` (`Kandinsky5TransformerDecoderBlock`) run
`self_attention` over the visual tokens only, then `cross_attention` from the visual tokens to the refined text, then
the feed-forward. Every attention is a `Kandinsky5Attention` with `Kandinsky5AttnProcessor`; only the visual blocks'
`self_attention` is served, so no text token joins the served sequence.

Token order: `Kandinsky5VisualEmbeddings` takes hidden_states channels-last (B, T, H, W, C), views it as
(B, T/pt, pt, H/ph, ph, W/pw, pw, C), permutes to (B, T', H', W', pt * ph * pw * C) and projects it;
`fractal_flatten` then flattens (T', H', W'), so token `t * H' * W' + h * W' + w` is patch (t, h, w): time-major. The
RoPE tables of `Kandinsky5RoPE3D` ((B, T', H', W', 1, D/2, 2, 2)) are flattened the same way. The head dimension is
`sum(axes_dims)` ((16, 24, 24) Lite, (32, 48, 48) Pro) split [t | h | w], each part rotated in interleaved pairs by
2 x 2 matrices at positions `visual_rope_pos` (the pipelines pass arange(T'), arange(H'), arange(W')) divided by
`scale_factor`; the stock processor rounds the rotated q and k to bf16, which this processor keeps. The image
condition of I2V checkpoints (`visual_cond=True`: condition latents and a mask concatenated as 2C + 1 input channels)
adds channels, no token.

NABLA: with `attention_type="nabla"` the pipelines pass `sparse_params`; the forward then reorders the tokens into
8 x 8 spatial blocks (`fractal_flatten(..., block_mask=True)`: order (t, h // 8, w // 8, h % 8, w % 8), the RoPE
with them) and the stock processor runs the model's own block-sparse attention (`nablaT_v2`, a flex-attention block
mask of 64-token blocks). Those calls keep the stock processor (warned once per layer); the full-attention
configuration (`attention_type="regular"`, `sparse_params=None`) is served.

Kandinsky 6 (`Kandinsky6Transformer3DModel`, `Kandinsky6TI2VAPipeline`: text/image to video and audio): every
attention is a `Kandinsky6Attention` with `Kandinsky6AttnProcessor`. `video_text_transformer_blocks.<i>.attn` and
`audio_text_transformer_blocks.<i>.attn` refine the text for each modality; each fused block
`visual_transformer_blocks.<i>` (`Kandinsky6FusedTransformerDecoderBlock`) runs `video_dec_block.self_attention` over
the video tokens only (the one served), `video_dec_block.cross_attention` to the video text, and with audio
`audio_dec_block.self_attention` (audio tokens, 1D RoPE), `audio_dec_block.cross_attention` to the audio text,
`va_cross_attention` (video queries, audio keys) and `av_cross_attention` (audio queries, video keys); all of those
keep their stock processors. Called with `audio_hidden_states=None` a block runs its video path only; the video
self-attention is the same call either way.

Token order: `Kandinsky6VisualEmbeddings` patches (B, T, H, W, C) exactly as Kandinsky 5 does, and the forward
flattens (T', H', W') with a plain `flatten(1, 3)`: time-major, no fractal or NABLA reordering (this transformer has no
attention_type option; NABLA belongs to the separate `Kandinsky6SRTransformer3DModel`, not served). The RoPE table of
`Kandinsky6RoPE3D` ((T', H', W', 1, D/2, 2, 2), no batch axis) is flattened the same way; the head dimension is
`sum(axes_dims)` split [t | h | w] with positions `visual_rope_pos` (default arange) divided by the config's
`scale_factor`. Unlike Kandinsky 5, q and k are RMS-normed in their own dtype and the rotated q and k are cast back to
their dtype with no bf16 rounding. With a reference image the pipeline appends its latent as one more frame at the end
(token type 1, RoPE time position 0, condition mask 1): a frame of the grid (T' + 1 frames), no extra token.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_kandinsky import Kandinsky5AttnProcessor
from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6AttnProcessor

from ..rope import HeadPairRope
from .base import SparseAttentionMixin, project_heads
from .forward_args import forward_arg
from .grids import patched_grid

NABLA_REASON = ("the model's own NABLA sparse attention is configured (attention_type='nabla', sparse_params given), "
                "which reorders the tokens into 8 x 8 blocks; it keeps the stock processor")


def apply_kandinsky_rope(x: torch.Tensor, rope: torch.Tensor,
                         rounding: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    """x [B, S, H, D] rotated by the RoPE table rope [(B,) S, 1, D/2, 2, 2] (one 2 x 2 matrix per pair
    (x[2i], x[2i+1])) in fp32, rounded to `rounding` as the stock processor does (Kandinsky 5: bf16; Kandinsky 6:
    None, no rounding); returned in x's dtype."""
    pairs = x.unflatten(-1, (-1, 1, 2)).float()
    rotated = (rope * pairs).sum(-1).flatten(-2)
    return (rotated if rounding is None else rotated.to(rounding)).type_as(x)


def kandinsky_head_pair_rope(rope: torch.Tensor, dtype: torch.dtype,
                             rounding: torch.dtype | None = torch.bfloat16) -> HeadPairRope | None:
    """The RoPE table rope [(1,) S, 1, D/2, 2, 2] (rotation matrices [[cos, -sin], [sin, cos]]) as a `HeadPairRope`
    that `attend` applies with the stock result for q, k in `dtype` (rounded once to `dtype`, which must then be the
    stock's `rounding` unless that is None); None when it cannot (a table per batch item, or an fp32 q in Kandinsky 5,
    whose stock rounds to bf16)."""
    if rounding not in (None, dtype):
        return None
    if rope.dim() == 6:
        if rope.shape[0] != 1:
            return None
        rope = rope[0]
    return HeadPairRope(rope[..., 0, 0].contiguous(), rope[..., 1, 0].contiguous())


class Kandinsky5SparseAttnProcessor(SparseAttentionMixin, Kandinsky5AttnProcessor):
    """`Kandinsky5AttnProcessor` whose visual self-attention runs through videosparse.

    Projections and the per-head RMSNorm of q and k (in fp32) run as diffusers does them, in (B, S, H, D) layout; the
    RoPE goes to `attend` as a `HeadPairRope` (fused into the tile-order gather on sparse calls) when q is bf16, the
    dtype the stock rounds the rotation to, else it is applied as stock. Calls with encoder states (cross-attention
    to the text) and calls with `sparse_params` (the model's NABLA attention; warned once per layer) go to the stock
    processor untouched.
    """

    _stock = Kandinsky5AttnProcessor

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, sparse_params=None):
        stock = (attn, hidden_states, encoder_hidden_states, rotary_emb, sparse_params)
        if encoder_hidden_states is not None:
            return self._to_stock(None, *stock)
        if sparse_params is not None:
            return self._to_stock(NABLA_REASON, *stock)
        query, key, value = project_heads(hidden_states, attn.num_heads, attn.to_query, attn.to_key, attn.to_value)
        query = attn.query_norm(query.float()).type_as(query)
        key = attn.key_norm(key.float()).type_as(key)
        rope = None if rotary_emb is None else kandinsky_head_pair_rope(rotary_emb, query.dtype)
        if rope is None and rotary_emb is not None:
            query = apply_kandinsky_rope(query, rotary_emb)
            key = apply_kandinsky_rope(key, rotary_emb)
        hidden_states = self.attend(query, key, value, rope=rope)
        return attn.out_layer(hidden_states.flatten(-2, -1))


class Kandinsky6SparseAttnProcessor(SparseAttentionMixin, Kandinsky6AttnProcessor):
    """`Kandinsky6AttnProcessor` whose video self-attention runs through videosparse.

    Projections and the per-head RMSNorm of q and k (in their dtype) run as diffusers does them, in (B, S, H, D)
    layout; the RoPE (`rotary_emb` on q, `rotary_emb_kv` on k, no bf16 rounding) goes to `attend` as a `HeadPairRope`
    when both are one table (self-attention), else it is applied as stock. A call
    with encoder states (cross-attention) goes to the stock processor untouched.
    """

    _stock = Kandinsky6AttnProcessor

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, rotary_emb_kv=None,
                 attn_mask=None):
        if encoder_hidden_states is not None:
            return self._to_stock(None, attn, hidden_states, encoder_hidden_states, rotary_emb, rotary_emb_kv,
                                  attn_mask)
        query, key, value = project_heads(hidden_states, attn.num_heads, attn.to_query, attn.to_key, attn.to_value,
                                          attn.query_norm, attn.key_norm)
        rope = None
        if rotary_emb is not None and rotary_emb_kv is rotary_emb:      # self-attention: one table for q and k
            rope = kandinsky_head_pair_rope(rotary_emb, query.dtype, rounding=None)
        if rope is None:
            if rotary_emb is not None:
                query = apply_kandinsky_rope(query, rotary_emb, rounding=None)
            if rotary_emb_kv is not None:
                key = apply_kandinsky_rope(key, rotary_emb_kv, rounding=None)
        hidden_states = self.attend(query, key, value, attn_mask, rope=rope)
        return attn.out_layer(hidden_states.flatten(-2, -1))


def kandinsky_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int]:
    """Token grid after patching from the forward's channels-last hidden_states (B, T, H, W, C) and `patch_size`;
    no joint text (Kandinsky 5 and 6)."""
    hidden_states = forward_arg(args, kwargs, "hidden_states", 0)
    _, T, H, W, _ = hidden_states.shape
    return patched_grid(module, T, H, W), 0


def kandinsky_attention_shape(config) -> tuple[int, int]:
    """(heads, head dim) of a Kandinsky 5 or 6 config (K6: of the video stream): the head dim is `sum(axes_dims)`, the
    heads `model_dim` over it."""
    head_dim = sum(int(d) for d in config.axes_dims)
    return int(config.model_dim) // head_dim, head_dim
