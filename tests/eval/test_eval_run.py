"""End to end on CPU: a small grid on the tiny Wan pipeline produces every artifact, reruns skip done cells."""

import json
import math
import os

import imageio.v3 as iio
import numpy as np
import pytest
import torch

from videosparse.eval.evaluate import BUILTIN_PROMPTS, EvalSettings, cell_id, run_evaluation
from videosparse.eval.spec import parse_method_specs
from videosparse.models.loading import LoadedPipeline
from videosparse.models.tiny_wan import build_tiny_wan_pipeline

# 9 frames 128x256 -> latent 3x16x32 -> token grid 3x8x16 = 384 tokens: 6 tiles of 64 tokens
CALL = dict(num_frames=9, height=128, width=256, num_inference_steps=2, guidance_scale=5.0, max_sequence_length=32)
METHODS = ["dense", "veda@0.5:block=64:tiling=1x8x8", "sol@0.5"]


@pytest.fixture(scope="module")
def one_thread():
    # two cores shared with other processes: one thread avoids oversubscription stalls
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def loaded(one_thread):
    return LoadedPipeline(build_tiny_wan_pipeline(), "tiny-wan-test", {})


@pytest.fixture(scope="module")
def evaluated(loaded, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("eval"))
    settings = EvalSettings(parse_method_specs(METHODS), BUILTIN_PROMPTS[:2], [0], dict(CALL))
    report = run_evaluation(loaded, settings, out, progress=False)
    return out, settings, report


def test_every_artifact_is_written(evaluated):
    out, settings, report = evaluated
    assert report["run_stats"] == {"computed": 6, "skipped": 0, "attention_computed": 2, "attention_skipped": 0}
    for name in ("report.json", "report.md", "plots/quality_vs_density.png", "plots/attention_error_heatmap.png",
                 "plots/speedup_vs_density.png"):
        path = os.path.join(out, name)
        assert os.path.isfile(path) and os.path.getsize(path) > 0, name
    for p in range(2):
        video = iio.imread(os.path.join(out, "videos", f"prompt{p:02d}_seed0.mp4"))
        # three panels of 256 + two 2-pixel gaps, padded to a multiple of 16
        assert video.shape[0] == 9 and video.shape[1] == 128 and video.shape[2] == 784
    md = open(os.path.join(out, "report.md")).read()
    for label in METHODS:
        assert f"`{label}`" in md
    assert "Amdahl est." in md and "LPIPS" in md and "pooled PSNR" in md
    from videosparse.eval.report import render_markdown

    row = next(iter(report["summary"]))         # review 54: the requested density was rounded to 2 digits
    for density in (0.125, 0.004):
        report["summary"][row]["nominal_density"] = density
        assert f"| `{row}` | {density} |" in render_markdown(report)


