"""Mochi 1: joint [video; T5 text] attention, the valid text prefix attended, padded text rows zero as in stock."""

import logging
import types

import pytest
import torch
from diffusers import MochiTransformer3DModel
from diffusers.models import attention_processor
from diffusers.models.attention_processor import MochiAttnProcessor2_0

import videosparse
from videosparse.processors import attention_processors, sessions
from videosparse.processors.mochi import MochiSparseAttnProcessor, mochi_grid
from videosparse.rope import apply_head_pair_rope

from tester import ProcessorTesterMixin

TEXT = 8


class TestMochiProcessors(ProcessorTesterMixin):
    num_layers = 2          # the second block is context_pre_only (no to_add_out)

    def make_transformer(self):
        torch.manual_seed(0)
        tr = MochiTransformer3DModel(
            patch_size=2, num_attention_heads=2, attention_head_dim=self.head_dim, num_layers=self.num_layers,
            pooled_projection_dim=32, in_channels=4, text_embed_dim=16, time_embed_dim=32, max_sequence_length=TEXT,
        ).eval()
        with torch.no_grad():       # the published weights' RoPE frequencies are learned; zeros would make it identity
            tr.pos_frequencies.normal_(0.0, 0.5)
        return tr

    def make_inputs(self, transformer, valid=(5,), mask=None):
        """As MochiPipeline passes them: latents (B, C, F, H, W), T5 states padded to TEXT tokens with a boolean
        prefix mask, the timestep in the latents' dtype."""
        g = torch.Generator().manual_seed(1)
        B = len(valid)
        if mask is None:
            mask = torch.arange(TEXT)[None, :] < torch.tensor(valid)[:, None]
        # grid after patching: 3 x 7 x 18 = 378 video tokens (odd, partial last tile), then the text
        return dict(
            hidden_states=torch.randn(B, 4, 3, 14, 36, generator=g),
            encoder_hidden_states=torch.randn(B, TEXT, 16, generator=g),
            timestep=torch.tensor([500.0] * B),
            encoder_attention_mask=mask,
        )


def _tiny():
    t = TestMochiProcessors()
    return t, t.make_transformer()


def _stock_rope():
    """The RoPE function nested in the stock `MochiAttnProcessor2_0.__call__`, rebuilt from its code object."""
    code = next(c for c in MochiAttnProcessor2_0.__call__.__code__.co_consts
                if isinstance(c, types.CodeType) and c.co_name == "apply_rotary_emb")
    return types.FunctionType(code, vars(attention_processor))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_stock_bitwise(dtype):
    x = torch.randn(2, 30, 3, 64).to(dtype)
    freqs = torch.randn(30, 3, 32) * 3
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    out = apply_head_pair_rope(x, cos, sin)
    assert out.dtype == dtype and torch.equal(out, _stock_rope()(x, cos, sin))
    text = torch.randn(2, 7, 3, 64).to(dtype)          # rows after the tables' rows: not rotated
    assert torch.equal(apply_head_pair_rope(torch.cat([x, text], 1), cos, sin), torch.cat([out, text], 1))


def test_grid_spatial_patch_and_valid_prefix():
    t, tr = _tiny()
    for valid, lengths in (((5, 5), 5), ((8,), 8), ((1, 6), (1, 6))):
        grid, text, reason = mochi_grid(tr, (), t.make_inputs(tr, valid=valid))
        assert grid == (3, 7, 18) and reason is None and text.total == TEXT and text.lengths() == lengths
        assert text.valid.dtype == torch.int32 and text.valid.tolist() == list(valid)


def test_token_order_is_time_major():
    """One latent patch changed at (f, h, w) changes the first layer's query of token f*H*W + h*W + w alone."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr)

    def first_query(inputs):
        queries = []
        with videosparse.processors.observe(tr, lambda r: queries.append(r.q)):
            t.run(tr, inputs)
        return queries[0]

    f, h, w = 2, 5, 11
    latents = inputs["hidden_states"].clone()
    latents[0, :, f, 2 * h + 1, 2 * w] += 1.0
    changed = (first_query(dict(inputs, hidden_states=latents)) - first_query(inputs)).abs().amax(dim=(0, 2, 3))
    assert changed.nonzero().flatten().tolist() == [f * 7 * 18 + h * 18 + w]


def test_every_block_attn1_served():
    t, tr = _tiny()
    before = dict(attention_processors(tr))
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    procs = attention_processors(tr)
    assert sorted(procs) == ["transformer_blocks.0.attn1.processor", "transformer_blocks.1.attn1.processor"]
    assert all(type(before[n]) is MochiAttnProcessor2_0 for n in procs)
    assert all(isinstance(procs[n], MochiSparseAttnProcessor) for n in procs)
    assert [p.layer for p in procs.values()] == [0, 1]
    info = sessions(tr)["transformer"].info
    assert (info.num_heads, info.head_dim, info.patch_size, info.text_position) == (2, 64, (1, 2, 2), "after")
    videosparse.remove(tr)
    assert all(attention_processors(tr)[n] is before[n] for n in before)


def test_padded_text_density_one_equals_stock():
    """5 of 8 text tokens valid: the layouts cover the video and the valid prefix; the output equals stock for the
    dense config and at density 1; a sparse density runs on the padded batch too."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr, valid=(5, 5))
    ref = t.run(tr, inputs)
    for config in (videosparse.DenseConfig(), videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block)):
        videosparse.apply(tr, config)
        text_lens = []
        with videosparse.processors.observe(tr, lambda r: text_lens.append(r.text_len)):
            out = t.run(tr, inputs)
        assert set(text_lens) == {5}
        assert (out - ref).abs().max() <= 1e-5, config
        if config.method != "dense":
            s = sessions(tr)["transformer"].stats()
            assert s["sparse_calls"] == 2 and s["dense_calls"] == 0 and s["density"] == 1.0
        videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    out = t.run(tr, inputs)
    assert torch.isfinite(out).all() and sessions(tr)["transformer"].stats()["sparse_calls"] == 2


