"""Triton kernel: account one sparse attention call in a layer's counters (`LayerStats.record_sparse`) in one
launch. The torch version takes seven small kernels, ~160 us of host time per call on the H200's host, which
adds up on models whose attention calls are short (LTX-Video: 6,144 tokens)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import COMPILE_OPTIONS, on_input_device

BLOCK = 1024


@triton.jit
def _record_kernel(KV_COUNT, COUNTS, n, pairs, BLOCK: tl.constexpr):
    # one program: counts += (1 call, 0, sum(kv_count), pairs, max(kv_count) * n)
    offs = tl.arange(0, BLOCK)
    kept = tl.zeros((), tl.int64)
    peak = tl.zeros((), tl.int32)
    for start in range(0, n, BLOCK):
        x = tl.load(KV_COUNT + start + offs, mask=start + offs < n, other=0)
        kept += tl.sum(x.to(tl.int64), 0)
        peak = tl.maximum(peak, tl.max(x, 0))
    tl.store(COUNTS, tl.load(COUNTS) + 1)
    tl.store(COUNTS + 2, tl.load(COUNTS + 2) + kept)
    tl.store(COUNTS + 3, tl.load(COUNTS + 3) + pairs)
    tl.store(COUNTS + 4, tl.load(COUNTS + 4) + peak.to(tl.int64) * n)


@on_input_device
def record_sparse_triton(counts: torch.Tensor, kv_count: torch.Tensor, num_key_tiles: int) -> None:
    """counts int64 [5] (see `LayerStats`) += one call of this int32 kv_count (any shape), in place."""
    n = kv_count.numel()
    _record_kernel[(1,)](kv_count.contiguous(), counts, n, n * num_key_tiles, BLOCK=BLOCK, num_warps=4,
                         **COMPILE_OPTIONS)
