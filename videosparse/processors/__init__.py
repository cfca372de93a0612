"""diffusers integration: `apply` / `remove`, the processors, and observation of attention inputs.

    videosparse.apply(pipe, videosparse.VedaConfig(density=0.1))    # every transformer of the pipeline
    videosparse.remove(pipe)                                        # exact original processors and hooks

or, diffusers-native (this also attaches the context hook; `remove` undoes both):

    pipe.transformer.set_attn_processor(videosparse.processors(pipe.transformer, cfg))

The module itself is callable: `videosparse.processors(transformer, config)` is `make_processors`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
import types
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

from ..config import DenseConfig
from .base import register_layer_skip
from .context import register_context_hook, remove_context_hook
from .registry import check_config, make_method, model_info, model_spec, register_model
from .session import AttentionRecord, SparseSession

logger = logging.getLogger("videosparse")

SESSION_ATTR = "_videosparse_session"
# Under torch.compile each new video grid (resolution, frame count) or batch shape adds up to four variants of the
# compiled forward or repeated block (dense and sparse steps, Sol's calibration call, dense layers) where stock adds at
# most one; at Dynamo's default recompile limit of 8 the third or fourth shape ran eagerly from then on (with a
# warning), or raised under fullgraph=True. `apply` raises the limit to this (never lowers it; a global setting).
MIN_RECOMPILE_LIMIT = 64
_SNAPSHOT_ATTR = "_videosparse_snapshot"

__all__ = ["apply", "remove", "make_processors", "observe", "sessions", "register_model", "AttentionRecord",
           "self_attention_processors", "attention_processors"]


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside `torch.compile`'s wrapper (OptimizedModule), else the module itself: processors,
    hooks and the session live on the real transformer, so apply/remove work before or after compiling."""
    while type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None),
                                                                  torch.nn.Module):
        module = module._orig_mod
    return module


def _transformers(obj) -> dict[str, torch.nn.Module]:
    """The transformers of a pipeline (transformer, transformer_2, ...) or the module itself, unwrapped
    from torch.compile's wrapper; empty for a pipeline whose transformer slots are all None (not loaded)."""
    return _transformer_slots(obj)[0]


def _transformer_slots(obj) -> tuple[dict[str, torch.nn.Module], list[str]]:
    """(`_transformers(obj)`, the names of the pipeline's transformer slots that hold None: not loaded)."""
    if isinstance(obj, torch.nn.Module):
        return {"transformer": _unwrap(obj)}, []
    components = getattr(obj, "components", None)
    if not isinstance(components, dict):
        raise TypeError(
            f"expected a diffusers pipeline or a transformer module, got {type(obj).__name__}."
        )
    found: dict[str, torch.nn.Module] = {}
    for name, comp in components.items():
        if name.startswith("transformer") and isinstance(comp, torch.nn.Module):
            module = _unwrap(comp)
            if all(module is not seen for seen in found.values()):   # one module in two slots: served once
                found[name] = module
    unloaded = sorted(name for name, comp in components.items() if name.startswith("transformer") and comp is None)
    if not found and not unloaded:
        raise ValueError(f"pipeline {type(obj).__name__} has no transformer component "
                         f"(components: {sorted(components)}).")
    return found, unloaded


def _is_modular(pipeline) -> bool:
    """Whether `pipeline` is a diffusers `ModularPipeline` (whose blocks expect each component they name)."""
    try:
        from diffusers.modular_pipelines import ModularPipeline
    except ImportError:
        return False
    return isinstance(pipeline, ModularPipeline)


def _are_not_loaded(names: list[str]) -> str:
    return f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} not loaded (None)"


def _and_unloaded(names) -> str:
    """For an error about the served transformers: the slots left out because they hold None, if any."""
    return f"; its {_are_not_loaded(list(names))}: load it or leave it out" if names else ""


