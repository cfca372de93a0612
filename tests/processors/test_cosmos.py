"""NVIDIA Cosmos (CosmosTransformer3DModel): video-only attn1 with (B, H, S, D) qk-norm and RoPE; attn2 stock.

The tiny models leave out the padding-mask channel (`concat_padding_mask=False`): the forward resizes that mask with
torchvision, which is not a videosparse dependency. It is one more input channel of the patch embedding, no token.
"""

import logging

import numpy as np
import pytest
import torch
from diffusers import CosmosTransformer3DModel
from diffusers.models.transformers.transformer_cosmos import (
    CosmosAttention,
    CosmosAttnProcessor2_0,
    CosmosAttnProcessor2_5,
    CosmosPatchEmbed,
)
from tester import ProcessorTesterMixin, apply_and_list_served, check_blocks_attn1_served, with_cache_context

import videosparse
from videosparse.processors import attention_processors, sessions
from videosparse.processors.cosmos import CosmosSparseAttnProcessor

CHANNELS, TEXT, TEXT_IN, TEXT_DIM = 4, 8, 48, 32
LATENT = (3, 14, 36)         # latent frames x height x width -> patches 3 x 7 x 18 = 378 tokens, a partial last tile
GRID = (3, 7, 18)


def tiny_cosmos(num_layers=2, head_dim=64, **kwargs):
    """A tiny CosmosTransformer3DModel shaped like Cosmos-Predict2.5 (condition-mask input channel, cross-attention
    projection of the text encoder's stacked states, no learnable position embedding, RoPE scale (1, 3, 3))."""
    config = dict(in_channels=CHANNELS + 1, out_channels=CHANNELS, num_attention_heads=2, attention_head_dim=head_dim,
                  num_layers=num_layers, mlp_ratio=2.0, text_embed_dim=TEXT_DIM, adaln_lora_dim=16,
                  rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=False, extra_pos_embed_type=None,
                  use_crossattn_projection=True, crossattn_proj_in_channels=TEXT_IN,
                  encoder_hidden_states_channels=TEXT_DIM)
    config.update(kwargs)
    torch.manual_seed(0)
    return CosmosTransformer3DModel(**config).eval()


def predict25_inputs(batch=1, cond_frames=1):
    """As Cosmos2_5_PredictBasePipeline calls its transformer: latents with the conditioning frames, the condition
    mask, per-frame timesteps [B, 1, T, 1, 1] (the conditioning frames at 1e-4) and the stacked text states."""
    g = torch.Generator().manual_seed(1)
    T, H, W = LATENT
    indicator = torch.zeros(batch, 1, T, 1, 1)
    indicator[:, :, :cond_frames] = 1.0
    return dict(
        hidden_states=torch.randn(batch, CHANNELS, T, H, W, generator=g),
        condition_mask=indicator.expand(-1, -1, -1, H, W),
        timestep=indicator * 1e-4 + (1 - indicator) * 0.6,
        encoder_hidden_states=torch.randn(batch, TEXT, TEXT_IN, generator=g),
    )


class TestCosmosProcessors(ProcessorTesterMixin):
    """Cosmos-Predict2.5-like: patch (1, 2, 2), per-head RMSNorm and RoPE in (B, H, S, D); video-only attn1."""

    def make_transformer(self):
        return with_cache_context(tiny_cosmos(self.num_layers, self.head_dim))

    def make_inputs(self, transformer):
        return predict25_inputs()


def test_sparse_runs_on_attn1_only():
    tr, _, records, _, _ = check_blocks_attn1_served(TestCosmosProcessors(), CosmosAttnProcessor2_0)
    assert all(isinstance(p, CosmosSparseAttnProcessor) for n, p in attention_processors(tr).items() if "attn1" in n)
    r = records[0]
    assert r.grid == GRID and r.text_len == 0 and r.text_position is None and r.q.shape == (1, 378, 2, 64)


