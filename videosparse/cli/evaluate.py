"""`videosparse evaluate`: its arguments, its option checks, the run (a quality grid or `--synthetic` speed) and
the tables it prints.

    videosparse evaluate --methods dense veda@0.5 sol@0.5 veda@0.1:dense_steps=0.2 \\
        --num-prompts 2 --seeds 0 --steps 8 --out eval_out
    videosparse evaluate --synthetic wan-1.3b wan-14b --methods veda@0.25 veda@0.1 veda@0.05 --out eval_syn

Method specs: see `videosparse.eval.spec` (NAME[@DENSITY][:KEY=VALUE...]).
"""

from __future__ import annotations

import argparse
import math
import os

from .._run_checks import check_device, check_output, check_seed
from ..config import BACKENDS
from ..eval.report import calls_per_forward
from ..eval.spec import check_spec_files, parse_method_specs
from ..eval.synthetic import default_synthetic_specs
from ..eval.synthetic_models import SYNTHETIC_MODELS
from .common import DTYPES, add_model_args, check_model

DEFAULT_METHODS = ["dense", "veda@0.25", "veda@0.1", "sol@0.25", "sol@0.1"]


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("evaluate", help="quality and speed of a method grid vs dense (or --synthetic speed mode)",
                       parents=[common])
    add_model_args(p)
    add_arguments(p)
    p.set_defaults(func=run)


def _ints(text: str) -> list[int]:
    """A comma-separated list of at least one index >= 0 (a step or a layer); argparse's error otherwise."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers, e.g. 0,4,9") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} samples nothing: give at least one index, e.g. 0,4,9, or leave the "
                                         "flag out (its default)")
    if negative := [x for x in values if x < 0]:
        raise argparse.ArgumentTypeError(f"{text!r} holds {negative}: indices count from 0")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The evaluate subcommand's own arguments (`add_parser` adds the model arguments)."""
    p.add_argument("--methods", nargs="+", default=None, metavar="SPEC",
                   help="method grid, NAME[@DENSITY][:KEY=VALUE...], e.g. dense veda@0.5 sol@0.5 "
                        "veda@0.1:dense_steps=0.2 sol:tau=1.5 (dense is always added as the reference; default: "
                        f"{' '.join(DEFAULT_METHODS)}; synthetic: {' '.join(default_synthetic_specs())})")
    p.add_argument("--backend", default=None, choices=list(BACKENDS),
                   help="kernel backend for specs that do not name one")
    p.add_argument("--out", default="eval_out", help="output directory (a rerun skips the cells already in it)")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh: discard report.json in --out and run every cell again (without it a rerun keeps "
                        "the cells already measured and refuses a report made with other settings)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--frames", type=int, default=None, help="video frames (both runs; default: the model's)")
    p.add_argument("--height", type=int, default=None, help="video height in pixels (both runs; default: the model's)")
    p.add_argument("--width", type=int, default=None, help="video width in pixels (both runs; default: the model's)")
    q = p.add_argument_group("quality run")
    q.add_argument("--prompts", default=None, help="prompts file (one per line, '#' comments skipped, or a JSON list), "
                   """or a JSON list of prompts: '["a cat", "a dog"]'; default built-in""")
    q.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable; instead of --prompts)")
    q.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    q.add_argument("--seeds", type=int, nargs="+", default=[0])
    q.add_argument("--steps", type=int, default=None, help="denoising steps")
    q.add_argument("--guidance-scale", type=float, default=None)
    q.add_argument("--negative-prompt", default=None)
    q.add_argument("--attn-steps", type=_ints, default=None, help="steps sampled at attention level (default: 3 spread)")
    q.add_argument("--attn-layers", type=_ints, default=None, help="layers sampled at attention level (default: all)")
    q.add_argument("--attn-cells", type=int, default=1,
                   help="(prompt, seed) pairs with the attention-level pass (0 = skip it)")
    q.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="one untimed generation per method first (default: on with CUDA)")
    q.add_argument("--no-lpips", action="store_true", help="do not compute LPIPS even when available")
    q.add_argument("--fps", type=int, default=8, help="frame rate of the side-by-side videos, 1 to 1000")
    s = p.add_argument_group("synthetic speed mode")
    s.add_argument("--synthetic", nargs="+", default=None, choices=sorted(SYNTHETIC_MODELS),
                   help="time one forward of real-size transformers with random weights (GPU)")
    s.add_argument("--synthetic-layers", type=int, default=None, help="build only N blocks (default: all)")
    s.add_argument("--repeats", type=int, default=3, help="timed forwards per method (median reported)")
    s.add_argument("--compile", default=None, metavar="MODE",
                   choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs", "aot_eager"],
                   help="time compiled dense vs compiled sparse: torch.compile mode (reduce-overhead = CUDA graphs; "
                        "aot_eager only checks tracing)")
    s.add_argument("--warmup-forwards", type=int, default=1, help="untimed forwards per method")


