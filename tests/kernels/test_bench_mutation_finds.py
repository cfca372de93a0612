"""Tests from a mutation pass over `videosparse.eval.kernel_bench` and its command's checks (`videosparse.cli.bench`):
each guards a behaviour that a one-line change left every other test passing (CPU; no timing runs)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from videosparse.eval import kernel_bench


def _row(**kw):
    return dict(dict(shape="s", B=1, H=2, S=256, D=64, ms_rounds=[1.0], plan="random", target_density=0.5,
                     density=0.5, impl="ours", ms=1.0, tflops=9.0), **kw)


def test_readme_names_a_row_without_a_shape(tmp_path):
    """Mutation find: `readme_tables` checks every row for both 'impl' and 'shape' (a row with 'impl' alone is named as
    lacking 'shape', not reported as an unreadable row)."""
    path = tmp_path / "noshape.json"
    path.write_text(json.dumps(dict(rows=[{"impl": "ours", "plan": "random", "ms": 1.0}])))
    with pytest.raises(ValueError, match=r"rows\[0\] lacks \['shape'\]"):
        kernel_bench.readme_tables(path)


def test_report_tables_put_the_kernel_table_before_the_variants():
    """Mutation find: `report_tables` is the README table (its caption first), then the variants' table."""
    variants = [dict(S=256, D=64, target_density=0.1, variant="default", tflops=400.0)]
    text = kernel_bench.report_tables(dict(rows=[_row()], meta={}, variants=variants))
    assert text.startswith("Kernel benchmark on ?")
    assert text.index("| shape | density |") < text.index("| variant | 256 d64 0.1 |")


def test_the_readme_table_has_one_line_per_random_plan_of_ours():
    """Mutation find: `render_markdown` tabulates ours on random top-k plans only: a banded plan's row of ours (timed
    too, at the same target) gets no line of its own."""
    rows = [_row(), _row(plan="banded", density=0.48, ms=0.9, tflops=9.5)]
    lines = [line for line in kernel_bench.render_markdown(dict(rows=rows, meta={})).splitlines()
             if line.startswith("| s |")]
    assert lines == ["| s | 0.500 | 1.00 | 9 | – | – | – | – | – |"]


def test_a_variant_timed_at_some_columns_only_keeps_its_line():
    """Mutation find: `render_variants` shows a variant timed at some of the (S, D, density) columns (the others marked
    '–'); only a variant with no timing at all is left out."""
    recs = [dict(S=256, D=64, target_density=t, variant="default", tflops=400.0 + t) for t in (1.0, 0.1)]
    recs.append(dict(S=256, D=64, target_density=0.1, variant="gluon_register_store", tflops=380.0))
    lines = kernel_bench.render_variants(dict(variants=recs)).splitlines()
    assert f"| {kernel_bench.VARIANT_LABELS['gluon_register_store']} | – | 380 |" in lines
    assert len(lines) == 4


def _run_with_fakes(monkeypatch, tmp_path, **options):
    """`run_benchmark` with every GPU part replaced: returns the steps it ran, in order, and its results."""
    steps = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(kernel_bench, "gpu_state", lambda run=None: {})
    monkeypatch.setattr(kernel_bench, "check_correctness", lambda results, deadline: None)
    monkeypatch.setattr(kernel_bench, "bench_shape", lambda name, results, args, deadline: steps.append(name))
    monkeypatch.setattr(kernel_bench, "bench_variants", lambda results, args, deadline: steps.append("variants"))
    monkeypatch.setattr(kernel_bench, "bench_item_sweep", lambda results, args, deadline: steps.append("item sweep"))
    opts = dict(quick=False, out=str(tmp_path / "new" / "k.json"), shapes=None, no_peers=True, no_variants=False,
                item_sweep=False, rounds=1, deadline_s=60.0)
    results = kernel_bench.run_benchmark(types.SimpleNamespace(**{**opts, **options}))
    return steps, results


def test_run_benchmark_runs_the_steps_asked_for_most_important_first(monkeypatch, tmp_path):
    """Mutation find: `run_benchmark` runs the peer shapes first, then the variants (not with --no-variants), the item
    sweep (with --item-sweep), then the other shapes; `--shapes` given empty runs no shape at all (not every shape)."""
    steps, results = _run_with_fakes(monkeypatch, tmp_path)
    peers = [n for n in kernel_bench.SHAPES if n in kernel_bench.PEER_SHAPES]
    rest = [n for n in kernel_bench.SHAPES if n not in kernel_bench.PEER_SHAPES]
    assert steps == peers + ["variants"] + rest
    assert json.loads((tmp_path / "new" / "k.json").read_text())["meta"]["gpu"] == "fake GPU"
    assert kernel_bench.exit_code(results) == 0
    steps, _ = _run_with_fakes(monkeypatch, tmp_path, no_variants=True, item_sweep=True)
    assert steps == peers + ["item sweep"] + rest
    steps, _ = _run_with_fakes(monkeypatch, tmp_path, shapes=[], no_variants=True, item_sweep=True)
    assert steps == ["item sweep"]


def test_banded_plan_width_rounds_to_the_target_density():
    """Mutation find: `banded_plan` takes the band half-width nearest to the target density (rounded, not floored):
    at 256 tiles and density 0.05, 6 tiles each side (13 per row), whose density is the closest to 0.05."""
    plan = kernel_bench.banded_plan(1, 1, 32768, 0.05, 128, "cpu")
    assert int(plan.kv_count.max()) == 13
    assert abs(kernel_bench.plan_density(plan, 32768) - 0.05) < 0.002


def test_plan_density_counts_a_partial_last_key_tile():
    """Mutation find: `plan_density` divides by ceil(S / block) key tiles: a dense plan over 4000 tokens (31 full tiles
    and a partial one) has density 1, not 32 / 31."""
    plan = kernel_bench.random_plan(1, 2, 4000, 1.0, 128, "cpu")
    assert kernel_bench.plan_density(plan, 4000) == 1.0

