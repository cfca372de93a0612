#!/usr/bin/env python
"""A/B (GPU) of the kernels' work order: the same plan and kernel, the plan's rows taken in different orders.

Orders (int32 permutations of the B*H*Mq plan rows):

* ``exact``: longest first by exact kv_count, stable (the kernels' first order);
* ``work_order``: `plan.work_order` for the device's persistent grid (the current order): ``base`` with each wave
  of as many entries as programs dealt so that the programs' work stays even;
* ``base``: rows over twice the mean length first, then ``identity`` (the order before, work_order's base);
* ``long_then_heads``: the same long rows first, then ``head``;
* ``class``: longest first by power-of-two class of kv_count, stable (the order before ``base``);
* ``head``: heads by their total kv_count, longest first, the rows of a head in query-tile order;
* ``identity``: (b, h, m) order.

Plans at 12 x 32,768 (head dim 128 and 64): random top-k plans (`bench_kernel.random_plan`, floor/ceil budgets
per row) at density 0.1 and 0.05, the same with 2 global tiles (text-like rows that list every tile), and plans
whose rows have uneven counts (log-normal per row; per-head densities 0.03-0.4). Interleaved rounds, medians;
outputs of every order are checked against the first::

    python scripts/ab_work_order.py [--rounds 7] [--backend hopper] [--orders work_order base] [--out ...json]
    python scripts/ab_work_order.py --cost       # time per call of computing each order, and of the balancing
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def exact_order(kv_count):
    """int32: rows longest first by exact kv_count, stable."""
    import torch

    return torch.sort(kv_count.reshape(-1), descending=True, stable=True).indices.to(torch.int32)


def head_order(kv_count):
    """int32: heads (b, h) by total kv_count, longest first, stable; a head's rows in query-tile order."""
    import torch

    BH, M = kv_count.shape[0] * kv_count.shape[1], kv_count.shape[2]
    heads = torch.sort(kv_count.reshape(BH, M).sum(1), descending=True, stable=True).indices
    return (heads[:, None] * M + torch.arange(M, device=kv_count.device)).reshape(-1).to(torch.int32)


def class_order(kv_count):
    """int32: rows longest first by power-of-two class of kv_count (bit length), stable; empty rows last (the
    kernels' order from commit f03b67c to the head-major `plan.work_order`)."""
    import torch

    return torch.sort(torch.frexp(kv_count.reshape(-1).float()).exponent, descending=True,
                      stable=True).indices.to(torch.int32)


def long_then_heads_order(kv_count):
    """int32: `plan.work_order` of the rows taken in `head_order` (the long rows first, then heads sorted by total;
    "hybrid" in benchmarks/order_ab_4_h200.json)."""
    from videosparse.plan import work_order

    base = head_order(kv_count).long()
    return base[work_order(kv_count.reshape(-1)[base]).long()].int()


def identity_order(kv_count):
    """int32: (b, h, m) order."""
    import torch

    return torch.arange(kv_count.numel(), dtype=torch.int32, device=kv_count.device)


def _work_order(kv_count):
    """int32: `plan.work_order` for the device's persistent grid (what the kernels run)."""
    from videosparse.plan import device_programs, work_order

    return work_order(kv_count, device_programs(kv_count.device))


def base_order(kv_count):
    """int32: `plan.work_order`'s base order (long rows first, then (b, h, m), empty rows last)."""
    from videosparse.plan import work_order

    return work_order(kv_count)


# the orders compared ("exact" first: the baseline of the A/B)
ORDER_FUNCTIONS = {"exact": exact_order, "work_order": _work_order, "base": base_order, "class": class_order,
                   "long_then_heads": long_then_heads_order, "head": head_order, "identity": identity_order}


def orders(kv_count, names=tuple(ORDER_FUNCTIONS)):
    """{name: int32 order} of the orders `names`."""
    return {name: ORDER_FUNCTIONS[name](kv_count) for name in dict.fromkeys(names)}


def counts_plan(counts, generator):
    """Plan with the given kv_count (int [B, H, M]): each row lists that many distinct random key tiles, sorted."""
    import torch

    from videosparse.plan import Plan

    M = counts.shape[-1]
    kmax = int(counts.max())
    scores = torch.rand(*counts.shape, M, device=counts.device, generator=generator)
    idx = scores.topk(kmax, dim=-1).indices
    keep = torch.arange(kmax, device=counts.device) < counts[..., None]   # topk is in random column order
    idx = torch.where(keep, idx, M).sort(-1).values
    idx = torch.where(idx == M, 0, idx)
    return Plan(idx.to(torch.int32).contiguous(), counts.to(torch.int32).contiguous(), 128, 128)


