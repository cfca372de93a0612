"""Benchmark of the tile-skipping kernel against cuDNN SDPA, FlexAttention and FlashAttention-4 (GPU).

One run checks correctness against the torch reference first, then times, side by side:
ours (dense plan, random top-k plans, banded plans, with and without zero-order correction),
cuDNN SDPA dense, FlexAttention with the same plan as a BlockMask (compiled), and FA4 block-sparse
when `flash_attn.cute` imports. TFLOP/s counts the kept tiles only: 4 * S^2 * D * B * H * density / time.

    videosparse bench [--quick] [--out kernel_bench.json]
    videosparse bench --readme kernel_bench.json        # markdown table from a JSON
    python scripts/bench_kernel.py [...]                # the same, writing to benchmarks/kernel_h200.json by default

Writes JSON (shapes, densities, GPU, versions, every timing; atomically, after each step) and prints a markdown
table last; exits 1 when a correctness check failed or a step raised.
"""

from __future__ import annotations

import json
import logging
import math
import time
import traceback
from pathlib import Path
from statistics import median

SHAPES = {  # name: (B, H, S, D)
    "12x32768 d128": (1, 12, 32768, 128),
    "Wan1.3B 12x32760 d128": (1, 12, 32760, 128),
    "Wan14B 40x75600 d128": (1, 40, 75600, 128),
    "Hunyuan 24x118800 d128": (1, 24, 118800, 128),
    "CogVideoX 48x17550 d64": (1, 48, 17550, 64),
    "12x32768 d64": (1, 12, 32768, 64),          # the head-dim-64 target shape
}
DENSITIES = [1.0, 0.5, 0.25, 0.1, 0.05]
DEVICE = "cuda"
QUICK_SHAPES = ["12x32768 d128", "Wan14B 40x75600 d128", "CogVideoX 48x17550 d64"]
PEER_SHAPES = ["12x32768 d128", "Wan14B 40x75600 d128", "CogVideoX 48x17550 d64", "12x32768 d64"]


logger = logging.getLogger(__name__)


def _log(*parts) -> None:
    """One progress line at INFO: `parts` joined by spaces, as print joins them (`videosparse bench` shows these lines
    on stdout)."""
    logger.info(" ".join(map(str, parts)))


GPU_STATE_FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu",
                    "clocks_throttle_reasons.active")


def gpu_state(run=None):
    """nvidia-smi's SM clock, power and throttle reasons now ({} without nvidia-smi): the H200 runs these loops
    at its power cap (throttle reason 0x4), so each run records the state at its start and end."""
    import subprocess

    run = run or (lambda cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout)
    try:
        line = run(["nvidia-smi", "--query-gpu=" + ",".join(GPU_STATE_FIELDS), "--format=csv,noheader"])
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in (line or "").splitlines()[0].split(",")] if line and line.strip() else []
    return dict(zip(GPU_STATE_FIELDS, values)) if len(values) == len(GPU_STATE_FIELDS) else {}


# ------------------------------------------------------------------ plans
def random_plan(B, H, S, density, block, device, seed=0):
    """Random top-k plan (diagonal forced, equal budget per row) built with the library's topk_plan."""
    import torch

    from videosparse.plan import dense_plan, topk_plan

    if density >= 1.0:
        return dense_plan(B, H, S, block, block, device=device)
    M = math.ceil(S / block)
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(B, H, M, M, device=device, generator=g)
    return topk_plan(scores, density, block=block)


def banded_plan(B, H, S, density, block, device):
    """Local plan: key tiles |i - j| <= w (a band about the diagonal), w from the density."""
    import torch

    from videosparse.plan import plan_from_mask

    M = math.ceil(S / block)
    w = max(0, round((density * M - 1) / 2))
    i = torch.arange(M, device=device)
    mask = ((i[:, None] - i[None, :]).abs() <= w).expand(B, H, M, M)
    return plan_from_mask(mask.contiguous(), block, block)


def plan_density(plan, S):
    return float(plan.kv_count.double().sum()) / (plan.kv_count.numel() * math.ceil(S / plan.block_n))


