"""Fallback reasons are one string per condition across the model families, so that `stats()` groups them."""

import test_ltx2
import torch
from test_helios import masked_helios
from test_minimax_h3 import masked_minimax

import videosparse
from videosparse.processors import sessions
from videosparse.processors.base import MASK_REASON


def masked_ltx2():
    """(tester, tiny transformer, inputs) with a video self-attention mask (IC-LoRA's kind)."""
    t = test_ltx2.TestLTX2Processors()        # (the module, not the class: this file would collect its tests)
    tr = t.make_transformer()
    inputs = test_ltx2.ltx2_inputs(tr, coords=True)
    S = inputs["hidden_states"].shape[1]
    inputs["video_self_attention_mask"] = torch.ones(1, S, S)
    return t, tr, inputs


def test_a_masked_call_has_one_reason_in_every_family():
    """Review D2: Helios, MiniMax-H3 and LTX-2 each spelled the mask fallback with their own suffix, which split one
    condition into several entries of `stats()`. A masked self-attention call of each is now counted under
    `MASK_REASON` alone, on every served layer."""
    for masked in (masked_helios, masked_minimax, masked_ltx2):
        t, tr, inputs = masked()
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
        t.run(tr, inputs)
        layers = sessions(tr)["transformer"].stats()["layers"]
        assert [layer["fallbacks"] for layer in layers.values()] == [[MASK_REASON]] * t.num_layers, masked.__name__