def test_patch_embed_and_rope_are_time_major():
    """The token order the layout assumes: CosmosPatchEmbed + the forward's flatten(1, 3) put patch (t, h, w) at
    t*H*W + h*W + w, and the RoPE tables follow the same order (time angles vary with t only, height with h, width
    with w)."""
    T, H, W = GRID
    pt, ph, pw = 1, 2, 2
    index = torch.arange(T * H * W, dtype=torch.float32).view(T, H, W)
    pixels = index.repeat_interleave(ph, 1).repeat_interleave(pw, 2)[None, None]      # each patch holds its index
    embed = CosmosPatchEmbed(1, 1, (pt, ph, pw), bias=False)
    with torch.no_grad():
        embed.proj.weight.fill_(1.0 / (pt * ph * pw))                                   # the mean of the patch
        tokens = embed(pixels).flatten(1, 3)                                            # as the forward does
    assert torch.equal(tokens[0, :, 0], torch.arange(T * H * W, dtype=torch.float32))

    tr = tiny_cosmos(num_layers=1)
    cos, _ = tr.rope(torch.zeros(1, CHANNELS + 1, *LATENT), fps=16)
    rope = tr.rope
    cos = cos.view(T, H, W, -1)[..., : cos.shape[-1] // 2]                              # [t | h | w] angles, twice
    t_part, h_part, w_part = cos.split([rope.dim_t // 2, rope.dim_h // 2, rope.dim_w // 2], dim=-1)
    assert torch.equal(t_part, t_part[:, :1, :1].expand_as(t_part)) and not torch.equal(t_part[0], t_part[1])
    assert torch.equal(h_part, h_part[:1, :, :1].expand_as(h_part)) and not torch.equal(h_part[:, 0], h_part[:, 1])
    assert torch.equal(w_part, w_part[:1, :1, :].expand_as(w_part)) and not torch.equal(w_part[..., 0, :],
                                                                                        w_part[..., 1, :])


def test_grid_from_hidden_states_and_patch_size():
    from videosparse.processors.cosmos import cosmos_grid

    tr = tiny_cosmos(num_layers=1)
    inputs = predict25_inputs()
    assert cosmos_grid(tr, (), inputs) == (GRID, 0)
    assert cosmos_grid(tr, (inputs["hidden_states"],), {}) == (GRID, 0)
    wide = tiny_cosmos(num_layers=1, patch_size=(1, 1, 2))
    assert cosmos_grid(wide, (), inputs) == ((3, 14, 18), 0)


@pytest.mark.parametrize("variant", ["cosmos1", "transfer25"])
def test_other_configs_serve_attn1_and_keep_attn2_stock(variant):
    """Cosmos 1.0 Video2World (learnable position embedding, one timestep, fps; with a text mask, which the forward
    gives attn2 only) and Transfer2.5 (attn2 a CosmosAttention over text and image context with CosmosAttnProcessor2_5,
    controlnet residuals added to the tokens): attn1 is served and runs sparse, density 1 equals stock, attn2 keeps its
    processor."""
    g = torch.Generator().manual_seed(2)
    T, H, W = LATENT
    S = T * (H // 2) * (W // 2)
    if variant == "cosmos1":
        tr = with_cache_context(tiny_cosmos(extra_pos_embed_type="learnable", use_crossattn_projection=False,
                                            rope_scale=(2.0, 1.0, 1.0)))
        mask = torch.arange(TEXT)[None] < 5                      # the valid text tokens, for attn2
        inputs = dict(hidden_states=torch.randn(1, CHANNELS, T, H, W, generator=g), timestep=torch.tensor([0.5]),
                      encoder_hidden_states=torch.randn(1, TEXT, TEXT_DIM, generator=g), attention_mask=mask,
                      fps=24, condition_mask=torch.zeros(1, 1, T, H, W))
        attn2_type = CosmosAttnProcessor2_0
    else:
        tr = with_cache_context(tiny_cosmos(img_context_dim_in=24, img_context_num_tokens=4,
                                            img_context_dim_out=128, controlnet_block_every_n=1))
        assert isinstance(tr.transformer_blocks[0].attn2, CosmosAttention)
        inputs = dict(predict25_inputs(),
                      encoder_hidden_states=(torch.randn(1, TEXT, TEXT_IN, generator=g),
                                             torch.randn(1, 4, 24, generator=g)),
                      block_controlnet_hidden_states=[0.1 * torch.randn(1, S, 128, generator=g) for _ in range(2)])
        attn2_type = CosmosAttnProcessor2_5
    t = TestCosmosProcessors()
    ref = t.run(tr, inputs)
    before, served = apply_and_list_served(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert served == [f"transformer_blocks.{i}.attn1.processor" for i in range(2)]
    assert all(type(before[f"transformer_blocks.{i}.attn2.processor"]) is attn2_type for i in range(2))
    assert all(attention_processors(tr)[f"transformer_blocks.{i}.attn2.processor"] is
               before[f"transformer_blocks.{i}.attn2.processor"] for i in range(2))
    out = t.run(tr, inputs)
    assert (out - ref).abs().max() <= 1e-5
    s = sessions(tr)["transformer"].stats()
    assert s["sparse_calls"] == 2 and s["dense_calls"] == 0
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    assert torch.isfinite(t.run(tr, inputs)).all() and sessions(tr)["transformer"].stats()["density"] < 0.7


def test_masked_call_runs_stock_with_one_warning(caplog):
    """The model never gives attn1 a mask; a caller that does gets the stock processor's output (no observer
    records), warned once per layer; a cross-attention call goes to the stock processor untouched."""
    t = TestCosmosProcessors()
    tr = t.make_transformer()
    attn = tr.transformer_blocks[0].attn1
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 378, 128, generator=g)
    rope = tr.rope(torch.zeros(1, CHANNELS + 1, *LATENT))
    mask = torch.rand(1, 1, 1, 378, generator=g) > 0.3
    context = torch.randn(1, TEXT, 128, generator=g)
    with torch.no_grad():
        ref = attn(x, attention_mask=mask, image_rotary_emb=rope)
        ref_cross = attn(x, encoder_hidden_states=context)
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
        session = sessions(tr)["transformer"]
        session.context.grid = GRID
        session.prepare(GRID, 0, torch.device("cpu"), torch.float32)
        records = []
        with caplog.at_level(logging.WARNING, logger="videosparse"):
            session.observers.append(records.append)
            outs = [attn(x, attention_mask=mask, image_rotary_emb=rope) for _ in range(2)]
            cross = attn(x, encoder_hidden_states=context)
    assert all(torch.equal(o, ref) for o in outs) and torch.equal(cross, ref_cross) and records == []
    warnings = [r.getMessage() for r in caplog.records if "runs dense" in r.getMessage()]
    assert len(warnings) == 1 and "an attention mask was given" in warnings[0]
    assert session.stats()["layers"][0]["dense_calls"] == 2          # the cross-attention call is not counted


def test_model_info_of_published_configs():
    """Cosmos-Predict2.5 2B and 14B (scripts/convert_cosmos_to_diffusers.py): heads, head dim, served layers; attn1
    has as many key/value heads as query heads (the class has no kv-heads setting)."""
    from videosparse.processors import self_attention_processors
    from videosparse.processors.registry import model_info, model_spec

    common = dict(in_channels=17, out_channels=16, attention_head_dim=128, rope_scale=(1.0, 3.0, 3.0),
                  extra_pos_embed_type=None, use_crossattn_projection=True, crossattn_proj_in_channels=100352,
                  encoder_hidden_states_channels=1024)
    for heads, layers in [(16, 28), (40, 36)]:
        with torch.device("meta"):
            tr = CosmosTransformer3DModel(num_attention_heads=heads, num_layers=layers, **common)
        info = model_info(tr, model_spec(tr), len(self_attention_processors(tr)))
        assert (info.num_layers, info.num_heads, info.head_dim) == (layers, heads, 128)
        assert info.patch_size == (1, 2, 2) and info.text_position is None
        attn1 = tr.transformer_blocks[0].attn1
        assert attn1.to_k.out_features == attn1.to_v.out_features == attn1.to_q.out_features == heads * 128


class _SafetyCheckerStub(torch.nn.Module):
    """Stands in for cosmos_guardrail's CosmosSafetyChecker (not installable here): passes text and video through."""

    device = torch.device("cpu")
    dtype = torch.float32

    def check_text_safety(self, prompt):
        return True

    def check_video_safety(self, video):
        return video


def _tiny_wan_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, z_dim=CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=[0.0] * CHANNELS,
                            latents_std=[1.0] * CHANNELS).eval()


def build_tiny_cosmos2_pipeline():
    """A tiny Cosmos2VideoToWorldPipeline with random weights, built offline: T5 (dim 32) and the tiny word-level
    tokenizer, Wan VAE (4 latent channels, 4 x 8 x 8), a Cosmos-Predict2-like transformer, a safety checker stub."""
    from diffusers import Cosmos2VideoToWorldPipeline, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    from videosparse.models.tiny_wan import TINY_VOCAB, build_tiny_tokenizer

    torch.manual_seed(0)
    text_encoder = T5EncoderModel(T5Config(
        vocab_size=len(TINY_VOCAB), d_model=TEXT_DIM, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    pipe = Cosmos2VideoToWorldPipeline(
        text_encoder=text_encoder, tokenizer=build_tiny_tokenizer(), vae=_tiny_wan_vae(),
        transformer=tiny_cosmos(use_crossattn_projection=False),
        scheduler=FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True), safety_checker=_SafetyCheckerStub())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_tiny_cosmos25_pipeline():
    """A tiny Cosmos2_5_PredictBasePipeline with random weights, built offline: Qwen2.5-VL (2 layers of width 16, whose
    stacked hidden states, 2 x 16, the transformer projects) with the tiny word-level tokenizer and a plain chat
    template, Wan VAE, a Cosmos-Predict2.5-like transformer, the flow UniPC scheduler, a safety checker stub."""
    from diffusers import UniPCMultistepScheduler
    from diffusers.pipelines.cosmos.pipeline_cosmos2_5_predict import Cosmos2_5_PredictBasePipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from videosparse.models.tiny_wan import TINY_VOCAB, build_tiny_tokenizer

    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(TINY_VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0,
                         bos_token_id=1, eos_token_id=1, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                           patch_size=2, spatial_merge_size=1, temporal_patch_size=1, fullatt_block_indexes=[0]),
    )).eval()
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% for c in m['content'] %}{{ c['text'] }} {% endfor %}"
                               "{% endfor %}")
    pipe = Cosmos2_5_PredictBasePipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=tiny_cosmos(crossattn_proj_in_channels=2 * 16),
        vae=_tiny_wan_vae(), safety_checker=_SafetyCheckerStub(),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=1.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(height=64, width=256):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8))


