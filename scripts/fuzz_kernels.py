"""Randomised check of the kernel backends against the torch reference, many cases drawn from a seed.

The GPU tests check a fixed grid of cases; this draws the combinations that grid does not name: sequence lengths
from 16 to --max-seq tokens (partial last tiles, key counts other than the query count), 1-3 batch items and 1-6
heads, head dims 64 / 128 and the padded 80 / 96, bf16 and fp16, 64- or 128-token tiles, row lengths uniform,
log-normal, with dense (global-tile) rows or with empty rows, plans packed to the full width with arbitrary entries
past each row's count (as Sol packs them on CUDA), the zero-order correction, key-padding limits
(`Plan.valid_keys`), a plan's own row order (the shipped work order or a random permutation) and softmax scales.
Each case runs on every requested backend that takes it (the others are counted as not supported, with the
reason) and is compared with `reference_attention` on the same inputs upcast to fp32: relative L2 error of the
output within the dtype's tolerance, the LSE within 2e-2 where finite and infinite exactly where the reference's is.

    python scripts/fuzz_kernels.py --cases 400 --time-limit 500 --out benchmarks/kernel_fuzz_h200.json   # GPU
    TRITON_INTERPRET=1 python scripts/fuzz_kernels.py --device cpu --backends triton --max-seq 400 --cases 5

Exits 1 when any case fails; the JSON lists every case with its draw, so a failure reruns with `--only N`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import replace

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from videosparse.kernels import block_sparse_attention, reference_attention  # noqa: E402
from videosparse.kernels.dispatch import select_backend  # noqa: E402
from videosparse.plan import Plan, dense_plan, device_programs, plan_from_mask, work_order  # noqa: E402
from videosparse.sol.centroids import tile_centroids_torch  # noqa: E402

TOLERANCE = {"bfloat16": 1.2e-2, "float16": 3e-3, "float32": 1e-4}
LSE_TOLERANCE = 2e-2
ROWS = ("uniform", "lognormal", "global", "empty")


def draw_case(rng: random.Random, max_seq: int) -> dict:
    """One case's parameters (plain JSON values)."""
    def length() -> int:
        return int(math.exp(rng.uniform(math.log(16), math.log(max_seq))))

    seq = length()
    case = {
        "batch": rng.choice([1, 1, 2, 3]), "heads": rng.randint(1, 6), "seq": seq,
        "keys": seq if rng.random() < 0.8 else length(),
        "head_dim": rng.choice([64, 128, 128, 80, 96]), "dtype": rng.choice(["bfloat16", "float16"]),
        "block": 128 if rng.random() < 0.75 else 64,
        "density": 1.0 if rng.random() < 0.15 else round(rng.uniform(0.02, 0.6), 3),
        "rows": rng.choice(ROWS), "correction": rng.random() < 0.4, "valid_keys": rng.random() < 0.25,
        "order": rng.choice([None, "work_order", "random"]),
        "scale": None if rng.random() < 0.7 else round(rng.uniform(0.03, 0.2), 4),
        "seed": rng.randrange(2**31),
    }
    case["full_width"] = case["seed"] % 10 < 3      # from the case's seed: the draws of earlier reports stay the same
    return case


