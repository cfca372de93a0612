"""ChronoEdit and AnyFlow: Wan-derived transformers whose modules carry their own processor classes."""

import logging
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import AnyFlowTransformer3DModel, ChronoEditTransformer3DModel
from diffusers.models.transformers import transformer_anyflow, transformer_chronoedit

import videosparse
from videosparse.processors import attention_processors, observe, sessions
from videosparse.processors.wan import AnyFlowSparseAttnProcessor, ChronoEditSparseAttnProcessor

from tester import ProcessorTesterMixin, apply_and_list_served, tiny_image_pipeline_parts, with_cache_context

SMALL = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
             text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64)
SERVED = ["blocks.0.attn1.processor", "blocks.1.attn1.processor"]


def tiny_chronoedit(**kw):
    """A tiny `ChronoEditTransformer3DModel`, image-conditioned as the released one (CLIP image context through
    attn2's added k/v)."""
    torch.manual_seed(0)
    return ChronoEditTransformer3DModel(**dict(SMALL, image_dim=24, added_kv_proj_dim=128, **kw)).eval()


def tiny_anyflow(**kw):
    torch.manual_seed(0)
    return with_cache_context(AnyFlowTransformer3DModel(**dict(SMALL, **kw)).eval())


def chronoedit_inputs(batch=1, frames=3):
    g = torch.Generator().manual_seed(1)
    # grid after patching: frames x 7 x 9 tokens (partial last tile). 512 text tokens: the stock attn2 takes the
    # tokens before the last 512 as the CLIP image context
    return dict(hidden_states=torch.randn(batch, 4, frames, 14, 18, generator=g), timestep=torch.tensor([500] * batch),
                encoder_hidden_states=torch.randn(batch, 512, 16, generator=g),
                encoder_hidden_states_image=torch.randn(batch, 5, 24, generator=g))


def anyflow_inputs(batch=1, frames=3, clean_frames=0):
    g = torch.Generator().manual_seed(1)
    timestep = torch.full((batch, frames), 700.0)
    timestep[:, :clean_frames] = 0                      # video-conditioned frames, as AnyFlowPipeline(video=...) sets
    # hidden_states (B, F, C, H, W), frames first: grid frames x 7 x 9
    return dict(hidden_states=torch.randn(batch, frames, 4, 14, 18, generator=g), timestep=timestep,
                r_timestep=torch.full((batch, frames), 400.0),
                encoder_hidden_states=torch.randn(batch, 8, 16, generator=g))


class TestChronoEditProcessors(ProcessorTesterMixin):
    def make_transformer(self):
        return tiny_chronoedit()

    def make_inputs(self, transformer):
        return chronoedit_inputs()


class TestAnyFlowProcessors(ProcessorTesterMixin):
    def make_transformer(self):
        return tiny_anyflow()

    def make_inputs(self, transformer):
        return anyflow_inputs()


