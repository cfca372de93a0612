"""Sustained throughput, SM clock and board power of our kernel, FA4 block-sparse and cuDNN dense (GPU).

At its power cap (700 W) the H200 lowers the SM clock under sustained load, so a 100 ms do_bench reading
depends on what ran just before it: a kernel timed right after an idle gap runs at a higher clock. Here each
kernel runs back to back for `--seconds` after `--cool` seconds of idle, while nvidia-smi samples the SM clock
and board power every 50 ms; reported per run: TFLOP/s over the first 100 ms (cool start) and over the second
half (steady state), with the median clock and power of that half, and TFLOP/s per watt.

    python scripts/bench_power.py [--seconds 3] [--cool 2] [--densities 1.0 0.1 0.05] [--out power.json]

Shape 12 x 32,768, head dim 128, bf16, random top-k plans of 128x128 tiles (as `bench_kernel.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def parse_sample(line: str, now: float):
    """(host time, SM clock MHz, power W) of one `nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,
    noheader,nounits` line, or None for anything else ('[N/A]', blank)."""
    try:
        clock, power = (float(x) for x in line.strip().split(","))
    except ValueError:
        return None
    return now, clock, power


class Sampler:
    """nvidia-smi polled every `period_ms` in the background; `samples` holds (host time, MHz, W)."""

    def __init__(self, period_ms: int = 50):
        self.samples = []
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                      f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            sample = parse_sample(line, time.perf_counter())
            if sample is not None:
                self.samples.append(sample)

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


def summarize(chunks, samples, flops: float, first_s: float = 0.1) -> dict:
    """Throughput and GPU state of one sustained run.

    chunks: [(host time after a synchronize, calls finished so far)], the first entry (start, 0).
    samples: [(host time, MHz, W)]. flops: the work of one call.
    Returns TFLOP/s over the first chunks up to `first_s` ("first"), over the second half ("steady"), the
    median clock and power of the samples in the second half and steady TFLOP/s per watt."""
    t0, t1 = chunks[0][0], chunks[-1][0]
    mid = next(c for c in chunks if c[0] >= (t0 + t1) / 2)
    head = next((c for c in chunks if c[0] >= t0 + first_s), chunks[-1])

    def rate(a, b):
        return (b[1] - a[1]) * flops / (b[0] - a[0]) / 1e12

    steady = [s for s in samples if mid[0] <= s[0] <= t1]
    clock = statistics.median(s[1] for s in steady) if steady else float("nan")
    power = statistics.median(s[2] for s in steady) if steady else float("nan")
    out = dict(tflops_first=rate(chunks[0], head), tflops_steady=rate(mid, chunks[-1]), clock_mhz=clock,
               power_w=power, n_samples=len(steady))
    out["tflops_per_w"] = out["tflops_steady"] / power if steady else float("nan")
    return out


def sustained(fn, seconds: float, chunk_s: float = 0.05):
    """Run fn back to back for `seconds`; [(host time, calls)] after each synchronize (one per ~chunk_s)."""
    import torch

    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    per_chunk = max(1, int(chunk_s / max(time.perf_counter() - t, 1e-6)))
    chunks = [(time.perf_counter(), 0)]
    while chunks[-1][0] - chunks[0][0] < seconds:
        for _ in range(per_chunk):
            fn()
        torch.cuda.synchronize()
        chunks.append((time.perf_counter(), chunks[-1][1] + per_chunk))
    return chunks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--cool", type=float, default=2.0, help="idle seconds before each run")
    ap.add_argument("--densities", type=float, nargs="*", default=[1.0, 0.1, 0.05])
    ap.add_argument("--repeats", type=int, default=2, help="passes over the kernels, the order reversed each pass")
    ap.add_argument("--out", default="power.json")
    args = ap.parse_args(argv)
    # the summary splits each run into a cool start (its first 100 ms) and a steady half: shorter runs hold neither
    if not args.seconds >= 0.5:
        ap.error(f"--seconds {args.seconds} must be >= 0.5 (the first 100 ms and a steady half are summarized).")
    if not args.cool >= 0 or args.repeats < 1 or any(not 0 < d <= 1 for d in args.densities):
        ap.error(f"--cool {args.cool} must be >= 0, --repeats {args.repeats} >= 1 and --densities "
                 f"{args.densities} in (0, 1].")

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench_kernel import first, gpu_state, make_fa4, random_plan
    from videosparse.kernels import block_sparse_attention

    B, H, S, D = 1, 12, 32768, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    full = 4.0 * S * S * D * B * H
    runs = {}

    def sdpa():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    runs["cudnn dense"] = (sdpa, full, 1.0)
    for density in args.densities:
        plan = random_plan(B, H, S, density, 128, "cuda")
        kept = plan.density(-(-S // 128))
        runs[f"ours {density}"] = (lambda p=plan: block_sparse_attention(q, k, v, p, validate=False), full * kept, kept)
        fa4 = make_fa4(plan)
        if fa4 is not None:
            first(fa4(qt, kt, vt, D ** -0.5))
            runs[f"fa4 {density}"] = (lambda f=fa4: f(qt, kt, vt, D ** -0.5), full * kept, kept)
    sampler = Sampler()
    rows = []
    try:
        for rep in range(args.repeats):
            for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
                fn, flops, kept = runs[name]
                time.sleep(args.cool)
                chunks = sustained(fn, args.seconds)
                row = dict(name=name, density=kept, repeat=rep, **summarize(chunks, sampler.samples, flops))
                rows.append(row)
                print(f"{name:14s} first 100 ms {row['tflops_first']:6.1f}  steady {row['tflops_steady']:6.1f} "
                      f"TFLOP/s at {row['clock_mhz']:5.0f} MHz {row['power_w']:5.0f} W "
                      f"({row['tflops_per_w']:.3f} TFLOP/s per W)", flush=True)
    finally:
        sampler.close()
    Path(args.out).write_text(json.dumps(dict(
        meta=dict(gpu=torch.cuda.get_device_name(), shape=[B, H, S, D], seconds=args.seconds, cool=args.cool,
                  gpu_state_end=gpu_state(), date=time.strftime("%Y-%m-%d %H:%M")), rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
