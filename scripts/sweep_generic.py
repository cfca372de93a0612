"""Launch-option sweep of the generic Triton kernel (the Ampere/Ada path, GPU): warps x stages x keys per softmax
step, per head dim and tile shape; interleaved rounds, median TFLOP/s; the winner and the default per case.

No Ampere or Ada GPU is at hand; on a Hopper GPU Triton can be told to emit Ampere code (mma.sync and cp.async
instead of wgmma and TMA; ptxas still targets the Hopper chip), a proxy for the defaults of `triton_generic`:

    TRITON_OVERRIDE_ARCH=sm80 python scripts/sweep_generic.py --out benchmarks/sweep_generic_sm80_on_h200.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

TILES = ["128x128", "128x64", "64x128", "64x64", "32x32"]


def random_tile_plan(B, H, S, density, block_m, block_n, device, seed=0):
    """Plan with `density` of the key tiles per query tile kept at random (at least one), tiles block_m x block_n."""
    import torch

    from videosparse.plan import dense_plan, plan_from_mask

    if density >= 1.0:
        return dense_plan(B, H, S, block_m, block_n, device=device)
    Mq, Nk = math.ceil(S / block_m), math.ceil(S / block_n)
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(B, H, Mq, Nk, device=device, generator=g)
    keep = max(1, round(density * Nk))
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.topk(keep, dim=-1).indices, True)
    return plan_from_mask(mask, block_m, block_n)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dims", type=int, nargs="*", default=[128, 64])
    ap.add_argument("--tiles", nargs="*", default=TILES, help="tile shapes BMxBN")
    ap.add_argument("--densities", type=float, nargs="*", default=[0.1])
    ap.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="*", default=[2, 3])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="sweep_generic.json")
    args = ap.parse_args(argv)

    import torch
    from triton.testing import do_bench

    from bench_kernel import time_interleaved
    from videosparse.kernels import triton_generic as tg

    S, H = args.seq_len, args.heads
    rows = []
    for D, tile, density in itertools.product(args.head_dims, args.tiles, args.densities):
        bm, bn = map(int, tile.split("x"))
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        plan = random_tile_plan(1, H, S, density, bm, bn, "cuda")
        kept = plan.density(math.ceil(S / bn))
        chunks = sorted({bn, 64} if bn > 64 else {bn}, reverse=True)
        fns = {(w, s, c): (lambda w=w, s=s, c=c: tg.generic_attention(q, k, v, plan, D ** -0.5, num_warps=w,
                                                                      num_stages=s, key_chunk=c))
               for w, s, c in itertools.product(args.warps, args.stages, chunks)}
        ref = fns[next(iter(fns))]().float()
        bad = {key for key, fn in fns.items() if float((fn().float() - ref).norm() / ref.norm()) > 1e-2}
        if bad:
            raise RuntimeError(f"D={D} {tile}: outputs of {sorted(bad)} differ from {next(iter(fns))}")
        times = time_interleaved(fns, args.rounds, lambda fn: do_bench(fn, warmup=5, rep=40, return_mode="median"))
        flops = 4.0 * S * S * D * H * kept
        tf = {key: flops / median(t) / 1e9 for key, t in times.items()}
        warps = tg.default_num_warps(bm, bn, D)
        default = (warps, tg.default_num_stages(D), tg.default_key_chunk(bm, bn, warps))
        best = max(tf, key=tf.get)
        rows.append(dict(head_dim=D, block_m=bm, block_n=bn, density=kept, best=dict(zip(("warps", "stages",
                         "key_chunk"), best)), best_tflops=tf[best], default=dict(zip(("warps", "stages", "key_chunk"),
                         default)), default_tflops=tf.get(default),
                         configs=[dict(warps=w, stages=s, key_chunk=c, tflops=t, ms_rounds=times[(w, s, c)])
                                  for (w, s, c), t in tf.items()]))
        dflt = f"{tf[default]:.0f}" if default in tf else "n/a"
        print(f"d{D} {tile} density {kept:.3f}: best warps/stages/chunk {best} {tf[best]:.0f} TFLOP/s, default "
              f"{default} {dflt}", flush=True)
    Path(args.out).write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), override_arch=os.environ.get("TRITON_OVERRIDE_ARCH"), seq_len=S,
        heads=H, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
