"""Synthetic speed mode on CPU: real sizes are refused clearly, a shrunken model runs end to end."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from videosparse.cli import main
from videosparse.eval.spec import parse_method_specs
from videosparse.eval.synthetic import run_synthetic, run_synthetic_model
from videosparse.eval.synthetic_models import (SYNTHETIC_MODELS, build_transformer, check_feasible, count_parameters,
                                               make_inputs, synthetic_setup)


def test_published_shapes():
    small, big = synthetic_setup("wan-1.3b"), synthetic_setup("wan-14b")
    assert small.grid == (21, 30, 52) and small.tokens == 32760 and small.num_layers == 30
    assert big.grid == (21, 45, 80) and big.tokens == 75600 and big.num_layers == 40
    assert (small.model.heads, big.model.heads, big.model.head_dim) == (12, 40, 128)
    assert synthetic_setup("hunyuan").grid == (33, 45, 80)
    assert 1.2e9 < count_parameters(small) < 1.6e9 and 13e9 < count_parameters(big) < 15.5e9


def test_real_sizes_are_refused_on_cpu():
    for name in ("wan-1.3b", "wan-14b"):
        setup = synthetic_setup(name)
        with pytest.raises(ValueError, match="cannot run on this CPU.*CUDA GPU.*--synthetic-layers"):
            check_feasible(setup, torch.device("cpu"), torch.bfloat16, count_parameters(setup))


def test_shrunken_hunyuan_runs_sparse(tmp_path, monkeypatch):
    """HunyuanVideo has a processor now: one dual-stream block at a tiny size runs sparse on CPU (text after video),
    with 2 of its 24 heads (the published width's 0.7B parameters take ~10 s to draw on 2 cores)."""
    setup = synthetic_setup("hunyuan", frames=5, height=128, width=128, layers=1)
    inputs = make_inputs(setup, torch.device("cpu"), torch.float32)
    assert tuple(inputs["encoder_attention_mask"].shape) == (1, 256) and inputs["encoder_attention_mask"].all()
    _narrowed(monkeypatch, "hunyuan", num_attention_heads=2)
    specs = parse_method_specs(["veda@0.5:block=64:tiling=1x8x8"])
    report = run_synthetic(["hunyuan"], specs, str(tmp_path), device="cpu", frames=5, height=128, width=128,
                           layers=1, warmup=0, repeats=1, progress=False)
    section = report["synthetic"]["hunyuan"]
    assert section["shape"]["grid"] == [2, 8, 8] and section["shape"]["layers"] == 1
    row = section["methods"]["veda@0.5:block=64:tiling=1x8x8"]
    assert row["sparse_calls"] == 1 and row["dense_calls"] == 0 and row["fallbacks"] == []
    assert 0.5 < row["realised_density"] < 1.0          # 2 video tiles + 4 text (global) tiles
    assert 0 < row["output_rel_l2_vs_dense"] < 0.5


def _shrunken_sparse_row(name: str, layers: int = 1, **size) -> dict:
    """`layers` blocks of `name` at a tiny size on CPU, Veda at density 0.5 on 64-token tiles: its result row, checked
    to have run sparse (one call per block, each block served, no fallback)."""
    spec = "veda@0.5:block=64:tiling=1x8x8"
    result = run_synthetic_model(name, parse_method_specs([spec]), "cpu", torch.float32, layers=layers, warmup=0,
                                 repeats=1, progress=False, **size)
    row = result.methods[spec]
    assert row["sparse_calls"] == layers and row["dense_calls"] == 0 and row["fallbacks"] == []
    assert len(row["layer_density"]) == layers
    return row


def _narrowed(monkeypatch, name: str, **config) -> None:
    """`SYNTHETIC_MODELS[name]` at a narrower width for the test (same head dim, fewer heads): the tokens that do not
    shrink with the video (Kandinsky's 256 text tokens through its 4 refiner blocks; FramePack's 729 image and 256
    text tokens in every block), or the time to draw its random parameters (~10 s for HunyuanVideo's 0.7B on 2
    cores), make the published width too slow for a CPU test. Inputs, the layers override and the serving are those
    of the published entry."""
    model = SYNTHETIC_MODELS[name]
    monkeypatch.setitem(SYNTHETIC_MODELS, name, replace(model, config=dict(model.config, **config)))


def test_shrunken_ltx_runs_sparse():
    """LTX-Video 2B (the class defaults): packed tokens plus the latent sizes, as LTXPipeline passes them; one
    block at a tiny size runs sparse on CPU."""
    setup = synthetic_setup("ltx")
    assert setup.grid == (16, 16, 24) and setup.tokens == 6144 and setup.attention_tokens == 6144
    assert (setup.model.heads, setup.model.head_dim, setup.num_layers) == (32, 64, 28)
    assert 1.8e9 < count_parameters(setup) < 2.1e9
    small = synthetic_setup("ltx", frames=17, height=256, width=256, layers=1)
    inputs = make_inputs(small, torch.device("cpu"), torch.float32)
    assert tuple(inputs["hidden_states"].shape) == (1, 3 * 8 * 8, 128)
    assert (inputs["num_frames"], inputs["height"], inputs["width"]) == (3, 8, 8)
    assert tuple(inputs["encoder_hidden_states"].shape) == (1, 128, 4096)
    row = _shrunken_sparse_row("ltx", frames=17, height=256, width=256)
    assert 0.3 < row["realised_density"] < 0.7 and 0 < row["output_rel_l2_vs_dense"] < 0.5


def test_shrunken_hunyuan15_runs_sparse(monkeypatch):
    """HunyuanVideo 1.5 480p T2V: 65 input channels, Qwen + masked ByT5 + zero image inputs as its pipeline
    passes them; the layouts cover the video and the 256 valid text tokens. One block at a tiny size on CPU, with 2
    of its 16 heads."""
    setup = synthetic_setup("hunyuan15")
    assert setup.grid == (31, 30, 53) and setup.attention_tokens == 49_290 + 256
    assert (setup.model.heads, setup.model.head_dim, setup.num_layers) == (16, 128, 54)
    assert 8.0e9 < count_parameters(setup) < 9.0e9
    _narrowed(monkeypatch, "hunyuan15", num_attention_heads=2)
    row = _shrunken_sparse_row("hunyuan15", frames=9, height=128, width=128)
    # 3 video tiles of 64 and 4 global text tiles: the text tiles are always kept
    assert 0.5 < row["realised_density"] < 0.95 and 0 < row["output_rel_l2_vs_dense"] < 0.5


def test_shrunken_mochi_runs_sparse(monkeypatch):
    """Mochi 1 preview (the class defaults): 12 latent channels, VAE 6 x 8 x 8, no temporal patch, 256 T5 tokens after
    the video with MochiPipeline's boolean mask; one (context_pre_only) block at a tiny size runs sparse on CPU, with 2
    of its 24 heads."""
    setup = synthetic_setup("mochi")
    assert setup.latent == (12, 28, 60, 106) and setup.grid == (28, 30, 53)
    assert setup.tokens == 44_520 and setup.attention_tokens == 44_520 + 256
    assert (setup.model.heads, setup.model.head_dim, setup.num_layers) == (24, 128, 48)
    assert 9.5e9 < count_parameters(setup) < 10.5e9
    small = synthetic_setup("mochi", frames=13, height=128, width=128, layers=1)
    inputs = make_inputs(small, torch.device("cpu"), torch.float32)
    assert tuple(inputs["hidden_states"].shape) == (1, 12, 3, 16, 16)
    assert inputs["encoder_attention_mask"].dtype == torch.bool and inputs["encoder_attention_mask"].all()
    _narrowed(monkeypatch, "mochi", num_attention_heads=2)
    row = _shrunken_sparse_row("mochi", frames=13, height=128, width=128)
    # 3 video tiles of 64 and 4 global text tiles: the text tiles are always kept
    assert 0.5 < row["realised_density"] < 0.95 and 0 < row["output_rel_l2_vs_dense"] < 0.5


def test_shrunken_allegro_runs_sparse():
    """Allegro (the class defaults: 24 heads x 96): 4 latent channels, 22 latent frames at 720x1280, 512 T5 tokens by
    cross-attention with their mask, the 3D RoPE as AllegroPipeline builds it; one block at a tiny size on CPU."""
    setup = synthetic_setup("allegro")
    assert setup.latent == (4, 22, 90, 160) and setup.grid == (22, 45, 80) and setup.attention_tokens == 79_200
    assert (setup.model.heads, setup.model.head_dim, setup.num_layers) == (24, 96, 32)
    assert 2.5e9 < count_parameters(setup) < 3.0e9
    small = synthetic_setup("allegro", frames=9, height=128, width=128, layers=1)
    inputs = make_inputs(small, torch.device("cpu"), torch.float32)
    (_, positions) = inputs["image_rotary_emb"]
    assert [int(p.max()) for p in positions] == [2, 7, 7]                 # (t, h, w) of the 3 x 8 x 8 token grid
    row = _shrunken_sparse_row("allegro", frames=9, height=128, width=128)
    assert 0.3 < row["realised_density"] < 0.7 and 0 < row["output_rel_l2_vs_dense"] < 0.5


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="frames must be 1 \\+ a multiple of 4"):
        synthetic_setup("wan-1.3b", frames=8)
    for size in (dict(frames=0), dict(height=-16), dict(width=0), dict(height=64.0)):
        with pytest.raises(ValueError, match=f"{next(iter(size))}=.* must be a positive int"):
            synthetic_setup("wan-1.3b", **size)


