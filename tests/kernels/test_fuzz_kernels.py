"""scripts/fuzz_kernels.py: the draws cover what they claim, a wrong kernel output fails, and the Triton kernels pass
a short run under the interpreter (a child process: TRITON_INTERPRET=1 must be set before triton is imported)."""

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_draws_cover_every_feature():
    fuzz = load_script("fuzz_kernels")
    rng = random.Random(0)
    cases = [fuzz.draw_case(rng, 5000) for _ in range(300)]
    assert {c["rows"] for c in cases} == set(fuzz.ROWS)
    assert {c["order"] for c in cases} == {None, "work_order", "random"}
    assert {c["head_dim"] for c in cases} == {64, 80, 96, 128} and {c["block"] for c in cases} == {64, 128}
    for key in ("correction", "valid_keys", "full_width"):
        assert {c[key] for c in cases} == {True, False}
    assert any(c["keys"] != c["seq"] for c in cases) and all(16 <= c["seq"] <= 5000 for c in cases)
    assert any(c["density"] == 1.0 for c in cases) and any(c["scale"] for c in cases)


def test_plans_are_valid_and_the_reference_passes(monkeypatch):
    fuzz = load_script("fuzz_kernels")
    rng = random.Random(1)
    for _ in range(12):
        case = fuzz.draw_case(rng, 600)
        q, k, v, plan = fuzz.build_inputs(case, "cpu")
        plan.validate(q, k, v)
        assert fuzz.check_case(case, ["reference"], "cpu")["reference"]["status"] == "ok"


def test_a_wrong_output_fails(monkeypatch):
    fuzz = load_script("fuzz_kernels")
    real = fuzz.block_sparse_attention

    def off_by_a_bit(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out * 1.05, lse

    monkeypatch.setattr(fuzz, "block_sparse_attention", off_by_a_bit)
    case = {**fuzz.draw_case(random.Random(2), 300), "rows": "uniform", "density": 0.5, "dtype": "float16"}
    result = fuzz.check_case(case, ["reference"], "cpu")["reference"]
    assert result["status"] == "fail" and result["rel_err"] > 0.04


def test_triton_kernels_pass_a_short_run_under_the_interpreter(tmp_path):
    out = tmp_path / "fuzz.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "fuzz_kernels.py"), "--device", "cpu", "--backends",
                          "triton", "--cases", "6", "--max-seq", "300", "--seed", "3", "--out", str(out)],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(out.read_text())
    assert report["summary"]["triton"]["ok"] == 6 and len(report["cases"]) == 6
    assert torch.isfinite(torch.tensor([c["results"]["triton"]["rel_err"] for c in report["cases"]])).all()


def test_time_limit_ends_the_run_with_its_summary(tmp_path):
    fuzz = load_script("fuzz_kernels")
    report = fuzz.main(["--device", "cpu", "--backends", "reference", "--cases", "50", "--max-seq", "200",
                        "--time-limit", "0", "--out", str(tmp_path / "f.json")])
    assert report["stopped_at_time_limit"] and len(report["cases"]) <= 1 and not report["failed"]
    assert json.loads((tmp_path / "f.json").read_text())["summary"]["reference"]["fail"] == 0


def test_a_run_that_checks_nothing_fails_and_bad_arguments_are_named(tmp_path, capsys):
    """Review finds: a mistyped backend or one that cannot run here counted as "not supported" and exited 0 having
    checked nothing; a directory as --out failed after every case, --only past the cases with an IndexError."""
    fuzz = load_script("fuzz_kernels")
    if os.environ.get("TRITON_INTERPRET") != "1":   # without it the generic kernel cannot run CPU tensors at all
        report = fuzz.main(["--device", "cpu", "--backends", "triton_generic", "--cases", "2", "--max-seq", "100"])
        assert report["failed"] and "nothing was checked" in capsys.readouterr().out
    for argv, match in ((["--backends", "tritn"], "not known"), (["--out", str(tmp_path)], "is a directory"),
                        (["--only", "99", "--cases", "5"], r"lie in \[0, 4\]"), (["--max-seq", "0"], ">= 16")):
        with pytest.raises(SystemExit):
            fuzz.main(["--device", "cpu", *argv])
        assert re.search(match, capsys.readouterr().err)
