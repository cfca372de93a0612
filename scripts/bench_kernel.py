"""The kernel benchmark (`videosparse bench`, `videosparse/eval/kernel_bench.py`), writing to
benchmarks/kernel_h200.json by default. The other scripts import its helpers (random_plan, time_interleaved,
gpu_state, ...) from here.

    python scripts/bench_kernel.py [--quick] [--out benchmarks/kernel_h200.json]
    python scripts/bench_kernel.py --readme benchmarks/kernel_h200.json   # markdown table from a JSON
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from videosparse.eval import kernel_bench  # noqa: E402
from videosparse.eval.kernel_bench import *  # noqa: E402,F401,F403

if __name__ == "__main__":
    sys.exit(kernel_bench.main(default_out=str(ROOT / "benchmarks" / "kernel_h200.json")))