@pytest.mark.parametrize("options, match", [(dict(repeats=0), "repeats=0 must be an int >= 1"),
                                            (dict(warmup=-1), "warmup=-1 must be an int >= 0"),
                                            (dict(compile_mode="fast"), "compile_mode='fast' is not known")])
def test_bad_run_options_are_refused_before_the_model_is_built(monkeypatch, tmp_path, options, match):
    import videosparse.eval.synthetic as synthetic

    monkeypatch.setattr(synthetic, "build_transformer", lambda *a, **k: pytest.fail("built before the refusal"))
    specs = parse_method_specs(["dense"])
    with pytest.raises(ValueError, match=match):
        run_synthetic_model("wan-1.3b", specs, "cpu", torch.float32, layers=1, frames=5, height=64, width=64,
                            **options)
    with pytest.raises(ValueError, match=match):
        run_synthetic(["wan-1.3b"], specs, str(tmp_path / "out"), device="cpu", layers=1, frames=5, height=64,
                      width=64, **options)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="not known"):
        synthetic_setup("wan-2b")


def test_cli_refuses_real_size_on_cpu(capsys):
    assert main(["evaluate", "--synthetic", "wan-1.3b", "--device", "cpu", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "21x30x52 = 32760 tokens" in err and "cannot run on this CPU" in err


def test_shrunken_synthetic_run_writes_report(tmp_path):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        specs = parse_method_specs(["veda@0.5:block=64:tiling=1x8x8", "sol@0.5"])
        report = run_synthetic(["wan-1.3b"], specs, str(tmp_path), device="cpu", frames=9, height=128, width=256,
                               layers=1, warmup=1, repeats=1, progress=False)
        # a rerun with the same settings (thread count included) skips the model
        again = run_synthetic(["wan-1.3b"], specs, str(tmp_path), device="cpu", frames=9, height=128, width=256,
                              layers=1, warmup=1, repeats=1, progress=False)
    finally:
        torch.set_num_threads(n)
    section = report["synthetic"]["wan-1.3b"]
    assert section["shape"]["grid"] == [3, 8, 16] and section["shape"]["layers"] == 1
    rows = section["methods"]
    assert list(rows) == ["dense", "veda@0.5:block=64:tiling=1x8x8", "sol@0.5"]
    assert rows["dense"]["speedup"] == pytest.approx(1.0) and rows["dense"]["output_rel_l2_vs_dense"] == 0.0
    for label in list(rows)[1:]:
        r = rows[label]
        # the session counts the warm-up forward too; the table shows the calls of one forward (review 54)
        assert r["sparse_calls"] == 2 and r["dense_calls"] == 0 and r["calls_counted_forwards"] == 2
        assert 0.2 < r["realised_density"] < 0.8
        assert 0 < r["output_rel_l2_vs_dense"] < 0.5 and r["amdahl_bound"] >= 1.0
        assert 0 < r["attention_s"] < r["forward_s"]
    for name in ("report.json", "report.md", "plots/speedup_vs_density_wan-1.3b.png"):
        assert os.path.getsize(tmp_path / name) > 0
    assert "sparse/dense calls per forward" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "report.md").read_text().count(" | 1/0 | ") == 2
    assert again["synthetic"]["wan-1.3b"]["estimates"]["build_s"] == section["estimates"]["build_s"]


def test_inputs_drive_the_wan_transformer_shapes():
    setup = synthetic_setup("wan-1.3b", frames=5, height=64, width=64, layers=1)
    inputs = make_inputs(setup, torch.device("cpu"), torch.float32)
    assert tuple(inputs["hidden_states"].shape) == (1, 16, 2, 8, 8)
    assert tuple(inputs["encoder_hidden_states"].shape) == (1, 512, 4096)


def test_script_entry_point_help():
    res = subprocess.run([sys.executable, "scripts/evaluate.py", "--help"], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0 and "--synthetic" in res.stdout and "NAME[@DENSITY]" in res.stdout


def test_shrunken_synthetic_run_compiled(tmp_path):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        specs = parse_method_specs(["veda@0.5:block=64:tiling=1x8x8"])
        report = run_synthetic(["wan-1.3b"], specs, str(tmp_path), device="cpu", frames=9, height=128, width=256,
                               layers=1, warmup=0, repeats=1, progress=False, compile_mode="aot_eager")
    finally:
        torch.set_num_threads(n)
    section = report["synthetic"]["wan-1.3b"]
    assert section["compile"] == "aot_eager"
    dense, sparse = section["methods"]["dense"], section["methods"]["veda@0.5:block=64:tiling=1x8x8"]
    # the dense forward's self-attention SDPA calls (keys = the video tokens, not the text's) in a profiled forward
    assert dense["attention_timed"] == "in a profiled forward"
    assert dense["attention_profile"]["calls"] == 1 and dense["attention_profile"]["problem"] is None   # 1 layer
    assert dense["dense_calls"] == sparse["sparse_calls"]      # the profiled forward is not counted
    assert dense["attention_s"] > 0 and 0 < section["dense_attention_share"] < 1
    assert sparse["attention_s"] is None and sparse["sparse_calls"] == 3 and sparse["forward_s"] > 0
    assert 0 < sparse["output_rel_l2_vs_dense"] < 0.5
    # 3 calls = 2 warm-up forwards (a compiled run takes at least 2) + 1 timed; the report says 2, not the 0 asked for
    assert (section["warmup"], section["warmup_run"]) == (0, 2)
    assert "1 timed forwards after 2 warm-up" in (tmp_path / "report.md").read_text()
    with pytest.raises(ValueError, match="compile_mode='fast'"):
        run_synthetic(["wan-1.3b"], specs, str(tmp_path / "x"), device="cpu", frames=9, height=128, width=256,
                      layers=1, warmup=0, repeats=1, progress=False, compile_mode="fast")


def test_compiled_run_sets_an_impossible_profile_aside(tmp_path, monkeypatch):
    """A profile whose SDPA time exceeds the forward (Wan 14B compiled on the H200 read 12.7 s in an 11.5 s forward)
    is not used: the dense row falls back to SDPA timed outside the model, says why, and keeps the reading."""
    from videosparse.eval import synthetic
    from videosparse.eval.timing import SdpaProfile

    monkeypatch.setattr(synthetic, "profile_sdpa", lambda fn, keys, device: (fn(), SdpaProfile(5.0, 1, 6.0))[1])
    report = run_synthetic(["wan-1.3b"], parse_method_specs([]), str(tmp_path), device="cpu", frames=9, height=128,
                           width=256, layers=1, warmup=0, repeats=1, progress=False, compile_mode="aot_eager")
    dense = report["synthetic"]["wan-1.3b"]["methods"]["dense"]
    assert dense["attention_timed"].startswith("outside the model, the profile set aside: the profiled SDPA calls' "
                                               "5.000 s exceed the timed forward's")
    assert dense["attention_profile"]["seconds"] == 5.0 and 0 < dense["attention_s"] < dense["forward_s"]


def test_synthetic_run_resumes_per_method(tmp_path):
    """A run cut short keeps the methods it measured; the rerun runs only the rest and still compares with dense."""
    kw = dict(device="cpu", frames=5, height=64, width=128, layers=1, warmup=0, repeats=1, progress=False)
    first = run_synthetic(["wan-1.3b"], parse_method_specs(["veda@0.5:block=64:tiling=1x8x8"]), str(tmp_path), **kw)
    kept = first["synthetic"]["wan-1.3b"]["methods"]
    assert os.path.getsize(tmp_path / "dense_output_wan-1.3b.safetensors") > 0
    specs = parse_method_specs(["veda@0.5:block=64:tiling=1x8x8", "sol@0.5:block=64"])
    again = run_synthetic(["wan-1.3b"], specs, str(tmp_path), **kw)["synthetic"]["wan-1.3b"]["methods"]
    assert list(again) == ["dense", "veda@0.5:block=64:tiling=1x8x8", "sol@0.5:block=64"]
    for label in kept:                                   # measured once, not again
        assert again[label]["forward_s_all"] == kept[label]["forward_s_all"]
    assert 0 < again["sol@0.5:block=64"]["output_rel_l2_vs_dense"] < 1.0
    # the rerun's row is compared with a dense row of the first run, and the report says so (exploratory find)
    assert not [n for n in first["notes"] if "a rerun into this" in n]
    assert again["sol@0.5:block=64"]["timed_in"] != again["dense"]["timed_in"] == kept["dense"]["timed_in"]
    notes = [n for n in json.loads((tmp_path / "report.json").read_text())["notes"] if "a rerun into this" in n]
    assert notes == [n for n in notes if n.startswith("wan-1.3b sol@0.5:block=64: timed in another run than dense")]
    assert len(notes) == 1 and "another run than dense" in (tmp_path / "report.md").read_text()
    # a report written before a derived shape key existed (attention_tokens) still resumes
    report = json.loads((tmp_path / "report.json").read_text())
    del report["synthetic"]["wan-1.3b"]["shape"]["attention_tokens"]
    (tmp_path / "report.json").write_text(json.dumps(report))
    third = run_synthetic(["wan-1.3b"], specs, str(tmp_path), **kw)["synthetic"]["wan-1.3b"]["methods"]
    assert all(third[label]["forward_s_all"] == again[label]["forward_s_all"] for label in again)
    # overwrite=True (--overwrite) measures every method again
    fresh = run_synthetic(["wan-1.3b"], specs[:2], str(tmp_path), **kw, overwrite=True)["synthetic"]["wan-1.3b"]
    assert list(fresh["methods"]) == list(kept)
    assert all(fresh["methods"][label]["forward_s_all"] != kept[label]["forward_s_all"] for label in kept)
    assert len({row["timed_in"] for row in fresh["methods"].values()}) == 1
    # the replaced report's files go (its plots), this run's dense output, written before the first save, stays
    assert os.path.getsize(tmp_path / "dense_output_wan-1.3b.safetensors") > 0
    assert os.listdir(tmp_path / "plots") == ["speedup_vs_density_wan-1.3b.png"]
    # other settings (here the video size) are refused without --overwrite, as the help says, and change nothing
    # (review find: the section and the dense output were replaced silently)
    before = (tmp_path / "report.json").read_text()
    with pytest.raises(ValueError, match=r"measured with other settings \(shape .*--overwrite"):
        run_synthetic(["wan-1.3b"], specs[:2], str(tmp_path), **dict(kw, height=32))
    assert (tmp_path / "report.json").read_text() == before
    # review finds: a row was kept by its label alone (--backend is not in it), and rows timed on another device or
    # thread count were kept under the new run's environment
    n = torch.get_num_threads()
    torch.set_num_threads(n + 1)
    try:
        with pytest.raises(ValueError, match=rf"environment \(cpu_threads: {n} -> {n + 1}\)"):
            run_synthetic(["wan-1.3b"], specs[:2], str(tmp_path), **kw)
    finally:
        torch.set_num_threads(n)
    assert (tmp_path / "report.json").read_text() == before
    other = parse_method_specs(["veda@0.5:block=64:tiling=1x8x8"], backend="reference")
    rerun = run_synthetic(["wan-1.3b"], other, str(tmp_path), **kw)["synthetic"]["wan-1.3b"]["methods"]
    label = "veda@0.5:block=64:tiling=1x8x8"
    assert rerun[label]["config"]["backend"] == "reference"
    assert rerun[label]["forward_s_all"] != fresh["methods"][label]["forward_s_all"]      # measured again
    assert rerun["dense"]["forward_s_all"] == fresh["methods"]["dense"]["forward_s_all"]  # dense kept


def test_cli_prints_compiled_rows(tmp_path, capsys):
    """Compiled sparse rows have no attention time: the summary prints a dash, not a crash."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = main(["evaluate", "--synthetic", "wan-1.3b", "--device", "cpu", "--frames", "5", "--height", "64",
                   "--width", "128", "--synthetic-layers", "1", "--compile", "aot_eager", "--methods",
                   "veda@0.5:block=64:tiling=1x8x8", "--repeats", "1", "--warmup-forwards", "0", "--no-progress",
                   "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(n)
    out = capsys.readouterr().out
    assert rc == 0 and "veda@0.5:block=64:tiling=1x8x8" in out and "attention   – s" in out
    # the calls of one forward (one block), as the report's table gives them, not the warm-up and timed ones summed
    assert "sparse/dense calls per forward 1/0" in out and "sparse/dense calls per forward 0/1" in out
    assert "(timed in a profiled forward)" in out


def test_shrunken_ltx2_runs_sparse(monkeypatch):
    """LTX-2 19B (the class defaults, split RoPE): packed video and audio tokens, the connector's text states for both
    streams and the latent sizes, as LTX2Pipeline passes them; one block at a tiny size runs sparse on CPU (its video
    self-attention; the audio and cross-attentions stay stock), with 2 heads per stream and its text states narrowed
    alike."""
    setup = synthetic_setup("ltx2")
    assert setup.grid == (16, 16, 24) and setup.tokens == 6144 and setup.attention_tokens == 6144
    assert (setup.model.heads, setup.model.head_dim, setup.num_layers) == (32, 128, 48)
    assert 18.5e9 < count_parameters(setup) < 19.5e9
    small = synthetic_setup("ltx2", frames=17, height=256, width=256, layers=1)
    inputs = make_inputs(small, torch.device("cpu"), torch.float32)
    assert tuple(inputs["hidden_states"].shape) == (1, 3 * 8 * 8, 128)
    assert tuple(inputs["audio_hidden_states"].shape) == (1, 18, 128)          # 17 frames at 24 fps, 25 per second
    assert (inputs["num_frames"], inputs["height"], inputs["width"], inputs["audio_num_frames"]) == (3, 8, 8, 18)
    assert tuple(inputs["audio_encoder_hidden_states"].shape) == (1, 1024, 3840)
    _narrowed(monkeypatch, "ltx2", num_attention_heads=2, cross_attention_dim=256, audio_num_attention_heads=2,
              audio_cross_attention_dim=128)
    row = _shrunken_sparse_row("ltx2", frames=17, height=256, width=256)
    assert 0.3 < row["realised_density"] < 0.7 and 0 < row["output_rel_l2_vs_dense"] < 0.5


def test_shrunken_cosmos_runs_sparse():
    """Cosmos-Predict2.5 2B (diffusers' conversion config, without the padding-mask channel): the latents, the
    condition mask, per-frame sigmas [B, 1, T, 1, 1] and the stacked Qwen2.5-VL text states (512 x 100,352) as
    Cosmos2_5_PredictBasePipeline passes them for text to world; one block at a tiny size runs sparse on CPU (its
    video self-attention; the cross-attention to the text stays stock)."""
    setup = synthetic_setup("cosmos")
    assert setup.latent == (16, 24, 88, 160) and setup.grid == (24, 44, 80)
    assert setup.tokens == 84_480 and setup.attention_tokens == 84_480
    assert (setup.model.heads, setup.model.head_dim, setup.num_layers) == (16, 128, 28)
    assert 2.0e9 < count_parameters(setup) < 2.1e9
    small = synthetic_setup("cosmos", frames=9, height=128, width=128, layers=1)
    inputs = make_inputs(small, torch.device("cpu"), torch.float32)
    assert tuple(inputs["hidden_states"].shape) == (1, 16, 3, 16, 16)
    assert tuple(inputs["condition_mask"].shape) == (1, 1, 3, 16, 16) and not inputs["condition_mask"].any()
    assert tuple(inputs["timestep"].shape) == (1, 1, 3, 1, 1) and inputs["timestep"].dtype == torch.float32
    assert tuple(inputs["encoder_hidden_states"].shape) == (1, 512, 100_352)
    del inputs
    row = _shrunken_sparse_row("cosmos", frames=9, height=128, width=128)     # 3 x 8 x 8 tokens: 3 tiles of 64
    assert 0.3 < row["realised_density"] < 0.7 and 0 < row["output_rel_l2_vs_dense"] < 0.5


def test_kandinsky5_published_shape():
    """Kandinsky 5.0 Video Pro 19B at 121 x 768 x 1024: 33 input channels (16 latent + 16 condition + 1 mask), 95,232
    video tokens, text by cross-attention only; heads and head dim from model_dim and axes_dims, layers from
    num_visual_blocks (the config has no num_attention_heads / attention_head_dim / num_layers)."""
    setup = synthetic_setup("kandinsky5")
    assert setup.latent == (33, 31, 96, 128) and setup.grid == (31, 48, 64)
    assert setup.tokens == 95_232 and setup.attention_tokens == 95_232
    assert (setup.model.heads, setup.model.head_dim, setup.num_layers) == (32, 128, 60)
    assert 19.0e9 < count_parameters(setup) < 19.6e9
    two = synthetic_setup("kandinsky5", layers=2)
    assert (two.config["num_visual_blocks"], two.config["num_text_blocks"], two.num_layers) == (2, 4, 2)
    assert "num_layers" not in two.config and two.describe()["layers"] == 2


def test_shrunken_kandinsky5_runs_sparse(monkeypatch):
    """Kandinsky 5 as Kandinsky5T2VPipeline calls it (channels-last latents with a zero condition, RoPE positions,
    the resolution's RoPE scale, no sparse_params), narrowed to 4 heads x 128: two visual blocks at a tiny size with
    a partial last tile run sparse on CPU (their self-attention; the text refiner and cross-attention stay stock).
    The zero-initialised modulations are drawn at random, so the sparse output differs from dense."""
    _narrowed(monkeypatch, "kandinsky5", model_dim=512, ff_dim=2048, time_dim=128)
    small = synthetic_setup("kandinsky5", frames=9, height=144, width=128, layers=2)
    assert small.grid == (3, 9, 8) and small.model.heads == 4
    inputs = make_inputs(small, torch.device("cpu"), torch.float32)
    hidden = inputs["hidden_states"]
    assert tuple(hidden.shape) == (1, 3, 18, 16, 33) and hidden.is_contiguous()
    assert hidden[..., :16].std() > 0.5 and not hidden[..., 16:].any()
    assert [len(p) for p in inputs["visual_rope_pos"]] == [3, 9, 8] and len(inputs["text_rope_pos"]) == 256
    assert inputs["scale_factor"] == (1.0, 3.16, 3.16) and inputs["sparse_params"] is None
    assert tuple(inputs["encoder_hidden_states"].shape) == (1, 256, 3584)
    assert tuple(inputs["pooled_projections"].shape) == (1, 768) and inputs["return_dict"] is True
    at_480p = synthetic_setup("kandinsky5", frames=1, height=480, width=832, layers=1)
    assert make_inputs(at_480p, torch.device("cpu"), torch.float32)["scale_factor"] == (1.0, 2.0, 2.0)
    transformer = build_transformer(small, torch.device("cpu"), torch.float32)
    assert all(block.visual_modulation.out_layer.weight.any() for block in transformer.visual_transformer_blocks)
    with torch.no_grad():
        out = transformer(**inputs)[0]
    assert tuple(out.shape) == (1, 3, 18, 16, 16)
    del transformer
    row = _shrunken_sparse_row("kandinsky5", layers=2, frames=9, height=144, width=128)
    assert all(0.3 < d < 0.7 for d in row["layer_density"]) and 0 < row["output_rel_l2_vs_dense"] < 0.5


def test_framepack_published_shape():
    """FramePack I2V at 640 x 640: a window of 9 latent frames (14,400 video tokens) after 3,200 + 400 + 400 history
    tokens, 729 image and 256 text tokens, all in the self-attention of HunyuanVideo's 20 + 40 blocks; the density
    floor the global tiles set is near 0.45."""
    setup = synthetic_setup("framepack")
    assert setup.latent == (16, 9, 80, 80) and setup.grid == (9, 40, 40) and setup.tokens == 14_400
    assert setup.history_tokens == (3_200, 400, 400)
    assert setup.attention_tokens == 14_400 + 4_000 + 729 + 256 == 19_385
    assert 0.44 < 1 - (setup.tokens / setup.attention_tokens) ** 2 < 0.46
    assert (setup.model.heads, setup.model.head_dim, setup.num_layers) == (24, 128, 60)
    shape = setup.describe()
    assert shape["history_tokens"] == [3_200, 400, 400] and shape["image_tokens"] == 729
    assert 12.5e9 < count_parameters(setup) < 13.2e9
    one = synthetic_setup("framepack", layers=1)
    assert (one.config["num_layers"], one.config["num_single_layers"], one.num_layers) == (1, 0, 1)


def test_shrunken_framepack_runs_sparse(monkeypatch):
    """FramePack as HunyuanVideoFramepackPipeline calls it in a later section (clean latents, 2x / 4x history and
    their frame indices, SigLIP image embeddings, text mask, guidance), narrowed to 2 heads x 128: the forward's
    joint sequence is the setup's attention tokens (the 2x / 4x history padded to whole kernels), and two blocks at a
    tiny size with a partial last tile run sparse on CPU, history, image and text served as global tiles."""
    _narrowed(monkeypatch, "framepack", num_attention_heads=2)
    small = synthetic_setup("framepack", frames=9, height=272, width=256, layers=2)
    assert small.grid == (3, 17, 16) and small.history_tokens == (2 * 17 * 16, 9 * 8, 4 * 5 * 4)
    inputs = make_inputs(small, torch.device("cpu"), torch.float32)
    assert tuple(inputs["hidden_states"].shape) == (1, 16, 3, 34, 32)
    for key, frames in (("latents_clean", 2), ("latents_history_2x", 2), ("latents_history_4x", 16)):
        assert tuple(inputs[key].shape) == (1, 16, frames, 34, 32)
    assert inputs["indices_latents"].tolist() == [1, 2, 3] and inputs["indices_latents_clean"].tolist() == [0, 4]
    assert inputs["indices_latents_history_2x"].tolist() == [5, 6]
    assert inputs["indices_latents_history_4x"].tolist() == list(range(7, 23))
    assert tuple(inputs["image_embeds"].shape) == (1, 729, 1152) and inputs["encoder_attention_mask"].all()
    assert inputs["guidance"].tolist() == [6000.0]
    transformer = build_transformer(small, torch.device("cpu"), torch.float32)
    joint = []
    transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda module, args: joint.append(args[0].shape[1] + args[1].shape[1]))
    with torch.no_grad():
        out = transformer(**inputs)[0]
    assert joint == [small.attention_tokens] and tuple(out.shape) == (1, 16, 3, 34, 32)
    del transformer
    row = _shrunken_sparse_row("framepack", layers=2, frames=9, height=272, width=256)
    floor = 1 - (small.tokens / small.attention_tokens) ** 2          # every pair with a global tile is kept
    assert all(floor < d < 0.99 for d in row["layer_density"]) and 0 < row["output_rel_l2_vs_dense"] < 0.5


def test_shrunken_minimax_h3_runs_sparse(monkeypatch):
    """MiniMax-H3 33B (the class defaults) in the t2va layout at the pipeline's 768 x 1344, 124 frames: 37 latent
    frames (given as 145, the 1 + 4k form) of 24 x 42 patches after 256 text and 2 x 207 audio rows, one packed
    sequence built by the pipeline's own layout and timestep helpers. Narrowed to 2 heads x 128 over a 256-wide
    residual, one block at a tiny size with a partial last tile runs sparse on CPU, text and audio as global tiles."""
    import inspect

    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (audio_latent_num_frames,
                                                                         video_latent_num_frames)

    setup = synthetic_setup("minimax-h3")
    assert setup.latent == (24, video_latent_num_frames(124, 17, 5), 768 // 16, 1344 // 16) == (24, 37, 48, 84)
    assert setup.grid == (37, 24, 42) and setup.tokens == 37_296
    assert setup.audio_tokens == 2 * audio_latent_num_frames(124) == 414
    assert setup.attention_tokens == 37_296 + 414 + 256 == 37_966 and setup.describe()["audio_tokens"] == 414
    assert (setup.model.heads, setup.model.head_dim, setup.num_layers) == (56, 128, 50)
    assert 33.0e9 < count_parameters(setup) < 33.3e9
    _narrowed(monkeypatch, "minimax-h3", num_attention_heads=2, hidden_size=256, ffn_dim=512,
              time_embed_hidden_dim=256, time_embed_dim=128)
    small = synthetic_setup("minimax-h3", frames=9, height=288, width=256, layers=1)
    assert small.grid == (3, 9, 8) and small.audio_tokens == 2 * 13        # 3 latent frames stand for 8 frames
    inputs = make_inputs(small, torch.device("cpu"), torch.float32)
    forward_args = set(inspect.signature(MiniMaxH3Transformer3DModel.forward).parameters) - {"self", "attention_kwargs"}
    assert set(inputs) == forward_args
    assert tuple(inputs["hidden_states"].shape) == (1, 3 * 9 * 8, 24 * 4)
    assert tuple(inputs["audio_hidden_states"].shape) == (1, 26, 32)
    assert tuple(inputs["encoder_hidden_states"].shape) == (1, 256, 5120)
    n = small.attention_tokens
    assert n == 216 + 26 + 256 and tuple(inputs["position_ids"].shape) == (n, 3)
    assert inputs["text_indices"].tolist() == list(range(256))
    assert inputs["audio_indices"].tolist() == list(range(256, 282)) and inputs["video_indices"].tolist() == list(
        range(282, n))
    assert inputs["token_tags"].bincount().tolist() == [216, 256, 26]          # video, text, audio
    video_t, audio_t = inputs["timestep"].tolist()                            # 1 - the shifted sigmas of a mid step
    assert video_t == pytest.approx(1 / 13) and audio_t == pytest.approx(0.25)
    assert inputs["timestep_indices"].tolist() == [0] * 256 + [1] * 26 + [0] * 216
    row = _shrunken_sparse_row("minimax-h3", frames=9, height=288, width=256)
    # 6 video tiles (3 x 9 x 8 on 1 x 8 x 8: partial last tiles); every pair with one of the 282 text / audio rows
    # (global tiles) is kept
    floor = 1 - (small.tokens / small.attention_tokens) ** 2
    assert floor < row["realised_density"] < 0.99 and 0 < row["output_rel_l2_vs_dense"] < 0.5


def test_shrunken_wan_animate2_runs_sparse(monkeypatch):
    """Wan-Animate-2 (the class defaults: the Wan 14B backbone) in one generation step of an 81-frame 800 x 640
    segment: 22 latent frames (the reference image's, then 21; given as 85 frames) of 50 x 40 patches, and a geometry
    that fills the block mask (origin_len 81, origin_area 800 x 640). Narrowed to 2 heads x 128, one block at a tiny
    size: the untimed extraction pass fills the cache, then the generation forward runs sparse with no fallback."""
    import inspect

    from diffusers import WanAnimate2Transformer3DModel

    setup = synthetic_setup("wan-animate2")
    assert setup.latent == (16, 22, 100, 80) and setup.grid == (22, 50, 40) and setup.tokens == 44_000
    assert (setup.model.heads, setup.model.head_dim, setup.num_layers) == (40, 128, 40)
    assert 16.0e9 < count_parameters(setup) < 17.5e9
    _narrowed(monkeypatch, "wan-animate2", dim=256, num_heads=2, ffn_dim=512)
    small = synthetic_setup("wan-animate2", frames=9, height=144, width=128, layers=1)
    assert small.grid == (3, 9, 8)
    inputs = make_inputs(small, torch.device("cpu"), torch.float32)
    forward_args = set(inspect.signature(WanAnimate2Transformer3DModel.forward).parameters)
    assert set(inputs) <= forward_args and inputs["kv_cache_mode"] == "cached" and inputs["seq_len"] == 216
    assert inputs["origin_len"] // 4 + 1 == 2 and inputs["origin_area"][0] * inputs["origin_area"][1] // 256 == 72
    row = _shrunken_sparse_row("wan-animate2", frames=9, height=144, width=128)
    assert 0.3 < row["realised_density"] < 0.8 and 0 < row["output_rel_l2_vs_dense"] < 0.5


def test_synthetic_layers_above_the_models_are_refused(capsys):
    """Review 51 (d15): --synthetic-layers 1000 for wan-1.3b's 30 layers planned 1000 blocks."""
    assert synthetic_setup("wan-1.3b", layers=30).num_layers == 30
    with pytest.raises(ValueError, match="layers=31 .* is more than the 30 layers of wan-1.3b; give 1 to 30"):
        synthetic_setup("wan-1.3b", layers=31)
    assert main(["evaluate", "--synthetic", "wan-1.3b", "--device", "cpu", "--synthetic-layers", "1000", "--frames",
                 "1", "--height", "16", "--width", "16", "--out", "unused"]) == 2
    assert "layers=1000 (--synthetic-layers) is more than the 30 layers" in capsys.readouterr().err


def test_synthetic_specs_are_checked_before_the_dense_forward(tmp_path, capsys, monkeypatch):
    """Review 51 (d01, d02): a spec's missing tiling file, or a dense layer the model lacks, was found after the dense
    forward, leaving the report and the dense output behind (quality runs checked the files first)."""
    import videosparse.eval.synthetic as synthetic

    out = tmp_path / "syn"
    spec = "veda:tiling=" + str(tmp_path / "nofile.json")
    with monkeypatch.context() as m:
        m.setattr(synthetic, "build_transformer", lambda *a, **k: pytest.fail("built before the refusal"))
        assert main(["evaluate", "--no-progress", "--synthetic", "wan-1.3b", "--device", "cpu", "--synthetic-layers",
                     "1", "--frames", "1", "--height", "16", "--width", "16", "--repeats", "1", "--warmup-forwards",
                     "0", "--methods", spec, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"method spec {spec!r}" in err and "does not exist" in err, err
    specs = parse_method_specs(["veda@0.5:dense_layers=1"])
    with pytest.raises(ValueError, match=r"method spec 'veda@0.5:dense_layers=1': dense_layers=\(1,\) names layers "
                                         r"\[1\], but this WanTransformer3DModel has 1"):
        run_synthetic(["wan-1.3b"], specs, str(out), device="cpu", frames=1, height=16, width=16, layers=1, warmup=0,
                      repeats=1, progress=False)
    assert not out.exists()


def test_a_damaged_dense_output_is_measured_again(tmp_path, caplog):
    """Fault-injection find: the dense output was written in place, so a run killed while writing it left a
    truncated file beside a report that lists dense as done, and the next run that adds a method failed on it
    (SafetensorError naming no file). It is written through a temporary file now, and one that cannot be read is
    measured again with a warning naming it."""
    import logging

    kw = dict(device="cpu", frames=5, height=64, width=128, layers=1, warmup=0, repeats=1, progress=False)
    veda = parse_method_specs(["veda@0.5:block=64:tiling=1x8x8"])
    first = run_synthetic(["wan-1.3b"], veda, str(tmp_path), **kw)["synthetic"]["wan-1.3b"]["methods"]
    saved = tmp_path / "dense_output_wan-1.3b.safetensors"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    saved.write_bytes(saved.read_bytes()[:100])                      # a half-written file
    specs = parse_method_specs(["veda@0.5:block=64:tiling=1x8x8", "sol@0.5:block=64"])
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        again = run_synthetic(["wan-1.3b"], specs, str(tmp_path), **kw)["synthetic"]["wan-1.3b"]["methods"]
    assert any(str(saved) in r.getMessage() and "runs again" in r.getMessage() for r in caplog.records)
    assert again["dense"]["forward_s_all"] != first["dense"]["forward_s_all"]          # measured again
    assert 0 < again["sol@0.5:block=64"]["output_rel_l2_vs_dense"] < 1.0
    assert os.path.getsize(saved) > 100


def test_a_speedup_above_the_attention_free_bound_is_flagged():
    """Review 54: on a loaded machine a synthetic run reported 1.43x where attention free would give 1.05x, with no
    note."""
    from videosparse.eval.synthetic import beyond_bound_notes

    section = {"amdahl_bound_free_attention": 1.05, "methods": {
        "dense": {"speedup": 1.0, "forward_s_all": [3.0]}, "veda@0.25": {"speedup": 1.43, "forward_s_all": [2.61, 3.92]},
        "sol@0.25": {"speedup": 1.08, "forward_s_all": [2.9]}}}
    notes = beyond_bound_notes({"wan-1.3b": section})
    assert len(notes) == 1 and notes[0].startswith("wan-1.3b veda@0.25: speedup 1.43x above 1.05x") and "2.61 to 3.92" \
        in notes[0]
    assert not beyond_bound_notes({"m": {"amdahl_bound_free_attention": None, "methods": section["methods"]}})


def test_a_speedup_above_one_with_slower_attention_is_flagged():
    """Review find: a CPU run printed sol@0.25 at 1.06x while its attention ran 0.80x of dense's (dense's own
    forwards spread 2.93 to 3.66 s), under the attention-free bound, so with no note."""
    from videosparse.eval.synthetic import beyond_bound_notes

    section = {"amdahl_bound_free_attention": 1.6, "methods": {
        "dense": {"speedup": 1.0, "speedup_attention": 1.0, "forward_s_all": [3.18, 2.93, 3.66]},
        "sol@0.25": {"speedup": 1.06, "speedup_attention": 0.80, "forward_s_all": [2.9]},
        "veda@0.25": {"speedup": 1.2, "speedup_attention": 1.5, "forward_s_all": [2.5]},
        "veda@0.1": {"speedup": 0.9, "speedup_attention": 0.7, "forward_s_all": [3.3]}}}
    notes = beyond_bound_notes({"wan-1.3b": section})
    assert len(notes) == 1 and notes[0].startswith("wan-1.3b sol@0.25: forward speedup 1.06x while its attention ran "
                                                   "slower than dense's (0.80x)")
    assert "2.93 to 3.66 s" in notes[0]


def _small_wan():
    """Two Wan 1.3B blocks at 5 frames 128x128 on CPU (2x8x8 tokens: two 1x8x8 tiles) and their inputs."""
    setup = synthetic_setup("wan-1.3b", frames=5, height=128, width=128, layers=2)
    return build_transformer(setup, torch.device("cpu"), torch.float32), make_inputs(setup, torch.device("cpu"),
                                                                                     torch.float32)


def test_synthetic_times_are_medians_of_the_timed_forwards_without_the_warm_up(monkeypatch):
    """Mutation testing: the warm-up forwards (cold compile, Sol calibration) were once counted among the timed ones,
    and a mean of 3 repeats (1, 1, 4 s) is not their median (1 s); the timers are faked with those readings."""
    from contextlib import contextmanager

    from videosparse.eval import synthetic
    from videosparse.eval.spec import parse_method_spec
    from videosparse.eval.synthetic import time_method

    readings = {"forward": [1.0, 1.0, 4.0], "attention": [0.5, 0.5, 2.0], "plan": [0.1, 0.1, 0.4]}

    def read(key):                      # a timed forward beyond the 3 repeats reads 9 s
        return readings[key].pop(0) if readings[key] else 9.0

    class FakeTransformerTimer:
        def __init__(self, transformers):
            self.times = []

        @contextmanager
        def __call__(self):
            yield self
            self.times.append(read("forward"))

    class FakeAttentionTimer(FakeTransformerTimer):
        @contextmanager
        def __call__(self):
            yield self
            self.attention_total, self.plan_total = read("attention"), read("plan")

    monkeypatch.setattr(synthetic, "TransformerTimer", FakeTransformerTimer)
    monkeypatch.setattr(synthetic, "AttentionTimer", FakeAttentionTimer)
    model, inputs = _small_wan()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    spec = parse_method_spec("veda@0.5:block=64:tiling=1x8x8")
    row, _ = time_method(model, inputs, spec, warmup=1, repeats=3)
    assert len(forwards) == 4 and row["calls_counted_forwards"] == 4
    assert row["forward_s_all"] == [1.0, 1.0, 4.0] and row["attention_s_all"] == [0.5, 0.5, 2.0]
    assert (row["forward_s"], row["attention_s"], row["plan_s"]) == (1.0, 0.5, 0.1)


def test_synthetic_attention_work_counts_the_dense_layers_calls():
    """Mutation testing: the attention work (what the Amdahl estimate uses) must count the calls of `dense_layers` as
    full work: one dense and one sparse layer at density d do (1 + d) / 2 of dense attention, not d / 2."""
    from videosparse.eval.spec import parse_method_spec
    from videosparse.eval.synthetic import time_method

    model, inputs = _small_wan()
    spec = parse_method_spec("veda@0.5:block=64:tiling=1x8x8:dense_layers=0")
    row, _ = time_method(model, inputs, spec, warmup=0, repeats=1)
    assert (row["sparse_calls"], row["dense_calls"]) == (1, 1)
    density = row["layer_density"][1]
    assert density == pytest.approx(0.5) and row["realised_density"] == pytest.approx(density)
    assert row["attention_work"] == pytest.approx((1 + density) / 2)


def test_synthetic_speedup_is_dense_over_method_time_and_amdahl_uses_the_dense_share():
    """Mutation testing: only the dense speedup (1) was checked; a method at 6 s against dense's 10 s is 1.67x, and
    with dense attention half the forward and work 0.1 the Amdahl estimate is 1 / (0.5 + 0.5 * 0.1)."""
    from videosparse.eval.synthetic import SyntheticResult, summarize_synthetic

    result = SyntheticResult("wan-1.3b", synthetic_setup("wan-1.3b", 9, 128, 256, 1), {})
    result.methods = {"dense": {"forward_s": 10.0, "attention_s": 5.0, "attention_work": 1.0},
                      "veda@0.1": {"forward_s": 6.0, "attention_s": 1.0, "attention_work": 0.1}}
    section = summarize_synthetic(result, torch.bfloat16, 1, 3)
    dense, veda = section["methods"]["dense"], section["methods"]["veda@0.1"]
    assert veda["speedup"] == pytest.approx(10.0 / 6.0) and veda["speedup_attention"] == pytest.approx(5.0)
    assert dense["speedup"] == dense["amdahl_bound"] == pytest.approx(1.0)
    assert veda["amdahl_bound"] == pytest.approx(1.0 / (0.5 + 0.5 * 0.1))
    assert section["dense_attention_share"] == pytest.approx(0.5) and veda["attention_share"] == pytest.approx(1 / 6)
