#!/usr/bin/env python
"""Where the Gluon kernel's warps stall (GPU, Nsight Compute): per-instruction warp-state samples, summarised.

Runs `ncu` (SourceCounters, WarpStateStats, SpeedOfLight, ComputeWorkloadAnalysis; `--clock-control none`) on
one launch of the Gluon kernel per density (12 x 32,768, head dim 128 by default, random top-k plans, bf16),
exports the SASS source page as CSV and writes one JSON with, per density: the SM clock, duration and "SM Busy"
(the busiest pipe, the tensor cores here), and for each role (consumer warpgroups, loader and idle warps: the
SASS between `USETMAXREG` markers, labelled by whether it issues HGMMA or UTMALDG) its share of the samples,
its stall reasons, its instruction mix and its hottest instructions.

    python scripts/ncu_stalls.py --densities 1.0 0.1 --out benchmarks/ncu_gluon_h200.json

`--summarize CSV [CSV ...]` re-reads exported source pages (`ncu -i REP --page source --csv --print-source sass`)
without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

DETAIL_METRICS = ("SM Frequency", "Duration", "SM Busy", "Issue Slots Busy", "Executed Ipc Active",
                  "Warp Cycles Per Issued Instruction", "L2 Cache Throughput", "DRAM Throughput")


def launch(density: float, seq: int, heads: int, head_dim: int, launches: int) -> None:
    """The profiled program: `launches` identical calls of the Gluon kernel (ncu skips all but the last)."""
    import torch

    from bench_kernel import random_plan
    from videosparse.kernels.gluon_hopper import gluon_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    plan = random_plan(1, heads, seq, density, 128, "cuda")
    for _ in range(launches):
        gluon_attention(q, k, v, plan, head_dim ** -0.5)
    torch.cuda.synchronize()


def _number(text: str) -> float:
    try:
        return float(text.replace(",", "")) if text else 0.0
    except ValueError:
        return 0.0


def read_source_page(path: str | Path) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of an exported SASS source page."""
    rows = list(csv.reader(open(path)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    return rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]


def split_roles(header: list[str], rows: list[list[str]]) -> dict[str, list[list[str]]]:
    """Instructions grouped by warp role: the SASS between USETMAXREG markers is one partition's code; a segment
    with HGMMA is consumer code, with UTMALDG loader code, anything else setup or idle warps."""
    src = header.index("Source")
    segments, cur = [], []
    for r in rows:
        if "USETMAXREG" in r[src] and cur:
            segments.append(cur)
            cur = []
        cur.append(r)
    segments.append(cur)
    roles = collections.defaultdict(list)
    for seg in segments:
        text = " ".join(r[src] for r in seg)
        role = "consumer" if "HGMMA" in text else "loader" if "UTMALDG" in text else "setup/idle"
        roles[role].extend(seg)
    return roles


def summarize_source(path: str | Path, top: int = 15) -> dict:
    """Per role: share of all samples, stall reasons (% of the role's samples), instruction mix (% of executed
    warp instructions) and the `top` instructions by samples with their main stall reasons."""
    header, rows = read_source_page(path)
    col = {name: i for i, name in enumerate(header)}
    samples, executed, src = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"], col["Source"]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_number(r[samples]) for r in rows) or 1.0
    out = {}
    for role, rs in split_roles(header, rows).items():
        role_samples = sum(_number(r[samples]) for r in rs) or 1.0
        stalls = {k[len("stall_"):]: sum(_number(r[col[k]]) for r in rs) / role_samples * 100 for k in reasons}
        mix = collections.Counter()
        for r in rs:
            words = r[src].split()
            if words:
                op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
                mix[op.split(".")[0]] += _number(r[executed])
        n_exec = sum(mix.values()) or 1.0
        hot = []
        for r in sorted(rs, key=lambda r: -_number(r[samples]))[:top]:
            s = _number(r[samples]) or 1.0
            why = sorted(((k[len("stall_"):], _number(r[col[k]]) / s * 100) for k in reasons), key=lambda kv: -kv[1])
            share = round(_number(r[samples]) / role_samples * 100, 2)
            hot.append(dict(sass=" ".join(r[src].split())[:80], share=share,
                            stalls={k: round(v, 1) for k, v in why[:3] if v >= 1}))
        out[role] = dict(sample_share=round(role_samples / total * 100, 2),
                         stalls={k: round(v, 2) for k, v in sorted(stalls.items(), key=lambda kv: -kv[1]) if v >= 0.5},
                         instruction_mix={k: round(v / n_exec * 100, 2) for k, v in mix.most_common(14)},
                         executed_warp_instructions=n_exec, hottest=hot)
    return out


def read_details(path: str | Path) -> dict:
    """The DETAIL_METRICS of an exported details page (`ncu -i REP --page details --csv`)."""
    rows = list(csv.reader(open(path)))
    header = rows[0]
    name, unit, value = header.index("Metric Name"), header.index("Metric Unit"), header.index("Metric Value")
    return {f"{r[name]} ({r[unit]})" if r[unit] else r[name]: _number(r[value]) for r in rows[1:]
            if len(r) > value and r[name] in DETAIL_METRICS}


def profile(density: float, args, work: Path) -> dict:
    """ncu on one launch at `density`; the exported pages summarised."""
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    rep = work / f"rep_{density}"
    cmd = [ncu, "--clock-control", "none", "-k", "regex:_gluon_fwd", "--launch-skip", str(args.launches - 1),
           "--launch-count", "1", "--section", "SourceCounters", "--section", "WarpStateStats", "--section",
           "SpeedOfLight", "--section", "ComputeWorkloadAnalysis", "-f", "-o", str(rep), sys.executable,
           __file__, "--launch", str(density), "--seq", str(args.seq), "--heads", str(args.heads),
           "--head-dim", str(args.head_dim), "--launches", str(args.launches)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0 or not Path(f"{rep}.ncu-rep").is_file():
        tail = (res.stdout + res.stderr)[-2000:]
        raise RuntimeError(f"ncu failed (exit {res.returncode}) at density {density}:\n{tail}")
    src, det = work / f"source_{density}.csv", work / f"details_{density}.csv"
    for page, path, extra in (("source", src, ["--print-source", "sass"]), ("details", det, [])):
        with open(path, "w") as f:
            subprocess.run([ncu, "-i", f"{rep}.ncu-rep", "--page", page, "--csv", *extra], stdout=f, check=True,
                           timeout=300)
    return dict(density=density, details=read_details(det), roles=summarize_source(src))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--densities", type=float, nargs="*", default=[1.0, 0.1])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--launches", type=int, default=4, help="launches per run; ncu profiles the last")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "ncu_gluon_h200.json"))
    ap.add_argument("--summarize", nargs="+", metavar="CSV", help="only summarise exported source pages")
    ap.add_argument("--launch", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.launch is not None:
        launch(args.launch, args.seq, args.heads, args.head_dim, args.launches)
        return None
    if args.summarize:
        result = {str(p): summarize_source(p) for p in args.summarize}
        print(json.dumps(result, indent=1))
        return result
    import torch
    import triton

    result = dict(what=__doc__.split("\n")[0], shape=dict(heads=args.heads, seq=args.seq, head_dim=args.head_dim),
                  gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, runs=[])
    with tempfile.TemporaryDirectory() as d:
        for density in args.densities:
            run = profile(density, args, Path(d))
            result["runs"].append(run)
            c = run["roles"].get("consumer", {})
            print(f"density {density}: " + ", ".join(f"{k} {v:g}" for k, v in run["details"].items())
                  + f"; consumer stalls {c.get('stalls')}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
