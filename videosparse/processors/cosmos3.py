"""Cosmos 3 (`Cosmos3OmniTransformer`, `Cosmos3OmniPipeline`): sparse attention processor and model facts.

Cosmos 3 is a mixture-of-transformers: every layer holds two sets of weights, one for the *understanding* rows (the
prompt's text tokens, a causal prefix of `und_len` rows) and one for the *generation* rows (the video, then the sound
and action rows when those are generated). Its attention (`Cosmos3PackedMoTAttention`, `Cosmos3AttnProcessor`) runs
two pathways per layer over one packed, unbatched sequence:

- understanding: the text rows attend causally to each other (stock here: a few hundred rows);
- generation: the generation rows attend to every understanding key and to every generation key, without a mask.

The generation pathway is the quadratic one (at 720p and 189 frames: 44,160 video rows next to a few hundred text
rows), and what videosparse serves. Its queries and keys use grouped-query attention (num_key_value_heads KV heads,
each shared by num_attention_heads / num_key_value_heads query heads) and a rotate-half multimodal RoPE from
per-row cos / sin tables. The pipeline lays the generation rows out as [video | sound | action]: the video is one
time-major grid (`_patchify_and_pack_latents` flattens latents as t, h, w), the sound and action rows follow it.

So the generation attention runs as one `attend` call over [video | sound | action | text]: the video grid sparse;
the sound and action rows and the understanding (text) keys as global tiles after it, which every video row keeps,
as stock attends to them. The text rows' own queries in that call (the understanding queries stand in for them) are
dropped: the understanding pathway's output is stock's causal attention. Calls that run dense by the config (dense
config, dense steps and layers) and that no observer watches make stock's attention call instead. The rotate-half
RoPE and the repeat of the KV heads to the query heads (as SDPA's `enable_gqa`) are fused into the tile-order gather
(one Triton pass per tensor on the GPU, `videosparse.rope.rope_gather`). A forward whose packed sequence is not laid
out that way (several vision items, vision rows not right after the text), or whose model has the context
parallelism seams set (`_cp_shard_fn`), keeps the stock processor with one warning per layer.
"""

from __future__ import annotations

import math

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor

from ..rope import HalfRope, apply_half_rope
from .base import SparseAttentionMixin
from .forward_args import forward_arg
from .grids import PaddedText


