"""Mutation finds (pass 65) in the synthetic speed mode: `videosparse/eval/synthetic.py` and `synthetic_models.py`.

Each test pins a behaviour that a mutant changed without failing the existing tests. They run on CPU in well under
a second each: shapes and estimates are arithmetic on the spec tables, and the resume checks stop `run_synthetic`
before any model is built (only the fresh-run test builds one block of Wan 1.3B at a tiny size)."""

import types

import pytest
import torch

from videosparse.eval import synthetic
from videosparse.eval.spec import parse_method_specs
from videosparse.eval.synthetic import (SyntheticResult, check_run_options, every_step_sparse, run_synthetic,
                                        summarize_synthetic)
from videosparse.eval.synthetic_models import check_feasible, estimate_flops, synthetic_setup

CPU = torch.device("cpu")
TINY = dict(frames=5, height=64, width=64, layers=1)
VEDA, SOL = "veda@0.5:block=64:tiling=1x8x8", "sol@0.5:block=64"


class Stop(Exception):
    """Raised by a stand-in for `run_synthetic_model`: what it was called with, and no model built."""


def _capture_run(monkeypatch) -> dict:
    seen = {}

    def fake(name, specs, device, dtype, **kw):
        seen.update(kw, name=name, device=device, dtype=dtype)
        raise Stop

    monkeypatch.setattr(synthetic, "run_synthetic_model", fake)
    return seen


def test_cosmos3_pads_its_latents_to_whole_patches():
    # Mutation find: Cosmos 3's grid rounds its 45 latent rows up to 23 patch rows (pad_patches), its patch is
    # (1, 2, 2) from latent_patch_size, and its default 720 rows (not a multiple of 16 x 2) are accepted
    setup = synthetic_setup("cosmos3")
    assert setup.model.patch == (1, 2, 2)
    assert setup.latent == (48, 48, 45, 80) and setup.grid == (48, 23, 40)
    assert setup.tokens == 44_160 and setup.attention_tokens == 44_160 + 256
    assert synthetic_setup("cosmos3", frames=5, height=48, width=80).grid == (2, 2, 3)


@pytest.mark.parametrize("size, match", [(dict(frames=True), "frames=True must be a positive int"),
                                         (dict(width=100), "width a multiple of 16"),
                                         (dict(layers=0), "layers=0 must be >= 1")])
def test_synthetic_setup_refuses_a_bool_frames_a_partial_patch_width_and_zero_layers(size, match):
    # Mutation find: frames=True (a bool, not a count), a width that is no whole number of patches and layers=0
    # (a transformer with no block) were each accepted by a mutant that dropped that check
    with pytest.raises(ValueError, match=match):
        synthetic_setup("wan-1.3b", **size)


def test_flop_estimate_counts_the_joint_text_tokens_in_both_terms():
    # Mutation find: 4 S^2 D H per layer and 2 S params, S the self-attention's tokens (HunyuanVideo's 32 video + 256
    # text), and the estimates report the attention part under attention_flops
    setup = synthetic_setup("hunyuan", **TINY)
    assert (setup.tokens, setup.attention_tokens) == (32, 288)
    attention, linear = 4.0 * 288 * 288 * 128 * 24, 2.0 * 288 * 1000
    assert estimate_flops(setup, 1000) == {"attention": attention, "linear": linear, "total": attention + linear}
    est = check_feasible(setup, CPU, torch.float32, 1000)
    assert (est["flops"], est["attention_flops"]) == (attention + linear, attention)