def test_report_json_holds_every_number(evaluated):
    out, settings, report = evaluated
    with open(os.path.join(out, "report.json")) as f:
        raw = json.load(f, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert raw["environment"]["torch"] == torch.__version__ and raw["environment"]["device"] == "cpu"
    assert raw["shapes"]["grid"] == [3, 8, 16] and raw["shapes"]["heads"] == 2 and raw["shapes"]["layers"] == 2
    assert raw["methods"]["sol@0.5"]["config"]["method"] == "sol"
    assert len(raw["cells"]) == 6
    dense = raw["summary"]["dense"]
    assert dense["psnr_db"] == "inf" and dense["ssim"] == pytest.approx(1.0)
    for cell in raw["cells"].values():
        assert len(cell["psnr_per_frame"]) == 9 and len(cell["transformer_s"]) == 4      # 2 steps x CFG
        assert cell["attention_calls"] == 8                                             # 2 layers x 4 forwards
        assert 0 < cell["attention_s"] < cell["transformer_total_s"] < cell["wall_s"]
    assert any("LPIPS" in n for n in raw["notes"])


def test_quality_and_attention_numbers_are_sane(evaluated):
    out, settings, report = evaluated
    s = report["summary"]
    assert math.isinf(s["dense"]["psnr_db"]) and s["dense"]["speedup_transformer"] == pytest.approx(1.0)
    for label in METHODS[1:]:
        row = s[label]
        assert math.isfinite(row["psnr_db"]) and 10 < row["psnr_db"] < 200
        assert 0 < row["ssim"] <= 1
        assert 0.2 < row["realised_density"] < 0.8 and row["attention_work"] == pytest.approx(row["realised_density"])
        assert all(d is not None and 0 < d <= 1 for d in row["layer_density"]["transformer"])
        assert row["attention_samples"] == 2 * 2                 # sampled steps [0, 1] x 2 layers
        assert 0 < row["attn_rel_l2"] < 1 and 0 <= row["tile_recall"] <= 1
        assert row["mass_kept"] <= row["oracle_mass_kept"] + 1e-6
        assert row["amdahl_bound"] is not None and row["amdahl_bound"] >= 1.0
    # the attention-level error of the sampled calls is what the kernel does on the same inputs
    entries = next(v for v in report["attention"].values() if v["method"] == "sol@0.5")["entries"]["transformer"]
    assert {(e["step"], e["layer"]) for e in entries} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert all(e["sparse"] and len(e["rel_l2_per_head"]) == 2 for e in entries)


def test_dense_frames_are_the_stock_pipeline_output(evaluated, loaded):
    out, settings, report = evaluated
    from videosparse.eval.generate import generate

    stock = generate(loaded.pipe, None, {**CALL, "prompt": BUILTIN_PROMPTS[0]}, seed=0)
    cid = cell_id(settings.methods[0], BUILTIN_PROMPTS[0], 0)
    saved = np.load(os.path.join(out, "frames", f"{cid}.npy")).astype(np.float32)
    np.testing.assert_allclose(saved, stock.frames, atol=1e-3)      # fp16 storage


def test_rerun_skips_done_cells_and_adds_new_ones(evaluated, loaded):
    out, settings, first = evaluated
    again = run_evaluation(loaded, settings, out, progress=False)
    assert again["run_stats"] == {"computed": 0, "skipped": 6, "attention_computed": 0, "attention_skipped": 2}
    assert again["summary"]["sol@0.5"]["psnr_db"] == pytest.approx(first["summary"]["sol@0.5"]["psnr_db"])
    more = EvalSettings(parse_method_specs(METHODS + ["veda@0.25:block=64:tiling=1x8x8"]), BUILTIN_PROMPTS[:2], [0],
                        dict(CALL), attn_cells=0)
    grown = run_evaluation(loaded, more, out, progress=False)
    assert grown["run_stats"] == {"computed": 2, "skipped": 6, "attention_computed": 0, "attention_skipped": 0}
    assert grown["summary"]["veda@0.25:block=64:tiling=1x8x8"]["realised_density"] < 0.4


def test_a_rerun_with_other_attention_sampling_summarises_only_its_own_cells(evaluated, loaded, tmp_path):
    """Review find: a rerun into the same directory with fewer attention cells (or other steps) kept averaging
    the earlier run's cells into its summary while its report named its own sampling."""
    import dataclasses
    import shutil

    out, settings, first = evaluated
    copy = str(tmp_path / "copy")
    shutil.copytree(out, copy)
    wider = run_evaluation(loaded, dataclasses.replace(settings, attn_cells=2), copy, progress=False)
    again = run_evaluation(loaded, settings, copy, progress=False)
    for label in ("veda@0.5:block=64:tiling=1x8x8", "sol@0.5"):
        assert wider["summary"][label]["attention_samples"] == 2 * first["summary"][label]["attention_samples"]
        for key in ("attention_samples", "attn_rel_l2", "tile_recall"):
            assert again["summary"][label][key] == pytest.approx(first["summary"][label][key]), (label, key)
    with pytest.raises(ValueError, match=r"attn_steps=\[\] \(--attn-steps ''\) samples nothing"):
        dataclasses.replace(settings, attn_steps=[])


def test_a_rerun_notes_speedups_across_runs_and_drops_the_heatmap_it_was_not_asked_for(evaluated, loaded, tmp_path):
    """Exploratory finds: a rerun's new method was compared with dense cells timed by an earlier process, and the
    report did not say so; with --attn-cells 0 the run still wrote an (empty) error heatmap, or kept an earlier
    run's, which then misread as this run's."""
    import shutil

    out, settings, first = evaluated
    assert not [n for n in first["notes"] if "a rerun into this" in n]
    assert len({c["timed_in"] for c in first["cells"].values()}) == 1
    copy = str(tmp_path / "copy")
    shutil.copytree(out, copy)
    rerun = EvalSettings(parse_method_specs(["dense", "sol@0.5", "sol@0.25"]), BUILTIN_PROMPTS[:1], [0], dict(CALL),
                         attn_cells=0)
    report = run_evaluation(loaded, rerun, copy, progress=False)
    assert report["run_stats"]["computed"] == 1
    runs = {label: report["summary"][label]["timed_in"] for label in ("dense", "sol@0.5", "sol@0.25")}
    assert runs["dense"] == runs["sol@0.5"] != runs["sol@0.25"] and len(runs["sol@0.25"]) == 1
    timed = [n for n in report["notes"] if "a rerun into this" in n]
    assert len(timed) == 1 and timed[0].startswith("sol@0.25: timed in another run than dense")
    assert "plots/attention_error_heatmap.png" not in report["artifacts"]["plots"]
    assert not os.path.exists(os.path.join(copy, "plots", "attention_error_heatmap.png"))
    assert "in another run than dense" in open(os.path.join(copy, "report.md")).read()


def test_rerun_timing_notes_name_each_method_timed_apart_from_dense():
    from videosparse.eval.report import UNRECORDED_RUN, rerun_timing_notes, runs_of

    assert runs_of([{"timed_in": "b"}, {}, {"timed_in": "a"}, {"timed_in": "b"}]) == sorted(["a", "b", UNRECORDED_RUN])
    notes = rerun_timing_notes({"dense": ["a"], "same": ["a"], "other": ["b"], "mixed": ["a", "b"],
                                "older": [UNRECORDED_RUN], "none": []})
    assert [n.split(":")[0] for n in notes] == ["other", "mixed", "older"]
    assert "in another run than dense" in notes[0] and "over 2 runs" in notes[1]
    both = rerun_timing_notes({"dense": ["a", "b"], "m": ["a", "b"]}, prefix="wan ")
    assert [n.split(":")[0] for n in both] == ["wan dense", "wan m"] and all("over 2 runs" in n for n in both)
    assert rerun_timing_notes({}) == [] and rerun_timing_notes({"dense": [UNRECORDED_RUN]}) == []


def test_other_settings_refuse_the_directory(evaluated, loaded):
    out, settings, _ = evaluated
    other = EvalSettings(settings.methods, settings.prompts, [0], dict(CALL, num_inference_steps=3))
    with pytest.raises(ValueError, match="other settings"):
        run_evaluation(loaded, other, out, progress=False)
    # review find: cells timed with a warm-up or another thread count joined the report, which then named only the
    # last run's settings; both are part of the run's key now
    warm = EvalSettings(settings.methods, settings.prompts, [0], dict(CALL), warmup=True)
    with pytest.raises(ValueError, match=r"other settings \(warmup: False -> True\)"):
        run_evaluation(loaded, warm, out, progress=False)
    n = torch.get_num_threads()
    torch.set_num_threads(n + 1)
    try:
        with pytest.raises(ValueError, match=f"timed_on.cpu_threads: {n} -> {n + 1}"):
            run_evaluation(loaded, settings, out, progress=False)
    finally:
        torch.set_num_threads(n)


def test_missing_video_writer_still_completes_the_report(loaded, tmp_path, monkeypatch):
    """A machine without ffmpeg for imageio (diffusers raises AttributeError) gets its report, with a note."""
    import videosparse.eval.evaluate as evaluate_module

    def no_ffmpeg(frames, path, fps=8):
        raise AttributeError("Unable to find a compatible ffmpeg installation in your environment")

    monkeypatch.setattr(evaluate_module, "write_video", no_ffmpeg)
    settings = EvalSettings(parse_method_specs(["dense", "sol@0.5"]), BUILTIN_PROMPTS[:1], [0],
                            dict(CALL, num_inference_steps=1), attn_cells=0)
    report = run_evaluation(loaded, settings, str(tmp_path), progress=False)
    assert report["artifacts"]["videos"] == []
    assert any("videos not written" in n and "ffmpeg" in n for n in report["notes"])
    assert "sol@0.5" in report["summary"] and (tmp_path / "report.md").is_file()
    assert json.loads((tmp_path / "report.json").read_text())["summary"]["sol@0.5"]["cells"] == 1


def test_a_method_identical_to_dense_reads_inf_not_a_rounding_floor(loaded, tmp_path):
    """Every step dense: the frames equal dense's, so PSNR is inf (both sides rounded to the stored fp16 alike,
    not 112 dB), the summary counts the cells equal to dense apart instead of averaging inf into the mean, and the
    markdown says so."""
    settings = EvalSettings(parse_method_specs(["dense", "veda@0.5:block=64:tiling=1x8x8:dense_steps=1"]),
                            BUILTIN_PROMPTS[:1], [0], dict(CALL, num_inference_steps=1), attn_cells=0)
    report = run_evaluation(loaded, settings, str(tmp_path), progress=False)
    label = settings.methods[1].label
    cell = next(c for c in report["cells"].values() if c["method"] == label)
    assert math.isinf(cell["psnr_db"])
    assert math.isinf(report["summary"][label]["psnr_db"]) and report["summary"][label]["cells_equal_to_dense"] == 1
    assert "(1 equal to dense)" in (tmp_path / "report.md").read_text()


def test_bad_settings_are_refused(loaded, tmp_path):
    with pytest.raises(ValueError, match=r"seeds repeat \[0\]"):
        EvalSettings(parse_method_specs(["dense"]), BUILTIN_PROMPTS[:1], [0, 0], dict(CALL))
    (tmp_path / "report.json").write_text("[]")
    settings = EvalSettings(parse_method_specs(["dense"]), BUILTIN_PROMPTS[:1], [0], dict(CALL), attn_cells=0)
    with pytest.raises(ValueError, match="holds a JSON list, not a videosparse report"):
        run_evaluation(loaded, settings, str(tmp_path), progress=False)


def test_other_attention_sampling_remeasures_only_the_attention(loaded, tmp_path):
    """A rerun with other --attn-steps keeps the quality cells and measures the attention cells again (its
    samples would otherwise sit under the new sampling's label); steps or layers the run lacks are refused
    before any work."""
    settings = EvalSettings(parse_method_specs(["dense", "sol@0.5"]), BUILTIN_PROMPTS[:1], [0], dict(CALL),
                            attn_steps=[0])
    run_evaluation(loaded, settings, str(tmp_path), progress=False)
    other = EvalSettings(settings.methods, settings.prompts, settings.seeds, dict(CALL), attn_steps=[1])
    report = run_evaluation(loaded, other, str(tmp_path), progress=False)
    assert report["run_stats"] == {"computed": 0, "skipped": 2, "attention_computed": 1,      # 2 quality cells kept
                                   "attention_skipped": 0}
    assert [a["steps"] for a in report["attention"].values()] == [[1]]
    same = EvalSettings(settings.methods, settings.prompts, settings.seeds, dict(CALL), attn_steps=(1,))
    assert run_evaluation(loaded, same, str(tmp_path), progress=False)["run_stats"]["attention_computed"] == 0  # tuple
    for bad, match in ((dict(attn_steps=[5]), r"--attn-steps \[5\]"), (dict(attn_layers=[99]), r"--attn-layers \[99\]")):
        with pytest.raises(ValueError, match=match):
            run_evaluation(loaded, EvalSettings(settings.methods, settings.prompts, settings.seeds, dict(CALL), **bad),
                           str(tmp_path / "bad"), progress=False)
        assert not (tmp_path / "bad" / "report.json").exists()


def test_summary_psnr_counts_identical_cells_apart_and_keeps_nan():
    from videosparse.eval.evaluate import summary_psnr

    assert summary_psnr([20.0, math.inf, 30.0]) == (25.0, 1)
    assert summary_psnr([math.inf, math.inf]) == (math.inf, 2)
    assert summary_psnr([math.inf], is_dense=True) == (math.inf, 0)       # dense against itself
    psnr, equal = summary_psnr([math.nan, 30.0])                          # a broken output is never "equal"
    assert math.isnan(psnr) and equal == 0
    assert summary_psnr([]) == (None, 0)


def test_pooled_psnr_and_the_notes_on_misleading_psnrs():
    """Review finds: a cell differing from dense in a few pixels (97.6 dB on saturated frames) pulled a method's mean
    PSNR to 56 dB where its other cells read 22-24 dB; a NaN video read "–", as a metric not measured."""
    from videosparse.cli.evaluate import _f
    from videosparse.eval.evaluate import pooled_psnr, psnr_notes
    from videosparse.eval.report import _fmt

    assert pooled_psnr([20.0, 20.0]) == pytest.approx(20.0)
    assert pooled_psnr([20.0, math.inf]) == pytest.approx(20.0 + 10 * math.log10(2))     # MSE halved
    assert pooled_psnr([22.2, 23.7, 82.0, 97.6]) == pytest.approx(25.9, abs=0.05)
    assert pooled_psnr([math.inf]) == math.inf and pooled_psnr([]) is None and math.isnan(pooled_psnr([math.nan, 3]))
    summary = {"veda@0.25": {"psnr_db": 56.4, "psnr_db_pooled": 25.9, "psnr_db_cell_max": 97.6},
               "sol@0.25": {"psnr_db": math.nan, "psnr_db_pooled": math.nan, "cells_nan": 1},
               "veda@0.1": {"psnr_db": 23.4, "psnr_db_pooled": 19.5, "psnr_db_cell_max": 30.0}}   # spread alone
    notes = psnr_notes(summary)
    assert len(notes) == 2 and "NaN in the video of sol@0.25 (1 cell):" in notes[0]
    assert "pulled up by cells nearly identical" in notes[1] and "97.6 dB" in notes[1] and "25.90 dB" in notes[1]
    assert psnr_notes({"veda@0.25": {"psnr_db": 24.0, "psnr_db_pooled": 23.5, "psnr_db_cell_max": 70.0}}) == []
    assert _fmt(math.nan) == "NaN" and _fmt(None) == "–" and _f(math.nan).strip() == "NaN"


def test_a_note_when_a_methods_cell_times_spread():
    """Review find: one stalled cell (7.9 s against 57.9 s for the same computation) moved a speedup with no sign."""
    from videosparse.eval.evaluate import timing_spread_notes

    notes = timing_spread_notes({"dense": {"transformer_s_range": [10.0, 11.0]},
                                 "veda@0.25": {"transformer_s_range": [7.9, 57.9]}, "sol@0.5": {}})
    assert len(notes) == 1 and notes[0].startswith("veda@0.25: its cells' transformer times spread from 7.9 to 57.9 s")


def test_a_note_when_a_method_kept_more_tiles_than_its_density():
    """Review find: on a 9-frame 128 x 128 video sol@0.5 kept every tile (realised 1.000, PSNR 103 dB) and only the
    console's log said why; the report showed the row as sol@0.5."""
    from videosparse.eval.evaluate import density_floor_notes

    notes = density_floor_notes({"dense": {"nominal_density": 1.0, "realised_density": 1.0},
                                 "sol@0.5": {"nominal_density": 0.5, "realised_density": 1.0},
                                 "veda@0.5": {"nominal_density": 0.5, "realised_density": 0.625},
                                 "veda@0.1": {"nominal_density": 0.1, "realised_density": 0.115},   # within 20%
                                 "veda@0.05": {"nominal_density": 0.05, "realised_density": 0.069},  # within 0.02
                                 "sol:tau=1": {"nominal_density": None, "realised_density": 0.3},
                                 "veda@0.25": {"nominal_density": 0.25, "realised_density": None}})
    assert len(notes) == 2 and notes[0].startswith("sol@0.5: its sparse calls kept 1.000 of the tile pairs, above "
                                                   "the 0.5 asked") and notes[1].startswith("veda@0.5: its sparse "
                                                                                            "calls kept 0.625")


def test_a_note_names_the_frames_a_stepped_pipeline_made(loaded, tmp_path):
    """Review find: `--frames 4` ran Wan's 5 frames (its counts are 4k + 1) and report.md said "4 frames" with no
    word that the metrics were over 5."""
    settings = EvalSettings(parse_method_specs(["dense", "sol@0.5"]), BUILTIN_PROMPTS[:1], [0],
                            dict(CALL, num_frames=8, num_inference_steps=1), attn_cells=0, lpips=False)
    report = run_evaluation(loaded, settings, str(tmp_path), progress=False)
    assert {tuple(c["frames_shape"][:1]) for c in report["cells"].values()} == {(9,)}
    note = "The pipeline made 9 frames per video (8 asked: its frame counts are stepped)"
    assert sum(n.startswith(note) for n in report["notes"]) == 1 and note in (tmp_path / "report.md").read_text()
    settings = EvalSettings(settings.methods, settings.prompts, [0], dict(CALL, num_inference_steps=1), attn_cells=0,
                            lpips=False)
    assert not any("frames per video" in n for n in run_evaluation(loaded, settings, str(tmp_path / "b"),
                                                                     progress=False)["notes"])


def test_overwrite_removes_the_files_of_the_report_it_replaces(loaded, tmp_path):
    """Review find: after --overwrite (1 prompt) the frames and the side-by-side video of the replaced run's second
    prompt stayed in the folder, beside the new run's, as if they were its own. Files the report never named stay."""
    out = tmp_path / "ev"
    call = dict(CALL, num_inference_steps=1)
    first = EvalSettings(parse_method_specs(["dense", "sol@0.5"]), BUILTIN_PROMPTS[:2], [0], call, attn_cells=0,
                         lpips=False)
    run_evaluation(loaded, first, str(out), progress=False)
    assert len(os.listdir(out / "frames")) == 4 and len(os.listdir(out / "videos")) == 2
    (out / "videos" / "mine.txt").write_text("not the report's")
    second = EvalSettings(first.methods, BUILTIN_PROMPTS[:1], [0], dict(call, guidance_scale=4.0), attn_cells=0,
                          lpips=False)
    report = run_evaluation(loaded, second, str(out), overwrite=True, progress=False)
    assert sorted(os.listdir(out / "frames")) == sorted(os.path.basename(c["frames_file"])
                                                        for c in report["cells"].values())
    assert len(report["cells"]) == 2
    assert sorted(os.listdir(out / "videos")) == ["mine.txt", "prompt00_seed0.mp4"]


def test_removing_a_replaced_reports_files_stays_inside_its_folder(tmp_path):
    """`remove_earlier_outputs` removes what the report names, within the folder only, and keeps what it is told to
    (a synthetic run's dense output, written before the report is replaced); an unreadable report removes nothing."""
    from videosparse.eval.report import remove_earlier_outputs

    out, outside = tmp_path / "out", tmp_path / "outside.txt"
    (out / "plots").mkdir(parents=True)
    for name in ("plots/a.png", "dense_output_wan-1.3b.safetensors", "dense_output_wan-14b.safetensors", "x.txt"):
        (out / name).write_text("x")
    outside.write_text("x")
    (out / "report.json").write_text(json.dumps({"mode": "synthetic", "synthetic": {"wan-1.3b": {}, "wan-14b": {}},
                                                 "artifacts": {"plots": ["plots/a.png", "../outside.txt", "/etc"]}}))
    removed = remove_earlier_outputs(str(out), keep=("dense_output_wan-14b.safetensors",))
    assert sorted(os.path.basename(p) for p in removed) == ["a.png", "dense_output_wan-1.3b.safetensors"]
    assert outside.exists() and sorted(os.listdir(out)) == ["dense_output_wan-14b.safetensors", "plots", "report.json",
                                                            "x.txt"]
    (out / "report.json").write_text("{not json")
    assert remove_earlier_outputs(str(out)) == [] and (out / "x.txt").exists()


def test_warm_up_runs_the_fewest_steps_that_reach_the_sparse_path(loaded, monkeypatch):
    """`generate --compare-dense` warms each arm up on CUDA with as few steps as reach its sparse path: 1, or k + 1
    with k dense steps; sparse kernels run in it, and the pipeline comes back stock."""
    import videosparse
    from videosparse.eval.generate import warm_up
    from videosparse.processors import base, sessions

    pipe, call = loaded.pipe, {**CALL, "prompt": BUILTIN_PROMPTS[0]}
    calls, original = [], base.block_sparse_attention
    monkeypatch.setattr(base, "block_sparse_attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    veda = videosparse.VedaConfig(density=0.5, tiling=(1, 8, 8), block=64, dense_steps=2)
    assert warm_up(pipe, veda, {**call, "num_inference_steps": 4}) == 3 and calls and sessions(pipe) == {}
    calls.clear()       # a call whose every step is dense (2 of 2) never reaches the sparse path: nothing to warm up
    assert warm_up(pipe, veda, call) == 0 and not calls and sessions(pipe) == {}
    assert warm_up(pipe, videosparse.SolConfig(density=0.5, block=64), call) == 1      # 0.2 of 1 step: none dense
    assert warm_up(pipe, None, call) == 1


def test_attention_columns_compare_methods_at_the_steps_all_ran_sparse(loaded, tmp_path):
    """A method with dense steps runs sparse at fewer of the sampled steps (the early ones, where the error is
    largest, drop out): the compared attention columns are means over the steps every method ran sparse; all-step
    means and per-step values stay in the summary, and report.md names the steps."""
    specs = parse_method_specs(["dense", "veda@0.5:block=64:tiling=1x8x8:dense_steps=0",
                                "veda@0.5:block=64:tiling=1x8x8:dense_steps=1"])
    settings = EvalSettings(specs, BUILTIN_PROMPTS[:1], [0], dict(CALL), attn_steps=[0, 1])
    summary = run_evaluation(loaded, settings, str(tmp_path), progress=False)["summary"]
    every, later = summary[specs[1].label], summary[specs[2].label]
    assert every["attn_steps"] == [0, 1] and later["attn_steps"] == [1]
    assert every["attn_common_steps"] == later["attn_common_steps"] == [1]
    assert every["attn_rel_l2_common"] == pytest.approx(every["attn_rel_l2_by_step"]["1"])
    assert every["attn_rel_l2"] == pytest.approx(np.mean(list(every["attn_rel_l2_by_step"].values())))
    assert later["tile_recall_common"] == pytest.approx(later["tile_recall"])
    assert summary["dense"]["attn_rel_l2_common"] is None
    assert "at the steps where every method runs sparse (steps 1;" in open(tmp_path / "report.md").read()


def test_changed_keys_names_keys_of_either_side():
    """Review find: a key only the old run had (e.g. a negative prompt dropped) gave "other settings ()"."""
    from videosparse.eval.report import changed_keys

    old = {"a": 1, "call": {"steps": 2, "negative_prompt": "blurry"}, "gone": 2}
    new = {"a": 1, "call": {"steps": 3}, "new": 3}
    assert changed_keys(old, new) == ["call.steps: 2 -> 3", "call.negative_prompt: blurry -> None", "new: None -> 3",
                                      "gone: 2 -> None"]
    assert changed_keys(None, {"a": 1}) == ["a: None -> 1"] and changed_keys(new, new) == []


def test_reruns_report_only_what_this_run_shows(loaded, tmp_path, monkeypatch):
    """Review finds on reruns into one report: notes of an earlier run stayed (videos not written, when this run
    wrote them); LPIPS averaged the cells that had it while the note said it was skipped; the heatmap plotted
    attention cells of other prompts; a tiling JSON edited at the same path kept its old cells; an --overwrite run
    stopped before its first cell left the old report's cells beside its own frames."""
    import torch

    from videosparse.eval import evaluate as E

    class FakeLPIPS(torch.nn.Module):           # lpips needs its weights from the hub: a stand-in, mean |x - y|
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Parameter(torch.zeros(1))       # where lpips_distance reads the device

        def forward(self, x, y):
            return (x - y).abs().mean((1, 2, 3))

    monkeypatch.setattr(E, "load_lpips", lambda device: (FakeLPIPS(), None))
    out, tiling = str(tmp_path / "eval"), tmp_path / "tiling.json"

    def write(shape):
        tiling.write_text(json.dumps({"format": "videosparse-tiling", "version": 1, "block": 64,
                                      "layers": [[shape] * 2] * 2}))

    def settings(prompts, **kw):
        specs = parse_method_specs(["dense", f"veda@0.5:block=64:tiling={tiling}"])
        return EvalSettings(specs, BUILTIN_PROMPTS[:prompts], [0], dict(CALL), attn_steps=[1], **kw)

    def failing_video(*args, **kwargs):
        raise OSError("no ffmpeg")

    write([1, 8, 8])
    with monkeypatch.context() as m:
        m.setattr(E, "write_video", failing_video)
        first = run_evaluation(loaded, settings(1, attn_cells=1), out, progress=False)
    assert any("videos not written" in n for n in first["notes"])
    second = run_evaluation(loaded, settings(2, attn_cells=0, lpips=False), out, progress=False)
    assert not any("videos not written" in n for n in second["notes"])
    label = next(k for k in second["summary"] if k != "dense")
    row = second["summary"][label]
    assert row["cells"] == 2 and row["lpips"] is None and row["ssim"] is not None     # 1 of 2 cells has LPIPS
    from videosparse.eval.evaluate import Evaluation

    again = Evaluation(loaded, settings(2, attn_cells=0, lpips=False), out, progress=False)
    assert again._summarized_attention() == {}           # the first run's attention cell is not this run's sampling
    write([4, 4, 4])                                     # the same path, another tiling: its cells run again
    third = run_evaluation(loaded, settings(1, attn_cells=0, lpips=False), out, progress=False)
    assert third["run_stats"] == {"computed": 1, "skipped": 1, "attention_computed": 0, "attention_skipped": 0}
    Evaluation(loaded, settings(1, attn_cells=0), out, overwrite=True, progress=False)     # stopped before a cell
    assert json.load(open(os.path.join(out, "report.json")))["cells"] == {}


def test_an_estimator_folder_is_known_by_the_files_it_loads(tmp_path):
    """Review find: the cell id hashed every file of an estimator folder, a distill output with its capture cache of
    many GB among them (read for every cell, and another id whenever a log line was added)."""
    from videosparse.config import VedaConfig
    from videosparse.eval.spec import MethodSpec

    est = tmp_path / "est"
    (est / "cache").mkdir(parents=True)
    (est / "config.json").write_text("{}")
    (est / "model.safetensors").write_bytes(b"weights 1")
    spec = MethodSpec("veda", VedaConfig(estimator=str(est)))
    first = cell_id(spec, "p", 0)
    (est / "cache" / "p00000_s0.safetensors").write_bytes(b"x" * 1000)
    (est / "log.jsonl").write_text("{}\n")
    assert cell_id(spec, "p", 0) == first
    (est / "model.safetensors").write_bytes(b"weights 2!")
    assert cell_id(spec, "p", 0) != first


def _written_into_fifo(tmp_path, write) -> str:
    """What `write(path)` wrote into a FIFO at `path` (opened for reading first, so the write does not wait for a
    reader), after checking the FIFO is still one and no temporary file is left beside it."""
    import stat

    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        write(str(fifo))
        text = os.read(reader, 1 << 16).decode()
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced by a regular file"
    assert os.listdir(tmp_path) == ["out.json"]
    fifo.unlink()
    return text


def test_a_summary_to_dev_stdout_lands_among_the_rest_of_stdout(tmp_path):
    """Review find: `--json /dev/stdout > log.txt` renamed a new file over log.txt (the link's target), so the shell
    went on writing to an unlinked file and log.txt held the JSON alone; written through sys.stdout, it sits between
    what was printed before and after."""
    import subprocess
    import sys

    log = tmp_path / "log.txt"
    code = ("from videosparse._io import write_atomic\nprint('before', flush=True)\n"
            "write_atomic('/dev/stdout', '{\"summary\": 1}\\n')\nprint('after')\n")
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-c", code], stdout=out, check=True,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(__file__)))})
    assert log.read_text() == 'before\n{"summary": 1}\nafter\n'


def test_outputs_that_are_no_regular_file_are_written_into_not_replaced(tmp_path):
    """Review 51 (d06): the atomic writes (temp file + rename) of the report, a tiling and the kernel benchmark's JSON
    put a regular file in place of a FIFO or a device (as root, /dev/null)."""
    from videosparse.eval.kernel_bench import write_json
    from videosparse.eval.report import save_report
    from videosparse.veda.tiling import Tiling

    assert json.loads(_written_into_fifo(tmp_path, lambda p: save_report({"x": math.inf}, p))) == {"x": "inf"}
    tiling = Tiling((((1, 8, 8), (1, 8, 8)),), block=64)
    assert json.loads(_written_into_fifo(tmp_path, tiling.save))["layers"] == [[[1, 8, 8], [1, 8, 8]]]
    assert json.loads(_written_into_fifo(tmp_path, lambda p: write_json(p, {"rows": []}))) == {"rows": []}
    save_report({"x": 1}, str(tmp_path / "r.json"))              # a regular file: temp file + rename, as before
    assert json.loads((tmp_path / "r.json").read_text()) == {"x": 1} and os.listdir(tmp_path) == ["r.json"]
    (tmp_path / "link.json").symlink_to(tmp_path / "r.json")      # a symlink (/dev/stdout) stays one
    save_report({"x": 2}, str(tmp_path / "link.json"))
    assert (tmp_path / "link.json").is_symlink() and json.loads((tmp_path / "r.json").read_text()) == {"x": 2}
    assert sorted(os.listdir(tmp_path)) == ["link.json", "r.json"]


def test_a_report_that_cannot_be_written_leaves_no_temporary_file(tmp_path):
    """Review 51 (d09): a report path that is a folder failed in the rename with report.json.tmp left behind and the
    errno text of the temporary file."""
    from videosparse.eval.report import save_report

    (tmp_path / "report.json").mkdir()
    with pytest.raises(OSError, match=f"{str(tmp_path / 'report.json')!r} could not be written: it is a directory"):
        save_report({"x": 1}, str(tmp_path / "report.json"))
    with pytest.raises(OSError, match="could not be written: No such file or directory"):
        save_report({"x": 1}, str(tmp_path / "none" / "report.json"))
    assert os.listdir(tmp_path) == ["report.json"] and not os.listdir(tmp_path / "report.json")


def test_a_spec_the_pipeline_refuses_is_named_before_any_cell(loaded, tmp_path):
    """Review 51 (d02): `dense_layers` past the model's layers failed at the method's first cell, after the dense
    cell and its report were written."""
    settings = EvalSettings(parse_method_specs(["dense", "veda@0.5:dense_layers=7"]), BUILTIN_PROMPTS[:1], [0],
                            dict(CALL), attn_cells=0)
    with pytest.raises(ValueError, match=r"method spec 'veda@0.5:dense_layers=7': dense_layers=\(7,\) names layers"):
        run_evaluation(loaded, settings, str(tmp_path / "ev"), progress=False)
    assert not (tmp_path / "ev").exists()


def test_an_estimator_given_another_tiling_names_the_specs_key(loaded, tmp_path):
    """Review find: the estimator's tiling hint named generate's flags (--tiling 1x8x8), which evaluate refuses; an
    evaluate spec names the spec's :tiling= key."""
    from videosparse.processors import model_info, model_spec, self_attention_processors
    from videosparse.veda import VedaEstimator

    tr = loaded.pipe.transformer
    info = model_info(tr, model_spec(tr), len(self_attention_processors(tr)))
    VedaEstimator(info.model_class, info.num_layers, info.num_heads, info.head_dim, block=64,
                  tile_shapes=(1, 8, 8)).save_pretrained(tmp_path / "est")
    spec = f"veda@0.5:block=64:tiling=2x4x8:estimator={tmp_path / 'est'}"
    settings = EvalSettings(parse_method_specs(["dense", spec]), BUILTIN_PROMPTS[:1], [0], dict(CALL), attn_cells=0)
    with pytest.raises(ValueError, match=r"\(no :tiling=\).*\(the spec's :tiling=1x8x8\)") as err:
        run_evaluation(loaded, settings, str(tmp_path / "ev"), progress=False)
    assert "--tiling" not in str(err.value)


def test_a_backend_that_cannot_run_here_is_named_before_any_cell(loaded, tmp_path, monkeypatch):
    """Review find: a spec's kernel backend that cannot run the model's attention on the run's device (`triton` on a
    CPU without the interpreter; `hopper` with fp32 on a GPU) failed at the first sparse forward, after the dense cell
    and its report were written, with an error naming no spec."""
    from videosparse.kernels._triton_utils import interpreter_active

    if interpreter_active():
        pytest.skip("under TRITON_INTERPRET=1 the Triton backend runs on the CPU")
    settings = EvalSettings(parse_method_specs(["dense", "veda@0.5:backend=triton"]), BUILTIN_PROMPTS[:1], [0],
                            dict(CALL), attn_cells=0)
    with pytest.raises(ValueError, match=r"method spec 'veda@0.5:backend=triton': backend='triton' cannot run this "
                                         r"transformer's attention \(torch.float32, .* on cpu\)"):
        run_evaluation(loaded, settings, str(tmp_path / "ev"), progress=False)
    assert not (tmp_path / "ev").exists()


def test_damaged_frames_of_a_finished_cell_name_the_file(tmp_path):
    """Fault-injection find: a finished cell's frames damaged after they were written failed with numpy's message
    naming no file; the error names it and says that deleting it computes the cell again."""
    from types import SimpleNamespace

    from videosparse.eval.evaluate import Evaluation

    path = tmp_path / "cell.npy"
    np.save(path, np.zeros((2, 8, 8, 3), np.float16))
    owner = SimpleNamespace(_frames_path=lambda cid: str(path))
    for damaged in (path.read_bytes()[:-100], b""):              # cut short; empty (numpy: EOFError)
        path.write_bytes(damaged)
        with pytest.raises(ValueError, match=f"the frames {path} of a finished cell cannot be read .*delete the file"):
            Evaluation._frames(owner, "cell")


def test_files_are_synced_to_disk_before_the_rename_publishes_them(tmp_path, monkeypatch):
    """A rename alone may reach the disk before the data it publishes (a power loss could leave an empty file under
    the final name); `replace_durably` fsyncs the file, or a folder's files and folders, before the rename, and the
    rename's folder after it. `write_atomic`, checkpoints and the distillation's writes go through it."""
    from videosparse._io import replace_durably, write_atomic
    from videosparse.distill.config import DistillConfig

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                  real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.fspath(b))), real_replace(a, b))[1])
    write_atomic(tmp_path / "r.json", "{}")
    assert events == [("fsync", str(tmp_path / ".r.json.tmp")), ("replace", str(tmp_path / "r.json")),
                      ("fsync", str(tmp_path))]
    events.clear()
    (tmp_path / ".ckpt" / "sub").mkdir(parents=True)
    for name in ("a.safetensors", "sub/b.bin"):
        (tmp_path / ".ckpt" / name).write_bytes(b"x")
    replace_durably(tmp_path / ".ckpt", tmp_path / "ckpt")
    synced = {path for kind, path in events[:-2] if kind == "fsync"}
    assert synced == {str(tmp_path / ".ckpt" / p) for p in ("a.safetensors", "sub/b.bin", "sub", ".")}, events
    assert events[-2:] == [("replace", str(tmp_path / "ckpt")), ("fsync", str(tmp_path))]
    events.clear()
    DistillConfig(model="tiny").save(tmp_path / "distill_config.json")
    assert [kind for kind, _ in events] == ["fsync", "replace", "fsync"]
    # a folder that cannot be opened (writable but not listable; any folder on Windows): its sync is best-effort, so
    # a write that was renamed into place is not reported as failed
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, *a: (_ for _ in ()).throw(PermissionError(13, "denied"))
                        if os.path.isdir(path) else real_open(path, flags, *a))
    write_atomic(tmp_path / "r.json", '{"x": 1}')
    assert (tmp_path / "r.json").read_text() == '{"x": 1}'