# ------------------------------------------------------------------ peers
def make_flex(plan, S, device):
    import torch
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    B, H, M, _ = plan.kv_index.shape
    N = math.ceil(S / plan.block_n)
    idx = torch.zeros(B, H, M, N, dtype=torch.int32, device=device)
    idx[..., : plan.kv_index.shape[-1]] = plan.kv_index
    zeros_cnt = torch.zeros_like(plan.kv_count)
    mask_mod = None
    if device == "cpu":
        # eager Flex (CPU) computes densely through mask_mod; compiled Flex skips unlisted blocks and never
        # evaluates mask_mod on full blocks, so on the GPU the default keeps one compiled kernel for all plans
        tiles = plan.to_dense_mask(N)

        def mask_mod(b, h, q_idx, kv_idx):
            return tiles[b, h, q_idx // plan.block_m, kv_idx // plan.block_n]

    bm = BlockMask.from_kv_blocks(zeros_cnt, torch.zeros_like(idx), plan.kv_count, idx, BLOCK_SIZE=plan.block_n,
                                  mask_mod=mask_mod, seq_lengths=(S, S))
    fn = make_flex.compiled
    if fn is None:
        fn = make_flex.compiled = torch.compile(flex_attention)
    return lambda q, k, v, scale: fn(q, k, v, block_mask=bm, scale=scale)


make_flex.compiled = None


def make_fa4(plan):
    """FA4 block-sparse (q, k, v in (B, S, H, D)); None when flash_attn.cute is not importable."""
    try:
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    except Exception:
        return None
    import torch

    if plan is None:
        return lambda q, k, v, scale: flash_attn_func(q, k, v, softmax_scale=scale)
    B, H, M, _ = plan.kv_index.shape
    zc = torch.zeros_like(plan.kv_count)
    zi = torch.zeros(B, H, M, 1, dtype=torch.int32, device=plan.kv_index.device)
    bst = BlockSparseTensorsTorch(mask_block_cnt=zc, mask_block_idx=zi, full_block_cnt=plan.kv_count,
                                  full_block_idx=plan.kv_index, block_size=(plan.block_m, plan.block_n))
    return lambda q, k, v, scale: flash_attn_func(q, k, v, softmax_scale=scale, block_sparse_tensors=bst)


def first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


# ------------------------------------------------------------------ main parts
def check_correctness(results, deadline):
    """Triton backends vs the torch reference on moderate problems (fresh random inputs)."""
    import torch

    from videosparse.kernels import block_sparse_attention, reference_attention
    from videosparse.sol.centroids import tile_centroids_torch

    dev = DEVICE
    cases = [  # B, H, S, D, dtype, plan kind, density, correction
        (1, 4, 8190, 128, torch.bfloat16, "random", 0.25, False),
        (1, 4, 8190, 128, torch.bfloat16, "random", 0.1, True),
        (1, 4, 8192, 128, torch.bfloat16, "dense", 1.0, False),
        (2, 3, 4000, 64, torch.float16, "banded", 0.3, True),
        (2, 3, 4000, 64, torch.bfloat16, "random", 0.5, False),
    ]
    for backend in ("gluon_hopper", "hopper", "triton_generic"):
        for B, H, S, D, dt, kind, dens, corr in cases:
            if time.time() > deadline:
                return
            torch.manual_seed(S + D)
            q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=dt) for _ in range(3))
            plan = banded_plan(B, H, S, dens, 128, dev) if kind == "banded" else random_plan(B, H, S, dens, 128, dev)
            if corr:
                plan = plan.with_correction(*tile_centroids_torch(k, v, 128))
            rec = dict(backend=backend, B=B, H=H, S=S, D=D, dtype=str(dt).split(".")[-1], plan=kind, density=dens,
                       correction=corr)
            try:
                out, lse = block_sparse_attention(q, k, v, plan, return_lse=True, backend=backend)
                ref, ref_lse = reference_attention(q, k, v, plan, D ** -0.5, return_lse=True)
                rec["rel_err"] = float((out.float() - ref.float()).norm() / ref.float().norm())
                rec["lse_max_err"] = float((lse - ref_lse).abs().max())
                rec["ok"] = rec["rel_err"] < 1.5e-2 and rec["lse_max_err"] < 5e-2 and bool(torch.isfinite(out).all())
            except Exception as e:  # recorded, the run goes on
                rec["ok"] = False
                rec["error"] = f"{type(e).__name__}: {e}"[:500]
            _log("check", rec)
            results["correctness"].append(rec)


