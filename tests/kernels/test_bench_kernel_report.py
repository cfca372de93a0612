"""scripts/bench_kernel.py's timing order and report tables (CPU; the timings themselves need a GPU)."""

from __future__ import annotations

from helpers import load_script


def test_interleaved_rounds_alternate_the_order_and_report_the_median():
    bench = load_script("bench_kernel")
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
    bench = load_script("bench_kernel")
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
