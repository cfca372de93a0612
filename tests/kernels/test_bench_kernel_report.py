"""The kernel benchmark's timing order and report tables (`videosparse bench`, scripts/bench_kernel.py; CPU, the
timings themselves need a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers import gluon_compiles, load_script

from videosparse.eval import kernel_bench


def test_interleaved_rounds_alternate_the_order_and_report_the_median():
    bench = kernel_bench
    calls = []
    fake_ms = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 9.0, 4.0]), "c": iter([1.0, 1.0, 7.0])}

    def timer(fn):
        calls.append(fn())
        return next(fake_ms[calls[-1]])

    times = bench.time_interleaved({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, 3, timer)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert times == {"a": [3.0, 1.0, 2.0], "b": [5.0, 9.0, 4.0], "c": [1.0, 1.0, 7.0]}
    assert [bench.median(times[k]) for k in "abc"] == [2.0, 5.0, 1.0]
    assert bench.median([4.0, 1.0]) == 2.5


def test_report_tables_come_from_the_json_rows():
    bench = kernel_bench
    base = dict(shape="s", B=1, H=2, S=256, D=64, ms_rounds=[1.0])
    rows = [dict(base, impl="cudnn", plan="dense", target_density=1.0, density=1.0, ms=2.0, tflops=10.0),
            dict(base, impl="ours", plan="random", target_density=0.5, density=0.5, ms=1.0, tflops=9.0),
            dict(base, impl="ours+corr", plan="random", target_density=0.5, density=0.5, ms=0.98, tflops=9.2,
                 overhead=-0.02),
            dict(base, impl="fa4", plan="random", target_density=0.5, density=0.5, ms=1.25, tflops=7.2)]
    table = bench.render_markdown(dict(rows=rows, meta={}))
    assert "| s | 0.500 | 1.00 | 9 | -2.0% | 2.00× | – | 7 | 1.25 |" in table
    variants = [dict(S=256, D=64, target_density=0.1, variant="default", tflops=400.0),
                dict(S=256, D=64, target_density=0.1, variant="gluon_register_store", tflops=380.4),
                dict(S=256, D=64, target_density=0.1, variant="broken", error="RuntimeError: x")]
    vt = bench.render_variants(dict(variants=variants)).splitlines()
    assert vt[0] == "| variant | 256 d64 0.1 |"
    assert vt[2] == f"| {bench.VARIANT_LABELS['default']} | 400 |"
    assert vt[3] == f"| {bench.VARIANT_LABELS['gluon_register_store']} | 380 |"
    assert len(vt) == 4          # the failed variant has no timing and no row
    assert bench.render_variants(dict(variants=[])) == ""


def test_item_sweep_fits_fixed_and_per_tile_cost(monkeypatch):
    """The work-item sweep: equal-length items from fixed-count plans, a least-squares fit of time per wave
    (run on CPU with a tiny shape, the reference backend and a stand-in timer)."""
    import types

    import torch
    import triton.testing

    bench = kernel_bench
    fit = bench.fit_item_cost([(8, 5.0 + 8 * 1.5), (16, 5.0 + 16 * 1.5), (32, 5.0 + 32 * 1.5)])
    assert abs(fit["fixed_us"] - 5.0) < 1e-9 and abs(fit["per_tile_us"] - 1.5) < 1e-9

    plan = bench.fixed_count_plan(2, 3, 1000, 3, 128, "cpu")
    q = torch.randn(2, 3, 1000, 64)
    plan.validate(q, q, q)
    assert bool((plan.kv_count == 3).all()) and plan.kv_index.shape == (2, 3, 8, 3)
    assert plan.order is not None and sorted(plan.order.tolist()) == list(range(2 * 3 * 8))

    ran = []

    def timer(fn, **kwargs):
        out = fn()
        ran.append(out.shape)
        return 1.0 + 0.25 * len(ran)       # later calls "slower": the fit must still come out finite

    monkeypatch.setattr(triton.testing, "do_bench", timer)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "ITEM_SWEEP", dict(B=1, H=2, S=300, head_dims=(64,), counts=(1, 2, 3), dtype="float32"))
    results = dict(item_sweep=[], errors=[])
    bench.bench_item_sweep(results, types.SimpleNamespace(rounds=2), deadline=float("inf"))
    (sweep,) = results["item_sweep"]
    assert [r["n"] for r in sweep["rows"]] == [1, 2, 3] and len(ran) == 6
    assert all(r["waves"] == 6 and len(r["ms_rounds"]) == 2 for r in sweep["rows"])    # 1 x 2 x 3 items, 1 "SM"
    assert set(sweep) >= {"fixed_us", "per_tile_us"} and results["errors"] == []
    assert list(sweep["fits"]) == ["ours"] and {r["impl"] for r in sweep["rows"]} == {"ours"}   # no FA4 on CPU
    assert sweep["fits"]["ours"]["fixed_us"] == sweep["fixed_us"]


def test_gpu_state_reads_nvidia_smi_and_is_empty_without_it():
    bench = kernel_bench
    line = "1755 MHz, 1980 MHz, 688.12 W, 700.00 W, 51, 0x0000000000000004\n"
    state = bench.gpu_state(run=lambda cmd: line)
    assert state["clocks.sm"] == "1755 MHz" and state["clocks_throttle_reasons.active"] == "0x0000000000000004"
    assert set(state) == set(bench.GPU_STATE_FIELDS)

    def missing(cmd):
        raise FileNotFoundError("nvidia-smi")

    assert bench.gpu_state(run=missing) == {}
    assert bench.gpu_state(run=lambda cmd: "") == {}
    assert bench.gpu_state(run=lambda cmd: "[N/A], 1980 MHz\n") == {}       # unexpected answer: no state


def test_ab_gluon_loads_a_kernel_copy_from_another_revision(tmp_path):
    """scripts/ab_gluon.py imports a gluon_hopper.py copy kept outside the package (relative imports rewritten)
    as its own module, which compiles for sm_90 like the package's kernel."""
    import pytest

    pytest.importorskip("triton.experimental.gluon")
    if not gluon_compiles():
        pytest.skip("the Gluon kernel needs Triton 3.6 or newer")
    from pathlib import Path

    ab = load_script("ab_gluon")
    src = Path(__file__).resolve().parents[2] / "videosparse" / "kernels" / "gluon_hopper.py"
    copy = tmp_path / "old_gluon.py"
    copy.write_text(src.read_text())
    mod = ab.load_kernel_module(copy, name="ab_test_gluon_copy")
    from videosparse.kernels import gluon_hopper

    assert mod is not gluon_hopper and mod.gluon_attention is not gluon_hopper.gluon_attention
    assert mod._gluon_fwd is not gluon_hopper._gluon_fwd
    kernel = mod.compile_for_sm90(head_dim=64)
    assert "wgmma.mma_async" in kernel.asm["ptx"]


