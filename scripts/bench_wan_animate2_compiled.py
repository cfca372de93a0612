"""Wan-Animate-2 compiled as diffusers advises (GPU): the real-size transformer of `videosparse evaluate --synthetic
wan-animate2` (random weights, bf16, the same inputs and untimed extraction pass) under `compile_repeated_blocks()`,
which its stock generation pass needs (uncompiled, flex attention materialises every score), with the stock
processors and with videosparse's (dense, then each method, every step sparse), side by side in one run.

    python scripts/bench_wan_animate2_compiled.py     # -> benchmarks/wan_animate2_compiled_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def built(device, dtype, layers=None, **size):
    """(setup, transformer, inputs) of `--synthetic wan-animate2`: random weights, its generation-pass inputs, the
    reference K/V filled by the stock extraction pass."""
    from videosparse.eval.synthetic_models import build_transformer, make_inputs, synthetic_setup

    setup = synthetic_setup("wan-animate2", layers=layers, **size)
    transformer = build_transformer(setup, device, dtype)
    inputs = make_inputs(setup, device, dtype)
    setup.model.prepare(setup, transformer, inputs)
    return setup, transformer, inputs


def uncompile_blocks(transformer) -> None:
    """Undo `compile_repeated_blocks()` (nn.Module.compile on every block)."""
    for block in transformer.blocks:
        block._compiled_call_impl = None


def main(argv=None) -> dict:
    import torch

    import videosparse
    from videosparse.eval.report import save_report
    from videosparse.eval.spec import parse_method_specs
    from videosparse.eval.synthetic import every_step_sparse, first_output

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["veda@0.25", "veda@0.1", "veda@0.05"],
                        help="videosparse methods after the stock and dense rows")
    parser.add_argument("--layers", type=int, default=None, help="build only this many blocks (default: all 40)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed forwards per row (the first compiles)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--device", default="cuda", help="cuda (bf16), or cpu (fp32: a check, not a speed)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default on CUDA: benchmarks/wan_animate2_compiled_h200.json; "
                             "on the CPU nothing is written unless given)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    setup, transformer, inputs = built(device, dtype, args.layers, frames=args.frames, height=args.height,
                                       width=args.width)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def forward() -> tuple[float, torch.Tensor]:
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = first_output(transformer(**inputs))
        sync()
        return time.perf_counter() - t0, out

    rows, reference = {}, None
    for spec in [None] + parse_method_specs(args.methods):
        label = "stock" if spec is None else spec.label
        if spec is not None:
            videosparse.apply(transformer, every_step_sparse(spec.config))
        torch._dynamo.reset()
        transformer.compile_repeated_blocks()
        warmup = [forward()[0] for _ in range(args.warmup)]
        timed = [forward() for _ in range(args.repeats)]
        out = timed[-1][1].float()
        reference = out if reference is None else reference
        times = [t for t, _ in timed]
        rows[label] = {"forward_s": statistics.median(times), "forward_s_all": times, "warmup_s": warmup,
                       "output_rel_l2_vs_stock": float((out - reference).norm() / reference.norm())}
        uncompile_blocks(transformer)
        if spec is not None:
            videosparse.remove(transformer)
        stock = rows["stock"]["forward_s"]
        print(f"{label:>12}: forward {rows[label]['forward_s']:.3f} s, {stock / rows[label]['forward_s']:.2f}x stock "
              f"(warmup {', '.join(f'{t:.1f}' for t in warmup)} s), rel L2 vs stock "
              f"{rows[label]['output_rel_l2_vs_stock']:.4f}")
    report = {"model": "wan-animate2", "shape": setup.describe(), "compile": "compile_repeated_blocks()",
              "rows": rows,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__}
    out = args.out or ("benchmarks/wan_animate2_compiled_h200.json" if device.type == "cuda" else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        save_report(report, out)
    return report


if __name__ == "__main__":
    main()
