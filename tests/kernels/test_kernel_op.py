"""The custom op that makes block-sparse attention one opaque node under torch.compile."""

import torch

from videosparse.kernels import block_sparse_attention
from videosparse.kernels.ops import block_sparse_attention_op
from videosparse.sol.centroids import tile_centroids_torch

from helpers import random_plan, rel_err


def test_opcheck_with_and_without_correction():
    q, k, v = (torch.randn(2, 3, 300, 64) for _ in range(3))
    p = random_plan(2, 3, 300, 64, 64, 0.3, seed=4)
    base = (q, k, v, p.kv_index, p.kv_count, 64, 64)
    torch.library.opcheck(block_sparse_attention_op, (*base, None, None, None, None, 0.125, "reference"))
    torch.library.opcheck(block_sparse_attention_op, (*base, *tile_centroids_torch(k, v, 64), None, 0.125,
                                                      "reference"))
    order = torch.randperm(p.kv_count.numel()).to(torch.int32)      # any permutation of the rows
    torch.library.opcheck(block_sparse_attention_op, (*base, None, None, None, order, 0.125, "reference"))


def test_fullgraph_compile_matches_eager():
    q, k, v = (torch.randn(1, 2, 333, 64) for _ in range(3))
    p = random_plan(1, 2, 333, 128, 128, 0.5, seed=5)
    p = p.with_correction(*tile_centroids_torch(k, v, 128))

    def f(q, k, v):
        return block_sparse_attention(q, k, v, p, return_lse=True, validate=False)

    out, lse = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    ref, ref_lse = f(q, k, v)
    assert rel_err(out, ref) == 0.0 and torch.equal(lse, ref_lse)
