"""Kandinsky 5.0 (Kandinsky5Transformer3DModel): visual blocks' self_attention served (video tokens only, fp32 qk-norm
and bf16-rounded RoPE in (B, S, H, D)); the text refiner and the cross-attention stock; NABLA calls stock.

diffusers zero-initialises every `Kandinsky5Modulation`, whose gates would then multiply each attention output by
zero; the tiny models draw them at random so that the attention reaches the output.
"""

import types

import numpy as np
import pytest
import torch
from diffusers import Kandinsky5T2VPipeline, Kandinsky5Transformer3DModel
from diffusers.models.transformers.transformer_kandinsky import (
    Kandinsky5AttnProcessor,
    Kandinsky5Modulation,
    Kandinsky5VisualEmbeddings,
    fractal_flatten,
)
from tester import (
    ProcessorTesterMixin,
    apply_and_list_served,
    assert_cross_attention_call_is_stock,
    assert_runs_stock_with_one_warning,
    check_blocks_attn1_served,
)

import videosparse
from videosparse.eval.synthetic_models import cast_like_from_pretrained
from videosparse.layout import TileLayout
from videosparse.processors import attention_processors, observe, sessions
from videosparse.processors.kandinsky import Kandinsky5SparseAttnProcessor, kandinsky_grid

CHANNELS, TEXT, TEXT_DIM, POOLED_DIM = 4, 8, 32, 16
LATENT = (3, 14, 36)         # latent frames x height x width -> patches 3 x 7 x 18 = 378 tokens, a partial last tile
GRID = (3, 7, 18)
SERVED = [f"visual_transformer_blocks.{i}.self_attention.processor" for i in range(2)]


