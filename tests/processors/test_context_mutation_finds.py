"""Tests from a mutation pass over the context hook (`processors/context.py`): which steps run dense, which warnings
it gives and how often, the step read from a cache context or the scheduler: each guards a behaviour that a one-line
change left every other test passing."""

import logging

import pytest
import torch

import videosparse
from videosparse.models.tiny_wan import build_tiny_wan_pipeline
from videosparse.processors.context import CONTEXT_HOOK


@pytest.fixture(scope="module")
def shared_pipe():
    pipe = build_tiny_wan_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def wan_pipe(shared_pipe):
    """The module's tiny Wan pipeline, left stock after each test (also one that failed midway)."""
    yield shared_pipe
    for target in (shared_pipe, shared_pipe.transformer):
        videosparse.remove(target)
    shared_pipe.transformer.disable_gradient_checkpointing()


def _config(dense_steps, **kw):
    return videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=dense_steps, **kw)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 4, 3, 16, 24, generator=g), torch.randn(1, 8, 32, generator=g)


def _forward(transformer, t, branch=None, **context):
    x, text = _inputs()
    with torch.no_grad():
        if branch is None:
            return transformer(hidden_states=x, timestep=torch.tensor([t]), encoder_hidden_states=text)
        with transformer.cache_context(branch, **context):
            return transformer(hidden_states=x, timestep=torch.tensor([t]), encoder_hidden_states=text)


def _dense_sparse(session):
    layer = session.stats()["layers"][0]
    return layer["dense_calls"], layer["sparse_calls"]


def _warnings(caplog, text):
    return sum(text in r.getMessage() for r in caplog.records)


def test_dense_steps_equal_to_the_step_count_warn_that_every_step_runs_dense(wan_pipe, caplog):
    """Mutation find: dense_steps equal to the call's step count (3 of 3, not only more than it) runs every step
    dense and is warned about once; one fewer (2 of 3) is not warned about."""
    for dense_steps, warned in ((3, 1), (2, 0)):
        session = videosparse.apply(wan_pipe, _config(dense_steps))["transformer"]
        wan_pipe.scheduler.set_timesteps(3)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="videosparse"):
            for t in wan_pipe.scheduler.timesteps:
                _forward(wan_pipe.transformer, float(t))
        assert _dense_sparse(session) == (dense_steps, 3 - dense_steps)
        assert _warnings(caplog, "covers all 3 denoising steps") == warned
        videosparse.remove(wan_pipe)


def test_a_zero_fraction_of_dense_steps_is_no_unknown_step_count(wan_pipe, caplog):
    """Mutation find: dense_steps=0.0 (no dense step, as a fraction) needs no step count: a bare transformer's
    forwards outside any cache context give no 'unknown' warning (0.5 there warns once)."""
    for dense_steps, warned in ((0.0, 0), (0.5, 1)):
        session = videosparse.apply(wan_pipe.transformer, _config(dense_steps))["transformer"]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="videosparse"):
            for t in (1000, 500):
                _forward(wan_pipe.transformer, t)
        assert _warnings(caplog, f"dense_steps={dense_steps}, but") == warned
        assert _dense_sparse(session) == (0, 2)
        videosparse.remove(wan_pipe.transformer)


@pytest.mark.parametrize("in_cache_context", [True, False])
def test_a_fraction_of_dense_steps_takes_the_step_count_from_the_schedulers_schedule(wan_pipe, in_cache_context):
    """Mutation find: where neither the forward nor a cache context gives the step count, the applied pipeline's
    scheduler's schedule does (4 entries): dense_steps=0.5 then runs the first 2 of 4 steps dense, whether the step
    index comes from a cache context (`step_index=` without `num_inference_steps=`) or the scheduler."""
    session = videosparse.apply(wan_pipe, _config(0.5))["transformer"]
    wan_pipe.scheduler.set_timesteps(4)
    for i, t in enumerate(wan_pipe.scheduler.timesteps):
        if in_cache_context:
            _forward(wan_pipe.transformer, float(t), "cond", step_index=i)
        else:
            _forward(wan_pipe.transformer, float(t))
    assert _dense_sparse(session) == (2, 2)
    videosparse.remove(wan_pipe)


def test_an_observer_sees_steps_counted_by_timestep_starting_again_at_a_new_call(wan_pipe):
    """Mutation find: with an observer and no dense steps, a bare transformer's forwards in a cache context without a
    step index are placed by their timestep (not by counting the branch's forwards): a forward back at t=1000 after
    1000, 750, 500 starts a new call at step 0."""
    videosparse.apply(wan_pipe.transformer, _config(0))
    seen = []
    with videosparse.processors.observe(wan_pipe.transformer,
                                        lambda r: seen.append(r.step) if r.layer == 0 else None):
        for t in (1000, 750, 500, 1000, 750):
            _forward(wan_pipe.transformer, t, "cond")
    assert seen == [0, 1, 2, 0, 1]
    videosparse.remove(wan_pipe.transformer)


