"""The one backend choice of the helper kernels (`videosparse._helper_backend`) and the config backend they follow."""

import pytest
import torch

from videosparse.config import VedaConfig


def test_both_methods_map_the_config_backend_to_the_helper_kernels_alike():
    """Sol mapped backend "triton" to "triton" for its centroid kernel while Veda mapped it to "auto" for TripPool
    and the correction's centroids; both now follow `helper_backend`: a "triton" config runs the helper kernels in
    Triton too, or says why it cannot (as the attention kernel does)."""
    from videosparse._helper_backend import helper_backend
    from videosparse.method import ModelInfo
    from videosparse.veda.method import VedaMethod

    assert [helper_backend(b) for b in ("auto", "triton", "reference", "hopper", "triton_generic")] == \
        ["auto", "triton", "torch", "auto", "auto"]
    info = ModelInfo("WanTransformer3DModel", num_layers=2, num_heads=2, head_dim=64, patch_size=(1, 2, 2))
    assert VedaMethod(VedaConfig(backend="triton"), info)._kernel_backend == "triton"
    assert VedaMethod(VedaConfig(backend="reference"), info)._kernel_backend == "torch"


def test_the_helper_kernels_share_one_backend_choice():
    """TripPool, the teacher, the centroids and the fused RoPE gather each had their own auto/triton/torch logic
    (with different errors); they share `use_triton` now: an unknown backend and a "triton" that cannot run name
    the reasons, "auto" falls back to torch."""
    import os

    from videosparse._helper_backend import use_triton
    from videosparse.rope import rope_gather
    from videosparse.sol.centroids import tile_centroids
    from videosparse.veda.trippool import trippool_qk

    x = torch.randn(1, 2, 130, 64)
    with pytest.raises(ValueError, match=r"backend='cuda' is not supported for TripPool; choose one of \('auto'"):
        trippool_qk(x, x, 64, backend="cuda")
    assert not use_triton(x, "auto", what="x") and not use_triton(x, "torch", what="x")
    with pytest.raises(ValueError, match=r"cannot run x here: .*head dim 6; use 'auto' or 'torch' there"):
        use_triton(x, "triton", ["head dim 6"], what="x")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available():
        for call in (lambda: trippool_qk(x, x, 64, backend="triton"),
                     lambda: tile_centroids(x, x, 64, backend="triton"),
                     lambda: rope_gather(x.transpose(1, 2), torch.arange(130), (x, x), backend="triton")):
            with pytest.raises(ValueError, match="backend='triton' cannot run .* the Triton kernels need a CUDA GPU"):
                call()
