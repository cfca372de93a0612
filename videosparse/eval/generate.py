"""One generation with a given attention config: frames, transformer time, sparsity statistics."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import numpy as np
import torch

from ..processors import apply, remove
from .._io import replace_durably
from .timing import TransformerTimer, pipeline_transformers


@dataclass
class GenerationResult:
    """frames: float [F, H, W, 3] in [0, 1] (None for output_type="latent"); transformer_s: seconds per
    transformer forward."""

    frames: np.ndarray | None
    transformer_s: list[float]
    wall_s: float
    stats: dict | None

    @property
    def transformer_total_s(self) -> float:
        return float(sum(self.transformer_s))

    def seconds_per_step(self, steps: int | None) -> float:
        """Transformer seconds per denoising step of a call of `steps` steps; per transformer forward where the call
        names no step count (`steps` None)."""
        return self.transformer_total_s / (steps or max(1, len(self.transformer_s)))

    @property
    def kernels(self) -> list[str]:
        """The kernel backends that served at least one sparse call, sorted."""
        return sorted({c.get("kernel_backend") for c in (self.stats or {}).values()
                       if c.get("kernel_backend") and c.get("sparse_calls")})

    @property
    def ran_sparse(self) -> bool:
        """Whether any attention call ran sparse (False where the dense steps / layers kept every call dense)."""
        return any(c.get("sparse_calls") for c in (self.stats or {}).values())


def work_fraction(stats: dict | None) -> tuple[float | None, float]:
    """(realised density of the sparse calls, attention work vs dense incl. dense calls) over all components."""
    if not stats:
        return None, 1.0
    kept = dense_calls = sparse_calls = 0.0
    densities = []
    for comp in stats.values():
        d = comp.get("density")
        sparse_calls += comp["sparse_calls"]
        dense_calls += comp["dense_calls"]
        if d is not None:
            densities.append((float(d), comp["sparse_calls"]))
            kept += float(d) * comp["sparse_calls"]
    calls = sparse_calls + dense_calls
    density = sum(d * n for d, n in densities) / sum(n for _, n in densities) if densities and sparse_calls else None
    work = (dense_calls + kept) / calls if calls else 1.0
    return density, work


def dense_comparison(sparse: GenerationResult, dense: GenerationResult, steps: int | None) -> dict:
    """The dense arm of `generate --compare-dense` against the sparse one (same call and seed): its wall time and
    transformer time per step, the sparse arm's speedup over it, and the sparse video's PSNR against it in dB (frames
    rounded to fp16 first, as `evaluate` stores and compares them; inf where they are equal)."""
    from .metrics import psnr_video

    dense_step = dense.seconds_per_step(steps)
    return {"arm": "stock processors", "wall_s": dense.wall_s, "transformer_s_per_step": dense_step,
            "speedup": dense_step / sparse.seconds_per_step(steps),
            "psnr_db": psnr_video(sparse.frames.astype(np.float16), dense.frames.astype(np.float16))}


def generate(pipe, config, call_kwargs: dict, seed: int = 0, device: str | None = None, *,
             instruments: Sequence[Callable[[object], ContextManager]] = (),
             output_type: str = "np") -> GenerationResult:
    """Run `pipe(**call_kwargs)` with `config` applied (None = the stock pipeline), then restore it.

    The generator is seeded identically for every config, so outputs are comparable frame by frame.

    Args:
        pipe: a diffusers pipeline.
        config: a videosparse config, or None for the stock processors.
        call_kwargs: the pipeline call's arguments (prompt, num_frames, ...), without generator/output_type.
        seed: seed of the generator (on `device`, default cpu).
        instruments: callables `pipe -> context manager` entered after `config` is applied and left
            before it is removed (e.g. `lambda p: AttentionTimer(pipeline_transformers(p))()`).
        output_type: "np" (frames returned) or "latent" (no VAE decode; frames is None).
    """
    import time

    gen_device = device or "cpu"
    generator = torch.Generator(device=gen_device).manual_seed(seed)
    handle = apply(pipe, config) if config is not None else None
    timer = TransformerTimer(pipeline_transformers(pipe))
    try:
        with contextlib.ExitStack() as stack:
            for make in instruments:
                stack.enter_context(make(pipe))
            t0 = time.perf_counter()
            with timer(), torch.no_grad():
                out = pipe(**call_kwargs, generator=generator, output_type=output_type)
                if output_type == "latent":
                    _sync_outputs(out)
            wall = time.perf_counter() - t0
        stats = {name: s.stats() for name, s in handle.items()} if handle else None
    finally:
        if handle is not None:
            remove(pipe)
    frames = None if output_type == "latent" else np.asarray(output_video(out), dtype=np.float32)
    return GenerationResult(frames, list(timer.times), wall, stats)


def check_specs_apply(target, specs, device: str | None = None) -> None:
    """`check_config_applies` for each spec, so that a config the model refuses (a dense layer it lacks, an estimator
    or a tiling file made for another model or block, with `device` a kernel backend that cannot run there) is a
    ValueError naming the spec before any cell runs, not after the dense one."""
    from .spec import in_spec_terms

    for spec in specs:
        try:
            check_config_applies(target, spec.config, device)
        except ValueError as err:
            raise ValueError(f"method spec {spec.label!r}: " + in_spec_terms(str(err))) from None


class _ThisThread(logging.Filter):
    """Drops the records logged by the thread that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


