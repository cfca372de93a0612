"""Capture of distillation samples from dense pipeline runs.

The dense pipeline runs under `videosparse.processors.observe`; for every self-attention call at a
sampled denoising step the observer gathers q and k into the layer's tile order, pools them with
TripPool (detached, fp32) and computes the teacher heat over the video tiles. One sample per
(prompt, step, CFG branch) holds every layer and is written as one safetensors file (a forward whose batch
items have different valid text lengths, e.g. Mochi's negative and positive prompt, is observed item by item:
one sample per item then, its branch named "<branch>-item<b>"):

    q.{layer}     fp32 [B, H, Mv, 3*D]   TripPool features of the query tiles
    k.{layer}     fp32 [B, H, Mv, 3*D]   TripPool features of the key tiles
    heat.{layer}  [B, H, Mv, Mv]         teacher heat (cache dtype)

Files are written atomically (temp name + rename) and a prompt is marked done only after all of its
samples are on disk, so a killed capture resumes where it stopped. With several processes
(`accelerate launch`), prompts are split between them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .._io import replace_durably, write_atomic
from ..layout import head_tiling
from ..method import ModelInfo
from ..veda.teacher import teacher_heat
from ..veda.trippool import trippool_qk
from .config import CaptureConfig, read_prompts

logger = logging.getLogger(__name__)

TileShape = tuple[int, int, int]
TilesFn = Callable[[int, int], Any]          # (layer, num_heads) -> one shape or one per head

MODEL_INFO_FILE = "model_info.json"


# ------------------------------------------------------------------------------------ pipeline
def load_capture_pipeline(cfg: CaptureConfig, device: str | torch.device | None = None) -> tuple[Any, dict[str, Any]]:
    """The pipeline named by `cfg.model` and its call settings (cfg values override the model's defaults).

    `device` overrides `cfg.device` (each process of a distributed run passes its own).

    Returns:
        (pipe, call_kwargs) where call_kwargs holds num_frames, height, width, num_inference_steps,
        guidance_scale (and max_sequence_length for the tiny pipeline).
    """
    from ..models.loading import default_device, default_dtype, load_pipeline

    device = str(device or cfg.device or default_device())
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else default_dtype(device)
    loaded = load_pipeline(cfg.model, device, dtype)
    pipe, defaults = loaded.pipe, dict(loaded.defaults)
    defaults.pop("prompt", None)
    for name in ("num_frames", "height", "width", "num_inference_steps", "guidance_scale"):
        value = getattr(cfg, name)
        if value is not None:
            defaults[name] = value
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    steps = defaults.get("num_inference_steps")
    if cfg.steps_per_prompt is not None and steps is not None and cfg.steps_per_prompt > int(steps):
        logger.warning("steps_per_prompt=%d is more than the %d denoising steps of a call: every step is sampled.",
                       cfg.steps_per_prompt, int(steps))
    return pipe, defaults


def sample_steps(num_steps: int, steps_per_prompt: int | None, seed: int, prompt_index: int) -> list[int]:
    """Sorted denoising steps sampled for one prompt (all steps when steps_per_prompt is None or larger)."""
    if steps_per_prompt is None or steps_per_prompt >= num_steps:
        return list(range(num_steps))
    rng = random.Random(seed * 1_000_003 + prompt_index)
    return sorted(rng.sample(range(num_steps), steps_per_prompt))


def transformer_info(transformer: torch.nn.Module) -> ModelInfo:
    """The `ModelInfo` videosparse's processors derive for `transformer` (dense processors, briefly)."""
    from ..processors import observe, sessions

    with observe(transformer, lambda record: None):
        return next(iter(sessions(transformer).values())).info


# ------------------------------------------------------------------------------------ observer
class TileFeatureCapture:
    """Observer turning attention records into (TripPool q, TripPool k, teacher heat) per layer.

    Args:
        tiles_for_layer: (layer, num_heads) -> tile shape(s) of that layer.
        block: tokens per tile.
        steps: denoising steps to keep (None: all).
        branches: CFG branches to keep (None: all).
        teacher_backend: "auto", "triton" or "torch".
        heat_dtype: dtype the heat is stored in.
        on_sample: with `num_layers`, called as `on_sample((step, branch), {layer: (qf, kf, heat)}, grid)` as soon
            as a sample holds every layer, which then leaves `samples` (a pipeline call then holds one forward's
            features at a time, not every step's).

    Attributes:
        samples: {(step, branch): {layer: (qf, kf, heat)}} on the CPU (those not handed to `on_sample`); the
            records of a forward observed item by item (`AttentionRecord.item`) go to the branch "<branch>-item<b>".
        handed: the keys handed to `on_sample`.
        branches_seen: the CFG branches of every record observed, kept or not.
    """

    def __init__(self, tiles_for_layer: TilesFn, block: int, *, steps: Sequence[int] | None = None,
                 branches: Sequence[str] | None = None, teacher_backend: str = "auto",
                 heat_dtype: torch.dtype = torch.float32, num_layers: int | None = None,
                 on_sample: Callable[[tuple[int, str], dict, tuple[int, int, int]], None] | None = None) -> None:
        self.tiles_for_layer = tiles_for_layer
        self.block = block
        self.steps = None if steps is None else set(steps)
        self.branches = None if branches is None else set(branches)
        self.teacher_backend = teacher_backend
        self.heat_dtype = heat_dtype
        self.samples: dict[tuple[int, str], dict[int, tuple[torch.Tensor, ...]]] = defaultdict(dict)
        self.grids: dict[tuple[int, str], tuple[int, int, int]] = {}
        self._calls: dict[tuple[str, int, int | None], int] = defaultdict(int)
        if on_sample is not None and num_layers is None:
            raise ValueError("TileFeatureCapture(on_sample=...) needs num_layers (a sample is complete with them).")
        self.num_layers, self.on_sample = num_layers, on_sample
        self.handed: list[tuple[int, str]] = []
        self.branches_seen: set[str] = set()
        self.grids_too_small: set[tuple[int, int, int]] = set()

    @torch.no_grad()
    def __call__(self, record) -> None:
        step = record.step
        item = record.item
        if step is None:                                        # no step from the pipeline: count calls
            step = self._calls[(record.branch, record.layer, item)]
            self._calls[(record.branch, record.layer, item)] += 1
        self.branches_seen.add(str(record.branch))
        if self.steps is not None and step not in self.steps:
            return
        if self.branches is not None and record.branch not in self.branches:
            return
        H = record.q.shape[2]
        if math.prod(record.grid) < self.block:
            # fewer video tokens than one tile: one partial tile, which every plan keeps (nothing to choose, a
            # sample of 1 x 1 heat that trains nothing), as search-tiling leaves it out
            grid = tuple(int(g) for g in record.grid)
            if grid not in self.grids_too_small:
                self.grids_too_small.add(grid)
                logger.warning("grid %s has fewer video tokens than one %d-token tile: its calls keep their one tile "
                               "(nothing to choose) and give no sample", grid, self.block)
            return
        layout = head_tiling(record.grid, self.tiles_for_layer(record.layer, H), H, self.block,
                             record.text_len, record.text_position or "after", record.text_slot)
        Mv = layout.num_video_tiles
        qt, kt = layout.gather(record.q), layout.gather(record.k)
        qf, kf = trippool_qk(qt, kt, self.block, Mv)
        heat = teacher_heat(qt, kt, self.block, num_tiles=Mv, backend=self.teacher_backend)
        key = (int(step), str(record.branch) if item is None else f"{record.branch}-item{item}")
        self.samples[key][int(record.layer)] = (qf.cpu(), kf.cpu(), heat.to(self.heat_dtype).cpu())
        self.grids[key] = tuple(int(g) for g in record.grid)
        if self.on_sample is not None and len(self.samples[key]) == self.num_layers:
            self.on_sample(key, self.samples.pop(key), self.grids[key])
            self.handed.append(key)


def write_sample(path: Path, layers: dict[int, tuple[torch.Tensor, ...]], meta: dict[str, Any]) -> None:
    """One sample as safetensors, written atomically."""
    from safetensors.torch import save_file

    tensors = {}
    for layer, (qf, kf, heat) in layers.items():
        tensors[f"q.{layer}"] = qf.contiguous()
        tensors[f"k.{layer}"] = kf.contiguous()
        tensors[f"heat.{layer}"] = heat.contiguous()
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={k: json.dumps(v) for k, v in meta.items()})
    replace_durably(tmp, path)


