"""One transformer's sparse-attention session: what `apply` attaches to it and the processors read.

`SparseSession` holds the config, the method (tile chooser), the current forward's `CallContext` (video grid, text
tokens, step, branch), one `LayerSlot` per self-attention layer (tile layouts, `LayerStats` counters, dense flag,
method state) and the observers' callbacks (given an `AttentionRecord` per call). `attention_dtype` is the dtype
attention runs in (as SDPA casts under autocast). The context hook (`context.py`) fills the context before every
forward.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..kernels.probe import probe_kernel
from ..layout import HeadTiling, head_tiling
from ..plan import HAS_TRITON
from .steps import BARE_TIMESTEP_COUNTER, ThreadTimestepCounters

logger = logging.getLogger("videosparse")

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
        self._announced: set[tuple] = set()       # the `prepare` keys of the cached layouts that `on_layout` has seen
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
        self._announced.clear()
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
                dtype: torch.dtype, sparse: bool = True) -> None:
        """Give every layer its tile layouts (index tensors on `device`) and check the kernel, once per shape.

        text_len: the valid text tokens, or one count per batch item (a layout for each distinct count).
        sparse: whether the forward may run sparse (False on a dense step): the method sees the layouts
            (`on_layout`, its warnings about them) on the first such forward of a shape, so that a call whose steps
            all run dense is not warned about a density it never uses.
        The layouts of the last `layout_cache_lengths` lengths stay cached for the grid and device, so forwards
        that alternate lengths (the guidance branches) reuse them instead of rebuilding them.
        Runs eagerly from the context hook, outside any compiled graph.
        """
        key = (grid, text_len, str(device), dtype, self.context.text_slot)
        if key != self._prepared_for:
            self._prepare(key, grid, text_len, device, dtype)
        if sparse and self.method is not None and key not in self._announced:
            for layer in range(self.info.num_layers):
                for layout in self.slot(layer).layouts.values():
                    self.method.on_layout(layer, layout)
            self._announced.add(key)

    def _prepare(self, key: tuple, grid: tuple[int, int, int], text_len: int | tuple[int, ...],
                 device: torch.device, dtype: torch.dtype) -> None:
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
                self._announced.clear()
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
        task = graph_task()
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


def graph_task() -> int:
    """The id of the autograd graph task running now (a backward pass), -1 outside one."""
    return getattr(torch._C, "_current_graph_task_id", lambda: -1)()


def _ignore_record(record: AttentionRecord) -> None:
    """An observer that does nothing (`SparseSession.recomputing`)."""
