"""How far bf16 rounding alone moves Wan-Animate-2's output (GPU), to read the differences of
`bench_wan_animate2_compiled.py` against: the synthetic real-size transformer (random weights, bf16, the same inputs and
extraction pass), `layers` blocks, compiled as diffusers advises (`compile_repeated_blocks()`). Compares the stock
forward with (a) the stock forward of latents perturbed by 1e-3 (relative), (b) videosparse's dense path and Veda at
density 1, each eager and compiled. Rel. L2 of the outputs.

    python scripts/check_wan_animate2_noise.py --layers 1 40    # -> benchmarks/wan_animate2_noise_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def check(layers: int, device, dtype, size: dict) -> dict:
    import torch

    import videosparse
    from bench_wan_animate2_compiled import built, uncompile_blocks
    from videosparse.eval.synthetic import first_output

    _, transformer, inputs = built(device, dtype, layers, **size)

    def run(compiled: bool) -> torch.Tensor:
        if compiled:
            torch._dynamo.reset()
            transformer.compile_repeated_blocks()
        with torch.no_grad():
            out = first_output(transformer(**inputs)).float()
        uncompile_blocks(transformer)
        return out

    def rel(a, b) -> float:
        return float((a - b).norm() / b.norm())

    stock = run(True)
    latents = inputs["hidden_states"][0]
    g = torch.Generator(device="cpu").manual_seed(2)
    noise = torch.randn(latents.shape, generator=g).to(device=latents.device, dtype=latents.dtype)
    inputs["hidden_states"] = [latents * (1 + 1e-3 * noise)]
    row = {"stock_perturbed_1e-3_vs_stock": rel(run(True), stock)}
    inputs["hidden_states"] = [latents]
    for name, config in (("dense", videosparse.DenseConfig()),
                         ("veda@1.0", videosparse.VedaConfig(density=1.0, dense_steps=0))):
        videosparse.apply(transformer, config)
        eager, compiled = run(False), run(True)
        videosparse.remove(transformer)
        row[name] = {"eager_vs_stock": rel(eager, stock), "compiled_vs_stock": rel(compiled, stock),
                     "eager_vs_compiled": rel(eager, compiled)}
    print(f"{layers} blocks: {json.dumps(row)}")
    return row


def main(argv=None) -> dict:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 40])
    parser.add_argument("--device", default="cuda", help="cuda (bf16), or cpu (fp32, a tiny size: a check of the code)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default on CUDA: benchmarks/wan_animate2_noise_h200.json; "
                             "on the CPU nothing is written unless given)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = {} if device.type == "cuda" else dict(frames=9, height=144, width=128)
    from videosparse.eval.report import save_report

    report = {"model": "wan-animate2", "compile": "compile_repeated_blocks()",
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
              "rows": {str(n): check(n, device, dtype, size) for n in args.layers}}
    out = args.out or ("benchmarks/wan_animate2_noise_h200.json" if device.type == "cuda" else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        save_report(report, out)
    return report


if __name__ == "__main__":
    main()
