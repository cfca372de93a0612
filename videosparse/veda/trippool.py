"""TripPool: per-tile [mean | max | min] features of q or k in tile order."""

from __future__ import annotations

import math

import torch


def trippool_torch(x: torch.Tensor, block: int, num_tiles: int | None = None) -> torch.Tensor:
    """Pool every tile of x into [mean | max | min].

    Args:
        x: [B, H, S, D] in tile order, any float dtype.
        block: tokens per tile; the last tile may be partial (pooled over its real tokens).
        num_tiles: pool only the first `num_tiles` tiles (e.g. the video tiles); default all.

    Returns:
        fp32 [B, H, N, 3*D].
    """
    B, H, S, D = x.shape
    N = math.ceil(S / block)
    pad = N * block - S
    xp = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).view(B, H, N, block, D)
    n = num_tiles if num_tiles is not None else N
    xp = xp[:, :, :n]
    lens = torch.full((n,), block, dtype=torch.float32, device=x.device)
    real = torch.ones(n, block, dtype=torch.bool, device=x.device)
    if n == N and pad:
        lens[-1] = block - pad
        real[-1, block - pad :] = False
    mask = real[None, None, :, :, None]
    mean = xp.sum(3) / lens[:, None]
    mx = xp.masked_fill(~mask, float("-inf")).amax(3)
    mn = xp.masked_fill(~mask, float("inf")).amin(3)
    return torch.cat([mean, mx, mn], -1)