def test_padded_text_rows_are_zero_as_in_stock():
    """One block's attention alone: video and valid text outputs equal stock, the padded text rows are the stock's
    zeros (through to_add_out: its bias)."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr, valid=(5,))
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    t.run(tr, inputs)                                        # records grid and the valid length
    attn = tr.transformer_blocks[0].attn1
    g = torch.Generator().manual_seed(2)
    video, text = torch.randn(1, 378, 128, generator=g), torch.randn(1, TEXT, 32, generator=g)
    rope = tr.rope(tr.pos_frequencies, 3, 7, 18, dtype=torch.float32)
    mask = inputs["encoder_attention_mask"]
    with torch.no_grad():
        out = attn.processor(attn, video, text, mask, rope)
        ref = MochiAttnProcessor2_0()(attn, video, text, mask, rope)
    for a, b in zip(out, ref):
        assert (a - b).abs().max() <= 1e-5
    assert torch.equal(out[1][:, 5:], attn.to_add_out.bias.expand(1, 3, -1))


def test_unequal_valid_lengths_run_in_one_call(caplog):
    """CFG batches [negative; positive] prompts in one forward: one sparse call for both, each item's padded keys
    masked in the kernel and its padded rows zero, as it would run alone; at density 1 the output equals stock."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr, valid=(1, 6))
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-4 * ref.abs().max()
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        out = t.run(tr, inputs)
    assert not [r for r in caplog.records if "runs dense" in r.message]
    s = sessions(tr)["transformer"].stats()
    assert s["sparse_calls"] == 2 and s["dense_calls"] == 0                 # 2 layers, one call each
    for b in range(2):
        alone = t.run(tr, {k: (v[b:b + 1] if torch.is_tensor(v) else v) for k, v in inputs.items()})
        assert (out[b:b + 1] - alone).abs().max() <= 1e-5


