"""Mutation finds for videosparse/eval/timing.py and videosparse/processors/registry.py: behaviour no other test
pinned (each test names the mutant it kills). No GPU: CUDA events, the profiler and the clock are faked."""

import os
import warnings
from types import SimpleNamespace

import pytest
import torch

import videosparse
from videosparse.eval import timing
from videosparse.processors import registry


# --- eval/timing.py

def test_transformer_timer_times_each_forward_synced_on_both_sides_and_unhooks_on_exit(monkeypatch):
    # Mutation find: the times are durations (not the stop clock), `total` sums them all, the forward is synced
    # before and after, and no hook is left on the module after the context.
    clock = [100.0]
    synced = []
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(timing, "_sync", synced.append)

    class Slow(torch.nn.Module):
        def forward(self, x, seconds):
            clock[0] += seconds
            return x

    model = Slow()
    timer = timing.TransformerTimer([model])
    with timer():
        model(1, 0.5)
        model(1, seconds=0.25)
    model(1, 2.0)
    assert timer.times == [0.5, 0.25] and timer.total == 0.75
    assert synced == [model] * 4
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_cuda_clock_reads_start_to_stop_in_seconds_once_the_stop_event_completed(monkeypatch):
    # Mutation find: each CUDA pair is read begin -> end (not end -> begin), in seconds (elapsed_time gives ms), and
    # only after the end event was synchronised (elapsed_time of an event still pending raises on a GPU).
    now_ms = [0.0]

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t, self.done = None, False

        def record(self, stream=None):
            self.t = now_ms[0]

        def synchronize(self):
            self.done = True

        def elapsed_time(self, end):
            assert end.done, "elapsed_time before the end event completed"
            return end.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    clock, gpu = timing._Clock(), torch.device("cuda", 0)
    for ms in (250.0, 4.0):
        begin = clock.start(gpu)
        now_ms[0] += ms
        clock.stop(gpu, begin)
    assert clock.seconds() == [0.25, 0.004]


def test_attention_timer_without_videosparse_processors_says_to_apply_first():
    # Mutation find: the timer refuses a model videosparse serves no layer of (it timed nothing, silently).
    with pytest.raises(ValueError, match=r"found no videosparse processors: call videosparse\.apply"):
        with timing.AttentionTimer([torch.nn.Linear(2, 2)])():
            pass


def _tiny_wan(num_layers):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                 text_dim=8, freq_dim=8, ffn_dim=8, num_layers=num_layers)


def test_attention_timer_gives_each_call_its_layer_index_forward_after_forward():
    # Mutation find: `layers` holds each call's layer (0..L-1 again in the next forward), not a running count.
    tr = _tiny_wan(3)
    videosparse.apply(tr, videosparse.DenseConfig())
    try:
        timer = timing.AttentionTimer([tr])
        inputs = dict(hidden_states=torch.randn(1, 4, 2, 8, 8), timestep=torch.tensor([500]),
                      encoder_hidden_states=torch.randn(1, 4, 8))
        with torch.no_grad(), timer():
            tr(**inputs)
            tr(**inputs)
    finally:
        videosparse.remove(tr)
    assert timer.layers == [0, 1, 2, 0, 1, 2] and len(timer.attention_s) == 6 and timer.plan_s == []


def test_a_transformer_listed_twice_leaves_no_wrapper_behind():
    # Mutation find: the wrappers are undone last-made first; in made order, a processor wrapped twice (one
    # transformer listed twice, e.g. as its compiled wrapper and itself) kept the first wrapper as an attribute.
    tr = _tiny_wan(2)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, block=64, tiling=(1, 8, 8)))
    try:
        procs = timing.AttentionTimer._processors(tr)
        before = [dict(p.__dict__) for p in procs]
        with timing.AttentionTimer([tr, tr])():
            pass
        assert [dict(p.__dict__) for p in procs] == before
    finally:
        videosparse.remove(tr)


def test_the_sdpa_backends_own_ops_count_as_attention():
    # Mutation find: a backend's ATen op (not only the dispatching scaled_dot_product one) is an SDPA op.
    for name in ("aten::_flash_attention_forward", "aten::_efficient_attention_forward",
                 "aten::_cudnn_attention_forward"):
        assert timing.is_sdpa_op(name), name


def _event(name, keys, parent=None, cpu=0.0, self_cpu=0.0, batch=(1, 2)):
    return SimpleNamespace(name=name, input_shapes=[[*batch, 8, 4], [*batch, keys, 4], [*batch, keys, 4]],
                           cpu_parent=parent, cpu_time_total=cpu, self_cpu_time_total=self_cpu, kernels=[],
                           cpu_children=[])


def test_cpu_sdpa_time_is_the_calls_whole_time_children_included(monkeypatch):
    # Mutation find: on CPU a call's time is its whole CPU time (cpu_time_total: the math backend's matmuls run in
    # its children), not its own (self) time; the nested backend op, calls with other key counts and calls whose key
    # is not (B, H, keys, D) (here 3-D) are left out.
    top = _event("aten::scaled_dot_product_attention", 64, cpu=300.0, self_cpu=10.0)
    events = [top, _event("aten::_scaled_dot_product_flash_attention_for_cpu", 64, parent=top, cpu=290.0,
                          self_cpu=290.0),
              _event("aten::scaled_dot_product_attention", 20, cpu=50.0, self_cpu=50.0),
              _event("aten::scaled_dot_product_attention", 64, cpu=200.0, self_cpu=5.0),
              _event("aten::scaled_dot_product_attention", 64, cpu=900.0, batch=(2,))]

    class FakeProfile:
        def __init__(self, activities, record_shapes):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    prof = timing.profile_sdpa(lambda: None, 64)
    assert prof.calls == 2 and prof.seconds == pytest.approx(500e-6)