def tiny_kandinsky(num_layers=2, text_dim=TEXT_DIM, pooled_dim=POOLED_DIM, **kwargs):
    """A tiny Kandinsky5Transformer3DModel shaped like Video Lite (patch (1, 2, 2), RoPE axes (16, 24, 24): 2 heads of
    64), one text refiner block, `num_layers` visual blocks, random modulations."""
    config = dict(in_visual_dim=CHANNELS, out_visual_dim=CHANNELS, in_text_dim=text_dim, in_text_dim2=pooled_dim,
                  time_dim=32, patch_size=(1, 2, 2), model_dim=128, ff_dim=256, num_text_blocks=1,
                  num_visual_blocks=num_layers, axes_dims=(16, 24, 24))
    config.update(kwargs)
    torch.manual_seed(0)
    tr = Kandinsky5Transformer3DModel(**config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in tr.modules():
            if isinstance(m, Kandinsky5Modulation):
                m.out_layer.weight.copy_(0.03 * torch.randn(m.out_layer.weight.shape, generator=g))
                m.out_layer.bias.copy_(0.3 * torch.randn(m.out_layer.bias.shape, generator=g))
    return tr


def kandinsky_inputs(transformer, batch=1, latent=LATENT, seed=1):
    """As Kandinsky5T2VPipeline / Kandinsky5I2VPipeline call the transformer: channels-last latents (B, T, H, W, C),
    for visual_cond models followed by the condition latents (zeros, as the I2V pipeline leaves them: the image latent
    replaces the first frame of the latents) and the condition mask (1 on the first frame), the text states, the pooled
    CLIP states, per-axis RoPE positions, the RoPE scale of small videos and the pipeline's `sparse_params` (None
    unless the config asks for NABLA)."""
    g = torch.Generator().manual_seed(seed)
    T, H, W = latent
    latents = torch.randn(batch, T, H, W, CHANNELS, generator=g)
    if transformer.visual_cond:
        mask = torch.zeros(batch, T, H, W, 1)
        mask[:, :1] = 1.0
        latents = torch.cat([latents, torch.zeros_like(latents), mask], dim=-1)
    cfg = transformer.config
    pipe = types.SimpleNamespace(transformer=transformer, fast_sta_nabla=Kandinsky5T2VPipeline.fast_sta_nabla)
    return dict(
        hidden_states=latents,
        encoder_hidden_states=torch.randn(batch, TEXT, cfg.in_text_dim, generator=g),
        pooled_projections=torch.randn(batch, cfg.in_text_dim2, generator=g),
        timestep=torch.full((batch,), 600.0),
        visual_rope_pos=[torch.arange(T), torch.arange(H // 2), torch.arange(W // 2)],
        text_rope_pos=torch.arange(TEXT),
        scale_factor=(1, 3.16, 3.16),
        sparse_params=Kandinsky5T2VPipeline.get_sparse_params(pipe, latents, "cpu"),
    )


class TestKandinsky5Processors(ProcessorTesterMixin):
    """Video Lite-like: patch (1, 2, 2), 2 heads x 64; visual self-attention over the video tokens only."""

    def make_transformer(self):
        return tiny_kandinsky(self.num_layers)

    def make_inputs(self, transformer):
        return kandinsky_inputs(transformer)

    def to_cuda_bf16(self, transformer):
        # the time embedding and modulations stay fp32, as from_pretrained(torch_dtype=torch.bfloat16) keeps them
        return cast_like_from_pretrained(transformer.to("cuda"), torch.bfloat16)


def test_sparse_runs_on_visual_self_attention_only():
    """Only visual_transformer_blocks.<i>.self_attention is replaced: the text refiner's self-attention and the
    cross-attention keep their processor objects; one forward runs sparse on every served layer over the grid."""
    tr, before, records, _, _ = check_blocks_attn1_served(TestKandinsky5Processors(), Kandinsky5AttnProcessor, SERVED)
    after = attention_processors(tr)
    assert all(isinstance(after[n], Kandinsky5SparseAttnProcessor) for n in SERVED)
    assert sorted(n for n in before if n not in SERVED) == [
        "text_transformer_blocks.0.self_attention.processor",
        "visual_transformer_blocks.0.cross_attention.processor",
        "visual_transformer_blocks.1.cross_attention.processor"]
    assert [(r.layer, r.grid, r.text_len, r.text_position) for r in records] == [(i, GRID, 0, None) for i in range(2)]
    assert records[0].q.shape == (1, 378, 2, 64)


def test_patch_embed_and_rope_are_time_major():
    """The token order the layout assumes: Kandinsky5VisualEmbeddings + fractal_flatten (no NABLA) put patch (t, h, w)
    at t*H*W + h*W + w, and the RoPE tables follow the same order (time angles vary with t only, height with h, width
    with w)."""
    T, H, W = GRID
    index = torch.arange(T * H * W, dtype=torch.float32).view(T, H, W)
    pixels = index.repeat_interleave(2, 1).repeat_interleave(2, 2)[None, ..., None]       # (1, T, 2H, 2W, 1)
    embed = Kandinsky5VisualEmbeddings(1, 1, (1, 2, 2))
    with torch.no_grad():
        embed.in_layer.weight.fill_(0.25)
        embed.in_layer.bias.zero_()
        tokens = embed(pixels)
    tr = tiny_kandinsky(num_layers=1)
    rope = tr.visual_rope_embeddings((1, T, H, W), [torch.arange(T), torch.arange(H), torch.arange(W)])
    tokens, rope = fractal_flatten(tokens, rope, (1, T, H, W))                                # as the forward does
    assert torch.equal(tokens[0, :, 0], torch.arange(T * H * W, dtype=torch.float32))
    angles = torch.atan2(rope[0, :, 0, :, 1, 0], rope[0, :, 0, :, 0, 0]).view(T, H, W, -1)    # [t | h | w] pairs
    t_part, h_part, w_part = angles.split([8, 12, 12], dim=-1)
    assert torch.equal(t_part, t_part[:, :1, :1].expand_as(t_part)) and not torch.equal(t_part[0], t_part[1])
    assert torch.equal(h_part, h_part[:1, :, :1].expand_as(h_part)) and not torch.equal(h_part[:, 0], h_part[:, 1])
    assert torch.equal(w_part, w_part[:1, :1, :].expand_as(w_part)) and not torch.equal(w_part[..., 0, :],
                                                                                        w_part[..., 1, :])


def test_nabla_token_order_is_the_tile_order_of_8x8_blocks():
    """What NABLA's `fractal_flatten(..., block_mask=True)` hands the blocks: the time-major tokens permuted into 8 x 8
    spatial blocks, which is videosparse's own tile order for tile (1, 8, 8), not a time-major grid; so those calls
    keep the stock processor (next test) instead of being described by a grid."""
    grid = (2, 16, 24)
    index = torch.arange(2 * 16 * 24).view(1, *grid, 1)
    fractal, _ = fractal_flatten(index, index, (1, *grid), block_mask=True)
    assert torch.equal(fractal.flatten(), TileLayout(grid, (1, 8, 8), 64).perm)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_nabla_config_runs_stock_with_one_warning(caplog):
    """attention_type="nabla" (the Pro HD and Lite 10s configs): the pipeline's sparse_params make the forward reorder
    the tokens and the stock processor run NABLA's flex-attention block mask; videosparse leaves every such call to
    the stock processor (output equal to stock), warned once per layer. Flex attention is the backend NABLA needs."""
    t = TestKandinsky5Processors()
    tr = tiny_kandinsky(attention_type="nabla", attention_P=0.9, attention_wT=11, attention_wH=3, attention_wW=3,
                        attention_add_sta=True, attention_method="topcdf")
    tr.set_attention_backend("flex")
    inputs = kandinsky_inputs(tr, latent=(2, 32, 48))
    assert inputs["sparse_params"]["to_fractal"]
    assert_runs_stock_with_one_warning(t, tr, inputs, "NABLA", caplog)
    assert all(p._attention_backend == "flex" for p in attention_processors(tr).values())


def test_grid_from_channels_last_hidden_states():
    tr = tiny_kandinsky(num_layers=1)
    inputs = kandinsky_inputs(tr)
    assert kandinsky_grid(tr, (), inputs) == (GRID, 0)
    assert kandinsky_grid(tr, (inputs["hidden_states"],), {}) == (GRID, 0)
    wide = tiny_kandinsky(num_layers=1, patch_size=(1, 1, 2))
    assert kandinsky_grid(wide, (), inputs) == ((3, 14, 18), 0)


@pytest.mark.parametrize("variant", ["i2v", "image"])
def test_i2v_and_image_configs(variant):
    """I2V (visual_cond: condition latents and mask as 2C + 1 input channels, no extra token) and Image Lite (one
    latent frame): the visual self-attention is served, density 1 equals stock, density 0.3 runs sparse."""
    t = TestKandinsky5Processors()
    tr = tiny_kandinsky(visual_cond=variant == "i2v")
    latent = LATENT if variant == "i2v" else (1, 16, 36)
    inputs = kandinsky_inputs(tr, latent=latent)
    ref = t.run(tr, inputs)
    _, served = apply_and_list_served(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert served == SERVED
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-4 * ref.abs().max()      # see test_density_one_one_block
    assert sessions(tr)["transformer"].context.grid == (latent[0], latent[1] // 2, latent[2] // 2)
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    out = t.run(tr, inputs)
    s = sessions(tr)["transformer"].stats()
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    assert s["sparse_calls"] == 2 and s["dense_calls"] == 0 and s["density"] < 0.7


def test_batch_of_two():
    """Batch 2 (the shared tests' `run` gives item 0 of the bare tensor the forward returns): density 1 equals stock
    on both items, and at density 0.3 each item of the batch equals that item run alone."""
    t = TestKandinsky5Processors()
    tr = t.make_transformer()
    inputs = kandinsky_inputs(tr, batch=2)
    alone = [{k: v[b:b + 1] if torch.is_tensor(v) and k != "text_rope_pos" else v for k, v in inputs.items()}
             for b in range(2)]

    def run(kw):
        with torch.no_grad(), tr.cache_context("cond", step_index=0, num_inference_steps=4):
            return tr(**kw).sample

    ref = run(inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (run(inputs) - ref).abs().max() <= 1e-4 * ref.abs().max()
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    out = run(inputs)
    assert not torch.equal(out, ref)
    for b in range(2):
        assert (out[b:b + 1] - run(alone[b])).abs().max() <= 1e-4 * ref.abs().max()


def test_density_one_one_block():
    """One visual block at density 1 matches stock to 1e-6 (the attention itself is exact to fp32). With more blocks a
    ~1e-7 difference can move a rotated q or k element across a bf16 rounding boundary (the stock processor rounds
    them to bf16), so the other multi-block comparisons here use the shared relative tolerance (1e-4 of the output)."""
    t = TestKandinsky5Processors()
    tr = tiny_kandinsky(num_layers=1, visual_cond=True)
    inputs = kandinsky_inputs(tr)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-6
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 1

def test_cross_attention_call_goes_to_stock():
    """A call with encoder states (the visual blocks' cross_attention layout) given to the served processor returns the
    stock output and is neither observed nor counted."""
    t = TestKandinsky5Processors()
    tr = t.make_transformer()
    attn = tr.visual_transformer_blocks[0].self_attention
    g = torch.Generator().manual_seed(3)
    assert_cross_attention_call_is_stock(tr, attn, torch.randn(1, 378, 128, generator=g),
                                         torch.randn(1, TEXT, 128, generator=g))


def test_model_info_of_published_configs():
    """Video Lite (model_dim 1792, axes (16, 24, 24), 32 visual blocks) and Video Pro (4096, (32, 48, 48), 60 visual
    blocks; kandinskylab/kandinsky-5 configs/k5_*.yaml): heads = model_dim / sum(axes_dims), served layers = visual
    blocks."""
    from videosparse.processors import self_attention_processors
    from videosparse.processors.registry import model_info, model_spec

    for dim, ff, axes, text_blocks, blocks, heads, head_dim in [(1792, 7168, (16, 24, 24), 2, 32, 28, 64),
                                                                (4096, 16384, (32, 48, 48), 4, 60, 32, 128)]:
        with torch.device("meta"):
            tr = Kandinsky5Transformer3DModel(in_visual_dim=16, out_visual_dim=16, model_dim=dim, ff_dim=ff,
                                              axes_dims=axes, num_text_blocks=text_blocks, num_visual_blocks=blocks,
                                              visual_cond=True)
        info = model_info(tr, model_spec(tr), len(self_attention_processors(tr)))
        assert (info.num_layers, info.num_heads, info.head_dim) == (blocks, heads, head_dim)
        assert info.patch_size == (1, 2, 2) and info.text_position is None
        assert tr.visual_transformer_blocks[0].self_attention.num_heads == heads


def build_tiny_kandinsky5_pipeline(cls=Kandinsky5T2VPipeline, **transformer_kwargs):
    """A tiny Kandinsky 5 pipeline with random weights, built offline: Qwen2.5-VL (2 layers of width 16) and CLIP
    (1 layer of width 16) text encoders with the tiny word-level tokenizer, a HunyuanVideo VAE (4 latent channels,
    4 x 8 x 8), a tiny transformer, the flow-matching Euler scheduler."""
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModel, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from videosparse.models.tiny_wan import TINY_VOCAB, build_tiny_tokenizer

    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(TINY_VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, pad_token_id=0,
                         bos_token_id=1, eos_token_id=1, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                           patch_size=2, spatial_merge_size=1, temporal_patch_size=1, fullatt_block_indexes=[0]),
    )).eval()
    text_encoder_2 = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(TINY_VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=77, pad_token_id=0, bos_token_id=1, eos_token_id=1)).eval()
    vae = AutoencoderKLHunyuanVideo(latent_channels=CHANNELS, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                    norm_num_groups=4).eval()
    pipe = cls(transformer=tiny_kandinsky(text_dim=16, pooled_dim=16, **transformer_kwargs), vae=vae,
               text_encoder=text_encoder, tokenizer=build_tiny_tokenizer(), text_encoder_2=text_encoder_2,
               tokenizer_2=build_tiny_tokenizer(), scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


PIPE_KW = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=17, height=80, width=256,
               num_inference_steps=2, output_type="np", max_sequence_length=16)
PIPE_GRID = (5, 5, 16)             # 17 x 80 x 256 -> latent 5 x 10 x 32 -> patches 5 x 5 x 16 = 400 tokens
# (I2V renormalises its first 4 latent frames to the statistics of the next ones: at least 5 latent frames)


def _tiny_pipeline(name: str):
    """(pipeline, its call's keyword arguments): text to video, or image to video (visual_cond transformer)."""
    if name == "t2v":
        return build_tiny_kandinsky5_pipeline(), PIPE_KW
    from diffusers import Kandinsky5I2VPipeline
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (80, 256, 3), dtype=np.uint8))
    return build_tiny_kandinsky5_pipeline(Kandinsky5I2VPipeline, visual_cond=True), dict(PIPE_KW, image=image)


@pytest.mark.parametrize("name", ["t2v", "i2v"])
def test_tiny_pipeline_end_to_end(name):
    """Kandinsky5T2VPipeline and Kandinsky5I2VPipeline (CFG as two forwards per step, no cache context): every
    forward's visual self-attention runs sparse on the (5, 5, 16) grid with no fallback, the output changes, and
    remove() restores it exactly; with dense_steps=1 the scheduler's counter makes exactly the first step dense."""
    pipe, kw = _tiny_pipeline(name)

    def run(output_type="np"):
        return pipe(**dict(kw, output_type=output_type), generator=torch.Generator().manual_seed(0)).frames

    ref = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64))
    seen = set()
    with observe(pipe, lambda r: seen.add((r.grid, r.text_len))):
        sparse = run()
    assert seen == {(PIPE_GRID, 0)}
    stats = handle["transformer"].stats()
    assert stats["transformer_calls"] == 4
    assert all(s["dense_calls"] == 0 and s["sparse_calls"] == 4 and s["fallbacks"] == []
               for s in stats["layers"].values())
    assert np.isfinite(sparse).all() and not np.array_equal(sparse, ref)
    videosparse.remove(pipe)
    assert np.array_equal(run(), ref)

    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1))
    steps = []
    with observe(pipe, lambda r: steps.append(r.step)):
        run("latent")
    assert steps == [0] * 4 + [1] * 4                    # 2 forwards (CFG) x 2 layers per step
    layers = handle["transformer"].stats()["layers"]
    assert all(s["dense_calls"] == 2 and s["sparse_calls"] == 2 for s in layers.values())
    videosparse.remove(pipe)


