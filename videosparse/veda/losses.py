"""Distillation loss and tile recall of the Veda estimator.

Loss (Veda): for every query-tile row, KL(teacher row normalised || softmax(estimator logits)) over
the key tiles; empty/pad columns are masked on both sides, rows whose teacher mass is zero (or that
are marked invalid) are skipped; the mean runs over valid rows, then over heads (and batch).

Recall: the fraction of the oracle's kept tiles (top-k of the teacher heat at the target density,
diagonal forced, exactly as `topk_plan` selects at inference) that the estimator's top-k also keeps.
Heat recall weighs each tile by its teacher heat: a miss whose heat ties the oracle's last pick costs
nearly nothing there, where tile recall counts it whole. `oracle_near_ties` measures how often that
happens: on attention whose rows are flat near the budget, tile recall is bounded well below 1 by
how little it takes to reorder the oracle, not by the estimator alone.
"""

from __future__ import annotations

import torch

from ..plan import topk_plan


def tile_kl_loss(logits: torch.Tensor, heat: torch.Tensor, *, col_valid: torch.Tensor | None = None,
                 row_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Row-wise KL(teacher || estimator), mean over valid rows, then heads and batch.

    Args:
        logits: fp32 [B, H, M, N] estimator logits.
        heat: [B, H, M, N] teacher heat (>= 0; any scale per row, it is normalised here).
        col_valid: optional bool broadcastable to [B, H, M, N] (e.g. [B, 1, 1, N]): False for empty/pad
            key tiles, excluded from both distributions.
        row_valid: optional bool broadcastable to [B, H, M]: False for pad query tiles.

    Returns:
        fp32 scalar. Rows whose teacher mass is zero count as invalid; a (batch, head) with no valid
        row is left out of the mean (zero if nothing is valid at all).
    """
    if logits.shape != heat.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and heat {tuple(heat.shape)} must have the same shape [B, H, M, N].")
    logits = logits.float()
    p = heat.float().clamp_min(0)
    if col_valid is not None:
        col_valid = col_valid.expand_as(p)
        p = p.masked_fill(~col_valid, 0.0)
        logits = logits.masked_fill(~col_valid, float("-inf"))
    mass = p.sum(-1)                                                       # [B, H, M]
    valid = mass > 0
    if row_valid is not None:
        valid = valid & row_valid.expand_as(valid)
    p = p / mass.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    log_q = torch.log_softmax(logits.masked_fill(~valid[..., None], 0.0), -1)
    pos = p > 0
    terms = torch.where(pos, p * (torch.log(p.clamp_min(1e-38)) - log_q), torch.zeros_like(p))
    kl = terms.sum(-1)                                                     # [B, H, M]
    kl = torch.where(valid, kl, torch.zeros_like(kl))
    rows = valid.sum(-1)                                                   # [B, H]
    per_head = kl.sum(-1) / rows.clamp_min(1)
    has = rows > 0
    if not bool(has.any()):     # 0 that keeps the graph (masked columns hold -inf: -inf * 0 would be NaN)
        return logits.masked_fill(~torch.isfinite(logits), 0.0).sum() * 0.0
    return per_head[has].mean()


@torch.no_grad()
def tile_recall(scores: torch.Tensor, heat: torch.Tensor, density: float) -> dict[str, float]:
    """Recall of the estimator's top-k tiles against the oracle's (teacher's) top-k.

    Args:
        scores: [B, H, M, M] estimator logits over video tiles.
        heat: [B, H, M, M] teacher heat over the same tiles.
        density: fraction of key tiles kept per row (the diagonal is forced and counted).

    Returns:
        {"recall": kept-tile recall including the forced diagonal (what the kernel runs),
         "recall_offdiag": recall over the off-diagonal oracle tiles only,
         "heat_recall": teacher heat summed over the estimator's kept tiles / over the oracle's (<= 1),
         "heat_recall_offdiag": the same over off-diagonal tiles}. Off-diagonal values are NaN when the
        oracle keeps no off-diagonal tile (or those hold no heat).
    """
    M = scores.shape[-1]
    est = topk_plan(scores.float(), density).to_dense_mask(M)
    ora = topk_plan(heat.float(), density).to_dense_mask(M)
    off = ~torch.eye(M, dtype=torch.bool, device=scores.device)
    h = heat.float().clamp_min(0)

    def ratio(num: torch.Tensor, den: torch.Tensor) -> float:
        num, den = float(num), float(den)
        return num / den if den > 0 else float("nan")

    return {"recall": ratio((est & ora).sum(), ora.sum()) if bool(ora.any()) else 0.0,
            "recall_offdiag": ratio((est & ora & off).sum(), (ora & off).sum()),
            "heat_recall": ratio((h * est).sum(), (h * ora).sum()),
            "heat_recall_offdiag": ratio((h * (est & off)).sum(), (h * (ora & off)).sum())}


@torch.no_grad()
def oracle_near_ties(heat: torch.Tensor, density: float, within: float = 0.1) -> float:
    """Fraction of query-tile rows whose best skipped tile is within `within` of the weakest kept one.

    The oracle is the teacher's top-k at `density` (diagonal forced, as `tile_recall`); the comparison
    runs over off-diagonal tiles only: heat(best skipped) >= (1 - within) * heat(weakest kept off-diagonal).
    In such a row a small change of the scores swaps a kept tile for a skipped one at almost no cost
    in heat, so a high fraction caps what tile recall can show.

    Args:
        heat: [B, H, M, M] teacher heat over video tiles.
        density: fraction of key tiles kept per row.
        within: relative margin, in [0, 1).

    Returns:
        The fraction over rows that keep at least one off-diagonal tile and skip at least one
        (NaN if there is none).
    """
    if not 0.0 <= within < 1.0:
        raise ValueError(f"within={within!r}: expected a relative margin in [0, 1).")
    M = heat.shape[-1]
    h = heat.float()
    kept = topk_plan(h, density).to_dense_mask(M)
    off = ~torch.eye(M, dtype=torch.bool, device=h.device)
    kept_off, skipped = kept & off, ~kept
    rows = kept_off.any(-1) & skipped.any(-1)
    if not bool(rows.any()):
        return float("nan")
    weakest = h.masked_fill(~kept_off, float("inf")).amin(-1)
    best_skipped = h.masked_fill(~skipped, float("-inf")).amax(-1)
    tie = best_skipped >= (1.0 - within) * weakest
    return float(tie[rows].float().mean())
