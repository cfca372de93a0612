"""Does host launch overhead inflate the kernel benchmark's do_bench medians? (GPU)

Times the same calls five ways and prints TFLOP/s on kept tiles for each: do_bench median (what
`bench_kernel.py` reports: L2 flushed before each call, CUDA events around one call), events around 10
back-to-back calls, `triton.testing.do_bench_cudagraph` (host overhead gone), and torch.profiler device time
of all kernels per call; plus the host (Python) time per call. Implementations: ours through
`block_sparse_attention(validate=False)` ("dispatch") and `gluon_attention` ("direct"), and cuDNN SDPA dense.
If the methods agree, the host time is hidden behind the GPU work and the do_bench numbers are GPU-bound.

    python scripts/check_timing_methods.py --out benchmarks/timing_methods_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CASES = [("12x32768 d128", (1, 12, 32768, 128), [1.0, 0.1, 0.05]), ("12x32768 d64", (1, 12, 32768, 64), [0.1]),
         ("Wan14B 40x75600 d128", (1, 40, 75600, 128), [0.1])]


def back_to_back_ms(fn, n=10):
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def profiler_ms(fn, n=10):
    """Device time of every kernel the call launches (torch.profiler), per call."""
    import torch

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / n / 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="timing_methods.json")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench, do_bench_cudagraph

    from _bench import host_us
    from bench_kernel import random_plan
    from videosparse.kernels import block_sparse_attention
    from videosparse.kernels.gluon_hopper import gluon_attention

    rows = []
    for name, (B, H, S, D), densities in CASES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fns = {}
        for density in densities:
            plan = random_plan(B, H, S, density, 128, "cuda")
            kept = plan.density(math.ceil(S / 128))
            fns[f"ours dispatch {density}"] = (lambda p=plan: block_sparse_attention(q, k, v, p, validate=False), kept)
            fns[f"ours direct {density}"] = (lambda p=plan: gluon_attention(q, k, v, p, D ** -0.5), kept)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)

        fns["cudnn dense"] = (cudnn, 1.0)
        for label, (fn, kept) in fns.items():
            flops = 4.0 * S * S * D * B * H * kept
            row = dict(shape=name, impl=label, density=kept, host_us=host_us(fn),
                       do_bench_ms=do_bench(fn, warmup=10, rep=80, return_mode="median"),
                       b2b_ms=back_to_back_ms(fn), graph_ms=do_bench_cudagraph(fn, rep=40, return_mode="median"),
                       prof_ms=profiler_ms(fn))
            for key in ("do_bench", "b2b", "graph", "prof"):
                row[f"{key}_tflops"] = flops / row[f"{key}_ms"] / 1e9
            rows.append(row)
            print(f"{name:22s} {label:22s} host {row['host_us']:5.0f} us | TFLOP/s do_bench "
                  f"{row['do_bench_tflops']:4.0f}  b2b {row['b2b_tflops']:4.0f}  graph {row['graph_tflops']:4.0f}  "
                  f"prof {row['prof_tflops']:4.0f}", flush=True)
    Path(args.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
