"""Configurations of the attention methods: what `videosparse.apply` takes.

Each config is a frozen dataclass validated in `__post_init__`; a bad value raises a `ValueError`
(or `TypeError`) that names the field, the value and what is allowed. Configs round-trip through
plain dicts (`to_dict` / `config_from_dict`) so they can be written beside every checkpoint and
evaluation result; an estimator object is written as the path or hub id it was loaded from, and one
built in memory (never loaded) as an `<in-memory ...>` marker that `config_from_dict` refuses. The
config's *type* selects the method (see `videosparse.processors`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, ClassVar, Union

from .validation import TileShape, as_scalar, check_density, check_finite, check_tile, is_int, plain_numbers

CONFIG_VERSION = 1

# The Triton attention kernels, in the order backend="triton" tries them: name -> (the module of `videosparse.kernels`
# whose BACKEND runs it, whether backend="auto" tries it too). `videosparse.kernels` registers these (the one list of
# them: this module imports no kernel, so the package imports without Triton).
TRITON_KERNELS = {"gluon_hopper": ("gluon_hopper", True), "triton_generic": ("triton_generic", True),
                  "hopper": ("triton_hopper", False)}
# "auto", "triton" (first Triton kernel that fits), "reference", or one kernel by name (an escape hatch,
# e.g. "hopper" to run the Triton Hopper kernel instead of the Gluon one)
BACKENDS = ("auto", "triton", "reference", *sorted(TRITON_KERNELS))
BLOCK_SIZES = (64, 128)
# SolConfig.band's largest value: |i - j| <= band is computed on int64 tile indices (torch), where a larger int
# overflows; a band at or past the number of video tiles already forces every tile
MAX_BAND = 2**63 - 1

DEFAULT_TILES: dict[int, TileShape] = {128: (4, 4, 8), 64: (4, 4, 4)}   # block -> the tile shape when none is given

# the share of the denoising steps the sparse methods run dense when not told (`dense_steps`)
DEFAULT_DENSE_STEPS = 0.2
# the density a method runs at when none is given (the CLI and the evaluation's method specs)
DEFAULT_DENSITY = {"veda": 0.1, "sol": 0.15}
_DENSITY_MEANS = "the fraction of key tiles computed exactly"

# what `to_dict` writes for an estimator object that was built in memory (no path or hub id to load it from)
IN_MEMORY_ESTIMATOR = "<in-memory"


def _layers(value: Any) -> tuple[int, ...]:
    """dense_layers as a tuple (TypeError naming the field when it is not a collection of layer indices)."""
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__") or getattr(value, "ndim", None) == 0:
        raise TypeError(f"dense_layers={value!r} must be a tuple or list of self-attention layer indices, "
                        "e.g. (0,) or [0, 29].")
    return tuple(int(v) if is_int(v) else v for v in map(as_scalar, value))


def _flag(config, name: str) -> None:
    """A bool field: numpy's bool and a 0-dim bool tensor become the Python bool; anything else is a TypeError."""
    value = as_scalar(getattr(config, name))
    if type(value).__name__ == "bool_" and type(value).__module__ == "numpy":
        value = bool(value)
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be a bool.")
    object.__setattr__(config, name, value)


def check_supported_block(block: Any) -> None:
    """ValueError unless `block` is one of the block sizes the configs take (`BLOCK_SIZES`)."""
    if not is_int(block) or block not in BLOCK_SIZES:
        raise ValueError(f"block={block!r} is not supported; choose one of the ints {BLOCK_SIZES}.")


def _check_backend(value: str) -> None:
    if value not in BACKENDS:
        raise ValueError(f"backend={value!r} is not supported; choose one of {BACKENDS}.")


def _dense_schedule(dense_steps: int | float, dense_layers: tuple[int, ...]) -> tuple[int, ...]:
    """Check dense_steps and dense_layers; the layers sorted and deduplicated (one spelling per set)."""
    if isinstance(dense_steps, bool) or not isinstance(dense_steps, (int, float)):
        raise TypeError(f"dense_steps={dense_steps!r} must be an int (a step count) or a float in [0, 1).")
    if isinstance(dense_steps, int) and dense_steps < 0:
        raise ValueError(f"dense_steps={dense_steps} must be >= 0 (a number of initial denoising steps run dense).")
    if isinstance(dense_steps, float) and not 0.0 <= dense_steps < 1.0:
        raise ValueError(
            f"dense_steps={dense_steps} as a float is a fraction of the steps and must lie in [0, 1); "
            "pass an int for a step count."
        )
    for layer in dense_layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"dense_layers={dense_layers!r} must hold layer indices, ints >= 0; got {layer!r}.")
    return tuple(sorted(set(dense_layers)))


