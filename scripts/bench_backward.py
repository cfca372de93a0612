"""Benchmark of the block-sparse backward (GPU): the Triton backward kernels against dense attention's backward.

Checks first, at a small shape, that the gradients through the kernels' forward (Triton backward) match the torch
reference's backward in fp64; then times, side by side in interleaved rounds, the backward alone (autograd.grad of
one forward kept with retain_graph) of SDPA dense (cuDNN / FlashAttention, as torch picks) and of ours at each
density, with and without the zero-order correction, and the torch reference's row loop once on the smallest shape.
TFLOP/s counts kept tiles: 10 * S^2 * D * B * H * density / time (FlashAttention's count: 2.5x the forward's).

    python scripts/bench_backward.py [--shapes "Wan1.3B 12x32760 d128" ...] [--out benchmarks/backward_h200.json]

Writes JSON (shapes, densities, GPU, versions, every timing) and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SHAPES = {  # name: (B, H, S, D)
    "12x8192 d128": (1, 12, 8192, 128),
    "Wan1.3B 12x32760 d128": (1, 12, 32760, 128),
    "CogVideoX 48x17550 d64": (1, 48, 17550, 64),
}
DENSITIES = [1.0, 0.25, 0.1, 0.05]
# the check's gradients are bf16 against fp64: ~4e-3 relative when right; past this the timings are not of our backward
CHECK_TOL = 2e-2


def backward_flops(B, H, S, D, density):
    return 10 * S * S * D * B * H * density


def check(device, dtype):
    """Relative errors of dq, dk, dv through backend="auto" (the Triton backward) against the fp64 reference's
    backward, with correction and a key limit, at 2 x 4 x 4,100 x 128, density 0.3."""
    import torch

    from _bench import rel
    from bench_kernel import random_plan
    from videosparse.kernels import block_sparse_attention
    from videosparse.kernels.reference import reference_attention_backward
    from videosparse.sol.centroids import tile_centroids_torch

    B, H, S, D = 2, 4, 4100, 128
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(B, H, S, D, generator=g) for _ in range(3)]
    w = torch.randn(B, H, S, D, generator=g)
    plan = random_plan(B, H, S, 0.3, 128, "cpu").with_valid_keys(torch.tensor([S, S - 700], dtype=torch.int32))
    q, k, v = (t.to(device, dtype, copy=True).requires_grad_() for t in base)
    p = plan.to(device).with_correction(*tile_centroids_torch(k, v, 128))
    block_sparse_attention(q, k, v, p).float().mul(w.to(device)).sum().backward()
    q64, k64, v64 = (t.double().requires_grad_() for t in base)
    p64 = plan.with_correction(*tile_centroids_torch(k64, v64, 128))
    dq, dk, dv, dkm, dvs = reference_attention_backward(q64, k64, v64, p64, D ** -0.5, w.double(), None)
    torch.autograd.backward([p64.k_mean, p64.v_sum], [dkm, dvs])
    want = [dq, dk + k64.grad, dv + v64.grad]
    return {name: rel(got.cpu(), ref.detach()) for name, got, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad),
                                                                             want)}


def bench_shape(name, args, device, dtype):
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from bench_kernel import plan_density, random_plan, time_interleaved
    from videosparse.kernels import block_sparse_attention, select_backend
    from videosparse.sol.centroids import tile_centroids

    B, H, S, D = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(B, H, S, D, device=device, dtype=dtype, generator=g)

    def backward_of(out):
        return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    fns = {"sdpa dense": backward_of(F.scaled_dot_product_attention(q, k, v))}
    densities, backend = {}, None
    for density in args.densities:
        plan = random_plan(B, H, S, density, 128, device, seed=2)
        backend = select_backend(q, k, v, plan).name
        for correction in (False, True):
            p = plan.with_correction(*tile_centroids(k, v, 128)) if correction else plan
            label = f"ours {density:g}" + (" +corr" if correction else "")
            fns[label] = backward_of(block_sparse_attention(q, k, v, p, validate=False))
            densities[label] = plan_density(plan, S)          # kept tiles as planned (the diagonal forced)
    if args.reference and name == args.shapes[0]:
        ref_plan = random_plan(B, H, S, 0.1, 128, device, seed=2)
        fns["reference loop 0.1"] = backward_of(block_sparse_attention(q, k, v, ref_plan, backend="reference"))
        densities["reference loop 0.1"] = plan_density(ref_plan, S)
    times = time_interleaved(fns, args.rounds, lambda fn: do_bench(fn, warmup=5, rep=40, return_mode="median"))
    dense_ms = median(times["sdpa dense"])
    rows = []
    for label, ts in times.items():
        density = densities.get(label, 1.0)
        ms = median(ts)
        rows.append({"shape": name, "impl": label, "density": density, "ms": ms, "ms_rounds": ts,
                     "tflops": backward_flops(B, H, S, D, density) / ms / 1e9, "speedup_vs_dense": dense_ms / ms})
    return {"shape": name, "B": B, "H": H, "S": S, "D": D, "forward_backend": backend, "rows": rows}


def render(results) -> str:
    lines = ["| shape | backward | density | ms | TFLOP/s (kept tiles) | vs SDPA dense backward |",
             "|---|---|---|---|---|---|"]
    for shape in results["shapes"]:
        for r in shape["rows"]:
            lines.append(f"| {r['shape']} | {r['impl']} | {r['density']:g} | {r['ms']:.2f} | {r['tflops']:.0f} | "
                         f"{r['speedup_vs_dense']:.2f}x |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--densities", nargs="+", type=float, default=DENSITIES)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median reported)")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip timing the torch reference's row loop on the first shape")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "backward_h200.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be >= 1.")
    if bad := [d for d in args.densities if not 0.0 < d <= 1.0]:
        parser.error(f"--densities {bad} must lie in (0, 1].")
    return args


def main(argv=None) -> int:
    """Exit code: 1 when the gradient check fails (nothing is timed then), else 0."""
    args = parse_args(argv)

    import torch

    from _bench import require_cuda, versions
    from bench_kernel import gpu_state, log, write_json

    require_cuda(__file__)
    device, dtype = "cuda", torch.bfloat16
    results = {"gpu": torch.cuda.get_device_name(), "versions": versions(), "dtype": "bfloat16",
               "gpu_state_start": gpu_state(), "check": check(device, dtype), "check_tol": CHECK_TOL, "shapes": []}
    log("check", results["check"])
    if not all(err <= CHECK_TOL for err in results["check"].values()):       # NaN fails too
        write_json(args.out, results)
        log(f"gradient check failed (tolerance {CHECK_TOL}): nothing timed")
        return 1
    for name in args.shapes:
        results["shapes"].append(bench_shape(name, args, device, dtype))
        write_json(args.out, results)                     # atomically, after every shape
        log(render({"shapes": results["shapes"][-1:]}))
    results["gpu_state_end"] = gpu_state()
    write_json(args.out, results)
    log(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
