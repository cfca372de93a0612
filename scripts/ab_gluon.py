"""A/B of the Gluon kernel against another version of itself (GPU): interleaved rounds, median, outputs compared.

The baseline is a copy of `videosparse/kernels/gluon_hopper.py` from another revision (extract it where git
history is at hand and carry the file along; the GPU machine gets a copy of the working tree):

    git show 382209d:videosparse/kernels/gluon_hopper.py > baseline_gluon.py
    python scripts/ab_gluon.py --baseline baseline_gluon.py [--correction] [--rounds 5] [--out ab.json]

Without --baseline both sides run this tree's kernel, told apart by their keyword arguments to
`gluon_attention` (Python dict literals), e.g. the K stage released early and only the Q release late:

    python scripts/ab_gluon.py --new-kwargs "{'late_k_release': False, 'late_q_release': True}"

Shapes: 12 x 32,768 at head dim 128 and 64 and Wan 1.3B's 12 x 32,760 (partial last tile), random top-k
plans at densities 0.25 / 0.1 / 0.05 (bf16). Prints TFLOP/s on kept tiles of both and the relative
difference of their outputs.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import re
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SHAPES = {"12x32768 d128": (1, 12, 32768, 128), "12x32760 d128": (1, 12, 32760, 128),
          "12x32768 d64": (1, 12, 32768, 64)}


def load_kernel_module(path: str | Path, name: str = "baseline_gluon_hopper") -> types.ModuleType:
    """Import a copy of gluon_hopper.py from anywhere: its package-relative imports become absolute (the
    rewritten source goes to a temporary file, since Triton's JIT reads its functions' source files)."""
    source = Path(path).read_text()
    source = re.sub(r"^from \.\.(\w+) import", r"from videosparse.\1 import", source, flags=re.M)
    source = re.sub(r"^from \.(\w+) import", r"from videosparse.kernels.\1 import", source, flags=re.M)
    copy = Path(tempfile.mkdtemp(prefix="ab_gluon_")) / f"{name}.py"
    copy.write_text(source)
    spec = importlib.util.spec_from_file_location(name, copy)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", help="gluon_hopper.py of the other revision (default: this tree's)")
    ap.add_argument("--new-kwargs", default="{}", help="keyword arguments of the new side, a dict literal")
    ap.add_argument("--baseline-kwargs", default="{}", help="keyword arguments of the baseline side")
    ap.add_argument("--correction", action="store_true", help="plans with the zero-order correction")
    ap.add_argument("--densities", type=float, nargs="*", default=[0.25, 0.1, 0.05])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="ab_gluon.json")
    args = ap.parse_args(argv)

    import torch

    from bench_kernel import interleaved_ab, random_plan
    from videosparse.kernels import gluon_hopper
    from videosparse.sol.centroids import tile_centroids_torch

    base = load_kernel_module(args.baseline) if args.baseline else gluon_hopper
    new_kw, base_kw = ast.literal_eval(args.new_kwargs), ast.literal_eval(args.baseline_kwargs)
    rows = []
    for name in args.shapes:
        B, H, S, D = SHAPES[name]
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for density in args.densities:
            plan = random_plan(B, H, S, density, 128, "cuda")
            if args.correction:
                plan = plan.with_correction(*tile_centroids_torch(k, v, 128))
            kept = plan.density(math.ceil(S / 128))
            fns = {"new": lambda p=plan: gluon_hopper.gluon_attention(q, k, v, p, D ** -0.5, **new_kw),
                   "baseline": lambda p=plan: base.gluon_attention(q, k, v, p, D ** -0.5, **base_kw)}
            tf, times, diff = interleaved_ab(fns, 4.0 * S * S * D * B * H * kept, args.rounds)
            rows.append(dict(shape=name, density=kept, correction=args.correction, tflops=tf, ms_rounds=times,
                             rel_diff=diff))
            print(f"{name} density {kept:.3f}{' +corr' if args.correction else ''}: new {tf['new']:.0f} "
                  f"baseline {tf['baseline']:.0f} TFLOP/s ({tf['new'] / tf['baseline'] - 1:+.1%}), "
                  f"outputs differ by {diff:.1e}", flush=True)
    Path(args.out).write_text(json.dumps(dict(baseline=str(args.baseline or "this tree"), new_kwargs=new_kw,
                                              baseline_kwargs=base_kw, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
