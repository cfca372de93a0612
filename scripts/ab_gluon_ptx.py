"""A/B of the Gluon kernel against itself with warpgroup barriers taken out of its PTX (GPU experiment).

Triton 3.6 puts a 128-thread `bar.sync` before every mbarrier wait and release arrive of a consumer warpgroup (its
shared-memory barrier analysis cannot see that a release after a wgmma wait, or a wait on an mbarrier, needs none;
CUTLASS / FA3 arrive from one thread without one). This script edits the PTX of the compiled kernel and runs the
edited copy through Triton's `ir_override` option, next to the unmodified kernel in interleaved rounds:

    python scripts/ab_gluon_ptx.py --drop arrive --drop arrive,wait --drop arrive,wait,epi [--rounds 5]

`arrive`: the barriers before the K / V stage releases and the first step's K release (after a wgmma wait); the
Q-buffer release after the output's TMA store (`cp.async.bulk.wait_group.read`) and the release of an item without
tiles keep theirs. `wait`: the barriers before mbarrier waits. `epi`: the one before the epilogue's output staging
store into the finished item's Q half. Outputs are checked bitwise against the unmodified kernel (20 calls each).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

BAR = re.compile(r"^\s*bar\.sync\s+\d+,\s*128;\s*$")
NOT_INSTR = (".loc", "//", "{", "}", ".reg", "waitLoop:")
CASES = [(128, 1.0, False), (128, 0.1, False), (128, 0.05, False), (128, 0.1, True), (64, 0.1, False),
         (64, 0.05, False)]     # head dim, density, correction; 12 x 32,768 bf16


def _source_line(fn, text: str, after: int = 0) -> int:
    """Line of `text` (plus `after`) in the kernel module's source, where the PTX's .loc comments point."""
    lines, first = inspect.getsourcelines(fn.fn)
    return first + after + next(i for i, line in enumerate(lines) if text in line)


def drop_barriers(ptx: str, kinds: set[str], epi_line: int, empty_line: int) -> tuple[str, dict]:
    """The PTX without the `bar.sync` of the given kinds (see the module docstring) and how many of each went."""
    lines, kept, removed = ptx.split("\n"), [], {k: 0 for k in kinds}

    def instr(i, step):
        j = i + step
        while 0 <= j < len(lines):
            s = lines[j].strip()
            if s and not s.startswith(NOT_INSTR):
                return s
            j += step
        return ""

    for i, line in enumerate(lines):
        if BAR.match(line):
            loc = [x for x in lines[max(0, i - 6):i] if ".loc" in x][-1:]
            at = (lambda n: bool(loc) and f"gluon_hopper.py:{n}:" in loc[0])
            nxt = next((s for s in (lines[j].strip() for j in range(i + 1, min(i + 12, len(lines))))
                        if "mbarrier.arrive" in s or "mbarrier.try_wait" in s), "")
            kind = ("epi" if at(epi_line) else "arrive" if "mbarrier.arrive" in nxt and not at(empty_line)
                    and "cp.async.bulk.wait_group" not in instr(i, -1) else "wait" if "try_wait" in nxt else None)
            if kind in kinds:
                removed[kind] += 1
                continue
        kept.append(line)
    return "\n".join(kept), removed


class PtxOverride:
    """Stands in for a module's `_gluon_fwd`: compiles each launch's kernel once as is, then launches the edited PTX."""

    def __init__(self, fn, edit, folder):
        self.fn, self.edit, self.folder, self.paths = fn, edit, folder, {}

    def __getitem__(self, grid):
        import torch

        def launch(*args, **kwargs):
            key = (grid, tuple((a.shape, a.dtype) if torch.is_tensor(a) else a for a in args),
                   tuple(sorted(kwargs.items())))
            if key not in self.paths:
                kernel = self.fn[grid](*args, **kwargs)
                ptx, removed = self.edit(kernel.asm["ptx"])
                self.paths[key] = str(Path(self.folder) / f"{kernel.hash}_{len(self.paths)}.ptx")
                Path(self.paths[key]).write_text(ptx)
                print(f"  removed {removed} of {kernel.asm['ptx'].count('bar.sync')} bar.sync", flush=True)
            return self.fn[grid](*args, ir_override=self.paths[key], **kwargs)
        return launch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drop", action="append", required=True, help="comma-separated kinds: arrive, wait, epi")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/ab_gluon_ptx_barriers_h200.json")
    args = ap.parse_args(argv)

    import torch

    import videosparse.kernels.gluon_hopper as tree
    from ab_gluon import load_kernel_module
    from bench_kernel import interleaved_ab, random_plan
    from videosparse.sol.centroids import tile_centroids_torch

    epi_line = _source_line(tree._epilogue, "o_smem.store(")
    empty_line = _source_line(tree._consume, "# an item without tiles", after=1)
    folder, sides = tempfile.mkdtemp(), {}
    for spec in args.drop:
        kinds = set(spec.split(","))
        module = load_kernel_module(ROOT / "videosparse/kernels/gluon_hopper.py", name="ptx_" + "_".join(sorted(kinds)))
        module._gluon_fwd = PtxOverride(module._gluon_fwd,
                                        lambda p, k=kinds: drop_barriers(p, k, epi_line, empty_line), folder)
        sides["-" + "-".join(sorted(kinds))] = module
    sides["baseline"] = tree
    rows = []
    for D, density, corr in CASES:
        B, H, S = 1, 12, 32768
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        plan = random_plan(B, H, S, density, 128, "cuda")
        if corr:
            plan = plan.with_correction(*tile_centroids_torch(k, v, 128))
        kept = plan.density(math.ceil(S / 128))
        fns = {n: (lambda p=plan, m=m: m.gluon_attention(q, k, v, p, D ** -0.5)) for n, m in sides.items()}
        ref = fns["baseline"]().clone()
        bitwise = {n: all(torch.equal(f(), ref) for _ in range(20)) for n, f in fns.items() if n != "baseline"}
        tf, times, _ = interleaved_ab(fns, 4.0 * S * S * D * B * H * kept, args.rounds)
        rows.append(dict(shape=f"12x32768 d{D}", density=kept, correction=corr, tflops=tf, ms_rounds=times,
                         bitwise_20=bitwise))
        print(f"12x32768 d{D} density {kept:.3f}{' +corr' if corr else ''}: " + "  ".join(
            f"{n} {t:.0f} ({t / tf['baseline'] - 1:+.1%})" for n, t in tf.items()) + f"  bitwise {bitwise}", flush=True)
    Path(args.out).write_text(json.dumps(dict(
        what="Gluon kernel with Triton's warpgroup bar.sync before mbarrier release arrives / waits / the epilogue "
             "store removed from its PTX (ir_override) vs unmodified, interleaved rounds, median TFLOP/s on kept tiles",
        drop=args.drop, rows=rows), indent=1))


if __name__ == "__main__":
    main()
