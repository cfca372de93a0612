#!/usr/bin/env python
"""The Gluon kernel with a key-padding limit (`Plan.valid_keys`) against the same plan without one, at the
HunyuanVideo 720P shape (1 x 24 x 119,056, head dim 128, bf16): every key valid (the limit costs a load per work
item and the masked-last-tile path) and the last 200 keys padded; interleaved rounds, do_bench medians (GPU).

    python scripts/ab_valid_keys.py --out benchmarks/ab_valid_keys_h200.json
"""

from __future__ import annotations

import statistics

import argparse
import functools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from bench_kernel import time_interleaved  # noqa: E402
from helpers import random_plan  # noqa: E402   (the random tile masks these runs were made with)

from videosparse.kernels import block_sparse_attention  # noqa: E402
from videosparse.plan import dense_plan, plan_from_mask  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--seq", type=int, default=119056)
    ap.add_argument("--global-tiles", type=int, default=0, help="last key tiles kept by every row, their rows dense")
    ap.add_argument("--out", default="benchmarks/ab_valid_keys_h200.json")
    args = ap.parse_args()
    from _bench import require_cuda

    require_cuda(__file__)
    B, H, S, D = 1, args.heads, args.seq, 128
    rows = []
    for density in (1.0, 0.1, 0.05):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        plan = (dense_plan(B, H, S, device="cuda") if density == 1
                else random_plan(B, H, S, 128, 128, density, seed=1, device="cuda"))
        if args.global_tiles and density < 1:      # text tiles: every row keeps them, their rows are dense
            mask = plan.to_dense_mask(-(-S // 128))
            mask[..., -args.global_tiles:] = True
            mask[:, :, -args.global_tiles:] = True
            plan = plan_from_mask(mask)
        variants = {"plain": plan,
                    "valid_all": plan.with_valid_keys(torch.tensor([S], dtype=torch.int32, device="cuda")),
                    "valid_pad200": plan.with_valid_keys(torch.tensor([S - 200], dtype=torch.int32, device="cuda"))}
        calls = {name: functools.partial(block_sparse_attention, q, k, v, p, validate=False)
                 for name, p in variants.items()}
        times = time_interleaved(calls, args.rounds, lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200,
                                                                                      return_mode="median"))
        median = {name: statistics.median(t) for name, t in times.items()}
        equal = bool(torch.equal(block_sparse_attention(q, k, v, plan), block_sparse_attention(q, k, v,
                                                                                                 variants["valid_all"])))
        rows.append(dict(density=density, ms=median, valid_all_bitwise_equal=equal))
        print(density, {n: round(m, 3) for n, m in median.items()}, "bitwise equal:", equal, flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(what=__doc__.splitlines()[0], shape=[B, H, S, D], global_tiles=args.global_tiles,
                       rounds=args.rounds, rows=rows,
                       device=torch.cuda.get_device_name()), f, indent=1)


if __name__ == "__main__":
    main()
