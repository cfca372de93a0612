import pytest
import torch
from diffusers import WanTransformer3DModel

import videosparse
from videosparse.processors import sessions

from tester import RANDOM_GRID_TILINGS, ProcessorTesterMixin, check_any_grid


class TestWanProcessors(ProcessorTesterMixin):

    def make_transformer(self):
        torch.manual_seed(0)
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=self.head_dim, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=32, ffn_dim=64, num_layers=self.num_layers,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
        ).eval()

    def make_inputs(self, transformer):
        g = torch.Generator().manual_seed(1)
        # grid after patching: 3 x 7 x 9 = 189 tokens (odd, partial last tile)
        return dict(
            hidden_states=torch.randn(1, 4, 3, 14, 18, generator=g),
            timestep=torch.tensor([500]),
            encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
        )


def test_unknown_transformer_lists_supported():
    with pytest.raises(ValueError, match="WanTransformer3DModel"):
        videosparse.apply(torch.nn.Linear(2, 2), videosparse.DenseConfig())


def test_native_set_attn_processor_form():
    t = TestWanProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    ref = t.run(tr, inputs)
    tr.set_attn_processor(videosparse.processors(tr, videosparse.VedaConfig(density=1.0, tiling=(1, 4, 16), block=64)))
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-4 * ref.abs().max()
    videosparse.remove(tr)
    assert torch.equal(t.run(tr, inputs), ref)


def test_native_form_without_scheduler_warns_that_fractional_dense_steps_cannot_apply(caplog):
    import logging

    t = TestWanProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    tr.set_attn_processor(videosparse.processors(tr, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64,
                                                                            dense_steps=0.4)))
    with caplog.at_level(logging.WARNING, logger="videosparse"), torch.no_grad():
        tr(**inputs, return_dict=False)
        tr(**inputs, return_dict=False)
    assert sum("scheduler=pipe.scheduler" in r.message for r in caplog.records) == 1
    assert sessions(tr)["transformer"].stats()["dense_calls"] == 0
    videosparse.remove(tr)


def test_native_form_whose_dict_is_never_set_says_so_once(caplog):
    """User check of the docs: `videosparse.processors(tr, cfg)` without `set_attn_processor` runs stock, and the
    warning said the layers were "replaced after videosparse.apply, e.g. by fuse_qkv_projections()". It now says the
    dict was not set; a layer the user replaces after setting it still gets the other warning."""
    import logging

    t = TestWanProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    ref = t.run(tr, inputs)
    procs = videosparse.processors(tr, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=0))
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        assert torch.equal(t.run(tr, inputs), ref)
        t.run(tr, inputs)
    said = [r.message for r in caplog.records if "holds its processors" in r.message]
    assert len(said) == 1 and "none of the 2 self-attention layers" in said[0] and "set_attn_processor" in said[0]
    assert "fuse_qkv_projections" not in said[0]
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 0
    videosparse.remove(tr)

    caplog.clear()                          # set, then one layer set back by hand: the other warning, not this one
    procs = videosparse.processors(tr, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=0))
    originals = dict(sessions(tr)["transformer"].original_processors)
    tr.set_attn_processor(dict(procs))
    name = next(iter(videosparse.processors.self_attention_processors(tr)))
    tr.set_attn_processor({**tr.attn_processors, name: originals[name]})
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        t.run(tr, inputs)
    assert "1 of the 2 self-attention layers it serves hold other processors" in caplog.text
    assert "holds its processors" not in caplog.text
    videosparse.remove(tr)
    assert torch.equal(t.run(tr, inputs), ref)


def test_apply_remove_without_cache_context_leaves_module_dict_identical():
    t = TestWanProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    before = dict(tr.__dict__)
    with torch.no_grad():
        ref = tr(**inputs, return_dict=False)[0]
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64))
    with torch.no_grad():
        tr(**inputs, return_dict=False)
    videosparse.remove(tr)
    assert set(tr.__dict__) == set(before)
    with torch.no_grad():
        assert torch.equal(tr(**inputs, return_dict=False)[0], ref)


