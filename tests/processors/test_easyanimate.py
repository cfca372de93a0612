"""EasyAnimate: joint [text; video] attention in every block's attn1, text first and unmasked (global tiles)."""

import logging

import torch
from diffusers import EasyAnimateTransformer3DModel
from diffusers.models.transformers.transformer_easyanimate import EasyAnimateAttnProcessor2_0

import videosparse
from videosparse.processors import attention_processors, sessions
from videosparse.processors.easyanimate import EasyAnimateSparseAttnProcessor, easyanimate_grid

from tester import (ProcessorTesterMixin, assert_batch_items_sparse_as_alone, assert_tiny_pipeline_sparse,
                    check_blocks_attn1_served, check_extra_tokens_served_as_global_tiles, with_cache_context)

TEXT, TEXT_T5 = 8, 6
LATENT = (3, 14, 36)            # latent (F, H, W); patch 2 -> grid 3 x 7 x 18 = 378 tokens: partial (1, 4, 16) tiles
GRID = (3, 7, 18)


def tiny_easyanimate(**overrides):
    torch.manual_seed(0)
    cfg = dict(num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, patch_size=2,
               num_layers=2, mmdit_layers=2, time_embed_dim=32, text_embed_dim=16, sample_width=36, sample_height=14)
    return with_cache_context(EasyAnimateTransformer3DModel(**dict(cfg, **overrides)).eval())


class TestEasyAnimateProcessors(ProcessorTesterMixin):
    """EasyAnimate V5.1-like: every block MMDiT (text through the add_*_proj layers), batch 2."""

    mmdit_layers = 2

    def make_transformer(self):
        return tiny_easyanimate(mmdit_layers=self.mmdit_layers)

    def make_inputs(self, transformer, batch=2):
        """As EasyAnimatePipeline passes them (a guidance batch of 2): latents (B, C, F, H, W), the text encoder's
        states (all tokens, no mask), the timestep per item."""
        g = torch.Generator().manual_seed(1)
        return dict(hidden_states=torch.randn(batch, 4, *LATENT, generator=g),
                    timestep=torch.tensor([500.0, 500.0][:batch]),
                    encoder_hidden_states=torch.randn(batch, TEXT, 16, generator=g))


class TestEasyAnimateMixedBlocksProcessors(TestEasyAnimateProcessors):
    """`mmdit_layers=1`: the second block is not MMDiT (its text goes through to_q/k/v with the video)."""

    mmdit_layers = 1


def test_attn1_served_text_first():
    tr, before, records, out, dense = check_blocks_attn1_served(TestEasyAnimateProcessors(),
                                                                EasyAnimateAttnProcessor2_0)
    assert (out - dense).norm() / dense.norm() < 0.5
    assert all(isinstance(p, EasyAnimateSparseAttnProcessor) for p in attention_processors(tr).values())
    r = records[0]
    assert r.grid == GRID and r.text_len == TEXT and r.text_position == "before" and r.q.shape == (2, TEXT + 378, 2, 64)


def test_text_rows_first_attend_densely():
    """Sparse at density 0.3, the first TEXT rows (the text, global tiles) get exactly dense attention and the video
    rows do not: the layout puts the text where the model does, before the video."""
    t = TestEasyAnimateProcessors()
    tr = t.make_transformer()
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    session = sessions(tr)["transformer"]
    session.context.grid, session.context.text_len = GRID, TEXT
    session.prepare(GRID, TEXT, torch.device("cpu"), torch.float32)
    proc = attention_processors(tr)["transformer_blocks.0.attn1.processor"]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, TEXT + 378, 2, 64, generator=g) for _ in range(3))
    out, dense = proc.attend(q, k, v), proc._dense(q, k, v, None)
    assert session.stats()["sparse_calls"] == 1
    assert (out[:, :TEXT] - dense[:, :TEXT]).abs().max() <= 1e-5
    assert (out[:, TEXT:] - dense[:, TEXT:]).abs().max() > 1e-3


