"""Inputs on a GPU that is not the current one (marked `gpu`; needs two GPUs).

Triton compiles for and launches on the current device, so every Triton launcher runs under the device of its
inputs (`_triton_utils.on_input_device`): a pipeline on cuda:1 with cuda:0 current (`pipe.to("cuda:1")`, diffusers'
`device_map="balanced"`) failed with "Pointer argument cannot be accessed from Triton" before. Each check runs the
same call on cuda:0 and on cuda:1 with cuda:0 current; the two must agree.
"""

from __future__ import annotations

import pytest
import torch

from helpers import random_plan, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


def _backends():
    names = ["triton_generic"]
    if torch.cuda.get_device_capability(1)[0] == 9:
        names[:0] = ["gluon_hopper", "hopper"]
    return names


@pytest.mark.parametrize("correction", [False, True])
def test_attention_forward_and_backward_on_the_second_gpu(correction):
    from videosparse.kernels import block_sparse_attention
    from videosparse.sol.centroids import tile_centroids_torch

    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, 2, 1000, 128, generator=g).to(torch.bfloat16) for _ in range(3)]
    plan = random_plan(1, 2, 1000, 128, 128, 0.4, seed=1)
    for backend in _backends():
        results = {}
        for device in ("cuda:0", "cuda:1"):
            q, k, v = (t.to(device).requires_grad_() for t in base)
            p = plan.to(device)
            if correction:
                p = p.with_correction(*tile_centroids_torch(k.detach(), v.detach(), 128))
            out, lse = block_sparse_attention(q, k, v, p, backend=backend, return_lse=True)
            out.float().square().sum().backward()
            results[device] = [t.float().cpu() for t in (out, lse, q.grad, k.grad, v.grad)]
            assert torch.cuda.current_device() == 0
        for got, want in zip(results["cuda:1"], results["cuda:0"]):
            assert rel_err(got, want) < 1e-6, backend


def test_plan_builders_on_the_second_gpu():
    from videosparse.kernels.triton_topk import topk_rows_triton
    from videosparse.sol.triton_centroids import tile_stats_triton
    from videosparse.veda.triton_kernels import teacher_heat_triton, trippool_triton

    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 700, 128, generator=g).to(torch.bfloat16) for _ in range(3))
    scores = torch.randn(1, 2, 6, 6, generator=g)
    budget = torch.full((6,), 3, dtype=torch.int32)
    calls = {
        "trippool": lambda q, k, v, s, b: trippool_triton(q, k, 128),
        "teacher": lambda q, k, v, s, b: teacher_heat_triton(q, k, 128),
        "tile_stats": lambda q, k, v, s, b: tile_stats_triton(q, k, v, 128),
        "topk": lambda q, k, v, s, b: topk_rows_triton(s, b, 6),
    }
    for name, call in calls.items():
        want = call(*_on("cuda:0", q, k, v, scores, budget))
        got = call(*_on("cuda:1", q, k, v, scores, budget))
        assert torch.cuda.current_device() == 0
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            if isinstance(a, torch.Tensor):
                assert a.device == torch.device("cuda:1"), name
                assert torch.equal(a.cpu(), b.cpu()), name


@pytest.mark.parametrize("method", ["veda", "sol"])
def test_a_transformer_on_the_second_gpu_runs_sparse_as_on_the_first(method):
    """The whole eager sparse path (fused RoPE gather, plan builders, work order, kernel, counters) of a Wan
    transformer moved to cuda:1, cuda:0 current, gives the output it gives on cuda:0."""
    from diffusers import WanTransformer3DModel

    import videosparse
    from videosparse.processors import sessions

    torch.cuda.set_device(0)
    outputs = {}
    for device in ("cuda:0", "cuda:1"):
        torch.manual_seed(0)
        tr = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=32, ffn_dim=256, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
        ).eval().to(device, torch.bfloat16)
        g = torch.Generator().manual_seed(1)
        inputs = dict(hidden_states=torch.randn(1, 4, 5, 30, 34, generator=g).to(device, torch.bfloat16),
                      timestep=torch.tensor([500], device=device),
                      encoder_hidden_states=torch.randn(1, 8, 16, generator=g).to(device, torch.bfloat16))
        config = (videosparse.VedaConfig(density=0.3, dense_steps=0) if method == "veda" else
                  videosparse.SolConfig(density=0.3, dense_steps=0))
        videosparse.apply(tr, config)
        with torch.no_grad():
            outputs[device] = tr(**inputs, return_dict=False)[0].float().cpu()
        stats = sessions(tr)["transformer"].stats()
        assert stats["sparse_calls"] == 2 and stats["dense_calls"] == 0, stats
        assert torch.cuda.current_device() == 0
        videosparse.remove(tr)
    assert rel_err(outputs["cuda:1"], outputs["cuda:0"]) < 1e-6
