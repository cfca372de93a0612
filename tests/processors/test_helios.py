"""Helios (HeliosTransformer3DModel): the blocks' attn1 over [long; mid; short history; video] served, the history as
global tiles before the video (keys scaled as in stock with `is_amplify_history`); attn2 stock; masked calls stock."""

import logging
import sys
import types

import pytest
import torch
from diffusers import HeliosTransformer3DModel
from diffusers.models.transformers.transformer_helios import HeliosAttnProcessor
from tester import (
    ProcessorTesterMixin,
    assert_runs_stock_with_one_warning,
    check_blocks_attn1_served,
    check_extra_tokens_served_as_global_tiles,
)

import videosparse
from videosparse.processors import attention_processors, observe, sessions
from videosparse.processors.helios import HeliosSparseAttnProcessor, helios_grid

LATENT = (6, 14, 20)           # latent frames x height x width -> patches 6 x 7 x 10 = 420 tokens, a partial last tile
GRID = (6, 7, 10)
# history as the forward patches it: short 1 frame (1 x 7 x 10 = 70 tokens), mid 2 frames padded to whole
# (2, 4, 4) latents (1 x 4 x 5 = 20), long 4 frames padded to whole (4, 8, 8) latents (1 x 2 x 3 = 6)
HISTORY = 70 + 20 + 6
SERVED = ["blocks.0.attn1.processor", "blocks.1.attn1.processor"]


def tiny_helios(**kwargs):
    """A tiny HeliosTransformer3DModel shaped like Helios (patch (1, 2, 2), the three history patch embeddings, text
    cross-attention on the video only): 2 heads of 64 (RoPE axes (16, 24, 24)), history key amplification per head."""
    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
                  text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2, rope_dim=(16, 24, 24), is_amplify_history=True)
    config.update(kwargs)
    torch.manual_seed(0)
    return HeliosTransformer3DModel(**config).eval()


def helios_inputs(batch=1, history=True, seed=1):
    """As HeliosPipeline calls its transformer: the chunk's latents, the text states, and the long / mid / short
    history latents with their frame indices (long history first, the chunk last)."""
    g = torch.Generator().manual_seed(seed)
    T, H, W = LATENT
    inputs = dict(hidden_states=torch.randn(batch, 4, T, H, W, generator=g), timestep=torch.tensor([500] * batch),
                  encoder_hidden_states=torch.randn(batch, 8, 16, generator=g))
    if history:
        long, mid, short, chunk = (i[None].expand(batch, -1) for i in torch.arange(4 + 2 + 1 + T).split([4, 2, 1, T]))
        inputs.update(indices_hidden_states=chunk, indices_latents_history_short=short,
                      indices_latents_history_mid=mid, indices_latents_history_long=long,
                      latents_history_short=torch.randn(batch, 4, 1, H, W, generator=g),
                      latents_history_mid=torch.randn(batch, 4, 2, H, W, generator=g),
                      latents_history_long=torch.randn(batch, 4, 4, H, W, generator=g))
    return inputs


class TestHeliosProcessors(ProcessorTesterMixin):
    """Helios with all three history parts: 420 video tokens after 96 history tokens."""

    def make_transformer(self):
        return tiny_helios()

    def make_inputs(self, transformer):
        return helios_inputs()


def _tiny():
    t = TestHeliosProcessors()
    return t, t.make_transformer()


def test_serves_only_the_blocks_attn1():
    """blocks.<i>.attn1 is replaced, attn2 (text cross-attention) keeps its processor object; one forward runs sparse
    on every served layer with the history as extra tokens before the video."""
    tr, before, records, _, _ = check_blocks_attn1_served(TestHeliosProcessors(), HeliosAttnProcessor, SERVED)
    after = attention_processors(tr)
    assert all(type(after[n]) is HeliosSparseAttnProcessor for n in SERVED)
    assert sorted(n for n in before if n not in SERVED) == ["blocks.0.attn2.processor", "blocks.1.attn2.processor"]
    assert [(r.layer, r.grid, r.text_len, r.text_position) for r in records] == [
        (i, GRID, HISTORY, "before") for i in range(2)]


