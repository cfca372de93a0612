"""Step counting by timestep, for pipelines that give the context hook no step index (see `TimestepCounter`)."""

from __future__ import annotations

import threading

import torch


class TimestepCounter:
    """Step index by counting the distinct timesteps of a pipeline call (two forwards of a step, the guidance
    branches, share one). It starts again at 0 at the end of the call (`reset`), and when the timestep moves against
    the direction of the schedule (falling for most, rising for Mochi's), which within one denoising loop it never
    does: a new call after one that ended early by an exception, when it starts on the other side of where that one
    stopped. Before the call's own first move shows its direction, the counter takes the one the model family is
    known to have (`ModelSpec.timestep_direction`: a move against it always starts a new call), else assumes the one
    of the calls that ended normally: so a call after a single stray timestep (a warm-up forward, or a call that
    died after its first step) that starts above it counts from 0 on a falling schedule. Where it only assumed, a
    call whose next move confirms the direction of that first move (a schedule that runs the other way than the
    earlier calls') continues the count: only its second forward was read as a new step 0. Timesteps alone cannot
    tell that from two stray timesteps in a row below the next call's first (two requests that died after their
    first step): without a family direction, that call then counts from 2 until its first fall starts it again.
    `apply` gives the transformers of one pipeline one set of counters, one per thread (`ThreadTimestepCounters`; Wan
    2.2's two experts take turns within a call); transformers set up with neither a pipeline nor a scheduler share
    `BARE_TIMESTEP_COUNTER`."""

    def __init__(self) -> None:
        self.last: float | None = None       # this call's latest timestep
        self.count = 0
        self.direction = 0                   # this call's schedule's direction: -1 falling, +1 rising, 0 not yet seen
        self.learned = 0                     # the direction of the calls that ended normally (kept by `reset`)
        self.doubted = 0                     # a first move taken as a new call against the assumed direction ...
        self.count_before = 0                # ... and the count it restarted from (given back if the call confirms it)

    def step(self, t, expected: int = 0) -> int:
        """The step index of a forward at timestep `t`; `expected`: the schedule direction the caller knows its model
        family to have (-1 / +1), 0 when it does not know it. A per-item, per-frame or per-token timestep counts by its
        mean, which moves at every step (the noisiest entry does not: SkyReels V2's diffusion forcing holds its
        newest frames at the schedule's first entry while older ones step on; clean frames' zeros, Wan 2.2 TI2V's,
        stay where they are)."""
        value = float(torch.as_tensor(t).detach().flatten().double().mean())
        if self.last is not None and value != self.last:
            move = 1 if value > self.last else -1
            if self.direction:
                if move != self.direction:                      # against the call's own direction: a new call
                    self.count, self.direction = 0, 0
            elif expected:                                      # the family's schedules never move the other way
                if move != expected:
                    self.count, self.doubted = 0, 0
                else:
                    self.direction = move
            elif self.doubted and move == self.doubted:
                # the move taken as a new call was the schedule's own direction: the count goes on from before it
                self.count, self.direction, self.doubted = self.count_before + self.count, move, 0
            elif self.learned and move != self.learned and not self.doubted:
                self.count_before, self.count, self.doubted = self.count, 0, move
            else:
                self.direction, self.doubted = move, 0
        if value != self.last:
            self.last = value
            self.count += 1
        return self.count - 1

    def reset(self) -> None:
        """The end of a pipeline call: the next forward is step 0; the call's direction is kept as learned."""
        self.learned = self.direction or self.learned
        self.last, self.count, self.direction, self.doubted, self.count_before = None, 0, 0, 0, 0

    def forget(self) -> None:
        """A new setup: nothing carried over, the learned direction included."""
        self.reset()
        self.learned = 0


class ThreadTimestepCounters:
    """One `TimestepCounter` per thread, behind the counter's interface (`step`, `reset`, `forget`): a pipeline call
    runs in one thread, so pipelines that share a transformer (`from_pipe`, each with a scheduler of its own, as
    diffusers' server example makes one per request) count the steps of their calls apart when they run at once,
    and the end of one call (`reset`) restarts only its own count. The direction learned from the calls that ended
    normally is shared: a thread's first call starts from it."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.learned = 0

    @property
    def current(self) -> TimestepCounter:
        """The calling thread's counter."""
        counter = getattr(self._local, "counter", None)
        if counter is None:
            counter = self._local.counter = TimestepCounter()
            counter.learned = self.learned
        return counter

    def step(self, t, expected: int = 0) -> int:
        return self.current.step(t, expected)

    def reset(self) -> None:
        counter = self.current
        counter.reset()
        self.learned = counter.learned

    def forget(self) -> None:
        """A new setup: every thread's count and the learned direction dropped."""
        self._local = threading.local()
        self.learned = 0

    def __deepcopy__(self, memo):
        new = memo[id(self)] = ThreadTimestepCounters()    # (a thread-local cannot be copied) the counts start over
        new.learned = self.learned
        return new


BARE_TIMESTEP_COUNTER = ThreadTimestepCounters()   # of every session without a pipeline or scheduler (SparseSession)
