"""Kandinsky 6 (Kandinsky6Transformer3DModel): the fused blocks' video self-attention served (video tokens only,
qk-norm in the input dtype, RoPE without bf16 rounding), video-only and with audio; the audio self-attention, the
text / video <-> audio cross-attentions and the text refiners stock."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky6TI2VAPipeline, Kandinsky6Transformer3DModel
from diffusers.models.transformers.transformer_kandinsky6 import (
    Kandinsky6AttnProcessor,
    Kandinsky6VisualEmbeddings,
    apply_rotary,
)
from tester import ProcessorTesterMixin, apply_and_list_served, assert_cross_attention_call_is_stock

import videosparse
from videosparse.processors import attention_processors, observe, sessions
from videosparse.processors.kandinsky import Kandinsky6SparseAttnProcessor, apply_kandinsky_rope, kandinsky_grid

CHANNELS, AUDIO_CHANNELS, AUDIO_LEN, TEXT, TEXT_DIM, POOLED_DIM = 4, 8, 10, 8, 32, 16
LATENT = (3, 14, 36)         # latent frames x height x width -> patches 3 x 7 x 18 = 378 tokens, a partial last tile
GRID = (3, 7, 18)
SERVED = [f"visual_transformer_blocks.{i}.video_dec_block.self_attention.processor" for i in range(2)]
STOCK_PER_BLOCK = ["audio_dec_block.cross_attention", "audio_dec_block.self_attention", "av_cross_attention",
                   "va_cross_attention", "video_dec_block.cross_attention"]


def tiny_kandinsky6(num_layers=2, **kwargs):
    """A tiny Kandinsky6Transformer3DModel with the released checkpoints' flags (ca_rope, cross_gates, fix_modulation,
    text_token_padding): video 2 heads of 64 (RoPE axes (16, 24, 24), patch (1, 2, 2)), audio 1 head of 64 (the
    cross-modal RoPE needs equal head dims), one text refiner block per modality, `num_layers` fused blocks."""
    config = dict(in_visual_dim=CHANNELS, out_visual_dim=CHANNELS, in_text_dim=TEXT_DIM, in_text_dim2=POOLED_DIM,
                  time_dim=32, patch_size=(1, 2, 2), model_dim=128, ff_dim=256, num_text_blocks=1,
                  num_visual_blocks=num_layers, axes_dims=(16, 24, 24), visual_cond=False, in_audio_dim=AUDIO_CHANNELS,
                  out_audio_dim=AUDIO_CHANNELS, model_dim_a=64, ff_dim_a=128, text_token_padding=True, ca_rope=True,
                  cross_gates=True, fix_modulation=True)
    torch.manual_seed(0)
    return Kandinsky6Transformer3DModel(**dict(config, **kwargs)).eval()


def kandinsky6_inputs(transformer, batch=1, latent=LATENT, audio=True, image=False, padded=False, seed=1):
    """As Kandinsky6TI2VAPipeline calls the transformer: channels-last latents (B, T, H, W, C) (visual_cond models:
    then zero condition latents and the condition mask), audio latents (B, L, C) or None (sample_audio=False), the
    Qwen text states (`padded`: item 1 padded after 5 tokens, with the boolean mask the pipeline then passes), pooled
    CLIP states. `image`: the reference frame's latent appended as a last frame with token type 1, mask 1 and RoPE time
    position 0, as the pipeline does for image conditioning."""
    g = torch.Generator().manual_seed(seed)
    T, H, W = latent
    latents = torch.randn(batch, T + image, H, W, CHANNELS, generator=g)
    cfg = transformer.config
    inputs = dict(
        hidden_states=latents,
        audio_hidden_states=torch.randn(batch, AUDIO_LEN, AUDIO_CHANNELS, generator=g) if audio else None,
        encoder_hidden_states=torch.randn(batch, TEXT, cfg.in_text_dim, generator=g),
        pooled_projections=torch.randn(batch, cfg.in_text_dim2, generator=g),
        timestep=torch.full((batch,), 600.0),
    )
    if padded:
        mask = torch.ones(batch, TEXT, dtype=torch.bool)
        mask[1:, 5:] = False
        inputs["encoder_attention_mask"] = mask
    if cfg.visual_cond:
        cond_mask = torch.zeros(batch, T + image, H, W, 1)
        cond_mask[:, -1] = float(image)
        inputs["hidden_states"] = torch.cat([latents, torch.zeros_like(latents), cond_mask], dim=-1)
    if image:
        types = torch.zeros(batch, T + 1, dtype=torch.long)
        types[:, -1] = 1
        inputs["visual_token_type_ids"] = types
        inputs["visual_rope_pos"] = (torch.cat([torch.arange(T), torch.zeros(1, dtype=torch.long)]),
                                     torch.arange(H // 2), torch.arange(W // 2))
    return inputs


class TestKandinsky6VideoOnly(ProcessorTesterMixin):
    """audio_hidden_states=None (sample_audio=False): the fused blocks run their video path only."""

    def make_transformer(self):
        return tiny_kandinsky6(self.num_layers)

    def make_inputs(self, transformer):
        return kandinsky6_inputs(transformer, audio=False)


class TestKandinsky6WithAudio(ProcessorTesterMixin):
    """Video and audio denoised together, batch 2 with a padded prompt (text mask) on item 1."""

    def make_transformer(self):
        return tiny_kandinsky6(self.num_layers)

    def make_inputs(self, transformer):
        return kandinsky6_inputs(transformer, batch=2, padded=True)


def _forward(tr, inputs):
    with torch.no_grad(), tr.cache_context("cond", step_index=0, num_inference_steps=4):
        return tr(**inputs)


def test_only_video_self_attention_is_served():
    """Only visual_transformer_blocks.<i>.video_dec_block.self_attention is replaced; the audio self-attention, the
    cross-attentions and the text refiners keep their processor objects; one forward with audio runs sparse on every
    served layer over the video grid, with no text or audio token in the served sequence."""
    tr = tiny_kandinsky6()
    inputs = kandinsky6_inputs(tr)
    dense = _forward(tr, inputs).sample
    before, served = apply_and_list_served(tr, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64))
    assert served == SERVED and all(type(before[n]) is Kandinsky6AttnProcessor for n in before)
    after = attention_processors(tr)
    assert all(type(after[n]) is Kandinsky6SparseAttnProcessor for n in served)
    assert sorted(n for n in before if n not in served) == sorted(
        ["video_text_transformer_blocks.0.attn.processor", "audio_text_transformer_blocks.0.attn.processor"]
        + [f"visual_transformer_blocks.{i}.{n}.processor" for i in range(2) for n in STOCK_PER_BLOCK])
    assert all(after[n] is before[n] for n in before if n not in served)
    records = []
    with observe(tr, records.append):
        out = _forward(tr, inputs).sample
    s = sessions(tr)["transformer"].stats()
    assert s["sparse_calls"] == 2 and s["dense_calls"] == 0 and 0.3 < s["density"] < 0.9
    assert torch.isfinite(out).all() and not torch.equal(out, dense)
    assert [(r.layer, r.grid, r.text_len, r.text_position) for r in records] == [(i, GRID, 0, None) for i in range(2)]
    assert records[0].q.shape == (1, 378, 2, 64)


def test_audio_output_follows_the_served_video_attention():
    """The audio prediction reads the video through av_cross_attention: at density 1 it equals stock, sparse video
    attention changes it, and both stay finite."""
    tr = tiny_kandinsky6()
    inputs = kandinsky6_inputs(tr, batch=2, padded=True)
    ref = _forward(tr, inputs).audio_sample
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=(1, 4, 16), block=64))
    assert (_forward(tr, inputs).audio_sample - ref).abs().max() <= 1e-5
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=(1, 4, 16), block=64))
    out = _forward(tr, inputs).audio_sample
    assert torch.isfinite(out).all() and not torch.equal(out, ref)


def test_patch_embed_and_rope_are_time_major():
    """The token order the layout assumes: Kandinsky6VisualEmbeddings then the forward's flatten(1, 3) put patch
    (t, h, w) at t*H*W + h*W + w (no fractal reordering), and the RoPE table flattened the same way follows it (time
    angles vary with t only, height with h, width with w; divided by the config's scale_factor)."""
    T, H, W = GRID
    index = torch.arange(T * H * W, dtype=torch.float32).view(T, H, W)
    pixels = index.repeat_interleave(2, 1).repeat_interleave(2, 2)[None, ..., None]       # (1, T, 2H, 2W, 1)
    embed = Kandinsky6VisualEmbeddings(1, 1, (1, 2, 2))
    with torch.no_grad():
        embed.in_layer.weight.fill_(0.25)
        embed.in_layer.bias.zero_()
        tokens = embed(pixels).flatten(1, 3)                                               # as the forward does
    assert torch.equal(tokens[0, :, 0], torch.arange(T * H * W, dtype=torch.float32))
    tr = tiny_kandinsky6(num_layers=1)
    rope = tr.visual_rope_embeddings((torch.arange(T), torch.arange(H), torch.arange(W)), tr.scale_factor)
    rope = rope.flatten(0, 2)                                                              # (S, 1, D/2, 2, 2)
    angles = torch.atan2(rope[:, 0, :, 1, 0], rope[:, 0, :, 0, 0]).view(T, H, W, -1)      # [t | h | w] pairs
    t_part, h_part, w_part = angles.split([8, 12, 12], dim=-1)
    assert torch.equal(t_part, t_part[:, :1, :1].expand_as(t_part)) and not torch.equal(t_part[0], t_part[1])
    assert torch.equal(h_part, h_part[:1, :, :1].expand_as(h_part)) and not torch.equal(h_part[:, 0], h_part[:, 1])
    assert torch.equal(w_part, w_part[:1, :1, :].expand_as(w_part)) and not torch.equal(w_part[..., 0, :],
                                                                                        w_part[..., 1, :])
    assert torch.allclose(h_part[0, 1, 0, 0], torch.tensor(1.0 / tr.scale_factor[1]))     # position 1, frequency 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_without_rounding_equals_stock(dtype):
    """apply_kandinsky_rope(..., rounding=None) is Kandinsky 6's rotation bit for bit (fp32 math, cast back to the
    input dtype), where Kandinsky 5's bf16 rounding would differ in fp32."""
    tr = tiny_kandinsky6(num_layers=1)
    rope = tr.visual_rope_embeddings(tuple(torch.arange(n) for n in GRID), tr.scale_factor).flatten(0, 2)
    x = torch.randn(2, 378, 2, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(apply_kandinsky_rope(x, rope, rounding=None), apply_rotary(x, rope))
    if dtype == torch.float32:
        assert not torch.equal(apply_kandinsky_rope(x, rope), apply_rotary(x, rope))


def test_dense_bf16_call_equals_stock_bitwise():
    """In bf16 (the released dtype) a served layer's dense call equals the stock processor's bit for bit: q, k and v
    are projected, RMS-normed and rotated exactly as Kandinsky6AttnProcessor does."""
    tr = tiny_kandinsky6(num_layers=1).to(torch.bfloat16)
    attn = tr.visual_transformer_blocks[0].video_dec_block.self_attention
    rope = tr.visual_rope_embeddings(tuple(torch.arange(n) for n in GRID), tr.scale_factor).flatten(0, 2)
    x = torch.randn(2, 378, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        ref = attn(x, rotary_emb=rope)
        videosparse.apply(tr, videosparse.DenseConfig())
        assert type(attn.processor) is Kandinsky6SparseAttnProcessor
        assert torch.equal(attn(x, rotary_emb=rope), ref)


def test_image_conditioned_tail_frame():
    """Image conditioning (visual_cond, token types): the reference latent appended as a last frame is one more frame
    of the grid (T' + 1), with its RoPE time position 0 applied before attention; density 1 equals stock and density
    0.3 runs sparse on every layer with no fallback."""
    tr = tiny_kandinsky6(visual_cond=True, visual_token_type_num_embeddings=2)
    inputs = kandinsky6_inputs(tr, image=True)
    ref = _forward(tr, inputs).sample
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=(1, 4, 16), block=64))
    assert (_forward(tr, inputs).sample - ref).abs().max() <= 1e-5
    session = sessions(tr)["transformer"]
    assert session.context.grid == (GRID[0] + 1, *GRID[1:])
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=(1, 4, 16), block=64))
    out = _forward(tr, inputs).sample
    s = sessions(tr)["transformer"].stats()
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    assert s["sparse_calls"] == 2 and s["dense_calls"] == 0 and s["density"] < 0.7