def make_processors(transformer: torch.nn.Module, config, *, scheduler=None, pipeline=None,
                    name: str | None = None) -> dict[str, Any]:
    """Sparse processors for every self-attention layer of `transformer` (others stay as they are).

    Also attaches the context hook and the session to the transformer, so the returned dict is
    ready for `transformer.set_attn_processor(...)`; `videosparse.remove(transformer)` undoes it.

    Args:
        transformer: a supported diffusers transformer (e.g. `WanTransformer3DModel`).
        config: `VedaConfig`, `SolConfig` or `DenseConfig`.
        scheduler: the pipeline's scheduler, used to find the step index when the pipeline gives none.
        pipeline: the pipeline (held weakly) whose current `scheduler` is read at every forward instead.
        name: the transformer's component name in its pipeline, for error messages.

    Returns:
        dict of processor name -> processor, for `set_attn_processor`.
    """
    transformer = _unwrap(transformer)
    spec = model_spec(transformer)
    active = getattr(transformer, SESSION_ATTR, None)
    if active is not None:
        raise ValueError(
            f"videosparse is already applied to this {type(transformer).__name__} with {active.config!r}; "
            "call videosparse.remove(...) first."
        )
    originals = dict(attention_processors(transformer))
    self_attn = self_attention_processors(transformer)
    info = model_info(transformer, spec, len(self_attn))
    beyond = [layer for layer in getattr(config, "dense_layers", ()) if layer >= len(self_attn)]
    if beyond:
        where = f" ({name})" if name else ""
        raise ValueError(f"dense_layers={config.dense_layers!r} names layers {beyond}, but this "
                         f"{type(transformer).__name__}{where} has {len(self_attn)} self-attention layers "
                         f"(0..{len(self_attn) - 1}).")
    try:
        method = make_method(config, info)
    except ValueError as err:
        if name is None:
            raise
        raise ValueError(f"{name}: {err}") from None        # which transformer of the pipeline refused it
    distilled_from = getattr(getattr(method, "estimator", None), "component", None)
    if name is not None and distilled_from is not None and distilled_from != name:
        # two experts of one pipeline (Wan 2.2) share the class and sizes, not their attention
        raise ValueError(f"the estimator {getattr(method.estimator, 'source', None) or ''} was distilled from "
                         f"{distilled_from!r}, not {name!r}; give each transformer its own, e.g. videosparse.apply("
                         f"pipe, {{{distilled_from!r}: VedaConfig(estimator=...), {name!r}: VedaConfig(...)}}).")
    session = SparseSession(config, method, info, originals, scheduler, pipeline)
    procs = dict(originals)
    custom = {}                                  # processors the user set in place of the stock ones -> stock
    modules = dict(transformer.named_modules())
    for layer, proc_name in enumerate(self_attn):
        procs[proc_name] = spec.processor_cls(session, layer, originals[proc_name])
        register_layer_skip(type(procs[proc_name]))
        session.served.append(weakref.ref(modules[proc_name.rsplit(".processor", 1)[0]]))
        stock = type(procs[proc_name])._stock
        if type(originals[proc_name]) is not stock:
            custom[type(originals[proc_name]).__name__] = stock.__name__
    if custom:
        logger.warning("%s%s: self-attention layers hold %s in place of diffusers' stock %s that videosparse builds "
                       "on; videosparse's processors take their place (their own behaviour is not kept) until "
                       "videosparse.remove(), which puts them back.", type(transformer).__name__,
                       f" ({name})" if name else "", ", ".join(sorted(custom)), ", ".join(sorted(set(custom.values()))))
    _attach(transformer, session, spec)
    return procs


def self_attention_processors(transformer: torch.nn.Module) -> list[str]:
    """Names (in `attn_processors`) of the self-attention layers videosparse serves, in layer order."""
    transformer = _unwrap(transformer)
    spec = model_spec(transformer)
    modules = dict(transformer.named_modules())
    return [n for n in attention_processors(transformer)
            if spec.is_self_attention(n.rsplit(".processor", 1)[0], modules[n.rsplit(".processor", 1)[0]])]


def attention_processors(transformer: torch.nn.Module) -> dict[str, Any]:
    """Every attention processor of `transformer`, by "<module name>.processor", in module order.

    diffusers' `attn_processors` where the model has it; otherwise (Mochi: neither `MochiTransformer3DModel` nor
    `MochiAttention` has diffusers' processor accessors) the `processor` attribute of every module holding one.
    """
    transformer = _unwrap(transformer)
    if hasattr(transformer, "attn_processors"):
        return transformer.attn_processors
    return {f"{name}.processor": module.processor for name, module in transformer.named_modules()
            if name and "processor" in vars(module)}