def test_ab_gluon_loads_a_folder_of_kernel_copies_as_one_package(tmp_path):
    """A --baseline folder (here the Triton Hopper kernel and its helpers): the module imports its helpers from the
    folder, not from this tree, and compiles for sm_90; a folder without the module is a clear error."""
    import pytest

    from videosparse.kernels import _triton_utils, triton_hopper

    ab = load_script("ab_gluon")
    src = Path(__file__).resolve().parents[2] / "videosparse" / "kernels"
    for name in ("triton_hopper", "_triton_utils"):
        (tmp_path / f"{name}.py").write_text((src / f"{name}.py").read_text())
    mod = ab.load_kernel_module(tmp_path, name="ab_test_triton_copy", module="triton_hopper")
    helpers = sys.modules["ab_test_triton_copy._triton_utils"]
    assert mod is not triton_hopper and helpers is not _triton_utils
    assert mod.partial_state is helpers.partial_state is not _triton_utils.partial_state
    assert mod.Plan is triton_hopper.Plan            # everything else comes from this tree
    assert "wgmma.mma_async" in mod.compile_for_sm90(head_dim=64).asm["ptx"]
    with pytest.raises(ValueError, match="gluon_hopper"):
        ab.load_kernel_module(tmp_path, name="ab_test_missing", module="gluon_hopper")


