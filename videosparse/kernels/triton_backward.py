"""Triton backward of block-sparse attention (any NVIDIA GPU of compute capability >= 8.0, and the CPU interpreter).

FlashAttention-2's backward on the plan's tiles: with the forward's lse (natural log, fp32) and, per query row r,
delta_r = dO_r . O_r - dlse_r, each kept pair of query row r and key c gives

    P_rc = exp(q_r . k_c * scale - lse_r),   dS_rc = P_rc * (dO_r . v_c - delta_r)
    dq_r += scale * dS_rc k_c,   dk_c += scale * dS_rc q_r,   dv_c += P_rc dO_r

Two kernels, so that no two programs add into one row: `_bwd_dq` runs one program per query tile over the key tiles
its plan lists (as the forward); `_bwd_dkdv` one per key tile over the query tiles that list it (the plan
transposed, `transpose_plan`). Keys past the sequence end or the item's `valid_keys` are masked (their values never
loaded, so NaN there reaches nothing); rows without keys (lse -inf) have P = 0. The zero-order correction's proxy
terms (each row against the centroids of its skipped tiles: S x Nk, a small share of the work) are added in torch
(`correction_backward`), with the same lse and delta. Everything accumulates in fp32; P and dS enter the products in
the inputs' dtype, as in FlashAttention.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..plan import Plan, work_order
from ._triton_utils import COMPILE_OPTIONS, LOG2E, flat_plan, key_limit, launch_signature
from .triton_generic import BACKEND as GENERIC

ROW_CHUNK = 32      # query rows per step of `_bwd_dkdv` (FlashAttention-2's and Triton's tutorial choice)
KEY_SPLIT = 64      # keys per `_bwd_dkdv` program: a 128-key tile in two programs (whole, its fp32 dk, dv spill)
DELTA_ROWS = 64     # rows per `_bwd_delta` program


@triton.jit
def _bwd_delta(O, DO, DLSE, DELTA, N_ROWS, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, HAS_DLSE: tl.constexpr):
    """delta = rowsum(dO * O) - dlse in fp32 for ROWS of the N_ROWS rows [N_ROWS, D] per program (no fp32 copies)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < N_ROWS
    off = rows.to(tl.int64)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(O + off, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=ok[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + rows, mask=ok, other=0.0)
    tl.store(DELTA + rows, delta, mask=ok)


@triton.jit
def _bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ,
    KV_INDEX, KV_COUNT, ORDER, KEY_LIMIT,
    qk_scale, scale,
    S, SK, MQ, KMAX,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEY_CHUNK: tl.constexpr,
    UPCAST: tl.constexpr, HAS_LIMIT: tl.constexpr,
):
    """One program per (b, h, query tile): dq of the tile's rows (fp32) over its listed key tiles, KEY_CHUNK keys per
    step, taken in ORDER (`plan.work_order`: long rows first). Q, DO [B*H, S, D], K, V [B*H, SK, D] contiguous; LSE,
    DELTA fp32 [B*H, S]; qk_scale = scale * log2(e)."""
    item = tl.load(ORDER + tl.program_id(0))
    bh = item // MQ
    mt = item % MQ
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, KEY_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < S
    q_rows = (bh.to(tl.int64) * S + offs_m)[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + q_rows, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + q_rows, mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + bh.to(tl.int64) * S + offs_m, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634     # no keys: P = 0
    delta = tl.load(DELTA + bh.to(tl.int64) * S + offs_m, mask=row_ok, other=0.0)
    limit = SK
    if HAS_LIMIT:
        limit = tl.minimum(tl.load(KEY_LIMIT + bh), SK)
    kv_base = bh.to(tl.int64) * SK * HEAD_DIM
    row = KV_INDEX + item.to(tl.int64) * KMAX
    count = tl.load(KV_COUNT + item)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    PARTS: tl.constexpr = BLOCK_N // KEY_CHUNK
    for jp in range(0, count * PARTS):
        keys = tl.load(row + jp // PARTS) * BLOCK_N + (jp % PARTS) * KEY_CHUNK + offs_c
        k_ok = keys < limit
        kv_off = kv_base + keys[None, :].to(tl.int64) * HEAD_DIM + offs_d[:, None]       # [D, C]
        kt = tl.load(K + kv_off, mask=k_ok[None, :], other=0.0)
        vt = tl.load(V + kv_off, mask=k_ok[None, :], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse[:, None])
        p = tl.where(k_ok[None, :], p, 0.0)
        ds = p * (tl.dot(do, vt) - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))
    tl.store(DQ + q_rows, dq * scale, mask=row_ok[:, None])


@triton.jit
def _bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    Q_INDEX, Q_COUNT, ORDER, KEY_LIMIT,
    qk_scale, scale,
    S, SK, NK, MMAX,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEYS: tl.constexpr, ROWS: tl.constexpr,
    UPCAST: tl.constexpr, HAS_LIMIT: tl.constexpr,
):
    """One program per (b, h, key tile, KEYS of its keys): their dk, dv over the query tiles that list the tile, ROWS
    query rows per step; Q_INDEX [B*H*NK, MMAX] / Q_COUNT [B*H*NK]: those query tiles (ascending); key tiles taken in
    ORDER (a key tile that every query tile lists, a global tile, first)."""
    SPLIT: tl.constexpr = BLOCK_N // KEYS
    item = tl.load(ORDER + tl.program_id(0) // SPLIT)
    bh = item // NK
    nt = item % NK
    keys = nt * BLOCK_N + (tl.program_id(0) % SPLIT) * KEYS + tl.arange(0, KEYS)
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    limit = SK
    if HAS_LIMIT:
        limit = tl.minimum(tl.load(KEY_LIMIT + bh), SK)
    k_ok = keys < limit
    kv_off = (bh.to(tl.int64) * SK + keys)[:, None] * HEAD_DIM + offs_d[None, :]      # [KEYS, D]
    k = tl.load(K + kv_off, mask=k_ok[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=k_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([KEYS, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([KEYS, HEAD_DIM], dtype=tl.float32)
    row = Q_INDEX + item.to(tl.int64) * MMAX
    count = tl.load(Q_COUNT + item)
    PARTS: tl.constexpr = BLOCK_M // ROWS
    for ip in range(0, count * PARTS):
        rows = tl.load(row + ip // PARTS) * BLOCK_M + (ip % PARTS) * ROWS + offs_r
        row_ok = rows < S
        q_off = (bh.to(tl.int64) * S + rows)[None, :] * HEAD_DIM + offs_d[:, None]     # [D, R]
        qt = tl.load(Q + q_off, mask=row_ok[None, :], other=0.0)
        do_t = tl.load(DO + q_off, mask=row_ok[None, :], other=0.0)
        if UPCAST:
            qt = qt.to(tl.float32)
            do_t = do_t.to(tl.float32)
        lse = tl.load(LSE + bh.to(tl.int64) * S + rows, mask=row_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
        delta = tl.load(DELTA + bh.to(tl.int64) * S + rows, mask=row_ok, other=0.0)
        pt = tl.math.exp2(tl.dot(k, qt) * qk_scale - lse[None, :])                      # P^T [KEYS, R]
        pt = tl.where(k_ok[:, None], pt, 0.0)
        dv += tl.dot(pt.to(do_t.dtype), tl.trans(do_t))
        dst = pt * (tl.dot(v, do_t) - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt))
    store_ok = (keys < SK)[:, None]
    tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=store_ok)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=store_ok)


# the module's kernels run in the interpreter iff TRITON_INTERPRET=1 was set when it was imported
INTERPRETED = not isinstance(_bwd_dq, triton.runtime.JITFunction)


def listed_tiles(plan: Plan, num_key_tiles: int) -> torch.Tensor:
    """bool [B, H, Mq, Nk]: whether query tile i lists key tile j."""
    B, H, Mq, kmax = plan.kv_index.shape
    dense = torch.zeros(B, H, Mq, num_key_tiles + 1, dtype=torch.bool, device=plan.kv_index.device)
    slot_valid = torch.arange(kmax, device=dense.device) < plan.kv_count[..., None]
    dense.scatter_(-1, torch.where(slot_valid, plan.kv_index.long(), num_key_tiles), True)
    return dense[..., :num_key_tiles]


def transpose_plan(listed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan by key tile: (q_index int32 [B*H*Nk, Mq], q_count int32 [B*H*Nk]), the query tiles listing each key
    tile in ascending order (entries past the count unused), from `listed_tiles` [B, H, Mq, Nk]. Mq columns, not the
    longest count: reading that would wait for the GPU."""
    B, H, Mq, Nk = listed.shape
    by_key = listed.transpose(-1, -2).reshape(B * H * Nk, Mq)
    q_count = by_key.sum(-1, dtype=torch.int32)
    q_index = torch.argsort((~by_key).to(torch.int8), dim=-1, stable=True)
    return q_index.to(torch.int32).contiguous(), q_count.contiguous()


def correction_backward(dq, q, d_out, lse, delta, plan: Plan, listed: torch.Tensor, scale: float):
    """The zero-order correction's share of the gradients: the proxy terms added into dq (fp32 [B, H, S, D], in
    place), and the gradients of the plan's k_mean, v_sum (each in its dtype), returned. lse, delta fp32 [B, H, S] as
    the kernels take them; `listed` [B, H, Mq, Nk] from `listed_tiles`. Rows in chunks of whole query tiles, so that
    the proxy scores stay near 2^25 elements. A centroid counts only where it is a proxy: non-finite ones elsewhere
    (tiles past valid_keys whose keys hold NaN) reach nothing, as in the reference."""
    B, H, S, D = q.shape
    Nk, bm, bn = listed.shape[-1], plan.block_m, plan.block_n
    limit = torch.full((B,), Nk * bn, device=q.device) if plan.valid_keys is None else plan.valid_keys.long()
    chosen = listed | (torch.arange(Nk, device=q.device) * bn >= limit[:, None])[:, None, None]   # not proxies
    tile_len = plan.tile_len.to(device=q.device, dtype=torch.float32)
    k_mean = plan.k_mean.float()
    v_mean = plan.v_sum.float() / tile_len[:, None].clamp_min(1)
    k_finite, v_finite = (torch.where(torch.isfinite(t), t, 0.0) for t in (k_mean, v_mean))
    log_len = tile_len.clamp_min(1).log()
    dk_mean, dv_mean = torch.zeros_like(k_mean), torch.zeros_like(v_mean)
    tiles_per_chunk = max(1, (1 << 25) // max(1, B * H * bm * Nk))
    for i0 in range(0, listed.shape[2], tiles_per_chunk):
        r0, r1 = i0 * bm, min(S, (i0 + tiles_per_chunk) * bm)
        qi, do = q[:, :, r0:r1].float(), d_out[:, :, r0:r1].float()
        row_lse = lse[:, :, r0:r1, None]
        exact = chosen[:, :, i0:i0 + tiles_per_chunk].repeat_interleave(bm, dim=2)[:, :, :r1 - r0]
        p = torch.exp((qi @ k_mean.transpose(-1, -2)) * scale + log_len - torch.where(
            torch.isfinite(row_lse), row_lse, math.inf)).masked_fill(exact, 0.0)                # [B, H, R, Nk]
        ds = (p * (do @ v_finite.transpose(-1, -2) - delta[:, :, r0:r1, None])).masked_fill_(exact, 0.0)
        dq[:, :, r0:r1] += (ds @ k_finite) * scale
        dk_mean += (ds.transpose(-1, -2) @ qi) * scale
        dv_mean += p.transpose(-1, -2) @ do
    return dk_mean.to(plan.k_mean.dtype), (dv_mean / tile_len[:, None].clamp_min(1)).to(plan.v_sum.dtype)


def default_num_warps(head_dim: int) -> int:
    """Warps per program: 8 at head dim 128 (its fp32 dk, dv / dq accumulators), else 4. Not timed on a GPU yet."""
    return 8 if head_dim >= 128 else 4


def default_key_chunk(block_m: int) -> int:
    """Keys per step of `_bwd_dq`: 32 at 128-row tiles (FlashAttention-2's and Triton's tutorial choice), else 64."""
    return 32 if block_m >= 128 else 64


def triton_attention_backward(q, k, v, out, lse, plan: Plan, scale: float, d_out, d_lse):
    """Gradients of block-sparse attention's (out, lse) with the Triton kernels, as `reference_attention_backward`.

    Args:
        q: [B, H, S, D]; k, v: [B, H, Sk, D]; out [B, H, S, D] and lse fp32 [B, H, S] from the forward (any backend);
            fp16 / bf16 (fp32 under the interpreter); D in {64, 128}.
        plan: the forward's Plan (with its centroids when it carries the correction).
        d_out: [B, H, S, D] or None (zero); d_lse: [B, H, S] or None (zero).

    Returns:
        (dq, dk, dv, d_k_mean, d_v_sum): in the dtypes of q, k, v, k_mean, v_sum; the last two None without
        correction.
    """
    B, H, S, D = q.shape
    Sk = k.shape[2]
    bm, bn = plan.block_m, plan.block_n
    Mq, Nk = math.ceil(S / bm), math.ceil(Sk / bn)
    if Nk == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None
    plan = plan.with_index_slot()
    d_out = torch.zeros_like(q) if d_out is None else d_out.to(q.dtype)
    lse = lse.float().contiguous()
    q, k, v, d_out, out = (t.contiguous() for t in (q, k, v, d_out, out))
    upcast = INTERPRETED and q.dtype != torch.float32
    delta = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    d_lse = None if d_lse is None else d_lse.float().contiguous()
    _bwd_delta[(triton.cdiv(B * H * S, DELTA_ROWS),)](out, d_out, delta if d_lse is None else d_lse, delta,
                                                      B * H * S, HEAD_DIM=D, ROWS=DELTA_ROWS,
                                                      HAS_DLSE=d_lse is not None, **COMPILE_OPTIONS)
    limit = key_limit(plan, H)
    kv_index, kv_count = flat_plan(plan)
    listed = listed_tiles(plan, Nk)
    q_index, q_count = transpose_plan(listed)
    dq = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    common = dict(HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, UPCAST=upcast, HAS_LIMIT=limit is not None,
                  num_warps=default_num_warps(D))
    key_limits = kv_count if limit is None else limit
    _bwd_dq[(B * H * Mq,)](q, k, v, d_out, lse, delta, dq, kv_index, kv_count, work_order(kv_count), key_limits,
                           scale * LOG2E, scale, S, Sk, Mq, kv_index.shape[1],
                           KEY_CHUNK=min(bn, default_key_chunk(bm)), **common, **COMPILE_OPTIONS)
    keys = min(bn, KEY_SPLIT)
    _bwd_dkdv[(B * H * Nk * (bn // keys),)](q, k, v, d_out, lse, delta, dk, dv, q_index, q_count,
                                            work_order(q_count), key_limits, scale * LOG2E, scale, S, Sk, Nk,
                                            q_index.shape[1], KEYS=keys,
                                            ROWS=min(bm, ROW_CHUNK), **common, **COMPILE_OPTIONS)
    d_k_mean = d_v_sum = None
    if plan.has_correction:
        d_k_mean, d_v_sum = correction_backward(dq, q, d_out, lse, delta, plan, listed, scale)
    return dq.to(q.dtype), dk, dv, d_k_mean, d_v_sum


def not_supported_reasons(q: torch.Tensor, plan: Plan) -> list[str]:
    """Why the Triton backward cannot take these inputs (empty: it can): where the generic forward kernel runs (device,
    dtype, head dim, tiles), it runs too (it makes its inputs contiguous)."""
    return GENERIC.not_supported_reasons(q, q, q, plan)


def compile_backward(kernel: str = "dq", *, capability: int = 90, head_dim: int = 128, dtype: str = "bf16",
                     block_m: int = 128, block_n: int = 128, seq_len: int = 32760):
    """Compile `_bwd_dq` or `_bwd_dkdv` ahead of time for compute capability `capability` (works on a CPU-only
    machine) with the launch options `triton_attention_backward` uses. Returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _bwd_dq if kernel == "dq" else _bwd_dkdv
    ptr = "*" + dtype
    pointers = dict(Q=ptr, K=ptr, V=ptr, DO=ptr, LSE="*fp32", DELTA="*fp32", DQ="*fp32", DK=ptr, DV=ptr,
                    KV_INDEX="*i32", KV_COUNT="*i32", Q_INDEX="*i32", Q_COUNT="*i32", ORDER="*i32",
                    KEY_LIMIT="*i32")
    Mq, Nk = -(-seq_len // block_m), -(-seq_len // block_n)
    values = dict(qk_scale=0.125 * 1.4427, scale=0.125, S=seq_len, SK=seq_len, MQ=Mq, NK=Nk, KMAX=Nk,
                  MMAX=Mq)
    constants = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=False, HAS_LIMIT=False)
    if kernel == "dq":
        constants["KEY_CHUNK"] = min(block_n, default_key_chunk(block_m))
    else:
        constants.update(KEYS=min(block_n, KEY_SPLIT), ROWS=min(block_m, ROW_CHUNK))
    signature, constants, attrs = launch_signature(fn.arg_names, pointers, values, constants)
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=default_num_warps(head_dim), **COMPILE_OPTIONS))
