"""Triton kernels vs the torch reference under the Triton interpreter (CPU).

`TRITON_INTERPRET=1` must be set before the kernel modules are imported, and it would turn every
other @triton.jit of the process into an interpreted function (breaking the AOT test). So the cases
run in one child process (this file run as a script, with the variable set), which prints one JSON
line per case; each parametrized test below checks its own line. The parent process never imports
triton in interpreter mode.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from helpers import InterpreterCases, interpreter_child

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# name: B, H, S, Sk, D, block_m, block_n, density, dtype, correction, kernel, extra
CASES = {
    "generic-fp32-d64-b64-odd": (2, 3, 300, 300, 64, 64, 64, 0.3, "float32", False, "generic", ""),
    "generic-fp32-d128-b128-corr": (1, 2, 257, 257, 128, 128, 128, 0.5, "float32", True, "generic", ""),
    "generic-fp16-d64-m64n128-corr": (2, 2, 191, 191, 64, 64, 128, 0.4, "float16", True, "generic", ""),
    "generic-bf16-d128-m128n64": (1, 2, 333, 333, 128, 128, 64, 0.4, "bfloat16", False, "generic", ""),
    "generic-fp32-cross-len-corr": (1, 2, 200, 333, 64, 64, 64, 0.3, "float32", True, "generic", ""),
    "generic-fp32-empty-rows": (2, 2, 300, 300, 64, 64, 64, 0.3, "float32", False, "generic", "empty"),
    "generic-fp32-empty-rows-corr": (2, 2, 300, 300, 64, 64, 64, 0.3, "float32", True, "generic", "empty"),
    "generic-fp32-dense-corr": (1, 2, 256, 256, 64, 128, 128, 1.0, "float32", True, "generic", "dense"),
    "generic-fp16-strided": (2, 2, 200, 200, 64, 64, 64, 0.5, "float16", False, "generic", "strided"),
    # q rows 14M elements apart (a [B, S, H, D] q at S * H * D past 2**31): the row offsets pass 2**31 from row
    # 154 on; computed in int32 they wrapped and the kernel read out of bounds (a segfault here)
    "generic-fp16-huge-row-stride": (1, 1, 160, 160, 64, 64, 64, 0.5, "float16", False, "generic", "huge-row-stride"),
    # Mutation find: rows 20M elements apart in 128-row tiles: the offsets of rows within one query tile pass 2**31
    # from row 108 on (the case above stays below: 64 x 14M), so the launcher must make q contiguous first
    "generic-fp16-huge-tile-stride": (1, 1, 160, 160, 64, 128, 128, 0.5, "float16", False, "generic",
                                      "huge-tile-stride"),
    "generic-fp32-no-index-columns": (1, 2, 300, 300, 64, 64, 64, 0.3, "float32", False, "generic", "kmax0"),
    # review 59: Kmax past the key tiles is valid (validate refused it); the slots past each count are never read
    "generic-fp32-wide-plan-corr": (2, 2, 300, 300, 64, 64, 64, 0.5, "float32", True, "generic", "wide"),
    "hopper-fp32-wide-plan-corr": (1, 2, 300, 300, 64, 64, 64, 0.5, "float32", True, "hopper", "wide"),
    # Mutation find: q and k x 4 (logits of std 16): the running max must be taken of the scaled logits, else
    # exp2 underflows and rows come out 0 with lse -inf (moderate logits hid it; x 8 would pass the fp32 lse bound)
    "generic-fp32-large-logits": (1, 2, 200, 200, 64, 64, 64, 0.5, "float32", False, "generic", "large-logits"),
    # 128x128 tiles at head dim 64 (4 warps): each key tile in two steps of 64 keys (`default_key_chunk`); at head
    # dim 128 (8 warps) whole tiles
    "generic-bf16-d64-b128-odd": (2, 2, 300, 300, 64, 128, 128, 0.5, "bfloat16", False, "generic", ""),
    "generic-bf16-d128-b128-odd": (2, 2, 300, 300, 128, 128, 128, 0.5, "bfloat16", False, "generic", ""),
    "generic-fp16-d128-m64n128-corr": (1, 2, 333, 333, 128, 64, 128, 0.4, "float16", True, "generic", ""),
    # head dims the kernels do not take run zero-padded to the next one they do (`dispatch.PaddedHeadDim`)
    "generic-fp32-d96-b64-corr-padded": (1, 2, 300, 300, 96, 64, 64, 0.3, "float32", True, "generic", ""),
    "generic-bf16-d48-b128-padded": (2, 2, 257, 257, 48, 128, 128, 0.5, "bfloat16", False, "generic", ""),
    "hopper-fp32-d64-b64-corr": (2, 2, 300, 300, 64, 64, 64, 0.3, "float32", True, "hopper", ""),
    "hopper-fp16-d128-b128": (1, 3, 257, 257, 128, 128, 128, 0.5, "float16", False, "hopper", ""),
    "hopper-bf16-d64-m128n64-corr": (2, 1, 256, 256, 64, 128, 64, 0.4, "bfloat16", True, "hopper", ""),
    "hopper-fp32-empty-rows-corr": (2, 2, 200, 333, 64, 64, 64, 0.3, "float32", True, "hopper", "empty"),
    "hopper-fp32-dense-d128": (1, 2, 384, 384, 128, 128, 128, 1.0, "float32", False, "hopper", "dense"),
    # a key-padding limit per batch item (`Plan.valid_keys`): keys past it masked, tiles past it neither listed
    # nor corrected; the limits cross a tile inside the sequence
    "generic-fp32-valid-keys-corr": (2, 2, 300, 300, 64, 64, 64, 0.4, "float32", True, "generic", "valid"),
    "generic-bf16-d128-b128-valid-keys": (2, 2, 333, 333, 128, 128, 128, 0.5, "bfloat16", False, "generic", "valid"),
    "hopper-fp32-d64-b64-valid-keys-corr": (2, 2, 300, 300, 64, 64, 64, 0.4, "float32", True, "hopper", "valid"),
    "hopper-bf16-d128-b128-valid-keys": (2, 1, 384, 384, 128, 128, 128, 0.6, "bfloat16", False, "hopper", "valid"),
    # centroids (generic: also keys and values) past the limits hold NaN / inf: the output stays finite
    "generic-fp32-valid-keys-nan-centroids-corr": (2, 2, 300, 300, 64, 64, 64, 0.4, "float32", True, "generic",
                                                   "valid-poisoned"),
    "hopper-bf16-d64-b64-valid-keys-nan-centroids-corr": (2, 1, 300, 300, 64, 64, 64, 0.4, "bfloat16", True, "hopper",
                                                          "valid-poisoned"),
    # the plan's order and valid_keys as strided views (the kernels read both flat: they used to read other rows)
    "generic-fp32-strided-order-valid-keys-corr": (2, 2, 300, 300, 64, 64, 64, 0.4, "float32", True, "generic",
                                                   "strided-plan"),
    "hopper-fp32-strided-order-valid-keys-corr": (2, 2, 300, 300, 64, 64, 64, 0.4, "float32", True, "hopper",
                                                  "strided-plan"),
    # inf / NaN in the first keys, values and centroids of the second head: the first, whose partial last key tile
    # and centroid chunk end where that head's begin, must not see them (only head (0, 0) is compared)
    "generic-fp32-d64-b64-poisoned-neighbour-corr": (1, 2, 300, 300, 64, 64, 64, 1.0, "float32", True, "generic",
                                                     "poisoned"),
    "hopper-fp32-d64-b64-poisoned-neighbour-corr": (1, 2, 300, 300, 64, 64, 64, 0.5, "float32", True, "hopper",
                                                    "poisoned"),
    "hopper-bf16-d128-b128-poisoned-neighbour": (1, 2, 333, 333, 128, 128, 128, 1.0, "bfloat16", False, "hopper",
                                                 "poisoned"),
    # key limits past Sk in an unvalidated plan (validate=False, or any call under torch.compile): as Sk, as the
    # reference; the forward kernels used to read the next head's keys past the partial last tile
    "generic-fp32-d64-b64-limits-past-keys-corr": (2, 2, 300, 300, 64, 64, 64, 0.5, "float32", True, "generic",
                                                   "valid-past-keys"),
    "hopper-fp32-d64-b64-limits-past-keys-corr": (2, 2, 300, 300, 64, 64, 64, 0.5, "float32", True, "hopper",
                                                  "valid-past-keys"),
}


def valid_keys_for(B: int, Sk: int) -> torch.Tensor:
    """int32 [B]: per-item key limits for the "valid" cases, Sk - 5, Sk - 75, ... (at least 1)."""
    return torch.tensor([max(1, Sk - 5 - 70 * b) for b in range(B)], dtype=torch.int32)


# correction inputs (one Triton launch) vs their torch version; name: B, H, S, block, D, density, dtype, extra
def poison_past_valid_keys(plan) -> None:
    """NaN / inf in the centroids of the tiles that start at or past each item's valid keys (in place)."""
    for b, limit in enumerate(plan.valid_keys.tolist()):
        first = -(-limit // plan.block_n)
        plan.k_mean[b, :, first:], plan.v_sum[b, :, first:] = float("nan"), float("inf")


PREP_CASES = {
    "prep-b128-odd": (2, 3, 1000, 128, 128, 0.3, "bfloat16", ""),
    "prep-b64-empty-rows": (1, 2, 333, 64, 64, 0.5, "float16", "empty"),
    "prep-b64-long-lists": (1, 1, 5000, 64, 64, 0.6, "float32", ""),     # Kmax > 32: several list blocks
    "prep-b64-valid-keys": (2, 2, 333, 64, 64, 0.5, "float16", "valid"),
    "prep-b64-valid-keys-nan-centroids": (2, 2, 333, 64, 64, 0.5, "float32", "valid-poisoned"),
}


# tail split of the Gluon kernel: its parts (from the reference) merged by the combine kernel vs the whole
# items; name: B, H, S, D, density, programs, extra
SPLIT_CASES = {
    "split-d64-no-split": (2, 3, 1000, 64, 0.5, 5, ""),       # 48 items on 5 programs: 3 left, 5 // 3 = 1 part
    "split-d128-partial-tile": (1, 2, 900, 128, 0.6, 3, ""),   # 16 items on 3: 1 left, 3 parts; 4-row last tile
    "split-d64-dense": (1, 1, 1100, 64, 1.0, 7, "dense"),      # 9 items on 7: 2 left, 3 parts of 3 tiles
    "split-d64-empty-rows": (1, 3, 640, 64, 0.8, 7, "empty"),  # 15 items on 7: 1 left, 2 parts (Kmax 5)
}


# ---------------------------------------------------------------- child side (TRITON_INTERPRET=1)
def _run_split_case(name: str) -> dict:
    from helpers import random_plan, rel_err

    from videosparse.kernels import reference_attention
    from videosparse.kernels.tail_split import combine_parts, combine_parts_torch, tail_split, work_units
    from videosparse.plan import Plan, dense_plan, work_order

    B, H, S, D, density, programs, extra = SPLIT_CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    plan = dense_plan(B, H, S) if extra == "dense" else random_plan(B, H, S, 128, 128, density, seed=S)
    if extra == "empty":
        count = plan.kv_count.clone()
        count[:, :, ::2] = 0
        plan = Plan(plan.kv_index, count, 128, 128)
    Mq = plan.kv_count.shape[-1]
    order = work_order(plan.kv_count, programs)
    n_full, parts = tail_split(order.numel(), programs, plan.kv_index.shape[-1])
    item, lo, n, last, slot = work_units(order, plan.kv_count, n_full, parts)
    n_slots = int((slot >= 0).sum())
    o_part = torch.full((n_slots * 128, D), float("nan"))
    lse_part = torch.full((n_slots * 128,), float("nan"))
    covered = torch.zeros_like(plan.kv_index, dtype=torch.int64).view(B * H * Mq, -1)
    flat_index = plan.kv_index.view(B * H * Mq, -1)
    for it, start, cnt, sl in zip(item.tolist(), lo.tolist(), n.tolist(), slot.tolist()):
        covered[it, start:start + cnt] += 1
        if sl < 0:
            continue
        bh, mt = divmod(it, Mq)
        rows = slice(mt * 128, min(S, (mt + 1) * 128))
        qs = q.view(B * H, S, D)[bh, rows][None, None]
        ks, vs = (t.view(B * H, S, D)[bh][None, None] for t in (k, v))
        sub = Plan(flat_index[it, start:start + max(cnt, 1)].clone().view(1, 1, 1, -1),
                   torch.tensor([cnt], dtype=torch.int32).view(1, 1, 1), 128, 128)
        o, lse = reference_attention(qs, ks, vs, sub, D ** -0.5, return_lse=True)
        nr = o.shape[2]
        o_part[sl * 128:sl * 128 + nr] = o[0, 0]
        lse_part[sl * 128:sl * 128 + nr] = lse[0, 0]
    ref, ref_lse = reference_attention(q, k, v, plan, D ** -0.5, return_lse=True)
    res = {"parts": parts, "n_split": order.numel() - n_full, "units": int(item.numel())}
    for impl, fn in (("triton", combine_parts), ("torch", combine_parts_torch)):
        out, lse = ref.clone(), ref_lse.clone()
        split_items = order[n_full:].long()
        for it in split_items.tolist():
            bh, mt = divmod(it, Mq)
            out.view(B * H, S, D)[bh, mt * 128:(mt + 1) * 128] = float("nan")
            lse.view(B * H, S)[bh, mt * 128:(mt + 1) * 128] = float("nan")
        fn(o_part, lse_part, out, lse, order, n_full, parts, Mq)
        finite = torch.isfinite(ref_lse)
        res[impl] = {"rel_err": rel_err(out, ref),
                     "lse_err": float((lse - ref_lse)[finite].abs().max()),
                     "lse_inf_match": bool(torch.equal(torch.isinf(lse), ~finite))}
    valid = torch.arange(flat_index.shape[1]) < plan.kv_count.view(-1, 1)
    res["tiles_covered_once"] = bool(torch.equal(covered, valid.long()))
    res["chunks_once_per_item"] = bool(torch.equal(torch.bincount(item[last.bool()], minlength=B * H * Mq),
                                                   torch.ones(B * H * Mq, dtype=torch.long)))
    return res


def _run_prep_case(name: str) -> dict:
    from helpers import random_plan

    from videosparse.kernels._triton_utils import correction_inputs, correction_inputs_torch
    from videosparse.plan import Plan
    from videosparse.sol.centroids import tile_centroids_torch

    B, H, S, block, D, density, dtype, extra = PREP_CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    k, v = (torch.randn(B, H, S, D, generator=g).to(getattr(torch, dtype)) for _ in range(2))
    plan = random_plan(B, H, S, block, block, density, seed=S)
    if extra == "empty":
        count = plan.kv_count.clone()
        count[:, :, ::2] = 0
        plan = Plan(plan.kv_index, count, block, block)
    if extra.startswith("valid"):
        plan = plan.with_valid_keys(valid_keys_for(B, S))
    plan = plan.with_correction(*tile_centroids_torch(k, v, block))
    if extra == "valid-poisoned":
        poison_past_valid_keys(plan)
    Nk = math.ceil(S / block)
    got = correction_inputs(plan, Nk, block, k.dtype)
    want = correction_inputs_torch(plan, Nk, block, k.dtype)
    finite = torch.isfinite(want[2])
    return {
        "kmax": plan.kv_index.shape[-1],
        "shapes_ok": [tuple(a.shape) for a in got] == [tuple(b.shape) for b in want]
        and [a.dtype for a in got] == [b.dtype for b in want],
        # the interpreter rounds to bf16 by truncation: one unit in the last place
        "k_mean_rel": float((got[0].float() - want[0].float()).norm() / want[0].float().norm()),
        "v_mean_rel": float((got[1].float() - want[1].float()).norm() / want[1].float().norm()),
        "bias_inf_match": bool(torch.equal(torch.isinf(got[2]), ~finite)),
        "bias_max_err": float((got[2][finite] - want[2][finite]).abs().max()),
        "centroids_finite": bool(got[0].isfinite().all() and got[1].isfinite().all()),
    }


AUTO_ON_CPU = "auto-on-cpu"


def _run_auto_on_cpu_case() -> dict:
    """What `backend="auto"` picks for CPU inputs in a process with the interpreter on (a test or dev process):
    the torch reference, for a head dim the kernels take and one they would take zero-padded."""
    from videosparse.kernels import select_backend
    from videosparse.plan import dense_plan

    picks = {}
    for D in (64, 96):
        q = torch.randn(1, 2, 128, D)
        picks[str(D)] = select_backend(q, q, q, dense_plan(1, 2, 128, 64, 64)).name
    return {"picks": picks}


def _run_case(name: str) -> dict:
    if name == AUTO_ON_CPU:
        return _run_auto_on_cpu_case()
    if name in PREP_CASES:
        return _run_prep_case(name)
    if name in SPLIT_CASES:
        return _run_split_case(name)
    from helpers import random_plan, rel_err

    from videosparse.kernels import block_sparse_attention, reference_attention
    from videosparse.kernels.dispatch import get_backend, select_backend
    from videosparse.plan import Plan, dense_plan
    from videosparse.sol.centroids import tile_centroids_torch

    B, H, S, Sk, D, bm, bn, density, dtype, corr, kernel, extra = CASES[name]
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if extra == "strided":   # (B, S, H, D) storage seen as (B, H, S, D): non-contiguous
        q, k, v = (torch.randn(B, n, H, D, generator=g).to(dtype).transpose(1, 2) for n in (S, Sk, Sk))
    else:
        q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for n in (S, Sk, Sk))
    if extra.startswith("huge-"):   # ~4.5 / 6.4 GB of address space (not committed), a few pages of it touched
        row = 14_000_000 if extra == "huge-row-stride" else 20_000_000
        q = torch.empty((S - 1) * row + D, dtype=dtype).as_strided((B, H, S, D), (0, 0, row, 1)).copy_(q)
    if extra == "large-logits":
        q, k = q * 4, k * 4
    if extra == "dense":
        plan = dense_plan(B, H, S, bm, bn)
    else:
        plan = random_plan(B, H, S, bm, bn, density, seed=S + D, sk=Sk)
    if extra == "empty":     # some query tiles attend to no tile at all
        count = plan.kv_count.clone()
        count[:, :, ::2] = 0
        plan = Plan(plan.kv_index, count, bm, bn)
    if extra == "wide":      # more index columns than key tiles (a plan packed at a fixed width), junk past counts
        junk = torch.full((*plan.kv_count.shape, plan.kv_index.shape[-1] + 4), 7777, dtype=torch.int32)
        junk[..., :plan.kv_index.shape[-1]] = plan.kv_index
        plan = Plan(junk, plan.kv_count, bm, bn)
        assert plan.kv_index.shape[-1] > math.ceil(Sk / bn)
    if extra == "kmax0":     # no index columns at all (partial last key tile: its reads must stay in bounds)
        plan = Plan(plan.kv_index[..., :0].contiguous(), torch.zeros_like(plan.kv_count), bm, bn)
    if extra == "valid-past-keys":
        plan = plan.with_valid_keys(torch.tensor([Sk + 40, Sk + 3][:B], dtype=torch.int32))
    elif extra.startswith("valid"):
        plan = plan.with_valid_keys(valid_keys_for(B, Sk))
    if extra == "strided-plan":
        def strided(t):    # the same values, every other element of a buffer twice the size
            return torch.stack([t, torch.zeros_like(t)], -1)[..., 0]

        plan = plan.with_valid_keys(strided(valid_keys_for(B, Sk)))
        n = plan.kv_count.numel()
        plan = Plan(plan.kv_index, plan.kv_count, bm, bn, valid_keys=plan.valid_keys,
                    order=strided(torch.randperm(n, generator=g).to(torch.int32)))
        assert not plan.order.is_contiguous() and not plan.valid_keys.is_contiguous()
    if corr:
        plan = plan.with_correction(*tile_centroids_torch(k, v, bn))
    if extra == "valid-poisoned":
        # the generic kernel never loads keys past the limits; the Hopper kernels load whole tiles, where an inf
        # or NaN past the limit reaches P.V as 0 * inf (as in SDPA with a key mask): only its centroids poisoned
        if kernel == "generic":
            for b, limit in enumerate(plan.valid_keys.tolist()):
                k[b, :, limit:], v[b, :, limit:] = float("nan"), float("inf")
        poison_past_valid_keys(plan)
    scale = 1.0 / math.sqrt(D)
    poisoned = extra == "poisoned"
    unvalidated = poisoned or extra == "valid-past-keys"     # a plan validate() refuses, run all the same
    if poisoned:
        plan.validate(q, k, v)
        k[0, 1, :3], v[0, 1, :3], v[0, 1, 3] = float("inf"), float("-inf"), float("nan")
        q[0, 0, 5, 0] = float("nan")        # and one NaN query row of head (0, 0): NaN out and lse, as the reference
        if corr:
            plan.k_mean[0, 1, 0], plan.v_sum[0, 1, 0] = float("inf"), float("nan")
    if kernel == "generic":
        out, lse = block_sparse_attention(q, k, v, plan, scale=scale, return_lse=True, backend="triton",
                                          validate=not unvalidated)
        used = select_backend(q, k, v, plan, "triton").name
    else:   # the Hopper kernel's code path (TMA descriptors, persistent loop, centroid pass + merge)
        if not unvalidated:
            plan.validate(q, k, v)
        out, lse = get_backend("hopper")(q.contiguous(), k.contiguous(), v.contiguous(), plan, scale, True)
        used = "hopper"
    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), plan, scale, return_lse=True)
    same_prec = reference_attention(q, k, v, plan, scale)         # fp32 math, output rounded to dtype
    nan_row_kept = None
    if poisoned:
        out, lse, ref, ref_lse, same_prec = (t[:1, :1] for t in (out, lse, ref, ref_lse, same_prec))
        nan_row_kept = bool(lse[0, 0, 5].isnan() and ref_lse[0, 0, 5].isnan() and out[0, 0, 5].isnan().all())
        rows = torch.arange(S) != 5
        out, lse, ref, ref_lse, same_prec = (t[:, :, rows] for t in (out, lse, ref, ref_lse, same_prec))
    lse_err = (lse - ref_lse).abs()
    finite = torch.isfinite(ref_lse)
    return {
        "backend": used,
        "rel_err": rel_err(out, ref),
        "ref_rel_err": rel_err(same_prec, ref),
        "lse_err": float(lse_err[finite].max()) if finite.any() else 0.0,
        "lse_inf_match": bool(torch.equal(torch.isinf(lse), ~finite)),
        "empty_rows_zero": bool((out.float()[~finite.unsqueeze(-1).expand_as(out)] == 0).all()),
        "shape_ok": tuple(out.shape) == ((1, 1, S - 1) if poisoned else (B, H, S)) + (D,) and out.dtype == dtype,
        "nan_row_kept": nan_row_kept,
    }


