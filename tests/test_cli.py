import json
import os
import subprocess
import sys
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch

from videosparse.cli import build_parser, main
from videosparse.cli.common import method_config
from videosparse.config import SolConfig, VedaConfig


def test_method_args_build_configs():
    p = build_parser()
    a = p.parse_args(["generate", "--method", "sol", "--density", "0.2", "--dense-layers", "0,1", "--no-correction"])
    assert method_config(a) == SolConfig(density=0.2, dense_layers=(0, 1), correction=False)
    a = p.parse_args(["generate", "--tiling", "8x4x4", "--dense-steps", "0.25"])
    assert method_config(a) == VedaConfig(density=0.1, tiling=(8, 4, 4), dense_steps=0.25)


def test_malformed_schedule_arguments_are_argparse_errors_naming_the_form(capsys):
    import pytest

    for argv, msg in ((["--dense-steps", "abc"], "argument --dense-steps: dense steps 'abc' must be an int count"),
                      (["--dense-layers", "a,b"], "layers 'a,b' must be comma-separated layer indices (e.g. 0,3)")):
        with pytest.raises(SystemExit) as exit_:
            main(["generate", *argv])
        assert exit_.value.code == 2 and msg in capsys.readouterr().err, argv
    a = build_parser().parse_args(["generate", "--dense-steps", "1e-1", "--dense-layers", ""])
    assert a.dense_steps == 0.1 and a.dense_layers == ()


def test_bad_arguments_exit_with_clear_error(capsys):
    assert main(["generate", "--density", "2"]) == 2
    assert "density=2.0" in capsys.readouterr().err
    assert main(["generate", "--steps", "-1"]) == 2
    assert "--steps=-1" in capsys.readouterr().err
    assert main(["generate", "--out", "/tmp/video"]) == 2        # no video extension: refused before any work
    assert "'/tmp/video' needs a video file extension" in capsys.readouterr().err
    # flags the method does not take are refused, not dropped
    for argv, msg in ((["--method", "veda", "--tau", "1.5"], "--tau does not apply to --method veda"),
                      (["--method", "sol", "--estimator", "x"], "--estimator does not apply to --method sol"),
                      (["--method", "dense", "--density", "0.3"], "--density does not apply to --method dense"),
                      (["--method", "dense", "--dense-layers", "0"], "--dense-layers does not apply to --method dense"),
                      (["--method", "dense", "--backend", "reference"], "--backend does not apply"),
                      (["--method", "sol", "--tau", "1.5", "--density", "0.05"], "exactly one of density or tau"),
                      (["--fps", "0"], "--fps=0"),
                      (["--out", "/no/such/folder/v.mp4"], "does not exist"),
                      (["--json", "/no/such/folder/s.json"], "does not exist"),
                      (["--device", "foo"], "device='foo' is not a torch device"),
                      (["--tiling", "/no/such/tiling.json"], "neither a tile shape like 4x4x8 nor an existing"),
                      (["--guidance-scale", "nan"], "--guidance-scale=nan must be a finite number")):
        assert main(["generate", *argv]) == 2, argv
        assert msg in capsys.readouterr().err, argv
    # evaluate: an option only the other mode reads is refused, not ignored (review find: `--compile` on a quality
    # run printed eager speedups with nothing said)
    for argv, msg in ((["--compile", "default", "--repeats", "5"],
                       "--repeats, --compile are only read by --synthetic speed runs"),
                      (["--synthetic", "wan-1.3b", "--seeds", "1"], "--seeds is only read by quality runs"),
                      (["--synthetic", "wan-1.3b", "--model", "tiny"], "--model is only read by quality runs"),
                      # review find: at their default values they were ignored
                      (["--synthetic", "wan-1.3b", "--seeds", "0", "--fps", "8"],
                       "--seeds, --fps are only read by quality runs"),
                      (["--repeats", "3", "--warmup-forwards", "1"],
                       "--repeats, --warmup-forwards are only read by --synthetic")):
        assert main(["evaluate", "--out", "/no/such/eval", *argv]) == 2, argv
        assert msg in capsys.readouterr().err, argv