def test_rope_table_as_head_pair_rope_equals_stock_rotation():
    """Kandinsky's 2 x 2 rotation table handed to `attend` as a `HeadPairRope` rotates exactly as the stock does:
    Kandinsky 5 (rounded to bf16) for bf16 q only, Kandinsky 6 (no rounding) in any dtype; a table per batch item is
    not taken."""
    from videosparse.processors.kandinsky import apply_kandinsky_rope, kandinsky_head_pair_rope
    from videosparse.rope import apply_rope

    g = torch.Generator().manual_seed(0)
    angle = torch.randn(1, 40, 1, 16, generator=g) * 3
    c, s = angle.cos(), angle.sin()
    table = torch.stack([c, -s, s, c], dim=-1).unflatten(-1, (2, 2))          # [1, S, 1, D/2, 2, 2]
    x = torch.randn(2, 40, 3, 32, generator=g)
    bf16 = kandinsky_head_pair_rope(table, torch.bfloat16)
    assert torch.equal(apply_rope(x.bfloat16(), bf16), apply_kandinsky_rope(x.bfloat16(), table))
    assert kandinsky_head_pair_rope(table, torch.float32) is None             # stock rounds fp32 q to bf16
    k6 = kandinsky_head_pair_rope(table, torch.float32, rounding=None)
    assert torch.equal(apply_rope(x, k6), apply_kandinsky_rope(x, table, rounding=None))
    assert kandinsky_head_pair_rope(table.expand(2, -1, -1, -1, -1, -1), torch.float32, rounding=None) is None
