"""Motif-Video (MotifVideoTransformer3DModel): the dual- and single-stream blocks' joint [video; image; text] attention
served like HunyuanVideo's (text after the video, valid text tokens first whichever side the tokenizer pads); the text
cross-attention stock; the DDT decoder blocks' calls stock."""

import logging

import pytest
import torch
from diffusers import MotifVideoTransformer3DModel
from diffusers.models.transformers.transformer_motif_video import (
    MotifVideoAttnProcessor2_0,
    MotifVideoCrossAttnProcessor2_0,
)
from tester import (
    ProcessorTesterMixin,
    apply_and_list_served,
    assert_batch_items_sparse_as_alone,
    assert_runs_stock_with_one_warning,
    check_extra_tokens_served_as_global_tiles,
)

import videosparse
from videosparse.processors import attention_processors, observe, sessions
from videosparse.processors.hunyuan import _HunyuanFamilySparseAttention
from videosparse.processors.motif import MotifVideoSparseAttnProcessor, motif_grid

TEXT, TEXT_DIM, IMAGE, IMAGE_DIM = 8, 16, 5, 12
LATENT = (3, 14, 36)         # latent frames x height x width -> patches 3 x 7 x 18 = 378 tokens, a partial last tile
GRID = (3, 7, 18)
SERVED = ["single_transformer_blocks.0.attn.processor", "transformer_blocks.0.attn.processor"]


def tiny_motif(num_layers=1, num_single_layers=1, **kwargs):
    """A tiny MotifVideoTransformer3DModel: 2 heads of 64 (RoPE axes (8, 28, 28)), patch (1, 2, 2), the shared text
    cross-attention in every block (as Motif-Video-2B)."""
    config = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64, num_layers=num_layers,
                  num_single_layers=num_single_layers, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
                  text_embed_dim=TEXT_DIM, rope_axes_dim=(8, 28, 28), enable_text_cross_attention_dual=True,
                  enable_text_cross_attention_single=True)
    config.update(kwargs)
    torch.manual_seed(0)
    return MotifVideoTransformer3DModel(**config).eval()


def motif_inputs(valid=(6,), side="left", image=False, seed=1):
    """As the pipelines call the transformer: latents, the text states padded to TEXT with their mask (padding on
    `side`), and for I2V the SigLIP image states."""
    g = torch.Generator().manual_seed(seed)
    B = len(valid)
    position = torch.arange(TEXT)[None, :]
    lengths = torch.tensor(valid)[:, None]
    mask = position < lengths if side == "right" else position >= TEXT - lengths
    inputs = dict(hidden_states=torch.randn(B, 4, *LATENT, generator=g), timestep=torch.tensor([500] * B),
                  encoder_hidden_states=torch.randn(B, TEXT, TEXT_DIM, generator=g), encoder_attention_mask=mask)
    if image:
        inputs["image_embeds"] = torch.randn(B, IMAGE, IMAGE_DIM, generator=g)
    return inputs


class TestMotifVideoProcessors(ProcessorTesterMixin):
    """One dual-stream and one single-stream block over 378 video tokens and 6 valid of 8 left-padded text tokens."""

    def make_transformer(self):
        return tiny_motif()

    def make_inputs(self, transformer):
        return motif_inputs()


def _tiny(**kwargs):
    t = TestMotifVideoProcessors()
    return t, tiny_motif(**kwargs)


