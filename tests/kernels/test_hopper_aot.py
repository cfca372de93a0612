"""Ahead-of-time compile of the Hopper kernel for sm_90 on CPU: warp specialization, TMA and wgmma must be in it.

Triton 3.6 drops warp specialization silently (num_warps=8, a run-time `if` or a second dot outside
the loop), so a change that loses it, TMA or wgmma fails here before it reaches a GPU.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

SHARED_LIMIT = 232448  # bytes of shared memory per block on sm_90

# (head_dim, dtype, block_m, block_n, centroids, mask_last, merge)
VARIANTS = {
    "d128-exact-partial": (128, "bf16", 128, 128, False, True, False),
    "d128-exact-full-merge": (128, "bf16", 128, 128, False, False, True),
    "d128-centroids": (128, "bf16", 128, 128, True, False, False),
    "d64-exact-partial-merge": (64, "bf16", 128, 128, False, True, True),
    "d64-centroids": (64, "bf16", 128, 128, True, False, False),
    "d128-fp16-b64": (128, "fp16", 64, 64, False, True, False),
}


@pytest.fixture(scope="module")
def hopper_module():
    from videosparse.kernels import triton_hopper

    if triton_hopper.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set in this process: kernels are interpreted, not compiled")
    return triton_hopper


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hopper_kernel_compiles_with_tma_wgmma_and_warp_specialization(hopper_module, name):
    d, dtype, bm, bn, centroids, mask_last, merge = VARIANTS[name]
    k = hopper_module.compile_for_sm90(head_dim=d, dtype=dtype, block_m=bm, block_n=bn, centroids=centroids,
                                       mask_last=mask_last, merge=merge)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    assert "ttg.warp_specialize" in ttgir, "warp specialization was dropped"
    assert k.metadata.num_warps > 4, "no producer/consumer warp groups were added"
    assert "wgmma.mma_async" in ptx, "no wgmma in the PTX"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads in the PTX"
    assert k.metadata.shared <= SHARED_LIMIT, f"shared memory {k.metadata.shared} > {SHARED_LIMIT}"


def test_aot_check_detects_lost_warp_specialization(hopper_module):
    """The same compile with warp specialization off must not pass the check above."""
    k = hopper_module.compile_for_sm90(head_dim=64, warp_specialize=False)
    assert "ttg.warp_specialize" not in k.asm["ttgir"]