def build_inputs(case: dict, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Plan]:
    """q [B, H, seq, D], k and v [B, H, keys, D] in the case's dtype, and its plan."""
    g = torch.Generator().manual_seed(case["seed"])
    B, H, S, Sk, D, block = (case[k] for k in ("batch", "heads", "seq", "keys", "head_dim", "block"))
    dtype = getattr(torch, case["dtype"])
    q = torch.randn(B, H, S, D, generator=g).to(device, dtype)
    k, v = (torch.randn(B, H, Sk, D, generator=g).to(device, dtype) for _ in range(2))
    Mq, Nk = math.ceil(S / block), math.ceil(Sk / block)
    if case["density"] >= 1.0:
        plan = dense_plan(B, H, S, block, block, device=device, key_len=Sk)
    else:
        scores = torch.rand(B, H, Mq, Nk, generator=g)
        if case["rows"] == "lognormal":     # per-row densities spread over two orders of magnitude
            row = (torch.randn(B, H, Mq, 1, generator=g) - 1.0).exp() * case["density"] / 0.6
            mask = scores < row.clamp(max=1.0)
        else:
            mask = scores < case["density"]
        mask.scatter_(-1, torch.randint(0, Nk, (B, H, Mq, 1), generator=g), True)   # no row empty by accident
        if case["rows"] == "global":        # a few rows see every key tile (global text tiles)
            mask[:, :, torch.randperm(Mq, generator=g)[: max(1, Mq // 8)]] = True
        if case["rows"] == "empty":         # a third of the rows see nothing: zero output, LSE -inf
            mask[:, :, torch.randperm(Mq, generator=g)[: Mq // 3]] = False
        plan = plan_from_mask(mask, block, block)
        plan = Plan(plan.kv_index.to(device), plan.kv_count.to(device), block, block)
    if case.get("full_width"):   # as Sol packs on CUDA: Nk columns, entries past kv_count arbitrary (never read)
        kmax = plan.kv_index.shape[-1]
        junk = torch.randint(0, Nk, (B, H, Mq, Nk), generator=g, dtype=torch.int32).to(device)
        listed = torch.arange(kmax, device=device) < plan.kv_count[..., None]
        junk[..., :kmax] = torch.where(listed, plan.kv_index, junk[..., :kmax])
        plan = replace(plan, kv_index=junk)
    if case["correction"]:
        plan = plan.with_correction(*tile_centroids_torch(k, v, block))
    if case["valid_keys"]:
        limits = torch.randint(1, Sk + 1, (B,), generator=g, dtype=torch.int32)
        plan = plan.with_valid_keys(limits.to(device))
    if case["order"] == "work_order":      # the persistent kernels' balanced order, as a plan may carry it
        plan = replace(plan, order=work_order(plan.kv_count, device_programs(device)))
    elif case["order"] == "random":
        plan = replace(plan, order=torch.randperm(B * H * Mq, generator=g).to(device, torch.int32))
    return q, k, v, plan


def check_case(case: dict, backends: list[str], device: str) -> dict:
    """The case's result per backend: {"status": "ok" | "fail" | "not supported" | "error", errors or reason}."""
    q, k, v, plan = build_inputs(case, device)
    scale = case["scale"] or 1.0 / math.sqrt(case["head_dim"])
    upcast = plan if not plan.has_correction else replace(plan, k_mean=plan.k_mean.float(), v_sum=plan.v_sum.float())
    ref, ref_lse = reference_attention(q.float(), k.float(), v.float(), upcast, scale, return_lse=True)
    results = {}
    for name in backends:
        try:
            impl = select_backend(q, k, v, plan, name)
        except ValueError as e:
            results[name] = {"status": "not supported", "reason": str(e)[-300:]}
            continue
        try:
            out, lse = block_sparse_attention(q, k, v, plan, scale=scale, return_lse=True, backend=name)
        except Exception as e:  # noqa: BLE001 - a crash is a finding, recorded with the case
            results[name] = {"status": "error", "ran": impl.name, "error": f"{type(e).__name__}: {e}"[:500]}
            continue
        rel = float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
        finite = torch.isfinite(ref_lse)
        same_inf = bool(torch.equal(torch.isfinite(lse), finite))
        lse_err = float((lse[finite] - ref_lse[finite]).abs().max()) if bool(finite.any()) else 0.0
        zero_rows = bool(out[~finite].eq(0).all()) if bool((~finite).any()) else True
        ok = (rel < TOLERANCE[case["dtype"]] or not bool(finite.any())) and same_inf and \
            lse_err < LSE_TOLERANCE and zero_rows and bool(torch.isfinite(out).all())
        results[name] = {"status": "ok" if ok else "fail", "ran": impl.name, "rel_err": rel, "lse_err": lse_err,
                         "lse_inf_match": same_inf, "empty_rows_zero": zero_rows}
    return results


def summarize(cases: list[dict], backends: list[str]) -> dict:
    """Per backend: how many cases were ok, failed, raised or were not supported, and the largest error of the ok."""
    summary = {}
    for name in backends:
        rows = [c["results"][name] for c in cases]
        counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "fail", "error", "not supported")}
        summary[name] = {**counts, "max_rel_err_ok": max((r["rel_err"] for r in rows if r["status"] == "ok"),
                                                         default=None)}
    return summary


def _write(report: dict, path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seq", type=int, default=12000, help="longest sequence drawn (tokens)")
    ap.add_argument("--backends", nargs="+", default=["auto", "gluon_hopper", "hopper", "triton_generic"],
                    help="backend names as block_sparse_attention takes them; a named kernel never pads the head "
                         "dim, 'auto' and 'triton' do (80 / 96 run zero-padded)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", type=int, nargs="+", help="rerun these case numbers of the same seed")
    ap.add_argument("--out", help="JSON report path")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds: start no case after this (the run ends with its summary; most of a first run's "
                         "time is compiling kernel variants, ~4 s per case on the H200)")
    args = ap.parse_args(argv)
    from videosparse.kernels.dispatch import backend_names

    known = backend_names()
    if unknown := [name for name in args.backends if name not in known]:
        ap.error(f"--backends {unknown} not known; choose from {known}")
    if args.cases < 1 or args.max_seq < 16 or (args.time_limit is not None and args.time_limit < 0):
        ap.error(f"--cases {args.cases} must be >= 1, --max-seq {args.max_seq} >= 16 and --time-limit >= 0")
    if args.out and os.path.isdir(args.out):
        ap.error(f"--out {args.out!r} is a directory; give the JSON file path")
    if args.only and not all(0 <= i < args.cases for i in args.only):
        ap.error(f"--only {args.only}: case numbers lie in [0, {args.cases - 1}] (--cases {args.cases})")
    rng = random.Random(args.seed)
    cases = [draw_case(rng, args.max_seq) for _ in range(args.cases)]
    picked = args.only if args.only is not None else range(len(cases))
    report = {"meta": {"seed": args.seed, "cases": args.cases, "max_seq": args.max_seq, "backends": args.backends,
                       "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                       "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
                       "command": "python scripts/fuzz_kernels.py " + " ".join(sys.argv[1:] if argv is None else argv)},
              "cases": []}
    t0 = time.time()
    for i in tqdm(picked, desc="cases", disable=not sys.stderr.isatty()):
        if args.time_limit is not None and time.time() - t0 > args.time_limit:
            report["stopped_at_time_limit"] = True
            break
        results = check_case(cases[i], args.backends, args.device)
        report["cases"].append({"index": i, "case": cases[i], "results": results})
        bad = {n: r for n, r in results.items() if r["status"] in ("fail", "error")}
        if bad:
            print(f"case {i} {cases[i]}: {bad}", flush=True)
        if args.out and len(report["cases"]) % 10 == 0:    # a run cut short keeps what it checked
            report["summary"], report["seconds"] = summarize(report["cases"], args.backends), time.time() - t0
            _write(report, args.out)
    summary = report["summary"] = summarize(report["cases"], args.backends)
    report["seconds"] = time.time() - t0
    print(f"{'backend':<16} {'ok':>5} {'fail':>5} {'error':>6} {'unsupported':>12}   ({len(report['cases'])} cases, "
          f"{report['seconds']:.0f} s)")
    for name, s in summary.items():
        print(f"{name:<16} {s['ok']:>5} {s['fail']:>5} {s['error']:>6} {s['not supported']:>12}")
    if args.out:
        _write(report, args.out)
    report["failed"] = any(s["fail"] or s["error"] for s in summary.values())
    if report["cases"] and not any(s["ok"] or s["fail"] or s["error"] for s in summary.values()):
        # every case was "not supported" by every backend: nothing was checked, which is no pass
        print("nothing was checked: no backend ran a case here (on CPU set TRITON_INTERPRET=1 and pass "
              "--device cpu --backends triton)")
        report["failed"] = True
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
