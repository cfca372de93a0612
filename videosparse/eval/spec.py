"""Method specs: one compact string per cell of an evaluation grid, mapped onto the configs.

Grammar (no spaces)::

    SPEC  := NAME ['@' DENSITY] (':' KEY '=' VALUE)*
    NAME  := dense | veda | sol

`@DENSITY` is the config's `density`; every `KEY=VALUE` sets one field of the config
(`VedaConfig`, `SolConfig`; `DenseConfig` takes none). Values are read by field:

=================  =====================================================================
field              value
=================  =====================================================================
density, tau       float
block, band        int
dense_steps        int (a step count, ``3``) or float (a fraction of the steps, ``0.2``)
dense_layers       comma-separated layer indices, ``0,1,29``
correction         on/off (also true/false, yes/no, 1/0)
tiling             ``PTxPHxPW`` (e.g. ``8x4x4``) or the path of a tiling JSON
estimator          a directory or hub id; several comma-separated, one per transformer (Wan 2.2's experts)
backend            auto / triton / reference / gluon_hopper / hopper / triton_generic
=================  =====================================================================

Examples::

    dense                         the reference arm (DenseConfig)
    veda@0.5                      VedaConfig(density=0.5)
    veda@0.1:dense_steps=0.2      10% of the key tiles, the first 20% of the steps dense
    sol@0.15:band=0:correction=off
    sol:tau=1.5                   Sol with a fixed threshold instead of a target density
    veda@0.1:tiling=8x4x4:estimator=runs/veda-est

`veda` without a density uses 0.1 and `sol` without density or tau uses 0.15 (as the CLI does).
Config validation errors (a density of 2, a tile of the wrong size) surface with the spec named.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..config import (CONFIG_CLASSES, DEFAULT_DENSITY, DenseConfig, SolConfig, VedaConfig, parse_dense_steps,
                      parse_layers, parse_tile)
from ..validation import BOOL_WORDS, bool_word

_NAME_RE = re.compile(r"^(?P<name>[a-z]+)(@(?P<density>[^:]+))?(?P<rest>(:.*)?)$")


@dataclass(frozen=True)
class MethodSpec:
    """One method of an evaluation grid.

    Attributes:
        label: the spec text as given (whitespace removed); names the method in tables and plots.
        config: the `DenseConfig` / `VedaConfig` / `SolConfig` it stands for.
    """

    label: str
    config: Any

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def is_dense(self) -> bool:
        return isinstance(self.config, DenseConfig)

    @property
    def density(self) -> float:
        """Nominal density (1.0 for dense; Sol with a fixed tau has none and reports nan)."""
        if self.is_dense:
            return 1.0
        value = getattr(self.config, "density", None)
        return float(value) if value is not None else float("nan")

    @property
    def family(self) -> str:
        """The label without its density, its other items sorted: the methods that one quality-vs-density line
        joins ('veda:density=0.1:block=64' and 'veda@0.3:block=64' are one family)."""
        return label_family(self.label)


def label_family(label: str) -> str:
    """A spec label without its density, its other items sorted (`MethodSpec.family`)."""
    head, _, rest = label.partition(":")
    name = head.split("@", 1)[0]
    items = sorted(item for item in rest.split(":") if item and not item.startswith("density="))
    return ":".join([name, *items])


_FORMS = {"density": "a number in (0, 1]", "tau": "a number (standard deviations)", "block": "an int (128 or 64)",
          "band": "an int >= 0", "correction": f"one of {'/'.join(BOOL_WORDS)}",
          "estimator": "a directory or hub id, or several separated by single commas (one per transformer)"}


def _parse_value(key: str, text: str, spec: str) -> Any:
    try:
        if key in ("density", "tau"):
            return float(text)
        if key in ("block", "band"):
            return int(text)
        if key == "dense_steps":
            return parse_dense_steps(text)
        if key == "dense_layers":
            return parse_layers(text)
        if key == "correction":
            return bool_word(text)
        if key == "tiling":
            return parse_tile(text)
        if key == "estimator" and "," in text and not os.path.isdir(text):      # one per transformer (a folder
            if not all(text.split(",")):                                        # whose name holds a comma is one)
                raise ValueError
            return tuple(text.split(","))
    except ValueError as e:
        form = _FORMS.get(key, str(e).rstrip("."))
        raise ValueError(f"method spec {spec!r}: {key}={text!r} is not a valid value for {key}: {form}.") from None
    return text


def parse_method_spec(text: str, *, backend: str | None = None) -> MethodSpec:
    """Parse one method spec (see the module docstring for the grammar).

    Args:
        text: e.g. "veda@0.1:dense_steps=0.2".
        backend: kernel backend for specs that do not set `backend=` themselves (None keeps the
            config's default, "auto").

    Returns:
        `MethodSpec(label, config)`.

    Raises:
        ValueError: unknown method or field, a malformed item, or a value the config rejects.

    Example:
        >>> spec = parse_method_spec("sol@0.2:band=0")
        >>> spec.config == SolConfig(density=0.2, band=0)
        True
        >>> spec.config.block, spec.config.tile_shape, spec.config.dense_steps       # the config's defaults
        (128, (4, 4, 8), 0.2)
    """
    # blanks around the separators go; inside a value (a path with a space) they stay
    spec = re.sub(r"\s*([:=@])\s*", r"\1", str(text).strip())
    m = _NAME_RE.match(spec)
    if not spec or m is None:
        raise ValueError(f"method spec {text!r} is malformed; expected NAME[@DENSITY][:KEY=VALUE...], e.g. 'veda@0.1'.")
    name = m.group("name")
    if name not in CONFIG_CLASSES:
        raise ValueError(f"method spec {text!r}: method {name!r} is not known; choose one of {sorted(CONFIG_CLASSES)}.")
    cls = CONFIG_CLASSES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    if m.group("density") is not None:
        if "density" not in fields:
            raise ValueError(f"method spec {text!r}: {name} takes no density.")
        kwargs["density"] = _parse_value("density", m.group("density"), text)
    rest = m.group("rest")
    for item in rest[1:].split(":") if rest else []:
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"method spec {text!r}: item {item!r} must look like KEY=VALUE.")
        if key not in fields:
            allowed = sorted(fields) or "none"
            raise ValueError(f"method spec {text!r}: {name} has no field {key!r}; allowed: {allowed}.")
        if key in kwargs:
            raise ValueError(f"method spec {text!r}: {key} is given twice.")
        kwargs[key] = _parse_value(key, value, text)
    if backend is not None and "backend" in fields and "backend" not in kwargs:
        kwargs["backend"] = backend
    if cls is VedaConfig:
        kwargs.setdefault("density", DEFAULT_DENSITY["veda"])
    elif cls is SolConfig and "density" not in kwargs and "tau" not in kwargs:
        kwargs["density"] = DEFAULT_DENSITY["sol"]
    try:
        return MethodSpec(spec, cls(**kwargs))
    except (TypeError, ValueError) as e:
        raise type(e)(f"method spec {text!r}: {e}") from None


def check_config_files(config, name: Callable[[str], str] = str) -> None:
    """Read the tiling JSON and the estimator `config` names, so that a missing or damaged one is an error before any
    pipeline runs; ValueError "<name(field)> '<path>': <why>"."""
    from ..veda.estimator import estimators_by_component, load_estimator
    from ..veda.tiling import load_tiling

    loaded = {}
    for field, load in (("tiling", lambda path: load_tiling(path, config.block)), ("estimator", load_estimator)):
        values = getattr(config, field, None)
        for value in values if isinstance(values, tuple) and field == "estimator" else (values,):
            if isinstance(value, (str, os.PathLike)):
                try:
                    loaded[field] = load(value)
                except (OSError, ValueError) as err:
                    several = (" (of the estimators, one per transformer, that the commas separate)"
                               if values is not value else "")
                    raise ValueError(f"{name(field)} {os.fspath(value)!r}{several}: {err}") from None
    if "estimator" in loaded and not isinstance(config.estimator, tuple) and getattr(config, "tiling", None):
        _check_estimator_tiles(config, loaded["estimator"], loaded.get("tiling"), name)
    if isinstance(getattr(config, "estimator", None), tuple):   # one per transformer: each records its own
        try:
            estimators_by_component(config.estimator)
        except ValueError as err:
            raise ValueError(f"{name('estimator')}: {err}") from None


def _check_estimator_tiles(config, estimator, tiling, name: Callable[[str], str]) -> None:
    """ValueError naming both flags when `config.tiling` (a tiling file, loaded as `tiling`, or one shape) gives
    other tile shapes than `estimator` was distilled with: the transformer would refuse the pair once loaded."""
    if tiling is None:
        shape = tuple(config.tiling)
        tiling_layers = [[shape] * estimator.num_heads] * estimator.num_layers
    else:
        try:
            tiling.check_model(estimator.model_class, estimator.num_layers, estimator.num_heads,
                               os.fspath(config.tiling))
        except ValueError as err:
            why = str(err).replace("the model's", "the estimator's")
            raise ValueError(f"{name('tiling')} and {name('estimator')} {os.fspath(config.estimator)!r} (distilled "
                             f"for {estimator.model_class}) are for other models: {why}") from None
        tiling_layers = tiling.layers
    try:
        estimator.check_compatible(block=config.block, tile_shapes=tiling_layers)
    except ValueError as err:
        raise ValueError(f"{name('estimator')} {os.fspath(config.estimator)!r} with {name('tiling')} "
                         f"{os.fspath(config.tiling) if tiling is not None else config.tiling}: {err}") from None


def in_spec_terms(message: str) -> str:
    """A config error's hints in a method spec's terms: the estimator's and the tiling's messages name generate's
    flags (--block 64, --tiling 1x4x16, no --tiling), which a spec gives as :block=64, :tiling=1x4x16."""
    message = re.sub(r"--block (\d+)", r"the spec's :block=\1", message)
    return re.sub(r"\(--tiling ([^):]+)", r"(the spec's :tiling=\1", message.replace("(no --tiling)", "(no :tiling=)"))


def check_spec_files(specs: list[MethodSpec]) -> None:
    """`check_config_files` of every spec before any cell runs (not after the dense arm); ValueError naming the
    spec."""
    for spec in specs:
        try:
            check_config_files(spec.config)
        except ValueError as e:
            raise ValueError(f"method spec {spec.label!r}: {in_spec_terms(str(e))}") from None


def parse_method_specs(texts: list[str], *, backend: str | None = None) -> list[MethodSpec]:
    """Parse a grid; dense is put first (added when missing: it is every comparison's reference).

    Raises:
        ValueError: a bad spec, or two specs naming the same config.
    """
    specs = [parse_method_spec(t, backend=backend) for t in texts]
    seen: dict[Any, str] = {}
    for s in specs:
        if s.config in seen:
            raise ValueError(f"method specs {seen[s.config]!r} and {s.label!r} describe the same config.")
        seen[s.config] = s.label
    dense = [s for s in specs if s.is_dense]
    if not dense:
        dense = [MethodSpec("dense", DenseConfig())]
    return dense[:1] + [s for s in specs if not s.is_dense]
