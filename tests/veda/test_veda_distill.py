"""Distillation on the tiny Wan pipeline (CPU): lowers the KL, writes a loadable estimator and checkpoints,
and a run killed with SIGKILL then resumed ends with the same weights as an uninterrupted one."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from videosparse.distill import DistillConfig, run_distillation
from videosparse.veda.estimator import VedaEstimator

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ("a red circle moving left", "a blue square moving up")


def test_a_tiling_file_named_by_another_path_is_the_same_run(tmp_path, monkeypatch):
    """Review find: resuming with the absolute path of the tiling file the run was started with (relative) was
    refused as "a different run (differs in ['tiling'])"; its contents are compared through the captures."""
    from videosparse.distill.train import _comparable_run

    (tmp_path / "t.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    run = {"seed": 3, "tiling": "t.json"}
    assert _comparable_run(run) == _comparable_run({"seed": 3, "tiling": str(tmp_path / "t.json")})
    assert _comparable_run(run) != _comparable_run({"seed": 3, "tiling": "other.json"})
    assert _comparable_run({"tiling": None}) == {"tiling": None} and run == {"seed": 3, "tiling": "t.json"}


def make_cfg(out: Path, **kw) -> DistillConfig:
    args = dict(model="tiny", prompts=PROMPTS, num_inference_steps=2, output_dir=str(out), density=0.3,
                max_steps=12, learning_rate=1e-3, log_every=2, checkpoint_every=4, keep_checkpoints=2, seed=3)
    args.update(kw)
    return DistillConfig(**args)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One capture of the tiny pipeline (2 prompts x 2 steps x 2 CFG branches), reused by every run."""
    from videosparse.distill.capture import capture_to_cache

    root = tmp_path_factory.mktemp("capture")
    cfg = make_cfg(root / "unused")
    files, info = capture_to_cache(cfg.capture_config(), root / "cache", lambda layer, heads: cfg.tiling,
                                   block=cfg.block)
    assert len(files) == 8 and info.num_layers == 2 and info.num_heads == 2
    return root / "cache"


def with_cache(out: Path, cache: Path) -> Path:
    out.mkdir(parents=True)
    shutil.copytree(cache, out / "cache")
    return out


def test_capture_samples_hold_features_and_teacher(cache):
    from safetensors.torch import load_file

    t = load_file(str(sorted(cache.glob("p00000_*.safetensors"))[0]))
    qf, kf, heat = t["q.0"], t["k.0"], t["heat.0"]
    assert qf.shape == kf.shape == (1, 2, 10, 192) and qf.dtype == torch.float32     # grid (5, 16, 16) -> 10 tiles
    assert heat.shape == (1, 2, 10, 10) and bool((heat > 0).all()) and bool((heat <= 1).all())
    assert (cache / "p00000.done").exists() and (cache / "p00001.done").exists()


def test_capture_resumes_only_matching_prompts(tmp_path, cache):
    """A done prompt is reused only when its prompt text, settings and tiles are the ones asked for now."""
    from videosparse.distill.capture import capture_to_cache

    out = with_cache(tmp_path / "run", cache)
    cfg = make_cfg(out)
    before = {p.name: p.stat().st_mtime_ns for p in (out / "cache").glob("p*_s*.safetensors")}
    capture_to_cache(cfg.capture_config(), out / "cache", lambda layer, heads: cfg.tiling, block=cfg.block)
    after = {p.name: p.stat().st_mtime_ns for p in (out / "cache").glob("p*_s*.safetensors")}
    assert after == before                                  # same settings: nothing recaptured
    changed = make_cfg(out, prompts=[PROMPTS[0], "a blue square moving up on a dark background"])
    files, _ = capture_to_cache(changed.capture_config(), out / "cache", lambda layer, heads: cfg.tiling,
                                block=cfg.block)
    from safetensors import safe_open

    kept = {p.name: p.stat().st_mtime_ns for p in (out / "cache").glob("p00000_*.safetensors")}
    assert all(before[n] == t for n, t in kept.items())     # prompt 0 unchanged: reused
    for f in files:
        if f.name.startswith("p00001"):
            with safe_open(str(f), "pt") as h:
                assert "blue square" in h.metadata()["prompt"]   # prompt 1 changed: recaptured


def test_short_distillation_lowers_kl_and_writes_a_loadable_estimator(tmp_path, cache):
    out = with_cache(tmp_path / "run", cache)
    res = run_distillation(make_cfg(out, max_steps=24, log_every=4, checkpoint_every=8))
    assert res.global_step == 24 and res.resumed_from is None
    trained, untrained = res.metrics["trained"], res.metrics["untrained_mean_pool"]
    assert trained["kl"] < 0.9 * untrained["kl"]
    assert trained["recall"] > untrained["recall"]
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [h["step"] for h in log] == [1, 4, 8, 12, 16, 20, 24]
    assert all({"loss", "recall", "lr"} <= set(h) for h in log)
    assert log[-1]["loss"] < log[0]["loss"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000016", "step_00000024"]
    assert json.loads((out / "distill_config.json").read_text())["max_steps"] == 24
    est = VedaEstimator.from_pretrained(out)
    assert est.model_class == "WanTransformer3DModel" and est.num_heads == 2 and est.head_dim == 64
    card = (out / "README.md").read_text()                 # our card, not huggingface_hub's placeholder one
    assert "More Information Needed" not in card and "pushed to the Hub" not in card
    assert "`WanTransformer3DModel`" in card and "4x4x8 for every head" in card and "2 prompts" in card
    assert f'VedaConfig(density=0.3, estimator="{out}")' in card and "library_name: videosparse" in card
    assert est.proj_q.abs().max() > 1e-2                  # moved away from the 1e-4 init

    import videosparse
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    pipe = build_tiny_wan_pipeline()
    pipe.set_progress_bar_config(disable=True)
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.3, estimator=str(out)))
    pipe("a red circle", num_frames=17, height=256, width=256, num_inference_steps=2, output_type="latent",
         max_sequence_length=32, generator=torch.Generator().manual_seed(0))
    assert handle["transformer"].stats()["sparse_calls"] == 2 * 2 * 2
    method = handle["transformer"].method
    assert torch.equal(method.estimator.proj_q, est.proj_q)
    videosparse.remove(pipe)


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from videosparse.distill import DistillConfig, run_distillation
    cfg = DistillConfig.load(sys.argv[1])
    def kill_at(step, metrics):
        if step == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)
    run_distillation(cfg, step_callback=kill_at)
