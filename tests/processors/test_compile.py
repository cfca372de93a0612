"""The sparse path under torch.compile: same output as eager, bounded graphs and breaks over a pipeline's steps."""

import pytest
import torch
from torch._dynamo.utils import counters

import videosparse
from videosparse.models.tiny_wan import build_tiny_wan_pipeline

from test_wan_processors import TestWanProcessors as _WanCase


def _run(tr, module, inputs, step, branch):
    with torch.no_grad(), tr.cache_context(branch, step_index=step, num_inference_steps=10):
        return module(**inputs, timestep=torch.tensor([900 - 50 * step]), return_dict=False)[0]


def test_compiled_transformer_matches_eager_with_bounded_graphs():
    t = _WanCase()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    inputs.pop("timestep")
    handle = videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=(1, 4, 16), block=64, dense_steps=2))
    eager = {s: _run(tr, tr, inputs, s, "cond") for s in (0, 1, 2, 3)}
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(tr, backend="eager")
    for step in range(10):
        for branch in ("cond", "uncond"):
            out = _run(tr, compiled, inputs, step, branch)
            if step in eager:
                assert torch.equal(out, eager[step])
    # one graph for dense steps, one for sparse steps; the only break is the context hook at the top
    assert counters["stats"]["unique_graphs"] <= 3
    breaks = counters["graph_break"]
    assert sum(breaks.values()) <= 2 and all("SparseContextHook.new_forward" in reason for reason in breaks)
    stats = handle["transformer"].stats()
    # eager warm-up: steps 0-1 dense, 2-3 sparse; compiled: 10 steps x 2 branches; 2 layers
    assert stats["sparse_calls"] == 2 * 2 + 2 * 8 * 2 and stats["dense_calls"] == 2 * 2 + 2 * 2 * 2


def test_compiled_pipeline_call_recompiles_a_bounded_number_of_times():
    pipe = build_tiny_wan_pipeline()
    pipe.set_progress_bar_config(disable=True)
    videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=3))
    torch._dynamo.reset()
    counters.clear()
    pipe.transformer.compile(backend="eager")
    pipe("a red circle", num_frames=5, height=64, width=96, num_inference_steps=10, output_type="np",
         max_sequence_length=16, generator=torch.Generator().manual_seed(0))
    assert counters["stats"]["unique_graphs"] <= 3
    # frames: the forward, its resumption after the hook, and the dense/sparse variants (not one per step)
    assert counters["frames"]["total"] <= 6


def test_compiled_sol_and_veda_with_correction_match_eager():
    t = _WanCase()
    for cfg in (videosparse.SolConfig(density=0.5, band=0, block=64, tiling=(1, 4, 16), dense_steps=0),
                videosparse.VedaConfig(density=0.3, block=64, tiling=(1, 4, 16), dense_steps=0, correction=True)):
        tr = t.make_transformer()
        inputs = t.make_inputs(tr)
        inputs.pop("timestep")
        videosparse.apply(tr, cfg)
        eager = {s: _run(tr, tr, inputs, s, "cond") for s in range(3, 7)}   # also calibrates Sol once
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(tr, backend="aot_eager")
        for step in range(3, 7):
            out = _run(tr, compiled, inputs, step, "cond")
            assert (out - eager[step]).abs().max() <= 1e-5 * eager[step].abs().max()
        assert counters["stats"]["unique_graphs"] <= 2
        breaks = counters["graph_break"]
        assert all("SparseContextHook.new_forward" in reason for reason in breaks), list(breaks)


def test_regional_compilation_compiles_one_block_for_every_layer():
    """diffusers' `compile_repeated_blocks`: the processors read their layer's state (layout, counters,
    Sol's calibrated threshold, the estimator's weights) from their own slot, so one compiled block
    serves all layers (a dense layer adds one variant); output equal to eager. The compiled run starts from
    a fresh session, so Sol calibrates inside the fullgraph-compiled block (a custom op)."""
    from diffusers import WanTransformer3DModel

    from videosparse.veda import VedaEstimator

    t = _WanCase()
    torch.manual_seed(0)
    # a trained-like estimator (large init so it changes the picks): its per-layer weights come from the slots
    estimator = VedaEstimator("WanTransformer3DModel", 6, 2, t.head_dim, block=64, tile_shapes=(1, 4, 16), init_std=0.5)
    for cfg, graphs in ((videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=0), 1),
                        (videosparse.VedaConfig(density=0.5, estimator=estimator, block=64, dense_steps=0), 1),
                        (videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=0,
                                                dense_layers=(0,)), 2),
                        (videosparse.SolConfig(density=0.5, band=0, block=64, tiling=(1, 4, 16), dense_steps=0), 1),
                        (videosparse.DenseConfig(), 1)):
        tr = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=t.head_dim, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=32, ffn_dim=64, num_layers=6, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
        ).eval()
        inputs = t.make_inputs(tr)

        def fresh_session():
            handle = videosparse.apply(tr, cfg)
            if isinstance(cfg, videosparse.SolConfig):
                # compiled Sol packs plans to full width; the same in eager, so that float noise of the
                # other packing cannot flip a tile at the threshold in a later layer
                handle["transformer"].method.static_width = True
            return handle["transformer"]

        fresh_session()
        with torch.no_grad():
            eager = tr(**inputs, return_dict=False)[0]
        videosparse.remove(tr)
        session = fresh_session()
        torch._dynamo.reset()
        counters.clear()
        tr.compile_repeated_blocks(fullgraph=True, backend="eager")
        with torch.no_grad():
            out = tr(**inputs, return_dict=False)[0]
        assert counters["stats"]["unique_graphs"] == graphs, (cfg, dict(counters["stats"]))
        assert (out - eager).abs().max() <= 1e-5
        stats = session.stats()
        assert stats["sparse_calls"] + stats["dense_calls"] == 6         # every layer counted
        if isinstance(cfg, videosparse.SolConfig):
            assert len(session.method.calibrations()) == 6               # calibrated inside the compiled blocks
        videosparse.remove(tr)
    torch._dynamo.reset()