def _atomic_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=1))


def capture_settings(cfg: CaptureConfig) -> dict:
    """The capture settings a done-marker records (every field but the prompts and the device), JSON-comparable."""
    return json.loads(json.dumps({k: v for k, v in asdict(cfg).items() if k not in ("prompts", "device")}))


def capture_key(cfg: CaptureConfig, prompt: str, block: int, tiles_for_layer: TilesFn, num_layers: int,
                 num_heads: int, heat_dtype: torch.dtype) -> dict:
    """Everything a prompt's captured samples depend on; stored in its done-marker (JSON-comparable)."""
    tiles = [tiles_for_layer(layer, num_heads) for layer in range(num_layers)]
    return json.loads(json.dumps({"prompt": prompt, "settings": capture_settings(cfg), "block": block,
                                  "tiles": tiles, "heat_dtype": str(heat_dtype).removeprefix("torch.")}))


_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def _marker_matches(cache: Path, index: int, key: dict) -> bool:
    """True when prompt `index` was captured with exactly `key` (an empty or other marker does not match). A marker
    written before the heat dtype was recorded matches when the rest does and its samples hold heat of that dtype."""
    marker = cache / f"p{index:05d}.done"
    try:
        stored = json.loads(marker.read_text())
        if isinstance(stored, dict) and "heat_dtype" not in stored and "heat_dtype" in key:
            sample = next(iter(sorted(cache.glob(f"p{index:05d}_s*.safetensors"))), None)
            if sample is None or stored != {k: v for k, v in key.items() if k != "heat_dtype"}:
                return False
            from safetensors import safe_open

            with safe_open(str(sample), framework="pt") as f:
                return f.get_slice("heat.0").get_dtype() == _SAFETENSORS_DTYPES.get(key["heat_dtype"])
        return stored == key
    except (OSError, ValueError, KeyError, StopIteration):
        return False