def plans(H, S, D, device):
    """{name: (plan, tokens)}: the plans timed at H heads of S video tokens."""
    import torch

    from bench_kernel import random_plan
    from videosparse.plan import topk_plan

    M = math.ceil(S / 128)
    g = torch.Generator(device=device).manual_seed(5)
    out = {"topk 0.1": (random_plan(1, H, S, 0.1, 128, device), S)}
    if D == 64:
        return out
    out["topk 0.05"] = (random_plan(1, H, S, 0.05, 128, device), S)
    out["topk 0.1 + 2 global tiles"] = (topk_plan(torch.rand(1, H, M, M, device=device, generator=g), 0.1,
                                                  num_global_tiles=2), S + 2 * 128)
    lognormal = torch.exp(torch.randn(1, H, M, device=device, generator=g) * 0.7 + math.log(20)).round().clamp(1, M)
    out["log-normal rows (mean ~26 tiles)"] = (counts_plan(lognormal.long(), g), S)
    density = torch.rand(H, device=device, generator=g) * 0.37 + 0.03
    per_head = (density[None, :, None] * M + torch.randn(1, H, M, device=device, generator=g)).round().clamp(1, M)
    out["per-head density 0.03-0.4"] = (counts_plan(per_head.long(), g), S)
    return out


def order_cost():
    """{rows: {what: us}}: time per call on the GPU of computing each order from kv_count (launch-bound at the
    smaller sizes), and of the balancing kernels alone (`kernels.triton_work_order.balanced_order`, given the base
    order and the costs) at 1, 2, 4 and 8 warps for its sequential kernel."""
    import torch
    from triton.testing import do_bench

    from videosparse.kernels.triton_work_order import balanced_order
    from videosparse.plan import ROW_FIXED_COST, device_programs, work_order

    programs = device_programs("cuda")
    out = {}
    for shape in ((1, 12, 256), (1, 40, 591), (2, 24, 929)):
        kv = torch.randint(20, 30, shape, device="cuda", dtype=torch.int32)
        row = {name: do_bench(lambda fn=fn: fn(kv), warmup=50, rep=200) * 1e3 for name, fn in ORDER_FUNCTIONS.items()}
        base, cost = work_order(kv), kv.reshape(-1).long() + ROW_FIXED_COST
        want = work_order(kv.cpu(), programs).cuda()
        for warps in (1, 2, 4, 8):
            if not torch.equal(balanced_order(base, cost, programs, num_warps=warps), want):
                raise RuntimeError(f"{shape}: the balancing kernel at {warps} warps differs from the torch path")
            row[f"balancing kernels, {warps} warps"] = do_bench(
                lambda w=warps: balanced_order(base, cost, programs, num_warps=w), warmup=50, rep=200) * 1e3
        out["x".join(map(str, shape))] = row
        print(shape, {k: f"{v:.1f} us" for k, v in row.items()})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="ab_work_order.json")
    ap.add_argument("--backend", default="auto", help="kernel backend timed (default: auto, the Gluon kernel on sm_90)")
    ap.add_argument("--orders", nargs="+", default=list(ORDER_FUNCTIONS), choices=list(ORDER_FUNCTIONS),
                    help="orders timed ('exact' always: the baseline)")
    ap.add_argument("--cost", action="store_true", help="only time computing each order (us per call), no kernels")
    args = ap.parse_args(argv)

    import torch
    from triton.testing import do_bench

    from bench_kernel import time_interleaved
    from videosparse.kernels import block_sparse_attention

    if args.cost:
        costs = order_cost()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        Path(args.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), programs=sms, us_per_call=costs),
                                             indent=1))
        return costs
    fns, work = {}, {}
    for H, S, D in ((12, 32768, 128), (12, 32768, 64)):
        for name, (plan, tokens) in plans(H, S, D, "cuda").items():
            q, k, v = (torch.randn(1, H, tokens, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            ref = None
            for order_name, order in orders(plan.kv_count, ["exact"] + args.orders).items():
                p = replace(plan, order=order)
                out = block_sparse_attention(q, k, v, p, backend=args.backend).float()
                ref = out if ref is None else ref
                diff = float((out - ref).norm() / ref.norm())
                if diff > 1e-2:
                    raise RuntimeError(f"{name}: order {order_name} changes the output by {diff:.2e}")
                key = f"{H}x{S} d{D} | {name} | {order_name}"
                fns[key] = lambda p=p, q=q, k=k, v=v: block_sparse_attention(q, k, v, p, backend=args.backend,
                                                                                validate=False)
                work[key] = 4.0 * int(plan.kv_count.sum()) * 128 * 128 * D
    times = time_interleaved(fns, args.rounds, lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median"))
    results = {}
    for key, ts in times.items():
        ms = median(ts)
        exact = median(times[key.rsplit(" | ", 1)[0] + " | exact"])
        results[key] = dict(ms=ms, tflops=work[key] / ms / 1e9, vs_exact=exact / ms - 1,
                            ms_rounds=[round(x, 4) for x in ts])
        print(f"{key:60s} {ms:8.3f} ms {work[key] / ms / 1e9:6.0f} TFLOP/s  vs exact {exact / ms - 1:+6.1%}")
    Path(args.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rounds=args.rounds,
                                              backend=args.backend, results=results), indent=1))
    return results


if __name__ == "__main__":
    main()
