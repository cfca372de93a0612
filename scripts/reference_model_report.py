#!/usr/bin/env python
"""Report on the reference model: prompt adherence and attention structure, trained vs random weights.

    python scripts/reference_model_report.py                      # CPU, shipped weights
    python scripts/reference_model_report.py --device cuda --sweep  # also a guidance / steps sweep

Writes JSON (default benchmarks/reference_model.json) with
* adherence: for the 32 fixed prompts of `reference_eval.ADHERENCE_PROMPTS`, the fraction whose generated
  object has the prompted colour and moves in the prompted direction (trained, and random weights);
* attention: per self-attention layer, the fraction of attention mass the top 10% of 128-token key tiles
  hold per query tile, chosen by the oracle (the dense attention itself), trained vs random, for two
  tile shapes; "uniform" is what evenly spread attention would give;
* with `--sparse-methods`: the adherence of the trained model under each sparse attention config.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

# sections of benchmarks/reference_model.json written by other runs (the training script's record, the CPU check)
KEPT_SECTIONS = ("training", "cpu_check")


def _public(config) -> dict:
    """A diffusers config without its private `_...` entries."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default=None, help="saved pipeline folder (default: the shipped weights)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="benchmarks/reference_model.json")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the pipeline default)")
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--shift", type=float, default=None,
                   help="sampler time shift for the trained model (default: the saved scheduler's, 2.0)")
    p.add_argument("--num-prompts", type=int, default=None, help="first N adherence prompts (default: all 32)")
    p.add_argument("--attn-prompts", type=int, default=2, help="prompts for the attention-mass measurement")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--direction-probe", action="store_true",
                   help="also measure the x0 error with the true vs the opposite direction word (reference_eval."
                        "direction_prompt_gap)")
    p.add_argument("--sweep", action="store_true", help="also sweep guidance and steps (trained model)")
    p.add_argument("--sparse-methods", nargs="+", default=None, metavar="SPEC",
                   help="also score adherence with sparse attention applied (evaluate's method specs, e.g. veda@0.1 "
                        "sol@0.25); bf16 on CUDA (the Triton kernels), float32 on the CPU")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import diffusers

    from videosparse.models import reference as ref
    from videosparse.models.reference_eval import (
        ADHERENCE_PROMPTS,
        adherence_rate,
        attention_tile_mass,
        direction_prompt_gap,
        direction_word_separation,
    )

    steps = args.steps or ref.DEFAULT_NUM_INFERENCE_STEPS
    guidance = args.guidance if args.guidance is not None else ref.DEFAULT_GUIDANCE_SCALE
    size = dict(num_frames=ref.DEFAULT_NUM_FRAMES, height=ref.DEFAULT_HEIGHT, width=ref.DEFAULT_WIDTH)
    prompts = ADHERENCE_PROMPTS[:args.num_prompts] if args.num_prompts else ADHERENCE_PROMPTS
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # keep fp32 numbers close to the CPU's

    trained = ref.load_reference_pipeline(args.device, torch.float32, path=args.weights)
    if args.shift is not None:
        trained.scheduler = type(trained.scheduler).from_config(trained.scheduler.config, shift=args.shift)
    # random weights of the same architecture as the trained ones
    random_pipe = ref.build_reference_pipeline(
        seed=0, transformer_overrides=_public(trained.transformer.config),
        text_overrides={k: v for k, v in _public(trained.text_encoder.config).items() if k != "vocab_size"},
    ).to(args.device)
    random_pipe.set_progress_bar_config(disable=True)
    weights_dir = args.weights or ref.REFERENCE_WEIGHTS_DIR
    weight_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(weights_dir)
                       for f in fs if f.endswith(".safetensors"))
    train_cfg_path = os.path.join(weights_dir, "train_config.json")

    report: dict = {
        "model": {
            "weights": os.path.relpath(weights_dir),
            "safetensors_bytes": weight_bytes,
            "transformer_params": sum(q.numel() for q in trained.transformer.parameters()),
            "text_encoder_params": sum(q.numel() for q in trained.text_encoder.parameters()),
            "transformer_config": _public(trained.transformer.config),
            "text_encoder_config": _public(trained.text_encoder.config),
            "train_config": json.load(open(train_cfg_path)) if os.path.isfile(train_cfg_path) else None,
        },
        "call": {**size, "num_inference_steps": steps, "guidance_scale": guidance,
                 "scheduler_shift": trained.scheduler.config.shift,
                 "video_tokens": int(torch.tensor(ref.video_token_grid(**size)).prod())},
        "environment": {"device": args.device, "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda")
                        else None, "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
                        "diffusers": diffusers.__version__, "python": platform.python_version()},
    }

    def timed(fn):
        t0 = time.time()
        out = fn()
        return out, round(time.time() - t0, 2)

    # near 0: the text encoder has merged "left" with "right" (and "up" with "down"), see reference_eval
    report["direction_word_separation"] = {"trained": direction_word_separation(trained),
                                           "random": direction_word_separation(random_pipe)}
    print(f"direction word separation (opposite / other axis): trained "
          f"{report['direction_word_separation']['trained']['opposite_over_axis']:.3f}, random "
          f"{report['direction_word_separation']['random']['opposite_over_axis']:.3f}", flush=True)

    if args.direction_probe:
        report["direction_prompt_gap"] = {"trained": direction_prompt_gap(trained),
                                          "random": direction_prompt_gap(random_pipe)}
        gap = report["direction_prompt_gap"]["trained"]
        print("x0 error with the true / opposite direction word per noise level: "
              + ", ".join(f"{s}: {c:.4f} / {o:.4f}" for s, c, o in zip(gap["sigma"], gap["correct"], gap["opposite"])),
              flush=True)

    adherence = {}
    for name, pipe in (("trained", trained), ("random", random_pipe)):
        res, secs = timed(lambda: adherence_rate(pipe, prompts, num_inference_steps=steps, guidance_scale=guidance,
                                                 batch_size=args.batch_size, **size))
        res["seconds"] = secs
        adherence[name] = res
        print(f"adherence {name}: {res['rate']:.3f} (colour {res['color_rate']:.3f}, direction "
              f"{res['direction_rate']:.3f}) in {secs}s", flush=True)
    report["adherence"] = adherence

    attention = {}
    attn_prompts = ADHERENCE_PROMPTS[:: max(1, len(ADHERENCE_PROMPTS) // max(1, args.attn_prompts))][:args.attn_prompts]
    for tile in ((4, 4, 8), (2, 8, 8)):
        key = "x".join(map(str, tile))
        attention[key] = {}
        for name, pipe in (("trained", trained), ("random", random_pipe)):
            res, secs = timed(lambda: attention_tile_mass(pipe, attn_prompts, num_inference_steps=steps,
                                                          guidance_scale=guidance, tile=tile, **size))
            res["seconds"] = secs
            attention[key][name] = res
            print(f"top-10% tile mass {key} {name}: mean {res['mean']:.3f} per layer "
                  f"{ {k: round(v, 3) for k, v in res['per_layer'].items()} } (uniform {res['uniform']:.3f})",
                  flush=True)
    report["attention_top10_tile_mass"] = {"prompts": list(attn_prompts), **attention}

    if args.sparse_methods:
        import videosparse
        from videosparse.eval.spec import parse_method_specs

        specs = parse_method_specs(args.sparse_methods)         # validated before any generation
        sparse_dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        sparse_pipe = ref.load_reference_pipeline(args.device, sparse_dtype, path=args.weights)
        sparse_pipe.scheduler = trained.scheduler
        methods = {}
        for spec in specs:
            if not spec.is_dense:
                videosparse.apply(sparse_pipe, spec.config)
            try:
                res, secs = timed(lambda: adherence_rate(sparse_pipe, prompts, num_inference_steps=steps,
                                                         guidance_scale=guidance, batch_size=args.batch_size, **size))
            finally:
                if not spec.is_dense:
                    videosparse.remove(sparse_pipe)
            methods[spec.label] = {"config": spec.config.to_dict(), "seconds": secs,
                                   **{k: res[k] for k in ("rate", "color_rate", "direction_rate", "num_prompts")}}
            print(f"adherence {spec.label} ({sparse_dtype}): {res['rate']:.3f} (colour {res['color_rate']:.3f}, "
                  f"direction {res['direction_rate']:.3f}) in {secs}s", flush=True)
        report["adherence_sparse"] = {"dtype": str(sparse_dtype), "methods": methods}

    if args.sweep:
        sweep = []
        for g, n in [(1.0, steps), (2.5, steps), (4.0, steps), (6.0, steps), (guidance, 6), (guidance, 16),
                     (guidance, 25)]:
            res, secs = timed(lambda: adherence_rate(trained, prompts, num_inference_steps=n, guidance_scale=g,
                                                     batch_size=args.batch_size, **size))
            sweep.append({"guidance_scale": g, "num_inference_steps": n, "rate": res["rate"],
                          "color_rate": res["color_rate"], "direction_rate": res["direction_rate"],
                          "seconds": secs})
            print(f"sweep guidance {g} steps {n}: {res['rate']:.3f}", flush=True)
        report["sweep"] = sweep

    # sections this script does not write (the training run's record, the CPU check) stay as the file has them
    try:
        with open(args.out) as f:
            kept = {k: v for k, v in json.load(f).items() if k in KEPT_SECTIONS}
    except (OSError, ValueError, AttributeError):
        kept = {}
    report = {**report, **{k: v for k, v in kept.items() if k not in report}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}" + (f" (kept its {', '.join(sorted(kept))})" if kept else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
