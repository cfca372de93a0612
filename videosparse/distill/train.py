"""Distillation of the Veda estimator with accelerate.

`run_distillation(cfg)` = capture (dense runs -> samples on disk, see `capture.py`) + training:

* every optimizer step takes one sample (or `gradient_accumulation_steps` of them): for every layer
  the estimator's logits from the detached TripPool features against the teacher heat, with the
  row-wise KL loss (`videosparse.veda.losses.tile_kl_loss`), averaged over layers;
* `accelerate`: mixed precision, data parallel over samples under `accelerate launch`, checkpoints
  with `save_state` into `checkpoints/step_XXXXXXXX` (written to a temp folder, renamed when
  complete) and `load_state` + `skip_first_batches` on resume; the sample order depends only on the
  seed and the epoch, so a killed-then-resumed run ends with the same weights as an uninterrupted one;
* `log.jsonl`: loss and tile recall at the target density every `log_every` steps;
* the output directory holds `model.safetensors` + `config.json` (`VedaEstimator.from_pretrained`),
  `distill_config.json`, `metrics.json` (trained vs untrained KL, tile and heat recall) and `tiling.json` when
  the estimator was distilled on a searched tiling.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .._helper_backend import triton_unavailable
from .._io import from_jsonable, replace_durably, to_jsonable, write_atomic
from .._run_checks import check_output
from ..method import ModelInfo
from ..models.loading import check_component
from ..validation import one_per_head
from ..veda.estimator import VedaEstimator
from ..veda.losses import tile_kl_loss, tile_recall
from ..veda.method import mean_pooled_logits
from ..veda.tiling import load_tiling
from .capture import (MODEL_INFO_FILE, capture_key, capture_settings, capture_to_cache, held_out_prompts, model_info,
                      split_by_prompt)
from .config import DistillConfig, read_prompts

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_PREFIX = "step_"
TRAINER_STATE = "trainer_state.json"


# ------------------------------------------------------------------------------------ data
class TileSampleDataset(torch.utils.data.Dataset):
    """Captured samples: item i is {layer: (qf, kf, heat)} of one (prompt, step, branch).

    Args:
        files: safetensors files written by `capture_to_cache`.
        num_layers: layers every sample must hold.
    """

    def __init__(self, files: Sequence[Path], num_layers: int) -> None:
        self.files = [Path(f) for f in files]
        self.num_layers = num_layers

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        from safetensors.torch import load_file

        try:
            t = load_file(str(self.files[i]))
        except Exception as e:      # damaged after it was written (writes are atomic): a disk fault, a power loss
            raise ValueError(f"sample {self.files[i]} cannot be read ({type(e).__name__}: {e}); delete it and its "
                             "prompt's .done marker (pNNNNN.done beside it) to capture that prompt again.") from None
        try:
            return {l: (t[f"q.{l}"], t[f"k.{l}"], t[f"heat.{l}"].float()) for l in range(self.num_layers)}
        except KeyError as e:
            raise ValueError(f"sample {self.files[i]} lacks {e.args[0]!r}; was it captured from another model?"
                             ) from None


class EpochShuffleSampler(torch.utils.data.Sampler[int]):
    """A permutation of range(n) that depends only on (seed, epoch): resumable and reproducible."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def _single(items):
    return items[0]


