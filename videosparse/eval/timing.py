"""Timing inside a pipeline call: transformer forwards (wall clock, CUDA-synchronised) and the
self-attention calls and plan building of videosparse processors (CUDA events)."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
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
    """The pipeline's transformer components (transformer, transformer_2, ...), each module once, as `apply` serves
    them (`processors._transformers`): one module in two slots (also compiled in one of them) would be timed twice
    per call. A `torch.compile` wrapper is kept as given (the timers' hooks go around the compiled call)."""
    from ..processors import _transformers

    return [pipe.components[name] for name in _transformers(pipe)]


class _Clock:
    """Start/stop pairs: CUDA events on a GPU (no host sync in the hot path), perf_counter on CPU."""

    def __init__(self) -> None:
        self.pairs: list[tuple] = []

    def start(self, device: torch.device):
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(device))    # the tensor's GPU (a bare record() takes the current one)
            return ev
        return time.perf_counter()

    def stop(self, device: torch.device, begin) -> None:
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(device))
            self.pairs.append((begin, ev))
        else:
            self.pairs.append((begin, time.perf_counter()))

    def seconds(self) -> list[float]:
        out = []
        for a, b in self.pairs:
            if isinstance(a, torch.cuda.Event):
                b.synchronize()
                out.append(a.elapsed_time(b) / 1000.0)
            else:
                out.append(b - a)
        return out


_MISSING = object()   # an attribute the timer found not set on the instance (removed again on exit)


class AttentionTimer:
    """Times the self-attention calls of transformers that videosparse is applied to.

    For the duration of the context it wraps, per instance, every videosparse processor's
    `attend(q, k, v)` (the whole attention: dense/sparse decision, Wan's RoPE, gather, plan, kernel, scatter; not
    the projections, which dense and sparse share; a processor whose attention takes more than one `attend` names
    its entry point in `timed_entry`) and every session's `method.plan` (mask
    building). On CUDA each call is bracketed by CUDA events, so nothing synchronises inside the
    forward; the durations are read when the context closes. Nothing in `videosparse.processors`
    changes: the wrappers are instance attributes, deleted on exit.

    Attributes (valid after the context closes):
        attention_s: seconds of every self-attention call, in call order.
        plan_s: seconds of every `plan` call (part of `attention_s`).
        layers: the layer index of every attention call.

    Example:
        >>> timer = AttentionTimer(pipeline_transformers(pipe))  # after videosparse.apply(pipe, cfg) # doctest: +SKIP
        >>> with timer():                                                                 # doctest: +SKIP
        ...     pipe(prompt)
        >>> sum(timer.attention_s)                                                        # doctest: +SKIP
    """

    def __init__(self, transformers: list[torch.nn.Module]) -> None:
        self.transformers = transformers
        self.attention_s: list[float] = []
        self.plan_s: list[float] = []
        self.layers: list[int] = []

    @staticmethod
    def _processors(transformer: torch.nn.Module) -> list:
        from ..processors import attention_processors
        from ..processors.base import SparseAttentionMixin

        procs = {id(p): p for p in attention_processors(transformer).values() if isinstance(p, SparseAttentionMixin)}
        return list(procs.values())

    @contextmanager
    def __call__(self) -> Iterator["AttentionTimer"]:
        attn_clock, plan_clock = _Clock(), _Clock()
        layers: list[int] = []
        wrapped: list[tuple[object, str, object]] = []    # (object, attribute, its own attribute before, or _MISSING)

        def wrap_attend(proc):
            original = getattr(proc, proc.timed_entry)

            def attend(q, *args, **kwargs):
                begin = attn_clock.start(q.device)
                out = original(q, *args, **kwargs)
                attn_clock.stop(q.device, begin)
                layers.append(proc.layer)
                return out

            return attend

        def wrap_plan(method):
            original = method.plan

            def plan(q, k, v, layout, layer, *args, **kwargs):
                begin = plan_clock.start(q.device)
                out = original(q, k, v, layout, layer, *args, **kwargs)
                plan_clock.stop(q.device, begin)
                return out

            return plan

        sessions = []
        for t in self.transformers:
            for proc in self._processors(t):
                wrapped.append((proc, proc.timed_entry, proc.__dict__.get(proc.timed_entry, _MISSING)))
                setattr(proc, proc.timed_entry, wrap_attend(proc))
                sessions.append(proc.session)
        for session in {id(s): s for s in sessions}.values():
            if session.method is not None:
                wrapped.append((session.method, "plan", session.method.__dict__.get("plan", _MISSING)))
                session.method.plan = wrap_plan(session.method)
        if not wrapped:
            raise ValueError("AttentionTimer found no videosparse processors: call videosparse.apply(...) first "
                             "(DenseConfig() for the dense reference).")
        try:
            yield self
        finally:
            for obj, name, before in reversed(wrapped):     # an outer timer's wrappers stay in place
                if before is _MISSING:
                    obj.__dict__.pop(name, None)
                else:
                    setattr(obj, name, before)
            self.attention_s.extend(attn_clock.seconds())
            self.plan_s.extend(plan_clock.seconds())
            self.layers.extend(layers)

    @property
    def attention_total(self) -> float:
        return float(sum(self.attention_s))

    @property
    def plan_total(self) -> float:
        return float(sum(self.plan_s))


