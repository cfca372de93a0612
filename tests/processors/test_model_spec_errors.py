"""Errors of the per-model registry name what was passed and what to pass instead."""

import pytest
import torch

import videosparse
from videosparse.models.tiny_wan import build_tiny_wan_pipeline


def test_a_pipeline_given_for_a_transformer_says_what_to_pass():
    pipe = build_tiny_wan_pipeline()
    with pytest.raises(ValueError, match=r"WanPipeline is a pipeline.*pipe\.transformer.*videosparse\.apply\(pipe"):
        videosparse.processors(pipe, videosparse.VedaConfig())
    assert videosparse.processors(pipe.transformer, videosparse.DenseConfig())
    videosparse.remove(pipe.transformer)


def test_an_unknown_module_lists_the_supported_transformers():
    with pytest.raises(ValueError, match=r"class Linear is not supported; supported: .*WanTransformer3DModel"):
        videosparse.processors(torch.nn.Linear(2, 2), videosparse.VedaConfig())


def test_a_model_registered_before_any_lookup_leaves_the_built_in_ones():
    """Review find: register_model before the first lookup kept the built-in models from ever loading (every stock
    transformer was "not supported"). In a fresh process: the registry's state is the process's."""
    import subprocess
    import sys

    code = """
import torch
from diffusers import WanTransformer3DModel
from videosparse.processors import register_model
from videosparse.processors.registry import ModelSpec, model_spec
from videosparse.processors.wan import WanSparseAttnProcessor, wan_grid

class Mine(torch.nn.Module):
    pass

spec = ModelSpec(WanSparseAttnProcessor, lambda n, m: n.endswith("attn1"), wan_grid)
register_model(Mine, lambda: spec)
assert model_spec(Mine()) is spec
tr = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=16, num_layers=1, in_channels=4, out_channels=4,
                           text_dim=8, freq_dim=8, ffn_dim=16, rope_max_seq_len=32)
assert model_spec(tr).processor_cls.__name__ == "WanSparseAttnProcessor"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_failed_built_in_registration_is_tried_again(monkeypatch):
    """Review find: the registry marked the built-ins loaded before their import ran, so one failed import left
    every later lookup with an empty list of supported models."""
    from videosparse.processors import registry

    calls = []

    def failing():
        calls.append(1)
        raise ImportError("a diffusers without these classes")

    monkeypatch.setattr(registry, "_BUILTINS_LOADED", [False])
    real = registry._register_builtin_models
    monkeypatch.setattr(registry, "_register_builtin_models", failing)
    for _ in range(2):
        with pytest.raises(ImportError, match="without these classes"):
            registry._load_builtins()
    assert len(calls) == 2 and registry._BUILTINS_LOADED == [False]
    monkeypatch.setattr(registry, "_register_builtin_models", real)     # the real one registers through
    registry._load_builtins()                                           # register_model: no deadlock on the lock
    assert registry._BUILTINS_LOADED == [True]


def test_a_subclass_of_a_supported_transformer_is_served_as_its_parent():
    """Mutation find: `register_model` promises that subclasses are served (the lookup walks the class's MRO); a
    lookup of the exact class only called `class MyWan(WanTransformer3DModel)` "not supported", and no test noticed."""
    from diffusers import WanTransformer3DModel

    from videosparse.processors.wan import WanSparseAttnProcessor

    class MyWan(WanTransformer3DModel):
        pass

    tr = MyWan(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=8, freq_dim=8,
               ffn_dim=8, num_layers=2)
    procs = videosparse.processors(tr, videosparse.DenseConfig())
    try:
        served = {name: type(p) for name, p in procs.items() if name.endswith("attn1.processor")}
        assert list(served.values()) == [WanSparseAttnProcessor] * 2
        assert videosparse.sessions(tr)["transformer"].info.model_class == "MyWan"
    finally:
        videosparse.remove(tr)


@pytest.mark.parametrize("patch_size_t, patch", [(None, (1, 2, 2)), (2, (2, 2, 2))])
def test_the_reported_patch_takes_the_temporal_patch_of_an_int_patch_config(patch_size_t, patch):
    """Mutation find: the model info (written as `patch_size` to evaluate's report, and read by the methods) took
    the temporal patch as 1 for configs with an int `patch_size` and a `patch_size_t` (CogVideoX 1.5: 2 x 2 x 2)."""
    from diffusers import CogVideoXTransformer3DModel

    tr = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=32,
        text_embed_dim=16, num_layers=1, sample_width=36, sample_height=14, sample_frames=9, patch_size=2,
        patch_size_t=patch_size_t, max_text_seq_length=8, use_rotary_positional_embeddings=True)
    videosparse.processors(tr, videosparse.DenseConfig())
    try:
        assert videosparse.sessions(tr)["transformer"].info.patch_size == patch
    finally:
        videosparse.remove(tr)
