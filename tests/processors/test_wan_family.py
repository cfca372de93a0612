"""Wan VACE, SkyReels V2 and Wan 2.2 Animate: the Wan family's other transformers run the shared processor tests."""

import logging

import numpy as np
import pytest
import torch
from diffusers import (
    SkyReelsV2Transformer3DModel,
    WanAnimateTransformer3DModel,
    WanTransformer3DModel,
    WanVACETransformer3DModel,
)
from diffusers.models.transformers import transformer_wan_animate

import videosparse
from videosparse.processors import sessions
from videosparse.processors.wan import (
    SkyReelsV2SparseAttnProcessor,
    WanAnimateSparseAttnProcessor,
    WanSparseAttnProcessor,
)

from tester import ProcessorTesterMixin, apply_and_list_served, tiny_image_pipeline_parts

SMALL = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
             text_dim=16, freq_dim=32, ffn_dim=64, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
             rope_max_seq_len=64)


def _video_inputs(channels=4, frames=3):
    g = torch.Generator().manual_seed(1)
    # grid after patching: frames x 7 x 9 tokens (odd, partial last tile)
    return dict(hidden_states=torch.randn(1, channels, frames, 14, 18, generator=g), timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, 8, 16, generator=g))


class TestWanVACEProcessors(ProcessorTesterMixin):
    """Wan VACE: 2 main blocks and 2 VACE blocks, each with a self-attention over the same grid."""

    num_layers = 4                     # self-attention layers: blocks.0-1 and vace_blocks.0-1

    def make_transformer(self):
        torch.manual_seed(0)
        return WanVACETransformer3DModel(**SMALL, num_layers=2, vace_layers=[0, 1], vace_in_channels=6).eval()

    def make_inputs(self, transformer):
        inputs = _video_inputs()
        inputs["control_hidden_states"] = torch.randn(1, 6, 3, 14, 18, generator=torch.Generator().manual_seed(2))
        return inputs


class TestSkyReelsV2Processors(ProcessorTesterMixin):

    def make_transformer(self):
        torch.manual_seed(0)
        return SkyReelsV2Transformer3DModel(**SMALL, num_layers=self.num_layers).eval()

    def make_inputs(self, transformer):
        return _video_inputs()


def test_vace_sparsifies_main_and_vace_blocks():
    t = TestWanVACEProcessors()
    tr = t.make_transformer()
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    procs = tr.attn_processors
    sparse = sorted(name for name, p in procs.items() if isinstance(p, WanSparseAttnProcessor))
    assert sparse == ["blocks.0.attn1.processor", "blocks.1.attn1.processor",
                      "vace_blocks.0.attn1.processor", "vace_blocks.1.attn1.processor"]
    t.run(tr, t.make_inputs(tr))
    layers = sessions(tr)["transformer"].stats()["layers"]
    assert len(layers) == 4 and all(s["sparse_calls"] == 1 for s in layers.values())


def test_skyreels_v2_processor_class_and_same_output_as_wan():
    """SkyReels V2 copies Wan's attention: with the same weights its sparse output equals Wan's."""
    t = TestSkyReelsV2Processors()
    sky = t.make_transformer()
    torch.manual_seed(0)
    wan = WanTransformer3DModel(**SMALL, num_layers=2).eval()
    missing, unexpected = wan.load_state_dict(sky.state_dict(), strict=False)
    assert not unexpected and not [m for m in missing if not m.startswith("condition_embedder")]
    wan.condition_embedder.load_state_dict(sky.condition_embedder.state_dict(), strict=False)
    inputs = t.make_inputs(sky)
    cfg = videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block)
    videosparse.apply(sky, cfg)
    videosparse.apply(wan, cfg)
    assert all(isinstance(p, SkyReelsV2SparseAttnProcessor) for n, p in sky.attn_processors.items() if "attn1" in n)
    a, b = t.run(sky, inputs), t.run(wan, inputs)
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_skyreels_v2_diffusion_forcing_mask_runs_dense_with_one_warning(caplog):
    """`causal_block_size > 1` gives every self-attention a block-causal mask: dense, equal to stock."""
    t = TestSkyReelsV2Processors()
    tr = t.make_transformer()
    tr._set_ar_attention(3)                    # 3 frames per causal block, as the diffusion-forcing pipeline does
    inputs = dict(_video_inputs(frames=6), enable_diffusion_forcing=True)
    inputs["timestep"] = torch.tensor([[900, 900, 900, 500, 500, 500]])
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        out = t.run(tr, inputs)
        t.run(tr, inputs)
    assert (out - ref).abs().max() <= 1e-6
    assert sum("attention mask" in r.message for r in caplog.records) == t.num_layers
    stats = sessions(tr)["transformer"].stats()
    assert stats["sparse_calls"] == 0 and stats["dense_calls"] == 2 * t.num_layers


