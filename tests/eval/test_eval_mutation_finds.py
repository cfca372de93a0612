"""Mutation finds over the evaluation (`eval/evaluate.py`, `eval/report.py`, `eval/metrics.py`): behaviour no test
pinned down, each checked on constructed inputs with known values (no pipeline runs)."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from videosparse.eval import evaluate
from videosparse.eval.evaluate import EvalSettings, Evaluation, cell_id
from videosparse.eval.metrics import dense_attention_tile_mass, lpips_distance, psnr_video
from videosparse.eval.report import calls_per_forward, load_report, render_markdown, timing_environment
from videosparse.eval.spec import MethodSpec, parse_method_specs


def _summary(cells: dict[str, list[dict]], attention: dict[str, list[dict]] | None = None) -> dict[str, dict]:
    """`Evaluation.summarize` over hand-made cells: label -> one dict of cell fields per prompt, and optionally label
    -> the attention probe's entries of its first cell at steps 0 and 1 (no pipeline runs)."""
    specs = parse_method_specs(list(cells))
    prompts = [f"prompt {i}" for i in range(len(next(iter(cells.values()))))]
    report = {"cells": {}, "attention": {}}
    for spec in specs:
        for prompt, fields in zip(prompts, cells[spec.label]):
            report["cells"][cell_id(spec, prompt, 0)] = {
                "wall_s": 15.0, "transformer_total_s": 10.0, "attention_s": 4.0, "plan_s": 0.1,
                "psnr_db": math.inf if spec.is_dense else 30.0, "ssim": 1.0, "lpips": None,
                "realised_density": None if spec.is_dense else 0.5, "attention_work": 1.0 if spec.is_dense else 0.5,
                **fields}
    for label, entries in (attention or {}).items():
        spec = next(s for s in specs if s.label == label)
        report["attention"][cell_id(spec, prompts[0], 0)] = {"method": label, "steps": [0, 1], "layers": None,
                                                             "entries": {"transformer": entries}}
    ev = Evaluation.__new__(Evaluation)
    ev.settings = EvalSettings(specs, prompts, [0], {"num_inference_steps": 10}, attn_cells=1 if attention else 0,
                               attn_steps=[0, 1] if attention else None)
    ev.report = report
    return ev.summarize()


def _row(md: str, header_start: str, label: str) -> dict[str, str]:
    """The row of `label` in the markdown table whose header starts with `header_start`, as {column: cell}."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    row = next(line for line in lines[start + 2:] if line.startswith(f"| `{label}` |"))
    return dict(zip(header, (c.strip() for c in row.strip("|").split("|"))))


# --------------------------------------------------------------------------------------------------- metrics
def test_channels_first_frames_are_refused():
    """Mutation find: frames given channels first ([F, C, H, W], torch's layout) must be refused, not read as
    [F, H, W, C] with H-wide "channels" (a mutant that dropped the channel check scored them without a word)."""
    video = np.full((2, 3, 16, 16), 0.5, np.float32)
    with pytest.raises(ValueError, match=r"frames must be \[F, H, W, C\] with C in \(1, 3\); got \(2, 3, 16, 16\)"):
        psnr_video(video, video)


def test_lpips_is_the_mean_over_frames_across_batches():
    """Mutation find: with more frames than `batch` the LPIPS value must be the mean over every frame, not the mean of
    the batches' means (10 frames in batches of 4, 4 and 2 weigh the last two frames double then)."""
    seen = []

    class Stub(torch.nn.Module):                # distance of frame i: its constant offset, i / 10
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x, y):
            seen.append(x.shape[0])
            return ((x - y) / 2).mean((1, 2, 3))

    reference = np.zeros((10, 8, 8, 3))
    video = reference + np.arange(10)[:, None, None, None] / 10
    assert lpips_distance(Stub(), video, reference, batch=4) == pytest.approx(0.45, abs=1e-6)
    assert seen == [4, 4, 2]


