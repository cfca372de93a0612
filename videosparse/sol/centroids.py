"""Per key tile: mean key, value sum and real length (inputs of Sol routing and the zero-order correction)."""

from __future__ import annotations

import math

import torch


def tile_centroids_torch(k: torch.Tensor, v: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centroids of key tiles in tile order.

    Args:
        k, v: [B, H, S, D] in tile order (any float dtype).
        block_n: tokens per key tile.

    Returns:
        k_mean fp32 [B, H, Nk, D], v_sum fp32 [B, H, Nk, D], tile_len int32 [Nk] (on k's device);
        the last tile may be partial and is averaged over its real tokens only.
    """
    B, H, S, D = k.shape
    Nk = math.ceil(S / block_n)
    pad = Nk * block_n - S
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(B, H, Nk, block_n, D)
    vp = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(B, H, Nk, block_n, D)
    tile_len = torch.full((Nk,), block_n, dtype=torch.int32, device=k.device)
    tile_len[-1] = S - (Nk - 1) * block_n
    k_mean = kp.sum(3, dtype=torch.float32) / tile_len[:, None].float()
    v_sum = vp.sum(3, dtype=torch.float32)
    return k_mean, v_sum, tile_len
