"""HunyuanVideo (`HunyuanVideoTransformer3DModel`), HunyuanVideo 1.5 (`HunyuanVideo15Transformer3DModel`) and
FramePack (`HunyuanVideoFramepackTransformer3DModel`): sparse self-attention processors and model facts.

Both attend over one joint sequence [video; text] (text after the video): dual-stream blocks project
the text with the `add_*_proj` layers and concatenate it; HunyuanVideo's `single_transformer_blocks` get
it already joined. RoPE covers the video part only. The token refiners' attention is text-only and keeps
its stock processor.

diffusers masks with a prefix mask: the video and the first `L_valid` text tokens are valid
(HunyuanVideo 1.5 reorders its image, ByT5 and Qwen tokens so that the valid ones come first). The grid
functions report `L_valid` per item as a device tensor (`PaddedText`): sparse forwards keep every text token in
the layout and the kernel masks the padded keys (`attend_text_prefix`), so the shapes do not depend on the
prompt, and a batch whose items have different `L_valid` (a prompt and a negative prompt batched for guidance)
runs in one call. The padded text rows get what the stock masked call gives them (their outputs never reach a
valid token): HunyuanVideo masks keys only, so its padded rows attend densely to the valid keys (they sit in
global tiles); HunyuanVideo 1.5 masks queries too, so its padded rows are zeros. Dense configs and observed
forwards serve each item's valid prefix instead.

FramePack runs HunyuanVideo's blocks and processor on [history; video; image; text] (every call, both block
kinds). The history comes first: `_pack_history_states` prepends the clean latents (start image + 1x history,
`clean_x_embedder.proj`, kernel (1, 2, 2)), then the 2x history before them (kernel (2, 4, 4)), then the 4x
history (kernel (4, 8, 8)), so the order is [4x; 2x; clean; video], each part time-major, with RoPE on all of it
(the history at its own frame indices, the 2x / 4x tables average-pooled). After them come the SigLIP image
tokens and the text, masked together as one prefix ([image ones; text mask]). At the released settings
(latent window 9, history 1 + 1 / 2 / 16 latent frames, 640 x 640) that is 14,400 video tokens, 3,200 + 400 + 400
history tokens, 729 image tokens and up to 256 text tokens. The processor moves the history behind the video
for the attention call, so the window's video is the tile grid and history, image and text are global tiles.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

from ..rope import PairRope, apply_rope
from .base import SparseAttentionMixin, project_heads, project_joint_outputs, project_text_heads
from .forward_args import forward_arg
from .grids import HistoryPart, PaddedText, history_tokens, valid_text_length, video_grid


class _HunyuanFamilySparseAttention(SparseAttentionMixin):
    """The shared `__call__`: joint [video; text] self-attention through videosparse.

    Projections and qk-norm are diffusers' own; the RoPE (diffusers' `apply_rotary_emb` on the video rows) goes to
    `attend` as a `PairRope`, fused into the tile-order gather on sparse calls. Calls without text (the token
    refiner's layout) go to the stock processor untouched.
    """

    _padded_rows = "attend"            # what the stock masked call gives the padded text rows (attend_text_prefix)
    # a call's whole attention, dense configs' padded text rows (served outside `attend`) and Motif's reorder included
    timed_entry = "_attend_joint"

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        stock = (attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if encoder_hidden_states is None:
            return self._to_stock(None, *stock)
        problem = self.session.context.unsupported
        if problem is not None:
            return self._to_stock(problem, *stock)
        text_len = encoder_hidden_states.shape[1]
        joint = attn.add_q_proj is None          # single-stream block: text goes through to_q/to_k/to_v too
        if joint:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        query, key, value = project_heads(hidden_states, attn.heads, attn.to_q, attn.to_k, attn.to_v,
                                          attn.norm_q, attn.norm_k)
        if not joint:
            enc_query, enc_key, enc_value = project_text_heads(attn, encoder_hidden_states)
            query = torch.cat([query, enc_query], dim=1)
            key = torch.cat([key, enc_key], dim=1)
            value = torch.cat([value, enc_value], dim=1)
        # diffusers' RoPE on the video rows (the first ones; the text rows after them are not rotated), applied by
        # `attend`: fused into the tile-order gather on sparse calls, as stock on dense ones
        rope = None if image_rotary_emb is None else PairRope(*image_rotary_emb)
        hidden_states = self._attend_joint(query, key, value, text_len, attention_mask, rope)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)

        hidden_states, encoder_hidden_states = hidden_states[:, :-text_len], hidden_states[:, -text_len:]
        return project_joint_outputs(attn, hidden_states, encoder_hidden_states)

    def _attend_joint(self, query, key, value, text_tokens: int, attention_mask,
                      rope: PairRope | None = None) -> torch.Tensor:
        """Attention of the joint q, k, v [B, S, H, D] whose last `text_tokens` are text, the padded ones last, through
        videosparse (`attend_text_prefix`); `rope` rotates the first rows of q and k."""
        return self.attend_text_prefix(query, key, value, text_tokens, attention_mask, padded_rows=self._padded_rows,
                                       rope=rope)


class HunyuanVideoSparseAttnProcessor(_HunyuanFamilySparseAttention, HunyuanVideoAttnProcessor2_0):
    """`HunyuanVideoAttnProcessor2_0` whose joint self-attention runs through videosparse (its mask [B, 1, 1, S]
    masks keys only: the padded text rows attend densely to the valid keys, as in stock)."""

    _stock = HunyuanVideoAttnProcessor2_0


class HunyuanVideo15SparseAttnProcessor(_HunyuanFamilySparseAttention, HunyuanVideo15AttnProcessor2_0):
    """`HunyuanVideo15AttnProcessor2_0` whose joint self-attention runs through videosparse (its mask, the valid
    prefix's rows & columns, leaves the padded text rows no key: they are zeros, as in stock)."""

    _stock = HunyuanVideo15AttnProcessor2_0
    _padded_rows = "zero"


class HunyuanVideoFramepackSparseAttnProcessor(HunyuanVideoSparseAttnProcessor):
    """`HunyuanVideoAttnProcessor2_0` in FramePack's blocks, through videosparse: the history tokens that come
    before the video are moved behind it for the attention call (keys and queries alike, after RoPE, so the result
    is the same up to summation order) and served with the image and text tokens as global tiles; the output
    goes back to diffusers' order. Observers see the moved order, [video; history; image; text]."""

    def _attend_joint(self, query, key, value, text_tokens: int, attention_mask,
                      rope: PairRope | None = None) -> torch.Tensor:
        session = self.session
        grid = session.context.grid
        video = grid[0] * grid[1] * grid[2] if grid is not None else 0
        history = query.shape[1] - text_tokens - video
        if grid is None or history < 0:        # not this grid: `attend` warns and runs dense
            return super()._attend_joint(query, key, value, text_tokens, attention_mask, rope)
        if history == 0 or (session.method is None and not session.observers):
            # a dense config, unobserved: diffusers' order as it is (the valid prefix is the same), bit-exact stock
            return super()._attend_joint(query, key, value, history + text_tokens, attention_mask, rope)
        if rope is not None and (rope.start != 0 or rope.cos.shape[0] != history + video):
            query, key, rope = apply_rope(query, rope), apply_rope(key, rope), None   # not [history; video]: as stock
        if rope is not None:                   # the rotated rows [history; video] become [video; history]
            rope = PairRope(*(torch.cat([t[history:], t[:history]]) for t in rope[:2]))

        def history_after_video(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
            return torch.cat([x.narrow(dim, history, video), x.narrow(dim, 0, history),
                              x.narrow(dim, history + video, text_tokens)], dim=dim)

        if attention_mask is not None:         # the key mask [B, 1, 1, S] (context parallelism only reads it)
            attention_mask = history_after_video(attention_mask, attention_mask.dim() - 1)
        out = super()._attend_joint(history_after_video(query), history_after_video(key),
                                    history_after_video(value), history + text_tokens, attention_mask, rope)
        return torch.cat([out[:, video:video + history], out[:, :video], out[:, video + history:]], dim=1)


def hunyuan_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int | PaddedText]:
    """Video grid after patching and the text tokens of this forward: all of them, or with a mask the valid ones per
    batch item (`valid_text_length`).

    The valid text length is `encoder_attention_mask.sum(1)` (diffusers' own definition of the valid
    prefix), kept on the device (a `PaddedText`; no host sync here).
    """
    text = forward_arg(args, kwargs, "encoder_hidden_states", 2)
    mask = forward_arg(args, kwargs, "encoder_attention_mask", 3)
    valid = None if mask is None else mask.sum(dim=1, dtype=torch.int)
    return video_grid(module, args, kwargs), valid_text_length(valid, text.shape[1])


def hunyuan15_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int | PaddedText]:
    """As `hunyuan_grid`, for HunyuanVideo 1.5, whose text is [image; ByT5; Qwen] tokens reordered valid-first:
    the valid length is the sum of the Qwen and ByT5 masks, plus the image tokens unless `image_embeds` is all
    zeros (text-to-video, where the forward masks them out; reading that syncs the host once per forward)."""
    text = forward_arg(args, kwargs, "encoder_hidden_states", 2)
    mask = forward_arg(args, kwargs, "encoder_attention_mask", 3)
    text_2 = forward_arg(args, kwargs, "encoder_hidden_states_2", 5)
    mask_2 = forward_arg(args, kwargs, "encoder_attention_mask_2", 6)
    image = forward_arg(args, kwargs, "image_embeds", 7)
    total = text.shape[1] + text_2.shape[1] + image.shape[1]
    valid = mask.sum(dim=1, dtype=torch.int) + mask_2.sum(dim=1, dtype=torch.int)
    if not bool(torch.all(image == 0)):
        valid = valid + image.shape[1]
    return video_grid(module, args, kwargs), valid_text_length(valid, total)


# the clean latents (1x patch embedding, no padding) and the 2x / 4x history latents (padded to whole kernels) that
# FramePack's forward prepends to the video, as `_pack_history_states` counts them
_FRAMEPACK_HISTORY = (
    HistoryPart("latents_clean", 8, "indices_latents_clean", 9, "clean_x_embedder.proj"),
    HistoryPart("latents_history_2x", 10, "indices_latents_history_2x", 11, "clean_x_embedder.proj_2x", "kernel"),
    HistoryPart("latents_history_4x", 12, "indices_latents_history_4x", 13, "clean_x_embedder.proj_4x", "kernel"),
)


def hunyuan_framepack_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int | PaddedText]:
    """As `hunyuan_grid`, for FramePack: the grid is the current window's video; the extra tokens served as global
    tiles are the history tokens (which the processor moves behind the video), the image tokens and the valid text
    tokens (the forward's mask is [image ones; text mask]). A single item's valid length is read on the host (one
    sync): the forward crops its text to it."""
    text = forward_arg(args, kwargs, "encoder_hidden_states", 2)
    mask = forward_arg(args, kwargs, "encoder_attention_mask", 3)
    image = forward_arg(args, kwargs, "image_embeds", 5)
    extra = history_tokens(module, args, kwargs, _FRAMEPACK_HISTORY) + (image.shape[1] if image is not None else 0)
    valid = None if mask is None else mask.sum(dim=1, dtype=torch.int) + extra
    text_len = valid_text_length(valid, text.shape[1] + extra)
    if isinstance(text_len, PaddedText) and text.shape[0] == 1:
        # the forward crops a single item's text to its valid tokens (no mask): the blocks see that many
        return video_grid(module, args, kwargs), text_len.lengths()
    return video_grid(module, args, kwargs), text_len


