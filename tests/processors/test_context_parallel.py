"""Ulysses context parallelism (diffusers' `enable_parallelism`): the sparse path runs on each rank's heads.

Two CPU processes over gloo: the tiny Wan transformer's output under `ContextParallelConfig(ulysses_degree=2)` must
equal the same config's single-process output (same plans: each rank plans its own heads over the whole sequence),
with a trained-like estimator whose heads differ and a different tile shape per head, so a rank that used another
rank's heads' weights or tiles would not match.
"""

import socket
import types

import pytest
import torch
import torch.multiprocessing as mp

import videosparse
from videosparse.processors import sessions
from videosparse.processors.parallel import UlyssesShard, ulysses_shard

HEADS, HEAD_DIM = 4, 32
TILES = [(1, 4, 16), (2, 4, 8), (1, 8, 8), (2, 2, 16)]      # one 64-token shape per head


def _tiny_wan(heads: int = HEADS):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    ).eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    # grid after patching: 3 x 6 x 9 = 162 tokens (2 x 81 per rank), partial last tiles in every head's shape
    return dict(hidden_states=torch.randn(2, 4, 3, 12, 18, generator=g), timestep=torch.tensor([500, 500]),
                encoder_hidden_states=torch.randn(2, 8, 16, generator=g))


def _estimator():
    from videosparse.veda import VedaEstimator

    torch.manual_seed(2)
    return VedaEstimator("WanTransformer3DModel", num_layers=2, num_heads=HEADS, head_dim=HEAD_DIM, block=64,
                         tile_shapes=[TILES, TILES], init_std=0.3)


def _forward(tr, inputs):
    with torch.no_grad(), tr.cache_context("cond", step_index=3, num_inference_steps=4):
        return tr(**inputs, return_dict=False)[0]