def test_each_sol_density_does_not_compile_its_own_block():
    """Review find: Sol's density went to the calibration custom op as a Python float, which Dynamo guards on; each
    density a long-lived compiled transformer served (apply / remove with another density) compiled one more variant,
    until the recompile limit, where regional fullgraph compilation raised. The density is now a tensor built
    outside the graph: one graph serves every density, each calibrated to its own target."""
    from diffusers import WanTransformer3DModel

    t = _WanCase()
    torch.manual_seed(0)
    tr = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=t.head_dim, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64).eval()
    inputs = t.make_inputs(tr)
    torch._dynamo.reset()
    counters.clear()
    tr.compile_repeated_blocks(fullgraph=True, backend="eager")
    try:
        for density in (0.3, 0.35, 0.4, 0.45, 0.5):
            session = videosparse.apply(tr, videosparse.SolConfig(density=density, band=0, block=64,
                                                                  tiling=(1, 4, 16), dense_steps=0))["transformer"]
            with torch.no_grad():
                tr(**inputs, return_dict=False)
            assert all(abs(c["density"] - density) < 0.05 for c in session.method.calibrations().values())
            videosparse.remove(tr)
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
def test_inductor_on_cuda_matches_eager():
    """The GPU path under Inductor: the fused top-k, TripPool, tile centroids and the kernel run as custom ops
    inside real compiled graphs. bf16 outputs match eager up to Inductor's reordering of the model's own math,
    the plans keep the same number of tiles, and nothing in videosparse breaks the graph but the context hook."""
    from tester import _to_cuda_bf16

    t = _WanCase()
    for cfg in (videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block, dense_steps=0),
                videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block, dense_steps=0, correction=True)):
        tr = t.make_transformer().to("cuda", torch.bfloat16)
        inputs = _to_cuda_bf16(t.make_inputs(tr))
        session = videosparse.apply(tr, cfg)["transformer"]
        with torch.no_grad():
            eager = tr(**inputs, return_dict=False)[0].float()
            kept = session.stats()["density"]
            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(tr)
            out = compiled(**inputs, return_dict=False)[0].float()
        torch._dynamo.reset()
        assert float((out - eager).norm() / eager.norm()) < 2e-2
        assert session.stats()["density"] == kept and session.stats()["sparse_calls"] == 2 * t.num_layers
        ours = [r for r in counters["graph_break"] if "videosparse" in r and "SparseContextHook.new_forward" not in r]
        assert not ours, ours
        videosparse.remove(tr)


def test_new_video_shapes_keep_regional_fullgraph_compilation_running():
    """Each new resolution adds up to four variants of the compiled block (dense and sparse steps, Sol's calibration
    call, a dense layer): at Dynamo's default recompile limit of 8 the third resolution raised under fullgraph=True
    (whole-transformer compilation ran eagerly from there on). apply raises the limit to MIN_RECOMPILE_LIMIT, never
    lowers it (review find)."""
    from videosparse.processors import MIN_RECOMPILE_LIMIT

    # Dynamo's own patch, which restores both limits on exit: pytest's monkeypatch deletes a torch config entry on
    # undo, and torch (2.11 to 2.14 at least) then hides it: every later apply raised AttributeError reading it
    dynamo_config = torch._dynamo.config
    with dynamo_config.patch(recompile_limit=8, accumulated_recompile_limit=dynamo_config.accumulated_recompile_limit):
        pipe = build_tiny_wan_pipeline(num_layers=3)
        pipe.set_progress_bar_config(disable=True)
        videosparse.apply(pipe, videosparse.SolConfig(density=0.5, band=0, block=64, tiling=(1, 4, 16), dense_steps=3,
                                                      dense_layers=(0,)))
        assert dynamo_config.recompile_limit == MIN_RECOMPILE_LIMIT
        torch._dynamo.reset()
        counters.clear()
        pipe.transformer.compile_repeated_blocks(fullgraph=True, backend="eager")
        for height, width in ((64, 96), (64, 128), (96, 96)):
            pipe("a red circle", num_frames=5, height=height, width=width, num_inference_steps=6, output_type="latent",
                 max_sequence_length=16, generator=torch.Generator().manual_seed(0))
        assert 8 < counters["stats"]["unique_graphs"] <= 4 * 3
        videosparse.remove(pipe)
        dynamo_config.recompile_limit = 100
        videosparse.apply(pipe, videosparse.DenseConfig())
        assert dynamo_config.recompile_limit == 100
        videosparse.remove(pipe)
        torch._dynamo.reset()
