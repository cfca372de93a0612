"""Wan-Animate-2 (`WanAnimate2Transformer3DModel`): both passes' self-attention through the shared processor tests
(the reference-extraction pass; the generation pass, whose per-frame reference keys are merged by log-sum-exp with
the sparse generation part), the geometries that keep stock, and the tiny modular pipeline end to end."""

import numpy as np
import pytest
import torch
from diffusers import WanAnimate2Transformer3DModel
from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2AttnProcessor, WanAnimate2KVCache

from videosparse.processors import sessions
from videosparse.processors.base import dense_with_lse, merge_attention
from videosparse.processors.wan import WanAnimate2SparseAttnProcessor

from tester import (
    ProcessorTesterMixin,
    _to_cuda_bf16,
    assert_runs_stock_with_one_warning,
    assert_tiny_pipeline_sparse,
    check_blocks_attn1_served,
    with_cache_context,
)

TINY = dict(patch_size=(1, 2, 2), text_len=8, in_dim=12, dim=128, ffn_dim=64, freq_dim=32, text_dim=16, out_dim=4,
            num_heads=2, num_layers=2, refer_stride=2)    # a temporal RoPE stride in the extraction pass
FRAMES, HEIGHT, WIDTH = 3, 14, 18          # reference latents: 3 x 7 x 9 tokens (odd: partial last tiles)
SERVED = ["blocks.0.self_attn.processor", "blocks.1.self_attn.processor"]


class _StackedOutput(WanAnimate2Transformer3DModel):
    """The tiny model with its per-item outputs (a list of (C, F, H, W)) stacked into one tensor, so that the shared
    tests compare tensors; blocks, processors and forward are WanAnimate2Transformer3DModel's."""

    def forward(self, *args, return_dict=True, **kwargs):
        return (torch.stack(super().forward(*args, return_dict=False, **kwargs)[0]),)


def _latents(batch, channels, frames, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(channels, frames, HEIGHT, WIDTH, generator=g) for _ in range(batch)]


def _common(batch=2):
    g = torch.Generator().manual_seed(3)
    return dict(timestep=torch.tensor([500]), encoder_hidden_states=[torch.randn(5, 16, generator=g)] * batch,
                encoder_hidden_states_image=torch.randn(batch, 4, 1280, generator=g))


