"""Sweep of the Triton backward kernels' launch parameters (GPU): `_bwd_dq`, `_bwd_dkdv` (and with the correction
`_bwd_centroids`) timed alone per variant.

For each shape, one random plan at the given density (with the zero-order correction's centroids under
--correction) and one `prepare_backward`; then every variant of `launch_dq` (keys per step, warps, pipeline
stages), of `launch_dkdv` (keys per program, query rows per step, warps, stages) and of `centroid_gradients`
(centroids per program, rows per step, warps, stages) is launched, checked against the library default's output (the
same sums: equal up to rounding), and timed (do_bench median). TFLOP/s count each kernel's own products: 3 for
`_bwd_dq` (6 S^2 D B H density, and 6 S Nk D B H for its proxy terms), 4 for `_bwd_dkdv` (8 S^2 D B H density), 4
over every (row, centroid) pair for `_bwd_centroids`. Also times the whole `triton_attention_backward` against SDPA's
dense backward.

    python scripts/sweep_backward.py [--shapes "Wan1.3B 12x32760 d128" ...] [--density 0.1] [--correction] \
        [--out benchmarks/backward_launch_sweep_h200.json]

Writes JSON (every variant: ms, TFLOP/s, registers, spills, error vs the default) and prints, per shape and kernel,
the default and the fastest variant.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_backward import SHAPES  # noqa: E402

DQ_GRID = list(itertools.product([32, 64], [4, 8], [2, 3, 4]))                  # key_chunk, warps, stages
DKDV_GRID = list(itertools.product([64, 128], [32, 64], [4, 8], [2, 3, 4]))     # keys, rows, warps, stages
CENTROID_GRID = list(itertools.product([32, 64, 128], [32, 64], [4, 8], [2, 3]))  # centroids, rows, warps, stages


def sweep_shape(name: str, density: float, device, dtype, correction: bool = False) -> dict:
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from _bench import rel
    from bench_kernel import random_plan
    from videosparse.kernels import triton_backward as tb
    from videosparse.kernels.ops import run_op
    from videosparse.sol.centroids import tile_centroids

    B, H, S, D = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v, d_out = (torch.randn(B, H, S, D, device=device, dtype=dtype, generator=g) for _ in range(4))
    plan = random_plan(B, H, S, density, 128, device, seed=2)
    if correction:
        plan = plan.with_correction(*tile_centroids(k, v, 128))
    out, lse = run_op(q, k, v, plan, D ** -0.5, "auto")
    inp = tb.prepare_backward(q, k, v, out, lse, plan, D ** -0.5, d_out, None)
    Nk = -(-S // 128)
    kept = float(inp.kv_count.float().mean()) / Nk          # the plan's realised density
    work = S * S * D * B * H * kept
    proxy_work = S * Nk * D * B * H if correction else 0    # every row against every centroid

    def variant(kind, params):
        """(launch, outputs) of one variant; params None: the library's defaults."""
        if kind == "dq":
            dq = torch.empty(B, H, S, D, dtype=torch.float32, device=device)
            chunk, warps, stages = params or (None, None, None)
            return (lambda: tb.launch_dq(inp, dq, key_chunk=chunk, num_warps=warps, num_stages=stages)), (dq,)
        if kind == "centroids":
            blocks, rows, warps, stages = params or (None, None, None, None)
            grads = []
            return (lambda: grads.__setitem__(slice(None), tb.centroid_gradients(
                inp, centroids=blocks, rows=rows, num_warps=warps, num_stages=stages))), grads
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        keys, rows, warps, stages = params or (None, None, None, None)
        return (lambda: tb.launch_dkdv(inp, dk, dv, keys=keys, rows=rows, num_warps=warps, num_stages=stages)), \
            (dk, dv)

    rows = []
    kernels = [("dq", DQ_GRID, 6 * (work + proxy_work)), ("dkdv", DKDV_GRID, 8 * work)]
    if correction:
        kernels.append(("centroids", CENTROID_GRID, 8 * proxy_work))
    for kind, grid, flops in kernels:
        base_fn, base_out = variant(kind, None)
        default = base_fn()
        default_ms = do_bench(base_fn, warmup=5, rep=40, return_mode="median")
        rows.append({"shape": name, "kernel": kind, "params": "default", "ms": default_ms,
                     "tflops": flops / default_ms / 1e9, "regs": getattr(default, "n_regs", None),
                     "spills": getattr(default, "n_spills", None)})
        for params in grid:
            fn, got = variant(kind, params)
            row = {"shape": name, "kernel": kind, "params": list(params)}
            try:
                compiled = fn()
                torch.cuda.synchronize()
            except Exception as e:      # noqa: BLE001  (out of shared memory or registers: recorded, not timed)
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
                continue
            row["error_vs_default"] = max(rel(a, b) for a, b in zip(got, base_out))
            row["ms"] = do_bench(fn, warmup=5, rep=40, return_mode="median")
            row.update(tflops=flops / row["ms"] / 1e9, regs=getattr(compiled, "n_regs", None),
                       spills=getattr(compiled, "n_spills", None))
            rows.append(row)
    qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
    dense = F.scaled_dot_product_attention(qd, kd, vd)
    sdpa_ms = do_bench(lambda: torch.autograd.grad(dense, (qd, kd, vd), d_out, retain_graph=True), warmup=5, rep=40,
                       return_mode="median")
    whole_ms = do_bench(lambda: tb.triton_attention_backward(q, k, v, out, lse, plan, D ** -0.5, d_out, None),
                        warmup=5, rep=40, return_mode="median")
    return {"shape": name, "B": B, "H": H, "S": S, "D": D, "density": density, "kept_density": kept,
            "correction": correction,
            "sdpa_dense_backward_ms": sdpa_ms, "triton_backward_ms": whole_ms, "rows": rows}