def _tile_text_parts(text: str) -> list[str]:
    """'4 x 4 X 8' -> ['4', '4', '8']: the sizes of a tile shape written as text, not yet checked."""
    return "".join(text.split()).lower().split("x")


def parse_tile(text: Any) -> Any:
    """'4x4x8' (any case of x) -> (4, 4, 8); a 1-D numpy array or tensor -> a tuple of its elements; anything else is
    returned as it is (a shape, or a tiling JSON path)."""
    if isinstance(text, str):
        parts = _tile_text_parts(text)
        if len(parts) == 3 and all(p.isascii() and p.isdigit() for p in parts):
            return tuple(int(p) for p in parts)
    if getattr(text, "ndim", None) == 1 and hasattr(text, "tolist"):     # numpy / torch: its elements, checked after
        return tuple(text.tolist())
    return text


def parse_dense_steps(text: str) -> int | float:
    """'4' -> 4 (a count), '0.2' or '2e-1' -> 0.2 (a fraction of the steps); ValueError naming the forms."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"dense steps {text!r} must be an int count (e.g. 4) or a float fraction of the "
                             "steps (e.g. 0.2).") from None


def parse_layers(text: str) -> tuple[int, ...]:
    """'0,3' -> (0, 3); '' -> (); ValueError naming the form."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"layers {text!r} must be comma-separated layer indices (e.g. 0,3).") from None


def _named_tile_check(tile: Any, block: int) -> TileShape:
    """`check_tile` for a config's `tiling` field: its errors name the field."""
    try:
        return check_tile(tile, block)
    except ValueError as err:
        raise ValueError(f"tiling: {err}") from None


def _malformed_tile_text(text: str) -> bool:
    """Whether `text` reads as a tile shape with the wrong number of sizes ('4x4', '4x4x8x1') and names no file: as a
    tiling path it could only fail later, at `apply`."""
    parts = _tile_text_parts(text)
    return all(p.isascii() and p.isdigit() for p in parts) and len(parts) != 3 and not os.path.exists(text)


def _estimator_entry(estimator: Any) -> str:
    """What `to_dict` writes for an estimator object: the path or hub id `from_pretrained` loaded it from
    (its `source`), else an `<in-memory ...>` marker that no path or hub id can be mistaken for."""
    source = getattr(estimator, "source", None)
    if source is not None:
        return os.fspath(source)
    model = getattr(estimator, "model_class", None)
    return f"{IN_MEMORY_ESTIMATOR} {type(estimator).__name__}{f' for {model}' if model else ''}, never saved>"


def _estimator(value: Any) -> Any:
    """VedaConfig.estimator checked: None, a non-empty path or hub id (a path-like one as its str), a
    `VedaEstimator` (a subclass too; known by its class path, so that this module imports no torch), or a tuple
    (or list) of several of these, one per transformer of a pipeline (a tuple of one is its one entry)."""
    if isinstance(value, (tuple, list)):
        if not value:
            raise ValueError("estimator=() names no estimator; give None (the untrained estimator), one, or one per "
                             "transformer of the pipeline.")
        if any(isinstance(entry, (tuple, list)) for entry in value):
            raise TypeError(f"estimator={value!r} nests a tuple or list; give one estimator per transformer, each a "
                            "directory, hub id or VedaEstimator.")
        if len(value) == 1:
            return _estimator(value[0])
        entries = tuple(_estimator(entry) for entry in value)
        if any(entry is None for entry in entries):
            raise ValueError(f"estimator={value!r} holds None; give one trained estimator per transformer (a "
                             "transformer left out scores its tiles untrained).")
        return entries
    if value is None or any(f"{c.__module__}.{c.__qualname__}" == "videosparse.veda.estimator.VedaEstimator"
                            for c in type(value).__mro__):
        return value
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if isinstance(path, str) and path:
            if path.startswith(IN_MEMORY_ESTIMATOR):
                raise ValueError(
                    f"estimator={path!r} stands for an estimator object that was never saved, so this config "
                    "cannot be rebuilt from it; save the estimator with est.save_pretrained(dir) and pass "
                    "estimator=dir (or the object loaded with VedaEstimator.from_pretrained(dir), which to_dict "
                    "writes as dir).")
            return path
        raise ValueError(f"estimator={value!r} must name a trained estimator: a directory or a hub id.")
    raise TypeError(f"estimator={value!r} must be None, a directory or hub id (str or os.PathLike), a "
                    "VedaEstimator, or a tuple of them (one per transformer of a pipeline).")