""")


def test_killed_then_resumed_run_equals_uninterrupted(tmp_path, cache):
    full = with_cache(tmp_path / "full", cache)
    ref = run_distillation(make_cfg(full, log_every=3))   # log windows across the step-4 checkpoint
    assert ref.global_step == 12

    out = with_cache(tmp_path / "killed", cache)
    cfg = make_cfg(out, log_every=3)
    cfg.save(tmp_path / "cfg.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path / "cfg.json"), "6"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (out / "checkpoints" / "step_00000004").is_dir()            # steps 5 and 6 are lost
    assert not (out / "model.safetensors").exists()
    # a save cut short by a kill leaves only a temp folder, which resume must ignore
    junk = out / "checkpoints" / ".tmp_step_00000008"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"truncated")

    res = run_distillation(cfg)
    assert res.resumed_from == out / "checkpoints" / "step_00000004"
    assert res.global_step == 12
    a, b = VedaEstimator.from_pretrained(full), VedaEstimator.from_pretrained(out)
    assert torch.equal(a.proj_q, b.proj_q) and torch.equal(a.proj_k, b.proj_k)
    assert [h["step"] for h in res.history] == [h["step"] for h in ref.history]
    # every logged loss, also the window the kill cut (its partial mean is in the checkpoint)
    assert [h["loss"] for h in res.history] == pytest.approx([h["loss"] for h in ref.history], rel=1e-6)
    # and resuming a finished run does no more steps, even after a kill cut the log's last line
    with open(out / "log.jsonl", "a") as f:
        f.write('{"step": 13, "lo')
    # ... and cleans up after a kill in its last save's pruning, which a resume at the end never repeats
    # (fault-injection find: a third checkpoint or an `.old_*` folder stayed for good)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    shutil.copytree(out / "checkpoints" / kept[0], out / "checkpoints" / "step_00000001")
    # a pruned folder left over under the name that pruning step_00000001 takes
    shutil.copytree(out / "checkpoints" / kept[0], out / "checkpoints" / ".old_step_00000001")
    again = run_distillation(cfg)
    assert again.global_step == 12 and again.resumed_from == out / "checkpoints" / "step_00000012"
    assert [h["step"] for h in again.history] == [h["step"] for h in ref.history]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == kept
    # a checkpoint of another configuration is not silently continued, and refusing it writes nothing: the run's
    # config (which a resume reads) and its samples stay as they were
    written = {p: p.read_bytes() for p in [out / "distill_config.json", *sorted((out / "cache").iterdir())]}
    with pytest.raises(ValueError, match="different run \\(differs in \\['learning_rate'\\]\\)"):
        run_distillation(make_cfg(out, learning_rate=2e-3))
    with pytest.raises(ValueError, match="differs in \\['prompts'\\]"):
        run_distillation(make_cfg(out, prompts=("a green triangle moving right", "a blue square moving up")))
    # (review find: it said only 'capture settings', not which)
    with pytest.raises(ValueError, match="differs in \\['capture settings: guidance_scale, num_inference_steps'\\]"):
        run_distillation(make_cfg(out, guidance_scale=3.0, num_inference_steps=3))
    assert {p: p.read_bytes() for p in written} == written
    # a checkpoint written before the capture check (no "captures" in its run key) still resumes
    state_file = _state_file(out, 12)
    state = json.loads(state_file.read_text())
    del state["run"]["captures"]
    state_file.write_text(json.dumps(state))
    assert run_distillation(cfg).resumed_from == out / "checkpoints" / "step_00000012"
    # resume=False starts afresh: the earlier run's checkpoints go (else they would outrank this run's)
    # (each moved out of the checkpoints before it is deleted: a kill while deleting left a complete-looking one)
    fresh = run_distillation(make_cfg(out, resume=False, max_steps=4))
    assert fresh.resumed_from is None and fresh.global_step == 4
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000004"]
    # nor is one trained on other samples (here: another heat dtype, recaptured under the same file names)
    with pytest.raises(ValueError, match="differs in \\['cache_dtype'\\]"):
        run_distillation(make_cfg(out, max_steps=4, cache_dtype="bfloat16"))
    # a folder that is not a run's is not written over
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "README.md").write_text("# my project notes")
    (tmp_path / "mine" / "prompts.txt").write_text("a cat")
    with pytest.raises(ValueError, match="not a distillation run's folder but holds README.md, which the run"):
        run_distillation(make_cfg(tmp_path / "mine", max_steps=4))
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["README.md", "prompts.txt"]
    # a tiling.json in the folder that is not the estimator's (an earlier run's) is not offered as its tiling
    from videosparse.veda.estimator import VedaEstimator as Estimator

    (out / "tiling.json").write_text(json.dumps({"layers": [[[2, 8, 8]] * 2] * 2}))
    est = Estimator.from_pretrained(out)
    assert "tiling.json" not in est._tiling_hint()
    (out / "tiling.json").write_text(json.dumps({"layers": est.tile_shapes}))
    assert "tiling.json" in est._tiling_hint()


def test_a_run_of_the_version_before_the_heat_dtype_was_recorded_resumes_without_recapture(tmp_path, cache):
    """Done-markers and checkpoints written before the heat dtype joined the capture and run keys: the markers match
    when their samples hold heat of the configured dtype, so nothing is captured again, and the run resumes."""
    out = with_cache(tmp_path / "run", cache)
    run_distillation(make_cfg(out, max_steps=4))
    for marker in (out / "cache").glob("*.done"):
        old = json.loads(marker.read_text())
        del old["heat_dtype"]
        marker.write_text(json.dumps(old))
    state_file = _state_file(out, 4)
    state = json.loads(state_file.read_text())
    del state["run"]["cache_dtype"]
    for capture in state["run"]["captures"]:
        del capture["heat_dtype"]
    state_file.write_text(json.dumps(state))
    samples = {p: p.read_bytes() for p in (out / "cache").glob("*.safetensors")}
    assert run_distillation(make_cfg(out, max_steps=4)).resumed_from == out / "checkpoints" / "step_00000004"
    assert {p: p.read_bytes() for p in samples} == samples


def test_a_damaged_checkpoint_is_a_clear_error(tmp_path, cache):
    """Checkpoints are written atomically, but a folder damaged afterwards (a truncated file, a hand edit) must not
    end in a library traceback: the error names the folder and the ways out, and resume=False still starts over."""
    out = with_cache(tmp_path / "run", cache)
    run_distillation(make_cfg(out, max_steps=4))
    ckpt = out / "checkpoints" / "step_00000004"
    weights = next(p for p in ckpt.iterdir() if p.suffix == ".safetensors")
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError,
                       match=r"checkpoint .*step_00000004 cannot be resumed: its saved model.*resume=False"):
        run_distillation(make_cfg(out, max_steps=4))
    (ckpt / "trainer_state.json").write_text('{"global_step": 4')
    with pytest.raises(ValueError, match=r"step_00000004 cannot be resumed: trainer_state.json cannot be read"):
        run_distillation(make_cfg(out, max_steps=4))
    # ... and refused before anything is written, also for another configuration (review find: that one's capture
    # replaced the run's config and samples first, then failed)
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"step_00000004 cannot be resumed: trainer_state.json cannot be read"):
        run_distillation(make_cfg(out, max_steps=4, prompts=("a green triangle moving right",)))
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    assert run_distillation(make_cfg(out, max_steps=4, resume=False)).global_step == 4


def test_distill_config_validation(tmp_path):
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        make_cfg(tmp_path, mixed_precision="fp8")
    with pytest.raises(ValueError, match=r"tiling: tile shape \(4, 4, 4\) has pt\*ph\*pw = 64, but the block size"):
        make_cfg(tmp_path, tiling=(4, 4, 4))
    with pytest.raises(ValueError, match="prompts"):
        make_cfg(tmp_path, prompts=())
    with pytest.raises(ValueError, match="unknown fields \\['lr'\\]"):
        DistillConfig.from_dict({"lr": 1.0})
    with pytest.raises(ValueError, match="lr_scheduler='bogus' must be one of diffusers' schedules .*'cosine'"):
        make_cfg(tmp_path, lr_scheduler="bogus")                 # at construction, not after the capture
    with pytest.raises(ValueError, match="learning_rate=1e-07 must be above 1e-7 with lr_scheduler='polynomial'"):
        make_cfg(tmp_path, lr_scheduler="polynomial", learning_rate=1e-7)
    with pytest.raises(ValueError, match=r"tiling: tile shape \[True, 4, 32\] must be three positive ints"):
        make_cfg(tmp_path, tiling=[True, 4, 32])
    import numpy as np                                  # code review find: numpy ints were refused here, with a
    assert make_cfg(tmp_path, tiling=[np.int64(4), 4, 8]).tiling == (4, 4, 8)    # reason about the product
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="output_dir=.*cannot be written: .*a_file' is a file, not a folder"):
        make_cfg(tmp_path / "a_file" / "run")
    assert make_cfg(tmp_path, tiling="8x4x4").tiling == (8, 4, 4)
    cfg = make_cfg(tmp_path, tiling=(8, 4, 4))
    assert DistillConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_output_paths_are_checked_by_one_rule_in_configs_and_runs(tmp_path, monkeypatch):
    """Review 61: the configs, the runs and the CLI had three different checks of an output path (the parent chain
    only; writability only, as an OSError; the CLI's). Now one (`_run_checks.check_output`): a config refuses what
    the path itself says at construction, its run also a folder no file can be made in, before any model loads."""
    from videosparse.distill import TilingSearchConfig, capture, run_tiling_search, search, train

    def tiling_cfg(output):
        return TilingSearchConfig(model="tiny", prompts=("a cat",), output=output)

    (tmp_path / "a_file").write_text("")
    for output, match in [("", "output='' is empty; give a file path"),
                          (str(tmp_path), "is a directory; give a file path"),
                          ("new_folder/", "output=.new_folder/. ends with a path separator; give a file path"),
                          (str(tmp_path / "a_file" / "t.json"), "cannot be written: .*a_file' is a file, not a folder"),
                          (3, "output=3 must be a file path")]:
        with pytest.raises(ValueError, match=match):
            tiling_cfg(output)
    for output_dir, match in [("", "output_dir='' is empty; give a directory path"),
                              (str(tmp_path / "a_file"), "output_dir=.*a_file' is a file; give a directory")]:
        with pytest.raises(ValueError, match=match):
            make_cfg(output_dir)
    # a missing folder of the tiling JSON is made with it, as the run does
    assert tiling_cfg(str(tmp_path / "x" / "y" / "t.json")).output == str(tmp_path / "x" / "y" / "t.json")

    def no_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded although the output cannot be written")

    for module in (search, capture, train):
        monkeypatch.setattr(module, "load_capture_pipeline", no_load, raising=False)
    with pytest.raises(ValueError, match=r"output='/proc/vs-test/t.json' cannot be written: no file can be made"):
        run_tiling_search(tiling_cfg("/proc/vs-test/t.json"))
    with pytest.raises(ValueError, match=r"output_dir='/proc/vs-test' cannot be written: no file can be made"):
        run_distillation(make_cfg("/proc/vs-test"))


def test_triton_teacher_on_cpu_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="teacher_backend='triton' .*need a CUDA GPU, or TRITON_INTERPRET=1"):
        run_distillation(make_cfg(out, teacher_backend="triton", device="cpu"))
    assert not (out / "distill_config.json").exists() and not (out / "cache").exists()


def test_a_diverged_run_is_refused_and_writes_no_estimator(tmp_path, cache):
    """Review find: a run whose weights went NaN saved them and exited 0 ("KL nan"); that estimator kept only each
    query tile's own tile. It is refused now, naming the first non-finite loss; the checkpoints stay."""
    out = with_cache(tmp_path / "run", cache)
    with pytest.raises(ValueError, match="distillation diverged: .* proj_q, proj_k hold non-finite values .*"
                                         "first not finite at logged step"):
        run_distillation(make_cfg(out, learning_rate=1e30))
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    assert any((out / "checkpoints").iterdir())


def test_a_video_smaller_than_one_tile_gives_no_sample_and_a_clear_error(tmp_path, caplog):
    """Review find: a 1 x 2 x 2 grid (under one 128-token tile) gave 1 x 1 heat samples that train nothing, and the
    run "distilled" 40 steps on them and exited 0; search-tiling already refused such a capture."""
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"grids \[\(1, 2, 2\)\] hold fewer tokens than one 128-token tile"):
        run_distillation(make_cfg(out, num_frames=1, height=32, width=32))
    assert "keep their one tile (nothing to choose) and give no sample" in caplog.text
    assert not out.exists()


