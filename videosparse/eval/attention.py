"""Attention-level quality: on sampled (step, layer) calls, the method's output vs exact dense attention.

`AttentionProbe` is an observer for `videosparse.processors.observe`: for a selected self-attention
call it takes the very q, k, v the processor is about to use, builds the method's plan for them
(the same `method.plan` the processor calls; Veda and Sol are deterministic, and Sol's calibrated
τ is cached after its first call, so the processor gets the same plan), runs the sparse kernel, and
compares with exact attention computed in fp32:

* relative L2 error ``||O_sparse - O_dense|| / ||O_dense||`` per head and over the call;
* tile recall vs the oracle: per query-tile row, the fraction of the plan's tiles that are among
  the same number of tiles with the largest true attention mass (see `metrics.tile_recall`);
* attention mass on the kept tiles, for the plan and for the oracle; the realised density.

Calls the processor runs dense (dense steps and layers of the schedule, and inputs or devices no kernel serves:
`AttentionRecord.dense_reason`) are recorded with `sparse: False`, their `dense_reason` and zero error. Only the
first call of every (step, layer) is measured (the first CFG branch).
"""

from __future__ import annotations

import logging
import math
from typing import Iterable

import torch

from ..kernels import block_sparse_attention
from ..layout import head_tiling
from ..processors.session import attention_dtype
from .metrics import dense_attention_tile_mass, relative_l2, tile_recall

logger = logging.getLogger("videosparse")


def spread_steps(num_steps: int, count: int = 3) -> list[int]:
    """`count` denoising steps spread evenly over [0, num_steps - 1] (first and last included)."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1.")
    count = max(1, min(count, num_steps))
    if count == 1:
        return [num_steps - 1]
    return sorted({round(i * (num_steps - 1) / (count - 1)) for i in range(count)})


class AttentionProbe:
    """Observer that measures sampled self-attention calls of one `SparseSession`.

    Args:
        session: the `SparseSession` of the transformer (from `videosparse.apply`).
        steps: denoising steps to measure (None = every step).
        layers: self-attention layer indices to measure (None = every layer).
        max_elements: bound on the attention probabilities held at once by the fp32 reference.

    Attributes:
        entries: one dict per measured call: step, layer, branch, sparse, rel_l2, rel_l2_per_head,
            recall, mass_kept, oracle_mass_kept, density, tokens (and dense_reason for calls run dense).
    """

    def __init__(self, session, steps: Iterable[int] | None = None, layers: Iterable[int] | None = None,
                 max_elements: int = 1 << 27) -> None:
        self.session = session
        self.steps = set(steps) if steps is not None else None
        self.layers = set(layers) if layers is not None else None
        self.max_elements = max_elements
        self.entries: list[dict] = []
        self._seen: set[tuple] = set()

    @torch.no_grad()
    def __call__(self, record) -> None:
        step, layer = record.step, record.layer
        if self.steps is not None and step not in self.steps:
            return
        if self.layers is not None and layer not in self.layers:
            return
        if (step, layer) in self._seen or record.grid is None:
            return
        self._seen.add((step, layer))
        B, S, H, D = record.q.shape
        entry = {"step": step, "layer": layer, "branch": record.branch, "tokens": S}
        if record.dense_reason is not None:         # what the processor does with this call (stats() counts it)
            entry.update(sparse=False, dense_reason=record.dense_reason, rel_l2=0.0, rel_l2_per_head=[0.0] * H,
                         recall=1.0, mass_kept=1.0, oracle_mass_kept=1.0, density=1.0)
            self.entries.append(entry)
            return
        method = self.session.method
        layout = head_tiling(record.grid, method.tile_shapes(layer, H), H, method.block, record.text_len,
                             record.text_position or "after", record.text_slot)
        qt, kt, vt = layout.gather(record.q), layout.gather(record.k), layout.gather(record.v)
        dtype = attention_dtype(qt.dtype, qt.device)                # what the processor attends in (autocast)
        qt, kt, vt = qt.to(dtype), kt.to(dtype), vt.to(dtype)
        plan = method.plan(qt, kt, vt, layout, layer)
        sparse = block_sparse_attention(qt, kt, vt, plan, backend=self.session.config.backend, validate=False)
        dense, mass = dense_attention_tile_mass(qt, kt, vt, plan.block_m, plan.block_n,
                                                scale=1.0 / math.sqrt(D), max_elements=self.max_elements)
        per_head = relative_l2(sparse, dense).mean(0)                                   # [H]
        total = float(((sparse.float() - dense).pow(2).sum(dtype=torch.float64)
                       / dense.pow(2).sum(dtype=torch.float64).clamp_min(1e-300)).sqrt())
        entry.update(sparse=True, rel_l2=total, rel_l2_per_head=[float(x) for x in per_head],
                     **tile_recall(plan, mass))
        logger.debug("probe step %s layer %d: rel L2 %.4f, recall %.3f, density %.3f",
                     step, layer, total, entry["recall"], entry["density"])
        self.entries.append(entry)