def test_capture_config_list_fields_from_strings():
    from videosparse.distill import DistillConfig, TilingSearchConfig
    from videosparse.distill.capture import split_by_prompt

    assert DistillConfig(branches="cond").branches == ("cond",)
    assert DistillConfig(branches="cond,uncond").branches == ("cond", "uncond")
    assert TilingSearchConfig(layers="0,1").layers == (0, 1)
    assert TilingSearchConfig(layers=1).layers == (1,)
    for bad in (dict(seed="abc"), dict(seed=1.5), dict(branches=[]), dict(device="foo")):
        try:
            DistillConfig(**bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")
    # refused at once, not after the dense runs: non-finite numbers (a NaN estimator was saved with exit code 0),
    # unknown branch names (they matched no record), a tiling file that is not there, a folder as the search output
    for bad, match in ((dict(learning_rate=float("inf")), "learning_rate=inf must be a finite number > 0"),
                       (dict(init_std=float("nan")), "init_std=nan"), (dict(weight_decay=-1.0), "weight_decay=-1.0"),
                       (dict(guidance_scale="high"), "guidance_scale='high'"),
                       (dict(guidance_scale=float("nan")), "guidance_scale=nan"),
                       (dict(branches="conditional"), r"\['conditional'\] are not branch names"),
                       (dict(tiling="tilng.json"), "tiling file 'tilng.json' does not exist")):
        with pytest.raises(ValueError, match=match):
            DistillConfig(**bad)
    assert DistillConfig(branches="cond,uncond_stg", guidance_scale=5).guidance_scale == 5
    assert TilingSearchConfig(branches="pred_cond,pred_uncond").branches == ("pred_cond", "pred_uncond")  # guiders'
    for out in ("newdir/", str(Path(__file__).parent)):
        with pytest.raises(ValueError, match="(is a directory|ends with a path separator); give a file path"):
            TilingSearchConfig(output=out)
    files = [Path(f"p{i:05d}_s0000_cond.safetensors") for i in range(3)]
    train, val = split_by_prompt(files, 0.34, seed=0)
    assert len(val) == 1 and len(train) == 2                 # the nearest count, not rounded up


def test_generate_writes_playable_mp4(tmp_path):
    out, js = tmp_path / "v.mp4", tmp_path / "s.json"
    cmd = [sys.executable, "-m", "videosparse.cli", "generate", "--frames", "5", "--height", "64", "--width", "96",
           "--steps", "2", "--density", "0.5", "--tiling", "1x8x16", "--out", str(out), "--json", str(js),
           "--compare-dense"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "video written to" in res.stdout and "realised density" in res.stdout
    frames = iio.imread(out)
    assert frames.shape == (5, 64, 96, 3)
    summary = json.loads(js.read_text())
    assert summary["stats"]["transformer"]["sparse_calls"] > 0
    # what reproduces the run (review find: no seed, dtype, versions or speedup in the JSON)
    # with --compare-dense both arms warm up on the CPU too (review 59: the first arm ran slower, 0.67-0.89x of the
    # second with dense in both); the timed arms alone are counted
    assert summary["seed"] == 0 and summary["dtype"] == "torch.float32" and summary["warmed_up"] is True
    calls = summary["stats"]["transformer"]
    assert calls["sparse_calls"] + calls["dense_calls"] == 4 * 2 * 2     # 4 layers, 2 steps, 2 guidance branches
    assert summary["environment"]["torch"] == torch.__version__
    assert summary["dense"]["arm"] == "stock processors" and summary["dense"]["speedup"] > 0


def test_generate_json_dash_prints_the_summary_alone_on_stdout(tmp_path):
    """Exploratory find (session 66): `--json -` wrote a file named '-' in the working folder; it now prints the
    summary to stdout, the only thing there (what the command prints else goes to stderr), for `| jq`."""
    cmd = [sys.executable, "-m", "videosparse.cli", "generate", "--frames", "5", "--height", "64", "--width", "96",
           "--steps", "2", "--density", "0.5", "--tiling", "1x8x16", "--out", "v.mp4", "--json", "-"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["stats"]["transformer"]["sparse_calls"] > 0 and summary["seed"] == 0
    assert "video written to" in res.stderr and "realised density" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.mp4"]


def test_generate_explains_a_sparse_arm_slower_than_dense():
    from videosparse.cli.generate import slower_than_dense_note

    assert slower_than_dense_note(1.3) is None and slower_than_dense_note(1.0) is None
    note = slower_than_dense_note(0.53)                   # the H200 reading of the README command (tiny model)
    assert note.startswith("note: sparse attention was slower than dense") and "--synthetic wan-1.3b" in note


def test_generate_checks_sizes_images_and_uses_the_pipelines_own_defaults():
    import pytest

    from videosparse.cli.generate import _image_input
    from videosparse.models.loading import check_size, pipeline_call_defaults
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    pipe = build_tiny_wan_pipeline()
    with pytest.raises(ValueError, match="--height=72 must be a multiple of 16"):
        check_size(pipe, {"height": 72, "width": 64})
    check_size(pipe, {"height": 64, "width": 96})
    from types import SimpleNamespace                       # LTX-Video: the factor only in its video processor
    ltx_like = SimpleNamespace(video_processor=SimpleNamespace(config=SimpleNamespace(vae_scale_factor=32)),
                               transformer=SimpleNamespace(config=SimpleNamespace(patch_size=1)))
    with pytest.raises(ValueError, match="--width=48 must be a multiple of 32"):
        check_size(ltx_like, {"height": 64, "width": 48})
    with pytest.raises(ValueError, match="takes none"):
        _image_input(pipe, "first.png")
    assert _image_input(pipe, None) is None
    defaults = pipeline_call_defaults(pipe)                        # WanPipeline.__call__'s own defaults
    assert (defaults["num_frames"], defaults["height"], defaults["width"]) == (81, 480, 832)

    class NoFrames(type(pipe)):
        def __call__(self, prompt=None, height=64, width=None, num_inference_steps=4):
            pass

    assert pipeline_call_defaults(NoFrames.__new__(NoFrames)) == {"prompt": defaults["prompt"], "height": 64,
                                                                  "num_inference_steps": 4}   # lacks: not passed


def test_a_size_the_model_cannot_tile_is_named_before_its_weights_load(tmp_path, capsys, monkeypatch):
    """Known gap of the last sessions: --height / --width were checked after the pipeline loaded (minutes for a 14B
    model); the VAE factor and the patch come from the model's config files now, the VAE made on the meta device."""
    import pytest

    from videosparse.models import loading
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    build_tiny_wan_pipeline().save_pretrained(tmp_path / "wan")

    def no_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the size was checked")

    monkeypatch.setattr(loading, "load_pipeline", no_load)
    assert main(["generate", "--model", str(tmp_path / "wan"), "--height", "72"]) == 2
    assert "--height=72 must be a multiple of 16 for WanPipeline" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="loaded before"):           # a size it can tile goes on to the load
        main(["generate", "--model", str(tmp_path / "wan"), "--height", "64", "--width", "96"])
    # evaluate too (it loaded the whole pipeline first, and left empty report folders behind)
    out = tmp_path / "report"
    assert main(["evaluate", "--model", str(tmp_path / "wan"), "--width", "40", "--out", str(out)]) == 2
    assert "--width=40 must be a multiple of 16 for WanPipeline" in capsys.readouterr().err
    assert not out.exists()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model_index.json").write_text('{"_class_name": "NoSuchPipeline"}')
    assert loading.size_stub(str(tmp_path / "broken")) is None and loading.size_stub("tiny") is None


def test_video_keeps_sizes_that_are_not_multiples_of_16(tmp_path):
    import numpy as np

    from videosparse.eval.generate import write_video

    frames = np.random.default_rng(0).random((4, 36, 44, 3)).astype(np.float32)
    path = write_video(frames, str(tmp_path / "v.mp4"), fps=4)
    assert iio.imread(path).shape == (4, 36, 44, 3)


def test_bool_fields_parse_strictly_on_the_command_line(capsys):
    import pytest

    from videosparse.distill import DistillConfig
    from videosparse.cli.config_args import config_from_namespace

    p = build_parser()
    for text, value in (("False", False), ("no", False), ("0", False), ("NO", False), ("true", True),
                        ("Yes", True), ("1", True)):
        assert config_from_namespace(p.parse_args(["distill", "--resume", text]), DistillConfig).resume is value, text
    assert p.parse_args(["distill", "--resume"]).resume is True             # the flag alone
    assert not hasattr(p.parse_args(["distill"]), "resume")                 # not given: the config's default
    with pytest.raises(SystemExit):
        p.parse_args(["distill", "--resume", "maybe"])
    err = capsys.readouterr().err
    assert "argument --resume: 'maybe' is not a bool" in err and "true or false" in err


def test_distill_says_when_it_resumed(tmp_path, capsys, monkeypatch):
    """Review find: a rerun into a run's folder resumed (or, finished, trained no more and rewrote its outputs) with
    no word of it unless -v was given."""
    import videosparse.distill as distill
    from videosparse.distill.train import DistillResult

    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"
    for resumed, said in ((ckpt, True), (None, False)):
        monkeypatch.setattr(distill, "run_distillation", lambda cfg, resumed=resumed: DistillResult(
            output_dir=tmp_path / "run", global_step=4, resumed_from=resumed))
        assert main(["distill", "--model", "tiny", "--output-dir", str(tmp_path / "run")]) == 0
        assert (f"resumed from {ckpt}" in capsys.readouterr().out) is said


def test_distill_prompts_accepted_forms_in_help_and_error(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["distill", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "one prompt per line" in help_text and """one prompt: '["a cat"]'""" in help_text
    out = tmp_path / "run"
    assert main(["distill", "--prompts", "a cat", "--model", "tiny", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "prompts='a cat' is not a file" in err and "one prompt per line" in err
    assert """--prompts '["a cat"]'""" in err
    assert not out.exists()                                                 # refused before any work


def test_text_flags_keep_names_that_read_as_numbers(tmp_path):
    """Paths and names are taken as given (a folder named 2024, a prompts file named 7); lists and numbers of
    other fields still parse as JSON."""
    from videosparse.distill import DistillConfig, TilingSearchConfig
    from videosparse.cli.config_args import config_from_namespace

    p = build_parser()
    args = p.parse_args(["distill", "--output-dir", "2024", "--prompts", "7", "--model", "null", "--max-steps", "5",
                         "--tiling", "[8,4,4]"])
    assert (args.output_dir, args.prompts, args.model, args.max_steps, args.tiling) == ("2024", "7", None, 5,
                                                                                       [8, 4, 4])
    assert p.parse_args(["distill", "--prompts", ' ["a cat"]']).prompts == ["a cat"]
    cfg = config_from_namespace(p.parse_args(["search-tiling", "--output", "2024.5", "--prompts", '["a cat"]']),
                                TilingSearchConfig)
    assert cfg.output == "2024.5"
    (tmp_path / "7").write_text("a cat\n")
    cfg = config_from_namespace(p.parse_args(["distill", "--prompts", str(tmp_path / "7")]), DistillConfig)
    assert cfg.prompts == str(tmp_path / "7")


def test_distill_flags_given_as_null_override_the_config_file_and_numbers_take_python_spellings(tmp_path):
    """Review finds: `--max-steps null` over a --config file was dropped (a flag given as null could not be told from
    one not given); `.1`, `5.` and `+5` stayed strings and were refused as 'must be a number'."""
    import json

    import pytest

    from videosparse.distill import DistillConfig
    from videosparse.cli.config_args import config_from_namespace

    p = build_parser()
    base = tmp_path / "distill_config.json"
    base.write_text(json.dumps(dict(max_steps=100, guidance_scale=3.0, dtype="bfloat16", density=0.3)))
    cfg = config_from_namespace(p.parse_args(["distill", "--config", str(base), "--max-steps", "null",
                                              "--guidance-scale", "null", "--dtype", "null"]), DistillConfig)
    assert (cfg.max_steps, cfg.guidance_scale, cfg.dtype, cfg.density) == (None, None, None, 0.3)
    cfg = config_from_namespace(p.parse_args(["distill", "--density", ".1", "--learning-rate", "5.",
                                              "--guidance-scale", "+5"]), DistillConfig)
    assert (cfg.density, cfg.learning_rate, cfg.guidance_scale) == (0.1, 5.0, 5.0)
    for field, value in (("model", 3), ("component", 3), ("component", "")):
        with pytest.raises(ValueError, match=f"{field}={value!r} must be"):
            DistillConfig(**{field: value})


def test_evaluate_refuses_prompt_and_prompts_together(tmp_path, capsys):
    assert main(["evaluate", "--model", "tiny", "--prompt", "a cat", "--prompts", str(tmp_path / "none.txt"),
                 "--out", str(tmp_path / "out")]) == 2
    assert "--prompt and --prompts" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_distill_block_64_takes_vedas_default_tile_shape():
    from videosparse.distill import DistillConfig
    from videosparse.cli.config_args import config_from_namespace
    from videosparse.config import DEFAULT_TILES

    p = build_parser()
    cfg = config_from_namespace(p.parse_args(["distill", "--block", "64"]), DistillConfig)
    assert cfg.tiling == DEFAULT_TILES[64] == (4, 4, 4)
    assert DistillConfig().tiling == DEFAULT_TILES[128] == (4, 4, 8)
    assert DistillConfig(block=64, tiling="2x4x8").tiling == (2, 4, 8)      # a given shape is kept


def test_verbose_flag_before_or_after_the_subcommand():
    p = build_parser()
    assert p.parse_args(["generate", "-v"]).verbose is True
    assert p.parse_args(["-v", "generate"]).verbose is True
    assert p.parse_args(["distill", "--verbose"]).verbose is True
    assert p.parse_args(["search-tiling", "-v"]).verbose is True
    assert p.parse_args(["generate"]).verbose is False


def test_missing_local_model_directory_is_named(tmp_path, capsys):
    import pytest

    from videosparse.cli.common import check_model

    for model in ("/nonexistent/dir", "./nope", "~/no-such-videosparse-model", "models/wan/v1"):
        assert main(["generate", "--model", model]) == 2, model
        assert f"--model {model!r} looks like a local directory, but it does not exist" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file, not a pipeline directory"):
        check_model(str(tmp_path / "file"))
    for model in (None, "reference", "tiny", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", str(tmp_path)):
        check_model(model)                                                  # hub ids and real folders pass


def test_sol_says_it_takes_no_tiling_file(capsys):
    assert main(["generate", "--method", "sol", "--tiling", "tiling.json"]) == 2
    err = capsys.readouterr().err
    assert "--tiling 'tiling.json': Sol takes one tile shape like 4x4x8" in err
    assert "only --method veda reads a tiling JSON" in err


def test_prompt_words_outside_the_tokenizer_are_named():
    """The reference model's closed vocabulary maps other words to [UNK]: generate names them."""
    from types import SimpleNamespace

    from videosparse.cli.generate import _unknown_words
    from videosparse.models.reference_text import build_reference_tokenizer

    pipe = SimpleNamespace(tokenizer=build_reference_tokenizer())
    assert _unknown_words(pipe, "a red circle moving right, on a dark background") == []
    assert _unknown_words(pipe, "a Red elephant dancing") == ["elephant", "dancing"]
    assert _unknown_words(SimpleNamespace(), "anything") == []


def test_evaluate_checks_the_files_its_specs_name_before_any_cell_runs(tmp_path, capsys):
    """A missing tiling JSON or estimator used to surface after the dense arm had run (and left a report behind)."""
    out = tmp_path / "ev"
    for spec, msg in (("veda@0.1:tiling=" + str(tmp_path / "nofile.json"), "does not exist"),
                      ("veda@0.1:estimator=/no/such/estimator", "neither an existing directory nor a hub id"),
                      ("sol@0.1:tiling=tiling.json", "sol takes one tile shape like 4x4x8")):
        assert main(["evaluate", "--methods", spec, "--out", str(out)]) == 2, spec
        err = capsys.readouterr().err
        assert f"method spec {spec!r}" in err and msg in err, err
    assert not out.exists()
    assert main(["evaluate", "--prompts", str(tmp_path / "none.txt"), "--out", str(out)]) == 2
    assert "prompts file" in capsys.readouterr().err and not out.exists()


def test_prompt_files_hold_lines_or_a_json_list_read_alike_by_every_command(tmp_path):
    """Review find: `evaluate` read a JSON list only from a file named .json (a prompts.txt holding one ran its raw
    text as one prompt) and skipped '#' lines, which `distill` and `search-tiling` took as prompts."""
    from videosparse.distill.config import read_prompts
    from videosparse.eval.evaluate import load_prompts

    lines, listed, broken = tmp_path / "p.txt", tmp_path / "p.txt.1", tmp_path / "bad.txt"
    lines.write_text("# my prompts\na cat\n\n  a dog  \n  # not this one\n")
    listed.write_text('[\n  "a red circle moving left",\n  "a blue square moving up"\n]\n')
    broken.write_text('[cinematic] a cat surfing\n[anime] a dog running\n')    # lines that start with "["
    for read in (read_prompts, load_prompts):
        assert read(str(lines)) == ["a cat", "a dog"]
        assert read(str(listed)) == ["a red circle moving left", "a blue square moving up"]
        assert read(str(broken)) == ["[cinematic] a cat surfing", "[anime] a dog running"]
    (tmp_path / "null.json").write_text("null")                 # (review find: read as the prompt "null")
    for read in (read_prompts, load_prompts):
        with pytest.raises(ValueError, match="null.json' holds a JSON null"):
            read(str(tmp_path / "null.json"))
    (tmp_path / "bad.json").write_text(broken.read_text())
    (tmp_path / "dict.json").write_text('{"prompts": ["a cat"]}')
    (tmp_path / "comments.txt").write_text("# a\n\n#b\n")
    for read in (read_prompts, load_prompts):
        with pytest.raises(ValueError, match="bad.json' is not valid JSON"):
            read(str(tmp_path / "bad.json"))
        with pytest.raises(ValueError, match="dict.json' holds a JSON object; a JSON list of prompts holds"):
            read(str(tmp_path / "dict.json"))
        with pytest.raises(ValueError, match="comments.txt' holds no prompt"):
            read(str(tmp_path / "comments.txt"))
    # review 59: evaluate's --prompts took no inline JSON list, which distill's and search-tiling's take
    assert load_prompts(' ["a cat", " a dog "]') == read_prompts(("a cat", "a dog")) == ["a cat", "a dog"]
    with pytest.raises(ValueError, match=r"--prompts '\[\"a cat\", 3\]' holds a JSON list that has 3 at position 1"):
        load_prompts('["a cat", 3]')
    with pytest.raises(ValueError, match="is neither a file nor a valid JSON list"):
        load_prompts('["a cat"')


def test_output_paths_seeds_and_method_files_are_checked_before_the_pipeline_loads(tmp_path, capsys, monkeypatch):
    """Review finds: an --out that is a directory was reported written (ffmpeg's error aside, exit 0); a --json
    directory failed after the whole run; a bad --estimator / --tiling file after the model loaded; a seed past torch's
    range gave 'Overflow when unpacking long long'; an existing file as evaluate's --out / distill's output dir, and a
    search output under a file, failed late with an errno message; an --image path that is not there or not an
    image failed only after the load."""
    from videosparse.models import loading

    def no_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the bad argument was named")

    monkeypatch.setattr(loading, "load_pipeline", no_load)
    (tmp_path / "d.mp4").mkdir()
    afile = tmp_path / "afile"
    afile.write_text("x")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    for argv, msg in ((["--out", str(tmp_path / "d.mp4")], "is a directory; give a file path"),
                      (["--json", str(tmp_path)], "is a directory; give a file path"),
                      (["--seed", str(2 ** 70)], "--seed 1180591620717411303424 is out of the range"),
                      (["--estimator", str(tmp_path / "none")], "--estimator"),
                      (["--tiling", str(bad_json)], f"--tiling {str(bad_json)!r}"),
                      (["--image", str(tmp_path / "none.png")], "could not be read as an image"),
                      (["--image", str(bad_json)], f"--image {str(bad_json)!r} could not be read")):
        assert main(["generate", *argv]) == 2, argv
        assert msg in capsys.readouterr().err, argv
    assert main(["evaluate", "--out", str(afile)]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err
    assert main(["evaluate", "--seeds", "-1", str(2 ** 64), "--out", str(tmp_path / "ev")]) == 2
    assert "--seeds 18446744073709551616 is out of the range" in capsys.readouterr().err
    assert main(["distill", "--model", "tiny", "--output-dir", str(afile)]) == 2
    assert "output_dir=" in capsys.readouterr().err
    assert main(["search-tiling", "--model", "tiny", "--output", str(afile / "t.json")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_config_files_must_hold_an_object_and_a_tiling_json_gives_its_search_settings(tmp_path, capsys):
    listed = tmp_path / "list.json"
    listed.write_text("[]")
    for command in ("distill", "search-tiling"):
        assert main([command, "--config", str(listed)]) == 2
        assert "holds a list; expected a JSON object" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert main(["distill", "--config", str(broken)]) == 2
    assert f"--config {str(broken)!r} cannot be read as JSON" in capsys.readouterr().err
    from videosparse.cli.config_args import add_config_arguments, config_from_namespace
    from videosparse.distill.config import TilingSearchConfig

    tiling = tmp_path / "tiling.json"
    tiling.write_text(json.dumps({"format": "videosparse-tiling", "layers": [],
                                  "search_config": TilingSearchConfig(density=0.2, output=str(tiling)).to_dict()}))
    import argparse

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, TilingSearchConfig)
    cfg = config_from_namespace(parser.parse_args(["--config", str(tiling), "--output", str(tmp_path / "t2.json")]),
                                TilingSearchConfig)
    assert cfg.density == 0.2 and cfg.output == str(tmp_path / "t2.json")


def test_write_video_fails_when_ffmpeg_wrote_nothing(tmp_path, monkeypatch):
    """imageio returns after ffmpeg refuses a path (its error on stderr only): the video must exist to be reported."""
    import diffusers.utils

    from videosparse.eval.generate import write_video

    monkeypatch.setattr(diffusers.utils, "export_to_video", lambda frames, path, **kw: path)
    with pytest.raises(OSError, match="was not written"):
        write_video(np.zeros((2, 16, 16, 3), dtype=np.float32), str(tmp_path / "v.mp4"))


def test_generate_without_ffmpeg_stops_before_the_pipeline_loads(capsys, monkeypatch):
    import imageio

    from videosparse.models import loading

    def no_exe():
        raise RuntimeError("No ffmpeg exe could be found.")

    def no_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded although no video could be written")

    monkeypatch.setattr(imageio.plugins.ffmpeg, "get_exe", no_exe)
    monkeypatch.setattr(loading, "load_pipeline", no_load)
    assert main(["generate"]) == 2
    err = capsys.readouterr().err
    assert "no ffmpeg to write the video with" in err and "imageio-ffmpeg" in err


def test_generate_whose_video_fails_still_writes_its_summary(tmp_path, capsys, monkeypatch):
    """A video that cannot be written at the end of a run (disk full, a folder gone) still leaves the run's numbers."""
    from videosparse.eval import generate as generate_module

    def disk_full(frames, path, fps=8):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(generate_module, "write_video", disk_full)
    js = tmp_path / "s.json"
    assert main(["generate", "--frames", "5", "--height", "64", "--width", "64", "--steps", "2",
                 "--out", str(tmp_path / "v.mp4"), "--json", str(js)]) == 2
    out = capsys.readouterr()
    assert "realised density" in out.out and "video written" not in out.out
    assert "could not be written" in out.err and "No space left on device" in out.err and str(js) in out.err
    summary = json.loads(js.read_text())
    assert summary["video"] is None and "No space left on device" in summary["video_error"]
    assert summary["stats"]["transformer"]["sparse_calls"] > 0


def test_a_hub_model_that_cannot_be_fetched_names_the_way_out(monkeypatch):
    import diffusers

    from videosparse.models.loading import load_pipeline

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in "
                      "the cached files.")

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", offline)
    with pytest.raises(OSError, match="download it first .* the models that need no download are 'reference' and "
                                      "'tiny'"):
        load_pipeline("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "cpu")

    def with_trace_hint(*args, **kwargs):          # diffusers' text points to a stack trace the CLI does not print
        raise OSError("Cannot load model wan-1.3b: not cached. Please check out the root cause in the stacktrace "
                      "above.")

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", with_trace_hint)
    with pytest.raises(OSError) as err:             # review 54: a synthetic model's name suggested `hf download`
        load_pipeline("wan-1.3b", "cpu")
    assert "stacktrace" not in str(err.value) and "hf download" not in str(err.value)
    assert "'wan-1.3b' names a random-weight model of `videosparse evaluate --synthetic`" in str(err.value)


def test_a_call_flag_the_pipeline_does_not_take_is_named_after_the_load(tmp_path, capsys, monkeypatch):
    """Review find: --guidance-scale given to HunyuanVideo15Pipeline (no such parameter) was a TypeError traceback from
    inside the call; a given flag is checked against `__call__` right after the load (defaults are not flags)."""
    from videosparse.models.reference import ReferenceVideoPipeline

    class NoGuidancePipeline(ReferenceVideoPipeline):     # HunyuanVideo15Pipeline's call: no guidance_scale, no **kw
        def __call__(self, prompt=None, negative_prompt=None, num_frames=5, height=64, width=64,
                     num_inference_steps=2, generator=None, output_type="np"):
            return super().__call__(prompt=prompt, negative_prompt=negative_prompt, num_frames=num_frames,
                                    height=height, width=width, num_inference_steps=num_inference_steps,
                                    generator=generator, output_type=output_type)

    _load_reference_as(monkeypatch, NoGuidancePipeline, "no-guidance")
    out = tmp_path / "v.mp4"
    assert main(["generate", "--guidance-scale", "6", "--out", str(out)]) == 2
    assert "--guidance-scale: NoGuidancePipeline.__call__ takes no guidance_scale" in capsys.readouterr().err
    assert main(["evaluate", "--methods", "dense", "--guidance-scale", "6", "--out", str(tmp_path / "ev")]) == 2
    assert "--guidance-scale: NoGuidancePipeline.__call__ takes no guidance_scale" in capsys.readouterr().err
    assert main(["generate", "--steps", "1", "--out", str(out)]) == 0 and out.is_file()   # its defaults: no flags
    from videosparse.eval.generate import check_call_flags

    class AnyKeyword:
        def __call__(self, prompt=None, **kwargs):
            pass

    check_call_flags(AnyKeyword(), {"--guidance-scale": "guidance_scale"})      # **kwargs: the pipeline decides


def test_warm_up_never_runs_more_steps_than_the_call(monkeypatch):
    """Review find: --steps 4 --dense-steps 50 warmed up with 51 steps (a huge count never ended)."""
    from videosparse.eval import generate as generate_module
    from videosparse.eval.generate import warm_up

    ran = []
    monkeypatch.setattr(generate_module, "generate", lambda pipe, config, call, **kw: ran.append(call))
    call = {"num_inference_steps": 4}
    assert warm_up(None, VedaConfig(dense_steps=50), call) == 0 and ran == []      # all dense: nothing to compile
    assert warm_up(None, VedaConfig(dense_steps=10 ** 12), call) == 0 and ran == []
    assert warm_up(None, VedaConfig(dense_steps=4), call) == 0 and ran == []
    assert warm_up(None, VedaConfig(dense_steps=3), call) == 4 and ran[-1]["num_inference_steps"] == 4
    assert warm_up(None, VedaConfig(dense_steps=0.5), call) == 1 and ran[-1]["num_inference_steps"] == 1
    assert warm_up(None, None, call) == 1


def test_a_model_directory_under_home_is_loaded_from_there(tmp_path, monkeypatch):
    """Review find: `--model ~/dir` passed check_model (which expands ~) and reached diffusers as '~/dir': 'Repo id
    must use alphanumeric chars'."""
    import diffusers

    from videosparse.models.loading import load_pipeline

    asked = []

    def from_pretrained(model, **kwargs):
        asked.append(model)
        raise OSError("stop here")

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", from_pretrained)
    with pytest.raises(OSError, match="stop here"):
        load_pipeline("~/wan", "cpu")
    assert asked == [str(tmp_path / "wan")]


def test_an_interrupted_video_or_summary_leaves_the_old_files_whole(tmp_path, capsys, monkeypatch):
    """Review find: the video was encoded straight into --out and the --json summary written in place, so a failed
    encode or write left a truncated file where the old one was; both go to a temporary file and a rename now."""
    import diffusers.utils

    from videosparse import _io

    out, js = tmp_path / "v.mp4", tmp_path / "s.json"
    out.write_bytes(b"old video")
    js.write_text('{"old": 1}')
    encoded = []

    def killed_encode(frames, path, **kwargs):
        encoded.append(path)
        with open(path, "wb") as f:
            f.write(b"partial")
        raise RuntimeError("ffmpeg was killed")

    class Unwritable:
        def __str__(self):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(diffusers.utils, "export_to_video", killed_encode)
    monkeypatch.setattr(_io, "to_jsonable", lambda summary: {"model": "x", "stats": Unwritable()})
    assert main(["generate", "--frames", "5", "--height", "64", "--width", "64", "--steps", "2",
                 "--out", str(out), "--json", str(js)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert out.read_bytes() == b"old video" and js.read_text() == '{"old": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "v.mp4"]          # no temporary file left
    assert encoded == [str(tmp_path / ".v.tmp.mp4")]                                    # the suffix picks the format


def test_an_output_path_ending_in_a_separator_is_refused_before_the_load(tmp_path, capsys, monkeypatch):
    """Review find: `--out dir.mp4/` passed the checks (Path drops the slash) and failed after the whole run."""
    from videosparse.models import loading

    def no_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the output path was checked")

    monkeypatch.setattr(loading, "load_pipeline", no_load)
    for argv in (["--out", str(tmp_path / "dir.mp4") + "/"], ["--json", str(tmp_path / "s.json") + "/"]):
        assert main(["generate", *argv]) == 2, argv
        assert f"{argv[0]} {argv[1]!r} ends with a path separator; give a file path" in capsys.readouterr().err


def test_settings_refused_before_a_pipeline_loads(tmp_path, capsys, monkeypatch):
    """Review finds: --json naming the --out video wrote the summary over the video; evaluate's --attn-cells -1 and a
    repeated seed were refused only after the model loaded (naming the field, not the flag); a file in the working
    directory named without a slash went to the hub as a repo id."""
    from videosparse.models import loading

    def no_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_pipeline", no_load)
    video = str(tmp_path / "v.mp4")
    assert main(["generate", "--out", video, "--json", video]) == 2
    assert "is the --out video's path" in capsys.readouterr().err
    for flags, message in ((["--attn-cells", "-1"], "--attn-cells=-1 must be >= 0"),
                           (["--seeds", "0", "3", "0"], "--seeds 0 3 0 repeats [0]")):
        assert main(["evaluate", "--out", str(tmp_path / "r"), *flags]) == 2
        assert message in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights.txt").write_text("not a pipeline")
    assert main(["generate", "--model", "weights.txt"]) == 2
    assert "'weights.txt' looks like a local directory, but it is a file" in capsys.readouterr().err


def test_a_pipeline_without_a_step_count_generates_and_evaluate_names_why_it_cannot(tmp_path, capsys, monkeypatch):
    """HeliosPyramidPipeline takes steps per stage, no num_inference_steps: generate raised KeyError (a traceback)
    and evaluate named an internal field; generate now times per transformer forward, evaluate says what it needs."""
    import json

    from videosparse.models.reference import ReferenceVideoPipeline

    class PyramidLike(ReferenceVideoPipeline):
        def __call__(self, prompt=None, negative_prompt=None, num_frames=5, height=64, width=64,
                     stage_steps=(1, 1), generator=None, output_type="np"):
            return super().__call__(prompt=prompt, negative_prompt=negative_prompt, num_frames=num_frames,
                                    height=height, width=width, num_inference_steps=sum(stage_steps),
                                    generator=generator, output_type=output_type)

    _load_reference_as(monkeypatch, PyramidLike, "pyramid-like")
    summary = tmp_path / "s.json"
    assert main(["generate", "--out", str(tmp_path / "v.mp4"), "--json", str(summary)]) == 0
    assert "ms transformer time per transformer forward" in capsys.readouterr().out
    data = json.loads(summary.read_text())
    assert data["timed_per"] == "transformer forward" and data["transformer_s_per_step"] > 0
    assert main(["evaluate", "--methods", "dense", "--out", str(tmp_path / "r")]) == 2
    assert "PyramidLike.__call__ takes no num_inference_steps" in capsys.readouterr().err


def test_video_pixels_round_to_the_nearest_level(tmp_path):
    """diffusers' export_to_video truncates float frames (0.999 -> 254); write_video rounds."""
    import numpy as np

    from videosparse.eval.generate import write_video

    frames = np.full((2, 16, 16, 3), 0.999, dtype=np.float32)
    path = write_video(frames, str(tmp_path / "v.mkv"), fps=4)
    assert int(np.median(iio.imread(path))) == 255


def _load_reference_as(monkeypatch, cls, name: str) -> None:
    """Make every `load_pipeline` give the reference pipeline as `cls` (a subclass with another `__call__`)."""
    from videosparse.models import loading

    real = loading.load_pipeline

    def load(*args, **kwargs):
        pipe = real("reference", "cpu").pipe
        pipe.__class__ = cls
        return loading.LoadedPipeline(pipe, name, loading.pipeline_call_defaults(pipe))

    monkeypatch.setattr(loading, "load_pipeline", load)


def test_bench_subcommand_is_the_kernel_benchmark(tmp_path, capsys, monkeypatch):
    """`videosparse bench` takes the kernel benchmark's options (scripts/bench_kernel.py runs the same code): bad
    ones exit 2 naming the value, --readme renders an earlier run's JSON on any machine, and without CUDA it says so."""
    from helpers import load_script

    from videosparse.cli import bench
    from videosparse.eval import kernel_bench

    (tmp_path / "afile").write_text("")
    for bad, match in ((["--shapes", "huge"], "--shapes ['huge'] unknown"), (["--rounds", "0"], "--rounds 0"),
                       (["--deadline-s", "nan"], "--deadline-s nan"),
                       # review find: an --out that cannot be written failed at the first save, after the checks
                       (["--out", str(tmp_path)], "is a directory; give a file path"),
                       (["--out", str(tmp_path / "afile" / "b.json")], "afile' is a file, not a folder.")):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", *bad])
        assert exit_info.value.code == 2 and match in capsys.readouterr().err
    row = dict(shape="s", B=1, H=2, S=256, D=64, ms_rounds=[1.0], plan="random", target_density=0.5, density=0.5)
    rows = [dict(row, impl="cudnn", plan="dense", target_density=1.0, density=1.0, ms=2.0, tflops=10.0),
            dict(row, impl="ours", ms=1.0, tflops=9.0)]
    (tmp_path / "run.json").write_text(json.dumps(dict(rows=rows, meta={}, variants=[])))
    assert main(["bench", "--readme", str(tmp_path / "run.json")]) == 0
    assert "| s | 0.500 | 1.00 | 9 |" in capsys.readouterr().out
    (tmp_path / "other.json").write_text(json.dumps({"synthetic": {}}))        # another report: named, no KeyError
    with pytest.raises(SystemExit, match="other.json: not a kernel benchmark JSON"):
        main(["bench", "--readme", str(tmp_path / "other.json")])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for out in (str(tmp_path / "new" / "k.json"), "/dev/null"):                    # (its folder is made)
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            main(["bench", "--quick", "--out", out])
    for out in ("/dev/stdout", "/proc/self/fd/1", str(tmp_path / "new") + "/"):     # rewritten after each step
        with pytest.raises(SystemExit):
            main(["bench", "--quick", "--out", out])
        assert "is no regular file: the benchmark writes its JSON again" in capsys.readouterr().err
    script = load_script("bench_kernel")
    assert script.random_plan is kernel_bench.random_plan and script.bench is bench


def test_bench_progress_and_summary_lines_are_printed_on_stdout(tmp_path, capsys, monkeypatch):
    """The benchmark logs its progress (`kernel_bench` prints nothing); `videosparse bench` shows those lines on
    stdout, once also with -v, then the summary, the errors and the tables, as the benchmark printed them before."""
    import logging

    from videosparse.eval import kernel_bench

    def fake_run(options):
        kernel_bench._log("check", {"ok": True})
        return dict(meta={"wall_s": 3.2}, correctness=[dict(ok=True), dict(ok=False)], rows=[], variants=[],
                    item_sweep=[], errors=["12x32768 d128: boom"])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel_bench, "run_benchmark", fake_run)
    out_path = tmp_path / "k.json"
    for verbose in ([], ["-v"]):
        assert main([*verbose, "bench", "--out", str(out_path)]) == 1        # a failed check: exit 1
        out, err = capsys.readouterr()
        assert out.splitlines()[:3] == ["check {'ok': True}", f"wrote {out_path} (3 s); correctness: 1/2 ok",
                                        "error: 12x32768 d128: boom"], verbose
        assert "| shape | density |" in out and "check" not in err, verbose
    log = logging.getLogger(kernel_bench.__name__)
    assert log.propagate and not log.handlers                          # the run's stdout handler is gone again


def test_one_estimator_per_expert_from_the_command_line(tmp_path, capsys, monkeypatch):
    """`--estimator A B` gives a tuple of estimators, each serving the transformer it was distilled from (Wan 2.2's
    experts); two of one expert, or one that records no component, are named before the pipeline loads."""
    from videosparse.models import loading
    from videosparse.veda import VedaEstimator

    for component in ("transformer", "transformer_2", None):
        VedaEstimator("WanTransformer3DModel", 2, 2, 64, block=64, tile_shapes=(1, 4, 16),
                      component=component).save_pretrained(tmp_path / str(component))
    high, low, old = (str(tmp_path / name) for name in ("transformer", "transformer_2", "None"))
    args = build_parser().parse_args(["generate", "--estimator", high, low])
    assert method_config(args).estimator == (high, low)
    assert method_config(build_parser().parse_args(["generate", "--estimator", high])).estimator == high

    def no_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the bad argument was named")

    monkeypatch.setattr(loading, "load_pipeline", no_load)
    for estimators, msg in (([high, high], "were both distilled from 'transformer'"),
                            ([old, low], "records no component")):
        assert main(["generate", "--estimator", *estimators]) == 2
        assert msg in capsys.readouterr().err


class _Loaded(Exception):
    """Raised by a stand-in `load_pipeline`: the arguments passed every check before the load."""


def _no_load(monkeypatch) -> None:
    from videosparse.models import loading

    def load(*args, **kwargs):
        raise _Loaded

    monkeypatch.setattr(loading, "load_pipeline", load)


def test_output_paths_that_cannot_be_written_are_named_before_the_load(tmp_path, capsys, monkeypatch):
    """Review 51 (d07, d08, d10): an --out / --json / --output-dir in a folder where no file can be made (/proc) or
    under a file was found after the whole run, with the errno text of a hidden temp file; an empty evaluate --out
    wrote the report into the working directory, an empty --json was dropped."""
    _no_load(monkeypatch)
    import videosparse.distill

    monkeypatch.setattr(videosparse.distill, "run_distillation", lambda cfg: pytest.fail("distilled"))
    monkeypatch.setattr(videosparse.distill, "run_tiling_search", lambda cfg: pytest.fail("searched"))
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "frames").write_text("x")
    cases = [(["generate", "--out", str(afile / "x.mp4")], f"{str(afile)!r} is a file, not a folder"),
             (["generate", "--json", str(afile / "sub" / "s.json")], f"{str(afile)!r} is a file, not a folder"),
             (["generate", "--json", ""], "--json is empty; give a file path"),
             (["evaluate", "--out", ""], "--out is empty; give a directory path"),
             (["evaluate", "--out", str(afile / "sub")], f"{str(afile)!r} is a file, not a folder"),
             (["evaluate", "--out", str(tmp_path / "ev")], "holds a file frames, where the run makes its frames "),
             (["evaluate", "--synthetic", "wan-1.3b", "--out", str(afile / "sub")], "is a file, not a folder"),
             (["distill", "--model", "tiny", "--output-dir", str(afile / "est")], "is a file, not a folder"),
             (["search-tiling", "--model", "tiny", "--output", str(afile / "t.json")], "is a file, not a folder"),
             (["search-tiling", "--model", "tiny", "--output", "sub/"], "ends with a path separator; give a file path")]
    if os.path.isdir("/proc/self"):                 # a folder where no file can be made, even by root
        cases += [(["generate", "--json", "/proc/s.json"], "--json '/proc/s.json' cannot be written: no file can be "
                                                           "made in '/proc'"),
                  (["generate", "--out", "/proc/x.mp4"], "--out '/proc/x.mp4' cannot be written"),
                  (["evaluate", "--out", "/proc/ev"], "--out '/proc/ev' cannot be written"),
                  (["distill", "--model", "tiny", "--output-dir", "/proc/est"], "--output-dir '/proc/est' cannot be "
                                                                               "written"),
                  (["search-tiling", "--model", "tiny", "--output", "/proc/t.json"], "--output '/proc/t.json' cannot "
                                                                                    "be written")]
    monkeypatch.chdir(tmp_path)
    for argv, msg in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and "Errno" not in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ev"]          # nothing written anywhere


def test_a_report_path_that_is_a_folder_is_refused_before_the_load(tmp_path, capsys, monkeypatch):
    """Review 51 (d09): a folder named report.json in --out was found after every cell ran, leaving
    report.json.tmp behind."""
    _no_load(monkeypatch)
    for name in ("report.json", "report.md"):
        out = tmp_path / name.split(".")[1]
        (out / name).mkdir(parents=True)
        for mode in ([], ["--synthetic", "wan-1.3b"]):
            assert main(["evaluate", *mode, "--out", str(out)]) == 2
            assert f"holds a folder {name}, where the run writes its {name} file" in capsys.readouterr().err
        assert [p.name for p in out.iterdir()] == [name]


def test_fps_has_an_upper_bound_checked_before_the_load(capsys, monkeypatch):
    """Review 51 (d17): --fps 1e20 ran the whole generation, then ffmpeg refused the rate."""
    _no_load(monkeypatch)
    assert main(["generate", "--fps", str(10 ** 20)]) == 2
    assert f"--fps={10 ** 20} must be an integer from 1 to 1000" in capsys.readouterr().err
    assert main(["evaluate", "--fps", "1001", "--out", "unused"]) == 2
    assert "--fps=1001 must be at most 1000" in capsys.readouterr().err
    with pytest.raises(_Loaded):                    # the bound itself is taken
        main(["generate", "--fps", "1000"])


def test_evaluate_refuses_flags_it_would_ignore(tmp_path, capsys, monkeypatch):
    """Review 51 (d18): --backend with only dense specs (or specs naming their own backend), and --attn-steps /
    --attn-layers with --attn-cells 0, were taken and ignored."""
    _no_load(monkeypatch)
    out = str(tmp_path / "ev")
    for argv, msg in ((["--methods", "dense", "--backend", "triton"], "--backend triton is for veda and sol specs"),
                      (["--methods", "veda@0.5:backend=reference", "--backend", "triton"], "it would be ignored"),
                      (["--synthetic", "wan-1.3b", "--methods", "dense", "--backend", "reference"], "--backend"),
                      (["--attn-cells", "0", "--attn-steps", "0"], "--attn-steps choose what the attention-level"),
                      (["--attn-cells", "0", "--attn-steps", "0", "--attn-layers", "1"],
                       "--attn-steps and --attn-layers")):
        assert main(["evaluate", *argv, "--out", out]) == 2, argv
        assert msg in capsys.readouterr().err, argv
    for argv in (["--methods", "dense", "veda@0.5", "--backend", "reference"], ["--attn-steps", "0"]):
        with pytest.raises(_Loaded):
            main(["evaluate", *argv, "--out", out])
    assert not os.path.exists(out)


def test_attention_sampling_flags_are_checked_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """--attn-steps '' (nothing sampled), a negative index, or a step past --steps failed only after the pipeline
    loaded (minutes for a real model)."""
    _no_load(monkeypatch)
    out = str(tmp_path / "ev")
    for argv, msg in ((["--attn-steps", ""], "'' samples nothing"), (["--attn-layers", ","], "',' samples nothing"),
                      (["--attn-steps", "0,-1"], "holds [-1]: indices count from 0")):
        with pytest.raises(SystemExit) as exit_:
            main(["evaluate", *argv, "--out", out])
        assert exit_.value.code == 2 and msg in capsys.readouterr().err, argv
    assert main(["evaluate", "--steps", "4", "--attn-steps", "1,4,7", "--out", out]) == 2
    assert "--attn-steps [4, 7]: the run has --steps 4 denoising steps (0..3)" in capsys.readouterr().err
    with pytest.raises(_Loaded):                    # the last step is taken
        main(["evaluate", "--steps", "4", "--attn-steps", "3", "--out", out])
    assert not os.path.exists(out)


def test_a_spec_the_model_refuses_is_named_before_the_dense_cell(tmp_path, capsys):
    """Review 51 (d02): a dense layer the model lacks, or an estimator distilled at block 64 used at the default 128,
    failed after the dense cell was written (ev/ half made), the estimator's message naming generate's --block."""
    from videosparse.veda import VedaEstimator

    VedaEstimator("WanTransformer3DModel", 2, 2, 64, block=64, tile_shapes=(1, 4, 16)).save_pretrained(tmp_path / "e")
    base = ["evaluate", "--model", "tiny", "--steps", "1", "--frames", "5", "--height", "32", "--width", "32",
            "--num-prompts", "1", "--attn-cells", "0", "--no-progress"]
    out = tmp_path / "ev"
    for spec, msg in (("veda:dense_layers=99", "names layers [99], but this WanTransformer3DModel has 2"),
                      (f"veda:estimator={tmp_path / 'e'}", "(pass VedaConfig(block=64), or the spec's :block=64)")):
        assert main([*base, "--methods", spec, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"method spec {spec!r}: " in err and msg in err and "--block" not in err, err
        assert not out.exists()


def test_a_fifo_output_is_written_into_not_replaced(tmp_path, capsys):
    """Review 51 (d06): the atomic write (temp file + rename) put a regular file in place of a FIFO given as --json
    (and, as root, of /dev/null). The FIFO is opened for reading first, so the write does not wait for a reader."""
    import stat

    fifo = tmp_path / "s.json"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert main(["generate", "--model", "tiny", "--steps", "1", "--frames", "5", "--height", "32", "--width", "32",
                     "--out", str(tmp_path / "v.mp4"), "--json", str(fifo)]) == 0
        summary = json.loads(os.read(reader, 1 << 16))
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and summary["seed"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "v.mp4"]


def test_bench_readme_names_the_file_for_any_json_that_is_no_benchmark(tmp_path):
    """Review 51 (d05): an A/B JSON of benchmarks/ (rows without 'impl') or {"rows": [1]} gave a KeyError / TypeError
    traceback, a file that is no JSON an error naming neither --readme nor the file."""
    row = dict(shape="s", plan="random", target_density=0.5, density=0.5, impl="ours", ms=1.0, tflops=9.0)
    ab = json.dumps({"rows": [{"shape": "s", "tflops": 1.0}]})
    for name, text, msg in (("ab.json", ab, r"rows\[0\] lacks \['impl'\]"),
                            ("ints.json", '{"rows": [1]}', r"rows\[0\] is a JSON int"),
                            ("damaged.json", json.dumps({"rows": [dict(row, ms=None)]}), "a row cannot be read"),
                            ("broken.json", "{", "cannot be read as JSON"),
                            ("missing.json", None, "cannot be read as JSON")):
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(SystemExit, match=f"--readme {path}: .*{msg}"):
            main(["bench", "--readme", str(path)])
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--readme", ""])
    assert exit_info.value.code == 2


def test_generate_names_a_backend_that_cannot_run_here_before_any_step(tmp_path, capsys, monkeypatch):
    """Review find: `generate --backend triton` on a CPU without the interpreter ran its dense steps, then failed at
    the first sparse forward."""
    from videosparse.eval import generate as generate_module
    from videosparse.kernels._triton_utils import interpreter_active

    if interpreter_active():
        pytest.skip("under TRITON_INTERPRET=1 the Triton backend runs on the CPU")

    def no_run(*args, **kwargs):
        raise AssertionError("the pipeline ran before the backend was checked")

    monkeypatch.setattr(generate_module, "generate", no_run)
    monkeypatch.setattr(generate_module, "warm_up", no_run)
    out = tmp_path / "v.mp4"
    assert main(["generate", "--model", "tiny", "--backend", "triton", "--steps", "2", "--out", str(out)]) == 2
    assert "backend='triton' cannot run this transformer's attention" in capsys.readouterr().err
    assert not out.exists()


def test_every_script_answers_help_without_running(monkeypatch, capsys):
    """Review find: two scripts ignored every argument, --help included: one ran its probe, one would have run its
    GPU benchmark and overwritten the shipped JSON. Each script's --help prints its usage and exits 0, and leaves
    the package's module-level settings as they were (session 64: `bench_head_tiling.py` set
    `videosparse.layout.KEEP_HEAD_ORDERS_BYTES` to 0 before parsing its arguments, so every later per-head tiling
    in the process expanded its orders per call, and a later test of the kept orders failed)."""
    import importlib
    import pkgutil
    import runpy

    import videosparse

    def settings():
        modules = [importlib.import_module(m.name) for m in pkgutil.walk_packages(videosparse.__path__, "videosparse.")]
        return {(module.__name__, attr): value for module in modules for attr, value in vars(module).items()
                if attr.isupper() and isinstance(value, (bool, int, float, str, tuple, frozenset))}

    before = settings()
    assert ("videosparse.layout", "KEEP_HEAD_ORDERS_BYTES") in before
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    monkeypatch.syspath_prepend(str(scripts))
    names = sorted(p for p in scripts.glob("*.py") if not p.name.startswith("_"))
    assert len(names) > 30
    for path in names:
        monkeypatch.setattr(sys, "argv", [str(path), "--help"])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(path), run_name="__main__")
        out = capsys.readouterr().out
        assert exit_info.value.code in (0, None) and out.startswith("usage:"), (path.name, exit_info.value.code)
        now = settings()
        changed = {key: (value, now[key]) for key, value in before.items() if now[key] != value}
        assert not changed, (path.name, changed)


def test_the_early_kernel_check_asks_about_the_dtype_the_run_attends_in(tmp_path, monkeypatch):
    """Review find: the check before the dense steps asked about the dtype of the transformer's first parameter: Wan's
    scale_shift_table, kept in fp32 by diffusers in a bf16 model, so on a GPU every Triton backend was refused for a
    run that attends in bf16."""
    import videosparse
    from diffusers import WanPipeline

    from videosparse.eval.generate import check_config_applies
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline
    from videosparse.processors.session import SparseSession

    build_tiny_wan_pipeline().save_pretrained(tmp_path)
    pipe = WanPipeline.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert next(pipe.transformer.parameters()).dtype == torch.float32          # (the fp32 table comes first)
    asked = []
    check = SparseSession.check_kernel
    monkeypatch.setattr(SparseSession, "check_kernel", lambda self, device, dtype: (asked.append(dtype),
                                                                                    check(self, device, dtype))[1])
    config = videosparse.SolConfig(density=0.5, block=64, tiling=(1, 4, 16))
    check_config_applies(pipe, config, "cpu")
    videosparse.apply(pipe, config)
    pipe(prompt="a cat", num_frames=5, height=32, width=32, num_inference_steps=1, output_type="latent")
    videosparse.remove(pipe)
    assert asked == [torch.bfloat16, torch.bfloat16]


def test_an_estimator_and_a_tiling_that_disagree_are_named_before_the_load(tmp_path, capsys, monkeypatch):
    """generate --estimator E --tiling T with T's tile shapes not those E was distilled with (or T searched for
    another model) failed only once the transformer had loaded."""
    from videosparse import VedaConfig
    from videosparse.eval.spec import check_config_files
    from videosparse.veda import VedaEstimator
    from videosparse.veda.tiling import Tiling

    _no_load(monkeypatch)
    VedaEstimator("WanTransformer3DModel", 2, 2, 64, block=64, tile_shapes=(1, 4, 16)).save_pretrained(tmp_path / "e")
    meta = {"model_class": "WanTransformer3DModel", "num_layers": 2, "num_heads": 2}
    Tiling((((1, 4, 16),) * 2,) * 2, 64, meta).save(tmp_path / "same.json")
    Tiling((((1, 4, 16), (2, 2, 16)),) * 2, 64, meta).save(tmp_path / "other.json")
    Tiling((((1, 4, 16),) * 2,) * 3, 64, {**meta, "num_layers": 3}).save(tmp_path / "deeper.json")
    base = ["generate", "--estimator", str(tmp_path / "e"), "--block", "64", "--out", str(tmp_path / "v.mp4")]
    for tiling, msg in (("2x2x16", "--estimator '%s' with --tiling (2, 2, 16): " % (tmp_path / "e")),
                        (str(tmp_path / "other.json"), "tile shapes of layer 0: estimator was distilled with"),
                        (str(tmp_path / "deeper.json"), "are for other models: tiling file")):
        assert main([*base, "--tiling", tiling]) == 2, tiling
        assert msg in capsys.readouterr().err, tiling
    for tiling in ("1x4x16", str(tmp_path / "same.json")):   # the estimator's own shapes are taken
        with pytest.raises(_Loaded):
            main([*base, "--tiling", tiling])
    assert not (tmp_path / "v.mp4").exists()
    assert "(the estimator's: 2)" in str(pytest.raises(ValueError, check_config_files, VedaConfig(
        density=0.5, block=64, estimator=str(tmp_path / "e"), tiling=str(tmp_path / "deeper.json"))).value)
    # an evaluate spec: the hints name the spec's own fields, not generate's flags (which evaluate does not take)
    for spec, msg in ((f"veda:estimator={tmp_path / 'e'}:tiling=2x2x16:block=64", "(the spec's :tiling=1x4x16)"),
                      (f"veda:estimator={tmp_path / 'e'}:tiling=1x8x16", "or the spec's :block=64")):
        assert main(["evaluate", "--methods", spec, "--out", str(tmp_path / "ev")]) == 2
        err = capsys.readouterr().err
        assert msg in err and "--tiling" not in err and "--block" not in err, err


def test_compare_dense_psnr_is_the_one_evaluate_reports(tmp_path, monkeypatch):
    """Review 54: `generate --compare-dense` compared fp32 frames where `evaluate` compares the frames it stores,
    rounded to fp16 (64.91 against 64.60 dB for the same two videos of the tiny model)."""
    from videosparse.eval import metrics

    seen = []
    real = metrics.psnr_video
    monkeypatch.setattr(metrics, "psnr_video", lambda a, b: (seen.append((a.dtype, b.dtype)), real(a, b))[1])
    assert main(["generate", "--frames", "5", "--height", "32", "--width", "32", "--steps", "1", "--density", "0.5",
                 "--tiling", "1x4x16", "--block", "64", "--out", str(tmp_path / "v.mp4"), "--compare-dense"]) == 0
    assert seen == [(np.float16, np.float16)]


def test_sol_without_density_or_tau_uses_the_documented_density(capsys):
    """Mutation testing: `generate --method sol` must default to density 0.15, as its --density help and the README
    say (only the Veda default, 0.1, was tested)."""
    assert method_config(build_parser().parse_args(["generate", "--method", "sol"])) == SolConfig(density=0.15)
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "(default 0.1 veda / 0.15 sol)" in " ".join(capsys.readouterr().out.split())


def test_compare_dense_times_steps_by_transformer_time_and_speedup_is_dense_over_sparse(tmp_path, capsys,
                                                                                       monkeypatch):
    """Mutation testing: `generate` reads the time per step from the transformer forwards (not the wall clock, which
    holds the text encoder and the VAE), and --compare-dense's speedup is dense time / sparse time; both arms are
    faked with known times (sparse 0.1 s per forward, dense 0.3 s, 4 forwards in 2 steps)."""
    from videosparse.eval import generate as generate_module
    from videosparse.eval.generate import GenerationResult

    rng = np.random.default_rng(0)
    frames = {arm: rng.uniform(0.2, 0.8, (5, 32, 32, 3)).astype(np.float32) for arm in ("sparse", "dense")}
    stats = {"transformer": {"density": 0.5, "sparse_calls": 4, "dense_calls": 0, "kernel_backend": "reference"}}

    warm_ups = []

    def fake_generate(pipe, config, call, seed=0, device=None, output_type="np"):
        if output_type == "latent":                     # each arm's untimed warm-up (on the CPU too, review 59)
            warm_ups.append("dense" if config is None else "sparse")
        if config is None:
            return GenerationResult(frames["dense"], [0.3] * 4, 20.0, None)
        return GenerationResult(frames["sparse"], [0.1] * 4, 9.0, stats)

    monkeypatch.setattr(generate_module, "generate", fake_generate)
    js = tmp_path / "s.json"
    assert main(["generate", "--frames", "5", "--height", "32", "--width", "32", "--steps", "2", "--density", "0.5",
                 "--out", str(tmp_path / "v.mp4"), "--json", str(js), "--compare-dense"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(js.read_text())
    assert summary["transformer_s_per_step"] == pytest.approx(0.2) and summary["timed_per"] == "step"
    assert summary["dense"]["transformer_s_per_step"] == pytest.approx(0.6)
    assert summary["dense"]["speedup"] == pytest.approx(3.0) and summary["wall_s"] == 9.0
    assert "200.0 ms transformer time per step" in out and "600.0 ms per step -> speedup 3.00x" in out
    assert warm_ups == ["sparse", "dense"] and "(each arm after an untimed warm-up run)" in out


def test_ctrl_c_ends_a_command_without_a_traceback(monkeypatch, capsys):
    """Review 59: Ctrl-C in `evaluate` printed a KeyboardInterrupt traceback; now one line that says whether a rerun
    resumes, exit status 130 (the shell's for SIGINT)."""
    from videosparse.cli import evaluate

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "run", interrupted)
    assert main(["evaluate", "--out", "nowhere"]) == 130
    assert capsys.readouterr().err.strip() == ("interrupted; the same command run again resumes from the cells "
                                               "already measured")


def test_a_prompts_file_whose_name_starts_with_a_bracket_is_read_as_the_file(tmp_path, monkeypatch):
    """Mutation find: `--prompts` is an inline JSON list only where it starts with "[" and names no file; with the
    file check dropped, a prompts file named "[v2] prompts.txt" was parsed as (broken) inline JSON and refused."""
    from videosparse.eval.evaluate import load_prompts

    monkeypatch.chdir(tmp_path)
    (tmp_path / "[v2] prompts.txt").write_text("a cat\na dog\n")
    (tmp_path / "[1].json").write_text('["a red circle"]')        # a file that is an inline list's text too
    assert load_prompts("[v2] prompts.txt") == ["a cat", "a dog"]
    assert load_prompts("[1].json") == ["a red circle"]


def test_a_json_prompt_list_refuses_a_prompt_of_blanks_only(tmp_path):
    """Mutation find: a prompt of only spaces in a JSON list (inline or in a file) must be refused like "" (a check
    of `not p` instead of `not p.strip()` let it through as an empty prompt after stripping)."""
    from videosparse.distill.config import read_prompts
    from videosparse.eval.evaluate import load_prompts

    with pytest.raises(ValueError, match=r"""--prompts '\["a cat", "   "\]' holds a JSON list that has "   " at """
                                         "position 1"):
        load_prompts('["a cat", "   "]')
    path = tmp_path / "p.json"
    path.write_text('["a cat", "\\t "]')
    for read in (read_prompts, load_prompts):
        with pytest.raises(ValueError, match=r'p.json\' holds a JSON list that has "\\t " at position 1'):
            read(str(path))


def test_ctrl_c_in_distill_names_its_resume_and_other_commands_only_stop(monkeypatch, capsys):
    """Mutation find: only evaluate's Ctrl-C line was tested; distill's (its samples and checkpoint resume) could
    lose its words (a misspelt key), and a command that resumes nothing (generate, search-tiling) could claim a
    resume ("resumes from None", or a default text)."""
    from videosparse.cli import distill, generate, search_tiling

    def interrupted(args):
        raise KeyboardInterrupt

    for command in (distill, generate, search_tiling):
        monkeypatch.setattr(command, "run", interrupted)
    assert main(["distill", "--output-dir", "nowhere"]) == 130
    assert capsys.readouterr().err.strip() == ("interrupted; the same command run again resumes from the samples "
                                               "captured and the last checkpoint")
    for argv in (["generate"], ["search-tiling", "--output", "nowhere.json"]):
        assert main(argv) == 130, argv
        assert capsys.readouterr().err.strip() == "interrupted", argv