def _child_main(names: list[str]) -> None:
    sys.path.insert(0, str(HERE.parent))
    interpreter_child(names, _run_case)


# ---------------------------------------------------------------- parent side (pytest)
INTERPRETER_CASES = InterpreterCases(__file__, [*CASES, *PREP_CASES, *SPLIT_CASES, AUTO_ON_CPU])


def _tolerance(dtype: str, ref_rel_err: float) -> float:
    if dtype == "float32":
        return 1e-5
    # ~2x the error of the same-precision torch computation; bf16 under the interpreter gets 3x
    # because the interpreter converts to bf16 by truncation (twice the rounding error)
    return (3.0 if dtype == "bfloat16" else 2.0) * ref_rel_err + 1e-4


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_matches_reference(interpreter_results, name):
    res = interpreter_results.get(name)
    assert res is not None, f"case {name} did not report"
    assert "error" not in res, res.get("error")
    D, dtype, kernel = CASES[name][4], CASES[name][8], CASES[name][10]
    pad = "" if D in (64, 128) else f"+pad{64 if D < 64 else 128}"
    assert res["backend"] == ("triton_generic" if kernel == "generic" else "hopper") + pad
    assert res["shape_ok"]
    assert res["rel_err"] <= _tolerance(dtype, res["ref_rel_err"]), res
    assert res["lse_err"] <= (1e-4 if dtype == "float32" else 2e-2), res
    assert res["lse_inf_match"] and res["empty_rows_zero"], res
    assert res["nan_row_kept"] in ((None,) if CASES[name][11] != "poisoned" else (True,)), res