@dataclass(frozen=True)
class _BaseConfig:
    """What every config shares: its method name, the dict / JSON round trip and the dense schedule's queries (no
    layer or step is dense by schedule here: `DenseConfig` runs every call dense by itself)."""

    method: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-safe) with the method name and the config version.

        Paths are written as strings; an estimator object as the path or hub id it was loaded from with
        `VedaEstimator.from_pretrained`, or, built in memory, as `"<in-memory VedaEstimator ...>"` (which
        `config_from_dict` refuses: save the estimator and pass its directory to get a config that round-trips).
        """
        out: dict[str, Any] = {"method": self.method, "version": CONFIG_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "estimator" and isinstance(value, tuple):
                value = [_estimator_entry(v) if not isinstance(v, str) else v for v in value]
            elif isinstance(value, tuple):
                value = [list(v) if isinstance(v, tuple) else v for v in value]
            elif isinstance(value, os.PathLike):
                value = os.fspath(value)
            elif not isinstance(value, (str, int, float, bool, type(None), list, dict)):
                value = _estimator_entry(value)
            out[f.name] = value
        return out

    def is_dense_layer(self, layer: int) -> bool:
        """Whether self-attention layer `layer` always runs dense (`dense_layers`)."""
        return False

    def dense_step_count(self, num_inference_steps: int | None) -> int:
        """Number of initial denoising steps that run dense (`dense_steps`), given the pipeline's step count."""
        return 0


@dataclass(frozen=True)
class _SparseConfig(_BaseConfig):
    """What the sparse methods' configs share: the checks of their dense schedule (`dense_steps`, `dense_layers`),
    `correction` and kernel `backend` fields, and the schedule's queries.

    Each subclass declares those fields itself, each where its positional order, repr and saved JSON have it since
    they were written (a dataclass puts a base class's fields before its own); their defaults are the shared
    `DEFAULT_DENSE_STEPS` and `"auto"`.
    """

    def _check_shared_fields(self) -> None:
        """Check dense_steps, dense_layers (stored sorted and deduplicated), correction and backend."""
        object.__setattr__(self, "dense_layers", _dense_schedule(self.dense_steps, _layers(self.dense_layers)))
        _flag(self, "correction")
        _check_backend(self.backend)

    def is_dense_layer(self, layer: int) -> bool:
        """Whether self-attention layer `layer` always runs dense (`dense_layers`)."""
        return layer in self.dense_layers

    def dense_step_count(self, num_inference_steps: int | None) -> int:
        """Number of initial denoising steps that run dense, given the pipeline's step count (a fraction: its share of
        the steps rounded down, the float product's rounding error aside: 0.29 of 100 steps is 29)."""
        steps = self.dense_steps
        if isinstance(steps, float):
            return math.floor(steps * num_inference_steps + 1e-9) if num_inference_steps else 0
        return steps


@dataclass(frozen=True)
class DenseConfig(_BaseConfig):
    """Dense attention through videosparse's processors (for baselines and statistics).

    Every self-attention call goes through diffusers' own `dispatch_attention_fn`, so outputs equal
    the stock processors' (bitwise for most families; within float rounding, ~1e-7 relative, where a
    processor merges parts of the attention itself: HunyuanVideo 1.5, Motif-Video, Wan-Animate-2, and
    HunyuanVideo and FramePack with padded text, whose valid prefix and padded rows run as two calls); the
    processors still count calls, which makes this the reference arm of an evaluation.

    Example:
        >>> import videosparse
        >>> cfg = videosparse.DenseConfig()
    """

    method: ClassVar[str] = "dense"


