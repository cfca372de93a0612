"""One generation with a given attention config: frames, transformer time, sparsity statistics."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..processors import apply, remove
from .timing import TransformerTimer, pipeline_transformers


@dataclass
class GenerationResult:
    """frames: float [F, H, W, 3] in [0, 1]; transformer_s: seconds per transformer forward."""

    frames: np.ndarray
    transformer_s: list[float]
    wall_s: float
    stats: dict | None

    @property
    def transformer_total_s(self) -> float:
        return float(sum(self.transformer_s))


def generate(pipe, config, call_kwargs: dict, seed: int = 0, device: str | None = None) -> GenerationResult:
    """Run `pipe(**call_kwargs)` with `config` applied (None = the stock pipeline), then restore it.

    The generator is seeded identically for every config, so outputs are comparable frame by frame.
    """
    import time

    gen_device = device or "cpu"
    generator = torch.Generator(device=gen_device).manual_seed(seed)
    handle = apply(pipe, config) if config is not None else None
    timer = TransformerTimer(pipeline_transformers(pipe))
    try:
        t0 = time.perf_counter()
        with timer(), torch.no_grad():
            out = pipe(**call_kwargs, generator=generator, output_type="np")
        wall = time.perf_counter() - t0
        stats = {name: s.stats() for name, s in handle.items()} if handle else None
    finally:
        if handle is not None:
            remove(pipe)
    frames = np.asarray(out.frames[0], dtype=np.float32)
    return GenerationResult(frames, list(timer.times), wall, stats)


def write_video(frames: np.ndarray, path: str, fps: int = 8) -> str:
    """Write float frames [F, H, W, 3] in [0, 1] to an mp4 (imageio + ffmpeg)."""
    from diffusers.utils import export_to_video

    return export_to_video(list(frames), path, fps=fps)