def test_cross_attention_call_goes_to_stock():
    """A call with encoder states given to the served processor returns the stock output, neither observed nor
    counted."""
    tr = tiny_kandinsky6()
    attn = tr.visual_transformer_blocks[0].video_dec_block.self_attention
    g = torch.Generator().manual_seed(3)
    assert_cross_attention_call_is_stock(tr, attn, torch.randn(1, 378, 128, generator=g),
                                         torch.randn(1, TEXT, 128, generator=g))


def test_grid_and_model_info_of_the_default_config():
    """The grid comes from the channels-last hidden_states and patch_size; the class defaults (the released sizes:
    model_dim 4096, axes (32, 48, 48), 60 fused blocks) give 32 video heads of 128 and 60 served layers."""
    from videosparse.processors import self_attention_processors
    from videosparse.processors.registry import model_info, model_spec

    tr = tiny_kandinsky6(num_layers=1)
    inputs = kandinsky6_inputs(tr)
    assert kandinsky_grid(tr, (), inputs) == (GRID, 0)
    assert kandinsky_grid(tr, (inputs["hidden_states"],), {}) == (GRID, 0)
    with torch.device("meta"):
        big = Kandinsky6Transformer3DModel(ca_rope=True, cross_gates=True, fix_modulation=True)
    info = model_info(big, model_spec(big), len(self_attention_processors(big)))
    assert (info.num_layers, info.num_heads, info.head_dim, info.patch_size) == (60, 32, 128, (1, 2, 2))
    assert info.text_position is None
    assert big.visual_transformer_blocks[0].video_dec_block.self_attention.num_heads == 32