def _set_attention_processors(transformer: torch.nn.Module, procs: dict[str, Any]) -> None:
    """Set every processor of `attention_processors(transformer)` from `procs` (same names)."""
    if hasattr(transformer, "set_attn_processor"):
        transformer.set_attn_processor(procs)
        return
    current = attention_processors(transformer)
    if set(procs) != set(current):
        raise ValueError(f"{len(procs)} processors were given for the {len(current)} attention layers of "
                         f"{type(transformer).__name__}; give one for each of {sorted(current)}.")
    modules = dict(transformer.named_modules())
    for name, proc in procs.items():
        modules[name.rsplit(".processor", 1)[0]].processor = proc


# the sessions applied and not removed (a transformer dropped without `remove` drops its session from the set)
_LIVE_SESSIONS: "weakref.WeakSet[SparseSession]" = weakref.WeakSet()
_LIVE_SESSIONS_LOCK = threading.Lock()      # apply / remove in other threads change the set while one reads it


def _attach(transformer: torch.nn.Module, session: SparseSession, spec) -> None:
    snapshot = {
        "had_registry": hasattr(transformer, "_diffusers_hook"),
        "had_forward_attr": "forward" in transformer.__dict__,
    }
    register_context_hook(transformer, session, spec.grid_fn, spec.step_timestep, spec.timestep_direction)
    setattr(transformer, SESSION_ATTR, session)
    setattr(transformer, _SNAPSHOT_ATTR, snapshot)
    with _LIVE_SESSIONS_LOCK:
        _LIVE_SESSIONS.add(session)


def _release_module_caches() -> None:
    """Empty the module-level tensor caches the sparse path shares between sessions (work orders, top-k constants,
    counter increments: up to ~30 MB on the device of the last forward at Wan 14B sizes) once no session is
    applied, so that `remove` frees what videosparse holds."""
    from .. import plan
    from .session import _INCREMENTS

    # a session whose transformer is gone serves nothing, even while its caller keeps it (for its stats)
    with _LIVE_SESSIONS_LOCK:
        live = list(_LIVE_SESSIONS)
    if not any(session.active and any(ref() is not None for ref in session.served) for session in live):
        for cache in (plan._ORDERS, plan._TOPK_CONSTANTS, _INCREMENTS):
            cache.clear()


def _detach(transformer: torch.nn.Module) -> None:
    snapshot = transformer.__dict__.pop(_SNAPSHOT_ATTR, {})
    wrapped_since = remove_context_hook(transformer)               # forward wrapped after apply: it stays
    registry = getattr(transformer, "_diffusers_hook", None)
    others = registry is not None and bool(registry.hooks)      # hooks registered by others stay, forward too
    if not snapshot.get("had_registry", True) and registry is not None and not others:
        del transformer._diffusers_hook
    if not snapshot.get("had_forward_attr", True) and not others and not wrapped_since:
        transformer.__dict__.pop("forward", None)
    transformer.__dict__.pop(SESSION_ATTR, None)


