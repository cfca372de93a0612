"""videosparse next to diffusers' own transformer hooks on the tiny Wan pipeline: the step caches
(FirstBlockCache, PyramidAttentionBroadcast, TaylorSeer, MagCache), group offloading and layerwise casting.

Whichever is applied first gives the same video; the caches still skip blocks on top of the sparse processors;
our step count (dense first step) is not shifted by them; `remove()` takes out videosparse only, the diffusers
hook keeps working. (FasterCache is left out: with Wan's separate cond / uncond calls it fails without videosparse
too, in diffusers' own hook.)
"""

import numpy as np
import pytest
import torch
from diffusers.hooks import (
    FirstBlockCacheConfig,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    TaylorSeerCacheConfig,
)

import videosparse
from videosparse.models.tiny_wan import build_tiny_wan_pipeline

STEPS = 4
KW = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=5, height=64, width=96,
          num_inference_steps=STEPS, output_type="np", max_sequence_length=16)
LAYERS, BRANCHES = 2, 2
ALL_CALLS = LAYERS * BRANCHES * STEPS      # attn1 calls of a run without any cache
DENSE_CALLS = LAYERS * BRANCHES            # dense_steps=1: the first step of both branches


def _pab(pipe):
    pipe.transformer.enable_cache(PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(0, 1000),
        current_timestep_callback=lambda: pipe.current_timestep))


HOOKS = {
    # name -> (set-up on a pipeline, whether it skips attention calls in this run)
    "first_block_cache": (lambda p: p.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2)), True),
    "pyramid_attention_broadcast": (_pab, True),
    "taylorseer_lite": (lambda p: p.transformer.enable_cache(TaylorSeerCacheConfig(
        cache_interval=2, disable_cache_before_step=1, use_lite_mode=True)), True),
    "mag_cache": (lambda p: p.transformer.enable_cache(MagCacheConfig(
        threshold=0.06, num_inference_steps=STEPS, mag_ratios=[1.0, 0.9, 0.95, 0.9])), True),
    "group_offloading": (lambda p: p.transformer.enable_group_offload(
        onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1), False),
    "layerwise_casting": (lambda p: p.transformer.enable_layerwise_casting(
        storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32), False),
}


def _pipe():
    pipe = build_tiny_wan_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe):
    return pipe(**KW, generator=torch.Generator().manual_seed(0)).frames


def _config():
    return videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1)


@pytest.mark.parametrize("name", list(HOOKS))
def test_sparse_attention_with_diffusers_hook(name):
    setup, skips = HOOKS[name]
    hook_first = _pipe()
    setup(hook_first)
    ref = _run(hook_first)                                      # the diffusers hook alone
    session = videosparse.apply(hook_first, _config())["transformer"]
    out = _run(hook_first)
    stats = session.stats()

    ours_first = _pipe()
    videosparse.apply(ours_first, _config())
    setup(ours_first)
    assert np.array_equal(_run(ours_first), out)                # the order of the two does not matter

    assert stats["dense_calls"] == DENSE_CALLS                  # the hook does not shift our step count
    assert stats["sparse_calls"] > 0 and not np.array_equal(out, ref)
    if skips:                                                   # the cache still skips work on top of ours
        assert stats["sparse_calls"] + stats["dense_calls"] < ALL_CALLS
    else:
        assert stats["sparse_calls"] + stats["dense_calls"] == ALL_CALLS

    for pipe in (hook_first, ours_first):                       # remove() leaves the diffusers hook in place
        videosparse.remove(pipe)
        assert np.array_equal(_run(pipe), ref)


