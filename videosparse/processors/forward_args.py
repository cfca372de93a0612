"""A transformer forward's arguments by name, whatever their position: what the context hook and the families'
grid functions read them with."""

from __future__ import annotations

import functools
import inspect


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