def test_serves_the_joint_attention_of_both_block_kinds():
    """Every block's `attn` is replaced; the text cross-attention (`cross_attn`) keeps its processor object; one
    forward runs sparse on both layers with the valid text as extra tokens after the video."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr)
    dense = t.run(tr, inputs)
    before, served = apply_and_list_served(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    assert served == SERVED and all(type(before[n]) is MotifVideoAttnProcessor2_0 for n in served)
    after = attention_processors(tr)
    assert all(type(after[n]) is MotifVideoSparseAttnProcessor for n in served)
    cross = sorted(n for n in before if n not in served)
    assert cross == ["single_transformer_blocks.0.cross_attn.processor", "transformer_blocks.0.cross_attn.processor"]
    assert all(after[n] is before[n] and type(before[n]) is MotifVideoCrossAttnProcessor2_0 for n in cross)
    records = []
    with observe(tr, records.append):
        out = t.run(tr, inputs)
    s = sessions(tr)["transformer"].stats()
    assert s["sparse_calls"] == 2 and s["dense_calls"] == 0 and 0.3 < s["density"] < 0.9
    assert torch.isfinite(out).all() and not torch.equal(out, dense)
    assert [(r.layer, r.grid, r.text_len, r.text_position) for r in records] == [
        (i, GRID, 6, "after") for i in range(2)]


def test_sequence_layout_video_image_text(monkeypatch):
    """What every stock call sees: the video (RoPE over it, time-major) with [image; text] as the encoder states and
    a key mask [B, 1, 1, S] over [video; image; text] (video and image valid); the grid function counts the image
    tokens and the valid text tokens."""
    t, tr = _tiny(image_embed_dim=IMAGE_DIM)
    inputs = motif_inputs(image=True)
    calls = []
    stock = MotifVideoAttnProcessor2_0.__call__

    def spy(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        calls.append((hidden_states.shape[1], encoder_hidden_states.shape[1], attention_mask, image_rotary_emb))
        return stock(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    monkeypatch.setattr(MotifVideoAttnProcessor2_0, "__call__", spy)
    t.run(tr, inputs)
    video = GRID[0] * GRID[1] * GRID[2]
    assert [c[:2] for c in calls] == [(video, IMAGE + TEXT)] * 2
    mask = torch.cat([torch.ones(1, video + IMAGE, dtype=torch.bool), inputs["encoder_attention_mask"]], dim=1)
    assert all(torch.equal(c[2], mask[:, None, None]) for c in calls)
    cos = calls[0][3][0]
    assert cos.shape[0] == video and torch.equal(cos, tr.rope(inputs["hidden_states"])[0])
    for grid_inputs, total, lengths in ((inputs, IMAGE + TEXT, IMAGE + 6),
                                        (motif_inputs(valid=(8, 5), side="right"), TEXT, (8, 5))):
        grid, text = motif_grid(tr, (), grid_inputs)
        assert grid == GRID and text.total == total and text.lengths() == lengths
    assert motif_grid(tr, (), dict(motif_inputs(), encoder_attention_mask=None)) == (GRID, TEXT)


@pytest.mark.parametrize(("side", "valid"), [("left", (8, 3)), ("right", (5, 5))])
def test_padded_text_either_side_equals_stock(side, valid, monkeypatch, caplog):
    """A batch of two with the text padded on either side (equal valid lengths, or different ones: one sparse call
    with each item's padded keys masked; the dense config item by item): the dense config and density 1 equal
    stock, density 0.5 runs sparse with no fallback, each item as if it ran alone. Taking the first valid-count
    text tokens as the valid ones (HunyuanVideo's prefix rule, without moving the valid tokens first) would be wrong
    for left padding."""
    t, tr = _tiny()
    inputs = motif_inputs(valid=valid, side=side)
    ref = t.run(tr, inputs)
    for config in (videosparse.DenseConfig(), videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block)):
        videosparse.apply(tr, config)
        assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5, config
        videosparse.remove(tr)
    assert_batch_items_sparse_as_alone(t, tr, inputs, 2, caplog)          # one call per layer, padded keys masked
    videosparse.remove(tr)
    monkeypatch.setattr(MotifVideoSparseAttnProcessor, "_attend_joint", _HunyuanFamilySparseAttention._attend_joint)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    prefix_rule_error = (t.run(tr, inputs) - ref).abs().max()
    assert prefix_rule_error <= 1e-5 if side == "right" or min(valid) == TEXT else prefix_rule_error > 1e-3


def test_other_masks_run_dense_with_one_warning(caplog):
    """A mask that is not the forward's boolean key mask (here an additive [B, 1, S, S] one) is not reordered: the
    call runs dense with it, warned once per layer."""
    t, tr = _tiny()
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    t.run(tr, t.make_inputs(tr))                       # records the grid and the 6 valid text tokens
    proc = attention_processors(tr)[SERVED[1]]
    S = GRID[0] * GRID[1] * GRID[2] + TEXT
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, S, 2, 64, generator=g) for _ in range(3))
    mask = torch.zeros(1, 1, S, S).masked_fill(torch.rand(S, S, generator=g) < 0.1, float("-inf"))
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        out = [proc._attend_joint(q, k, v, TEXT, mask) for _ in range(2)]
    assert torch.equal(out[0], proc._dense(q, k, v, mask)) and torch.equal(out[1], out[0])
    assert sum("attention mask" in r.getMessage() for r in caplog.records) == 1


def test_an_additive_key_mask_runs_dense_as_stock(caplog):
    """Mutation find: a float (additive) [B, 1, 1, S] key mask was taken as the forward's boolean one, which turned
    its 0 / -inf entries into padded / valid text (inverted): a direct processor call with it differed from stock
    by 0.03. It runs dense with the mask as given, equal to `MotifVideoAttnProcessor2_0`, warned once."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    t.run(tr, inputs)                                  # records the grid and the 6 valid text tokens
    attn = tr.transformer_blocks[0].attn
    video = GRID[0] * GRID[1] * GRID[2]
    g = torch.Generator().manual_seed(2)
    x, text = torch.randn(1, video, 128, generator=g), torch.randn(1, TEXT, 128, generator=g)
    keep = torch.cat([torch.ones(1, video, dtype=torch.bool), inputs["encoder_attention_mask"]], dim=1)
    mask = torch.zeros(1, 1, 1, video + TEXT).masked_fill(~keep[:, None, None], float("-inf"))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="videosparse"):
        out = attn.processor(attn, x, text, mask, None)
        ref = MotifVideoAttnProcessor2_0()(attn, x, text, mask, None)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, atol=1e-6, rtol=0)
    assert sum("attention mask" in r.getMessage() for r in caplog.records) == 1