def test_remove_keeps_model_cpu_offload_enabled_after_apply(monkeypatch):
    """apply -> enable_model_cpu_offload -> remove: accelerate's hook, which wraps the forward videosparse's hook
    registry installed, keeps running; the removed context hook never runs again, not even after diffusers'
    `remove_all_hooks` puts accelerate's saved forward back, and apply / remove still work on top."""
    pipe = _pipe()
    tr = pipe.transformer
    reference = _run(pipe)
    session = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, dense_steps=1))["transformer"]
    pipe.enable_model_cpu_offload(device="cpu")
    offload_calls = []                 # each pipeline call sets up new hooks (maybe_free_model_hooks): count by class
    hook_cls, pre = type(tr._hf_hook), type(tr._hf_hook).pre_forward
    monkeypatch.setattr(hook_cls, "pre_forward", lambda self, module, *a, **k: (
        offload_calls.append(module is tr), pre(self, module, *a, **k))[1])
    sparse = _run(pipe)
    videosparse.remove(pipe)
    seen, calls = len(offload_calls), session.calls
    np.testing.assert_array_equal(_run(pipe), reference)       # dense again, through the offload hook
    assert any(offload_calls[seen:]) and session.calls == calls and not videosparse.sessions(pipe)
    again = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, dense_steps=1))["transformer"]
    np.testing.assert_array_equal(_run(pipe), sparse)
    videosparse.remove(pipe)
    pipe.remove_all_hooks()
    np.testing.assert_array_equal(_run(pipe), reference)
    assert session.calls == calls and again.calls > 0 and "_old_forward" not in vars(tr)


def test_model_cpu_offload_before_apply_keeps_the_context_hook_across_calls():
    """enable_model_cpu_offload() before apply (the usual order): diffusers removes and re-adds the offload hooks after
    every pipeline call, which put back the forward accelerate saved before apply and dropped the context hook from
    the second call on (no dense first step, the previous call's grid). The hook sits inside the offload hook now:
    every call counts its steps and grid, and gives what the same config gives without offloading."""
    plain = _pipe()
    videosparse.apply(plain, videosparse.VedaConfig(density=0.5, dense_steps=1))
    sizes = [dict(height=64, width=96), dict(height=96, width=64)]
    want = [plain(**{**KW, **size}, generator=torch.Generator().manual_seed(0)).frames for size in sizes]
    pipe = _pipe()
    pipe.enable_model_cpu_offload(device="cpu")
    session = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, dense_steps=1))["transformer"]
    for size, frames in zip(sizes, want):
        calls, dense = session.calls, session.stats()["dense_calls"]
        np.testing.assert_array_equal(pipe(**{**KW, **size}, generator=torch.Generator().manual_seed(0)).frames, frames)
        assert session.calls - calls == BRANCHES * STEPS and session.stats()["dense_calls"] - dense == DENSE_CALLS
    videosparse.remove(pipe)
    calls = session.calls
    np.testing.assert_array_equal(_run(pipe), _run(_pipe()))
    assert session.calls == calls


def test_remove_under_a_hook_registered_after_the_offload_hook():
    """apply -> offload -> a root hook of diffusers' registry (as SeaCache / TaylorSeer register) -> remove: the
    removed context hook does not run again, the offload hook still does, the output is dense again."""
    from diffusers.hooks import HookRegistry, ModelHook

    pipe = _pipe()
    reference = _run(pipe)
    session = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, dense_steps=1))["transformer"]
    pipe.enable_model_cpu_offload(device="cpu")
    HookRegistry.check_if_exists_or_initialize(pipe.transformer).register_hook(ModelHook(), "user_root_hook")
    _run(pipe)
    videosparse.remove(pipe)
    calls = session.calls
    np.testing.assert_array_equal(_run(pipe), reference)
    np.testing.assert_array_equal(_run(pipe), reference)
    assert session.calls == calls and getattr(pipe.transformer, "_hf_hook", None) is not None


@pytest.mark.parametrize("hook_inside_offload", [False, True])
def test_a_root_hook_between_offload_and_apply_comes_off_without_recursion(hook_inside_offload):
    """offload -> a root hook of the registry (SeaCache, FasterCache register one) -> apply -> that hook removed
    (disable_cache): every later call recursed (review find: the context hook, placed inside accelerate's forward, was
    listed after the root hook, so removing it pointed ours at accelerate's forward, which calls ours), and so did
    the calls after remove. With the root hook registered before the offload it sits inside accelerate's forward too,
    and the context hook goes after it."""
    from diffusers.hooks import HookRegistry, ModelHook

    reference = _run(_pipe())
    pipe = _pipe()
    if not hook_inside_offload:
        pipe.enable_model_cpu_offload(device="cpu")
    registry = HookRegistry.check_if_exists_or_initialize(pipe.transformer)
    registry.register_hook(ModelHook(), "user_root_hook")
    if hook_inside_offload:
        pipe.enable_model_cpu_offload(device="cpu")
    session = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, dense_steps=1))["transformer"]
    assert registry._hook_order == (["user_root_hook", "videosparse_context"] if hook_inside_offload else
                                    ["videosparse_context", "user_root_hook"])
    registry.remove_hook("user_root_hook")
    calls = session.calls
    _run(pipe)
    assert session.calls - calls == BRANCHES * STEPS
    videosparse.remove(pipe)
    np.testing.assert_array_equal(_run(pipe), reference)
    assert session.calls - calls == BRANCHES * STEPS and getattr(pipe.transformer, "_hf_hook", None) is not None


