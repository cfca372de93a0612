"""Teacher tile scores that the Veda estimator is distilled from.

For query tile i and key tile j (tile order, `block` tokens each):

    heat[i, j] = max over rows r in i, keys c in j of exp(q_r . k_c * scale - lse_r)

with lse_r the natural-log row log-sum-exp of the dense attention over *all* keys: the largest
attention probability that any query of tile i gives to any key of tile j. It takes one QK pass and
no P.V. On CUDA a fused Triton kernel computes it (with the LSE as a QK-only first pass when none is
given); elsewhere a chunked torch path that never holds more than a few query tiles' logit rows.
"""

from __future__ import annotations

import math

import torch

from ..validation import check_block
from .trippool import _use_triton


def teacher_num_tiles(S: int, Sk: int, block: int, num_tiles: int | None) -> int:
    """Tiles scored per side: `num_tiles`, or all tiles both sides have; ValueError outside [1, that] (or for a
    block that is not a positive int)."""
    check_block("block", block)
    limit = min(math.ceil(S / block), math.ceil(Sk / block))
    n = limit if num_tiles is None else int(num_tiles)
    if not 0 < n <= limit:
        raise ValueError(f"num_tiles={num_tiles} must lie in [1, {limit}].")
    return n


def teacher_heat_torch(q: torch.Tensor, k: torch.Tensor, block: int, *, lse: torch.Tensor | None = None,
                       scale: float | None = None, num_tiles: int | None = None,
                       max_chunk_elems: int = 1 << 25) -> torch.Tensor:
    """Chunked torch teacher (reference and CPU path).

    Args:
        q: [B, H, S, D]; k: [B, H, Sk, D], in tile order, any float dtype.
        block: tokens per query and key tile; the last tile may be partial.
        lse: optional fp32 [B, H, S] row LSE of the dense attention (natural log); when None it is
            computed from the same logit rows (exactly, over all Sk keys).
        scale: softmax scale, default 1/sqrt(D).
        num_tiles: heat over the first `num_tiles` query and key tiles only (default all).
        max_chunk_elems: bound on the logit elements held at once (B*H*rows*Sk).

    Returns:
        fp32 [B, H, n, n] in [0, 1].
    """
    B, H, S, D = q.shape
    Sk = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    n = teacher_num_tiles(S, Sk, block, num_tiles)
    if lse is not None and tuple(lse.shape) != (B, H, S):
        raise ValueError(f"lse has shape {tuple(lse.shape)}; expected ({B}, {H}, {S}).")
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    kc = k.detach().to(cd)
    ncols = min(n * block, Sk)
    tiles_per_chunk = max(1, max_chunk_elems // max(1, B * H * block * Sk))
    heat = torch.empty(B, H, n, n, dtype=torch.float32, device=q.device)
    nfull = ncols // block                                  # key tiles with `block` real keys
    for i0 in range(0, n, tiles_per_chunk):
        i1 = min(n, i0 + tiles_per_chunk)
        r0, r1 = i0 * block, min(S, i1 * block)
        s = (q[:, :, r0:r1].detach().to(cd) @ kc.transpose(-1, -2)) * scale        # [B, H, r, Sk]
        row_lse = torch.logsumexp(s, -1) if lse is None else lse[:, :, r0:r1].to(cd)
        rows = r1 - r0
        colmax = s[..., : nfull * block].view(B, H, rows, nfull, block).amax(-1)    # [B, H, r, nfull]
        if nfull < n:                                                               # partial last key tile
            colmax = torch.cat([colmax, s[..., nfull * block : ncols].amax(-1, keepdim=True)], -1)
        colmax = colmax - row_lse[..., None]
        row_pad = (i1 - i0) * block - rows
        colmax = torch.nn.functional.pad(colmax, (0, 0, 0, row_pad), value=float("-inf"))
        heat[:, :, i0:i1] = colmax.view(B, H, i1 - i0, block, n).amax(3).exp().float()
    return heat


def dense_lse_torch(q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
                    max_chunk_elems: int = 1 << 25) -> torch.Tensor:
    """Row log-sum-exp of dense attention logits (QK only, chunked over query rows).

    Args:
        q: [B, H, S, D]; k: [B, H, Sk, D]; any float dtype, any token order.
        scale: softmax scale, default 1/sqrt(D).

    Returns:
        fp32 [B, H, S] natural-log LSE (the same as the dense attention's).
    """
    B, H, S, D = q.shape
    Sk = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    kc = k.detach().to(cd)
    rows = max(1, max_chunk_elems // max(1, B * H * Sk))
    out = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    for r0 in range(0, S, rows):
        r1 = min(S, r0 + rows)
        out[:, :, r0:r1] = torch.logsumexp((q[:, :, r0:r1].detach().to(cd) @ kc.transpose(-1, -2)) * scale, -1).float()
    return out


def teacher_heat(q: torch.Tensor, k: torch.Tensor, block: int, *, lse: torch.Tensor | None = None,
                 scale: float | None = None, num_tiles: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Teacher tile scores heat[i, j] = max over the tile pair of exp(q.k*scale - lse_row).

    Args:
        q: [B, H, S, D]; k: [B, H, Sk, D] in tile order (fp32/fp16/bf16).
        block: tokens per tile.
        lse: optional fp32 [B, H, S] natural-log row LSE of the dense attention over all keys, e.g.
            from `block_sparse_attention(q, k, v, dense_plan(...), return_lse=True)`; computed in
            the same pass when None.
        scale: softmax scale, default 1/sqrt(D).
        num_tiles: heat over the first `num_tiles` tiles only (the video tiles); LSE over all keys.
        backend: "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch".

    Returns:
        fp32 [B, H, n, n] with values in [0, 1].

    Example:
        >>> import torch
        >>> from videosparse.veda.teacher import teacher_heat
        >>> q = k = torch.randn(1, 2, 300, 64)
        >>> teacher_heat(q, k, 128).shape
        torch.Size([1, 2, 3, 3])
    """
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must be (B, H, S, D) and (B, H, Sk, D); got {tuple(q.shape)} and {tuple(k.shape)}.")
    if _use_triton(q, block, backend, "the teacher heat") and (backend == "triton"
                                                                or q.shape[-1] in (16, 32, 64, 128, 256)):
        from .triton_kernels import teacher_heat_triton

        return teacher_heat_triton(q.detach(), k.detach(), block, lse=lse, scale=scale, num_tiles=num_tiles)
    return teacher_heat_torch(q, k, block, lse=lse, scale=scale, num_tiles=num_tiles)
