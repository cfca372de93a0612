"""The model-independent part of every sparse self-attention processor.

`SparseAttentionMixin.attend(q, k, v, ...)` takes post-RoPE q, k, v in diffusers' layout
(B, S, H, D) and returns the attention output in the same layout. It decides dense vs sparse for
this call, and when sparse runs gather -> plan -> kernel -> scatter. The dense path always calls
diffusers' `dispatch_attention_fn` with the processor's `_attention_backend` and `_parallel_config`,
so the user's backend choice and context parallelism keep working.
"""

from __future__ import annotations

import logging

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from ..kernels import block_sparse_attention, select_backend
from ..layout import HeadTiling, head_tiling
from .context import AttentionRecord, LayerStats, SparseSession

logger = logging.getLogger("videosparse")


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
        self._layouts: dict[tuple, HeadTiling] = {}
        for attr in ("_attention_backend", "_parallel_config"):
            if original is not None and hasattr(original, attr):
                setattr(self, attr, getattr(original, attr))

    # ---------------------------------------------------------------- decisions
    def _stats(self) -> LayerStats:
        return self.session.layer_stats.setdefault(self.layer, LayerStats())

    def _warn_once(self, reason: str) -> None:
        stats = self._stats()
        if reason not in stats.fallbacks:
            stats.fallbacks.add(reason)
            logger.warning("videosparse: layer %d runs dense attention: %s", self.layer, reason)

    def _dense_reason(self, q: torch.Tensor, attention_mask) -> str | None:
        """Why this call must run dense (None = sparse). Warnings only for unsupported inputs."""
        session, cfg = self.session, self.session.config
        if session.method is None:
            return "dense config"
        if cfg.is_dense_layer(self.layer):
            return "dense layer"
        ctx = session.context
        if ctx.step is not None and ctx.step < cfg.dense_step_count(ctx.num_steps):
            return "dense step"
        unsupported = None
        if ctx.grid is None:
            unsupported = "no video grid recorded (was the transformer called through its forward?)"
        elif attention_mask is not None:
            unsupported = "an attention mask was given"
        elif getattr(self, "_parallel_config", None) is not None:
            unsupported = "context parallelism splits the sequence"
        elif q.shape[1] != ctx.grid[0] * ctx.grid[1] * ctx.grid[2] + ctx.text_len:
            unsupported = f"sequence length {q.shape[1]} does not match grid {ctx.grid} + {ctx.text_len} text tokens"
        if unsupported:
            self._warn_once(unsupported)
            return unsupported
        return None

    def _layout(self, num_heads: int) -> HeadTiling:
        ctx = self.session.context
        key = (ctx.grid, ctx.text_len, num_heads)
        layout = self._layouts.get(key)
        if layout is None:
            method = self.session.method
            tiles = method.tile_shapes(self.layer, num_heads)
            layout = head_tiling(ctx.grid, tiles, num_heads, method.block, ctx.text_len,
                                 self.session.info.text_position or "after")
            self._layouts[key] = layout
        return layout

    # ---------------------------------------------------------------- attention
    def _dense(self, q, k, v, attention_mask) -> torch.Tensor:
        return dispatch_attention_fn(
            q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=getattr(self, "_attention_backend", None),
            parallel_config=getattr(self, "_parallel_config", None),
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """Self-attention of q, k, v [B, S, H, D] (diffusers order) -> [B, S, H, D]."""
        session = self.session
        if session.observers:
            ctx = session.context
            record = AttentionRecord(self.layer, q, k, v, ctx.grid, ctx.text_len, session.info.text_position,
                                     ctx.step, ctx.branch)
            for observer in session.observers:
                observer(record)
        stats = self._stats()
        reason = self._dense_reason(q, attention_mask)
        if reason is not None:
            stats.dense_calls += 1
            return self._dense(q, k, v, attention_mask)

        layout = self._layout(q.shape[2])
        qt, kt, vt = layout.gather(q), layout.gather(k), layout.gather(v)
        plan = session.method.plan(qt, kt, vt, layout, self.layer)
        try:
            impl = select_backend(qt, kt, vt, plan, session.config.backend)
        except ValueError as err:
            self._warn_once(str(err))
            stats.dense_calls += 1
            return self._dense(q, k, v, attention_mask)
        if impl.name == "reference" and q.is_cuda and session.config.backend == "auto":
            self._warn_once(f"no fast kernel serves dtype {q.dtype}, head dim {q.shape[-1]} on {q.device}")
            stats.dense_calls += 1
            return self._dense(q, k, v, attention_mask)
        out = block_sparse_attention(qt, kt, vt, plan, backend=impl.name, validate=False)
        self._record_plan(stats, plan, layout.num_tiles)
        return layout.scatter(out)

    @torch.compiler.disable
    def _record_plan(self, stats: LayerStats, plan, num_key_tiles: int) -> None:
        counts = plan.kv_count
        stats.sparse_calls += 1
        stats.kept_pairs += int(counts.sum())
        stats.total_pairs += counts.numel() * num_key_tiles
        stats.balance_sum += float(counts.max()) / max(float(counts.float().mean()), 1e-9)
