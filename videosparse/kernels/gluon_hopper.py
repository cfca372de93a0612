"""Hopper (sm_90) tile-skipping attention forward written in Gluon: an explicit FA3-style schedule.

Triton's automatic warp specialization (`triton_hopper`) gives one consumer warpgroup whose softmax
does not overlap its own GEMMs. This kernel writes the schedule out:

* one loader warp: TMA loads of the two Q halves of the work item, then the listed K and V tiles into
  a ring of `NUM_STAGES` shared-memory stages (K and V have their own ready barriers, so the score
  GEMM can start before V lands); it also hands each item's id and tile count to the consumers in shared
  memory beside its Q buffer (`HANDOFF`), so they need no global loads at item boundaries;
* two consumer warpgroups, each owning 64 of the 128 query rows: per key tile the score GEMM
  S_j = Q K_j^T is issued asynchronously *before* the P_{j-1} V_{j-1} GEMM of the previous tile, so
  that the online softmax of S_j can run while P_{j-1} V_{j-1} is in the tensor cores. With P in registers
  ptxas keeps that overlap only if a branch separates the softmax from the P.V wait (otherwise it hoists the
  wait above the softmax): `LATE_Q` puts the step's conditional Q-buffer release there, `LATE_K` the K-stage
  release (both on by default at head dim 128: `default_late_k_release`; `scripts/inspect_gluon_sass.py`
  counts the overlap). The two warpgroups also interleave one's softmax with the other's GEMMs.
* persistent grid, work items (batch*head, query tile) in `plan.work_order` as in `triton_hopper`; two Q
  buffers let the loader fetch the next item's Q and first K/V tiles early, and the pipeline is carried
  across items: an item's last P.V GEMM and epilogue overlap the next item's first score GEMM and softmax
  (`FIRST_OVERLAP`: that softmax also stays under the P.V GEMM); the epilogue
  stages the output in the finished item's Q half and stores it with TMA (asynchronous). The items of
  the last, partly filled wave are cut into parts for the idle SMs (`SPLIT`, `tail_split`), whose
  partial outputs a small Triton kernel merges.

Measured and removed (docs/kernel_notes.md gives the numbers; the code is in git at 8525f03): a pipeline per work item
without the cross-item carry, FA3's enforced ping-pong of the two warpgroups' GEMMs, and P read by the P.V GEMM
from shared memory instead of registers; none was faster on the H200. Nor, on this pipeline (code in git at
e300669), the ping-pong on hardware named barriers (even) or the softmax's row max and sum as shallow trees (slower);
nor the correction's centroid GEMMs in fp8 or its exact tiles and chunks in two loops (slower; docs/kernel_notes.md).

Semantics are those of `reference.reference_attention`. With the zero-order correction each item's
centroid chunks (k_mean, v_sum/len, bias log2 len; -inf for its exact tiles) follow its exact tiles in
the same loop, each chunk's bias staged in shared memory by the loader with its k_mean. Rows past S are not
stored; key columns past Sk in the last tile are masked. Needs a CUDA device of compute capability 9.x; compile
it ahead of time on any machine with `compile_for_sm90`.
"""

from __future__ import annotations

import warnings

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..plan import Plan, device_programs
from ._triton_utils import (COMPILE_OPTIONS, LOG2E, aot_seq_len, correction_inputs, key_limit, launch_dims,
                            launch_signature, on_input_device)
from .probe import probe_kernel
from .tail_split import AUTO_MIN_SAVED, combine_parts, tail_split
from .triton_generic import generic_attention
from .triton_hopper import HopperBackend

HALF_M = 64            # query rows per consumer warpgroup
BLOCK_M = 2 * HALF_M   # query rows per work item (two consumer warpgroups)
NEG_BIG = gl.constexpr(-1.0e30)
SHARED_LIMIT = 227 * 1024 - 1024   # sm_90 shared memory per block, less room for the barriers
# Gluon builtins renamed after Triton 3.6: the block-wide barrier (bar.sync; the old name is gone in 3.7) and the TMA
# copies between global and shared memory (old names gone in 3.9)
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# the newest Triton this kernel was compiled and run on (GPU tests, timings); Gluon's API has changed every release
NEWEST_CHECKED_TRITON = (3, 9)
# the oldest it compiles on: Gluon before 3.6 (3.5 is torch 2.9's) has no device-side TMA descriptors
OLDEST_TRITON = (3, 6)


@gluon.constexpr_function
def _wgmma_layout(n):
    """Register layout of one consumer warpgroup's 64 x n wgmma accumulator (scores: n = BLOCK_N; output:
    n = HEAD_DIM)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _work_item(ORDER, KV_COUNT, it, MQ):
    """(item, batch*head, query tile, kv_count) of the it-th work item of ORDER."""
    item = gl.load(ORDER + it)
    return item, item // MQ, item % MQ, gl.load(KV_COUNT + item)


@gluon.jit
def _unit_part(u, N_FULL, PARTS, SPLIT: gl.constexpr):
    """Work unit u (`tail_split`) as (index of its item in ORDER, tail, v, k, part). SPLIT: units from N_FULL on
    are parts of the last items, PARTS per item (tail = 1, v = u - N_FULL, k = PARTS, part = v % k); otherwise
    every unit is a whole item (u, 0, 0, 1, 0)."""
    if SPLIT:
        tail = (u >= N_FULL).to(gl.int32)
        v = (u - N_FULL) * tail
        k = 1 + (PARTS - 1) * tail
        part = v % k
        idx = u + tail * (N_FULL + v // k - u)
    else:
        tail = 0
        v = 0
        k = 1
        part = 0
        idx = u
    return idx, tail, v, k, part


@gluon.jit
def _unit_tiles(item, bh, mt, total, tail, v, k, part, KV_INDEX, KMAX, NCH, SPLIT: gl.constexpr):
    """(item, bh, mt, its kv_index row from its first tile on, n exact tiles, n_all = n + its centroid chunks,
    workspace slot; -1: a whole item) of a unit of `_unit_part` whose item has `total` listed tiles (a part
    takes tiles [part total / k, (part + 1) total / k), the centroid chunks go with the last part)."""
    if SPLIT:
        lo = part * total // k
        n = (part + 1) * total // k - lo
        n_all = n + NCH * (part == k - 1).to(gl.int32)
        slot = tail * (v + 1) - 1
    else:
        lo = 0
        n = total
        n_all = n + NCH
        slot = -1
    return item, bh, mt, KV_INDEX + item.to(gl.int64) * KMAX + lo, n, n_all, slot


@gluon.jit
def _work_unit(ORDER, KV_COUNT, KV_INDEX, u, MQ, KMAX, NCH, N_FULL, PARTS, SPLIT: gl.constexpr):
    """Work unit u (`tail_split`), its item and kv_count loaded here (two dependent global loads): `_unit_tiles`
    and, last, the item's kv_count."""
    idx, tail, v, k, part = _unit_part(u, N_FULL, PARTS, SPLIT)
    item, bh, mt, total = _work_item(ORDER, KV_COUNT, idx, MQ)
    item, bh, mt, row, n, n_all, slot = _unit_tiles(item, bh, mt, total, tail, v, k, part, KV_INDEX, KMAX, NCH, SPLIT)
    return item, bh, mt, row, n, n_all, slot, total


