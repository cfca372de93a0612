"""LTX-2 (`LTX2VideoTransformer3DModel`): sparse video self-attention processors and model facts.

Every `LTX2VideoTransformerBlock` holds six `LTX2Attention` layers: `attn1` (video self-attention),
`audio_attn1` (audio self-attention), `attn2` / `audio_attn2` (cross-attention to the text) and
`audio_to_video_attn` / `video_to_audio_attn` (cross-attention between the two streams). All six use one
processor class per model (`LTX2AudioVideoAttnProcessor`, or `LTX2PerturbedAttnProcessor` when the model is
built with `perturbed_attn=True` for spatio-temporal guidance), so videosparse selects the layers by name:
only `transformer_blocks.<i>.attn1` is served; the audio self-attention and the cross-attentions keep their
stock processors.

Token order: the pipelines pack the latent video (B, C, F, H, W) into patches with `LTX2Pipeline._pack_latents`,
time-major (`index = f*H*W + h*W + w` over the patch grid), and the RoPE positions come from `video_coords`
(B, 3, S, 2), the [start, end) of every patch on the (frame, height, width) axes, built by
`transformer.rope.prepare_video_coords` in the same order. `ltx2_grid` reads the patch grid from those
coordinates when they are given (they define the RoPE; every LTX-2 pipeline passes them), else from the
latent sizes `num_frames, height, width` divided by the patch sizes. `LTX2ConditionPipeline` appends
keyframe-condition tokens after the video and passes the video's latent sizes: when the first tokens form the
grid of those sizes, the appended ones are served like joint text after the video (global tiles); pipelines that
pass coordinates alone (the DFR ones) must give one grid over the whole sequence.
Any other sequence runs the stock processor, warned once per layer, and so does a call with an attention mask
(`video_self_attention_mask`, e.g. the IC-LoRA pipeline's reference-token mask).
"""

from __future__ import annotations

import math

import torch
from diffusers.models.transformers.transformer_ltx2 import (
    LTX2AudioVideoAttnProcessor,
    LTX2PerturbedAttnProcessor,
    apply_interleaved_rotary_emb,
    apply_split_rotary_emb,
)

from .base import SparseAttentionMixin
from .context import sequence_length
from .forward_args import forward_arg
from .grids import coords_grid

_ROTATIONS = {"interleaved": apply_interleaved_rotary_emb, "split": apply_split_rotary_emb}


def _rotate(attn, query: torch.Tensor, key: torch.Tensor, query_rotary_emb, key_rotary_emb):
    """LTX-2's RoPE on the flattened q, k [B, S, C] with diffusers' helper for `attn.rope_type`; the key uses
    `key_rotary_emb` when given, else the query's tables (as the stock processors do)."""
    rotate = _ROTATIONS.get(attn.rope_type)
    if query_rotary_emb is None or rotate is None:
        return query, key
    return rotate(query, query_rotary_emb), rotate(key, query_rotary_emb if key_rotary_emb is None else key_rotary_emb)


class _LTX2SparseAttention(SparseAttentionMixin):
    """The shared body of both LTX-2 processors: video self-attention through videosparse.

    Projections, the across-heads RMSNorm of q and k, the RoPE (interleaved or split) and the per-head output
    gate (`attn.to_gate_logits`, gated-attention models) are diffusers' own; only the attention call changes.
    Spatio-temporal guidance (perturbed processor): a block whose batch is entirely perturbed skips attention
    and passes the value projection on (no attention call is made, none is counted); a partial
    `perturbation_mask` blends the attention output with the values (`torch.lerp`), as stock. The forward gives
    `all_perturbed` as a tensor in the guided blocks; reading it syncs the host there, as in the stock processor.
    """

    def _serve(self, stock: tuple, attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
               key_rotary_emb, perturbation_mask=None, all_perturbed=False) -> torch.Tensor:
        if encoder_hidden_states is not None:                  # cross-attention: never touched
            return self._to_stock(None, *stock)
        problem = self._stock_reason(attention_mask)          # (the mask: the forward's video_self_attention_mask)
        if problem is not None:     # not one token grid (see `ltx2_grid`) or masked: no layout, no observer records
            return self._to_stock(problem, *stock)

        gates = None
        if attn.to_gate_logits is not None:                    # per-head gates from the block's input, in (0, 2)
            gates = 2.0 * torch.sigmoid(attn.to_gate_logits(hidden_states))
        value = attn.to_v(hidden_states)
        if all_perturbed is None:
            all_perturbed = perturbation_mask is not None and torch.all(perturbation_mask == 0)
        if all_perturbed:
            hidden_states = value
        else:
            query = attn.norm_q(attn.to_q(hidden_states))
            key = attn.norm_k(attn.to_k(hidden_states))
            query, key = _rotate(attn, query, key, query_rotary_emb, key_rotary_emb)
            out = self.attend(query.unflatten(2, (attn.heads, -1)), key.unflatten(2, (attn.heads, -1)),
                              value.unflatten(2, (attn.heads, -1)))
            hidden_states = out.flatten(2, 3).to(query.dtype)
            if perturbation_mask is not None:
                hidden_states = torch.lerp(value, hidden_states, perturbation_mask)
        if gates is not None:
            hidden_states = (hidden_states.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


class LTX2SparseAttnProcessor(_LTX2SparseAttention, LTX2AudioVideoAttnProcessor):
    """`LTX2AudioVideoAttnProcessor` whose video self-attention runs through videosparse (see `_LTX2SparseAttention`).

    Calls with encoder states (cross-attention) go to the stock processor untouched; calls with an attention mask
    and the calls of a forward whose tokens are not one grid (`ltx2_grid` says why) go to it with one warning per
    layer.
    """

    _stock = LTX2AudioVideoAttnProcessor

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None):
        stock = (attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb)
        return self._serve(stock, *stock)


