"""LTX-2: the video self-attention (attn1) of the audio-video transformer, plain and perturbed (STG) processors."""

import inspect

import numpy as np
import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoAttnProcessor, LTX2PerturbedAttnProcessor
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

import videosparse
from videosparse.processors import attention_processors, sessions
from videosparse.processors.registry import model_spec
from videosparse.processors.ltx2 import (
    LTX2PerturbedSparseAttnProcessor,
    LTX2SparseAttnProcessor,
    ltx2_grid,
)

from tester import (
    ProcessorTesterMixin,
    apply_and_list_served,
    assert_runs_stock_with_one_warning,
    check_blocks_attn1_served,
    check_extra_tokens_served_as_global_tiles,
)

CHANNELS, AUDIO_CHANNELS, AUDIO_LEN, TEXT, TEXT_DIM = 8, 8, 10, 8, 16
LATENT = (3, 7, 18)          # latent frames x height x width: 378 tokens, a partial last tile of 64


def tiny_ltx2(head_dim=64, num_layers=2, **kwargs):
    """A tiny LTX2VideoTransformer3DModel: 2 video heads of `head_dim` (the served attention), 2 audio heads of 16."""
    torch.manual_seed(0)
    config = dict(
        in_channels=CHANNELS, out_channels=CHANNELS, num_attention_heads=2, attention_head_dim=head_dim,
        cross_attention_dim=2 * head_dim, audio_in_channels=AUDIO_CHANNELS, audio_out_channels=AUDIO_CHANNELS,
        audio_num_attention_heads=2, audio_attention_head_dim=16, audio_cross_attention_dim=32, num_layers=num_layers,
        caption_channels=TEXT_DIM,
    )
    return LTX2VideoTransformer3DModel(**dict(config, **kwargs)).eval()


