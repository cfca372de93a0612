#!/usr/bin/env python
"""Launch settings of the tile-pooling kernels (rows per load step x warps per program) at three model shapes (GPU).

`--kernel trippool` (Veda's TripPool of q and k) or `tile_stats` (Sol's mean query, mean key and value sum of
q, k, v). For each shape (bf16 inputs in tile order, 128-token tiles) and each setting: checks the outputs
against the default launch (TripPool's max / min equal; means and sums within fp32 rounding of a different
summation order), then times one launch (triton's do_bench). Writes JSON and prints a table; the kernels'
defaults come from it.

    python scripts/sweep_trippool.py --out benchmarks/sweep_trippool_h200.json
    python scripts/sweep_trippool.py --kernel tile_stats --out benchmarks/sweep_tile_stats_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _bench import require_cuda, versions  # noqa: E402
from videosparse.sol.triton_centroids import tile_stats_triton  # noqa: E402
from videosparse.veda.triton_kernels import trippool_triton  # noqa: E402

SHAPES = {"wan14b": (1, 40, 75600, 128), "wan1.3b": (1, 12, 32760, 128), "ltx": (1, 32, 6144, 64)}


def _launcher(kernel: str, q, k, v):
    """fn(chunk, warps) -> the outputs to compare (a list of fp32 tensors) for one launch of `kernel`."""
    if kernel == "trippool":
        return lambda chunk=None, warps=1: list(trippool_triton(q, k, 128, chunk=chunk, num_warps=warps))
    return lambda chunk=None, warps=4: list(tile_stats_triton(q, k, v, 128, chunk=chunk, num_warps=warps)[:3])


def main(argv: list[str] | None = None) -> list[dict]:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=["trippool", "tile_stats"], default="trippool")
    ap.add_argument("--chunks", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--out", default="benchmarks/sweep_trippool_h200.json")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    rows = []
    for name, (B, H, S, D) in SHAPES.items():
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        run = _launcher(args.kernel, q, k, v)
        ref = run()
        gb = (2 if args.kernel == "trippool" else 3) * q.numel() * q.element_size() / 1e9
        for chunk in args.chunks:
            for warps in args.warps:
                out = run(chunk, warps)
                extremes_equal = (all(torch.equal(a[..., D:], b[..., D:]) for a, b in zip(out, ref))
                                  if args.kernel == "trippool" else None)      # TripPool's [max | min] part
                sums = [(a[..., :D], b[..., :D]) for a, b in zip(out, ref)]
                sum_err = max(float(((a - b).abs().max() / b.abs().max().clamp_min(1e-30))) for a, b in sums)
                ms = do_bench(lambda: run(chunk, warps), warmup=10, rep=100)
                rows.append({"shape": name, "B_H_S_D": [B, H, S, D], "chunk": chunk, "warps": warps, "us": ms * 1e3,
                             "GBps": gb / ms * 1e3, "max_min_equal": extremes_equal, "sum_rel_diff": sum_err})
                print(f"{name:8s} chunk {chunk:3d} warps {warps}: {ms * 1e3:8.1f} us {gb / ms * 1e3:7.0f} GB/s "
                      f"max/min equal {extremes_equal}, means/sums rel diff {sum_err:.1e}")
    report = {"what": f"{args.kernel} kernel launch settings (bf16, 128-token tiles)", "gpu":
              torch.cuda.get_device_name(), "versions": versions(), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