def time_interleaved(fns, rounds, bench):
    """{name: [ms per round]}: every callable timed once per round, the order reversed every other round, so
    that clock and power drift (the H200 runs at its power cap) fall on all of them alike."""
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[name].append(bench(fns[name]))
    return times


def interleaved_ab(fns, flops, rounds):
    """Two or more callables with equal outputs timed in interleaved rounds (`time_interleaved`, do_bench medians):
    ({name: TFLOP/s at the median of its rounds}, {name: [ms per round]}, ||first - last|| / ||last|| of their
    outputs). flops: the work one call does."""
    from triton.testing import do_bench

    outs = [fn().float() for fn in fns.values()]
    diff = float((outs[0] - outs[-1]).norm() / outs[-1].norm())
    times = time_interleaved(fns, rounds, lambda fn: do_bench(fn, warmup=10, rep=80, return_mode="median"))
    return {n: flops / median(t) / 1e9 for n, t in times.items()}, times, diff


def bench_shape(name, results, args, deadline):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from videosparse.kernels import block_sparse_attention, select_backend
    from videosparse.sol.centroids import tile_centroids_torch

    B, H, S, D = SHAPES[name]
    dev = DEVICE
    dt = torch.bfloat16
    scale = D ** -0.5
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=dt) for _ in range(3))
    full_flops = 4.0 * S * S * D * B * H
    big = full_flops > 5e14
    bench = lambda fn: do_bench(fn, warmup=10 if big else 25, rep=60 if big else 100, return_mode="median")
    rows = results["rows"]

    def add(impl, plan_kind, target, density, ms_rounds, **extra):
        ms = median(ms_rounds)
        row = dict(shape=name, B=B, H=H, S=S, D=D, impl=impl, plan=plan_kind, target_density=target,
                   density=density, ms=ms, tflops=full_flops * density / (ms * 1e-3) / 1e12,
                   ms_rounds=[round(x, 4) for x in ms_rounds], **extra)
        rows.append(row)
        _log(f"{name:24s} {impl:14s} {plan_kind:7s} d={density:.3f} {ms:9.3f} ms {row['tflops']:7.1f} TFLOP/s"
             + "".join(f" {k}={v}" for k, v in extra.items()))
        return row

    def sdpa():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    ref_dense = sdpa()
    qt = kt = vt = None
    do_peers = (name in PEER_SHAPES) and not args.no_peers
    fa4_dense = make_fa4(None) if do_peers else None
    dense_peers = {"cudnn": sdpa}       # timed with ours on the dense plan, interleaved
    dense_extra = {"cudnn": {}}
    if fa4_dense is not None:
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        try:
            o = first(fa4_dense(qt, kt, vt, scale)).transpose(1, 2)
            err = float((o.float() - ref_dense.float()).norm() / ref_dense.float().norm())
            dense_peers["fa4"] = lambda: fa4_dense(qt, kt, vt, scale)
            dense_extra["fa4"] = dict(rel_err_vs_cudnn=round(err, 5))
        except Exception as e:
            _log("fa4 dense failed:", type(e).__name__, str(e)[:300])
            results["errors"].append(f"fa4 dense {name}: {type(e).__name__}: {str(e)[:300]}")
            qt = None
    cud = None

    densities = DENSITIES if not args.quick else [1.0, 0.25, 0.1, 0.05]
    for kind in ("random", "banded"):
        for target in densities:
            if kind == "banded" and target >= 1.0:
                continue
            if time.time() > deadline:
                results["errors"].append(f"deadline: skipped {name} {kind} {target} and later")
                return
            plan = (random_plan(B, H, S, target, 128, dev) if kind == "random"
                    else banded_plan(B, H, S, target, 128, dev))
            dens = plan_density(plan, S)

            def ours_fn(p):   # what users run: the auto backend, plan already validated
                return block_sparse_attention(q, k, v, p, scale=scale, validate=False)

            out = ours_fn(plan)
            fns = {"ours": lambda p=plan: ours_fn(p)}
            extra = {"ours": {"backend": select_backend(q, k, v, plan).name}}
            if target >= 1.0:
                extra["ours"]["rel_err_vs_cudnn"] = round(float((out.float() - ref_dense.float()).norm()
                                                                / ref_dense.float().norm()), 5)
                for peer, fn in dense_peers.items():
                    fns[peer + "@dense"] = fn
            if target < 1.0 and (kind == "random" or name == "12x32768 d128"):
                cplan = plan.with_correction(*tile_centroids_torch(k, v, 128))
                ours_fn(cplan)
                fns["ours+corr"] = lambda: ours_fn(cplan)
            if do_peers and (kind == "random" or name == "12x32768 d128"):
                try:
                    flex = make_flex(plan, S, dev)
                    o = flex(q, k, v, scale)
                    extra["flex"] = dict(rel_err_vs_ours=round(float((o.float() - out.float()).norm()
                                                                     / out.float().norm()), 5))
                    fns["flex"] = lambda flex=flex: flex(q, k, v, scale)
                except Exception as e:
                    _log("flex failed:", type(e).__name__, str(e)[:300])
                    results["errors"].append(f"flex {name} {kind} {target}: {type(e).__name__}: {str(e)[:300]}")
                if qt is not None:
                    try:
                        fa4 = make_fa4(plan)
                        o = first(fa4(qt, kt, vt, scale)).transpose(1, 2)
                        extra["fa4"] = dict(rel_err_vs_ours=round(float((o.float() - out.float()).norm()
                                                                        / out.float().norm()), 5))
                        fns["fa4"] = lambda fa4=fa4: fa4(qt, kt, vt, scale)
                    except Exception as e:
                        _log("fa4 failed:", type(e).__name__, str(e)[:300])
                        results["errors"].append(f"fa4 {name} {kind} {target}: {type(e).__name__}: {str(e)[:300]}")
            times = time_interleaved(fns, args.rounds, bench)
            for peer in dense_peers:
                if peer + "@dense" in times:
                    r = add(peer, "dense", 1.0, 1.0, times[peer + "@dense"], **dense_extra[peer])
                    cud = r if peer == "cudnn" else cud
            ours = add("ours", kind, target, dens, times["ours"], **extra["ours"])
            if cud is not None:
                ours["speedup_vs_cudnn"] = cud["ms"] / ours["ms"]
            if "ours+corr" in times:
                crow = add("ours+corr", kind, target, dens, times["ours+corr"])
                crow["overhead"] = round(crow["ms"] / ours["ms"] - 1, 4)
                if cud is not None:
                    crow["speedup_vs_cudnn"] = cud["ms"] / crow["ms"]
            for peer in ("flex", "fa4"):
                if peer in times:
                    pr = add(peer, kind, target, dens, times[peer], **extra[peer])
                    ours["ratio_" + peer] = pr["ms"] / ours["ms"]
            del plan


