"""Mutation finds of the distillation script (`videosparse/distill/train.py`, `capture.py`, `config.py`): each test
fails on a realistic one-line bug the rest of the suite let through. The training tests run `train_estimator` on a
few synthetic samples written with `capture.write_sample` (no pipeline, well under a second); the capture tests run
the tiny Wan pipeline at its smallest size."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from videosparse.distill import DistillConfig
from videosparse.method import ModelInfo

INFO = ModelInfo("WanTransformer3DModel", 2, 2, 16, (1, 2, 2))       # 2 layers x 2 heads, head dim 16
TILES = 10                                                            # video tiles per sample


def write_samples(folder: Path, n: int = 4, seed: int = 0) -> list[Path]:
    """`n` synthetic samples (one per prompt) in the capture's file layout: TripPool-shaped features and a peaked
    teacher heat, every layer of `INFO`."""
    from videosparse.distill.capture import write_sample

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    files = []
    for i in range(n):
        layers = {}
        for layer in range(INFO.num_layers):
            shape = (1, INFO.num_heads, TILES)
            qf = torch.randn(*shape, 3 * INFO.head_dim, generator=g)
            kf = torch.randn(*shape, 3 * INFO.head_dim, generator=g)
            heat = torch.rand(*shape, TILES, generator=g) ** 6 + 1e-4
            layers[layer] = (qf, kf, heat / heat.sum(-1, keepdim=True))
        path = folder / f"p{i:05d}_s0000_cond.safetensors"
        write_sample(path, layers, {"prompt_index": i})
        files.append(path)
    return files


def cfg_for(out: Path, **kw) -> DistillConfig:
    args = dict(model="tiny", prompts=("a cat",), output_dir=str(out), density=0.5, max_steps=4, learning_rate=1e-3,
                log_every=1, checkpoint_every=100, keep_checkpoints=2, seed=3)
    args.update(kw)
    return DistillConfig(**args)


def train(cfg: DistillConfig, files, **kw):
    from videosparse.distill.train import train_estimator

    return train_estimator(cfg, files, INFO, **kw)


def untrained(file: Path, density: float) -> dict:
    """KL and recall of the mean-pooled scores (what a zero-initialised estimator computes) on one sample."""
    from videosparse.distill.train import evaluate_estimator

    return evaluate_estimator(None, [file], INFO.num_layers, density)


def sample_order(n: int, seed: int, steps: int) -> list[int]:
    """The samples the first `steps` optimizer steps take (one per step): the documented order, which depends only on
    (seed, epoch)."""
    from videosparse.distill.train import EpochShuffleSampler

    sampler, order = EpochShuffleSampler(n, seed), []
    for epoch in range(math.ceil(steps / n)):
        sampler.set_epoch(epoch)
        order += list(sampler)
    return order[:steps]


def test_the_log_holds_each_windows_mean_loss_and_the_recall_at_the_target_density(tmp_path):
    """Mutation find: log.jsonl's "loss" is the mean KL over the samples since the previous log line, and its recall
    is the step's own at the configured density, with the last step logged also when log_every does not divide it
    (mutants: the recall logged at the default density 0.1, the layers' KL summed instead of averaged, the loss
    window never reset, the last step left out of the log). An estimator initialised at zero with a negligible
    learning rate scores each sample as the mean-pooled baseline does, so every logged number is known."""
    files = write_samples(tmp_path / "cache")
    out = tmp_path / "run"
    res = train(cfg_for(out, init_std=0.0, learning_rate=1e-30, max_steps=5, log_every=2), files)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [h["step"] for h in log] == [1, 2, 4, 5]
    per_step = [untrained(files[i], 0.5) for i in sample_order(len(files), 3, 5)]
    windows = {1: [0], 2: [1], 4: [2, 3], 5: [4]}
    for h in log:
        steps = windows[h["step"]]
        assert h["loss"] == pytest.approx(sum(per_step[s]["kl"] for s in steps) / len(steps), rel=1e-5), h
        for key in ("recall", "recall_offdiag", "heat_recall"):
            assert h[key] == pytest.approx(per_step[steps[-1]][key], rel=1e-5, abs=1e-7), (h["step"], key)
    assert [h["loss"] for h in res.history] == [h["loss"] for h in log]
    # the density matters on these samples: at 0.1 the recall of some sample differs
    assert any(untrained(files[i], 0.1)["recall"] != untrained(files[i], 0.5)["recall"] for i in range(len(files)))


def test_the_logged_learning_rate_follows_the_schedule_over_max_steps_with_its_warmup(tmp_path):
    """Mutation find: the learning rate runs the configured diffusers schedule over max_steps (not over the epochs
    max_steps overrides), after warmup_steps of linear warmup, and the log records the rate the scheduler set
    (mutants: the schedule's length taken from `epochs`, the config's base rate logged)."""
    files = write_samples(tmp_path / "cache")
    res = train(cfg_for(tmp_path / "run", max_steps=6, warmup_steps=2, epochs=10, lr_scheduler="cosine"), files)

    def cosine(step: int) -> float:                     # after `step` scheduler steps (diffusers' cosine schedule)
        if step < 2:
            return 1e-3 * step / 2
        return 1e-3 * 0.5 * (1 + math.cos(math.pi * (step - 2) / (6 - 2)))

    assert [h["step"] for h in res.history] == [1, 2, 3, 4, 5, 6]
    assert [h["lr"] for h in res.history] == pytest.approx([cosine(s) for s in range(1, 7)], abs=1e-12)
    assert res.history[-1]["lr"] == pytest.approx(0.0, abs=1e-12)      # the schedule ends at max_steps


def test_weight_decay_reaches_the_optimizer(tmp_path):
    """Mutation find: `weight_decay` is AdamW's decoupled decay (the mutant left it out, so AdamW's default 0.01
    applied whatever the config said). With lr * weight_decay = 0.1 and a constant rate, each step shrinks the
    projections by 0.9 (Adam's own step is ~1e-3 of them), so two steps leave 0.81 of the undecayed run's norm."""
    from videosparse.veda.estimator import VedaEstimator

    files = write_samples(tmp_path / "cache")
    norms = {}
    for wd in (0.0, 100.0):
        train(cfg_for(tmp_path / f"wd{wd}", init_std=1.0, max_steps=2, lr_scheduler="constant", weight_decay=wd),
              files)
        est = VedaEstimator.from_pretrained(tmp_path / f"wd{wd}")
        norms[wd] = float(est.proj_q.detach().norm())
    assert norms[100.0] / norms[0.0] == pytest.approx(0.81, abs=0.01)


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_the_last_step_is_checkpointed_and_a_finished_run_resumes_there(tmp_path):
    """Mutation find: the last optimizer step is checkpointed also when checkpoint_every does not divide it, so
    running the finished configuration again resumes at its end and trains no more (the mutant saved only every
    checkpoint_every steps: the rerun went back to step 2 and trained step 3 again)."""
    files = write_samples(tmp_path / "cache")
    out = tmp_path / "run"
    assert train(cfg_for(out, max_steps=3, checkpoint_every=2), files).global_step == 3
    assert checkpoints(out) == ["step_00000002", "step_00000003"]
    steps = []
    again = train(cfg_for(out, max_steps=3, checkpoint_every=2), files, step_callback=lambda s, m: steps.append(s))
    assert again.resumed_from == out / "checkpoints" / "step_00000003" and again.global_step == 3 and steps == []


def test_a_step_folder_without_a_trainer_state_is_not_resumed_and_is_cleared(tmp_path):
    """Mutation find: a `step_*` folder without trainer_state.json (a save cut short) is no checkpoint: the run
    resumes from the newest complete one and removes it (the mutant took any `step_*` folder: the resume then failed
    on the missing trainer state, however good the checkpoints before it were)."""
    files = write_samples(tmp_path / "cache")
    out = tmp_path / "run"
    train(cfg_for(out, max_steps=2, checkpoint_every=1), files)
    cut = out / "checkpoints" / "step_00000009"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"cut short")
    res = train(cfg_for(out, max_steps=2, checkpoint_every=1), files)
    assert res.resumed_from == out / "checkpoints" / "step_00000002" and res.global_step == 2
    assert checkpoints(out) == ["step_00000001", "step_00000002"]


def test_a_kill_while_the_trainer_state_is_written_leaves_the_checkpoint_before(tmp_path, monkeypatch):
    """Mutation find: a checkpoint's trainer_state.json is written inside the temp folder, before it is renamed
    into place, so a kill during that write leaves the checkpoint before it as the newest complete one (the mutant
    wrote it after the rename: a torn trainer state in `step_00000002`, and the resume was refused as damaged)."""
    from videosparse.distill import train as train_module

    files = write_samples(tmp_path / "cache")
    out = tmp_path / "run"
    real_dump = json.dump

    def torn_dump(obj, fp, *args, **kwargs):
        if str(getattr(fp, "name", "")).endswith("trainer_state.json") and obj.get("global_step") == 2:
            fp.write(json.dumps(obj)[:20])
            raise KeyboardInterrupt                                  # the kill, in the middle of the write
        return real_dump(obj, fp, *args, **kwargs)

    monkeypatch.setattr(train_module.json, "dump", torn_dump)
    with pytest.raises(KeyboardInterrupt):
        train(cfg_for(out, max_steps=3, checkpoint_every=1), files)
    monkeypatch.setattr(train_module.json, "dump", real_dump)
    steps = []
    res = train(cfg_for(out, max_steps=3, checkpoint_every=1), files, step_callback=lambda s, m: steps.append(s))
    assert res.resumed_from == out / "checkpoints" / "step_00000001" and steps == [2, 3]
    assert checkpoints(out) == ["step_00000002", "step_00000003"]


@pytest.mark.parametrize("field, bad, message", [
    ("density", 0.0, "density=0.0 must be a number in (0, 1]"),
    ("density", 1.5, "density=1.5 must be a number in (0, 1]"),
    ("val_fraction", 1, "val_fraction=1 must lie in [0, 1)"),
    ("keep_checkpoints", 0, "keep_checkpoints=0 must be an int >= 1"),
    ("steps_per_prompt", 0, "steps_per_prompt=0 must be an int >= 1"),
    ("max_steps", 0, "max_steps=0 must be an int >= 1"),
    ("teacher_backend", "reference", "teacher_backend='reference' must be one of 'auto', 'triton', 'torch'"),
])
def test_distill_config_refuses_each_bound_at_construction(tmp_path, field, bad, message):
    """Mutation find: each of these values is refused when the config is made, naming the field, not after the
    capture (mutants: the density, keep_checkpoints or steps_per_prompt check dropped, val_fraction=1 or max_steps=0
    let through, search-tiling's backend name 'reference' taken for the teacher's)."""
    import re

    with pytest.raises(ValueError, match=re.escape(message)):
        cfg_for(tmp_path / "run", **{field: bad})


def test_distill_config_takes_the_largest_seed_and_generates_dtype_spellings(tmp_path):
    """Mutation find: the seed's bound is inclusive (2**32 - 1, the largest accelerate's set_seed takes, is a valid
    seed; the mutant refused it) and each of generate's dtype spellings maps to its own dtype (the mutant mapped
    'fp16' to bfloat16)."""
    assert cfg_for(tmp_path / "run", seed=2 ** 32 - 1).seed == 2 ** 32 - 1
    for spelling, dtype in (("fp16", "float16"), ("bf16", "bfloat16"), ("fp32", "float32")):
        assert cfg_for(tmp_path / "run", dtype=spelling).dtype == dtype
    with pytest.raises(ValueError, match=r"seed=4294967296 must lie in \[0, 2\*\*32 - 1\]"):
        cfg_for(tmp_path / "run", seed=2 ** 32)


TWO_PROMPTS = ("a red circle moving left", "a blue square moving up")


def capture_cfg(out: Path, **kw) -> DistillConfig:
    """The tiny pipeline at its smallest capture: 9 frames of 128 x 128 (a 3 x 8 x 8 grid), one branch, one of two
    steps sampled per prompt."""
    args = dict(prompts=TWO_PROMPTS, num_inference_steps=2, steps_per_prompt=1, num_frames=9, height=128, width=128,
                guidance_scale=1.0)
    args.update(kw)
    return cfg_for(out, **args)


def capture(cfg: DistillConfig, cache: Path) -> list[Path]:
    from videosparse.distill.capture import capture_to_cache

    files, _ = capture_to_cache(cfg.capture_config(), cache, lambda layer, heads: cfg.tiling, block=cfg.block)
    return files


def test_a_capture_returns_exactly_its_own_samples_after_one_of_other_settings(tmp_path):
    """Mutation find: capturing into a cache that holds an earlier capture with another seed and more prompts
    returns this configuration's samples only: the prompt is captured again (the seed is part of its key: the
    pipeline noise and the sampled steps depend on it), its earlier samples go, and the earlier run's extra prompts
    are not returned (mutants: the seed left out of the capture key, the stale samples kept, the samples of prompts
    beyond the list returned)."""
    from videosparse.distill.capture import sample_steps

    cache = tmp_path / "cache"
    assert sample_steps(2, 1, 0, 0) == [1] and sample_steps(2, 1, 3, 0) == [0]
    first = capture(capture_cfg(tmp_path / "a", seed=0), cache)
    assert [f.name for f in first] == ["p00000_s0001_cond.safetensors", "p00001_s0000_cond.safetensors"]
    files = capture(capture_cfg(tmp_path / "b", seed=3, prompts=TWO_PROMPTS[:1]), cache)
    assert [f.name for f in files] == ["p00000_s0000_cond.safetensors"]
    assert sorted(p.name for p in cache.glob("p00000_*.safetensors")) == ["p00000_s0000_cond.safetensors"]
    assert json.loads((cache / "p00000.done").read_text())["settings"]["seed"] == 3


def test_a_prompt_captured_again_is_not_marked_done_until_its_samples_are_written(tmp_path, monkeypatch):
    """Mutation find: when a prompt is captured again (here: the cache's model_info.json was damaged, so nothing of it
    is reused), its done-marker goes with its old samples before the new ones are written; a capture stopped then
    leaves the prompt to capture, not a marker of a prompt without samples (the mutant kept the marker: the next
    capture reused the prompt and returned none of its samples)."""
    from videosparse.distill import capture as capture_module

    cache = tmp_path / "cache"
    cfg = capture_cfg(tmp_path / "run", prompts=TWO_PROMPTS[:1])
    first = [f.name for f in capture(cfg, cache)]
    assert len(first) == 1
    (cache / "model_info.json").write_text("{}")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(capture_module, "write_sample", killed)
    with pytest.raises(KeyboardInterrupt):
        capture(cfg, cache)
    assert not (cache / "p00000.done").exists()
    monkeypatch.undo()
    assert [f.name for f in capture(cfg, cache)] == first


def test_a_zero_guidance_scale_is_passed_to_the_pipeline(tmp_path):
    """Mutation find: call settings given in the config override the model's defaults also when they are falsy
    (the mutant took `guidance_scale=0.0` as not given, and the tiny pipeline's default 5.0 ran)."""
    from videosparse.distill.capture import load_capture_pipeline

    _, call_kwargs = load_capture_pipeline(capture_cfg(tmp_path / "run", guidance_scale=0.0))
    assert call_kwargs["guidance_scale"] == 0.0
    _, call_kwargs = load_capture_pipeline(capture_cfg(tmp_path / "run", guidance_scale=None))
    assert call_kwargs["guidance_scale"] == 5.0                         # not given: the model's default


def test_a_searched_tiling_is_copied_beside_the_estimator(tmp_path):
    """Mutation find: an estimator distilled on a tiling JSON gets a copy of it as `output_dir/tiling.json`, as
    DistillConfig documents (the JSON must be used at inference with it; the mutant wrote no copy)."""
    from videosparse.veda.tiling import Tiling

    tiling = tmp_path / "searched.json"
    Tiling((((2, 8, 8), (4, 4, 8)), ((4, 4, 8), (4, 4, 8))), 128,
           {"model_class": INFO.model_class, "num_layers": 2, "num_heads": 2}).save(tiling)
    out = tmp_path / "run"
    train(cfg_for(out, tiling=str(tiling), max_steps=1), write_samples(tmp_path / "cache"))
    assert (out / "tiling.json").read_bytes() == tiling.read_bytes()
    assert json.loads((out / "config.json").read_text())["tile_shapes"] == [[[2, 8, 8], [4, 4, 8]],
                                                                           [[4, 4, 8], [4, 4, 8]]]


def test_the_validation_split_holds_out_at_least_one_prompt_chosen_by_the_seed():
    """Mutation find: val_fraction above 0 holds out at least one prompt, also where the nearest count is 0, never a
    prompt's samples on both sides, and which prompts are held out follows the seed, reproducibly (mutants: the
    count only rounded, so 0.1 of 4 prompts held out none and the final metrics were the training samples'; the
    split drawn with a fixed seed)."""
    from videosparse.distill.capture import held_out_prompts, split_by_prompt

    files = [Path(f"p{i:05d}_s{s:04d}_cond.safetensors") for i in range(4) for s in range(2)]
    train_files, val_files = split_by_prompt(files, 0.1, seed=0)
    assert len(val_files) == 2 and len(train_files) == 6                 # one prompt, both its samples
    assert not {f.name[:6] for f in val_files} & {f.name[:6] for f in train_files}
    ids = [f"p{i:05d}" for i in range(10)]
    splits = {seed: held_out_prompts(ids, 0.2, seed) for seed in range(8)}
    assert all(len(s) == 2 for s in splits.values())
    assert len({frozenset(s) for s in splits.values()}) > 1             # the seed picks the prompts
    assert all(held_out_prompts(ids, 0.2, seed) == s for seed, s in splits.items())


def test_a_run_may_go_into_the_folder_that_holds_its_tiling_json(tmp_path):
    """Mutation find: a new output folder that already holds a tiling JSON (the search's output, written there to
    distill on it) is not taken for someone else's folder: the run distills into it and keeps the file (the mutant
    counted tiling.json among the files a run would overwrite and refused the folder)."""
    from videosparse.distill import run_distillation
    from videosparse.veda.tiling import Tiling

    out = tmp_path / "run"
    out.mkdir()
    Tiling((((4, 4, 8),) * 2,) * 2, 128, {"model_class": "WanTransformer3DModel", "num_layers": 2,
                                          "num_heads": 2}).save(out / "tiling.json")
    searched = (out / "tiling.json").read_bytes()
    res = run_distillation(capture_cfg(out, prompts=TWO_PROMPTS[:1], tiling=str(out / "tiling.json"), max_steps=1,
                                       num_inference_steps=1))
    assert res.global_step == 1 and (out / "model.safetensors").is_file()
    assert (out / "tiling.json").read_bytes() == searched