def test_power_summary_splits_the_cool_start_from_the_steady_half():
    """scripts/bench_power.py: TFLOP/s over the first 100 ms and over the second half of a sustained run, and the
    median clock and power of the samples in that half only; nvidia-smi lines it cannot read are skipped."""
    import math

    power = load_script("bench_power")
    # 1 TFLOP per call; 20 calls per 0.1 s at first (200 TFLOP/s), then 10 per 0.1 s (100 TFLOP/s)
    chunks = [(0.0, 0), (0.1, 20)] + [(0.1 + 0.1 * i, 20 + 10 * i) for i in range(1, 10)]
    samples = [(0.05, 1980.0, 400.0), (0.3, 1700.0, 650.0), (0.6, 1500.0, 700.0), (0.8, 1520.0, 690.0),
               (0.9, 1510.0, 700.0), (2.0, 345.0, 80.0)]
    out = power.summarize(chunks, samples, flops=1e12)
    assert math.isclose(out["tflops_first"], 200.0) and math.isclose(out["tflops_steady"], 100.0)
    assert out["n_samples"] == 3 and out["clock_mhz"] == 1510.0 and out["power_w"] == 700.0
    assert math.isclose(out["tflops_per_w"], 100.0 / 700.0)
    assert power.parse_sample(" 1515, 669.33\n", 1.0) == (1.0, 1515.0, 669.33)
    assert power.parse_sample("[N/A], 80.0", 1.0) is None and power.parse_sample("", 1.0) is None


def test_ncu_stall_summary_splits_roles_and_weights_by_samples(tmp_path):
    """scripts/ncu_stalls.py on a hand-made source page: code between USETMAXREG markers is labelled by what it
    issues, and shares, stall reasons and the instruction mix are weighted by samples and executed counts."""
    import csv

    ncu = load_script("ncu_stalls")
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
              "Instructions Executed", "stall_barrier", "stall_wait", "stall_long_sb", "stall_wait (Not Issued)"]
    lines = [("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", 0, 0, 0, 0, 0),      # consumer code
             ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT", 10, 100, 0, 10, 0),
             ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 30, 100, 30, 0, 0),
             ("@!P1 MUFU.EX2 R1, R1", 20, 300, 0, 20, 0),
             ("USETMAXREG.DEALLOC.CTAPOOL 0x18", 0, 0, 0, 0, 0),             # loader code
             ("UTMALDG.2D [UR8], [UR14]", 5, 10, 0, 0, 5),
             ("@!P3 BRA 0x100", 35, 10, 0, 0, 35)]
    path = tmp_path / "source.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(['"Kernel Name"', "_gluon_fwd"])
        w.writerow(header)
        for i, (sass, samples, executed, barrier, wait, long_sb) in enumerate(lines):
            w.writerow([hex(0x1000 + 16 * i), sass, samples, samples, executed, barrier, wait, long_sb, 0])
    roles = ncu.summarize_source(path)
    assert set(roles) == {"consumer", "loader"}
    consumer, loader = roles["consumer"], roles["loader"]
    assert consumer["sample_share"] == 60.0 and loader["sample_share"] == 40.0
    assert consumer["stalls"] == {"barrier": 50.0, "wait": 50.0}
    assert loader["stalls"] == {"long_sb": 100.0}
    assert consumer["instruction_mix"]["MUFU"] == 60.0          # predicated instructions count by their opcode
    assert consumer["hottest"][0] == dict(sass="WARPGROUP.DEPBAR.LE gsb0, 0x0", share=50.0, stalls={"barrier": 100.0})


