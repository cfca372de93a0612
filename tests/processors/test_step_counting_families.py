"""Dense steps where the step is counted, not given, on every family's tiny pipeline (the cases of
`test_timestep_directions`): a transformer set up on its own (`apply(pipe.transformer, ...)`, which sees no
scheduler), and a `from_pipe` pipeline with a scheduler of its own after the applied pipeline ran a call of another
length, run the same dense steps as `apply(pipe, ...)` does.

Session 66 finds (exploratory testing): on a transformer set up on its own, families whose pipelines open no cache
context (Kandinsky 5, MiniMax-H3, ConsisID, EasyAnimate, FramePack, ChronoEdit, AnyFlow, Cosmos, Allegro) ran every step
sparse with a warning, and SkyReels V2's diffusion forcing (`ar_step=1`) ran 3 of its 5 loop iterations dense for
`dense_steps=1` (counted by the noisiest frame, which stays at the first schedule entry while frames start); a
`from_pipe` pipeline ran every step dense on Wan-Animate (whose pipeline sets its scheduler again after the loop) and
4 of 5 on ConsisID (whose transformer has no `_reset_stateful_cache`, so the end of a call went unseen).
"""

import copy

import pytest
import torch

import videosparse
from test_timestep_directions import CASES, _builtin_specs

CONFIG = videosparse.VedaConfig(density=0.3, dense_steps=1)


def _dense_flags(pipe, target, kw, **call) -> list[bool]:
    """Whether each self-attention call of layer 0 in one call of `pipe` ran as a dense step (`target`: what is
    applied; not a call dense for another reason, such as an attention mask or a video smaller than a tile)."""
    seen = []
    with videosparse.observe(target, lambda r: r.layer == 0 and seen.append(r.dense_reason == "dense step")):
        pipe(**{**kw, **call}, generator=torch.Generator().manual_seed(0))
    return seen


# the pipelines that open no cache context (Cosmos, AnyFlow and FramePack too, left out for time: ~25 s on 2 cores),
# SkyReels V2's diffusion forcing, and Wan, whose pipeline gives the step (the control)
BARE_CASES = ("Kandinsky5T2VPipeline", "MiniMaxH3FL2VACoreDenoiseStep", "ConsisIDPipeline", "EasyAnimatePipeline",
              "ChronoEditPipeline", "AllegroPipeline", "SkyReelsV2DiffusionForcingPipeline", "WanPipeline")


def _case(name):
    return next(cases[name] for cases in CASES.values() if name in cases)


def test_the_cases_count_by_timestep():
    specs = _builtin_specs()
    assert all(specs[cls].timestep_direction != 0 for cls, cases in CASES.items() for name in cases
               if name in BARE_CASES)


@pytest.mark.parametrize("name", BARE_CASES)
def test_a_transformer_set_up_on_its_own_runs_the_dense_steps_of_its_pipeline(name, monkeypatch, caplog):
    pipe, kw = _case(name)(monkeypatch)
    pipe.set_progress_bar_config(disable=True)
    videosparse.apply(pipe, CONFIG)
    try:
        on_pipe = _dense_flags(pipe, pipe, kw)
    finally:
        videosparse.remove(pipe)
    videosparse.apply(pipe.transformer, CONFIG)
    try:
        with caplog.at_level("WARNING", logger="videosparse"):
            bare = _dense_flags(pipe, pipe.transformer, kw)
    finally:
        videosparse.remove(pipe.transformer)
    assert on_pipe[0] and not on_pipe[-1], on_pipe            # the first step dense, the last sparse
    assert bare == on_pipe
    assert not [r.getMessage() for r in caplog.records if "step is unknown" in r.getMessage()]


@pytest.mark.parametrize("name", ["WanAnimatePipeline", "ConsisIDPipeline", "SkyReelsV2DiffusionForcingPipeline"])
def test_a_from_pipe_pipeline_after_a_call_of_another_length_runs_its_own_dense_steps(name, monkeypatch):
    """The applied pipeline runs 2 steps, then one made from it with `from_pipe` and a scheduler of its own runs 3:
    the same dense steps as the applied pipeline's own 3-step call (int dense_steps=2; diffusion forcing: 1, of 5
    loop iterations)."""
    pipe, kw = _case(name)(monkeypatch)
    pipe.set_progress_bar_config(disable=True)
    config = CONFIG if name.startswith("SkyReels") else videosparse.VedaConfig(density=0.3, dense_steps=2)
    videosparse.apply(pipe, config)
    try:
        other = type(pipe).from_pipe(pipe, scheduler=copy.deepcopy(pipe.scheduler))
        other.set_progress_bar_config(disable=True)
        expected = _dense_flags(pipe, pipe, kw, num_inference_steps=3)
        _dense_flags(pipe, pipe, kw, num_inference_steps=2)
        assert _dense_flags(other, pipe, kw, num_inference_steps=3) == expected
    finally:
        videosparse.remove(pipe)
    assert any(expected) and not all(expected), expected


def test_the_call_end_signal_is_set_only_where_diffusers_gives_none_and_remove_takes_it_away(monkeypatch):
    from test_timestep_directions import _consisid, _wan

    for build, had in ((_consisid, False), (_wan, True)):
        pipe, _ = build(monkeypatch)
        transformer = pipe.transformer
        assert hasattr(transformer, "_reset_stateful_cache") == had
        before = dict(transformer.__dict__)
        videosparse.apply(pipe, CONFIG)
        assert hasattr(transformer, "_reset_stateful_cache")
        assert ("_reset_stateful_cache" in transformer.__dict__) != had
        videosparse.remove(pipe)
        assert transformer.__dict__.keys() == before.keys()
        assert hasattr(transformer, "_reset_stateful_cache") == had


@pytest.mark.parametrize("dense_steps, steps", [(0, [None] * 4), (1, [0, 0, 1, 1])])
def test_a_loop_of_the_users_own_counts_by_timestep_only_for_a_count_of_dense_steps(dense_steps, steps):
    """Forwards of a transformer set up on its own, without a cache context (a sampling loop of the user's own, two
    guidance forwards a step): for a count of dense steps the step comes from the timestep (the first step's two
    forwards dense); without dense steps no timestep is read (a host sync per forward on a GPU) and the records carry
    no step, so that observers count their forwards, as the distillation capture does (test_mochi.py checks that
    through the capture; this is the contract itself, on the Wan path)."""
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    tr = build_tiny_wan_pipeline(num_layers=1).transformer
    g = torch.Generator().manual_seed(0)
    video, text = torch.randn(1, 4, 3, 16, 32, generator=g), torch.randn(1, 8, 32, generator=g)   # 3 x 8 x 16 tokens
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, block=64, tiling=(1, 4, 16), dense_steps=dense_steps))
    seen = []
    try:
        with videosparse.observe(tr, lambda r: seen.append((r.step, r.dense_reason))), torch.no_grad():
            for t in (900, 900, 800, 800):
                tr(hidden_states=video, timestep=torch.tensor([t]), encoder_hidden_states=text, return_dict=False)
    finally:
        videosparse.remove(tr)
    assert [step for step, _ in seen] == steps
    assert [reason == "dense step" for _, reason in seen] == [step is not None and step < dense_steps for step in steps]
    assert all(reason in (None, "dense step") for _, reason in seen)
