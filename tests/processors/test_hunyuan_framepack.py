"""FramePack (HunyuanVideoFramepackTransformer3DModel): HunyuanVideo's blocks over [history; video; image; text];
the window's video is the tile grid, the history, image and text tokens are global tiles."""


import pytest
import torch
from diffusers import HunyuanVideoFramepackTransformer3DModel
from diffusers.models.transformers import transformer_hunyuan_video
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from tester import (
    ProcessorTesterMixin,
    apply_and_list_served,
    assert_batch_items_sparse_as_alone,
    check_extra_tokens_served_as_global_tiles,
)

import videosparse
from videosparse.processors import attention_processors, sessions
from videosparse.processors.hunyuan import HunyuanVideoFramepackSparseAttnProcessor, hunyuan_framepack_grid

TEXT, IMAGE, IMAGE_DIM = 8, 5, 12
LATENT = (9, 14, 36)           # a window of 9 latent frames (the released latent_window_size), 14 x 36 latents
GRID = (9, 7, 18)              # after the (1, 2, 2) patches: 1134 video tokens, a partial last tile of 64
# history as the pipeline gives it: clean = start image + 1x history (2 frames, 2 x 7 x 18 = 252 tokens),
# 2x history (2 frames, 1 x 4 x 9 = 36 tokens), 4x history (16 frames, 4 x 2 x 5 = 40 tokens)
HISTORY = 252 + 36 + 40


def frame_indices():
    """Frame indices as the pipeline's inverted anti-drifting sampling splits them (first section): prefix, window,
    1x, 2x, 4x history."""
    prefix, window, h1, h2, h4 = torch.arange(1 + LATENT[0] + 1 + 2 + 16).split([1, LATENT[0], 1, 2, 16])
    return torch.cat([prefix, h1]), window, h2, h4


class TestHunyuanFramepackProcessors(ProcessorTesterMixin):
    num_layers = 2          # one dual-stream + one single-stream block

    def make_transformer(self):
        torch.manual_seed(0)
        return HunyuanVideoFramepackTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=self.head_dim, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
            text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(8, 28, 28), has_image_proj=True,
            image_proj_dim=IMAGE_DIM, has_clean_x_embedder=True,
        ).eval()

    def make_inputs(self, transformer, valid=(6,)):
        """As the pipeline calls its transformer (one item, its text padded to TEXT), or a batch of len(valid)."""
        g = torch.Generator().manual_seed(1)
        B = len(valid)
        clean, window, h2, h4 = frame_indices()
        return dict(
            hidden_states=torch.randn(B, 4, *LATENT, generator=g),
            timestep=torch.tensor([500] * B),
            encoder_hidden_states=torch.randn(B, TEXT, 16, generator=g),
            encoder_attention_mask=(torch.arange(TEXT)[None, :] < torch.tensor(valid)[:, None]).float(),
            pooled_projections=torch.randn(B, 8, generator=g),
            image_embeds=torch.randn(B, IMAGE, IMAGE_DIM, generator=g),
            indices_latents=window,
            guidance=torch.tensor([6000.0] * B),
            latents_clean=torch.randn(B, 4, 2, *LATENT[1:], generator=g),
            indices_latents_clean=clean,
            latents_history_2x=torch.randn(B, 4, 2, *LATENT[1:], generator=g),
            indices_latents_history_2x=h2,
            latents_history_4x=torch.randn(B, 4, 16, *LATENT[1:], generator=g),
            indices_latents_history_4x=h4,
        )


def _tiny():
    t = TestHunyuanFramepackProcessors()
    return t, t.make_transformer()


