"""Distill a Veda tile estimator from a model's dense attention (thin entry; the work is in videosparse.distill).

    python scripts/distill.py --model reference --prompts prompts.txt --output-dir veda-ref --epochs 20
    accelerate launch scripts/distill.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompts prompts.txt ...
    python scripts/distill.py --config veda-ref/distill_config.json      # rerun / resume a run

Every field of `DistillConfig` is a flag (underscores -> dashes, JSON values: `--tiling [8,4,4]`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from videosparse.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["distill", *sys.argv[1:]]))