def test_feasibility_weights_follow_the_dtype_and_the_cpu_limit_counts_the_linear_flops():
    # Mutation find: weights are params x the dtype's bytes (2 for bf16, 4 for fp32), and on CPU the limit (1e12)
    # applies to the whole forward: 4,096 tokens through 1e9 params is ~8.3 TFLOP although attention is only 0.1
    setup = synthetic_setup("hunyuan", **TINY)
    assert check_feasible(setup, CPU, torch.bfloat16, 2**30)["weight_gib"] == 2.0
    assert check_feasible(setup, CPU, torch.float32, 2**30)["weight_gib"] == 4.0
    wide = synthetic_setup("wan-1.3b", frames=13, height=512, width=512, layers=1)
    assert wide.attention_tokens == 4096 and estimate_flops(wide, 10**9)["attention"] < 0.2e12
    assert check_feasible(wide, CPU, torch.bfloat16, 10**8)["flops"] < 1e12
    with pytest.raises(ValueError, match=r"~8\.3 TFLOP .*limit 1\.0 TFLOP"):
        check_feasible(wide, CPU, torch.bfloat16, 10**9)


@pytest.mark.parametrize("options, match", [(dict(warmup=True), "warmup=True must be an int >= 0"),
                                            (dict(repeats=1.5), "repeats=1.5 must be an int >= 1")])
def test_run_options_refuse_a_bool_warmup_and_a_fractional_repeat_count(options, match):
    # Mutation find: warmup=True and repeats=1.5 passed a mutant that dropped the bool / int checks
    with pytest.raises(ValueError, match=match):
        check_run_options(None, **dict(dict(warmup=1, repeats=3), **options))


