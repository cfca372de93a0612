"""`videosparse generate`: its arguments, its checks, the run and what it prints."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
from pathlib import Path

from .._run_checks import check_device, check_output, check_seed
from .common import DTYPES, add_method_args, add_model_args, check_model, method_config

# containers diffusers' export_to_video (imageio + ffmpeg) writes
VIDEO_SUFFIXES = (".mp4", ".mkv", ".mov", ".avi")        # (libx264 video; .webm would need VP8/VP9/AV1)


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("generate", help="generate a video with sparse attention", parents=[common])
    add_model_args(p)
    add_method_args(p)
    p.add_argument("--prompt", default=None)
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--steps", type=int, default=None, help="denoising steps")
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--guidance-scale", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fps", type=int, default=8, help="frame rate of the video, 1 to 1000")
    p.add_argument("--out", default="video.mp4",
                   help="output video path (.mp4, .mkv, .mov or .avi; an existing file is replaced)")
    p.add_argument("--image", default=None, help="first-frame image (path or URL) for image-to-video pipelines")
    p.add_argument("--compare-dense", action="store_true", help="also run dense with the same seed and compare")
    p.add_argument("--json", default=None,
                   help="also write the summary as JSON here; '-': to stdout (the other lines then go to stderr)")
    p.set_defaults(func=run)


def _unknown_words(pipe, prompt) -> list[str]:
    """The words of `prompt` that the pipeline's tokenizer maps to its unknown token (the reference model's
    closed vocabulary drops them); [] when the pipeline has no such tokenizer."""
    tok = getattr(pipe, "tokenizer", None)
    unk = getattr(tok, "unk_token_id", None)
    if unk is None or not isinstance(prompt, str):
        return []
    return [w for w in prompt.split() if unk in tok(w, add_special_tokens=False)["input_ids"]]


def slower_than_dense_note(speedup: float) -> str | None:
    """What `generate --compare-dense` adds when the sparse arm was the slower one, else None."""
    if speedup >= 1.0:
        return None
    return ("note: sparse attention was slower than dense here. Each arm ran once, so on a busy machine this can be "
            "noise; otherwise, at this size attention is too small a part of a step for skipping tiles to pay "
            "(kernel launches, plan building and the rest of the model dominate; the default model's default video "
            "is 4,096 tokens x 3 heads, the models this package is for run 30,000 to 120,000 tokens). Speed at real "
            "sizes: `videosparse evaluate --synthetic wan-1.3b` on a GPU (README, Results).")


def run(args: argparse.Namespace) -> int:
    """The command; with `--json -` the summary is the only thing on stdout (what it prints else goes to stderr), so
    that `videosparse generate ... --json - | jq .speedup` reads it."""
    if args.json != "-":
        return _run(args, summary_stream=None)
    summary_stream = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        return _run(args, summary_stream)


def _run(args: argparse.Namespace, summary_stream) -> int:
    from ..eval.generate import (MAX_FPS, check_call_flags, check_config_applies, check_video_writer, dense_comparison,
                                 generate, warm_up, work_fraction, write_video)
    from ..eval.spec import check_config_files
    from ..models.loading import check_size, load_pipeline, size_stub

    for name in ("steps", "frames", "height", "width"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name}={value} must be a positive integer.")
    json_file = args.json if summary_stream is None else None
    for flag, path in (("--out", args.out), ("--json", json_file)):    # (a trailing separator too, which Path drops)
        if path is not None:
            check_output(flag, path)
    if Path(args.out).suffix.lower() not in VIDEO_SUFFIXES:
        raise ValueError(f"--out {args.out!r} needs a video file extension, one of {', '.join(VIDEO_SUFFIXES)} "
                         "(checked before the pipeline runs).")
    if json_file is not None and Path(json_file).resolve() == Path(args.out).resolve():
        raise ValueError(f"--json {args.json!r} is the --out video's path; give the summary its own file.")
    check_seed("--seed", args.seed)
    if not 1 <= args.fps <= MAX_FPS:
        raise ValueError(f"--fps={args.fps} must be an integer from 1 to {MAX_FPS} (frames per second of the video).")
    if args.guidance_scale is not None and not math.isfinite(args.guidance_scale):
        raise ValueError(f"--guidance-scale={args.guidance_scale} must be a finite number.")
    check_device(args.device)
    config = method_config(args)
    check_config_files(config, lambda field: f"--{field}")     # before the pipeline loads
    check_model(args.model)
    check_video_writer()
    first_frame = _read_image(args.image)                     # a bad path fails here, not after a long load
    if (args.height or args.width) and (stub := size_stub(args.model)) is not None:     # so does a size
        check_size(stub, {"height": args.height, "width": args.width})
    loaded = load_pipeline(args.model, args.device, DTYPES.get(args.dtype))
    pipe = loaded.pipe
    given = {flag: (key, value) for flag, key, value in (
        ("--prompt", "prompt", args.prompt), ("--negative-prompt", "negative_prompt", args.negative_prompt),
        ("--steps", "num_inference_steps", args.steps), ("--frames", "num_frames", args.frames),
        ("--height", "height", args.height), ("--width", "width", args.width),
        ("--guidance-scale", "guidance_scale", args.guidance_scale)) if value is not None}
    check_call_flags(pipe, {flag: key for flag, (key, _) in given.items()})   # not a TypeError in the call
    pipe.set_progress_bar_config(disable=True)
    call = dict(loaded.defaults)
    call.update(given.values())
    check_size(pipe, call)
    if unknown := _unknown_words(pipe, call.get("prompt")):
        logging.getLogger(__name__).warning("the model's tokenizer does not know %s: %s ignores them",
                                            ", ".join(repr(w) for w in unknown), loaded.name)
    image = _image_input(pipe, first_frame)
    if image is not None:
        call["image"] = image
    steps = call.get("num_inference_steps")         # None: the pipeline takes none (Helios' pyramid: per stage)
    device = str(pipe.device)
    size = f"{call.get('height', 'default')}x{call.get('width', 'default')}"
    print(f"model: {loaded.name} | method: {config.to_dict()} | {call.get('num_frames', 'default')} frames "
          f"{size}, {steps or 'default'} steps, seed {args.seed}")
    # on CUDA the first sparse forward compiles the kernels: an untimed short run of each arm first. On the CPU
    # nothing compiles, but the first forwards of a process run slower (allocator, thread pool): with
    # --compare-dense the first arm read 0.67-0.89x of the second with dense in both, so both arms warm up there too
    check_config_applies(pipe, config, device)     # a --backend that cannot run here: before the dense steps
    warm = device.startswith("cuda") or args.compare_dense
    if warm:
        warm_up(pipe, config, call, seed=args.seed, device=device)
    result = generate(pipe, config, call, seed=args.seed, device=device)
    try:
        path, video_error = write_video(result.frames, args.out, fps=args.fps), None
    except (OSError, AttributeError, RuntimeError) as err:    # the run's numbers are still printed and saved
        path, video_error = None, err
    # time per denoising step, or per transformer forward where the call names no step count
    unit = "step" if steps else "transformer forward"
    per_step = result.seconds_per_step(steps)
    frames, height, width = result.frames.shape[:3]
    if call.get("num_frames") not in (None, frames):
        print(f"note: the pipeline made {frames} frames ({call['num_frames']} asked; its frame counts are stepped)")
    from ..eval.report import environment

    summary = {"model": loaded.name, "config": config.to_dict(),
               "call": {k: v for k, v in call.items() if k != "image"}, "seed": args.seed,
               "dtype": str(getattr(pipe.transformer, "dtype", "")), "warmed_up": warm,
               "image": args.image, "video": path, "frames": frames, "height": height, "width": width,
               "wall_s": result.wall_s, "transformer_s_per_step": per_step, "timed_per": unit, "stats": result.stats,
               "environment": environment(device)}
    density, work = work_fraction(result.stats)              # pooled over every transformer (Wan 2.2: both)
    kernels = result.kernels
    print(f"{config.method}: {per_step * 1000:.1f} ms transformer time per {unit}, {result.wall_s:.1f} s in all"
          + (f", realised density {density:.3f} (attention work {work:.2f} of dense, dense steps included)"
             if density is not None else "")
          + (f", kernel {', '.join(kernels)}" if kernels else ""))
    if args.compare_dense:
        if warm:
            warm_up(pipe, None, call, seed=args.seed, device=device)
        # the dense arm is the pipeline's own processors (videosparse not applied), same seed and call
        dense = summary["dense"] = dense_comparison(result, generate(pipe, None, call, seed=args.seed, device=device),
                                                    steps)
        print(f"dense: {dense['transformer_s_per_step'] * 1000:.1f} ms per {unit} -> speedup {dense['speedup']:.2f}x; "
              f"PSNR vs dense {dense['psnr_db']:.2f} dB" + (" (each arm after an untimed warm-up run)" if warm else ""))
        if not result.ran_sparse:
            print("note: no attention call ran sparse in this run (the method, or its dense steps / layers, kept "
                  "every call dense), so the two arms differ only by noise.")
        elif note := slower_than_dense_note(round(dense["speedup"], 2)):    # as printed: 0.996 reads 1.00x
            print(note)
    if video_error is not None:
        summary["video_error"] = f"{type(video_error).__name__}: {video_error}"
    else:
        print(f"video written to {path}")
    if args.json:
        from .._io import to_jsonable, write_atomic

        text = json.dumps(to_jsonable(summary), indent=2, default=str)       # inf PSNR as "inf": strict JSON
        if summary_stream is not None:
            summary_stream.write(text + "\n")
            summary_stream.flush()
        else:
            try:
                write_atomic(args.json, text)
            except OSError as err:
                raise OSError(f"--json {err}") from None
    if video_error is not None:
        where = "on stdout" if summary_stream is not None else f"in {args.json!r}"
        raise OSError(f"the video {args.out!r} could not be written: {video_error}"
                      + (f" (the summary is {where})" if args.json else ""))
    return 0


def _read_image(image: str | None):
    """--image read as a PIL image (None when not given); ValueError naming the path when it is not a readable image
    file or an http(s) URL that gives one."""
    if image is None:
        return None
    from diffusers.utils import load_image

    try:
        return load_image(image)
    except (OSError, ValueError) as err:                      # missing file, not an image, URL unreachable
        raise ValueError(f"--image {image!r} could not be read as an image (a file path or an http(s) URL): "
                         f"{err}") from None


def _image_input(pipe, image):
    """The first-frame image (PIL, or None) for an image-to-video pipeline (ValueError when one is needed and
    missing, or given to a text-to-video pipeline)."""
    import inspect

    from ..models.loading import image_parameter

    param = image_parameter(pipe)
    if param is None:
        if image is not None:
            raise ValueError(f"--image is for image-to-video pipelines; {type(pipe).__name__} takes none.")
        return None
    if image is None and param.default is inspect.Parameter.empty:
        raise ValueError(f"{type(pipe).__name__} is image-to-video: pass --image PATH (the first frame).")
    return image