def _summarized(times: dict[str, list[tuple[float, float, float]]], work: dict[str, float]) -> dict[str, dict]:
    """`Evaluation.summarize` over hand-made cells: label -> one (wall_s, transformer_total_s, attention_s) per prompt,
    and each method's attention work (no pipeline runs)."""
    from videosparse.eval.evaluate import Evaluation

    specs = parse_method_specs(list(times))
    prompts = [f"prompt {i}" for i in range(len(next(iter(times.values()))))]
    cells = {}
    for spec in specs:
        for prompt, (wall, transformer, attention) in zip(prompts, times[spec.label]):
            cells[cell_id(spec, prompt, 0)] = {
                "wall_s": wall, "transformer_total_s": transformer, "attention_s": attention, "plan_s": 0.1,
                "psnr_db": math.inf if spec.is_dense else 30.0, "ssim": 1.0, "lpips": None,
                "realised_density": None if spec.is_dense else 0.5, "attention_work": work[spec.label]}
    ev = Evaluation.__new__(Evaluation)
    ev.settings = EvalSettings(specs, prompts, [0], {"num_inference_steps": 10}, attn_cells=0)
    ev.report = {"cells": cells, "attention": {}}
    return ev.summarize()


def test_speedups_are_dense_over_method_and_amdahl_uses_the_dense_attention_share():
    """Mutation testing: the speedups were not checked to be dense time / method time, the Amdahl estimate to be
    1 / ((1 - f) + f * work) (1 for dense), nor the dense attention share f to be over transformer (not wall) time."""
    s = _summarized({"dense": [(15.0, 10.0, 4.0)] * 3, "sol@0.5": [(12.0, 8.0, 2.0)] * 3},
                    {"dense": 1.0, "sol@0.5": 0.6})
    dense, sol = s["dense"], s["sol@0.5"]
    assert dense["attention_share"] == pytest.approx(0.4) and sol["attention_share"] == pytest.approx(0.25)
    assert sol["speedup_transformer"] == pytest.approx(10.0 / 8.0) and sol["speedup_e2e"] == pytest.approx(15.0 / 12.0)
    assert sol["speedup_attention"] == pytest.approx(2.0)
    assert dense["speedup_transformer"] == dense["speedup_e2e"] == dense["speedup_attention"] == pytest.approx(1.0)
    assert dense["amdahl_bound"] == pytest.approx(1.0)
    assert sol["amdahl_bound"] == pytest.approx(1.0 / (0.6 + 0.4 * 0.6))                     # 1.19x
    assert dense["amdahl_bound_free_attention"] == sol["amdahl_bound_free_attention"] == pytest.approx(1.0 / 0.6)


