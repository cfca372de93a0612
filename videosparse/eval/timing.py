"""Wall-clock timing of transformer forwards inside a pipeline call."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch


def _sync(module: torch.nn.Module) -> None:
    p = next(module.parameters(), None)
    if p is not None and p.is_cuda:
        torch.cuda.synchronize(p.device)


class TransformerTimer:
    """Times every forward of the given transformers (CUDA-synchronised), via torch forward hooks.

    Attributes:
        times: seconds of each transformer forward, in call order.
    """

    def __init__(self, transformers: list[torch.nn.Module]) -> None:
        self.transformers = transformers
        self.times: list[float] = []
        self._t0 = 0.0

    def _pre(self, module, args, kwargs):
        _sync(module)
        self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        _sync(module)
        self.times.append(time.perf_counter() - self._t0)

    @contextmanager
    def __call__(self) -> Iterator["TransformerTimer"]:
        handles = []
        for t in self.transformers:
            handles.append(t.register_forward_pre_hook(self._pre, with_kwargs=True))
            handles.append(t.register_forward_hook(self._post, with_kwargs=True))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    @property
    def total(self) -> float:
        return sum(self.times)


def pipeline_transformers(pipe) -> list[torch.nn.Module]:
    return [c for n, c in pipe.components.items() if n.startswith("transformer") and isinstance(c, torch.nn.Module)]
