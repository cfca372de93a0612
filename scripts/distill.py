"""Distill a Veda tile estimator from a model's dense attention (thin entry; the work is in videosparse.distill).

    python scripts/distill.py --model reference --prompts prompts.txt --output-dir veda-ref --epochs 20
    accelerate launch scripts/distill.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompts prompts.txt ...
    python scripts/distill.py --config veda-ref/distill_config.json      # rerun / resume a run

Every field of `DistillConfig` is a flag (underscores -> dashes, JSON values: `--tiling [8,4,4]`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from videosparse.distill.config import DistillConfig, add_config_arguments, config_from_namespace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description="Distill a Veda tile estimator (arXiv 2605.30325).")
    add_config_arguments(parser, DistillConfig)
    cfg = config_from_namespace(parser.parse_args(argv), DistillConfig)
    from videosparse.distill import run_distillation

    result = run_distillation(cfg)
    if result.metrics:
        t, u = result.metrics["trained"], result.metrics["untrained_mean_pool"]
        print(f"{result.global_step} steps: KL {t['kl']:.4f} (untrained {u['kl']:.4f}), recall at density "
              f"{cfg.density}: {t['recall']:.3f} (untrained {u['recall']:.3f}) -> {result.output_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
