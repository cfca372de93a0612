"""`videosparse distill`: every DistillConfig field a flag, the run, and its one-line summary."""

from __future__ import annotations

import argparse

from .._run_checks import check_output
from ..distill.config import DistillConfig
from .common import check_model
from .config_args import add_config_arguments, config_from_namespace


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("distill", help="distill a Veda tile estimator from the model's dense attention",
                       parents=[common],
                       description="Every DistillConfig field is a flag (JSON values allowed; bool fields take "
                                   "true/false); runs under `accelerate launch -m videosparse.cli distill ...` "
                                   "across GPUs.")
    add_config_arguments(p, DistillConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..distill import run_distillation

    cfg = config_from_namespace(args, DistillConfig)
    check_model(cfg.model)
    check_output("--output-dir", cfg.output_dir, folder=True)
    result = run_distillation(cfg)
    if result.resumed_from is not None:     # (a rerun of a finished run resumes at its end and trains no more)
        print(f"resumed from {result.resumed_from} (same settings; --resume false starts afresh)")
    if result.metrics:
        t, u = result.metrics["trained"], result.metrics["untrained_mean_pool"]
        print(f"{result.global_step} steps: KL {t['kl']:.4f} (untrained {u['kl']:.4f}), recall at density "
              f"{cfg.density}: {t['recall']:.3f} (untrained {u['recall']:.3f}), teacher heat kept "
              f"{t['heat_recall']:.3f} (untrained {u['heat_recall']:.3f}) -> {result.output_dir}")
    return 0