def bench_variants(results, args, deadline):
    """Kernel variants at 12 x 32768 (and 32760: partial-tile mask), head dim 128 and 64."""
    import torch
    from triton.testing import do_bench

    from videosparse.kernels import block_sparse_attention
    from videosparse.kernels.gluon_hopper import default_late_k_release, gluon_attention
    from videosparse.kernels.triton_generic import generic_attention
    from videosparse.kernels.triton_hopper import hopper_attention

    dev = DEVICE
    for S, D in ((32768, 128), (32760, 128), (32768, 64)):
        B, H = 1, 12
        torch.manual_seed(1)
        q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
        flops = 4.0 * S * S * D * B * H
        for target in (1.0, 0.1, 0.05):
            plan = random_plan(B, H, S, target, 128, dev)
            dens = plan_density(plan, S)
            variants = {
                "default": lambda: block_sparse_attention(q, k, v, plan, validate=False),
                "triton_hopper": lambda: hopper_attention(q, k, v, plan, D ** -0.5),
                "triton_hopper_no_ws": lambda: hopper_attention(q, k, v, plan, D ** -0.5, warp_specialize=False),
                "generic": lambda: generic_attention(q, k, v, plan, D ** -0.5),
            }
            variants["gluon_1_q_buffer_cross"] = lambda: gluon_attention(q, k, v, plan, D ** -0.5, q_buffers=1)
            variants["gluon_register_store"] = lambda: gluon_attention(q, k, v, plan, D ** -0.5, tma_store=False)
            variants["gluon_no_tail_split"] = lambda: gluon_attention(q, k, v, plan, D ** -0.5, split_tail=False)
            # the step's releases at the other point than this head dim's default (`default_late_k_release`)
            variants["gluon_k_release_flipped"] = lambda: gluon_attention(
                q, k, v, plan, D ** -0.5, late_k_release=not default_late_k_release(D))
            # K stage released early, only the conditional Q release after the softmax (same SASS overlap)
            variants["gluon_late_q_only"] = lambda: gluon_attention(q, k, v, plan, D ** -0.5, late_k_release=False,
                                                                    late_q_release=True)
            # an item's first softmax not under the previous item's last P.V (the default before this run)
            variants["gluon_no_first_overlap"] = lambda: gluon_attention(q, k, v, plan, D ** -0.5,
                                                                         first_step_overlap=False)
            # each consumer decodes the work unit with its own global loads (default: the loader hands it over)
            variants["gluon_no_unit_handoff"] = lambda: gluon_attention(q, k, v, plan, D ** -0.5, unit_handoff=False)
            if D == 64:     # deeper K/V rings fit next to two Q buffers only at head dim 64
                for st in (3, 4):
                    variants[f"gluon_{st}_stages"] = (
                        lambda st=st: gluon_attention(q, k, v, plan, D ** -0.5, num_stages=st))
            if time.time() > deadline:
                results["errors"].append("deadline: variants cut short")
                return
            base = None     # the default variant's output (checked against the reference above)
            diffs, runnable = {}, {}
            for vname, fn in variants.items():
                try:
                    out = fn().float()
                    base = out if base is None else base
                    finite = bool(torch.isfinite(out).all())
                    diffs[vname] = float((out - base).norm() / base.norm()) if finite else float("nan")
                    runnable[vname] = fn
                except Exception as e:
                    rec = dict(S=S, D=D, target_density=target, variant=vname,
                               error=f"{type(e).__name__}: {str(e)[:300]}")
                    _log("variant", rec)
                    results["variants"].append(rec)
            times = time_interleaved(runnable, args.rounds, lambda fn: do_bench(fn, warmup=25, rep=100,
                                                                                return_mode="median"))
            for vname, ms_rounds in times.items():
                ms = median(ms_rounds)
                rec = dict(S=S, D=D, H=H, target_density=target, density=dens, variant=vname, ms=ms,
                           tflops=flops * dens / (ms * 1e-3) / 1e12, ms_rounds=[round(x, 4) for x in ms_rounds],
                           rel_diff_vs_default=diffs[vname], ok=bool(diffs[vname] < 1e-2))
                _log("variant", rec)
                results["variants"].append(rec)