@pytest.mark.parametrize("name", list(PREP_CASES))
def test_correction_inputs_kernel_matches_torch(interpreter_results, name):
    res = interpreter_results.get(name)
    assert res is not None, f"case {name} did not report"
    assert "error" not in res, res.get("error")
    assert res["shapes_ok"] and res["bias_inf_match"] and res["centroids_finite"], res
    tol = {"bfloat16": 1e-2, "float16": 1e-3, "float32": 1e-7}[PREP_CASES[name][6]]
    assert res["k_mean_rel"] <= tol and res["v_mean_rel"] <= tol, res
    assert res["bias_max_err"] <= 1e-6, res
    if name == "prep-b64-long-lists":
        assert res["kmax"] > 32, res


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_tail_split_parts_merge_to_the_whole_items(interpreter_results, name):
    """The work units of `tail_split` cover every listed tile of every item once (centroid chunks once per
    item), and their partial outputs, merged by the combine kernel (and its torch version), give the items'
    rows and LSE."""
    res = interpreter_results.get(name)
    assert res is not None, f"case {name} did not report"
    assert "error" not in res, res.get("error")
    assert res["tiles_covered_once"] and res["chunks_once_per_item"], res
    expected_parts = {"split-d64-no-split": 1, "split-d128-partial-tile": 3, "split-d64-dense": 3,
                      "split-d64-empty-rows": 2}[name]
    assert res["parts"] == expected_parts, res
    for impl in ("triton", "torch"):
        assert res[impl]["rel_err"] < 1e-5 and res[impl]["lse_err"] < 1e-4, res
        assert res[impl]["lse_inf_match"], res


