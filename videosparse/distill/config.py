"""Configurations of the Veda distillation and of the head-aware tiling search.

Frozen dataclasses validated in `__post_init__` (a bad value raises a `ValueError` naming the field,
the value and what is allowed); they round-trip through JSON-safe dicts and are written beside every
output (`distill_config.json` beside a distill run; the tiling JSON holds the search's under "search_config").
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Union

from ..config import DEFAULT_TILES, _named_tile_check, check_supported_block, parse_tile
from .._io import replace_durably
from .._run_checks import check_device, check_output
from ..prompts import PROMPTS_FILE_FORMS, read_prompts_file
from ..validation import check_density, check_finite, int_at_least, plain_numbers

MIXED_PRECISION = ("no", "bf16", "fp16")
CACHE_DTYPES = ("float32", "float16", "bfloat16")


def _int_fields(config, names: tuple[str, ...], minimum: int = 1, *, optional: bool = False) -> None:
    """Each field of `names` an int >= minimum (numpy and 0-dim torch ints taken and stored as Python ints, so the
    config stays JSON-safe); None passes where `optional`."""
    for name in names:
        value = getattr(config, name)
        if not (optional and value is None):
            object.__setattr__(config, name, int_at_least(value, minimum, name))


def _tiling(value: Any, block: int) -> Any:
    if value is None:                                   # the shape VedaConfig runs without a tiling: per block
        return DEFAULT_TILES[block]
    value = parse_tile(value)                           # "4x4x8", as the CLI writes it
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return _named_tile_check(value, block)          # VedaConfig's check: numpy ints too, the product named
    raise ValueError(f"tiling={value!r} must be (pt, ph, pw) with product block={block}, or a tiling JSON path.")


# the names diffusers' pipelines give their guidance branches (`cache_context(...)`: the pipelines' own and the
# guiders' identifiers), and "default" for a forward outside any
BRANCHES = ("cond", "uncond", "cond_uncond", "uncond_modality", "uncond_stg", "pred_cond", "pred_uncond",
            "pred_cond_skip", "pred_cond_seg", "pred_cond_stg", "pred_cond_modality", "default")


def _names(name: str, value: Any) -> tuple[str, ...]:
    """A tuple of names from a list or a comma-separated string ("cond" or "cond,uncond")."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name}={value!r} must be a non-empty list of names, e.g. ['cond'] or 'cond,uncond'.")
    return tuple(value)


def _indices(name: str, value: Any) -> tuple[int, ...]:
    """A tuple of ints >= 0 from an int, a list or a comma-separated string ("0,1")."""
    if isinstance(value, str):
        try:
            value = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"{name}={value!r} must be layer indices, e.g. 0,1 or [0, 1].") from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(f"{name}={value!r} must be a non-empty list of layer indices >= 0, e.g. [0, 1].")
    return tuple(value)


# the seeds distill and search-tiling take (accelerate's set_seed: numpy's range)
RUN_SEED_MAX = 2 ** 32 - 1


_PROMPT_FORMS = (f"{PROMPTS_FILE_FORMS}, or a list of prompts (on the "
                 """command line a JSON list: --prompts '["a cat", "a dog"]'; one prompt: --prompts '["a cat"]')""")


def _prompts(value: Any) -> Any:
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(p, str) for p in value):
        empty = [i for i, p in enumerate(value) if not p.strip()]
        if empty:
            raise ValueError(f"prompts={list(value)!r}: prompt {empty[0]} is empty; every prompt needs text.")
        return tuple(value)
    raise ValueError(f"prompts={value!r} must be {_PROMPT_FORMS}.")


