"""Where one block_sparse_attention call's GPU time goes (GPU): the Gluon kernel, the tail-split merge and
whatever runs before them, per kernel name from torch.profiler, split tail off and on.

    python scripts/profile_kernel_call.py [--out benchmarks/profile_kernel_call_h200.json]

Shapes 12 x 32,768 at head dim 128 and 64, random top-k plans at density 0.1 and 0.05 (bf16). Prints one
JSON line per case: do_bench median (ms), mean device time per kernel name (us), and the gap between the
kernel's end and the merge's start (us).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20, help="profiled calls per case")
    ap.add_argument("--out", default="profile_kernel_call.json")
    args = ap.parse_args(argv)

    import torch
    from triton.testing import do_bench

    from bench_kernel import random_plan
    from videosparse.kernels.gluon_hopper import gluon_attention

    rows = []
    for D in (128, 64):
        q, k, v = (torch.randn(1, 12, 32768, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for density in (0.1, 0.05):
            plan = random_plan(1, 12, 32768, density, 128, "cuda")
            for split in (False, True):
                def call(p=plan, split=split):
                    return gluon_attention(q, k, v, p, D ** -0.5, split_tail=split)

                call()
                torch.cuda.synchronize()
                ms = do_bench(call, warmup=20, rep=200, return_mode="median")
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.calls):
                        call()
                    torch.cuda.synchronize()
                events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                                key=lambda e: e.time_range.start)
                total, count = defaultdict(float), defaultdict(int)
                for e in events:
                    total[e.name[:40]] += e.device_time
                    count[e.name[:40]] += 1
                gaps = [b.time_range.start - a.time_range.end for a, b in zip(events, events[1:])
                        if a.name.startswith("_gluon_fwd") and b.name.startswith("_combine")]
                row = dict(D=D, density=density, split=split, ms=ms,
                           kernels_us={n: round(total[n] / count[n], 1) for n in total},
                           merge_gap_us=sum(gaps) / len(gaps) if gaps else None)
                rows.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(dict(rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