def test_a_root_hook_removed_just_before_remove_leaves_the_stock_forward():
    """A root hook (a cache) -> apply -> that hook removed -> remove, with no forward in between: diffusers' remove_hook
    points our link's forward past the removed hook, and our own removal then put back the forward saved at apply,
    the removed hook's wrapper (review find of the lock change: the context hook's new_forward keeps the wrapped
    forward as the link's original_forward). The transformer runs stock, and its registry is empty."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Doubling(ModelHook):
        def post_forward(self, module, output):
            return (output[0] * 2,) + tuple(output[1:])

    transformer = build_tiny_wan_pipeline().transformer
    stock = _forward(transformer)
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    registry.register_hook(Doubling(), "user_root_hook")
    assert torch.equal(_forward(transformer), stock * 2)
    videosparse.apply(transformer, videosparse.DenseConfig())
    registry.remove_hook("user_root_hook")
    videosparse.remove(transformer)
    assert torch.equal(_forward(transformer), stock) and transformer._diffusers_hook._hook_order == []


def test_remove_under_a_hook_with_its_own_forward_leaves_nothing_once_that_hook_goes():
    """apply -> a hook with its own new_forward (FasterCache's denoiser hook) -> remove -> disable_cache: the
    transformer's forward is its own method again, as without videosparse (review find: the hook kept our pass-through
    link as its original_forward, so a dead wrapper stayed on forward, one more per apply / remove)."""
    from diffusers import FasterCacheConfig

    def faster_cache():
        return FasterCacheConfig(current_timestep_callback=lambda: 500, spatial_attention_block_skip_range=2,
                                 spatial_attention_timestep_skip_range=(-1, 681))

    transformer = build_tiny_wan_pipeline().transformer
    for _ in range(2):
        videosparse.apply(transformer, videosparse.DenseConfig())
        transformer.enable_cache(faster_cache())
        videosparse.remove(transformer)
        transformer.disable_cache()
        forward = transformer.__dict__.get("forward")
        assert forward is None or getattr(forward, "__func__", None) is type(transformer).forward, forward
        assert transformer._diffusers_hook._hook_order == []


def _forward(transformer):
    g = torch.Generator().manual_seed(1)
    latents, text = torch.randn(1, 4, 5, 32, 32, generator=g), torch.randn(1, 8, 32, generator=g)
    with torch.no_grad():
        return transformer(hidden_states=latents, timestep=torch.tensor([500]), encoder_hidden_states=text)[0]


@pytest.fixture
def stock_wan_layer_skip(monkeypatch):
    """diffusers registers the layer-skip metadata of Wan's deprecated `WanAttnProcessor2_0` only (0.42), not of the
    `WanAttnProcessor` its blocks hold: register that too, as a user must (or a later diffusers does)."""
    from diffusers.hooks._helpers import AttentionProcessorRegistry
    from diffusers.models.transformers import transformer_wan

    metadata = AttentionProcessorRegistry.get(transformer_wan.WanAttnProcessor2_0)
    monkeypatch.setitem(AttentionProcessorRegistry._registry, transformer_wan.WanAttnProcessor, metadata)


@pytest.mark.parametrize("skip", ["scores", "attention", "block"])
@pytest.mark.parametrize("skip_first", [True, False])
def test_layer_skip_hook_acts_on_sparse_layers(stock_wan_layer_skip, skip, skip_first):
    """diffusers' layer skip (what skip-layer and perturbed-attention guidance put on their layers) does to
    videosparse's layers what it does to the stock ones, registered before or after `apply`: skipping the attention
    scores returns the values (the layer served by the stock processor, counted dense with its reason; before the
    fix the sparse path ignored the skip, 0.24 off, and a skip registered after apply raised "not registered")."""
    from diffusers.hooks import LayerSkipConfig, apply_layer_skip

    def skip_config():
        return LayerSkipConfig(indices=[0], skip_attention=skip != "scores", skip_attention_scores=skip == "scores",
                               skip_ff=skip == "block")

    stock = _pipe().transformer
    plain = _forward(stock)
    apply_layer_skip(stock, skip_config())
    ref = _forward(stock)
    assert (ref - plain).abs().max() > 0.05                     # the skip changes this model's output

    transformer = _pipe().transformer
    if skip_first:
        apply_layer_skip(transformer, skip_config())
    session = videosparse.apply(transformer, videosparse.VedaConfig(density=1.0, tiling=(1, 4, 16), block=64,
                                                                    dense_steps=0))["transformer"]
    if not skip_first:
        apply_layer_skip(transformer, skip_config())
    torch.testing.assert_close(_forward(transformer), ref, rtol=0, atol=1e-5)
    stats = session.stats()["layers"]
    if skip == "scores":                                        # layer 0 ran the stock processor, layer 1 sparse
        assert stats[0]["dense_calls"] == 1 and stats[0]["sparse_calls"] == 0
        assert any("layer-skip" in reason for reason in stats[0]["fallbacks"])
    else:                                                       # the hook returns the input, no attention runs
        assert stats[0]["dense_calls"] == stats[0]["sparse_calls"] == 0
    assert stats[1]["sparse_calls"] == 1

    videosparse.remove(transformer)
    torch.testing.assert_close(_forward(transformer), ref, rtol=0, atol=0)


def test_layer_skip_on_an_unregistered_stock_processor_fails_as_stock_does():
    """Where diffusers has no layer-skip metadata for the stock processor, registering the skip on the applied
    model fails as on the stock one, naming the stock class (not videosparse's)."""
    from diffusers.hooks import LayerSkipConfig, apply_layer_skip
    from diffusers.hooks._helpers import AttentionProcessorRegistry
    from diffusers.models.transformers import transformer_wan

    if transformer_wan.WanAttnProcessor in AttentionProcessorRegistry._registry:
        pytest.skip("this diffusers registers WanAttnProcessor")
    config = LayerSkipConfig(indices=[0], skip_attention=False, skip_attention_scores=True, skip_ff=False)
    with pytest.raises(ValueError, match="WanAttnProcessor'> not registered") as stock_error:
        apply_layer_skip(_pipe().transformer, config)
    transformer = _pipe().transformer
    videosparse.apply(transformer, _config())
    with pytest.raises(ValueError) as ours:
        apply_layer_skip(transformer, config)
    assert str(ours.value) == str(stock_error.value)


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16])
def test_layerwise_casting_to_16_bit_storage_attends_in_its_compute_dtype(storage):
    """Review 55: with 16-bit storage and fp32 compute, the dtype the kernel was chosen for was the storage dtype (the
    Linear weights' between calls) while q, k, v came in fp32: on CUDA the probe passed for bf16 and every sparse call
    fell through to the torch reference. The hook's compute dtype is the one attention sees."""
    import videosparse.processors.base as base

    seen = []
    kernel = base.block_sparse_attention

    def spy(q, *args, **kwargs):
        seen.append(q.dtype)
        return kernel(q, *args, **kwargs)

    pipe = _pipe()
    pipe.transformer.enable_layerwise_casting(storage_dtype=storage, compute_dtype=torch.float32)
    session = videosparse.apply(pipe, _config())["transformer"]
    base.block_sparse_attention = spy
    try:
        pipe(**{**KW, "num_inference_steps": 2}, generator=torch.Generator().manual_seed(0))
    finally:
        base.block_sparse_attention = kernel
    assert set(seen) == {torch.float32}
    assert session.attention_dtype_for(torch.float32, "cpu") == torch.float32
    videosparse.remove(pipe)