def test_sequence_layout_history_before_the_video(monkeypatch):
    """What every stock attn1 call sees: [history; video] with the video's token count as `original_context_length`
    and the video's RoPE table last (time-major, at the chunk's frame indices); the grid function reports the chunk's
    grid and the history tokens."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr)
    calls = []
    stock = HeliosAttnProcessor.__call__

    def spy(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
            original_context_length=None):
        if encoder_hidden_states is None:
            calls.append((hidden_states.shape[1], original_context_length, attention_mask, rotary_emb))
        return stock(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb,
                     original_context_length)

    monkeypatch.setattr(HeliosAttnProcessor, "__call__", spy)
    t.run(tr, inputs)
    video = GRID[0] * GRID[1] * GRID[2]
    assert [c[:3] for c in calls] == [(HISTORY + video, video, None)] * 2
    table = tr.rope(inputs["indices_hidden_states"], GRID[1], GRID[2], "cpu").flatten(2).transpose(1, 2)
    assert torch.equal(calls[0][3][:, -video:], table)
    assert helios_grid(tr, (), inputs) == (GRID, HISTORY)
    assert helios_grid(tr, (), helios_inputs(history=False)) == (GRID, 0)


def test_history_served_as_global_tiles_before_the_video(caplog):
    t, tr = _tiny()
    check_extra_tokens_served_as_global_tiles(t, tr, t.make_inputs(tr), GRID, HISTORY, "before", caplog)


@pytest.mark.parametrize("config", [dict(is_amplify_history=False), dict(history_scale_mode="scalar")])
def test_history_key_scale_variants_equal_stock_at_density_one(config):
    """Without history amplification, and with one scalar scale: density 1 equals stock, both with and without history
    (the first call of a pipeline-free user)."""
    t = TestHeliosProcessors()
    tr = tiny_helios(**config)
    with torch.no_grad():
        for block in tr.blocks:
            if config.get("is_amplify_history", True):
                block.attn1.history_key_scale.fill_(-0.5)
    for inputs in (helios_inputs(), helios_inputs(history=False)):
        ref = t.run(tr, inputs)
        videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
        assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5
        assert sessions(tr)["transformer"].stats()["sparse_calls"] == 2
        videosparse.remove(tr)


def test_history_keys_are_scaled():
    """The amplification reaches the output (so the equality tests above cover it): a different scale changes the
    stock output, and the sparse processor follows it."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr)
    ref = t.run(tr, inputs)
    with torch.no_grad():
        tr.blocks[0].attn1.history_key_scale.fill_(-3.0)
    changed = t.run(tr, inputs)
    assert not torch.allclose(changed, ref, atol=1e-4)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (t.run(tr, inputs) - changed).abs().max() <= 1e-5


def test_batch_of_two_and_sol():
    """A batch of two: density 1 equals stock, each item at density 0.5 as if it ran alone; Sol runs sparse."""
    t, tr = _tiny()
    inputs = helios_inputs(batch=2)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    out = t.run(tr, inputs)
    for b in range(2):
        alone = t.run(tr, {k: (v[b:b + 1] if torch.is_tensor(v) else v) for k, v in inputs.items()})
        assert (out[b:b + 1] - alone).abs().max() <= 1e-5
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.SolConfig(density=0.5, block=t.block))
    assert torch.isfinite(t.run(tr, inputs)).all()
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 2


def masked_helios():
    """(tester, tiny transformer, inputs) whose blocks' attn1 are given a block-causal mask (Helios passes none)."""
    t, tr = _tiny()
    frame = GRID[1] * GRID[2]
    block = torch.arange(HISTORY + GRID[0] * frame).sub(HISTORY).clamp(min=0) // frame
    mask = (block[None, :] <= block[:, None])[None, None]

    def with_mask(module, args):
        return args[:2] + (mask,) + args[3:]

    for b in tr.blocks:
        b.attn1.register_forward_pre_hook(with_mask)
    return t, tr, t.make_inputs(tr)


