"""videosparse.eval.timing.profile_sdpa / sdpa_seconds: the self-attention SDPA calls of a forward, from a profile."""

import time

import pytest
import torch

from videosparse.eval.timing import SdpaProfile, is_sdpa_op, kernel_us, profile_sdpa, sdpa_seconds


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


def test_profile_sdpa_counts_the_calls_and_times_the_forward():
    q = torch.randn(1, 2, 256, 32)
    prof = profile_sdpa(lambda: [torch.nn.functional.scaled_dot_product_attention(q, q, q) for _ in range(3)], 256)
    assert prof.calls == 3 and 0 < prof.seconds <= prof.wall_s
    assert prof.problem(3) is None and sdpa_seconds(lambda: None, 256) is None


def test_a_profile_that_cannot_be_the_forwards_attention_is_set_aside():
    """Another number of calls than the forward makes, or more attention time than the profiled or the timed
    forward took (Wan 14B compiled on the H200 read 12.7 s of SDPA against an 11.5 s forward): a problem."""
    assert SdpaProfile(0.5, 40, 1.0).problem(40) is None
    assert "60 SDPA calls with these keys where the forward makes 40" in SdpaProfile(0.5, 60, 1.0).problem(40)
    assert "exceed the profiled forward's" in SdpaProfile(1.2, 40, 1.0).problem(40)
    assert "exceed the timed forward's 0.900 s" in SdpaProfile(0.95, 40, 1.1).problem(40, forward_s=0.9)
    assert SdpaProfile(None, 0, 1.0).problem() == "the profile holds no SDPA call with these keys"
    assert SdpaProfile(None, 4, 1.0).problem() == "the profile holds no kernel time for its 4 SDPA calls"


def test_only_aten_attention_ops_count_not_inductor_kernels_named_after_them():
    assert is_sdpa_op("aten::scaled_dot_product_attention") and is_sdpa_op("aten::_scaled_dot_product_cudnn_attention")
    assert is_sdpa_op("aten::_scaled_dot_product_flash_attention_for_cpu")
    assert not is_sdpa_op("triton_poi_fused__scaled_dot_product_cudnn_attention_add_copy_0")
    assert not is_sdpa_op("triton_red_fused__fused_rms_norm__scaled_dot_product_cudnn_attention_1")
    assert not is_sdpa_op("aten::addmm")


def test_kernel_time_counts_each_kernel_once_though_profiler_overhead_records_repeat_them():
    """The profiler can nest its own overhead records in an op and credit them with the op's kernels again
    (device_time_total then counts them twice; on the H200, 'Command Buffer Full' records in a compiled Wan 14B
    forward's attention calls: 12.34 s against 8.37 s of kernels); only the ATen ops' own kernels are summed."""
    from types import SimpleNamespace as Event

    from torch.autograd.profiler_util import Kernel

    attention = Kernel("cudnn_sdpa_fprop", 0, 300.0)
    overhead = Event(name="Command Buffer Full", kernels=[attention], cpu_children=[])
    backend = Event(name="aten::_cudnn_attention_forward", kernels=[attention], cpu_children=[overhead])
    fill = Event(name="aten::fill_", kernels=[Kernel("fill", 0, 2.0)], cpu_children=[])
    launch = Event(name="cudaLaunchKernel", kernels=[], cpu_children=[])
    top = Event(name="aten::_scaled_dot_product_cudnn_attention", kernels=[], cpu_children=[backend, fill, launch])
    assert kernel_us(top) == 302.0


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
    """On CUDA the self-attention calls' kernel time: near CUDA events' time of those calls alone, and far from
    that of the whole forward, whose cross-attention (half the self-attention's keys) must not count.

    The forward is ~10 ms and the profile is read the second time, so the clock's ramp after the profiler's
    start-up gap does not decide the comparison (one 2 ms forward read 5% over its events time on the H200)."""
    F = torch.nn.functional.scaled_dot_product_attention
    q, k = (torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    text = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)

    def self_attention():
        return [F(q, k, k) for _ in range(16)]

    def forward():
        return [F(q, k, k) + F(q, text, text) for _ in range(16)]

    def events_seconds(fn):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3

    sdpa_seconds(forward, 8192, "cuda")
    seconds = sdpa_seconds(forward, 8192, "cuda")
    alone, whole = events_seconds(self_attention), events_seconds(forward)
    assert whole > 1.3 * alone                                  # the cross-attention is a third of the forward
    assert seconds is not None and 0.8 * alone < seconds < 1.15 * alone, (seconds, alone, whole)