@pytest.mark.parametrize("per", ["token", "frame"])
def test_step_from_the_noisiest_timestep(per):
    """Per-token / per-frame timesteps (Wan 2.2 TI2V, SkyReels V2 diffusion forcing) hold 0 for clean
    conditioning frames: the step is read from the noisiest entry, not from the first."""
    from types import SimpleNamespace

    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.hooks.hooks import CacheContext

    from videosparse.processors.context import SparseContextHook

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    hook = SparseContextHook(SimpleNamespace(scheduler=scheduler, made_by_apply=False), grid_fn=None)
    t = float(scheduler.timesteps[4])
    timestep = torch.tensor([[0, 0, t, t]]) if per == "token" else torch.tensor([0.0, t])
    assert hook._step(CacheContext("cond"), (), {"timestep": timestep}) == (4, 10)


def _tiny_family_pipeline(name: str):
    """A tiny pipeline of `name` from the tiny Wan pipeline's text encoder, tokenizer and VAE, with a tiny
    transformer of its own family (built offline, random weights)."""
    import diffusers

    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    wan = build_tiny_wan_pipeline()
    small = dict(SMALL, text_dim=32, in_channels=4, out_channels=4)
    torch.manual_seed(0)
    if name == "WanVACEPipeline":
        # VACE's control input: inactive and reactive video latents (2 x 4) and the 8x8-folded mask (64)
        transformer = WanVACETransformer3DModel(**small, num_layers=2, vace_layers=[0, 1], vace_in_channels=72)
    else:
        transformer = SkyReelsV2Transformer3DModel(**small, num_layers=2)
    scheduler = wan.scheduler
    if name.startswith("SkyReels"):                        # its pipelines step a flow-matching UniPC scheduler
        scheduler = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                      flow_shift=8.0)
    pipe = getattr(diffusers, name)(tokenizer=wan.tokenizer, text_encoder=wan.text_encoder, vae=wan.vae,
                                    scheduler=scheduler, transformer=transformer.eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("name", ["WanVACEPipeline", "SkyReelsV2Pipeline", "SkyReelsV2DiffusionForcingPipeline"])
def test_tiny_pipeline_end_to_end(name, monkeypatch):
    """Each pipeline runs its first step dense and the others sparse (the step from its scheduler), every
    self-attention layer served, and remove() restores it exactly."""
    import sys
    from types import SimpleNamespace


    pipe = _tiny_family_pipeline(name)
    # the prompt cleaning of these pipelines calls ftfy (not a videosparse dependency): an identity stand-in
    monkeypatch.setattr(sys.modules[type(pipe).__module__], "ftfy", SimpleNamespace(fix_text=lambda t: t),
                        raising=False)
    kw = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=32, width=96,
              num_inference_steps=3, output_type="np", max_sequence_length=16)
    if name == "SkyReelsV2DiffusionForcingPipeline":
        kw.update(base_num_frames=9)                       # synchronous diffusion forcing: one window, no AR steps

    ref = _check_sparse_after_dense_step(pipe, kw, num_layers=4 if name == "WanVACEPipeline" else 2)
    assert ref.ndim == 5                                    # 9 x 32 x 96 -> latent 3 x 4 x 12 -> 3 x 2 x 6 tokens


