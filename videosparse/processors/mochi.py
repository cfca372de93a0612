"""Mochi 1 (`MochiTransformer3DModel`): sparse self-attention processor and model facts.

Every block's `attn1` (`MochiAttention`) is joint attention over [video; text]: the video tokens go through
`to_q/k/v`, the T5 text tokens through `add_q/k/v_proj` (the text stream has its own width), each with its
per-head RMSNorm; Mochi's RoPE rotates the video part only. The last block is `context_pre_only` (no
`to_add_out`: its text output is returned as it leaves the attention). Video tokens are time-major: the
forward patches each frame spatially (`patch_size` 2, no temporal patch) and flattens (f, h, w), the order
in which `MochiRoPE` lays out its positions, so the token grid is (F, H / p, W / p) of the latent.

The stock `MochiAttnProcessor2_0` keeps, per batch item, the text tokens that `encoder_attention_mask` marks
valid, attends over [video; valid text] and gives the other text rows zeros. T5's mask is a prefix mask, so
`mochi_grid` reports the number of valid text tokens as the text length of the layouts, and the processor
attends over the video and that prefix (sparse or dense, as `attend` decides) and pads the text rows after it
with zeros, as the stock processor does. A forward whose mask is not a prefix mask runs the stock processor
(one warning per layer). `MochiPipeline` with classifier-free guidance batches the negative and the positive
prompt in one forward; when their valid lengths differ, each item is served with the layout of its own length.

`MochiTransformer3DModel` has no `attn_processors` / `set_attn_processor`, so the diffusers-native form
(`set_attn_processor(videosparse.processors(...))`) does not apply to it; `videosparse.apply` sets the
`processor` attribute of each `MochiAttention` itself.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import MochiAttnProcessor2_0

from ..rope import HeadPairRope
from .base import SparseAttentionMixin, project_heads, project_joint_outputs, project_text_heads
from .forward_args import forward_arg
from .grids import PaddedText, valid_text_length, video_grid


class MochiSparseAttnProcessor(SparseAttentionMixin, MochiAttnProcessor2_0):
    """`MochiAttnProcessor2_0` whose joint [video; valid text] attention runs through videosparse.

    Projections and qk-norms are diffusers' own modules, the RoPE its math (`videosparse.rope.HeadPairRope`, fused
    into the tile-order gather on sparse calls). Padded text rows get zeros, as in the stock processor. The forwards
    that `mochi_grid` marks unsupported (a non-prefix text mask) run the stock processor.
    """

    _stock = MochiAttnProcessor2_0

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb=None):
        stock = (attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        ctx = self.session.context
        problem = ctx.unsupported
        if ctx.grid is None:        # the valid text length is known only from a forward through the hook
            problem = "no video grid recorded (was the transformer called through its forward?)"
        if problem is not None:
            return self._to_stock(problem, *stock)
        query, key, value = project_heads(hidden_states, attn.heads, attn.to_q, attn.to_k, attn.to_v,
                                          attn.norm_q, attn.norm_k)
        text_query, text_key, text_value = project_text_heads(attn, encoder_hidden_states)
        # Mochi's per-head RoPE on the video rows, applied by `attend` (fused into the tile-order gather when sparse)
        rope = None if image_rotary_emb is None else HeadPairRope(*image_rotary_emb)

        # [video; each item's valid text prefix]; the padded text rows get zeros, as the stock processor gives them
        video_len, text_len = query.shape[1], text_query.shape[1]
        query = torch.cat([query, text_query], dim=1)
        key = torch.cat([key, text_key], dim=1)
        value = torch.cat([value, text_value], dim=1)
        hidden_states = self.attend_text_prefix(query, key, value, text_len, padded_rows="zero", rope=rope)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)

        hidden_states, encoder_hidden_states = hidden_states.split_with_sizes((video_len, text_len), dim=1)
        # the last, context_pre_only block has no to_add_out
        return project_joint_outputs(attn, hidden_states, encoder_hidden_states)


def mochi_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int | PaddedText, str | None]:
    """Video grid after patching, the number of valid text tokens of this forward, and why it must run stock
    (None when it can run sparse).

    The grid is (F, H // p, W // p) of hidden_states (B, C, F, H, W): Mochi patches only spatially. The valid
    text length is the count of nonzero `encoder_attention_mask` entries (one per item when the batch
    differs) when they are a prefix of every item's text; otherwise the full text length is returned with the
    reason. Syncs the host once per forward.
    """
    text = forward_arg(args, kwargs, "encoder_hidden_states", 1)
    mask = forward_arg(args, kwargs, "encoder_attention_mask", 3)
    grid, total = video_grid(module, args, kwargs), text.shape[1]
    if mask is None:
        return grid, total, None
    keep = mask != 0
    valid = keep.sum(dim=1, dtype=torch.int)
    if not torch.equal(keep, torch.arange(total, device=keep.device) < valid[:, None]):
        return grid, total, ("encoder_attention_mask is not a prefix mask (valid text tokens first, then padding); "
                             "sparse attention needs the valid tokens as one prefix")
    return grid, valid_text_length(valid, total), None
