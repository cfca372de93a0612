"""The model-independent part of every sparse self-attention processor.

`SparseAttentionMixin.attend(q, k, v, ...)` takes q, k, v in diffusers' layout (B, S, H, D),
post-RoPE or with Wan's rotary tables as `rope` (then the rotation is fused into the gather), and
returns the attention output in the same layout. It decides dense vs sparse for this call, and when
sparse runs gather -> plan -> kernel -> scatter. The dense path always calls
diffusers' `dispatch_attention_fn` with the processor's `_attention_backend` and `_parallel_config`,
so the user's backend choice and context parallelism keep working; under Ulysses context parallelism the
sparse path runs too (`parallel.py`). With `return_lse=True` it also returns each row's log-sum-exp, dense calls
then running on videosparse's kernel with a dense plan (`dense_with_lse`), so that a caller can merge the result
with attention over further keys (`merge_attention`).
"""

from __future__ import annotations

import functools
import logging

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

try:
    from diffusers.hooks.layer_skip import AttentionScoreSkipFunctionMode
except ImportError:                     # a diffusers without layer-skip hooks
    AttentionScoreSkipFunctionMode = None

from ..kernels import block_sparse_attention
from ..kernels.autograd import refuse_functorch_transforms
from ..plan import dense_plan
from ..rope import PairRope, apply_rope, tables_on
from .parallel import heads_to_seq, seq_to_heads, ulysses_shard
from .session import AttentionRecord, LayerStats, SparseSession, attention_dtype

logger = logging.getLogger("videosparse")

SCORES_SKIPPED = "attention scores skipped (a diffusers layer-skip hook: perturbed-attention guidance)"
# the fallback reason of a self-attention call given an attention mask, in every family (one entry in `stats()`)
MASK_REASON = "an attention mask was given"


def attention_scores_skipped() -> bool:
    """True inside diffusers' `AttentionScoreSkipFunctionMode` (`LayerSkipConfig(skip_attention_scores=True)`, which
    perturbed-attention guidance puts on its layers): the stock processors' attention then returns the values.
    Traced by Dynamo (no graph break); False on a diffusers without layer-skip hooks."""
    return AttentionScoreSkipFunctionMode is not None and any(
        isinstance(mode, AttentionScoreSkipFunctionMode) for mode in torch.overrides._get_current_function_mode_stack())


class _StockSkipMetadata:
    """diffusers' layer-skip metadata (`AttentionProcessorRegistry`) of a sparse processor class: its stock class's,
    looked up when a hook asks. A stock class registered after `apply` counts, and one diffusers never registered
    fails as it does for the stock processor (naming the stock class)."""

    def __init__(self, stock: type) -> None:
        self.stock = stock

    @property
    def skip_processor_output_fn(self):
        from diffusers.hooks._helpers import AttentionProcessorRegistry

        return AttentionProcessorRegistry.get(self.stock).skip_processor_output_fn


def register_layer_skip(processor_cls: type) -> None:
    """Register `processor_cls` (a sparse processor class) in diffusers' `AttentionProcessorRegistry` with its stock
    class's metadata, so that `apply_layer_skip` and the guiders (skip-layer, perturbed-attention) treat videosparse's
    layers as they treat the stock ones. Idempotent; nothing on a diffusers without that registry."""
    try:
        from diffusers.hooks._helpers import AttentionProcessorRegistry
    except ImportError:
        return
    registered = AttentionProcessorRegistry._registry
    if processor_cls not in registered:
        AttentionProcessorRegistry.register(processor_cls, _StockSkipMetadata(processor_cls._stock))


def project_heads(x: torch.Tensor, heads: int, to_q, to_k, to_v, norm_q=None, norm_k=None):
    """q, k, v [B, S, H, D] from x [B, S, C]: three linear projections split into `heads`, with the
    optional per-head q/k norms applied (the shape diffusers' joint-attention processors use)."""
    query = to_q(x).unflatten(2, (heads, -1))
    key = to_k(x).unflatten(2, (heads, -1))
    value = to_v(x).unflatten(2, (heads, -1))
    if norm_q is not None:
        query = norm_q(query)
    if norm_k is not None:
        key = norm_k(key)
    return query, key, value


def project_text_heads(attn, encoder_hidden_states: torch.Tensor):
    """q, k, v [B, L, H, D] of the text stream of a dual-stream (MMDiT) block: its `add_q/k/v_proj` and
    `norm_added_q/k`."""
    return project_heads(encoder_hidden_states, attn.heads, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj,
                         attn.norm_added_q, attn.norm_added_k)


