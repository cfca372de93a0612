"""Shared processor tests: every model family runs these through a subclass that builds its inputs."""

from __future__ import annotations

import logging
import re
import types

import pytest
import torch

import videosparse
from videosparse.eval.timing import host_sync_sites, package_frames
from videosparse.processors import attention_processors, observe, sessions


class ProcessorTesterMixin:
    """Subclasses define `make_transformer()` and `make_inputs(transformer) -> kwargs` (fp32, CPU), and override
    the class attributes below where their tiny model differs."""

    num_layers = 2              # self-attention layers of the tiny model
    head_dim = 64
    tiling = (1, 4, 16)         # 64-token tiles: several tiles, and a partial last one, on small grids
    block = 64

    def make_transformer(self) -> torch.nn.Module:
        raise NotImplementedError

    def make_inputs(self, transformer) -> dict:
        raise NotImplementedError

    def to_cuda_bf16(self, transformer):
        """The model on CUDA in bf16 for the GPU case (a family whose class keeps modules in fp32 overrides this)."""
        return transformer.to("cuda", torch.bfloat16)

    def output(self, result) -> torch.Tensor:
        """The tensor the tests compare, from a forward's `return_dict=False` tuple (default: its first item)."""
        return result[0]

    def run(self, transformer, inputs, name="cond", step=0, steps=4):
        with torch.no_grad(), transformer.cache_context(name, step_index=step, num_inference_steps=steps):
            return self.output(transformer(**inputs, return_dict=False))

    # ------------------------------------------------------------------ tests
    def test_dense_config_equals_stock(self):
        tr = self.make_transformer()
        inputs = self.make_inputs(tr)
        ref = self.run(tr, inputs)
        videosparse.apply(tr, videosparse.DenseConfig())
        out = self.run(tr, inputs)
        assert (out - ref).abs().max() <= 1e-6
        stats = sessions(tr)["transformer"].stats()
        assert stats["dense_calls"] > 0 and stats["sparse_calls"] == 0

    def test_sparse_density_one_equals_dense(self):
        tr = self.make_transformer()
        inputs = self.make_inputs(tr)
        ref = self.run(tr, inputs)
        videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=self.tiling, block=self.block))
        out = self.run(tr, inputs)
        assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
        s = sessions(tr)["transformer"].stats()
        assert s["sparse_calls"] > 0 and s["dense_calls"] == 0 and s["density"] == 1.0

    def test_density_one_max_abs(self):
        """Dense-equivalent sparse (density 1.0) matches the stock output to 1e-5 absolute."""
        tr = self.make_transformer()
        inputs = self.make_inputs(tr)
        ref = self.run(tr, inputs)
        videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=self.tiling, block=self.block))
        assert (self.run(tr, inputs) - ref).abs().max() <= 1e-5

    def test_sparse_changes_output_and_reports_density(self):
        tr = self.make_transformer()
        inputs = self.make_inputs(tr)
        ref = self.run(tr, inputs)
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=self.tiling, block=self.block))
        out = self.run(tr, inputs)
        assert torch.isfinite(out).all() and not torch.equal(out, ref)
        s = sessions(tr)["transformer"].stats()
        assert 0.0 < s["density"] < 0.7

    def test_remove_restores_exactly(self):
        tr = self.make_transformer()
        inputs = self.make_inputs(tr)
        ref = self.run(tr, inputs)
        before_procs = dict(attention_processors(tr))
        before_attrs = set(tr.__dict__)
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=self.tiling, block=self.block))
        self.run(tr, inputs)
        videosparse.remove(tr)
        assert all(attention_processors(tr)[k] is v for k, v in before_procs.items())
        assert set(tr.__dict__) == before_attrs          # no hook registry / forward attribute left
        assert torch.equal(self.run(tr, inputs), ref)
        assert sessions(tr) == {}

    def test_double_apply_raises_and_leaves_state(self):
        tr = self.make_transformer()
        videosparse.apply(tr, videosparse.DenseConfig())
        procs = dict(attention_processors(tr))
        with pytest.raises(ValueError, match="already applied"):
            videosparse.apply(tr, videosparse.VedaConfig())
        assert all(attention_processors(tr)[k] is v for k, v in procs.items())

    def test_dense_steps_and_layers(self):
        tr = self.make_transformer()
        inputs = self.make_inputs(tr)
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=self.tiling, block=self.block,
                                                     dense_steps=2, dense_layers=(0,)))
        session = sessions(tr)["transformer"]
        self.run(tr, inputs, step=0)
        self.run(tr, inputs, step=1)
        assert session.stats()["sparse_calls"] == 0
        self.run(tr, inputs, step=2)
        layers = session.stats()["layers"]
        assert layers[0]["sparse_calls"] == 0 and layers[0]["dense_calls"] == 3
        assert all(layers[i]["sparse_calls"] == 1 for i in layers if i != 0)

    def test_a_training_step_with_a_dense_and_a_sparse_layer(self):
        """Autograd recording, layer 0 dense (stock SDPA) and the others sparse: backward runs (nothing autograd
        saved is changed in place) and gives every parameter that the stock model trains a finite gradient (the
        parameters DenseConfig's processors train where the stock model has no backward on the CPU)."""
        tr = self.make_transformer()
        inputs = self.make_inputs(tr)

        def grads():
            tr.zero_grad(set_to_none=True)
            with tr.cache_context("cond", step_index=0, num_inference_steps=4):
                out = self.output(tr(**inputs, return_dict=False))
            out.float().square().mean().backward()
            return {n: p.grad for n, p in tr.named_parameters() if p.grad is not None}

        try:
            trained = set(grads())
        except NotImplementedError:         # e.g. Wan-Animate-2's stock FlexAttention call (no CPU backward)
            videosparse.apply(tr, videosparse.DenseConfig())
            trained = set(grads())
            videosparse.remove(tr)
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=self.tiling, block=self.block,
                                                     dense_steps=0, dense_layers=(0,)))
        got = grads()
        assert set(got) == trained and all(torch.isfinite(g).all() for g in got.values())
        layers = sessions(tr)["transformer"].stats()["layers"]
        assert layers[0]["sparse_calls"] == 0 and layers[0]["dense_calls"] >= 1
        assert all(layers[i]["sparse_calls"] >= 1 for i in layers if i != 0)

    def test_dense_steps_fraction_uses_step_count(self):
        tr = self.make_transformer()
        inputs = self.make_inputs(tr)
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=self.tiling, block=self.block,
                                                     dense_steps=0.5))
        session = sessions(tr)["transformer"]
        self.run(tr, inputs, step=4, steps=10)
        assert session.stats()["sparse_calls"] == 0
        self.run(tr, inputs, step=5, steps=10)
        assert session.stats()["sparse_calls"] > 0

    def test_cond_uncond_isolation(self):
        tr = self.make_transformer()
        inputs = self.make_inputs(tr)
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=self.tiling, block=self.block))
        seen = []
        with observe(tr, lambda r: seen.append((r.branch, r.step, r.layer))):
            a = self.run(tr, inputs, "cond", step=3)
            b = self.run(tr, inputs, "uncond", step=3)
        assert torch.equal(a, b)   # same inputs, same plan: branches do not leak state
        assert {s[0] for s in seen} == {"cond", "uncond"} and {s[1] for s in seen} == {3}

    def test_observer_sees_post_rope_inputs(self):
        tr = self.make_transformer()
        inputs = self.make_inputs(tr)
        records = []
        with observe(tr, records.append):
            self.run(tr, inputs)
        assert sessions(tr) == {}                       # observe applied dense and removed it
        assert len(records) == self.num_layers
        r = records[0]
        assert r.q.dim() == 4 and r.q.shape[1] == r.grid[0] * r.grid[1] * r.grid[2] + r.text_len

    def test_unsupported_mask_falls_back_dense_with_one_warning(self, caplog):
        tr = self.make_transformer()
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=self.tiling, block=self.block))
        session = sessions(tr)["transformer"]
        session.context.grid = (1, 1, 1)               # a grid that cannot match the sequence
        proc = next(p for p in attention_processors(tr).values() if hasattr(p, "attend"))
        q = torch.randn(1, 10, 2, self.head_dim)
        with caplog.at_level(logging.WARNING, logger="videosparse"):
            out1 = proc.attend(q, q, q)
            out2 = proc.attend(q, q, q)
        assert torch.equal(out1, out2)
        assert sum("runs dense" in r.message for r in caplog.records) == 1

    def test_video_shorter_than_one_tile(self, caplog):
        """Joint-attention models (text tokens in the sequence) run a video of fewer tokens than one tile
        dense, with one warning (there is nothing to skip); video-only ones keep the partial tile sparse."""
        tr = self.make_transformer()
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=self.tiling, block=self.block))
        session = sessions(tr)["transformer"]
        text = 8 if session.info.text_position else 0
        grid = (1, 2, 3)
        session.context.grid, session.context.text_len = grid, text
        session.prepare(grid, text, torch.device("cpu"), torch.float32)
        proc = next(p for p in attention_processors(tr).values() if hasattr(p, "attend"))
        q, k, v = (torch.randn(1, 6 + text, 2, self.head_dim) for _ in range(3))
        with caplog.at_level(logging.WARNING, logger="videosparse"):
            out = proc.attend(q, k, v)
        assert (out - proc._dense(q, k, v, None)).abs().max() <= 1e-5
        stats = session.stats()
        if text:
            assert stats["dense_calls"] == 1 and any("fewer tokens" in r.message for r in caplog.records)
        else:
            assert stats["sparse_calls"] == 1

    def test_compiled_matches_eager_without_breaks_in_the_blocks(self):
        """torch.compile (Dynamo, eager backend) through the model's sparse processors: the same output as eager,
        and no graph break in videosparse's code but the context hook's, before the blocks (a model's own forward
        may break: HunyuanVideo 1.5 branches on its image embeddings)."""
        from torch._dynamo.utils import counters

        tr = self.make_transformer()
        inputs = self.make_inputs(tr)
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=self.tiling, block=self.block))
        eager = self.run(tr, inputs, step=2)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(tr, backend="eager")
        with torch.no_grad(), tr.cache_context("cond", step_index=2, num_inference_steps=4):
            out = self.output(compiled(**inputs, return_dict=False))
        torch._dynamo.reset()
        assert torch.equal(out, eager)
        assert sessions(tr)["transformer"].stats()["sparse_calls"] == 2 * self.num_layers
        breaks = counters["graph_break"]
        ours = [r for r in breaks if "videosparse" in r and "SparseContextHook.new_forward" not in r]
        assert any("SparseContextHook.new_forward" in r for r in breaks) and not ours, ours

    @pytest.mark.gpu
    def test_gpu_bf16_density_one_matches_stock(self):
        """On CUDA in bf16 (the GPU kernels, the model's own layout and text handling): density 1 equals the
        stock forward up to bf16 rounding, and a sparse density gives a finite output."""
        tr = self.to_cuda_bf16(self.make_transformer())
        inputs = _to_cuda_bf16(self.make_inputs(tr))
        ref = self.run(tr, inputs).float()
        videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=self.tiling, block=self.block))
        out = self.run(tr, inputs).float()
        assert sessions(tr)["transformer"].stats()["sparse_calls"] > 0
        videosparse.remove(tr)
        assert float((out - ref).norm() / ref.norm()) < 2e-2
        videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=self.tiling, block=self.block))
        assert torch.isfinite(self.run(tr, inputs)).all()
        videosparse.remove(tr)

    @pytest.mark.gpu
    @pytest.mark.parametrize("method", ["veda", "sol"])
    def test_gpu_sparse_layers_never_sync_the_host_in_videosparse(self, method):
        """After a warm-up forward (kernels compiled, Sol calibrated, per-shape tensors cached) the sparse layers
        only queue GPU work in videosparse's code: a host sync per layer lets the GPU idle while the host catches
        up (24% of an eager Wan 1.3B Sol forward before, docs/results.md, "Sol without host syncs"). Not counted:
        syncs in diffusers' own code, and the context hook's once-per-forward reading of the geometry that some families
        pass as tensors (positions, coordinates, masks), before the forward's first kernel."""
        config_class = videosparse.VedaConfig if method == "veda" else videosparse.SolConfig
        tr = self.to_cuda_bf16(self.make_transformer())
        inputs = _to_cuda_bf16(self.make_inputs(tr))
        videosparse.apply(tr, config_class(density=0.3, tiling=self.tiling, block=self.block, dense_steps=0))
        self.run(tr, inputs)
        torch.cuda.synchronize()
        sites = [package_frames(frames) for frames in host_sync_sites(lambda: self.run(tr, inputs))]
        assert sessions(tr)["transformer"].stats()["sparse_calls"] > 0
        videosparse.remove(tr)
        hook = re.compile(r"processors/context\.py:\d+:_update$")
        # innermost package frame the hook's new_forward: the sync is in the model's own code, which it calls
        model = re.compile(r"processors/context\.py:\d+:new_forward$")
        ours = [" <- ".join(f) for f in sites
                if f and not model.match(f[0]) and not any(hook.match(frame) for frame in f)]
        assert not ours, ours

    def test_bad_config_type(self):
        tr = self.make_transformer()
        with pytest.raises(TypeError, match="not a videosparse config"):
            videosparse.apply(tr, {"density": 0.1})
        with pytest.raises(TypeError, match=r"the class VedaConfig; pass an instance, e.g. VedaConfig\(\)"):
            videosparse.apply(tr, videosparse.VedaConfig)
        assert sessions(tr) == {}