def test_a_capture_that_cannot_start_leaves_nothing_behind(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="component='nope' is not a transformer"):
        run_distillation(make_cfg(out, component="nope"))
    assert not out.exists()
    mine = tmp_path / "mine"                    # a folder of the user's: its files stay, the run's go
    mine.mkdir()
    (mine / "prompts.txt").write_text("a red ball\n")
    with pytest.raises(ValueError, match="transformer class AutoencoderKLWan is not supported"):
        run_distillation(make_cfg(mine, component="vae"))
    assert sorted(p.name for p in mine.iterdir()) == ["prompts.txt"]


def test_a_component_the_pipeline_lacks_is_named_before_its_weights_load(tmp_path, monkeypatch):
    """Review find: `--component transformer2` of a Wan 2.2 model failed only after both experts had loaded; the
    model's model_index.json names its components without loading anything."""
    from videosparse.distill import TilingSearchConfig, run_tiling_search
    from videosparse.models import loading

    def no_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the component was checked")

    monkeypatch.setattr(loading, "load_pipeline", no_load)
    model = tmp_path / "wan22"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "_diffusers_version": "0.42.1", "boundary_ratio": 0.875,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"]}))
    out = tmp_path / "run"
    expected = r"component='transformer2': .* no such component .* its transformers: transformer, transformer_2\."
    with pytest.raises(ValueError, match=expected):
        run_distillation(make_cfg(out, model=str(model), component="transformer2"))
    assert not out.exists()
    with pytest.raises(ValueError, match=expected):
        run_tiling_search(TilingSearchConfig(model=str(model), component="transformer2",
                                             output=str(tmp_path / "tiling.json")))
    with pytest.raises(AssertionError, match="was loaded before"):    # a component it has goes on to the load
        run_tiling_search(TilingSearchConfig(model=str(model), component="transformer_2",
                                             output=str(tmp_path / "tiling.json")))