@dataclass(frozen=True)
class VedaConfig(_SparseConfig):
    """Veda: top-k tile selection from a distilled per-head estimator (arXiv 2605.30325).

    Args:
        density (`float`, defaults to 0.1): fraction of video key tiles computed exactly per query
            tile, in (0, 1]. The diagonal tile is forced and counted; text tiles are always kept.
        estimator (`str`, `os.PathLike`, `VedaEstimator` or `None`): a trained estimator (a directory
            or hub id for `VedaEstimator.from_pretrained`, or the object, which is left as it is: videosparse
            runs an fp32 eval copy). `None` uses the untrained estimator, i.e. mean-pooled q·k per tile (the
            VSA-style baseline). `to_dict` writes an object as the path or hub id it was loaded from. On a
            pipeline of several transformers (Wan 2.2's two experts), a tuple of estimators, one per
            transformer: each serves the component it was distilled from (`videosparse distill --component`),
            and a transformer none was distilled from scores its tiles untrained.
        tiling (`tuple[int, int, int]`, path or `None`): one tile shape (pt, ph, pw) for every head
            with pt*ph*pw == block (or the string "4x4x8"), or a JSON file written by `videosparse
            search-tiling` giving each (layer, head) its own shape. `None` (default): the tile shapes the
            estimator was trained with; without an estimator (4, 4, 8) for block=128 and (4, 4, 4) for
            block=64.
        block (`int`, defaults to 128): tokens per tile, 128 or 64.
        dense_steps (`int` or `float`, defaults to 0.2): initial denoising steps run dense (an int
            count, or a float fraction of the steps). The early steps lay out the video; running the
            first 20% dense lifted PSNR vs dense from 21.4 to 24.7 dB on the reference model at
            density 0.1 (the usual schedule of Sol-Attn and Radial Attention). Pass 0 for all-sparse.
            Steps are the scheduler's: a second-order scheduler such as FlowMatchHeun counts each of its
            model evaluations (its `timesteps`), so an int there counts evaluations; a call that starts
            part-way into its schedule (video-to-video with `strength` < 1) runs dense only the dense steps
            it reaches.
        dense_layers (`tuple[int, ...]`): self-attention layers always run dense.
        correction (`bool`, defaults to False): add Sol's zero-order correction for skipped tiles.
        backend (`str`, defaults to "auto"): kernel backend: "auto", "triton", "reference", or one kernel
            by name ("gluon_hopper", "hopper", "triton_generic").

    Example:
        >>> import videosparse
        >>> cfg = videosparse.VedaConfig(density=0.1, dense_steps=0.2)
    """

    method: ClassVar[str] = "veda"

    density: float = DEFAULT_DENSITY["veda"]
    estimator: Union[str, os.PathLike, Any, None] = None
    tiling: Union[TileShape, str, os.PathLike, None] = None
    block: int = 128
    dense_steps: int | float = DEFAULT_DENSE_STEPS
    dense_layers: tuple[int, ...] = ()
    correction: bool = False
    backend: str = "auto"

    def __post_init__(self) -> None:
        plain_numbers(self, ("density", "block", "dense_steps"))
        check_density("density", self.density, _DENSITY_MEANS)
        object.__setattr__(self, "estimator", _estimator(self.estimator))
        check_supported_block(self.block)
        object.__setattr__(self, "tiling", parse_tile(self.tiling))
        if isinstance(self.tiling, (tuple, list)):
            object.__setattr__(self, "tiling", _named_tile_check(self.tiling, self.block))
        elif self.tiling is not None and not isinstance(self.tiling, (str, os.PathLike)):
            raise TypeError(f"tiling={self.tiling!r} must be a tile shape (pt, ph, pw) or a path to a tiling JSON.")
        elif isinstance(self.tiling, os.PathLike):      # as to_dict writes it: equal to its dict round trip
            object.__setattr__(self, "tiling", os.fspath(self.tiling))
        if isinstance(self.tiling, str) and (not self.tiling.strip() or _malformed_tile_text(self.tiling)):
            raise ValueError(f"tiling={self.tiling!r} must be a tile shape like 4x4x8, the path of a tiling JSON from "
                             "`videosparse search-tiling`, or None.")
        self._check_shared_fields()


