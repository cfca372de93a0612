
import logging

import numpy as np
import pytest
import torch
from diffusers import LTXVideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor
from diffusers.pipelines.ltx.pipeline_ltx import LTXPipeline
from diffusers.pipelines.ltx.pipeline_ltx_condition import LTXConditionPipeline
from tester import (
    ProcessorTesterMixin,
    assert_runs_stock_with_one_warning,
    check_blocks_attn1_served,
    check_extra_tokens_served_as_global_tiles,
)

import videosparse
from videosparse.processors import sessions

CHANNELS, TEXT, TEXT_DIM = 8, 8, 16
LATENT = (3, 7, 18)          # latent frames x height x width: 378 tokens, a partial last tile of 64


def _video_coords(grid, batch=1, frame_index=0):
    """video_coords [B, 3, S] as LTXConditionPipeline builds them (VAE 8 x 32 x 32, 25 fps)."""
    ids = LTXConditionPipeline._prepare_video_ids(batch, *grid)
    return LTXConditionPipeline._scale_video_ids(ids, 32, 8, frame_index, "cpu").float() / torch.tensor([25, 1, 1])[
        None, :, None]


class TestLTXProcessors(ProcessorTesterMixin):
    """LTX-Video (0.9.x 2B-like: patch 1, across-heads RMSNorm, RoPE over the flattened heads); video-only attn1."""


    def make_transformer(self):
        torch.manual_seed(0)
        return LTXVideoTransformer3DModel(
            in_channels=CHANNELS, out_channels=CHANNELS, num_attention_heads=2, attention_head_dim=self.head_dim,
            cross_attention_dim=2 * self.head_dim, num_layers=self.num_layers, caption_channels=TEXT_DIM,
        ).eval()

    def make_inputs(self, transformer):
        """As LTXPipeline calls its transformer: packed latents, latent sizes, RoPE scale, padded prompt mask."""
        g = torch.Generator().manual_seed(1)
        latents = LTXPipeline._pack_latents(torch.randn(1, CHANNELS, *LATENT, generator=g), 1, 1)
        mask = torch.ones(1, TEXT, dtype=torch.long)
        mask[:, 5:] = 0
        return dict(
            hidden_states=latents,
            encoder_hidden_states=torch.randn(1, TEXT, TEXT_DIM, generator=g),
            timestep=torch.tensor([500.0]),
            encoder_attention_mask=mask,
            num_frames=LATENT[0], height=LATENT[1], width=LATENT[2],
            rope_interpolation_scale=(8 / 25, 32, 32),
        )


def test_pack_latents_is_time_major():
    """The token order the layout assumes: LTXPipeline._pack_latents flattens (f, h, w) as f*H*W + h*W + w."""
    F, H, W = LATENT
    latents = torch.arange(F * H * W, dtype=torch.float32).view(1, 1, F, H, W).expand(1, CHANNELS, F, H, W)
    packed = LTXPipeline._pack_latents(latents, 1, 1)
    assert torch.equal(packed[0, :, 0], torch.arange(F * H * W, dtype=torch.float32))


def test_sparse_runs_on_attn1_only():
    _, _, records, _, _ = check_blocks_attn1_served(TestLTXProcessors(), LTXVideoAttnProcessor)
    r = records[0]
    assert r.grid == LATENT and r.text_len == 0 and r.text_position == "before" and r.q.shape == (1, 378, 2, 64)


def test_video_coords_grid_runs_sparse():
    """LTXConditionPipeline passes only video_coords: a time-major grid of them is recognised and runs sparse."""
    t = TestLTXProcessors()
    tr = t.make_transformer()
    inputs = dict(t.make_inputs(tr), num_frames=None, height=None, width=None, rope_interpolation_scale=None,
                  video_coords=_video_coords(LATENT))
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5
    session = sessions(tr)["transformer"]
    assert session.context.grid == LATENT and session.stats()["sparse_calls"] == 2


def test_grid_needs_the_sizes_or_coords_of_every_token():
    from videosparse.processors.ltx import ltx_grid

    t = TestLTXProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    assert ltx_grid(tr, (), inputs) == (LATENT, 0, None)
    assert ltx_grid(tr, tuple(inputs.values()), {}) == (LATENT, 0, None)          # positional, as in the signature
    grid, text_len, problem = ltx_grid(tr, (inputs["hidden_states"],), {"num_frames": 3})
    assert grid == (1, 1, 378) and text_len == 0 and "were not all given" in problem
    assert "not num_frames x height x width = 2 x 7 x 18" in ltx_grid(tr, (), dict(inputs, num_frames=2))[2]
    coords = _video_coords(LATENT)
    assert "coordinates for each of the 378 tokens" in ltx_grid(tr, (), dict(inputs, video_coords=coords[:, :2]))[2]


def with_condition(inputs: dict, frame_index: int = 16) -> dict:
    """`inputs` with one latent frame of condition tokens before the video, as LTXConditionPipeline puts an image
    condition at `frame_index` > 0: its tokens first, its coordinates (at that frame) before the video's."""
    cond = _video_coords((1, *LATENT[1:]), frame_index=frame_index)
    g = torch.Generator().manual_seed(2)
    return dict(inputs, hidden_states=torch.cat([torch.randn(1, cond.shape[2], CHANNELS, generator=g),
                                                 inputs["hidden_states"]], dim=1),
                video_coords=torch.cat([cond, _video_coords(LATENT)], dim=2))