@gluon.jit
def _unit_send(buf, item, total):
    """HANDOFF, loader warp: (item, kv_count) of the unit into its slot `buf` (int32 [2] in shared memory), before
    the arrive on the unit's Q barrier that publishes it (the warp barrier orders every lane's store first)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    pick = gl.arange(0, 2, layout=layout)
    buf.store(gl.where(pick == 0, item, total))
    _cta_barrier()


@gluon.jit
def _unit_received(buf):
    """HANDOFF, consumer warpgroup: (item, kv_count) of `_unit_send`, every thread holding both (no shuffles)."""
    layout: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
    vals = buf.load(layout)
    pick = gl.arange(0, 2, layout=layout)
    return gl.sum(gl.where(pick == 0, vals, 0), axis=0), gl.sum(gl.where(pick == 1, vals, 0), axis=0)


@gluon.jit
def _item_start(ORDER, KV_COUNT, KV_INDEX, it, t, MQ, KMAX, NCH, N_FULL, PARTS, q_smem, q_ready, unit_smem,
                WG: gl.constexpr, SPLIT: gl.constexpr, HANDOFF: gl.constexpr):
    """A consumer's start of its t-th work unit (unit it, `_work_unit`): waits for the item's Q; returns
    (bh, mt, n exact tiles, its kv_index row, n_all steps, workspace slot, Q buffer, this warpgroup's Q
    half). HANDOFF: the unit's item and kv_count come from the loader through shared memory
    (`_unit_send`) with the Q barrier, instead of two dependent global loads before it."""
    Q_BUFS: gl.constexpr = q_ready.type.shape[0]
    if HANDOFF:
        qb = t % Q_BUFS
        mbarrier.wait(q_ready.index(qb), (t // Q_BUFS) & 1)
        item, total = _unit_received(unit_smem.index(qb))
        _, tail, v, k, part = _unit_part(it, N_FULL, PARTS, SPLIT)
        item, bh, mt, row, n, n_all, slot = _unit_tiles(item, item // MQ, item % MQ, total, tail, v, k, part,
                                                        KV_INDEX, KMAX, NCH, SPLIT)
    else:
        item, bh, mt, row, n, n_all, slot, _ = _work_unit(ORDER, KV_COUNT, KV_INDEX, it, MQ, KMAX, NCH, N_FULL,
                                                          PARTS, SPLIT)
        qb = t % Q_BUFS
        mbarrier.wait(q_ready.index(qb), (t // Q_BUFS) & 1)
    return bh, mt, n, row, n_all, slot, qb, q_smem.index(2 * qb + WG)


@gluon.jit
def _box(buf):
    """A [BLOCK_N, D] stage buffer seen as the [1, BLOCK_N, D] box of the 3D K / V descriptors (same bytes)."""
    return buf.reshape([1, buf.shape[0], buf.shape[1]])


@gluon.jit
def _loader(desc_q, desc_k, desc_v, desc_km, desc_vm, desc_b, KV_INDEX, KV_COUNT, ORDER, S, SK, NK, NCP, MQ, KMAX,
            N_UNITS, NCH, N_FULL, PARTS, q_smem, k_smem, v_smem, bars, unit_smem, BLOCK_N: gl.constexpr,
            NUM_STAGES: gl.constexpr, SPLIT: gl.constexpr, HANDOFF: gl.constexpr, CORR: gl.constexpr):
    """1 warp: Q halves per work unit, then its listed K/V tiles and centroid chunks (k_mean / v_mean rows of
    the item's head and, CORR, the chunk's slice of the item's bias row into the stage's b_smem, on the K barrier;
    NCH = 0 without a correction) into the stage ring. HANDOFF: also the unit's item and kv_count, for the
    consumers, into the slot of its Q buffer (`_unit_send`)."""
    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, b_smem = bars
    Q_BUFS: gl.constexpr = q_ready.type.shape[0]
    c = 0
    t = 0
    for it in range(gl.program_id(0), N_UNITS, gl.num_programs(0)):
        item, bh, mt, row, n, n_all, slot, total = _work_unit(ORDER, KV_COUNT, KV_INDEX, it, MQ, KMAX, NCH, N_FULL,
                                                              PARTS, SPLIT)
        qb = t % Q_BUFS
        mbarrier.wait(q_empty.index(qb), ((t // Q_BUFS) & 1) ^ 1)
        if HANDOFF:
            _unit_send(unit_smem.index(qb), item, total)
        mbarrier.expect(q_ready.index(qb), 2 * desc_q.block_type.nbytes)
        row0 = bh * S + mt * 128
        _tma_load(desc_q, [row0, 0], q_ready.index(qb), q_smem.index(2 * qb))
        _tma_load(desc_q, [row0 + 64, 0], q_ready.index(qb), q_smem.index(2 * qb + 1))
        for j in range(n_all):
            s = c % NUM_STAGES
            ph = (c // NUM_STAGES) & 1
            if j < n:
                key_row = gl.load(row + j) * BLOCK_N
            else:
                key_row = (j - n) * BLOCK_N
            k_box = _box(k_smem.index(s))
            v_box = _box(v_smem.index(s))
            mbarrier.wait(k_empty.index(s), ph ^ 1)
            if CORR:
                if j < n:
                    mbarrier.expect(k_ready.index(s), desc_k.block_type.nbytes)
                    _tma_load(desc_k, [bh, key_row, 0], k_ready.index(s), k_box)
                else:
                    mbarrier.expect(k_ready.index(s), desc_k.block_type.nbytes + desc_b.block_type.nbytes)
                    _tma_load(desc_km, [bh, key_row, 0], k_ready.index(s), k_box)
                    _tma_load(desc_b, [item * NCP + (j - n) * BLOCK_N], k_ready.index(s), b_smem.index(s))
            else:
                mbarrier.expect(k_ready.index(s), desc_k.block_type.nbytes)
                _tma_load(desc_k, [bh, key_row, 0], k_ready.index(s), k_box)
            mbarrier.wait(v_empty.index(s), ph ^ 1)
            mbarrier.expect(v_ready.index(s), desc_v.block_type.nbytes)
            if j < n:
                _tma_load(desc_v, [bh, key_row, 0], v_ready.index(s), v_box)
            else:
                _tma_load(desc_vm, [bh, key_row, 0], v_ready.index(s), v_box)
            c += 1
        t += 1


@gluon.jit
def _step_bias(j, n, b_smem, s, cols, inv_scale, CORR: gl.constexpr):
    """CORR: the bias of centroid step j >= n in raw-score units (log2(len) / qk_scale; -inf for exact tiles and
    padding), fp32 [BLOCK_N] (zeros, unused, for exact tiles: ptxas branches over the load), from stage s of
    b_smem, where the loader put the chunk's bias row with its k_mean (`_loader`). Read before the wait for the
    step's score GEMM."""
    if CORR:
        if j >= n:
            bias = b_smem.index(s).load(cols.type.layout) * inv_scale
        else:
            bias = gl.zeros_like(cols, dtype=gl.float32)
    else:
        bias = 0.0
    return bias