@dataclass(frozen=True)
class SolConfig(_SparseConfig):
    """Sol-Attn: training-free tiles from a Gaussian-calibrated threshold (arXiv 2607.24027).

    Give exactly one of `density` (τ is calibrated by bisection per shape and layer to reach it, on the first call's
    whole batch, then kept for the session) or `tau` (used as given: the output of an input then depends neither on
    what ran before nor on what it is batched with).

    Args:
        density (`float` or `None`): target fraction of key tiles computed exactly, in (0, 1] (of all the tile
            pairs computed, text tiles included; a padded prompt's pad tiles are not computed and do not count).
        tau (`float` or `None`): threshold in standard deviations above the mean proxy score.
        block (`int`, defaults to 128): tokens per tile, 128 or 64. The paper uses 64-token blocks;
            128 is the default here because the Hopper kernel runs 128x128 tiles 2.2x faster than
            64x64 ones at the same density (benchmarks/sol_plan_h200.json).
        tiling (`tuple[int, int, int]` or `None`): the 3D tile shape, pt*ph*pw == block (or the string "4x4x8");
            `None` (default): 4x4x8 for block 128, 4x4x4 for 64 (`tile_shape` gives the one that runs; the
            default given explicitly is stored as `None`), so `dataclasses.replace(config, block=64)` of a config
            with the default shape stays valid.
        band (`int`, defaults to 1): key tiles with |i - j| <= band are always exact.
        correction (`bool`, defaults to True): zero-order correction for skipped tiles.
        dense_steps, dense_layers, backend: as in `VedaConfig` (dense_steps defaults to 0.2 here too).

    Example:
        >>> import videosparse
        >>> cfg = videosparse.SolConfig(density=0.15)
    """

    method: ClassVar[str] = "sol"

    density: float | None = None
    tau: float | None = None
    block: int = 128
    tiling: TileShape | None = None
    band: int = 1
    correction: bool = True
    dense_steps: int | float = DEFAULT_DENSE_STEPS
    dense_layers: tuple[int, ...] = ()
    backend: str = "auto"

    def __post_init__(self) -> None:
        plain_numbers(self, ("density", "tau", "block", "band", "dense_steps"))
        if (self.density is None) == (self.tau is None):
            raise ValueError(
                f"SolConfig needs exactly one of density or tau; got density={self.density!r}, tau={self.tau!r}."
            )
        if self.density is not None:
            check_density("density", self.density, _DENSITY_MEANS)
        if self.tau is not None and (isinstance(self.tau, bool) or not isinstance(self.tau, (int, float))):
            raise TypeError(f"tau={self.tau!r} must be a number (standard deviations above the mean score).")
        check_finite("tau", self.tau, optional=True, what="standard deviations above the mean score")
        check_supported_block(self.block)
        if self.tiling is not None:
            tiling = parse_tile(self.tiling)
            if isinstance(tiling, (str, os.PathLike)):
                raise ValueError(f"tiling={tiling!r}: sol takes one tile shape like 4x4x8, three positive ints "
                                 "(pt, ph, pw) with pt*ph*pw = block, not a tiling file; only veda reads a tiling "
                                 "JSON from search-tiling.")
            tiling = _named_tile_check(tiling, self.block)
            # the block's default given explicitly (as `to_dict` writes it) is the default: one config, one identity
            object.__setattr__(self, "tiling", None if tiling == DEFAULT_TILES[self.block] else tiling)
        if isinstance(self.band, bool) or not isinstance(self.band, int) or not 0 <= self.band <= MAX_BAND:
            raise ValueError(f"band={self.band!r} must be an int in [0, {MAX_BAND}] (the int64 range of the tile "
                             "index math; any band >= the number of video tiles already keeps every tile).")
        self._check_shared_fields()

    @property
    def tile_shape(self) -> TileShape:
        """The (pt, ph, pw) every head runs: `tiling`, or the block's default when it is `None`."""
        return self.tiling if self.tiling is not None else DEFAULT_TILES[self.block]

    def to_dict(self) -> dict[str, Any]:
        """As `_BaseConfig.to_dict`, with the tile shape that runs (so reports name it, and their cell ids stay those of
        configs written before `tiling=None` meant the default)."""
        out = super().to_dict()
        out["tiling"] = list(self.tile_shape)
        return out


CONFIG_CLASSES: dict[str, type[_BaseConfig]] = {c.method: c for c in (DenseConfig, VedaConfig, SolConfig)}


def config_from_dict(data: dict[str, Any]) -> _BaseConfig:
    """Rebuild a config from `to_dict()` output.

    An estimator object comes back as the path or hub id it was loaded from (loaded again at `apply`); one
    that was built in memory was written as an `<in-memory ...>` marker and raises a `ValueError`.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"config {data!r} must be a dict as to_dict() writes it (a {type(data).__name__} is not), "
                        f"e.g. {{'method': 'veda', 'density': 0.1}}.")
    data = dict(data)
    method = data.pop("method", None)
    version = data.pop("version", CONFIG_VERSION)
    if not isinstance(method, str) or method not in CONFIG_CLASSES:
        raise ValueError(f"method={method!r} is not known; choose one of {sorted(CONFIG_CLASSES)}.")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"config version={version!r} must be an int >= 1 (this videosparse writes {CONFIG_VERSION}).")
    if version > CONFIG_VERSION:
        raise ValueError(f"config version {version} is newer than this videosparse understands ({CONFIG_VERSION}).")
    cls = CONFIG_CLASSES[method]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names, key=str)      # (a key that is not a str is named, not compared)
    if unknown:
        raise ValueError(f"unknown fields {unknown} for {cls.__name__}; allowed: {sorted(names)}.")
    for key in ("tiling", "dense_layers", "estimator"):
        if isinstance(data.get(key), list):
            data[key] = tuple(data[key])
    return cls(**data)