def test_asynchronous_diffusion_forcing_counts_the_pipelines_iterations(monkeypatch):
    """SkyReels V2 diffusion forcing with ar_step > 0 starts the frames one after another and steps one scheduler
    copy per frame: the noisiest frame sat at the schedule's first entry until the last frame started, so the session
    read step 0 for 5 of 8 iterations and dense_steps=1 ran them all dense (review find). It counts the loop's
    iterations now, of the pipeline's `_num_timesteps`, which a fractional dense_steps takes."""
    import sys
    from types import SimpleNamespace

    pipe = _tiny_family_pipeline("SkyReelsV2DiffusionForcingPipeline")
    monkeypatch.setattr(sys.modules[type(pipe).__module__], "ftfy", SimpleNamespace(fix_text=lambda t: t),
                        raising=False)
    kw = dict(prompt="a red circle moving left", num_frames=17, height=32, width=32, num_inference_steps=4,
              output_type="latent", max_sequence_length=16, guidance_scale=1.0, base_num_frames=17, ar_step=1,
              causal_block_size=1)
    for dense_steps, dense_iterations in ((1, 1), (0.5, 4)):        # 8 iterations of the 4-step schedule
        session = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64,
                                                                 dense_steps=dense_steps))["transformer"]
        iterations, seen = [], []
        with videosparse.processors.observe(pipe, lambda r: seen.append((r.step, r.dense_reason)) if r.layer == 0
                                            else None):
            pipe(**kw, generator=torch.Generator().manual_seed(0),
                 callback_on_step_end=lambda p, i, t, k: iterations.append(i) or {})
        assert iterations == list(range(8))
        assert [step for step, _ in seen] == iterations
        assert sum(reason is not None for _, reason in seen) == dense_iterations, (dense_steps, seen)
        assert session.stats()["layers"][0]["dense_calls"] == dense_iterations
        videosparse.remove(pipe)


def _check_sparse_after_dense_step(pipe, kw: dict, num_layers: int):
    """Run `pipe(**kw)` stock, then with Veda (first of 3 steps dense): every step on the (3, 2, 6) token grid, each
    of `num_layers` served layers 2 dense + 4 sparse calls (CFG) with no fallback, a different finite output; after
    remove() the stock output exactly. Returns the stock frames."""
    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0)).frames

    ref = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1))
    seen = set()
    with videosparse.processors.observe(pipe, lambda r: seen.add((r.step, r.grid))):
        sparse = run()
    assert seen == {(s, (3, 2, 6)) for s in range(3)}
    layers = handle["transformer"].stats()["layers"]
    assert len(layers) == num_layers
    assert all(s["dense_calls"] == 2 and s["sparse_calls"] == 4 and s["fallbacks"] == [] for s in layers.values())
    assert np.isfinite(sparse).all() and not np.array_equal(sparse, ref)
    videosparse.remove(pipe)
    assert np.array_equal(run(), ref)
    return ref