_SDPA_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def is_sdpa_op(name: str) -> bool:
    """An ATen scaled-dot-product attention op (the dispatching one or a backend's). Only `aten::` names count:
    Inductor names its fused Triton kernels after the ops they fuse ("triton_poi_fused__scaled_dot_product_cudnn_
    attention_add_..."), and those launches are elementwise work around the attention, not attention."""
    return name.startswith("aten::") and any(op in name for op in _SDPA_OPS)


@dataclass
class SdpaProfile:
    """What one profiled fn() spent in scaled-dot-product attention calls with a given number of keys.

    Attributes:
        seconds: their GPU kernels' time on a CUDA device (each kernel once, `kernel_us`), their CPU time
            elsewhere; None when there is no such call or, on CUDA, no kernel time for them (CUDA graphs replay
            kernels without their ops; a profiler without CUPTI access records no kernels).
        calls: how many such calls (each counted once, although the dispatching op nests the backend's).
        wall_s: wall time of the profiled fn() (device-synchronised), profiler overhead included.
    """

    seconds: float | None
    calls: int
    wall_s: float

    def problem(self, expected_calls: int | None = None, forward_s: float | None = None) -> str | None:
        """Why `seconds` cannot be the attention time of the forward (None when it can): no time, another number
        of calls than the forward makes (`expected_calls`), or more attention time than the profiled forward took
        or than `forward_s`, the forward's time measured without the profiler."""
        if self.seconds is None:
            return (f"the profile holds no kernel time for its {self.calls} SDPA calls" if self.calls
                    else "the profile holds no SDPA call with these keys")
        if expected_calls is not None and self.calls != expected_calls:
            return f"the profile holds {self.calls} SDPA calls with these keys where the forward makes {expected_calls}"
        if self.seconds > self.wall_s:
            return f"the profiled SDPA calls' {self.seconds:.3f} s exceed the profiled forward's {self.wall_s:.3f} s"
        if forward_s is not None and self.seconds >= forward_s:
            return f"the profiled SDPA calls' {self.seconds:.3f} s exceed the timed forward's {forward_s:.3f} s"
        return None


def kernel_us(event) -> float:
    """Device time (us) of the kernels that `event` and the ATen ops nested in it launched, each kernel once.

    Only ATen ops' own kernels count, not `event.device_time_total`: the profiler can nest records of its own
    overhead in an op and credit each with that op's kernels again (fixed in PyTorch by PR 193924, 2026-08). Seen
    with torch 2.11 on a compiled Wan 14B forward: 19 "Command Buffer Full" records in its 40 attention calls, whose
    `device_time_total` summed 12.34 s against 8.37 s of their own kernels."""
    own = sum(k.duration for k in event.kernels) if event.name.startswith("aten::") else 0.0
    return own + sum(kernel_us(child) for child in event.cpu_children)


def profile_sdpa(fn, key_tokens: int, device: torch.device | str = "cpu") -> SdpaProfile:
    """Run fn() once under torch.profiler and sum its scaled-dot-product attention calls with `key_tokens` keys
    (key (B, H, key_tokens, D)); see `SdpaProfile`.

    Unlike timing one such call outside the model, this measures them inside the forward, at the clock the GPU
    holds under the forward's load; calls with other key counts (cross-attention to the text) are left out."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0

    def is_sdpa(event) -> bool:
        return event is not None and is_sdpa_op(event.name)

    calls, device_us, cpu_us = 0, 0.0, 0.0
    for event in prof.events():
        shapes = event.input_shapes or []
        if (not is_sdpa(event) or is_sdpa(event.cpu_parent) or len(shapes) < 2 or len(shapes[1]) != 4
                or shapes[1][-2] != key_tokens):
            continue
        calls += 1
        device_us += kernel_us(event) if cuda else 0.0
        cpu_us += event.cpu_time_total
    if not calls or (cuda and device_us <= 0):
        return SdpaProfile(None, calls, wall)
    return SdpaProfile((device_us if cuda else cpu_us) * 1e-6, calls, wall)


def sdpa_seconds(fn, key_tokens: int, device: torch.device | str = "cpu") -> float | None:
    """`profile_sdpa(...).seconds`, or None when `SdpaProfile.problem()` finds the reading unusable."""
    prof = profile_sdpa(fn, key_tokens, device)
    return None if prof.problem() else prof.seconds


def host_sync_sites(fn) -> list[list[str]]:
    """Run fn() with CUDA's sync debug mode set to warn: for every synchronizing CUDA call it makes (a host wait
    on the GPU, e.g. `.item()`, `.tolist()` or a copy from pageable host memory), the Python stack that made it,
    innermost frame first, each frame as "file:line:function", down to fn's own frame (this helper and its callers
    are left out: they are where every site is called from, not where it syncs). Needs CUDA."""
    import sys
    import warnings

    sites = []
    outer = sys._getframe()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            frames, frame = [], sys._getframe(1)
            while frame is not None and frame is not outer:
                frames.append(f"{frame.f_code.co_filename}:{frame.f_lineno}:{frame.f_code.co_name}")
                frame = frame.f_back
            sites.append(frames)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


def package_frames(frames: list[str]) -> list[str]:
    """The frames of a `host_sync_sites` stack that lie in the videosparse package, innermost first, each as
    "path inside the package:line:function" (e.g. "sol/threshold.py:192:pack_mask")."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    return [f[len(package):] for f in frames if f.startswith(package)]

