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


def _tiny_wan():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=4,
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
    ours = [r for r in counters["graph_break"] if "videosparse" in r and "SparseContextHook._update" not in r]
    assert not ours, ours
    torch._dynamo.reset()


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
        ]
        for name, config, apply_first in cases:
            single = _tiny_wan()
            videosparse.apply(single, config)
            ref = _forward(single, inputs)
            tr = _tiny_wan()
            if apply_first:
                videosparse.apply(tr, config)
            tr.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
            if not apply_first:
                videosparse.apply(tr, config)
            out = _forward(tr, inputs)
            err = float((out - ref).norm() / ref.norm())
            assert err < 1e-5, f"rank {rank}, {name}: rel L2 {err:.2e} vs the single-process sparse forward"
            stats = sessions(tr)["transformer"].stats()
            assert stats["sparse_calls"] == 2 and stats["dense_calls"] == 0, (name, stats)
            assert not any(layer["fallbacks"] for layer in stats["layers"].values()), (name, stats)
            if apply_first:
                _check_compiled(tr, inputs, out)
            videosparse.remove(tr)
            assert all(p._parallel_config is not None for p in tr.attn_processors.values()), name
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
