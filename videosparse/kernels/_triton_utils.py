"""Pieces shared by the Triton kernels: host-side plan preparation and the online-softmax step.

Imported only through the backend registry (it imports triton). Host helpers turn a `Plan` into the
flat tensors both kernels read:

    order     int32 [B*H*Mq]          work items (b*H + h)*Mq + m, longest first (stable by kv_count)
    kv_index  int32 [B*H*Mq, Kmax]    the plan's key tiles, contiguous
    kv_count  int32 [B*H*Mq]
    k_mean    [B*H*Nk, D]  (q.dtype)  correction: mean key per key tile
    v_mean    [B*H*Nk, D]  (q.dtype)  correction: mean value per key tile (v_sum / len)
    bias      fp32 [B*H*Mq, Ncp]      correction: log2(len_j), or -inf where tile j is exact or j >= Nk
                                      (Ncp = Nk rounded up to whole chunks)

With v_mean and a log2(len) bias, a skipped tile contributes exp(s - m) * len * v_mean = exp(s - m) * v_sum
to the numerator and exp(s - m) * len to the denominator, exactly as the reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..plan import Plan

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# finite "minus infinity" for the running max: keeps exp2(m_old - m_new) free of inf - inf
NEG_BIG = tl.constexpr(-1.0e30)


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)


def work_order(kv_count: torch.Tensor) -> torch.Tensor:
    """int32 [B*H*Mq]: flat work-item ids sorted by kv_count, longest first, stable (keeps head locality)."""
    flat = kv_count.reshape(-1)
    return torch.sort(flat, descending=True, stable=True).indices.to(torch.int32)


def correction_inputs(plan: Plan, num_key_tiles: int, chunk: int, dtype: torch.dtype):
    """(k_mean [B*H*Nk, D], v_mean [B*H*Nk, D] in `dtype`, bias fp32 [B*H*Mq, Ncp]); see the module docstring."""
    B, H, Mq, kmax = plan.kv_index.shape
    Nk = num_key_tiles
    D = plan.k_mean.shape[-1]
    dev = plan.kv_index.device
    ncp = math.ceil(Nk / chunk) * chunk
    tile_len = plan.tile_len.to(device=dev, dtype=torch.float32)
    k_mean = plan.k_mean.to(dtype).reshape(B * H * Nk, D).contiguous()
    v_mean = (plan.v_sum.float() / tile_len.clamp_min(1)[:, None]).to(dtype).reshape(B * H * Nk, D).contiguous()
    log2_len = torch.full((ncp + 1,), float("-inf"), dtype=torch.float32, device=dev)
    log2_len[:Nk] = torch.log2(tile_len.clamp_min(1))
    bias = log2_len.expand(B * H * Mq, ncp + 1).contiguous()
    valid = torch.arange(kmax, device=dev) < plan.kv_count[..., None]
    idx = torch.where(valid, plan.kv_index.long(), ncp).reshape(B * H * Mq, kmax)
    bias.scatter_(-1, idx, float("-inf"))
    return k_mean, v_mean, bias[:, :ncp].contiguous()


def launch_dims(q: torch.Tensor, k: torch.Tensor, plan: Plan):
    """(B, H, S, D, Sk, Mq, Nk, kv_index, kv_count, order): the shapes and flat plan tensors both kernels launch with."""
    B, H, S, D = q.shape
    Sk = k.shape[2]
    Mq, Nk = math.ceil(S / plan.block_m), math.ceil(Sk / plan.block_n)
    kv_index, kv_count = flat_plan(plan)
    return B, H, S, D, Sk, Mq, Nk, kv_index, kv_count, work_order(kv_count)


def flat_plan(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_index [B*H*Mq, Kmax], kv_count [B*H*Mq]) as contiguous int32."""
    B, H, Mq, kmax = plan.kv_index.shape
    return (plan.kv_index.reshape(B * H * Mq, kmax).contiguous(), plan.kv_count.reshape(-1).contiguous())


@triton.jit
def softmax_step(acc, l_i, m_i, qk, v, qk_scale, bias, HAS_BIAS: tl.constexpr):
    """One online-softmax update with raw logits qk [M, N] (fp32), values v [N, D].

    Logits are scaled by qk_scale (= scale * log2 e) and shifted by `bias` [N] (log2 domain,
    -inf masks a column) when HAS_BIAS. Returns the new (acc, l_i, m_i), m_i in the log2 domain.
    """
    if HAS_BIAS:
        s = qk * qk_scale + bias[None, :]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        s = s - m_new[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        s = qk * qk_scale - m_new[:, None]
    p = tl.math.exp2(s)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def finish_rows(acc, l_i, m_i):
    """(out fp32 [M, D], lse fp32 [M], natural log); rows that saw no key give 0 and -inf."""
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def merge_partial(acc, l_i, m_i, o_ptr, lse_ptr, row_ok):
    """Fold a stored partial result (normalised out at o_ptr, natural-log lse at lse_ptr) into the state."""
    o_prev = tl.load(o_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
    t = tl.load(lse_ptr, mask=row_ok, other=float("-inf")) * 1.4426950408889634
    m_new = tl.maximum(m_i, t)
    a = tl.math.exp2(m_i - m_new)
    b = tl.math.exp2(t - m_new)
    return acc * a[:, None] + o_prev * b[:, None], l_i * a + b, m_new