def test_distill_config_bool_fields_must_be_bools(tmp_path):
    for bad in ("False", "no", 0, 1, None):
        with pytest.raises(ValueError, match=f"resume={bad!r} must be a bool"):
            make_cfg(tmp_path, resume=bad)
    assert make_cfg(tmp_path, resume=False).resume is False
    cfg_file = tmp_path / "cfg.json"                        # a config file with "resume": "false" is refused too
    cfg_file.write_text(json.dumps({**make_cfg(tmp_path).to_dict(), "resume": "false"}))
    with pytest.raises(ValueError, match="resume='false' must be a bool"):
        DistillConfig.load(cfg_file)


def test_model_card_describes_the_estimator_without_placeholders(tmp_path):
    from videosparse.distill.train import model_card

    est = VedaEstimator("WanTransformer3DModel", 2, 2, 64, block=64,
                        tile_shapes=[[[4, 4, 4], [1, 8, 8]], [[4, 4, 4], [4, 4, 4]]])
    from videosparse.veda.tiling import Tiling

    Tiling(((((4, 4, 4), (1, 8, 8))), ((4, 4, 4), (4, 4, 4))), block=64).save(tmp_path / "tiling.json")
    cfg = make_cfg(tmp_path, block=64, tiling=str(tmp_path / "tiling.json"), val_fraction=0.5)
    files = [Path(f"p00000_s000{i}_cond.safetensors") for i in range(2)]
    metrics = {"split": "val", "density": 0.3, "trained": {"kl": 0.1, "recall": 0.8},
               "untrained_mean_pool": {"kl": 0.2, "recall": 0.6}}
    card = model_card(est, cfg, metrics, [{"step": 12, "loss": 0.125, "recall": 0.75}], 12, files,
                      [Path("p00001_s0000_cond.safetensors")])
    assert "More Information Needed" not in card
    for text in ("# Veda tile estimator for `WanTransformer3DModel`", "| self-attention layers | 2 |",
                 "| heads per layer | 2 |", "| head dim | 64 |", "| block (tokens per tile) | 64 |",
                 "4x4x4 (3 heads), 1x8x8 (1 head)", "2 prompts, 3 samples", "1 of them held out",
                 "12 optimizer steps (max_steps=12", "loss 0.1250, tile recall 0.750",
                 "KL 0.1000 (untrained, mean-pooled q·k: 0.2000), tile recall 0.800",
                 f'VedaConfig(density=0.3, estimator="{tmp_path}", block=64)',
                 f"videosparse generate --estimator {tmp_path} --model tiny --density 0.3 --block 64"):   # generate's
        assert text in card, text                                            # defaults are another model, 0.1
    assert "distilled from the pipeline's `transformer` and serves that transformer only" in card
    est.component = "transformer_2"                                  # Wan 2.2's second expert
    card = model_card(est, make_cfg(tmp_path, block=64, component="transformer_2"), metrics, [], 12, files, [])
    assert "distilled from the pipeline's `transformer_2`" in card
    assert f'VedaConfig(estimator=("{tmp_path}", <the other expert\'s>))' in card
    assert f"`--estimator {tmp_path} <the other expert's>` on the command line" in card


