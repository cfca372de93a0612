"""Veda: distilled per-head tile estimator, teacher tile scores and head-aware tiling (arXiv 2605.30325)."""
