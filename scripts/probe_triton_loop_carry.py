#!/usr/bin/env python
"""Triton 3.6 frontend: a variable that an outer loop reassigns but reads only as an inner `range()` bound is
not made loop-carried, so every iteration keeps its first value (no GPU needed: compiles for sm_90, reads TTGIR).

Three kernels reassign `m` at the end of each outer iteration; the script prints whether `m` is among the outer
`scf.for`'s iter_args. Only the one that reads `m` solely as the inner loop's bound drops it (a Gluon loader
written that way fetched the first work unit's tile count for every unit and hung). Work-around: compute the
bound inside the outer loop from values the body also reads.

    python scripts/probe_triton_loop_carry.py
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from videosparse.kernels._triton_utils import COMPILE_OPTIONS


@gluon.jit
def _bound_only(X, Y, N):
    m = gl.load(X)
    acc = 0
    for it in range(N):
        for j in range(m):
            acc += j
        m = gl.load(X + it + 1)
    gl.store(Y, acc)


@gluon.jit
def _also_in_body(X, Y, N):
    m = gl.load(X)
    acc = 0
    for it in range(N):
        for j in range(m):
            acc += j + m
        m = gl.load(X + it + 1)
    gl.store(Y, acc)


@gluon.jit
def _no_inner_loop(X, Y, N):
    m = gl.load(X)
    acc = 0
    for it in range(N):
        acc += m
        m = gl.load(X + it + 1)
    gl.store(Y, acc)


def carried(fn) -> bool:
    """Whether `m` is an iter_arg of fn's outer loop in the sm_90 TTGIR."""
    src = GluonASTSource(fn, {"X": "*i32", "Y": "*i32", "N": "i32"}, {})
    options = dict(num_warps=1, **COMPILE_OPTIONS)
    ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ttgir"]
    outer = next(line for line in ttgir.splitlines() if "scf.for" in line)
    return "= %m" in outer


def main() -> dict[str, bool]:
    result = {fn.fn.__name__.strip("_"): carried(fn) for fn in (_bound_only, _also_in_body, _no_inner_loop)}
    for name, ok in result.items():
        print(f"{name:14s} m loop-carried: {ok}")
    return result


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()    # --help; no options
    main()
