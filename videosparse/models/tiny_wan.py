"""A tiny Wan pipeline built offline from configs (random weights): the CPU demo and test model.

Real diffusers classes throughout (`WanPipeline`, `WanTransformer3DModel`, `AutoencoderKLWan`,
UMT5 text encoder, a word-level tokenizer built with `tokenizers`), so every code path of the real
Wan 2.1 pipeline runs; only the sizes are small. Its attention is near-uniform (random weights), so
it says nothing about quality: use the trained reference model for that.
"""

from __future__ import annotations

import torch

TINY_VOCAB = (
    "<pad> </s> <unk> a an the red green blue yellow white black orange purple circle square triangle "
    "moving left right up down bouncing rotating growing on dark light background cat dog surfing in "
    "sky sea of and with"
).split()


def build_tiny_tokenizer():
    """A word-level `PreTrainedTokenizerFast` over `TINY_VOCAB` (built offline with `tokenizers`)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_tiny_wan_pipeline(
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 64,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """A `WanPipeline` with tiny random components (text dim 32, VAE base dim 8).

    Args:
        num_layers: transformer blocks.
        num_heads, head_dim: self-attention heads and head dimension.
        seed: seed of the random weights.
        dtype: parameter dtype.
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = build_tiny_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(TINY_VOCAB), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )).eval()
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True],
                           latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=num_heads, attention_head_dim=head_dim, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=64, ffn_dim=4 * num_heads * head_dim, num_layers=num_layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=256,
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=scheduler)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)