ITEM_SWEEP = dict(B=1, H=48, S=32768, head_dims=(128, 64), counts=(8, 16, 32, 64), dtype="bfloat16")


def fixed_count_plan(B, H, S, n, block, device, seed=1):
    """Every query tile lists exactly n random key tiles (sorted): all work items equally long, with their work
    order attached as `topk_plan` attaches it (so the kernels do not sort per call)."""
    import torch

    from videosparse.plan import Plan, row_order

    M = math.ceil(S / block)
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.rand(B, H, M, M, device=device, generator=g).topk(n, dim=-1).indices.sort(-1).values
    count = torch.full((B, H, M), n, dtype=torch.int32, device=device)
    return Plan(idx.to(torch.int32).contiguous(), count, block, block, order=row_order([n] * M, B * H, device))


def fit_item_cost(points):
    """Least-squares fit of us per wave = fixed + n * per_tile over (n, us_per_wave) points."""
    import numpy as np

    per_tile, fixed = np.polyfit([n for n, _ in points], [t for _, t in points], 1)
    return dict(fixed_us=float(fixed), per_tile_us=float(per_tile))


def bench_item_sweep(results, args, deadline):
    """Where the time of a work item goes: plans with exactly n key tiles per query tile (n = 8..64) at 48 heads
    of 32,768 tokens (12,288 items, counted as ceil(12,288 / 132) = 94 waves of 132: the tail split spreads the
    last wave's 12 items, so the per-wave times, and both terms of the fit, read ~1% low), ours (and FA4
    block-sparse with the same plans, unless --no-peers or not importable) timed in interleaved rounds; fits the
    time per wave of work items as fixed + n * per-tile cost for each (the fixed part is what sparse plans pay more
    than dense per tile). Rows carry `impl`; the entry's top-level fit is ours, `fits` holds every
    implementation's."""
    import torch
    from triton.testing import do_bench

    from videosparse.kernels import block_sparse_attention

    B, H, S = ITEM_SWEEP["B"], ITEM_SWEEP["H"], ITEM_SWEEP["S"]
    for D in ITEM_SWEEP["head_dims"]:
        torch.manual_seed(2)
        q, k, v = (torch.randn(B, H, S, D, device=DEVICE, dtype=getattr(torch, ITEM_SWEEP["dtype"])) for _ in range(3))
        items = B * H * math.ceil(S / 128)
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        waves = math.ceil(items / sms)
        plans = {n: fixed_count_plan(B, H, S, n, 128, DEVICE) for n in ITEM_SWEEP["counts"]}
        fns = {("ours", n): (lambda p=p, qkv=(q, k, v): block_sparse_attention(*qkv, p, validate=False))
               for n, p in plans.items()}
        if not getattr(args, "no_peers", False) and q.is_cuda:
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            for n, p in plans.items():
                fa4 = make_fa4(p)
                if fa4 is None:
                    break
                try:
                    o = first(fa4(qt, kt, vt, D ** -0.5)).transpose(1, 2).float()
                    ref = fns[("ours", n)]().float()
                    err = float((o - ref).norm() / ref.norm())
                    if err > 2e-2:
                        raise RuntimeError(f"FA4 differs from ours by {err:.3g} (rel. L2)")
                    fns[("fa4", n)] = lambda fa4=fa4, qkv=(qt, kt, vt): fa4(*qkv, D ** -0.5)
                except Exception as e:
                    results["errors"].append(f"item sweep fa4 d{D} n={n}: {type(e).__name__}: {str(e)[:300]}")
                    break
        if time.time() > deadline:
            results["errors"].append("deadline: item sweep skipped")
            return
        times = time_interleaved(fns, args.rounds, lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median"))
        rows = [dict(impl=impl, D=D, H=H, S=S, n=n, items=items, waves=waves, ms=median(t),
                     ms_rounds=[round(x, 4) for x in t], us_per_wave=median(t) * 1e3 / waves)
                for (impl, n), t in times.items()]
        fits = {}
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = [(r["n"], r["us_per_wave"]) for r in rows if r["impl"] == impl]
            if len(pts) == len(plans):          # a peer that failed part-way gets no fit
                fits[impl] = fit_item_cost(pts)
        results["item_sweep"].append(dict(D=D, rows=rows, **fits["ours"], fits=fits))
        for impl, fit in fits.items():
            _log(f"item sweep d{D} {impl}: fixed {fit['fixed_us']:.2f} us per work item, "
                 f"{fit['per_tile_us']:.3f} us per key tile")


# ------------------------------------------------------------------ report
def render_markdown(results) -> str:
    """README table: per shape and density, ours vs cuDNN dense, Flex and FA4 (random top-k plans)."""
    meta = results.get("meta", {})
    rows = results["rows"]
    versions = f"torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}"
    out = [f"Kernel benchmark on {meta.get('gpu', '?')} ({versions}), "
           "bf16, 128x128 tiles, random top-k plans; TFLOP/s on kept tiles (4·S²·D·H·density / time).", "",
           "| shape | density | ours ms | ours TFLOP/s | +correction | vs cuDNN dense | Flex TFLOP/s | FA4 TFLOP/s "
           "| ours / FA4 |",
           "|---|---|---|---|---|---|---|---|---|"]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        sub = [r for r in rows if r["shape"] == shape]
        cud = next((r for r in sub if r["impl"] == "cudnn"), None)
        for r in sub:
            if r["impl"] != "ours" or r["plan"] != "random":
                continue
            td = r["target_density"]
            pick = lambda impl: next((x for x in sub if x["impl"] == impl and x["target_density"] == td
                                      and x["plan"] == "random"), None)
            corr, flex, fa4 = pick("ours+corr"), pick("flex"), pick("fa4")
            cell = lambda x, f: f.format(x) if x is not None else "–"
            out.append("| {} | {:.3f} | {:.2f} | {:.0f} | {} | {} | {} | {} | {} |".format(
                shape, r["density"], r["ms"], r["tflops"],
                cell(corr and corr["overhead"] * 100, "{:+.1f}%"),
                cell(cud and cud["ms"] / r["ms"], "{:.2f}×"),
                cell(flex and flex["tflops"], "{:.0f}"), cell(fa4 and fa4["tflops"], "{:.0f}"),
                cell(fa4 and fa4["ms"] / r["ms"], "{:.2f}")))
        if cud is not None:
            out.append(f"| {shape} | cuDNN dense | {cud['ms']:.2f} | {cud['tflops']:.0f} | | 1.00× | | | |")
    return "\n".join(out)


VARIANT_LABELS = {  # bench_variants name: README label
    "default": "Gluon, pipeline across items, TMA-store epilogue, last wave split (default)",
    "gluon_no_tail_split": "Gluon, across items, last wave not split",
    "gluon_k_release_flipped": "Gluon, across items, releases at the other point (d128: early, d64: late)",
    "gluon_late_q_only": "Gluon, across items, K released early, Q release after the softmax",
    "gluon_no_first_overlap": "Gluon, across items, an item's first softmax not under the last P.V",
    "gluon_no_unit_handoff": "Gluon, across items, each consumer loads the unit's item and count itself",
    "gluon_register_store": "Gluon, across items, outputs stored from registers",
    "gluon_1_q_buffer_cross": "Gluon, across items, 1 Q buffer",
    "gluon_p_in_smem": "Gluon, across items, P in shared memory (1 Q buffer at d128; removed)",
    "gluon_3_stages": "Gluon, across items, 3 K/V stages",
    "gluon_4_stages": "Gluon, across items, 4 K/V stages",
    "gluon_no_cross": "Gluon, pipeline per item (removed)",
    "gluon_1_q_buffer": "Gluon, per item, 1 Q buffer (removed)",
    "gluon_pingpong": "Gluon, per item, FA3 ping-pong (removed)",
    "triton_hopper": "Triton Hopper kernel (TMA + automatic warp specialization)",
    "triton_hopper_no_ws": "Triton Hopper kernel without warp specialization",
    "generic": "generic Triton kernel",
}


def render_variants(results) -> str:
    """The table of the "variants" part (docs/kernel_notes.md): TFLOP/s on kept tiles per variant and (S, D,
    density)."""
    recs = [r for r in results.get("variants", []) if "tflops" in r]
    if not recs:
        return ""
    cols = list(dict.fromkeys((r["S"], r["D"], r["target_density"]) for r in recs))
    head = ["variant"] + [f"{S} d{D} {t:g}" for S, D, t in cols]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in dict.fromkeys([n for n in VARIANT_LABELS] + [r["variant"] for r in recs]):
        cells = []
        for key in cols:
            hit = next((r for r in recs if r["variant"] == name and (r["S"], r["D"], r["target_density"]) == key), None)
            # a variant whose output differs from the default's is marked: its time is of another computation
            cells.append("–" if not hit else f"{hit['tflops']:.0f}" + ("" if hit.get("ok", True) else " (wrong)"))
        if any(c != "–" for c in cells):
            out.append("| " + " | ".join([VARIANT_LABELS.get(name, name)] + cells) + " |")
    return "\n".join(out)


def write_json(path, results) -> None:
    """Write `results` to `path` atomically (`videosparse._io.write_atomic`: a temporary file beside it, then
    a rename): a run stopped mid-write leaves the JSON of the step before."""
    from .._io import write_atomic

    write_atomic(path, json.dumps(results, indent=1))


# bf16 outputs of two correct kernels differ by ~4e-3 relative; a peer or variant past this computed something else
AGREEMENT_TOL = 1.5e-2


def disagreements(results) -> list[str]:
    """The timed rows whose output disagrees with ours (a peer's `rel_err_vs_ours`), with cuDNN (`rel_err_vs_cudnn`)
    or with the default kernel (a variant's `rel_diff_vs_default`) by more than AGREEMENT_TOL, or is not finite: their
    times are of another computation."""
    bad = []
    for r in results.get("rows", []):
        for key in ("rel_err_vs_ours", "rel_err_vs_cudnn"):
            if key in r and not r[key] <= AGREEMENT_TOL:      # NaN fails too
                bad.append(f"{r.get('impl')} {r.get('shape')} {r.get('plan')} {r.get('target_density')}: "
                           f"{key}={r[key]}")
    for r in results.get("variants", []):
        if "tflops" in r and not r.get("ok", True):
            bad.append(f"variant {r['variant']} S={r['S']} D={r['D']} {r['target_density']}: "
                       f"rel_diff_vs_default={r.get('rel_diff_vs_default')}")
    return bad


def exit_code(results) -> int:
    """1 when a correctness check failed (ours against the reference, or a peer or variant timed beside ours that
    disagrees with it: `disagreements`) or a step raised (the deadline's notes aside), else 0."""
    failed = any(not c["ok"] for c in results["correctness"]) or bool(disagreements(results))
    return int(failed or any(not e.startswith("deadline:") for e in results["errors"]))


def report_tables(results) -> str:
    """The markdown tables of a run: `render_markdown` and `render_variants`."""
    return render_markdown(results) + "\n\n" + render_variants(results)


def readme_tables(path) -> str:
    """`report_tables` of an earlier run's JSON at `path` (ValueError naming the path when it cannot be read as JSON,
    or is not a kernel benchmark's)."""
    what = "not a kernel benchmark JSON (written by `videosparse bench` or scripts/bench_kernel.py)"
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:        # missing, unreadable, not JSON
        raise ValueError(f"--readme {path}: cannot be read as JSON: {err}") from None
    if not isinstance(results, dict) or not isinstance(results.get("rows"), list):
        raise ValueError(f"--readme {path}: {what}: no list of 'rows'.")
    # another JSON with a list of rows (the A/B files in benchmarks/): its rows lack the benchmark's fields
    keys = {"impl", "shape"}
    bad = next(((i, r) for i, r in enumerate(results["rows"]) if not isinstance(r, dict) or not keys <= set(r)), None)
    if bad is not None:
        i, row = bad
        why = f"lacks {sorted(keys - set(row))}" if isinstance(row, dict) else f"is a JSON {type(row).__name__}"
        raise ValueError(f"--readme {path}: {what}: rows[{i}] {why}, where a benchmark row is an object with 'impl', "
                         "'shape', 'plan', 'ms', ...")
    try:
        return report_tables(results)
    except (KeyError, TypeError, ValueError, AttributeError) as err:      # a damaged row
        raise ValueError(f"--readme {path}: {what}: a row cannot be read ({type(err).__name__}: {err}).") from None


def run_benchmark(options) -> dict:
    """The benchmark on the GPU: the correctness checks, then the timings of `options.shapes` (all, or the quick set
    with `options.quick`), the variants and the item sweep, most important first; the JSON at `options.out` is
    rewritten after each step. Returns the results (`exit_code` tells whether they pass).

    options: any object with the command's options as attributes (quick, out, shapes, no_peers, no_variants,
    item_sweep, rounds, deadline_s)."""
    import torch
    import triton

    t0 = time.time()
    deadline = t0 + options.deadline_s
    results = dict(meta=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                             shapes=SHAPES, densities=DENSITIES, dtype="bfloat16", block=128, quick=options.quick,
                             rounds=options.rounds,
                             date=time.strftime("%Y-%m-%d %H:%M")),
                   correctness=[], rows=[], variants=[], item_sweep=[], errors=[])
    try:
        import flash_attn.cute  # noqa: F401
        results["meta"]["fa4"] = "importable"
    except Exception as e:
        results["meta"]["fa4"] = f"not importable: {type(e).__name__}: {str(e)[:200]}"
    out_path = Path(options.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        results["meta"]["wall_s"] = round(time.time() - t0, 1)
        write_json(out_path, results)

    results["meta"]["gpu_state_start"] = gpu_state()
    check_correctness(results, deadline)
    save()
    bad = [c for c in results["correctness"] if not c["ok"]]
    if bad:
        _log(f"CORRECTNESS FAILED for {len(bad)} case(s); timing anyway, but the numbers are suspect")
    shapes = options.shapes if options.shapes is not None else (QUICK_SHAPES if options.quick else list(SHAPES))
    # most important first: the target shape, Wan 14B, head dim 64, the variants, then the rest
    steps = [n for n in shapes if n in PEER_SHAPES] + (["variants"] if not options.no_variants else []) \
        + (["item sweep"] if options.item_sweep else []) + [n for n in shapes if n not in PEER_SHAPES]
    for name in steps:
        try:
            if name == "variants":
                bench_variants(results, options, deadline)
            elif name == "item sweep":
                bench_item_sweep(results, options, deadline)
            else:
                bench_shape(name, results, options, deadline)
        except Exception:
            results["errors"].append(f"{name}: {traceback.format_exc()[-800:]}")
            _log(traceback.format_exc())
        save()
        torch.cuda.empty_cache()
    results["meta"]["gpu_state_end"] = gpu_state()
    save()
    return results
