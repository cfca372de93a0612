"""A/B of a Hopper kernel against another version of itself (GPU): interleaved rounds, median, outputs compared.

The baseline is a copy of `videosparse/kernels/gluon_hopper.py` from another revision (extract it where git
history is at hand and carry the file along; the GPU machine gets a copy of the working tree):

    git show 382209d:videosparse/kernels/gluon_hopper.py > baseline_gluon.py
    python scripts/ab_gluon.py --baseline baseline_gluon.py [--correction] [--rounds 5] [--out ab.json]

or a folder of such copies when the change spans modules; a module of the folder imports its siblings from
the folder and everything else from this tree. The Triton Hopper kernel (`--kernel triton_hopper`, 128x128
or `--block 64` tiles) with its helpers of 1a923ab:

    mkdir old && for f in triton_hopper _triton_utils; do git show 1a923ab:videosparse/kernels/$f.py > old/$f.py; done
    python scripts/ab_gluon.py --kernel triton_hopper --baseline old --correction --block 64

The generic kernel (`--kernel triton_generic`, the Ampere/Ada path) runs on a Hopper GPU as Ampere code when
Triton is told the architecture (mma.sync and cp.async instead of wgmma and TMA; ptxas still targets sm_90):

    TRITON_OVERRIDE_ARCH=sm80 python scripts/ab_gluon.py --kernel triton_generic --baseline old_generic

Without --baseline both sides run this tree's kernel, told apart by their keyword arguments to
`gluon_attention` / `hopper_attention` (Python dict literals), e.g. the K stage released early and only the
Q release late:

    python scripts/ab_gluon.py --new-kwargs "{'late_k_release': False, 'late_q_release': True}"

Shapes: 12 x 32,768 at head dim 128 and 64 and Wan 1.3B's 12 x 32,760 (partial last tile), random top-k
plans at densities 0.25 / 0.1 / 0.05 (bf16). Prints TFLOP/s on kept tiles of both and the relative
difference of their outputs.
"""

from __future__ import annotations

import argparse
import ast
import importlib
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
ENTRY = {"gluon_hopper": "gluon_attention", "triton_hopper": "hopper_attention",   # kernel module -> its function
         "triton_generic": "generic_attention"}


def _absolute_imports(source: str, siblings=()) -> str:
    """A kernel module's package-relative imports made absolute (this tree's videosparse), except imports of
    `siblings`, which stay relative (modules copied along with it)."""
    source = re.sub(r"^from \.\.(\w+) import", r"from videosparse.\1 import", source, flags=re.M)
    return re.sub(r"^from \.(\w+) import",
                  lambda m: m.group(0) if m.group(1) in siblings else f"from videosparse.kernels.{m.group(1)} import",
                  source, flags=re.M)


def load_kernel_module(path: str | Path, name: str = "baseline_gluon_hopper",
                       module: str = "gluon_hopper") -> types.ModuleType:
    """Import a copy of a kernel module from anywhere (rewritten into a temporary folder, since Triton's JIT reads
    its functions' source files). path: a copy of gluon_hopper.py, or a folder of copies of kernel modules, from
    which `module` is imported as part of a package `name` (its imports of the folder's other modules stay among
    the copies; the rest come from this tree)."""
    path = Path(path)
    tmp = Path(tempfile.mkdtemp(prefix="ab_gluon_"))
    if path.is_dir():
        files = {f.stem: f for f in path.glob("*.py") if f.stem != "__init__"}
        if module not in files:
            raise ValueError(f"--baseline folder {path} has no {module}.py (it has {sorted(files)})")
        package = tmp / name
        package.mkdir()
        (package / "__init__.py").write_text("")
        for stem, f in files.items():
            (package / f.name).write_text(_absolute_imports(f.read_text(), siblings=files))
        sys.path.insert(0, str(tmp))
        return importlib.import_module(f"{name}.{module}")
    copy = tmp / f"{name}.py"
    copy.write_text(_absolute_imports(path.read_text()))
    spec = importlib.util.spec_from_file_location(name, copy)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded
    spec.loader.exec_module(loaded)
    return loaded


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=sorted(ENTRY), default="gluon_hopper", help="the kernel module to compare")
    ap.add_argument("--baseline", help="copy of the kernel module from the other revision, or a folder of copies "
                                       "(default: this tree's)")
    ap.add_argument("--new-kwargs", default="{}", help="keyword arguments of the new side, a dict literal")
    ap.add_argument("--baseline-kwargs", default="{}", help="keyword arguments of the baseline side")
    ap.add_argument("--correction", action="store_true", help="plans with the zero-order correction")
    ap.add_argument("--block", type=int, choices=(64, 128), default=128,
                    help="square tile size of the plans (64: Triton kernels only)")
    ap.add_argument("--densities", type=float, nargs="*", default=[0.25, 0.1, 0.05])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="ab_gluon.json")
    args = ap.parse_args(argv)

    import torch

    from bench_kernel import interleaved_ab, random_plan
    from videosparse.sol.centroids import tile_centroids_torch

    if args.block != 128 and args.kernel == "gluon_hopper":
        raise ValueError(f"--block {args.block}: the Gluon kernel takes 128x128 tiles only; use a Triton kernel")
    tree = importlib.import_module(f"videosparse.kernels.{args.kernel}")
    base = load_kernel_module(args.baseline, module=args.kernel) if args.baseline else tree
    new_fn, base_fn = getattr(tree, ENTRY[args.kernel]), getattr(base, ENTRY[args.kernel])
    new_kw, base_kw = ast.literal_eval(args.new_kwargs), ast.literal_eval(args.baseline_kwargs)
    rows = []
    for name in args.shapes:
        B, H, S, D = SHAPES[name]
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for density in args.densities:
            plan = random_plan(B, H, S, density, args.block, "cuda")
            if args.correction:
                plan = plan.with_correction(*tile_centroids_torch(k, v, args.block))
            kept = plan.density(math.ceil(S / args.block))
            fns = {"new": lambda p=plan: new_fn(q, k, v, p, D ** -0.5, **new_kw),
                   "baseline": lambda p=plan: base_fn(q, k, v, p, D ** -0.5, **base_kw)}
            tf, times, diff = interleaved_ab(fns, 4.0 * S * S * D * B * H * kept, args.rounds)
            rows.append(dict(shape=name, block=args.block, density=kept, correction=args.correction, tflops=tf,
                             ms_rounds=times, rel_diff=diff))
            print(f"{name} {args.block}x{args.block} tiles density {kept:.3f}{' +corr' if args.correction else ''}: "
                  f"new {tf['new']:.0f} baseline {tf['baseline']:.0f} TFLOP/s ({tf['new'] / tf['baseline'] - 1:+.1%}), "
                  f"outputs differ by {diff:.1e}", flush=True)
    Path(args.out).write_text(json.dumps(dict(kernel=args.kernel, gpu=torch.cuda.get_device_name(),
                                              baseline=str(args.baseline or "this tree"), new_kwargs=new_kw,
                                              baseline_kwargs=base_kw, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
