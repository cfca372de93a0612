"""Veda: distilled per-head tile estimator, teacher tile scores and head-aware tiling (arXiv 2605.30325).

Nothing here imports diffusers; Triton kernels are imported lazily (CUDA only, or the interpreter).
"""

from .estimator import VedaEstimator, load_estimator
from .losses import oracle_near_ties, tile_kl_loss, tile_recall
from .teacher import dense_lse_torch, teacher_heat, teacher_heat_torch
from .tiling import (CANDIDATES_64, CANDIDATES_128, Tiling, TilingSearch, candidate_shapes, load_tiling,
                     search_tiling)
from .trippool import trippool_qk, trippool_torch

__all__ = [
    "CANDIDATES_128", "CANDIDATES_64", "Tiling", "TilingSearch", "VedaEstimator", "candidate_shapes", "dense_lse_torch",
    "load_estimator", "load_tiling", "oracle_near_ties", "search_tiling", "teacher_heat", "teacher_heat_torch", "tile_kl_loss",
    "tile_recall", "trippool_qk", "trippool_torch",
]
