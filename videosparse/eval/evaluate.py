"""The evaluation run: a grid of methods x prompts x seeds, compared with dense, written to one directory.

    from videosparse.eval.evaluate import EvalSettings, run_evaluation
    from videosparse.eval.spec import parse_method_specs
    from videosparse.models.loading import load_pipeline

    loaded = load_pipeline()
    settings = EvalSettings(parse_method_specs(["dense", "veda@0.5", "sol@0.5"]), prompts=BUILTIN_PROMPTS[:2],
                            call={**loaded.defaults, "num_inference_steps": 4})
    report = run_evaluation(loaded, settings, "eval_out")

What one run does, cell by cell (a cell is one method, one prompt, one seed):

1. **Quality and speed.** Generate with the method applied (dense is `DenseConfig`: diffusers' own
   attention through videosparse's processors, so it can be timed the same way), the generator
   seeded identically for every method. Per cell: PSNR and SSIM per frame vs the dense cell of the
   same prompt and seed (PSNR of the whole video, i.e. the MSE pooled over frames, plus the
   per-frame values; dense vs itself: PSNR inf, SSIM 1), LPIPS when available; end-to-end wall
   time, transformer time (every forward, CUDA-synchronised), attention time and plan time (every
   self-attention call, CUDA events; `timing.AttentionTimer`); the session statistics (realised
   density per layer, load balance, sparse/dense calls). Frames are kept in `frames/` (fp16 .npy) so
   a rerun can compare new methods with the dense cells it skips.
2. **Attention level.** For the first `attn_cells` (prompt, seed) pairs and every sparse method, one
   more generation (no VAE decode) with an `AttentionProbe` on the sampled steps and layers: the
   relative L2 error of the attention output vs exact dense attention on the same q, k, v, tile
   recall vs the oracle, attention mass kept.
3. **Outputs.** `report.json` (every number, versions, device, shapes, configs; saved after every
   cell), `report.md`, `plots/` (quality vs density, per-layer error heatmap unless `attn_cells` is
   0, speedup vs density with the Amdahl estimate), `videos/` (one side-by-side mp4 per prompt:
   dense | method | ...).

A rerun with the same model and call settings skips every cell already in report.json (new
methods, prompts or seeds are added; each cell records the run that timed it, and the report notes
speedups that compare runs); other settings raise unless `overwrite=True`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import numpy as np
import torch

from ..processors import sessions as active_sessions
from ..prompts import read_prompts_arg
from .attention import AttentionProbe, spread_steps
from .generate import check_specs_apply, generate, work_fraction, write_video
from .metrics import load_lpips, lpips_distance, psnr_per_frame, psnr_video, ssim_per_frame
from .._io import replace_durably, write_atomic
from .report import (REPORT_FORMAT, changed_keys, environment, load_report, new_run_id, render_markdown,
                     remove_earlier_outputs, rerun_timing_notes, runs_of, save_report, timing_environment)
from .spec import MethodSpec
from .timing import AttentionTimer, pipeline_transformers

logger = logging.getLogger("videosparse")

# Prompts every built-in model understands (the tiny Wan vocabulary and the reference model's).
BUILTIN_PROMPTS = [
    "a red circle moving right on a dark background",
    "a blue square bouncing on a light background",
    "a green triangle rotating on a dark background",
    "a yellow circle moving up on a light background",
    "a purple square growing on a dark background",
    "an orange triangle moving left on a light background",
]

CALL_KEYS_NOT_COMPARED = ("prompt",)


def load_prompts(path: str | None, limit: int | None = None) -> list[str]:
    """Prompts from a file (`videosparse.prompts.read_prompts_file`: a JSON list of strings, or one prompt per line,
    '#' comments and blank lines skipped), an inline JSON list (`read_prompts_arg`), or the built-in list when `path`
    is None; the first `limit` of them."""
    prompts = list(BUILTIN_PROMPTS) if path is None else read_prompts_arg(path)
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise ValueError(f"no prompts in {path!r}.")
    return prompts


@dataclass
class EvalSettings:
    """What to evaluate.

    Args:
        methods: the grid, dense first (`spec.parse_method_specs` puts it there).
        prompts: the prompts.
        seeds: generator seeds; every method runs every (prompt, seed).
        call: the pipeline call's other arguments (num_frames, height, width, num_inference_steps,
            guidance_scale, ...); `prompt` is taken from `prompts`.
        attn_steps: denoising steps sampled at attention level (None: 3 spread over the run).
        attn_layers: self-attention layers sampled (None: all).
        attn_cells: how many (prompt, seed) pairs get the attention-level pass (0 = none).
        warmup: one untimed generation per method before its first timed cell (kernel compilation, CUDA start-up);
            None (the default): on when the pipeline runs on CUDA, where a cold first call would count compile and
            start-up time into one method's times only.
        fps: frame rate of the side-by-side videos.
        lpips: compute LPIPS when the package and its weights are on this machine.
    """

    methods: list[MethodSpec]
    prompts: list[str]
    seeds: list[int] = field(default_factory=lambda: [0])
    call: dict = field(default_factory=dict)
    attn_steps: list[int] | None = None
    attn_layers: list[int] | None = None
    attn_cells: int = 1
    warmup: bool | None = None
    fps: int = 8
    lpips: bool = True

    def __post_init__(self) -> None:
        if not self.methods or not self.methods[0].is_dense:
            raise ValueError("methods must start with dense (use spec.parse_method_specs).")
        labels = [m.label for m in self.methods]
        if len(set(labels)) != len(labels):
            raise ValueError(f"method labels must be unique; got {labels}.")
        if not self.prompts:
            raise ValueError("at least one prompt is needed.")
        if not self.seeds:
            raise ValueError("at least one seed is needed.")
        for name, values in (("prompts", self.prompts), ("seeds", self.seeds)):
            repeated = sorted({v for v in values if values.count(v) > 1}, key=str)
            if repeated:
                raise ValueError(f"{name} repeat {repeated}; each (prompt, seed) cell runs once, so give each once.")
        steps = self.call.get("num_inference_steps")
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"call['num_inference_steps']={steps!r} must be a positive int.")
        if self.attn_cells < 0:
            raise ValueError(f"attn_cells={self.attn_cells} must be >= 0.")
        for name in ("attn_steps", "attn_layers"):
            if getattr(self, name) is not None and not len(getattr(self, name)):
                raise ValueError(f"{name}=[] (--{name.replace('_', '-')} '') samples nothing: give at least one, or "
                                 "leave it out (None: the default).")

    def attention_sampling(self) -> tuple[list[tuple[int, int]], list[int], list[int] | None]:
        """The attention-level pass's (prompt index, seed) pairs, denoising steps and layers (None: all)."""
        pairs = [(p, seed) for p in range(len(self.prompts)) for seed in self.seeds][: self.attn_cells]
        steps = list(self.attn_steps) if self.attn_steps is not None else spread_steps(self.call["num_inference_steps"],
                                                                                       3)
        return pairs, steps, None if self.attn_layers is None else list(self.attn_layers)


