"""ConsisID (ConsisIDTransformer3DModel): CogVideoX's blocks, served by the CogVideoX processor and grid; text first.

The identity modules (the local facial extractor, a perceiver over the face embeddings, and the perceiver
cross-attention that adds the face tokens to the video tokens after every `cross_attn_interval`-th block) are plain
modules without attention processors: they stay stock. The tiny models include them (`is_train_face=True`, a
cross-attention after every block) and the inputs give random face embeddings, as the face models would.
"""

import numpy as np
import pytest
import torch
from diffusers import ConsisIDTransformer3DModel
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from tester import (ProcessorTesterMixin, apply_and_list_served, assert_tiny_pipeline_sparse, check_blocks_attn1_served,
                    with_cache_context)

import videosparse
from videosparse.processors import attention_processors, sessions
from videosparse.processors.cogvideox import CogVideoXSparseAttnProcessor

TEXT, ID_DIM, VIT_DIM, SCALES = 8, 12, 16, 2
GRID = (3, 7, 18)            # latents 3 x 14 x 36, patch 2 -> 378 video tokens: partial last tiles of (1, 4, 16)


def tiny_consisid(num_layers=2, head_dim=64, **kwargs):
    """A tiny ConsisIDTransformer3DModel (image-to-video: 4 latent + 4 image channels, RoPE) with its face modules;
    the perceiver cross-attention's key width is two thirds of the inner dim (int(128 * 2 / 3) = 85), so the
    extractor's output has that width."""
    config = dict(num_attention_heads=2, attention_head_dim=head_dim, in_channels=8, out_channels=4, time_embed_dim=32,
                  text_embed_dim=16, num_layers=num_layers, sample_width=36, sample_height=14, sample_frames=9,
                  patch_size=2, max_text_seq_length=TEXT, use_rotary_positional_embeddings=True, is_train_face=True,
                  cross_attn_interval=1, cross_attn_dim_head=16, cross_attn_num_heads=2, LFE_id_dim=ID_DIM,
                  LFE_vit_dim=VIT_DIM, LFE_depth=SCALES, LFE_dim_head=8, LFE_num_heads=2, LFE_num_id_token=2,
                  LFE_num_querie=4, LFE_output_dim=85, LFE_ff_mult=1, LFE_num_scale=SCALES)
    config.update(kwargs)
    torch.manual_seed(0)
    return with_cache_context(ConsisIDTransformer3DModel(**config).eval())


def consisid_inputs(batch=2, rope=True):
    """As ConsisIDPipeline calls its transformer: latents with the image latents as channels (B, F, 2C, H, W), the
    text first, CogVideoX 1.0's RoPE, and the face embeddings (id_cond [B, id_dim], one ViT state per scale)."""
    g = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(batch, GRID[0], 8, 2 * GRID[1], 2 * GRID[2], generator=g),
        encoder_hidden_states=torch.randn(batch, TEXT, 16, generator=g),
        timestep=torch.full((batch,), 500),
        image_rotary_emb=get_3d_rotary_pos_embed(64, ((0, 0), GRID[1:]), GRID[1:], GRID[0]) if rope else None,
        id_cond=torch.randn(batch, ID_DIM, generator=g),
        id_vit_hidden=[torch.randn(batch, 5, VIT_DIM, generator=g) for _ in range(SCALES)],
    )


class TestConsisIDProcessors(ProcessorTesterMixin):
    """ConsisID with its face modules, batch 2; text before the video."""

    def make_transformer(self):
        return tiny_consisid(self.num_layers, self.head_dim)

    def make_inputs(self, transformer):
        return consisid_inputs()


