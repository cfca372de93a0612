#!/usr/bin/env python
"""What ptxas made of the Gluon kernel, without a GPU: compile it for sm_90 and read the SASS.

For each consumer loop it counts the `MUFU.EX2` (softmax exponentials) that sit between the wait for the
score GEMM (`WARPGROUP.DEPBAR.LE gsb0, 0x1`) and the wait for the P.V GEMM (`... 0x0`): that number is the
in-warpgroup overlap of softmax and P.V the kernel's source asks for (0 means ptxas placed the P.V wait first).
It also runs ptxas -v on the PTX and prints its performance notes (wgmma serialisation, spills), the
registers of the consumer code and the bar.sync count, and the spills per tile loop.

    python scripts/inspect_gluon_sass.py [--head-dim 64] [--kwargs "dict(num_stages=3)"]
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def sass_listing(cubin: bytes, tools: Path) -> list[tuple[int, str]]:
    """The SASS instructions of a cubin as (address, instruction) (cuobjdump ships with triton)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(tools / "cuobjdump"), "-sass", str(path)], capture_output=True, text=True).stdout
    return [(int(m.group(1), 16), m.group(2).strip()) for line in text.splitlines()
            for m in [re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)] if m]


def sass_ops(cubin: bytes, tools: Path) -> list[str]:
    """The SASS instructions of a cubin, one string per instruction."""
    return [op for _, op in sass_listing(cubin, tools)]


def tile_loops(listing: list[tuple[int, str]]) -> list[list[str]]:
    """The instructions of each consumer tile loop: the innermost spans from a conditional backward branch's
    target to the branch whose body issues a GEMM and a softmax exponential. (The unconditional backward
    branches are the retry paths of mbarrier waits at the end of the kernel, not loops of the source.)"""
    spans = []
    for addr, op in listing:
        m = re.match(r"@!?U?P\w+\s+BRA\b.*?0x([0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr:
            body = [o for a, o in listing if int(m.group(1), 16) <= a <= addr]
            if any(o.startswith("HGMMA") for o in body) and any("MUFU.EX2" in o for o in body):
                spans.append((int(m.group(1), 16), addr, body))
    inner = [s for s in spans if not any(o is not s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return [body for _, _, body in inner]


def local_memory_ops(ops: list[str]) -> int:
    """Spill traffic: local-memory loads and stores (LDL / STL) among the instructions."""
    return sum(bool(re.match(r"(@!?U?P\w+\s+)?(LDL|STL)\b", op)) for op in ops)


def overlap_per_loop(ops: list[str]) -> list[int]:
    """MUFU.EX2 between each score-GEMM wait (LE 1) and the next P.V wait (LE 0)."""
    counts = []
    for i, op in enumerate(ops):
        if "DEPBAR.LE gsb0, 0x1" in op:
            n = 0
            for later in ops[i + 1:]:
                if "DEPBAR.LE gsb0, 0x0" in later:
                    break
                n += "MUFU.EX2" in later
            counts.append(n)
    return counts


def triton_ptxas(tools: Path, arch: str = "sm_90a") -> Path:
    """The ptxas Triton itself runs for `arch` ("sm_90a", "sm_80"): Triton 3.9 ships a second, newer one for sm_90
    and up, whose PTX version the first cannot read; before it (Triton 3.5: one ptxas) `tools / "ptxas"`."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return Path(get_ptxas(int(re.sub(r"\D", "", arch))).path)
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return tools / "ptxas"


def ptxas_notes(ptx: str, tools: Path, arch: str = "sm_90a") -> list[str]:
    """ptxas -v's lines on performance losses, spills and registers for the PTX, assembled for `arch` by the
    ptxas Triton runs for it."""
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "k.ptx", Path(d) / "k.cubin"
        src.write_text(ptx)
        res = subprocess.run([str(triton_ptxas(tools, arch)), f"-arch={arch}", "-v", str(src), "-o", str(out)],
                             capture_output=True, text=True)
    lines = (res.stdout + res.stderr).splitlines()
    return [line.strip() for line in lines if re.search(r"Performance Loss|spill|Used \d+ registers", line)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kwargs", default="{}", help="more compile_for_sm90 arguments, as a Python dict literal")
    args = ap.parse_args()
    import triton

    from videosparse.kernels import gluon_hopper

    extra = ast.literal_eval(args.kwargs) if args.kwargs.strip().startswith("{") else eval(args.kwargs, {"dict": dict})
    kernel = gluon_hopper.compile_for_sm90(head_dim=args.head_dim, **extra)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ops = sass_ops(kernel.asm["cubin"], tools)
    hgmma = [i for i, op in enumerate(ops) if op.startswith("HGMMA")]
    regs = {int(r) for op in ops[:hgmma[-1] + 1] for r in re.findall(r"\bR(\d+)\b", op)} if hgmma else set()
    print(f"head dim {args.head_dim} {extra}: shared {kernel.metadata.shared} B, {len(ops)} SASS instructions")
    print(f"softmax exponentials overlapping P.V, per consumer loop: {overlap_per_loop(ops)}")
    print(f"highest register up to the last HGMMA: R{max(regs) if regs else '?'}; "
          f"BAR.SYNC: {sum(op.startswith('BAR.SYNC') for op in ops)}")
    loops = tile_loops(sass_listing(kernel.asm["cubin"], tools))
    print(f"spill loads/stores: {local_memory_ops(ops)} in all, per tile loop {[local_memory_ops(b) for b in loops]}")
    for note in ptxas_notes(kernel.asm["ptx"], tools):
        print("ptxas:", note)


if __name__ == "__main__":
    main()
