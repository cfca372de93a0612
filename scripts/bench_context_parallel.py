"""Sparse attention under Ulysses context parallelism (GPU, several processes): one synthetic forward per method.

    torchrun --nproc-per-node 2 scripts/bench_context_parallel.py --model wan-14b --out benchmarks/cp_h200x2.json

Every rank builds the same real-size transformer (random weights, `videosparse.eval.synthetic_models`), first times it on
its own GPU (no parallelism: dense and each method), then calls diffusers' `enable_parallelism(
ContextParallelConfig(ulysses_degree=P))` and times the same methods with the sequence split over the P GPUs. Each
method's parallel output is compared with its single-GPU output (reported as rel_l2_vs_single_gpu, not
asserted: every rank plans its own heads over the whole sequence, so the plans are the same), and rank 0 writes the
table and the JSON.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from videosparse.eval.report import save_report
from videosparse.eval.spec import parse_method_specs
from videosparse.eval.synthetic import check_run_options, time_method
from videosparse.eval.synthetic_models import (build_transformer, check_feasible, check_supported, count_parameters,
                                               make_inputs, synthetic_setup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="wan-14b")
    p.add_argument("--methods", nargs="+", default=["dense", "veda@0.25", "veda@0.1", "veda@0.05"])
    p.add_argument("--layers", type=int, default=None, help="build only this many blocks (default: all)")
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU, fp32 (a smoke run at a small size)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    try:
        check_run_options(None, 1, args.repeats)
    except ValueError as e:
        p.error(str(e))

    from diffusers.models._modeling_parallel import ContextParallelConfig

    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cpu:
        device, dtype = torch.device("cpu"), torch.float32
        torch.accelerator.device_count = lambda: 1     # diffusers places rank r on accelerator r % device_count()
    else:
        device, dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))), torch.bfloat16
        torch.cuda.set_device(device)
    setup = synthetic_setup(args.model, args.frames, args.height, args.width, args.layers)
    check_supported(setup)
    check_feasible(setup, device, dtype, count_parameters(setup))
    transformer = build_transformer(setup, device, dtype)
    inputs = make_inputs(setup, device, dtype)
    specs = parse_method_specs(args.methods)

    single, outputs = {}, {}
    for spec in specs:
        single[spec.label], outputs[spec.label] = time_method(transformer, inputs, spec, warmup=1,
                                                              repeats=args.repeats)
    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    rows = []
    for spec in specs:
        row, out = time_method(transformer, inputs, spec, warmup=1, repeats=args.repeats)
        ref = outputs[spec.label].float()
        rows.append({
            "method": spec.label, "single_gpu_forward_s": single[spec.label]["forward_s"],
            "parallel_forward_s": row["forward_s"], "parallel_attention_s": row["attention_s"],
            "realised_density": row["realised_density"], "fallbacks": row["fallbacks"],
            "sparse_calls": row["sparse_calls"], "dense_calls": row["dense_calls"],
            "rel_l2_vs_single_gpu": float((out.float() - ref).norm() / ref.norm()),
        })
    if rank == 0:
        dense, name = rows[0], "CPU" if args.cpu else torch.cuda.get_device_name(device)
        print(f"{args.model}: grid {setup.grid} ({setup.tokens} tokens), Ulysses over {world} GPUs "
              f"({name})")
        print(f"{'method':<12} {'1 GPU s':>8} {'speedup':>8} {f'{world} GPUs s':>9} {'speedup':>8} "
              f"{'scaling':>8} {'rel L2 vs 1 GPU':>16}  fallbacks")
        for r in rows:
            print(f"{r['method']:<12} {r['single_gpu_forward_s']:8.3f} "
                  f"{dense['single_gpu_forward_s'] / r['single_gpu_forward_s']:7.2f}x "
                  f"{r['parallel_forward_s']:9.3f} {dense['parallel_forward_s'] / r['parallel_forward_s']:7.2f}x "
                  f"{r['single_gpu_forward_s'] / r['parallel_forward_s']:7.2f}x {r['rel_l2_vs_single_gpu']:16.2e}  "
                  f"{r['fallbacks'] or '-'}")
        if args.out:
            save_report({"model": args.model, "grid": setup.grid, "tokens": setup.tokens, "world_size": world,
                         "device": name, "repeats": args.repeats, "rows": rows}, args.out)
            print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
