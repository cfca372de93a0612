"""Tests from a mutation pass over the per-family attention processors (`processors/base.py` and the family modules):
how a family finds its grid and its global tokens, padded-text masks and rows, RoPE, and the fallbacks to the stock
processor: each guards a behaviour that a one-line change left every other test passing."""

import logging

import torch
from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6AttnProcessor
import test_hunyuan
import test_kandinsky6
import test_ltx2
import test_minimax_h3
import test_mochi
from tester import assert_runs_stock_with_one_warning

import videosparse
from videosparse.processors import sessions
from videosparse.processors.base import MASK_REASON

MOCHI_PADDED = 3        # the tiny Mochi's 8 text tokens, 5 of them valid


def _attention_outputs(tester, transformer, inputs, module, grad=False):
    """The outputs of `module` (one attention layer of `transformer`) in a forward of `inputs`, detached; with `grad`
    the forward records autograd (as a training step does)."""
    seen = []
    handle = module.register_forward_hook(lambda m, args, out: seen.append(tuple(o.detach() for o in out)))
    try:
        if grad:
            with transformer.cache_context("cond", step_index=0, num_inference_steps=4):
                transformer(**inputs, return_dict=False)
        else:
            tester.run(transformer, inputs)
    finally:
        handle.remove()
    assert len(seen) == 1
    return seen[0]


def _dense_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "runs dense" in r.getMessage()]


def test_a_joint_video_of_exactly_one_tile_runs_sparse(caplog):
    """Mutation find: a joint [video; text] model whose video is exactly one tile (64 tokens, the 1 x 4 x 16 tiling)
    is served sparse like any other: only a video shorter than one tile has nothing to skip. At density 1 the output
    equals stock, every layer sparse, no fallback warning."""
    t = test_hunyuan.TestHunyuanProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    inputs["hidden_states"] = torch.randn(1, 4, 1, 8, 32, generator=torch.Generator().manual_seed(3))   # (1, 4, 16)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        out = t.run(tr, inputs)
    assert sessions(tr)["transformer"].context.grid == (1, 4, 16)
    s = sessions(tr)["transformer"].stats()
    assert s["sparse_calls"] == t.num_layers and s["dense_calls"] == 0 and not _dense_warnings(caplog)
    assert (out - ref).abs().max() <= 1e-5


def test_hunyuan_dense_config_padded_text_rows_read_the_rotated_keys():
    """Mutation find: under the dense config HunyuanVideo's padded text rows (its mask masks keys only) attend to the
    valid keys as the valid prefix's call used them, RoPE-rotated: a block's whole attention output, the padded text
    rows included, equals stock's (the model's output alone cannot tell: no valid token reads a padded row)."""
    t = test_hunyuan.TestHunyuanProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr, valid=(5,))
    attn = tr.transformer_blocks[0].attn
    ref = _attention_outputs(t, tr, inputs, attn)
    videosparse.apply(tr, videosparse.DenseConfig())
    out = _attention_outputs(t, tr, inputs, attn)
    assert sessions(tr)["transformer"].context.text_valid is None        # each item's valid prefix, then its rows
    for a, b in zip(out, ref):
        assert (a - b).abs().max() <= 1e-5
    assert (out[1][:, 5:] - ref[1][:, 5:]).abs().max() <= 1e-5


def test_mochi_padded_text_rows_are_zero_while_autograd_records():
    """Mutation find: a sparse forward that records autograd (training) gives Mochi's padded text rows the stock's
    zeros too (the out-of-place branch of `attend_text_prefix`): block 0's attention output, text rows included
    (padded ones: to_add_out's bias), equals the stock processor's under autograd."""
    t = test_mochi.TestMochiProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr, valid=(5,))
    attn = tr.transformer_blocks[0].attn1
    ref = _attention_outputs(t, tr, inputs, attn, grad=True)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    out = _attention_outputs(t, tr, inputs, attn, grad=True)
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == t.num_layers
    for a, b in zip(out, ref):
        assert (a - b).abs().max() <= 1e-5
    assert torch.equal(out[1][0, 5:], attn.to_add_out.bias.detach().expand(MOCHI_PADDED, -1))


