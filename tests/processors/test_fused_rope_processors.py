"""The processors' RoPE fused into the tile-order gather, end to end on tiny models (CPU, Triton interpreter).

On CPU `rope_gather` runs only when forced (its "auto" backend is CUDA-only), so each case forces it (`backend=
"triton"`) for one tiny transformer per RoPE style and layout of rotated rows: HunyuanVideo (pairs on the video rows
before the text; a padded batch served item by item, whose padded text rows read the tile-order keys), HunyuanVideo
1.5, FramePack (the history rows moved behind the video with their tables), Motif-Video (its valid text rows moved
first), CogVideoX and EasyAnimate (pairs after the text), Cosmos (rotate-half), Wan (interleaved), Mochi (per-head
pairs; a padded batch, item by item) and Kandinsky 6 (its 2 x 2 rotations as pair angles shared by the heads;
Kandinsky 5's are the same table, taken only in bf16, the dtype its stock rounds to: see test_kandinsky.py) and
Allegro (rotate-half in each third of its head dim 96).
Density 1 must equal the stock forward; at density 0.5 the fused run must equal the same config with the torch
rotation (rope-then-gather).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from helpers import InterpreterCases, interpreter_child

# name: (test module, tester class, make_inputs kwargs)
CASES = {
    "hunyuan-padded-batch": ("test_hunyuan", "TestHunyuanProcessors", {"valid": (5, 8)}),
    "hunyuan15": ("test_hunyuan15", "TestHunyuanVideo15Processors", {}),
    "framepack": ("test_hunyuan_framepack", "TestHunyuanFramepackProcessors", {}),
    "motif": ("test_motif_video", "TestMotifVideoProcessors", {}),
    "cogvideox": ("test_cogvideox", "TestCogVideoXProcessors", {}),
    "easyanimate": ("test_easyanimate", "TestEasyAnimateMixedBlocksProcessors", {}),
    "cosmos": ("test_cosmos", "TestCosmosProcessors", {}),
    "wan": ("test_wan_processors", "TestWanProcessors", {}),
    "mochi-padded-batch": ("test_mochi", "TestMochiProcessors", {"valid": (5, 8)}),
    "kandinsky6": ("test_kandinsky6", "TestKandinsky6VideoOnly", {}),
    "allegro-d96": ("test_allegro", "TestAllegroProcessors", {}),
}


def _run_case(name: str) -> dict:
    import torch

    import videosparse
    import videosparse.layout as layout_module
    from videosparse.rope import rope_gather

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    module, cls, kwargs = CASES[name]
    tester = getattr(importlib.import_module(module), cls)()
    calls = []

    def forced(backend):
        def gather(x, perm, rope, **kw):
            calls.append(backend)
            return rope_gather(x, perm, rope, backend=backend, **kw)
        return gather

    def forward(config, backend):
        tr = tester.make_transformer()
        inputs = tester.make_inputs(tr, **kwargs)
        if config is None:
            return tester.run(tr, inputs)
        layout_module.rope_gather = forced(backend)
        try:
            videosparse.apply(tr, config)
            return tester.run(tr, inputs)
        finally:
            layout_module.rope_gather = rope_gather

    stock = forward(None, None)
    one = videosparse.VedaConfig(density=1.0, tiling=tester.tiling, block=tester.block)
    fused_one = forward(one, "triton")
    fused_calls = [calls.count("triton")]
    half = videosparse.VedaConfig(density=0.5, tiling=tester.tiling, block=tester.block)
    fused = forward(half, "triton")
    fused_calls.append(calls.count("triton") - fused_calls[0])
    unfused = forward(half, "torch")
    return {"fused_calls": fused_calls,
            "density_one_max_abs": float((fused_one - stock).abs().max()),
            "half_rel": float((fused - unfused).norm() / unfused.norm()),
            "half_changes": not torch.equal(fused, stock)}


INTERPRETER_CASES = InterpreterCases(__file__, list(CASES), timeout=900)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_rope_in_the_processor_equals_stock_rotation(interpreter_results, name):
    res = interpreter_results[name]
    assert "error" not in res, res.get("error")
    assert min(res["fused_calls"]) >= 2, res           # q and k of sparse calls went through the kernel, both runs
    assert res["density_one_max_abs"] <= 1e-5, res
    assert res["half_rel"] < 1e-5 and res["half_changes"], res


if __name__ == "__main__":
    interpreter_child(sys.argv[1:], _run_case)
