"""Per-transformer sparse-attention session and the context hook that feeds it.

One `SparseSession` per transformer holds the config, the method (tile chooser), the current call
context (video grid, step index, CFG branch) and per-layer statistics. A diffusers `ModelHook`
(`SparseContextHook`, registered under `CONTEXT_HOOK`) records that context before every transformer
forward; the per-layer processors read it. The hook is stateful so that diffusers'
`cache_context(name, step_index=..., num_inference_steps=...)` reaches it; pipelines that give no
step index get one by matching the timestep against the scheduler's timesteps, else by counting
calls per branch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState, HookFunctionReference, StateManager

from ..kernels.probe import probe_kernel
from ..layout import HeadTiling, head_tiling
from ..plan import HAS_TRITON
from .registry import patch_size_of

logger = logging.getLogger("videosparse")

CONTEXT_HOOK = "videosparse_context"
_LAYERWISE_CASTING_HOOK = "layerwise_casting"     # the name diffusers' enable_layerwise_casting registers its hook by


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention on `device` runs in for inputs of `dtype`: under `torch.autocast` SDPA casts floating
    inputs other than fp64 to the autocast dtype (an fp32 model under bf16 autocast attends in bf16), and the
    sparse path does the same."""
    if dtype.is_floating_point and dtype != torch.float64 and device.type != "meta" \
            and torch.is_autocast_enabled(device.type):                 # (meta tensors have no autocast)
        return torch.get_autocast_dtype(device.type)
    return dtype