def test_summary_times_are_medians_over_the_cells():
    """Mutation testing: every test had at most 2 cells per method, where median and mean agree; one slow dense cell
    of three (16 s against 10 s) must not move the transformer time, the speedup or the attention share."""
    s = _summarized({"dense": [(15.0, 10.0, 4.0), (15.0, 10.0, 4.0), (30.0, 16.0, 10.0)],
                     "sol@0.5": [(12.0, 8.0, 2.0), (13.0, 8.0, 2.0), (12.0, 14.0, 2.0)]},
                    {"dense": 1.0, "sol@0.5": 0.6})
    dense, sol = s["dense"], s["sol@0.5"]
    assert (dense["wall_s"], dense["transformer_s"], dense["attention_s"]) == (15.0, 10.0, 4.0)
    assert (sol["wall_s"], sol["transformer_s"], sol["attention_s"]) == (12.0, 8.0, 2.0)
    assert sol["speedup_transformer"] == pytest.approx(1.25) and dense["attention_share"] == pytest.approx(0.4)
    assert dense["transformer_s_range"] == [10.0, 16.0]


def test_work_fraction_counts_dense_calls_and_weighs_densities_by_sparse_calls():
    """Mutation testing: the attention work (what Amdahl and `generate` use) left out dense-scheduled calls, and the
    realised density of two transformers (Wan 2.2's experts) was their plain mean, not weighted by sparse calls."""
    from videosparse.eval.generate import work_fraction

    # 16 sparse calls at 0.25 and 4 dense-scheduled ones: density 0.25, work (4 + 16 * 0.25) / 20
    assert work_fraction({"transformer": {"density": 0.25, "sparse_calls": 16, "dense_calls": 4}}) == \
        pytest.approx((0.25, 0.4))
    two = {"transformer": {"density": 0.2, "sparse_calls": 30, "dense_calls": 0},
           "transformer_2": {"density": 0.6, "sparse_calls": 10, "dense_calls": 10}}
    density, work = work_fraction(two)
    assert density == pytest.approx((0.2 * 30 + 0.6 * 10) / 40)                     # 0.3, not 0.4
    assert work == pytest.approx((10 + 0.2 * 30 + 0.6 * 10) / 50)
    assert work_fraction(None) == (None, 1.0)