# options that only one of the two runs reads (dest names); given to the other, they are refused, not ignored
QUALITY_ONLY = ("model", "prompts", "prompt", "num_prompts", "seeds", "steps", "guidance_scale", "negative_prompt",
                "attn_steps", "attn_layers", "attn_cells", "warmup", "no_lpips", "fps")
SYNTHETIC_ONLY = ("synthetic_layers", "repeats", "compile", "warmup_forwards")


def _check_mode_options(args: argparse.Namespace) -> None:
    """ValueError naming the options given that the chosen run (quality, or --synthetic) would not read."""
    from . import build_parser

    other, mode = (QUALITY_ONLY, "quality runs (without --synthetic)") if args.synthetic else (
        SYNTHETIC_ONLY, "--synthetic speed runs")
    if getattr(args, "given", None) is not None:        # (`cli.main` records the options given, at any value)
        given = [name for name in other if name in args.given]
    else:
        defaults = build_parser().parse_args(["evaluate"])
        given = [name for name in other if getattr(args, name, None) != getattr(defaults, name, None)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        one = len(given) == 1
        raise ValueError(f"{flags} {'is' if one else 'are'} only read by {mode}; this run would ignore "
                         f"{'it' if one else 'them'}. Drop {'it' if one else 'them'}, or run the other mode.")


def _check_positive(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be a positive integer.")


def _check_out(out: str, synthetic: bool) -> None:
    """ValueError naming --out when the report cannot be written there (checked before anything runs): a folder that
    cannot be made or written (`check_output`), a folder where the run writes a file or a file where it makes a
    folder."""
    check_output("--out", out, folder=True)
    for name in ("report.json", "report.md"):
        if os.path.isdir(os.path.join(out, name)):
            raise ValueError(f"--out {out!r} holds a folder {name}, where the run writes its {name} file; move it "
                             "away or give another --out.")
    for name in ("plots",) if synthetic else ("frames", "plots", "videos"):
        if os.path.exists(os.path.join(out, name)) and not os.path.isdir(os.path.join(out, name)):
            raise ValueError(f"--out {out!r} holds a file {name}, where the run makes its {name} folder; move it "
                             "away or give another --out.")


def _method_specs(args: argparse.Namespace, default: list[str]) -> list:
    """The --methods grid (`default` when not given) with --backend, refused before anything runs when a file a
    spec names is missing or damaged, or --backend would be ignored (no veda or sol spec without its own backend)."""
    texts = args.methods or default
    specs = parse_method_specs(texts, backend=args.backend)
    if args.backend is not None and not any(hasattr(s.config, "backend") and ":backend=" not in s.label
                                            for s in specs):
        raise ValueError(f"--backend {args.backend} is for veda and sol specs that name no backend; --methods "
                         f"{' '.join(texts)} has none, so it would be ignored. Drop it.")
    check_spec_files(specs)
    return specs


def run(args: argparse.Namespace) -> int:
    """Run the evaluate subcommand from parsed arguments; prints a short table and where the report is."""
    from ..eval.generate import MAX_FPS

    check_device(args.device)
    check_model(args.model)
    _check_positive(args, ("steps", "frames", "height", "width", "num_prompts", "repeats", "synthetic_layers", "fps"))
    if args.fps > MAX_FPS:
        raise ValueError(f"--fps={args.fps} must be at most {MAX_FPS} (frames per second of the videos).")
    if getattr(args, "warmup_forwards", None) is not None and args.warmup_forwards < 0:
        raise ValueError(f"--warmup-forwards={args.warmup_forwards} must be >= 0.")
    if args.guidance_scale is not None and not math.isfinite(args.guidance_scale):
        raise ValueError(f"--guidance-scale={args.guidance_scale} must be a finite number.")
    _check_mode_options(args)
    _check_out(args.out, bool(args.synthetic))
    if args.synthetic:
        return _run_synthetic(args)
    from ..models.loading import load_pipeline
    from ..eval.evaluate import EvalSettings, load_prompts, run_evaluation

    specs = _method_specs(args, DEFAULT_METHODS)
    for seed in args.seeds:
        check_seed("--seeds", seed)
    if repeated := sorted({seed for seed in args.seeds if args.seeds.count(seed) > 1}):
        raise ValueError(f"--seeds {' '.join(map(str, args.seeds))} repeats {repeated}; each (prompt, seed) cell runs "
                         "once, so give each seed once.")
    if args.attn_cells is not None and args.attn_cells < 0:
        raise ValueError(f"--attn-cells={args.attn_cells} must be >= 0 (0: no attention-level pass).")
    if args.attn_cells == 0 and (given := [f for f, v in (("--attn-steps", args.attn_steps),
                                                          ("--attn-layers", args.attn_layers)) if v is not None]):
        raise ValueError(f"{' and '.join(given)} choose what the attention-level pass samples; --attn-cells 0 skips "
                         "that pass, so this run would ignore them. Drop them, or give --attn-cells 1 or more.")
    if args.steps is not None and (beyond := [t for t in args.attn_steps or () if t >= args.steps]):
        raise ValueError(f"--attn-steps {beyond}: the run has --steps {args.steps} denoising steps "
                         f"(0..{args.steps - 1}).")
    if args.prompt and args.prompts:
        raise ValueError(f"--prompt and --prompts {args.prompts} exclude each other: give the prompts one way.")
    prompts = list(args.prompt) if args.prompt else load_prompts(args.prompts)
    if args.num_prompts is not None and args.num_prompts > len(prompts):
        where = ("--prompt" if args.prompt else f"--prompts {args.prompts}" if args.prompts
                 else "the built-in list; --prompts FILE gives more")
        raise ValueError(f"--num-prompts={args.num_prompts} asks for more prompts than there are: {len(prompts)} "
                         f"({where}). Give at most {len(prompts)}, or more prompts.")
    prompts = prompts[: args.num_prompts]
    from ..models.loading import check_size, image_parameter, size_stub

    if (args.height or args.width) and (stub := size_stub(args.model)) is not None:    # before the weights load
        check_size(stub, {"height": args.height, "width": args.width})
    dtype = DTYPES.get(args.dtype) if getattr(args, "dtype", None) else None
    loaded = load_pipeline(args.model, args.device, dtype)

    param = image_parameter(loaded.pipe)
    if param is not None and param.default is param.empty:
        raise ValueError(f"{type(loaded.pipe).__name__} is image-to-video; evaluate runs text-to-video pipelines only "
                         "(videosparse generate --image takes image-to-video ones).")
    given = {flag: (key, value) for flag, key, value in (
        ("--steps", "num_inference_steps", args.steps), ("--frames", "num_frames", args.frames),
        ("--height", "height", args.height), ("--width", "width", args.width),
        ("--guidance-scale", "guidance_scale", args.guidance_scale),
        ("--negative-prompt", "negative_prompt", args.negative_prompt)) if value is not None}
    from ..eval.generate import check_call_flags

    check_call_flags(loaded.pipe, {flag: key for flag, (key, _) in given.items()})   # not a TypeError in a cell
    call = {k: v for k, v in loaded.defaults.items() if k != "prompt"}
    call.update(given.values())
    check_size(loaded.pipe, call)
    if "num_inference_steps" not in call:
        from ..eval.generate import call_takes

        if call_takes(loaded.pipe, "num_inference_steps"):
            raise ValueError(f"{type(loaded.pipe).__name__} has no default step count; give --steps.")
        raise ValueError(f"{type(loaded.pipe).__name__}.__call__ takes no num_inference_steps (HeliosPyramidPipeline "
                         "counts steps per stage); evaluate samples and times denoising steps, so it needs a pipeline "
                         "that takes one (videosparse generate runs this one).")
    settings = EvalSettings(specs, prompts, list(args.seeds), call, attn_steps=args.attn_steps,
                            attn_layers=args.attn_layers, attn_cells=args.attn_cells, warmup=args.warmup, fps=args.fps,
                            lpips=not args.no_lpips)
    def count(n: int, noun: str) -> str:
        return f"{n} {noun}" + ("s" if n != 1 else "")

    print(f"model: {loaded.name} | {count(len(specs), 'method')} x {count(len(prompts), 'prompt')} x "
          f"{count(len(args.seeds), 'seed')} | "
          f"{call.get('num_frames')} frames {call.get('height')}x{call.get('width')}, "
          f"{call['num_inference_steps']} steps | out: {args.out}")
    report = run_evaluation(loaded, settings, args.out, overwrite=args.overwrite, progress=not args.no_progress)
    stats = report["run_stats"]
    print(f"cells computed {stats['computed']}, skipped {stats['skipped']}; attention passes computed "
          f"{stats['attention_computed']}, skipped {stats['attention_skipped']}")
    print(f"{'method':<36} {'density':>8} {'PSNR dB':>8} {'pooled':>7} {'SSIM':>7} {'attn err':>9} {'recall':>7} "
          f"{'speedup':>8} {'Amdahl':>7}  kernel")
    for label, s in report["summary"].items():
        equal = f" ({s['cells_equal_to_dense']} equal to dense)" if s.get("cells_equal_to_dense") else ""
        print(f"{label:<36} {_f(s['realised_density'])} {_f(s['psnr_db'], 8, 2)} {_f(s.get('psnr_db_pooled'), 7, 2)} "
              f"{_f(s['ssim'], 7, 4)} "
              f"{_f(s['attn_rel_l2_common'], 9, 4)} {_f(s['tile_recall_common'], 7)} "
              f"{_f(s['speedup_transformer'], 7, 2)}x "
              f"{_f(s['amdahl_bound'], 6, 2)}x  {', '.join(s.get('kernels') or []) or '-'}{equal}")
    return _print_notes(report, args.out)


def _f(value, width: int = 8, digits: int = 3) -> str:
    if value is None:
        return "–".rjust(width)
    if isinstance(value, float) and math.isnan(value):
        return "NaN".rjust(width)              # a broken output, not a value left out
    return f"{value:>{width}.{digits}f}"


def _print_notes(report: dict, out: str) -> int:
    """Print the report's notes and where it was written; the command's exit code (0)."""
    for note in report.get("notes", []):
        print(f"note: {note}")
    print(f"report: {out}/report.md, {out}/report.json")
    return 0


def _run_synthetic(args: argparse.Namespace) -> int:
    from ..eval.synthetic import run_synthetic

    specs = _method_specs(args, default_synthetic_specs())
    dtype = DTYPES.get(args.dtype) if getattr(args, "dtype", None) else None
    report = run_synthetic(args.synthetic, specs, args.out, device=args.device, dtype=dtype, frames=args.frames,
                           height=args.height, width=args.width, layers=args.synthetic_layers,
                           warmup=args.warmup_forwards, repeats=args.repeats, progress=not args.no_progress,
                           compile_mode=args.compile, overwrite=args.overwrite)
    for name in args.synthetic:
        section = report["synthetic"][name]
        timed = next(iter(section["methods"].values())).get("attention_timed")
        print(f"{name}: grid {section['shape']['grid']} ({section['shape']['tokens']} tokens), dense attention share "
              f"{100 * section['dense_attention_share']:.1f}%{f' (timed {timed})' if timed else ''}, bound with "
              f"attention free {section['amdahl_bound_free_attention']:.2f}x")
        for label, r in section["methods"].items():
            # compiled sparse rows have no attention/plan time (the graph hides the processors): "-"
            print(f"  {label:<28} density {_f(r['realised_density'], 6)}  forward {r['forward_s']:.3f} s  "
                  f"attention {_f(r['attention_s'], 3)} s (plan {_f(r['plan_s'], 3)})  speedup {r['speedup']:.2f}x  "
                  f"Amdahl est. {r['amdahl_bound']:.2f}x  sparse/dense calls per forward {calls_per_forward(r)}"
                  + (f"  kernel {r['kernel_backend']}" if r.get("kernel_backend") else ""))
    return _print_notes(report, args.out)