@contextlib.contextmanager
def _quiet_this_thread():
    """The `videosparse` loggers' records of this thread dropped inside (other threads' kept; no level changed)."""
    mute = _ThisThread()
    names = ["videosparse"] + [n for n in list(logging.Logger.manager.loggerDict) if n.startswith("videosparse.")]
    loggers = [logging.getLogger(n) for n in names]
    for each in loggers:        # (a logger's filters see only its own records, not its children's)
        each.addFilter(mute)
    try:
        yield
    finally:
        for each in loggers:
            each.removeFilter(mute)


def check_config_applies(target, config, device: str | None = None) -> None:
    """Apply, then remove, `config` on `target` (a pipeline, or a transformer): a ValueError where the model refuses
    it, and, given the `device` the run will use, where a kernel backend the config names cannot run the attention
    there in the transformer's dtype (found otherwise at the first sparse forward, after the dense steps)."""
    with _quiet_this_thread():          # its warnings come from the apply that serves the run
        handle = apply(target, config)
    try:
        for name, session in handle.items() if device is not None else ():
            if session.method is not None:
                module = getattr(target, name) if hasattr(target, "components") else target
                # the dtype of the hidden states the pipeline passes: the model's (diffusers' `dtype` skips the
                # modules kept in fp32, such as Wan's scale_shift_table), as the attention sees it
                hidden = getattr(module, "dtype", None)
                if not isinstance(hidden, torch.dtype):
                    hidden = next(module.parameters()).dtype
                session.check_kernel(device, session.attention_dtype_for(hidden, device))
    finally:
        remove(target)


def call_takes(pipe, keyword: str) -> bool:
    """Whether the pipeline's `__call__` takes `keyword` (by name, or through **kwargs)."""
    import inspect

    params = inspect.signature(type(pipe).__call__).parameters
    return keyword in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_call_flags(pipe, given: dict[str, str]) -> None:
    """ValueError naming the flags of `given` ({flag: call keyword}, the flags the user gave) whose keyword the
    pipeline's `__call__` does not take (HunyuanVideo 1.5 takes no guidance_scale); none when it takes **kwargs."""
    missing = {flag: key for flag, key in given.items() if not call_takes(pipe, key)}
    if missing:
        one = len(missing) == 1
        raise ValueError(f"{', '.join(missing)}: {type(pipe).__name__}.__call__ takes no "
                         f"{', '.join(missing.values())}; drop {'it' if one else 'them'} for this model.")