def test_image_and_text_tokens_served_as_global_tiles(caplog):
    """I2V: the SigLIP image tokens and the valid text tokens are the extra tokens after the video."""
    t, tr = _tiny(image_embed_dim=IMAGE_DIM)
    check_extra_tokens_served_as_global_tiles(t, tr, motif_inputs(image=True), GRID, IMAGE + 6, "after", caplog)


def test_sol_runs_sparse():
    t, tr = _tiny()
    videosparse.apply(tr, videosparse.SolConfig(density=0.5, block=t.block))
    assert torch.isfinite(t.run(tr, motif_inputs())).all()
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 2


class _DecoderOnly(TestMotifVideoProcessors):
    num_layers = 1


def test_decoder_block_runs_stock_with_one_warning(caplog):
    """A DDT decoder block attends over [decoder video; encoder's video output] (no text, no mask): stock, one warning
    per layer, no observer record."""
    t = _DecoderOnly()
    tr = tiny_motif(num_layers=0, num_single_layers=1, num_decoder_layers=1)
    assert_runs_stock_with_one_warning(t, tr, motif_inputs(), "DDT decoder", caplog)


def test_encoder_blocks_sparse_decoder_blocks_stock(caplog):
    """Dual-stream, single-stream encoder and decoder blocks together (Motif-Video-2B's three stages): density 1 equals
    stock; at density 0.5 the encoder layers run sparse and only the decoder layer falls back, warned once."""
    t, tr = _tiny(num_single_layers=2, num_decoder_layers=1)
    inputs = motif_inputs()
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        t.run(tr, inputs)
        t.run(tr, inputs, step=1)
    layers = sessions(tr)["transformer"].stats()["layers"]
    assert [(s["sparse_calls"], s["dense_calls"]) for s in layers.values()] == [(2, 0), (2, 0), (0, 2)]
    warnings = [r.getMessage() for r in caplog.records if "runs dense" in r.getMessage()]
    assert len(warnings) == 1 and "layer 2" in warnings[0] and "DDT decoder" in warnings[0]