def ltx2_inputs(transformer, latent=LATENT, batch=1, coords=False, sizes=True, seed=1):
    """As LTX2Pipeline calls its transformer: packed video latents, packed audio latents, the connector's text states
    for both streams with its mask, the latent sizes and (coords=True) the video / audio RoPE coordinates."""
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    p, pt = cfg.patch_size, cfg.patch_size_t
    video = torch.randn(batch, cfg.in_channels // (p * p * pt), *latent, generator=g)
    inputs = dict(
        hidden_states=LTX2Pipeline._pack_latents(video, p, pt),
        audio_hidden_states=torch.randn(batch, AUDIO_LEN, AUDIO_CHANNELS, generator=g),
        encoder_hidden_states=torch.randn(batch, TEXT, TEXT_DIM, generator=g),
        audio_encoder_hidden_states=torch.randn(batch, TEXT, TEXT_DIM, generator=g),
        timestep=torch.tensor([500.0] * batch),
        encoder_attention_mask=torch.ones(batch, TEXT, dtype=torch.long),
        audio_encoder_attention_mask=torch.ones(batch, TEXT, dtype=torch.long),
        audio_num_frames=AUDIO_LEN, fps=25.0,
    )
    if sizes:
        inputs.update(num_frames=latent[0], height=latent[1], width=latent[2])
    if coords:
        inputs["video_coords"] = transformer.rope.prepare_video_coords(batch, *latent, "cpu", fps=25.0)
    return inputs


class TestLTX2Processors(ProcessorTesterMixin):
    """LTX-2 as the class defaults build it (interleaved RoPE, no gates, plain processor), at a tiny size."""

    def make_transformer(self):
        return tiny_ltx2(self.head_dim, self.num_layers)

    def make_inputs(self, transformer):
        return ltx2_inputs(transformer)


class TestLTX2GatedPerturbedProcessors(ProcessorTesterMixin):
    """The LTX-2.x options: split RoPE, per-head gates, perturbed (STG) processors, prompt modulation; the pipeline's
    inputs with video_coords (which then define the RoPE and the grid)."""

    def make_transformer(self):
        tr = tiny_ltx2(self.head_dim, self.num_layers, rope_type="split", gated_attn=True, audio_gated_attn=True,
                       perturbed_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True)
        with torch.no_grad():       # gates away from 1 (zero logits would make them the identity)
            for block in tr.transformer_blocks:
                block.attn1.to_gate_logits.weight.normal_(0.0, 0.5)
        return tr

    def make_inputs(self, transformer):
        return dict(ltx2_inputs(transformer, coords=True), sigma=torch.tensor([0.5]))


def test_pack_latents_is_time_major():
    """The token order the layout assumes: LTX2Pipeline._pack_latents flattens the patch grid (f, h, w) time-major, in
    the order of prepare_video_coords (patch 2 x 2 spatially, 1 in time)."""
    F, H, W = 3, 4, 6
    ids = torch.arange(F * H * W, dtype=torch.float32).view(F, H, W)
    latents = ids.repeat_interleave(2, 1).repeat_interleave(2, 2).expand(1, 1, F, 2 * H, 2 * W)
    packed = LTX2Pipeline._pack_latents(latents, 2, 1)                 # (1, S, 1 * 2 * 2)
    assert torch.equal(packed[0, :, 0], torch.arange(F * H * W, dtype=torch.float32))
    tr = tiny_ltx2(num_layers=1, patch_size=2, in_channels=4 * CHANNELS, out_channels=4 * CHANNELS)
    starts = tr.rope.prepare_video_coords(1, F, 2 * H, 2 * W, "cpu")[0, :, :, 0]     # patch starts, pixel units
    _, h, w = (i.flatten() for i in torch.meshgrid(torch.arange(F), torch.arange(H), torch.arange(W), indexing="ij"))
    assert torch.equal(starts[1], h * 2 * 32.0) and torch.equal(starts[2], w * 2 * 32.0)     # VAE 32, patch 2
    assert torch.equal(torch.unique_consecutive(starts[0], return_counts=True)[1], torch.full((F,), H * W))


def test_only_video_self_attention_is_served():
    t = TestLTX2Processors()
    tiny = t.make_transformer()
    is_video_self_attention = model_spec(tiny).is_self_attention
    assert not is_video_self_attention("transformer_blocks.0.audio_attn1", tiny.transformer_blocks[0].audio_attn1)
    tr, before, records, _, _ = check_blocks_attn1_served(t, LTX2AudioVideoAttnProcessor)
    served = [p for n, p in tr.attn_processors.items() if n.endswith(".attn1.processor") and "audio" not in n]
    assert len(served) == t.num_layers and all(type(p) is LTX2SparseAttnProcessor for p in served)
    assert len(before) == 6 * t.num_layers          # audio_attn1, attn2, audio_attn2, a2v, v2a stay stock
    r = records[0]
    assert r.grid == LATENT and r.text_len == 0 and r.text_position == "after" and r.q.shape == (1, 378, 2, 64)


def test_perturbed_model_serves_perturbed_processors():
    t = TestLTX2GatedPerturbedProcessors()
    tr = t.make_transformer()
    before, served = apply_and_list_served(tr, videosparse.DenseConfig())
    assert served == [f"transformer_blocks.{i}.attn1.processor" for i in range(t.num_layers)]
    assert all(type(before[n]) is LTX2PerturbedAttnProcessor for n in before)
    assert all(type(tr.attn_processors[n]) is LTX2PerturbedSparseAttnProcessor for n in served)


@pytest.mark.parametrize("perturb", ["all", "part"])
def test_spatio_temporal_guidance_equals_stock(perturb):
    """STG at block 0 of a perturbed model, whole forward at density 1 vs stock: the whole batch perturbed (the
    forward's default mask) skips attention in that layer (no call counted) and passes the values on; a partial mask
    blends the sparse attention with the values. Bit-exactness of one call: `test_perturbed_call_equals_stock`."""
    t = TestLTX2GatedPerturbedProcessors()
    tr = t.make_transformer()
    if perturb == "all":
        inputs = dict(t.make_inputs(tr), spatio_temporal_guidance_blocks=[0])
    else:
        inputs = {k: torch.cat([v, v]) if torch.is_tensor(v) else v for k, v in t.make_inputs(tr).items()}
        inputs.update(spatio_temporal_guidance_blocks=[0], perturbation_mask=torch.tensor([0.0, 1.0]))
    ref = t.run(tr, inputs)
    assert not torch.equal(ref, t.run(tr, dict(inputs, spatio_temporal_guidance_blocks=None)))   # STG acts
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    out = t.run(tr, inputs)
    layers = sessions(tr)["transformer"].stats()["layers"]
    assert (out - ref).abs().max() <= 1e-5
    assert layers[0]["sparse_calls"] == (0 if perturb == "all" else 1) and layers[0]["dense_calls"] == 0
    assert layers[1]["sparse_calls"] == 1


@pytest.mark.parametrize("all_perturbed", [None, True, False])
def test_perturbed_call_equals_stock(all_perturbed):
    """One perturbed attn1 call, sparse processor vs stock: all-perturbed (the flag, or a zero mask with the flag
    unset) passes the gated values on bit for bit; a mixed mask blends attention (density 1) with the values."""
    t = TestLTX2GatedPerturbedProcessors()
    tr = t.make_transformer()
    inputs = {k: torch.cat([v, v]) if torch.is_tensor(v) else v for k, v in t.make_inputs(tr).items()}
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    t.run(tr, inputs)                                          # records the grid, builds the layouts
    attn = tr.transformer_blocks[0].attn1
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 378, 128, generator=g)
    rope = tr.rope(inputs["video_coords"])
    mask = torch.zeros(2, 1, 1) if all_perturbed is not False else torch.tensor([0.0, 1.0])[:, None, None]
    with torch.no_grad():
        out = attn.processor(attn, hidden, None, None, rope, None, mask, all_perturbed)
        ref = LTX2PerturbedAttnProcessor()(attn, hidden, None, None, rope, None, mask, all_perturbed)
    if all_perturbed is False:
        assert (out - ref).abs().max() <= 1e-5 and not torch.equal(out[0], out[1])
    else:
        assert torch.equal(out, ref)