def capture_to_cache(cfg: CaptureConfig, cache_dir: str | os.PathLike, tiles_for_layer: TilesFn, *, block: int,
                     accelerator=None, teacher_backend: str = "auto", heat_dtype: torch.dtype = torch.float32,
                     check_model: Callable[[ModelInfo], None] | None = None) -> tuple[list[Path], ModelInfo]:
    """Run the dense pipeline on every prompt and write the samples into `cache_dir`.

    Prompts already marked done with the same prompt text, settings, block, tile shapes and heat dtype are skipped
    (resume); a marker from other settings is recaptured. With an `accelerate.Accelerator` the prompts
    are split between processes. `check_model(info)` may refuse the transformer (e.g. a tiling file searched for
    another model) before anything is captured.

    Returns:
        (sorted sample files, the transformer's `ModelInfo`).
    """
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(cfg.prompts)
    if accelerator is not None:
        accelerator.wait_for_everyone()             # every process sees the same done-markers
    info_path = cache / MODEL_INFO_FILE
    try:
        known = model_info(json.loads(info_path.read_text())) if info_path.exists() else None
    except ValueError:                  # damaged (as a damaged done-marker): nothing of that cache is reused
        logger.warning("%s does not hold the transformer description a capture writes: every prompt is captured "
                       "afresh", info_path)
        known = None

    def reusable(i: int) -> bool:
        try:
            key = capture_key(cfg, prompts[i], block, tiles_for_layer, known.num_layers, known.num_heads, heat_dtype)
        except ValueError:              # tile shapes that do not fit the cached model: that cache is not this run's
            return False
        return _marker_matches(cache, i, key)

    todo = [i for i in range(len(prompts)) if known is None or not reusable(i)]
    if len(todo) < len(prompts) and check_model is not None:     # samples of the cached model are reused
        check_model(known)
    mine = todo
    if accelerator is not None and accelerator.num_processes > 1:
        with accelerator.split_between_processes(todo) as part:
            mine = list(part)
    if mine or not info_path.exists():
        device = accelerator.device if accelerator is not None and cfg.device is None else None
        pipe, call_kwargs = load_capture_pipeline(cfg, device)
        transformer = getattr(pipe, cfg.component, None)
        if not isinstance(transformer, torch.nn.Module):
            raise ValueError(f"component={cfg.component!r} is not a transformer of {type(pipe).__name__}.")
        info = transformer_info(transformer)
        if check_model is not None:
            check_model(info)
        if accelerator is None or accelerator.is_main_process:
            _atomic_json(info_path, asdict(info))
        from ..processors import observe

        num_steps = int(call_kwargs["num_inference_steps"])
        for i in mine:
            (cache / f"p{i:05d}.done").unlink(missing_ok=True)      # its samples are about to be replaced
            for stale in cache.glob(f"p{i:05d}_s*.safetensors"):   # an earlier capture with other settings
                stale.unlink()

            def write(key: tuple[int, str], layers: dict, grid: tuple[int, int, int], i: int = i) -> None:
                step, branch = key              # each sample as soon as its forward is done: one in memory at a time
                meta = {"prompt_index": i, "prompt": prompts[i], "step": step, "branch": branch, "grid": list(grid),
                        "block": block}
                write_sample(cache / f"p{i:05d}_s{step:04d}_{branch}.safetensors", layers, meta)

            steps = sample_steps(num_steps, cfg.steps_per_prompt, cfg.seed, i)
            cap = TileFeatureCapture(tiles_for_layer, block, steps=steps, branches=cfg.branches,
                                     teacher_backend=teacher_backend, heat_dtype=heat_dtype,
                                     num_layers=info.num_layers, on_sample=write)
            generator = torch.Generator("cpu").manual_seed(cfg.seed + i)
            with observe(transformer, cap):
                pipe(prompts[i], generator=generator, output_type="latent", **call_kwargs)
            if cap.samples:                                     # left over: a forward that missed layers
                (step, branch), layers = min(cap.samples.items())
                raise ValueError(f"prompt {i} step {step} branch {branch!r}: captured layers {sorted(layers)}, "
                                 f"expected {info.num_layers}.")
            if not cap.handed:
                if cfg.branches is not None and cap.branches_seen and not cap.branches_seen & set(cfg.branches):
                    raise ValueError(f"branches={list(cfg.branches)}: prompt {i}'s forwards name the branches "
                                     f"{sorted(cap.branches_seen)} (with guidance_scale <= 1 a pipeline runs only "
                                     "'cond').")
                if cap.grids_too_small:
                    raise ValueError(f"prompt {i}: its video grids {sorted(cap.grids_too_small)} hold fewer tokens "
                                     f"than one {block}-token tile, so there is no tile to choose and no sample; "
                                     "capture at a larger height, width or num_frames.")
                raise ValueError(f"prompt {i} produced no self-attention records at steps {steps}; "
                                 "is the pipeline's transformer supported by videosparse.processors?")
            key = capture_key(cfg, prompts[i], block, tiles_for_layer, info.num_layers, info.num_heads, heat_dtype)
            _atomic_json(cache / f"p{i:05d}.done", key)
            logger.info("captured prompt %d/%d (%d samples)", i + 1, len(prompts), len(cap.handed))
        del pipe, transformer
    if accelerator is not None:
        accelerator.wait_for_everyone()
    with open(info_path) as f:
        info = model_info(json.load(f))
    files = sorted(p for p in cache.glob("p*_s*.safetensors"))
    keep = {f"p{i:05d}" for i in range(len(prompts))}
    files = [p for p in files if p.name.split("_")[0] in keep]
    return files, info