@pytest.mark.parametrize("family", ["chronoedit", "anyflow"])
def test_serves_only_the_blocks_attn1(family):
    """Only blocks.<i>.attn1 is served, by the family's processor (a subclass of the module's own stock class);
    attn2 (ChronoEdit: text + image context; AnyFlow: AnyFlowCrossAttnProcessor) keeps its stock processor."""
    t = TestChronoEditProcessors() if family == "chronoedit" else TestAnyFlowProcessors()
    tr = t.make_transformer()
    cls, stock, cross = ((ChronoEditSparseAttnProcessor, transformer_chronoedit.WanAttnProcessor,
                          transformer_chronoedit.WanAttnProcessor) if family == "chronoedit" else
                         (AnyFlowSparseAttnProcessor, transformer_anyflow.AnyFlowAttnProcessor,
                          transformer_anyflow.AnyFlowCrossAttnProcessor))
    before, served = apply_and_list_served(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    assert served == SERVED and all(type(before[n]) is stock for n in served)
    after = attention_processors(tr)
    assert all(type(after[n]) is cls and isinstance(after[n], stock) for n in served)
    others = [n for n in before if n not in served]
    assert others == ["blocks.0.attn2.processor", "blocks.1.attn2.processor"]
    assert all(after[n] is before[n] and type(before[n]) is cross for n in others)
    t.run(tr, t.make_inputs(tr))
    s = sessions(tr)["transformer"].stats()
    assert s["sparse_calls"] == 2 and s["dense_calls"] == 0 and 0.3 < s["density"] < 0.9


def test_chronoedit_two_frame_latent_keeps_its_grid():
    """A 2-frame latent (input and edited image) takes temporal RoPE positions 0 and rope_temporal_skip_len - 1,
    but no token is dropped: the grid is (2, H, W), every call served; batch 2 at density 1 equals stock."""
    t = TestChronoEditProcessors()
    tr = t.make_transformer()
    cos2, _ = tr.rope(torch.zeros(1, 4, 2, 14, 18))
    cos8, _ = tr.rope(torch.zeros(1, 4, 8, 14, 18))
    per_frame = 7 * 9
    assert torch.equal(cos2[:, :per_frame], cos8[:, :per_frame])
    assert torch.equal(cos2[:, per_frame:], cos8[:, 7 * per_frame:])
    inputs = chronoedit_inputs(batch=2, frames=2)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    grids = []
    with observe(tr, lambda r: grids.append(r.grid)):
        out = t.run(tr, inputs)
    assert grids == [(2, 7, 9)] * 2 and (out - ref).abs().max() <= 1e-5
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 2


def test_anyflow_conditioned_batch_of_two_equals_stock_at_density_one(caplog):
    """AnyFlow's per-frame timesteps (B, F) with a clean conditioning frame and a batch of 2 (its guidance batch):
    density 1 equals stock on the (F, H, W) grid read from hidden_states (B, F, C, H, W); density 0.3 runs sparse
    on every layer with no fallback."""
    t = TestAnyFlowProcessors()
    tr = t.make_transformer()
    inputs = anyflow_inputs(batch=2, frames=4, clean_frames=1)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    grids = []
    with observe(tr, lambda r: grids.append((r.grid, r.q.shape[0]))):
        out = t.run(tr, inputs)
    assert grids == [((4, 7, 9), 2)] * 2 and (out - ref).abs().max() <= 1e-5
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        out = t.run(tr, inputs)
    s = sessions(tr)["transformer"].stats()
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    assert s["sparse_calls"] == 2 and s["dense_calls"] == 0 and s["density"] < 0.9
    assert not [r for r in caplog.records if "runs dense" in r.getMessage()]


def test_anyflow_far_is_not_supported():
    """The FAR causal model is a separate class (block-causal flex mask, KV cache, compressed context frames):
    apply refuses it and names it, and leaves its processors alone."""
    from diffusers import AnyFlowFARTransformer3DModel

    torch.manual_seed(0)
    far = AnyFlowFARTransformer3DModel(**SMALL)
    before = dict(attention_processors(far))
    with pytest.raises(ValueError, match="AnyFlowFARTransformer3DModel is not supported"):
        videosparse.apply(far, videosparse.VedaConfig(density=0.3))
    assert all(attention_processors(far)[n] is p for n, p in before.items())


# ---------------------------------------------------------------------------------------------- tiny pipelines
def _tiny_chronoedit_pipeline():
    """A tiny `ChronoEditPipeline` (built offline, random weights): the tiny Wan pipeline's text encoder, tokenizer
    and VAE, a tiny CLIP vision encoder (32 x 32 pixels, hidden size 24) and a tiny ChronoEdit transformer (4 latent
    + 4 mask + 4 condition channels in). Its scheduler is UniPC: temporal reasoning trims the multistep history."""
    import diffusers

    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    wan = build_tiny_wan_pipeline()
    image_encoder, image_processor, scheduler = tiny_image_pipeline_parts()
    pipe = diffusers.ChronoEditPipeline(tokenizer=wan.tokenizer, text_encoder=wan.text_encoder, vae=wan.vae,
                                        scheduler=scheduler, image_processor=image_processor,
                                        image_encoder=image_encoder,
                                        transformer=tiny_chronoedit(in_channels=12, text_dim=32))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _tiny_anyflow_pipeline():
    """A tiny `AnyFlowPipeline` (built offline, random weights): the tiny Wan pipeline's text encoder, tokenizer and
    VAE, a flow-map Euler scheduler and a tiny AnyFlow transformer."""
    import diffusers

    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    wan = build_tiny_wan_pipeline()
    torch.manual_seed(0)
    transformer = AnyFlowTransformer3DModel(**dict(SMALL, text_dim=32)).eval()
    pipe = diffusers.AnyFlowPipeline(tokenizer=wan.tokenizer, text_encoder=wan.text_encoder, vae=wan.vae,
                                     scheduler=diffusers.FlowMapEulerDiscreteScheduler(shift=5.0),
                                     transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _check_sparse_after_dense_step(pipe, kw: dict, grids: list, forwards_per_step: int):
    """Run `pipe(**kw)` stock, then with Veda (first of 3 steps dense): step s on `grids[s]`, both blocks' attn1
    served, each with `forwards_per_step` dense then 2 x `forwards_per_step` sparse calls and no fallback, a different
    finite output; after remove() the stock output exactly. Returns the stock frames."""
    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0)).frames

    ref = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1))
    seen = set()
    with observe(pipe, lambda r: seen.add((r.step, r.grid))):
        sparse = run()
    assert seen == set(enumerate(grids))
    layers = handle["transformer"].stats()["layers"]
    assert len(layers) == 2
    assert all(s["dense_calls"] == forwards_per_step and s["sparse_calls"] == 2 * forwards_per_step
               and s["fallbacks"] == [] for s in layers.values())
    assert np.isfinite(sparse).all() and not np.array_equal(sparse, ref)
    videosparse.remove(pipe)
    assert np.array_equal(run(), ref)
    return ref