def apply(pipe_or_transformer, config) -> dict[str, SparseSession]:
    """Swap the self-attention of every transformer of a pipeline for videosparse's.

    Args:
        pipe_or_transformer: a diffusers pipeline (every `transformer*` component is served, e.g.
            Wan 2.2's `transformer_2`) or a bare transformer module.
        config: `VedaConfig`, `SolConfig` or `DenseConfig`; or a dict of them by component name, one for each
            transformer (Wan 2.2's experts each with the estimator distilled from it: {"transformer":
            VedaConfig(estimator=...), "transformer_2": VedaConfig(estimator=...)}). One Veda config with an
            estimator that records its component serves that transformer with it and the others untrained.

    Returns:
        dict component name -> `SparseSession` (its `.stats()` gives realised density per layer).

    Raises:
        ValueError: unsupported transformer class (the error lists the supported ones), already applied, a dict that
            does not name each transformer of the pipeline, or an estimator given to another transformer than the
            one it was distilled from.
        TypeError: `config` is not a videosparse config (nor a dict of them).

    Example:
        >>> import torch, videosparse
        >>> from diffusers import WanPipeline
        >>> pipe = WanPipeline.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", dtype=torch.bfloat16) # doctest: +SKIP
        >>> sessions = videosparse.apply(pipe, videosparse.VedaConfig(density=0.1))     # doctest: +SKIP
        >>> video = pipe("a cat surfing", num_frames=81).frames[0]                     # doctest: +SKIP
        >>> videosparse.remove(pipe)                                                   # doctest: +SKIP
    """
    transformers, unloaded = _transformer_slots(pipe_or_transformer)
    if not transformers:
        raise ValueError(f"pipeline {type(pipe_or_transformer).__name__}'s {_are_not_loaded(unloaded)}; load it "
                         "first (a modular pipeline: pipe.load_components() or pipe.update_components("
                         "transformer=...)), then apply.")
    pipeline = pipe_or_transformer if hasattr(pipe_or_transformer, "scheduler") else None
    several = len(transformers) > 1
    configs = _configs_by_component(config, transformers, unloaded)
    for name, transformer in transformers.items():  # check everything before touching anything
        model_spec(transformer)
        active = getattr(transformer, SESSION_ATTR, None)
        if active is not None:
            raise ValueError(f"videosparse is already applied to {name} with {active.config!r}; call remove() first.")
    for cfg in configs.values():
        check_config(cfg)
    applied: list[torch.nn.Module] = []
    try:
        for name, transformer in transformers.items():
            procs = make_processors(transformer, configs[name], pipeline=pipeline, name=name if several else None)
            applied.append(transformer)
            _keep_through_unfuse(transformer, procs)
            _set_attention_processors(transformer, procs)     # (diffusers' set_attn_processor empties the dict)
        made = [getattr(t, SESSION_ATTR) for t in transformers.values()]
        for session in made[1:]:        # experts that take turns in one call (Wan 2.2) count its steps together
            session.timestep_counter = made[0].timestep_counter
        _raise_recompile_limit()
    except BaseException:
        for transformer in applied:
            _restore(transformer)
        raise
    if several:
        _warn_tilings_of_other_components(transformers)
    if unloaded and _is_modular(pipe_or_transformer):   # (a standard pipeline's transformer_2=None is for good)
        logger.warning("videosparse: %s's %s: only %s served; one loaded later runs stock attention until "
                       "videosparse.remove(pipe) and apply again.", type(pipe_or_transformer).__name__,
                       _are_not_loaded(unloaded), ", ".join(transformers))
    return {name: getattr(t, SESSION_ATTR) for name, t in transformers.items()}


def _warn_tilings_of_other_components(transformers: dict[str, torch.nn.Module]) -> None:
    """A warning for each transformer served with a tiling file searched on another component of its pipeline (the
    tile shapes fit: Wan 2.2's experts share class and sizes, not their attention)."""
    for name, transformer in transformers.items():
        tiling = getattr(getattr(transformer, SESSION_ATTR).method, "tiling", None)
        searched = getattr(tiling, "searched_component", None)
        if searched is not None and searched != name:
            path = getattr(transformer, SESSION_ATTR).config.tiling
            logger.warning("videosparse: %s uses the tiling file %r searched on %s; its tile shapes fit, but were "
                           "chosen for %s's attention. A tiling of its own: videosparse search-tiling --component %s, "
                           "then a config by component, videosparse.apply(pipe, {%r: VedaConfig(tiling=...), ...}).",
                           name, str(path), searched, searched, name, name)


