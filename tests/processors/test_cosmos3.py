"""Cosmos 3 (Cosmos3OmniTransformer): the generation pathway of every layer's self_attn served (the video grid sparse,
the sound rows and the text keys as global tiles after it), the causal text pathway stock; grouped-query attention;
packed sequences laid out otherwise, and the model's context-parallel seams, stock with one warning per layer.

The inputs are laid out by the pipeline's own segment builders (`videosparse.eval.synthetic_models.cosmos3_inputs`), as
`Cosmos3OmniPipeline` calls the transformer.
"""

import logging

import pytest
import torch
from diffusers import Cosmos3OmniTransformer
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor
from tester import (
    ProcessorTesterMixin,
    assert_runs_stock_with_one_warning,
    check_blocks_attn1_served,
    check_extra_tokens_served_as_global_tiles,
)

import videosparse
from videosparse.eval.synthetic_models import cosmos3_inputs
from videosparse.processors import sessions

LATENT = (3, 15, 24)          # latent frames x height x width -> patches 3 x 8 x 12 (height padded) = 288 rows
GRID = (3, 8, 12)
TEXT, SOUND, SOUND_DIM = 10, 6, 8
SERVED = ["layers.0.self_attn.processor", "layers.1.self_attn.processor"]


def tiny_cosmos3(**kwargs):
    """A tiny Cosmos3OmniTransformer: 2 layers of 2 query heads sharing 1 KV head x 64, 4 latent channels in 2 x 2
    patches, sound generation on (8 channels), mRoPE sections 12 / 10 / 10 of the 32 rotary frequencies."""
    config = dict(head_dim=64, hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
                  num_hidden_layers=2, latent_channel=4, latent_patch_size=2, patch_latent_dim=16, vocab_size=64,
                  rope_axes_dim=(12, 10, 10), sound_gen=True, sound_dim=SOUND_DIM)
    config.update(kwargs)
    torch.manual_seed(0)
    return Cosmos3OmniTransformer(**config).eval()


def make_inputs(transformer, seed=1, sound=SOUND, condition_frames=()):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, transformer.config.latent_channel, *LATENT, generator=g)
    text = torch.randint(0, transformer.config.vocab_size, (TEXT,), generator=g).tolist()
    sound_latents = torch.randn(SOUND_DIM, sound, generator=g) if sound else None
    return cosmos3_inputs(transformer.config, latents, text, sound_latents, condition_frames=condition_frames)


def sound_first(inputs: dict) -> dict:
    """`inputs` with the sound rows packed before the video (the pipeline puts them after it): the same computation
    (every row keeps its mRoPE position), but the vision rows no longer follow the text."""
    und, n, s = inputs["und_len"], inputs["vision_sequence_indexes"].numel(), inputs["sound_sequence_indexes"].numel()
    pos = inputs["position_ids"]
    moved = dict(inputs, position_ids=torch.cat([pos[:, :und], pos[:, und + n:], pos[:, und:und + n]], dim=1))
    moved.update(sound_sequence_indexes=torch.arange(und, und + s), sound_mse_loss_indexes=torch.arange(und, und + s),
                 vision_sequence_indexes=inputs["vision_sequence_indexes"] + s,
                 vision_mse_loss_indexes=inputs["vision_mse_loss_indexes"] + s)
    return moved