def test_a_cells_ssim_is_the_mean_over_its_frames(monkeypatch):
    """Mutation testing: the cell's SSIM as the median over frames hides frames that broke (2 of 5 here)."""
    from types import SimpleNamespace

    from videosparse.eval import evaluate
    from videosparse.eval.evaluate import Evaluation

    monkeypatch.setattr(evaluate, "ssim_per_frame", lambda a, b: [1.0, 1.0, 1.0, 0.5, 0.25])
    ev = Evaluation.__new__(Evaluation)
    ev._lpips, ev._lpips_note, ev.settings = None, None, SimpleNamespace(lpips=False)
    video = np.full((5, 16, 16, 3), 0.5, np.float32)
    quality = ev._quality(video, video)
    assert quality["ssim"] == pytest.approx(0.75) and quality["ssim_per_frame"] == [1.0, 1.0, 1.0, 0.5, 0.25]


def test_report_md_shows_the_common_step_attention_means_and_the_dense_share_in_percent():
    """Mutation testing: report.md's attn rel L2 and tile recall columns must be the means at the common steps that
    their caption names (not the all-steps means), and the dense attention share a percentage (40.0%, not 0.4%)."""
    from videosparse.eval.report import render_markdown

    summary = {"dense": {"attention_share": 0.4, "amdahl_bound_free_attention": 1.0 / 0.6},
               "sol@0.5": {"attn_rel_l2": 0.30, "attn_rel_l2_common": 0.12, "tile_recall": 0.6,
                           "tile_recall_common": 0.8, "attn_common_steps": [4, 9], "attn_steps": [0, 4, 9]}}
    md = render_markdown({"summary": summary})
    cells = [c.strip() for c in next(line for line in md.splitlines() if line.startswith("| `sol@0.5` |")).split("|")]
    assert "0.1200" in cells and "0.800" in cells and "0.3000" not in cells and "0.600" not in cells, cells
    assert "Dense attention is 40.0% of transformer time: with attention free the transformer could run at most " \
           "1.67x faster" in md