def apply_and_list_served(transformer, config) -> tuple[dict, list[str]]:
    """Apply `config` to `transformer`: (its attention processors before, by name; the sorted names of those
    the apply replaced)."""
    before = dict(attention_processors(transformer))
    videosparse.apply(transformer, config)
    after = attention_processors(transformer)
    return before, sorted(n for n in after if after[n] is not before[n])


def _to_cuda_bf16(obj):
    """Inputs moved to CUDA: floating tensors in bf16, others (masks, integer timesteps) as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.to("cuda", torch.bfloat16) if obj.is_floating_point() else obj.to("cuda")
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_cuda_bf16(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_cuda_bf16(v) for k, v in obj.items()}
    return obj


def assert_runs_stock_with_one_warning(tester, transformer, inputs: dict, reason: str, caplog) -> None:
    """Applied now, a sparse config leaves two forwards of `inputs` (steps 0 and 1) equal to the stock forward, with
    no observer records, one warning per layer naming `reason`, and every self-attention call counted dense."""
    ref = tester.run(transformer, inputs)
    videosparse.apply(transformer, videosparse.VedaConfig(density=0.3, tiling=tester.tiling, block=tester.block))
    records = []
    with caplog.at_level(logging.WARNING, logger="videosparse"), observe(transformer, records.append):
        out1 = tester.run(transformer, inputs)
        out2 = tester.run(transformer, inputs, step=1)
    assert torch.equal(out1, ref) and torch.equal(out2, ref) and records == []
    warnings = [r.message for r in caplog.records if "runs dense" in r.message]
    assert len(warnings) == tester.num_layers and all(reason in w for w in warnings)
    s = sessions(transformer)["transformer"].stats()
    assert s["sparse_calls"] == 0 and s["dense_calls"] == 2 * tester.num_layers


def check_blocks_attn1_served(tester, stock_cls, expected: list[str] | None = None):
    """Apply Veda at density 0.5 to a fresh tiny transformer of `tester`: exactly the processors named `expected`
    (default: the blocks' attn1, `transformer_blocks.<i>.attn1.processor`; all `stock_cls` before) are replaced and
    every other processor stays the same object; one forward runs sparse on every served layer with a finite output
    that differs from dense. Returns (transformer, processors before, the forward's attention records, sparse
    output, dense output)."""
    transformer = tester.make_transformer()
    inputs = tester.make_inputs(transformer)
    dense = tester.run(transformer, inputs)
    before, served = apply_and_list_served(
        transformer, videosparse.VedaConfig(density=0.5, tiling=tester.tiling, block=tester.block))
    if expected is None:
        expected = [f"transformer_blocks.{i}.attn1.processor" for i in range(tester.num_layers)]
    assert served == expected
    assert all(type(before[n]) is stock_cls for n in served)
    after = attention_processors(transformer)
    assert all(after[n] is before[n] for n in before if n not in served)
    records = []
    with observe(transformer, records.append):
        out = tester.run(transformer, inputs)
    s = sessions(transformer)["transformer"].stats()
    assert s["sparse_calls"] == tester.num_layers and s["dense_calls"] == 0 and 0.3 < s["density"] < 0.9
    assert torch.isfinite(out).all() and not torch.equal(out, dense)
    assert [r.layer for r in records] == list(range(tester.num_layers))
    return transformer, before, records, out, dense


def check_extra_tokens_served_as_global_tiles(tester, transformer, inputs: dict, grid, extra: int, position: str,
                                              caplog) -> None:
    """A forward of `inputs` whose sequence holds `extra` condition tokens beside the `grid` video (`position`
    "before" / "after" it): Veda at density 1 equals the stock forward and records them as global (text-like)
    tokens on every layer; at density 0.3 every layer runs sparse, with no fallback to dense."""
    ref = tester.run(transformer, inputs)
    videosparse.apply(transformer, videosparse.VedaConfig(density=1.0, tiling=tester.tiling, block=tester.block))
    records = []
    with caplog.at_level(logging.WARNING, logger="videosparse"), observe(transformer, records.append):
        out = tester.run(transformer, inputs)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert [(r.grid, r.text_len, r.text_position) for r in records] == [(grid, extra, position)] * tester.num_layers
    videosparse.remove(transformer)
    videosparse.apply(transformer, videosparse.VedaConfig(density=0.3, tiling=tester.tiling, block=tester.block))
    assert torch.isfinite(tester.run(transformer, inputs)).all()
    s = sessions(transformer)["transformer"].stats()
    assert s["sparse_calls"] == tester.num_layers and s["dense_calls"] == 0 and s["density"] < 0.9
    assert not [r for r in caplog.records if "runs dense" in r.getMessage()]


def with_cache_context(transformer):
    """`transformer` given diffusers' `CacheMixin.cache_context` (for classes without CacheMixin, such as Cosmos and
    AnyFlow, whose pipelines set no cache context): the shared tests name the branch and step of a forward
    through it."""
    from diffusers.models.cache_utils import CacheMixin

    transformer.cache_context = types.MethodType(CacheMixin.cache_context, transformer)
    return transformer


def tiny_image_pipeline_parts():
    """(image_encoder, image_processor, scheduler) for tiny image-conditioned Wan-family pipelines, built offline: a
    CLIP vision encoder of hidden size 24 on 32 x 32 pixels and a flow-sigma UniPC scheduler."""
    import diffusers
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=24, intermediate_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, image_size=32, patch_size=16)).eval()
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    scheduler = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                  flow_shift=5.0)
    return image_encoder, image_processor, scheduler


def assert_cross_attention_call_is_stock(transformer, attn, x: torch.Tensor, context: torch.Tensor) -> None:
    """A call with encoder states `context` given to the served self-attention module `attn` of `transformer`
    (applied at density 0.3 here) returns the stock output and is neither observed nor counted."""
    with torch.no_grad():
        ref = attn(x, encoder_hidden_states=context)
        videosparse.apply(transformer, videosparse.VedaConfig(density=0.3, tiling=ProcessorTesterMixin.tiling,
                                                              block=ProcessorTesterMixin.block))
        records = []
        with observe(transformer, records.append):
            out = attn(x, encoder_hidden_states=context)
    assert torch.equal(out, ref) and records == []
    s = sessions(transformer)["transformer"].stats()
    assert s["sparse_calls"] == s["dense_calls"] == 0


def assert_batch_items_sparse_as_alone(tester, transformer, inputs: dict, sparse_calls: int, caplog,
                                       item=lambda name, value, b: value[b:b + 1]) -> None:
    """Density 0.5 over a batch of 2: `sparse_calls` sparse calls, no dense call and no fallback warning, and each
    item's output as when the item runs alone (`item(name, value, b)`: input `name` of item b)."""
    videosparse.apply(transformer, videosparse.VedaConfig(density=0.5, tiling=tester.tiling, block=tester.block))
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        out = tester.run(transformer, inputs)
    s = sessions(transformer)["transformer"].stats()
    assert s["sparse_calls"] == sparse_calls and s["dense_calls"] == 0
    assert not [r for r in caplog.records if "runs dense" in r.getMessage()]
    for b in range(2):
        alone = tester.run(transformer, {k: item(k, v, b) for k, v in inputs.items()})
        assert (out[b:b + 1] - alone).abs().max() <= 1e-5