def project_joint_outputs(attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor):
    """(video, text) outputs of a joint-attention block: its `to_out` (linear, dropout) on the video part and its
    `to_add_out` on the text part, each where the block has one."""
    if getattr(attn, "to_out", None) is not None:
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
    if getattr(attn, "to_add_out", None) is not None:
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
    return hidden_states, encoder_hidden_states


def rope_after_text(attn, query: torch.Tensor, text_len: int, image_rotary_emb) -> tuple[torch.Tensor, PairRope | None]:
    """diffusers' RoPE of the video rows, which follow `text_len` text rows, for a joint [text; video] call: as a
    `PairRope` for `attend` (which rotates q and k, fused into the tile-order gather on sparse calls), or, where the
    stock processor rotates the query alone (`attn.is_cross_attention`), applied to `query` here. Returns (query,
    rope)."""
    if image_rotary_emb is None:
        return query, None
    rope = PairRope(*tables_on(image_rotary_emb, query.device), start=text_len)
    return (apply_rope(query, rope), None) if attn.is_cross_attention else (query, rope)


def project_output(attn, out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The attention output out [B, S, H, D] through `attn.to_out` (linear, dropout): flattened to [B, S, H * D] in
    `like`'s dtype first, as diffusers' processors do after their attention call."""
    out = out.flatten(2, 3).type_as(like)
    return attn.to_out[1](attn.to_out[0](out))


def _plain(x: torch.Tensor) -> torch.Tensor:
    """x as a plain tensor of its values where it is a tensor subclass that dequantizes (optimum-quanto's quantized
    activations, W8A8): the plan builders' and the attention kernels' Triton code reads a tensor's storage, which for
    such a subclass holds its int8 payload. Plain tensors, and everything while torch.compile traces, as they are."""
    if type(x) is torch.Tensor or torch.compiler.is_compiling() or type(x).dequantize is torch.Tensor.dequantize:
        return x
    plain = x.dequantize()
    return plain if type(plain) is torch.Tensor else x


def dense_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto"):
    """Full attention of q [B, S, H, D] over k, v [B, Sk, H, D] (diffusers' layout) on videosparse's kernel with a
    dense plan: (out [B, S, H, D] in q's dtype, lse fp32 [B, S, H], natural-log row log-sum-exp)."""
    B, S, H, _ = q.shape
    dtype = attention_dtype(q.dtype, q.device)                     # under autocast, as SDPA casts
    qt, kt, vt = (x.transpose(1, 2).to(dtype).contiguous() for x in (q, k, v))
    plan = dense_plan(B, H, S, device=q.device, key_len=k.shape[1])
    out, lse = block_sparse_attention(qt, kt, vt, plan, return_lse=True, backend=backend, validate=False)
    return out.transpose(1, 2), lse.transpose(1, 2)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Attention over the union of two disjoint key sets from the attention over each: out [..., D] with its row
    log-sum-exp lse [...]. Returns (out [..., D] in out_a's dtype, lse); computed in fp32 (fp64 for fp64 inputs)."""
    dtype = torch.promote_types(out_a.dtype, torch.float32)
    lse = torch.logaddexp(lse_a.to(dtype), lse_b.to(dtype))
    weight_a, weight_b = torch.exp(lse_a - lse).unsqueeze(-1), torch.exp(lse_b - lse).unsqueeze(-1)
    out = out_a.to(dtype) * weight_a + out_b.to(dtype) * weight_b
    return out.to(out_a.dtype), lse


class SparseAttentionMixin:
    """Mixed into a model's stock processor class (`_stock`, the second base); one instance per self-attention
    layer. Calls the sparse path cannot serve go to `self._stock.__call__`.

    Args:
        session: the transformer's `SparseSession`.
        layer: index of this self-attention layer (0-based, in module order).
        original: the processor this one replaces (its `_attention_backend` / `_parallel_config` are kept).
    """

    _stock: type                       # the model's stock processor class
    timed_entry = "attend"             # the method holding a call's whole attention (what `AttentionTimer` times)

    def __init_subclass__(cls, **kwargs) -> None:
        """A subclass's own `__call__` serves a call whose attention scores a diffusers layer-skip hook skips with
        the stock processor (its attention then returns the values, as the hook means; counted as a dense call,
        without a warning: the user asked for it)."""
        super().__init_subclass__(**kwargs)
        call = cls.__dict__.get("__call__")
        if call is None:
            return

        @functools.wraps(call)          # (diffusers reads the processor's parameters from its signature)
        def __call__(self, *args, **kwargs):
            if attention_scores_skipped():
                stats = self._stats()
                stats.fallbacks.add(SCORES_SKIPPED)
                stats.record_dense()
                return self._stock.__call__(self, *args, **kwargs)
            return call(self, *args, **kwargs)

        cls.__call__ = __call__

    def __init__(self, session: SparseSession, layer: int, original=None) -> None:
        self._stock.__init__(self)
        self.session = session
        self.layer = layer
        self.slot = session.slot(layer)
        for attr in ("_attention_backend", "_parallel_config"):
            if original is not None and hasattr(original, attr):
                setattr(self, attr, getattr(original, attr))

    # ---------------------------------------------------------------- decisions
    def _stats(self) -> LayerStats:
        """This layer's counters (in its slot: read without the layer index, see `LayerSlot`); during a backward,
        a block recomputed by activation checkpointing other than diffusers' (`SparseSession.unmanaged_recompute`)
        counts nowhere."""
        if not torch.compiler.is_compiling() and self.session.unmanaged_recompute():
            return self.session.recompute_stats(self.slot)
        return self.slot.stats

    def _warn_once(self, reason: str, message: str = "runs dense attention: %s") -> None:
        """Record `reason` in this layer's stats and warn about it once per session (not again after `reset_stats`)."""
        self._stats().fallbacks.add(reason)
        if reason not in self.slot.warned:
            self.slot.warned.add(reason)
            logger.warning("videosparse: layer %d " + message, self.layer, reason)

    def _scheduled_dense(self) -> str | None:
        """Why the config runs this call dense ("dense config", "dense layer", "dense step"; "removed" once
        `videosparse.remove` took the session away, for a processor still held elsewhere), else None."""
        if not self.session.active:
            return "removed"
        if self.session.method is None:
            return "dense config"
        if self.slot.dense:
            return "dense layer"
        if not self.session.context.sparse_step:
            return "dense step"
        return None

    def _dense_reason(self, q: torch.Tensor, attention_mask, text_len, shard) -> str | None:
        """Why this call must run dense (None = sparse). Warnings only for unsupported inputs.

        shard: `ulysses_shard` of the processor's parallel config (q then holds this rank's 1/P of the tokens)."""
        scheduled = self._scheduled_dense()
        if scheduled is not None:
            return scheduled
        session, ctx = self.session, self.session.context
        unsupported = None
        if ctx.grid is None:
            unsupported = "no video grid recorded (was the transformer called through its forward?)"
        elif ctx.unsupported is not None:
            unsupported = ctx.unsupported
        elif attention_mask is not None:
            unsupported = MASK_REASON
        elif isinstance(shard, str):
            unsupported = shard
        elif shard is not None and q.shape[2] % shard.world:       # diffusers' own Ulysses attention fails too
            raise ValueError(f"{q.shape[2]} attention heads do not split evenly over ulysses_degree={shard.world}; "
                             f"use a ulysses_degree that divides {q.shape[2]}, or ulysses_anything=True (served "
                             "dense).")
        elif isinstance(text_len, tuple):
            unsupported = (f"the batch items have different valid text lengths {text_len}; this processor serves one "
                           "length per call")
        elif q.shape[1] * (shard.world if shard else 1) != ctx.grid[0] * ctx.grid[1] * ctx.grid[2] + text_len:
            seq = f"{q.shape[1]} x {shard.world} ranks" if shard else str(q.shape[1])
            unsupported = f"sequence length {seq} does not match grid {ctx.grid} + {text_len} text tokens"
        elif text_len in self.slot.layouts and self.slot.layouts[text_len].num_video_tiles == 0:
            layout = self.slot.layouts[text_len]
            unsupported = (f"the video has fewer tokens ({layout.num_video_tokens}) than one tile ({layout.block}); "
                           "there is nothing to skip")
        elif session.kernel_problem is not None:
            # the session's problem (device, dtype, head dim), not this layer's: counted per layer, warned once
            self._stats().fallbacks.add(session.kernel_problem)
            if not session.kernel_problem_warned:
                session.kernel_problem_warned = True
                logger.warning("videosparse: every self-attention layer runs dense attention: %s",
                               session.kernel_problem)
            return session.kernel_problem
        if unsupported:
            self._warn_once(unsupported)
            return unsupported
        return None

    # ---------------------------------------------------------------- attention
    @property
    def _kernel_choice(self) -> str:
        """The block-sparse kernel backend of the config ("auto" under the dense config)."""
        return getattr(self.session.config, "backend", "auto")

    def _dense(self, q, k, v, attention_mask) -> torch.Tensor:
        return dispatch_attention_fn(
            q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=getattr(self, "_attention_backend", None),
            parallel_config=getattr(self, "_parallel_config", None),
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask=None,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None, text_len: int | None = None,
               item: int | None = None, return_lse: bool = False, return_kv: bool = False,
               valid_keys: torch.Tensor | None = None, padded_rows: str = "attend"):
        """Self-attention of q [B, S, H, D], k, v [B, S, H / G, D] (diffusers order; G > 1: grouped-query attention,
        query head h reads KV head h // G) -> [B, S, H, D].

        rope: rotary tables still to be applied to q and k: Wan's (freqs_cos, freqs_sin), a `HalfRope`, a `PairRope`
        or a `HeadPairRope` (`videosparse.rope.apply_rope`); the sparse path fuses the rotation (and the KV heads'
        repeat) into the tile-order gather.
        text_len: the text tokens in q, k, v (default: the forward's, `context.text_len`).
        item: the batch item that q, k, v hold when the forward's items are served one by one (for observers; the
            items count as one call in `stats()`, item 0's).
        return_lse: also return the rows' log-sum-exp, fp32 [B, S, H]; dense calls then run `dense_with_lse`
            (no attention mask, no context parallelism).
        return_kv: also return (k, v) [B, S, H, D] as the attention used them (rotated, KV heads repeated; on
            sparse calls views of the tile-order copies: the key order does not change an attention over them), for
            a caller that attends other queries to the same keys (no context parallelism, not with return_lse).
        valid_keys: int32 [B], a key-padding mask as a tensor: item b's keys at positions >= valid_keys[b] are
            masked (they must be its last text tokens, which stay last in tile order). Sparse calls run the whole
            sequence with it (`Plan.valid_keys`), dense calls with the key mask [B, 1, 1, S] made of it (then
            `attention_mask` is not used). Not with observers, return_lse, return_kv or context parallelism.
        padded_rows: with valid_keys, what the rows past the limit need: "attend" (the valid keys, as the others)
            or "zero" (the caller zeroes them; sparse calls then skip their whole query tiles).

        Under Ulysses context parallelism q, k, v hold this rank's tokens of every head; the sparse path exchanges
        them for every token of this rank's heads, and the output back (`parallel`).
        """
        session = self.session
        text_len = session.context.text_len if text_len is None else text_len
        shard = ulysses_shard(getattr(self, "_parallel_config", None))
        if return_lse and (attention_mask is not None or shard is not None):
            raise ValueError("attend(return_lse=True) takes no attention mask and no context parallelism; got "
                             f"attention_mask={type(attention_mask).__name__}, shard={shard!r}.")
        if return_kv and (return_lse or shard is not None):
            raise ValueError(f"attend(return_kv=True) takes neither return_lse nor context parallelism; got "
                             f"return_lse={return_lse}, shard={shard!r}.")
        if valid_keys is not None and (return_lse or return_kv or shard is not None or session.observers):
            raise ValueError(f"attend(valid_keys=...) takes no return_lse, return_kv, context parallelism or "
                             f"observers; got return_lse={return_lse}, return_kv={return_kv}, shard={shard!r}, "
                             f"{len(session.observers)} observers.")
        reason = self._dense_reason(q, attention_mask if valid_keys is None else None, text_len, shard)
        if q.shape[2] % k.shape[2] or k.shape[2] != v.shape[2]:
            raise ValueError(f"q has {q.shape[2]} heads, k {k.shape[2]} and v {v.shape[2]}: k and v need the same "
                             "head count, a divisor of q's (grouped-query attention).")
        groups = q.shape[2] // k.shape[2]
        unfused = session.observers or reason is not None or shard is not None
        if rope is not None and unfused:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
            rope = None
        if groups > 1 and unfused:
            k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
            groups = 1
        if session.observers and shard is not None:
            self._warn_once("attention observers (distillation capture, attention metrics) skipped under context "
                            "parallelism", "%s; run them on one GPU")
        elif session.observers:
            ctx = session.context
            record = AttentionRecord(self.layer, q, k, v, ctx.grid, text_len, session.info.text_position,
                                     ctx.step, ctx.branch, item, reason, ctx.text_slot)
            for observer in session.observers:
                observer(record)
            if reason is None and not session.active:       # an observer called `remove`: this call runs dense too
                reason = "removed"
        stats = self._stats()
        if reason is not None:
            if not item:                # items served one by one count as the one layer call they make up
                stats.record_dense()
            if return_lse:
                return dense_with_lse(q, k, v, self._kernel_choice)
            if valid_keys is not None:
                positions = torch.arange(k.shape[1], device=k.device)
                attention_mask = (positions < valid_keys[:, None])[:, None, None, :]      # [B, 1, 1, S] key mask
            out = self._dense(q, k, v, attention_mask)
            return (out, (k, v)) if return_kv else out

        if shard is not None:
            heads = shard.heads(q.shape[2])
            q, k, v = (seq_to_heads(x, shard) for x in (q, k, v))
            return heads_to_seq(self._sparse(q, k, v, text_len, rope, heads, group=shard.group), shard)
        return self._sparse(q, k, v, text_len, rope, return_lse=return_lse, groups=groups, return_kv=return_kv,
                            valid_keys=valid_keys, skip_padded_queries=padded_rows == "zero", new_call=not item)

    def _sparse(self, q, k, v, text_len: int, rope=None, heads: slice | None = None, return_lse: bool = False,
                groups: int = 1, return_kv: bool = False, valid_keys: torch.Tensor | None = None,
                skip_padded_queries: bool = False, group=None, new_call: bool = True):
        """gather -> plan -> kernel -> scatter of q [B, S, H, D], k, v [B, S, H / groups, D] (the layer's heads
        `heads`, default all; the other heads on the ranks of the process group `group`); with `return_lse` also
        the rows' lse, fp32 [B, S, H]; with `return_kv` also the rotated, repeated k, v in tile order as
        [B, S, H, D] views; `valid_keys` as in `attend` (with `skip_padded_queries` the query tiles past it are not
        computed); `new_call` as in `LayerStats.record_sparse`."""
        refuse_functorch_transforms()
        q, k, v = _plain(q), _plain(k), _plain(v)
        session = self.session
        layout, state = self.slot.layouts[text_len], self.slot.method_state
        if heads is not None:
            layout = layout.select_heads(heads)
            state = session.method.head_state(self.layer, state, heads, group)
        qt, kt, vt = layout.gather(q, rope), layout.gather(k, rope, groups), layout.gather(v, groups=groups)
        dtype = attention_dtype(qt.dtype, qt.device)
        if dtype != qt.dtype or dtype != kt.dtype or dtype != vt.dtype:     # under autocast, as SDPA casts
            qt, kt, vt = qt.to(dtype), kt.to(dtype), vt.to(dtype)
        plan = session.method.plan(qt, kt, vt, layout, self.layer, state, valid_keys, skip_padded_queries)
        pairs = None
        if valid_keys is not None:      # the density counts pairs of valid tiles (padded tiles are not computed)
            plan = plan.with_valid_keys(valid_keys, skip_padded_queries)
            key_tiles = (valid_keys.long() + plan.block_n - 1) // plan.block_n
            query_tiles = (valid_keys.long() + plan.block_m - 1) // plan.block_m if skip_padded_queries else \
                plan.kv_count.shape[-1]
            pairs = (plan.kv_count.shape[1] * query_tiles * key_tiles).sum()
        self._stats().record_sparse(plan.kv_count, layout.num_tiles, pairs, new_call=new_call)
        out = block_sparse_attention(qt, kt, vt, plan, backend=session.config.backend, validate=False,
                                     return_lse=return_lse)
        if return_lse:
            out, lse = out
            return layout.scatter(out), layout.scatter(lse.unsqueeze(-1)).squeeze(-1)
        if return_kv:
            return layout.scatter(out), (kt.transpose(1, 2), vt.transpose(1, 2))
        return layout.scatter(out)

    def _record_stock_call(self, reason: str) -> None:
        """Account a call that the model's stock processor serves for `reason` (warned once per layer
        when a sparse method is active; dense configs count it silently, like any dense call)."""
        if self.session.method is not None:
            self._warn_once(reason)
        self._stats().record_dense()

    def _to_stock(self, reason: str | None, *args, **kwargs):
        """The stock processor's `__call__(*args, **kwargs)`; a `reason` (not None) is accounted first
        (`_record_stock_call`), and without one the call is not counted (cross-attention: not a layer served)."""
        if reason is not None:
            self._record_stock_call(reason)
        return self._stock.__call__(self, *args, **kwargs)

    def _stock_reason(self, attention_mask) -> str | None:
        """Why a call keeps the stock processor in families whose grid function can refuse a forward: what it found
        (`context.unsupported`), else `MASK_REASON` for a call given a mask; None when it is served."""
        problem = self.session.context.unsupported
        if problem is None and attention_mask is not None:
            problem = MASK_REASON
        return problem

    def attend_text_prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_tokens: int,
                           attention_mask=None, padded_rows: str = "attend", rope=None) -> torch.Tensor:
        """Joint [video; text] self-attention whose text keys are valid only up to each item's valid length (a
        key-padding prefix mask): [B, S, H, D] -> same, for models whose padded text tokens come last
        (HunyuanVideo, Mochi). The last `text_tokens` of the sequence are text.

        Dense configs and observed forwards: the valid prefix of each item (video and its `context.text_len` valid
        text tokens) goes through `attend`, one call for the batch when the items agree, else one per item with its
        own layout. The padded text rows either attend densely to the valid keys ("attend", what
        HunyuanVideo's masked call gives them; they read the keys as the valid prefix's call used them) or are zeros
        ("zero", what Mochi and HunyuanVideo 1.5 give them). `rope` (as in `attend`) may rotate rows of the valid
        prefix only. Under context parallelism the sequence is split across ranks, so the stock masked call runs
        instead.

        Sparse forwards (`context.text_valid` set by the context hook) run the whole sequence in one call whatever
        the valid lengths, the padded keys masked in the kernel (`attend(valid_keys=...)`): the padded rows then
        sit in global tiles and attend densely to the valid keys, or are zeroed, and a new prompt length changes no
        shape (no recompile under torch.compile).
        """
        if getattr(self, "_parallel_config", None) is not None:
            return self.attend(q, k, v, attention_mask, rope=rope)     # dense, with the stock mask
        valid = self.session.context.text_valid
        if valid is not None:
            valid_keys = (q.shape[1] - text_tokens) + valid
            out = self.attend(q, k, v, rope=rope, text_len=text_tokens, valid_keys=valid_keys, padded_rows=padded_rows)
            if padded_rows == "zero" and text_tokens:
                # the padded rows are among the last text_tokens: zero them there, in place (not a pass over all rows),
                # unless autograd records: a dense layer's call returns SDPA's output, which it saves for backward
                rows = torch.arange(q.shape[1] - text_tokens, q.shape[1], device=q.device)
                padded = (rows >= valid_keys[:, None])[:, :, None, None]
                if out.requires_grad:
                    out = torch.cat([out[:, :-text_tokens], out[:, -text_tokens:].masked_fill(padded, 0)], dim=1)
                else:
                    out[:, -text_tokens:].masked_fill_(padded, 0)
            return out
        lengths = self.session.context.text_len
        if isinstance(lengths, tuple):
            return torch.cat([self._attend_valid(q[b:b + 1], k[b:b + 1], v[b:b + 1], text_tokens, n, padded_rows,
                                                 rope, b) for b, n in enumerate(lengths)])
        return self._attend_valid(q, k, v, text_tokens, lengths, padded_rows, rope)

    def _attend_valid(self, q, k, v, text_tokens: int, text_len: int, padded_rows: str, rope=None,
                      item: int | None = None) -> torch.Tensor:
        valid = q.shape[1] - text_tokens + text_len
        if valid >= q.shape[1]:
            return self.attend(q, k, v, None, rope=rope, text_len=text_len, item=item)
        if padded_rows == "zero":
            head = self.attend(q[:, :valid], k[:, :valid], v[:, :valid], None, rope=rope, text_len=text_len,
                               item=item)
            tail = q.new_zeros(q.shape[0], q.shape[1] - valid, *head.shape[2:])
        else:
            head, (keys, values) = self.attend(q[:, :valid], k[:, :valid], v[:, :valid], None, rope=rope,
                                               text_len=text_len, item=item, return_kv=True)
            tail = self._dense(q[:, valid:], keys, values, None)
        return torch.cat([head, tail], dim=1)
