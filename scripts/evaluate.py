#!/usr/bin/env python
"""Evaluation entry point: the same as `videosparse evaluate ...` (see `videosparse evaluate --help`).

    python scripts/evaluate.py --methods dense veda@0.5 sol@0.5 --num-prompts 2 --steps 8 --out eval_out
    python scripts/evaluate.py --synthetic wan-1.3b wan-14b --methods veda@0.25 veda@0.1 veda@0.05 --out eval_syn
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from videosparse.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["evaluate", *sys.argv[1:]]))
