"""GPU: do the kernels stay exact while other processes use the GPU (the driver time-slices and preempts them)?

Each case runs `--reps` times on finite inputs (B=2, H=3, 32,760 tokens) in worker processes, in three modes:
alone; next to one process running matmuls ("shared"); eight workers at once ("eight"). Before each call the
memory block the output will take is filled with a sentinel, so rows a kernel never writes show as such. Counted
per case: runs with any bad row, rows left unwritten, non-finite rows, finite rows off the reference (> 5%), and
for the Triton Hopper kernel the places in its persistent loop (item index of each program) where bad rows sit.
Alone, the Triton Hopper kernel at 64x64 tiles is also timed next to the generic kernel (what `auto` runs there
instead of it) on 12 heads x 32,760 tokens.

    python scripts/probe_preemption.py --out benchmarks/preemption_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

SENTINEL = 1000.0
# label: (kernel, head dim, tile, plan, correction, kernel kwargs)
CASES = {
    "gluon d128 dense": ("gluon", 128, 128, "dense", False, {}),
    "gluon d128 0.1+corr": ("gluon", 128, 128, "random", True, {}),
    "gluon d64 dense": ("gluon", 64, 128, "dense", False, {}),
    "generic 128 dense": ("generic", 128, 128, "dense", False, {}),
    "generic 64 dense": ("generic", 128, 64, "dense", False, {}),
    "generic 64 0.1+corr": ("generic", 128, 64, "random", True, {}),
    "triton-hopper WS 128 dense": ("hopper", 128, 128, "dense", False, {}),
    "triton-hopper WS 128 dense, 1 stage": ("hopper", 128, 128, "dense", False, dict(num_stages=1)),
    "triton-hopper WS 64 dense": ("hopper", 128, 64, "dense", False, {}),
    "triton-hopper WS 64 0.1+corr": ("hopper", 128, 64, "random", True, {}),
    "triton-hopper no-WS 128 dense": ("hopper", 128, 128, "dense", False, dict(warp_specialize=False)),
    "triton-hopper no-WS 64 0.1+corr": ("hopper", 128, 64, "random", True, dict(warp_specialize=False)),
}


def _inputs(seed, D, block, kind, corr, B=2, H=3, S=32760):
    from videosparse.plan import dense_plan, plan_from_mask
    from videosparse.sol.centroids import tile_centroids_torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    if kind == "dense":
        plan = dense_plan(B, H, S, block, block, device="cuda")
    else:
        m = -(-S // block)
        mask = torch.rand(B, H, m, m, device="cuda", generator=g) < 0.1
        mask[..., torch.arange(m), torch.arange(m)] = True
        plan = plan_from_mask(mask, block, block)
    if corr:
        plan = plan.with_correction(*tile_centroids_torch(k, v, block))
    return q, k, v, plan


def _run(kernel, q, k, v, plan, kwargs):
    scale = q.shape[-1] ** -0.5
    if kernel == "gluon":
        from videosparse.kernels.gluon_hopper import gluon_attention
        return gluon_attention(q, k, v, plan, scale, True, **kwargs)[0]
    if kernel == "generic":
        from videosparse.kernels.triton_generic import generic_attention
        return generic_attention(q, k, v, plan, scale, True, **kwargs)[0]
    from videosparse.kernels.triton_hopper import hopper_attention
    return hopper_attention(q, k, v, plan, scale, True, **kwargs)[0]


def _loop_places(bad_rows, plan, block, S):
    """Item index within its program (persistent loop) of the items holding bad rows, as the Triton Hopper kernel
    deals them (`launch_dims` order, one program per SM)."""
    from videosparse.kernels._triton_utils import launch_dims
    from videosparse.plan import device_programs

    n_items = plan.kv_count.numel()
    programs = min(n_items, device_programs(torch.device("cuda")))
    order = launch_dims(torch.empty(plan.kv_count.shape[0], plan.kv_count.shape[1], S, 1, device="cuda"),
                        torch.empty(1, 1, S, 1, device="cuda"), plan, programs)[-1].long()
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device="cuda")
    bh, row = bad_rows.view(-1, S).nonzero(as_tuple=True)
    items = torch.unique(bh * -(-S // block) + row // block)
    return sorted(set((position[items] // programs).tolist()))


def worker(seed: int, reps: int, path: str, labels: list[str]) -> None:
    from videosparse.kernels import reference_attention

    junk = torch.full((1 << 28,), float("nan"), device="cuda", dtype=torch.bfloat16)   # memory as a busy process
    del junk
    results = {}
    for label in labels:
        kernel, D, block, kind, corr, kwargs = CASES[label]
        q, k, v, plan = _inputs(seed, D, block, kind, corr)
        ref = reference_attention(q, k, v, plan, D ** -0.5).float()
        r = results[label] = dict(bad_runs=0, unwritten=0, non_finite=0, wrong=0, loop_places=[])
        places = set()
        for _ in range(reps):
            fill = torch.full_like(q, SENTINEL)     # the block the output takes next holds the sentinel
            del fill
            out = _run(kernel, q, k, v, plan, kwargs).float()
            unwritten = (out == SENTINEL).all(-1)
            non_finite = ~torch.isfinite(out).all(-1) & ~unwritten
            err = (out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)
            wrong = (err > 0.05) & ~unwritten & ~non_finite
            bad = unwritten | non_finite | wrong
            if bad.any():
                r["bad_runs"] += 1
                r["unwritten"] += int(unwritten.sum())
                r["non_finite"] += int(non_finite.sum())
                r["wrong"] += int(wrong.sum())
                if kernel == "hopper":
                    places.update(_loop_places(bad, plan, block, q.shape[2]))
        r["loop_places"] = sorted(places)
        del q, k, v, plan, ref
    with open(path, "w") as f:
        json.dump(results, f)


def gpu_load(seconds: float) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.time()
    while time.time() - start < seconds:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def timings() -> list[dict]:
    """ms and TFLOP/s on kept tiles, 1 x 12 x 32,760, head dim 128, 64x64 tiles: generic vs Triton Hopper."""
    from triton.testing import do_bench

    rows = []
    for kind, corr in (("dense", False), ("random", False), ("random", True)):
        q, k, v, plan = _inputs(0, 128, 64, kind, corr, B=1, H=12)
        kept = float(plan.kv_count.sum()) * 64 * 64
        for label, kernel, kwargs in (("generic", "generic", {}), ("triton-hopper WS", "hopper", {}),
                                      ("triton-hopper no-WS", "hopper", dict(warp_specialize=False))):
            ms = do_bench(lambda: _run(kernel, q, k, v, plan, kwargs), warmup=50, rep=300)
            rows.append(dict(kernel=label, plan=f"{kind} 0.1" if kind == "random" else kind, correction=corr,
                             ms=round(ms, 3), tflops_kept=round(4 * kept * 128 / ms / 1e9, 1)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/preemption_h200.json")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--cases", default="", help="comma-separated parts of case labels to run (default all)")
    parser.add_argument("--modes", default="alone,shared,eight", help="of alone, shared, eight")
    parser.add_argument("--no-timings", action="store_true")
    args = parser.parse_args()
    from _bench import require_cuda

    require_cuda(__file__)
    wanted = [part.strip() for part in args.cases.split(",") if part.strip()]
    labels = [label for label in CASES if not wanted or any(part in label for part in wanted)]
    if not labels:
        raise SystemExit(f"--cases {args.cases!r} matches none of {list(CASES)}")
    me = [sys.executable, os.path.abspath(__file__)]
    tmp = tempfile.mkdtemp()
    modes = {}
    for mode, workers, loads in (("alone", 1, 0), ("shared", 1, 1), ("eight", 8, 0)):
        if mode not in args.modes.split(","):
            continue
        load = [subprocess.Popen(me + ["--load", "300"]) for _ in range(loads)]
        time.sleep(5 if loads else 0)
        procs = [subprocess.Popen(me + ["--worker", str(s), str(args.reps), f"{tmp}/{mode}{s}.json", "|".join(labels)])
                 for s in range(workers)]
        codes = [p.wait() for p in procs]
        for p in load:
            p.kill()
        if any(codes):
            raise SystemExit(f"a worker of mode {mode} failed: exit codes {codes}")
        per_case = {}
        for s in range(workers):
            with open(f"{tmp}/{mode}{s}.json") as f:
                for label, r in json.load(f).items():
                    acc = per_case.setdefault(label, dict(runs=0, bad_runs=0, unwritten=0, non_finite=0, wrong=0,
                                                          loop_places=set()))
                    acc["runs"] += args.reps
                    for key in ("bad_runs", "unwritten", "non_finite", "wrong"):
                        acc[key] += r[key]
                    acc["loop_places"].update(r["loop_places"])
        for acc in per_case.values():
            acc["loop_places"] = sorted(acc["loop_places"])
        modes[mode] = per_case
    table = [] if args.no_timings else timings()
    print(f"{'case':38s} " + " ".join(f"{m:>22s}" for m in modes))
    for label in labels:
        cells = []
        for mode in modes:
            r = modes[mode][label]
            places = str(r["loop_places"][:3])
            cells.append(f"{r['bad_runs']:>3d}/{r['runs']:<3d} nan {r['non_finite']:>7d} {places:>5s}")
        print(f"{label:38s} " + " ".join(f"{c:>22s}" for c in cells))
    for row in table:
        print(row)
    import triton
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, reps_per_worker=args.reps,
                inputs="B=2, H=3, 32,760 tokens, bf16, finite randn; random plans keep 10% of tiles plus the diagonal",
                modes=dict(alone="one worker", shared="one worker next to one process running bf16 matmuls",
                           eight="eight workers at once"))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, modes=modes, timings_64x64_tiles=table), f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5].split("|"))
    elif len(sys.argv) > 1 and sys.argv[1] == "--load":
        gpu_load(float(sys.argv[2]))
    else:
        main()
