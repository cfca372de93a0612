"""HunyuanVideo 1.5: joint [video; image, ByT5, Qwen text] attention with the text reordered valid-first."""

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

import videosparse
from videosparse.processors import sessions
from videosparse.processors.hunyuan import HunyuanVideo15SparseAttnProcessor

from tester import ProcessorTesterMixin, apply_and_list_served

TEXT, TEXT_2, IMAGE = 8, 4, 3


class TestHunyuanVideo15Processors(ProcessorTesterMixin):

    def make_transformer(self):
        torch.manual_seed(0)
        return HunyuanVideo15Transformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=self.head_dim,
            num_layers=self.num_layers, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
            text_embed_dim=16, text_embed_2_dim=12, image_embed_dim=10, rope_axes_dim=(8, 28, 28),
        ).eval()

    def make_inputs(self, transformer, valid=(6,), valid_2=(3,), image=False):
        g = torch.Generator().manual_seed(1)
        B = len(valid)
        mask = torch.arange(TEXT)[None, :] < torch.tensor(valid)[:, None]
        mask_2 = torch.arange(TEXT_2)[None, :] < torch.tensor(valid_2)[:, None]
        image_embeds = torch.randn(B, IMAGE, 10, generator=g) if image else torch.zeros(B, IMAGE, 10)
        # grid after patching: 3 x 7 x 18 = 378 video tokens (partial last tile), then 15 text tokens
        return dict(
            hidden_states=torch.randn(B, 4, 3, 14, 36, generator=g),
            timestep=torch.tensor([500.0] * B),       # the time embedder runs in the timestep's dtype
            encoder_hidden_states=torch.randn(B, TEXT, 16, generator=g),
            encoder_attention_mask=mask,
            encoder_hidden_states_2=torch.randn(B, TEXT_2, 12, generator=g),
            encoder_attention_mask_2=mask_2,
            image_embeds=image_embeds,
        )


def test_blocks_served_refiner_stock():
    t = TestHunyuanVideo15Processors()
    tr = t.make_transformer()
    before, served = apply_and_list_served(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    procs = tr.attn_processors
    assert served == ["transformer_blocks.0.attn.processor", "transformer_blocks.1.attn.processor"]
    assert all(type(before[n]) is HunyuanVideo15AttnProcessor2_0 for n in served)
    assert all(isinstance(procs[n], HunyuanVideo15SparseAttnProcessor) for n in served)


@pytest.mark.parametrize("image", [False, True])
def test_valid_text_length_counts_the_reordered_valid_tokens(image):
    """The layout's text length is what the forward's reordered mask keeps valid: Qwen + ByT5 (+ image tokens
    for image-to-video); at density 1 the output equals the stock masked call."""
    t = TestHunyuanVideo15Processors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr, image=image)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    text_lens = []
    with videosparse.processors.observe(tr, lambda r: text_lens.append(r.text_len)):
        out = t.run(tr, inputs)
    assert set(text_lens) == {6 + 3 + (IMAGE if image else 0)}
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == t.num_layers


def test_unequal_valid_lengths_across_the_batch_run_in_one_call():
    t = TestHunyuanVideo15Processors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr, valid=(6, 5), valid_2=(3, 3))
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    out = t.run(tr, inputs)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    stats = sessions(tr)["transformer"].stats()
    assert stats["sparse_calls"] == t.num_layers and stats["dense_calls"] == 0     # one call, padded keys masked


@pytest.mark.parametrize("config", [videosparse.DenseConfig(), videosparse.VedaConfig(density=1.0, tiling=(1, 4, 16),
                                                                                        block=64)])