def test_sparse_runs_on_attn1_and_face_modules_stay_stock():
    """Only the blocks' attn1 is served (CogVideoX's sparse processor, text first); the facial extractor and the
    perceiver cross-attentions keep their forward (no hook) and give the same output after apply."""
    t = TestConsisIDProcessors()
    tr, _, records, out, dense = check_blocks_attn1_served(t, CogVideoXAttnProcessor2_0)
    assert all(isinstance(p, CogVideoXSparseAttnProcessor) for p in attention_processors(tr).values())
    assert (out - dense).norm() / dense.norm() < 0.5
    r = records[0]
    assert r.grid == GRID and r.text_len == TEXT and r.text_position == "before"
    assert r.q.shape == (2, TEXT + 378, 2, 64)

    fresh = tiny_consisid()
    inputs = consisid_inputs()
    x = torch.randn(2, 378, 128)
    face = [fresh.local_facial_extractor] + list(fresh.perceiver_cross_attention)

    def face_outputs():
        with torch.no_grad():
            emb = fresh.local_facial_extractor(inputs["id_cond"], inputs["id_vit_hidden"])
            return [emb] + [ca(emb, x) for ca in fresh.perceiver_cross_attention]

    before = face_outputs()
    videosparse.apply(fresh, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    assert all("forward" not in m.__dict__ and not hasattr(m, "_diffusers_hook") for f in face for m in f.modules())
    assert all(torch.equal(a, b) for a, b in zip(face_outputs(), before))


def test_face_embeddings_reach_the_served_forward():
    """The face path is live in the tested forward: other face embeddings change the sparse output."""
    t = TestConsisIDProcessors()
    tr = t.make_transformer()
    inputs = consisid_inputs()
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    a = t.run(tr, inputs)
    b = t.run(tr, dict(inputs, id_cond=inputs["id_cond"] + 1.0))
    assert not torch.equal(a, b)


@pytest.mark.parametrize("variant", ["no_face", "no_rope"])
def test_other_configs_match_stock_and_run_sparse(variant):
    """Without the face modules (`is_train_face=False`, as the forward then ignores id_cond) and with sincos
    positions instead of RoPE: density 1 equals stock and density 0.3 runs sparse on every layer."""
    t = TestConsisIDProcessors()
    if variant == "no_face":
        tr, inputs = tiny_consisid(is_train_face=False), consisid_inputs()
    else:
        tr, inputs = tiny_consisid(use_rotary_positional_embeddings=False), consisid_inputs(rope=False)
    ref = t.run(tr, inputs)
    _, served = apply_and_list_served(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert served == [f"transformer_blocks.{i}.attn1.processor" for i in range(2)]
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    assert torch.isfinite(t.run(tr, inputs)).all()
    s = sessions(tr)["transformer"].stats()
    assert s["sparse_calls"] == 2 and s["dense_calls"] == 0 and s["density"] < 0.7


def build_tiny_consisid_pipeline():
    """A tiny ConsisIDPipeline with random weights, built offline: T5 (dim 16) with the tiny word-level tokenizer,
    CogVideoX VAE (4 latent channels, 8x spatial, 4x temporal), the tiny transformer above, CogVideoX's DPM scheduler.

    The class comes from its module: the top-level `diffusers.ConsisIDPipeline` is a placeholder without OpenCV,
    which the pipeline only needs to draw face keypoints (`is_kps` configs). The face models (insightface, facexlib,
    EVA-CLIP in `consisid_utils`) only compute `id_cond` / `id_vit_hidden` from a photo; the test gives them."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDPMScheduler
    from diffusers.pipelines.consisid.pipeline_consisid import ConsisIDPipeline
    from transformers import T5Config, T5EncoderModel

    from videosparse.models.tiny_wan import TINY_VOCAB, build_tiny_tokenizer

    torch.manual_seed(0)
    text_encoder = T5EncoderModel(T5Config(
        vocab_size=len(TINY_VOCAB), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    vae = AutoencoderKLCogVideoX(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
                                 norm_num_groups=2, down_block_types=("CogVideoXDownBlock3D",) * 4,
                                 up_block_types=("CogVideoXUpBlock3D",) * 4).eval()
    pipe = ConsisIDPipeline(tokenizer=build_tiny_tokenizer(), text_encoder=text_encoder, vae=vae,
                            transformer=tiny_consisid(max_text_seq_length=16), scheduler=CogVideoXDPMScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_tiny_pipeline_end_to_end():
    """ConsisIDPipeline (image to video with face embeddings; CFG batched as one forward of 2): every forward's attn1
    runs sparse on the (3, 4, 18) grid after the 16 text tokens with no fallback, the output changes, and remove()
    restores it exactly."""
    from PIL import Image

    pipe = build_tiny_consisid_pipeline()
    g = torch.Generator().manual_seed(1)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 288, 3), dtype=np.uint8))
    kw = dict(image=image, prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=64,
              width=288, num_inference_steps=2, max_sequence_length=16, output_type="np",
              id_cond=torch.randn(1, ID_DIM, generator=g),
              id_vit_hidden=[torch.randn(1, 5, VIT_DIM, generator=g) for _ in range(SCALES)])

    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0)).frames

    assert_tiny_pipeline_sparse(pipe, run, lambda r: (r.grid, r.text_len, tuple(r.q.shape)),
                                {((3, 4, 18), 16, (2, 16 + 216, 2, 64))}, calls=2)