def test_forwards_without_a_timestep_count_the_branchs_calls_from_zero_in_each_pipeline_call(wan_pipe):
    """Mutation find: where the step timestep cannot be read (None), a cache context's forwards are counted per
    branch from 0, and the count starts again when a pipeline call ends (`reset_stateful_hooks`): with dense_steps=1
    the first forward of each call runs dense, the others sparse."""
    tr = wan_pipe.transformer
    session = videosparse.apply(tr, _config(1))["transformer"]
    tr._diffusers_hook.get_hook(CONTEXT_HOOK).step_timestep = lambda module, args, kwargs: None
    for _ in range(2):
        for t in (1000, 500):
            _forward(tr, t, "cond")
        tr._diffusers_hook.reset_stateful_hooks()
    assert _dense_sparse(session) == (2, 2)
    videosparse.remove(tr)


def test_processors_replaced_after_apply_are_warned_about_once(wan_pipe, caplog):
    """Mutation find: a served layer given another processor after apply is named in one warning, on the first
    forward that sees it (not on forwards before, and not again on later ones)."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    tr = wan_pipe.transformer
    session = videosparse.apply(tr, _config(0))["transformer"]
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        _forward(tr, 1000)
        assert _warnings(caplog, "hold other processors") == 0
        session.served[0]().set_processor(WanAttnProcessor())
        for t in (750, 500):
            _forward(tr, t)
    assert _warnings(caplog, "1 of the 2 self-attention layers it serves hold other processors") == 1
    videosparse.remove(tr)


def _hook_on(scheduler):
    from types import SimpleNamespace

    from videosparse.processors.context import SparseContextHook

    return SparseContextHook(SimpleNamespace(scheduler=scheduler, made_by_apply=False), grid_fn=None)


def _step_of(hook, t):
    from diffusers.hooks.hooks import CacheContext

    with torch.no_grad():                              # as pipelines sample
        return hook._step(CacheContext("cond"), (), {"timestep": t})[0]


def test_a_bf16_timestep_is_placed_on_the_schedule_as_rounded_to_bf16():
    """Mutation find: with no step counter yet, a bf16 timestep is matched against the schedule rounded to bf16 too
    (the first entry of those that round alike), not against the float32 schedule (which places it on a later
    entry nearer the rounded value)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=17.0)
    scheduler.set_timesteps(50)
    hook = _hook_on(scheduler)
    steps = [_step_of(hook, t.expand(1).to(torch.bfloat16)) for t in scheduler.timesteps[:10]]
    assert steps == [0, 0, 2, 2, 2, 5, 5, 5, 8, 8]


def test_a_scheduler_counter_at_zero_places_an_off_schedule_timestep_at_step_zero():
    """Mutation find: a scheduler whose step counter already reads 0 gives step 0, also for a timestep that is on no
    schedule entry (a Cosmos-like sigma), not the entry nearest that value."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(10)
    scheduler._step_index = 0
    hook = _hook_on(scheduler)
    assert _step_of(hook, torch.tensor([0.3])) == 0
    scheduler._step_index = 1
    assert _step_of(hook, torch.tensor([0.3])) == 1


def test_remove_gives_checkpointing_back_its_own_function_after_several_training_forwards(wan_pipe):
    """Mutation find: each training forward wraps the checkpointing function only once (not a wrapper around the
    wrapper), so remove leaves the transformer the function gradient checkpointing set."""
    tr = wan_pipe.transformer
    tr.enable_gradient_checkpointing()
    original = tr._gradient_checkpointing_func
    videosparse.apply(tr, _config(0, backend="reference"))
    x, text = _inputs()
    for t in (900, 300):
        tr(hidden_states=x, timestep=torch.tensor([t]), encoder_hidden_states=text)
    videosparse.remove(tr)
    assert tr._gradient_checkpointing_func is original
    tr.disable_gradient_checkpointing()


def test_a_stepped_scheduler_places_an_off_schedule_timestep_by_matching_not_at_its_begin():
    """Mutation find: the begin-index fallback for a timestep on no schedule entry holds only before the scheduler's
    first step (no counter): with its counter past the schedule's end the nearest entry places it."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(10)
    hook = _hook_on(scheduler)
    assert _step_of(hook, torch.tensor([0.3])) == 0
    scheduler._step_index = 10
    assert _step_of(hook, torch.tensor([0.3])) == 9


def test_a_counter_that_moved_since_a_call_ended_is_the_applied_pipelines_again(wan_pipe):
    """Mutation find: a scheduler counter noted as stale when a pipeline call ended (mid-schedule) stops being taken
    for another driver once it moves on: a loop stepping the applied pipeline's scheduler is placed by its counter."""
    session = videosparse.apply(wan_pipe, _config(0))["transformer"]
    scheduler, tr = wan_pipe.scheduler, wan_pipe.transformer
    scheduler.set_timesteps(4)
    x = torch.zeros(1, 4)
    seen = []
    with videosparse.processors.observe(tr, lambda r: seen.append(r.step) if r.layer == 0 else None):
        for i, t in enumerate(scheduler.timesteps):
            _forward(tr, float(t))
            x = scheduler.step(torch.zeros_like(x), t, x).prev_sample
            if i == 1:
                tr._diffusers_hook.reset_stateful_hooks()      # a pipeline call ending (another pipeline's)
    assert seen[:2] == [0, 1] and seen[3] == 3
    assert session.active
    videosparse.remove(wan_pipe)
