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
* ``+cond-release``: the real step's conditional arrive (the item's Q released after its last S_j);
* ``+late-release``: the K-stage arrive (and the conditional one) after the softmax instead of right after the
  wait for S_j (the kernel's `late_k_release`). The counts show that the conditional arrive, a branch, is what
  matters: behind the softmax it keeps ptxas from hoisting the P.V wait above it (64-66), while the
  unconditional arrive alone, early or late, leaves 0;
* ``smem``: P.V reads P from one shared-memory buffer (P_j stored after P_{j-1} V_{j-1} has completed);
  ``smem2``: two buffers, P_j stored into the other one before the P.V wait;
* ``ws1`` / ``ws2``: the loop in a persistent warp-specialized kernel with one consumer warpgroup, or two
  (the kernel's layout: two 4-warp consumer partitions and a 1-warp worker).

    python scripts/probe_ptxas_overlap.py [--head-dim 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from inspect_gluon_sass import overlap_per_loop, sass_ops  # noqa: E402

from videosparse.kernels._triton_utils import COMPILE_OPTIONS  # noqa: E402
from videosparse.kernels.gluon_hopper import _cta_barrier  # noqa: E402  (the barrier under this Triton's name)


@gluon.jit
def _release(j, n, bars, COND_RELEASE: gl.constexpr):
    """The step's K-stage arrive, and (COND_RELEASE) the item's Q arrive after its last S_j."""
    mbarrier.arrive(bars.index(2), count=1)
    if COND_RELEASE:
        if j == n - 1:
            mbarrier.arrive(bars.index(3), count=1)


@gluon.jit
def _issue_and_softmax(j, n, q_smem, k, v, acc, p_in, m, zero, scale, bars,
                       WAITS: gl.constexpr, COND_RELEASE: gl.constexpr, LATE_RELEASE: gl.constexpr):
    """Front of a tile step: issue S_j and P_{j-1} V_{j-1} (p_in: registers or a shared buffer), wait for
    S_j, softmax; the arrives right after the S_j wait, or (LATE_RELEASE) after the softmax. Returns (P.V
    token, P_j fp32, alpha, new row max)."""
    if WAITS:
        mbarrier.wait(bars.index(0), j & 1)
        mbarrier.wait(bars.index(1), j & 1)
    qk_tok = warpgroup_mma(q_smem, k.permute((1, 0)), zero, use_acc=False, is_async=True)
    acc_tok = warpgroup_mma(p_in, v, acc, is_async=True)
    qk = warpgroup_mma_wait(1, deps=(qk_tok,))
    if not LATE_RELEASE:
        _release(j, n, bars, COND_RELEASE)
    m_new = gl.maximum(m, gl.max(qk, 1) * scale)
    alpha = gl.exp2(m - m_new)
    p = gl.exp2(qk * scale - m_new[:, None])
    if LATE_RELEASE:
        _release(j, n, bars, COND_RELEASE)
    return acc_tok, p, alpha, m_new


@gluon.jit
def _step(j, n, q_smem, k, v, acc, p_in, m, l, zero, scale, bars,
          WAITS: gl.constexpr, LAGGED_SUM: gl.constexpr, COND_RELEASE: gl.constexpr, LATE_RELEASE: gl.constexpr):
    """One tile step with P in registers; returns (acc, P_j as the next P.V operand, m, l)."""
    acc_tok, p, alpha, m_new = _issue_and_softmax(j, n, q_smem, k, v, acc, p_in, m, zero, scale, bars, WAITS,
                                                  COND_RELEASE, LATE_RELEASE)
    if LAGGED_SUM:
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        l = l * alpha + gl.convert_layout(gl.sum(p_in.to(gl.float32), 1), l.type.layout)
    else:
        l = l * alpha + gl.sum(p, 1)
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    return acc, gl.convert_layout(p.to(p_in.dtype), p_in.type.layout), m_new, l


@gluon.jit
def _step_smem(j, n, q_smem, k, v, acc, p_in, p_out, m, l, zero, scale, bars,
               WAITS: gl.constexpr, COND_RELEASE: gl.constexpr, TWO_BUFFERS: gl.constexpr):
    """`_step` with P in shared memory: P.V reads P_{j-1} from buffer p_in while P_j is stored into p_out,
    before the P.V wait when the buffers differ, after it otherwise; returns (acc, m, l)."""
    acc_tok, p, alpha, m_new = _issue_and_softmax(j, n, q_smem, k, v, acc, p_in, m, zero, scale, bars, WAITS,
                                                  COND_RELEASE, False)
    l = l * alpha + gl.sum(p, 1)
    if TWO_BUFFERS:
        p_out.store(p.to(p_out.dtype))
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
    else:
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        p_out.store(p.to(p_out.dtype))
    fence_async_shared()
    _cta_barrier()
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    return acc, m_new, l


@gluon.jit
def _ws_consumer(O, N, scale, q_smem, k_smem, v_smem, p_smem, bars, HEAD_DIM: gl.constexpr, WAITS: gl.constexpr,
                 COND_RELEASE: gl.constexpr, P_SMEM: gl.constexpr):
    """Persistent consumer: items it, N of them, each with a trip count read from O[it]; P in shared memory."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    row: gl.constexpr = gl.SliceLayout(1, s_layout)
    zero = gl.zeros([64, 128], gl.float32, layout=s_layout)
    l = gl.zeros([64], gl.float32, layout=row)
    m = gl.full([64], -1e30, gl.float32, layout=row)
    for it in range(gl.program_id(0), N, gl.num_programs(0)):
        n = gl.load(O + it).to(gl.int32)
        acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)
        for j in range(1, n):
            acc, m, l = _step_smem(j, n, q_smem, k_smem.index(j % 2), v_smem.index(1 - j % 2), acc,
                                   p_smem.index((j + 1) % P_SMEM), p_smem.index(j % P_SMEM), m, l, zero, scale, bars,
                                   WAITS, COND_RELEASE, P_SMEM == 2)
        offs = gl.arange(0, 64, layout=row)
        gl.store(O + it * 64 + offs, l + gl.convert_layout(gl.sum(acc, 1), row))


@gluon.jit
def _ws_idle(bars):
    mbarrier.arrive(bars.index(0), count=1)


@gluon.jit
def _probe(Q, O, N, scale, HEAD_DIM: gl.constexpr, PAIRS: gl.constexpr, WAITS: gl.constexpr,
           LAGGED_SUM: gl.constexpr, COND_RELEASE: gl.constexpr, P_SMEM: gl.constexpr, WS: gl.constexpr,
           LATE_RELEASE: gl.constexpr):
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
    p_smem = gl.allocate_shared_memory(dtype, [2, 64, 128], gl.NVMMASharedLayout.get_default_for([64, 128], dtype))
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)
    zero = gl.zeros([64, 128], gl.float32, layout=s_layout)
    pa = gl.convert_layout(zero.to(dtype), p_layout)
    l = gl.zeros([64], gl.float32, layout=row)
    m = gl.full([64], -1e30, gl.float32, layout=row)
    if WS == 1:
        gl.warp_specialize([
            (_ws_consumer, (O, N, scale, q_smem, k_smem, v_smem, p_smem, bars, HEAD_DIM, WAITS, COND_RELEASE, P_SMEM)),
            (_ws_idle, (bars,)),
        ], [1], [24])
    elif WS == 2:
        gl.warp_specialize([
            (_ws_consumer, (O, N, scale, q_smem, k_smem, v_smem, p_smem, bars, HEAD_DIM, WAITS, COND_RELEASE, P_SMEM)),
            (_ws_consumer, (O, N, scale, q_smem, k_smem, v_smem, p_smem, bars, HEAD_DIM, WAITS, COND_RELEASE, P_SMEM)),
            (_ws_idle, (bars,)),
        ], [4, 1], [240, 24])
    elif P_SMEM:
        for j in range(N):
            acc, m, l = _step_smem(j, N, q_smem, k_smem.index(j % 2), v_smem.index(1 - j % 2), acc,
                                   p_smem.index((j + 1) % P_SMEM), p_smem.index(j % P_SMEM), m, l, zero, scale, bars,
                                   WAITS, COND_RELEASE, P_SMEM == 2)
        offs = gl.arange(0, 64, layout=row)
        gl.store(O + offs, l + gl.convert_layout(gl.sum(acc, 1), row))
    elif PAIRS:
        for i in range(N // 2):
            acc, pb, m, l = _step(2 * i, N, q_smem, k_smem.index(0), v_smem.index(1), acc, pa, m, l, zero, scale, bars,
                                  WAITS, LAGGED_SUM, COND_RELEASE, LATE_RELEASE)
            acc, pa, m, l = _step(2 * i + 1, N, q_smem, k_smem.index(1), v_smem.index(0), acc, pb, m, l, zero, scale,
                                  bars, WAITS, LAGGED_SUM, COND_RELEASE, LATE_RELEASE)
    else:
        for j in range(N):
            acc, pa, m, l = _step(j, N, q_smem, k_smem.index(j % 2), v_smem.index(1 - j % 2), acc, pa, m, l, zero,
                                  scale, bars, WAITS, LAGGED_SUM, COND_RELEASE, LATE_RELEASE)
    if WS == 0 and not P_SMEM:
        offs = gl.arange(0, 64, layout=row)
        gl.store(O + offs, l + gl.convert_layout(gl.sum(acc, 1), row))


FLAGS = ("PAIRS", "WAITS", "LAGGED_SUM", "COND_RELEASE", "P_SMEM", "WS", "LATE_RELEASE")
VARIANTS = {   # name: values of FLAGS
    "single": (0, 0, 0, 0, 0, 0, 0),
    "pairs": (1, 0, 0, 0, 0, 0, 0),
    "pairs+waits": (1, 1, 0, 0, 0, 0, 0),
    "pairs+waits+lagged-sum": (1, 1, 1, 0, 0, 0, 0),
    "pairs+waits+lagged-sum+cond-release": (1, 1, 1, 1, 0, 0, 0),
    "smem+waits+cond-release": (0, 1, 0, 1, 1, 0, 0),
    "smem2+waits+cond-release": (0, 1, 0, 1, 2, 0, 0),
    "ws1-smem2+waits+cond-release": (0, 1, 0, 1, 2, 1, 0),
    "ws2-smem2+waits+cond-release": (0, 1, 0, 1, 2, 2, 0),
    "single+waits": (0, 1, 0, 0, 0, 0, 0),
    "single+waits+cond-release": (0, 1, 0, 1, 0, 0, 0),
    "single+late-release": (0, 0, 0, 0, 0, 0, 1),
    "single+cond-release+late-release": (0, 0, 0, 1, 0, 0, 1),
    "single+waits+late-release": (0, 1, 0, 0, 0, 0, 1),
    "single+waits+cond-release+late-release": (0, 1, 0, 1, 0, 0, 1),
    "pairs+waits+late-release": (1, 1, 0, 0, 0, 0, 1),
}


def main(argv: list[str] | None = None) -> dict[str, list[int]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    ap.add_argument("--variants", nargs="*", choices=sorted(VARIANTS), help="default: all")
    ap.add_argument("--out", help="write the counts as JSON (merged into the file's entry for this head dim)")
    args = ap.parse_args(argv)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    signature = {"Q": "*bf16", "O": "*fp32", "N": "i32", "scale": "fp32"}
    signature.update({k: "constexpr" for k in ("HEAD_DIM",) + FLAGS})
    counts = {}
    for name in args.variants or list(VARIANTS):
        flags = dict(zip(FLAGS, VARIANTS[name]), HEAD_DIM=args.head_dim)
        kernel = triton.compile(GluonASTSource(_probe, signature, flags), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=4, **COMPILE_OPTIONS))
        counts[name] = overlap_per_loop(sass_ops(kernel.asm["cubin"], tools))
        print(f"head dim {args.head_dim} {name:38s} exponentials under P.V per step: {counts[name]}", flush=True)
    if args.out:
        out = Path(args.out)
        report = json.loads(out.read_text()) if out.exists() else {
            "what": "MUFU.EX2 between the score-GEMM wait and the P.V wait, per loop step, in the sm_90 SASS of "
                    "minimal Gluon loops (scripts/probe_ptxas_overlap.py); 64-66 = softmax fully under P.V",
            "triton": triton.__version__}
        report[f"head_dim_{args.head_dim}"] = {**report.get(f"head_dim_{args.head_dim}", {}), **counts}
        out.write_text(json.dumps(report, indent=1))
    return counts


if __name__ == "__main__":
    main()
