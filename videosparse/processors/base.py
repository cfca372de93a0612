"""The model-independent part of every sparse self-attention processor.

`SparseAttentionMixin.attend(q, k, v, ...)` takes q, k, v in diffusers' layout (B, S, H, D),
post-RoPE or with Wan's rotary tables as `rope` (then the rotation is fused into the gather), and
returns the attention output in the same layout. It decides dense vs sparse for this call, and when
sparse runs gather -> plan -> kernel -> scatter. The dense path always calls
diffusers' `dispatch_attention_fn` with the processor's `_attention_backend` and `_parallel_config`,
so the user's backend choice and context parallelism keep working.
"""

from __future__ import annotations

import logging

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from ..kernels import block_sparse_attention
from ..rope import apply_interleaved_rope
from .context import AttentionRecord, LayerStats, SparseSession

logger = logging.getLogger("videosparse")


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


class SparseAttentionMixin:
    """Mixed into a model's stock processor class; one instance per self-attention layer.

    Args:
        session: the transformer's `SparseSession`.
        layer: index of this self-attention layer (0-based, in module order).
        original: the processor this one replaces (its `_attention_backend` / `_parallel_config` are kept).
    """

    def _init_sparse(self, session: SparseSession, layer: int, original=None) -> None:
        self.session = session
        self.layer = layer
        self.slot = session.slot(layer)
        for attr in ("_attention_backend", "_parallel_config"):
            if original is not None and hasattr(original, attr):
                setattr(self, attr, getattr(original, attr))

    # ---------------------------------------------------------------- decisions
    def _stats(self) -> LayerStats:
        """This layer's counters (in its slot: read without the layer index, see `LayerSlot`)."""
        return self.slot.stats

    def _warn_once(self, reason: str) -> None:
        stats = self._stats()
        if reason not in stats.fallbacks:
            stats.fallbacks.add(reason)
            logger.warning("videosparse: layer %d runs dense attention: %s", self.layer, reason)

    def _dense_reason(self, q: torch.Tensor, attention_mask) -> str | None:
        """Why this call must run dense (None = sparse). Warnings only for unsupported inputs."""
        session = self.session
        if session.method is None:
            return "dense config"
        if self.slot.dense:
            return "dense layer"
        ctx = session.context
        if not ctx.sparse_step:
            return "dense step"
        unsupported = None
        if ctx.grid is None:
            unsupported = "no video grid recorded (was the transformer called through its forward?)"
        elif ctx.unsupported is not None:
            unsupported = ctx.unsupported
        elif attention_mask is not None:
            unsupported = "an attention mask was given"
        elif getattr(self, "_parallel_config", None) is not None:
            unsupported = "context parallelism splits the sequence"
        elif q.shape[1] != ctx.grid[0] * ctx.grid[1] * ctx.grid[2] + ctx.text_len:
            unsupported = f"sequence length {q.shape[1]} does not match grid {ctx.grid} + {ctx.text_len} text tokens"
        elif self.slot.layout is not None and self.slot.layout.num_video_tiles == 0:
            layout = self.slot.layout
            unsupported = (f"the video has fewer tokens ({layout.num_video_tokens}) than one tile ({layout.block}); "
                           "there is nothing to skip")
        elif session.kernel_problem is not None:
            unsupported = session.kernel_problem
        if unsupported:
            self._warn_once(unsupported)
            return unsupported
        return None

    # ---------------------------------------------------------------- attention
    def _dense(self, q, k, v, attention_mask) -> torch.Tensor:
        return dispatch_attention_fn(
            q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=getattr(self, "_attention_backend", None),
            parallel_config=getattr(self, "_parallel_config", None),
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask=None,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Self-attention of q, k, v [B, S, H, D] (diffusers order) -> [B, S, H, D].

        rope: Wan's rotary tables (freqs_cos, freqs_sin), still to be applied to q and k
        (`apply_interleaved_rope`); the sparse path fuses the rotation into the tile-order gather.
        """
        session = self.session
        reason = self._dense_reason(q, attention_mask)
        if rope is not None and (session.observers or reason is not None):
            q, k = apply_interleaved_rope(q, *rope), apply_interleaved_rope(k, *rope)
            rope = None
        if session.observers:
            ctx = session.context
            record = AttentionRecord(self.layer, q, k, v, ctx.grid, ctx.text_len, session.info.text_position,
                                     ctx.step, ctx.branch)
            for observer in session.observers:
                observer(record)
        stats = self._stats()
        if reason is not None:
            stats.record_dense()
            return self._dense(q, k, v, attention_mask)

        layout = self.slot.layout
        qt, kt, vt = layout.gather(q, rope), layout.gather(k, rope), layout.gather(v)
        plan = session.method.plan(qt, kt, vt, layout, self.layer, self.slot.method_state)
        out = block_sparse_attention(qt, kt, vt, plan, backend=session.config.backend, validate=False)
        stats.record_sparse(plan.kv_count, layout.num_tiles)
        return layout.scatter(out)

    def _record_stock_call(self, reason: str) -> None:
        """Account a call that the model's stock processor serves for `reason` (warned once per layer
        when a sparse method is active; dense configs count it silently, like any dense call)."""
        if self.session.method is not None:
            self._warn_once(reason)
        self._stats().record_dense()

    def attend_valid_prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: int,
                            attention_mask=None) -> torch.Tensor:
        """Self-attention under a key-padding mask that keeps the first `valid` tokens: [B, S, H, D] -> same.

        For joint-attention models whose padded text tokens sit at the end of the sequence
        (HunyuanVideo): rows [:valid] go through `attend` over the valid prefix alone (sparse or dense,
        as it decides; the grid's `text_len` counts the valid text tokens only), rows [valid:] attend
        densely to the valid keys, which is what the stock masked call gives them. `valid >= S` means
        nothing is padded and `attend` runs on the whole sequence without the (all-true) mask. Under
        context parallelism the sequence is split across ranks, so the stock masked call runs instead.
        """
        if getattr(self, "_parallel_config", None) is not None:
            return self.attend(q, k, v, attention_mask)     # dense, with the stock mask
        if valid >= q.shape[1]:
            return self.attend(q, k, v, None)
        head = self.attend(q[:, :valid], k[:, :valid], v[:, :valid], None)
        tail = self._dense(q[:, valid:], k[:, :valid], v[:, :valid], None)
        return torch.cat([head, tail], dim=1)