def cosmos3_attention_shape(cfg) -> tuple[int, int]:
    """(query heads, head dim) of a Cosmos 3 config."""
    return int(cfg.num_attention_heads), int(cfg.head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Cosmos 3's rotate-half RoPE of x [S, H, D] with the tables cos, sin [S, D] (the stock processor's ops)."""
    return apply_half_rope(x, cos.unsqueeze(1), sin.unsqueeze(1))


class Cosmos3SparseAttnProcessor(SparseAttentionMixin, Cosmos3AttnProcessor):
    """`Cosmos3AttnProcessor` whose generation pathway runs through videosparse (see the module docstring); the
    projections, q/k norms, RoPE and the causal understanding pathway are stock's."""

    _stock = Cosmos3AttnProcessor
    timed_entry = "attend_generation"

    def __call__(self, attn, und_seq: torch.Tensor, gen_seq: torch.Tensor, rotary_emb):
        problem = self.session.context.unsupported
        if problem is None and getattr(self, "_parallel_config", None) is not None:
            problem = "Cosmos 3 under a parallel config keeps the stock processor"
        if problem is not None:
            return self._to_stock(problem, attn, und_seq, gen_seq, rotary_emb)
        heads, kv_heads, head_dim = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
        q_und = attn.norm_q(attn.to_q(und_seq).view(-1, heads, head_dim))
        k_und = attn.norm_k(attn.to_k(und_seq).view(-1, kv_heads, head_dim))
        v_und = attn.to_v(und_seq).view(-1, kv_heads, head_dim)
        k_und_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else k_und
        q_gen = attn.norm_added_q(attn.add_q_proj(gen_seq).view(-1, heads, head_dim))
        k_gen = attn.norm_added_k(attn.add_k_proj(gen_seq).view(-1, kv_heads, head_dim))
        v_gen = attn.add_v_proj(gen_seq).view(-1, kv_heads, head_dim)

        cos_und, sin_und = rotary_emb[:2]
        q_und_rotated, k_und_rotated = _rotate(q_und, cos_und, sin_und), _rotate(k_und, cos_und, sin_und)
        causal_out = dispatch_attention_fn(
            q_und_rotated.unsqueeze(0), k_und_rotated.unsqueeze(0), v_und.unsqueeze(0), is_causal=True,
            enable_gqa=True, backend=getattr(self, "_attention_backend", None), parallel_config=None)
        gen_out = self.attend_generation(q_gen, k_gen, v_gen, q_und, k_und_for_gen, v_und, rotary_emb)
        und_out = attn.to_out(causal_out.squeeze(0).flatten(-2, -1))
        return und_out, attn.to_add_out(gen_out.flatten(-2, -1).type_as(q_gen))

    def attend_generation(self, q, k, v, q_und, k_und, v_und, rotary_emb):
        """The generation pathway's attention from the rows' pre-RoPE projections: q [N, H, D], k, v [N, Hkv, D] of
        the generation rows, q_und [U, H, D], k_und, v_und [U, Hkv, D] of the understanding rows (k_und: its keys for
        the generation pathway), and the forward's rotary tables (cos, sin of the understanding rows, then of the
        generation rows; [rows, D] each) -> [N, H, D]. Dense by the config: stock's call (RoPE, then one attention
        over both key sets, grouped-query); else one `attend` over [generation; text] with the rotate-half RoPE and
        the KV heads' repeat fused into its tile-order gather, the text rows' outputs dropped."""
        cos_und, sin_und, cos_gen, sin_gen = rotary_emb
        if not self.session.observers and self._scheduled_dense() is not None:   # observers' records come from attend
            self._stats().record_dense()
            keys = torch.cat([_rotate(k_und, cos_und, sin_und), _rotate(k, cos_gen, sin_gen)])
            out = dispatch_attention_fn(_rotate(q, cos_gen, sin_gen).unsqueeze(0), keys.unsqueeze(0),
                                        torch.cat([v_und, v]).unsqueeze(0), enable_gqa=True,
                                        backend=getattr(self, "_attention_backend", None))
            return out.squeeze(0)
        valid, pad, video = self.session.context.text_valid, 0, None
        if valid is not None:
            # sparse forwards: the text rows padded with zero rows to the layout's length (the sequence in whole
            # tiles, `PaddedText.pad_to_tile`) and masked as keys (`attend(valid_keys=)`), so that prompts whose rows
            # end in the same tile run the same shapes (one compiled graph)
            video = math.prod(self.session.context.grid)
            pad = video + self.session.context.text_len - q.shape[0] - q_und.shape[0]
        tables = ((cos_gen, cos_und), (sin_gen, sin_und))
        rope = HalfRope(*(_pad_rows(torch.cat([gen, und]), pad)[None, :, None] for gen, und in tables))
        rows = [_pad_rows(torch.cat([gen, und]), pad).unsqueeze(0)
                for gen, und in ((q, q_und), (k, k_und), (v, v_und))]
        valid_keys = None if valid is None else video + valid
        return self.attend(*rows, rope=rope, valid_keys=valid_keys)[0, :q.shape[0]]


def _pad_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x [rows, ...] with `pad` zero rows appended."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) if pad else x



def cosmos3_grid(module, args, kwargs) -> tuple[tuple[int, int, int], int | PaddedText, str | None]:
    """The video grid (T, H, W) of the generation rows; the rows after it in the processor's attention call (sound,
    action and the understanding keys: global tiles); and why the forward keeps the stock processor (None when it can
    be served; else the grid is (1, 1, N), only to keep the layouts well-formed). Syncs the host once (the vision
    rows' indexes)."""
    und_len = int(forward_arg(args, kwargs, "und_len", 3))
    generation = int(forward_arg(args, kwargs, "sequence_length", 4)) - und_len
    shapes = forward_arg(args, kwargs, "vision_token_shapes", 6)
    indexes = forward_arg(args, kwargs, "vision_sequence_indexes", 7)
    problem = None
    if getattr(module, "_cp_shard_fn", None) is not None:
        problem = "the model's context-parallel seams (_cp_shard_fn) are set"
    elif shapes is None or len(shapes) != 1:
        problem = f"the forward packs {0 if shapes is None else len(shapes)} vision items (served: exactly one)"
    else:
        grid = tuple(int(n) for n in shapes[0])
        tokens = grid[0] * grid[1] * grid[2]
        expected = torch.arange(und_len, und_len + tokens, device=indexes.device)
        if indexes.numel() != tokens or tokens > generation or not bool((indexes == expected).all()):
            problem = "the vision rows are not the first generation rows, right after the text"
    if problem is not None:
        return (1, 1, max(generation, 1)), 0, problem + "; sparse attention needs them as the video grid"
    rest = generation - tokens + und_len           # sound and action rows, then the prompt's
    valid = torch.tensor([rest], dtype=torch.int32, device=indexes.device)
    return grid, PaddedText(rest, valid, pad_to_tile=True), None