def _configs_by_component(config, transformers: dict[str, torch.nn.Module], unloaded=()) -> dict[str, Any]:
    """`apply`'s config for each transformer: the one config for all, or a dict's by component name (naming every
    transformer: the experts of one pipeline count their denoising steps together, so each gets the context hook;
    `DenseConfig()` keeps one dense). One Veda config whose estimator (or each of whose tuple of estimators) records
    the component it was distilled from, on a pipeline of several transformers: each such component gets its
    estimator, the others the same config scoring their tiles untrained (a warning says so)."""
    if not isinstance(config, Mapping):
        estimators = getattr(config, "estimator", None)
        several = isinstance(estimators, tuple)
        if estimators is None or (len(transformers) == 1 and not several):
            return {name: config for name in transformers}
        from ..veda.estimator import (distilled_component, estimator_label, estimators_by_component,
                                      records_no_component)

        if len(transformers) == 1:
            raise ValueError(f"estimator={estimator_label(estimators)} names {len(estimators)} estimators, one per "
                             f"transformer of a pipeline; this one has one transformer ({next(iter(transformers))}"
                             f"{_and_unloaded(unloaded)}): give it its one estimator.")
        check_config(config)
        if not several and distilled_component(estimators) is None:   # saved before estimators recorded it: all
            if records_no_component(estimators):     # (not one that is not there: its loading says so)
                logger.warning("videosparse: the estimator %s records no component (saved before estimators "
                               "recorded the one they were distilled from), so it serves every transformer: %s. One "
                               "estimator per transformer: VedaConfig(estimator=(%s)), or a dict of configs by "
                               "component.", estimator_label(estimators), ", ".join(transformers),
                               ", ".join(f"<{name}'s>" for name in transformers))
            return {name: config for name in transformers}
        # (its config.json: the weights load once, per transformer)
        served = estimators_by_component(estimators if several else (estimators,), list(transformers))
        others = [name for name in transformers if name not in served]
        if others:
            logger.warning("videosparse: the estimator%s serve%s %s (distilled from %s); %s score their tiles "
                           "untrained (mean-pooled q.k). One estimator per transformer: VedaConfig(estimator=(%s)).",
                           "s" if len(served) > 1 else "", "" if len(served) > 1 else "s", ", ".join(served),
                           "them" if len(served) > 1 else "it", ", ".join(others),
                           ", ".join(f"<{name}'s>" for name in transformers))
        return {name: config if served.get(name) is estimators else
                dataclasses.replace(config, estimator=served.get(name)) for name in transformers}
    for value in config.values():
        try:
            check_config(value)
        except TypeError:
            raise TypeError(f"config is a dict holding {value!r}, which is not a videosparse config; give a "
                            "VedaConfig, SolConfig or DenseConfig, or a dict of them by component name (a config's "
                            "to_dict() is read back by videosparse.config.config_from_dict).") from None
    if set(config) != set(transformers):
        raise ValueError(f"config names the components {sorted(map(str, config))}; give one config for each "
                         f"transformer of this pipeline, {sorted(transformers)}{_and_unloaded(unloaded)} (DenseConfig() "
                         "keeps one dense).")
    return {name: config[name] for name in transformers}


def _raise_recompile_limit() -> None:
    """Dynamo's per-code-object recompile limit to at least `MIN_RECOMPILE_LIMIT` (see there)."""
    dynamo_config = torch._dynamo.config
    if dynamo_config.recompile_limit < MIN_RECOMPILE_LIMIT:
        logger.info("videosparse: torch._dynamo.config.recompile_limit %d -> %d (each new video shape compiles up to 4 "
                    "variants)", dynamo_config.recompile_limit, MIN_RECOMPILE_LIMIT)
        dynamo_config.recompile_limit = MIN_RECOMPILE_LIMIT
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit,
                                                        4 * MIN_RECOMPILE_LIMIT)


def _keep_through_unfuse(transformer: torch.nn.Module, procs: dict[str, Any]) -> None:
    """After a `fuse_qkv_projections()` that saved the processors (CogVideoX: `original_attn_processors`, which
    `unfuse_qkv_projections()` puts back), each saved entry of a served layer becomes a twin of videosparse's
    processor there (same session and layer) that `remove` turns back into the saved one (`restores_to`): unfused
    while applied, the layers stay sparse, and removed, they are stock and unfused."""
    saved = getattr(transformer, "original_attn_processors", None)
    if not isinstance(saved, dict):
        return
    for name, proc in procs.items():
        if getattr(proc, "session", None) is not None and name in saved:
            twin = type(proc)(proc.session, proc.layer, saved[name])
            twin.restores_to = saved[name]
            saved[name] = twin


