"""Gradient checkpointing with videosparse: a block recomputed in backward attends as its forward did.

diffusers' `enable_gradient_checkpointing` runs each block through the transformer's `_gradient_checkpointing_func`;
the context hook wraps that function (`CheckpointingWithContext`) so that the recompute sees the session's state
(grid, text lengths, layouts, processors) of the block's own forward, not of a forward run in between.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

from .session import SparseSession


class _RecomputeWithContext:
    """Stands in for the block that diffusers' gradient checkpointing function runs (`func(block, *args)`): the first
    run is the forward; every later one is the recompute in backward, which then sees the session as that forward
    saw it (another forward in between, such as a no-grad teacher pass or a second micro-batch, would otherwise
    give it its grid, text lengths and layouts: wrong gradients). Other attributes are the block's; its `forward`
    runs the same way (a function that checkpoints `module.forward`)."""

    def __init__(self, block, session: SparseSession) -> None:
        self._block, self._session = block, session
        self._snapshot = session.snapshot()
        self._ran = False
        # the block's attention processors as its forward runs them (a `remove` / `apply` before the backward, as
        # between a student's forward and a teacher pass, sets others, through which the recompute would differ)
        # (a block may be a bound method: Cosmos 3 checkpoints `decoder_layer.__call__`)
        module = block if isinstance(block, torch.nn.Module) else getattr(block, "__self__", None)
        self._processors = [(m, m.processor) for m in module.modules() if getattr(m, "processor", None) is not None] \
            if isinstance(module, torch.nn.Module) else []

    def _run(self, fn, *args, **kwargs):
        if not self._ran:
            self._ran = True
            return fn(*args, **kwargs)
        with self._session.forward_lock, self._session.recomputing(self._snapshot), _processors_as(self._processors):
            return fn(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._run(self._block, *args, **kwargs)

    @property
    def forward(self):
        return functools.partial(self._run, self._block.forward)

    def __getattr__(self, name: str):
        return getattr(self._block, name)


@contextlib.contextmanager
def _processors_as(processors: list[tuple[torch.nn.Module, Any]]) -> Iterator[None]:
    """Within: each attention module holds the processor paired with it (those set since are put back on exit)."""
    changed = [(module, was, module.processor) for module, was in processors if module.processor is not was]
    try:
        for module, was, _ in changed:       # (inside: one that fails half-way is undone too)
            _set_processor(module, was)
        yield
    finally:
        for module, _, now in changed:
            _set_processor(module, now)


def _set_processor(module: torch.nn.Module, processor: Any) -> None:
    if hasattr(module, "set_processor"):
        module.set_processor(processor)
    else:
        module.processor = processor


class CheckpointingWithContext:
    """A module's `_gradient_checkpointing_func` wrapped so that its blocks recompute with their forward's session
    state (`_RecomputeWithContext`); `inner` is the function it wraps, put back by `remove`."""

    def __init__(self, inner, session: SparseSession) -> None:
        self.inner, self.session = inner, session

    def __call__(self, block, *args, **kwargs):
        return self.inner(_RecomputeWithContext(block, self.session), *args, **kwargs)
