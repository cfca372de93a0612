"""Allegro (AllegroTransformer3DModel): video-only attn1 with its 3D RoPE served; attn2 (text cross-attention) stock.

The tiny models keep the published head dim, 96: Allegro's RoPE rotates each third of the head dim (t, h, w) by
halves, so the head dim must be a multiple of 6 (neither 64 nor 128 is); the CPU reference serves 96, the GPU kernels
zero-padded to 128.
"""

import types

import pytest
import torch
from diffusers import AllegroPipeline, AllegroTransformer3DModel
from diffusers.models.attention_processor import AllegroAttnProcessor2_0
from diffusers.models.embeddings import PatchEmbed
from tester import (
    ProcessorTesterMixin,
    _to_cuda_bf16,
    assert_batch_items_sparse_as_alone,
    assert_runs_stock_with_one_warning,
    assert_tiny_pipeline_sparse,
    check_blocks_attn1_served,
)

import videosparse
from videosparse.processors import attention_processors
from videosparse.processors.allegro import AllegroSparseAttnProcessor, allegro_grid

TEXT, CAPTION = 8, 16
LATENT = (3, 14, 36)         # latent frames x height x width -> patches 3 x 7 x 18 = 378 tokens, partial last tiles
GRID = (3, 7, 18)


def tiny_allegro(num_layers=2, head_dim=96, **kwargs):
    config = dict(num_attention_heads=2, attention_head_dim=head_dim, in_channels=4, out_channels=4,
                  num_layers=num_layers, cross_attention_dim=2 * head_dim, caption_channels=CAPTION,
                  sample_height=LATENT[1], sample_width=LATENT[2], sample_frames=LATENT[0])
    config.update(kwargs)
    torch.manual_seed(0)
    return AllegroTransformer3DModel(**config).eval()


def pipeline_rope(transformer, latent=LATENT):
    """The RoPE tables and per-token positions as AllegroPipeline builds them (its own method, on a stand-in)."""
    stand_in = types.SimpleNamespace(vae_scale_factor_spatial=8, transformer=transformer)
    T, H, W = latent
    return AllegroPipeline._prepare_rotary_positional_embeddings(stand_in, 1, 8 * H, 8 * W, T, torch.device("cpu"))