def test_processes_that_did_not_join_one_group_are_refused(monkeypatch, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on a machine without GPUs (and without ACCELERATE_USE_CPU=1)
    starts two processes that each set up a single-process accelerator and distill alone into the same folder (a
    log of interleaved steps; review find): refused before anything is written."""
    from accelerate import Accelerator

    from videosparse.distill.train import check_process_group

    accelerator = Accelerator(cpu=True)
    check_process_group(accelerator)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"started 2 processes \(WORLD_SIZE=2\) but accelerate set up 1"):
        check_process_group(accelerator)
    from videosparse.distill.config import DistillConfig
    from videosparse.distill.train import run_distillation

    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        run_distillation(DistillConfig(model="tiny", prompts=["a red circle"], output_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


def _snapshot(out: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in [out / "distill_config.json", *sorted((out / "cache").iterdir())]}


def test_a_resume_of_other_samples_is_refused_before_the_capture_rewrites_any(tmp_path, cache):
    """Review find: resuming with the prompts reordered or extended, another validation split or a tiling file whose
    shapes changed was refused only after the capture had replaced the run's samples (hours on a real model)."""
    from videosparse.veda.tiling import Tiling

    out = with_cache(tmp_path / "run", cache)
    run_distillation(make_cfg(out, max_steps=4))
    written = _snapshot(out)
    for changed, reason in (({"prompts": PROMPTS[::-1]}, "prompts \\(the list, its order"),
                            ({"prompts": (*PROMPTS, "a green triangle")}, "prompts \\(the list, its order"),
                            ({"val_fraction": 0.5}, "validation split")):
        with pytest.raises(ValueError, match=reason):
            run_distillation(make_cfg(out, max_steps=4, **changed))
        assert _snapshot(out) == written, changed
    tiling = tmp_path / "tiling.json"
    meta = {"model_class": "WanTransformer3DModel", "num_layers": 2, "num_heads": 2}
    Tiling((((4, 4, 8),) * 2,) * 2, 128, meta).save(tiling)
    run_distillation(make_cfg(out, max_steps=4, tiling=str(tiling), resume=False))
    written = _snapshot(out)
    Tiling((((2, 8, 8), (4, 4, 8)), ((4, 4, 8),) * 2), 128, meta).save(tiling)    # searched again: other shapes
    with pytest.raises(ValueError, match="tile shapes \\(the tiling file's contents\\)"):
        run_distillation(make_cfg(out, max_steps=4, tiling=str(tiling)))
    assert _snapshot(out) == written


def test_a_tiling_file_of_another_model_is_refused_before_the_capture(tmp_path):
    from videosparse.veda.tiling import Tiling

    tiling = tmp_path / "tiling.json"
    Tiling((((4, 4, 8),) * 2,) * 3, 128, {"model_class": "CogVideoXTransformer3DModel", "num_layers": 3,
                                         "num_heads": 2}).save(tiling)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=f"tiling file {str(tiling)!r} was searched for another model: "
                                         "model_class='CogVideoXTransformer3DModel'"):
        run_distillation(make_cfg(out, tiling=str(tiling)))
    assert not out.exists()


def test_a_branch_filter_that_matches_nothing_is_named_and_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="branches=\\['uncond'\\]: prompt 0's forwards name the branches \\['cond'\\]"):
        run_distillation(make_cfg(out, branches=("uncond",), guidance_scale=1.0))
    assert not out.exists()


def test_capture_writes_each_sample_when_its_forward_ends(tmp_path, monkeypatch):
    """Review find: a prompt's samples (every layer's features and teacher scores: ~380 MB each on Wan 1.3B at 480P)
    were all held in memory until its pipeline call ended."""
    from videosparse.distill import capture
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    events = []
    real_write = capture.write_sample
    monkeypatch.setattr(capture, "write_sample", lambda *a: (events.append("write"), real_write(*a)))
    pipe = build_tiny_wan_pipeline()
    pipe.transformer.register_forward_pre_hook(lambda *a: events.append("forward"))
    real_load = capture.load_capture_pipeline
    monkeypatch.setattr(capture, "load_capture_pipeline", lambda cfg, device=None: (pipe, real_load(cfg)[1]))
    cfg = make_cfg(tmp_path / "unused", prompts=PROMPTS[:1])
    files, _ = capture.capture_to_cache(cfg.capture_config(), tmp_path / "cache", lambda layer, heads: cfg.tiling,
                                        block=cfg.block)
    assert len(files) == 4 and events == ["forward", "write"] * 4       # 2 steps x 2 branches


def test_prompt_files_holding_a_bad_json_list_and_empty_prompts_are_refused(tmp_path):
    from videosparse.distill.config import read_prompts

    for text, what in (("[]", "is empty"), ('["a", 3]', "has 3 at position 1"),
                       ('[\n  "a red circle",\n  ""\n]\n', 'has "" at position 1')):
        path = tmp_path / "p.txt"
        path.write_text(text)
        with pytest.raises(ValueError, match=f"holds a JSON list that {what}"):
            read_prompts(str(path))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        make_cfg(tmp_path, prompts=("a cat", " "))
    with pytest.raises(ValueError, match="seed=4294967296 must lie in \\[0, 2\\*\\*32 - 1\\]"):
        make_cfg(tmp_path, seed=2 ** 32)


def test_a_fresh_run_takes_away_the_estimator_of_the_run_before(tmp_path, cache):
    """resume=False into a finished run's folder: until the new run ends, no estimator of the old one may sit beside
    the new config (a kill mid-run left them mixed, and from_pretrained loaded the old weights)."""
    out = with_cache(tmp_path / "run", cache)
    run_distillation(make_cfg(out, max_steps=4))
    assert (out / "model.safetensors").exists()

    def stop(step, metrics):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_distillation(make_cfg(out, max_steps=4, resume=False, learning_rate=2e-3), step_callback=stop)
    assert not any((out / name).exists() for name in ("model.safetensors", "config.json", "README.md", "metrics.json"))


def test_a_fresh_run_stopped_in_its_capture_leaves_no_estimator_of_the_run_before(tmp_path, monkeypatch):
    """Review find: a fresh run with other prompts (so a new capture) killed while capturing left its config beside the
    finished run's estimator, which from_pretrained then loaded. The estimator goes once the model has loaded; a
    model that fails to load leaves the finished run as it was."""
    import videosparse.distill.capture as capture

    out = tmp_path / "run"
    run_distillation(make_cfg(out, max_steps=2))
    finals = ("model.safetensors", "config.json", "README.md", "metrics.json", "distill_config.json")
    before = {name: (out / name).read_bytes() for name in finals}
    with pytest.raises(Exception, match="no/such-model-offline"):         # offline here: no hub
        run_distillation(make_cfg(out, max_steps=2, resume=False, model="no/such-model-offline"))
    assert {name: (out / name).read_bytes() for name in finals} == before     # its config too

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(capture, "write_sample", killed)
    with pytest.raises(KeyboardInterrupt):
        run_distillation(make_cfg(out, max_steps=2, resume=False, prompts=["a green triangle moving right"]))
    assert not any((out / name).exists() for name in finals[:4])


