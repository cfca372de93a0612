"""`videosparse search-tiling`: every TilingSearchConfig field a flag, the search, and the tiling it found."""

from __future__ import annotations

import argparse

from .._run_checks import check_output
from ..distill.config import TilingSearchConfig
from .common import check_model
from .config_args import add_config_arguments, config_from_namespace


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("search-tiling", help="head-aware tile-shape search on captured attention", parents=[common],
                       description="Every TilingSearchConfig field is a flag (JSON values allowed).")
    add_config_arguments(p, TilingSearchConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..distill import run_tiling_search

    cfg = config_from_namespace(args, TilingSearchConfig)
    check_model(cfg.model)
    check_output("--output", cfg.output, parents=True)       # (its folder is made with its parents)
    res = run_tiling_search(cfg)
    s = res.summary
    print(f"searched tiling: mean relative error {s['mean_rel_err_searched']:.4f}; best single shape "
          f"{s['best_single_shape']}: {s['mean_rel_err_best_single']:.4f} -> {cfg.output}")
    for layer, shapes in enumerate(res.tiling.layers):
        print(f"  layer {layer}: " + " ".join("x".join(map(str, sh)) for sh in shapes))
    return 0