def test_published_config():
    """Motif-Video-2B's block counts (12 dual-stream, 16 + 8 single-stream: the last 8 DDT decoder blocks) at its
    default 1280 x 736 x 121 frames: 36 served layers (no cross-attention), a (31, 46, 80) grid, 512 text tokens."""
    from videosparse.processors import self_attention_processors
    from videosparse.processors.registry import model_info, model_spec

    with torch.device("meta"):
        tr = MotifVideoTransformer3DModel(num_layers=12, num_single_layers=24, num_decoder_layers=8,
                                          enable_text_cross_attention_dual=True,
                                          enable_text_cross_attention_single=True)
        inputs = dict(hidden_states=torch.empty(1, 33, 31, 92, 160), encoder_hidden_states=torch.empty(1, 512, 4096))
    served = self_attention_processors(tr)
    assert len(served) == 36 and all(n.endswith(".attn.processor") for n in served)
    assert motif_grid(tr, (), inputs) == ((31, 46, 80), 512)
    info = model_info(tr, model_spec(tr), len(served))
    assert (info.num_layers, info.num_heads, info.head_dim, info.patch_size) == (36, 24, 128, (1, 2, 2))
    assert info.text_position == "after"


def test_tiny_pipeline_end_to_end(caplog):
    """MotifVideoPipeline (tiny T5Gemma2 encoder, a left-padding tokenizer, CFG as two forwards with different valid
    text lengths, a decoder block): the first step dense, the others sparse on the encoder layers with no fallback,
    the decoder layer stock; remove() restores it. The latents are compared (output_type "latent")."""
    from diffusers import FlowMatchEulerDiscreteScheduler, MotifVideoPipeline
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import T5Gemma2Encoder, T5Gemma2EncoderConfig, T5Gemma2TextConfig

    from videosparse.models.tiny_wan import TINY_VOCAB, build_tiny_wan_pipeline

    wan = build_tiny_wan_pipeline()
    torch.manual_seed(0)
    text_encoder = T5Gemma2Encoder(T5Gemma2EncoderConfig(text_config=T5Gemma2TextConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=len(TINY_VOCAB),
        max_position_embeddings=64, head_dim=16, num_key_value_heads=2, dropout_rate=0.0))).eval()
    tokenizer = wan.tokenizer
    tokenizer.padding_side = "left"
    # latents | condition latents | mask: 4 + 4 + 1 input channels
    transformer = tiny_motif(num_single_layers=2, num_decoder_layers=1, in_channels=9, text_embed_dim=32)
    pipe = MotifVideoPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), vae=wan.vae,
                              text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                              guider=ClassifierFreeGuidance(guidance_scale=5.0))
    pipe.set_progress_bar_config(disable=True)
    kw = dict(prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=64, width=192,
              num_inference_steps=3, output_type="latent", max_sequence_length=16)

    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0)).frames

    ref = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.3, tiling=(1, 4, 16), block=64, dense_steps=1))
    seen = set()
    with caplog.at_level(logging.WARNING, logger="videosparse"), \
            observe(pipe, lambda r: seen.add((r.step, r.branch, r.grid, r.text_len))):
        sparse = run()
    # 64 x 192 pixels -> 8 x 24 latents -> 4 x 12 patches; valid text: the prompt's 5 words + </s>, "blue" + </s>
    assert seen == {(s, b, (3, 4, 12), n) for s in range(3) for b, n in (("pred_cond", 6), ("pred_uncond", 2))}
    layers = handle["transformer"].stats()["layers"]
    assert all(layers[i]["dense_calls"] == 2 and layers[i]["sparse_calls"] == 4 for i in (0, 1))
    assert layers[2]["dense_calls"] == 6 and layers[2]["sparse_calls"] == 0
    warnings = [r.getMessage() for r in caplog.records if "runs dense" in r.getMessage()]
    assert len(warnings) == 1 and "DDT decoder" in warnings[0]
    assert torch.isfinite(sparse).all() and not torch.equal(sparse, ref)
    videosparse.remove(pipe)
    assert torch.equal(run(), ref)