def test_dtype_takes_generates_spelling_and_a_split_that_holds_out_nothing_warns(tmp_path, caplog):
    import logging

    from videosparse.distill.capture import split_by_prompt

    assert make_cfg(tmp_path, dtype="bf16").dtype == "bfloat16"
    assert make_cfg(tmp_path, dtype="float16").dtype == "float16"
    with pytest.raises(ValueError, match="dtype='half' must be one of"):
        make_cfg(tmp_path, dtype="half")
    with caplog.at_level(logging.WARNING):
        train, val = split_by_prompt([Path("p00000_s0000_cond.safetensors")], 0.5, seed=0)
    assert len(train) == 1 and not val and "holds out no prompt of 1" in caplog.text


def test_a_dtype_that_is_not_a_string_is_a_clear_error_of_distill_and_search_tiling(tmp_path, capsys):
    """Review find: "dtype": {} or ["bf16"] in a --config JSON was `TypeError: unhashable type` with a traceback (the
    CLI prints only ValueError / OSError); also an int past the float range for a float field (OverflowError)."""
    from videosparse.cli import main
    from videosparse.distill import TilingSearchConfig

    for bad in ({}, ["bf16"]):
        with pytest.raises(ValueError, match=re.escape(f"dtype={bad!r} must be one of 'float32'")):
            make_cfg(tmp_path, dtype=bad)
        with pytest.raises(ValueError, match=re.escape(f"dtype={bad!r} must be one of 'float32'")):
            TilingSearchConfig(output=str(tmp_path / "t.json"), dtype=bad)
    for command, bad in (("distill", {}), ("search-tiling", ["bf16"])):
        config = tmp_path / f"{command}.json"
        config.write_text(json.dumps({"dtype": bad}))
        assert main([command, "--config", str(config)]) == 2
        assert f"error: dtype={bad!r} must be one of 'float32'" in capsys.readouterr().err
    for name in ("guidance_scale", "learning_rate", "weight_decay", "init_std"):
        with pytest.raises(ValueError, match=f"{name}=10{{400}} must be a finite number"):
            make_cfg(tmp_path, **{name: 10**400})


def test_a_damaged_model_info_in_the_cache_is_captured_afresh(tmp_path, cache, caplog):
    """Review find: a cache/model_info.json holding {} or [] ended in a KeyError / TypeError traceback, and one that
    is no JSON in a JSON error that named no file. Like a damaged done-marker, it makes nothing of the cache reusable:
    every prompt is captured afresh, with a warning naming the file; the description itself refuses what a capture
    does not write, naming the file and the way out."""
    import logging

    from videosparse.distill.capture import capture_to_cache, model_info

    for bad in ({}, [], {"model_class": "WanTransformer3DModel", "num_layers": "2", "num_heads": 2, "head_dim": 16,
                         "patch_size": [1, 2, 2]}):
        with pytest.raises(ValueError, match=r"model_info.json holds .* delete the output folder's cache/ folder"):
            model_info(bad)
    good = json.loads((cache / "model_info.json").read_text())
    assert model_info(good).num_layers == 2
    cfg = make_cfg(tmp_path / "unused", prompts=PROMPTS[:1])
    for i, damage in enumerate(("{}", "[]", "x")):
        out = with_cache(tmp_path / f"run{i}", cache)
        info_path = out / "cache" / "model_info.json"
        info_path.write_text(damage)
        before = {p.name: p.stat().st_mtime_ns for p in (out / "cache").glob("p00000_s*.safetensors")}
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            files, info = capture_to_cache(cfg.capture_config(), out / "cache", lambda layer, heads: cfg.tiling,
                                           block=cfg.block)
        assert "model_info.json does not hold the transformer description" in caplog.text
        assert info.num_layers == 2 and json.loads(info_path.read_text()) == good
        after = {p.name: p.stat().st_mtime_ns for p in (out / "cache").glob("p00000_s*.safetensors")}
        assert after.keys() == before.keys() and all(after[n] != before[n] for n in before)     # captured afresh


def test_a_cache_of_another_model_is_recaptured_not_checked_against_the_tiling(tmp_path, cache):
    """Review find (of this check's first form): a fresh run whose folder held another model's cache (same layer
    and head counts) was refused as if its tiling file were another model's, because the cached model was checked
    before anything showed the cache would be reused."""
    from videosparse.veda.tiling import Tiling

    out = with_cache(tmp_path / "run", cache)
    info_path = out / "cache" / "model_info.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "model_class": "SkyReelsV2Transformer3DModel"}))
    for marker in (out / "cache").glob("*.done"):
        key = json.loads(marker.read_text())
        key["settings"]["model"] = "Skywork/SkyReels-V2-DF-1.3B"
        marker.write_text(json.dumps(key))
    tiling = tmp_path / "tiling.json"
    Tiling((((4, 4, 8),) * 2,) * 2, 128, {"model_class": "WanTransformer3DModel", "num_layers": 2,
                                          "num_heads": 2}).save(tiling)
    res = run_distillation(make_cfg(out, max_steps=2, tiling=str(tiling)))
    assert res.global_step == 2 and json.loads(info_path.read_text())["model_class"] == "WanTransformer3DModel"


def test_search_output_block_and_padding_are_checked_by_type(tmp_path):
    """Review finds: `--output null` (or "output": 5 in a --config) was a TypeError from os.fspath, `--block 128.0`
    passed (the capture failed after the model load), max_padding=False passed as 0."""
    from videosparse.distill import TilingSearchConfig

    out = str(tmp_path / "t.json")
    for bad, match in ((dict(output=None), "output=None must be a file path"), (dict(output=5), "output=5 must be"),
                       (dict(output=out, block=128.0), r"block=128.0 .* ints \(64, 128\)"),
                       (dict(output=out, max_padding=False), "max_padding=False must lie in"),
                       (dict(output=out, max_padding=True), "max_padding=True must lie in")):
        with pytest.raises(ValueError, match=match):
            TilingSearchConfig(**bad)
    with pytest.raises(ValueError, match=r"block=64.0 .* ints \(64, 128\)"):
        make_cfg(tmp_path, block=64.0)
    assert TilingSearchConfig(output=tmp_path / "t.json", block=64, max_padding=0).output == out
    # numpy and 0-dim torch ints stay taken (as VedaConfig takes them), as plain ints
    import numpy as np
    import torch

    for block in (np.int64(64), torch.tensor(64)):
        searched = TilingSearchConfig(output=out, block=block)
        assert searched.block == 64 and type(searched.block) is int