def test_patch_embed_and_rope_are_time_major():
    """The token order the layout assumes, read from the forward itself: the per-frame Conv2d patch embedding and the
    forward's flatten put patch (t, h, w) at t*H*W + h*W + w (each patch holds its index, the conv averages it), and
    the RoPE tables follow the same order (time angles vary with t only, height with h, width with w)."""
    T, H, W = GRID
    tr = tiny_easyanimate(num_layers=1, mmdit_layers=1)
    index = torch.arange(T * H * W, dtype=torch.float32).view(T, H, W)
    pixels = index.repeat_interleave(2, 1).repeat_interleave(2, 2)[None, None].expand(1, 4, -1, -1, -1)
    with torch.no_grad():
        tr.proj.weight.fill_(1.0 / (4 * 2 * 2))
        tr.proj.bias.zero_()
    seen = []
    tr.transformer_blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        tr(pixels, torch.tensor([1.0]), encoder_hidden_states=torch.zeros(1, TEXT, 16))
    assert torch.allclose(seen[0][0, :, 0], index.flatten())

    cos, _ = tr.rope_embedding(pixels)
    cos = cos.view(T, H, W, -1)
    t_part, h_part, w_part = cos.split([16, 24, 24], dim=-1)          # dim_t = D / 4, dim_h = dim_w = 3 D / 8
    assert torch.equal(t_part, t_part[:, :1, :1].expand_as(t_part)) and not torch.equal(t_part[0], t_part[1])
    assert torch.equal(h_part, h_part[:1, :, :1].expand_as(h_part)) and not torch.equal(h_part[:, 0], h_part[:, 1])
    assert torch.equal(w_part, w_part[:1, :1, :].expand_as(w_part)) and not torch.equal(w_part[..., 0, :],
                                                                                        w_part[..., 1, :])


def test_grid_counts_every_text_token():
    tr = tiny_easyanimate()
    inputs = TestEasyAnimateProcessors().make_inputs(tr)
    assert easyanimate_grid(tr, (), inputs) == (GRID, TEXT)
    x, t, text = inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"]
    assert easyanimate_grid(tr, (x, t, None, text), {}) == (GRID, TEXT)
    both = dict(encoder_hidden_states=text, encoder_hidden_states_t5=torch.zeros(2, TEXT_T5, 8))
    assert easyanimate_grid(tr, (x,), both) == (GRID, TEXT + TEXT_T5)


def test_t5_text_served_as_global_tiles(caplog):
    """A config with a second (T5) text encoder: its tokens follow the first text's, before the video; all of them
    are global tiles, density 1 equals stock, density 0.3 runs sparse on every layer."""
    t = TestEasyAnimateProcessors()
    tr = tiny_easyanimate(text_embed_dim_t5=8)
    inputs = dict(t.make_inputs(tr), encoder_hidden_states_t5=torch.randn(2, TEXT_T5, 8))
    check_extra_tokens_served_as_global_tiles(t, tr, inputs, GRID, TEXT + TEXT_T5, "before", caplog)


def test_inpaint_and_control_latents_are_channels(caplog):
    """EasyAnimateInpaintPipeline's inpaint latents (mask + masked video) and EasyAnimateControlPipeline's control
    latents are concatenated as channels before the patch embedding: the grid and the text are unchanged."""
    t = TestEasyAnimateProcessors()
    tr = tiny_easyanimate(in_channels=4 + 5 + 4)
    g = torch.Generator().manual_seed(4)
    inputs = dict(t.make_inputs(tr), inpaint_latents=torch.randn(2, 5, *LATENT, generator=g),
                  control_latents=torch.randn(2, 4, *LATENT, generator=g))
    check_extra_tokens_served_as_global_tiles(t, tr, inputs, GRID, TEXT, "before", caplog)


def test_batch_items_sparse_as_alone(caplog):
    t = TestEasyAnimateMixedBlocksProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    inputs["encoder_hidden_states"][1] += 1.0           # the two items differ in text too
    assert_batch_items_sparse_as_alone(t, tr, inputs, t.num_layers, caplog)


