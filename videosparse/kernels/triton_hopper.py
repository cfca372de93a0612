"""Hopper (sm_90) tile-skipping attention forward: TMA descriptors + warp specialization, persistent grid.

Layout of this file (as Triton's fused-attention tutorial): hardware checks, the kernel, the host
wrapper, the backend object that the dispatch registry imports.

The kernel runs a persistent grid (one program per SM). Work items are (batch, head, query tile), taken in
`plan.work_order` for this grid (waves of head-major rows, each wave dealt so that the programs' work stays
even) and dealt round-robin to the programs. Per item one warp-specialized loop (TMA loads of K and V at the
listed tile, wgmma, online softmax in the exp2 domain), then the epilogue (out = acc / l, lse = m + log l,
masked stores: rows past S dropped).

* Partial last key tile: kv_index is sorted, so it can only be the last entry; when S is not a
  multiple of BLOCK_N the loop adds a column bias (0 / -inf) to every tile (a tail step after the
  loop would turn warp specialization off, see below).
* Zero-order correction: a first launch of the same kernel with CENTROIDS=True runs the loop over
  all Nk key-tile centroids (k_mean, v_mean = v_sum/len) in chunks of BLOCK_N, with bias log(len)
  and -inf for the tiles the plan keeps exactly; it stores its partial (out, lse). The exact launch
  (MERGE=True) starts its online softmax from that partial. Cost: Nk/BLOCK_N extra loop
  iterations per query tile (1/(BLOCK_N*density) of the exact work) plus one read of out/lse.

Triton 3.6 on sm_90 keeps warp specialization only when every dot of the kernel sits in that one
loop: a second loop with dots (before or after) crashes the NVGPUWarpSpecialization pass, a dot
after the loop silently disables it, and so does a data-dependent `if` inside it. Hence one loop per
kernel and the correction as its own launch.

Descriptors are created on the device (`tl.make_tensor_descriptor`, workspace from
`triton.set_allocator`): host-side TensorDescriptors together with warp specialization crash the
sm_90 compiler in Triton 3.6. num_warps must stay 4 (8 silently disables warp specialization).

Preemption (measured on the H200 with Triton 3.6, `scripts/probe_preemption.py`): while another process uses the GPU
(one process running matmuls is enough), this kernel with warp specialization returns NaN rows on finite inputs:
every program goes wrong at the same one or two items of its persistent loop (4th-5th at 2 stages, 3rd-4th at 1);
kernels shorter than a couple of milliseconds escape, which points to the driver's time slicing preempting it.
Without warp specialization it stays exact, as do the Gluon kernel (its own warp-specialized schedule) and the
generic kernel. So `backend="auto"` never picks this kernel and `backend="hopper"` warns once. Cause not found: the
compiler's partitions and barriers read correct in the TTGIR.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from ..plan import Plan, device_programs
from ._triton_utils import (COMPILE_OPTIONS, LOG2E, NEG_BIG, aot_seq_len, correction_inputs, finish_rows, key_limit,
                            launch_dims, launch_signature, partial_state, softmax_step, on_input_device)
from .dispatch import KERNEL_HEAD_DIMS

SUPPORTED_BLOCKS = (64, 128)


def _hopper_available(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


@triton.jit
def _hopper_fwd(
    Q, K, V, O, LSE,
    KV_INDEX, KV_COUNT, ORDER, BIAS, KEY_LIMIT,
    qk_scale,
    S, SK, N_BH, MQ, KMAX, NCP, N_ITEMS,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CENTROIDS: tl.constexpr,
    MASK_LAST: tl.constexpr,
    MERGE: tl.constexpr,
    STORE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    FLATTEN: tl.constexpr,
    SKIP_LOG2: tl.constexpr = 0.0,
    HAS_LIMIT: tl.constexpr = False,
):
    """One pass of block-sparse attention over a persistent grid.

    CENTROIDS=False: K, V are [N_BH*SK, D]; per item the listed key tiles (MASK_LAST masks keys past SK, or with
                     HAS_LIMIT past the row's KEY_LIMIT [N_BH], `plan.valid_keys`).
    CENTROIDS=True:  K, V are k_mean, v_mean [N_BH*NK, D]; per item all NCP/BLOCK_N centroid chunks, with
                     the log2-domain column bias BIAS [N_ITEMS, NCP] (log2 len, -inf for exact tiles and pad).
    MERGE: O, LSE already hold a partial result (normalised out, natural-log lse) of this item from an
    earlier pass; this pass starts its online softmax from it (`partial_state`).
    SKIP_LOG2 > 0 (exact pass, benchmarks only): online skip; a listed tile whose every score lies more
    than SKIP_LOG2 (log2 units) below the running max of its row is dropped (no exp, no P.V). It needs
    WARP_SPECIALIZE=False (a run-time `if` in the loop).
    """
    tl.static_assert(HEAD_DIM % 16 == 0)
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0)
    dtype = Q.dtype.element_ty
    desc_q = tl.make_tensor_descriptor(Q, shape=[N_BH * S, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    # K, V as [heads, keys, D]: a box past a head's last key reads zeros, not the next head's keys (which the masked
    # scores would drop, but an inf or NaN there would still reach P.V as 0 * inf)
    desc_k = tl.make_tensor_descriptor(K, shape=[N_BH, SK, HEAD_DIM], strides=[SK * HEAD_DIM, HEAD_DIM, 1],
                                       block_shape=[1, BLOCK_N, HEAD_DIM])
    desc_v = tl.make_tensor_descriptor(V, shape=[N_BH, SK, HEAD_DIM], strides=[SK * HEAD_DIM, HEAD_DIM, 1],
                                       block_shape=[1, BLOCK_N, HEAD_DIM])
    if CENTROIDS:
        desc_b = tl.make_tensor_descriptor(BIAS, shape=[N_ITEMS, NCP], strides=[NCP, 1], block_shape=[1, BLOCK_N])
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    for it in tl.range(tl.program_id(0), N_ITEMS, tl.num_programs(0), flatten=FLATTEN):
        item = tl.load(ORDER + it)
        bh = item // MQ
        mt = item % MQ
        q = desc_q.load([bh * S + mt * BLOCK_M, 0])
        if UPCAST:
            q = q.to(tl.float32)
        if MERGE:   # continue from the partial of the centroid pass (pointers recomputed for the stores below:
            # a [BLOCK_M, HEAD_DIM] pointer tensor live across the loop would take 128 registers per thread; a TMA
            # load of the partial spilled more, 368 bytes at head dim 128)
            rows = mt * BLOCK_M + offs_m
            acc, l_i, m_i = partial_state(O + (bh.to(tl.int64) * S + rows)[:, None] * HEAD_DIM + offs_d[None, :],
                                          LSE + bh.to(tl.int64) * S + rows, rows < S)
        else:
            m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if CENTROIDS:
            n_iter = NCP // BLOCK_N
        else:
            n_iter = tl.load(KV_COUNT + item)
        row = KV_INDEX + item.to(tl.int64) * KMAX
        limit = SK
        if HAS_LIMIT:
            limit = tl.load(KEY_LIMIT + bh)

        # the only loop with dots: it must stay free of run-time `if`s (warp specialization)
        for j in tl.range(0, n_iter, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
            if CENTROIDS:
                start = j * BLOCK_N
            else:
                start = tl.load(row + j) * BLOCK_N
            k = desc_k.load([bh, start, 0]).reshape([BLOCK_N, HEAD_DIM])
            v = desc_v.load([bh, start, 0]).reshape([BLOCK_N, HEAD_DIM])
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k))
            if CENTROIDS:
                bias = desc_b.load([item, start]).reshape([BLOCK_N])
                acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, qk_scale, bias, True)
            elif SKIP_LOG2 > 0:
                bias = tl.where(start + offs_n < limit, 0.0, float("-inf"))
                gap = tl.max(tl.max(qk * qk_scale + bias[None, :], 1) - m_i, 0)
                if gap > -SKIP_LOG2:
                    acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, qk_scale, bias, True)
            elif MASK_LAST:
                bias = tl.where(start + offs_n < limit, 0.0, float("-inf"))
                acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, qk_scale, bias, True)
            else:
                acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, qk_scale, qk_scale, False)

        rows = mt * BLOCK_M + offs_m
        row_ok = rows < S
        o_ptr = O + (bh.to(tl.int64) * S + rows)[:, None] * HEAD_DIM + offs_d[None, :]
        lse_ptr = LSE + bh.to(tl.int64) * S + rows
        out, lse = finish_rows(acc, l_i, m_i)
        tl.store(o_ptr, out.to(dtype), mask=row_ok[:, None])
        if STORE_LSE:
            tl.store(lse_ptr, lse, mask=row_ok)


# the module's kernels run in the interpreter iff TRITON_INTERPRET=1 was set when it was imported
INTERPRETED = not isinstance(_hopper_fwd, triton.runtime.JITFunction)


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _num_programs(device: torch.device, n_items: int) -> int:
    sms = device_programs(device) or 3   # interpreter: a few programs are enough to exercise the persistent loop
    return max(1, min(n_items, sms))


@on_input_device
def hopper_attention(q, k, v, plan: Plan, scale: float, return_lse: bool = False, *,
                     num_stages: int | None = None, warp_specialize: bool = True, flatten: bool = False,
                     num_programs: int | None = None, online_skip: float | None = None, num_warps: int = 4):
    """Run the Hopper kernel (inputs are assumed checked: see `HopperBackend.not_supported_reasons`).

    Without correction: one pass over the listed tiles. With correction (plan carries k_mean, v_sum,
    tile_len): a centroid pass writes the partial result of the skipped tiles into out/lse, then the
    exact pass starts its online softmax from it (`partial_state`). (Triton 3.6 on sm_90 keeps warp
    specialization only for a kernel whose dots all sit in one loop, so the two loops cannot share a
    kernel.)

    Args:
        q: [B, H, S, D]; k, v: [B, H, Sk, D]; contiguous fp16/bf16 (fp32 under the interpreter).
        plan: the Plan; k_mean/v_sum/tile_len enable the zero-order correction.
        scale: softmax scale. return_lse: also return fp32 [B, H, S] natural-log LSE.
        num_stages, warp_specialize, flatten, num_programs: tuning knobs for benchmarks. flatten=True
            (flattened persistent loop) gives the same output without a correction but no steady gain
            on the H200 (543 vs 520 TFLOP/s at density 0.1, 568 vs 574 dense, 12 x 32768); with a
            correction it does not compile in Triton 3.6.
        num_warps: 4; 8 only with warp_specialize=False (with it, 8 silently loses warp specialization).
        online_skip: benchmarks only (issue: Sol's inline sparsification). A listed key tile whose scores
            (scale * q.k) all lie more than `online_skip` (natural-log units) below the running max of
            every row is dropped; not exact. Needs warp_specialize=False. Measured slower: see
            scripts/bench_online_skip.py and benchmarks/online_skip_h200.json.

    Returns:
        out [B, H, S, D] in q's dtype (and lse).
    """
    programs = num_programs or _num_programs(q.device, plan.kv_count.numel())
    dims = launch_dims(q, k, plan, programs)
    B, H, S, D, Sk, Mq, Nk, kv_index, kv_count, order = dims
    bm, bn = plan.block_m, plan.block_n
    n_items = order.numel()
    out = torch.empty_like(q)
    corr = plan.has_correction
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device) if (return_lse or corr) else out
    if num_stages is None:
        num_stages = 2
    if warp_specialize and num_stages > MAX_WS_STAGES:
        raise ValueError(f"num_stages={num_stages} with warp specialization returns NaN on the H200 with Triton 3.6 "
                         f"(seen at head dim 64); use num_stages <= {MAX_WS_STAGES}, or warp_specialize=False.")
    if online_skip is not None:
        if not online_skip > 0:
            raise ValueError(f"online_skip={online_skip!r} must be a positive score gap (natural-log units), or None.")
        if warp_specialize:
            raise ValueError("online_skip needs warp_specialize=False: its run-time `if` turns warp specialization "
                             "off in Triton 3.6.")
    if num_warps not in (4, 8) or (warp_specialize and num_warps != 4):
        raise ValueError(f"num_warps={num_warps!r}: use 4, or 8 with warp_specialize=False (Triton 3.6 drops warp "
                         "specialization at 8 warps without a word).")
    if flatten and corr:
        raise ValueError("flatten=True does not compile with the correction's centroid pass (Triton 3.6, "
                         "TMA lowering); use flatten=None or False with a correction plan.")
    if not INTERPRETED:
        triton.set_allocator(_alloc)
    grid = (programs,)
    common = dict(HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, UPCAST=INTERPRETED and q.dtype != torch.float32,
                  NUM_STAGES=num_stages, WARP_SPECIALIZE=warp_specialize, FLATTEN=flatten,
                  num_warps=num_warps, num_stages=num_stages)
    if corr:
        centroid_pass(q, plan, scale, out, lse, dims, num_programs=grid[0], **common)
    limit = key_limit(plan, H, k.shape[2])
    _hopper_fwd[grid](
        q, k, v, out, lse,
        kv_index, kv_count, order, lse, kv_count if limit is None else limit,
        scale * LOG2E,
        S, Sk, B * H, Mq, kv_index.shape[1], 0, n_items,
        CENTROIDS=False, MASK_LAST=(Sk % bn) != 0 or limit is not None, MERGE=corr, STORE_LSE=return_lse,
        SKIP_LOG2=float(online_skip or 0.0) * LOG2E, HAS_LIMIT=limit is not None, **common, **COMPILE_OPTIONS)
    return (out, lse) if return_lse else out


def centroid_pass(q, plan: Plan, scale: float, out, lse, dims, *, num_programs: int | None = None,
                  **options) -> None:
    """The zero-order correction's first launch: the centroids of each item's skipped tiles, written as a
    partial result (normalised out, natural-log lse) into `out` [B, H, S, D] and `lse` fp32 [B, H, S]; an
    exact pass with MERGE folds it in. `dims`: the caller's
    `launch_dims(q, k, plan)`."""
    B, H, S, D, Sk, Mq, Nk, kv_index, kv_count, order = dims
    k_mean, v_mean, bias = correction_inputs(plan, Nk, plan.block_n, q.dtype)
    if not options:
        options = dict(HEAD_DIM=D, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                       UPCAST=INTERPRETED and q.dtype != torch.float32, NUM_STAGES=2,
                       WARP_SPECIALIZE=True, FLATTEN=False, num_warps=4, num_stages=2)
    if not INTERPRETED:
        triton.set_allocator(_alloc)
    n_items = order.numel()
    grid = (num_programs or _num_programs(q.device, n_items),)
    _hopper_fwd[grid](
        q, k_mean, v_mean, out, lse,
        kv_index, kv_count, order, bias, kv_count,
        scale * LOG2E,
        S, Nk, B * H, Mq, kv_index.shape[1], bias.shape[1], n_items,
        CENTROIDS=True, MASK_LAST=False, MERGE=False, STORE_LSE=True, **options, **COMPILE_OPTIONS)


def compile_for_sm90(*, head_dim: int = 128, dtype: str = "bf16", block_m: int = 128, block_n: int = 128,
                     centroids: bool = False, mask_last: bool = True, merge: bool = False, store_lse: bool = True,
                     num_stages: int | None = None, warp_specialize: bool = True, flatten: bool = False,
                     skip_log2: float = 0.0, seq_len: int | None = None, heads: int = 12, has_limit: bool = False):
    """Compile the kernel ahead of time for sm_90 (works on a CPU-only machine); returns the CompiledKernel.

    Its integer arguments are specialized as a launch with a dense plan on [1, heads, seq_len, head_dim] q, k, v
    would be (`launch_signature`; seq_len defaults to 32,760 with `mask_last`, else 32,768); `centroids`: the
    correction's centroid pass, whose keys are the key tiles' centroids; `has_limit`: a plan with `valid_keys`.

    Inspect `.asm["ttgir"]` (warp specialization: `ttg.warp_specialize`), `.asm["ptx"]` (`wgmma`,
    `cp.async.bulk.tensor`) and `.metadata.shared` (bytes of shared memory).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if num_stages is None:
        num_stages = 2
    ptr = "*" + dtype
    pointers = dict(Q=ptr, K=ptr, V=ptr, O=ptr, LSE="*fp32", KV_INDEX="*i32", KV_COUNT="*i32", ORDER="*i32",
                    BIAS="*fp32", KEY_LIMIT="*i32")
    S = aot_seq_len(seq_len, mask_last)
    mq, nk = -(-S // block_m), -(-S // block_n)
    values = dict(qk_scale=0.125, S=S, SK=nk if centroids else S, N_BH=heads, MQ=mq, KMAX=nk,
                  NCP=-(-nk // block_n) * block_n if centroids else 0, N_ITEMS=mq * heads)
    constants = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CENTROIDS=centroids,
                     MASK_LAST=mask_last, MERGE=merge, STORE_LSE=store_lse, UPCAST=False, NUM_STAGES=num_stages,
                     WARP_SPECIALIZE=warp_specialize, FLATTEN=flatten, SKIP_LOG2=skip_log2, HAS_LIMIT=has_limit)
    signature, constants, attrs = launch_signature(_hopper_fwd.arg_names, pointers, values, constants)
    src = ASTSource(_hopper_fwd, signature, constants, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, num_stages=num_stages, **COMPILE_OPTIONS))


# Triton 3.6 on the H200 (2026-11-30, scratch probe over stages x WS x flatten x tiles): with warp
# specialization, num_stages 3 or 4 returns NaN in ~all rows at head dim 64 (the AOT compile and the
# interpreter pass); 1 and 2 are exact. At head dim 128, 3 stages do not fit shared memory anyway.
MAX_WS_STAGES = 2


class HopperBackend:
    """Backend object for the dispatch registry ("hopper"): by name only (see the module docstring, Preemption)."""

    name = "hopper"
    warned = False

    def not_supported_reasons(self, q, k, v, plan: Plan) -> list[str]:
        why = []
        if not _hopper_available(q.device):
            why.append(f"needs a CUDA GPU of compute capability 9.x (q is on {q.device})")
        if q.dtype not in (torch.float16, torch.bfloat16):
            why.append(f"dtype {q.dtype} is not fp16/bf16")
        if q.shape[-1] not in KERNEL_HEAD_DIMS:
            why.append(f"head dim {q.shape[-1]} not in {KERNEL_HEAD_DIMS}")
        if plan.block_m not in SUPPORTED_BLOCKS or plan.block_n not in SUPPORTED_BLOCKS:
            why.append(f"tiles {plan.block_m}x{plan.block_n} not in {SUPPORTED_BLOCKS}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not t.is_contiguous():
                why.append(f"{name} is not contiguous")
        return why

    def __call__(self, q, k, v, plan: Plan, scale: float, return_lse: bool):
        if not (INTERPRETED or HopperBackend.warned):
            HopperBackend.warned = True
            warnings.warn("videosparse: backend 'hopper' (the Triton Hopper kernel, automatic warp specialization) "
                          "returns NaN rows when the GPU preempts it, e.g. while another process uses the GPU; "
                          "backend='auto' runs the Gluon or the generic kernel instead.", RuntimeWarning, stacklevel=2)
        return hopper_attention(q, k, v, plan, scale, return_lse)


BACKEND = HopperBackend()