def warm_up(pipe, config, call_kwargs: dict, seed: int = 0, device: str | None = None) -> int | None:
    """An untimed generation of as few steps as reach `config`'s sparse path (1; with `dense_steps=k` steps, k + 1;
    never more than the call's own steps), latents only: the kernels a timed generation would compile on its first
    sparse forward compile here. Returns the steps run (0, nothing run, when every step of the call is dense; None
    when the pipeline takes no `num_inference_steps`: then the call runs as given)."""
    if "num_inference_steps" not in call_kwargs and not call_takes(pipe, "num_inference_steps"):
        generate(pipe, config, call_kwargs, seed=seed, device=device, output_type="latent")
        return None
    total = call_kwargs.get("num_inference_steps")
    steps = 1
    counting = next(iter(config.values())) if isinstance(config, Mapping) else config    # one dense_steps for all
    while counting is not None and counting.dense_step_count(steps) >= steps:
        if total is not None and steps >= total:
            return 0                                    # the call never reaches the sparse path
        steps += 1
    generate(pipe, config, {**call_kwargs, "num_inference_steps": steps}, seed=seed, device=device,
             output_type="latent")
    return steps


def output_video(out):
    """The first video of a pipeline output: `.frames[0]` (one video per prompt, the diffusers convention), or
    `.video` where the pipeline returns a single unbatched video (Cosmos 3's `Cosmos3OmniPipelineOutput`)."""
    if hasattr(out, "frames"):
        return out.frames[0]
    if hasattr(out, "video"):
        return out.video
    raise TypeError(f"{type(out).__name__} holds no video: expected a `frames` or a `video` field.")


def _sync_outputs(out) -> None:
    frames = getattr(out, "frames", getattr(out, "video", None))
    if isinstance(frames, torch.Tensor) and frames.is_cuda:
        torch.cuda.synchronize(frames.device)


def check_video_writer() -> None:
    """OSError when imageio finds no ffmpeg to write a video with (checked before a generation, which would
    otherwise run to its end and then fail)."""
    try:
        import imageio

        imageio.plugins.ffmpeg.get_exe()
    except (ImportError, AttributeError, RuntimeError) as err:
        raise OSError(f"no ffmpeg to write the video with ({type(err).__name__}: {err}); `pip install imageio-ffmpeg` "
                      "(a dependency of videosparse) ships one, or set IMAGEIO_FFMPEG_EXE to an ffmpeg binary.") from err


# highest frame rate the command line takes for a video: ffmpeg takes more, but refuses a huge one (1e20) only when
# the video is written, after the whole generation; a few hundred is plenty
MAX_FPS = 1000


def write_video(frames: np.ndarray, path: str, fps: int = 8) -> str:
    """Write float frames [F, H, W, 3] in [0, 1] to an mp4 (imageio + ffmpeg), atomically: encoded into a temporary
    file beside `path` (same suffix, so the same container), then renamed; a failed encode leaves `path` as it was."""
    from diffusers.utils import export_to_video
    from PIL import Image

    folder, name = os.path.split(path)
    stem, suffix = os.path.splitext(name)
    tmp = os.path.join(folder, f".{stem}.tmp{suffix}")
    try:
        # macro_block_size=2: yuv420p needs even sizes; imageio's default 16 would resize e.g. 36x44 to 48x48
        # frames rounded to 8 bits here, handed over as images: diffusers truncates float frames (0.999 -> 254)
        pixels = (np.clip(np.asarray(frames, dtype=np.float32), 0.0, 1.0) * 255).round().astype(np.uint8)
        written = export_to_video([Image.fromarray(f) for f in pixels], tmp, fps=fps, macro_block_size=2)
        # ffmpeg reports a file it cannot open on stderr and imageio returns as if it wrote it (a directory, ...)
        if not os.path.isfile(written) or os.path.getsize(written) == 0:
            raise OSError(f"the video {path!r} was not written (ffmpeg could not write it: see its message above).")
        replace_durably(written, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    return path