def test_sequence_layout_history_video_image_text(monkeypatch):
    """What every stock attention call sees: hidden states [4x; 2x; clean; video] with RoPE over all of them (the
    video's table last, the clean latents' just before it), encoder states [image; valid text]; the grid function
    reports the window's grid and history + image + valid text as the extra tokens."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr)
    calls = []
    stock = HunyuanVideoAttnProcessor2_0.__call__

    def spy(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if encoder_hidden_states is not None:
            calls.append((hidden_states.shape[1], encoder_hidden_states.shape[1], attention_mask, image_rotary_emb))
        return stock(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    monkeypatch.setattr(HunyuanVideoAttnProcessor2_0, "__call__", spy)
    t.run(tr, inputs)
    video = GRID[0] * GRID[1] * GRID[2]
    assert [c[:3] for c in calls] == [(HISTORY + video, IMAGE + 6, None)] * 2     # batch 1: valid text only, no mask
    cos = calls[0][3][0]
    clean, window, _, _ = frame_indices()
    H, W = LATENT[1:]
    assert cos.shape[0] == HISTORY + video
    assert torch.equal(cos[-video:], tr.rope(window, H, W, "cpu")[0])
    assert torch.equal(cos[-video - 252:-video], tr.rope(clean, H, W, "cpu")[0])
    # one item: the forward crops its text to the valid tokens; a batch keeps them all, the padded ones masked
    assert hunyuan_framepack_grid(tr, (), inputs) == (GRID, HISTORY + IMAGE + 6)
    grid, text = hunyuan_framepack_grid(tr, (), t.make_inputs(tr, valid=(8, 5)))
    assert grid == GRID and text.total == HISTORY + IMAGE + TEXT
    assert text.lengths() == (HISTORY + IMAGE + 8, HISTORY + IMAGE + 5)


def test_typical_settings_extra_tokens():
    """The released FramePack (FramePackI2V_HY: 20 + 40 blocks, 24 heads of 128) at 640 x 640, a window of 9
    latent frames: 14,400 video tokens; 3,200 + 400 + 400 history, 729 SigLIP image and 256 text tokens around them."""
    from videosparse.processors import self_attention_processors
    from videosparse.processors.registry import model_info, model_spec

    with torch.device("meta"):
        tr = HunyuanVideoFramepackTransformer3DModel(num_layers=20, num_single_layers=40, has_image_proj=True,
                                                     has_clean_x_embedder=True)
        latents = dict(
            hidden_states=torch.empty(1, 16, 9, 80, 80), encoder_hidden_states=torch.empty(1, 256, 4096),
            image_embeds=torch.empty(1, 729, 1152), latents_clean=torch.empty(1, 16, 2, 80, 80),
            latents_history_2x=torch.empty(1, 16, 2, 80, 80), latents_history_4x=torch.empty(1, 16, 16, 80, 80),
            indices_latents_clean=torch.empty(2), indices_latents_history_2x=torch.empty(2),
            indices_latents_history_4x=torch.empty(16))
    assert hunyuan_framepack_grid(tr, (), latents) == ((9, 40, 40), 3200 + 400 + 400 + 729 + 256)
    spec = model_spec(tr)
    info = model_info(tr, spec, len(self_attention_processors(tr)))
    assert (info.num_layers, info.num_heads, info.head_dim, info.patch_size) == (60, 24, 128, (1, 2, 2))
    assert info.text_position == "after"


def test_blocks_served_refiner_stock():
    t, tr = _tiny()
    inputs = t.make_inputs(tr)
    dense = t.run(tr, inputs)
    before, served = apply_and_list_served(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    procs = attention_processors(tr)          # the model has no AttentionMixin (no attn_processors)
    refiner = [n for n in procs if n.startswith("context_embedder.")]
    assert refiner and all(procs[n] is before[n] for n in refiner)
    assert served == ["single_transformer_blocks.0.attn.processor", "transformer_blocks.0.attn.processor"]
    assert all(type(before[n]) is HunyuanVideoAttnProcessor2_0 for n in served)
    assert all(type(procs[n]) is HunyuanVideoFramepackSparseAttnProcessor for n in served)
    out = t.run(tr, inputs)
    s = sessions(tr)["transformer"].stats()
    assert s["sparse_calls"] == 2 and s["dense_calls"] == 0 and s["density"] < 0.9
    assert torch.isfinite(out).all() and not torch.equal(out, dense)


def test_history_image_text_served_as_global_tiles(caplog):
    t, tr = _tiny()
    check_extra_tokens_served_as_global_tiles(t, tr, t.make_inputs(tr), GRID, HISTORY + IMAGE + 6, "after", caplog)


def test_observers_see_history_behind_the_video(monkeypatch):
    """The sparse calls see [video; history; image; text]: the stock call's q, k, v with the history moved."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr)
    stock = []
    dispatch = transformer_hunyuan_video.dispatch_attention_fn

    def spy(q, k, v, **kwargs):
        stock.append((q, k, v))
        return dispatch(q, k, v, **kwargs)

    monkeypatch.setattr(transformer_hunyuan_video, "dispatch_attention_fn", spy)
    t.run(tr, inputs)
    records = []
    with videosparse.processors.observe(tr, records.append):
        t.run(tr, inputs)
    video = GRID[0] * GRID[1] * GRID[2]
    assert len(records) == len(stock) == 2
    for r, qkv in zip(records, stock):
        for got, ref in zip((r.q, r.k, r.v), qkv):
            moved = torch.cat([ref[:, HISTORY:HISTORY + video], ref[:, :HISTORY], ref[:, HISTORY + video:]], dim=1)
            # the first layer's exactly; the second's up to the first's summation order
            assert torch.equal(got, moved) if r.layer == 0 else (got - moved).abs().max() <= 1e-5