def test_a_zero_perturbation_mask_skips_attention():
    """Mutation find: with `all_perturbed` unset, an all-zero `perturbation_mask` (every item perturbed) must skip the
    attention as stock does (its output is the values, bit for bit, either way): no attention call is made or
    counted, and no observer record is made; a mask with one unperturbed item still attends."""
    t = TestLTX2GatedPerturbedProcessors()
    tr = t.make_transformer()
    inputs = {k: torch.cat([v, v]) if torch.is_tensor(v) else v for k, v in t.make_inputs(tr).items()}
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    t.run(tr, inputs)                                          # records the grid, builds the layouts
    session = sessions(tr)["transformer"]
    attn = tr.transformer_blocks[0].attn1
    hidden = torch.randn(2, 378, 128, generator=torch.Generator().manual_seed(3))
    rope = tr.rope(inputs["video_coords"])
    for mask, calls in ((torch.zeros(2, 1, 1), 0), (torch.tensor([0.0, 1.0])[:, None, None], 1)):
        before, records = session.stats()["sparse_calls"], []
        with torch.no_grad(), videosparse.observe(tr, records.append):
            out = attn.processor(attn, hidden, None, None, rope, None, mask, None)
            ref = LTX2PerturbedAttnProcessor()(attn, hidden, None, None, rope, None, mask, None)
        assert session.stats()["sparse_calls"] - before == calls and len(records) == calls
        assert (out - ref).abs().max() <= 1e-5


def test_size_grid_is_the_ceil_of_size_over_patch():
    """Mutation find: the grid from the latent sizes must count the patches `prepare_video_coords` lays out, a
    partial patch included (ceil of size / patch); floored, a patch-2 model at odd latent sizes ran dense with "not
    the 3 x 6 x 17 patches". The released models use patch 1, where both agree."""
    tr = tiny_ltx2(num_layers=1, patch_size=2, in_channels=4 * CHANNELS, out_channels=4 * CHANNELS)
    F, H, W = 3, 13, 35                                        # 3 x ceil(13 / 2) x ceil(35 / 2) = 3 x 7 x 18
    coords = tr.rope.prepare_video_coords(1, F, H, W, "cpu", fps=25.0)
    assert coords.shape[2] == 378
    hidden = torch.zeros(1, 378, 4 * CHANNELS)
    assert ltx2_grid(tr, (), dict(hidden_states=hidden, video_coords=coords)) == ((3, 7, 18), 0, None)
    assert ltx2_grid(tr, (), dict(hidden_states=hidden, num_frames=F, height=H, width=W)) == ((3, 7, 18), 0, None)