def test_masked_or_textless_call_runs_stock_with_one_warning(caplog):
    """The model always gives attn1 its text and never a mask; a caller that gives a mask, or no text, gets the stock
    processor's output, not observed, warned once per layer and reason."""
    t = TestEasyAnimateProcessors()
    tr = t.make_transformer()
    attn = tr.transformer_blocks[0].attn1
    g = torch.Generator().manual_seed(3)
    x, text = torch.randn(1, 378, 128, generator=g), torch.randn(1, TEXT, 128, generator=g)
    mask = torch.rand(1, 1, 1, TEXT + 378, generator=g) > 0.3
    with torch.no_grad():
        ref_masked = attn(x, encoder_hidden_states=text, attention_mask=mask)
        ref_textless = attn(x)
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
        session = sessions(tr)["transformer"]
        records = []
        with caplog.at_level(logging.WARNING, logger="videosparse"):
            session.observers.append(records.append)
            masked = [attn(x, encoder_hidden_states=text, attention_mask=mask) for _ in range(2)]
            textless = [attn(x) for _ in range(2)]
    assert all(torch.equal(a, b) for out in masked for a, b in zip(out, ref_masked))
    assert all(torch.equal(out[0], ref_textless[0]) and out[1] is None for out in textless) and records == []
    warnings = [r.getMessage() for r in caplog.records if "runs dense" in r.getMessage()]
    assert len(warnings) == 2 and "an attention mask was given" in warnings[0] and "no text" in warnings[1]
    assert session.stats()["layers"][0]["dense_calls"] == 4


def test_sol_runs_sparse():
    t = TestEasyAnimateMixedBlocksProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.SolConfig(density=0.5, block=t.block))
    out = t.run(tr, inputs)
    s = sessions(tr)["transformer"].stats()
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    assert s["sparse_calls"] == 2 and s["dense_calls"] == 0


def test_model_info_of_default_config():
    """The class defaults (48 heads of 64, 48 blocks, all MMDiT, Qwen2-VL 7B text width 3584: EasyAnimate V5.1 12B):
    48 served layers, patch (1, 2, 2), text before the video."""
    from videosparse.processors import self_attention_processors
    from videosparse.processors.registry import model_info, model_spec

    with torch.device("meta"):
        tr = EasyAnimateTransformer3DModel(in_channels=16, out_channels=16, patch_size=2)
    info = model_info(tr, model_spec(tr), len(self_attention_processors(tr)))
    assert (info.num_layers, info.num_heads, info.head_dim) == (48, 48, 64)
    assert info.patch_size == (1, 2, 2) and info.text_position == "before"


def build_tiny_easyanimate_pipeline():
    """A tiny EasyAnimatePipeline with random weights, built offline: Qwen2-VL (2 layers of width 16) with the tiny
    word-level tokenizer and a plain chat template, a Magvit VAE (4 latent channels, 8 x spatial, 4 x temporal), the
    tiny transformer, the flow-matching Euler scheduler."""
    from diffusers import AutoencoderKLMagvit, EasyAnimatePipeline, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from videosparse.models.tiny_wan import TINY_VOCAB, build_tiny_tokenizer

    torch.manual_seed(0)
    text_encoder = Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=dict(vocab_size=len(TINY_VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, pad_token_id=0,
                         bos_token_id=1, eos_token_id=1, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=16, mlp_ratio=1, num_heads=2, patch_size=2,
                           spatial_merge_size=1, temporal_patch_size=1),
    )).eval()
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% for c in m['content'] %}{{ c['text'] }} {% endfor %}"
                               "{% endfor %}")
    vae = AutoencoderKLMagvit(latent_channels=4, block_out_channels=[8, 8, 8, 8], layers_per_block=1,
                              norm_num_groups=4).eval()
    pipe = EasyAnimatePipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                               transformer=tiny_easyanimate(), scheduler=FlowMatchEulerDiscreteScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_tiny_pipeline_end_to_end():
    """EasyAnimatePipeline (guidance as one batch of 2, the prompt padded to 256 tokens, all attended): every forward
    runs sparse on the (3, 4, 15) grid (partial tiles) with the 256 text tokens as global tiles and no fallback, the
    output changes, and remove() restores it exactly."""
    pipe = build_tiny_easyanimate_pipeline()
    kw = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=64, width=240,
              num_inference_steps=2, output_type="np")

    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0)).frames

    assert_tiny_pipeline_sparse(pipe, run, lambda r: (r.grid, r.text_len, r.q.shape[0]), {((3, 4, 15), 256, 2)},
                                calls=2)
