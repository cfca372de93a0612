"""Generic Triton tile-skipping attention forward (Ampere/Ada, and the CPU interpreter).

Same semantics as the torch reference (see `reference.py`); no TMA, no warp specialization, plain
pointer loads, so it runs on any NVIDIA GPU of compute capability >= 8.0 and under
`TRITON_INTERPRET=1` on CPU tensors (that is what CI exercises). One program per work item
(batch, head, query tile), launched in `plan.work_order` (long rows first, then head by head) so that
long rows do not trail at the end of the grid.

Per item, in one online softmax (exp2 domain):
1. zero-order correction (when the plan carries centroids): all Nk centroids in chunks of KEY_CHUNK,
   bias log2(len_j), -inf where tile j is exact;
2. the listed full key tiles, unmasked;
3. the partial last key tile, masked (it can only be the last entry: kv_index is sorted);
4. epilogue: out = acc / l, lse = m + log l (natural); rows without keys give 0 and -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import Plan
from ._triton_utils import (COMPILE_OPTIONS, LOG2E, NEG_BIG, correction_inputs, finish_rows, interpreter_active,
                            key_limit, launch_dims, launch_signature, softmax_step, stride_arg_names, on_input_device)
from .dispatch import KERNEL_HEAD_DIMS

SUPPORTED_BLOCKS = (16, 32, 64, 128)


@triton.jit
def _generic_fwd(
    Q, K, V, O, LSE,
    KV_INDEX, KV_COUNT, ORDER,
    K_MEAN, V_MEAN, BIAS, KEY_LIMIT,
    qk_scale,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    H, S, SK, MQ, NK, KMAX, NCP,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CORRECTION: tl.constexpr,
    PARTIAL_K: tl.constexpr,
    STORE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    KEY_CHUNK: tl.constexpr,
    HAS_LIMIT: tl.constexpr = False,
):
    """KEY_CHUNK (divides BLOCK_N): keys per softmax step; a key tile is taken in BLOCK_N / KEY_CHUNK steps, so that
    the score tile and the K/V chunks fit in registers (`default_key_chunk`). PARTIAL_K: the last listed tile may
    hold keys past the limit, SK or (HAS_LIMIT) the row's KEY_LIMIT [B*H] (`plan.valid_keys`); they are masked."""
    item = tl.load(ORDER + tl.program_id(0))
    bh = item // MQ
    mt = item % MQ
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, KEY_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < S

    # the tile's first row in int64 (a strided q, diffusers' [B, S, H, D] seen as [B, H, S, D], passes 2**31 at
    # S * H * D), the rows within it in int32 (the host keeps BLOCK_M * stride_qs below 2**31): 64-bit offsets for
    # the whole [BLOCK_M, D] tile cost 7-11% at head dim 128 on the H100
    q_tile = Q + b * stride_qb + h * stride_qh + (mt * BLOCK_M).to(tl.int64) * stride_qs
    q = tl.load(q_tile + tl.arange(0, BLOCK_M)[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + h * stride_kh + offs_d[:, None] * stride_kd      # K^T tile [D, N]
    v_base = V + b * stride_vb + h * stride_vh + offs_d[None, :] * stride_vd      # V tile [N, D]
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # 1. zero-order correction over all centroids, exact tiles masked by the bias
    if CORRECTION:
        c_row = bh.to(tl.int64) * NK
        bias_row = BIAS + item.to(tl.int64) * NCP
        for c0 in range(0, NCP, KEY_CHUNK):
            cols = c0 + offs_c
            c_ok = cols < NK
            kc = tl.load(K_MEAN + (c_row + cols)[None, :] * HEAD_DIM + offs_d[:, None], mask=c_ok[None, :], other=0.0)
            vc = tl.load(V_MEAN + (c_row + cols)[:, None] * HEAD_DIM + offs_d[None, :], mask=c_ok[:, None], other=0.0)
            if UPCAST:
                kc = kc.to(tl.float32)
                vc = vc.to(tl.float32)
            bias = tl.load(bias_row + cols)
            acc, l_i, m_i = softmax_step(acc, l_i, m_i, tl.dot(q, kc), vc, qk_scale, bias, True)

    # 2. listed full tiles
    row = KV_INDEX + item.to(tl.int64) * KMAX
    count = tl.load(KV_COUNT + item)
    n_full = count
    if PARTIAL_K:
        limit = SK
        if HAS_LIMIT:
            limit = tl.load(KEY_LIMIT + bh)
        last = tl.load(row + tl.maximum(count - 1, 0))
        n_full = count - ((count > 0) & (last * BLOCK_N + BLOCK_N > limit)).to(tl.int32)
    PARTS: tl.constexpr = BLOCK_N // KEY_CHUNK
    for jp in range(0, n_full * PARTS):      # each listed tile in PARTS steps of KEY_CHUNK keys
        keys = tl.load(row + jp // PARTS) * BLOCK_N + (jp % PARTS) * KEY_CHUNK + offs_c
        kt = tl.load(k_base + keys[None, :].to(tl.int64) * stride_ks)
        vt = tl.load(v_base + keys[:, None].to(tl.int64) * stride_vs)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, tl.dot(q, kt), vt, qk_scale, qk_scale, False)

    # 3. the partial last key tile
    if PARTIAL_K:
        if n_full < count:
            for part in tl.static_range(PARTS):
                keys = last * BLOCK_N + part * KEY_CHUNK + offs_c
                k_ok = keys < limit
                kt = tl.load(k_base + keys[None, :].to(tl.int64) * stride_ks, mask=k_ok[None, :], other=0.0)
                vt = tl.load(v_base + keys[:, None].to(tl.int64) * stride_vs, mask=k_ok[:, None], other=0.0)
                if UPCAST:
                    kt = kt.to(tl.float32)
                    vt = vt.to(tl.float32)
                bias = tl.where(k_ok, 0.0, float("-inf"))
                acc, l_i, m_i = softmax_step(acc, l_i, m_i, tl.dot(q, kt), vt, qk_scale, bias, True)

    # 4. epilogue
    out, lse = finish_rows(acc, l_i, m_i)
    o_off = (bh.to(tl.int64) * S + offs_m) * HEAD_DIM
    tl.store(O + o_off[:, None] + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
    if STORE_LSE:
        tl.store(LSE + bh.to(tl.int64) * S + offs_m, lse, mask=row_ok)


# the module's kernels run in the interpreter iff TRITON_INTERPRET=1 was set when it was imported
INTERPRETED = not isinstance(_generic_fwd, triton.runtime.JITFunction)


def default_num_warps(block_m: int, block_n: int, head_dim: int) -> int:
    """Warps per program: 8 at head dim 128 with 128-row tiles, else 4 (`scripts/sweep_generic.py`; see
    `default_key_chunk` for the numbers)."""
    return 8 if head_dim >= 128 and block_m >= 128 else 4


def default_num_stages(head_dim: int) -> int:
    return 2 if head_dim == 128 else 3


def default_key_chunk(block_m: int, block_n: int, num_warps: int) -> int:
    """Keys per softmax step: the whole tile width, or less so that a thread holds at most 64 fp32 scores
    (block_m * key_chunk / (32 * num_warps) <= 64): 4 warps take 128x128 tiles in two 64-key steps.

    Measured on an H200 running the kernel as Ampere code (`TRITON_OVERRIDE_ARCH=sm80 python
    scripts/sweep_generic.py`, benchmarks/sweep_generic_sm80_on_h200.json; 12 x 32,768, density 0.1, TFLOP/s):
    head dim 128: 128x128 tiles 8 warps whole tiles 288 (4 warps in 64-key steps 290 but 204 bytes of sm_80
    spills vs 32; 4 warps whole tiles 7: spilled), 128x64 8 warps 284 (4: 273), 64x128 4 warps whole tiles 282
    (8 warps 176), 64x64 4 warps 215 (8: 152), 32x32 141 (85); head dim 64: 128x128 4 warps in 64-key steps 282
    (whole tiles 206-236, 8 warps 201-238), 128x64 282 (8: 203), 64x128 258 (8: 121), 64x64 250 (102).
    Not timed on an Ampere or Ada GPU (none at hand)."""
    return min(block_n, 64 * 32 * num_warps // block_m)


def compile_generic(*, capability: int = 80, head_dim: int = 128, dtype: str = "bf16", block_m: int = 128,
                    block_n: int = 128, correction: bool = False, seq_len: int = 32768, heads: int = 12,
                    num_warps: int | None = None, num_stages: int | None = None, key_chunk: int | None = None):
    """Compile the kernel ahead of time for compute capability `capability` (works on a CPU-only machine), as
    `generic_attention` launches it on contiguous [1, heads, seq_len, head_dim] q, k, v with a dense plan: integer
    arguments specialized as Triton's JIT does for those values (== 1 folded in, multiples of 16 marked), pointers
    16-byte aligned; launch defaults as `generic_attention`. Returns the CompiledKernel (`.asm["ptx"]`, ...)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    num_warps = num_warps or default_num_warps(block_m, block_n, head_dim)
    ptr = "*" + dtype
    pointers = dict(Q=ptr, K=ptr, V=ptr, O=ptr, LSE="*fp32", KV_INDEX="*i32", KV_COUNT="*i32", ORDER="*i32",
                    K_MEAN=ptr, V_MEAN=ptr, BIAS="*fp32", KEY_LIMIT="*i32")
    Mq, Nk = -(-seq_len // block_m), -(-seq_len // block_n)
    strides = (heads * seq_len * head_dim, seq_len * head_dim, head_dim, 1) * 3     # q, k, v contiguous
    values = dict(zip(stride_arg_names(_generic_fwd), strides), qk_scale=0.125, H=heads, S=seq_len, SK=seq_len,
                  MQ=Mq, NK=Nk, KMAX=Nk, NCP=Nk if correction else 0)
    constants = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CORRECTION=correction,
                     PARTIAL_K=seq_len % block_n != 0, STORE_LSE=True, UPCAST=False,
                     KEY_CHUNK=key_chunk or default_key_chunk(block_m, block_n, num_warps), HAS_LIMIT=False)
    signature, constants, attrs = launch_signature(_generic_fwd.arg_names, pointers, values, constants)
    options = dict(num_warps=num_warps, num_stages=num_stages or default_num_stages(head_dim))
    return triton.compile(ASTSource(_generic_fwd, signature, constants, attrs),
                          target=GPUTarget("cuda", capability, 32), options=dict(options, **COMPILE_OPTIONS))


@on_input_device
def generic_attention(q, k, v, plan: Plan, scale: float, return_lse: bool = False, *, num_warps: int | None = None,
                      num_stages: int | None = None, key_chunk: int | None = None):
    """Run the generic kernel (inputs assumed checked: see `GenericBackend.not_supported_reasons`).

    Args:
        q: [B, H, S, D]; k, v: [B, H, Sk, D] (any strides); fp16/bf16 (fp32 under the interpreter).
        plan: the Plan; k_mean/v_sum/tile_len enable the zero-order correction.
        scale: softmax scale. return_lse: also return fp32 [B, H, S] natural-log LSE.
        num_warps, num_stages: launch options (default `default_num_warps`, `default_num_stages`).
        key_chunk: keys per softmax step, divides the tile width (default `default_key_chunk`).

    Returns:
        out [B, H, S, D] contiguous in q's dtype (and lse).
    """
    B, H, S, D, Sk, Mq, Nk, kv_index, kv_count, order = launch_dims(q, k, plan)
    bm, bn = plan.block_m, plan.block_n
    if bm * max(q.stride(2), q.stride(3) * D) >= 2 ** 31:       # offsets within a query tile stay int32
        q = q.contiguous()
    limit = key_limit(plan, H, Sk)
    out = torch.empty(B, H, S, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device) if return_lse else out
    if plan.has_correction:
        k_mean, v_mean, bias = correction_inputs(plan, Nk, bn, q.dtype)
        ncp = bias.shape[1]
    else:
        k_mean = v_mean = bias = out
        ncp = 0
    if num_warps is None:
        num_warps = default_num_warps(bm, bn, D)
    if num_stages is None:
        num_stages = default_num_stages(D)
    if key_chunk is None:
        key_chunk = default_key_chunk(bm, bn, num_warps)
    elif key_chunk < 16 or bn % key_chunk:
        raise ValueError(f"key_chunk={key_chunk}: must divide the tile width {bn} and be at least 16")
    _generic_fwd[(order.numel(),)](
        q, k, v, out, lse,
        kv_index, kv_count, order,
        k_mean, v_mean, bias, kv_count if limit is None else limit,
        scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(),
        H, S, Sk, Mq, Nk, kv_index.shape[1], ncp,
        HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn,
        CORRECTION=plan.has_correction, PARTIAL_K=(Sk % bn) != 0 or limit is not None, STORE_LSE=return_lse,
        UPCAST=INTERPRETED and q.dtype != torch.float32, KEY_CHUNK=key_chunk,
        HAS_LIMIT=limit is not None, num_warps=num_warps, num_stages=num_stages, **COMPILE_OPTIONS,
    )
    return (out, lse) if return_lse else out


class GenericBackend:
    """Backend object for the dispatch registry ("triton_generic")."""

    name = "triton_generic"

    def not_supported_reasons(self, q, k, v, plan: Plan) -> list[str]:
        why = []
        if q.device.type == "cuda":
            if INTERPRETED:
                why.append("TRITON_INTERPRET=1 is set: the interpreter runs on CPU tensors only")
            elif torch.cuda.get_device_capability(q.device) < (8, 0):
                why.append(f"needs compute capability >= 8.0 (got {torch.cuda.get_device_capability(q.device)})")
        elif q.device.type == "cpu":
            if not INTERPRETED:
                why.append("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 set before import)")
        else:
            why.append(f"device {q.device} is not supported")
        # fp32 under the interpreter (CPU tensors, whose missing interpreter is named above)
        allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if INTERPRETED or q.device.type == "cpu" else ())
        if q.dtype not in allowed:
            why.append(f"dtype {q.dtype} not in {allowed}")
        if q.shape[-1] not in KERNEL_HEAD_DIMS:
            why.append(f"head dim {q.shape[-1]} not in {KERNEL_HEAD_DIMS}")
        if plan.block_m not in SUPPORTED_BLOCKS or plan.block_n not in SUPPORTED_BLOCKS:
            why.append(f"tiles {plan.block_m}x{plan.block_n} not in {SUPPORTED_BLOCKS}")
        return why

    def __call__(self, q, k, v, plan: Plan, scale: float, return_lse: bool):
        return generic_attention(q, k, v, plan, scale, return_lse)


BACKEND = GenericBackend()

__all__ = ["BACKEND", "GenericBackend", "compile_generic", "default_num_warps", "generic_attention",
           "interpreter_active"]
