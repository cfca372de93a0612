"""Pieces shared by the Triton kernels: host-side plan preparation and the online-softmax step.

Imported only through the backend registry (it imports triton). Host helpers turn a `Plan` into the
flat tensors both kernels read:

    order     int32 [B*H*Mq]          work items (b*H + h)*Mq + m in `plan.work_order` for the kernel's
                                      grid (the plan's own `order` when it carries one: nothing per call)
    kv_index  int32 [B*H*Mq, Kmax]    the plan's key tiles, contiguous
    kv_count  int32 [B*H*Mq]
    k_mean    [B*H*Nk, D]  (q.dtype)  correction: mean key per key tile (zero for tiles that start at or
                                      past the item's valid keys: what the plan holds there is never read)
    v_mean    [B*H*Nk, D]  (q.dtype)  correction: mean value per key tile (v_sum / len; zero as k_mean)
    bias      fp32 [B*H*Mq, Ncp]      correction: log2(len_j), or -inf where tile j is exact or j >= Nk
                                      (Ncp = Nk rounded up to whole chunks) or, with `plan.valid_keys`,
                                      where tile j starts at or past the item's valid keys
    key_limit int32 [B*H]             with `plan.valid_keys`: the valid keys of every (b, h)

With v_mean and a log2(len) bias, a skipped tile contributes exp(s - m) * len * v_mean = exp(s - m) * v_sum
to the numerator and exp(s - m) * len to the denominator, exactly as the reference.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..plan import Plan, work_order

LOG2E = 1.4426950408889634
# finite "minus infinity" for the running max: keeps exp2(m_old - m_new) free of inf - inf
NEG_BIG = tl.constexpr(-1.0e30)


# compile options every launch (and every ahead-of-time compile) passes: FP fusion (a*b+c -> one FMA, e.g. the softmax's
# scale-and-subtract) is what the kernels were tuned and tested with; Triton 3.9 warns that its default turns it off
# from 3.10, so it is asked for by name, not left to the default
COMPILE_OPTIONS = dict(enable_fp_fusion=True)


def on_input_device(launcher):
    """Decorator: run `launcher` with the CUDA device of its first tensor argument current. Triton compiles for and
    launches on the current device, not the tensors' one: inputs on cuda:1 with cuda:0 current (a pipeline moved
    there, diffusers' device_map="balanced") failed with "Pointer argument cannot be accessed from Triton" or, with
    peer access, ran on the wrong GPU. CPU tensors (the interpreter) pass through without touching torch.cuda."""

    @functools.wraps(launcher)
    def guarded(*args, **kwargs):
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if tensor is None or tensor.device.type != "cuda" or tensor.device.index == torch.cuda.current_device():
            return launcher(*args, **kwargs)
        with torch.cuda.device(tensor.device):
            return launcher(*args, **kwargs)

    guarded.on_input_device = True
    return guarded


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)


def correction_inputs_torch(plan: Plan, num_key_tiles: int, chunk: int, dtype: torch.dtype):
    """`correction_inputs` in plain torch ops (about a dozen small kernels): the reference the Triton
    version is tested against."""
    B, H, Mq, kmax = plan.kv_index.shape
    Nk = num_key_tiles
    D = plan.k_mean.shape[-1]
    dev = plan.kv_index.device
    ncp = math.ceil(Nk / chunk) * chunk
    tile_len = plan.tile_len.to(device=dev, dtype=torch.float32)
    k_mean = plan.k_mean.to(dtype)
    v_mean = (plan.v_sum.float() / tile_len.clamp_min(1)[:, None]).to(dtype)
    if plan.valid_keys is not None:      # centroids of tiles past the valid keys may hold anything (NaN): zeroed
        past = (torch.arange(Nk, device=dev) * plan.block_n >= plan.valid_keys.long()[:, None])[:, None, :, None]
        k_mean, v_mean = (t.masked_fill(past, 0) for t in (k_mean, v_mean))
    k_mean, v_mean = (t.reshape(B * H * Nk, D).contiguous() for t in (k_mean, v_mean))
    log2_len = torch.full((ncp + 1,), float("-inf"), dtype=torch.float32, device=dev)
    log2_len[:Nk] = torch.log2(tile_len.clamp_min(1))
    bias = log2_len.expand(B * H * Mq, ncp + 1).contiguous()
    valid = torch.arange(kmax, device=dev) < plan.kv_count[..., None]
    idx = torch.where(valid, plan.kv_index.long(), ncp).reshape(B * H * Mq, kmax)
    bias.scatter_(-1, idx, float("-inf"))
    if plan.valid_keys is not None:      # tiles that start past an item's valid keys do not count
        tiles = (plan.valid_keys.long() + plan.block_n - 1) // plan.block_n
        past = torch.arange(ncp + 1, device=dev) >= tiles.repeat_interleave(H * Mq)[:, None]
        bias.masked_fill_(past, float("-inf"))
    return k_mean, v_mean, bias[:, :ncp].contiguous()


def key_limit(plan: Plan, heads: int, key_len: int) -> torch.Tensor | None:
    """int32 [B*H]: `plan.valid_keys` per (b, h) row of the kernels' flat layout, at most `key_len` (Sk: a limit past
    the keys, which an unvalidated plan may carry, would read the next head's keys), or None without it."""
    if plan.valid_keys is None:
        return None
    return plan.valid_keys.clamp_max(key_len).repeat_interleave(heads).contiguous()