@pytest.mark.parametrize("cls", [SkyReelsV2Transformer3DModel, WanTransformer3DModel])
def test_image_to_video_serves_attn1_and_leaves_the_image_context_stock(cls):
    """I2V checkpoints (SkyReels V2 I2V, Wan 2.1 I2V) add the CLIP image context to attn2 through add_k/v_proj:
    attn1 is served, attn2 keeps its stock processor; a guidance-sized batch at density 1 equals stock."""
    torch.manual_seed(0)
    tr = cls(**SMALL, num_layers=2, image_dim=24, added_kv_proj_dim=128).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 4, 3, 14, 18, generator=g), timestep=torch.tensor([500, 500]),
                  encoder_hidden_states=torch.randn(2, 8, 16, generator=g),
                  encoder_hidden_states_image=torch.randn(2, 5, 24, generator=g))
    t = TestSkyReelsV2Processors()
    ref = t.run(tr, inputs)
    _, served = apply_and_list_served(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert served == ["blocks.0.attn1.processor", "blocks.1.attn1.processor"]
    assert tr.blocks[0].attn2.add_k_proj is not None
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 2


def test_per_token_timesteps_of_ti2v_run_sparse():
    """Wan 2.2 TI2V-5B (`expand_timesteps`) gives the transformer one timestep per token (B, S), 0 on the clean
    first frame: the forward runs sparse on its grid, equal to stock at density 1."""
    t = TestSkyReelsV2Processors()
    torch.manual_seed(0)
    tr = WanTransformer3DModel(**SMALL, num_layers=2).eval()
    inputs = _video_inputs()
    timestep = torch.full((1, 3 * 7 * 9), 700)
    timestep[:, :7 * 9] = 0
    inputs["timestep"] = timestep
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    grids = []
    with videosparse.processors.observe(tr, lambda r: grids.append(r.grid)):
        out = t.run(tr, inputs)
    assert grids == [(3, 7, 9)] * 2 and (out - ref).abs().max() <= 1e-5
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 2


def _tiny_animate_transformer(text_dim=16, image_dim=24):
    """A tiny `WanAnimateTransformer3DModel`: 2 blocks (CLIP image context through attn2's added k/v), 2 latent
    channels x 2 + 4 input channels, an 8 x 8 pixel motion encoder (one res block; the pipeline's video processor
    rounds the face video down to a multiple of 8 pixels) and a face adapter after every block (face_adapter.0-1)."""
    torch.manual_seed(0)
    small = {k: v for k, v in SMALL.items() if k not in ("in_channels", "out_channels", "text_dim")}
    return WanAnimateTransformer3DModel(
        **small, num_layers=2, latent_channels=4, in_channels=12, out_channels=4, text_dim=text_dim,
        image_dim=image_dim, added_kv_proj_dim=128, motion_encoder_size=8,
        motion_encoder_channel_sizes={"8": 8, "4": 8},
        motion_style_dim=8, motion_dim=4, motion_encoder_dim=8, face_encoder_hidden_dim=8, face_encoder_num_heads=2,
        inject_face_latents_blocks=1,
    ).eval()


class TestWanAnimateProcessors(ProcessorTesterMixin):
    """Wan 2.2 Animate: the blocks' attn1 over the (T+1) x H x W grid (pose latents added to frames 1..T)."""

    def make_transformer(self):
        return _tiny_animate_transformer()

    def make_inputs(self, transformer):
        g = torch.Generator().manual_seed(1)
        # grid after patching: 3 x 7 x 9 tokens; 5 face frames -> 2 motion frames + 1 pad = 3, one per latent frame.
        # 512 text tokens: the stock attn2 takes the tokens before the last 512 as the CLIP image context
        return dict(hidden_states=torch.randn(1, 12, 3, 14, 18, generator=g), timestep=torch.tensor([500]),
                    encoder_hidden_states=torch.randn(1, 512, 16, generator=g),
                    encoder_hidden_states_image=torch.randn(1, 5, 24, generator=g),
                    pose_hidden_states=torch.randn(1, 4, 2, 14, 18, generator=g),
                    face_pixel_values=torch.randn(1, 3, 5, 8, 8, generator=g))


def test_animate_serves_only_the_blocks_attn1():
    """Only blocks.<i>.attn1 is served; attn2 (text + image) and the face adapter's motion cross-attention keep
    their stock processors, and the grid of every call is the (T+1) x H x W latent grid."""
    t = TestWanAnimateProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    ref = t.run(tr, inputs)
    before, served = apply_and_list_served(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert served == ["blocks.0.attn1.processor", "blocks.1.attn1.processor"]
    procs = tr.attn_processors
    assert all(type(procs[n]) is WanAnimateSparseAttnProcessor for n in served)
    assert isinstance(procs["blocks.0.attn1.processor"], transformer_wan_animate.WanAttnProcessor)
    face = sorted(n for n in procs if n.startswith("face_adapter."))
    assert face == ["face_adapter.0.processor", "face_adapter.1.processor"]
    assert all(type(procs[n]) is transformer_wan_animate.WanAnimateFaceBlockAttnProcessor and procs[n] is before[n]
               for n in face)
    assert all(procs[n] is before[n] for n in procs if n not in served)
    grids = []
    with videosparse.processors.observe(tr, lambda r: grids.append(r.grid)):
        out = t.run(tr, inputs)
    assert grids == [(3, 7, 9)] * 2 and (out - ref).abs().max() <= 1e-5
    s = sessions(tr)["transformer"].stats()
    assert s["sparse_calls"] == 2 and s["dense_calls"] == 0


def _tiny_animate_pipeline():
    """A tiny `WanAnimatePipeline` (built offline, random weights): the tiny Wan pipeline's text encoder, tokenizer
    and VAE, a tiny CLIP vision encoder (32 x 32 pixels, hidden size 24) and a tiny Animate transformer."""
    import diffusers

    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    wan = build_tiny_wan_pipeline()
    image_encoder, image_processor, scheduler = tiny_image_pipeline_parts()
    pipe = diffusers.WanAnimatePipeline(tokenizer=wan.tokenizer, text_encoder=wan.text_encoder, vae=wan.vae,
                                        scheduler=scheduler, image_processor=image_processor,
                                        image_encoder=image_encoder,
                                        transformer=_tiny_animate_transformer(text_dim=32, image_dim=24))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_tiny_animate_pipeline_end_to_end(monkeypatch):
    """WanAnimatePipeline (animate mode, guidance with the blanked face branch) runs its first step dense and the
    others sparse, both blocks' attn1 served on the (T+1) x H x W grid, and remove() restores it exactly."""
    import sys
    from types import SimpleNamespace

    from PIL import Image

    pipe = _tiny_animate_pipeline()
    monkeypatch.setattr(sys.modules[type(pipe).__module__], "ftfy", SimpleNamespace(fix_text=lambda t: t),
                        raising=False)
    rng = np.random.default_rng(0)

    def frame(w, h):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    # 5 frames in one segment: latent 2 frames + the reference frame = 3; 32 x 96 pixels -> 4 x 12 latents
    kw = dict(image=frame(96, 32), pose_video=[frame(96, 32) for _ in range(5)],
              face_video=[frame(8, 8) for _ in range(5)], prompt="a red circle moving left", negative_prompt="blue",
              height=32, width=96, segment_frame_length=5, num_inference_steps=3, guidance_scale=2.0,
              output_type="np", max_sequence_length=512)

    ref = _check_sparse_after_dense_step(pipe, kw, num_layers=2)      # latent 3 x 4 x 12 -> 3 x 2 x 6 tokens
    assert ref.shape[1] == 5


def test_from_pipe_steps_when_the_applied_pipeline_never_ran(monkeypatch):
    """Review find (Wan VACE: no step index in its cache context, so the step comes from the scheduler): a `from_pipe`
    pipeline with its own scheduler read the applied pipeline's scheduler before that one had ever run, whose table is
    then the 1,000-step training schedule (steps 0, 332, 665, 997): it counts its own steps now."""
    import sys
    from types import SimpleNamespace

    import diffusers

    pipe = _tiny_family_pipeline("WanVACEPipeline")
    monkeypatch.setattr(sys.modules[type(pipe).__module__], "ftfy", SimpleNamespace(fix_text=lambda t: t),
                        raising=False)
    kw = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=32, width=96,
              num_inference_steps=4, output_type="latent", max_sequence_length=16)
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=2))
    other = diffusers.WanVACEPipeline.from_pipe(pipe, scheduler=type(pipe.scheduler).from_config(pipe.scheduler.config))
    other.set_progress_bar_config(disable=True)

    def steps_of(p) -> list[int]:
        seen = []
        with videosparse.processors.observe(pipe, lambda r: seen.append(r.step)):
            p(**kw, generator=torch.Generator().manual_seed(0))
        return seen

    seen = steps_of(other)
    assert sorted(set(seen)) == [0, 1, 2, 3] and [seen.count(s) for s in range(4)] == [len(seen) // 4] * 4
    assert seen == sorted(seen)                              # in order: each step's forwards together
    layer = next(iter(handle["transformer"].stats()["layers"].values()))
    assert layer["dense_calls"] == 4 and layer["sparse_calls"] == 4     # steps 0-1 dense, 2-3 sparse, two branches
    assert steps_of(pipe) == seen                            # and the applied pipeline's own call the same
    videosparse.remove(pipe)


def _dense_steps_seen(pipe, applied, kw, die_at=None) -> list:
    """(component, step, dense?) of layer 0's cond-branch calls of one call of `pipe` (the sessions of `applied`);
    `die_at`: a step-end callback raises at that step."""
    seen = []

    def cb(p, i, t, kwargs):
        if i == die_at:
            raise RuntimeError("client went away")
        return kwargs

    for name, session in videosparse.sessions(applied).items():
        session.observers.append(lambda r, name=name: r.layer == 0 and r.branch == "cond" and seen.append(
            (name, r.step, r.dense_reason is not None)))
    try:
        pipe(**kw, callback_on_step_end=cb, generator=torch.Generator().manual_seed(0))
    except RuntimeError:
        seen.append("raised")
    finally:
        for session in videosparse.sessions(applied).values():
            session.observers.clear()
    return seen


def test_two_experts_count_the_steps_of_a_from_pipe_call_together(monkeypatch):
    """Review find: a `from_pipe` pipeline with its own scheduler counts its steps by timestep; with Wan 2.2's two
    experts (transformer_2 past the boundary) each counted on its own, so transformer_2 ran its first steps dense
    again in the middle of the schedule. The experts share one count now."""
    import diffusers

    pipe, kw = _vace_two_experts(monkeypatch)
    videosparse.apply(pipe, TWO_EXPERT_CONFIG)
    other = diffusers.WanVACEPipeline.from_pipe(pipe, scheduler=type(pipe.scheduler).from_config(pipe.scheduler.config))
    other.set_progress_bar_config(disable=True)
    assert _dense_steps_seen(pipe, pipe, kw) == TWO_EXPERT_STEPS
    assert _dense_steps_seen(other, pipe, kw) == TWO_EXPERT_STEPS
    videosparse.remove(pipe)


def test_two_experts_set_up_one_by_one_count_the_steps_together(monkeypatch):
    """Review find: each expert set up on its own (videosparse.apply per transformer, or the diffusers-native
    set_attn_processor(videosparse.processors(t, config))), with no scheduler, counted the steps alone: transformer_2
    ran its 'first' dense steps again when it took over mid-schedule. Transformers set up with neither a pipeline nor a
    scheduler share one count now."""
    pipe, kw = _vace_two_experts(monkeypatch)
    for name in ("transformer", "transformer_2"):
        videosparse.apply(getattr(pipe, name), TWO_EXPERT_CONFIG)
    assert _dense_steps_seen(pipe, pipe, kw) == TWO_EXPERT_STEPS
    videosparse.remove(pipe)
    for name in ("transformer", "transformer_2"):
        transformer = getattr(pipe, name)
        transformer.set_attn_processor(videosparse.processors(transformer, TWO_EXPERT_CONFIG))
    assert _dense_steps_seen(pipe, pipe, kw) == TWO_EXPERT_STEPS
    videosparse.remove(pipe)


TWO_EXPERT_CONFIG = videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=2)
TWO_EXPERT_STEPS = [("transformer", 0, True), ("transformer", 1, True)] + [("transformer_2", i, False)
                                                                            for i in range(2, 6)]


