"""Tests from a mutation pass over `videosparse/cli/` (each one failed on a mutant the other tests let through)."""

import logging
import os

import numpy as np
import pytest

from videosparse.cli import build_parser, main
from videosparse.cli.common import method_config
from videosparse.config import SolConfig, VedaConfig


class _Loaded(Exception):
    """Raised by a stand-in `load_pipeline`: the arguments passed every check before the load."""


@pytest.fixture
def no_load(monkeypatch):
    from videosparse.models import loading

    def load(*args, **kwargs):
        raise _Loaded

    monkeypatch.setattr(loading, "load_pipeline", load)


def _config(*argv):
    return method_config(build_parser().parse_args(["generate", *argv]))


def test_verbose_sets_the_info_level_and_its_absence_the_warning_level(monkeypatch):
    """Mutation find: -v must log INFO messages (basicConfig at INFO), without it WARNING; under pytest the root
    logger already has handlers, so nothing else showed a -v that set WARNING."""
    levels = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: levels.append(kw["level"]))
    for argv in (["-v", "generate", "--steps", "0"], ["generate", "-v", "--steps", "0"], ["generate", "--steps", "0"]):
        assert main(argv) == 2, argv
    assert levels == [logging.INFO, logging.INFO, logging.WARNING]


def test_sol_takes_block_and_tau_keeps_the_other_flags():
    """Mutation find: --block is a Sol flag too (a mutant refused it for sol), and --tau builds a SolConfig with the
    tile, block, correction and schedule flags given (a mutant dropped them all on the tau path)."""
    assert _config("--method", "sol", "--block", "64", "--tiling", "1x4x16") == SolConfig(density=0.15, block=64,
                                                                                          tiling=(1, 4, 16))
    assert _config("--method", "sol", "--tau", "1.5", "--block", "64", "--tiling", "1x4x16", "--no-correction",
                   "--dense-steps", "2", "--dense-layers", "1", "--backend", "reference") == SolConfig(
        tau=1.5, block=64, tiling=(1, 4, 16), correction=False, dense_steps=2, dense_layers=(1,), backend="reference")


def test_veda_takes_the_correction_flag():
    """Mutation find: --correction (zero-order correction, default off for veda) applies to veda too; a mutant that
    took it for sol only refused `--method veda --correction`."""
    assert _config("--correction") == VedaConfig(density=0.1, correction=True)
    assert _config("--method", "veda", "--no-correction") == VedaConfig(density=0.1, correction=False)


def test_model_names_reference_and_tiny_pass_even_with_a_file_of_that_name_here(tmp_path, monkeypatch):
    """Mutation find: 'tiny' and 'reference' name the shipped models whatever is in the working directory; with
    'tiny' dropped from the names check_model took it for a file here and refused it."""
    from videosparse.cli.common import check_model

    monkeypatch.chdir(tmp_path)
    for name in ("tiny", "reference"):
        (tmp_path / name).write_text("")
        check_model(name)
    (tmp_path / "other").write_text("")
    with pytest.raises(ValueError, match="'other' looks like a local directory, but it is a file"):
        check_model("other")


def test_a_model_directory_under_home_passes_the_model_check(tmp_path, monkeypatch):
    """Mutation find: `--model ~/wan` naming an existing folder must pass (the ~ expanded); a mutant that looked for
    a folder literally named '~/wan' refused it as missing."""
    from videosparse.cli.common import check_model

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "wan").mkdir()
    check_model("~/wan")
    with pytest.raises(ValueError, match="does not exist"):
        check_model("~/no-such-wan")


def test_number_flags_take_a_plus_sign_as_an_int(tmp_path):
    """Mutation find: a config flag's number in Python's spelling is tried as an int before a float, so
    `--max-steps +5` is the int 5 (tried as a float first it was 5.0, refused: 'must be an int >= 1')."""
    from videosparse.cli.config_args import config_from_namespace
    from videosparse.distill import DistillConfig

    cfg = config_from_namespace(build_parser().parse_args(["distill", "--max-steps", "+5", "--epochs", "+2",
                                                           "--learning-rate", "+1e-3"]), DistillConfig)
    assert (cfg.max_steps, cfg.epochs, cfg.learning_rate) == (5, 2, 1e-3) and type(cfg.max_steps) is int