def _bool_fields(cls) -> tuple[str, ...]:
    """The fields of dataclass `cls` annotated `bool` (a string under `from __future__ import annotations`)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.type in (bool, "bool"))


def read_prompts(prompts: Union[str, tuple[str, ...]]) -> list[str]:
    """The prompt list: the tuple itself, or the prompts of a file (`videosparse.prompts.read_prompts_file`)."""
    if isinstance(prompts, str):
        if not os.path.isfile(prompts):
            raise ValueError(f"prompts={prompts!r} is not a file; prompts must be {_PROMPT_FORMS}. "
                             "A plain string is read as a file path, never as a prompt.")
        return read_prompts_file(prompts)
    return list(prompts)


class _JsonConfig:
    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown fields {unknown} for {cls.__name__}; allowed: {sorted(names)}.")
        return cls(**data)

    def save(self, path: str | os.PathLike) -> None:
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        replace_durably(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike):
        with open(path) as f:
            return cls.from_dict(json.load(f))


_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class CaptureConfig(_JsonConfig):
    """What the dense runs capture: model, prompts, call settings, steps.

    Args:
        model (`str` or `None`): None or "reference" (the reference model shipped in the package),
            "tiny" (the tiny random Wan pipeline built offline), or a hub id / local pipeline directory
            (see `videosparse.models.loading.load_pipeline`).
        prompts: list of prompts or a text file with one prompt per line.
        num_inference_steps, num_frames, height, width, guidance_scale: pipeline call settings;
            None keeps the model's defaults.
        steps_per_prompt (`int` or `None`): denoising steps sampled per prompt (None: every step).
        branches (`tuple[str, ...]` or `None`): CFG branches kept ("cond", "uncond"); None keeps all.
        seed (`int`): seed of the pipeline noise (prompt i uses seed + i) and of the step sampling.
        device (`str` or `None`): default cuda when available.
        dtype (`str` or `None`): pipeline dtype ("bfloat16", "float32", ...); default per device.
        component (`str`): which transformer of the pipeline to distill ("transformer", "transformer_2").
    """

    model: str | None = None
    prompts: Union[str, tuple[str, ...]] = ("a red circle moving left on a dark background",)
    num_inference_steps: int | None = None
    num_frames: int | None = None
    height: int | None = None
    width: int | None = None
    guidance_scale: float | None = None
    steps_per_prompt: int | None = None
    branches: tuple[str, ...] | None = None
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    component: str = "transformer"

    def __post_init__(self) -> None:
        for name in _bool_fields(type(self)):           # "False" from a JSON file or a flag would be truthy
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be a bool (True or False), not {type(value).__name__}.")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model={self.model!r} must be a hub id, a local directory, 'reference', 'tiny' or None.")
        if not isinstance(self.component, str) or not self.component:
            raise ValueError(f"component={self.component!r} must be the name of the pipeline's transformer "
                             "('transformer', 'transformer_2').")
        object.__setattr__(self, "prompts", _prompts(self.prompts))
        _int_fields(self, ("num_inference_steps", "num_frames", "height", "width", "steps_per_prompt"), optional=True)
        if self.branches is not None:
            object.__setattr__(self, "branches", _names("branches", self.branches))
            unknown = [b for b in self.branches if b not in BRANCHES]
            if unknown:
                raise ValueError(f"branches={list(self.branches)!r}: {unknown} are not branch names the pipelines use; "
                                 f"choose from {BRANCHES} (diffusers' guidance branches, 'default' outside any).")
        check_finite("guidance_scale", self.guidance_scale, 0.0, optional=True)
        _int_fields(self, ("seed",), minimum=0)
        if self.seed > RUN_SEED_MAX:
            raise ValueError(f"seed={self.seed} must lie in [0, 2**32 - 1] (accelerate's set_seed takes no more; "
                             "prompt i is generated with seed + i).")
        check_device(self.device)
        # generate's spelling (bf16, fp16, fp32) too; a dict or list from a --config JSON is not looked up (unhashable)
        dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
        if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be one of 'float32', 'bfloat16', 'float16' (or 'fp32', "
                             "'bf16', 'fp16') or None.")
        object.__setattr__(self, "dtype", dtype)


@dataclass(frozen=True)
class DistillConfig(CaptureConfig):
    """Distillation of a `VedaEstimator` from a model's dense attention (Veda, arXiv 2605.30325).

    Capture fields (model, prompts, steps, ...) as in `CaptureConfig`, plus:

    Args:
        output_dir (`str`): where the estimator (`model.safetensors`, `config.json`), the training
            log (`log.jsonl`), the checkpoints (`checkpoints/step_*`) and the captured samples
            (`cache/`) go. Loadable by `VedaEstimator.from_pretrained` / `VedaConfig(estimator=...)`.
        density (`float`, defaults to 0.1): density at which tile recall is logged.
        tiling: the tile shape or tiling JSON the estimator's features are pooled with (the same one
            must be used at inference; a JSON is copied to `output_dir/tiling.json`). None (default): the
            shape `VedaConfig` uses for the block without a tiling, (4, 4, 8) for 128 and (4, 4, 4) for 64.
        block (`int`, defaults to 128): tokens per tile.
        epochs (`int`), max_steps (`int` or None): training length (max_steps wins when set).
        learning_rate, weight_decay, warmup_steps, lr_scheduler: AdamW and a diffusers scheduler name.
        gradient_accumulation_steps (`int`): samples per optimizer step.
        mixed_precision (`str`): "no", "bf16" or "fp16" (accelerate; logits and the loss stay fp32).
        checkpoint_every (`int`): optimizer steps between checkpoints (written atomically).
        keep_checkpoints (`int`): newest checkpoints kept.
        log_every (`int`): optimizer steps between log lines (loss, recall at `density`).
        resume (`bool`): continue from the newest complete checkpoint in `output_dir`.
        init_std (`float`): std of the projections' init (1e-4, see `VedaEstimator`).
        cache_dtype (`str`): dtype of the cached teacher heat ("float32", "float16", "bfloat16").
        val_fraction (`float`): fraction of the prompts (with all their samples) held out for the final
            evaluation: the nearest count, at least one when above 0, never all (0: none).
        teacher_backend (`str`): "auto", "triton" or "torch". Like the device, it is not part of the capture cache's
            key: both backends compute the same heat (equal to rounding, `tests/veda/test_veda_kernels.py`), so a cache
            captured with one is reused with the other; delete the cache folder to recapture.
    """

    output_dir: str = "veda-estimator"
    density: float = 0.1
    tiling: Any = None
    block: int = 128
    epochs: int = 10
    max_steps: int | None = None
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_scheduler: str = "cosine"
    gradient_accumulation_steps: int = 1
    mixed_precision: str = "no"
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    resume: bool = True
    init_std: float = 1e-4
    cache_dtype: str = "float32"
    val_fraction: float = 0.0
    teacher_backend: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_output("output_dir=", self.output_dir, folder=True, writable=False)     # the run checks in full
        object.__setattr__(self, "output_dir", os.fspath(self.output_dir))
        check_density("density", self.density)
        plain_numbers(self, ("block",))                 # numpy / 0-dim torch ints as ints, as VedaConfig takes them
        check_supported_block(self.block)                        # 128.0 too: as VedaConfig, not after the model load
        object.__setattr__(self, "tiling", _tiling(self.tiling, self.block))
        if isinstance(self.tiling, str):                # a missing or malformed file: now, not after the capture
            from ..veda.tiling import load_tiling

            load_tiling(self.tiling, self.block)
        _int_fields(self, ("epochs",))
        _int_fields(self, ("max_steps",), optional=True)
        check_finite("learning_rate", self.learning_rate, 0.0, strict=True)
        check_finite("weight_decay", self.weight_decay, 0.0)
        _int_fields(self, ("warmup_steps",), minimum=0)
        _int_fields(self, ("gradient_accumulation_steps",))
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision={self.mixed_precision!r} must be one of {MIXED_PRECISION}.")
        _int_fields(self, ("checkpoint_every", "keep_checkpoints", "log_every"))
        check_finite("init_std", self.init_std, 0.0)
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype={self.cache_dtype!r} must be one of {CACHE_DTYPES}.")
        if isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, (int, float)) or \
                not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction={self.val_fraction!r} must lie in [0, 1).")
        if self.teacher_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"teacher_backend={self.teacher_backend!r} must be one of 'auto', 'triton', 'torch'.")
        from diffusers.optimization import SchedulerType

        schedulers = [s.value for s in SchedulerType if s.value != "piecewise_constant"]   # that one needs a rule
        if self.lr_scheduler not in schedulers:
            raise ValueError(f"lr_scheduler={self.lr_scheduler!r} must be one of diffusers' schedules {schedulers}.")
        if self.lr_scheduler == "polynomial" and self.learning_rate <= 1e-7:      # diffusers' lr_end for it
            raise ValueError(f"learning_rate={self.learning_rate!r} must be above 1e-7 with lr_scheduler='polynomial' "
                             "(diffusers decays it to 1e-7).")

    def capture_config(self) -> CaptureConfig:
        names = {f.name for f in dataclasses.fields(CaptureConfig)}
        return CaptureConfig(**{k: v for k, v in self.to_dict().items() if k in names})


@dataclass(frozen=True)
class TilingSearchConfig(CaptureConfig):
    """Head-aware tiling search on a model's dense attention.

    Capture fields as in `CaptureConfig`, plus:

    Args:
        output (`str`): the tiling JSON to write (read by `VedaConfig(tiling=output)`).
        density (`float`, defaults to 0.1): target density of the oracle top-k.
        block (`int`, defaults to 128): tokens per tile (64 uses the 64-token candidates).
        max_padding (`float`, defaults to 0.2): shapes padding the grid by more are excluded.
        max_shapes_per_layer (`int`, defaults to 2).
        layers (`tuple[int, ...]` or None): restrict the search to these layers (the others take the shape
            the searched layers chose most often); None searches all.
        backend (`str`): kernel backend for the sparse outputs ("auto", "triton", "reference").
    """

    output: str = "tiling.json"
    density: float = 0.1
    block: int = 128
    max_padding: float = 0.2
    max_shapes_per_layer: int = 2
    layers: tuple[int, ...] | None = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_output("output=", self.output, parents=True, writable=False)      # the tiling JSON; the run checks in full
        object.__setattr__(self, "output", os.fspath(self.output))
        check_density("density", self.density)
        plain_numbers(self, ("block",))
        check_supported_block(self.block)
        if isinstance(self.max_padding, bool) or not isinstance(self.max_padding, (int, float)) or \
                not 0 <= self.max_padding < 1:
            raise ValueError(f"max_padding={self.max_padding!r} must lie in [0, 1).")
        _int_fields(self, ("max_shapes_per_layer",))
        if self.layers is not None:
            object.__setattr__(self, "layers", _indices("layers", self.layers))
        if self.backend not in ("auto", "triton", "reference"):
            raise ValueError(f"backend={self.backend!r} must be one of 'auto', 'triton', 'reference'.")