def test_remove_keeps_hooks_registered_after_apply():
    """A diffusers hook registered on top of videosparse's (e.g. a cache) keeps running after remove()."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Counter(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counter.calls += 1
            return args, kwargs

    t = TestWanProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64))
    HookRegistry.check_if_exists_or_initialize(tr).register_hook(Counter(), "user_counter")
    t.run(tr, inputs)
    videosparse.remove(tr)
    t.run(tr, inputs)
    assert Counter.calls == 2
    assert list(tr._diffusers_hook.hooks) == ["user_counter"]


def test_apply_and_remove_through_the_torch_compile_wrapper():
    """`torch.compile(transformer)` returns a wrapper: apply and remove act on the module inside it."""
    t = TestWanProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    ref = t.run(tr, inputs)
    compiled = torch.compile(tr, backend="eager")
    before = set(tr.__dict__)
    procs = dict(tr.attn_processors)
    videosparse.apply(compiled, videosparse.VedaConfig(density=1.0, tiling=(1, 4, 16), block=64))
    assert sessions(tr) and sessions(compiled)
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert set(videosparse.remove(compiled)) == {"transformer"}
    assert sessions(tr) == {} and set(tr.__dict__) == before
    assert all(tr.attn_processors[k] is v for k, v in procs.items())
    videosparse.apply(tr, videosparse.DenseConfig())                     # not "already applied"
    videosparse.remove(tr)
    torch._dynamo.reset()


def test_attention_backend_set_while_applied_stays_after_remove():
    t = TestWanProcessors()
    tr = t.make_transformer()
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64))
    tr.set_attention_backend("native")
    videosparse.remove(tr)
    backends = {name: str(p._attention_backend) for name, p in tr.attn_processors.items()}
    assert len(set(backends.values())) == 1 and "native" in next(iter(backends.values())).lower(), backends


def test_dense_layers_beyond_the_model_are_rejected():
    t = TestWanProcessors()
    tr = t.make_transformer()
    procs = dict(tr.attn_processors)
    with pytest.raises(ValueError, match=r"dense_layers=\(7,\) names layers \[7\].*2 self-attention layers"):
        videosparse.apply(tr, videosparse.VedaConfig(dense_layers=(7,)))
    assert sessions(tr) == {} and all(tr.attn_processors[k] is v for k, v in procs.items())


@pytest.mark.parametrize("seed", range(4))
def test_random_grids_and_tilings(seed):
    """Any frame count and resolution: a grid drawn per seed (1-6 frames, 1-13 x 1-13 patches, so tiles larger than
    the grid and partial last tiles), a 64-token tile shape and a method drawn with it. At density 1 the sparse
    forward equals the stock one; sparse, it runs finite and reports a density inside (0, 1]."""
    import random

    rng = random.Random(seed)
    frames, height, width = rng.randint(1, 6), 2 * rng.randint(1, 13), 2 * rng.randint(1, 13)
    tiling = rng.choice(RANDOM_GRID_TILINGS)
    t = TestWanProcessors()
    g = torch.Generator().manual_seed(seed)
    inputs = dict(hidden_states=torch.randn(1, 4, frames, height, width, generator=g), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 8, 16, generator=g))
    sparse = rng.choice([videosparse.VedaConfig(density=0.3, tiling=tiling, block=64, dense_steps=0,
                                                correction=rng.random() < 0.5),
                         videosparse.SolConfig(density=0.3, tiling=tiling, block=64, dense_steps=0)])
    check_any_grid(t, t.make_transformer(), inputs, tiling, sparse, label=(frames, height, width, tiling))


def _cuda_wan():
    """A 2-layer bf16 Wan transformer with head dim 128 on CUDA and its inputs (grid 5 x 15 x 17, partial tiles)."""
    torch.manual_seed(0)
    tr = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=256, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
    ).eval().to("cuda", torch.bfloat16)
    g = torch.Generator("cuda").manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 4, 5, 30, 34, generator=g, device="cuda", dtype=torch.bfloat16),
                  timestep=torch.tensor([500], device="cuda"),
                  encoder_hidden_states=torch.randn(1, 8, 16, generator=g, device="cuda", dtype=torch.bfloat16))
    return tr, inputs


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [(2, 4, 16), (4, 4, 8)])
def test_gpu_density_one_with_fused_rope_matches_stock(tiles):
    """On CUDA the sparse path fuses RoPE into the gather (Triton); at density 1 the forward equals the
    stock processor's up to bf16 rounding (the fused rotation rounds once, the stock one per op)."""
    tr, inputs = _cuda_wan()
    with torch.no_grad():
        ref = tr(**inputs, return_dict=False)[0].float()
        videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=tiles, dense_steps=0))
        out = tr(**inputs, return_dict=False)[0].float()
    videosparse.remove(tr)
    assert float((out - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.gpu
def test_gpu_sparse_forward_has_no_host_sync():
    """After the first forward (layouts, constants), a sparse forward never waits for the GPU: a sync per
    layer (e.g. a host list copied to the device) left the H200 idle ~1 ms per layer at Wan 1.3B."""
    import warnings

    tr, inputs = _cuda_wan()
    videosparse.apply(tr, videosparse.VedaConfig(density=0.2, dense_steps=0))
    with torch.no_grad():
        tr(**inputs)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                tr(**inputs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    videosparse.remove(tr)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()
             and "prototype" not in str(w.message).lower()]
    assert syncs == [], syncs


def test_processors_kept_after_remove_run_stock_also_after_a_checkpointed_backward():
    """`remove` marks the session removed: processors the user kept (the native form's dict, set again) run the stock
    attention, also after a gradient-checkpointed backward that recomputes a block after `remove` (mutation testing:
    a session left active, or made active again by the recompute, raised KeyError in the kept processors)."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    tr = build_tiny_wan_pipeline().transformer
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 4, 3, 32, 32, generator=g), timestep=torch.tensor([500]),
              encoder_hidden_states=torch.randn(1, 8, tr.config.text_dim, generator=g))
    with torch.no_grad():
        stock = tr(**kw).sample
    procs = videosparse.processors(tr, videosparse.VedaConfig(density=0.3, dense_steps=0, block=64))
    tr.set_attn_processor(dict(procs))
    with torch.no_grad():
        tr(**kw)
    session = sessions(tr)["transformer"]
    videosparse.remove(tr)
    assert not session.active
    tr.set_attn_processor(dict(procs))
    with torch.no_grad():
        assert torch.equal(tr(**kw).sample, stock)
    tr = build_tiny_wan_pipeline().transformer
    tr.enable_gradient_checkpointing(partial(checkpoint, use_reentrant=False))
    session = videosparse.apply(tr, videosparse.VedaConfig(density=0.3, dense_steps=0, block=64))["transformer"]
    kept = dict(videosparse.processors.attention_processors(tr))
    pred = tr(**kw).sample
    videosparse.remove(tr)
    pred.square().mean().backward()                # the blocks recomputed after remove
    assert not session.active
    tr.set_attn_processor(kept)
    with torch.no_grad():
        assert torch.equal(tr(**kw).sample, stock)


def test_a_sequence_that_does_not_fit_the_grid_runs_dense_and_says_why():
    """A call whose token count is not the grid's (plus text) cannot be laid out in tiles: it runs the dense path,
    recorded per layer, never a layout error (mutation testing: checking only longer sequences survived)."""
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline
    from videosparse.processors import attention_processors

    tr = build_tiny_wan_pipeline().transformer
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, block=64, dense_steps=0))
    session = sessions(tr)["transformer"]
    grid = (2, 8, 8)                                  # 128 video tokens
    session.context.grid, session.context.text_len = grid, 0
    session.prepare(grid, 0, torch.device("cpu"), torch.float32)
    proc = next(p for p in attention_processors(tr).values() if hasattr(p, "attend"))
    D, H = tr.config.attention_head_dim, tr.config.num_attention_heads
    g = torch.Generator().manual_seed(0)
    for seq in (120, 136):                            # 8 tokens short of the grid, 8 past it
        q, k, v = (torch.randn(1, seq, H, D, generator=g) for _ in range(3))
        assert torch.equal(proc.attend(q, k, v), proc._dense(q, k, v, None))
    fallbacks = session.stats()["layers"][0]["fallbacks"]
    assert any("sequence length 120 does not match grid (2, 8, 8)" in f for f in fallbacks), fallbacks
    assert any("sequence length 136 does not match grid (2, 8, 8)" in f for f in fallbacks), fallbacks


def test_the_forward_arguments_are_read_by_name_whatever_their_position():
    """Code review find: the grid functions read positional arguments at positions written in the code (about 45,
    matching diffusers 0.42.1), so a forward whose parameters diffusers reordered would be misread. The hook now
    names the positional arguments from the forward's signature first: a subclass whose forward takes the timestep
    first, called positionally, gets the grid of its hidden states and the output of a keyword call."""
    from videosparse.models import build_tiny_wan_pipeline
    from videosparse.processors.forward_args import args_by_name

    class TimestepFirst(WanTransformer3DModel):
        def forward(self, timestep, hidden_states, encoder_hidden_states, **kwargs):
            return super().forward(hidden_states, timestep, encoder_hidden_states, **kwargs)

    base = build_tiny_wan_pipeline().transformer
    model = TimestepFirst.from_config(base.config)
    model.load_state_dict(base.state_dict())
    videosparse.apply(model, videosparse.VedaConfig(density=0.5, block=64, tiling=(1, 8, 8), dense_steps=0))
    x, t, text = torch.randn(1, 4, 2, 16, 16), torch.tensor([500]), torch.randn(1, 8, 32)
    with torch.no_grad():
        positional = model(t, x, text).sample
        keywords = model(hidden_states=x, timestep=t, encoder_hidden_states=text).sample
    torch.testing.assert_close(positional, keywords, rtol=0, atol=0)
    assert sessions(model)["transformer"].context.grid == (2, 8, 8)
    assert args_by_name(TimestepFirst.forward, (t, x), {"return_dict": True}) == (
        (), {"timestep": t, "hidden_states": x, "return_dict": True})
    assert args_by_name(TimestepFirst.forward, (t, x, text, 7), {}) == ((7,), {"timestep": t, "hidden_states": x,
                                                                           "encoder_hidden_states": text})
