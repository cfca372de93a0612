"""The kernel benchmark (`videosparse bench`: the command in `videosparse/cli/bench.py`, the work in
`videosparse/eval/kernel_bench.py`), writing to benchmarks/kernel_h200.json by default. The other scripts import its
helpers (random_plan, time_interleaved, gpu_state, log, ...) from here.

    python scripts/bench_kernel.py [--quick] [--out benchmarks/kernel_h200.json]
    python scripts/bench_kernel.py --readme benchmarks/kernel_h200.json   # markdown table from a JSON
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from videosparse.cli import bench  # noqa: E402
from videosparse.eval.kernel_bench import *  # noqa: E402,F401,F403


def log(*a):
    """A progress line on stdout, flushed (the other scripts' progress; the benchmark itself logs its own)."""
    print(*a, flush=True)


if __name__ == "__main__":
    sys.exit(bench.main(default_out=str(ROOT / "benchmarks" / "kernel_h200.json")))