@pytest.mark.parametrize("flag", ["--steps", "--frames", "--height", "--width"])
def test_generate_refuses_a_zero_size_or_step_count(flag, capsys, no_load):
    """Mutation find: --steps / --frames / --height / --width 0 must be refused as not positive before the load (a
    check of `< 0` let 0 through to the pipeline)."""
    assert main(["generate", flag, "0"]) == 2
    assert f"{flag}=0 must be a positive integer" in capsys.readouterr().err


def test_generate_takes_the_bounds_and_any_case_of_a_video_suffix(tmp_path, no_load):
    """Mutation finds: --fps 1 is in range (a mutant took 2 as the lowest), and --out's suffix is matched in any case
    (a mutant refused V.MP4 as having no video extension)."""
    for argv in (["--fps", "1"], ["--out", str(tmp_path / "V.MP4")], ["--out", str(tmp_path / "v.Mkv")]):
        with pytest.raises(_Loaded):
            main(["generate", *argv])


def test_generate_refuses_a_json_summary_that_is_the_video_by_another_spelling(tmp_path, capsys, monkeypatch,
                                                                             no_load):
    """Mutation find: --json and --out are compared as resolved paths: `--out v.mp4 --json ./v.mp4` (or the absolute
    path) would write the summary over the video; a mutant comparing the strings let it through."""
    monkeypatch.chdir(tmp_path)
    for json_path in ("./v.mp4", str(tmp_path / "v.mp4"), "sub/../v.mp4"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        assert main(["generate", "--out", "v.mp4", "--json", json_path]) == 2, json_path
        assert "is the --out video's path" in capsys.readouterr().err


def test_an_image_to_video_pipeline_with_an_optional_image_runs_without_one():
    """Mutation find: --image is required only where the pipeline's `image` has no default; a pipeline whose image is
    optional runs without one (a mutant demanded it), and one that requires it names the flag."""
    from videosparse.cli.generate import _image_input

    class OptionalImage:
        def __call__(self, prompt=None, image=None):
            pass

    class RequiredImage:
        def __call__(self, image, prompt=None):
            pass

    assert _image_input(OptionalImage(), None) is None
    assert _image_input(OptionalImage(), "frame") == "frame"
    with pytest.raises(ValueError, match="RequiredImage is image-to-video: pass --image PATH"):
        _image_input(RequiredImage(), None)


def test_compare_dense_notes_a_slower_sparse_arm_by_the_speedup_it_prints(tmp_path, capsys, monkeypatch):
    """Mutation find: the 'slower than dense' note is judged on the speedup as printed (0.996 reads 1.00x: no note);
    a mutant that judged the unrounded value printed '1.00x' and then called the sparse arm slower."""
    from videosparse.eval import generate as generate_module
    from videosparse.eval.generate import GenerationResult

    frames = np.random.default_rng(0).uniform(0.2, 0.8, (5, 32, 32, 3)).astype(np.float32)
    stats = {"transformer": {"density": 0.5, "sparse_calls": 4, "dense_calls": 0, "kernel_backend": "reference"}}
    for dense_s, speedup, noted in ((0.0996, "1.00x", False), (0.05, "0.50x", True)):
        def fake_generate(pipe, config, call, seed=0, device=None, output_type="np", dense_s=dense_s):
            if config is None:
                return GenerationResult(frames, [dense_s] * 4, 2.0, None)
            return GenerationResult(frames, [0.1] * 4, 2.0, stats)

        monkeypatch.setattr(generate_module, "generate", fake_generate)
        assert main(["generate", "--frames", "5", "--height", "32", "--width", "32", "--steps", "2",
                     "--out", str(tmp_path / "v.mp4"), "--compare-dense"]) == 0
        out = capsys.readouterr().out
        assert f"speedup {speedup}" in out and ("sparse attention was slower than dense" in out) is noted, out


def test_evaluate_refuses_zero_prompts_and_takes_the_fps_bound(tmp_path, capsys, no_load):
    """Mutation finds: evaluate's --num-prompts 0 is refused as not positive (a mutant that dropped it from the
    check ran every prompt, `[:0]` read as 'no limit'), and --fps 1000, the documented bound, is taken (a mutant
    refused it)."""
    out = str(tmp_path / "ev")
    assert main(["evaluate", "--num-prompts", "0", "--out", out]) == 2
    assert "--num-prompts=0 must be a positive integer" in capsys.readouterr().err
    with pytest.raises(_Loaded):
        main(["evaluate", "--fps", "1000", "--out", out])
    assert not os.path.exists(out)


def test_evaluate_refuses_more_prompts_than_there_are(tmp_path, capsys, no_load):
    """Review find: --num-prompts 100 ran the 6 built-in prompts without a word (the header's count alone said it);
    it is refused before the model loads, naming where the prompts came from, and a count up to it is taken."""
    out = str(tmp_path / "ev")
    assert main(["evaluate", "--num-prompts", "100", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "--num-prompts=100 asks for more prompts than there are: 6 (the built-in list" in err
    assert main(["evaluate", "--prompt", "a cat", "--prompt", "a dog", "--num-prompts", "3", "--out", out]) == 2
    assert "than there are: 2 (--prompt)" in capsys.readouterr().err
    assert not os.path.exists(out)
    with pytest.raises(_Loaded):
        main(["evaluate", "--num-prompts", "6", "--out", out])


def test_synthetic_evaluate_refuses_warmup_a_quality_run_option(tmp_path, capsys, no_load):
    """Mutation find: --warmup / --no-warmup (one untimed generation per method) is read by quality runs only; with
    --synthetic it is refused, not ignored (a mutant left it out of the quality-only options)."""
    for flag in ("--warmup", "--no-warmup"):
        assert main(["evaluate", "--synthetic", "wan-1.3b", flag, "--out", str(tmp_path / "ev")]) == 2, flag
        assert f"{flag.replace('no-', '')} is only read by quality runs" in capsys.readouterr().err, flag


def test_evaluate_refuses_a_file_where_it_makes_its_videos_folder(tmp_path, capsys, no_load):
    """Mutation find: a quality run makes frames/, plots/ and videos/ in --out; a file named videos there is refused
    before the load (a mutant checked frames and plots only, and the run failed after its cells)."""
    out = tmp_path / "ev"
    out.mkdir()
    (out / "videos").write_text("x")
    assert main(["evaluate", "--out", str(out)]) == 2
    assert "holds a file videos, where the run makes its videos folder" in capsys.readouterr().err


class _Settings(Exception):
    pass


def test_evaluate_passes_its_quality_flags_to_the_run(tmp_path, monkeypatch):
    """Mutation finds: --num-prompts cuts the --prompt list, --no-lpips turns LPIPS off and --no-warmup the warm-up
    in the settings the run gets (mutants ran every prompt, computed LPIPS, or left the warm-up to the device); the
    reference model's pipeline loads, the run itself is stopped."""
    from videosparse.eval import evaluate as evaluate_module

    def stop(loaded, settings, out, **kwargs):
        raise _Settings(settings)

    monkeypatch.setattr(evaluate_module, "run_evaluation", stop)
    base = ["evaluate", "--methods", "dense", "--prompt", "a cat", "--prompt", "a dog", "--prompt", "a red circle",
            "--steps", "1", "--out", str(tmp_path / "ev")]
    with pytest.raises(_Settings) as got:
        main([*base, "--num-prompts", "2", "--no-lpips", "--no-warmup", "--fps", "4"])
    settings = got.value.args[0]
    assert (settings.prompts, settings.lpips, settings.warmup, settings.fps) == (["a cat", "a dog"], False, False, 4)
    with pytest.raises(_Settings) as got:
        main([*base, "--warmup"])
    settings = got.value.args[0]
    assert (len(settings.prompts), settings.lpips, settings.warmup) == (3, True, True)


def test_synthetic_evaluate_passes_its_options_to_the_run(tmp_path, monkeypatch):
    """Mutation find: the synthetic run gets --warmup-forwards, --repeats, --synthetic-layers, the size flags and
    --compile as given (a mutant always warmed up once); `run_synthetic` is stopped before any model is built."""
    from videosparse.eval import synthetic

    def stop(names, specs, out, **kwargs):
        raise _Settings(kwargs)

    monkeypatch.setattr(synthetic, "run_synthetic", stop)
    with pytest.raises(_Settings) as got:
        main(["evaluate", "--synthetic", "wan-1.3b", "--methods", "veda@0.5", "--warmup-forwards", "0", "--repeats",
              "2", "--synthetic-layers", "1", "--frames", "5", "--height", "64", "--width", "96", "--compile",
              "aot_eager", "--no-progress", "--overwrite", "--out", str(tmp_path / "ev")])
    kwargs = got.value.args[0]
    assert {k: kwargs[k] for k in ("warmup", "repeats", "layers", "frames", "height", "width", "compile_mode",
                                   "progress", "overwrite")} == dict(warmup=0, repeats=2, layers=1, frames=5,
                                                                    height=64, width=96, compile_mode="aot_eager",
                                                                    progress=False, overwrite=True)


def test_bench_refuses_a_deadline_of_zero(capsys):
    """Mutation find: --deadline-s must be > 0 (0 would start no timing at all); a mutant that checked `< 0` took
    0."""
    for value in ("0", "-1"):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "--deadline-s", value])
        assert exit_.value.code == 2 and f"--deadline-s {float(value)} must be a finite number of seconds > 0" in \
            capsys.readouterr().err, value


@pytest.mark.parametrize("command, output", [("distill", "--output-dir"), ("search-tiling", "--output")])
def test_distill_and_search_tiling_name_a_missing_local_model_before_any_work(command, output, tmp_path, capsys,
                                                                              monkeypatch):
    """Mutation finds: distill and search-tiling check --model like generate does (a './path' or '/path' that is not
    a folder is named, not sent to the hub as a repo id); mutants that dropped the check went on to the run."""
    import videosparse.distill

    monkeypatch.setattr(videosparse.distill, "run_distillation", lambda cfg: pytest.fail("distilled"))
    monkeypatch.setattr(videosparse.distill, "run_tiling_search", lambda cfg: pytest.fail("searched"))
    target = str(tmp_path / ("est" if command == "distill" else "t.json"))
    for model in ("./no-such-model", str(tmp_path / "none")):
        assert main([command, "--model", model, output, target]) == 2, model
        assert f"--model {model!r} looks like a local directory, but it does not exist" in capsys.readouterr().err


def test_search_tiling_makes_the_folders_of_its_output(tmp_path, monkeypatch):
    """Mutation find: search-tiling's --output may lie in folders not there yet (made with their parents when the
    tiling is saved); a mutant's output check refused 'the folder ... does not exist'."""
    import videosparse.distill

    seen = []

    def search(cfg):
        seen.append(cfg.output)
        raise _Settings

    monkeypatch.setattr(videosparse.distill, "run_tiling_search", search)
    output = str(tmp_path / "new" / "sub" / "t.json")
    with pytest.raises(_Settings):
        main(["search-tiling", "--model", "tiny", "--output", output])
    assert seen == [output]


def test_bench_progress_lines_do_not_reach_the_root_logger(tmp_path, capsys, caplog, monkeypatch):
    """Mutation find: the benchmark's progress lines go to stdout only, not on to the root logger's handlers as well
    (with `-v` they were printed twice); a mutant that left propagation on passed the stdout checks."""
    import torch

    from videosparse.eval import kernel_bench

    def fake_run(options):
        kernel_bench._log("check", {"ok": True})
        return dict(meta={"wall_s": 1.0}, correctness=[dict(ok=True)], rows=[], variants=[], item_sweep=[], errors=[])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel_bench, "run_benchmark", fake_run)
    with caplog.at_level(logging.INFO):
        assert main(["-v", "bench", "--out", str(tmp_path / "k.json")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "check {'ok': True}"
    assert not [r for r in caplog.records if r.name == kernel_bench.__name__]


def test_a_folder_given_as_tiling_is_named_as_no_tiling_file(tmp_path, capsys, no_load):
    """Mutation find: --tiling naming a folder gets the message of a tiling that is neither a shape nor a file (a
    mutant that checked only that the path exists let the tiling reader fail with an errno text)."""
    (tmp_path / "tilings").mkdir()
    assert main(["generate", "--tiling", str(tmp_path / "tilings")]) == 2
    err = capsys.readouterr().err
    assert "is neither a tile shape like 4x4x8 nor an existing tiling JSON file" in err and "Errno" not in err