def test_the_problem_bounds_and_an_expected_call_count_of_zero():
    # Mutation find: attention time equal to the profiled forward's is fine (only more is a problem), equal to the
    # timed forward's is not (`>=`), and expected_calls=0 is a count to compare, not "no count given".
    assert timing.SdpaProfile(1.0, 40, 1.0).problem(40) is None
    assert "exceed the timed forward's 0.900 s" in timing.SdpaProfile(0.9, 40, 1.0).problem(40, forward_s=0.9)
    assert "3 SDPA calls with these keys where the forward makes 0" in timing.SdpaProfile(0.5, 3, 1.0).problem(0)


def test_every_sync_of_a_loop_is_a_site_of_its_own(monkeypatch):
    # Mutation find: a sync repeated from one line (a `.item()` in a loop) is recorded each time; the warnings'
    # default filter shows a warning once per location.
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)

    def forward():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation")

    assert len(timing.host_sync_sites(forward)) == 3


def test_package_frames_are_those_under_the_package_not_paths_holding_it():
    # Mutation find: a frame counts as the package's when its path starts with the package folder, not when the
    # folder's path appears inside it (a copy of the tree under another folder).
    package = os.path.dirname(os.path.abspath(videosparse.__file__)) + os.sep
    frames = [f"/backup{package}sol/method.py:1:plan", f"{package}sol/threshold.py:192:pack_mask"]
    assert timing.package_frames(frames) == ["sol/threshold.py:192:pack_mask"]


# --- processors/registry.py

def test_a_users_entry_for_a_built_in_class_keeps_its_place_when_the_built_ins_load(monkeypatch):
    # Mutation find: register_model's "it replaces a built-in entry of the same class" holds for an entry made before
    # the built-ins loaded (the load used to be able to overwrite it).
    from diffusers import WanTransformer3DModel

    def mine():
        return "mine"

    monkeypatch.setattr(registry, "_MODEL_SPECS", {WanTransformer3DModel: mine})
    monkeypatch.setattr(registry, "_BUILTINS_LOADED", [False])
    registry._load_builtins()
    assert registry._MODEL_SPECS[WanTransformer3DModel] is mine and len(registry._MODEL_SPECS) > 10


def test_a_registered_subclass_is_served_by_its_own_entry_not_its_parents(monkeypatch):
    # Mutation find: the lookup takes the nearest registered class of the MRO (the subclass's own entry first).
    from diffusers import WanTransformer3DModel

    class MyWan(WanTransformer3DModel):
        pass

    registry._load_builtins()
    monkeypatch.setitem(registry._MODEL_SPECS, MyWan, lambda: "mine")
    tr = MyWan(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=8, freq_dim=8,
               ffn_dim=8, num_layers=1)
    assert registry.model_spec(tr) == "mine"


def test_things_that_hold_a_transformer_or_components_are_named_pipelines():
    # Mutation find: either mark (a `transformer` attribute, or diffusers' `components` dict) makes the error say
    # "pipeline, pass pipe.transformer" rather than "not supported".
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = torch.nn.Linear(2, 2)

    class UNetPipeline:
        components = {"unet": None}

    for thing in (Wrapper(), UNetPipeline()):
        with pytest.raises(ValueError, match=rf"{type(thing).__name__} is a pipeline, not a transformer"):
            registry.model_spec(thing)


def test_patch_size_of_two_tuples_lists_and_cosmos3s_latent_patch_size():
    # Mutation find: a 2-tuple patch is spatial (pt = 1 in front), and a config without `patch_size` takes its
    # spatial `latent_patch_size` (Cosmos 3), not 1.
    assert registry.patch_size_of(SimpleNamespace(patch_size=(2, 4))) == (1, 2, 4)
    assert registry.patch_size_of(SimpleNamespace(patch_size=[1, 2, 2])) == (1, 2, 2)
    assert registry.patch_size_of(SimpleNamespace(latent_patch_size=2)) == (1, 2, 2)


def test_model_info_takes_heads_head_dim_and_the_specs_text_position():
    # Mutation find: the info carries the spec's text_position (the tiny Wan of the other tests has none).
    from videosparse.method import ModelInfo

    tr = SimpleNamespace(config=SimpleNamespace(num_attention_heads=3, attention_head_dim=8, patch_size=(1, 2, 2)))
    spec = registry.ModelSpec(object, lambda name, module: True, None, text_position="after")
    assert registry.model_info(tr, spec, 4) == ModelInfo("SimpleNamespace", 4, 3, 8, (1, 2, 2), "after")


def test_a_config_subclass_is_its_parents_method_and_the_class_itself_is_refused():
    # Mutation find: check_config walks the config's MRO, and a subclass passed as a class gets the "pass an
    # instance" error, not "not a videosparse config".
    from videosparse import SolConfig, VedaConfig

    class MyVeda(VedaConfig):
        pass

    assert registry.check_config(MyVeda()) == "videosparse.veda.method:VedaMethod"
    assert registry.check_config(SolConfig(density=0.5)) == "videosparse.sol.method:SolMethod"
    with pytest.raises(TypeError, match=r"the class MyVeda; pass an instance, e\.g\. MyVeda\(\)"):
        registry.check_config(MyVeda)