def cell_id(spec: MethodSpec, prompt: str, seed: int) -> str:
    """Stable id of one (config, prompt, seed) cell: the same config under another label is the same cell; a config
    naming a tiling JSON or an estimator folder on disk is another cell when their contents change."""
    content = {"config": spec.config.to_dict(), "prompt": prompt, "seed": seed}
    files = {field: _content_digest(getattr(spec.config, field)) for field in ("tiling", "estimator")
             if isinstance(getattr(spec.config, field, None), str) and os.path.exists(getattr(spec.config, field))}
    several = getattr(spec.config, "estimator", None)
    if isinstance(several, tuple) and any(isinstance(e, str) and os.path.exists(e) for e in several):
        files["estimator"] = [_content_digest(e) if isinstance(e, str) and os.path.exists(e) else None
                              for e in several]
    if files:                                   # only then: the ids of configs without files stay as they were
        content["files"] = files
    blob = json.dumps(content, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


# the files of an estimator folder that `VedaEstimator.from_pretrained` reads (a distill output folder also holds its
# capture cache, checkpoints and logs: not part of what the estimator is)
ESTIMATOR_FILES = ("config.json", "model.safetensors")
_DIGESTS: dict[tuple, str] = {}     # (path, its files' names, sizes and mtimes) -> digest: read once per version


def _content_digest(path: str) -> str:
    """sha1 of a file's bytes, or of an estimator folder's `ESTIMATOR_FILES` (names and bytes), memoised while the
    files' sizes and modification times stay."""
    files = [path] if os.path.isfile(path) else [os.path.join(path, n) for n in ESTIMATOR_FILES
                                                 if os.path.isfile(os.path.join(path, n))]
    stamp = (os.path.abspath(path), tuple((f, st.st_size, st.st_mtime_ns) for f in files for st in [os.stat(f)]))
    if stamp not in _DIGESTS:
        digest = hashlib.sha1()
        for file in files:
            digest.update(os.path.basename(file).encode())
            with open(file, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
        _DIGESTS[stamp] = digest.hexdigest()
    return _DIGESTS[stamp]


def _comparable(call: dict) -> dict:
    return {k: v for k, v in sorted(call.items()) if k not in CALL_KEYS_NOT_COMPARED}


@contextlib.contextmanager
def _capture_context(pipe, store: dict) -> Iterator[None]:
    """Records, after the run, each session's last grid, text length and model info."""
    try:
        yield
    finally:
        for name, s in active_sessions(pipe).items():
            store[name] = {"grid": s.context.grid, "text_len": s.context.text_len, "info": s.info}


@contextlib.contextmanager
def _probing(pipe, probes: dict, steps, layers) -> Iterator[None]:
    """Attaches an `AttentionProbe` to every active session for the duration of the block."""
    attached = []
    for name, session in active_sessions(pipe).items():
        probe = AttentionProbe(session, steps, layers)
        probes[name] = probe
        session.observers.append(probe)
        attached.append((session, probe))
    try:
        yield
    finally:
        for session, probe in attached:
            session.observers.remove(probe)


def pooled_psnr(psnrs: list[float]) -> float | None:
    """PSNR of the MSE pooled over cells of equal size (each cell's MSE is 10^(-PSNR/10) for data range 1): cells
    identical to dense enter with MSE 0, so unlike the mean of the cells' dB it moves continuously, and one cell
    that differs from dense in a few pixels (80+ dB) cannot dominate it. NaN when a cell is NaN; None for none."""
    if not psnrs:
        return None
    if any(math.isnan(v) for v in psnrs):
        return math.nan
    mse = float(np.mean([10.0 ** (-v / 10.0) for v in psnrs]))
    return math.inf if mse == 0.0 else -10.0 * math.log10(mse)


def summary_psnr(psnrs: list[float], is_dense: bool = False) -> tuple[float | None, int]:
    """(mean PSNR over a method's cells, cells identical to dense). Cells equal to dense (inf dB) are counted
    apart, not averaged in (one would make the mean inf); a NaN cell (a broken output) makes the mean NaN."""
    if any(math.isnan(v) for v in psnrs):
        return math.nan, 0
    finite = [v for v in psnrs if math.isfinite(v)]
    equal = 0 if is_dense else sum(v == math.inf for v in psnrs)
    return (float(np.mean(finite)) if finite else (math.inf if psnrs else None)), equal


def timing_spread_notes(summary: dict[str, dict], ratio: float = 1.5) -> list[str]:
    """A note for each method whose cells' transformer times (same call, other prompt or seed; the summary's
    `transformer_s_range`) spread by more than `ratio` (slowest / fastest): its speedups rest on noisy runs."""
    notes = []
    for label, row in summary.items():
        low, high = row.get("transformer_s_range") or (None, None)
        if low and high and high > ratio * low:
            notes.append(f"{label}: its cells' transformer times spread from {low:.3g} to {high:.3g} s (other load "
                         "on the machine?): its speedups are medians of noisy runs.")
    return notes


def density_floor_notes(summary: dict[str, dict]) -> list[str]:
    """A note for each method whose sparse calls kept clearly more tiles than its nominal density (realised above
    it by more than 20% of it and by more than 0.02): on a short video the tiles every query tile always keeps (its
    own, Sol's band, text and condition tiles) outnumber what the density asks, and its row compares a denser method
    than its label."""
    notes = []
    for label, row in summary.items():
        nominal, realised = row.get("nominal_density"), row.get("realised_density")
        if nominal is None or realised is None or not math.isfinite(realised):
            continue
        if realised - nominal > max(0.2 * nominal, 0.02):
            notes.append(f"{label}: its sparse calls kept {realised:.3f} of the tile pairs, above the {nominal:g} "
                         "asked: at this video size the tiles always kept (each query tile's own, Sol's band, text "
                         "and condition tiles) are more than that; the run's log names them per layer.")
    return notes


def psnr_notes(summary: dict[str, dict], near_identical_db: float = 60.0) -> list[str]:
    """Report notes on PSNRs a reader could misread, from the summary's cell counts: cells whose video has NaN
    pixels (a broken output, not a metric left out), and a mean over cells more than 3 dB above the pooled PSNR
    with a cell above `near_identical_db` (a video that differs from dense in a few pixels) pulling it up."""
    notes = []
    broken = {label: row.get("cells_nan", 0) for label, row in summary.items()}
    if any(broken.values()):
        notes.append("NaN in the video of " + ", ".join(f"{label} ({n} cell{'s' if n > 1 else ''})"
                                                        for label, n in broken.items() if n)
                     + ": its PSNR and SSIM are NaN (a broken output, not a metric left out).")
    for label, row in summary.items():
        mean, pooled, highest = row.get("psnr_db"), row.get("psnr_db_pooled"), row.get("psnr_db_cell_max")
        if None in (mean, pooled, highest) or not (math.isfinite(mean) and math.isfinite(pooled)) \
                or mean - pooled <= 3 or highest < near_identical_db:
            continue
        notes.append(f"{label}: its mean PSNR over cells ({mean:.2f} dB) is pulled up by cells nearly identical to "
                     f"dense (up to {highest:.1f} dB, e.g. saturated frames); the pooled PSNR, {pooled:.2f} dB, is "
                     "the robust figure.")
    return notes


def _range_of(entries: list[dict], key: str) -> list[float] | None:
    vals = [e[key] for e in entries if e.get(key) is not None]
    return [min(vals), max(vals)] if vals else None


def _mean_of(entries: list[dict], key: str) -> float | None:
    vals = [e[key] for e in entries if e.get(key) is not None]
    return float(np.mean(vals)) if vals else None


def _by_step(entries: list[dict], key: str) -> dict[str, float | None]:
    """{step: mean of key over the entries of that step} (string keys, as JSON keeps them)."""
    return {str(step): _mean_of([e for e in entries if e["step"] == step], key)
            for step in sorted({e["step"] for e in entries})}


def _layer_densities(stats: dict | None) -> dict[str, list[float | None]]:
    out = {}
    for name, comp in (stats or {}).items():
        layers = comp.get("layers", {})
        out[name] = [layers[k].get("density") for k in sorted(layers, key=int)]
    return out


class Evaluation:
    """One evaluation directory: its report, the cells still to run, and the artifacts.

    Args:
        loaded: the `LoadedPipeline` (pipeline, name, defaults).
        settings: `EvalSettings`.
        out_dir: output directory (created).
        overwrite: start a fresh report even when report.json was made with other settings.
        progress: show tqdm progress bars.
    """

    def __init__(self, loaded, settings: EvalSettings, out_dir: str, *, overwrite: bool = False,
                 progress: bool = True) -> None:
        self.loaded = loaded
        self.pipe = loaded.pipe
        self.out_dir = out_dir
        self.progress = progress
        self.device = str(self.pipe.device)
        if settings.warmup is None:
            settings = replace(settings, warmup=self.device.startswith("cuda"))
        self.settings = settings
        self.dtype = str(getattr(self.pipe.transformer, "dtype", ""))
        self.path = os.path.join(out_dir, "report.json")
        self._check_attention_sampling()
        # the cells of a rerun join those already in the report: same pipeline call, warm-up and environment
        key = {"model": loaded.name, "call": _comparable(settings.call), "dtype": self.dtype, "device": self.device,
               "warmup": settings.warmup, "timed_on": timing_environment(self.device)}
        old = None if overwrite else load_report(self.path)
        if old is not None and old.get("mode", "quality") != "quality":
            raise ValueError(f"{self.path} holds a {old.get('mode')} report; write this quality run to another "
                             "directory, or overwrite=True (--overwrite) to replace it.")
        key = json.loads(json.dumps(key, default=str))
        if old is not None and old.get("run_key") != key:
            raise ValueError(
                f"{self.path} was made with other settings ({'; '.join(changed_keys(old.get('run_key'), key))}). "
                "Use another output directory, or overwrite=True (--overwrite) to start afresh."
            )
        # a spec the model refuses: before the dense cell (on the device the forwards run on: under model CPU
        # offload the pipeline's own `device` is the CPU)
        check_specs_apply(self.pipe, settings.methods, str(getattr(self.pipe, "_execution_device", self.pipe.device)))
        for sub in ("frames", "plots", "videos"):            # after the checks: a refused run leaves nothing behind
            os.makedirs(os.path.join(out_dir, sub), exist_ok=True)
        self.report: dict[str, Any] = old or {"format": REPORT_FORMAT, "mode": "quality", "cells": {}, "attention": {}}
        self.report["run_key"] = key
        if overwrite:       # the old report goes now: stopped before its first cell, a run leaves no stale cells
            remove_earlier_outputs(out_dir)         # nor the frames, videos and plots the old report named
            self._save()
        self._lpips = None
        self._lpips_note: str | None = None
        self._contexts: dict = {}
        # which process timed a cell: a rerun's cells join the report, and their speedups then compare processes
        self.run_started = new_run_id()
        self.computed = 0               # cells
        self.skipped = 0
        self.attention_computed = 0     # attention-level passes
        self.attention_skipped = 0

    # ---------------------------------------------------------------- helpers
    def _frames_path(self, cid: str) -> str:
        return os.path.join(self.out_dir, "frames", f"{cid}.npy")

    def _done(self, cid: str) -> bool:
        return cid in self.report["cells"] and os.path.isfile(self._frames_path(cid))

    def _frames(self, cid: str) -> np.ndarray:
        path = self._frames_path(cid)
        try:
            return np.load(path).astype(np.float32)
        except (OSError, ValueError, EOFError) as e:    # damaged after it was written (writes are atomic)
            raise ValueError(f"the frames {path} of a finished cell cannot be read ({e}); delete the file and run "
                             "again to compute that cell again.") from None

    def _call(self, prompt: str) -> dict:
        return {**self.settings.call, "prompt": prompt}

    def _tqdm(self, total: int, desc: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, disable=not self.progress, leave=False)

    def _lpips_model(self):
        if self._lpips is None and self._lpips_note is None:
            if self.settings.lpips:
                self._lpips, self._lpips_note = load_lpips(self.device)
            else:
                self._lpips_note = "LPIPS skipped: disabled (--no-lpips)."
        return self._lpips

    def _save(self) -> None:
        save_report(self.report, self.path)

    # ---------------------------------------------------------------- cells
    def _warmup(self, spec: MethodSpec) -> None:
        call = self._call(self.settings.prompts[0])
        logger.info("warm-up generation for %s", spec.label)
        generate(self.pipe, spec.config, call, seed=self.settings.seeds[0], device=self.device, output_type="latent")

    def _run_cell(self, spec: MethodSpec, prompt_index: int, seed: int, dense_id: str | None) -> dict:
        prompt = self.settings.prompts[prompt_index]
        timers: list[AttentionTimer] = []

        def timed(pipe):
            timer = AttentionTimer(pipeline_transformers(pipe))
            timers.append(timer)
            return timer()

        result = generate(self.pipe, spec.config, self._call(prompt), seed=seed, device=self.device,
                          instruments=[timed, lambda p: _capture_context(p, self._contexts)])
        cid = cell_id(spec, prompt, seed)
        stored = result.frames.astype(np.float16)
        path = self._frames_path(cid)
        tmp = f"{path[:-len('.npy')]}.tmp.npy"             # then renamed: a kill leaves no truncated frames
        np.save(tmp, stored)
        replace_durably(tmp, path)
        timer = timers[0]
        density, work = work_fraction(result.stats)
        cell = {
            "method": spec.label, "config": spec.config.to_dict(), "prompt_index": prompt_index, "prompt": prompt,
            "seed": seed, "frames_file": os.path.relpath(self._frames_path(cid), self.out_dir),
            "frames_shape": list(result.frames.shape),
            "wall_s": result.wall_s, "transformer_s": result.transformer_s,
            "transformer_total_s": result.transformer_total_s,
            "attention_s": timer.attention_total, "plan_s": timer.plan_total,
            "attention_calls": len(timer.attention_s),
            "realised_density": density, "attention_work": work,
            "layer_density": _layer_densities(result.stats), "stats": result.stats,
            "timed_in": self.run_started,
        }
        # both sides as stored (fp16): dense frames come back from disk, so the method's are rounded alike
        frames = stored.astype(result.frames.dtype)
        reference = frames if spec.is_dense else self._frames(dense_id)
        cell.update(self._quality(frames, reference))
        return cell

    def _quality(self, frames: np.ndarray, reference: np.ndarray) -> dict:
        psnr = psnr_per_frame(frames, reference)
        ssim = ssim_per_frame(frames, reference)
        model = self._lpips_model()
        return {
            "psnr_db": psnr_video(frames, reference), "psnr_per_frame": psnr,
            "ssim": float(np.mean(ssim)), "ssim_per_frame": ssim,
            "lpips": lpips_distance(model, frames, reference) if model is not None else None,
        }

    def run_cells(self) -> None:
        s = self.settings
        pairs = [(p, seed) for p in range(len(s.prompts)) for seed in s.seeds]
        bar = self._tqdm(len(pairs) * len(s.methods), "evaluate")
        warmed: set[str] = set()
        for p, seed in pairs:
            dense_id = cell_id(s.methods[0], s.prompts[p], seed)
            for spec in s.methods:
                cid = cell_id(spec, s.prompts[p], seed)
                bar.set_postfix_str(f"{spec.label} p{p} s{seed}")
                if self._done(cid):
                    self.skipped += 1
                    bar.update(1)
                    continue
                if s.warmup and spec.label not in warmed:
                    self._warmup(spec)
                    warmed.add(spec.label)
                t0 = time.perf_counter()
                self.report["cells"][cid] = self._run_cell(spec, p, seed, dense_id)
                self.computed += 1
                logger.info("cell %s prompt %d seed %d done in %.1f s", spec.label, p, seed, time.perf_counter() - t0)
                self._save()
                bar.update(1)
        bar.close()

    def _check_attention_sampling(self) -> None:
        """ValueError, before any work, for sampled steps or layers the run does not have."""
        s = self.settings
        steps = s.call["num_inference_steps"]
        beyond = [t for t in s.attn_steps or () if not 0 <= t < steps]
        if beyond:
            raise ValueError(f"--attn-steps {beyond}: the run has {steps} denoising steps (0..{steps - 1}).")
        from ..processors import self_attention_processors

        for transformer in pipeline_transformers(self.pipe):
            n = len(self_attention_processors(transformer))
            beyond = [layer for layer in s.attn_layers or () if not 0 <= layer < n]
            if beyond:
                raise ValueError(f"--attn-layers {beyond}: {type(transformer).__name__} has {n} self-attention "
                                 f"layers (0..{n - 1}).")

    def run_attention(self) -> None:
        s = self.settings
        pairs, steps, layers = s.attention_sampling()
        sparse = [m for m in s.methods if not m.is_dense]
        bar = self._tqdm(len(pairs) * len(sparse), "attention")
        for p, seed in pairs:
            for spec in sparse:
                cid = cell_id(spec, s.prompts[p], seed)
                old = self.report["attention"].get(cid)
                if old is not None and (old.get("steps"), old.get("layers")) == (steps, layers):
                    self.attention_skipped += 1
                    bar.update(1)
                    continue
                probes: dict[str, AttentionProbe] = {}
                generate(self.pipe, spec.config, self._call(s.prompts[p]), seed=seed, device=self.device,
                         output_type="latent", instruments=[lambda pipe: _probing(pipe, probes, steps, s.attn_layers)])
                self.report["attention"][cid] = {
                    "method": spec.label, "prompt_index": p, "seed": seed, "steps": steps, "layers": layers,
                    "entries": {name: probe.entries for name, probe in probes.items()},
                }
                self.attention_computed += 1
                self._save()
                bar.update(1)
        bar.close()

    # ---------------------------------------------------------------- summary and artifacts
    def summarize(self) -> dict[str, dict]:
        """label -> per-method means (quality) and medians (time), speedups and Amdahl estimates."""
        s = self.settings
        cells = self.report["cells"]
        keys = [(p, seed) for p in range(len(s.prompts)) for seed in s.seeds]
        # the attention cells of this run's sampling only (a report rerun with other sampling keeps older cells)
        pairs, steps, layers = s.attention_sampling()
        attention = {c: a for c, a in self.report["attention"].items()
                     if (a.get("steps"), a.get("layers")) == (steps, layers)}
        summary: dict[str, dict] = {}
        probes_of: dict[str, list[dict]] = {}
        for spec in s.methods:
            mine = [cells[c] for c in (cell_id(spec, s.prompts[p], seed) for p, seed in keys) if c in cells]
            probes = [e for c in (cell_id(spec, s.prompts[p], seed) for p, seed in pairs) if c in attention
                      for entries in attention[c]["entries"].values() for e in entries if e.get("sparse")]
            probes_of[spec.label] = probes

            def mean(key, rows=mine):
                return _mean_of(rows, key)

            psnrs = [r["psnr_db"] for r in mine if r.get("psnr_db") is not None]
            psnr_db, equal = summary_psnr(psnrs, spec.is_dense)

            def median(key):
                vals = [r[key] for r in mine if r.get(key) is not None]
                return float(statistics.median(vals)) if vals else None

            layer_density: dict[str, list] = {}
            for r in mine:
                for comp, dens in r.get("layer_density", {}).items():
                    layer_density.setdefault(comp, []).append(dens)
            summary[spec.label] = {
                "method": spec.method, "family": spec.family, "config": spec.config.to_dict(), "cells": len(mine),
                "nominal_density": None if math.isnan(spec.density) else spec.density,     # Sol by tau: none
                "realised_density": mean("realised_density") if not spec.is_dense else 1.0,
                "attention_work": mean("attention_work"),
                "layer_density": {c: [None if any(v is None for v in col) else float(np.mean(col))
                                      for col in zip(*rows)] for c, rows in layer_density.items()},
                "psnr_db": psnr_db, "cells_equal_to_dense": equal, "psnr_db_pooled": pooled_psnr(psnrs),
                "psnr_db_cell_max": max((v for v in psnrs if math.isfinite(v)), default=None),
                "cells_nan": sum(math.isnan(v) for v in psnrs),
                "transformer_s_range": _range_of(mine, "transformer_total_s"),
                # LPIPS over every cell or none (a rerun with --no-lpips leaves cells without it)
                "ssim": mean("ssim"), "lpips": mean("lpips") if all(r.get("lpips") is not None for r in mine) else None,
                "attn_rel_l2": mean("rel_l2", probes), "tile_recall": mean("recall", probes),
                "mass_kept": mean("mass_kept", probes), "oracle_mass_kept": mean("oracle_mass_kept", probes),
                "attention_samples": len(probes),
                "attn_steps": sorted({e["step"] for e in probes}),
                "attn_rel_l2_by_step": _by_step(probes, "rel_l2"), "tile_recall_by_step": _by_step(probes, "recall"),
                "timed_in": runs_of(mine),
                "wall_s": median("wall_s"), "transformer_s": median("transformer_total_s"),
                "attention_s": median("attention_s"), "plan_s": median("plan_s"),
                "kernels": sorted({comp["kernel_backend"] for r in mine for comp in (r.get("stats") or {}).values()
                                   if comp.get("kernel_backend") and comp.get("sparse_calls")}),
            }
        # methods with dense steps run sparse at fewer of the sampled steps, where the error differs most (the early
        # ones): they are compared at the steps every method ran sparse
        sampled = [set(row["attn_steps"]) for row in summary.values() if row["attn_steps"]]
        common = sorted(set.intersection(*sampled)) if sampled else []
        for label, row in summary.items():
            at = [e for e in probes_of[label] if e["step"] in common]
            row["attn_common_steps"] = common
            row["attn_rel_l2_common"] = _mean_of(at, "rel_l2")
            row["tile_recall_common"] = _mean_of(at, "recall")
        dense = summary[s.methods[0].label]
        f = None
        if dense["attention_s"] is not None and dense["transformer_s"]:
            f = min(dense["attention_s"] / dense["transformer_s"], 0.999999)
        for row in summary.values():
            row["attention_share"] = (row["attention_s"] / row["transformer_s"]
                                      if row["attention_s"] is not None and row["transformer_s"] else None)
            for key, base in (("speedup_transformer", "transformer_s"), ("speedup_e2e", "wall_s"),
                              ("speedup_attention", "attention_s")):
                row[key] = dense[base] / row[base] if dense[base] and row[base] else None
            work = row["attention_work"]
            row["amdahl_bound"] = 1.0 / ((1 - f) + f * work) if f is not None and work is not None else None
            row["amdahl_bound_free_attention"] = 1.0 / (1 - f) if f is not None else None
        return summary

    def _model_facts(self) -> tuple[dict, dict]:
        transformer = self.pipe.transformer
        ctx = self._contexts.get("transformer") or next(iter(self._contexts.values()), None)
        model = {"name": self.loaded.name, "pipeline_class": type(self.pipe).__name__,
                 "transformer_class": type(transformer).__name__, "dtype": self.dtype,
                 "transformer_config": dict(transformer.config)}
        shapes = dict(self.report.get("shapes", {}))
        if ctx is not None and ctx["grid"] is not None:
            info = ctx["info"]
            shapes = {"grid": list(ctx["grid"]), "video_tokens": math.prod(ctx["grid"]), "text_tokens": ctx["text_len"],
                      "heads": info.num_heads, "head_dim": info.head_dim, "layers": info.num_layers,
                      "patch_size": list(info.patch_size)}
        return model, shapes

    def write_videos(self) -> tuple[list[str], str | None]:
        """Side-by-side mp4 per prompt (first seed). Returns (paths relative to the output dir, None), or the
        paths written so far and the reason when no video can be written (e.g. no ffmpeg for imageio): the
        report is still completed then."""
        s = self.settings
        paths = []
        seed = s.seeds[0]
        for p, prompt in enumerate(s.prompts):
            present = [(m, cell_id(m, prompt, seed)) for m in s.methods]
            present = [(m, c) for m, c in present if self._done(c)]
            if len(present) < 1:
                continue
            from .video import side_by_side

            frames = side_by_side([self._frames(c) for _, c in present], [m.label for m, _ in present])
            path = os.path.join(self.out_dir, "videos", f"prompt{p:02d}_seed{seed}.mp4")
            try:
                write_video(frames, path, fps=s.fps)
            except (AttributeError, ImportError, OSError, RuntimeError) as err:   # diffusers: AttributeError
                return paths, f"{type(err).__name__}: {str(err).strip().splitlines()[-1]}"
            paths.append(os.path.relpath(path, self.out_dir))
        return paths, None

    def _summarized_attention(self) -> dict[str, dict]:
        """The attention cells `summarize` reads (this run's methods, pairs, steps and layers), under this run's
        labels."""
        s = self.settings
        pairs, steps, layers = s.attention_sampling()
        out = {}
        for spec in s.methods:
            for p, seed in pairs:
                cid = cell_id(spec, s.prompts[p], seed)
                cell = self.report["attention"].get(cid)
                if not spec.is_dense and cell is not None and (cell.get("steps"), cell.get("layers")) == (steps, layers):
                    out[cid] = {**cell, "method": spec.label}
        return out

    def _summarized_cells(self) -> list[dict]:
        """The quality cells `summarize` reads (this run's methods, prompts and seeds)."""
        s, cells = self.settings, self.report["cells"]
        ids = (cell_id(m, s.prompts[p], seed) for m in s.methods for p in range(len(s.prompts)) for seed in s.seeds)
        return [cells[c] for c in ids if c in cells]

    def write_plots(self, summary: dict) -> list[str]:
        from .plots import plot_error_heatmap, plot_quality_vs_density, plot_speedup_vs_density

        d = os.path.join(self.out_dir, "plots")
        name = self.loaded.name
        dense = summary[self.settings.methods[0].label]
        heatmap = os.path.join(d, "attention_error_heatmap.png")
        paths = [
            plot_quality_vs_density(summary, os.path.join(d, "quality_vs_density.png"), f"Quality vs density: {name}"),
            plot_speedup_vs_density(summary, dense.get("attention_share"), os.path.join(d, "speedup_vs_density.png"),
                                    f"Transformer speedup: {name}"),
        ]
        if self.settings.attn_cells:
            paths.insert(1, plot_error_heatmap(self._summarized_attention(), heatmap))
        elif os.path.exists(heatmap):       # no attention-level pass asked for: an earlier run's map would misread
            os.remove(heatmap)
        return [os.path.relpath(p, self.out_dir) for p in paths]

    def finish(self) -> dict:
        s = self.settings
        model, shapes = self._model_facts()
        summary = self.summarize()
        notes = []          # every note is found again from this run's cells: none carried over from a run before
        self._lpips_model()
        if self._lpips_note:
            notes.append(self._lpips_note)
        if self.device == "cpu":
            notes.append("Run on CPU: the sparse path uses the torch reference kernel, so times say nothing about "
                         "GPU speed (use --synthetic on a GPU for that).")
        fallbacks = sorted({reason for c in self._summarized_cells() for comp in (c.get("stats") or {}).values()
                            for layer in comp.get("layers", {}).values() for reason in layer.get("fallbacks", [])})
        if fallbacks:
            notes.append("Some calls fell back to dense attention: " + "; ".join(fallbacks))
        asked = s.call.get("num_frames")
        made = sorted({c["frames_shape"][0] for c in self._summarized_cells() if c.get("frames_shape")})
        if asked is not None and made and made != [asked]:
            notes.append(f"The pipeline made {' / '.join(map(str, made))} frames per video ({asked} asked: its frame "
                         "counts are stepped); every metric is over the frames it made.")
        notes += density_floor_notes(summary) + psnr_notes(summary) + timing_spread_notes(summary) + rerun_timing_notes(
            {label: row["timed_in"] for label, row in summary.items()})
        videos, video_error = self.write_videos()
        if video_error:
            notes.append(f"Side-by-side videos not written ({video_error}); the frames are in frames/*.npy.")
        notes = list(dict.fromkeys(notes))
        self.report.update(
            environment=environment(self.device), model=model, shapes=shapes,
            settings={"call": s.call, "prompts": s.prompts, "seeds": s.seeds, "warmup": s.warmup,
                      "attention_sampling": {"steps": s.attention_sampling()[1], "layers": s.attn_layers,
                                             "cells": s.attn_cells}},
            methods={m.label: {"config": m.config.to_dict(), "family": m.family} for m in s.methods},
            summary=summary, notes=notes, updated=time.strftime("%Y-%m-%dT%H:%M:%S"),
        )
        self.report["artifacts"] = {"videos": videos, "plots": self.write_plots(summary),
                                    "report_md": "report.md", "report_json": "report.json"}
        self._save()
        write_atomic(os.path.join(self.out_dir, "report.md"), render_markdown(self.report))
        return self.report


def run_evaluation(loaded, settings: EvalSettings, out_dir: str, *, overwrite: bool = False,
                   progress: bool = True) -> dict:
    """Run (or complete) an evaluation into `out_dir` and return the report dict.

    Args:
        loaded: `videosparse.models.loading.LoadedPipeline` (e.g. from `load_pipeline`).
        settings: `EvalSettings`.
        out_dir: output directory; cells already in its report.json are skipped.
        overwrite: discard a report.json made with other model/call settings instead of raising.
        progress: tqdm progress bars.

    Returns:
        The report (as written to report.json, with non-finite floats as floats); its `summary` maps
        each method label to its means, medians, speedups and Amdahl estimates, and `run_stats` says how
        many cells ("computed", "skipped") and attention-level passes ("attention_computed",
        "attention_skipped") were run and found done.
    """
    loaded.pipe.set_progress_bar_config(disable=True)
    ev = Evaluation(loaded, settings, out_dir, overwrite=overwrite, progress=progress)
    with torch.no_grad():
        ev.run_cells()
        if settings.attn_cells:
            ev.run_attention()
    report = ev.finish()
    report["run_stats"] = {"computed": ev.computed, "skipped": ev.skipped,
                           "attention_computed": ev.attention_computed, "attention_skipped": ev.attention_skipped}
    return report