def _vace_two_experts(monkeypatch):
    """A tiny Wan VACE pipeline with two experts (transformer_2 from step 2 of 6; its cache context gives no step
    index) and its call arguments."""
    import sys
    from types import SimpleNamespace

    import diffusers

    base = _tiny_family_pipeline("WanVACEPipeline")
    monkeypatch.setattr(sys.modules[type(base).__module__], "ftfy", SimpleNamespace(fix_text=lambda t: t),
                        raising=False)
    torch.manual_seed(1)
    second = WanVACETransformer3DModel(**dict(SMALL, text_dim=32, in_channels=4, out_channels=4), num_layers=2,
                                       vace_layers=[0, 1], vace_in_channels=72).eval()
    pipe = diffusers.WanVACEPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                                     scheduler=base.scheduler, transformer=base.transformer, transformer_2=second,
                                     boundary_ratio=0.875)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(prompt="a red circle moving left", num_frames=9, height=32, width=96, guidance_scale=1.0,
              num_inference_steps=6, output_type="latent", max_sequence_length=16)
    return pipe, kw


def test_a_transformer_applied_alone_counts_again_after_a_call_that_raised(monkeypatch):
    """Review find: applied to the bare transformer (no scheduler), a pipeline whose cache context gives no step
    index had its forwards counted per branch, a count reset only when a call ends normally: after a call that
    raised, the next one went on from there and ran none of its dense steps. Counted by timestep now."""
    import sys
    from types import SimpleNamespace

    pipe = _tiny_family_pipeline("WanVACEPipeline")
    monkeypatch.setattr(sys.modules[type(pipe).__module__], "ftfy", SimpleNamespace(fix_text=lambda t: t),
                        raising=False)
    kw = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=32, width=96,
              num_inference_steps=4, output_type="latent", max_sequence_length=16)
    videosparse.apply(pipe.transformer, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64,
                                                               dense_steps=2))
    want = [("transformer", i, i < 2) for i in range(4)]
    assert _dense_steps_seen(pipe, pipe.transformer, kw) == want
    assert _dense_steps_seen(pipe, pipe.transformer, kw, die_at=2) == want[:3] + ["raised"]
    assert _dense_steps_seen(pipe, pipe.transformer, kw) == want
    videosparse.remove(pipe.transformer)
    # observed with no dense steps (DenseConfig, as `observe` applies it): the records' steps start again too (they
    # went on from the call that raised)
    videosparse.apply(pipe.transformer, videosparse.DenseConfig())
    want = [("transformer", i, True) for i in range(4)]
    assert _dense_steps_seen(pipe, pipe.transformer, kw, die_at=1) == want[:2] + ["raised"]
    assert _dense_steps_seen(pipe, pipe.transformer, kw) == want
    videosparse.remove(pipe.transformer)
