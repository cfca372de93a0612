#!/usr/bin/env python
"""Veda plan-building time next to the sparse kernel time (default: Wan 14B 720P, density 0.1).

Measures, on one GPU, side by side in one run (B=1, 40 heads x 75,600 tokens, D=128, bf16):
  * TripPool of q and k: the fused Triton kernel against the torch path (and checks them),
  * the estimator (per-head projections + fp32 tile logits) and the top-k plan,
  * the whole hot path `VedaMethod.plan` (TripPool + estimator + top-k), trained-like estimator and
    the untrained mean-pooled one,
  * the sparse kernel on the resulting plan through `block_sparse_attention(backend="auto")` when a
    fast backend serves the inputs, and dense SDPA (cuDNN) as a yardstick,
  * the teacher kernel (distillation only, not on the inference path) on a few heads, checked
    against the chunked torch teacher.

Writes JSON (shapes, density, GPU, versions, times in ms, ratios) and prints a short table.
Nothing here imports diffusers.

    PYTHONUNBUFFERED=1 python scripts/bench_veda_plan.py --out benchmarks/veda_plan_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _bench import bench as _bench, host_us, rel, require_cuda, versions  # noqa: E402
from videosparse import VedaConfig  # noqa: E402
from videosparse.kernels import block_sparse_attention, select_backend  # noqa: E402
from videosparse.layout import head_tiling  # noqa: E402
from videosparse.method import ModelInfo  # noqa: E402
import videosparse.plan as plan_module  # noqa: E402
from videosparse.kernels.triton_topk import topk_rows_triton  # noqa: E402
from videosparse.plan import row_budget_list, topk_plan  # noqa: E402
from videosparse.veda.estimator import VedaEstimator  # noqa: E402
from videosparse.veda.method import VedaMethod  # noqa: E402
from videosparse.veda.teacher import teacher_heat, teacher_heat_torch  # noqa: E402
from videosparse.veda.trippool import trippool_qk  # noqa: E402


def bench(fn, *, rep: int = 100) -> float:
    return _bench(fn, warmup=10, rep=rep)


@contextlib.contextmanager
def torch_path_topk():
    """`topk_plan` takes its torch path (as on CPU) inside this block."""
    saved = plan_module._fused_topk
    plan_module._fused_topk = lambda scores: False
    try:
        yield
    finally:
        plan_module._fused_topk = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--grid", type=int, nargs=3, default=[21, 45, 80])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--tile", type=int, nargs=3, default=[4, 4, 8])
    ap.add_argument("--teacher-heads", type=int, default=4, help="heads for the teacher timing/check")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--out", default="benchmarks/veda_plan_h200.json")
    args = ap.parse_args()
    require_cuda(__file__)

    torch.manual_seed(0)
    H, D, block = args.heads, args.dim, 128
    grid = tuple(args.grid)
    S = math.prod(grid)
    layout = head_tiling(grid, tuple(args.tile), H, block=block)
    N, Mv = layout.num_tiles, layout.num_video_tiles
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    report: dict = {
        "what": "Veda plan building (TripPool + estimator + top-k) vs sparse kernel",
        "shape": {"B": 1, "H": H, "S": S, "D": D, "grid": list(grid), "tile": args.tile, "block": block,
                  "dtype": "bf16", "num_tiles": N},
        "density_target": args.density,
        "inputs": "random normal q, k, v; estimator projections N(0, 0.02^2) (trained-like magnitude)",
        "gpu": torch.cuda.get_device_name(),
        "versions": versions(),
    }
    t: dict[str, float] = {}

    # ---------------------------------------------------------------- TripPool: check, then time
    qf, kf = trippool_qk(q, k, block, Mv)
    rq, rk = trippool_qk(q, k, block, Mv, backend="torch")
    report["trippool_rel_err_vs_torch"] = [rel(qf, rq), rel(kf, rk)]
    del rq, rk
    t["trippool_triton"] = bench(lambda: trippool_qk(q, k, block, Mv))
    t["trippool_torch"] = bench(lambda: trippool_qk(q, k, block, Mv, backend="torch"), rep=50)

    # ---------------------------------------------------------------- estimator + top-k
    info = ModelInfo("bench", 1, H, D, (1, 2, 2))
    est = VedaEstimator("bench", 1, H, D, block=block, tile_shapes=tuple(args.tile), init_std=0.02).cuda()
    est.requires_grad_(False)
    with torch.no_grad():
        logits = est(qf, kf, 0)
    t["estimator_logits"] = bench(lambda: est(qf, kf, 0))
    def topk():
        return topk_plan(logits, args.density, num_global_tiles=layout.num_global_tiles, block=block)

    fused = topk()
    t["topk_plan"] = bench(topk)                      # the fused Triton selection (one launch)
    host = {"fused": host_us(topk, calls=200)}
    with torch_path_topk():                           # the torch path: ~25 small kernels, fp16 select as Veda's
        t["topk_plan_torch_path"] = bench(lambda: topk_plan(logits, args.density, block=block,
                                                            num_global_tiles=layout.num_global_tiles,
                                                            select_dtype=torch.float16))
        host["torch_path"] = host_us(lambda: topk_plan(logits, args.density, block=block,
                                                       num_global_tiles=layout.num_global_tiles,
                                                       select_dtype=torch.float16), calls=200)
        same = topk()
    report["topk_host_us_per_call"] = host
    budget = torch.tensor(row_budget_list(args.density, Mv, Mv), device="cuda")
    width = int(budget.max()) if layout.num_global_tiles == 0 else N
    report["topk_kernel_us_by_warps"] = {
        w: 1e3 * bench(lambda: topk_rows_triton(logits, budget, width, layout.num_global_tiles, num_warps=w))
        for w in (1, 2, 4, 8)}
    report["topk_fused_equals_torch_path_fp32"] = bool(torch.equal(fused.kv_index, same.kv_index)
                                                       and torch.equal(fused.kv_count, same.kv_count))
    trained = VedaMethod(VedaConfig(density=args.density, estimator=est, tiling=tuple(args.tile)), info)
    untrained = VedaMethod(VedaConfig(density=args.density, tiling=tuple(args.tile)), info)
    plan = trained.plan(q, k, v, layout, 0)
    torch.cuda.synchronize()
    t["plan_total"] = bench(lambda: trained.plan(q, k, v, layout, 0))
    t["plan_total_untrained"] = bench(lambda: untrained.plan(q, k, v, layout, 0))
    report["plan_density"] = plan.density(N)
    report["kmax"] = plan.kv_index.shape[-1]

    # ---------------------------------------------------------------- sparse kernel
    report["kernel"] = None
    try:
        impl = select_backend(q, k, v, plan, "auto")
        if impl.name == "reference":
            report["kernel"] = {"backend": "reference", "skipped": "no fast backend serves these inputs"}
        else:
            block_sparse_attention(q, k, v, plan, validate=False)
            kern = bench(lambda: block_sparse_attention(q, k, v, plan, validate=False), rep=200)
            report["kernel"] = {"backend": impl.name, "ms": kern, "plan_over_kernel": t["plan_total"] / kern,
                                "plan_untrained_over_kernel": t["plan_total_untrained"] / kern,
                                "tflops_on_kept_tiles": 4 * S * S * D * H * report["plan_density"] / kern / 1e9}
    except Exception as err:  # report and keep the plan numbers
        report["kernel"] = {"error": f"{type(err).__name__}: {err}"[:500]}

    dense_ms = None
    if not args.skip_dense:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                dense_ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), rep=100)
            report["dense_sdpa"] = {"backend": "cudnn", "ms": dense_ms, "tflops": 4 * S * S * D * H / dense_ms / 1e9}
            report["plan_over_ideal_sparse"] = t["plan_total"] / (dense_ms * report["plan_density"])
        except Exception as err:
            report["dense_sdpa"] = {"error": f"{type(err).__name__}: {err}"[:300]}

    # ---------------------------------------------------------------- teacher (distillation only)
    th = min(args.teacher_heads, H)
    qs, ks = q[:, :th].contiguous(), k[:, :th].contiguous()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    heat = teacher_heat(qs, ks, block, num_tiles=Mv)
    torch.cuda.synchronize()
    report["teacher_first_call_ms"] = (time.perf_counter() - t0) * 1e3
    ref = teacher_heat_torch(qs, ks, block, num_tiles=Mv)
    report["teacher_check"] = {"heads": th, "rel_err_vs_torch": rel(heat, ref),
                               "max_abs_err": float((heat - ref).abs().max()), "max_heat": float(ref.max())}
    del ref
    t["teacher_triton"] = bench(lambda: teacher_heat(qs, ks, block, num_tiles=Mv), rep=20)
    report["teacher_heads"] = th
    report["teacher_tflops"] = 2 * 2 * S * S * D * th / t["teacher_triton"] / 1e9      # two QK passes
    report["times_ms"] = t

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    kern = report["kernel"] or {}
    print(f"\n{report['gpu']}  B=1 H={H} S={S} D={D} bf16  density {args.density} "
          f"(realised {report['plan_density']:.4f})")
    print(f"trippool triton {t['trippool_triton']:.3f} ms (torch {t['trippool_torch']:.3f}) | estimator "
          f"{t['estimator_logits']:.3f} | top-k {t['topk_plan']:.3f} (torch path {t['topk_plan_torch_path']:.3f}; "
          f"host {host['fused']:.0f} vs {host['torch_path']:.0f} us) | plan {t['plan_total']:.3f} "
          f"(untrained {t['plan_total_untrained']:.3f}) ms")
    print(f"kernel {kern.get('backend', kern.get('error', '-'))} {kern.get('ms', float('nan')):.2f} ms | "
          f"plan/kernel {kern.get('plan_over_kernel', float('nan')):.3f} | dense cuDNN "
          f"{dense_ms if dense_ms is None else round(dense_ms, 2)} ms")
    print(f"teacher ({th} heads) {t['teacher_triton']:.2f} ms, {report['teacher_tflops']:.0f} TFLOP/s, "
          f"rel err vs torch {report['teacher_check']['rel_err_vs_torch']:.2e}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