def extract_inputs(cache, batch=2):
    """The reference-extraction pass over batch x (3, 14, 18) reference latents, filling `cache`."""
    return dict(_common(batch), hidden_states=_latents(batch, 4, FRAMES, 1),
                condition_latents=_latents(batch, 8, FRAMES, 2), kv_cache=cache, kv_cache_mode="extract",
                seq_len=FRAMES * HEIGHT * WIDTH // 4,
                offset_grid_sizes=torch.tensor([[FRAMES, HEIGHT // 2, WIDTH // 2]] * batch))


def cached_inputs(cache, batch=2):
    """A generation pass over (1 + 3) latent frames against the reference K/V in `cache` (a block mask built for
    exactly this geometry: origin_len 8 -> 3 latent frames, origin_area 112 x 144 pixels -> 7 x 9 tokens)."""
    return dict(_common(batch), hidden_states=_latents(batch, 4, FRAMES + 1, 4),
                condition_latents=_latents(batch, 8, FRAMES + 1, 5), kv_cache=cache, kv_cache_mode="cached",
                seq_len=(FRAMES + 1) * HEIGHT * WIDTH // 4,
                reference_grid_sizes=torch.tensor([[FRAMES, HEIGHT // 2, WIDTH // 2]] * batch),
                origin_len=4 * (FRAMES - 1), origin_area=[HEIGHT * 8, WIDTH * 8])


class TestWanAnimate2Processors(ProcessorTesterMixin):
    """The reference-extraction pass (batch 2, CLIP image context on): unmasked self-attention over (3, 7, 9)."""

    def make_transformer(self):
        torch.manual_seed(0)
        return with_cache_context(_StackedOutput(**TINY).eval())     # no CacheMixin: the tests name step and branch

    def make_inputs(self, transformer):
        return extract_inputs(WanAnimate2KVCache(transformer.config.num_layers))


def test_self_attn_served_cross_attn_stock():
    """Exactly the blocks' self_attn are replaced (cross_attn, text + CLIP image, keeps its stock processor); the
    extraction pass runs sparse on every layer over the (3, 7, 9) grid, and the K/V it caches are those of stock."""
    t = TestWanAnimate2Processors()
    transformer, before, records, _, _ = check_blocks_attn1_served(t, WanAnimate2AttnProcessor, SERVED)
    assert all(type(p) is WanAnimate2SparseAttnProcessor for n, p in transformer.attn_processors.items() if n in SERVED)
    assert all(type(before[n]).__name__ == "WanAnimate2CrossAttnProcessor" for n in before if n not in SERVED)
    assert {(r.grid, r.text_len) for r in records} == {((FRAMES, HEIGHT // 2, WIDTH // 2), 0)}
    # layer 0's cached K/V come before any attention: identical to a stock pass's
    stock = t.make_transformer()
    stock_cache, cache = WanAnimate2KVCache(2), WanAnimate2KVCache(2)
    t.run(stock, extract_inputs(stock_cache))
    t.run(transformer, extract_inputs(cache))
    assert all(torch.equal(a, b) for a, b in zip(cache.get(0).get(), stock_cache.get(0).get()))
    assert not torch.equal(cache.get(1).key, stock_cache.get(1).key)      # layer 1 sees layer 0's sparse output


class TestWanAnimate2GenerationPass(TestWanAnimate2Processors):
    """The generation pass (batch 2): (1 + 3, 7, 9) generation tokens, each frame f >= 1 also attending to the
    cached reference frame f - 1 (the cache filled by an extraction pass of the same transformer first)."""

    def make_inputs(self, transformer):
        cache = WanAnimate2KVCache(transformer.config.num_layers)
        extract = extract_inputs(cache)
        if next(transformer.parameters()).is_cuda:
            extract = _to_cuda_bf16(extract)
        self.run(transformer, extract)
        return cached_inputs(cache)


def test_generation_pass_sparse_records_its_grid():
    """Veda at density 0.5: every layer's generation call runs sparse over the (1 + 3, 7, 9) grid, no fallback, a
    finite output that differs from stock; its density counts the generation part."""
    t = TestWanAnimate2GenerationPass()
    transformer, _, records, _, _ = check_blocks_attn1_served(t, WanAnimate2AttnProcessor, SERVED)
    assert {(r.grid, r.text_len) for r in records} == {((FRAMES + 1, HEIGHT // 2, WIDTH // 2), 0)}
    assert all(s["fallbacks"] == [] for s in sessions(transformer)["transformer"].stats()["layers"].values())


def test_dense_with_lse_and_merge_equal_attention_over_the_union():
    """dense_with_lse on odd lengths equals softmax attention with its log-sum-exp, and merge_attention of two
    disjoint key sets equals attention over their union (float64)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 37, 3, 64, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 37 + 21, 3, 64, dtype=torch.float64, generator=g) for _ in range(2))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8.0
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    out_a, lse_a = dense_with_lse(q, k[:, :37], v[:, :37], "reference")
    lse_a_ref = scores[..., :37].logsumexp(-1).transpose(1, 2)
    assert lse_a.dtype == torch.float32 and (lse_a - lse_a_ref).abs().max() < 1e-5       # the kernels' lse: fp32
    assert (out_a - torch.einsum("bhqk,bkhd->bqhd", scores[..., :37].softmax(-1), v[:, :37])).abs().max() < 1e-12
    b = scores[..., 37:]
    out_b = torch.einsum("bhqk,bkhd->bqhd", b.softmax(-1), v[:, 37:])
    out, lse = merge_attention(out_a, lse_a_ref, out_b, b.logsumexp(-1).transpose(1, 2))
    assert (out - ref).abs().max() < 1e-12 and (lse - scores.logsumexp(-1).transpose(1, 2)).abs().max() < 1e-12
    out32, _ = merge_attention(out_a.float(), lse_a, out_b.float(), b.logsumexp(-1).transpose(1, 2).float())
    assert out32.dtype == torch.float32 and (out32 - ref).abs().max() < 1e-5


def test_two_key_sets_merged_by_lse_equal_attention_over_both():
    """Queries over their own keys and over a shorter set of keys (another length, a partial tile) on the kernel
    (`dense_with_lse`), each with its log-sum-exp, merged = attention over the union (fp64); KV heads repeated to the
    query heads as SDPA's enable_gqa."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 200, 4, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 200, 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
    k_txt, v_txt = (torch.randn(2, 37, 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), torch.cat([k, k_txt], 1).transpose(1, 2), torch.cat([v, v_txt], 1).transpose(1, 2),
        enable_gqa=True).transpose(1, 2)
    parts = [dense_with_lse(q, a.repeat_interleave(2, dim=2), b.repeat_interleave(2, dim=2), "reference")
             for a, b in ((k, v), (k_txt, v_txt))]
    out, _ = merge_attention(*parts[0], *parts[1])
    assert (out - ref).abs().max() <= 1e-6             # the kernels' lse is fp32


def test_rope_tables_equal_diffusers_rope_apply():
    """wan_animate2_rope + apply_interleaved_rope (fp32) equals diffusers' rope_apply (float64) on an odd grid with a
    temporal stride and offset positions."""
    from diffusers.models.transformers.transformer_wan_animate_2 import rope_apply

    from videosparse.processors.wan import wan_animate2_rope
    from videosparse.rope import apply_interleaved_rope

    freqs = _StackedOutput(**TINY)._rope_freqs((1, 0, 9), torch.device("cpu"))
    grid = (3, 5, 7)
    x = torch.randn(2, 105, 2, 64)
    ref = rope_apply(x, torch.tensor([grid, grid]), freqs, 2)
    assert (apply_interleaved_rope(x, *wan_animate2_rope(freqs, grid, 2)) - ref).abs().max() < 1e-5


@pytest.mark.parametrize("origin", [dict(origin_len=4 * FRAMES), dict(origin_area=[HEIGHT * 8, (WIDTH + 2) * 8])])
def test_generation_geometry_off_the_mask_runs_stock(origin, caplog):
    """A segment that does not fill the geometry the block mask is built for (one origin frame more than the
    segment, or wider frames: stock then attends to its zero padding too) keeps the stock processor, one warning
    per layer."""
    t = TestWanAnimate2GenerationPass()
    transformer = t.make_transformer()
    inputs = dict(t.make_inputs(transformer), **origin)
    assert_runs_stock_with_one_warning(t, transformer, inputs, "does not fill the block mask", caplog)


def _tiny_pipeline():
    """A tiny `WanAnimate2ModularPipeline` (diffusers has no classic Wan-Animate-2 pipeline), built offline with
    random weights: the tiny Wan pipeline's text encoder, tokenizer, VAE (z_dim 4) and Euler scheduler, a tiny CLIP
    vision encoder (224 x 224 pixels, hidden size 24; the transformer has no CLIP projection) and a tiny
    transformer (latents 4 + condition 8 channels)."""
    from diffusers import WanAnimate2Blocks
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    wan = build_tiny_wan_pipeline()
    torch.manual_seed(0)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=24, intermediate_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, image_size=224, patch_size=32)).eval()
    transformer = WanAnimate2Transformer3DModel(**dict(TINY, text_len=512, text_dim=32, use_img_emb=False)).eval()
    pipe = WanAnimate2Blocks().init_pipeline()
    pipe.update_components(transformer=transformer, vae=wan.vae, text_encoder=wan.text_encoder,
                           tokenizer=wan.tokenizer, image_encoder=image_encoder, scheduler=wan.scheduler)
    return pipe


def test_tiny_modular_pipeline_end_to_end():
    """WanAnimate2ModularPipeline, a 9-frame driving video in two segments of 5 frames (the second conditioned on the
    first's last frame) at 64 x 160 pixels, 2 steps with guidance: every forward (each segment's extraction pass over
    the (2, 4, 10) grid, then 2 steps x 2 guidance branches of generation passes over (1 + 2, 4, 10), 2 tiles a frame
    group, the last partial) runs sparse on both layers, the video changes, and remove() restores it exactly."""
    from PIL import Image

    pipe = _tiny_pipeline()
    rng = np.random.default_rng(0)

    def frame():
        return Image.fromarray(rng.integers(0, 256, (64, 160, 3), dtype=np.uint8))

    image, video = frame(), [frame() for _ in range(9)]

    def run():
        return np.asarray(pipe(image=image, driving_video=video, prompt="a red circle", negative_prompt="blue",
                               prompt_ref="a red circle", height=64, width=160, segment_frame_length=5,
                               num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0),
                               output="videos"))

    assert_tiny_pipeline_sparse(pipe, run, lambda r: r.grid, {(2, 4, 10), (3, 4, 10)}, calls=2 * 5)


def test_attention_timer_times_the_generation_pass_whole(monkeypatch):
    """`AttentionTimer` times the generation pass's reference-frame part and merge too (it timed `attend`, the
    generation part alone): on a clock that only the reference part moves (50 ms a call), every generation-pass call
    is timed at 50 ms, and the extraction pass's calls are still timed (at 0: no wall-clock timing, which a busy
    machine stretches)."""
    import types

    import videosparse
    import videosparse.eval.timing as timing
    import videosparse.processors.wan as wan
    from videosparse import VedaConfig
    from videosparse.eval.timing import AttentionTimer

    clock = [0.0]

    def slow_dense_with_lse(*args, **kwargs):
        clock[0] += 0.05
        return dense_with_lse(*args, **kwargs)

    monkeypatch.setattr(wan, "dense_with_lse", slow_dense_with_lse)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    t = TestWanAnimate2GenerationPass()
    transformer = t.make_transformer()
    videosparse.apply(transformer, VedaConfig(density=0.5, block=t.block, tiling=t.tiling))
    timer = AttentionTimer([transformer])
    with timer(), torch.no_grad():
        inputs = t.make_inputs(transformer)        # runs the extraction pass
        t.run(transformer, inputs)
    assert len(timer.attention_s) == 4
    assert timer.attention_s[:2] == [0.0, 0.0] and timer.attention_s[2:] == pytest.approx([0.05, 0.05])