def test_padded_text_rows_are_zero_as_in_stock(config):
    """HunyuanVideo 1.5 masks queries as well as keys (its mask is rows & columns of the valid prefix): the stock
    processor gives the padded text rows zeros. One block's attention alone, valid and padded, the sparse processor
    gives what stock gives (so no dense attention is spent on the padded rows), per item with unequal lengths too."""
    t = TestHunyuanVideo15Processors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr, valid=(6, 2), valid_2=(3, 1))
    videosparse.apply(tr, config)
    t.run(tr, inputs)                                          # records the grid and the valid lengths (9, 3)
    context = sessions(tr)["transformer"].context
    if config.method == "dense":                               # each item's valid prefix
        assert context.text_len == (9, 3) and context.text_valid is None
    else:                                                      # all text tokens, the padded keys masked
        assert context.text_len == TEXT + TEXT_2 + IMAGE and context.text_valid.tolist() == [9, 3]
    attn = tr.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(2)
    video = torch.randn(2, 378, 128, generator=g)
    text = torch.randn(2, TEXT + TEXT_2 + IMAGE, 128, generator=g)
    mask = torch.arange(TEXT + TEXT_2 + IMAGE)[None, :] < torch.tensor([9, 3])[:, None]
    with torch.no_grad():
        rope = tr.rope(inputs["hidden_states"][:1])
        out = attn.processor(attn, video, text, mask, rope)
        ref = HunyuanVideo15AttnProcessor2_0()(attn, video, text, mask, rope)
    for a, b in zip(out, ref):
        assert (a - b).abs().max() <= 1e-5
    bias = attn.to_add_out.bias
    assert torch.equal(out[1][0, 9:], bias.expand(TEXT + TEXT_2 + IMAGE - 9, -1))   # zeros through to_add_out


def test_guidance_branches_reuse_their_layouts(monkeypatch):
    """HunyuanVideo15Pipeline's guider runs the prompt and the negative prompt as separate forwards with different
    valid text lengths: sparse forwards of both share one layout over all text tokens (the padded keys masked in
    the kernel), built once; observed forwards, which serve each valid prefix, build each length's layouts once and
    reuse them when the branches alternate; a new grid drops them."""
    from videosparse.processors import observe
    from videosparse.processors import session as session_module

    built = []
    real = session_module.head_tiling
    monkeypatch.setattr(session_module, "head_tiling", lambda *a, **k: built.append(a[4]) or real(*a, **k))
    t = TestHunyuanVideo15Processors()
    tr = t.make_transformer()
    cond, uncond = t.make_inputs(tr, valid=(6,)), t.make_inputs(tr, valid=(2,))      # 9 and 5 valid text tokens
    total = TEXT + TEXT_2 + IMAGE
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    slot = sessions(tr)["transformer"].slots[0]
    first, first_uncond = t.run(tr, cond, "cond", 0), t.run(tr, uncond, "uncond", 0)
    layout = slot.layouts[total]
    for step in (1, 2):
        assert torch.equal(t.run(tr, cond, "cond", step), first)
        assert torch.equal(t.run(tr, uncond, "uncond", step), first_uncond)
        assert slot.layouts == {total: layout} and slot.layouts[total] is layout
    assert built == [total] * t.num_layers
    built.clear()
    with observe(tr, lambda record: None):
        t.run(tr, cond, "cond", 3)
        cond_layout = slot.layouts[9]
        t.run(tr, uncond, "uncond", 3)
        uncond_layout = slot.layouts[5]
        for step in (4, 5):
            t.run(tr, cond, "cond", step)
            assert slot.layouts == {9: cond_layout} and slot.layouts[9] is cond_layout
            t.run(tr, uncond, "uncond", step)
            assert slot.layouts == {5: uncond_layout} and slot.layouts[5] is uncond_layout
        assert sorted(built) == [5] * t.num_layers + [9] * t.num_layers       # each length's layouts built once
        t.run(tr, dict(cond, hidden_states=cond["hidden_states"][:, :, :2]), "cond", 6)    # another grid: rebuilt
        assert slot.layouts[9] is not cond_layout and slot.layouts[9].grid == (2, 7, 18)