@pytest.mark.parametrize("valid", [(8, 8), (8, 5)])
def test_batch_of_two_with_history_density_one_equals_stock(valid, caplog):
    """Batches of two (equal valid text lengths, or different ones: served item by item, the padded text rows
    attending densely to the valid keys as in the stock masked call): the dense config and density 1 equal
    stock, density 0.5 runs sparse on every layer with no fallback and each item as if it ran alone."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr, valid=valid)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.DenseConfig())
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5        # different lengths: per item, over the valid keys
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5
    videosparse.remove(tr)
    assert_batch_items_sparse_as_alone(t, tr, inputs, 2, caplog,          # one call per layer, padded keys masked
                                       item=lambda k, v, b: v if k.startswith("indices_") else v[b:b + 1])


def test_dense_config_with_history_is_bit_exact_stock():
    """Mutation find: under the dense config, unobserved, the attention runs in diffusers' order (history before the
    video, not moved behind it), so the forward is bit for bit stock; moving the history changed the summation order
    (4.8e-7), which the shared test's 1e-6 bound let pass."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.DenseConfig())
    assert torch.equal(t.run(tr, inputs), ref)
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 0


def test_sol_runs_sparse_with_history():
    t, tr = _tiny()
    inputs = t.make_inputs(tr)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.SolConfig(density=0.5, block=t.block))
    out = t.run(tr, inputs)
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 2


def build_tiny_framepack_pipeline():
    """A tiny HunyuanVideoFramepackPipeline with random weights, built offline: Llama and CLIP text encoders over the
    word-level tiny tokenizer, a SigLIP vision tower (32 x 32 images, 16 tokens of 12), a HunyuanVideo VAE (8 x
    spatial, 4 x temporal, 4 latent channels) and the tiny transformer."""
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoFramepackPipeline
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        LlamaConfig,
        LlamaModel,
        SiglipImageProcessor,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    from videosparse.models.tiny_wan import TINY_VOCAB, build_tiny_tokenizer

    torch.manual_seed(0)
    vocab = len(TINY_VOCAB)
    text_encoder = LlamaModel(LlamaConfig(       # 3 layers: the pipeline reads the third hidden state from the end
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, pad_token_id=0)).eval()
    text_encoder_2 = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=77, pad_token_id=0, bos_token_id=0, eos_token_id=1)).eval()
    image_encoder = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=IMAGE_DIM, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=32,
        patch_size=8)).eval()
    vae = AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8,) * 4, layers_per_block=1,
                                    norm_num_groups=4, mid_block_add_attention=False).eval()
    pipe = HunyuanVideoFramepackPipeline(
        text_encoder=text_encoder, tokenizer=build_tiny_tokenizer(), transformer=TestHunyuanFramepackProcessors(
        ).make_transformer(), vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder_2=text_encoder_2,
        tokenizer_2=build_tiny_tokenizer(), image_encoder=image_encoder,
        feature_extractor=SiglipImageProcessor(size={"height": 32, "width": 32}))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("sampling_type", ["inverted_anti_drifting", "vanilla"])
def test_tiny_pipeline_end_to_end(sampling_type):
    """Two sections of a 3-latent-frame window (the second one's history holds the first one's latents), true CFG
    with a shorter negative prompt (two forwards per step, two valid text lengths): every forward after the dense
    step runs sparse on every layer, the history, image and text tokens as global tiles; remove() restores it.
    The latents are compared (output_type "latent"): the tiny VAE's decoding only costs time on CPU."""
    import numpy as np
    from PIL import Image

    pipe = build_tiny_framepack_pipeline()
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (112, 288, 3), dtype=np.uint8))
    kw = dict(image=image, prompt="a red circle moving left", negative_prompt="blue", true_cfg_scale=2.0,
              height=112, width=288, num_frames=17, latent_window_size=3, num_inference_steps=3,
              output_type="latent", max_sequence_length=TEXT, prompt_template={"template": "{}", "crop_start": 0},
              sampling_type=sampling_type)

    def run():
        return torch.cat(pipe(**kw, generator=torch.Generator().manual_seed(0)).frames, dim=2)

    ref = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1))
    seen = []
    with videosparse.processors.observe(pipe, lambda r: seen.append((r.step, r.grid, r.text_len))):
        sparse = run()
    # the same history as the unit tests' (14 x 36 latents), 16 SigLIP tokens, and the valid text: the prompt's
    # 5 words + </s>, the negative prompt's 1 + </s>
    assert sorted(set(seen)) == [(s, (3, 7, 18), HISTORY + 16 + n) for s in range(3) for n in (2, 6)]
    layers = handle["transformer"].stats()["layers"]
    # 2 sections x 3 steps x 2 branches: the first step of each section dense
    assert all(s["dense_calls"] == 4 and s["sparse_calls"] == 8 and s["fallbacks"] == [] for s in layers.values())
    assert torch.isfinite(sparse).all() and not torch.equal(sparse, ref)
    videosparse.remove(pipe)
    assert torch.equal(run(), ref)