def _restore(transformer: torch.nn.Module) -> SparseSession | None:
    session = getattr(transformer, SESSION_ATTR, None)
    if session is None:
        return None
    with session.forward_lock:          # after a forward in flight in another thread
        return _restore_locked(transformer, session)


def _restore_locked(transformer: torch.nn.Module, session: SparseSession) -> SparseSession:
    session.active = False
    saved = getattr(transformer, "original_attn_processors", None)
    if isinstance(saved, dict):       # a fuse's saved processors (before or after apply): videosparse's leave them
        for name, proc in saved.items():
            if getattr(proc, "session", None) is session:
                saved[name] = getattr(proc, "restores_to", session.original_processors.get(name))
    current = attention_processors(transformer)
    restored = dict(current)
    for name, original in session.original_processors.items():
        mine = current.get(name)
        if getattr(mine, "session", None) is not session:
            continue        # not a layer we serve, or a processor set since apply by someone else: it stays
        original = getattr(mine, "restores_to", original)      # a twin an unfuse put back: the unfused processor
        # a backend or context-parallel config set while applied (set_attention_backend) stays set
        for attr in ("_attention_backend", "_parallel_config"):
            if hasattr(original, attr) and getattr(mine, attr, None) is not getattr(original, attr):
                setattr(original, attr, getattr(mine, attr, None))
        restored[name] = original
    _set_attention_processors(transformer, restored)
    _detach(transformer)
    session.release()
    with _LIVE_SESSIONS_LOCK:
        _LIVE_SESSIONS.discard(session)
    _release_module_caches()
    return session


def remove(pipe_or_transformer) -> dict[str, SparseSession]:
    """Restore the original processors and hooks of every transformer `apply` touched.

    Only what `apply` put there is taken out: a processor set on a layer since `apply`, a diffusers hook registered
    since (a cache) and a wrapper put on `forward` since (accelerate's offload hook) stay.

    Returns the removed sessions (their statistics stay readable); transformers without videosparse
    are left alone.
    """
    removed = {}
    for name, transformer in _transformers(pipe_or_transformer).items():
        session = _restore(transformer)
        if session is not None:
            removed[name] = session
    return removed


def sessions(pipe_or_transformer) -> dict[str, SparseSession]:
    """The active `SparseSession` of every transformer (empty when videosparse is not applied)."""
    return {
        name: getattr(t, SESSION_ATTR)
        for name, t in _transformers(pipe_or_transformer).items() if hasattr(t, SESSION_ATTR)
    }


@contextlib.contextmanager
def observe(pipe_or_transformer, callback: Callable[[AttentionRecord], None]) -> Iterator[None]:
    """Call `callback(record)` with the post-RoPE q, k, v of every self-attention call inside the block.

    Works on top of an applied config; without one, dense processors (`DenseConfig`) are applied for
    the duration of the block and removed afterwards (a config the block itself applied in their place, after a
    `remove`, stays applied).

    Raises:
        TypeError: `callback` is not callable.
        ValueError: videosparse is applied to some transformers of the pipeline and not to others (their calls
            would go unobserved).
    """
    if not callable(callback):
        raise TypeError(f"callback={callback!r} must be a callable taking an AttentionRecord.")
    found = sessions(pipe_or_transformer)
    missing = sorted(set(_transformers(pipe_or_transformer)) - set(found))
    if found and missing:
        raise ValueError(f"observe: videosparse is applied to {sorted(found)} but not to {missing}, whose calls would "
                         "go unobserved; apply it to every transformer (videosparse.apply(pipe, ...)) or to none.")
    applied_here = not found
    if applied_here:
        apply(pipe_or_transformer, DenseConfig())
    active = list(sessions(pipe_or_transformer).values())
    for session in active:
        session.observers.append(callback)
    try:
        yield
    finally:
        for session in active:
            session.observers.remove(callback)
        if applied_here:
            for transformer in _transformers(pipe_or_transformer).values():
                if any(getattr(transformer, SESSION_ATTR, None) is session for session in active):
                    _restore(transformer)


class _CallableModule(types.ModuleType):
    def __call__(self, transformer, config, **kwargs):
        return make_processors(transformer, config, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