# ------------------------------------------------------------------------------------ objective
class DistillObjective(nn.Module):
    """Wraps the estimator so that one forward computes the loss over every layer of a sample.

    (One forward per backward keeps DistributedDataParallel happy.)
    """

    def __init__(self, estimator: VedaEstimator) -> None:
        super().__init__()
        self.estimator = estimator

    def forward(self, sample: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        """Mean KL over layers (fp32 scalar) and the detached logits per layer."""
        losses, logits = [], {}
        for layer in sorted(sample):
            qf, kf, heat = sample[layer]
            lg = self.estimator(qf, kf, layer)
            losses.append(tile_kl_loss(lg, heat))
            logits[layer] = lg.detach()
        return torch.stack(losses).mean(), logits


def _mean_recall(logits: dict[int, torch.Tensor], sample, density: float) -> dict[str, float]:
    vals = [tile_recall(logits[l], sample[l][2], density) for l in sorted(logits)]
    return {k: sum(v[k] for v in vals) / len(vals) for k in vals[0]}


@torch.no_grad()
def evaluate_estimator(estimator: VedaEstimator | None, files: Sequence[Path], num_layers: int, density: float,
                       device: torch.device | str = "cpu") -> dict[str, Any]:
    """KL and tile recall over samples, per layer and overall; `estimator=None` is the mean-pooled baseline.

    Returns:
        {"kl", "recall", "recall_offdiag", "heat_recall", "heat_recall_offdiag", "layers": {layer: {...}},
        "num_samples"} (see `veda.losses.tile_recall`).
    """
    data = TileSampleDataset(files, num_layers)
    per_layer: dict[int, list[dict[str, float]]] = {l: [] for l in range(num_layers)}
    for i in range(len(data)):
        sample = data[i]
        for l, (qf, kf, heat) in sample.items():
            qf, kf, heat = qf.to(device), kf.to(device), heat.to(device)
            lg = mean_pooled_logits(qf, kf) if estimator is None else estimator(qf, kf, l)
            rec = tile_recall(lg, heat, density)
            per_layer[l].append({"kl": float(tile_kl_loss(lg, heat)), **rec})
    layers = {l: {k: sum(d[k] for d in v) / len(v) for k in v[0]} for l, v in per_layer.items() if v}
    out = {k: sum(d[k] for d in layers.values()) / len(layers) for k in next(iter(layers.values()))}
    return {**out, "layers": layers, "num_samples": len(data)}


# ------------------------------------------------------------------------------------ checkpoints
def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (folders renamed from their temp name, holding the trainer state), oldest first."""
    found = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and (p / TRAINER_STATE).is_file():
                try:
                    found.append((int(p.name[len(CHECKPOINT_PREFIX):]), p))
                except ValueError:
                    continue
    return sorted(found)


_RUN_FIELDS = ("seed", "epochs", "max_steps", "learning_rate", "weight_decay", "warmup_steps", "lr_scheduler",
               "gradient_accumulation_steps", "mixed_precision", "init_std", "tiling", "block", "density",
               "cache_dtype")
# what `run_distillation` writes into output_dir (besides distill_config.json, checkpoints/ and cache/)
_RUN_FILES = ("log.jsonl", "model.safetensors", "config.json", "README.md", "metrics.json", "tiling.json")
# the finished estimator's files (written at the end of training)
_FINAL_FILES = ("model.safetensors", "config.json", "README.md", "metrics.json")


def _comparable_run(run: dict) -> dict:
    """A checkpoint's run settings as compared: the tiling file by the file it names (an absolute and a relative
    path to one file are one run; its contents are compared through the captures' tile shapes)."""
    tiling = run.get("tiling")
    return {**run, "tiling": os.path.realpath(tiling)} if isinstance(tiling, str) else run


def _refuse_other_run(cfg: DistillConfig, out: Path, tiles_for_layer, check_model) -> None:
    """Before anything is written or captured into `out`: a folder that is not a run's (no distill_config.json) but
    holds files a run would overwrite, or (resume on) a checkpoint another run wrote, is refused; train_estimator's
    own check comes only after the capture, which would already have replaced that run's config and samples. Checks
    what the config decides (training fields; with the cache's model info, each training prompt's capture key:
    prompt, its place, the validation split, capture settings, tile shapes); train_estimator compares the samples
    themselves. Other files (a prompts file, a tiling JSON) may share the folder."""
    if out.is_dir() and not (out / "distill_config.json").is_file():
        clash = [name for name in _RUN_FILES if (out / name).exists() and name != "tiling.json"]
        if clash:
            raise ValueError(f"output_dir={str(out)!r} is not a distillation run's folder but holds "
                             f"{', '.join(clash)}, which the run would overwrite; use an empty or new folder.")
    found = _checkpoints(out / CHECKPOINT_DIR)
    if not cfg.resume or not found:
        return
    try:        # a damaged newest checkpoint is refused here, before the capture replaces anything
        with open(found[-1][1] / TRAINER_STATE) as f:
            run = json.load(f).get("run")
        if not isinstance(run, dict):
            raise ValueError(f"its 'run' entry is {type(run).__name__}, not the run's settings")
    except (OSError, ValueError, AttributeError) as e:
        raise _damaged(found[-1][1], TRAINER_STATE, e) from None
    new = _comparable_run(json.loads(json.dumps(to_jsonable({name: cfg.to_dict()[name] for name in _RUN_FIELDS}))))
    captured = [c for c in run.get("captures") or [] if isinstance(c, dict)]
    run = _comparable_run(run)
    diff = sorted(k for k in new if k in run and run[k] != new[k])
    settings = capture_settings(cfg.capture_config())
    if any(c.get("settings") != settings for c in captured):
        fields = sorted({k for c in captured if isinstance(c.get("settings"), dict)
                         for k in set(c["settings"]) | set(settings) if c["settings"].get(k) != settings.get(k)})
        diff.append(f"capture settings: {', '.join(fields)}" if fields else "capture settings")
    if not {c.get("prompt") for c in captured} <= set(read_prompts(cfg.prompts)):
        diff.append("prompts")
    elif not diff and (out / "cache" / MODEL_INFO_FILE).is_file() and "captures" in run:
        diff += _captures_differ(cfg, out, tiles_for_layer, check_model, captured)
    if diff:
        raise ValueError(f"checkpoint {found[-1][1]} was written by a different run (differs in {diff}); resume it "
                         "with the same configuration, or use another output_dir (or resume=False; on the command line "
                         "--output-dir, --resume false). Nothing was "
                         "written.")


def _captures_differ(cfg: DistillConfig, out: Path, tiles_for_layer, check_model, captured: list[dict]) -> list[str]:
    """What differs between a checkpoint's captures (the training prompts' done-markers, in prompt order) and the
    capture keys this configuration gives its training prompts on the cached model ([] when nothing)."""
    info = model_info(json.loads((out / "cache" / MODEL_INFO_FILE).read_text()))
    check_model(info)
    prompts = read_prompts(cfg.prompts)
    held_out = held_out_prompts([f"p{i:05d}" for i in range(len(prompts))], cfg.val_fraction, cfg.seed, warn=False)
    heat_dtype = getattr(torch, cfg.cache_dtype)
    expected = [capture_key(cfg.capture_config(), prompt, cfg.block, tiles_for_layer, info.num_layers,
                            info.num_heads, heat_dtype)
                for i, prompt in enumerate(prompts) if f"p{i:05d}" not in held_out]
    for e, c in zip(expected, captured):
        if "heat_dtype" not in c:                           # a marker of before the heat dtype was recorded
            e.pop("heat_dtype", None)
    if expected == captured:
        return []
    if [e["prompt"] for e in expected] != [c.get("prompt") for c in captured]:
        return ["prompts (the list, its order or the validation split: val_fraction, seed)"]
    if [e["tiles"] for e in expected] != [c.get("tiles") for c in captured]:
        return ["tile shapes (the tiling file's contents)"]
    return ["captured samples (block, heat dtype)"]


def _undo_empty_start(out: Path, new_folder: bool, new_config: bool) -> None:
    """After a capture that failed before it captured anything (a pipeline that does not load, a `component` that is
    not a transformer): take back the config, the empty cache and the folder this run made, so that nothing
    half-done is left. A cache with anything in it is a run to resume and stays."""
    cache = out / "cache"
    if cache.is_dir() and any(p.name != MODEL_INFO_FILE for p in cache.iterdir()):
        return
    if cache.is_dir():
        (cache / MODEL_INFO_FILE).unlink(missing_ok=True)
        cache.rmdir()
    if new_config:
        (out / "distill_config.json").unlink(missing_ok=True)
    if new_folder and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def check_process_group(accelerator) -> None:
    """ValueError when the launcher started several processes (WORLD_SIZE > 1) that did not join one group: each
    would run the whole distillation alone into the same output folder (e.g. `accelerate launch --multi_gpu` on a
    machine without GPUs and without ACCELERATE_USE_CPU=1)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and accelerator.num_processes != world:
        raise ValueError(
            f"the launcher started {world} processes (WORLD_SIZE={world}) but accelerate set up "
            f"{accelerator.num_processes} ({accelerator.distributed_type}): each would distill alone into the same "
            "output folder. On CPU launch with ACCELERATE_USE_CPU=1 (e.g. `ACCELERATE_USE_CPU=1 accelerate launch "
            "--multi_gpu --num_processes 2 ...`), or run one process.")


def _run_key(cfg: DistillConfig, files: Sequence[Path], num_processes: int) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: training fields, the sample files and what they were
    captured from (each prompt's done-marker: prompt text, model and capture settings, tile shapes), the
    process count."""
    key = {name: cfg.to_dict()[name] for name in _RUN_FIELDS}
    key["samples"] = [Path(f).name for f in files]
    markers = sorted({Path(f).parent / f"{Path(f).name.split('_')[0]}.done" for f in files})
    key["captures"] = [json.loads(m.read_text()) if m.is_file() else None for m in markers]
    key["num_processes"] = num_processes
    return key


def _read_log(path: Path) -> list[dict[str, Any]]:
    """The log lines of an earlier run; a torn last line (a kill during its write) is dropped."""
    history = []
    if path.exists():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                history.append(from_jsonable(json.loads(line)))
            except ValueError:
                logger.warning("%s line %d is not valid JSON (cut by a kill?); dropped", path, n)
    return history


def _damaged(checkpoint: Path, what: str, error: BaseException) -> ValueError:
    """The error for a checkpoint folder that cannot be resumed (damaged after it was written: writes are atomic)."""
    detail = " ".join(f"{type(error).__name__}: {error}".split())[:300]
    return ValueError(f"checkpoint {checkpoint} cannot be resumed: {what} cannot be read ({detail}). Delete that "
                      "folder to resume from the checkpoint before it (if any is kept), or start over with resume=False "
                      "(`--resume false`).")


def _save_checkpoint(accelerator, root: Path, state: dict[str, Any], keep: int) -> Path:
    step = state["global_step"]
    final = root / f"{CHECKPOINT_PREFIX}{step:08d}"
    tmp = root / f".tmp_{CHECKPOINT_PREFIX}{step:08d}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(tmp / TRAINER_STATE, "w") as f:
            json.dump(state, f)
        shutil.rmtree(final, ignore_errors=True)
        replace_durably(tmp, final)
        _retire(root, _checkpoints(root)[:-keep])
    accelerator.wait_for_everyone()
    return final


def _retire(root: Path, checkpoints: list[tuple[int, Path]]) -> None:
    """Delete `checkpoints` (`_checkpoints` entries): each out of the checkpoints at once (renamed `.old_*`: a kill
    while deleting leaves none half-way), then deleted with whatever else a killed run left (`_remove_leftovers`)."""
    for _, old in checkpoints:
        os.replace(old, root / f".old_{old.name}")
    _remove_leftovers(root)


def _remove_leftovers(root: Path) -> None:
    """Delete the pruned checkpoints (`.old_*` folders) and what a run killed while pruning or saving left in `root`:
    `.tmp_*` folders and `step_*` folders without a trainer state (never a complete checkpoint: those are renamed
    into place whole)."""
    for p in root.iterdir():
        if not p.is_dir():
            continue
        if p.name.startswith((".old_", ".tmp_")) or (p.name.startswith(CHECKPOINT_PREFIX)
                                                      and not (p / TRAINER_STATE).is_file()):
            shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------------------------ training
@dataclass
class DistillResult:
    """What `run_distillation` returns.

    Attributes:
        output_dir: the estimator directory.
        global_step: optimizer steps done.
        history: the log lines (loss, recall, lr per logged step).
        metrics: final evaluation, trained vs untrained (mean-pooled) estimator.
        resumed_from: the checkpoint the run resumed from, if any.
    """

    output_dir: Path
    global_step: int
    history: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    resumed_from: Path | None = None


def layer_tiles(tiling: Any, num_layers: int, num_heads: int, block: int) -> list[list[tuple[int, int, int]]]:
    """Per layer, per head tile shapes from a shape or a tiling JSON path."""
    if isinstance(tiling, str):
        t = load_tiling(tiling, block)
        return [list(t.tiles_for(l, num_heads)) for l in range(num_layers)]
    return [one_per_head(tiling, num_heads) for _ in range(num_layers)]


def train_estimator(cfg: DistillConfig, files: Sequence[Path], info: ModelInfo, *, accelerator=None,
                    val_files: Sequence[Path] = (),
                    step_callback: Callable[[int, dict[str, Any]], None] | None = None) -> DistillResult:
    """Train a `VedaEstimator` on captured samples (see the module docstring).

    Args:
        cfg: the `DistillConfig` (output_dir, optimisation, checkpointing, logging fields).
        files: training sample files.
        info: the transformer's `ModelInfo` (recorded in the estimator's config).
        accelerator: an `accelerate.Accelerator` (made from cfg when None).
        val_files: held-out samples for the final evaluation (the training samples when empty).
        step_callback: called as `step_callback(global_step, metrics)` after every optimizer step
            (after any checkpoint of that step).

    Returns:
        `DistillResult`.
    """
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from diffusers.optimization import get_scheduler
    from tqdm.auto import tqdm

    out = Path(cfg.output_dir)
    if accelerator is None:
        accelerator = Accelerator(mixed_precision=cfg.mixed_precision,
                                  gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                                  project_config=ProjectConfiguration(project_dir=str(out)))
    if not files:
        raise ValueError("no training samples; capture at least one prompt.")
    set_seed(cfg.seed)
    tiles = layer_tiles(cfg.tiling, info.num_layers, info.num_heads, cfg.block)
    estimator = VedaEstimator(info.model_class, info.num_layers, info.num_heads, info.head_dim, block=cfg.block,
                              tile_shapes=[[list(s) for s in heads] for heads in tiles], init_std=cfg.init_std,
                              density=cfg.density, component=cfg.component)
    objective = DistillObjective(estimator)
    optimizer = torch.optim.AdamW(objective.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    dataset = TileSampleDataset(files, info.num_layers)
    sampler = EpochShuffleSampler(len(dataset), cfg.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, sampler=sampler, collate_fn=_single)
    steps_per_epoch = math.ceil(math.ceil(len(dataset) / accelerator.num_processes) / cfg.gradient_accumulation_steps)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    scheduler = get_scheduler(cfg.lr_scheduler, optimizer,
                              num_warmup_steps=cfg.warmup_steps * accelerator.num_processes,
                              num_training_steps=total_steps * accelerator.num_processes)
    objective, optimizer, loader, scheduler = accelerator.prepare(objective, optimizer, loader, scheduler)
    loader_len = len(loader)                                  # batches per epoch on this process

    ckpt_root = out / CHECKPOINT_DIR
    log_path = out / "log.jsonl"
    global_step, epoch, batches_done = 0, 0, 0
    resumed_from = None
    history: list[dict[str, Any]] = []
    running_resumed = (0.0, 0)
    run_key = _run_key(cfg, files, accelerator.num_processes)
    found = _checkpoints(ckpt_root)
    if accelerator.is_main_process and ckpt_root.is_dir():
        _remove_leftovers(ckpt_root)    # what a kill while saving or pruning left (frees the .old_ names used below)
    if found and not cfg.resume:
        # a fresh start: an earlier run's checkpoints would outrank (and prune) this run's and be resumed later
        if accelerator.is_main_process:
            logger.info("resume=False: removing %d checkpoints of an earlier run in %s", len(found), ckpt_root)
            _retire(ckpt_root, found)
        found = []
    accelerator.wait_for_everyone()
    if found:
        resumed_from = found[-1][1]
        try:
            with open(resumed_from / TRAINER_STATE) as f:
                st = json.load(f)
            if not isinstance(st, dict) or not all(k in st for k in ("global_step", "epoch", "batches_done")):
                raise ValueError("no global_step, epoch and batches_done")
        except (OSError, ValueError) as e:
            raise _damaged(resumed_from, TRAINER_STATE, e) from None
        expected = run_key
        if isinstance(st.get("run"), dict) and "cache_dtype" not in st["run"]:   # written before it was recorded:
            expected = {k: v for k, v in expected.items() if k != "cache_dtype"}  # the markers hold the heat dtype
        if "captures" not in st.get("run", {}):     # written before the capture check: compare what it recorded
            logger.warning("checkpoint %s predates the capture check; resuming it assumes its samples are these",
                           resumed_from)
            expected = {k: v for k, v in expected.items() if k != "captures"}
        # (the same run may name its tiling file by another path)
        if not isinstance(st.get("run"), dict) or _comparable_run(st["run"]) != _comparable_run(expected):
            written = st.get("run", {})
            diff = sorted(k for k in set(expected) | set(written) if expected.get(k) != written.get(k))
            what = (" (the captured samples: prompts, model, capture settings or tile shapes)"
                    if "captures" in diff else "")
            raise ValueError(
                f"checkpoint {resumed_from} was written by a different run (differs in {diff}{what}); resume it with "
                "the same configuration, samples and process count, or use another output_dir (or resume=False; "
                "on the command line --output-dir, --resume false)."
            )
        try:
            accelerator.load_state(str(resumed_from))
        except Exception as e:          # safetensors, torch.load and missing-file errors of the saved states
            raise _damaged(resumed_from, "its saved model, optimizer or RNG states", e) from None
        global_step, epoch, batches_done = st["global_step"], st["epoch"], st["batches_done"]
        running_resumed = (st.get("running_loss", 0.0), st.get("running_n", 0))   # the log window in progress
        logger.info("resumed from %s (step %d)", resumed_from, global_step)
    if accelerator.is_main_process and found:
        # the pruning a run killed in its last save left undone (a resume at its end never saves again); only once
        # the newest was resumed: the error for a damaged one points to the checkpoint before it
        _retire(ckpt_root, found[:-cfg.keep_checkpoints])
    history = [h for h in _read_log(log_path) if h.get("step", global_step + 1) <= global_step]
    if accelerator.is_main_process:
        if resumed_from is None:        # a run from step 0: an earlier run's estimator must not sit beside its config
            for name in _FINAL_FILES:
                (out / name).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(log_path, "".join(json.dumps(to_jsonable(h), allow_nan=False) + "\n" for h in history))

    progress = tqdm(total=total_steps, initial=global_step, desc="distill",
                    disable=not accelerator.is_local_main_process)
    running, running_n = running_resumed
    while global_step < total_steps:
        loader.set_epoch(epoch)
        active = accelerator.skip_first_batches(loader, batches_done) if batches_done else loader
        for sample in active:
            with accelerator.accumulate(objective):
                loss, logits = objective(sample)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            batches_done += 1
            running += float(accelerator.gather(loss.detach()).mean())
            running_n += 1
            if not accelerator.sync_gradients:
                continue
            global_step += 1
            progress.update(1)
            metrics: dict[str, Any] = {"step": global_step, "epoch": epoch, "loss": running / running_n,
                                       "lr": scheduler.get_last_lr()[0]}
            if global_step % cfg.log_every == 0 or global_step == total_steps or global_step == 1:
                rec = _mean_recall(logits, sample, cfg.density)
                keys = sorted(rec)
                vals = accelerator.gather(torch.tensor([rec[k] for k in keys], device=accelerator.device)[None])
                rec = dict(zip(keys, vals.float().nanmean(0).tolist()))              # mean over processes
                metrics.update(rec)
                history.append(metrics)
                progress.set_postfix(loss=f"{metrics['loss']:.4f}", recall=f"{rec['recall']:.3f}")
                if accelerator.is_main_process:
                    with open(log_path, "a") as f:
                        f.write(json.dumps(to_jsonable(metrics), allow_nan=False) + "\n")
                running, running_n = 0.0, 0
            epoch_done = batches_done >= loader_len
            if global_step % cfg.checkpoint_every == 0 or global_step == total_steps:
                state = {"global_step": global_step, "epoch": epoch + 1 if epoch_done else epoch,
                         "batches_done": 0 if epoch_done else batches_done, "run": run_key,
                         "running_loss": running, "running_n": running_n}
                _save_checkpoint(accelerator, ckpt_root, state, cfg.keep_checkpoints)
            if step_callback is not None:
                step_callback(global_step, metrics)
            if global_step >= total_steps:
                break
        else:                                              # the epoch ran to its end
            epoch += 1
            batches_done = 0
    progress.close()

    accelerator.wait_for_everyone()
    trained = accelerator.unwrap_model(objective).estimator
    _refuse_diverged(trained, history, ckpt_root)        # every process (replicas are equal): none waits for another
    metrics_out: dict[str, Any] = {}
    if accelerator.is_main_process:
        trained = trained.float().eval()
        eval_files = list(val_files) or list(files)
        metrics_out = {
            "split": "val" if val_files else "train",
            "density": cfg.density,
            "trained": evaluate_estimator(trained, eval_files, info.num_layers, cfg.density, accelerator.device),
            "untrained_mean_pool": evaluate_estimator(None, eval_files, info.num_layers, cfg.density,
                                                      accelerator.device),
        }
        card = model_card(trained, cfg, metrics_out, history, global_step, files, val_files)
        _save_final(trained, out, cfg, metrics_out, card)
    accelerator.wait_for_everyone()
    return DistillResult(out, global_step, history, metrics_out, resumed_from)


def _refuse_diverged(estimator: VedaEstimator, history: list[dict[str, Any]], ckpt_root: Path) -> None:
    """ValueError when training left non-finite weights (a diverged run), naming the first logged step whose loss was
    not finite: such an estimator scores every tile NaN, which the plan never chooses, so only each query tile's own
    tile would run (a density far below the target) without an error. Nothing final is written; the checkpoints
    stay."""
    bad = [name for name, p in estimator.named_parameters() if not bool(torch.isfinite(p).all())]
    if not bad:
        return
    first = next((h["step"] for h in history if not math.isfinite(float(h.get("loss", 0.0)))), None)
    raise ValueError(f"distillation diverged: the trained estimator's {', '.join(bad)} hold non-finite values"
                     + (f" (the loss was first not finite at logged step {first})" if first is not None else "")
                     + f"; lower --learning-rate and run again with --resume false (checkpoints in {ckpt_root}).")


def _shapes_text(estimator: VedaEstimator) -> str:
    """'4x4x8 for every head', or each distinct shape with its head count."""
    counts: dict[str, int] = {}
    for heads in estimator.tile_shapes:
        for shape in heads:
            name = "x".join(map(str, shape))
            counts[name] = counts.get(name, 0) + 1
    if len(counts) == 1:
        return f"{next(iter(counts))} for every head"
    return "per head (searched tiling, also in `tiling.json`): " + ", ".join(
        f"{name} ({n} head{'s' if n > 1 else ''})" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def model_card(estimator: VedaEstimator, cfg: DistillConfig, metrics: dict[str, Any], history: list[dict[str, Any]],
               global_step: int, files: Sequence[Path], val_files: Sequence[Path] = ()) -> str:
    """The README.md written beside the estimator: what it serves, how it was distilled, how to load it.

    (Replaces huggingface_hub's default card of `save_pretrained`, which only has placeholders.)
    """
    from huggingface_hub import ModelCard, ModelCardData

    prompts = {Path(f).name.split("_")[0] for f in (*files, *val_files)}
    model = cfg.model or "reference"
    source = f"`{model}`" + (f" (its `{cfg.component}`)" if cfg.component != "transformer" else "")
    held_out = f", {len(val_files)} of them held out for the evaluation" if val_files else ""
    length = f"max_steps={cfg.max_steps}" if cfg.max_steps else f"{cfg.epochs} epoch{'s' if cfg.epochs != 1 else ''}"
    block_arg = "" if estimator.block == 128 else f", block={estimator.block}"     # VedaConfig's default: 128
    cli_flags = f" --density {cfg.density:g}" + ("" if estimator.block == 128 else f" --block {estimator.block}")
    if cfg.model not in (None, "reference"):                # generate's default model is the reference model
        cli_flags = f" --model {cfg.model}" + cli_flags
    lines = [
        f"# Veda tile estimator for `{estimator.model_class}`",
        "",
        "A videosparse Veda estimator (arXiv 2605.30325): TripPool features of every query and key tile and a "
        "per-head projection score each (query tile, key tile) pair of the video self-attention, and videosparse's "
        "Veda method computes only the top-scoring key tiles of each query tile. It was distilled from the model's "
        "own dense attention.",
        "",
        "| | |",
        "|---|---|",
        f"| transformer class | `{estimator.model_class}` |",
        f"| self-attention layers | {estimator.num_layers} |",
        f"| heads per layer | {estimator.num_heads} |",
        f"| head dim | {estimator.head_dim} |",
        f"| block (tokens per tile) | {estimator.block} |",
        f"| tile shapes (pt x ph x pw) | {_shapes_text(estimator)} |",
        "",
        "## Training",
        "",
        f"`videosparse distill` on {source}: {len(prompts)} prompt{'s' if len(prompts) != 1 else ''}, "
        f"{len(files) + len(val_files)} samples (one per prompt, denoising step and CFG branch{held_out}); "
        f"{global_step} optimizer steps ({length}, "
        f"learning rate {cfg.learning_rate:g}, {cfg.lr_scheduler} schedule), row-wise KL to the dense tile "
        f"attention; recall logged at density {cfg.density:g}.",
    ]
    if history:
        last = history[-1]
        recall = f", tile recall {last['recall']:.3f}" if "recall" in last else ""
        lines += ["", f"Last logged training step ({last.get('step')}): loss {last['loss']:.4f}{recall}."]
    if metrics.get("trained"):
        t, u = metrics["trained"], metrics["untrained_mean_pool"]
        lines += ["", f"Evaluation on the {metrics.get('split', 'train')} samples at density {metrics['density']:g}: "
                      f"KL {t['kl']:.4f} (untrained, mean-pooled q·k: {u['kl']:.4f}), tile recall {t['recall']:.3f} "
                      f"(untrained: {u['recall']:.3f})" + (
                          f", teacher heat kept against the oracle's {t['heat_recall']:.3f} (untrained: "
                          f"{u['heat_recall']:.3f})" if "heat_recall" in t and "heat_recall" in u else "") + "."]
    lines += [
        "",
        "The full settings are in `distill_config.json`, the training log in `log.jsonl`, the evaluation in "
        "`metrics.json`.",
        "",
        "## Use",
        "",
        "```python",
        "import videosparse",
        "",
        f'videosparse.apply(pipe, videosparse.VedaConfig(density={cfg.density:g}, estimator="{cfg.output_dir}"'
        f"{block_arg}))",
        "```",
        "",
        f"or `videosparse generate --estimator {cfg.output_dir}{cli_flags}` (a directory or, once uploaded, its hub "
        "id; upload it without the run's `cache/` and `checkpoints/`: `huggingface_hub.upload_folder(..., "
        'ignore_patterns=["cache/*", "checkpoints/*"])`). '
        f"It was distilled from the pipeline's `{cfg.component}` and serves that transformer only: in a pipeline "
        "of several (Wan 2.2's experts) the others score their tiles untrained unless each gets its own estimator: "
        f'`VedaConfig(estimator=("{cfg.output_dir}", <the other expert\'s>))`, each serving the transformer it was '
        f"distilled from (`--estimator {cfg.output_dir} <the other expert's>` on the command line). The transformer "
        "must be a "
        f"`{estimator.model_class}` with the layers, heads and head dim above (videosparse checks and raises "
        "otherwise); its own tile shapes are used unless `tiling=` is given.",
    ]
    data = ModelCardData(library_name="videosparse", tags=["videosparse", "veda", "sparse-attention"])
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"))


def _save_final(estimator: VedaEstimator, out: Path, cfg: DistillConfig, metrics: dict[str, Any],
                card: str | None = None) -> None:
    """Weights + config + model card (save_pretrained into a temp folder, files moved in by rename), metrics,
    tiling."""
    tmp = out / ".tmp_final"
    shutil.rmtree(tmp, ignore_errors=True)
    estimator.save_pretrained(tmp)
    if card is not None:
        (tmp / "README.md").write_text(card)            # instead of huggingface_hub's placeholder card
    for name in os.listdir(tmp):
        replace_durably(tmp / name, out / name)
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(cfg.tiling, str) and Path(cfg.tiling).resolve() != (out / "tiling.json").resolve():
        shutil.copyfile(cfg.tiling, out / ".tiling.json.tmp")
        replace_durably(out / ".tiling.json.tmp", out / "tiling.json")
    write_atomic(out / "metrics.json", json.dumps(to_jsonable(metrics), indent=1, allow_nan=False))   # nan as "nan"


def run_distillation(cfg: DistillConfig, *, step_callback: Callable[[int, dict[str, Any]], None] | None = None
                     ) -> DistillResult:
    """Distill a Veda estimator: capture samples from dense runs, then train (resumable).

    Args:
        cfg: a `DistillConfig`.
        step_callback: optional `step_callback(global_step, metrics)` after every optimizer step.

    Returns:
        `DistillResult`; `cfg.output_dir` then loads with `VedaEstimator.from_pretrained` and
        `VedaConfig(estimator=cfg.output_dir, tiling=...)`.

    Example:
        >>> from videosparse.distill import DistillConfig, run_distillation
        >>> cfg = DistillConfig(model="reference", prompts="prompts.txt", output_dir="veda-ref", epochs=20)
        >>> result = run_distillation(cfg)                                              # doctest: +SKIP
    """
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    read_prompts(cfg.prompts)                               # a bad prompts value fails before any work
    check_output("output_dir=", cfg.output_dir, folder=True)    # and a folder no file can be made in
    check_component(cfg.model, cfg.component)               # a component the pipeline lacks, before its load
    out = Path(cfg.output_dir)
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision,
                              gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                              project_config=ProjectConfiguration(project_dir=str(out)))
    check_process_group(accelerator)
    device = torch.device(cfg.capture_config().device or accelerator.device)
    why = triton_unavailable(device) if cfg.teacher_backend == "triton" else None
    if why:                                                 # before the config or any sample is written
        raise ValueError(f"teacher_backend='triton' (--teacher-backend triton): {why}; use 'auto' or 'torch'.")
    tiling = load_tiling(cfg.tiling, cfg.block) if isinstance(cfg.tiling, str) else None

    def tiles_for_layer(layer: int, num_heads: int):
        return tiling.tiles_for(layer, num_heads) if tiling is not None else cfg.tiling

    fresh = not (cfg.resume and _checkpoints(out / CHECKPOINT_DIR))      # a run from step 0

    def check_model(info: ModelInfo) -> None:
        if tiling is not None:                              # before any sample is captured with its shapes
            tiling.check_model(info.model_class, info.num_layers, info.num_heads, cfg.tiling)
        if fresh and accelerator.is_main_process:
            # the model loaded and the capture starts: an earlier run's estimator must not stay beside this run's
            # config, also after a kill during the capture (a model that fails to load leaves it)
            for name in _FINAL_FILES:
                (out / name).unlink(missing_ok=True)

    _refuse_other_run(cfg, out, tiles_for_layer, check_model)
    new_folder, new_config = not out.exists(), not (out / "distill_config.json").exists()
    old_config = None if new_config else (out / "distill_config.json").read_bytes()
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        cfg.save(out / "distill_config.json")
    accelerator.wait_for_everyone()

    heat_dtype = getattr(torch, cfg.cache_dtype)
    try:
        files, info = capture_to_cache(cfg.capture_config(), out / "cache", tiles_for_layer, block=cfg.block,
                                       accelerator=accelerator, teacher_backend=cfg.teacher_backend,
                                       heat_dtype=heat_dtype, check_model=check_model)
    except Exception:
        if accelerator.is_main_process:
            if old_config is not None and (out / "model.safetensors").exists():
                # failed before the capture began (`check_model`): the earlier run's estimator stays, with its config
                write_atomic(out / "distill_config.json", old_config)
            _undo_empty_start(out, new_folder, new_config)
        raise
    train_files, val_files = split_by_prompt(files, cfg.val_fraction, cfg.seed)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return train_estimator(cfg, train_files, info, accelerator=accelerator, val_files=val_files,
                           step_callback=step_callback)
