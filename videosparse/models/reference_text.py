"""Word-level tokenizer and tiny text encoder of the reference model.

The tokenizer is a `tokenizers` WordLevel model over the closed vocabulary of the procedural prompts
(`reference_data.VOCABULARY`), wrapped as a transformers fast tokenizer so that it saves as
``tokenizer.json`` and loads with ``from_pretrained``. The text encoder is a learned embedding table
(plus learned positions) and `num_layers` pre-norm transformer encoder layers (0 for the shipped model), a diffusers
`ModelMixin`/`ConfigMixin` saved as safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput
from torch import nn

from .reference_data import VOCABULARY

PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"
MAX_TEXT_LENGTH = 16


def build_reference_tokenizer():
    """A word-level fast tokenizer over `[PAD] [UNK]` + `VOCABULARY` (lower-cased, punctuation split off).

    Returns:
        `transformers.PreTrainedTokenizerFast` with pad id 0, unk id 1, no special tokens added.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([PAD_TOKEN, UNK_TOKEN, *VOCABULARY])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, unk_token=UNK_TOKEN,
                                   model_max_length=MAX_TEXT_LENGTH, padding_side="right")


@dataclass
class ReferenceTextEncoderOutput(BaseOutput):
    """last_hidden_state: float [B, L, dim]."""

    last_hidden_state: torch.Tensor


class ReferenceTextEncoder(ModelMixin, ConfigMixin):
    """Tiny text encoder: token + position embeddings, `num_layers` pre-norm encoder layers, final LayerNorm.

    Args:
        vocab_size (`int`): size of the tokenizer's vocabulary.
        dim (`int`, defaults to 256): width of the embeddings (the transformer's `text_dim`).
        num_layers (`int`, defaults to 2): encoder layers.
        num_heads (`int`, defaults to 4): attention heads per layer.
        ffn_dim (`int`, defaults to 512): hidden width of the feed-forward blocks.
        max_length (`int`, defaults to 16): longest token sequence (learned positions).
    """

    @register_to_config
    def __init__(self, vocab_size: int, dim: int = 256, num_layers: int = 2, num_heads: int = 4,
                 ffn_dim: int = 512, max_length: int = MAX_TEXT_LENGTH):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Embedding(max_length, dim)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(dim, num_heads, ffn_dim, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(num_layers)
        ])
        self.norm = nn.LayerNorm(dim)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.position_embedding.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                return_dict: bool = True):
        """Encode token ids.

        Args:
            input_ids: int64 [B, L], L <= max_length.
            attention_mask: [B, L], 1 for real tokens, 0 for padding (padding is ignored as a key).

        Returns:
            `ReferenceTextEncoderOutput` with `last_hidden_state` [B, L, dim] (or a tuple).
        """
        B, L = input_ids.shape
        if L > self.config.max_length:
            raise ValueError(f"input_ids has length {L}, more than max_length={self.config.max_length}.")
        pos = torch.arange(L, device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(pos)[None]
        pad = None
        if attention_mask is not None:
            pad = attention_mask == 0
            # a fully padded row (empty prompt) would give NaN softmax: let it attend to everything
            pad = pad & ~pad.all(dim=1, keepdim=True)
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=pad)
        x = self.norm(x)
        if not return_dict:
            return (x,)
        return ReferenceTextEncoderOutput(last_hidden_state=x)
