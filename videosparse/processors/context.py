"""Per-transformer sparse-attention session and the context hook that feeds it.

One `SparseSession` per transformer holds the config, the method (tile chooser), the current call
context (video grid, step index, CFG branch) and per-layer statistics. A diffusers `ModelHook`
(`SparseContextHook`, registered under `CONTEXT_HOOK`) records that context before every transformer
forward; the per-layer processors read it. The hook is stateful so that diffusers'
`cache_context(name, step_index=..., num_inference_steps=...)` reaches it; pipelines that give no
step index get one by matching the timestep against the scheduler's timesteps, else by counting
calls per branch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState, StateManager

logger = logging.getLogger("videosparse")

CONTEXT_HOOK = "videosparse_context"


@dataclass
class LayerStats:
    """Counters of one self-attention layer, accumulated over calls."""

    sparse_calls: int = 0
    dense_calls: int = 0
    kept_pairs: int = 0          # (query tile, key tile) pairs computed exactly
    total_pairs: int = 0         # all pairs of the sparse calls
    balance_sum: float = 0.0     # sum over sparse calls of max(kv_count) / mean(kv_count)
    fallbacks: set = field(default_factory=set)

    @property
    def density(self) -> float | None:
        return self.kept_pairs / self.total_pairs if self.total_pairs else None

    @property
    def load_balance(self) -> float | None:
        """max kv_count / mean kv_count over the sparse calls (1.0 = perfectly even)."""
        return self.balance_sum / self.sparse_calls if self.sparse_calls else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "sparse_calls": self.sparse_calls,
            "dense_calls": self.dense_calls,
            "density": self.density,
            "load_balance": self.load_balance,
            "fallbacks": sorted(self.fallbacks),
        }


@dataclass
class CallContext:
    """Where the current transformer forward is: grid, text tokens, step and branch."""

    grid: tuple[int, int, int] | None = None
    text_len: int = 0
    step: int | None = None
    num_steps: int | None = None
    branch: str = "default"


@dataclass
class AttentionRecord:
    """What an observer receives for one self-attention call (post-RoPE, before attention).

    q, k, v: [B, S, H, D] in diffusers' token order; grid (T, H, W); text_len and text_position
    describe joint-attention text tokens.
    """

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grid: tuple[int, int, int]
    text_len: int
    text_position: str | None
    step: int | None
    branch: str


class SparseSession:
    """Everything `apply` attaches to one transformer; returned by `videosparse.apply`.

    Attributes:
        config: the method config.
        method: the `SparseMethod` (None for `DenseConfig`).
        context: the `CallContext` of the current forward.
        layer_stats: `LayerStats` per self-attention layer index.
    """

    def __init__(self, config, method, info, original_processors: dict[str, Any], scheduler=None) -> None:
        self.config = config
        self.method = method
        self.info = info
        self.original_processors = original_processors
        self.scheduler = scheduler
        self.context = CallContext()
        self.layer_stats: dict[int, LayerStats] = {}
        self.observers: list[Callable[[AttentionRecord], None]] = []
        self.calls = 0

    def stats(self) -> dict[str, Any]:
        """Per-layer and overall statistics (realised density, load balance, sparse/dense calls)."""
        layers = {i: s.as_dict() for i, s in sorted(self.layer_stats.items())}
        kept = sum(s.kept_pairs for s in self.layer_stats.values())
        total = sum(s.total_pairs for s in self.layer_stats.values())
        return {
            "config": self.config.to_dict(),
            "transformer_calls": self.calls,
            "sparse_calls": sum(s.sparse_calls for s in self.layer_stats.values()),
            "dense_calls": sum(s.dense_calls for s in self.layer_stats.values()),
            "density": kept / total if total else None,
            "layers": layers,
        }

    def summary(self) -> str:
        s = self.stats()
        dens = f"{s['density']:.3f}" if s["density"] is not None else "n/a"
        return (
            f"videosparse[{self.config.method}]: {s['transformer_calls']} transformer calls, "
            f"{s['sparse_calls']} sparse / {s['dense_calls']} dense attention calls, realised density {dens}"
        )

    def reset_stats(self) -> None:
        self.layer_stats.clear()
        self.calls = 0

    def __repr__(self) -> str:
        return f"SparseSession({self.config!r})"


class _BranchState(BaseState):
    """Per cache-context (cond/uncond) state: forward calls seen in this pipeline call."""

    def __init__(self) -> None:
        self.calls = 0

    def reset(self) -> None:
        self.calls = 0


class SparseContextHook(ModelHook):
    """Records grid, step index and branch of every transformer forward into the session.

    Args:
        session: the `SparseSession` to update.
        grid_fn: (module, args, kwargs) -> ((T, H, W), text_len) for this model family.
    """

    _is_stateful = True

    def __init__(self, session: SparseSession, grid_fn) -> None:
        super().__init__()
        self.session = session
        self.grid_fn = grid_fn
        self.state_manager = StateManager(_BranchState)

    def pre_forward(self, module, *args, **kwargs):
        ctx = self.session.context
        ctx.grid, ctx.text_len = self.grid_fn(module, args, kwargs)
        cache_ctx = getattr(self.state_manager, "_context", None)
        ctx.branch = cache_ctx.name if cache_ctx is not None else "default"
        ctx.step, ctx.num_steps = self._step(cache_ctx, args, kwargs)
        self.session.calls += 1
        return args, kwargs

    @torch.compiler.disable
    def _step(self, cache_ctx, args, kwargs) -> tuple[int | None, int | None]:
        """Step index and step count: from the cache context, else the scheduler, else by counting."""
        scheduler = self.session.scheduler
        timesteps = getattr(scheduler, "timesteps", None) if scheduler is not None else None
        num_steps = getattr(cache_ctx, "num_inference_steps", None)
        if num_steps is None and timesteps is not None and len(timesteps):
            num_steps = len(timesteps)
        if cache_ctx is not None and cache_ctx.step_index is not None:
            return cache_ctx.step_index, num_steps
        t = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        if t is not None and timesteps is not None and len(timesteps):
            t0 = float(torch.as_tensor(t).flatten()[0])
            return int((timesteps.float().cpu() - t0).abs().argmin()), num_steps
        if cache_ctx is not None:
            state = self.state_manager.get_state()
            state.calls += 1
            return state.calls - 1, num_steps
        return None, num_steps

    def reset_state(self, module):
        # called by diffusers at the end of every pipeline call (maybe_free_model_hooks)
        if self.session.calls:
            logger.info(self.session.summary())
        self.state_manager.reset()
        return module


def register_context_hook(transformer: torch.nn.Module, session: SparseSession, grid_fn) -> None:
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    registry.register_hook(SparseContextHook(session, grid_fn), CONTEXT_HOOK)


def remove_context_hook(transformer: torch.nn.Module) -> None:
    registry = getattr(transformer, "_diffusers_hook", None)
    if registry is not None and registry.get_hook(CONTEXT_HOOK) is not None:
        registry.remove_hook(CONTEXT_HOOK, recurse=False)
