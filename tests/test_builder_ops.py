"""Plan-builder custom ops (TripPool, tile statistics, centroids): schema/fake checks and equality with torch."""

import torch

from videosparse.sol.centroids import (tile_centroids_op, tile_centroids_torch, tile_means_torch, tile_stats,
                                       tile_stats_op)
from videosparse.veda.trippool import trippool_qk, trippool_qk_op, trippool_torch


def test_opcheck_builder_ops():
    q, k, v = (torch.randn(2, 3, 300, 64) for _ in range(3))
    torch.library.opcheck(trippool_qk_op, (q, k, 64, 4))
    torch.library.opcheck(tile_stats_op, (q, k, v, 64))
    torch.library.opcheck(tile_centroids_op, (k, v, 128))


def test_auto_path_equals_torch_and_compiles_fullgraph():
    q, k, v = (torch.randn(1, 2, 333, 64) for _ in range(3))

    def f(q, k, v):
        return (*trippool_qk(q, k, 128), *tile_stats(q, k, v, 128))

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    ref = (trippool_torch(q, 128), trippool_torch(k, 128), tile_means_torch(q, 128), *tile_centroids_torch(k, v, 128))
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
