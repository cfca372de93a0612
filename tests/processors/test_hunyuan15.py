"""HunyuanVideo 1.5: joint [video; image, ByT5, Qwen text] attention with the text reordered valid-first."""

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

import videosparse
from videosparse.processors import sessions
from videosparse.processors.hunyuan import HunyuanVideo15SparseAttnProcessor

from tester import ProcessorTesterMixin

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
    before = dict(tr.attn_processors)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    procs = tr.attn_processors
    served = sorted(n for n in procs if procs[n] is not before[n])
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


def test_unequal_valid_lengths_across_the_batch_are_served_item_by_item():
    t = TestHunyuanVideo15Processors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr, valid=(6, 5), valid_2=(3, 3))
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    out = t.run(tr, inputs)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    stats = sessions(tr)["transformer"].stats()
    assert stats["sparse_calls"] == 2 * t.num_layers and stats["dense_calls"] == 0     # one call per item