def test_video_coords_give_the_grid_of_the_sizes():
    """A forward with video_coords only (the DFR pipelines) records the grid of one with num_frames/height/width only,
    and so does one with both (LTX2Pipeline); each runs sparse and equals stock at density 1."""
    t = TestLTX2Processors()
    tr = t.make_transformer()
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    session = sessions(tr)["transformer"]
    for coords, sizes in [(False, True), (True, False), (True, True)]:
        inputs = ltx2_inputs(tr, coords=coords, sizes=sizes)
        out = t.run(tr, inputs)
        assert session.context.grid == LATENT and session.context.unsupported is None
        videosparse.remove(tr)
        assert (out - t.run(tr, inputs)).abs().max() <= 1e-5
        videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
        session = sessions(tr)["transformer"]
        assert session.calls == 0
    assert ltx2_grid(tr, (), ltx2_inputs(tr, coords=True, sizes=False)) == (LATENT, 0, None)


def test_grid_is_in_patches():
    """Spatial patch 2: the grid is the patch grid, from the latent sizes and from the coordinates alike, and a
    forward runs sparse on it."""
    tr = tiny_ltx2(num_layers=1, patch_size=2, in_channels=4 * CHANNELS, out_channels=4 * CHANNELS)
    latent = (3, 14, 36)
    assert ltx2_grid(tr, (), ltx2_inputs(tr, latent)) == ((3, 7, 18), 0, None)
    assert ltx2_grid(tr, (), ltx2_inputs(tr, latent, coords=True, sizes=False)) == ((3, 7, 18), 0, None)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64))
    with torch.no_grad():
        tr(**ltx2_inputs(tr, latent, coords=True), return_dict=False)
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 1


def test_grid_arguments():
    t = TestLTX2Processors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    assert ltx2_grid(tr, (), inputs) == (LATENT, 0, None)
    params = list(inspect.signature(type(tr).forward).parameters)[1:]
    positional = tuple(inputs.get(name) for name in params[:params.index("width") + 1])
    assert ltx2_grid(tr, positional, {}) == (LATENT, 0, None)                     # positional, as in the signature
    grid, text_len, problem = ltx2_grid(tr, (inputs["hidden_states"],), {"num_frames": 3})
    assert grid == (1, 1, 378) and text_len == 0 and "were not all given" in problem
    assert "not the 2 x 7 x 18 patches" in ltx2_grid(tr, (), dict(inputs, num_frames=2))[2]
    coords = ltx2_inputs(tr, coords=True)["video_coords"]
    assert "for each of the 378 tokens" in ltx2_grid(tr, (), dict(inputs, video_coords=coords[:, :2]))[2]
    assert ltx2_grid(tr, (), dict(inputs, video_coords=coords.mean(dim=3)))[0] == LATENT    # (B, 3, S) positions


def test_coordinates_are_checked_once_per_tensor(monkeypatch):
    """The pipelines pass the same video_coords tensor at every step: it is checked (one host sync) once, and again
    only after an in-place change."""
    from videosparse.processors import grids

    calls = []
    real = grids.check_coords
    monkeypatch.setattr(grids, "check_coords", lambda *a: calls.append(1) or real(*a))
    tr = tiny_ltx2(num_layers=1)
    inputs = ltx2_inputs(tr, coords=True)
    for _ in range(3):
        assert ltx2_grid(tr, (), inputs)[0] == LATENT
    assert len(calls) == 1
    inputs["video_coords"][:, 0, :3] += 100.0
    assert "do not form one time-major" in ltx2_grid(tr, (), inputs)[2] and len(calls) == 2


def with_keyframe(transformer, inputs: dict) -> dict:
    """`inputs` with one single-frame keyframe condition appended after the video, as LTX2ConditionPipeline does:
    its latent tokens after the video's and its coordinates (at pixel frame 5) after theirs."""
    keyframe = transformer.rope.prepare_video_coords(1, 1, *LATENT[1:], "cpu", fps=25.0)
    keyframe[:, 0, :, 0], keyframe[:, 0, :, 1] = 5 / 25, 6 / 25
    g = torch.Generator().manual_seed(2)
    return dict(inputs, hidden_states=torch.cat([inputs["hidden_states"],
                                                 torch.randn(1, keyframe.shape[2], CHANNELS, generator=g)], dim=1),
                video_coords=torch.cat([inputs["video_coords"], keyframe], dim=2))


