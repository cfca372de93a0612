#!/usr/bin/env python
"""Sol plan-building time next to the sparse kernel time (default: Wan 14B 720P, density 0.15).

Measures, on one GPU, side by side in one run:
  * the fused Triton tile statistics (mean q, mean k, v sum) against the torch path (and checks them),
  * the routing z-scores (Gaussian fit + q̄·(kc - μ)), the threshold mask + packing (tight width: one
    host sync; static width: none), and the whole hot-path `SolMethod.plan` after calibration,
  * the one-off τ calibration (bisection) per (layer, shape),
  * the sparse kernel on the resulting plan (with the zero-order correction) through
    `block_sparse_attention(backend="auto")` when a fast backend serves the inputs; without the correction,
    interleaved, in the kernels' work order (per call and precomputed) and in the base order, and dense
    SDPA (cuDNN) as a yardstick; dense * density is the ideal sparse time.

Writes JSON (shapes, density, GPU, versions, times in ms, ratios) to --out and prints a short table.

    PYTHONUNBUFFERED=1 python scripts/bench_sol_plan.py --out benchmarks/sol_plan_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _bench import bench, rel, require_cuda, versions  # noqa: E402
from videosparse import SolConfig  # noqa: E402
from videosparse.kernels import block_sparse_attention, select_backend  # noqa: E402
from videosparse.layout import head_tiling  # noqa: E402
from videosparse.method import ModelInfo  # noqa: E402
from videosparse.sol.centroids import tile_centroids_torch, tile_means_torch, tile_stats  # noqa: E402
from videosparse.sol.method import SolMethod  # noqa: E402
from videosparse.sol.threshold import routing_zscores, sol_plan_from_zscores  # noqa: E402




def order_ab(q, k, v, plan, rounds: int = 5) -> dict:
    """The kernel with `plan`'s correction and without it (its work order computed per call: the balanced
    `plan.work_order`), the latter also with that order precomputed and with the base order (long rows first, then
    (b, h, m); the kernels' order before the balancing): interleaved rounds, so that the correction's cost is read
    under the same conditions, medians in ms, and TFLOP/s on kept tiles."""
    from dataclasses import replace
    from statistics import median

    from bench_kernel import time_interleaved
    from triton.testing import do_bench

    from videosparse.plan import device_programs, work_order

    plain = plan.without_correction()
    plans = {**({"with_correction_ms": plan} if plan.has_correction else {}), "without_correction_ms": plain,
             "precomputed_order_ms": replace(plain, order=work_order(plain.kv_count, device_programs(q.device))),
             "base_order_ms": replace(plain, order=work_order(plain.kv_count))}
    fns = {name: (lambda p=p: block_sparse_attention(q, k, v, p, validate=False)) for name, p in plans.items()}
    times = time_interleaved(fns, rounds, lambda fn: do_bench(fn, warmup=10, rep=100, return_mode="median"))
    out = {name: median(ts) for name, ts in times.items()}
    work = 4.0 * float(plan.kv_count.sum()) * plan.block_m * plan.block_n * q.shape[-1]
    out["tflops"] = {name.removesuffix("_ms"): work / ms / 1e9 for name, ms in out.items()}
    return out


def run_block(q, k, v, grid, block: int, density: float, tiling, dense_ms: float | None, skip_kernel: bool) -> dict:
    B, H, S, D = q.shape
    layout = head_tiling(grid, tiling, H, block=block)
    N, Mv = layout.num_tiles, layout.num_video_tiles
    scale = 1.0 / math.sqrt(D)
    res: dict = {"block": block, "tiling": list(tiling), "num_tiles": N}

    # correctness of the fused statistics against torch
    got = tile_stats(q, k, v, block)
    ref = (tile_means_torch(q, block), *tile_centroids_torch(k, v, block))
    res["stats_rel_err"] = [rel(a, b) for a, b in zip(got[:3], ref[:3])]
    res["stats_tile_len_equal"] = bool(torch.equal(got[3], ref[3]))
    del ref

    # one-off calibration (timed once; kernels already compiled by the call above)
    method = SolMethod(SolConfig(density=density, block=block, tiling=tuple(tiling)), ModelInfo("bench", 1, H, D, (1, 2, 2)))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    plan = method.plan(q, k, v, layout, 0)
    torch.cuda.synchronize()
    res["first_call_with_calibration_ms"] = (time.perf_counter() - t0) * 1e3
    cal = next(iter(method.calibrations().values()))
    res["tau"], res["calibrated_density"] = cal["tau"], cal["density"]
    res["plan_density"] = plan.density(N)
    counts = plan.kv_count.float()
    res["load_balance"] = float(counts.max() / counts.mean())
    res["kmax"] = plan.kv_index.shape[-1]
    tau = next(iter(method.layer_state(0).values()))[0]

    q_mean, k_mean = got[0], got[1]
    z = routing_zscores(q_mean[:, :, :Mv], k_mean[:, :, :Mv], scale, 1)
    # plans from torch statistics vs Triton statistics: same tiles up to near-ties
    z_ref = routing_zscores(tile_means_torch(q, block)[:, :, :Mv], tile_centroids_torch(k, v, block)[0][:, :, :Mv], scale, 1)
    res["mask_agreement_triton_vs_torch"] = float(((z > tau) == (z_ref > tau)).float().mean())
    del z_ref

    t = {}
    t["stats_triton"] = bench(lambda: tile_stats(q, k, v, block))
    t["stats_torch"] = bench(lambda: tile_stats(q, k, v, block, backend="torch"))
    t["zscores"] = bench(lambda: routing_zscores(q_mean[:, :, :Mv], k_mean[:, :, :Mv], scale, 1))
    t["mask_pack_tight"] = bench(lambda: sol_plan_from_zscores(z, tau, 0, block))
    t["mask_pack_static"] = bench(lambda: sol_plan_from_zscores(z, tau, 0, block, width=N))
    t["plan_total"] = bench(lambda: method.plan(q, k, v, layout, 0))
    method.static_width = True
    t["plan_total_static_width"] = bench(lambda: method.plan(q, k, v, layout, 0))
    method.static_width = False
    res["times_ms"] = t

    res["kernel"] = None
    if not skip_kernel:
        try:
            impl = select_backend(q, k, v, plan, "auto")
            if impl.name == "reference":
                res["kernel"] = {"backend": "reference", "skipped": "no fast backend serves these inputs"}
            else:
                timed = order_ab(q, k, v, plan)
                res["kernel"] = {"backend": impl.name, **timed,
                                 "plan_over_kernel": t["plan_total"] / timed["with_correction_ms"]}
        except Exception as err:  # report and keep the plan numbers
            res["kernel"] = {"error": f"{type(err).__name__}: {err}"[:500]}
    if dense_ms:
        ideal = dense_ms * res["plan_density"]
        res["ideal_sparse_ms"] = ideal
        res["plan_over_ideal_sparse"] = t["plan_total"] / ideal
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--grid", type=int, nargs=3, default=[21, 45, 80])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--density", type=float, default=0.15)
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--out", default="benchmarks/sol_plan_h200.json")
    args = ap.parse_args()
    require_cuda(__file__)

    torch.manual_seed(0)
    H, D = args.heads, args.dim
    S = math.prod(args.grid)
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    report = {
        "what": "Sol plan building (centroids, threshold, lists) vs sparse kernel",
        "shape": {"B": 1, "H": H, "S": S, "D": D, "grid": args.grid, "dtype": "bf16"},
        "density_target": args.density,
        "inputs": "random normal q, k, v",
        "gpu": torch.cuda.get_device_name(),
        "versions": versions(),
    }
    dense_ms = None
    if not args.skip_dense:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                dense_ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), rep=300)
            report["dense_sdpa"] = {"backend": "cudnn", "ms": dense_ms,
                                    "tflops": 4 * S * S * D * H / dense_ms / 1e9}
        except Exception as err:
            report["dense_sdpa"] = {"error": f"{type(err).__name__}: {err}"[:300]}
    tilings = {64: (4, 4, 4), 128: (4, 4, 8)}
    report["blocks"] = []
    for block in args.blocks:
        r = run_block(q, k, v, tuple(args.grid), block, args.density, tilings[block], dense_ms, args.skip_kernel)
        report["blocks"].append(r)
        torch.cuda.empty_cache()
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    print(f"\n{report['gpu']}  B=1 H={H} S={S} D={D} bf16  density {args.density}  dense cuDNN: "
          f"{dense_ms if dense_ms is None else round(dense_ms, 2)} ms")
    for r in report["blocks"]:
        t = r["times_ms"]
        kern = r["kernel"] or {}
        print(f"block {r['block']}: density {r['plan_density']:.4f} (tau {r['tau']:.3f}, balance {r['load_balance']:.2f})"
              f" | stats triton {t['stats_triton']:.3f} torch {t['stats_torch']:.3f} | z {t['zscores']:.3f}"
              f" | mask+pack {t['mask_pack_tight']:.3f} (static {t['mask_pack_static']:.3f})"
              f" | plan {t['plan_total']:.3f} (static {t['plan_total_static_width']:.3f}) ms"
              f" | kernel {kern.get('backend', kern.get('error', '-'))} {kern.get('with_correction_ms', float('nan')):.2f} ms"
              f" (no corr. {kern.get('without_correction_ms', float('nan')):.2f}, base order"
              f" {kern.get('base_order_ms', float('nan')):.2f})"
              f" | plan/kernel {kern.get('plan_over_kernel', float('nan')):.3f}"
              f" | plan/ideal {r.get('plan_over_ideal_sparse', float('nan')):.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