PIPE_KW = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=64, width=256,
               num_inference_steps=3, output_type="np", max_sequence_length=16)
PIPE_GRID = (3, 4, 16)             # 9 x 64 x 256 -> latent 3 x 8 x 32 -> patches 3 x 4 x 16 = 192 tokens


def _tiny_pipeline(name: str):
    """(pipeline, its call's keyword arguments): Cosmos-Predict2 image to world, or Cosmos-Predict2.5 text to world
    (its image and video modes convert the frames with torchvision, which is not a videosparse dependency)."""
    if name == "predict2":
        return build_tiny_cosmos2_pipeline(), dict(PIPE_KW, image=_image())
    return build_tiny_cosmos25_pipeline(), dict(PIPE_KW, image=None, video=None)


@pytest.mark.parametrize("name", ["predict2", "predict2.5"])
def test_tiny_pipeline_end_to_end(name):
    """Cosmos2VideoToWorldPipeline and Cosmos2_5_PredictBasePipeline (CFG as two forwards per step): every forward's
    attn1 runs sparse on the (3, 4, 16) grid with no fallback, the output changes, and remove() restores it exactly."""
    pipe, kw = _tiny_pipeline(name)

    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0)).frames

    ref = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64))
    seen = set()
    with videosparse.processors.observe(pipe, lambda r: seen.add(r.grid)):
        sparse = run()
    assert seen == {PIPE_GRID}
    stats = handle["transformer"].stats()
    assert stats["transformer_calls"] == 6
    assert all(s["dense_calls"] == 0 and s["sparse_calls"] == 6 and s["fallbacks"] == []
               for s in stats["layers"].values())
    assert np.isfinite(sparse).all() and not np.array_equal(sparse, ref)
    videosparse.remove(pipe)
    assert np.array_equal(run(), ref)


@pytest.mark.parametrize("name", ["predict2", "predict2.5"])
def test_tiny_pipeline_runs_its_first_step_dense(name):
    """The Cosmos pipelines pass the transformer sigma / (sigma + 1) (Predict2) or sigma (Predict2.5), not a scheduler
    timestep: before the scheduler's first step the hook takes step 0 (the timestep is on no schedule entry), after
    it the scheduler's counter, so `dense_steps=1` makes exactly the first step dense."""
    pipe, kw = _tiny_pipeline(name)
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1))
    steps = []
    with videosparse.processors.observe(pipe, lambda r: steps.append(r.step)):
        pipe(**kw, generator=torch.Generator().manual_seed(0))
    assert steps == [0] * 4 + [1] * 4 + [2] * 4            # 2 forwards (CFG) x 2 layers per step
    layers = handle["transformer"].stats()["layers"]
    assert all(s["dense_calls"] == 2 and s["sparse_calls"] == 4 for s in layers.values())