def test_appended_keyframe_tokens_are_served_as_global_tiles(caplog):
    """LTX2ConditionPipeline's keyframe tokens after the video (with the video's latent sizes given): the video grid
    is the first tokens', the keyframe tokens are global tiles (every video tile attends to them, they to all):
    density 1 equals stock, a sparse density runs sparse on every layer with no fallback."""
    t = TestLTX2Processors()
    tr = t.make_transformer()
    inputs = with_keyframe(tr, ltx2_inputs(tr, coords=True))
    extra = inputs["hidden_states"].shape[1] - 378
    assert ltx2_grid(tr, (), inputs) == (LATENT, extra, None)
    check_extra_tokens_served_as_global_tiles(t, tr, inputs, LATENT, extra, "after", caplog)


@pytest.mark.parametrize("case", ["mask", "appended", "batch"])
def test_unsupported_forwards_run_stock_with_one_warning(case, caplog):
    """A video self-attention mask (IC-LoRA), tokens appended after the video without the video's latent sizes, or
    coordinates that differ across the batch: every attn1 call runs the stock processor (no observer records),
    warned once per layer over two forwards, and the output is stock's."""
    t = TestLTX2Processors()
    tr = t.make_transformer()
    inputs = ltx2_inputs(tr, coords=True)
    S = inputs["hidden_states"].shape[1]
    if case == "mask":
        mask = torch.ones(1, S, S)
        mask[:, :, -50:] = 0.5
        inputs["video_self_attention_mask"] = mask
        expected = "an attention mask was given"
    elif case == "appended":        # without the video's sizes the appended tokens cannot be told from the video
        inputs = with_keyframe(tr, ltx2_inputs(tr, coords=True, sizes=False))
        expected = "do not form one time-major"
    else:
        inputs = {k: torch.cat([v, v]) if torch.is_tensor(v) else v for k, v in inputs.items()}
        inputs["video_coords"][1, 0] += 1.0
        expected = "differ across the batch"
    assert_runs_stock_with_one_warning(t, tr, inputs, expected, caplog)


def test_model_info_of_the_published_config():
    """LTX-2 19B (the class defaults, as diffusers' conversion script and Lightricks/LTX-2 configure it): 48 served
    layers of 32 heads x 128, patch 1 x 1 x 1, condition tokens appended after the video served as global tiles."""
    from videosparse.processors import self_attention_processors
    from videosparse.processors.registry import model_info, model_spec

    with torch.device("meta"):
        tr = LTX2VideoTransformer3DModel(rope_type="split")
    served = self_attention_processors(tr)
    assert served == [f"transformer_blocks.{i}.attn1.processor" for i in range(48)]
    info = model_info(tr, model_spec(tr), len(served))
    assert (info.num_layers, info.num_heads, info.head_dim, info.patch_size, info.text_position) == (
        48, 32, 128, (1, 1, 1), "after")          # appended keyframe-condition tokens: global tiles after the video
    assert len(attention_processors(tr)) == 6 * 48


