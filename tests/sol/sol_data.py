"""Synthetic attention inputs for the Sol tests (not a test module)."""

import torch


def structured_qkv(B: int, H: int, num_tiles: int, block: int, D: int, *, clusters: int = 6,
                   spread: float = 0.5, noise: float = 0.5, seed: int = 0):
    """q, k, v fp32 [B, H, num_tiles*block, D] in tile order with clustered keys and queries.

    Every key tile and every query tile belongs to one of `clusters` centres (drawn per batch and
    head, norm ~ spread * D**0.75); its tokens are the centre plus N(0, noise²) per channel. Queries
    therefore attend mostly to the key tiles of their own cluster, spread over the sequence.
    """
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(B, H, clusters, D, generator=g) * spread * D ** 0.25
    S = num_tiles * block

    def draw():
        cl = torch.randint(0, clusters, (B, H, num_tiles), generator=g)
        base = torch.gather(centres, 2, cl[..., None].expand(B, H, num_tiles, D)).repeat_interleave(block, 2)
        return base + noise * torch.randn(B, H, S, D, generator=g)

    k = draw()
    q = draw()
    v = torch.randn(B, H, S, D, generator=g)
    return q, k, v