def build_tiny_kandinsky6_pipeline():
    """A tiny Kandinsky6TI2VAPipeline built offline around the tiny transformer: no text encoders (the calls pass
    prompt embeddings) and no video VAE (latent output); tiny MMAudio VAE and vocoder, which only the audio check and
    the audio length (sample rate, hop) read at latent output."""
    from diffusers import MMAudioVAE, MMAudioVocoder

    torch.manual_seed(0)
    audio_vae = MMAudioVAE(mel_bins=8, latent_channels=AUDIO_CHANNELS, hidden_channels=8, channel_multipliers=(1,),
                           layers_per_block=1, n_fft=64, hop_length=512).eval()
    vocoder = MMAudioVocoder(num_mels=8, upsample_initial_channel=8, upsample_rates=(2,), upsample_kernel_sizes=(4,),
                             resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),)).eval()
    pipe = Kandinsky6TI2VAPipeline(transformer=tiny_kandinsky6(), vae=None, text_encoder=None, tokenizer=None,
                                   text_encoder_2=None, tokenizer_2=None,
                                   scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), audio_vae=audio_vae,
                                   vocoder=vocoder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


PIPE_GRID = (5, 5, 18)    # 17 frames x 80 x 288 -> latent 5 x 10 x 36 (VAE 4 x 8 x 8) -> patches 5 x 5 x 18 = 450