def build_tiny_ltx2_pipeline(**transformer_kwargs):
    """A tiny LTX2Pipeline with random weights, built offline: T5 text encoder (32 wide, 1 layer) and word-level
    tokenizer in place of Gemma 3, connectors 4 x 8, video VAE 4 x 4 x 4 (4 latent channels), audio VAE (2 latent
    channels, 8 mel bins) and vocoder at diffusers' test sizes."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import T5Config, T5EncoderModel

    from videosparse.models.tiny_wan import TINY_VOCAB, build_tiny_tokenizer

    torch.manual_seed(0)
    text_encoder = T5EncoderModel(T5Config(
        vocab_size=len(TINY_VOCAB), d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    connectors = LTX2TextConnectors(
        caption_channels=32, text_proj_in_factor=2, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_type="split").eval()
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
        layers_per_block=(1, 1), decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(False,) * 3,
        downsample_type=("spatiotemporal", "spatial"), upsample_residual=(False, False), upsample_factor=(1, 1),
        timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False).eval()
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8).eval()
    vocoder = LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
        resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000).eval()
    torch.manual_seed(0)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64, cross_attention_dim=128,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=8,
        audio_cross_attention_dim=16, num_layers=2, caption_channels=32, **transformer_kwargs).eval()
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=build_tiny_tokenizer(), connectors=connectors,
                        transformer=transformer, vocoder=vocoder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_tiny_pipeline_end_to_end():
    """LTX2Pipeline with its default guidance (batched CFG forward, STG forward perturbing block 1, modality-isolation
    forward each step): after the dense first step every video attn1 runs sparse in every branch except the STG
    forward's perturbed block (no attention there), with no fallback; remove() restores the output exactly."""
    pipe = build_tiny_ltx2_pipeline(rope_type="split", perturbed_attn=True, gated_attn=True)
    kw = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=32, width=128,
              frame_rate=25.0, num_inference_steps=3, spatio_temporal_guidance_blocks=[1], max_sequence_length=16,
              output_type="np")

    def run():
        out = pipe(**kw, generator=torch.Generator().manual_seed(0))
        return out.frames, out.audio

    ref, ref_audio = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1))
    seen = []
    with videosparse.processors.observe(pipe, lambda r: seen.append((r.step, r.branch, r.layer, r.grid))):
        sparse, sparse_audio = run()
    branches = ("cond_uncond", "uncond_stg", "uncond_modality")
    assert {(s, b) for s, b, _, _ in seen} == {(s, b) for s in range(3) for b in branches}
    assert {g for *_, g in seen} == {(3, 8, 32)}                            # 9 x 32 x 128 -> latent 3 x 8 x 32
    assert ("uncond_stg", 1) not in {(b, layer) for _, b, layer, _ in seen}  # the perturbed block skips attention
    layers = handle["transformer"].stats()["layers"]
    assert layers[0]["dense_calls"] == 3 and layers[0]["sparse_calls"] == 6 and layers[0]["fallbacks"] == []
    assert layers[1]["dense_calls"] == 2 and layers[1]["sparse_calls"] == 4 and layers[1]["fallbacks"] == []
    assert np.isfinite(sparse).all() and not np.array_equal(sparse, ref)
    videosparse.remove(pipe)
    frames, audio = run()
    assert np.array_equal(frames, ref) and torch.equal(audio, ref_audio)


def test_tiny_condition_pipeline_serves_keyframe_tokens_sparse():
    """LTX2ConditionPipeline with a keyframe condition at latent frame 1: its 1 x 8 x 32 keyframe tokens are appended
    after the 3 x 8 x 32 video, and are served as global tiles (no fallback to dense); remove() restores the output."""
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2ConditionPipeline, LTX2VideoCondition

    base = build_tiny_ltx2_pipeline(rope_type="split")
    pipe = LTX2ConditionPipeline(**{name: getattr(base, name) for name in (
        "scheduler", "vae", "audio_vae", "text_encoder", "tokenizer", "connectors", "transformer", "vocoder")})
    pipe.set_progress_bar_config(disable=True)
    keyframe = LTX2VideoCondition(frames=torch.rand(3, 32, 128, generator=torch.Generator().manual_seed(3)), index=1,
                                  crf=0)
    kw = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=32, width=128,
              frame_rate=25.0, num_inference_steps=3, max_sequence_length=16, output_type="np", conditions=[keyframe])

    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0)).frames

    ref = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1))
    seen = []
    with videosparse.processors.observe(pipe, lambda r: seen.append((r.grid, r.text_len, r.q.shape[1]))):
        sparse = run()
    assert set(seen) == {((3, 8, 32), 256, 3 * 8 * 32 + 256)}
    for layer in handle["transformer"].stats()["layers"].values():
        assert layer["dense_calls"] == 3 and layer["sparse_calls"] == 6 and layer["fallbacks"] == []
    assert np.isfinite(sparse).all() and not np.array_equal(sparse, ref)
    videosparse.remove(pipe)
    assert np.array_equal(run(), ref)
