"""Veda as a `SparseMethod`: estimator scores over video tiles -> top-k plan."""

from __future__ import annotations

import math

import torch

from ..layout import HeadTiling
from ..method import SparseMethod
from ..plan import Plan, topk_plan
from ..sol.centroids import tile_centroids_torch
from .trippool import trippool_torch


class VedaMethod(SparseMethod):
    """Top-k tile selection from estimator logits (untrained estimator = mean-pooled q·k)."""

    def scores(self, q: torch.Tensor, k: torch.Tensor, layout: HeadTiling, layer: int) -> torch.Tensor:
        """fp32 [B, H, Mv, Mv] tile logits over the video tiles."""
        Mv = layout.num_video_tiles
        D = q.shape[-1]
        q_hat = trippool_torch(q, self.block, Mv)[..., :D]
        k_hat = trippool_torch(k, self.block, Mv)[..., :D]
        return (q_hat @ k_hat.transpose(-1, -2)) / math.sqrt(D)

    def plan(self, q, k, v, layout: HeadTiling, layer: int) -> Plan:
        scores = self.scores(q, k, layout, layer)
        plan = topk_plan(scores, self.config.density, num_global_tiles=layout.num_global_tiles, block=self.block)
        if self.config.correction:
            plan = plan.with_correction(*tile_centroids_torch(k, v, self.block))
        return plan