def test_tiny_pipeline_end_to_end():
    """Kandinsky6TI2VAPipeline with audio (CFG as cond / uncond forwards in cache contexts, 2 steps, latent output),
    dense_steps=1: the first step's forwards run dense, the second's video self-attention sparse on the (5, 5, 18)
    grid with no fallback; video and audio latents change and stay finite, and remove() restores them exactly. (The
    video-only forward, sample_audio=False, is `TestKandinsky6VideoOnly`.)"""
    pipe = build_tiny_kandinsky6_pipeline()
    g = torch.Generator().manual_seed(5)
    embeds = {name: torch.randn(1, *shape, generator=g) for name, shape in [
        ("prompt_embeds", (TEXT, TEXT_DIM)), ("pooled_prompt_embeds", (POOLED_DIM,)),
        ("negative_prompt_embeds", (TEXT, TEXT_DIM)), ("negative_pooled_prompt_embeds", (POOLED_DIM,))]}

    def run():
        out = pipe(**embeds, height=80, width=288, num_frames=17, num_inference_steps=2, guidance_scale=5.0,
                   sample_audio=True, output_type="latent", generator=torch.Generator().manual_seed(0))
        return out.frames, out.audio

    ref_video, ref_audio = run()
    assert ref_video.shape == (1, CHANNELS, PIPE_GRID[0], 10, 36)
    assert ref_audio.shape == (1, AUDIO_CHANNELS, math.ceil(17 / 24 * 44100 / 1024))
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1))
    seen = []
    with observe(pipe, lambda r: seen.append((r.step, r.branch, r.grid, r.text_len))):
        video, audio = run()
    assert seen == [(step, branch, PIPE_GRID, 0) for step in (0, 1) for branch in ("cond", "uncond") for _ in "ab"]
    stats = handle["transformer"].stats()
    assert stats["transformer_calls"] == 4
    assert all(s["dense_calls"] == 2 and s["sparse_calls"] == 2 and s["fallbacks"] == []
               for s in stats["layers"].values())
    assert torch.isfinite(video).all() and not torch.equal(video, ref_video)
    assert torch.isfinite(audio).all() and not torch.equal(audio, ref_audio)
    videosparse.remove(pipe)
    assert all(torch.equal(a, b) for a, b in zip(run(), (ref_video, ref_audio)))