class LTX2PerturbedSparseAttnProcessor(_LTX2SparseAttention, LTX2PerturbedAttnProcessor):
    """`LTX2PerturbedAttnProcessor` (spatio-temporal guidance) whose video self-attention runs through videosparse.

    Same routing as `LTX2SparseAttnProcessor`; `perturbation_mask` and `all_perturbed` act as in the stock
    processor (the parameter names must stay: `LTX2Attention.forward` passes only the keyword arguments that the
    processor's `__call__` names).
    """

    _stock = LTX2PerturbedAttnProcessor

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None, perturbation_mask=None, all_perturbed=None):
        stock = (attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb,
                 perturbation_mask, all_perturbed)
        return self._serve(stock, *stock)


def ltx2_sparse_processor(session, layer: int, original=None) -> _LTX2SparseAttention:
    """The sparse processor replacing `original`: the perturbed (STG) one for an `LTX2PerturbedAttnProcessor`, the
    plain one otherwise (the `ModelSpec.processor_cls` of LTX-2)."""
    cls = LTX2PerturbedSparseAttnProcessor if isinstance(original, LTX2PerturbedAttnProcessor) \
        else LTX2SparseAttnProcessor
    return cls(session, layer, original)


# ---------------------------------------------------------------- token grid

def ltx2_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int, str | None]:
    """Token grid of a forward (in patches), the tokens appended after the video, and why the forward must run dense
    (None when it can run sparse).

    The grid is the one `video_coords` spans when they are given (the forward then builds the RoPE from them and
    ignores the sizes), else (ceil(num_frames / patch_size_t), ceil(height / patch_size), ceil(width / patch_size))
    of the latent sizes, the patch counts `prepare_video_coords` lays out. `LTX2ConditionPipeline` appends keyframe
    tokens after the video and passes the video's latent sizes with coordinates for all tokens: when the first
    tokens form the grid of those sizes, the rest are served like joint text after the video (global tiles: every
    video tile attends to them, and they to every tile). Any other sequence runs dense; the grid returned then is
    (1, 1, S), only to keep the layouts well-formed.
    """
    def arg(name: str, default: int):       # (the hook named the positional arguments: the position is a fallback)
        return forward_arg(args, kwargs, name, default)

    seq_len = sequence_length(module, arg("hidden_states", 0))      # all ranks' tokens under context parallelism
    video_coords = arg("video_coords", 15)
    sizes = [arg("num_frames", 10), arg("height", 11), arg("width", 12)]
    size_grid = None
    if all(s is not None for s in sizes):
        cfg = module.config
        patch = (int(cfg.patch_size_t), int(cfg.patch_size), int(cfg.patch_size))
        size_grid = tuple(-(-int(s) // p) for s, p in zip(sizes, patch))
    if video_coords is not None:
        grid, problem = coords_grid(video_coords, seq_len)
        video_len = math.prod(size_grid) if size_grid is not None else seq_len
        if problem is not None and video_len < seq_len:       # appended condition tokens after the video?
            head, _ = coords_grid(video_coords, seq_len, video_len)
            if head == size_grid:
                return size_grid, seq_len - video_len, None
    elif size_grid is None:
        grid, problem = None, "num_frames, height and width were not all given (and no video_coords)"
    else:
        grid, problem = size_grid, None
        if math.prod(grid) != seq_len:
            grid, problem = None, (f"the sequence has {seq_len} tokens, not the {' x '.join(map(str, grid))} patches "
                                   f"of num_frames x height x width = {' x '.join(str(int(s)) for s in sizes)}")
    return (grid or (1, 1, seq_len)), 0, problem
