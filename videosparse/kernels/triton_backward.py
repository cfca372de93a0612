"""Triton backward of block-sparse attention (any NVIDIA GPU of compute capability >= 8.0, and the CPU interpreter).

FlashAttention-2's backward on the plan's tiles: with the forward's lse (natural log, fp32) and, per query row r,
delta_r = dO_r . O_r - dlse_r, each kept pair of query row r and key c gives

    P_rc = exp(q_r . k_c * scale - lse_r),   dS_rc = P_rc * (dO_r . v_c - delta_r)
    dq_r += scale * dS_rc k_c,   dk_c += scale * dS_rc q_r,   dv_c += P_rc dO_r

Two kernels, so that no two programs add into one row: `_bwd_dq` runs one program per query tile over the key tiles
its plan lists (as the forward); `_bwd_dkdv` one per key tile over the query tiles that list it (the plan
transposed, `transpose_plan`). Keys past the sequence end or the item's `valid_keys` are masked (their values never
loaded, so NaN there reaches nothing); rows without keys (lse -inf) have P = 0. The zero-order correction's proxy
terms (each row against the centroid of every tile it skips, with P_rj = len_j * exp(q_r . k_mean_j * scale - lse_r)
and v_mean_j: S x Nk, a small share of the work) enter `_bwd_dq` first, over all centroids with the forward's bias
row (-inf where a tile is no proxy), and `_bwd_centroids` gives the centroids' own gradients, one program per 64
centroids and a range of query tiles. Everything accumulates in fp32; P and dS enter the products in the inputs'
dtype, as in FlashAttention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..plan import Plan, device_programs, work_order
from ._triton_utils import (COMPILE_OPTIONS, LOG2E, correction_inputs, flat_plan, key_limit, launch_signature,
                            on_input_device)
from .triton_generic import BACKEND as GENERIC

ROW_CHUNK = 32      # query rows per step of `_bwd_dkdv` (FlashAttention-2's and Triton's tutorial choice; 64 on
                    # Hopper at head dim 128: `default_rows`)
DQ_KEY_CHUNK = 32   # keys (or centroids) per step of `_bwd_dq` (the same; 64 at 64-row tiles spilled at sm_80, d 64)
KEY_SPLIT = 64      # keys per `_bwd_dkdv` program: a 128-key tile in two programs (whole, its fp32 dk, dv spill)
CENTROID_BLOCK = 64  # centroids per `_bwd_centroids` program (as KEY_SPLIT keys)
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
def _load_pair(A, B, offsets, mask, UPCAST: tl.constexpr):
    """A[offsets] and B[offsets] (zero where not `mask`), in fp32 under the interpreter (UPCAST), else as stored."""
    a = tl.load(A + offsets, mask=mask, other=0.0)
    b = tl.load(B + offsets, mask=mask, other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def _bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ,
    KV_INDEX, KV_COUNT, ORDER, KEY_LIMIT, K_MEAN, V_MEAN, BIAS,
    qk_scale, scale,
    S, SK, MQ, KMAX, NK, NCP,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEY_CHUNK: tl.constexpr,
    UPCAST: tl.constexpr, HAS_LIMIT: tl.constexpr, CORRECTION: tl.constexpr,
):
    """One program per (b, h, query tile): dq of the tile's rows (fp32) over its listed key tiles, KEY_CHUNK keys per
    step, taken in ORDER (`plan.work_order`: long rows first). Q, DO [B*H, S, D], K, V [B*H, SK, D] contiguous; LSE,
    DELTA fp32 [B*H, S]; qk_scale = scale * log2(e). CORRECTION: first the proxy terms, the rows against all NK
    centroids K_MEAN, V_MEAN [B*H*NK, D] with the forward's bias row BIAS [B*H*MQ, NCP] (log2 len, -inf where the
    tile is no proxy: `correction_inputs`), KEY_CHUNK centroids per step."""
    item = tl.load(ORDER + tl.program_id(0))
    bh = item // MQ
    mt = item % MQ
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, KEY_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < S
    q_rows = (bh.to(tl.int64) * S + offs_m)[:, None] * HEAD_DIM + offs_d[None, :]
    q, do = _load_pair(Q, DO, q_rows, row_ok[:, None], UPCAST)
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
    if CORRECTION:
        c_base = bh.to(tl.int64) * NK
        for c0 in range(0, NCP, KEY_CHUNK):
            cols = c0 + offs_c
            c_ok = cols < NK
            c_off = (c_base + cols)[None, :] * HEAD_DIM + offs_d[:, None]                      # [D, C]
            kt, vt = _load_pair(K_MEAN, V_MEAN, c_off, c_ok[None, :], UPCAST)
            bias = tl.load(BIAS + item.to(tl.int64) * NCP + cols)
            p = tl.math.exp2(tl.dot(q, kt) * qk_scale + bias[None, :] - lse[:, None])          # len * exp(s - lse)
            ds = p * (tl.dot(do, vt) - delta[:, None])
            dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))
    PARTS: tl.constexpr = BLOCK_N // KEY_CHUNK
    for jp in range(0, count * PARTS):
        keys = tl.load(row + jp // PARTS) * BLOCK_N + (jp % PARTS) * KEY_CHUNK + offs_c
        k_ok = keys < limit
        kv_off = kv_base + keys[None, :].to(tl.int64) * HEAD_DIM + offs_d[:, None]       # [D, C]
        kt, vt = _load_pair(K, V, kv_off, k_ok[None, :], UPCAST)
        p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse[:, None])
        p = tl.where(k_ok[None, :], p, 0.0)
        ds = p * (tl.dot(do, vt) - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))
    tl.store(DQ + q_rows, dq * scale, mask=row_ok[:, None])


@triton.jit
def _key_side_step(dk, dv, k, v, bias, Q, DO, LSE, DELTA, bh, rows, S, qk_scale, HEAD_DIM: tl.constexpr,
                   UPCAST: tl.constexpr):
    """One step of the key-side kernels: dk (without the scale) and dv [KEYS, D] fp32 of keys k, v [KEYS, D] plus
    what the query rows `rows` [R] of head bh give them, with P^T = exp2(k . q^T * qk_scale + bias - lse * log2(e))
    (bias [KEYS]: 0, -inf for a masked key, or a centroid's log2 len). Rows past S or without keys give nothing."""
    row_ok = rows < S
    q_off = (bh.to(tl.int64) * S + rows)[None, :] * HEAD_DIM + tl.arange(0, HEAD_DIM)[:, None]   # [D, R]
    qt, do_t = _load_pair(Q, DO, q_off, row_ok[None, :], UPCAST)
    lse = tl.load(LSE + bh.to(tl.int64) * S + rows, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(DELTA + bh.to(tl.int64) * S + rows, mask=row_ok, other=0.0)
    pt = tl.math.exp2(tl.dot(k, qt) * qk_scale + bias[:, None] - lse[None, :])                   # P^T [KEYS, R]
    dv += tl.dot(pt.to(do_t.dtype), tl.trans(do_t))
    dst = pt * (tl.dot(v, do_t) - delta[None, :])
    dk += tl.dot(dst.to(qt.dtype), tl.trans(qt))
    return dk, dv


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
    k, v = _load_pair(K, V, kv_off, k_ok[:, None], UPCAST)
    dk = tl.zeros([KEYS, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([KEYS, HEAD_DIM], dtype=tl.float32)
    row = Q_INDEX + item.to(tl.int64) * MMAX
    count = tl.load(Q_COUNT + item)
    PARTS: tl.constexpr = BLOCK_M // ROWS
    key_bias = tl.where(k_ok, 0.0, float("-inf"))
    for ip in range(0, count * PARTS):
        rows = tl.load(row + ip // PARTS) * BLOCK_M + (ip % PARTS) * ROWS + offs_r
        dk, dv = _key_side_step(dk, dv, k, v, key_bias, Q, DO, LSE, DELTA, bh, rows, S, qk_scale, HEAD_DIM, UPCAST)
    store_ok = (keys < SK)[:, None]
    tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=store_ok)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=store_ok)


@triton.jit
def _bwd_centroids(
    Q, DO, LSE, DELTA, K_MEAN, V_MEAN, BIAS, DK_PART, DV_PART,
    qk_scale,
    S, MQ, NK, NCP, TILES_PER_SPLIT,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CENTROIDS: tl.constexpr, ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (i, s): the proxy terms' gradients of CENTROIDS centroids of one (b, h) (i over B*H*ceil(NK /
    CENTROIDS)) from query tiles [s * TILES_PER_SPLIT, (s + 1) * TILES_PER_SPLIT), ROWS rows per step; writes its
    partial sums (dk_mean without the scale, dv_mean: fp32) to DK_PART, DV_PART [splits, B*H*NK, D], summed on the
    host (no atomics: the same bits every run). Inputs as `_bwd_dq`'s; a tile's bias column is the same for all
    its rows."""
    blocks = tl.cdiv(NK, CENTROIDS)
    bh = tl.program_id(0) // blocks
    cols = (tl.program_id(0) % blocks) * CENTROIDS + tl.arange(0, CENTROIDS)
    c_ok = cols < NK
    offs_d = tl.arange(0, HEAD_DIM)
    c_off = (bh.to(tl.int64) * NK + cols)[:, None] * HEAD_DIM + offs_d[None, :]               # [C, D]
    kc, vc = _load_pair(K_MEAN, V_MEAN, c_off, c_ok[:, None], UPCAST)
    dk = tl.zeros([CENTROIDS, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([CENTROIDS, HEAD_DIM], dtype=tl.float32)
    first = tl.program_id(1) * TILES_PER_SPLIT
    PARTS: tl.constexpr = BLOCK_M // ROWS
    for ip in range(0, (tl.minimum(first + TILES_PER_SPLIT, MQ) - first) * PARTS):
        mt = first + ip // PARTS
        bias = tl.load(BIAS + (bh.to(tl.int64) * MQ + mt) * NCP + cols, mask=c_ok, other=float("-inf"))
        rows = mt * BLOCK_M + (ip % PARTS) * ROWS + tl.arange(0, ROWS)
        dk, dv = _key_side_step(dk, dv, kc, vc, bias, Q, DO, LSE, DELTA, bh, rows, S, qk_scale, HEAD_DIM, UPCAST)
    out_off = (bh.to(tl.int64) * NK + cols)[:, None] * HEAD_DIM + offs_d[None, :]
    split_off = tl.program_id(1).to(tl.int64) * (tl.num_programs(0) // blocks) * NK * HEAD_DIM
    tl.store(DK_PART + split_off + out_off, dk, mask=c_ok[:, None])
    tl.store(DV_PART + split_off + out_off, dv, mask=c_ok[:, None])


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


def backward_num_warps(head_dim: int, kernel: str = "dq", capability: int = 90) -> int:
    """Warps per program of `_bwd_dq` ("dq": 8 at head dim 128 for its fp32 dq accumulator, else 4), `_bwd_dkdv`
    ("dkdv": 4) or `_bwd_centroids` ("centroids": 4 from compute capability 9.0, 8 below, where 4 spill at head dim
    64). At 12 x 32,760, d 128, density 0.1, `_bwd_dkdv` took 3.30 ms with 4 warps and 7.58 ms with 8 on the H100 (400
    vs 174 TFLOP/s on its four products; 3.24 vs 7.60 on the H200), and 64-row steps 12% faster still
    (`default_rows`; `scripts/sweep_backward.py --out benchmarks/backward_launch_sweep_h100.json`);
    `_bwd_centroids` 0.29 ms with 4 warps and 0.82 with 8 on the H200 (`... --correction --out
    benchmarks/backward_launch_sweep_correction_h200.json`; 0.35 vs 0.83 at CogVideoX's 48 x 17,550, d 64)."""
    if kernel == "centroids":
        return 4 if capability >= 90 else 8
    return 4 if kernel == "dkdv" or head_dim < 128 else 8


def default_rows(head_dim: int, block_m: int, capability: int = 90) -> int:
    """Query rows per step of `_bwd_dkdv`: 64 from compute capability 9.0 at head dim 128, else `ROW_CHUNK` (at most
    block_m). At 12 x 32,760, d 128, density 0.1 on the H100 the kernel took 2.91 ms with 64 rows and 3.30 with 32
    (453 vs 400 TFLOP/s; 0.29 vs 0.32 ms at 12 x 8,192), though ptxas spills there (68-72 bytes of stores at 255
    registers); at head dim 64 64 rows were slower (2.53 vs 2.34 ms at CogVideoX's 48 x 17,550;
    `scripts/sweep_backward.py --out benchmarks/backward_launch_sweep_h100.json`)."""
    rows = 64 if capability >= 90 and head_dim == 128 else ROW_CHUNK
    return min(block_m, rows)


def _capability(t: torch.Tensor) -> int:
    """Compute capability of t's GPU as major * 10 + minor (90 elsewhere: the interpreter)."""
    if t.device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(t.device)
    return major * 10 + minor


@dataclass
class BackwardInputs:
    """What the backward kernels read, prepared once per backward (`prepare_backward`): q, d_out [B, H, S, D],
    k, v [B, H, Sk, D] contiguous; lse, delta fp32 [B, H, S]; the plan (with its index slot), flat (kv_index
    [B*H*Mq, Kmax], kv_count [B*H*Mq]) and transposed (q_index [B*H*Nk, Mq], q_count [B*H*Nk]); key_limits int32
    [B*H] or a placeholder; the correction's k_mean, v_mean, bias (`correction_inputs`, `key_chunk` centroids per
    step) or placeholders."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    d_out: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor
    plan: Plan
    scale: float
    kv_index: torch.Tensor
    kv_count: torch.Tensor
    q_index: torch.Tensor
    q_count: torch.Tensor
    key_limits: torch.Tensor
    has_limit: bool
    k_mean: torch.Tensor
    v_mean: torch.Tensor
    bias: torch.Tensor
    key_chunk: int
    upcast: bool

    def constants(self) -> dict:
        """The constexprs `_bwd_dq` and `_bwd_dkdv` share."""
        return dict(HEAD_DIM=self.q.shape[-1], BLOCK_M=self.plan.block_m, BLOCK_N=self.plan.block_n, UPCAST=self.upcast,
                    HAS_LIMIT=self.has_limit)


def prepare_backward(q, k, v, out, lse, plan: Plan, scale: float, d_out, d_lse) -> BackwardInputs | None:
    """The `BackwardInputs` of `triton_attention_backward`'s arguments (None when there are no keys), delta included
    (one `_bwd_delta` launch)."""
    B, H, S, D = q.shape
    Sk = k.shape[2]
    Nk = math.ceil(Sk / plan.block_n)
    if Nk == 0:
        return None
    plan = plan.with_index_slot()
    d_out = torch.zeros_like(q) if d_out is None else d_out.to(q.dtype)
    lse = lse.float().contiguous()
    q, k, v, d_out, out = (t.contiguous() for t in (q, k, v, d_out, out))
    delta = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    d_lse = None if d_lse is None else d_lse.float().contiguous()
    _bwd_delta[(triton.cdiv(B * H * S, DELTA_ROWS),)](out, d_out, delta if d_lse is None else d_lse, delta,
                                                      B * H * S, HEAD_DIM=D, ROWS=DELTA_ROWS,
                                                      HAS_DLSE=d_lse is not None, **COMPILE_OPTIONS)
    limit = key_limit(plan, H, Sk)
    kv_index, kv_count = flat_plan(plan)
    q_index, q_count = transpose_plan(listed_tiles(plan, Nk))
    key_chunk = min(plan.block_n, DQ_KEY_CHUNK)
    k_mean = v_mean = bias = delta       # no correction: placeholders, never read
    if plan.has_correction:
        k_mean, v_mean, bias = correction_inputs(plan, Nk, key_chunk, q.dtype)
    return BackwardInputs(q, k, v, d_out, lse, delta, plan, scale, kv_index, kv_count, q_index, q_count,
                          kv_count if limit is None else limit, limit is not None, k_mean, v_mean, bias, key_chunk,
                          INTERPRETED and q.dtype != torch.float32)


def _launch_options(num_warps: int, num_stages: int | None) -> dict:
    """num_warps, and num_stages when given (else Triton's default)."""
    return dict(num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}))


def launch_dq(inp: BackwardInputs, dq: torch.Tensor, *, key_chunk: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None):
    """`_bwd_dq` into dq (fp32 [B, H, S, D], without the cast to q's dtype); launch parameters default to those
    `triton_attention_backward` uses (`scripts/sweep_backward.py` times others). Returns the launch's kernel."""
    B, H, S, D = inp.q.shape
    Mq, Nk = math.ceil(S / inp.plan.block_m), math.ceil(inp.k.shape[2] / inp.plan.block_n)
    key_chunk = key_chunk or inp.key_chunk
    if inp.plan.has_correction and inp.bias.shape[-1] % key_chunk:
        raise ValueError(f"key_chunk={key_chunk} must divide the correction's {inp.bias.shape[-1]} padded centroids.")
    return _bwd_dq[(B * H * Mq,)](
        inp.q, inp.k, inp.v, inp.d_out, inp.lse, inp.delta, dq, inp.kv_index, inp.kv_count, work_order(inp.kv_count),
        inp.key_limits, inp.k_mean, inp.v_mean, inp.bias, inp.scale * LOG2E, inp.scale, S, inp.k.shape[2], Mq,
        inp.kv_index.shape[1], Nk, inp.bias.shape[-1], KEY_CHUNK=key_chunk, CORRECTION=inp.plan.has_correction,
        **inp.constants(), **_launch_options(num_warps or backward_num_warps(D, "dq"), num_stages), **COMPILE_OPTIONS)


def launch_dkdv(inp: BackwardInputs, dk: torch.Tensor, dv: torch.Tensor, *, keys: int | None = None,
                rows: int | None = None, num_warps: int | None = None, num_stages: int | None = None):
    """`_bwd_dkdv` into dk, dv (as k, v); `keys` per program (a divisor of block_n) and `rows` per step (of block_m)
    default to those `triton_attention_backward` uses, as the other launch parameters. Returns the launch's kernel."""
    B, H, S, D = inp.q.shape
    bm, bn = inp.plan.block_m, inp.plan.block_n
    Sk = inp.k.shape[2]
    Nk = math.ceil(Sk / bn)
    keys, rows = keys or min(bn, KEY_SPLIT), rows or default_rows(D, bm, _capability(inp.q))
    if bn % keys or bm % rows:
        raise ValueError(f"keys={keys} and rows={rows} must divide the plan's tiles ({bm} x {bn}).")
    return _bwd_dkdv[(B * H * Nk * (bn // keys),)](
        inp.q, inp.k, inp.v, inp.d_out, inp.lse, inp.delta, dk, dv, inp.q_index, inp.q_count,
        work_order(inp.q_count), inp.key_limits, inp.scale * LOG2E, inp.scale, S, Sk, Nk, inp.q_index.shape[1],
        KEYS=keys, ROWS=rows, **inp.constants(),
        **_launch_options(num_warps or backward_num_warps(D, "dkdv"), num_stages), **COMPILE_OPTIONS)


def centroid_gradients(inp: BackwardInputs, *, centroids: int | None = None, rows: int | None = None,
                       num_warps: int | None = None, num_stages: int | None = None):
    """The gradients of the plan's k_mean and v_sum (in their dtypes) from the proxy terms: `_bwd_centroids`,
    `centroids` per program (default `CENTROID_BLOCK`) and `rows` query rows per step, over query tiles split so that
    the grid fills the GPU about four times, its partial sums added here (the centroids of tiles past valid_keys are
    zeroed by `correction_inputs`, so NaN there reaches nothing)."""
    B, H, S, D = inp.q.shape
    plan, k_mean, bias = inp.plan, inp.k_mean, inp.bias
    Mq, Nk, ncp = bias.shape[0] // (B * H), k_mean.shape[0] // (B * H), bias.shape[1]
    centroids, rows = centroids or CENTROID_BLOCK, rows or min(plan.block_m, ROW_CHUNK)
    if plan.block_m % rows:
        raise ValueError(f"rows={rows} must divide the plan's block_m={plan.block_m}.")
    blocks = B * H * triton.cdiv(Nk, centroids)
    splits = max(1, min(Mq, triton.cdiv(4 * (device_programs(inp.q.device) or 1), blocks)))
    tiles = triton.cdiv(Mq, splits)
    splits = triton.cdiv(Mq, tiles)
    parts = torch.empty(2, splits, B * H * Nk, D, dtype=torch.float32, device=inp.q.device)
    _bwd_centroids[(blocks, splits)](inp.q, inp.d_out, inp.lse, inp.delta, k_mean, inp.v_mean, bias, parts[0],
                                     parts[1], inp.scale * LOG2E, S, Mq, Nk, ncp, tiles, HEAD_DIM=D,
                                     BLOCK_M=plan.block_m, CENTROIDS=centroids, ROWS=rows, UPCAST=inp.upcast,
                                     **_launch_options(num_warps or backward_num_warps(D, "centroids",
                                                                                       _capability(inp.q)), num_stages),
                                     **COMPILE_OPTIONS)
    d_k_mean, dv_mean = parts.sum(1).view(2, B, H, Nk, D)
    tile_len = plan.tile_len.to(device=inp.q.device, dtype=torch.float32)
    return ((d_k_mean * inp.scale).to(plan.k_mean.dtype),
            (dv_mean / tile_len[:, None].clamp_min(1)).to(plan.v_sum.dtype))


@on_input_device
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
    inp = prepare_backward(q, k, v, out, lse, plan, scale, d_out, d_lse)
    if inp is None:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None
    dq = torch.empty(inp.q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(inp.k), torch.empty_like(inp.v)
    launch_dq(inp, dq)
    launch_dkdv(inp, dk, dv)
    d_k_mean = d_v_sum = None
    if inp.plan.has_correction:
        d_k_mean, d_v_sum = centroid_gradients(inp)
    return dq.to(q.dtype), dk, dv, d_k_mean, d_v_sum


def not_supported_reasons(q: torch.Tensor, plan: Plan) -> list[str]:
    """Why the Triton backward cannot take these inputs (empty: it can): where the generic forward kernel runs (device,
    dtype, head dim, tiles), it runs too (it makes its inputs contiguous)."""
    return GENERIC.not_supported_reasons(q, q, q, plan)


def compile_backward(kernel: str = "dq", *, capability: int = 90, head_dim: int = 128, dtype: str = "bf16",
                     block_m: int = 128, block_n: int = 128, seq_len: int = 32760, correction: bool = True):
    """Compile `_bwd_dq` (with the proxy terms when `correction`), `_bwd_dkdv` or `_bwd_centroids` ("dq", "dkdv",
    "centroids") ahead of time for compute capability `capability` (works on a CPU-only machine) with the launch
    options `triton_attention_backward` uses. Returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = {"dq": _bwd_dq, "dkdv": _bwd_dkdv, "centroids": _bwd_centroids}[kernel]
    ptr = "*" + dtype
    pointers = dict(Q=ptr, K=ptr, V=ptr, DO=ptr, LSE="*fp32", DELTA="*fp32", DQ="*fp32", DK=ptr, DV=ptr,
                    KV_INDEX="*i32", KV_COUNT="*i32", Q_INDEX="*i32", Q_COUNT="*i32", ORDER="*i32",
                    KEY_LIMIT="*i32", K_MEAN=ptr, V_MEAN=ptr, BIAS="*fp32", DK_PART="*fp32", DV_PART="*fp32")
    Mq, Nk = -(-seq_len // block_m), -(-seq_len // block_n)
    values = dict(qk_scale=0.125 * 1.4427, scale=0.125, S=seq_len, SK=seq_len, MQ=Mq, NK=Nk, KMAX=Nk,
                  MMAX=Mq, NCP=-(-Nk // 32) * 32, TILES_PER_SPLIT=-(-Mq // 4))
    constants = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=False, HAS_LIMIT=False)
    if kernel == "dq":
        constants.update(KEY_CHUNK=min(block_n, DQ_KEY_CHUNK), CORRECTION=correction)
    elif kernel == "dkdv":
        constants.update(KEYS=min(block_n, KEY_SPLIT), ROWS=default_rows(head_dim, block_m, capability))
    else:
        constants = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, CENTROIDS=CENTROID_BLOCK, ROWS=min(block_m, ROW_CHUNK),
                         UPCAST=False)
    signature, constants, attrs = launch_signature(fn.arg_names, pointers, values, constants)
    warps = backward_num_warps(head_dim, kernel, capability)
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=warps, **COMPILE_OPTIONS))
