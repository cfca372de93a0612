"""Does Sol's online skip pay in the Hopper kernel? (GPU; kernel issue, item 5.)

Online skip drops a listed key tile whose scores all lie more than a gap below the running max of its
rows (no exp, no P.V). In Triton 3.6 the run-time `if` this needs turns warp specialization off, so
the question is whether the work it saves beats what warp specialization gives. One run times, on
the same plan (random top-k, key tile 0 listed first in every row):

* `ws`            the default kernel (warp-specialized, no skip)
* `no_ws`         warp specialization off, no skip (the price of the `if` alone is the next row)
* `no_ws_skip`    warp specialization off, online skip with `--gap` (natural-log units)
* `no_ws_w8`, `no_ws_w8_skip`  the same two with 8 warps (two consumer warpgroups; without warp
                  specialization that is the usual Hopper setting)

on random inputs (nothing falls below the gap) and on planted inputs where key tile 0 scores highest
and a share `cold` of the other tiles sits 20 units lower (they are skipped), the rest 1 unit lower.
TFLOP/s counts the listed tiles (4 * S^2 * D * H * density / time), skipped or not.

    python scripts/bench_online_skip.py [--out benchmarks/online_skip_h200.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

COLD_SHARES = (0.0, 0.5, 0.9)


def plan_with_tile0(B, H, S, density, block, device, seed=0):
    """Random top-k plan whose rows all list key tile 0 (the first one the kernel visits)."""
    import torch

    from videosparse.plan import dense_plan, topk_plan

    if density >= 1.0:
        return dense_plan(B, H, S, block, block, device=device)
    M = -(-S // block)
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(B, H, M, M, device=device, generator=g)
    scores[..., 0] = 2.0
    return topk_plan(scores, density, block=block)


def planted_inputs(B, H, S, D, block, cold, device, seed=0):
    """bf16 q, k, v: scale*q.k is 16 on key tile 0, 16-20 on a share `cold` of the other tiles, 15 elsewhere."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    u = torch.randn(D, device=device, generator=g)
    u = u / u.norm()
    a = 4.0 * D ** 0.25
    n = -(-S // block)
    offsets = torch.where(torch.rand(n, device=device, generator=g) < cold, -20.0, -1.0)
    offsets[0] = 0.0
    coef = a * (1.0 + offsets / 16.0)
    q = a * u + 0.02 * torch.randn(B, H, S, D, device=device, generator=g)
    k = coef.repeat_interleave(block)[:S, None] * u + 0.02 * torch.randn(B, H, S, D, device=device, generator=g)
    v = torch.randn(B, H, S, D, device=device, generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), offsets


def main(argv=None) -> int:
    import torch

    from _bench import bench, rel, versions
    from bench_kernel import plan_density
    from videosparse.kernels.triton_hopper import hopper_attention

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "online_skip_h200.json"))
    p.add_argument("--gap", type=float, default=8.0)
    args = p.parse_args(argv)
    dev, B, H, block = "cuda", 1, 12, 128
    rows = []
    for S, D in ((32768, 128), (32768, 64)):
        flops = 4.0 * S * S * D * B * H
        for density in (1.0, 0.1):
            plan = plan_with_tile0(B, H, S, density, block, dev)
            dens = plan_density(plan, S)
            for data in ["random"] + [f"planted cold={c}" for c in COLD_SHARES]:
                if data == "random":
                    g = torch.Generator(device=dev).manual_seed(1)
                    q, k, v = (torch.randn(B, H, S, D, device=dev, generator=g).bfloat16() for _ in range(3))
                    skipped = 0.0      # predicted share of listed tiles below the gap
                else:
                    cold = float(data.split("=")[1])
                    q, k, v, offsets = planted_inputs(B, H, S, D, block, cold, dev)
                    listed = plan.kv_index.long().clamp(max=offsets.numel() - 1)
                    valid = torch.arange(plan.kv_index.shape[-1], device=dev) < plan.kv_count[..., None]
                    skipped = float(((offsets[listed] < -args.gap) & valid).sum() / valid.sum())
                scale = D ** -0.5
                variants = {
                    "ws": lambda: hopper_attention(q, k, v, plan, scale),
                    "no_ws": lambda: hopper_attention(q, k, v, plan, scale, warp_specialize=False),
                    "no_ws_skip": lambda: hopper_attention(q, k, v, plan, scale, warp_specialize=False,
                                                           online_skip=args.gap),
                    "no_ws_w8": lambda: hopper_attention(q, k, v, plan, scale, warp_specialize=False, num_warps=8),
                    "no_ws_w8_skip": lambda: hopper_attention(q, k, v, plan, scale, warp_specialize=False,
                                                              num_warps=8, online_skip=args.gap),
                }
                base = variants["ws"]().float()
                for name, fn in variants.items():
                    diff = rel(fn().float(), base)
                    ms = bench(fn, warmup=25, rep=100)
                    rec = dict(S=S, D=D, H=H, density=dens, data=data, variant=name, ms=ms,
                               tflops=flops * dens / (ms * 1e-3) / 1e12, predicted_skipped_share=skipped if "skip" in name else 0.0,
                               rel_diff_vs_ws=diff)
                    print(json.dumps(rec), flush=True)
                    rows.append(rec)
    result = dict(what=__doc__.split("\n\n")[0], gap=args.gap, block=block, gpu=torch.cuda.get_device_name(),
                  versions=versions(), rows=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n| D | density | data | skipped (predicted) | ws TFLOP/s | no_ws | no_ws + skip | no_ws w8 | no_ws w8 + skip "
          "| best skip vs ws |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    n = len(variants)
    for i in range(0, len(rows), n):
        ws, nows, skip, w8, w8skip = rows[i:i + n]
        best = min(skip["ms"], w8skip["ms"])
        print(f"| {ws['D']} | {ws['density']:.3f} | {ws['data']} | {skip['predicted_skipped_share']:.0%} | "
              f"{ws['tflops']:.0f} | {nows['tflops']:.0f} | {skip['tflops']:.0f} | {w8['tflops']:.0f} | "
              f"{w8skip['tflops']:.0f} | {ws['ms'] / best:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