def test_prepended_condition_tokens_are_served_as_global_tiles(caplog):
    """LTXConditionPipeline's condition tokens before the video: the grid is the tokens' after them, the condition
    tokens are global tiles before the video (every video tile attends to them, they to all): density 1 equals
    stock, a sparse density runs sparse on every layer with no fallback."""
    from videosparse.processors.ltx import ltx_grid

    t = TestLTXProcessors()
    tr = t.make_transformer()
    inputs = with_condition(t.make_inputs(tr))
    prefix = LATENT[1] * LATENT[2]
    assert ltx_grid(tr, (), inputs) == (LATENT, prefix, None)
    check_extra_tokens_served_as_global_tiles(t, tr, inputs, LATENT, prefix, "before", caplog)


@pytest.mark.parametrize("case", ["scrambled", "batch"])
def test_not_one_grid_runs_stock_with_one_warning(case, caplog):
    """Coordinates that form no time-major grid, even after whole frames of condition tokens, or that differ across
    the batch: every attn1 call runs the stock processor (no observer records), warned once per layer."""
    t = TestLTXProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    grid_coords = _video_coords(LATENT)
    if case == "scrambled":
        order = torch.randperm(grid_coords.shape[2], generator=torch.Generator().manual_seed(3))
        inputs.update(hidden_states=inputs["hidden_states"][:, order], video_coords=grid_coords[:, :, order])
        expected = "do not form one time-major"
    else:
        shifted = grid_coords.clone()
        shifted[:, 0] += 1.0
        inputs = {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        inputs["video_coords"] = torch.cat([grid_coords, shifted])
        expected = "differ across the batch"
    assert_runs_stock_with_one_warning(t, tr, inputs, expected, caplog)


def test_a_masked_attn1_call_runs_stock_with_one_warning(caplog):
    """Mutation find: the sparse path ignored an `attention_mask` given to attn1 (the model gives it none, a direct
    call may): the output differed from stock by 0.1 and nothing was said. The call runs the stock processor with the
    mask, warned once, counted dense."""
    t = TestLTXProcessors()
    tr = t.make_transformer()
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    t.run(tr, t.make_inputs(tr))                      # records the grid
    session = sessions(tr)["transformer"]
    before = session.stats()
    attn = tr.transformer_blocks[0].attn1
    x = torch.randn(1, 378, 2 * t.head_dim, generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(1, 1, 1, 378)
    mask[..., 200:] = -1e4                            # additive key mask: the last 178 keys off
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="videosparse"):
        out = [attn.processor(attn, x, attention_mask=mask) for _ in range(2)]
        ref = LTXVideoAttnProcessor()(attn, x, attention_mask=mask)
    assert torch.equal(out[0], ref) and torch.equal(out[1], ref)
    assert sum("an attention mask was given" in r.getMessage() for r in caplog.records) == 1
    after = session.stats()
    assert after["sparse_calls"] == before["sparse_calls"] and after["dense_calls"] == before["dense_calls"] + 2


def test_video_coords_changed_in_place_are_checked_again(caplog):
    """Mutation find: the check of `video_coords` is cached per tensor; keyed on the tensor alone (not its version
    counter), coordinates edited in place into no grid kept the stale grid and the forward ran sparse on it. After the
    edit the check names the problem and the forward runs stock, warned once per layer."""
    from videosparse.processors.grids import coords_grid

    coords = _video_coords(LATENT)
    S = LATENT[0] * LATENT[1] * LATENT[2]
    assert coords_grid(coords, S) == (LATENT, None)
    t = TestLTXProcessors()
    tr = t.make_transformer()
    inputs = dict(t.make_inputs(tr), num_frames=None, height=None, width=None, rope_interpolation_scale=None,
                  video_coords=coords)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    t.run(tr, inputs)
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == t.num_layers
    order = torch.randperm(S, generator=torch.Generator().manual_seed(3))
    coords.copy_(coords[:, :, order].clone())          # in place: the same tensor, no longer a time-major grid
    grid, problem = coords_grid(coords, S)
    assert grid is None and "do not form one time-major" in problem
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        t.run(tr, inputs, step=1)
    stats = sessions(tr)["transformer"].stats()
    assert stats["sparse_calls"] == t.num_layers and stats["dense_calls"] == t.num_layers
    assert sum("do not form one time-major" in r.getMessage() for r in caplog.records) == t.num_layers


def test_model_info_of_published_configs():
    """LTX-Video 2B (the class defaults) and 0.9.7 13B: int patch sizes, head dims 64 and 128, served layers."""
    from videosparse.processors import self_attention_processors
    from videosparse.processors.registry import model_info, model_spec

    for kwargs, expected in [({}, (28, 32, 64)),
                             (dict(num_attention_heads=32, attention_head_dim=128, cross_attention_dim=4096,
                                   num_layers=48), (48, 32, 128))]:
        with torch.device("meta"):
            tr = LTXVideoTransformer3DModel(**kwargs)
        spec = model_spec(tr)
        info = model_info(tr, spec, len(self_attention_processors(tr)))
        assert (info.num_layers, info.num_heads, info.head_dim) == expected
        assert info.patch_size == (1, 1, 1) and info.text_position == "before"     # condition tokens before the video


def build_tiny_ltx_pipeline(cls=LTXPipeline):
    """A tiny LTX pipeline of `cls` with random weights, built offline (VAE 4 x 4 x 4, 8 latent channels)."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    from videosparse.models.tiny_wan import TINY_VOCAB, build_tiny_tokenizer

    torch.manual_seed(0)
    text_encoder = T5EncoderModel(T5Config(
        vocab_size=len(TINY_VOCAB), d_model=TEXT_DIM, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    vae = AutoencoderKLLTXVideo(
        latent_channels=CHANNELS, block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4,
        layers_per_block=(1,) * 5, decoder_layers_per_block=(1,) * 5,
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4,
        patch_size=1, patch_size_t=1).eval()
    pipe = cls(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
               tokenizer=build_tiny_tokenizer(), transformer=TestLTXProcessors().make_transformer())
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("cls", ["LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline"])
def test_tiny_pipeline_end_to_end(cls):
    """Each LTX pipeline runs sparse after its dense step (one batched CFG forward per step, the step found from
    the scheduler; the image-to-video ones give the clean first frame timestep 0) and remove() restores it."""
    import diffusers
    from PIL import Image

    pipe = build_tiny_ltx_pipeline(getattr(diffusers, cls))
    kw = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=32, width=96,
              num_inference_steps=3, output_type="np", max_sequence_length=16)
    if cls != "LTXPipeline":
        kw["image"] = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 96, 3), dtype=np.uint8))

    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0)).frames

    ref = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1))
    seen = []
    with videosparse.processors.observe(pipe, lambda r: seen.append((r.step, r.grid))):
        sparse = run()
    assert sorted(set(seen)) == [(s, (3, 8, 24)) for s in range(3)]        # 9 x 32 x 96 -> latent 3 x 8 x 24
    layers = handle["transformer"].stats()["layers"]
    assert all(s["dense_calls"] == 1 and s["sparse_calls"] == 2 and s["fallbacks"] == [] for s in layers.values())
    assert np.isfinite(sparse).all() and not np.array_equal(sparse, ref)
    videosparse.remove(pipe)
    assert np.array_equal(run(), ref)


def test_tiny_condition_pipeline_serves_condition_tokens_sparse():
    """LTXConditionPipeline with an image condition at frame_index 4: its latent frame of 8 x 24 tokens goes before
    the 3 x 8 x 24 video and is served as global tiles (no fallback to dense); remove() restores the output."""
    from diffusers.pipelines.ltx.pipeline_ltx_condition import LTXVideoCondition
    from PIL import Image

    pipe = build_tiny_ltx_pipeline(LTXConditionPipeline)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 96, 3), dtype=np.uint8))
    kw = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=32, width=96,
              num_inference_steps=3, output_type="np", max_sequence_length=16,
              conditions=[LTXVideoCondition(image=image, frame_index=4)])

    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0)).frames

    ref = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1))
    seen = []
    with videosparse.processors.observe(pipe, lambda r: seen.append((r.grid, r.text_len, r.text_position))):
        sparse = run()
    assert set(seen) == {((3, 8, 24), 8 * 24, "before")}
    layers = handle["transformer"].stats()["layers"]
    assert all(s["dense_calls"] == 1 and s["sparse_calls"] == 2 and s["fallbacks"] == [] for s in layers.values())
    assert np.isfinite(sparse).all() and not np.array_equal(sparse, ref)
    videosparse.remove(pipe)
    assert np.array_equal(run(), ref)


def test_a_whole_video_condition_at_strength_below_one_steps_from_its_schedule_place():
    """LTXConditionPipeline with denoise_strength=0.5 runs schedule places 3-5 of 6; a video conditioned whole gives
    every token timestep 0, on no schedule entry, and the scheduler has not stepped at the first forward (and has
    no begin index): that forward read step 0 and ran dense with dense_steps=1 (review find). The pipeline's
    `_current_timestep` places it now."""
    from PIL import Image
    from diffusers.pipelines.ltx.pipeline_ltx_condition import LTXVideoCondition

    pipe = build_tiny_ltx_pipeline(LTXConditionPipeline)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 96, 3), dtype=np.uint8))
    videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1))
    seen = []
    with videosparse.processors.observe(pipe, lambda r: seen.append((r.step, r.dense_reason)) if r.layer == 0
                                        else None):
        pipe(prompt="a red circle", negative_prompt="blue", num_frames=9, height=32, width=96, num_inference_steps=6,
             output_type="latent", max_sequence_length=16, denoise_strength=0.5,
             conditions=[LTXVideoCondition(video=[image] * 9, frame_index=0)],
             generator=torch.Generator().manual_seed(0))
    assert seen == [(3, None), (4, None), (5, None)]
    videosparse.remove(pipe)
