"""Veda distillation and head-aware tiling search on a model's dense attention.

    from videosparse.distill import DistillConfig, run_distillation, TilingSearchConfig, run_tiling_search
    run_tiling_search(TilingSearchConfig(model="reference", output="tiling.json"))
    run_distillation(DistillConfig(model="reference", tiling="tiling.json", output_dir="veda-ref"))

Heavy imports (diffusers, accelerate) happen inside the functions.
"""

from .config import CaptureConfig, DistillConfig, TilingSearchConfig


def run_distillation(cfg, **kwargs):
    """See `videosparse.distill.train.run_distillation`."""
    from .train import run_distillation as _run

    return _run(cfg, **kwargs)


def run_tiling_search(cfg):
    """See `videosparse.distill.search.run_tiling_search`."""
    from .search import run_tiling_search as _run

    return _run(cfg)


__all__ = ["CaptureConfig", "DistillConfig", "TilingSearchConfig", "run_distillation", "run_tiling_search"]