def model_info(d: dict[str, Any]) -> ModelInfo:
    """The `ModelInfo` a cache's model_info.json holds (a ValueError naming the file when it holds anything else)."""
    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if not (isinstance(d, dict) and isinstance(d.get("model_class"), str)
            and all(count(d.get(k)) for k in ("num_layers", "num_heads", "head_dim"))
            and isinstance(d.get("patch_size"), list) and all(count(v) for v in d["patch_size"])
            and isinstance(d.get("text_position"), (str, type(None)))):
        raise ValueError(f"the capture cache's {MODEL_INFO_FILE} holds {d!r}, not the transformer description a "
                         "capture writes (model_class, num_layers, num_heads, head_dim, patch_size, text_position); "
                         "delete the output folder's cache/ folder to capture afresh.")
    return ModelInfo(d["model_class"], d["num_layers"], d["num_heads"], d["head_dim"], tuple(d["patch_size"]),
                     d.get("text_position"))


def held_out_prompts(prompt_ids: Sequence[str], val_fraction: float, seed: int, *, warn: bool = True) -> set[str]:
    """The prompt ids ("p00003") held out for validation: the nearest count to val_fraction, at least one when it
    is above 0, never all of them (a fraction that holds out none warns when `warn`)."""
    prompts = sorted(set(prompt_ids))
    n_val = max(1, round(val_fraction * len(prompts))) if val_fraction > 0 else 0     # nearest, at least one
    n_val = min(n_val, len(prompts) - 1)
    if val_fraction > 0 and n_val == 0 and warn:
        logger.warning("val_fraction=%s holds out no prompt of %d (training needs one): the evaluation uses the "
                       "training samples", val_fraction, len(prompts))
    rng = random.Random(seed)
    return set(rng.sample(prompts, n_val)) if n_val > 0 else set()


def split_by_prompt(files: Sequence[Path], val_fraction: float, seed: int) -> tuple[list[Path], list[Path]]:
    """(train, val) split of sample files by prompt (no prompt in both); val empty when val_fraction is 0."""
    val_prompts = held_out_prompts([p.name.split("_")[0] for p in files], val_fraction, seed)
    train = [p for p in files if p.name.split("_")[0] not in val_prompts]
    val = [p for p in files if p.name.split("_")[0] in val_prompts]
    return train, val