class TestCosmos3(ProcessorTesterMixin):
    def make_transformer(self):
        return tiny_cosmos3()

    def make_inputs(self, transformer):
        return make_inputs(transformer)

    def output(self, result):
        vision, sound, _ = result
        return torch.cat([vision[0].flatten(), sound[0].flatten()])

    def test_generation_pathway_served_text_pathway_stock(self):
        tr, before, records, _, _ = check_blocks_attn1_served(self, Cosmos3AttnProcessor, SERVED)
        # the observers see the generation rows (video grid, then the sound rows) and the text rows after them, with
        # the KV heads repeated
        assert all(r.q.shape == r.k.shape == (1, 288 + SOUND + TEXT, 2, 64) for r in records)

    def test_sound_rows_and_text_keys_are_global_tiles(self, caplog):
        tr = self.make_transformer()
        check_extra_tokens_served_as_global_tiles(self, tr, self.make_inputs(tr), GRID, SOUND + TEXT, "after", caplog)

    @pytest.mark.parametrize("config", [
        dict(num_key_value_heads=2),                                         # no grouping
        dict(qk_norm_for_text=False, use_und_k_norm_for_gen=True),           # a separate k norm for the text keys
        dict(hidden_act="relu2", num_attention_heads=4, num_key_value_heads=2),   # Nemotron norms, 2 groups of 2
    ], ids=["mha", "und-k-norm-for-gen", "nemotron"])
    def test_variants_at_density_one_equal_stock(self, config):
        tr = tiny_cosmos3(**config)
        inputs = make_inputs(tr)
        ref = self.run(tr, inputs)
        videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=self.tiling, block=self.block))
        assert (self.run(tr, inputs) - ref).abs().max() <= 1e-5
        assert sessions(tr)["transformer"].stats()["sparse_calls"] == self.num_layers
        videosparse.remove(tr)
        # an observed forward (metrics, the distillation capture) runs the dense path, which repeats the KV heads
        # itself: each query head with its own KV head (mutation testing: a tiled repeat survived, 1.28 off with 2)
        with videosparse.observe(tr, lambda record: None):
            assert (self.run(tr, inputs) - ref).abs().max() <= 1e-5

    def test_image_conditioned_without_sound(self):
        """Image to video (latent frame 0 held clean, not predicted) and no sound rows: the same grid, served."""
        tr = self.make_transformer()
        inputs = make_inputs(tr, sound=0, condition_frames=(0,))
        vision_only = (lambda result: result[0][0])
        ref = vision_only(self._forward(tr, inputs))
        videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=self.tiling, block=self.block))
        out = vision_only(self._forward(tr, inputs))
        assert (out - ref).abs().max() <= 1e-5 and torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
        s = sessions(tr)["transformer"].stats()
        assert s["sparse_calls"] == self.num_layers
        assert s["layers"][0]["total_pairs"] == 2 * 5 * 5            # 2 heads x 5 x 5 tiles

    def _forward(self, tr, inputs, step=1):
        with torch.no_grad(), tr.cache_context("cond", step_index=step, num_inference_steps=4):
            return tr(**inputs, return_dict=False)

    def test_vision_not_after_the_text_runs_stock(self, caplog):
        tr = self.make_transformer()
        inputs = self.make_inputs(tr)
        moved = sound_first(inputs)
        assert torch.allclose(self.run(tr, moved), self.run(tr, inputs), atol=1e-5)   # the same model computation
        assert_runs_stock_with_one_warning(self, tr, moved, "not the first generation rows", caplog)

    def test_context_parallel_seams_run_stock(self, caplog):
        tr = self.make_transformer()
        tr._cp_shard_fn = lambda und, gen, rope: (und, gen, rope)       # identity seams: one rank
        tr._cp_gather_fn = lambda und, gen: (und, gen)
        assert_runs_stock_with_one_warning(self, tr, self.make_inputs(tr), "context-parallel seams", caplog)

    def test_a_processor_under_a_parallel_config_runs_stock(self, caplog, monkeypatch):
        """Mutation find (session 64's open gap): a processor given a parallel config (as `enable_parallelism` sets
        it) hands the call to stock. On one process stock's causal call under a config raises ("not yet supported
        for templated attention"), so the stock call here runs with the config taken off, and is counted."""
        tr = self.make_transformer()
        inputs = self.make_inputs(tr)
        ref = self.run(tr, inputs)
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=self.tiling, block=self.block))
        processors = [tr.get_submodule(name.rsplit(".", 1)[0]).processor for name in SERVED]
        stock_call, stock_calls = Cosmos3AttnProcessor.__call__, []

        def stock_without_the_config(proc, *args, **kwargs):
            stock_calls.append(proc._parallel_config)
            config, proc._parallel_config = proc._parallel_config, None
            try:
                return stock_call(proc, *args, **kwargs)
            finally:
                proc._parallel_config = config

        monkeypatch.setattr(Cosmos3AttnProcessor, "__call__", stock_without_the_config)
        config = object()                                         # a stand-in: only its presence counts
        for proc in processors:
            proc._parallel_config = config
        with caplog.at_level(logging.WARNING, logger="videosparse"):
            out = self.run(tr, inputs)
        assert torch.equal(out, ref) and stock_calls == [config] * len(SERVED)
        warnings = [r.message for r in caplog.records if "runs dense" in r.message]
        assert len(warnings) == len(SERVED) and all("under a parallel config" in w for w in warnings)
        s = sessions(tr)["transformer"].stats()
        assert s["sparse_calls"] == 0 and s["dense_calls"] == len(SERVED)