def test_a_damaged_sample_is_named_with_what_to_delete(tmp_path):
    """Fault-injection find: a capture sample damaged after it was written failed training with a bare
    SafetensorError naming no file (and the prompt's .done marker keeps it from being captured again)."""
    from videosparse.distill.train import TileSampleDataset

    sample = tmp_path / "p00000_s000_cond.safetensors"
    sample.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"q.0\"")
    with pytest.raises(ValueError, match=re.escape(f"sample {sample} cannot be read") + ".*pNNNNN.done"):
        TileSampleDataset([sample], num_layers=1)[0]


def test_a_refused_resume_prunes_no_checkpoint(tmp_path, cache):
    """Review find: the start pruned the checkpoints beyond `keep_checkpoints` before checking the newest, so a
    resume refused for a damaged newest checkpoint (run with a smaller keep_checkpoints) had already deleted the one
    before, which the error tells the user to resume from."""
    out = with_cache(tmp_path / "run", cache)
    run_distillation(make_cfg(out, keep_checkpoints=3))
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(saved) == 3
    weights = next(p for p in (out / "checkpoints" / saved[-1]).iterdir() if p.suffix == ".safetensors")
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="cannot be resumed.*resume from the checkpoint before it"):
        run_distillation(make_cfg(out, keep_checkpoints=1))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == saved


def _state_file(out: Path, step: int) -> Path:
    """The trainer_state.json of the run's checkpoint at `step`."""
    return out / "checkpoints" / f"step_{step:08d}" / "trainer_state.json"


def _trainer_state(out: Path, step: int) -> dict:
    return json.loads(_state_file(out, step).read_text())


def test_a_run_stopped_after_an_epoch_end_checkpoint_resumes_in_the_next_epoch(tmp_path, cache):
    """A checkpoint taken at the end of an epoch records the next epoch (batches_done 0), so a run stopped after it
    and resumed ends with the uninterrupted run's weights instead of repeating the finished epoch (mutation testing:
    the kill/resume test above only resumes from a mid-epoch checkpoint)."""
    full = with_cache(tmp_path / "full", cache)
    run_distillation(make_cfg(full, log_every=4, checkpoint_every=8))       # 8 samples: step 8 ends epoch 0

    class Stop(Exception):
        pass

    def stop_at_10(step, metrics):
        if step == 10:
            raise Stop

    out = with_cache(tmp_path / "cut", cache)
    with pytest.raises(Stop):
        run_distillation(make_cfg(out, log_every=4, checkpoint_every=8), step_callback=stop_at_10)
    state = _trainer_state(out, 8)
    assert (state["global_step"], state["epoch"], state["batches_done"]) == (8, 1, 0)
    res = run_distillation(make_cfg(out, log_every=4, checkpoint_every=8))
    assert res.resumed_from == out / "checkpoints" / "step_00000008" and res.global_step == 12
    a, b = VedaEstimator.from_pretrained(full), VedaEstimator.from_pretrained(out)
    assert torch.equal(a.proj_q, b.proj_q) and torch.equal(a.proj_k, b.proj_k)


def test_gradient_accumulation_takes_that_many_samples_per_step_and_every_sample_of_an_epoch(tmp_path, cache,
                                                                                               monkeypatch):
    """gradient_accumulation_steps=k: every optimizer step takes k samples, and an epoch whose sample count k does
    not divide still trains on every sample, its last step on the rest (mutation testing: the Accelerator dropping
    the setting, or the steps per epoch floored)."""
    from videosparse.distill import train

    forwards = []
    real_forward = train.DistillObjective.forward

    def forward(self, sample):
        forwards.append(1)
        return real_forward(self, sample)

    monkeypatch.setattr(train.DistillObjective, "forward", forward)
    out = with_cache(tmp_path / "ga2", cache)
    res = run_distillation(make_cfg(out, max_steps=2, gradient_accumulation_steps=2, log_every=1, checkpoint_every=2))
    assert res.global_step == 2 and len(forwards) == 4                     # 2 steps x 2 samples
    state = _trainer_state(out, 2)
    assert (state["epoch"], state["batches_done"]) == (0, 4)
    forwards.clear()
    out = with_cache(tmp_path / "ga3", cache)
    res = run_distillation(make_cfg(out, max_steps=None, epochs=1, gradient_accumulation_steps=3, log_every=1,
                                    checkpoint_every=3))
    assert res.global_step == 3 and len(forwards) == 8                     # 8 samples: 3 + 3 + 2
    assert [h["step"] for h in res.history] == [1, 2, 3]
    state = _trainer_state(out, 3)
    assert (state["epoch"], state["batches_done"]) == (1, 0)               # the epoch ran to its end


def test_final_metrics_are_computed_on_the_validation_split_they_name(tmp_path, cache):
    """With val_fraction set, metrics.json's trained and untrained numbers are those of the held-out prompts'
    samples, as its "split": "val" says, not of the training samples (mutation testing)."""
    from videosparse.distill.capture import split_by_prompt
    from videosparse.distill.train import evaluate_estimator

    out = with_cache(tmp_path / "run", cache)
    res = run_distillation(make_cfg(out, max_steps=4, val_fraction=0.5))
    train_files, val_files = split_by_prompt(sorted((out / "cache").glob("p*_s*.safetensors")), 0.5, seed=3)
    assert len(train_files) == len(val_files) == 4
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["split"] == "val" and metrics["trained"]["num_samples"] == 4
    expected = evaluate_estimator(VedaEstimator.from_pretrained(out), val_files, 2, 0.3)
    for key in ("kl", "recall", "heat_recall"):
        assert metrics["trained"][key] == pytest.approx(expected[key], rel=1e-5), key
    assert res.metrics["untrained_mean_pool"]["num_samples"] == 4
    assert "Evaluation on the val samples" in (out / "README.md").read_text()