def test_nested_attention_timers_each_count_their_own_calls_and_leave_the_processors_as_found():
    """An inner timer's exit restores the outer timer's wrappers (it used to remove them: the outer timer then missed
    every later call), and the outermost exit leaves no instance attribute behind."""
    from videosparse import VedaConfig
    from videosparse.eval.synthetic import method_applied
    from videosparse.eval.synthetic_models import build_transformer, make_inputs, synthetic_setup
    from videosparse.eval.timing import AttentionTimer

    setup = synthetic_setup("wan-1.3b", frames=5, height=64, width=128, layers=2)
    model = build_transformer(setup, torch.device("cpu"), torch.float32)
    inputs = make_inputs(setup, torch.device("cpu"), torch.float32)
    config = VedaConfig(density=0.5, block=64, tiling=(1, 8, 8), dense_steps=0)
    with method_applied(model, config), torch.no_grad():
        procs = AttentionTimer._processors(model)
        before = [dict(p.__dict__) for p in procs]
        outer, inner = AttentionTimer([model]), AttentionTimer([model])
        with outer():
            model(**inputs)
            with inner():
                model(**inputs)
            model(**inputs)
        assert (len(outer.attention_s), len(inner.attention_s)) == (6, 2)
        assert (len(outer.plan_s), len(inner.plan_s)) == (6, 2)
        assert [dict(p.__dict__) for p in procs] == before


def test_attention_clock_records_on_the_tensors_gpu(monkeypatch):
    """The CUDA events bracket the stream of the GPU the attention runs on: a bare `record()` took the current
    device's stream (cuda:0), so a pipeline on cuda:1 timed an idle stream. No GPU needed: fake events and streams."""
    from videosparse.eval import timing

    recorded = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", torch.device(device)))
    clock = timing._Clock()
    gpu1 = torch.device("cuda", 1)
    clock.stop(gpu1, clock.start(gpu1))
    assert recorded == [("stream of", gpu1)] * 2


def test_attention_and_plan_timers_bracket_the_calls_they_time(monkeypatch):
    """Mutation testing: a timer whose clock stopped before the call (attention or plan) read ~10 us, which the
    `0 < attention_s < transformer_s` checks still passed; with every attention call made 30 ms slower (15 ms of them
    in its plan), the timers read at least that, and no more than the forward's time."""
    from videosparse import VedaConfig
    from videosparse.eval.synthetic import method_applied
    from videosparse.eval.synthetic_models import build_transformer, make_inputs, synthetic_setup
    from videosparse.eval.timing import AttentionTimer, TransformerTimer

    setup = synthetic_setup("wan-1.3b", frames=5, height=64, width=128, layers=2)
    model = build_transformer(setup, torch.device("cpu"), torch.float32)
    inputs = make_inputs(setup, torch.device("cpu"), torch.float32)
    config = VedaConfig(density=0.5, block=64, tiling=(1, 8, 8), dense_steps=0)

    def slowed(fn, seconds):
        def slow(*args, **kwargs):
            time.sleep(seconds)
            return fn(*args, **kwargs)
        return slow

    with method_applied(model, config), torch.no_grad():
        procs = AttentionTimer._processors(model)
        for proc in procs:
            monkeypatch.setattr(proc, proc.timed_entry, slowed(getattr(proc, proc.timed_entry), 0.015))
        method = procs[0].session.method
        monkeypatch.setattr(method, "plan", slowed(method.plan, 0.015))
        ttimer, atimer = TransformerTimer([model]), AttentionTimer([model])
        with ttimer(), atimer():
            model(**inputs)
    assert len(atimer.attention_s) == len(atimer.plan_s) == 2 and atimer.layers == [0, 1]
    assert all(p >= 0.015 for p in atimer.plan_s) and all(a >= 0.03 for a in atimer.attention_s)
    assert all(p < a for p, a in zip(atimer.plan_s, atimer.attention_s))
    assert 0.06 <= atimer.attention_total < ttimer.total


def test_one_transformer_in_two_slots_is_timed_once_per_call():
    """Code review find: a pipeline whose transformer_2 is its transformer (one expert for both noise levels, which
    `apply` serves once) was listed twice, so the timers hooked it twice: two forward times and two attention times
    per call, and `generate` printed twice the time per step. Also with the compiled wrapper in one slot."""
    import videosparse
    from videosparse.eval.timing import AttentionTimer, TransformerTimer, pipeline_transformers
    from videosparse.models import build_tiny_wan_pipeline

    pipe = build_tiny_wan_pipeline()
    pipe.register_modules(transformer_2=pipe.transformer)
    assert pipeline_transformers(pipe) == [pipe.transformer]
    pipe.register_modules(transformer_2=torch.compile(pipe.transformer, backend="eager"))
    assert pipeline_transformers(pipe) == [pipe.transformer]
    pipe.register_modules(transformer_2=pipe.transformer)
    videosparse.apply(pipe, videosparse.DenseConfig())
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 8, 32))
    forward, attention = TransformerTimer(pipeline_transformers(pipe)), AttentionTimer(pipeline_transformers(pipe))
    with torch.no_grad(), forward(), attention():
        pipe.transformer(**inputs)
    assert len(forward.times) == 1
    assert attention.layers == list(range(pipe.transformer.config.num_layers))
