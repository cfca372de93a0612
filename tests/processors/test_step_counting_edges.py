"""Step counting by timestep (`videosparse.processors.steps`): the cases the pipeline tests do not reach, each a
sequence of forwards and the step index each one gets."""

import copy
import threading

import torch

from videosparse.processors.steps import ThreadTimestepCounters, TimestepCounter

FALLING = [1000, 1000, 750, 750, 500, 500]          # guidance pairs share a step


def steps(counter, timesteps, expected=0):
    return [counter.step(torch.tensor(float(t)), expected) for t in timesteps]


def test_a_per_token_timestep_counts_by_its_mean():
    """Conditioning tokens kept at t=0 beside the video's (LTX-style per-token timesteps) do not hide the steps."""
    counter = TimestepCounter()
    per_token = [torch.tensor([[t, 0.0, 0.0]] * 2) for t in (1000.0, 1000.0, 750.0, 500.0)]
    assert [counter.step(t) for t in per_token] == [0, 0, 1, 2]


def test_a_call_that_shows_no_direction_keeps_the_learned_one():
    """A call of one forward (a warm-up) ends with no direction of its own: the one learned before stays, so the next
    call, after a stray timestep below its start, still counts from 0."""
    counter = TimestepCounter()
    steps(counter, FALLING)
    counter.reset()
    assert steps(counter, [500]) == [0]
    counter.reset()
    assert counter.learned == -1
    assert steps(counter, [600] + FALLING) == [0, 0, 0, 1, 1, 2, 2]
    assert steps(TimestepCounter(), [600] + FALLING) == [0, 1, 1, 0, 0, 1, 1]     # (with nothing learned)


def test_a_move_against_the_family_direction_starts_a_call_with_no_doubt_left_over():
    """Learned falling; a rise without a family direction is doubted (a new call, maybe); a rise against the family's
    known falling direction is a new call for sure, and leaves nothing of that doubt: the next rise is read afresh,
    not taken to confirm the old doubt and count on from before it (step 2)."""
    counter = TimestepCounter()
    steps(counter, FALLING)
    counter.reset()
    assert steps(counter, [700, 900]) == [0, 0]
    assert steps(counter, [1000], -1) == [0]
    assert steps(counter, [1100]) == [0]


def test_a_threads_first_call_starts_from_the_direction_other_threads_learned():
    """`ThreadTimestepCounters`: the direction learned at the end of a call in one thread is shared, so a thread's
    first call (a `from_pipe` pipeline's request) after a stray timestep counts from 0 as the first thread would."""
    counters = ThreadTimestepCounters()
    assert steps(counters, FALLING) == [0, 0, 1, 1, 2, 2]
    counters.reset()
    assert counters.learned == -1
    seen = []
    thread = threading.Thread(target=lambda: seen.append(steps(counters, [600] + FALLING)))
    thread.start()
    thread.join()
    assert seen == [[0, 0, 0, 1, 1, 2, 2]]
    fresh = []
    other = ThreadTimestepCounters()                 # nothing learned: the stray timestep reads as a rising schedule
    thread = threading.Thread(target=lambda: fresh.append(steps(other, [600] + FALLING)))
    thread.start()
    thread.join()
    assert fresh == [[0, 1, 1, 0, 0, 1, 1]]


def test_forget_drops_the_learned_direction_of_every_thread():
    """Mutation find: `ThreadTimestepCounters.forget` (a new setup sharing the bare counters) drops the direction the
    earlier calls taught: a call after a stray timestep below its start is read afresh (as with nothing learned)."""
    counters = ThreadTimestepCounters()
    steps(counters, FALLING)
    counters.reset()
    assert counters.learned == -1
    counters.forget()
    assert counters.learned == 0
    assert steps(counters, [600] + FALLING) == [0, 1, 1, 0, 0, 1, 1]


def test_a_deep_copy_keeps_the_learned_direction():
    """Mutation find: `copy.deepcopy` of the per-thread counters (a session's deep copy) starts the counts over but
    keeps the learned direction, so the copy still counts a call after a stray timestep from 0."""
    counters = ThreadTimestepCounters()
    steps(counters, FALLING)
    counters.reset()
    clone = copy.deepcopy(counters)
    assert clone.learned == -1
    assert steps(clone, [600] + FALLING) == [0, 0, 0, 1, 1, 2, 2]
