"""End to end: `videosparse.apply(pipe, SolConfig(block=64, density=0.2))` on the tiny offline Wan pipeline (CPU)."""

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

import videosparse  # noqa: E402
from videosparse.models.tiny_wan import build_tiny_wan_pipeline  # noqa: E402

# 13 frames of 256x384 -> latent grid (4, 16, 24) = 1536 tokens = 24 tiles of 64 (default (4, 4, 4) tiles)
KW = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=13, height=256, width=384,
          num_inference_steps=2, output_type="np", max_sequence_length=16)


def test_apply_sol_density_02_end_to_end():
    pipe = build_tiny_wan_pipeline()
    pipe.set_progress_bar_config(disable=True)
    handle = videosparse.apply(pipe, videosparse.SolConfig(block=64, density=0.2))
    try:
        frames = pipe(**KW, generator=torch.Generator().manual_seed(0)).frames
        session = handle["transformer"]
        stats = session.stats()
        calibrations = session.method.calibrations()
    finally:
        videosparse.remove(pipe)
    assert np.isfinite(frames).all() and frames.shape[:2] == (1, 13)
    assert stats["sparse_calls"] == 2 * 2 * 2 and stats["dense_calls"] == 0     # 2 layers, 2 steps, cond+uncond
    # one τ per layer, calibrated on its first call to ±0.01; later calls reuse it, so the realised
    # density over all calls follows the data but stays near the target
    assert len(calibrations) == 2
    assert all(abs(c["density"] - 0.2) <= 0.01 for c in calibrations.values())
    for layer in stats["layers"].values():
        assert abs(layer["density"] - 0.2) < 0.05 and layer["load_balance"] >= 1.0
    assert abs(stats["density"] - 0.2) < 0.05
