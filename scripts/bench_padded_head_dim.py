"""Head dims the kernels do not take (GPU): Allegro-size attention at head dim 96 through `block_sparse_attention`
(auto: the kernel on q, k, v zero-padded to 128, `kernels.dispatch.PaddedHeadDim`) on random top-k plans, vs cuDNN
SDPA dense at the real head dim.

    python scripts/bench_padded_head_dim.py     # -> benchmarks/padded_head_dim_allegro_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main(out="benchmarks/padded_head_dim_allegro_h200.json", B=1, H=24, S=79200, D=96):
    import torch

    from _bench import require_cuda

    require_cuda(__file__)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from bench_kernel import random_plan
    from videosparse.kernels import block_sparse_attention, select_backend

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        dense = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), warmup=5, rep=200)
    rows = [dict(impl="cudnn_sdpa_dense", density=1.0, ms=dense)]
    for density in (1.0, 0.25, 0.1, 0.05):
        plan = random_plan(B, H, S, density, 128, "cuda")
        name = select_backend(q, k, v, plan).name
        ms = do_bench(lambda: block_sparse_attention(q, k, v, plan, validate=False), warmup=5, rep=200)
        kept = plan.density(math.ceil(S / 128))
        rows.append(dict(impl=name, density=kept, ms=ms, speedup_vs_cudnn=dense / ms,
                         tflops_real_d=4 * S * S * D * H * kept / ms / 1e9))
        print(f"{name} density {kept:.3f}: {ms:.2f} ms, {dense / ms:.2f}x cuDNN dense ({dense:.2f} ms), "
              f"{rows[-1]['tflops_real_d']:.0f} TFLOP/s at d{D}", flush=True)
    Path(out).write_text(json.dumps(dict(
        what=f"Allegro-size attention ({H} heads x {S:,} tokens, head dim {D}, bf16): block_sparse_attention (auto: "
             "head dim zero-padded to 128) on random top-k plans vs cuDNN SDPA dense; TFLOP/s count the real head dim",
        rows=rows), indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/padded_head_dim_allegro_h200.json", help="the JSON written")
    main(parser.parse_args().out)
