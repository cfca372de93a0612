"""Checks of single values that configs, layouts, plans and helper kernels share.

Each check raises a `ValueError` naming the field, the value and what is allowed (or returns the value in a plain
Python type). Numpy and 0-dim torch integers count as ints wherever an int is asked for; bools never do. Imports
nothing from the rest of the package (and no torch), so that `videosparse.config` can use it.
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
from collections.abc import Sequence
from typing import Any

TileShape = tuple[int, int, int]

#: the words a bool setting takes as text (a method spec's `correction=off`, a distill flag's `--resume no`): any case
BOOL_WORDS = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def is_int(value: Any) -> bool:
    """An integer-like value (int, a numpy integer: any `numbers.Integral`), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_scalar(value: Any) -> Any:
    """A 0-dim torch tensor or numpy array as the Python number it holds; anything else as it is."""
    return value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value


def plain_numbers(obj: Any, names: tuple[str, ...]) -> None:
    """In the fields `names` of the (frozen) dataclass `obj`, numpy / torch scalars become Python int / float (so
    that checks, `to_dict` and JSON see plain numbers); bools and non-numbers are left for the field checks to
    reject."""
    for name in names:
        value = as_scalar(getattr(obj, name))
        if not isinstance(value, bool) and type(value) not in (int, float) and isinstance(value, numbers.Real):
            value = int(value) if isinstance(value, numbers.Integral) else float(value)
        object.__setattr__(obj, name, value)


def int_at_least(value: Any, low: int, name: str, what: str | None = None) -> int:
    """`value` as a Python int >= low (numpy and 0-dim torch integers taken; floats and bools refused), or a
    ValueError naming it ("<name>=<value> must be an int >= <low> (<what>).")."""
    try:
        value_int = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        value_int = None
    if value_int is None or value_int < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}{f' ({what})' if what else ''}.")
    return value_int


def check_block(name: str, value: Any) -> None:
    """ValueError unless `value` is a positive Python int (tokens per tile, as a kernel takes it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int (tokens per tile).")


def check_density(name: str, value: Any, what: str | None = None) -> float:
    """`value` as a Python float in (0, 1], or a ValueError naming it (`what` says what the fraction counts). Takes
    any real number (numpy and 0-dim torch ones too), no bool."""
    value = as_scalar(value)
    # (compared as it is: float() of an int past the float range raises OverflowError)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"{name}={value!r} must be a number in (0, 1]{f' ({what})' if what else ''}.")
    return float(value)


def check_finite(name: str, value: Any, minimum: float | None = None, *, strict: bool = False,
                 optional: bool = False, what: str | None = None) -> None:
    """ValueError unless `value` is a finite int or float within the float range (an int past it is refused: a float
    of it would overflow), >= minimum (> minimum when `strict`) when one is given; None passes when `optional`."""
    if optional and value is None:
        return
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and (math.isfinite(value) if isinstance(value, float) else abs(value) <= sys.float_info.max)
          and (minimum is None or (value > minimum if strict else value >= minimum)))
    if not ok:
        bound = " within the float range" if minimum is None else f" {'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"{name}={value!r} must be a finite number{bound}{f' ({what})' if what else ''}"
                         f"{' or None' if optional else ''}.")


def int_triple(values: Any) -> TileShape | None:
    """`values` as three Python ints (a tuple, list or 1-D array of ints, numpy or 0-dim torch integers; a float such
    as 2.7 is refused, not truncated, and so is a bool), or None when it is not three integers."""
    if isinstance(values, (str, bytes)) or not (isinstance(values, Sequence) or getattr(values, "ndim", None) == 1):
        return None
    try:
        if len(values) != 3 or any(isinstance(v, bool) for v in values):
            return None
        return tuple(operator.index(v) for v in values)  # type: ignore[return-value]
    except TypeError:
        return None


def check_tile(tile: Any, block: int, name: str | None = None) -> TileShape:
    """`tile` as the (pt, ph, pw) of three positive ints with pt*ph*pw == block, or a ValueError naming it (as
    `name=<tile>` when a field name is given, else as "tile shape <tile>")."""
    subject = f"tile shape {tile!r}" if name is None else f"{name}={tile!r}"
    shape = int_triple(tile)
    if shape is None or min(shape) < 1:
        raise ValueError(f"{subject} must be three positive ints (pt, ph, pw).")
    if math.prod(shape) != block:
        raise ValueError(f"{subject} has pt*ph*pw = {math.prod(shape)}, but the block size is {block}: a tile shape is "
                         f"three positive ints whose product equals block={block}.")
    return shape


def one_per_head(tiles: Any, num_heads: int) -> list:
    """One tile shape (pt, ph, pw) for every head, or one per head, as a list of `num_heads` shapes: each a tuple of
    Python ints where it is three ints, else as given (for the caller's own check to name); a ValueError when the
    count of shapes is not the number of heads."""
    one = int_triple(tiles)
    if one is not None:
        return [one] * num_heads
    per_head = [int_triple(t) or t for t in tiles]
    if len(per_head) != num_heads:
        raise ValueError(f"tiling names {len(per_head)} tile shapes but the layer has {num_heads} heads.")
    return per_head


def bool_word(text: str) -> bool:
    """A bool written as text: true/false, on/off, yes/no or 1/0 in any case (spaces around ignored); else a
    ValueError naming the words."""
    word = text.strip().lower()
    if word not in BOOL_WORDS:
        raise ValueError(f"{text!r} is not a bool; use true or false (also on/off, yes/no, 1/0; any case).")
    return BOOL_WORDS[word]