def test_the_untrained_baseline_is_a_zero_initialised_estimator(tmp_path, cache):
    """metrics.json's and the model card's untrained numbers are those of the mean-pooled q·k scores, which a
    zero-initialised estimator computes (mutation testing: the baseline's logits transposed, key tiles as rows)."""
    from videosparse.distill.train import evaluate_estimator

    out = with_cache(tmp_path / "run", cache)
    run_distillation(make_cfg(out, max_steps=2))
    metrics = json.loads((out / "metrics.json").read_text())
    zero = VedaEstimator("WanTransformer3DModel", 2, 2, 64, block=128, tile_shapes=(4, 4, 8), init_std=0.0)
    expected = evaluate_estimator(zero, sorted((out / "cache").glob("p*_s*.safetensors")), 2, 0.3)
    untrained = metrics["untrained_mean_pool"]
    for key in ("kl", "recall", "recall_offdiag", "heat_recall"):
        assert untrained[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    card = (out / "README.md").read_text()
    assert f"(untrained, mean-pooled q·k: {expected['kl']:.4f})" in card
    assert f"(untrained: {expected['recall']:.3f})" in card


def test_the_heat_is_stored_in_the_cache_dtype(tmp_path):
    """cache_dtype="bfloat16": the captured teacher heat is stored as bfloat16, the dtype the done-marker records
    (mutation testing: heat always stored fp32 while the marker and the run key said bfloat16)."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    run_distillation(make_cfg(out, prompts=PROMPTS[:1], num_inference_steps=1, num_frames=9, height=128, width=128,
                              cache_dtype="bfloat16", max_steps=1))
    files = sorted((out / "cache").glob("p*_s*.safetensors"))
    assert files
    assert json.loads((out / "cache" / "p00000.done").read_text())["heat_dtype"] == "bfloat16"
    for f in files:
        t = load_file(str(f))
        assert t["heat.0"].dtype == t["heat.1"].dtype == torch.bfloat16, f.name
        assert t["q.0"].dtype == torch.float32                            # the features stay fp32


def test_sampled_steps_cover_every_step_and_differ_between_prompts():
    """steps_per_prompt: each prompt samples that many distinct denoising steps out of all of them (the last one
    included), reproducibly from (seed, prompt index), and prompts get their own steps (mutation testing)."""
    from videosparse.distill.capture import sample_steps

    picks = [sample_steps(4, 2, 0, i) for i in range(40)]
    assert all(len(p) == 2 and p == sorted(set(p)) and set(p) <= set(range(4)) for p in picks)
    assert set().union(*map(set, picks)) == {0, 1, 2, 3}                  # the last step is sampled too
    assert len({tuple(p) for p in picks}) > 1                             # not one choice for every prompt
    assert picks == [sample_steps(4, 2, 0, i) for i in range(40)]
    assert sample_steps(4, None, 0, 0) == sample_steps(4, 9, 0, 0) == [0, 1, 2, 3]


def test_capture_samples_each_prompts_own_steps_with_its_own_seed(tmp_path, monkeypatch):
    """With steps_per_prompt, prompt i's samples are those of `sample_steps(..., seed, i)` and its pipeline noise is
    seeded with seed + i, as CaptureConfig documents (mutation testing: one seed or one step choice for every
    prompt)."""
    from videosparse.distill.capture import capture_to_cache, sample_steps
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    seeds = []
    pipe_class = type(build_tiny_wan_pipeline())
    real_call = pipe_class.__call__

    def call(self, prompt, *args, generator=None, **kwargs):
        seeds.append(generator.initial_seed())
        return real_call(self, prompt, *args, generator=generator, **kwargs)

    monkeypatch.setattr(pipe_class, "__call__", call)
    seed = 1
    assert sample_steps(3, 1, seed, 0) != sample_steps(3, 1, seed, 1)     # so a shared choice would show
    cfg = make_cfg(tmp_path / "unused", num_inference_steps=3, steps_per_prompt=1, num_frames=9, height=128,
                   width=128, seed=seed, guidance_scale=1.0)
    files, _ = capture_to_cache(cfg.capture_config(), tmp_path / "cache", lambda layer, heads: cfg.tiling,
                                block=cfg.block)
    assert seeds == [seed, seed + 1]
    for i in range(2):
        steps = sorted(int(f.name.split("_")[1][1:]) for f in files if f.name.startswith(f"p{i:05d}_"))
        assert steps == sample_steps(3, 1, seed, i), i


def test_the_sample_order_changes_between_epochs_and_depends_only_on_seed_and_epoch():
    """EpochShuffleSampler: each epoch is a permutation of the samples that depends only on (seed, epoch), so a resume
    repeats it, and the order changes from one epoch to the next (mutation testing: the same order every epoch)."""
    from videosparse.distill.train import EpochShuffleSampler

    def orders(seed: int) -> list[list[int]]:
        sampler = EpochShuffleSampler(8, seed)
        out = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            out.append(list(sampler))
        return out

    first = orders(3)
    assert all(sorted(o) == list(range(8)) for o in first)
    assert len({tuple(o) for o in first}) == 3
    assert orders(3) == first and orders(4) != first


def test_more_steps_per_prompt_than_a_call_has_warns_and_samples_every_step(tmp_path, caplog):
    """steps_per_prompt above the call's step count cannot be met: every step is sampled, and the load says so
    (it was taken silently)."""
    import logging

    from videosparse.distill.capture import load_capture_pipeline, sample_steps

    with caplog.at_level(logging.WARNING, logger="videosparse"):
        _, call_kwargs = load_capture_pipeline(make_cfg(tmp_path, steps_per_prompt=5))
        load_capture_pipeline(make_cfg(tmp_path, steps_per_prompt=2))
    warned = [r.getMessage() for r in caplog.records if "steps_per_prompt" in r.getMessage()]
    assert warned == ["steps_per_prompt=5 is more than the 2 denoising steps of a call: every step is sampled."]
    assert sample_steps(int(call_kwargs["num_inference_steps"]), 5, 0, 0) == [0, 1]


def test_steps_per_prompt_with_no_known_step_count_loads_without_a_word(tmp_path, monkeypatch, caplog):
    """Mutation find: a pipeline whose __call__ gives no num_inference_steps default (and a config that sets none)
    leaves the step count to the pipeline; steps_per_prompt is then not compared (dropping the `steps is not None`
    check raised a TypeError from int(None) at load)."""
    import logging

    from videosparse.distill.capture import load_capture_pipeline
    from videosparse.models import loading

    real = loading.load_pipeline

    def without_steps(*args, **kwargs):
        loaded = real(*args, **kwargs)
        loaded.defaults.pop("num_inference_steps", None)
        return loaded

    monkeypatch.setattr(loading, "load_pipeline", without_steps)
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        _, call_kwargs = load_capture_pipeline(make_cfg(tmp_path, num_inference_steps=None, steps_per_prompt=5))
    assert "num_inference_steps" not in call_kwargs
    assert not [r for r in caplog.records if "steps_per_prompt" in r.getMessage()]
