"""Sol-Attn as a `SparseMethod`: centroids -> Gaussian-calibrated threshold -> plan (+ correction)."""

from __future__ import annotations

import logging
import math

import torch

from .._helper_backend import helper_backend
from ..config import SolConfig
from ..layout import HeadTiling, _cache_key
from ..method import ModelInfo, SparseMethod
from ..plan import Plan
from .centroids import tile_stats
from .threshold import calibrate_tau, forced_pairs, routing_zscores, sol_plan_from_zscores

logger = logging.getLogger(__name__)

class SolMethod(SparseMethod):
    """Training-free tile selection with a Gaussian-calibrated, query-dependent threshold (arXiv 2607.24027).

    Per call: one fused pass over q, k, v gives mean query / mean key / value sum per tile; the
    routing statistic q̄_i·kc_j·scale is compared with thr_i = scale·(q̄_i·μ + τ·sqrt(Σ_d q̄²_{i,d} σ²_d))
    (μ, σ² a diagonal Gaussian fitted per batch and head to the video-tile centroids); tiles in the
    diagonal band and global (text) tiles are always exact, global rows are dense. Skipped tiles go
    to the zero-order correction when `config.correction` is set.

    With `SolConfig(density=...)`, τ is found by bisection on the first call of each
    (layer, shape and grid) and cached in this instance (one scalar per layer, shared by all heads, so the
    per-head density follows the data); with `SolConfig(tau=...)` τ is used as given.

    Args:
        config: a `SolConfig`.
        info: the transformer's `ModelInfo`.

    Attributes:
        static_width: True: plans are packed to the full width (number of tiles) instead of the
            largest row count, which removes the one host sync per call (only fast kernels, which read
            kv_count, should run such plans: the reference's cost grows with the width); False: tight;
            None (default): full width on CUDA with fp16/bf16 inputs, which the fast kernels serve,
            and under torch.compile; tight elsewhere (`packs_full_width`).

    Example:
        >>> import torch
        >>> from videosparse import SolConfig
        >>> from videosparse.layout import head_tiling
        >>> from videosparse.method import ModelInfo
        >>> info = ModelInfo("WanTransformer3DModel", 1, 2, 64, (1, 2, 2))
        >>> method = SolMethod(SolConfig(density=0.5, block=64), info)
        >>> layout = head_tiling((4, 8, 8), (4, 4, 4), 2, block=64)
        >>> q = k = v = torch.randn(1, 2, 256, 64)
        >>> plan = method.plan(q, k, v, layout, layer=0)
    """

    static_width: bool | None = None

    def __init__(self, config: SolConfig, info: ModelInfo) -> None:
        if not isinstance(config, SolConfig):
            raise TypeError(f"SolMethod needs a SolConfig; got {type(config).__name__}.")
        super().__init__(config, info)
        self._warned: set[int] = set()
        self._density_tensors: dict[str, torch.Tensor] = {}

    def prepare(self, device: torch.device | str) -> None:
        """The density target as a tensor on `device`, built here, outside compiled graphs: passed as a Python float,
        each density a process served compiled its own calibration graph (Dynamo guards on it), up to the recompile
        limit."""
        if self.config.density is not None:
            self._density_on(device)

    def release(self) -> None:
        self._density_tensors.clear()

    def _density_on(self, device: torch.device | str) -> torch.Tensor:
        """fp64 0-dim: `config.density` on `device`, cached."""
        key = _cache_key(device)
        if key not in self._density_tensors:
            self._density_tensors[key] = torch.tensor(float(self.config.density), dtype=torch.float64, device=key)
        return self._density_tensors[key]

    def stats(self) -> dict:
        """Calibrated thresholds, keyed "layer L, H heads, S tokens, grid (T, H, W)" (see `calibrations`)."""
        return {"calibrations": {f"layer {k[0]}, {k[1]} heads, {k[2]} tokens, grid {k[6]}": v
                                 for k, v in self.calibrations().items()}}

    def recalibrate(self) -> None:
        """Forget every calibrated τ (each layer's state is cleared in place, so the processors' slots see it): the
        next call of each layer and shape calibrates again, e.g. after fine-tuning moved the weights."""
        for state in self.layer_states.values():
            state.clear()

    def calibrations(self) -> dict[tuple, dict[str, float]]:
        """Calibrated τ and the density it gave on its calibration call, per (layer, H, S, D, Mv, G, grid).

        Converts to Python floats (a host sync): for reports, not for the hot path. A τ at the float32 limit is
        reported as +inf (no finite score passed: only the always-exact tiles are kept) or -inf (every tile passed).
        """
        return {(layer, *shape): {"tau": _report_tau(tau), "density": float(realized)}
                for layer, state in sorted(self.layer_states.items()) for shape, (tau, realized) in state.items()}

    def tau(self, z: torch.Tensor, layout: HeadTiling, layer: int, key: tuple, state: dict | None = None,
            valid_keys: torch.Tensor | None = None, skip_padded_queries: bool = False) -> torch.Tensor | float:
        """τ for this call: the configured one, or the one cached in the layer's state (calibrated on its
        first call per shape `key`, over the tiles computed: those of `valid_keys` as in `plan`)."""
        cfg = self.config
        if cfg.tau is not None:
            return float(cfg.tau)
        state = self.layer_state(layer) if state is None else state
        cached = state.get(key)
        if cached is not None:
            tau = cached[0]
            return tau if tau.device == z.device else tau.to(z.device)
        if isinstance(state, _RankState):     # one rank's heads: calibrate on every head, as one GPU would
            from ..processors.parallel import gather_heads

            z = gather_heads(z, state.group)
        valid_key_tiles = None if valid_keys is None else (valid_keys.long() + self.block - 1) // self.block
        tau, realized = calibrate_tau(z, self._density_on(z.device), layout.num_global_tiles,
                                      valid_key_tiles=valid_key_tiles, skip_padded_queries=skip_padded_queries)
        tau, realized = tau.detach(), realized.detach()     # kept for the session: no hold on this call's graph
        state[key] = (tau, realized)
        return tau

    def head_state(self, layer: int, state: dict, heads: slice, group=None):
        """Under Ulysses context parallelism (`group`): the layer's state, seen from one rank, so that a
        calibration counts the z-scores of all heads (gathered from the group's ranks): the same τ as on one GPU."""
        return state if group is None else _RankState(state, group)

    def on_layout(self, layer: int, layout: HeadTiling) -> None:
        """Warn once per layer when the target density is below that of the always-exact tiles (eager)."""
        cfg = self.config
        if cfg.density is None or layer in self._warned or cfg.is_dense_layer(layer):
            return
        Mv, G = layout.num_video_tiles, layout.num_global_tiles
        N = Mv + G
        floor = forced_pairs(Mv, G, cfg.band) / (N * N) if N else 0.0
        if floor > cfg.density:
            self._warned.add(layer)
            logger.warning(
                "Sol layer %d: target density %.3f is below the density of the always-exact tiles "
                "(band=%d, %d global tiles of %d) %.3f; only those are kept (with every text token valid: the pad "
                "tiles of a padded prompt are not computed, which lowers it).",
                layer, cfg.density, cfg.band, G, N, floor,
            )

    def plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: HeadTiling, layer: int,
             state: dict | None = None, valid_keys: torch.Tensor | None = None,
             skip_padded_queries: bool = False) -> Plan:
        """The Sol plan for one attention call.

        Args:
            q, k, v: [B, H, S, D] in tile order (each head in its own tile shape), bf16/fp16/fp32.
            layout: the `HeadTiling` that gathered them (num_video_tiles, num_global_tiles).
            layer: self-attention layer index.
            state: the layer's state dict (`layer_state(layer)`; the processors pass it).
            valid_keys: int [B] or None: item b's keys at tile-order positions >= valid_keys[b] are padding, which
                the caller drops from the plan (`Plan.with_valid_keys`, with `skip_padded_queries` the query tiles
                past it too); a density calibration then counts only the tiles computed.

        Returns:
            `Plan` with block_m == block_n == config.block over N = ceil(S / block) tiles, and
            k_mean / v_sum (fp32 [B, H, N, D]) and tile_len (int32 [N]) when config.correction.
        """
        cfg = self.config
        B, H, S, D = q.shape
        block = cfg.block
        N = math.ceil(S / block)
        Mv, G = layout.num_video_tiles, layout.num_global_tiles
        if Mv + G != N:
            raise ValueError(
                f"layout has {Mv} video + {G} global tiles but q has {S} tokens = {N} tiles of {block} "
                f"(layer {layer}); the layout's block must equal SolConfig.block={block}."
            )
        q_mean, k_mean, v_sum, tile_len = tile_stats(q, k, v, block, backend=helper_backend(cfg.backend))
        z = routing_zscores(q_mean[:, :, :Mv], k_mean[:, :, :Mv], 1.0 / math.sqrt(D), cfg.band)
        key = (H, S, D, Mv, G, layout.grid)
        tau = self.tau(z, layout, layer, key, state, valid_keys, skip_padded_queries)
        plan = sol_plan_from_zscores(z, tau, G, block, width=N if packs_full_width(self.static_width, q) else None)
        if cfg.correction:
            plan = plan.with_correction(k_mean, v_sum, tile_len)
        return plan


class _RankState:
    """A layer's state dict seen from one rank of a Ulysses group (reads and writes go to the dict); `group`: the
    process group whose ranks hold the other heads."""

    def __init__(self, state: dict, group) -> None:
        self.state, self.group = state, group

    def get(self, key):
        return self.state.get(key)

    def __setitem__(self, key, value) -> None:
        self.state[key] = value


def packs_full_width(static_width: bool | None, q: torch.Tensor) -> bool:
    """Whether `SolMethod.plan` packs the plan for q to the full width (see `SolMethod.static_width`). The tight
    width's host sync, with one more that is gone too, left the H200 idle for 24% of an eager Wan 1.3B forward
    (docs/results.md, "Sol without host syncs")."""
    if torch.compiler.is_compiling():
        return True
    if static_width is not None:
        return static_width
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _report_tau(tau: torch.Tensor) -> float:
    """A calibrated τ as a Python float, its float32-limit sentinels (see `threshold._centre_in_gap`) as ±inf."""
    value = float(tau)
    limit = float(torch.finfo(torch.float32).max)
    return math.copysign(math.inf, value) if abs(value) >= limit else value
