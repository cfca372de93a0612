#!/usr/bin/env python
"""Where the time of one transformer forward goes: torch.profiler over a synthetic real-size model.

For each method (dense first, as in `videosparse evaluate --synthetic`): apply it, optionally compile the
transformer, warm up, time `--repeats` forwards, then profile one more. Device kernels are summed by
category (GEMMs, dense attention, the sparse kernel, plan building, Inductor's fused kernels, ...), the
largest kernels are listed, and the host side is summarised by the launch latency (first kernel after
the forward starts), the idle gaps between kernels, the time the host takes to queue a forward (until it
returns, before the GPU finishes) and, on CUDA, the synchronizing CUDA calls of one more forward, by the
innermost videosparse frame that made them (CUDA's sync debug mode). On a CPU-only machine the same runs with
CPU operators in place of kernels (a smoke test; the figures mean nothing there).

    python scripts/profile_forward.py --model wan-1.3b --methods dense veda@0.1 --compile default \\
        --out benchmarks/profile_compiled_wan1.3b_h200.json
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from videosparse.eval.report import save_report  # noqa: E402
from videosparse.eval.spec import parse_method_specs  # noqa: E402
from videosparse.eval.synthetic import COMPILE_MODES, every_step_sparse, method_applied  # noqa: E402
from videosparse.eval.synthetic_models import (  # noqa: E402
    build_transformer, check_feasible, check_supported, count_parameters, make_inputs, synthetic_setup)
from videosparse.eval.timing import host_sync_sites, package_frames  # noqa: E402

# (category, substrings of a lower-cased kernel name); the first match wins. Inductor's kernels
# ("triton_poi_...", "triton_red_...") are named after the ops they fuse, so they are taken first.
CATEGORIES = (
    ("inductor fused", ("triton_poi_", "triton_red_", "triton_per_", "triton_tem_")),
    ("sparse kernel", ("_gluon_fwd", "_hopper_fwd", "_generic_fwd")),
    ("layout gather", ("rope_gather",)),
    ("plan building", ("trippool", "topk", "sort", "tile_stats", "centroid", "threshold")),
    ("dense attention", ("sdpa", "fmha", "flash", "cudnn_generated", "attention")),
    ("gemm", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "aten::mm", "aten::addmm", "aten::bmm")),
    ("copies", ("memcpy", "memset", "copy", "elementwise")),
)
TOP_KERNELS = 25
GAP_US = 20.0     # idle time between two kernels counted as a host-side gap


def kernel_category(name: str) -> str:
    """The category of a device kernel (or, on CPU, an operator) by its name; "other" if none fits."""
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


def summarize_profile(prof, device_type: str) -> dict:
    """Busy time by category, top kernels, launch latency and idle gaps (all in ms) of one profiled forward.

    device_type "CUDA": device kernels; "CPU": operators by self time (no launch latency or gaps).
    """
    if device_type == "CPU":
        items = [(e.name, e.self_cpu_time_total) for e in prof.events() if e.device_type.name == "CPU"]
        events = []
    else:
        events = [e for e in prof.events() if e.device_type.name == device_type]
        events.sort(key=lambda e: e.time_range.start)
        items = [(e.name, e.time_range.end - e.time_range.start) for e in events]
    by_category, by_name, calls = collections.Counter(), collections.Counter(), collections.Counter()
    for name, us in items:
        by_category[kernel_category(name)] += us
        by_name[name[:100]] += us
        calls[name[:100]] += 1
    row = {
        "busy_ms": sum(by_category.values()) / 1e3,
        "by_category_ms": {k: v / 1e3 for k, v in by_category.most_common()},
        "top_kernels": [{"name": k, "ms": v / 1e3, "calls": calls[k]} for k, v in by_name.most_common(TOP_KERNELS)],
        "first_kernel_after_ms": None, "idle_gaps_ms": None, "idle_gaps": None,
    }
    if events:
        host_start = min(e.time_range.start for e in prof.events() if e.device_type.name == "CPU")
        gaps = [b.time_range.start - a.time_range.end for a, b in zip(events, events[1:])]
        gaps = [g for g in gaps if g > GAP_US]
        row.update(first_kernel_after_ms=(events[0].time_range.start - host_start) / 1e3,
                   idle_gaps_ms=sum(gaps) / 1e3, idle_gaps=len(gaps))
    return row


def sync_sites_by_frame(sites: list[list[str]]) -> dict[str, int]:
    """{innermost videosparse frame ("path inside the package:line:function"), or "outside videosparse": count} of
    the stacks `host_sync_sites` returned."""
    counts = collections.Counter((package_frames(frames) or ["outside videosparse"])[0] for frames in sites)
    return dict(counts.most_common())


def profile_method(transformer, inputs: dict, spec, compile_mode: str | None, warmup: int, repeats: int) -> dict:
    """Forward times and the profile summary of one method (applied here, removed before returning)."""
    from torch.profiler import ProfilerActivity, profile

    device = inputs["hidden_states"].device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    with method_applied(transformer, every_step_sparse(spec.config), compile_mode) as (model, _), torch.no_grad():
        t0 = time.perf_counter()
        for _ in range(warmup):
            model(**inputs)
        sync()
        warm_s = time.perf_counter() - t0
        host = []
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            model(**inputs)
            host.append(time.perf_counter() - t)
            sync()
            times.append(time.perf_counter() - t)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            sync()
            model(**inputs)
            sync()
        syncs = sync_sites_by_frame(host_sync_sites(lambda: model(**inputs))) if device.type == "cuda" else None
        sync()
    row = {"forward_ms": statistics.median(times) * 1e3, "forward_ms_all": [t * 1e3 for t in times],
           "host_issue_ms": statistics.median(host) * 1e3, "warmup_s": warm_s, "host_syncs": syncs}
    row.update(summarize_profile(prof, "CUDA" if device.type == "cuda" else "CPU"))
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan-1.3b", help="a synthetic model name (see `videosparse evaluate --help`)")
    ap.add_argument("--methods", nargs="+", default=["dense", "veda@0.1"], help="method specs, as for evaluate")
    ap.add_argument("--compile", choices=sorted(COMPILE_MODES), help="torch.compile mode (default: eager)")
    ap.add_argument("--frames", type=int)
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--layers", type=int, help="build only this many transformer blocks")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1:
        ap.error(f"--warmup {args.warmup} / --repeats {args.repeats}: need warmup >= 0 and repeats >= 1.")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    setup = synthetic_setup(args.model, args.frames, args.height, args.width, args.layers)
    check_supported(setup)
    check_feasible(setup, device, dtype, count_parameters(setup))   # a size this device cannot run: refused first
    transformer = build_transformer(setup, device, dtype)
    inputs = make_inputs(setup, device, dtype)
    command = "python scripts/profile_forward.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {"meta": {"model": args.model, "grid": list(setup.grid), "tokens": setup.tokens,
                       "layers": setup.num_layers, "device": torch.cuda.get_device_name(device)
                       if device.type == "cuda" else "cpu", "dtype": str(dtype), "compile": args.compile,
                       "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
                       "command": command},
              "methods": {}}
    for spec in parse_method_specs(args.methods):
        row = profile_method(transformer, inputs, spec, args.compile, args.warmup, args.repeats)
        report["methods"][spec.label] = row
        cats = ", ".join(f"{k} {v:.1f}" for k, v in row["by_category_ms"].items())
        host = ("" if row["idle_gaps_ms"] is None else f"; first kernel after {row['first_kernel_after_ms']:.2f} ms, "
                f"idle gaps {row['idle_gaps_ms']:.2f} ms, host syncs {sum(row['host_syncs'].values())}")
        print(f"{spec.label}: forward {row['forward_ms']:.1f} ms, busy {row['busy_ms']:.1f} ms ({cats}){host}",
              flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            save_report(report, args.out)     # atomic: a run cut short keeps the methods before it
    return report


if __name__ == "__main__":
    main()
