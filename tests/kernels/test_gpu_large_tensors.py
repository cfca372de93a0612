"""Tensors past 2**31 elements on a real GPU (marked `gpu`): every kernel of the sparse path keeps 64-bit offsets.

A long video at a large batch reaches this size (e.g. Wan 14B at 1080P with a batch of 3, 40 heads x 171,360 tokens x
128 x 3 = 2.6e9 elements per tensor). Each kernel runs on the whole tensor; its output for the first and the last
(batch, head) -- the last one's offsets lie past 2**31 elements -- is checked against torch on that slice alone.
"""

from __future__ import annotations

import pytest
import torch

from helpers import random_plan, rel_err

pytestmark = pytest.mark.gpu

B, H, D = 2, 64, 128
GRID = (25, 64, 82)                       # 131,200 tokens: B * H * S * D = 2.149e9 > 2**31
TILE = (4, 8, 4)                          # partial tiles along the frames and the width
SLICES = ((0, 0), (B - 1, H - 1))


@pytest.fixture(scope="module")
def large():
    from videosparse.layout import head_tiling

    if not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 60 * 2 ** 30:
        pytest.skip("needs a CUDA GPU with 60 GiB")
    layout = head_tiling(GRID, TILE, H)
    S = layout.seq_len
    assert B * H * S * D > 2 ** 31
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)   # (B, S, H, D) as the model has it
    angle = torch.rand(1, S, 1, D // 2, device="cuda", generator=g) * 6.3
    cos, sin = angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)  # Wan's tables
    return layout, x, (cos, sin)


def test_rope_gather_and_scatter_past_2_31_elements(large):
    from videosparse.rope import apply_rope

    layout, x, rope = large
    xt = layout.gather(x, rope)                                   # the fused RoPE + gather kernel
    perm = layout.first.indices("cuda")[0]
    for b, h in SLICES:
        ref = apply_rope(x[b:b + 1, :, h:h + 1].float(), rope)[0, :, 0][perm]
        assert rel_err(xt[b, h].float(), ref) < 1e-2
    back = layout.scatter(xt)
    for b, h in SLICES:
        assert rel_err(back[b, :, h].float(), apply_rope(x[b:b + 1, :, h:h + 1].float(), rope)[0, :, 0]) < 1e-2
    del xt, back


def test_pooling_kernels_past_2_31_elements(large):
    from videosparse.sol.centroids import tile_centroids, tile_centroids_torch
    from videosparse.veda.trippool import trippool_qk, trippool_torch

    layout, x, _ = large
    q = layout.gather(x)
    k = q.flip(-1).contiguous()
    qf, kf = trippool_qk(q, k, 128)
    k_mean, v_sum, tile_len = tile_centroids(k, q, 128)
    for b, h in SLICES:
        qs, ks = q[b:b + 1, h:h + 1], k[b:b + 1, h:h + 1]
        torch.testing.assert_close(qf[b, h], trippool_torch(qs, 128)[0, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kf[b, h], trippool_torch(ks, 128)[0, 0], rtol=1e-5, atol=1e-5)
        ref = tile_centroids_torch(ks, qs, 128)
        torch.testing.assert_close(k_mean[b, h], ref[0][0, 0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v_sum[b, h], ref[1][0, 0], rtol=1e-4, atol=1e-2)
        assert torch.equal(tile_len, ref[2])


@pytest.mark.parametrize("backend", ["auto", "triton_generic"])
@pytest.mark.parametrize("correction", [False, True])
def test_attention_kernels_past_2_31_elements(large, backend, correction):
    from videosparse.kernels import block_sparse_attention, reference_attention
    from videosparse.plan import Plan
    from videosparse.sol.centroids import tile_centroids

    layout, x, _ = large
    q = layout.gather(x)
    k, v = q.roll(1, dims=-1), q.flip(-1)
    S = q.shape[2]
    plan = random_plan(B, H, S, 128, 128, 0.01, seed=1, device="cuda")
    if correction:
        plan = plan.with_correction(*tile_centroids(k.contiguous(), v.contiguous(), 128))
    k, v = k.contiguous(), v.contiguous()
    out, lse = block_sparse_attention(q, k, v, plan, return_lse=True, backend=backend)
    for b, h in SLICES:
        part = Plan(plan.kv_index[b:b + 1, h:h + 1], plan.kv_count[b:b + 1, h:h + 1], 128, 128)
        if correction:
            part = part.with_correction(plan.k_mean[b:b + 1, h:h + 1], plan.v_sum[b:b + 1, h:h + 1], plan.tile_len)
        qs, ks, vs = (t[b:b + 1, h:h + 1] for t in (q, k, v))
        ref, ref_lse = reference_attention(qs, ks, vs, part, D ** -0.5, return_lse=True)
        assert rel_err(out[b:b + 1, h:h + 1], ref) < 1.2e-2
        assert float((lse[b, h] - ref_lse[0, 0]).abs().max()) < 2e-2


def test_a_strided_q_past_2_31_elements_in_one_head_on_the_generic_kernel(large):
    """The generic kernel takes q as the model has it ([B, S, H, D] seen as [B, H, S, D], what auto sends it: the
    Hopper kernels take contiguous inputs only). Its row offsets pass 2**31 once S * H * D does within one batch
    item; they were int32 and wrapped (review find, a segfault under the interpreter)."""
    from videosparse.kernels import block_sparse_attention, reference_attention
    from videosparse.plan import Plan

    _, x, _ = large
    q = x.view(1, -1, H, D).transpose(1, 2)               # [1, H, 2 S, D], row stride H * D
    S = q.shape[2]
    assert (S - 1) * q.stride(2) >= 2 ** 31 and not q.is_contiguous()
    k, v = q[:, :, : S // 4].contiguous(), q[:, :, S // 4: S // 2].flip(-1).contiguous()
    plan = random_plan(1, H, S, 128, 128, 0.05, seed=2, device="cuda", sk=S // 4)
    out = block_sparse_attention(q, k, v, plan, backend="triton_generic")
    h = H - 1
    rows = S - 256                                         # the last two query tiles: offsets past 2**31
    part = Plan(plan.kv_index[:, h:h + 1, -2:].contiguous(), plan.kv_count[:, h:h + 1, -2:].contiguous(), 128, 128)
    ref = reference_attention(q[:, h:h + 1, rows:], k[:, h:h + 1], v[:, h:h + 1], part, D ** -0.5)
    assert rel_err(out[:, h:h + 1, rows:], ref) < 1.2e-2