def allegro_inputs(transformer, batch=2):
    """As AllegroPipeline calls its transformer: latents (B, C, F, H, W), T5 states [B, 1, L, D] with their key mask
    (the second item's last 3 tokens padded), one timestep per item, the pipeline's RoPE."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(batch, TEXT, dtype=torch.long)
    mask[1:, -3:] = 0
    return dict(
        hidden_states=torch.randn(batch, 4, *LATENT, generator=g),
        encoder_hidden_states=torch.randn(batch, 1, TEXT, CAPTION, generator=g),
        encoder_attention_mask=mask,
        timestep=torch.full((batch,), 500),
        image_rotary_emb=pipeline_rope(transformer),
    )


class TestAllegroProcessors(ProcessorTesterMixin):
    """Allegro with 2 heads of 96, batch 2 with a padded text item; video-only attn1."""

    head_dim = 96

    def make_transformer(self):
        return tiny_allegro(self.num_layers, self.head_dim)

    def make_inputs(self, transformer):
        return allegro_inputs(transformer)

    @pytest.mark.gpu
    def test_gpu_bf16_density_one_matches_stock(self):
        """On CUDA head dim 96 runs on a GPU kernel zero-padded to 128 (`kernels.dispatch.PaddedHeadDim`): the shared
        check, then which backend served the sparse calls."""
        super().test_gpu_bf16_density_one_matches_stock()
        tr = self.to_cuda_bf16(self.make_transformer())
        inputs = _to_cuda_bf16(self.make_inputs(tr))
        session = videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=self.tiling,
                                                               block=self.block))["transformer"]
        self.run(tr, inputs)
        stats = session.stats()
        assert stats["kernel_backend"].endswith("+pad128") and stats["dense_calls"] == 0


def test_sparse_runs_on_attn1_only():
    tr, before, records, _, _ = check_blocks_attn1_served(TestAllegroProcessors(), AllegroAttnProcessor2_0)
    procs = attention_processors(tr)
    assert all(isinstance(procs[f"transformer_blocks.{i}.attn1.processor"], AllegroSparseAttnProcessor)
               for i in range(2))
    assert all(type(procs[f"transformer_blocks.{i}.attn2.processor"]) is AllegroAttnProcessor2_0 for i in range(2))
    r = records[0]
    assert r.grid == GRID and r.text_len == 0 and r.text_position is None and r.q.shape == (2, 378, 2, 96)


def test_patch_embed_and_rope_are_time_major():
    """The token order the layout assumes: the forward's per-frame PatchEmbed and flatten put patch (t, h, w) at
    t*H*W + h*W + w, and the pipeline's RoPE positions (t, h, w) follow the same order."""
    T, H, W = GRID
    index = torch.arange(T * H * W, dtype=torch.float32).view(T, H, W)
    latents = index.repeat_interleave(2, 1).repeat_interleave(2, 2)[None, None]       # (B, C, F, H, W), patch index
    embed = PatchEmbed(2 * H, 2 * W, patch_size=2, in_channels=1, embed_dim=1, pos_embed_type=None)
    with torch.no_grad():
        embed.proj.weight.fill_(0.25)                                                   # the mean of the patch
        embed.proj.bias.zero_()
        x = latents.permute(0, 2, 1, 3, 4).flatten(0, 1)                                # as the forward does
        tokens = embed(x).unflatten(0, (1, -1)).flatten(1, 2)
    assert torch.equal(tokens[0, :, 0], torch.arange(T * H * W, dtype=torch.float32))

    _, (pos_t, pos_h, pos_w) = pipeline_rope(tiny_allegro(num_layers=1))
    i = torch.arange(T * H * W)
    assert torch.equal(pos_t[0], i // (H * W)) and torch.equal(pos_h[0], i // W % H) and torch.equal(pos_w[0], i % W)


def test_grid_from_hidden_states_and_patch_size():
    tr = tiny_allegro(num_layers=1)
    inputs = allegro_inputs(tr)
    assert allegro_grid(tr, (), inputs) == (GRID, 0)
    assert allegro_grid(tr, (inputs["hidden_states"],), {}) == (GRID, 0)
    assert allegro_grid(tiny_allegro(num_layers=1, patch_size=1), (), inputs) == ((3, 14, 36), 0)


def test_batch_items_with_different_text_masks_run_sparse_as_alone(caplog):
    """Batch 2 whose text items have different valid lengths (attn2's key mask, stock): each item's sparse output is
    the one it gets alone."""
    t = TestAllegroProcessors()
    tr = t.make_transformer()
    inputs = allegro_inputs(tr)
    assert_batch_items_sparse_as_alone(
        t, tr, inputs, 2, caplog,
        item=lambda name, value, b: value if name == "image_rotary_emb" else value[b:b + 1])


def test_masked_call_runs_stock_with_one_warning(caplog):
    """The forward's optional video mask (B, F, H, W), which it turns into a key bias for attn1 (AllegroPipeline
    never passes one): attn1 keeps the stock processor's output, warned once per layer."""
    t = TestAllegroProcessors()
    tr = t.make_transformer()
    video_mask = torch.ones(2, *LATENT)
    video_mask[:, -1, :, -4:] = 0
    inputs = dict(allegro_inputs(tr), attention_mask=video_mask)
    assert_runs_stock_with_one_warning(t, tr, inputs, "an attention mask was given", caplog)


def build_tiny_allegro_pipeline():
    """A tiny AllegroPipeline with random weights, built offline: T5 (dim 16) with the tiny word-level tokenizer, the
    Allegro VAE (8 channels, 8x spatial, 4x temporal; its decode is tiled only, in tiles of 24 frames x
    `sample_size` pixels, so the video is 24 x 128 x 128), the tiny transformer above, Euler ancestral."""
    from diffusers import AutoencoderKLAllegro, EulerAncestralDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    from videosparse.models.tiny_wan import TINY_VOCAB, build_tiny_tokenizer

    torch.manual_seed(0)
    text_encoder = T5EncoderModel(T5Config(
        vocab_size=len(TINY_VOCAB), d_model=CAPTION, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    vae = AutoencoderKLAllegro(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
                               norm_num_groups=2, sample_size=128).eval()
    vae.enable_tiling()
    pipe = AllegroPipeline(tokenizer=build_tiny_tokenizer(), text_encoder=text_encoder, vae=vae,
                           transformer=tiny_allegro(), scheduler=EulerAncestralDiscreteScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_tiny_pipeline_end_to_end():
    """AllegroPipeline (CFG batched as one forward of 2, the prompts padded to 16 tokens with their masks): every
    forward's attn1 runs sparse on the (6, 8, 8) grid with no fallback, the output changes, and
    remove() restores it exactly."""
    pipe = build_tiny_allegro_pipeline()
    kw = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=24, height=128, width=128,
              num_inference_steps=2, max_sequence_length=16, clean_caption=False, output_type="np")

    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0)).frames

    assert_tiny_pipeline_sparse(pipe, run, lambda r: (r.grid, tuple(r.q.shape)), {((6, 8, 8), (2, 384, 2, 96))},
                                calls=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_as_three_section_half_rope_equals_stock_bitwise(dtype):
    """The pipeline's tables and positions as one `HalfRope` with three sections rotate exactly as
    `apply_rotary_emb_allegro`; positions given per batch item are not taken."""
    from diffusers.models.embeddings import apply_rotary_emb_allegro

    from videosparse.processors.allegro import allegro_half_rope
    from videosparse.rope import apply_rope

    tr = tiny_allegro(1, 96)
    freqs, positions = pipeline_rope(tr)
    x = torch.randn(2, positions[0].shape[1], 2, 96).to(dtype)                # [B, S, H, D]
    rope = allegro_half_rope(freqs, positions)
    ref = apply_rotary_emb_allegro(x.transpose(1, 2), freqs, positions).transpose(1, 2)
    assert rope.sections == 3 and torch.equal(apply_rope(x, rope), ref)
    # review find: tables a caller cast to the model's dtype rotated in that dtype; diffusers rotates in fp32
    low = tuple(tuple(t.to(torch.bfloat16) for t in f) for f in freqs)
    ref = apply_rotary_emb_allegro(x.transpose(1, 2), low, positions).transpose(1, 2)
    assert torch.equal(apply_rope(x, allegro_half_rope(low, positions)), ref)
    assert allegro_half_rope(freqs, tuple(p.expand(2, -1) for p in positions)) is None