def test_ab_work_order_plans_are_valid_and_its_orders_are_permutations():
    """scripts/ab_work_order.py: every plan it times is valid at its token count, and every order it compares is a
    permutation of the plan rows; `exact` is longest first, `class` longest first by power-of-two class, `head`
    keeps each head's rows together."""
    import torch

    ab = load_script("ab_work_order")
    for name, (plan, tokens) in ab.plans(3, 2048, 128, "cpu").items():
        q = torch.zeros(1, 3, tokens, 16)
        plan.validate(q, q)
        n = plan.kv_count.numel()
        for order_name, order in ab.orders(plan.kv_count).items():
            assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(n)), (name, order_name)
        flat = plan.kv_count.reshape(-1)
        exact = flat[ab.exact_order(plan.kv_count).long()]
        assert (exact[1:] <= exact[:-1]).all(), name
        heads = ab.head_order(plan.kv_count).long() // plan.kv_count.shape[-1]
        assert int((heads[1:] != heads[:-1]).sum()) == plan.kv_count.shape[1] - 1, name
        bits = torch.frexp(flat[ab.class_order(plan.kv_count).long()].float()).exponent
        assert (bits[1:] <= bits[:-1]).all(), name
    counts = torch.tensor([[[3, 1, 2], [2, 2, 3]]])
    p = ab.counts_plan(counts, torch.Generator().manual_seed(0))
    assert torch.equal(p.kv_count, counts.int())


def test_bad_arguments_are_argparse_errors_and_failures_exit_1(tmp_path, capsys):
    """Review finds: a --shapes typo was caught per shape and the run exited 0, as did failed correctness checks;
    --rounds 0 crashed in median; the JSON was rewritten in place after each step."""
    import json

    import pytest

    from videosparse.cli import bench as command

    bench = kernel_bench
    for argv, msg in ((["--shapes", "12x32768 d128", "Wan14B"], "--shapes ['Wan14B'] unknown"),
                      (["--rounds", "0"], "--rounds 0 must be >= 1"),
                      (["--deadline-s", "nan"], "--deadline-s nan must be a finite"),
                      (["--deadline-s", "inf"], "--deadline-s inf must be a finite")):
        with pytest.raises(SystemExit) as exit_:
            command.main(argv)
        assert exit_.value.code == 2 and msg in capsys.readouterr().err, argv
    assert command.parse_args(["--shapes"]).shapes == [] and command.parse_args([]).rounds == 3
    ok = dict(correctness=[dict(ok=True)], errors=["deadline: variants cut short"])
    assert bench.exit_code(ok) == 0
    assert bench.exit_code(dict(ok, correctness=[dict(ok=True), dict(ok=False)])) == 1
    assert bench.exit_code(dict(ok, errors=["12x32768 d128: Traceback ..."])) == 1
    # a peer or a variant timed beside ours that computed something else fails the run too (review find: recorded,
    # tabulated, exit 0)
    row = dict(impl="fa4", shape="s", plan="random", target_density=0.1)
    assert bench.exit_code(dict(ok, rows=[dict(row, rel_err_vs_ours=4e-3)])) == 0
    for bad in (dict(row, rel_err_vs_ours=0.9), dict(row, impl="ours", rel_err_vs_cudnn=float("nan"))):
        assert bench.exit_code(dict(ok, rows=[bad])) == 1
    variant = dict(S=256, D=64, target_density=0.1, variant="v", tflops=800.0, rel_diff_vs_default=float("nan"))
    assert bench.exit_code(dict(ok, variants=[dict(variant, ok=True)])) == 0
    assert bench.exit_code(dict(ok, variants=[dict(variant, ok=False)])) == 1
    assert "| v | 800 (wrong) |" in bench.render_variants(dict(variants=[dict(variant, ok=False)]))
    out = tmp_path / "kernel.json"
    out.write_text("{}")
    bench.write_json(out, dict(rows=[1]))
    assert json.loads(out.read_text()) == dict(rows=[1]) and [p.name for p in tmp_path.iterdir()] == ["kernel.json"]


