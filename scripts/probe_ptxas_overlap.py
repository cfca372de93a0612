#!/usr/bin/env python
"""Why ptxas waits for the P.V GEMM before the softmax: minimal Gluon loops, compiled for sm_90, no GPU needed.

Each loop step issues S_j = Q K_j^T and P_{j-1} V_{j-1} (P from registers), waits for S_j, runs the online
softmax of S_j and waits for P.V: the softmax is meant to run under the in-flight P.V. For each variant
the script counts the MUFU.EX2 (exponentials) that ptxas leaves between the two waits, per loop step
(`inspect_gluon_sass.overlap_per_loop`; 64 or 66 is full overlap at head dim 128, 0 none):

* ``single``: one P register set (what the kernel does);
* ``pairs``: two steps per iteration, P in two register sets;
* ``+waits``: the real step's mbarrier waits for K_j and V_{j-1} (spin loops) at the start of each step;
* ``+lagged-sum``: the row sum taken from the in-flight bf16 P after its wait (keeps its registers live);
* ``+cond-release``: the real step's conditional arrive (the item's Q released after its last S_j).

    python scripts/probe_ptxas_overlap.py [--head-dim 64]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from inspect_gluon_sass import overlap_per_loop, sass_ops  # noqa: E402


@gluon.jit
def _step(j, n, q_smem, k, v, acc, p_in, m, l, zero, scale, bars,
          WAITS: gl.constexpr, LAGGED_SUM: gl.constexpr, COND_RELEASE: gl.constexpr):
    """One tile step; returns (acc, P_j as the next P.V operand, m, l)."""
    dtype: gl.constexpr = p_in.dtype
    p_layout: gl.constexpr = p_in.type.layout
    if WAITS:
        mbarrier.wait(bars.index(0), j & 1)
        mbarrier.wait(bars.index(1), j & 1)
    qk_tok = warpgroup_mma(q_smem, k.permute((1, 0)), zero, use_acc=False, is_async=True)
    acc_tok = warpgroup_mma(p_in, v, acc, is_async=True)
    qk = warpgroup_mma_wait(1, deps=(qk_tok,))
    mbarrier.arrive(bars.index(2), count=1)
    if COND_RELEASE:
        if j == n - 1:
            mbarrier.arrive(bars.index(3), count=1)
    m_new = gl.maximum(m, gl.max(qk, 1) * scale)
    alpha = gl.exp2(m - m_new)
    p = gl.exp2(qk * scale - m_new[:, None])
    if LAGGED_SUM:
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        l = l * alpha + gl.convert_layout(gl.sum(p_in.to(gl.float32), 1), l.type.layout)
    else:
        l = l * alpha + gl.sum(p, 1)
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    return acc, gl.convert_layout(p.to(dtype), p_layout), m_new, l


@gluon.jit
def _probe(Q, O, N, scale, HEAD_DIM: gl.constexpr, PAIRS: gl.constexpr, WAITS: gl.constexpr,
           LAGGED_SUM: gl.constexpr, COND_RELEASE: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, HEAD_DIM], dtype)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_smem = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], q_sl)
    k_smem = gl.allocate_shared_memory(dtype, [2, 128, HEAD_DIM], kv_sl)
    v_smem = gl.allocate_shared_memory(dtype, [2, 128, HEAD_DIM], kv_sl)
    bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(bars.index(i), count=1)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)
    zero = gl.zeros([64, 128], gl.float32, layout=s_layout)
    pa = gl.convert_layout(zero.to(dtype), p_layout)
    l = gl.zeros([64], gl.float32, layout=row)
    m = gl.full([64], -1e30, gl.float32, layout=row)
    if PAIRS:
        for i in range(N // 2):
            acc, pb, m, l = _step(2 * i, N, q_smem, k_smem.index(0), v_smem.index(1), acc, pa, m, l, zero, scale, bars,
                                  WAITS, LAGGED_SUM, COND_RELEASE)
            acc, pa, m, l = _step(2 * i + 1, N, q_smem, k_smem.index(1), v_smem.index(0), acc, pb, m, l, zero, scale,
                                  bars, WAITS, LAGGED_SUM, COND_RELEASE)
    else:
        for j in range(N):
            acc, pa, m, l = _step(j, N, q_smem, k_smem.index(j % 2), v_smem.index(1 - j % 2), acc, pa, m, l, zero,
                                  scale, bars, WAITS, LAGGED_SUM, COND_RELEASE)
    offs = gl.arange(0, 64, layout=row)
    gl.store(O + offs, l + gl.convert_layout(gl.sum(acc, 1), row))


VARIANTS = {   # name: (PAIRS, WAITS, LAGGED_SUM, COND_RELEASE)
    "single": (0, 0, 0, 0),
    "pairs": (1, 0, 0, 0),
    "pairs+waits": (1, 1, 0, 0),
    "pairs+waits+lagged-sum": (1, 1, 1, 0),
    "pairs+waits+lagged-sum+cond-release": (1, 1, 1, 1),
}


def main(argv: list[str] | None = None) -> dict[str, list[int]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    ap.add_argument("--variants", nargs="*", choices=sorted(VARIANTS), help="default: all")
    args = ap.parse_args(argv)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    signature = {"Q": "*bf16", "O": "*fp32", "N": "i32", "scale": "fp32"}
    signature.update({k: "constexpr" for k in ("HEAD_DIM", "PAIRS", "WAITS", "LAGGED_SUM", "COND_RELEASE")})
    counts = {}
    for name in args.variants or list(VARIANTS):
        flags = dict(zip(("PAIRS", "WAITS", "LAGGED_SUM", "COND_RELEASE"), VARIANTS[name]), HEAD_DIM=args.head_dim)
        kernel = triton.compile(GluonASTSource(_probe, signature, flags), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=4))
        counts[name] = overlap_per_loop(sass_ops(kernel.asm["cubin"], tools))
        print(f"head dim {args.head_dim} {name:38s} exponentials under P.V per step: {counts[name]}", flush=True)
    return counts


if __name__ == "__main__":
    main()