def _check_compiled(tr, inputs, eager):
    """torch.compile of the parallel sparse transformer gives the eager output, and the only graph break in
    videosparse's code is the context hook's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    tr.compile()
    out = _forward(tr, inputs)
    assert float((out - eager).norm() / eager.norm()) < 1e-5
    ours = [r for r in counters["graph_break"] if "videosparse" in r and "SparseContextHook.new_forward" not in r]
    assert not ours, ours
    torch._dynamo.reset()


def _parallel(transformer, config, apply_first: bool, world: int):
    """`transformer` under Ulysses over `world` ranks with `config` applied before or after `enable_parallelism`."""
    from diffusers.models._modeling_parallel import ContextParallelConfig

    if apply_first:
        videosparse.apply(transformer, config)
    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    if not apply_first:
        videosparse.apply(transformer, config)
    return transformer


def _rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from diffusers.models._modeling_parallel import ContextParallelConfig

    # diffusers places rank r on accelerator r % device_count(), which is 0 on a CPU-only machine
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        inputs = _inputs()
        cases = [
            ("veda, applied before enable_parallelism",
             videosparse.VedaConfig(density=0.4, estimator=_estimator(), block=64), True),
            ("sol with a fixed tau, applied after", videosparse.SolConfig(tau=0.5, block=64, band=0), False),
            # tau calibrated over all heads (gathered from both ranks), as on one GPU: each rank alone found its own
            ("sol with a target density", videosparse.SolConfig(density=0.5, block=64, band=0), False),
        ]
        for name, config, apply_first in cases:
            single = _tiny_wan()
            videosparse.apply(single, config)
            ref = _forward(single, inputs)
            tr = _parallel(_tiny_wan(), config, apply_first, world)
            out = _forward(tr, inputs)
            err = float((out - ref).norm() / ref.norm())
            assert err < 1e-5, f"rank {rank}, {name}: rel L2 {err:.2e} vs the single-process sparse forward"
            if isinstance(config, videosparse.SolConfig) and config.tau is None:
                taus = [[v["tau"] for v in sessions(t)["transformer"].method.calibrations().values()]
                        for t in (single, tr)]
                # the same calibration up to float32 rounding (the gathered heads' sums run in another order: 1.2e-7
                # apart in one CPU run of 2026-12-07); a rank calibrating on its own heads alone finds another tau
                assert len(taus[0]) == len(taus[1]) == 2, (rank, taus)
                assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(*taus)), (rank, taus)
            stats = sessions(tr)["transformer"].stats()
            assert stats["sparse_calls"] == 2 and stats["dense_calls"] == 0, (name, stats)
            # review 54: each rank counts the plans of its own heads; all_ranks=True gives the model's density
            whole, alone = sessions(tr)["transformer"].stats(all_ranks=True), sessions(single)["transformer"].stats()
            assert whole["density"] == alone["density"] and whole["sparse_calls"] == 2, (name, whole, alone)
            assert [v["kept_pairs"] for v in whole["layers"].values()] == \
                [v["kept_pairs"] for v in alone["layers"].values()], name
            assert sessions(single)["transformer"].stats(all_ranks=True) == alone      # no parallelism: the same
            assert not any(layer["fallbacks"] for layer in stats["layers"].values()), (name, stats)
            if apply_first:
                _check_compiled(tr, inputs, out)
            videosparse.remove(tr)
            assert all(p._parallel_config is not None for p in tr.attn_processors.values()), name
        # 3 heads over 2 ranks: a clear error (diffusers' own Ulysses attention cannot split them either)
        tr = _tiny_wan(heads=3)
        tr.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        videosparse.apply(tr, videosparse.SolConfig(tau=0.5, block=64, band=0))
        with pytest.raises(ValueError, match="3 attention heads do not split evenly over ulysses_degree=2"):
            _forward(tr, inputs)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ulysses_sparse_matches_single_process():
    pytest.importorskip("torch.distributed")
    if not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed has no gloo backend")
    mp.spawn(_rank, args=(2, _free_port()), nprocs=2, join=True)


def _ltx_rank(rank: int, world: int, port: int) -> None:
    """LTX-Video splits its own forward's inputs (`_cp_plan` key ""): with `apply` before `enable_parallelism` that
    split runs outside the context hook, which must still see the whole sequence (it used to run every call dense)."""
    import torch.distributed as dist
    from diffusers import LTXVideoTransformer3DModel
    from diffusers.pipelines.ltx.pipeline_ltx import LTXPipeline

    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        def tiny():
            torch.manual_seed(0)
            return LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2,
                                              attention_head_dim=64, cross_attention_dim=128, num_layers=2,
                                              caption_channels=16).eval()

        g = torch.Generator().manual_seed(1)
        inputs = dict(hidden_states=LTXPipeline._pack_latents(torch.randn(1, 8, 3, 8, 16, generator=g), 1, 1),
                      encoder_hidden_states=torch.randn(1, 8, 16, generator=g), timestep=torch.tensor([500.0]),
                      encoder_attention_mask=None, num_frames=3, height=8, width=16,
                      rope_interpolation_scale=(8 / 25, 32, 32))
        config = videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64)
        single = tiny()
        videosparse.apply(single, config)
        ref = _forward(single, inputs)
        for apply_first in (True, False):
            tr = _parallel(tiny(), config, apply_first, world)
            out = _forward(tr, inputs)
            stats = sessions(tr)["transformer"].stats()
            assert stats["sparse_calls"] == 2 and stats["dense_calls"] == 0, (apply_first, stats)
            assert float((out - ref).norm() / ref.norm()) < 1e-5, apply_first
            videosparse.remove(tr)
    finally:
        dist.destroy_process_group()


def _helios_rank(rank: int, world: int, port: int) -> None:
    """Helios amplifies its history keys, the first rows of the sequence: under Ulysses each rank projects its own
    1/P of the rows, so the history rows are those of the whole sequence's history that fall in its shard (stock
    diffusers counts them from the shard's length, scaling none: 0.28 rel L2 off the single-process output)."""
    import torch.distributed as dist
    from test_helios import helios_inputs, tiny_helios

    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        inputs = helios_inputs()
        config = videosparse.SolConfig(tau=0.5, block=64, band=0)
        single = tiny_helios(num_layers=40)             # diffusers' Helios `_cp_plan` names blocks 0..39
        videosparse.apply(single, config)
        ref = _forward(single, inputs)
        tr = _parallel(tiny_helios(num_layers=40), config, False, world)
        out = _forward(tr, inputs)
        assert sessions(tr)["transformer"].stats()["sparse_calls"] == 40
        assert float((out - ref).norm() / ref.norm()) < 1e-5
    finally:
        dist.destroy_process_group()


def test_ulysses_helios_scales_the_history_keys_of_each_shard():
    pytest.importorskip("torch.distributed")
    if not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed has no gloo backend")
    mp.spawn(_helios_rank, args=(2, _free_port()), nprocs=2, join=True)


def test_ulysses_ltx_runs_sparse_whichever_comes_first():
    pytest.importorskip("torch.distributed")
    if not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed has no gloo backend")
    mp.spawn(_ltx_rank, args=(2, _free_port()), nprocs=2, join=True)


def _cp(**kw):
    cp = types.SimpleNamespace(ring_degree=1, ulysses_degree=1, ulysses_anything=False, _ulysses_mesh=None,
                               _ulysses_local_rank=0)
    cp.__dict__.update(kw)
    return types.SimpleNamespace(context_parallel_config=cp)


def test_ulysses_shard_names_what_it_cannot_serve():
    assert ulysses_shard(None) is None
    assert ulysses_shard(types.SimpleNamespace(context_parallel_config=None)) is None
    assert "ring_degree=2" in ulysses_shard(_cp(ring_degree=2))
    assert "unevenly" in ulysses_shard(_cp(ulysses_degree=2, ulysses_anything=True))
    mesh = types.SimpleNamespace(get_group=lambda: "group")
    shard = ulysses_shard(_cp(ulysses_degree=4, _ulysses_mesh=mesh, _ulysses_local_rank=3))
    assert shard == UlyssesShard("group", 4, 3) and shard.heads(40) == slice(30, 40)