def test_bench_backward_refuses_bad_arguments_and_times_nothing_after_a_failed_check(tmp_path, capsys, monkeypatch):
    """Review finds: its gradient check only logged numbers (the run timed on and exited 0 with dq, dk, dv all
    wrong); --rounds 0 failed in median after the GPU work; --densities 2 doubled the reported TFLOP/s."""
    import json

    import pytest
    import torch

    bench = load_script("bench_backward")
    for argv, msg in ((["--rounds", "0"], "--rounds 0 must be >= 1"), (["--densities", "0.1", "2"], "[2.0]")):
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(argv)
        assert exit_.value.code == 2 and msg in capsys.readouterr().err, argv
    import _bench
    import bench_kernel

    monkeypatch.setattr(_bench, "require_cuda", lambda script: None)
    monkeypatch.setattr(_bench, "versions", lambda: {})
    monkeypatch.setattr(bench_kernel, "gpu_state", lambda: {})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(bench, "check", lambda device, dtype: {"dq": 3e-3, "dk": 1.0, "dv": float("nan")})

    def no_timing(*args):
        raise AssertionError("timed after a failed check")

    monkeypatch.setattr(bench, "bench_shape", no_timing)
    out = tmp_path / "backward.json"
    assert bench.main(["--out", str(out)]) == 1
    assert json.loads(out.read_text())["check"]["dk"] == 1.0


def test_sweep_backward_leaves_wrong_variants_out_and_fails():
    """Review find: a launch variant's error against the default was recorded only; the table named the fastest
    variant whatever its error (the launch defaults were chosen from that table)."""
    sweep = load_script("sweep_backward")
    row = dict(kernel="dq", ms=1.0, tflops=100.0)
    shape = dict(shape="s", correction=False, triton_backward_ms=3.0, sdpa_dense_backward_ms=9.0,
                 rows=[dict(row, params="default", error_vs_default=0.0),
                       dict(row, params=[32, 4, 2], ms=0.5, tflops=200.0, error_vs_default=0.7),
                       dict(row, params=[64, 8, 2], ms=0.9, tflops=111.0, error_vs_default=2e-6)])
    results = dict(shapes=[shape])
    assert "| s | dq | 1.000 (100) | [64, 8, 2] | 0.900 (111) |" in sweep.render(results)
    assert sweep.wrong_variants(results) == ["s dq [32, 4, 2]: error_vs_default=0.7"]
    shape["rows"] = shape["rows"][:2]
    assert "| s | dq | 1.000 (100) | – | – |" in sweep.render(results)


def test_veda_report_keeps_the_pooled_tiling_error_of_a_batch():
    """Review find: veda_report divided head_errors' ratio, already pooled over the batch, by the batch size again
    (the fix of the tiling search, f8492f0, had left it here): a CFG-batched record read half its error."""
    import types

    import torch

    from videosparse.veda.tiling import candidate_shapes

    report = load_script("veda_report")
    torch.manual_seed(0)
    grid, block, shapes = (4, 8, 8), 64, candidate_shapes(64)
    one = [torch.randn(1, 256, 2, 32) for _ in range(3)]
    tiling = types.SimpleNamespace(tiles_for=lambda layer, heads: shapes[0])
    observer = report.HeldOutObserver(tiling, block, 0.5, steps=[0], error_steps=[0])
    observer.capture = lambda rec: None
    for q, k, v in (one, [torch.cat([x, x]) for x in one]):        # the same sample alone and twice in a batch
        observer(types.SimpleNamespace(step=0, layer=0, q=q, k=k, v=v, grid=grid, text_len=0, text_position=None))
    alone, batched = observer.errors[0]
    assert torch.allclose(alone, batched)


def test_bench_power_refuses_runs_too_short_to_summarize(capsys):
    import pytest

    power = load_script("bench_power")
    for argv, msg in ((["--seconds", "0"], "--seconds 0.0 must be >= 0.5"), (["--densities", "2"], "in (0, 1]")):
        with pytest.raises(SystemExit) as exit_:
            power.main(argv)
        assert exit_.value.code == 2 and msg in capsys.readouterr().err
