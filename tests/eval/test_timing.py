"""videosparse.eval.timing.sdpa_seconds: the self-attention SDPA calls of a forward, from a profile."""

import time

import pytest
import torch

from videosparse.eval.timing import sdpa_seconds


def test_sdpa_seconds_counts_the_calls_with_that_many_keys_once():
    """Only the calls whose keys number key_tokens count (not the cross-attention to 20 text keys), each once
    although the profile nests the op that dispatches SDPA and the one that runs it; None without such a call."""
    F = torch.nn.functional.scaled_dot_product_attention
    q, k = torch.randn(1, 4, 1024, 64), torch.randn(1, 4, 1024, 64)
    text = torch.randn(1, 4, 20, 64)
    wall = []

    def forward():
        t0 = time.perf_counter()
        out = [F(q, k, k) + F(q, text, text) for _ in range(3)]
        wall.append(time.perf_counter() - t0)
        return out

    forward()
    self_attention = sdpa_seconds(forward, 1024)
    cross_attention = sdpa_seconds(forward, 20, "cpu")
    assert 0 < cross_attention < self_attention <= wall[1]   # counted twice it would read ~2x the wall time
    assert sdpa_seconds(forward, 7) is None


def test_sdpa_seconds_sees_the_calls_inside_a_compiled_graph():
    F = torch.nn.functional.scaled_dot_product_attention
    q = torch.randn(1, 2, 256, 32)
    compiled = torch.compile(lambda: F(q, q, q) * 2, backend="aot_eager")
    compiled()
    assert sdpa_seconds(compiled, 256) > 0


def test_sdpa_seconds_on_cuda_without_kernel_times_is_none(monkeypatch):
    """On a CUDA device only the kernels' time counts: a profile without it (no CUPTI access; here no GPU at all)
    gives None, so the caller falls back, never the op's CPU launch time read as attention time."""
    import warnings

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    q = torch.randn(1, 2, 256, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert sdpa_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), 256, "cuda") is None


@pytest.mark.gpu
def test_gpu_sdpa_seconds_is_the_kernels_time():
    """On CUDA the self-attention calls' kernel time, within the forward's wall time and near CUDA events' time."""
    F = torch.nn.functional.scaled_dot_product_attention
    q, k = (torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    text = torch.randn(1, 8, 512, 128, device="cuda", dtype=torch.bfloat16)

    def forward():
        return [F(q, k, k) + F(q, text, text) for _ in range(4)]

    forward()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    forward()
    end.record()
    end.synchronize()
    seconds = sdpa_seconds(forward, 8192, "cuda")
    assert seconds is not None and 0.5 * start.elapsed_time(end) * 1e-3 < seconds < start.elapsed_time(end) * 1e-3