# a variant computes the default's gradients in another order: fp32 sums differ by ~1e-6; past this it is wrong
VARIANT_TOL = 1e-3


def wrong_variants(results) -> list[str]:
    """The timed variants whose gradients differ from the default launch's by more than VARIANT_TOL (or are not
    finite): never the fastest in `render`, and they fail the run."""
    return [f"{shape['shape']} {r['kernel']} {r['params']}: error_vs_default={r['error_vs_default']}"
            for shape in results["shapes"] for r in shape["rows"]
            if "ms" in r and not r["error_vs_default"] <= VARIANT_TOL]


def render(results) -> str:
    lines = ["| shape | kernel | default ms (TFLOP/s) | fastest variant | its ms (TFLOP/s) | whole backward ms | "
             "SDPA dense backward ms |", "|---|---|---|---|---|---|---|"]
    for shape in results["shapes"]:
        for kind in dict.fromkeys(r["kernel"] for r in shape["rows"]):
            rows = [r for r in shape["rows"] if r["kernel"] == kind and "ms" in r
                    and (r["params"] == "default" or r["error_vs_default"] <= VARIANT_TOL)]
            default = next(r for r in rows if r["params"] == "default")
            best = min((r for r in rows if r["params"] != "default"), key=lambda r: r["ms"], default=None)
            label = shape["shape"] + (" +corr" if shape.get("correction") else "")
            fastest = "– | –" if best is None else f"{best['params']} | {best['ms']:.3f} ({best['tflops']:.0f})"
            lines.append(f"| {label} | {kind} | {default['ms']:.3f} ({default['tflops']:.0f}) | {fastest} | "
                         f"{shape['triton_backward_ms']:.3f} | {shape['sdpa_dense_backward_ms']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    """Exit code 1 when a variant's gradients disagree with the default's (`wrong_variants`), else 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--correction", action="store_true", help="plans with the zero-order correction's centroids")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "backward_launch_sweep_h200.json")
    args = parser.parse_args()

    import torch

    from _bench import require_cuda, versions
    from bench_kernel import gpu_state, log
    from videosparse.eval.report import save_report

    require_cuda(__file__)
    results = {"gpu": torch.cuda.get_device_name(), "versions": versions(), "dtype": "bfloat16",
               "dq_grid": "key_chunk, num_warps, num_stages", "dkdv_grid": "keys, rows, num_warps, num_stages",
               "gpu_state_start": gpu_state(), "shapes": []}
    for name in args.shapes:
        results["shapes"].append(sweep_shape(name, args.density, "cuda", torch.bfloat16, args.correction))
        log(render({"shapes": results["shapes"][-1:]}))
        save_report(results, str(args.out))
    results["gpu_state_end"] = gpu_state()
    save_report(results, str(args.out))
    log(render(results))
    for wrong in wrong_variants(results):
        log("wrong gradients (left out of the table):", wrong)
    return int(bool(wrong_variants(results)))


if __name__ == "__main__":
    sys.exit(main())
