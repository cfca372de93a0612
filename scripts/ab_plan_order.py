"""A/B (GPU): the kernels with the plan's own work order vs a per-call sort of kv_count, same plan, same kernel.

`topk_plan` and `dense_plan` attach `Plan.order` (longest-first rows from their host-side budgets), so the
kernels skip their `torch.sort` of kv_count. This times `block_sparse_attention` on a random top-k plan with
and without that order, in interleaved rounds (median), and checks the outputs are equal:

    python scripts/ab_plan_order.py [--rounds 5] [--out benchmarks/ab_plan_order_h200.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# (heads, tokens, head dim): densities
CASES = {(12, 32768, 128): (1.0, 0.1, 0.05), (12, 32768, 64): (1.0, 0.1, 0.05), (40, 75600, 128): (0.1,)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="ab_plan_order.json")
    args = ap.parse_args(argv)

    import torch

    from bench_kernel import interleaved_ab, random_plan
    from videosparse.kernels import block_sparse_attention

    rows = []
    for (H, S, D), densities in CASES.items():
        q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for density in densities:
            plan = random_plan(1, H, S, density, 128, "cuda")
            fns = {"order": lambda p=plan: block_sparse_attention(q, k, v, p, validate=False),
                   "sort": lambda p=replace(plan, order=None): block_sparse_attention(q, k, v, p, validate=False)}
            kept = plan.density(math.ceil(S / 128))
            tf, times, diff = interleaved_ab(fns, 4.0 * S * S * D * H * kept, args.rounds)
            rows.append(dict(shape=f"{H}x{S} d{D}", density=kept, tflops=tf, ms_rounds=times, rel_diff=diff))
            print(f"{H}x{S} d{D} density {kept:.3f}: order {tf['order']:.0f} sort {tf['sort']:.0f} TFLOP/s "
                  f"({tf['order'] / tf['sort'] - 1:+.1%}), outputs differ by {diff:.1e}", flush=True)
    Path(args.out).write_text(json.dumps(dict(rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