def test_auto_on_cpu_takes_the_reference_even_with_the_interpreter_on(interpreter_results):
    """The interpreter is for tests: `backend="auto"` on CPU inputs stays on the torch reference in a process that
    has it on, padded head dims included (mutation testing: dropping either check survived, as the test below runs
    without the interpreter)."""
    res = interpreter_results.get(AUTO_ON_CPU)
    assert res is not None and "error" not in res, res
    assert res["picks"] == {"64": "reference", "96": "reference"}, res


def test_triton_on_cpu_without_interpreter_gives_reasons():
    pytest.importorskip("triton")
    from videosparse.kernels import block_sparse_attention
    from videosparse.kernels.triton_generic import INTERPRETED
    from videosparse.plan import dense_plan

    if INTERPRETED:
        pytest.skip("this pytest process itself runs with TRITON_INTERPRET=1")
    q = torch.randn(1, 2, 100, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        block_sparse_attention(q, q, q, dense_plan(1, 2, 100), backend="triton")
    # auto on CPU never picks a Triton backend
    out = block_sparse_attention(q.float(), q.float(), q.float(), dense_plan(1, 2, 100))
    assert out.shape == q.shape


def test_bad_plans_are_rejected_before_any_kernel():
    from videosparse.kernels import block_sparse_attention
    from videosparse.plan import Plan, dense_plan

    q = torch.randn(1, 2, 300, 64, dtype=torch.float16)
    good = dense_plan(1, 2, 300)
    bad_index = good.kv_index.clone()
    bad_index[0, 0, 0, 0] = 7                                  # out of range (3 key tiles)
    unsorted = good.kv_index.flip(-1).contiguous()
    cases = [
        Plan(bad_index, good.kv_count, 128, 128),
        Plan(unsorted, good.kv_count, 128, 128),
        Plan(good.kv_index, good.kv_count + 1, 128, 128),       # count > Kmax
        Plan(good.kv_index[:, :1], good.kv_count[:, :1], 128, 128),
        Plan(good.kv_index.long(), good.kv_count, 128, 128),
    ]
    for plan in cases:
        with pytest.raises(ValueError):
            block_sparse_attention(q, q, q, plan, backend="triton")
    # correction inputs given only in part (k_mean missing used to run silently without the correction)
    k_mean, v_sum, tile_len = (torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 64), torch.full((3,), 100))
    for partial, missing in ((dict(v_sum=v_sum, tile_len=tile_len), "'k_mean'"), (dict(k_mean=k_mean), "'v_sum'")):
        with pytest.raises(ValueError, match=f"k_mean, v_sum and tile_len together; .*{missing}"):
            block_sparse_attention(q, q, q, Plan(good.kv_index, good.kv_count, 128, 128, **partial))
    with pytest.raises(ValueError, match="kv_count is on meta, q is on cpu"):   # names the tensor that is elsewhere
        block_sparse_attention(q, q, q, Plan(good.kv_index, good.kv_count.to("meta"), 128, 128))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