@gluon.jit
def _fix_scores(qk, j, n, row, bias, cols, SK, BLOCK_N: gl.constexpr, MASK_LAST: gl.constexpr, CORR: gl.constexpr):
    """Raw scores of step j: exact tile (j < n; keys past SK masked on the partial last tile, which can only be
    the last listed one: kv_index rows are strictly increasing) or centroid chunk j - n (CORR: + `bias` of
    `_step_bias`)."""
    if j < n:
        if MASK_LAST:
            if j == n - 1:
                start = gl.load(row + j) * BLOCK_N
                if start + BLOCK_N > SK:
                    qk = gl.where((start + cols < SK)[None, :], qk, float("-inf"))
    elif CORR:
        qk = qk + bias[None, :]
    return qk


@gluon.jit
def _first_softmax(qk, qk_scale):
    """Online-softmax state (m, l in the log2 domain, P fp32) after an item's first tile."""
    m_i = gl.maximum(gl.max(qk, 1) * qk_scale, NEG_BIG)
    p = gl.exp2(qk * qk_scale - m_i[:, None])
    return m_i, gl.sum(p, 1), p


@gluon.jit
def _normalized_rows(acc, m_i, l_i, mt, WG: gl.constexpr):
    """One warpgroup's 64 finished rows: (out = acc * (1 / l), one reciprocal per row rather than a division per
    element; m, l and `seen` = l != 0 in the rows' layout; the row indices). Rows that saw no key give 0 (and lse
    -inf); a NaN row keeps NaN in both."""
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    m_o = gl.convert_layout(m_i, row_o)
    l_o = gl.convert_layout(l_i, row_o)
    seen = l_o != 0.0
    out = acc * (1.0 / gl.where(seen, l_o, 1.0))[:, None]
    return out, m_o, l_o, seen, mt * 128 + WG * 64 + gl.arange(0, 64, layout=row_o)


@gluon.jit
def _store_lse(m_o, l_o, seen, rows, bh, LSE, S, STORE_LSE: gl.constexpr):
    """STORE_LSE: lse = (m + log2 l) ln 2 of the rows (-inf for rows that saw no key; rows past S dropped)."""
    if STORE_LSE:
        lse = gl.where(seen, (m_o + gl.log2(gl.where(seen, l_o, 1.0))) * 0.6931471805599453, float("-inf"))
        gl.store(LSE + bh.to(gl.int64) * S + rows, lse, mask=rows < S)


@gluon.jit
def _store_rows(acc, m_i, l_i, bh, mt, O, LSE, S, WG: gl.constexpr, HEAD_DIM: gl.constexpr, STORE_LSE: gl.constexpr):
    """Epilogue of one warpgroup's 64 rows from registers (`_normalized_rows`) and the lse; rows past S
    dropped."""
    out, m_o, l_o, seen, rows = _normalized_rows(acc, m_i, l_i, mt, WG)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc.type.layout))
    o_ptr = O + (bh.to(gl.int64) * S + rows)[:, None] * HEAD_DIM + offs_d[None, :]
    gl.store(o_ptr, out.to(O.dtype.element_ty), mask=(rows < S)[:, None])
    _store_lse(m_o, l_o, seen, rows, bh, LSE, S, STORE_LSE)


@gluon.jit
def _epilogue(acc, m_i, l_i, bh, mt, O, LSE, S, desc_o, o_smem, WG: gl.constexpr, HEAD_DIM: gl.constexpr,
              STORE_LSE: gl.constexpr, EPI_TMA: gl.constexpr):
    """One warpgroup's 64 rows out. EPI_TMA and all 64 rows below S: the normalised rows into o_smem (the
    finished item's Q half), then an asynchronous TMA store (the caller waits for it with `_release_q` before the
    buffer is reused); otherwise `_store_rows` from registers."""
    if EPI_TMA and mt * 128 + WG * 64 + 64 <= S:
        out, m_o, l_o, seen, rows = _normalized_rows(acc, m_i, l_i, mt, WG)
        o_smem.store(out.to(o_smem.dtype))
        fence_async_shared()
        _cta_barrier()
        _tma_store(desc_o, [bh * S + mt * 128 + WG * 64, 0], o_smem)
        _store_lse(m_o, l_o, seen, rows, bh, LSE, S, STORE_LSE)
    else:
        _store_rows(acc, m_i, l_i, bh, mt, O, LSE, S, WG, HEAD_DIM, STORE_LSE)


@gluon.jit
def _release_q(q_empty, qb):
    """EPI_TMA: hand Q buffer qb back to the loader once the TMA store of the output staged in it has read
    shared memory (every thread passes the wait before the single arrive)."""
    tma.store_wait(0)
    _cta_barrier()
    mbarrier.arrive(q_empty.index(qb), count=1)


@gluon.jit
def _release_q_at_step(q_empty, qb, rel_qb, j, n_all, EPI_TMA: gl.constexpr):
    """Step j of `_tile_loop`, after its score GEMM: the Q buffer that this step frees, if any (EPI_TMA: at step 1
    the previous item's, rel_qb, once its output's TMA store has read it; otherwise this item's after its last
    score GEMM). A branch: placed after the softmax it keeps ptxas's P.V wait behind the softmax (`_tile_loop`)."""
    if EPI_TMA:
        if j == 1 and rel_qb >= 0:
            _release_q(q_empty, rel_qb)
    elif j == n_all - 1:
        mbarrier.arrive(q_empty.index(qb), count=1)


