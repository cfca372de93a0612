import numpy as np
import torch

import videosparse
from videosparse.models.tiny_wan import build_tiny_wan_pipeline

KW = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=5, height=64, width=96,
          num_inference_steps=3, output_type="np", max_sequence_length=16)


def _run(pipe):
    return pipe(**KW, generator=torch.Generator().manual_seed(0)).frames


def test_pipeline_apply_remove_bit_identical_and_steps_seen():
    pipe = build_tiny_wan_pipeline()
    pipe.set_progress_bar_config(disable=True)
    ref = _run(pipe)
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1))
    steps = []
    with videosparse.processors.observe(pipe, lambda r: steps.append((r.step, r.branch))):
        sparse = _run(pipe)
    assert {s for s, _ in steps} == {0, 1, 2} and {b for _, b in steps} == {"cond", "uncond"}
    stats = handle["transformer"].stats()
    assert stats["transformer_calls"] == 6
    assert stats["dense_calls"] == 2 * 2 and stats["sparse_calls"] == 2 * 2 * 2   # 2 layers, cond+uncond
    assert stats["kernel_backend"] == "reference"      # what the sparse calls ran on (auto, CPU)
    assert not np.array_equal(sparse, ref)
    videosparse.remove(pipe)
    assert np.array_equal(_run(pipe), ref)


def test_step_index_from_scheduler_when_pipeline_gives_none():
    pipe = build_tiny_wan_pipeline()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=2))
    pipe.scheduler.set_timesteps(4)
    session = handle["transformer"]
    tr = pipe.transformer
    x = torch.randn(1, 4, 2, 16, 24)
    text = torch.randn(1, 8, 32)
    with torch.no_grad():
        for t in pipe.scheduler.timesteps:
            tr(hidden_states=x, timestep=t[None], encoder_hidden_states=text)
    layers = session.stats()["layers"]
    assert all(s["dense_calls"] == 2 and s["sparse_calls"] == 2 for s in layers.values())