@triton.jit
def _correction_inputs_kernel(KV_INDEX, KV_COUNT, TILE_LEN, K_MEAN, V_SUM, KM_OUT, VM_OUT, BIAS, VALID_KEYS,
                              N_ITEMS, NK, NCP, KMAX, N_ROWS, D, ITEMS_PER_B, ROWS_PER_B, BLOCK_N,
                              D_P2: tl.constexpr, CHUNK: tl.constexpr, KB: tl.constexpr, ROWS: tl.constexpr,
                              HAS_VALID: tl.constexpr):
    """Programs [0, N_ITEMS): one bias row each (log2 len, -inf on the item's exact tiles, past NK and, HAS_VALID,
    from the first tile that starts at or past its item's VALID_KEYS; the exact tiles are matched KB list entries
    at a time); programs past that: ROWS rows of k_mean (cast) and v_mean = v_sum / max(len, 1) each, zero for
    tiles that start at or past VALID_KEYS (their centroids may hold anything: NaN there would reach every row
    through 0 * NaN, as the bias only masks them)."""
    pid = tl.program_id(0)
    if pid < N_ITEMS:
        count = tl.load(KV_COUNT + pid)
        row = KV_INDEX + pid.to(tl.int64) * KMAX
        n_tiles = NK
        if HAS_VALID:
            n_tiles = tl.minimum(NK, tl.cdiv(tl.load(VALID_KEYS + pid // ITEMS_PER_B), BLOCK_N))
        for c0 in range(0, NCP, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            length = tl.load(TILE_LEN + cols, mask=cols < NK, other=1).to(tl.float32)
            bias = tl.where(cols < n_tiles, tl.math.log2(tl.maximum(length, 1.0)), float("-inf"))
            exact = tl.zeros([CHUNK], dtype=tl.int32)
            for j0 in range(0, count, KB):
                js = j0 + tl.arange(0, KB)
                idx = tl.load(row + js, mask=js < count, other=-1)
                exact = tl.maximum(exact, tl.max((cols[:, None] == idx[None, :]).to(tl.int32), 1))
            tl.store(BIAS + pid.to(tl.int64) * NCP + cols, tl.where(exact > 0, float("-inf"), bias))
    else:
        rows = (pid - N_ITEMS) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < N_ROWS
        length = tl.maximum(tl.load(TILE_LEN + rows % NK, mask=row_ok, other=1).to(tl.float32), 1.0)
        dims = tl.arange(0, D_P2)
        offs = rows.to(tl.int64)[:, None] * D + dims[None, :]
        ok = row_ok[:, None] & (dims < D)[None, :]
        counts = ok
        if HAS_VALID:
            past = (rows % NK) * BLOCK_N >= tl.load(VALID_KEYS + rows // ROWS_PER_B, mask=row_ok, other=0)
            counts = ok & ~past[:, None]
        km = tl.load(K_MEAN + offs, mask=counts, other=0.0)
        vs = tl.load(V_SUM + offs, mask=counts, other=0.0).to(tl.float32)
        tl.store(KM_OUT + offs, km.to(KM_OUT.dtype.element_ty), mask=ok)
        tl.store(VM_OUT + offs, (vs / length[:, None]).to(VM_OUT.dtype.element_ty), mask=ok)


def correction_inputs(plan: Plan, num_key_tiles: int, chunk: int, dtype: torch.dtype):
    """(k_mean [B*H*Nk, D], v_mean [B*H*Nk, D] in `dtype`, bias fp32 [B*H*Mq, Ncp]); see the module docstring.

    One Triton launch (the torch version, `correction_inputs_torch`, took 0.14 ms of small kernels per call at
    12 x 32,768 on the H200, 12% of the sparse kernel at density 0.1)."""
    B, H, Mq, kmax = plan.kv_index.shape
    Nk = num_key_tiles
    D = plan.k_mean.shape[-1]
    dev = plan.kv_index.device
    ncp = math.ceil(Nk / chunk) * chunk
    n_items, n_rows = B * H * Mq, B * H * Nk
    kv_index, kv_count = flat_plan(plan)
    tile_len = plan.tile_len.to(device=dev).contiguous()
    k_mean = torch.empty(n_rows, D, dtype=dtype, device=dev)
    v_mean = torch.empty(n_rows, D, dtype=dtype, device=dev)
    bias = torch.empty(n_items, ncp, dtype=torch.float32, device=dev)
    rows = 16
    grid = (n_items + triton.cdiv(n_rows, rows),)
    valid = plan.valid_keys.contiguous() if plan.valid_keys is not None else None    # the kernel reads it flat
    _correction_inputs_kernel[grid](kv_index, kv_count, tile_len, plan.k_mean.contiguous(), plan.v_sum.contiguous(),
                                    k_mean, v_mean, bias, kv_count if valid is None else valid, n_items, Nk, ncp,
                                    kmax, n_rows, D, H * Mq, H * Nk, plan.block_n, D_P2=triton.next_power_of_2(D),
                                    CHUNK=chunk, KB=32, ROWS=rows, HAS_VALID=valid is not None, **COMPILE_OPTIONS)
    return k_mean, v_mean, bias


def aot_seq_len(seq_len: int | None, mask_last: bool) -> int:
    """The sequence length an ahead-of-time compile assumes: `seq_len`, or 32,760 when the last key tile is
    partial (`mask_last`) and 32,768 when it is not (12 x 32,768 is the benchmarks' shape)."""
    return seq_len or (32760 if mask_last else 32768)


def stride_arg_names(fn) -> list[str]:
    """A kernel's stride arguments in order (names starting with "stride")."""
    return [name for name in fn.arg_names if name.startswith("stride")]


def launch_signature(arg_names, pointers: dict, values: dict, constants: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for `triton.compile(ASTSource(fn, ...))` as Triton's JIT specializes a
    launch: `pointers` {name: "*bf16", ...} 16-byte aligned; `values` {name: int or float} typed and hinted by
    Triton's own rule (an integer == 1 folded in as a constant, a multiple of 16 marked divisible by 16);
    `constants` {name: value} constexpr. Used by the ahead-of-time compiles, so that their PTX / SASS is what a
    launch with such arguments runs (without the hints the code differs: other loads, more registers)."""
    from triton.backends.nvidia.compiler import CUDABackend

    specialize = _value_specializer(CUDABackend)
    constants = dict(constants)
    signature, attrs = {}, {}
    for i, name in enumerate(arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name], attrs[(i,)] = pointers[name], CUDABackend.parse_attr("D")
        elif name in values:
            kind, hint = specialize(values[name])
            signature[name] = kind
            if kind == "constexpr":
                constants[name] = values[name]
            elif hint:
                attrs[(i,)] = CUDABackend.parse_attr(hint)
        else:
            raise ValueError(f"argument {name!r}: no pointer type, value or constant given")
    return signature, constants, attrs


def _value_specializer(backend):
    """value -> (type, hint) by the rule Triton's JIT applies to a launch argument (is_const False, specialize
    and align on): Triton >= 3.6 has it in C++, Triton 3.5 (torch 2.9's) in Python."""
    try:
        from triton._C.libtriton import native_specialize_impl
    except ImportError:                                   # Triton < 3.6
        from triton.runtime.jit import create_specialize_impl
        impl = create_specialize_impl(backend.get_arg_specialization)
        return lambda value: impl(value, False, True, True)
    return lambda value: native_specialize_impl(backend, value, False, True, True)


def launch_dims(q: torch.Tensor, k: torch.Tensor, plan: Plan, programs: int | None = None):
    """(B, H, S, D, Sk, Mq, Nk, kv_index, kv_count, order): the shapes and flat plan tensors the kernels launch
    with; `programs`: the persistent grid the order is balanced for (None: one program per row)."""
    B, H, S, D = q.shape
    Sk = k.shape[2]
    Mq, Nk = math.ceil(S / plan.block_m), math.ceil(Sk / plan.block_n)
    kv_index, kv_count = flat_plan(plan)
    order = plan.order.contiguous() if plan.order is not None else work_order(plan.kv_count, programs)   # read flat
    return B, H, S, D, Sk, Mq, Nk, kv_index, kv_count, order


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
    """(out fp32 [M, D], lse fp32 [M], natural log); rows that saw no key give 0 and -inf (a NaN row keeps NaN)."""
    seen = l_i != 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def partial_state(o_ptr, lse_ptr, row_ok):
    """Online-softmax state (acc, l_i, m_i; log2 domain) that continues a stored partial result (normalised out
    at o_ptr, natural-log lse at lse_ptr): m = lse, l = 1, acc = out, since out = acc / l at m. Rows the partial
    did not see (lse -inf) start empty. Starting the next pass from it, rather than merging the partial in after
    the loop, keeps a second output tile out of registers at the end (at head dim 128 in the Hopper kernel,
    compiled without a launch's argument specialization, that merge spilled 408 bytes of stack and this 296; as
    launched, this spills none)."""
    t = tl.load(lse_ptr, mask=row_ok, other=float("-inf")) * 1.4426950408889634
    seen = t != float("-inf")              # a NaN lse continues as NaN
    acc = tl.load(o_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
    return acc, tl.where(seen, 1.0, 0.0), tl.where(seen, t, NEG_BIG)