def test_masked_calls_run_stock_with_one_warning(caplog):
    """Helios passes no mask; a block-causal mask given to attn1 all the same runs dense through the stock math, equal
    to the stock processor, with one warning per layer."""
    t, tr, inputs = masked_helios()
    assert_runs_stock_with_one_warning(t, tr, inputs, "attention mask", caplog)


def test_published_config():
    """Helios at its defaults (40 blocks, 40 heads of 128) and the pipeline's defaults (384 x 640, 9 latent frames per
    chunk, history sizes 16 / 2 / 1 + the first frame): 8,640 video tokens after 1,920 + 240 + 240 history tokens."""
    from videosparse.processors import self_attention_processors
    from videosparse.processors.registry import model_info, model_spec

    with torch.device("meta"):
        tr = HeliosTransformer3DModel()
        inputs = dict(hidden_states=torch.empty(1, 16, 9, 48, 80),
                      latents_history_short=torch.empty(1, 16, 2, 48, 80), indices_latents_history_short=torch.empty(2),
                      latents_history_mid=torch.empty(1, 16, 2, 48, 80), indices_latents_history_mid=torch.empty(2),
                      latents_history_long=torch.empty(1, 16, 16, 48, 80), indices_latents_history_long=torch.empty(16))
    assert helios_grid(tr, (), inputs) == ((9, 24, 40), 1920 + 240 + 240)
    spec = model_spec(tr)
    info = model_info(tr, spec, len(self_attention_processors(tr)))
    assert (info.num_layers, info.num_heads, info.head_dim, info.patch_size) == (40, 40, 128, (1, 2, 2))
    assert info.text_position == "before"


def test_tiny_pipeline_end_to_end(monkeypatch, caplog):
    """HeliosPipeline (one chunk of 3 latent frames, history sizes 4 / 2 / 1, CFG as two forwards): the first step
    dense, the others sparse on every layer with the history as global tiles and no fallback; remove() restores it.
    The latents are compared (output_type "latent"); the pipeline decodes every chunk even then, which the tiny VAE
    only spends time on, so its decode is a stand-in here."""
    from diffusers import HeliosPipeline, HeliosScheduler

    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    wan = build_tiny_wan_pipeline()
    pipe = HeliosPipeline(tokenizer=wan.tokenizer, text_encoder=wan.text_encoder, vae=wan.vae,
                          scheduler=HeliosScheduler(stages=1), transformer=tiny_helios(text_dim=32))
    pipe.set_progress_bar_config(disable=True)
    # the prompt cleaning calls ftfy (not a videosparse dependency): an identity stand-in
    monkeypatch.setattr(sys.modules[type(pipe).__module__], "ftfy", types.SimpleNamespace(fix_text=lambda s: s),
                        raising=False)
    monkeypatch.setattr(pipe.vae, "decode", lambda latents, return_dict=False: (latents,))
    kw = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=64, width=192,
              num_inference_steps=3, output_type="latent", max_sequence_length=16, history_sizes=[4, 2, 1],
              num_latent_frames_per_chunk=3)

    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0)).frames

    ref = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.3, tiling=(1, 4, 16), block=64, dense_steps=1))
    seen = set()
    with caplog.at_level(logging.WARNING, logger="videosparse"), \
            observe(pipe, lambda r: seen.add((r.step, r.branch, r.grid, r.text_len))):
        sparse = run()
    # 64 x 192 pixels -> 8 x 24 latents -> 4 x 12 patches; history: short 2 frames (2 x 4 x 12 = 96), mid 2 frames
    # (1 x 2 x 6 = 12), long 4 frames (1 x 1 x 3 = 3)
    assert seen == {(s, b, (3, 4, 12), 96 + 12 + 3) for s in range(3) for b in ("cond", "uncond")}
    layers = handle["transformer"].stats()["layers"]
    assert all(s["dense_calls"] == 2 and s["sparse_calls"] == 4 and s["fallbacks"] == [] for s in layers.values())
    assert not [r for r in caplog.records if "runs dense" in r.getMessage()]
    assert torch.isfinite(sparse).all() and not torch.equal(sparse, ref)
    videosparse.remove(pipe)
    assert torch.equal(run(), ref)