def _projection_dtype(session: "SparseSession", dtype: torch.dtype) -> torch.dtype:
    """The dtype q, k, v come out of the served layers' projections in for a forward whose hidden states are `dtype`:
    their Linear weights' where those are floats of 16 bits or more (MiniMax-H3 keeps its input projection in fp32
    and takes fp32 rows into bf16 blocks), else `dtype` (quantized weights are no float); under diffusers' layerwise
    casting the hook's compute dtype (the weights hold the storage dtype between calls: bf16 storage computing in
    fp32 gives fp32 q, k, v)."""
    attn = next((m for ref in session.served[:1] if (m := ref()) is not None), None)
    linear = next((m for m in attn.modules() if isinstance(m, torch.nn.Linear)), None) if attn is not None else None
    registry = getattr(linear, "_diffusers_hook", None)
    casting = registry.get_hook(_LAYERWISE_CASTING_HOOK) if registry is not None else None
    compute = getattr(casting, "compute_dtype", None)
    if isinstance(compute, torch.dtype):
        return compute
    weight = getattr(linear, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point and weight.dtype.itemsize >= 2:
        return weight.dtype
    return dtype


class LayerStats:
    """Counters of one self-attention layer, accumulated over calls.

    The counters are device tensors updated in place (no host sync and no Python-int guards in the
    attention path, so it stays capturable by torch.compile and CUDA graphs); reading them syncs.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        # sparse calls, dense calls, kept (query tile, key tile) pairs, all pairs of the sparse calls,
        # sum over sparse calls of max(kv_count) x rows (what the calls would cost if every row were the longest);
        # a normal tensor even when `apply` runs under inference_mode (calls outside it add to it in place)
        with torch.inference_mode(False):
            self.counts = torch.zeros(5, dtype=torch.int64, device=device)
        self.fallbacks: set[str] = set()

    def record_sparse(self, kv_count: torch.Tensor, num_key_tiles: int, pairs: torch.Tensor | None = None, *,
                      new_call: bool = True) -> None:
        """Account one sparse call whose plan has these kv_count [B, H, Mq] (no sync): one Triton launch on CUDA
        in eager mode, else 7 small torch kernels (fused by torch.compile). The call's pairs are rows x
        num_key_tiles, or `pairs` (an int64 device scalar) when given (a call with padded keys: the pairs of its
        valid tiles). `new_call=False`: the tiles of a further batch item of a layer call already counted (items
        served one by one), not one more call."""
        if pairs is not None:
            self.counts[3].add_(pairs)
            num_key_tiles = 0
        if self.counts.is_cuda and HAS_TRITON and not torch.compiler.is_compiling():
            from ..kernels.triton_counters import record_sparse_triton

            record_sparse_triton(self.counts, kv_count, num_key_tiles)
        else:
            rows = kv_count.numel()
            self.counts.add_(_call_increment(rows * num_key_tiles, self.counts.device))
            self.counts[2::2].add_(torch.stack((kv_count.sum(dtype=torch.int64),
                                                kv_count.amax().to(torch.int64) * rows)))
        if not new_call:
            self.counts[0].sub_(1)

    def record_dense(self) -> None:
        self.counts[1].add_(1)

    def as_dict(self, group=None) -> dict[str, Any]:
        """Counts, realised density and load balance (longest row over mean row, weighted by each call's kept
        pairs); syncs the host. With a process `group` (context parallelism: each rank counts the plans of its own
        heads) the tile pairs are summed over its ranks, a collective; the call counts, the same on every rank, are
        this rank's, and the load balance weighs each rank's longest row."""
        counts = self.counts
        if group is not None:
            import torch.distributed as dist

            counts = counts.clone()
            dist.all_reduce(counts[2:], group=group)       # (a contiguous view: reduced in place)
        sparse, dense, kept, total, widest = (int(c) for c in counts.tolist())
        return {
            "sparse_calls": sparse,
            "dense_calls": dense,
            "density": kept / total if total else None,
            "load_balance": widest / kept if kept else None,
            "kept_pairs": kept,
            "total_pairs": total,
            "fallbacks": sorted(self.fallbacks),
        }


_INCREMENTS: dict[tuple[int, str], torch.Tensor] = {}


def _call_increment(pairs: int, device: torch.device) -> torch.Tensor:
    """int64 [5] (1, 0, 0, pairs, 0) on `device`: one sparse call with `pairs` tile pairs (cached in eager mode,
    a constant of the graph under torch.compile)."""
    if torch.compiler.is_compiling():
        return torch.tensor([1, 0, 0, pairs, 0], dtype=torch.int64, device=device)
    key = (pairs, str(device))
    inc = _INCREMENTS.get(key)
    if inc is None:
        if len(_INCREMENTS) >= 64:
            _INCREMENTS.clear()
        inc = _INCREMENTS[key] = torch.tensor([1, 0, 0, pairs, 0], dtype=torch.int64, device=device)
    return inc


class LayerSlot:
    """One self-attention layer's state, held by its processor as `processor.slot`.

    The processors read their layout, counters, dense-layer flag and method state as attributes of
    their own slot, never through the layer index, so a block compiled once (diffusers' `compile_repeated_blocks`)
    serves every layer with the same configuration instead of recompiling per layer index.

    Attributes:
        stats: the layer's `LayerStats`.
        layouts: its `HeadTiling` for the current grid, by valid text length (one entry unless the batch items
            of the forward have different valid text lengths; empty before the first forward or for dense configs).
        dense: the config runs this layer dense (`dense_layers`).
        method_state: the method's state dict for this layer (`SparseMethod.layer_state`), handed to `plan`.
        warned: the reasons this layer has warned about (once per session: `reset_stats` keeps them).
    """

    def __init__(self, dense: bool = False, method_state: dict | None = None) -> None:
        self.stats = LayerStats()
        self.warned: set[str] = set()
        self.layouts: dict[int, HeadTiling] = {}
        self.dense = dense
        self.method_state = {} if method_state is None else method_state


@dataclass
class CallContext:
    """Where the current transformer forward is: grid, text tokens, step and branch."""

    grid: tuple[int, int, int] | None = None
    text_len: int | tuple[int, ...] = 0   # text tokens the layouts cover (see `PaddedText`)
    text_valid: torch.Tensor | None = None   # int32 [B]: each item's valid text tokens, when the sparse path masks
    text_slot: bool = False       # the model's text is padded per item (`PaddedText`): layouts' `text_slot`
    step: int | None = None
    num_steps: int | None = None
    branch: str = "default"
    sparse_step: bool = True     # False inside the config's dense steps
    unsupported: str | None = None   # why this forward cannot run sparse (from the model's grid_fn)


@dataclass
class AttentionRecord:
    """What an observer receives for one self-attention call (post-RoPE, before attention).

    q, k, v: [B, S, H, D] in the order the sparse path serves: the video grid with the extra tokens (text,
    conditions) at text_position, which is diffusers' token order except for FramePack, whose history tokens are
    moved behind the video; grid (T, H, W); text_len (the valid extra tokens of this call, which come with the video
    in q, k, v) and text_position describe those extra tokens, global tiles of the layout.
    item: None when q, k, v hold the forward's whole batch; the index of the batch item they hold (B = 1) when
    the items have different valid text lengths and are served, and observed, one by one.
    dense_reason: why the processor runs this call dense (a scheduled dense step or layer, a dense config, or an
        input or device no kernel serves, as `stats()` counts it); None when it runs sparse.
    text_slot: the model pads its text per item, so an item with no valid text still has a text part (the layouts'
        `text_slot`: build this call's layout with it to get the tiles the processor uses).
    """

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grid: tuple[int, int, int]
    text_len: int
    text_position: str | None
    step: int | None
    branch: str
    item: int | None = None
    dense_reason: str | None = None
    text_slot: bool = False


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
        """The step index of a forward at timestep `t` (the noisiest entry of a per-token timestep); `expected`: the
        schedule direction the caller knows its model family to have (-1 / +1), 0 when it does not know it."""
        value = float(torch.as_tensor(t).detach().flatten().max())
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


class SparseSession:
    """Everything `apply` attaches to one transformer; returned by `videosparse.apply`.

    Attributes:
        config: the method config.
        method: the `SparseMethod` (None for `DenseConfig`).
        context: the `CallContext` of the current forward.
        slots: one `LayerSlot` per self-attention layer (layout, counters, dense flag, method state).
        layer_stats: `LayerStats` per self-attention layer index (a view of the slots).
        observers: callables that `videosparse.observe` registered, given each attention call's `AttentionRecord`.
        calls: transformer forwards seen (`reset_stats` restarts the count).
        active: False once `remove` took the session off its transformer.
        served: weak references to the transformers the session serves.
        forward_lock: held through each forward, so that threads sharing the transformer take turns.
    """

    # how many valid text lengths keep their layouts cached (at least the current forward's): the prompt and the
    # negative prompt that a guider runs as separate forwards (HunyuanVideo 1.5) alternate without rebuilding them
    layout_cache_lengths = 2

    def __init__(self, config, method, info, original_processors: dict[str, Any], scheduler=None,
                 pipeline=None) -> None:
        self.config = config
        self.method = method
        self.info = info
        self.original_processors = original_processors
        self._scheduler = scheduler
        self._pipeline = weakref.ref(pipeline) if pipeline is not None else None
        self.context = CallContext()
        self.slots: list[LayerSlot] = []
        self.observers: list[Callable[[AttentionRecord], None]] = []
        self.calls = 0
        self.kernel_problem: str | None = None   # why the fast path cannot serve the current inputs
        self.kernel_problem_warned = False       # that problem is one of the session: warned once, for all layers
        self._probe_args: tuple | None = None     # `probe_kernel`'s arguments for the current inputs (None: not probed)
        self._prepared_for: tuple | None = None
        # every layer's layouts by valid text length, kept for reuse while the grid and device stay (`prepare`)
        self._layout_cache: dict[int, list[HeadTiling]] = {}
        self._layout_cache_for: tuple | None = None
        self._recomputing = False                 # inside `recomputing`
        # shared with the other transformers of the pipeline by `apply`; transformers set up on their own, with no
        # pipeline and no scheduler, share one: Wan 2.2's experts set up one by one take turns in a call (each
        # counting alone, the second restarted the count, and with it the dense steps, when it took over)
        if scheduler is None and pipeline is None:
            BARE_TIMESTEP_COUNTER.forget()        # a new setup: nothing carried over from an earlier one's calls
            self.timestep_counter = BARE_TIMESTEP_COUNTER
        else:
            self.timestep_counter = ThreadTimestepCounters()
        self.forward_graph_task = -1              # the autograd graph task the latest transformer forward ran in
        self._warned_unmanaged_recompute = False
        self.active = True                        # False once removed: processors kept elsewhere then run dense
        # weak refs to the attention modules of the served layers: one holding a processor of another session or
        # none (fuse_qkv_projections or set_attn_processor after apply) is warned about once
        self.served: list[weakref.ref] = []
        # held through every transformer forward (`SparseContextHook.new_forward`) and by `remove`: the context and
        # layouts above are those of one forward, so forwards from several threads (pipelines sharing the
        # transformer) take turns; reentrant, for a forward run from inside one (a callback, a recompute)
        self.forward_lock = threading.RLock()

    def __reduce_ex__(self, protocol):
        # pickling met a weak reference (to the pipeline, the modules) with a message that does not name videosparse
        raise TypeError("a transformer with videosparse applied cannot be pickled (torch.save(model), "
                        "multiprocessing), nor its SparseSession: call videosparse.remove(...) on the transformer "
                        "first, or save its state_dict(); for a session's numbers, pickle session.stats() (a dict).")

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):
        # copy.deepcopy goes through __reduce_ex__ too: copy the attributes as it would (a copied transformer then
        # refuses to run, see `SparseContextHook.pre_forward`)
        new = memo[id(self)] = self.__copy__()
        new.__dict__ = copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "forward_lock"}, memo)
        new.forward_lock = threading.RLock()
        return new

    def release(self) -> None:
        """Free what this session keeps on the device for its calls (every layer's layouts, the method's weights
        there: Veda's estimator copy, 600 MB at Wan 14B, goes to the CPU); `remove` calls it. The counters stay
        (`stats()`); a block recomputed later in a backward still pending finds what it needs again."""
        self._layout_cache.clear()
        self._layout_cache_for = self._prepared_for = None
        for slot in self.slots:
            slot.layouts = {}
        if self.method is not None:
            self.method.release()

    @property
    def made_by_apply(self) -> bool:
        """Whether `videosparse.apply(pipe, ...)` made this session (it then counts steps on that pipeline's
        scheduler), rather than `processors(...)` on a bare transformer."""
        return self._pipeline is not None

    @property
    def pipeline(self):
        """The pipeline given to `videosparse.apply` while it lives, else None."""
        return self._pipeline() if self._pipeline is not None else None

    @property
    def scheduler(self):
        """The scheduler the steps are counted with: the pipeline's current `scheduler` when the session was made by
        `videosparse.apply(pipe, ...)` (a scheduler swapped in after apply is the one read), else the one given."""
        pipeline = self._pipeline() if self._pipeline is not None else None
        return getattr(pipeline, "scheduler", self._scheduler) if pipeline is not None else self._scheduler

    def slot(self, layer: int) -> LayerSlot:
        """The `LayerSlot` of self-attention layer `layer` (made on first request)."""
        while len(self.slots) <= layer:
            i = len(self.slots)
            self.slots.append(LayerSlot(dense=self.config.is_dense_layer(i),
                                        method_state=self.method.layer_state(i) if self.method is not None else None))
        return self.slots[layer]

    @property
    def layer_stats(self) -> dict[int, LayerStats]:
        return {i: slot.stats for i, slot in enumerate(self.slots)}

    def prepare(self, grid: tuple[int, int, int], text_len: int | tuple[int, ...], device: torch.device,
                dtype: torch.dtype) -> None:
        """Give every layer its tile layouts (index tensors on `device`) and check the kernel, once per shape.

        text_len: the valid text tokens, or one count per batch item (a layout for each distinct count).
        The layouts of the last `layout_cache_lengths` lengths stay cached for the grid and device, so forwards
        that alternate lengths (the guidance branches) reuse them instead of rebuilding them.
        Runs eagerly from the context hook, outside any compiled graph.
        """
        key = (grid, text_len, str(device), dtype, self.context.text_slot)
        if key == self._prepared_for:
            return
        self._prepared_for = None       # until this one is done: a call interrupted in between prepares again
        info, method = self.info, self.method
        for layer in range(info.num_layers):
            stats = self.slot(layer).stats
            if stats.counts.device != torch.device(device):
                stats.counts = stats.counts.to(device)
        if method is not None:
            lengths = sorted(set(text_len)) if isinstance(text_len, tuple) else [text_len]
            cache = self._layout_cache
            if self._layout_cache_for != (grid, str(device), self.context.text_slot):
                cache.clear()
                self._layout_cache_for = (grid, str(device), self.context.text_slot)
            for length in lengths:
                shared: dict[tuple, HeadTiling] = {}     # layers of the same tile shapes share one layout
                layouts = cache.pop(length, None) or [self._build_layout(layer, grid, length, device, shared)
                                                      for layer in range(info.num_layers)]
                cache[length] = layouts                  # most recently used last
            while len(cache) > max(self.layout_cache_lengths, len(lengths)):
                del cache[next(iter(cache))]
            for layer in range(info.num_layers):
                self.slot(layer).layouts = {length: cache[length][layer] for length in lengths}
            method.prepare(device)
            self.kernel_problem = self.check_kernel(device, dtype)
            self._probe_args = self._kernel_probe_args(device, dtype)
        self._prepared_for = key

    def attention_dtype_for(self, hidden_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
        """The dtype attention sees in a forward on `device` whose hidden states are `hidden_dtype` (the served
        layers' projection dtype, as SDPA casts it)."""
        return attention_dtype(_projection_dtype(self, hidden_dtype), torch.device(device))

    def _kernel_probe_args(self, device, dtype: torch.dtype) -> tuple:
        return (self.config.backend, device, dtype, self.info.num_heads, self.info.head_dim, self.method.block,
                getattr(self.config, "correction", False))

    def check_kernel(self, device: torch.device | str, dtype: torch.dtype) -> str | None:
        """Why no fast kernel serves this transformer's attention in `dtype` on `device` (None: one does); a
        ValueError for a kernel backend named in the config that cannot run it. Needs a sparse method."""
        info, backend = self.info, self.config.backend
        probe = probe_kernel(*self._kernel_probe_args(device, dtype))
        if probe.problem is not None and backend != "auto":
            raise ValueError(
                f"backend={backend!r} cannot run this transformer's attention ({dtype}, {info.num_heads} heads x "
                f"{info.head_dim}, {self.method.block}-token tiles, on {device}): {probe.problem} Use "
                "backend='auto', which picks the fastest kernel that fits (the torch reference on CPU) and runs "
                "dense with a warning where none does.")
        return probe.problem

    def _build_layout(self, layer: int, grid: tuple[int, int, int], text_len: int, device,
                      shared: dict[tuple, HeadTiling]) -> HeadTiling:
        """The `HeadTiling` of `layer` for `grid` and `text_len` valid text tokens, its index tensors on `device`; the
        one in `shared` (by the heads' tile shapes, added to it) where an earlier layer has the same shapes (their
        index tensors: 2.4 MB at Wan 14B 720P for per-head shapes of two kinds)."""
        info, method = self.info, self.method
        layout = head_tiling(grid, method.tile_shapes(layer, info.num_heads), info.num_heads, method.block, text_len,
                             info.text_position or "after", self.context.text_slot)
        if layout.tiles in shared:
            layout = shared[layout.tiles]
        else:
            shared[layout.tiles] = layout
            layout.warm(device)
        method.on_layout(layer, layout)
        return layout

    @property
    def kernel_backend(self) -> str | None:
        """The kernel backend the sparse calls run on (None: not probed yet), asked of the dispatcher (cached) for
        the current inputs each time: a backend that stopped serving them (the Gluon kernel on a Triton it fails to
        compile on) is not reported after that."""
        return probe_kernel(*self._probe_args).backend if self._probe_args is not None else None

    def stats(self, *, all_ranks: bool = False) -> dict[str, Any]:
        """Per-layer and overall statistics (realised density, sparse/dense calls, the kernel backend the sparse calls
        ran on: None without any; per layer also the load balance and the reasons for dense calls).

        Under context parallelism each rank plans and counts its own heads, so the densities are this rank's;
        `all_ranks=True` sums the tile pairs over the Ulysses group, giving the model's density (a collective: every
        rank of the group must call it). Without context parallelism it changes nothing."""
        group = self._ulysses_group() if all_ranks else None
        return {**self._layer_totals(group), "method": self.method.stats() if self.method is not None else {}}

    def _ulysses_group(self):
        """The process group of the served layers' Ulysses context parallelism, or None without it."""
        from .parallel import UlyssesShard, ulysses_shard

        for ref in self.served:
            shard = ulysses_shard(getattr(getattr(ref(), "processor", None), "_parallel_config", None))
            if isinstance(shard, UlyssesShard):
                return shard.group
        return None

    def _layer_totals(self, group=None) -> dict[str, Any]:
        """`stats()` without the method's own (Sol's calibrations: host syncs growing with the shapes served)."""
        layers = {i: s.as_dict(group) for i, s in sorted(self.layer_stats.items())}
        kept = sum(s["kept_pairs"] for s in layers.values())
        total = sum(s["total_pairs"] for s in layers.values())
        return {
            "config": self.config.to_dict(),
            "transformer_calls": self.calls,
            "sparse_calls": sum(s["sparse_calls"] for s in layers.values()),
            "dense_calls": sum(s["dense_calls"] for s in layers.values()),
            "density": kept / total if total else None,
            "kernel_backend": self.kernel_backend if any(s["sparse_calls"] for s in layers.values()) else None,
            "layers": layers,
        }

    def summary(self) -> str:
        s = self._layer_totals()
        dens = f"{s['density']:.3f}" if s["density"] is not None else "n/a"
        return (
            f"videosparse[{self.config.method}]: {s['transformer_calls']} transformer calls, "
            f"{s['sparse_calls']} sparse / {s['dense_calls']} dense attention calls, realised density {dens}"
            + (f", kernel {s['kernel_backend']}" if s["kernel_backend"] and s["sparse_calls"] else "")
        )

    def reset_stats(self) -> None:
        for slot in self.slots:
            slot.stats = LayerStats(slot.stats.counts.device)
        self.calls = 0

    def recalibrate(self) -> None:
        """Calibrate again: a method that calibrates on the first call of each layer and shape (Sol with `density`)
        forgets what it calibrated, so the next calls calibrate on the current weights (after fine-tuning moved
        them; statistics are kept). Other methods calibrate nothing: a no-op."""
        recalibrate = getattr(self.method, "recalibrate", None)
        if recalibrate is not None:
            recalibrate()

    def recompute_stats(self, slot: LayerSlot) -> LayerStats:
        """Counters that count nowhere, sharing `slot`'s fallbacks (a warning given once is not given again)."""
        scratch = LayerStats(slot.stats.counts.device)
        scratch.fallbacks = slot.stats.fallbacks
        return scratch

    def unmanaged_recompute(self) -> bool:
        """Whether a processor runs in a backward pass outside `recomputing`: a block recomputed by activation
        checkpointing that is not diffusers' `enable_gradient_checkpointing` (torch's `checkpoint_wrapper`, FSDP's),
        which sees the session's latest forward; warned once."""
        task = _graph_task()
        if self._recomputing or task == -1 or task == self.forward_graph_task:
            return False                  # not in a backward, or the transformer itself runs in it (a real forward)
        if not self._warned_unmanaged_recompute:
            self._warned_unmanaged_recompute = True
            logger.warning(
                "videosparse: a block (or the whole transformer) is recomputed in backward by activation "
                "checkpointing other than diffusers' (transformer.enable_gradient_checkpointing()): it attends with "
                "the grid, text lengths, layouts and dense / sparse step of the latest transformer forward, so run "
                "no other forward between a forward and its backward there, or use enable_gradient_checkpointing, "
                "which keeps each block's own.")
        return True

    def snapshot(self) -> tuple:
        """What the processors read of the current forward (its context, every layer's layouts, the kernel
        problem, how many observers it had), for `recomputing` it later."""
        return copy.copy(self.context), [slot.layouts for slot in self.slots], self.kernel_problem, len(self.observers)

    @contextlib.contextmanager
    def recomputing(self, snapshot: tuple):
        """Within: the processors see the forward of `snapshot` again (gradient checkpointing's recompute in
        backward, after other forwards may have changed the session), without counting its calls twice or
        showing them to observers (as many observers that ignore them stand in, so that the recompute takes the
        path the forward took); everything is put back on exit."""
        live = self.context, [slot.layouts for slot in self.slots], self.kernel_problem
        counters, observers = [slot.stats for slot in self.slots], self.observers
        outer, was_active = self._recomputing, self.active
        context, layouts, kernel_problem, watched = snapshot
        throwaway = [self.recompute_stats(slot) for slot in self.slots]    # (allocates: before anything changes)
        try:
            self.context, self.kernel_problem = context, kernel_problem
            self._recomputing = True
            self.active = True                          # a forward's recompute after `remove`: as the forward ran
            for slot, kept, stats in zip(self.slots, layouts, throwaway):
                slot.layouts, slot.stats = kept, stats
            self.observers = [_ignore_record] * watched
            yield
        finally:
            self.context, self.kernel_problem, self.observers = live[0], live[2], observers
            self._recomputing, self.active = outer, was_active
            for slot, kept, stats in zip(self.slots, live[1], counters):
                slot.layouts, slot.stats = kept, stats

    def __repr__(self) -> str:
        return f"SparseSession({self.config!r})"


def _graph_task() -> int:
    """The id of the autograd graph task running now (a backward pass), -1 outside one."""
    return getattr(torch._C, "_current_graph_task_id", lambda: -1)()


def _ignore_record(record: AttentionRecord) -> None:
    """An observer that does nothing (`SparseSession.recomputing`)."""


class _ThreadStateManager(StateManager):
    """diffusers' `StateManager` with the cache context and the per-branch states kept per thread: a pipeline sets
    the context (`cache_context("cond", step_index=i, ...)`) on the shared transformer's hooks before each forward,
    so with pipelines sharing the transformer in several threads another call's context would otherwise be the one
    read (its branch and step); `reset` at the end of a call clears the calling thread's."""

    def __init__(self, state_cls) -> None:
        self._local = threading.local()
        super().__init__(state_cls)

    @property
    def _context(self):
        return getattr(self._local, "context", None)

    @_context.setter
    def _context(self, context) -> None:
        self._local.context = context

    @property
    def _state_cache(self) -> dict:
        states = getattr(self._local, "states", None)
        if states is None:
            states = self._local.states = {}
        return states

    @_state_cache.setter
    def _state_cache(self, states: dict) -> None:
        self._local.states = states

    def __deepcopy__(self, memo):
        new = memo[id(self)] = _ThreadStateManager(self._state_cls)    # (a thread-local cannot be copied)
        return new


class _BranchState(BaseState):
    """Per cache-context (cond/uncond) state: forward calls seen in this pipeline call."""

    def __init__(self) -> None:
        self.calls = 0

    def reset(self) -> None:
        self.calls = 0


@functools.lru_cache(maxsize=None)
def _positional_names(forward) -> tuple[str, ...]:
    """The names of a module forward's positional parameters after self, in order (empty when its signature cannot
    be read). Read once per forward."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = []
    for param in params:
        if param.kind not in positional:
            break
        names.append(param.name)
    return tuple(names)


def parameter_position(forward, name: str, default: int) -> int:
    """Position of parameter `name` among a module forward's positional arguments (after self); `default` when it
    has none (`_positional_names`)."""
    names = _positional_names(forward)
    return names.index(name) if name in names else default


def args_by_name(forward, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward call's arguments with the positional ones moved to keywords by the names `forward`'s signature
    gives them: (the positional arguments left, those past its named parameters; the keywords). So `forward_arg`
    finds each argument by its name whatever its position, and a position that diffusers moves is not misread."""
    names = _positional_names(forward)
    if not args or not names:
        return args, kwargs
    n = min(len(args), len(names))
    return args[n:], {**dict(zip(names[:n], args[:n])), **kwargs}


def forward_arg(args: tuple, kwargs: dict, name: str, index: int):
    """Argument `name` of a transformer forward, given by keyword or at position `index` (None if absent)."""
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


# the name of the hook diffusers' context parallelism puts on the transformer itself to split its forward's inputs
# (`_cp_plan` key "": LTX-Video and LTX-2 split hidden_states there)
_INPUT_SPLIT_HOOK = "cp_input---"


def sequence_length(module, hidden_states: torch.Tensor) -> int:
    """The whole sequence's length of a transformer forward's token-major `hidden_states` [B, S, C] as the context
    hook sees them: S, or S x P when diffusers' context parallelism splits the transformer's own inputs over P ranks
    before the hook runs. A hook registered later runs first, so `enable_parallelism` after `videosparse.apply`
    puts that split outside the context hook."""
    seen = hidden_states.shape[1]
    registry = getattr(module, "_diffusers_hook", None)
    cp = getattr(getattr(module, "_parallel_config", None), "context_parallel_config", None)
    order = getattr(registry, "_hook_order", ())
    if cp is None or _INPUT_SPLIT_HOOK not in order or CONTEXT_HOOK not in order:
        return seen
    if order.index(_INPUT_SPLIT_HOOK) < order.index(CONTEXT_HOOK):        # the split runs inside the context hook
        return seen
    return seen * (cp.ulysses_degree or 1) * (cp.ring_degree or 1)


def patch_tokens(latents: torch.Tensor, kernel, pad=None) -> int:
    """Tokens a Conv3d patch embedding with `kernel` makes of latents (B, C, F, H, W), after padding each of F, H, W
    up to a multiple of `pad` when given (the history latents of FramePack and Helios)."""
    sizes = latents.shape[2:] if pad is None else [-(-n // p) * p for n, p in zip(latents.shape[2:], pad)]
    return math.prod(n // k for n, k in zip(sizes, kernel))


class HistoryPart(NamedTuple):
    """One part of the history that a forward puts before its video (FramePack, Helios), as `history_tokens` counts
    it: named by the forward's arguments (with their positions, read where an argument is not named)."""

    latents: str                # the argument holding its latents (B, C, F, H, W)
    latents_at: int
    indices: str                # the argument holding its frame indices: the part is counted when both are given
    indices_at: int
    embedding: str              # the path in the transformer of its patch embedding (a Conv3d)
    pad: tuple[int, int, int] | str | None = None   # F, H, W padded to a multiple of this first ("kernel": its kernel)


def history_tokens(module, args: tuple, kwargs: dict, parts: tuple[HistoryPart, ...]) -> int:
    """Tokens of the history `parts` that a forward of `module` puts before its video: each part given with its frame
    indices, through a patch embedding the module has, counted as `patch_tokens` of its latents."""
    total = 0
    for part in parts:
        latents = forward_arg(args, kwargs, part.latents, part.latents_at)
        embedding = functools.reduce(lambda owner, name: getattr(owner, name, None), part.embedding.split("."), module)
        if latents is None or embedding is None or forward_arg(args, kwargs, part.indices, part.indices_at) is None:
            continue
        pad = embedding.kernel_size if part.pad == "kernel" else part.pad
        total += patch_tokens(latents, embedding.kernel_size, pad)
    return total


@dataclass(frozen=True)
class PaddedText:
    """The text tokens of a forward whose padded tail is masked (what a grid function returns for HunyuanVideo,
    Mochi, ...): `total` in the sequence, the first `valid[b]` of item b valid (int32 [B], on the model's device).

    A sparse forward covers all `total` (one layout, whatever the prompt) and masks the padded keys in the kernel
    (`Plan.valid_keys`), so that prompts of other lengths run the same shapes and, under torch.compile, the same
    graph. Dense configs and observed forwards serve each item's valid prefix instead (`lengths`)."""

    total: int
    valid: torch.Tensor
    pad_to_tile: bool = False   # the forward holds only the valid rows (total == valid): the processor pads them
    #                             to the layout's length, the sequence rounded up to whole tiles (Cosmos 3's prompt)

    def lengths(self) -> int | tuple[int, ...]:
        """The valid text tokens as host ints: one when the batch agrees, else one per item (e.g. a prompt and a
        shorter negative prompt batched for classifier-free guidance). Syncs the host."""
        lengths = tuple(int(n) for n in self.valid.tolist())
        return lengths[0] if len(set(lengths)) == 1 else lengths


def patched_grid(module, frames: int, height: int, width: int) -> tuple[int, int, int]:
    """The token grid of a latent of frames x height x width after the transformer's patch embedding: each size
    floor-divided by its patch size from `module.config` (`registry.patch_size_of`: pt is 1 where the config patches
    no time)."""
    pt, ph, pw = patch_size_of(module.config)
    return frames // pt, height // ph, width // pw


def valid_text_length(valid: torch.Tensor | None, total: int) -> int | PaddedText:
    """The text tokens of a forward from the per-item valid lengths [B] (None = all `total` valid): `total`, or a
    `PaddedText` (no host sync here)."""
    if valid is None:
        return total
    return PaddedText(total, valid.to(torch.int32))


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


class _CheckpointingWithContext:
    """A module's `_gradient_checkpointing_func` wrapped so that its blocks recompute with their forward's session
    state (`_RecomputeWithContext`); `inner` is the function it wraps, put back by `remove`."""

    def __init__(self, inner, session: SparseSession) -> None:
        self.inner, self.session = inner, session

    def __call__(self, block, *args, **kwargs):
        return self.inner(_RecomputeWithContext(block, self.session), *args, **kwargs)


class SparseContextHook(ModelHook):
    """Records grid, step index and branch of every transformer forward into the session.

    Args:
        session: the `SparseSession` to update.
        grid_fn: (module, args, kwargs) -> ((T, H, W), text_len) for this model family, or
            ((T, H, W), text_len, reason) where a non-None reason makes the whole forward dense.
    """

    _is_stateful = True

    def __init__(self, session: SparseSession, grid_fn, step_timestep=None, timestep_direction: int = 0) -> None:
        super().__init__()
        self.session = session
        self.grid_fn = grid_fn
        self.step_timestep = step_timestep   # ModelSpec.step_timestep: None reads the forward's timestep
        self.timestep_direction = timestep_direction    # ModelSpec.timestep_direction (what counting may assume)
        self.state_manager = _ThreadStateManager(_BranchState)
        self._warned_unknown_steps = False
        self._warned_all_dense = False
        self._warned_training = False
        self._warned_replaced = False
        self._checkpointing: list[torch.nn.Module] = []     # set in `initialize_hook`
        # (scheduler, its timesteps, step_index) as weak references and a value, recorded when a pipeline call ended
        # while the applied pipeline's scheduler was mid-schedule, or had no step counter: a counter its aborted call
        # left, or a finished schedule (`_other_driver`)
        self._stale_counter: tuple | None = None

    def initialize_hook(self, module):
        self._module = weakref.ref(module)
        # the modules diffusers' `enable_gradient_checkpointing` gives a checkpointing function (the transformer)
        self._checkpointing = [m for m in module.modules() if hasattr(m, "gradient_checkpointing")]
        return module

    def deinitalize_hook(self, module):
        for owner in self._checkpointing:                    # the checkpointing functions as they were
            func = owner.__dict__.get("_gradient_checkpointing_func")
            if isinstance(func, _CheckpointingWithContext):
                owner._gradient_checkpointing_func = func.inner
        return module

    def _wrap_checkpointing(self) -> None:
        """Wrap the checkpointing function of every module that checkpoints (enabled before or after `apply`)."""
        for owner in self._checkpointing:
            func = owner.__dict__.get("_gradient_checkpointing_func")
            if getattr(owner, "gradient_checkpointing", False) and callable(func) and \
                    not isinstance(func, _CheckpointingWithContext):
                owner._gradient_checkpointing_func = _CheckpointingWithContext(func, self.session)

    def pre_forward(self, module, *args, **kwargs):
        if module is not self._module():
            _refuse_copy(module)
        return args, kwargs

    @torch.compiler.disable(recursive=False)
    def new_forward(self, module, *args, **kwargs):
        """The transformer's forward (the registry's `original_forward`) with the session's `forward_lock` held and
        the context of this forward recorded first (`_update`): forwards from several threads take turns, each
        with its own grid, layouts and step. Not traced (`torch.compile` compiles the forward it calls on its own
        frame), so the lock works under compile too."""
        with self.session.forward_lock:
            if self.session.active:         # else `remove` ran while this forward waited for the lock: stock
                self._update(module, args, kwargs)
            return self.fn_ref.wrapped(*args, **kwargs)

    @torch.compiler.disable
    def _update(self, module, args, kwargs) -> None:
        """Record grid, branch and step; decide whether this step is sparse; prepare layouts.

        Runs eagerly, from `new_forward`: under `torch.compile(transformer)` that is the one graph break (at the
        top of the forward); the processors then read only plain flags, so steps do not recompile.
        """
        if _graph_task() != -1 and torch.is_grad_enabled() and not self.session._recomputing:
            # the whole forward rerun, recording gradients, inside a backward: activation checkpointing around the
            # transformer call (a forward that a backward hook or an adjoint method runs, without grad as backward
            # passes run, is a forward of its own). It keeps the latest forward's context and decisions (a
            # reentrant checkpoint ran that forward without grad, as a sampling step, and the rerun must attend as
            # it did), and its processors count it as a recompute, not a call (`unmanaged_recompute`)
            return
        if torch.is_grad_enabled() and self._checkpointing:
            self._wrap_checkpointing()
        session, ctx = self.session, self.session.context
        if not self._warned_replaced:
            self._warn_replaced_processors()
        session.forward_graph_task = _graph_task()
        args, kwargs = args_by_name(type(module).forward, args, kwargs)     # read below by name, not position
        found = self.grid_fn(module, args, kwargs)
        ctx.grid, ctx.text_len, ctx.text_valid = found[0], found[1], None
        ctx.text_slot = isinstance(ctx.text_len, PaddedText)
        if isinstance(ctx.text_len, PaddedText):
            # sparse and unobserved: every text token in the layout, the padded keys masked by the kernel (one shape
            # and one graph for any prompt); else each item's valid prefix (observers see what attention used)
            if session.method is not None and not session.observers:
                text, video = ctx.text_len, math.prod(ctx.grid)
                total = -(-(video + text.total) // session.method.block) * session.method.block - video \
                    if text.pad_to_tile else text.total
                ctx.text_len, ctx.text_valid = total, text.valid
            else:
                ctx.text_len = ctx.text_len.lengths()
        ctx.unsupported = found[2] if len(found) > 2 else None
        cache_ctx = getattr(self.state_manager, "_context", None)
        ctx.branch = cache_ctx.name if cache_ctx is not None else "default"
        training = self._records_gradients(module, args, kwargs)
        ctx.step, ctx.num_steps = self._step(cache_ctx, args, kwargs, training)
        ctx.sparse_step = ctx.step is None or ctx.step >= session.config.dense_step_count(ctx.num_steps)
        dense_steps = getattr(session.config, "dense_steps", 0)
        if ctx.num_steps and session.method is not None and not self._warned_all_dense \
                and session.config.dense_step_count(ctx.num_steps) >= ctx.num_steps:
            self._warned_all_dense = True
            logger.warning(
                "videosparse: dense_steps=%s covers all %d denoising steps of this call, so every step runs dense "
                "(no speedup); give fewer dense steps (an int below %d, or a fraction).", dense_steps,
                ctx.num_steps, ctx.num_steps)
        unknown_count = ctx.num_steps is None and isinstance(dense_steps, float) and dense_steps > 0
        unknown_step = ctx.step is None and dense_steps and session.method is not None
        if ctx.step is None and training and (unknown_count or unknown_step):
            if not self._warned_training:
                self._warned_training = True
                logger.warning(
                    "videosparse: dense_steps=%s applies to denoising loops; a forward that records gradients "
                    "outside one (a training step) runs sparse at any timestep (dense_layers still run dense). Pass "
                    "dense_steps=0 to say so, or give the step by `transformer.cache_context(name, step_index=..., "
                    "num_inference_steps=...)`.", dense_steps)
        elif (unknown_count or unknown_step) and not self._warned_unknown_steps:
            self._warned_unknown_steps = True
            what = ("the denoising step is unknown here (no scheduler, no cache context and no step index)"
                    if unknown_step else "the number of denoising steps, which a fraction needs, is unknown here "
                    "(no cache context gives it, and the steps are counted, not read from the pipeline's scheduler)")
            logger.warning(
                "videosparse: dense_steps=%s, but %s, so every step runs sparse. Use videosparse.apply(pipe, config) "
                "on the pipeline that runs, or pass scheduler=pipe.scheduler to videosparse.processors(...)%s.",
                dense_steps, what, "" if unknown_step else ", or give dense_steps as a step count (an int)")
        hidden = forward_arg(args, kwargs, "hidden_states", 0)
        if isinstance(hidden, (list, tuple)):       # per-item latents (Wan-Animate-2): device and dtype of the first
            hidden = hidden[0]
        if torch.is_tensor(hidden) and hidden.is_floating_point():
            device, dtype = hidden.device, hidden.dtype
        else:                                       # no hidden_states (Cosmos 3 embeds token ids): the model's own
            device, dtype = module.device, module.dtype
        dtype = session.attention_dtype_for(dtype, device)          # what attention sees
        # the layouts' index tensors are cached for later calls: made as normal tensors even under inference_mode
        # (an inference tensor saved for backward breaks a later forward that records autograd)
        with torch.inference_mode(False):
            session.prepare(ctx.grid, ctx.text_len, device, dtype)
        session.calls += 1

    def _warn_replaced_processors(self) -> None:
        """Warn once when served layers hold other processors than videosparse set (a `fuse_qkv_projections()` or
        `set_attn_processor(...)` after apply): those layers then run as set, not sparse."""
        replaced = sum(1 for module in self.session.served
                       if (m := module()) is not None and getattr(m.processor, "session", None) is not self.session)
        if replaced:
            self._warned_replaced = True
            logger.warning(
                "videosparse: %d of the %d self-attention layers it serves hold other processors than it set (replaced "
                "after videosparse.apply, e.g. by fuse_qkv_projections() or set_attn_processor()); they run as set, "
                "not sparse. Make such changes before videosparse.apply, or call videosparse.remove and apply again.",
                replaced, len(self.session.served))

    @staticmethod
    def _records_gradients(module, args, kwargs) -> bool:
        """Whether this forward records gradients: grad mode on and a parameter or the latents require grad (a
        training step; a sampling loop run without `torch.no_grad` over frozen weights records none)."""
        if not torch.is_grad_enabled():
            return False
        hidden = forward_arg(args, kwargs, "hidden_states", 0)
        if torch.is_tensor(hidden) and hidden.requires_grad:
            return True
        return any(p.requires_grad for p in module.parameters())

    def _step(self, cache_ctx, args, kwargs, training: bool = False) -> tuple[int | None, int | None]:
        """Step index and step count: from the cache context, else none for a forward that records gradients
        (`training`: a training step), else the scheduler (its own step counter, else the timestep's place in its
        schedule, or its begin index when the timestep is on no schedule entry and the scheduler has not stepped
        yet), else by counting."""
        scheduler = self.session.scheduler
        timesteps = getattr(scheduler, "timesteps", None) if scheduler is not None else None
        num_steps = getattr(cache_ctx, "num_inference_steps", None)
        if cache_ctx is not None and cache_ctx.step_index is not None:
            if num_steps is None and timesteps is not None and len(timesteps):
                num_steps = len(timesteps)
            return cache_ctx.step_index, num_steps
        if training:
            # a training step (pipelines sample under no_grad): its timestep is no place in a denoising loop, and it
            # does not move the step count of a pipeline call either
            return None, None
        t = (self.step_timestep(self._module(), args, kwargs) if self.step_timestep is not None else
             forward_arg(args, kwargs, "timestep", 1))       # (named by `_update`: the position is a fallback)
        counted = getattr(scheduler, "step_index", None)          # advanced by each scheduler.step() of this call
        if t is not None and self._other_driver(scheduler, timesteps, counted):
            return self.session.timestep_counter.step(t, self.timestep_direction), num_steps
        if num_steps is None and timesteps is not None and len(timesteps):
            num_steps = len(timesteps)
        if t is not None and timesteps is not None and len(timesteps):
            if isinstance(counted, int) and 0 <= counted < len(timesteps):
                return counted, num_steps
            iterations = self._loop_iterations()
            if iterations is not None and iterations > len(timesteps):     # more iterations than schedule entries
                return self._counted_iteration(t, iterations)
            # per-token or per-frame timesteps (Wan 2.2 TI2V, SkyReels V2 diffusion forcing) hold 0 for clean
            # conditioning frames: the noisiest entry says how far the denoising is
            t0 = torch.as_tensor(t).detach().flatten().max().cpu()
            # in t's own precision: a bf16 timestep matches its rounding of the schedule (ties: the first)
            table = timesteps.detach().cpu().to(t0.dtype) if t0.is_floating_point() else timesteps.detach().cpu()
            gap = (table.double() - float(t0)).abs()
            best = int(gap.argmin())
            if float(gap[best]) > 1e-2 * max(1.0, abs(float(table[best]))) and \
                    hasattr(scheduler, "_step_index") and counted is None:
                # the forward's timestep is not on the schedule (the Cosmos pipelines pass sigma or sigma / (sigma + 1);
                # LTX's condition pipeline gives a video conditioned whole at strength < 1 timestep 0 everywhere) and
                # the scheduler has not stepped yet in this call: the place of the timestep the pipeline is at
                # (`_current_timestep`, which most set before the forward), else its first step (its begin index, if
                # it has one; an on-schedule timestep keeps its place, for pipelines that start later in the schedule)
                current = self._pipeline_timestep()
                if current is not None:
                    gap = (table.double() - current).abs()
                    at = int(gap.argmin())
                    if float(gap[at]) <= 1e-2 * max(1.0, abs(float(table[at]))):
                        return at, num_steps
                begin = getattr(scheduler, "begin_index", None)
                return (begin if isinstance(begin, int) else 0), num_steps
            return best, num_steps
        if cache_ctx is not None:
            if t is not None and (getattr(self.session.config, "dense_steps", 0) or self.session.observers):
                # no scheduler: by timestep, which also starts again after a call that raised (reading it syncs
                # the host once a forward, so only where a dense-step schedule or an observer needs the step)
                return self.session.timestep_counter.step(t, self.timestep_direction), num_steps
            state = self.state_manager.get_state()
            state.calls += 1
            return state.calls - 1, num_steps
        return None, num_steps

    def _pipeline_timestep(self) -> float | None:
        """The applied pipeline's `_current_timestep` (the schedule entry its loop is at) as a float, or None."""
        if not self.session.made_by_apply:
            return None
        current = getattr(self.session.pipeline, "_current_timestep", None)
        if isinstance(current, bool) or not isinstance(current, (int, float, torch.Tensor)):
            return None
        if not isinstance(current, torch.Tensor):
            return float(current)
        numeric = current.is_floating_point() or current.dtype in (torch.int32, torch.int64)
        return float(current.detach().flatten().max()) if numeric and current.numel() else None

    def _loop_iterations(self) -> int | None:
        """The iterations of the applied pipeline's denoising loop as it recorded them before the loop
        (`_num_timesteps`), or None."""
        if not self.session.made_by_apply:
            return None
        iterations = getattr(self.session.pipeline, "_num_timesteps", None)
        return iterations if isinstance(iterations, int) and not isinstance(iterations, bool) and iterations > 0 \
            else None

    def _counted_iteration(self, t, iterations: int) -> tuple[int, int]:
        """Step and step count where the pipeline's loop runs more iterations than its scheduler's schedule has
        entries and steps no scheduler of its own (SkyReels V2's asynchronous diffusion forcing: frames start one
        after another, each with its own copy of the scheduler; the noisiest frame stays at the schedule's first
        entry until the last one has started, so the schedule says nothing): the loop's iteration, counted by the
        sum of the per-frame timesteps (it falls at every iteration; the guidance branches share it), of
        `iterations` (which a fractional dense_steps takes)."""
        return self.session.timestep_counter.step(torch.as_tensor(t).detach().double().sum(), -1), iterations

    def _other_driver(self, scheduler, timesteps, counted) -> bool:
        """Whether another pipeline than the one given to `apply` drives this call (one made with `from_pipe`, sharing
        the transformer with its own scheduler): the given pipeline is gone, or its scheduler has no schedule, was
        never set for a call (its table is then the training schedule), has finished its own call (a driving
        scheduler is reset by `set_timesteps` before the first forward) or holds the counter it held when a pipeline
        call last ended (`reset_state`): no call of it was running then, so that counter was left by one that ended
        early (an exception, or `_interrupt`). Such a counter cannot be told from a live one without reading the
        timestep from the device on every forward before a call ends: the first call of another pipeline after it
        reads it."""
        if not self.session.made_by_apply:
            return False                     # `processors(...)` on a bare transformer: the scheduler given, or none
        if scheduler is None or timesteps is None or not len(timesteps):
            return True
        if self._stale_counter is not None:
            # the schedule a call of the applied pipeline left, unchanged: that pipeline's next call would have set a
            # new one (`set_timesteps`) before its first forward
            scheduler_ref, timesteps_ref, stale = self._stale_counter
            if scheduler_ref() is scheduler and timesteps_ref() is timesteps and stale == counted:
                return True
        if counted is None:
            # the video schedulers set `num_inference_steps` in `set_timesteps` (FlowMatchEuler, UniPC, DPM-Solver:
            # None or absent before; Heun-like ones that preset it are taken as set, as before)
            return getattr(scheduler, "num_inference_steps", None) is None
        return isinstance(counted, int) and counted >= len(timesteps)

    def reset_state(self, module):
        # called by diffusers at the end of every pipeline call (maybe_free_model_hooks); the calling thread's counts
        with self.session.forward_lock:
            return self._reset_state(module)

    def _reset_state(self, module):
        if self.session.calls and logger.isEnabledFor(logging.INFO):     # (the summary syncs with the device)
            logger.info("pipeline call ended; since apply or reset_stats(): %s", self.session.summary())
        self.state_manager.reset()
        self.session.timestep_counter.reset()
        self._note_stale_counter()
        return module

    def _note_stale_counter(self) -> None:
        """At the end of a pipeline call (`reset_state`), where no call of the applied pipeline can be running:
        record its scheduler's counter as stale if it was left mid-schedule (or has none)."""
        self._stale_counter = None
        scheduler = self.session.scheduler if self.session.made_by_apply else None
        timesteps = getattr(scheduler, "timesteps", None)
        counted = getattr(scheduler, "step_index", None)
        # a counter left mid-schedule (an aborted call), or a schedule without a counter (CogVideoX's schedulers):
        # while it stays unchanged, another pipeline drives the calls
        stale = isinstance(counted, int) and 0 <= counted < len(timesteps) if torch.is_tensor(timesteps) else False
        no_counter = torch.is_tensor(timesteps) and not hasattr(scheduler, "step_index")
        if stale or no_counter:
            self._stale_counter = (weakref.ref(scheduler), weakref.ref(timesteps), counted)


class _ContextLink(HookFunctionReference):
    """The registry's link of the context hook: while the hook is installed its `forward` stays the hook's
    `new_forward` (`entry`). diffusers' `remove_hook` of a hook registered before ours (a cache disabled after apply)
    points the next link's `forward`, ours, at the forward that hook wrapped: here that sets the forward `new_forward`
    wraps (`original_forward`) instead, so the lock and the context stay in the chain. `release` (our removal by
    `remove_context_hook`'s pass-through) makes it a plain link to `forward`."""

    entry = None
    _forward = None

    @property
    def forward(self):
        return self.entry if self.entry is not None else self._forward

    @forward.setter
    def forward(self, fn) -> None:
        if self.entry is not None:
            self.original_forward = fn
        else:
            self._forward = fn

    @classmethod
    def adopt(cls, link: HookFunctionReference) -> "_ContextLink":
        """Turn the registry's link (its `forward` the registry's partial of `new_forward`) into this class."""
        entry = link.__dict__.pop("forward")
        link.__class__ = cls
        link.entry = entry
        return link

    @property
    def wrapped(self):
        """The forward this link leads to past `new_forward` (`forward` itself once `release`d)."""
        return self.original_forward if self.original_forward is not None else self.forward

    def release(self):
        """Make this a plain link to the forward past `new_forward` (`wrapped`), and return that forward."""
        forward = self.wrapped
        self.entry, self.original_forward, self._forward = None, None, forward
        return forward


@torch.compiler.disable
def _refuse_copy(module) -> None:
    """diffusers' hook registry wraps `forward` in closures that `copy.deepcopy` shares with the original, so a copy's
    forward would run the original's weights and session (the registry's link calls the original's `new_forward`,
    bound to the original): refuse it rather than answer wrongly."""
    raise RuntimeError(
        f"this {type(module).__name__} is a copy (copy.deepcopy) of a transformer with videosparse applied; "
        "diffusers' hooks do not survive deepcopy, so its forward would run the original's weights. Call "
        "videosparse.remove(...) on the original before copying it, then videosparse.apply(...) to each.")


def _run_untraced(fn) -> None:
    """Have Dynamo run `fn`'s own frame (not what it calls) as is, decided once per code object rather than
    converting the frame again at every call (torch.compiler.disable(recursive=False) alone reconverts it, one
    lookup per transformer forward); a no-op where this torch has no `skip_code`."""
    skip_code = getattr(getattr(torch._dynamo, "eval_frame", None), "skip_code", None)
    if skip_code is not None:
        skip_code(inspect.unwrap(fn).__code__)


_run_untraced(SparseContextHook.new_forward)
_run_untraced(_ContextLink.wrapped.fget)            # (called from new_forward's frame)


def register_context_hook(transformer: torch.nn.Module, session: SparseSession, grid_fn,
                          step_timestep=None, timestep_direction: int = 0) -> None:
    """Register the context hook in the transformer's diffusers hook registry.

    With accelerate's offload hook already on the transformer (`enable_model_cpu_offload` before `apply`), the context
    hook goes inside it, around the forward accelerate saved in `_old_forward`: after every pipeline call diffusers
    (`maybe_free_model_hooks`) removes and re-adds the offload hooks, which puts that saved forward back as `forward`
    and would drop a hook wrapped around the outside.
    """
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    hook = SparseContextHook(session, grid_fn, step_timestep, timestep_direction)
    offload = getattr(transformer, "_hf_hook", None) is not None and "_old_forward" in transformer.__dict__
    outer = transformer.__dict__.get("forward")
    if offload:
        inside = _registry_link(registry, transformer._old_forward)   # hooks 0..inside: within accelerate's
        transformer.forward = transformer._old_forward
    try:
        registry.register_hook(hook, CONTEXT_HOOK)
        _ContextLink.adopt(hook.fn_ref)
    finally:
        hook.installed_forward = transformer.__dict__.get("forward")     # the registry's wrapper around our hook
        if offload:
            transformer._old_forward = hook.installed_forward
            transformer.forward = outer
    if offload and CONTEXT_HOOK in registry.hooks:
        # the registry's order is its nesting (diffusers' remove_hook repoints the next hook's forward): hooks added
        # after the offload (a cache on the transformer) wrap accelerate's forward, which wraps ours, so ours goes before
        # them, not last (disable_cache() then pointed our hook at accelerate's forward, which calls ours: recursion)
        at = 0 if inside is None else inside + 1
        registry._hook_order.insert(at, registry._hook_order.pop())
        registry._fn_refs.insert(at, registry._fn_refs.pop())


def _registry_link(registry: HookRegistry, forward) -> int | None:
    """The index in `registry` of the hook whose wrapper `forward` is (diffusers' wrappers are partials of a closure over
    the hook's function reference), else None."""
    cells = getattr(getattr(forward, "func", None), "__closure__", None) or ()
    for i, ref in enumerate(registry._fn_refs):
        if any(cell.cell_contents is ref for cell in cells):
            return i
    return None


def _pass_through_pre(module, *args, **kwargs):
    return args, kwargs


def _pass_through_post(module, output):
    return output


def remove_context_hook(transformer: torch.nn.Module) -> bool:
    """Take the context hook out of the transformer's hook registry; returns whether `forward` was left as it is.

    When nothing wrapped the hook since it was registered, diffusers' `remove_hook` does it (and puts the forward from
    before the hook back). Otherwise something holds the registry's wrapper around it (accelerate's `_old_forward`,
    the offload hook's saved forward; a wrapper set on `forward`): the hook's link in that chain becomes a
    pass-through and leaves the registry, the references we know of (`_old_forward`, the next hook's link, its
    `original_forward` for a hook with its own `new_forward`) are pointed past it, and `forward` stays.
    """
    registry = getattr(transformer, "_diffusers_hook", None)
    hook = registry.get_hook(CONTEXT_HOOK) if registry is not None else None
    if hook is None:
        return False
    ours = getattr(hook, "installed_forward", None)
    index = registry._hook_order.index(CONTEXT_HOOK)
    last = index == len(registry._hook_order) - 1
    holder = transformer.__dict__.get("forward") if last else registry._fn_refs[index + 1].forward
    if ours is None or (holder is ours and getattr(transformer, "_old_forward", None) is not ours):
        registry.remove_hook(CONTEXT_HOOK, recurse=False)        # the one reference diffusers repoints is the only one
        return False
    link = registry._fn_refs[index]
    link.pre_forward, link.post_forward = _pass_through_pre, _pass_through_post
    before = link.release()                                     # the link calls past `new_forward` from now on
    if not last:
        nxt = registry._fn_refs[index + 1]
        if nxt.forward is ours:
            nxt.forward = before
        if getattr(nxt, "original_forward", None) is ours:     # a hook with its own new_forward keeps ours there too
            nxt.original_forward = before
    if getattr(transformer, "_old_forward", None) is ours:
        transformer._old_forward = before
    restored = transformer.__dict__.get("forward") is ours
    if restored:
        transformer.forward = before
    hook.deinitalize_hook(transformer)                           # as diffusers' remove_hook does (sic)
    del registry.hooks[CONTEXT_HOOK]
    registry._hook_order.pop(index)
    registry._fn_refs.pop(index)
    return not restored