def assert_tiny_pipeline_sparse(pipe, run, record_key, expected: set, calls: int) -> None:
    """A tiny pipeline end to end: with Veda at density 0.5 (64-token (1, 4, 16) tiles) each of the `calls`
    transformer forwards of `run()` serves every layer sparse, no fallback; its records give `{record_key(r)} ==
    expected`; the video changes; remove() restores it exactly."""
    import numpy as np

    ref = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64))
    seen = set()
    with observe(pipe, lambda r: seen.add(record_key(r))):
        sparse = run()
    assert seen == expected
    stats = handle["transformer"].stats()
    assert stats["transformer_calls"] == calls
    assert all(s["dense_calls"] == 0 and s["sparse_calls"] == calls and s["fallbacks"] == []
               for s in stats["layers"].values())
    assert np.isfinite(sparse).all() and not np.array_equal(sparse, ref)
    videosparse.remove(pipe)
    assert np.array_equal(run(), ref)


RANDOM_GRID_TILINGS = [(1, 4, 16), (1, 8, 8), (2, 4, 8), (4, 4, 4), (4, 2, 8)]   # 64-token tiles of every aspect


def check_any_grid(tester, transformer, inputs: dict, tiling, sparse_config=None, label=None) -> None:
    """On inputs of a drawn grid: Veda at density 1 with `tiling` (64-token tiles) equals the stock forward, and
    `sparse_config` (default Sol at 0.3) runs finite, every layer counted, with a realised density inside (0, 1]."""
    ref = tester.run(transformer, inputs)
    videosparse.apply(transformer, videosparse.VedaConfig(density=1.0, tiling=tiling, block=64, dense_steps=0))
    out = tester.run(transformer, inputs)
    videosparse.remove(transformer)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max(), label
    config = sparse_config or videosparse.SolConfig(density=0.3, tiling=tiling, block=64, dense_steps=0)
    videosparse.apply(transformer, config)
    out = tester.run(transformer, inputs)
    stats = sessions(transformer)["transformer"].stats()
    videosparse.remove(transformer)
    assert torch.isfinite(out).all() and out.shape == ref.shape, label
    assert stats["sparse_calls"] + stats["dense_calls"] == tester.num_layers
    assert stats["sparse_calls"] == 0 or 0 < stats["density"] <= 1