def test_dense_calls_run_the_stock_processor():
    """Dense by the config (the dense config; a sparse config's dense steps): the stock processor serves the call, so
    the output is stock's bit for bit, and the call is counted dense."""
    tr = tiny_cosmos3()
    inputs = make_inputs(tr)
    tester = TestCosmos3()
    ref = tester.run(tr, inputs)
    videosparse.apply(tr, videosparse.DenseConfig())
    assert torch.equal(tester.run(tr, inputs), ref)
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=tester.tiling, block=tester.block, dense_steps=1))
    assert torch.equal(tester.run(tr, inputs, step=0), ref)
    assert not torch.equal(tester.run(tr, inputs, step=1), ref)
    s = sessions(tr)["transformer"].stats()
    assert s["dense_calls"] == s["sparse_calls"] == tester.num_layers


def test_prompt_lengths_ending_in_the_same_tile_share_the_compiled_graphs():
    """Sparse forwards pad the prompt's rows to whole tiles, the padding masked as keys (`PaddedText.pad_to_tile`),
    so under torch.compile prompts whose rows end in the same tile reuse the graphs of the first: Dynamo compiles the
    forward once and once more with a dynamic prompt length, as it does for the stock processor (it used to compile
    one graph per prompt length, up to its limit of 8); every output equals eager."""
    from torch._dynamo.utils import counters

    tr = tiny_cosmos3()
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64))

    def inputs(n):
        g = torch.Generator().manual_seed(1)
        latents = torch.randn(1, tr.config.latent_channel, *LATENT, generator=g)
        text = torch.randint(0, tr.config.vocab_size, (n,), generator=g).tolist()
        return cosmos3_inputs(tr.config, latents, text, torch.randn(SOUND_DIM, SOUND, generator=g))

    def run(model, n):
        with torch.no_grad(), tr.cache_context("cond", step_index=2, num_inference_steps=4):
            vision, sound, _ = model(**inputs(n), return_dict=False)
        return torch.cat([vision[0].flatten(), sound[0].flatten()])

    lengths = (10, 7, 13, 20, 5)         # 288 video + 6 sound + n rows: 5 tiles of 64 for n <= 26
    eager = {n: run(tr, n) for n in lengths}
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(tr, backend="eager")
    try:
        for n in lengths:
            assert (run(compiled, n) - eager[n]).abs().max() <= 1e-5, n
        assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
        assert sessions(tr)["transformer"].context.text_len == 5 * 64 - 288
    finally:
        torch._dynamo.reset()


def test_checkpointed_training_recomputes_its_bound_method_blocks_as_they_ran():
    """Cosmos 3 gives diffusers' checkpointing function `decoder_layer.__call__`, a bound method (review find: the
    recompute's processor bookkeeping took every block for a module and raised AttributeError at the first training
    forward). Checkpointed gradients equal the unchecked ones, also with `remove()` before the backward."""
    def grads(checkpointing):
        torch.manual_seed(0)
        tr = tiny_cosmos3().train()
        inputs = make_inputs(tr)
        if checkpointing:
            tr.enable_gradient_checkpointing()
        videosparse.apply(tr, videosparse.VedaConfig(density=0.5, block=64, tiling=(1, 4, 16), dense_steps=0))
        out = tr(**inputs, return_dict=False)[0]
        out = out[0] if isinstance(out, (list, tuple)) else out
        videosparse.remove(tr)
        out.float().square().mean().backward()
        return [p.grad for p in tr.parameters() if p.grad is not None]

    plain, checkpointed = grads(False), grads(True)
    assert len(plain) == len(checkpointed) > 0
    for a, b in zip(checkpointed, plain):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1e-12)