@pytest.mark.parametrize("reasoning", [False, True])
def test_tiny_chronoedit_pipeline_end_to_end(reasoning, monkeypatch):
    """ChronoEditPipeline (guidance: two forwards per step) runs its first step dense and the others sparse.
    Without temporal reasoning the latent is 2 frames (input, edit); with it the first step denoises 3 latent frames
    (9 video frames) and the later ones the 2 kept ([0, -1]): the grid shrinks mid-run and the layouts follow."""
    from PIL import Image

    pipe = _tiny_chronoedit_pipeline()
    monkeypatch.setattr(sys.modules[type(pipe).__module__], "ftfy", SimpleNamespace(fix_text=lambda t: t),
                        raising=False)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8))
    # 96 x 128 pixels -> 12 x 16 latents -> 6 x 8 tokens a frame (48: tiles of 64 straddle frames)
    kw = dict(image=image, prompt="a red circle moving left", negative_prompt="blue", height=96, width=128,
              num_inference_steps=3, guidance_scale=2.0, output_type="np", max_sequence_length=512)
    if reasoning:
        kw.update(enable_temporal_reasoning=True, num_temporal_reasoning_steps=1, num_frames=9)
    grids = [(3 if reasoning else 2, 6, 8), (2, 6, 8), (2, 6, 8)]
    ref = _check_sparse_after_dense_step(pipe, kw, grids, forwards_per_step=2)
    assert ref.shape[1] == 5             # the reasoning frames are dropped before decoding: input and edit frames


def test_tiny_anyflow_pipeline_end_to_end(monkeypatch):
    """AnyFlowPipeline with guidance (negative and positive prompt in one batch of 2) and a conditioning video
    latent (its frame held clean, timestep 0): the first step dense, the others sparse, on the (F, H, W) grid."""
    pipe = _tiny_anyflow_pipeline()
    monkeypatch.setattr(sys.modules[type(pipe).__module__], "ftfy", SimpleNamespace(fix_text=lambda t: t),
                        raising=False)
    video_latents = torch.randn(1, 1, 4, 12, 16, generator=torch.Generator().manual_seed(3))
    # 9 frames of 96 x 128 pixels -> latent 3 x 12 x 16 -> 3 x 6 x 8 tokens
    kw = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=96, width=128,
              num_inference_steps=3, guidance_scale=2.0, output_type="np", max_sequence_length=16,
              video_latents=video_latents)
    ref = _check_sparse_after_dense_step(pipe, kw, [(3, 6, 8)] * 3, forwards_per_step=1)
    assert ref.shape[:2] == (1, 9)


def test_an_unknown_step_count_with_fractional_dense_steps_warns(monkeypatch, caplog):
    """ChronoEdit passes no cache context: on its transformer alone (no scheduler) the steps are counted by timestep,
    so an integer dense_steps holds (session 66: it used to warn and run every step sparse), while a fraction, which
    needs the step count, is named in one warning and every step runs sparse (review find: dropped silently); on the
    pipeline the first step runs dense."""
    from PIL import Image

    pipe = _tiny_chronoedit_pipeline()
    monkeypatch.setattr(sys.modules[type(pipe).__module__], "ftfy", SimpleNamespace(fix_text=lambda t: t),
                        raising=False)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8))
    kw = dict(image=image, prompt="a red circle moving left", height=96, width=128, num_inference_steps=3,
              guidance_scale=1.0, output_type="latent", max_sequence_length=512)
    for target, dense_steps, dense_calls in ((pipe.transformer, 1, 1), (pipe.transformer, 0.5, 0), (pipe, 1, 1)):
        handle = videosparse.apply(target, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64,
                                                                  dense_steps=dense_steps))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="videosparse"):
            pipe(**kw, generator=torch.Generator().manual_seed(0))
        warned = [r.getMessage() for r in caplog.records if f"dense_steps={dense_steps}, but" in r.getMessage()]
        assert len(warned) == (1 if isinstance(dense_steps, float) and target is not pipe else 0), warned
        assert all("the denoising step is unknown here" in m for m in warned)
        assert next(iter(handle["transformer"].stats()["layers"].values()))["dense_calls"] == dense_calls
        videosparse.remove(target)