def test_dense_attention_fallback_times_one_call_per_layer(monkeypatch):
    # Mutation find: the SDPA time measured outside the model is one call's median times the layers (here a fake
    # clock makes every call take 1 s; 2 layers -> 2 s)
    clock = iter(range(100))
    monkeypatch.setattr(synthetic, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    setup = synthetic_setup("wan-1.3b", frames=5, height=64, width=64, layers=2)
    assert synthetic._dense_attention_seconds(setup, CPU, torch.float32, 3) == 2


def test_summary_caps_the_dense_attention_share_below_one():
    # Mutation find: an attention reading as long as the forward (noise) gives a share just below 1, not a
    # ZeroDivisionError in the attention-free bound
    result = SyntheticResult("wan-1.3b", synthetic_setup("wan-1.3b", **TINY), {})
    result.methods = {"dense": {"forward_s": 2.0, "attention_s": 2.0, "attention_work": 1.0}}
    section = summarize_synthetic(result, torch.float32, 0, 1)
    assert section["dense_attention_share"] == 0.999999
    assert section["amdahl_bound_free_attention"] == pytest.approx(1e6)


def test_run_synthetic_defaults_to_float32_on_cpu(monkeypatch, tmp_path):
    # Mutation find: with no dtype given a CPU run is fp32 (bf16 only on CUDA)
    seen = _capture_run(monkeypatch)
    with pytest.raises(Stop):
        run_synthetic(["wan-1.3b"], parse_method_specs([VEDA]), str(tmp_path), device="cpu", warmup=0, repeats=1,
                      progress=False, **TINY)
    assert seen["dtype"] == torch.float32 and seen["done"] == {}


def _old_report(tmp_path, methods: dict, **settings) -> None:
    """A report.json holding wan-1.3b at TINY measured with `settings` (default: those of `_rerun`) on this CPU."""
    from videosparse.eval.report import REPORT_FORMAT, as_saved, save_report, timing_environment

    section = dict(dict(shape=synthetic_setup("wan-1.3b", **TINY).describe(), dtype="torch.float32", compile=None,
                        warmup=0, repeats=1), **settings, timed_on=as_saved(timing_environment(CPU)), methods=methods)
    save_report({"format": REPORT_FORMAT, "mode": "synthetic", "synthetic": {"wan-1.3b": section}},
                str(tmp_path / "report.json"))


def _rerun(tmp_path, labels):
    return run_synthetic(["wan-1.3b"], parse_method_specs(labels), str(tmp_path), device="cpu",
                         dtype=torch.float32, warmup=0, repeats=1, progress=False, **TINY)


@pytest.mark.parametrize("settings, match", [(dict(repeats=3), "repeats 3 vs 1"),
                                             (dict(warmup=1), "warm-up forwards 1 vs 0"),
                                             (dict(dtype="torch.bfloat16"), "dtype torch.bfloat16 vs torch.float32")])
def test_a_report_of_other_timing_settings_is_refused(monkeypatch, tmp_path, settings, match):
    # Mutation find: a model measured with other repeats, warm-up or dtype is refused, not resumed (only the shape and
    # the environment were tested)
    _capture_run(monkeypatch)
    _old_report(tmp_path, {}, **settings)
    with pytest.raises(ValueError, match=rf"measured with other settings \({match}\)"):
        _rerun(tmp_path, [VEDA])


def _configs(labels) -> dict:
    from videosparse.eval.report import as_saved

    return {s.label: as_saved(every_step_sparse(s.config).to_dict()) for s in parse_method_specs(labels)}


def test_resume_keeps_rows_only_against_the_same_dense_row(monkeypatch, tmp_path):
    # Mutation find: rows of the same config are kept (the dense output beside them), but none when the dense row
    # was measured with another config: every speedup would be against that other dense
    seen = _capture_run(monkeypatch)
    cfg = _configs([VEDA, SOL])
    _old_report(tmp_path, {"dense": {"config": cfg["dense"]}, VEDA: {"config": cfg[VEDA]}})
    with pytest.raises(Stop):
        _rerun(tmp_path, [VEDA, SOL])
    assert list(seen["done"]) == ["dense", VEDA]
    _old_report(tmp_path, {"dense": {"config": dict(cfg["dense"], backend="other")}, VEDA: {"config": cfg[VEDA]}})
    with pytest.raises(Stop):
        _rerun(tmp_path, [VEDA, SOL])
    assert seen["done"] == {}


def test_a_fresh_cpu_run_measures_dense_again_and_notes_the_reference_kernel(tmp_path):
    # Mutation find: a dense output left by another run is read only when the dense row is kept (a fresh run measures
    # dense, compares with it: 0.0, and saves it over the stale file); the dense row's density is 1.0; a CPU run's
    # report notes that its sparse times come from the torch reference kernel
    from safetensors.torch import load_file, save_file

    path = tmp_path / "dense_output_wan-1.3b.safetensors"
    save_file({"dense_output": torch.zeros(1)}, str(path))
    report = run_synthetic(["wan-1.3b"], parse_method_specs([]), str(tmp_path), device="cpu", warmup=0, repeats=1,
                           progress=False, **TINY)
    dense = report["synthetic"]["wan-1.3b"]["methods"]["dense"]
    assert dense["output_rel_l2_vs_dense"] == 0.0 and dense["realised_density"] == 1.0
    assert tuple(load_file(str(path))["dense_output"].shape) == (1, 16, 2, 8, 8)
    assert any(note.startswith("Run on CPU: the sparse path uses the torch reference kernel")
               for note in report["notes"])


def test_a_compiled_dense_count_that_is_no_multiple_of_the_forwards_does_not_set_the_profile_aside(monkeypatch):
    # Mutation find: when the session's dense calls are not a whole number per forward (counters a compiled graph
    # does not replay: 1 call over 3 forwards), the profile's call count is not checked, so its reading is used
    import contextlib

    from videosparse.eval.timing import SdpaProfile

    stats = {"layers": {}, "sparse_calls": 0, "dense_calls": 1, "density": None}
    session = types.SimpleNamespace(stats=lambda all_ranks: stats)

    @contextlib.contextmanager
    def applied(transformer, config, compile_mode):
        yield (lambda **inputs: (torch.zeros(1),)), session

    clock = iter(range(100))
    monkeypatch.setattr(synthetic, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(synthetic, "method_applied", applied)
    monkeypatch.setattr(synthetic, "profile_sdpa", lambda fn, keys, device: SdpaProfile(0.5, 1, 1.0))
    dense = parse_method_specs([])[0]
    row, _ = synthetic.time_method(torch.nn.Linear(1, 1), {}, dense, 0, 1, "aot_eager", sdpa_keys=32)
    assert row["calls_counted_forwards"] == 3 and row["attention_profile"]["problem"] is None
    assert row["attention_s"] == 0.5 and row["forward_s"] == 1
