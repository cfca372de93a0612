"""Veda as a `SparseMethod`: estimator scores over video tiles -> top-k plan."""

from __future__ import annotations

import copy
import logging
import math
import os
from typing import Sequence

import torch

from .._helper_backend import helper_backend
from ..config import TileShape
from ..layout import HeadTiling
from ..method import ModelInfo, SparseMethod
from ..plan import Plan, row_budget_list, topk_plan
from ..sol.centroids import tile_centroids  # dispatching: Triton on CUDA, torch elsewhere
from ..validation import one_per_head
from .estimator import VedaEstimator, load_estimator, scaled_logits
from .tiling import Tiling, load_tiling
from .trippool import trippool_qk

logger = logging.getLogger(__name__)


def mean_pooled_logits(qf: torch.Tensor, kf: torch.Tensor) -> torch.Tensor:
    """Untrained-estimator logits: mean(q_i) . mean(k_j) / sqrt(D), fp32 [B, H, N, N].

    Args:
        qf, kf: fp32 [B, H, N, 3*D] TripPool features (only the mean part is used).
    """
    D = qf.shape[-1] // 3
    return scaled_logits(qf[..., :D], kf[..., :D], 1.0 / math.sqrt(D))


class VedaMethod(SparseMethod):
    """Top-k tile selection from estimator logits (arXiv 2605.30325).

    With `config.estimator=None` the scores are mean-pooled q.k per tile (the untrained estimator);
    otherwise the `VedaEstimator` (object, directory or hub id) scores the tiles; an object is run as
    an fp32 eval copy and left as the caller had it. `config.tiling` is one tile shape for every head
    or a tiling JSON from the head-aware search.

    Args:
        config: a `VedaConfig`.
        info: the transformer's `ModelInfo`; a mismatched estimator or tiling file raises `ValueError`.
    """

    def __init__(self, config, info: ModelInfo) -> None:
        super().__init__(config, info)
        self.tiling: Tiling | None = None
        self._warned_floors: set[tuple[int, int]] = set()
        if isinstance(config.tiling, (str, os.PathLike)):
            self.tiling = load_tiling(config.tiling, config.block)
            self.tiling.check_model(info.model_class, info.num_layers, info.num_heads, os.fspath(config.tiling))
        self.estimator: VedaEstimator | None = None
        self._estimator_tiles: list | None = None
        if isinstance(config.estimator, tuple):
            raise ValueError(f"estimator= names {len(config.estimator)} estimators, one per transformer of a "
                             "pipeline, which videosparse.apply(pipe, config) splits by the component each was "
                             "distilled from; a config for one transformer (videosparse.processors(transformer, "
                             "config), or a dict entry of apply) takes that transformer's one estimator.")
        if config.estimator is not None:
            est = load_estimator(config.estimator)
            model = dict(model_class=info.model_class, num_layers=info.num_layers, num_heads=info.num_heads,
                         head_dim=info.head_dim, block=config.block)
            est.check_compatible(**model)   # first the sizes: the tile shapes below index the estimator's layers
            if config.tiling is None:   # the tile shapes the estimator was trained with
                self._estimator_tiles = [[tuple(s) for s in heads] for heads in est.tile_shapes]
            est.check_compatible(**model, tile_shapes=[self.head_shapes(l, info.num_heads)
                                                       for l in range(info.num_layers)])
            if est is config.estimator:   # the caller's module: run a copy (its dtype, mode, grads, device stay)
                est = copy.deepcopy(est)
                est.zero_grad(set_to_none=True)
            self.estimator = est.float().eval().requires_grad_(False)
        self._kernel_backend = helper_backend(config.backend)    # TripPool and the correction's centroids

    def tile_shapes(self, layer: int, num_heads: int) -> TileShape | Sequence[TileShape]:
        """One (pt, ph, pw) for all heads (fixed tiling) or one per head (tiling file or estimator)."""
        if self.tiling is not None:
            return self.tiling.tiles_for(layer, num_heads)
        if self._estimator_tiles is not None:
            return self._estimator_tiles[layer]
        return super().tile_shapes(layer, num_heads)

    def head_shapes(self, layer: int, num_heads: int) -> list[TileShape]:
        """The tile shape of every head of `layer`."""
        return one_per_head(self.tile_shapes(layer, num_heads), num_heads)

    def on_layout(self, layer: int, layout: HeadTiling) -> None:
        """Warn once per tile count when the tiles every plan keeps (each query tile's own tile, at least one per
        row, and the global tiles: rows and columns) put the realised density above 1.25x the target (eager)."""
        Mv, G = layout.num_video_tiles, layout.num_global_tiles
        N = Mv + G
        if not Mv or (Mv, G) in self._warned_floors or self.config.is_dense_layer(layer):
            return
        floor = (sum(row_budget_list(self.config.density, Mv, Mv)) + Mv * G + G * N) / (N * N)
        if floor > 1.25 * self.config.density:
            self._warned_floors.add((Mv, G))
            logger.warning(
                "Veda: target density %.3g gives %.3f on this input: %d video tile%s (every query tile keeps at least "
                "its own) and %d global tile%s (text or conditions, always kept); the realised density cannot be "
                "lower.", self.config.density, floor, Mv, "" if Mv == 1 else "s", G, "" if G == 1 else "s")

    def prepare(self, device: torch.device | str) -> None:
        """Move the estimator to `device` and give every layer's state its weights (see `scores`)."""
        if self.estimator is None:
            return
        if self.estimator.proj_q.device != torch.device(device):
            self.estimator.to(device)
        for layer in range(self.estimator.num_layers):
            self.layer_state(layer)["weights"] = (self.estimator.proj_q[layer], self.estimator.proj_k[layer])

    def release(self) -> None:
        """The estimator copy to the CPU, and no layer state holding its device weights."""
        if self.estimator is None:
            return
        for state in self.layer_states.values():
            state.pop("weights", None)
        self.estimator.to("cpu")

    def head_state(self, layer: int, state: dict, heads: slice, group=None) -> dict:
        """The layer's state with the estimator weights of heads `heads` only."""
        if self.estimator is None:
            return state
        proj_q, proj_k = state.get("weights") or (self.estimator.proj_q[layer], self.estimator.proj_k[layer])
        return {**state, "weights": (proj_q[heads], proj_k[heads])}

    def scores(self, q: torch.Tensor, k: torch.Tensor, layout: HeadTiling, layer: int,
               state: dict | None = None) -> torch.Tensor:
        """fp32 [B, H, Mv, Mv] tile logits over the video tiles (q, k: [B, H, S, D] in tile order).

        With a trained estimator the layer's weights come from `state` when `prepare` put them there
        (no indexing by the layer number, so one compiled block serves every layer), else by index.
        """
        qf, kf = trippool_qk(q, k, self.block, layout.num_video_tiles, backend=self._kernel_backend)
        if self.estimator is None:
            return mean_pooled_logits(qf, kf)
        weights = state.get("weights") if state is not None else None
        if weights is not None and weights[0].device == q.device:
            return VedaEstimator.logits_with(qf, kf, *weights)
        if self.estimator.proj_q.device != q.device:
            self.estimator.to(q.device)
        with torch.no_grad():
            return self.estimator(qf, kf, layer)

    def plan(self, q, k, v, layout: HeadTiling, layer: int, state: dict | None = None, valid_keys=None,
             skip_padded_queries: bool = False) -> Plan:
        """The Veda plan of one attention call: per (batch, head, query tile), the top-k video key tiles by the
        estimator's scores (`scores`), each query tile's own tile and the global tiles always kept.

        Args:
            q, k, v: [B, H, S, D] in tile order (bf16 / fp16 / fp32); v is read only for the correction.
            layout: the `HeadTiling` that gathered them; layer: the self-attention layer index; state: its state.
            valid_keys, skip_padded_queries: not read (padded text tiles do not enter the top-k's density; the
                processors add the key limit to the plan).

        Returns:
            `Plan` over Mv + G tiles of `block` tokens.
        """
        scores = self.scores(q, k, layout, layer, state)
        # fp16 selection on CUDA: estimator logits are O(10), and the radix select runs over half the bits
        plan = topk_plan(scores, self.config.density, num_global_tiles=layout.num_global_tiles, block=self.block,
                         select_dtype=torch.float16 if scores.is_cuda else torch.float32)
        if self.config.correction:
            plan = plan.with_correction(*tile_centroids(k, v, self.block, backend=self._kernel_backend))
        return plan