def test_ltx2_masked_calls_under_the_dense_config_keep_stock_without_a_warning(caplog):
    """Mutation find: under the dense config a call that keeps the stock processor (here LTX-2's video self-attention
    mask) is counted dense silently, as every dense call is: no "runs dense" warning, the stock output."""
    t = test_ltx2.TestLTX2Processors()
    tr = t.make_transformer()
    inputs = test_ltx2.ltx2_inputs(tr, coords=True)
    S = inputs["hidden_states"].shape[1]
    mask = torch.ones(1, S, S)
    mask[:, :, -50:] = 0.5
    inputs["video_self_attention_mask"] = mask
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.DenseConfig())
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        out = t.run(tr, inputs)
    assert torch.equal(out, ref) and not _dense_warnings(caplog)
    s = sessions(tr)["transformer"].stats()
    assert s["dense_calls"] == t.num_layers and s["sparse_calls"] == 0


def test_kandinsky6_a_masked_self_attention_call_honours_the_mask(caplog):
    """Mutation find: a Kandinsky 6 video self-attention call given an `attn_mask` (the model passes none; a caller
    may) keeps the mask: it runs dense with it, equal to the stock masked call, counted dense and warned once, never
    sparse over every key."""
    tr = test_kandinsky6.tiny_kandinsky6()
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=(1, 4, 16), block=64))
    test_kandinsky6._forward(tr, test_kandinsky6.kandinsky6_inputs(tr, audio=False))     # records the grid
    session = sessions(tr)["transformer"]
    session.reset_stats()
    attn = tr.visual_transformer_blocks[0].video_dec_block.self_attention
    rope = tr.visual_rope_embeddings(tuple(torch.arange(n) for n in test_kandinsky6.GRID), tr.scale_factor).flatten(0, 2)
    x = torch.randn(1, 378, 128, generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(378) < 300)[None, None, None, :]
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="videosparse"):
        out = attn(x, rotary_emb=rope, attn_mask=mask)
        ref = Kandinsky6AttnProcessor()(attn, x, rotary_emb=rope, rotary_emb_kv=rope, attn_mask=mask)
    assert (out - ref).abs().max() <= 1e-5
    layer = session.stats()["layers"][0]
    assert layer["dense_calls"] == 1 and layer["sparse_calls"] == 0 and MASK_REASON in layer["fallbacks"]
    assert sum(MASK_REASON in w for w in _dense_warnings(caplog)) == 1


def test_ltx2_appended_tokens_behind_a_video_that_is_not_the_sizes_grid_run_stock(caplog):
    """Mutation find: LTX-2 tokens appended after the video are served as global tiles only when the first tokens'
    coordinates form the grid of the latent sizes given; sizes of another grid of as many tokens (3 x 14 x 9 for the
    coordinates' 3 x 7 x 18) leave the forward to the stock processor, warned once per layer."""
    t = test_ltx2.TestLTX2Processors()
    tr = t.make_transformer()
    inputs = dict(test_ltx2.with_keyframe(tr, test_ltx2.ltx2_inputs(tr, coords=True)), height=14, width=9)
    assert test_ltx2.ltx2_grid(tr, (), inputs)[2] is not None
    assert_runs_stock_with_one_warning(t, tr, inputs, "do not form one time-major", caplog)


def test_minimax_fused_projections_keep_each_norm(caplog):
    """Mutation find: with fused q/k/v projections MiniMax-H3's q and k each go through their own RMSNorm (norm_q,
    norm_k), as stock: with the two norms' weights apart, density 1 equals the fused stock forward, every layer
    sparse."""
    t = test_minimax_h3.TestMiniMaxH3Processors()
    tr = t.make_transformer()
    tr.fuse_qkv_projections()
    with torch.no_grad():
        for block in tr.transformer_blocks:
            block.attn.norm_q.weight.normal_(1.0, 0.5)
            block.attn.norm_k.weight.normal_(1.0, 0.5)
    inputs = t.make_inputs(tr)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        out = t.run(tr, inputs)
    s = sessions(tr)["transformer"].stats()
    assert s["sparse_calls"] == t.num_layers and s["dense_calls"] == 0 and not _dense_warnings(caplog)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()