@gluon.jit
def _tile_loop(c, n, n_all, qb, q_half, acc, m_i, l_i, p_op, row, cols, SK, qk_scale, inv_scale, zero_s,
               k_smem, v_smem, bars, rel_qb, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, MASK_LAST: gl.constexpr,
               CORR: gl.constexpr, EPI_TMA: gl.constexpr, LATE_K: gl.constexpr, LATE_Q: gl.constexpr):
    """Steps 1 .. n_all-1 of an item: S_j = Q K_j^T issued before P_{j-1} V_{j-1}, online softmax of S_j while
    P.V runs; releases each K stage after its score GEMM (LATE_K: after the softmax), each V stage after its
    P.V, and Q after the last score GEMM (EPI_TMA: instead, at step 1, Q buffer rel_qb of the previous item,
    whose output the TMA store read from it; rel_qb < 0: none) (`_release_q_at_step`; LATE_Q: after the
    softmax). Returns (acc, m_i, l_i, p_op); the last P.V (P_{n_all-1}) is left to the caller.

    With P in registers, ptxas hoists the P.V wait above the softmax when both sit in one basic block; the
    conditional Q release placed after the softmax (LATE_Q) is a branch between them, and the softmax stays
    under the GEMM (66 of 66 exponentials; where the K arrive goes does not matter for that:
    `scripts/probe_ptxas_overlap.py` "+late-release" variants, `scripts/inspect_gluon_sass.py`)."""
    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, b_smem = bars
    dtype: gl.constexpr = p_op.dtype
    p_layout: gl.constexpr = p_op.type.layout
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    for j in range(1, n_all):
        cj = c + j
        sj = cj % NUM_STAGES
        sp = (cj - 1) % NUM_STAGES
        mbarrier.wait(k_ready.index(sj), (cj // NUM_STAGES) & 1)
        mbarrier.wait(v_ready.index(sp), ((cj - 1) // NUM_STAGES) & 1)
        qk_tok = warpgroup_mma(q_half, k_smem.index(sj).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)
        bias = _step_bias(j, n, b_smem, sj, cols, inv_scale, CORR)
        qk = warpgroup_mma_wait(1, deps=(qk_tok,))
        if not LATE_K:
            mbarrier.arrive(k_empty.index(sj), count=1)
        if not LATE_Q:
            _release_q_at_step(q_empty, qb, rel_qb, j, n_all, EPI_TMA)
        qk = _fix_scores(qk, j, n, row, bias, cols, SK, BLOCK_N, MASK_LAST, CORR)
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(qk * qk_scale - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        if LATE_K:
            mbarrier.arrive(k_empty.index(sj), count=1)
        if LATE_Q:
            _release_q_at_step(q_empty, qb, rel_qb, j, n_all, EPI_TMA)
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        mbarrier.arrive(v_empty.index(sp), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    return acc, m_i, l_i, p_op


@gluon.jit
def _unit_epilogue(acc, m_i, l_i, bh, mt, slot, O, LSE, S, desc_o, o_smem, O_PART, LSE_PART, WG: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STORE_LSE: gl.constexpr, EPI_TMA: gl.constexpr, SPLIT: gl.constexpr):
    """`_epilogue` of a work unit: a part of a split item (slot >= 0) writes its 128 normalised rows (fp32) and
    their lse to workspace slot `slot` (`tail_split.combine_parts` merges them), a whole item to O."""
    if SPLIT and slot >= 0:
        _store_rows(acc, m_i, l_i, slot, 0, O_PART, LSE_PART, 128, WG, HEAD_DIM, True)
    else:
        _epilogue(acc, m_i, l_i, bh, mt, O, LSE, S, desc_o, o_smem, WG, HEAD_DIM, STORE_LSE, EPI_TMA)


@gluon.jit
def _finish_pending(WG: gl.constexpr, pv_c, acc, m_i, l_i, p_op, v_smem, v_ready, v_empty, bh, mt, slot, O, LSE, S,
                    desc_o, o_smem, O_PART, LSE_PART, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
                    STORE_LSE: gl.constexpr, EPI_TMA: gl.constexpr, SPLIT: gl.constexpr):
    """The pending unit's last P.V (tile pv_c) when no next score GEMM goes with it, then its epilogue."""
    sp = pv_c % NUM_STAGES
    mbarrier.wait(v_ready.index(sp), (pv_c // NUM_STAGES) & 1)
    acc_tok = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc_tok,))
    mbarrier.arrive(v_empty.index(sp), count=1)
    _unit_epilogue(acc, m_i, l_i, bh, mt, slot, O, LSE, S, desc_o, o_smem, O_PART, LSE_PART, WG, HEAD_DIM, STORE_LSE,
                   EPI_TMA, SPLIT)


@gluon.jit
def _consume(WG: gl.constexpr, O, LSE, KV_INDEX, KV_COUNT, ORDER, KEY_LIMIT, qk_scale, S, SK, MQ, KMAX, N_UNITS,
             NCH, N_FULL, PARTS, O_PART, LSE_PART, q_smem, k_smem, v_smem, bars, desc_o, HEAD_DIM: gl.constexpr,
             BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, MASK_LAST: gl.constexpr, STORE_LSE: gl.constexpr,
             CORR: gl.constexpr, EPI_TMA: gl.constexpr, SPLIT: gl.constexpr, LATE_K: gl.constexpr,
             LATE_Q: gl.constexpr, FIRST_OVERLAP: gl.constexpr, unit_smem, HANDOFF: gl.constexpr,
             HAS_LIMIT: gl.constexpr):
    """One consumer warpgroup (rows WG*64 .. WG*64+63 of each item), the pipeline carried across work items: per
    item the score GEMMs, online softmax and P.V GEMMs of its exact tiles and (CORR) centroid chunks
    (`_tile_loop`); an item's last P.V GEMM is issued after the next item's first score GEMM, and its epilogue
    runs while that GEMM's softmax is done (no idle tensor cores at item boundaries from this warpgroup).
    FIRST_OVERLAP: the first step releases its K stage after the softmax, inside a branch, so that the softmax
    also overlaps the previous item's last P.V. EPI_TMA: the epilogue stages the output in the finished
    item's Q half and stores it with TMA; that Q buffer goes back to the loader at the next item's second step
    (`_release_q`). SPLIT: the work units of `tail_split`; a part of a split item ends with `_unit_epilogue`
    into the workspace. HANDOFF: see `_item_start`."""
    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, b_smem = bars
    dtype: gl.constexpr = O.dtype.element_ty
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    inv_scale = 1.0 / qk_scale
    zero_s = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
    zero_o = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)
    c = 0
    t = 0
    # state of the previous item whose last P.V is still to issue (pend = 1)
    pend = 0
    pv_c = 0
    prev_bh = 0
    prev_mt = 0
    prev_qb = 0
    prev_slot = -1
    acc = zero_o
    m_i = gl.full([64], NEG_BIG, gl.float32, layout=row_s)
    l_i = gl.zeros([64], gl.float32, layout=row_s)
    p_op = gl.convert_layout(zero_s.to(dtype), p_layout)
    for it in range(gl.program_id(0), N_UNITS, gl.num_programs(0)):
        bh, mt, n, row, n_all, slot, qb, q_half = _item_start(ORDER, KV_COUNT, KV_INDEX, it, t, MQ, KMAX, NCH,
                                                              N_FULL, PARTS, q_smem, q_ready, unit_smem, WG, SPLIT,
                                                              HANDOFF)
        limit = SK                  # keys past it are masked in the last listed tile (MASK_LAST)
        if HAS_LIMIT:
            limit = gl.load(KEY_LIMIT + bh)
        if n_all > 0:
            s0 = c % NUM_STAGES
            mbarrier.wait(k_ready.index(s0), (c // NUM_STAGES) & 1)
            qk_tok = warpgroup_mma(q_half, k_smem.index(s0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            bias = _step_bias(0, n, b_smem, s0, cols, inv_scale, CORR)
            if pend == 1:
                sp = pv_c % NUM_STAGES
                mbarrier.wait(v_ready.index(sp), (pv_c // NUM_STAGES) & 1)
                acc_tok = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)
                qk = warpgroup_mma_wait(1, deps=(qk_tok,))
                if not FIRST_OVERLAP:
                    mbarrier.arrive(k_empty.index(s0), count=1)
                qk = _fix_scores(qk, 0, n, row, bias, cols, limit, BLOCK_N, MASK_LAST, CORR)
                m_n, l_n, p = _first_softmax(qk, qk_scale)
                if FIRST_OVERLAP:
                    # always taken (c counts steps): the branch keeps ptxas from hoisting the wait for the
                    # previous item's last P.V above this softmax (see `_tile_loop`)
                    if c >= 0:
                        mbarrier.arrive(k_empty.index(s0), count=1)
                p_n = gl.convert_layout(p.to(dtype), p_layout)
                acc = warpgroup_mma_wait(0, deps=(acc_tok,))
                mbarrier.arrive(v_empty.index(sp), count=1)
                _unit_epilogue(acc, m_i, l_i, prev_bh, prev_mt, prev_slot, O, LSE, S, desc_o,
                               q_smem.index(2 * prev_qb + WG), O_PART, LSE_PART, WG, HEAD_DIM, STORE_LSE, EPI_TMA,
                               SPLIT)
                rel_qb = prev_qb
            else:
                qk = warpgroup_mma_wait(0, deps=(qk_tok,))
                mbarrier.arrive(k_empty.index(s0), count=1)
                qk = _fix_scores(qk, 0, n, row, bias, cols, limit, BLOCK_N, MASK_LAST, CORR)
                m_n, l_n, p = _first_softmax(qk, qk_scale)
                p_n = gl.convert_layout(p.to(dtype), p_layout)
                rel_qb = -1
            if n_all == 1:
                if EPI_TMA:
                    if rel_qb >= 0:
                        _release_q(q_empty, rel_qb)
                else:
                    mbarrier.arrive(q_empty.index(qb), count=1)
            m_i = m_n
            l_i = l_n
            p_op = p_n
            acc = zero_o
            acc, m_i, l_i, p_op = _tile_loop(c, n, n_all, qb, q_half, acc, m_i, l_i, p_op, row, cols, limit,
                                             qk_scale, inv_scale, zero_s, k_smem, v_smem, bars, rel_qb, BLOCK_N,
                                             NUM_STAGES, MASK_LAST, CORR, EPI_TMA, LATE_K, LATE_Q)
            pend = 1
            pv_c = c + n_all - 1
            prev_bh = bh
            prev_mt = mt
            prev_qb = qb
            prev_slot = slot
        else:
            # an item without tiles: finish the pending one, then write this item's empty rows
            mbarrier.arrive(q_empty.index(qb), count=1)
            if pend == 1:
                _finish_pending(WG, pv_c, acc, m_i, l_i, p_op, v_smem, v_ready, v_empty, prev_bh, prev_mt, prev_slot,
                                O, LSE, S, desc_o, q_smem.index(2 * prev_qb + WG), O_PART, LSE_PART, HEAD_DIM,
                                NUM_STAGES, STORE_LSE, EPI_TMA, SPLIT)
                if EPI_TMA:
                    _release_q(q_empty, prev_qb)
            pend = 0
            m_i = gl.full([64], NEG_BIG, gl.float32, layout=row_s)
            l_i = gl.zeros([64], gl.float32, layout=row_s)
            acc = zero_o
            _unit_epilogue(acc, m_i, l_i, bh, mt, slot, O, LSE, S, desc_o, q_smem.index(2 * qb + WG), O_PART,
                           LSE_PART, WG, HEAD_DIM, STORE_LSE, False, SPLIT)
        c += n_all
        t += 1
    if pend == 1:
        _finish_pending(WG, pv_c, acc, m_i, l_i, p_op, v_smem, v_ready, v_empty, prev_bh, prev_mt, prev_slot, O, LSE,
                        S, desc_o, q_smem.index(2 * prev_qb + WG), O_PART, LSE_PART, HEAD_DIM, NUM_STAGES, STORE_LSE,
                        EPI_TMA, SPLIT)
    if EPI_TMA:
        tma.store_wait(0)


@gluon.jit
def _gluon_fwd(Q, K, V, KM, VM, BIAS, O, LSE, O_PART, LSE_PART, KV_INDEX, KV_COUNT, ORDER, KEY_LIMIT, qk_scale, S, SK,
               NK, NCP, N_BH, MQ, KMAX, N_UNITS, N_FULL, PARTS, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_STAGES: gl.constexpr, MASK_LAST: gl.constexpr, STORE_LSE: gl.constexpr, CORR: gl.constexpr,
               Q_BUFS: gl.constexpr, EPI_TMA: gl.constexpr, SPLIT: gl.constexpr, LATE_K: gl.constexpr,
               LATE_Q: gl.constexpr, FIRST_OVERLAP: gl.constexpr, HANDOFF: gl.constexpr,
               HAS_LIMIT: gl.constexpr = False):
    """Q, O [N_BH*S, D]; K, V [N_BH*SK, D]; LSE fp32 [N_BH*S]; plan KV_INDEX [items, KMAX], KV_COUNT, ORDER.
    MASK_LAST: keys past SK, or (HAS_LIMIT) past the row's KEY_LIMIT int32 [N_BH] (`plan.valid_keys`), are masked
    in an item's last listed tile (the only one that can hold any: rows are sorted and start below the limit).

    Work units (`tail_split`): N_UNITS = N_FULL + (items - N_FULL) * PARTS; SPLIT: the units from N_FULL on are
    parts of the last items, written to O_PART fp32 [(N_UNITS - N_FULL) * 128, D] and LSE_PART fp32 (natural
    log) for `tail_split.combine_parts`.

    EPI_TMA (two Q buffers only): outputs go through shared memory and TMA stores.

    CORR: KM, VM [N_BH*NK, D] tile centroids (k_mean, v_sum/len) and BIAS fp32 [items, NCP] (log2 len; -inf
    for the item's exact tiles and for padding), NCP = NK rounded up to BLOCK_N; the loader stages each chunk's
    slice of the bias row in shared memory with its k_mean (one 512-byte TMA box on the K barrier), so that the
    consumers read it there instead of from L2 in the step.
    """
    dtype: gl.constexpr = Q.dtype.element_ty
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    # K, V and the centroids as [heads, keys, D]: a box past a head's last key reads zeros, not the next head's keys
    # (which the masked scores would drop, but an inf or NaN there would still reach P.V as 0 * inf)
    kv_box: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, HEAD_DIM], dtype)
    desc_q = tma.make_tensor_descriptor(Q, shape=[N_BH * S, HEAD_DIM], strides=[HEAD_DIM, 1],
                                        block_shape=[64, HEAD_DIM], layout=q_sl)
    desc_k = tma.make_tensor_descriptor(K, shape=[N_BH, SK, HEAD_DIM], strides=[SK * HEAD_DIM, HEAD_DIM, 1],
                                        block_shape=[1, BLOCK_N, HEAD_DIM], layout=kv_box)
    desc_v = tma.make_tensor_descriptor(V, shape=[N_BH, SK, HEAD_DIM], strides=[SK * HEAD_DIM, HEAD_DIM, 1],
                                        block_shape=[1, BLOCK_N, HEAD_DIM], layout=kv_box)
    if EPI_TMA:
        desc_o = tma.make_tensor_descriptor(O, shape=[N_BH * S, HEAD_DIM], strides=[HEAD_DIM, 1],
                                            block_shape=[64, HEAD_DIM], layout=q_sl)
    else:
        desc_o = desc_q
    if CORR:
        desc_km = tma.make_tensor_descriptor(KM, shape=[N_BH, NK, HEAD_DIM], strides=[NK * HEAD_DIM, HEAD_DIM, 1],
                                             block_shape=[1, BLOCK_N, HEAD_DIM], layout=kv_box)
        desc_vm = tma.make_tensor_descriptor(VM, shape=[N_BH, NK, HEAD_DIM], strides=[NK * HEAD_DIM, HEAD_DIM, 1],
                                             block_shape=[1, BLOCK_N, HEAD_DIM], layout=kv_box)
        b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
        desc_b = tma.make_tensor_descriptor(BIAS, shape=[N_BH * MQ * NCP], strides=[1], block_shape=[BLOCK_N],
                                            layout=b_sl)
        b_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_N], b_sl)
        NCH = NCP // BLOCK_N
    else:
        desc_km = desc_k
        desc_vm = desc_v
        desc_b = desc_k
        NCH = 0
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFS, 64, HEAD_DIM], q_sl)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    if not CORR:
        b_smem = k_smem             # unused
    if HANDOFF:   # (item, kv_count) of the unit whose Q is in each Q buffer
        unit_smem = gl.allocate_shared_memory(gl.int32, [Q_BUFS, 2],
                                              gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    else:
        unit_smem = q_smem
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    bars = (q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, b_smem)
    # partition arguments are written out in each tuple: a tuple held in a variable turns constexprs into
    # tensors. Default partition: consumer warpgroup 0; workers: consumer warpgroup 1 and the loader warp.
    gl.warp_specialize([
        (_consume, (0, O, LSE, KV_INDEX, KV_COUNT, ORDER, KEY_LIMIT, qk_scale, S, SK, MQ, KMAX, N_UNITS, NCH,
                    N_FULL, PARTS, O_PART, LSE_PART, q_smem, k_smem, v_smem, bars, desc_o, HEAD_DIM, BLOCK_N,
                    NUM_STAGES, MASK_LAST, STORE_LSE, CORR, EPI_TMA, SPLIT, LATE_K, LATE_Q, FIRST_OVERLAP, unit_smem,
                    HANDOFF, HAS_LIMIT)),
        (_consume, (1, O, LSE, KV_INDEX, KV_COUNT, ORDER, KEY_LIMIT, qk_scale, S, SK, MQ, KMAX, N_UNITS, NCH,
                    N_FULL, PARTS, O_PART, LSE_PART, q_smem, k_smem, v_smem, bars, desc_o, HEAD_DIM, BLOCK_N,
                    NUM_STAGES, MASK_LAST, STORE_LSE, CORR, EPI_TMA, SPLIT, LATE_K, LATE_Q, FIRST_OVERLAP, unit_smem,
                    HANDOFF, HAS_LIMIT)),
        (_loader, (desc_q, desc_k, desc_v, desc_km, desc_vm, desc_b, KV_INDEX, KV_COUNT, ORDER, S, SK, NK, NCP, MQ,
                   KMAX, N_UNITS, NCH, N_FULL, PARTS, q_smem, k_smem, v_smem, bars, unit_smem, BLOCK_N, NUM_STAGES,
                   SPLIT, HANDOFF, CORR)),
    ], [4, 1], [240, 24])


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def default_stages(head_dim: int) -> int:
    """K/V ring depth. With separate K and V release barriers 2 stages are as fast as 3 on the H200 (12 x
    32,760 d128 at density 0.1: 599 vs 546 TFLOP/s; d64: 409 vs 414) and leave shared memory free."""
    return 2


def default_late_k_release(head_dim: int) -> bool:
    """Release each K stage, and the Q buffer a step frees, after the softmax of its scores rather than right after
    its score GEMM (`_tile_loop`). With the conditional Q release (a branch) behind the softmax, ptxas keeps the
    softmax under the previous tile's P.V GEMM within the warpgroup (66 of 66 exponentials between the two waits,
    `scripts/inspect_gluon_sass.py`; 0 otherwise), but the loader gets each K stage a softmax later. Measured on
    the H200 (interleaved A/Bs, `benchmarks/ab_gluon_late_k_h200.json`, `..._all_head_dims_h200.json`): at head dim
    128 it gains 0.5-2.6% dense and is even on sparse plans, at 64 it loses 1-5% on sparse plans (at the item
    boundaries: `..._boundary_h200.json`), so it is on at 128 only. The K stage released early and only the Q
    release late (`late_k_release=False, late_q_release=True`, the same overlap in the SASS) was even at 128 and
    lost 3% at 64 on sparse plans (`benchmarks/ab_gluon_late_q_only_h200.json`)."""
    return head_dim == 128


@on_input_device
def gluon_attention(q, k, v, plan: Plan, scale: float, return_lse: bool = False, *, num_stages: int | None = None,
                    q_buffers: int = 2, tma_store: bool = True, split_tail: bool | None = None,
                    late_k_release: bool | None = None, late_q_release: bool | None = None,
                    first_step_overlap: bool = True, unit_handoff: bool = True, num_programs: int | None = None,
                    maxnreg: int = 168):
    """Run the Gluon kernel (inputs are assumed checked: see `GluonHopperBackend.not_supported_reasons`).

    With a correction plan (k_mean / v_sum / tile_len) the skipped tiles enter the same online softmax
    through their centroids: after its exact tiles each work item runs ceil(Nk/128) centroid chunks
    (k_mean, v_sum/len, bias log2 len; -inf for the item's exact tiles), in the same kernel.

    Args:
        q: [B, H, S, D]; k, v: [B, H, Sk, D]; contiguous fp16/bf16 on an sm_90 device; D in (64, 128).
        plan: a Plan of 128x128 tiles.
        scale: softmax scale. return_lse: also return fp32 [B, H, S] natural-log LSE.
        num_stages (default `default_stages(D)`): depth of the K/V ring.
        q_buffers (1 or 2): Q tiles in shared memory; with 2 the loader fetches the next item's Q and
            first K/V tiles while the consumers still work on the current item.
        tma_store (default True; with two Q buffers only): each warpgroup stages its 64
            output rows in the finished item's Q half and writes them with one asynchronous TMA store (rows of
            a partial last query tile from registers). Register stores cost ~1.7 us per work item on the H200
            (an A/B with the stores predicated off); interleaved A/B, 12 x 32,768 d128: +3.0% at density
            0.1 (585 vs 568 TFLOP/s), +5.7% at 0.05 (549 vs 520), +0.9% at 0.25, equal dense; d64 +0.8% to +3%.
        split_tail: cut the items of the last, partly filled wave of the persistent
            grid into parts for the idle SMs and merge them afterwards (`tail_split`). None (default): when
            that saves enough work (`tail_split.AUTO_MIN_SAVED`); True: whenever the last wave has room;
            False: never.
        late_k_release (None: `default_late_k_release(D)`, on at head dim 128): release each K stage after the
            softmax of its scores. late_q_release (None: as late_k_release): release the Q buffer a step frees
            after the softmax; this branch behind the softmax is what lets it overlap the previous tile's P.V
            within the warpgroup. first_step_overlap (default True): the same for an item's first softmax and
            the previous item's last P.V (its K stage released after that softmax; 64 of 64 exponentials
            under that GEMM, 0 without). Interleaved A/Bs on the H200
            (benchmarks/ab_gluon_first_step_overlap_h200.json, ..._correction_h200.json): d128 +0.7 / +1.0 /
            +0.7% at density 1 / 0.1 / 0.05 on 12 x 32,768 (+1.0 / +1.5 / -0.2% on 12 x 32,760), d64 +1.0 /
            -0.3 / +1.7%, with the correction +0.1 to +1.4%; outputs bitwise equal.
        unit_handoff (default True): the loader warp, which decodes each work unit anyway, hands its item and
            kv_count to the consumers through shared memory with the unit's Q barrier, so that they do not wait
            for two dependent global loads at every item boundary (`_item_start`). Interleaved A/Bs on the H200
            (benchmarks/ab_gluon_unit_handoff_h200.json, ..._2_h200.json, ..._correction_h200.json): d64 +1.2 /
            +2.7% at density 0.1 and +2.2 / +0.2% at 0.05 (with the correction +0.8 / +2.4%), d128 -0.3 to
            +0.8% (even); outputs bitwise equal.
        num_programs, maxnreg: tuning knobs (benchmarks).

    Returns:
        out [B, H, S, D] in q's dtype (and lse).
    """
    programs = num_programs or device_programs(q.device)
    B, H, S, D, Sk, Mq, Nk, kv_index, kv_count, order = launch_dims(q, k, plan, programs)
    stages = num_stages or default_stages(D)
    corr = plan.has_correction
    smem = (2 * q_buffers * HALF_M + 2 * stages * plan.block_n) * D * q.element_size()
    smem += stages * plan.block_n * 4 if corr else 0        # the centroid chunks' bias rows
    if q_buffers not in (1, 2) or smem > SHARED_LIMIT:
        raise ValueError(f"q_buffers={q_buffers!r}, num_stages={stages!r} at head dim {D}: need q_buffers in (1, 2) "
                         f"and Q, K/V and bias buffers within {SHARED_LIMIT} bytes of shared memory (this asks "
                         f"{smem}).")
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device) if return_lse else out
    if corr:
        k_mean, v_mean, bias = correction_inputs(plan, Nk, plan.block_n, q.dtype)
    else:
        k_mean, v_mean, bias = k, v, lse
    n_items = order.numel()
    if split_tail is False:
        n_full, parts = n_items, 1
    else:
        n_full, parts = tail_split(n_items, programs, kv_index.shape[1], 0.0 if split_tail else AUTO_MIN_SAVED / D)
    n_units = n_full + (n_items - n_full) * parts
    if parts > 1:
        o_part = torch.empty((n_units - n_full) * BLOCK_M, D, dtype=torch.float32, device=q.device)
        lse_part = torch.empty((n_units - n_full) * BLOCK_M, dtype=torch.float32, device=q.device)
    else:
        o_part, lse_part = out, lse
    grid = (max(1, min(n_units, programs)),)
    late_k = default_late_k_release(D) if late_k_release is None else late_k_release
    triton.set_allocator(_alloc)
    limit = key_limit(plan, H, k.shape[2])
    _gluon_fwd[grid](q, k, v, k_mean, v_mean, bias, out, lse, o_part, lse_part, kv_index, kv_count, order,
                     kv_count if limit is None else limit,
                     scale * LOG2E, S, Sk, Nk, bias.shape[-1] if corr else 0, B * H, Mq, kv_index.shape[1], n_units,
                     n_full, parts, HEAD_DIM=D, BLOCK_N=plan.block_n, NUM_STAGES=stages,
                     MASK_LAST=(Sk % plan.block_n) != 0 or limit is not None, STORE_LSE=return_lse, CORR=corr,
                     Q_BUFS=q_buffers, EPI_TMA=tma_store and q_buffers == 2, SPLIT=parts > 1,
                     LATE_K=late_k, LATE_Q=late_k if late_q_release is None else late_q_release,
                     FIRST_OVERLAP=first_step_overlap, HANDOFF=unit_handoff, HAS_LIMIT=limit is not None, num_warps=4,
                     maxnreg=maxnreg, **COMPILE_OPTIONS)
    if parts > 1:
        combine_parts(o_part, lse_part, out, lse if return_lse else None, order, n_full, parts, Mq)
    return (out, lse) if return_lse else out


def compile_for_sm90(*, head_dim: int = 128, dtype: str = "bf16", num_stages: int | None = None,
                     mask_last: bool = True, store_lse: bool = True, correction: bool = False, q_buffers: int = 2,
                     tma_store: bool = True, split_tail: bool = False, late_k_release: bool | None = None,
                     late_q_release: bool | None = None, first_step_overlap: bool = True, unit_handoff: bool = True,
                     maxnreg: int = 168, seq_len: int | None = None, heads: int = 12, has_limit: bool = False):
    """Compile the kernel ahead of time for sm_90 (works on a CPU-only machine); returns the CompiledKernel.

    Its integer arguments are specialized as a launch with a dense plan on [1, heads, seq_len, head_dim] q, k, v
    would be (`launch_signature`; seq_len defaults to 32,760 with `mask_last`, else 32,768); with `split_tail`
    the last 60 items are cut in two parts; `has_limit`: a plan with `valid_keys` (with `mask_last`).

    Inspect `.asm["ttgir"]` (`ttg.warp_specialize`), `.asm["ptx"]` (`wgmma`, `cp.async.bulk.tensor`,
    `setmaxnreg`) and `.metadata.shared` (bytes of shared memory).
    """
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    ptr = "*" + dtype
    late_k = default_late_k_release(head_dim) if late_k_release is None else late_k_release
    pointers = dict(Q=ptr, K=ptr, V=ptr, KM=ptr, VM=ptr, BIAS="*fp32", O=ptr, LSE="*fp32", O_PART="*fp32",
                    LSE_PART="*fp32", KV_INDEX="*i32", KV_COUNT="*i32", ORDER="*i32", KEY_LIMIT="*i32")
    S = aot_seq_len(seq_len, mask_last or has_limit)
    tiles = -(-S // 128)
    items = tiles * heads
    n_full, parts = (items - 60, 2) if split_tail else (items, 1)
    values = dict(qk_scale=0.125, S=S, SK=S, NK=tiles, NCP=-(-tiles // 128) * 128 if correction else 0, N_BH=heads,
                  MQ=tiles, KMAX=tiles, N_UNITS=n_full + (items - n_full) * parts, N_FULL=n_full, PARTS=parts)
    constants = dict(HEAD_DIM=head_dim, BLOCK_N=128, NUM_STAGES=num_stages or default_stages(head_dim),
                     MASK_LAST=mask_last or has_limit, STORE_LSE=store_lse, CORR=correction, Q_BUFS=q_buffers,
                     EPI_TMA=tma_store and q_buffers == 2, SPLIT=split_tail, LATE_K=late_k,
                     LATE_Q=late_k if late_q_release is None else late_q_release, FIRST_OVERLAP=first_step_overlap,
                     HANDOFF=unit_handoff, HAS_LIMIT=has_limit)
    signature, constants, attrs = launch_signature(_gluon_fwd.arg_names, pointers, values, constants)
    src = GluonASTSource(_gluon_fwd, signature, constants, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=maxnreg, **COMPILE_OPTIONS))


class GluonHopperBackend(HopperBackend):
    """Backend object for the dispatch registry ("gluon_hopper"): first in the auto order on sm_90.

    Accepts what the Triton Hopper backend accepts, with 128x128 tiles only (on CPU it declines:
    Gluon has no interpreter)."""

    name = "gluon_hopper"
    # set when the kernel failed to compile on a Triton newer than NEWEST_CHECKED_TRITON: the backend then declines,
    # and the call that found it ran the generic Triton kernel (not the Triton Hopper one: see triton_hopper.py on
    # preemption)
    compile_failure: str | None = None
    warned_old_triton = False

    def not_supported_reasons(self, q, k, v, plan: Plan) -> list[str]:
        why = super().not_supported_reasons(q, k, v, plan)
        if self.compile_failure is not None:
            why.append(self.compile_failure)
        if (plan.block_m, plan.block_n) != (BLOCK_M, 128):
            why.append(f"tiles {plan.block_m}x{plan.block_n} are not 128x128")
        elif plan.has_correction:      # the loader stages the bias rows by 1D TMA boxes (int32 coordinates)
            # key tiles from the plan, not k: PaddedHeadDim asks with a one-token stand-in of k
            items, ncp = plan.kv_index[..., 0].numel(), -(-plan.k_mean.shape[2] // 128) * 128
            if items * ncp >= 2 ** 31:
                why.append(f"the correction's bias rows ({items} items x {ncp} chunk columns) exceed the 2^31 "
                           "elements a TMA coordinate reaches")
        if triton_version() < OLDEST_TRITON:
            old = (f"needs Triton {'.'.join(map(str, OLDEST_TRITON))} or newer (Gluon's device-side TMA descriptors); "
                   f"this is Triton {triton.__version__}")
            if not why and not GluonHopperBackend.warned_old_triton:      # it would have served these inputs
                GluonHopperBackend.warned_old_triton = True
                warnings.warn(f"videosparse: the Gluon Hopper kernel {old}, so the generic Triton kernel runs instead "
                              "(about 1.4x the time on the H200); a newer torch brings a newer Triton.",
                              RuntimeWarning, stacklevel=2)
            why.append(old)
        return why

    def __call__(self, q, k, v, plan: Plan, scale: float, return_lse: bool):
        if self.compile_failure is None:
            try:
                return gluon_attention(q, k, v, plan, scale, return_lse)
            except triton.CompilationError as err:
                if triton_version() <= NEWEST_CHECKED_TRITON:
                    raise
                self.compile_failure = (f"does not compile on Triton {triton.__version__}, newer than the "
                                        f"{'.'.join(map(str, NEWEST_CHECKED_TRITON))} it was checked on "
                                        f"({str(err).strip().splitlines()[-1]})")
                warnings.warn(f"videosparse: the Gluon Hopper kernel {self.compile_failure}; the generic Triton kernel "
                              "runs instead (about 1.4x the time on the H200).", RuntimeWarning, stacklevel=2)
                probe_kernel.cache_clear()      # sessions report the backend that serves their inputs from now on
        return generic_attention(q, k, v, plan, scale, return_lse)


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton."""
    return tuple(int(part) for part in triton.__version__.split(".")[:2])


BACKEND = GluonHopperBackend()
