"""Motif-Video (`MotifVideoTransformer3DModel`; `MotifVideoPipeline`, `MotifVideoImage2VideoPipeline`): sparse
self-attention processor and model facts.

The blocks' `attn` (`MotifVideoAttention`, `MotifVideoAttnProcessor2_0`) is HunyuanVideo's joint attention: the
dual-stream blocks (`transformer_blocks`) project the video with to_q/k/v and the text with the `add_*_proj` layers,
the single-stream blocks (`single_transformer_blocks`) project [video; text] with to_q/k/v; per-head qk-norm, RoPE on
the video part only (`apply_rotary_emb`, (cos, sin) tables), one attention call over [video; text], text after the
video. The optional `cross_attn` of a block (`MotifVideoCrossAttention`, the shared text cross-attention) is a
separate module and keeps its stock processor.

Token order: `MotifVideoPatchEmbed` patches hidden_states (B, C, F, H, W) with a Conv3d and flattens (F/pt, H/p, W/p)
time-major. The "text" is [image; text]: the I2V checkpoints' SigLIP image tokens (`image_embeds`) come first, then the
T5Gemma2 text tokens. The mask is a key mask [B, 1, 1, S] (the video and the image tokens valid, the text as
`encoder_attention_mask` says), so the padded text rows attend to the valid keys, as in HunyuanVideo. The tokenizer
pads to `max_sequence_length`, on whichever side it is configured to: the processor moves the valid text tokens in
front of the padded ones for the attention call (a permutation of keys and queries: the same result up to summation
order) and serves [image; text] as global tiles with the padded keys masked (`attend_text_prefix`), then puts the
outputs back.

The DDT decoder blocks (the last `num_decoder_layers` single-stream blocks; 8 of 24 in Motif-Video-2B) run their
attention over [decoder video; encoder's video output] with no mask and RoPE on the first part only: two copies of the
grid, no text. Those calls keep the stock processor (one warning per layer).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_motif_video import MotifVideoAttnProcessor2_0

from ..rope import PairRope
from .forward_args import forward_arg
from .grids import PaddedText, valid_text_length, video_grid
from .hunyuan import _HunyuanFamilySparseAttention

DECODER_REASON = ("its second input is unmasked and exactly as long as the video, as in a DDT decoder block (whose "
                  "joint attention is over two copies of the video: the decoder's video and the encoder's video "
                  "output, not video and text); it keeps the stock processor")


class MotifVideoSparseAttnProcessor(_HunyuanFamilySparseAttention, MotifVideoAttnProcessor2_0):
    """`MotifVideoAttnProcessor2_0` whose joint [video; image; text] self-attention runs through videosparse (the
    HunyuanVideo family's call), with the valid text tokens moved first; DDT decoder calls stay stock."""

    _stock = MotifVideoAttnProcessor2_0

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if (encoder_hidden_states is not None and attention_mask is None
                and encoder_hidden_states.shape[1] == hidden_states.shape[1]):
            # a decoder block's call; an unmasked text exactly as long as the video looks the same and runs stock too
            # (the processor does not know its block's role: right, only not sparse)
            return self._to_stock(DECODER_REASON, attn, hidden_states, encoder_hidden_states, attention_mask,
                                  image_rotary_emb)
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    def _attend_joint(self, query, key, value, text_tokens: int, attention_mask,
                      rope: PairRope | None = None) -> torch.Tensor:
        if attention_mask is None or getattr(self, "_parallel_config", None) is not None:
            return super()._attend_joint(query, key, value, text_tokens, attention_mask, rope)
        if attention_mask.dtype != torch.bool or attention_mask.shape[-2] != 1:
            return self.attend(query, key, value, attention_mask, rope=rope)   # not the forward's key mask: dense
        # the key mask's text part [B, L] -> each item's valid text tokens first (in order), then the padded ones
        keep = attention_mask.reshape(attention_mask.shape[0], -1)[:, -text_tokens:]
        order = torch.argsort(keep.logical_not().to(torch.uint8), dim=1, stable=True)
        index = order[:, :, None, None].expand(query.shape[0], -1, *query.shape[2:])

        def valid_first(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x[:, :-text_tokens], x[:, -text_tokens:].gather(1, index)], dim=1)

        # (the text rows move among themselves; `rope` rotates video rows only)
        out = super()._attend_joint(valid_first(query), valid_first(key), valid_first(value), text_tokens, None, rope)
        text = torch.empty_like(out[:, -text_tokens:]).scatter_(1, index, out[:, -text_tokens:])
        return torch.cat([out[:, :-text_tokens], text], dim=1)


def motif_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int | PaddedText]:
    """Video grid after patching and the valid [image; text] tokens of this forward (one count per batch item when
    they differ): the image tokens and `encoder_attention_mask.sum(1)` (kept on the device: no host sync here)."""
    text = forward_arg(args, kwargs, "encoder_hidden_states", 2)
    mask = forward_arg(args, kwargs, "encoder_attention_mask", 3)
    image = forward_arg(args, kwargs, "image_embeds", 4)
    image_tokens = 0 if image is None else image.shape[1]
    valid = None if mask is None else mask.bool().sum(dim=1, dtype=torch.int) + image_tokens
    return video_grid(module, args, kwargs), valid_text_length(valid, text.shape[1] + image_tokens)
