"""The context hook: a diffusers `ModelHook` on the transformer that records each forward's context in its session.

`SparseContextHook` (registered under `CONTEXT_HOOK`) runs before every transformer forward: it reads the token grid
and text tokens through the family's grid function, the CFG branch from diffusers' `cache_context`, and the step
index (from the cache context, the scheduler, else by counting: `steps.py`), decides whether the step runs sparse and
prepares the layers' layouts (`SparseSession.prepare`). It is stateful so that diffusers' `cache_context(name,
step_index=..., num_inference_steps=...)` reaches it. `register_context_hook` / `remove_context_hook` put it in and
take it out of the transformer's hook registry exactly, also under accelerate's offload hook and caches added later.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
import weakref

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState, HookFunctionReference, StateManager

from .checkpointing import CheckpointingWithContext
from .forward_args import args_by_name, forward_arg
from .grids import PaddedText
from .session import SparseSession, graph_task

logger = logging.getLogger("videosparse")

CONTEXT_HOOK = "videosparse_context"


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


class SparseContextHook(ModelHook):
    """Records grid, step index and branch of every transformer forward into the session.

    Args:
        session: the `SparseSession` to update.
        grid_fn: (module, args, kwargs) -> ((T, H, W), text_len) for this model family, or
            ((T, H, W), text_len, reason) where a non-None reason makes the whole forward dense (`ModelSpec.grid_fn`);
            text_len an int, or a `PaddedText` (the hook turns it into the layouts' length and `text_valid`).
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
        # (scheduler, its timesteps, step_index) as weak references and a value, recorded when a pipeline call ended:
        # what the applied pipeline's scheduler held then, which no call of it is using (`_other_driver`)
        self._stale_counter: tuple | None = None

    def initialize_hook(self, module):
        self._module = weakref.ref(module)
        # the modules diffusers' `enable_gradient_checkpointing` gives a checkpointing function (the transformer)
        self._checkpointing = [m for m in module.modules() if hasattr(m, "gradient_checkpointing")]
        return module

    def deinitalize_hook(self, module):
        for owner in self._checkpointing:                    # the checkpointing functions as they were
            func = owner.__dict__.get("_gradient_checkpointing_func")
            if isinstance(func, CheckpointingWithContext):
                owner._gradient_checkpointing_func = func.inner
        return module

    def _wrap_checkpointing(self) -> None:
        """Wrap the checkpointing function of every module that checkpoints (enabled before or after `apply`)."""
        for owner in self._checkpointing:
            func = owner.__dict__.get("_gradient_checkpointing_func")
            if getattr(owner, "gradient_checkpointing", False) and callable(func) and \
                    not isinstance(func, CheckpointingWithContext):
                owner._gradient_checkpointing_func = CheckpointingWithContext(func, self.session)

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
        if graph_task() != -1 and torch.is_grad_enabled() and not self.session._recomputing:
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
        session.forward_graph_task = graph_task()
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
            session.prepare(ctx.grid, ctx.text_len, device, dtype, sparse=ctx.sparse_step)
        session.calls += 1

    def _warn_replaced_processors(self) -> None:
        """Warn once when served layers hold other processors than videosparse set (a `fuse_qkv_projections()` or
        `set_attn_processor(...)` after apply): those layers then run as set, not sparse."""
        held = [m.processor for module in self.session.served if (m := module()) is not None]
        replaced = sum(1 for proc in held if getattr(proc, "session", None) is not self.session)
        originals = {id(proc) for proc in self.session.original_processors.values()}
        if replaced and replaced == len(self.session.served) and all(id(proc) in originals for proc in held):
            self._warned_replaced = True        # `videosparse.processors(...)` without `set_attn_processor` after it
            logger.warning(
                "videosparse: none of the %d self-attention layers it serves holds its processors; each holds the one "
                "it had before (the dict videosparse.processors(transformer, config) returns was not passed to "
                "transformer.set_attn_processor(...), or the layers were set back), so every layer runs as before, "
                "not sparse. Set that dict, or use videosparse.apply(pipe, config); videosparse.remove(transformer) "
                "detaches the session.", len(self.session.served))
        elif replaced:
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
        dense_steps = getattr(self.session.config, "dense_steps", 0)
        # no scheduler: by timestep, which also starts again after a call that raised (reading it syncs the host once
        # a forward, so only where a dense-step schedule or an observer needs the step); without a cache context (a
        # pipeline that opens none, a loop of the user's own) only for a count of dense steps, which holds there
        # (a fraction needs the step count, which no such call gives; observers there count their forwards)
        counted_dense = isinstance(dense_steps, int) and dense_steps > 0       # (the configs refuse a bool)
        if t is not None and (counted_dense if cache_ctx is None else (dense_steps or self.session.observers)):
            return self.session.timestep_counter.step(t, self.timestep_direction), num_steps
        if cache_ctx is not None:
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
        early (an exception, or `_interrupt`), or the schedule was set again after the loop (Wan-Animate). Such a
        counter cannot be told from a live one without reading the timestep from the device on every forward before a
        call ends: the first call of another pipeline after it reads it."""
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
        record the schedule and counter its scheduler holds as stale (`_other_driver`)."""
        self._stale_counter = None
        scheduler = self.session.scheduler if self.session.made_by_apply else None
        timesteps = getattr(scheduler, "timesteps", None)
        # whatever the call left is stale while it stays unchanged (the applied pipeline's next call sets a new
        # schedule before its first forward): a counter left mid-schedule (an aborted call), a schedule without a
        # counter (CogVideoX's schedulers), or one set again for a next loop that never ran (Wan-Animate resets
        # its scheduler after each segment, the last included, which reads as a call about to start)
        if torch.is_tensor(timesteps) and len(timesteps):
            self._stale_counter = (weakref.ref(scheduler), weakref.ref(timesteps),
                                   getattr(scheduler, "step_index", None))


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
    if not hasattr(transformer, "_reset_stateful_cache"):
        transformer.__dict__["_reset_stateful_cache"] = _CallEndSignal(transformer)
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


class _CallEndSignal:
    """The end of every pipeline call for transformers without diffusers' `CacheMixin` (ConsisID, EasyAnimate, AnyFlow,
    Cosmos 1, Wan-Animate-2): set as the transformer's `_reset_stateful_cache` while the context hook is on, so that
    diffusers' `maybe_free_model_hooks`, which calls that on each component that has it, reaches the hook's
    `reset_state` as it does on the other families (the step count restarts, the applied pipeline's schedule is
    known stale). It resets only the context hook, not other stateful hooks, which stock would not reset there."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self._transformer = weakref.ref(transformer)

    def __call__(self, recurse: bool = True) -> None:
        transformer = self._transformer()
        registry = getattr(transformer, "_diffusers_hook", None) if transformer is not None else None
        hook = registry.get_hook(CONTEXT_HOOK) if registry is not None else None
        if hook is not None:
            hook.reset_state(transformer)


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
    if isinstance(transformer.__dict__.get("_reset_stateful_cache"), _CallEndSignal):
        del transformer.__dict__["_reset_stateful_cache"]
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
