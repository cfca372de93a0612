#!/usr/bin/env python
"""Launch settings of the TripPool kernel (rows per load step x warps per program) at three model shapes (GPU).

For each shape (bf16 q and k in tile order, 128-token tiles) and each setting: checks the features against the
default launch (max / min equal, means within fp32 rounding of a different summation order), then times one
launch for q and k (triton's do_bench). Writes JSON and prints a table; `trippool_triton`'s defaults come from it.

    python scripts/sweep_trippool.py --out benchmarks/sweep_trippool_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _bench import versions  # noqa: E402
from videosparse.veda.triton_kernels import trippool_triton  # noqa: E402

SHAPES = {"wan14b": (1, 40, 75600, 128), "wan1.3b": (1, 12, 32760, 128), "ltx": (1, 32, 6144, 64)}


def main(argv: list[str] | None = None) -> list[dict]:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--out", default="benchmarks/sweep_trippool_h200.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("sweep_trippool.py needs a CUDA GPU.")
    rows = []
    for name, (B, H, S, D) in SHAPES.items():
        q, k = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref = trippool_triton(q, k, 128)
        gb = 2 * q.numel() * q.element_size() / 1e9
        for chunk in args.chunks:
            for warps in args.warps:
                out = trippool_triton(q, k, 128, chunk=chunk, num_warps=warps)
                extremes_equal = all(torch.equal(a[..., D:], b[..., D:]) for a, b in zip(out, ref))
                mean_err = max(float((a[..., :D] - b[..., :D]).abs().max()) for a, b in zip(out, ref))
                ms = do_bench(lambda: trippool_triton(q, k, 128, chunk=chunk, num_warps=warps), warmup=10, rep=100)
                rows.append({"shape": name, "B_H_S_D": [B, H, S, D], "chunk": chunk, "warps": warps, "us": ms * 1e3,
                             "GBps": gb / ms * 1e3, "max_min_equal": extremes_equal, "mean_max_abs_diff": mean_err})
                print(f"{name:8s} chunk {chunk:3d} warps {warps}: {ms * 1e3:8.1f} us {gb / ms * 1e3:7.0f} GB/s "
                      f"max/min {'equal' if extremes_equal else 'DIFFER'}, mean diff {mean_err:.1e}")
    report = {"what": "TripPool kernel launch settings (q and k, bf16, 128-token tiles)", "gpu":
              torch.cuda.get_device_name(), "versions": versions(), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