def test_non_prefix_mask_runs_stock():
    """A mask whose valid tokens are not all first (equal counts across the batch) runs stock: the stock processor
    packs the valid rows first, which no prefix layout reproduces."""
    t, tr = _tiny()
    mask = torch.tensor([[1, 0, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    inputs = t.make_inputs(tr, valid=(3, 3), mask=mask)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    out = t.run(tr, inputs)
    assert torch.equal(out, ref)
    s = sessions(tr)["transformer"].stats()
    assert s["sparse_calls"] == 0 and s["dense_calls"] == 2
    assert all(any("not a prefix mask" in f for f in layer["fallbacks"]) for layer in s["layers"].values())


def test_empty_text_and_sol():
    """An all-zero mask (the pipeline's force_zeros_for_empty_prompt) attends over the video alone, as stock; Sol
    runs on the joint layout."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr, valid=(0,))
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 2
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.SolConfig(density=0.5, block=t.block))
    out = t.run(tr, t.make_inputs(tr, valid=(5,)))
    assert torch.isfinite(out).all() and sessions(tr)["transformer"].stats()["sparse_calls"] == 2


def test_tiny_pipeline_guidance_batch_runs_sparse_item_by_item():
    """MochiPipeline batches the negative and the positive prompt (different token counts) in one forward per
    step: after its dense first step every layer runs sparse (observed: item by item), with no fallback; remove()
    restores it exactly. Each layer counts one call a step, the dense config's item-by-item calls too (it counted
    two). Latent output (the VAE is not what is tested)."""
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline
    from transformers import T5Config, T5EncoderModel

    from videosparse.models.tiny_wan import TINY_VOCAB, build_tiny_tokenizer

    torch.manual_seed(0)
    text_encoder = T5EncoderModel(T5Config(
        vocab_size=len(TINY_VOCAB), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    vae = AutoencoderKLMochi(latent_channels=4, encoder_block_out_channels=(32,) * 4,
                             decoder_block_out_channels=(32,) * 4, layers_per_block=(1,) * 5,
                             add_attention_block=(False,) * 5).eval()
    pipe = MochiPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                         tokenizer=build_tiny_tokenizer(), transformer=TestMochiProcessors().make_transformer())
    pipe.set_progress_bar_config(disable=True)
    kw = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=13, height=64, width=256,
              num_inference_steps=3, output_type="latent", max_sequence_length=TEXT)

    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0)).frames

    ref = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=1))
    seen = set()
    with videosparse.processors.observe(pipe, lambda r: seen.add((r.step, r.grid, r.text_len))):
        sparse = run()
    assert {(s, g) for s, g, _ in seen} == {(s, (3, 4, 16)) for s in range(3)}   # 13 x 64 x 256 -> 3 x 4 x 16
    assert len({n for _, _, n in seen}) == 2                  # the two prompts' valid lengths, each its own layout
    layers = handle["transformer"].stats()["layers"]
    # one call per layer and step, whether the items run together or, observed, one by one
    assert all(s["dense_calls"] == 1 and s["sparse_calls"] == 2 and s["fallbacks"] == [] for s in layers.values())
    assert torch.isfinite(sparse).all() and not torch.equal(sparse, ref)
    videosparse.remove(pipe)
    assert torch.equal(run(), ref)
    handle = videosparse.apply(pipe, videosparse.DenseConfig())
    assert torch.equal(run(), ref)
    layers = handle["transformer"].stats()["layers"]
    assert all(s["dense_calls"] == 3 and s["sparse_calls"] == 0 for s in layers.values())
    videosparse.remove(pipe)


def test_distill_capture_keeps_every_item_of_a_guidance_batch():
    """MochiPipeline's forward holds the negative and the positive prompt; with different valid lengths they are
    served (and observed) item by item. The distillation capture keeps a sample for each item (not the last item
    alone), each as the item alone would give it, and counts steps per forward."""
    from videosparse.distill.capture import TileFeatureCapture

    t, tr = _tiny()
    inputs = t.make_inputs(tr, valid=(3, 6))
    tiles = lambda layer, heads: t.tiling                                 # noqa: E731
    cap = TileFeatureCapture(tiles, t.block, teacher_backend="torch")
    with videosparse.processors.observe(tr, cap):
        t.run(tr, inputs, "cond_uncond", step=1)
    records = []
    with videosparse.processors.observe(tr, records.append):
        t.run(tr, inputs, "cond_uncond", step=1)
    assert [(r.layer, r.item, r.text_len, r.q.shape[0]) for r in records] == [(0, 0, 3, 1), (0, 1, 6, 1),
                                                                              (1, 0, 3, 1), (1, 1, 6, 1)]
    assert sorted(cap.samples) == [(1, "cond_uncond-item0"), (1, "cond_uncond-item1")]
    for b in range(2):
        alone = TileFeatureCapture(tiles, t.block, teacher_backend="torch")
        with videosparse.processors.observe(tr, alone):
            t.run(tr, {k: v[b:b + 1] for k, v in inputs.items()}, "cond_uncond", step=1)
        (key, layers), = alone.samples.items()
        assert key == (1, "cond_uncond")
        for layer, feats in layers.items():
            for a, e in zip(cap.samples[(1, f"cond_uncond-item{b}")][layer], feats):
                assert a.shape == e.shape and (a - e).abs().max() <= 1e-5
    counted = TileFeatureCapture(tiles, t.block, teacher_backend="torch")     # no step from the pipeline: counted
    with videosparse.processors.observe(tr, counted):
        for _ in range(2):
            with torch.no_grad():
                tr(**inputs, return_dict=False)
    assert sorted(counted.samples) == [(s, f"default-item{b}") for s in (0, 1) for b in (0, 1)]


def test_an_item_without_valid_text_gets_the_same_tiles_observed_or_not():
    """Review find: with an all-zero text mask (MochiPipeline's empty negative prompt) an observed forward (the
    distillation capture, attention metrics) served the item with a layout without text, whose partial last video
    tile was an ordinary sparse tile, while the unobserved forward keeps it global beside the padded text: outputs
    7e-2 apart at density 0.5, and captures of tiles inference never used."""
    from videosparse.processors import observe

    t = TestMochiProcessors()
    tr = t.make_transformer()
    inputs = dict(t.make_inputs(tr, valid=(0, 6)), timestep=torch.tensor([500.0, 500.0]))
    cfg = videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block, dense_steps=0)
    videosparse.apply(tr, cfg)
    plain = t.run(tr, inputs)
    records = []
    with observe(tr, records.append):
        observed = t.run(tr, inputs)
    videosparse.remove(tr)
    assert (observed - plain).abs().max() <= 1e-6 * plain.abs().max()
    empty = [r for r in records if r.item == 0]
    assert empty and all(r.text_len == 0 and r.text_slot for r in empty)