def test_tile_mass_with_more_keys_than_queries():
    """Mutation find: `dense_attention_tile_mass` takes keys of another length than the queries ([B, H, Sk, D]); every
    test had Sk == S, so padding the key tiles by S instead of Sk went unnoticed (it fails for Sk != S)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 150, 16), torch.randn(1, 2, 150, 16)
    out, mass = dense_attention_tile_mass(q, k, v, 64, 32)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)
    assert mass.shape == (1, 2, 2, 5)                       # 2 query tiles of 64, 5 key tiles of 32
    torch.testing.assert_close(mass.sum(-1), torch.tensor([64.0, 36.0]).expand(1, 2, 2), atol=1e-4, rtol=1e-5)
    p = torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1)
    torch.testing.assert_close(mass[..., 1, 4], p[:, :, 64:, 128:].sum((-1, -2)), atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------------------------------- settings
def test_eval_settings_refuse_a_grid_without_dense_first_repeated_labels_or_no_steps():
    """Mutation finds: `EvalSettings` must refuse a grid not led by dense (every method is compared with the first),
    two methods under one label (their rows would merge) and a call of 0 denoising steps; only repeated seeds were
    tested."""
    dense, sol = parse_method_specs(["dense", "sol@0.5"])
    call = {"num_inference_steps": 2}
    with pytest.raises(ValueError, match="methods must start with dense"):
        EvalSettings([sol, dense], ["p"], [0], call)
    with pytest.raises(ValueError, match=r"method labels must be unique; got \['dense', 'sol@0.5', 'sol@0.5'\]"):
        EvalSettings([dense, sol, sol], ["p"], [0], call)
    with pytest.raises(ValueError, match=r"call\['num_inference_steps'\]=0 must be a positive int"):
        EvalSettings([dense, sol], ["p"], [0], {"num_inference_steps": 0})
    assert EvalSettings([dense, sol], ["p"], [0], {"num_inference_steps": 1}).call == {"num_inference_steps": 1}


def test_load_prompts_takes_the_first_n_and_refuses_none_left():
    """Mutation find: `load_prompts(path, limit)` cuts to the first `limit` prompts; a limit of 0 leaves none and is
    refused (a mutant reading `if limit:` returned every prompt; the CLI refuses --num-prompts 0 before it)."""
    assert evaluate.load_prompts(None, 2) == evaluate.BUILTIN_PROMPTS[:2]
    assert evaluate.load_prompts('["a cat", "a dog"]') == ["a cat", "a dog"]
    with pytest.raises(ValueError, match="no prompts"):
        evaluate.load_prompts(None, 0)


def test_default_attention_steps_are_three_spread_over_the_whole_run():
    """Mutation find: without --attn-steps the attention pass samples 3 steps spread from the first to the last step
    of the run (every test ran 1 or 2 steps, where any spread gives the same steps); the pairs are the first
    `attn_cells` (prompt, seed) cells."""
    specs = parse_method_specs(["dense", "sol@0.5"])
    settings = EvalSettings(specs, ["a", "b"], [0, 1], {"num_inference_steps": 10}, attn_cells=3)
    pairs, steps, layers = settings.attention_sampling()
    assert pairs == [(0, 0), (0, 1), (1, 0)] and layers is None
    assert len(steps) == 3 and steps[0] == 0 and steps[-1] == 9 and 0 < steps[1] < 9


def test_an_attention_step_equal_to_the_step_count_is_refused():
    """Mutation find: --attn-steps counts from 0, so with 2 denoising steps step 2 does not exist and is refused before
    any work (only a step far past the end was tested)."""
    owner = SimpleNamespace(settings=EvalSettings(parse_method_specs(["dense", "sol@0.5"]), ["p"], [0],
                                                  {"num_inference_steps": 2}, attn_steps=[1, 2]))
    with pytest.raises(ValueError, match=r"--attn-steps \[2\]: the run has 2 denoising steps \(0\.\.1\)"):
        Evaluation._check_attention_sampling(owner)


def test_cell_ids_tell_seeds_prompts_and_configs_apart_but_not_labels():
    """Mutation find: every test ran one seed, so a cell id that left out the seed went unnoticed (the cells of seed 1
    would be skipped as done, holding seed 0's frames); the same config under another label is the same cell."""
    _, sol, other = parse_method_specs(["dense", "sol@0.5", "sol@0.25"])
    first = cell_id(sol, "a cat", 0)
    assert len({first, cell_id(sol, "a cat", 1), cell_id(sol, "a dog", 0), cell_id(other, "a cat", 0)}) == 4
    assert cell_id(parse_method_specs(["sol@0.5"])[-1], "a cat", 0) == first
    assert cell_id(MethodSpec("mine", sol.config), "a cat", 0) == first


# -------------------------------------------------------------------------------------------------- cells
def test_a_cells_psnr_pools_the_error_over_its_frames():
    """Mutation find: a cell's `psnr_db` is the PSNR of the MSE pooled over its frames, so one frame identical to
    dense does not make it inf (the mean of the per-frame PSNRs would); the per-frame values are kept beside it."""
    ev = Evaluation.__new__(Evaluation)
    ev._lpips, ev._lpips_note, ev.settings = None, None, SimpleNamespace(lpips=False)
    reference = np.full((3, 16, 16, 3), 0.5, np.float32)
    frames = reference.copy()
    frames[1:] += 0.1                                       # frame 0 identical: pooled MSE 2/3 * 0.01
    quality = ev._quality(frames, reference)
    assert quality["psnr_db"] == pytest.approx(10 * math.log10(1 / (0.01 * 2 / 3)), abs=1e-3)
    assert math.isinf(quality["psnr_per_frame"][0]) and quality["psnr_per_frame"][1] == pytest.approx(20.0, abs=1e-3)


def test_layer_densities_are_in_layer_order_past_ten_layers():
    """Mutation find: the per-layer densities (report.json's `layer_density`, the heatmap's rows) must follow the layer
    numbers; sorted as strings, layer 10 came before layer 2 (the tiny test model has 2 layers)."""
    layers = {str(i): {"density": i / 100} for i in range(12)}
    assert evaluate._layer_densities({"transformer": {"layers": layers}}) == \
        {"transformer": [i / 100 for i in range(12)]}


def test_warm_up_runs_once_per_method_before_its_first_cell(monkeypatch):
    """Mutation find: the warm-up is one untimed generation per method, before its first timed cell, not one before
    every cell (which doubles the run's time); the cells are faked."""
    specs = parse_method_specs(["dense", "sol@0.5"])
    ev = Evaluation.__new__(Evaluation)
    ev.settings = EvalSettings(specs, ["a", "b"], [0, 1], {"num_inference_steps": 2}, warmup=True, attn_cells=0)
    ev.report, ev.progress, ev.computed, ev.skipped = {"cells": {}}, False, 0, 0
    events = []
    ev._done = lambda cid: False
    ev._save = lambda: None
    ev._warmup = lambda spec: events.append(("warm-up", spec.label))
    ev._run_cell = lambda spec, p, seed, dense_id: events.append((spec.label, p, seed)) or {}
    ev.run_cells()
    assert events == [("warm-up", "dense"), ("dense", 0, 0), ("warm-up", "sol@0.5"), ("sol@0.5", 0, 0),
                      ("dense", 0, 1), ("sol@0.5", 0, 1), ("dense", 1, 0), ("sol@0.5", 1, 0), ("dense", 1, 1),
                      ("sol@0.5", 1, 1)]
    assert ev.computed == 8


def test_an_attention_cell_of_other_layers_is_measured_again(monkeypatch):
    """Mutation find: an attention cell is done only for the same sampled steps and layers; a rerun with other
    --attn-layers (same steps) must measure it again, not keep the other layers' samples (only steps were tested)."""
    specs = parse_method_specs(["dense", "sol@0.5"])
    ev = Evaluation.__new__(Evaluation)
    ev.settings = EvalSettings(specs, ["p"], [0], {"num_inference_steps": 2}, attn_steps=[1], attn_layers=[1])
    cid = cell_id(specs[1], "p", 0)
    ev.report = {"attention": {cid: {"method": "sol@0.5", "steps": [1], "layers": [0], "entries": {}}}}
    ev.progress, ev.pipe, ev.device, ev.attention_computed, ev.attention_skipped = False, None, "cpu", 0, 0
    ev._save = lambda: None
    runs = []
    monkeypatch.setattr(evaluate, "generate", lambda pipe, config, call, **kw: runs.append(call["prompt"]))
    ev.run_attention()
    assert runs == ["p"] and (ev.attention_computed, ev.attention_skipped) == (1, 0)
    assert ev.report["attention"][cid]["layers"] == [1]
    ev.run_attention()                                       # now the cell is this sampling's: skipped
    assert runs == ["p"] and ev.attention_skipped == 1


# -------------------------------------------------------------------------------------------------- summary
def test_summary_rows_of_three_cells():
    """Mutation finds on `summarize` over three cells per method: the transformer time range is the min and max (not
    the first and last cell's), a layer's density is the mean over cells (not the median), the highest finite cell
    PSNR leaves out cells identical to dense (inf), and dense's realised density is 1."""
    s = _summary({"dense": [{}, {}, {}],
                  "sol@0.5": [{"transformer_total_s": 12.0, "psnr_db": 30.0, "layer_density": {"transformer": [0.2]}},
                              {"transformer_total_s": 16.0, "psnr_db": math.inf,
                               "layer_density": {"transformer": [0.3]}},
                              {"transformer_total_s": 10.0, "psnr_db": 24.0, "layer_density": {"transformer": [0.7]}}]})
    dense, sol = s["dense"], s["sol@0.5"]
    assert sol["transformer_s_range"] == [10.0, 16.0]
    assert sol["layer_density"]["transformer"] == [pytest.approx(0.4)]
    assert sol["psnr_db_cell_max"] == 30.0 and sol["cells_equal_to_dense"] == 1 and sol["psnr_db"] == 27.0
    assert dense["realised_density"] == 1.0 and dense["psnr_db_cell_max"] is None


def test_an_attention_share_of_one_keeps_the_amdahl_figures_finite():
    """Mutation find: dense attention timed at the whole transformer time (f = 1, timer overhead on a tiny model) must
    not divide by zero in the attention-free bound; f is capped just below 1."""
    s = _summary({"dense": [{"attention_s": 10.0}], "sol@0.5": [{"attention_s": 5.0}]})
    assert s["dense"]["attention_share"] == 1.0
    assert math.isfinite(s["dense"]["amdahl_bound_free_attention"]) and s["dense"]["amdahl_bound_free_attention"] > 1e5
    assert s["sol@0.5"]["amdahl_bound"] == pytest.approx(2.0, rel=1e-4)           # 1 / work


def test_notes_on_spread_times_and_on_a_pulled_up_mean_psnr_at_their_thresholds():
    """Mutation finds: a method's cells spread in transformer time by more than 1.5x get a note (1.6x here; the test had
    7x), and the mean-over-cells PSNR note needs the mean more than 3 dB above the pooled PSNR (2 dB: none; 4 dB:
    one) with a cell above 60 dB."""
    notes = evaluate.timing_spread_notes({"sol@0.5": {"transformer_s_range": [10.0, 16.0]},
                                          "veda@0.5": {"transformer_s_range": [10.0, 14.0]}})
    assert len(notes) == 1 and notes[0].startswith("sol@0.5: its cells' transformer times spread from 10 to 16 s")
    row = {"psnr_db_cell_max": 70.0, "psnr_db_pooled": 24.0}
    assert evaluate.psnr_notes({"sol@0.5": {**row, "psnr_db": 26.0}}) == []
    (note,) = evaluate.psnr_notes({"sol@0.5": {**row, "psnr_db": 28.0}})
    assert note.startswith("sol@0.5: its mean PSNR over cells (28.00 dB) is pulled up")


# -------------------------------------------------------------------------------------------------- report
def test_report_md_quality_and_speed_columns_hold_their_own_numbers():
    """Mutation finds: report.md's columns were checked by label only; each number must sit under its own header
    (mass kept vs oracle mass, pooled vs mean PSNR, e2e vs attention speedup) with SSIM to 4 digits."""
    summary = {"sol@0.5": {"psnr_db": 31.5, "psnr_db_pooled": 29.25, "ssim": 0.91234, "mass_kept": 0.7,
                           "oracle_mass_kept": 0.9, "speedup_e2e": 1.1, "speedup_attention": 3.0,
                           "speedup_transformer": 1.5, "wall_s": 12.0, "transformer_s": 8.0}}
    md = render_markdown({"summary": summary})
    quality = _row(md, "| method | density |", "sol@0.5")
    assert (quality["PSNR dB"], quality["pooled PSNR"], quality["SSIM"]) == ("31.50", "29.25", "0.9123")
    assert (quality["mass kept"], quality["oracle mass"]) == ("0.700", "0.900")
    speed = _row(md, "| method | e2e s |", "sol@0.5")
    assert (speed["e2e s"], speed["transformer s"]) == ("12.00", "8.000")
    assert (speed["e2e speedup"], speed["attention speedup"], speed["transformer speedup"]) == \
        ("1.10x", "3.00x", "1.50x")


def test_report_md_lists_artifacts_notes_and_the_gpu():
    """Mutation finds: an artifact given as one path (report_md) is listed whole, not letter by letter; a report with
    a single note has its Notes section; the environment line names the GPU."""
    report = {"environment": {"device": "cuda:0", "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.5.0"},
              "summary": {}, "notes": ["Run on CPU: times say nothing about GPU speed."],
              "artifacts": {"videos": ["videos/prompt00_seed0.mp4"], "report_md": "report.md"}}
    md = render_markdown(report)
    assert "**Environment:** device cuda:0, gpu NVIDIA H100 80GB HBM3, torch 2.5.0" in md
    assert "- videos: `videos/prompt00_seed0.mp4`\n- report_md: `report.md`\n" in md
    assert "## Notes\n\n- Run on CPU: times say nothing about GPU speed.\n" in md


def test_timing_environment_holds_what_times_depend_on():
    """Mutation find: a rerun keeps earlier cells only when their times were taken with the same versions, device and
    thread count; `timing_environment` must carry the torch version (only the thread count was tested)."""
    env = timing_environment("cpu")
    assert env["torch"] == torch.__version__ and env["device"] == "cpu"
    assert env["cpu_threads"] == torch.get_num_threads() and "videosparse" in env
    assert "platform" not in env and "numpy" not in env


def test_a_damaged_or_foreign_report_json_is_named(tmp_path):
    """Mutation finds: a report.json cut short names the file and the way out (not json's bare error); JSON that is no
    object is refused; an absent file is no report."""
    path = tmp_path / "report.json"
    assert load_report(str(path)) is None
    path.write_text('{"cells": {')
    with pytest.raises(ValueError, match=r"report.json is not valid JSON .*move it away \(or, for a quality run, pass "
                                         r"--overwrite\)"):
        load_report(str(path))
    for value, kind in ((3, "int"), ("x", "str"), ([1], "list")):
        path.write_text(json.dumps(value))
        with pytest.raises(ValueError, match=f"holds a JSON {kind}, not a videosparse report"):
            load_report(str(path))
    path.write_text('{"psnr": "inf"}')
    assert load_report(str(path)) == {"psnr": math.inf}


def test_calls_per_forward_of_an_old_report_keeps_sparse_before_dense():
    """Mutation find: a report written before the forwards were counted shows its call totals as sparse/dense, the
    order of the column's header, as the per-forward form does."""
    assert calls_per_forward({"sparse_calls": 8, "dense_calls": 2}) == "8/2 (all forwards)"
    assert calls_per_forward({"sparse_calls": 8, "dense_calls": 2, "calls_counted_forwards": 2}) == "4/1"


def test_attention_columns_average_only_the_calls_run_sparse():
    """Mutation find: the attention-level means (rel L2, recall, mass kept) are over the sampled calls the method ran
    sparse; a dense-scheduled call (a dense layer: error 0, recall 1) averaged in would flatter the method."""
    def entry(step, layer, sparse, rel_l2, recall):
        return {"step": step, "layer": layer, "sparse": sparse, "rel_l2": rel_l2, "recall": recall,
                "mass_kept": 0.8 if sparse else 1.0, "oracle_mass_kept": 0.9 if sparse else 1.0}

    entries = [entry(0, 0, True, 0.3, 0.5), entry(0, 1, False, 0.0, 1.0), entry(1, 0, True, 0.1, 0.7),
               entry(1, 1, False, 0.0, 1.0)]
    sol = _summary({"dense": [{}], "sol@0.5": [{}]}, {"sol@0.5": entries})["sol@0.5"]
    assert sol["attention_samples"] == 2 and sol["attn_steps"] == [0, 1]
    assert sol["attn_rel_l2"] == pytest.approx(0.2) and sol["tile_recall"] == pytest.approx(0.6)
    assert sol["mass_kept"] == pytest.approx(0.8) and sol["attn_rel_l2_by_step"] == {"0": 0.3, "1": 0.1}


def test_report_md_names_the_run_it_measured():
    """Mutation finds: report.md's model line gives the frame size as height x width (as the pipeline call takes them)
    and counts the prompts, not the seeds."""
    report = {"model": {"name": "wan-1.3b", "transformer_class": "WanTransformer3DModel", "dtype": "torch.bfloat16"},
              "settings": {"call": {"num_frames": 81, "height": 480, "width": 832, "num_inference_steps": 50,
                                    "guidance_scale": 5.0}, "prompts": ["a", "b", "c"], "seeds": [0]},
              "summary": {}}
    md = render_markdown(report)
    assert "**Model:** wan-1.3b (WanTransformer3DModel, torch.bfloat16); 81 frames 480x832, 50 steps, guidance " \
           "5.0;" in md
    assert "**Prompts:** 3; **seeds:** [0]." in md


def test_a_rerun_with_another_model_dtype_or_mode_refuses_the_directory(tmp_path):
    """Mutation finds: cells join an earlier report only when made by the same model in the same dtype (only the call
    steps, warm-up and thread count were tested), and a directory holding a synthetic report is named as such."""
    from videosparse.models.loading import LoadedPipeline
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    pipe = build_tiny_wan_pipeline()
    settings = EvalSettings(parse_method_specs(["dense"]), ["p"], [0], {"num_inference_steps": 1}, attn_cells=0)
    Evaluation(LoadedPipeline(pipe, "tiny-a", {}), settings, str(tmp_path), progress=False)._save()
    with pytest.raises(ValueError, match=r"made with other settings \(model: tiny-a -> tiny-b\)"):
        Evaluation(LoadedPipeline(pipe, "tiny-b", {}), settings, str(tmp_path), progress=False)
    pipe.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"made with other settings \(dtype: torch.float32 -> torch.bfloat16\)"):
        Evaluation(LoadedPipeline(pipe, "tiny-a", {}), settings, str(tmp_path), progress=False)
    (tmp_path / "report.json").write_text(json.dumps({"format": 1, "mode": "synthetic", "synthetic": {}}))
    with pytest.raises(ValueError, match="holds a synthetic report; write this quality run to another directory"):
        Evaluation(LoadedPipeline(pipe, "tiny-a", {}), settings, str(tmp_path), progress=False)


def test_synthetic_report_md_columns_hold_their_own_numbers():
    """Mutation find: the synthetic table's speedup, Amdahl estimate and attention speedup columns were checked by
    header only; each number must sit under its own header."""
    methods = {"sol@0.5": {"realised_density": 0.5, "forward_s": 0.8, "attention_s": 0.3, "speedup": 1.25,
                           "amdahl_bound": 1.6, "speedup_attention": 2.5, "sparse_calls": 4, "dense_calls": 0,
                           "calls_counted_forwards": 2, "output_rel_l2_vs_dense": 0.05}}
    md = render_markdown({"mode": "synthetic", "synthetic": {"wan": {"methods": methods, "dense_attention_share": 0.5,
                                                                     "amdahl_bound_free_attention": 2.0}}})
    row = _row(md, "| method | realised density |", "sol@0.5")
    assert (row["speedup"], row["Amdahl est."], row["attention speedup"]) == ("1.25x", "1.60x", "2.50x")
    assert (row["forward s"], row["sparse/dense calls per forward"], row["output rel L2"]) == ("0.800", "2/0", "0.0500")
