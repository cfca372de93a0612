"""VedaEstimator: TripPool features + a per-layer, per-head residual projection -> tile logits.

For layer l and head h, with TripPool features f = [mean | max | min] (3*D) of a tile:

    q_hat = mean(q) + f_q @ P_q[l, h]        P_q[l, h]: (3*D, D)
    k_hat = mean(k) + f_k @ P_k[l, h]
    logits[i, j] = q_hat_i . k_hat_j / sqrt(D)        (fp32)

Initialisation. Veda writes the init as N(0, 1e-4) and states that the untrained estimator equals
mean-pooled q.k (the VSA-style baseline). Read as a *standard deviation* of 1e-4 that statement
nearly holds: each output coordinate of f @ P moves by about 1e-4 * sqrt(3*D) * rms(f) (~2e-3 rms(f) at
D = 128), where f holds the tile's max and min besides its mean, so the relative change of the logits depends on
how large tile means are next to the spread of their tokens: 0.4% on the tests' video-like data at D = 128, but
6% on tokens whose tile means are near zero (97% of the off-diagonal top-k picks at density 0.1 unchanged);
`init_std=0` gives the baseline exactly. Read as a variance (std 1e-2) the perturbation would be 100x that
and the untrained estimator would no longer be the baseline. We therefore use std = 1e-4
(`init_std`, recorded in the config); the residual form makes the gradient independent of the
init scale, so training is not slowed by the small init.

Weights are stored with safetensors only (`save_pretrained` / `from_pretrained(path_or_repo)`),
together with a config.json recording the model it was distilled for; `check_compatible` raises a
`ValueError` naming every mismatch when it is used with another transformer.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import os
import re
from pathlib import Path
from typing import Any, Sequence

import torch
from huggingface_hub import PyTorchModelHubMixin, hf_hub_download
from torch import nn

from ..config import BLOCK_SIZES, DEFAULT_TILES, parse_tile
from ..validation import check_density, check_tile, int_triple

DEFAULT_INIT_STD = 1e-4
SAFETENSORS_NAME = "model.safetensors"


def scaled_logits(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """a @ b^T * scale over the last two dims, [..., N, D] x [..., M, D] -> [..., N, M], in one batched GEMM
    (the scale in its epilogue: one kernel launch instead of a GEMM and a division)."""
    lead = a.shape[:-2]
    out = torch.baddbmm(a.new_empty(()), a.flatten(0, -3), b.flatten(0, -3).transpose(-1, -2), beta=0.0, alpha=scale)
    return out.view(*lead, a.shape[-2], b.shape[-2])


def _as_shape(value: Any) -> list[int] | None:
    """One (pt, ph, pw) (three integer-like values: ints, numpy or 0-dim torch integers, not bools; or '4x4x8') as a
    list of ints; None for anything else."""
    shape = int_triple(parse_tile(value))
    return None if shape is None else list(shape)


def _normalize_tiles(tile_shapes: Any, num_layers: int, num_heads: int) -> list[list[list[int]]]:
    """[num_layers][num_heads][3] from one shape, one shape per layer, or one per (layer, head)."""
    if tile_shapes is None:
        raise ValueError("tile_shapes is required (one (pt, ph, pw), or one per layer and head).")
    one = _as_shape(tile_shapes)
    if one is not None:
        return [[list(one) for _ in range(num_heads)] for _ in range(num_layers)]
    if isinstance(tile_shapes, str) or not isinstance(tile_shapes, Sequence):
        raise ValueError(f"tile_shapes={tile_shapes!r} must be one (pt, ph, pw) such as (4, 4, 8) or '4x4x8', or one "
                         "per layer, or one per layer and head.")
    if len(tile_shapes) != num_layers:
        raise ValueError(f"tile_shapes={tile_shapes!r} names {len(tile_shapes)} layers; expected one (pt, ph, pw) of "
                         f"ints or {num_layers} layers.")
    out = []
    for layer, entry in enumerate(tile_shapes):
        shape = _as_shape(entry)
        heads = [_as_shape(h) for h in entry] if shape is None and isinstance(entry, (list, tuple)) else []
        if shape is not None:
            out.append([list(shape) for _ in range(num_heads)])
        elif len(heads) == num_heads and None not in heads:
            out.append(heads)
        else:
            raise ValueError(f"tile_shapes[{layer}]={entry!r}: expected one (pt, ph, pw) of ints or {num_heads} "
                             "of them (one per head).")
    return out


class VedaEstimator(nn.Module, PyTorchModelHubMixin, library_name="videosparse", tags=["videosparse", "veda"]):
    """Distilled tile estimator of Veda (arXiv 2605.30325): TripPool + per-head residual projection.

    Args:
        model_class (`str`): class name of the transformer it serves (e.g. "WanTransformer3DModel").
        num_layers (`int`): self-attention layers.
        num_heads (`int`): heads per layer.
        head_dim (`int`): D.
        block (`int`, defaults to 128): tokens per tile.
        tile_shapes: the tile shapes the features were pooled with: one (pt, ph, pw), or per layer a
            shape or a list of one shape per head; `None` (default): 4x4x8 for block 128, 4x4x4 for 64.
        init_std (`float`, defaults to 1e-4): std of the N(0, std^2) init of P_q, P_k (see the module
            docstring for why std and not variance).
        density (`float`, optional): the density it was distilled for (informational).
        component (`str`, optional): the pipeline component it was distilled from ("transformer", "transformer_2");
            applied to a pipeline of several transformers (Wan 2.2's experts), it serves only that one.

    Parameters:
        proj_q, proj_k: fp32 [num_layers, num_heads, 3*D, D].

    Attributes:
        source (`str` or `None`): the path or hub id `from_pretrained` loaded it from ("owner/name@revision" for a
            revision; the snapshot folder for a `cache_dir`; `None` when built in memory); `VedaConfig.to_dict` writes
            it, so stats and reports name the estimator that ran, and `load_estimator` loads it again.

    Example:
        >>> from videosparse.veda import VedaEstimator
        >>> est = VedaEstimator("WanTransformer3DModel", num_layers=2, num_heads=4, head_dim=64, tile_shapes=(4, 4, 8))
        >>> est.save_pretrained("my-estimator")                                    # doctest: +SKIP
        >>> est = VedaEstimator.from_pretrained("my-estimator")                     # doctest: +SKIP
    """

    def __init__(self, model_class: str, num_layers: int, num_heads: int, head_dim: int, block: int = 128,
                 tile_shapes: Any = None, init_std: float = DEFAULT_INIT_STD, density: float | None = None,
                 component: str | None = None):
        super().__init__()
        sizes = {"num_layers": num_layers, "num_heads": num_heads, "head_dim": head_dim, "block": block}
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int.")
            sizes[name] = int(value)                # numpy ints as Python ints (the saved config.json too)
        num_layers, num_heads, head_dim, block = sizes.values()
        if block not in BLOCK_SIZES:         # an estimator for a block no config takes could never be used
            raise ValueError(f"block={block!r} is not supported; choose one of {BLOCK_SIZES} (VedaConfig's blocks).")
        if (isinstance(init_std, bool) or not isinstance(init_std, numbers.Real) or not math.isfinite(init_std)
                or init_std < 0):
            raise ValueError(f"init_std={init_std!r} must be a finite number >= 0.")
        if isinstance(model_class, type):           # the class itself: by its name, as the config.json records it
            model_class = model_class.__name__
        if not isinstance(model_class, str) or not model_class:
            raise ValueError(f"model_class={model_class!r} must be the name of the transformer class it serves (e.g. "
                             "'WanTransformer3DModel').")
        self.model_class = model_class
        self.num_layers, self.num_heads, self.head_dim, self.block = num_layers, num_heads, head_dim, block
        self.tile_shapes = _normalize_tiles(DEFAULT_TILES[block] if tile_shapes is None else tile_shapes, num_layers,
                                            num_heads)
        for layer, heads in enumerate(self.tile_shapes):
            for h, s in enumerate(heads):
                check_tile(s, block, f"tile_shapes[{layer}][{h}]")
        self.init_std = float(init_std)
        self.density = None if density is None else check_density("density", density,
                                                                  "the density it was distilled for; or None")
        if component is not None and (not isinstance(component, str) or not component):
            raise ValueError(f"component={component!r} must be the pipeline component it was distilled from (e.g. "
                             "'transformer_2') or None.")
        self.component = component
        self.source: str | None = None
        # the config save_pretrained writes gets the checked values as plain Python numbers (the mixin drops numpy
        # ones and would save the default, or null for a numpy density) and one tile shape where all heads share it
        if isinstance(self._hub_mixin_config, dict):
            shapes = {tuple(s) for heads in self.tile_shapes for s in heads}
            self._hub_mixin_config.update(
                sizes, model_class=model_class, init_std=self.init_std, density=self.density,
                tile_shapes=list(shapes.pop()) if len(shapes) == 1 else self.tile_shapes)
        shape = (num_layers, num_heads, 3 * head_dim, head_dim)
        self.proj_q = nn.Parameter(torch.randn(shape) * self.init_std)
        self.proj_k = nn.Parameter(torch.randn(shape) * self.init_std)

    def extra_repr(self) -> str:
        """What the estimator serves and where it came from (printed by `repr`, so configs and messages name it)."""
        return (f"{self.model_class}, {self.num_layers} layers x {self.num_heads} heads x {self.head_dim}, "
                f"block={self.block}, source={self.source!r}")

    # ------------------------------------------------------------------ inference / training math
    def project(self, feat: torch.Tensor, layer: int, which: str) -> torch.Tensor:
        """q_hat or k_hat: fp32 [B, H, N, D] from TripPool features fp32 [B, H, N, 3*D].

        The projection may run under autocast; the residual and the result are fp32.
        """
        D = self.head_dim
        if feat.dim() != 4 or feat.shape[1] != self.num_heads or feat.shape[3] != 3 * D:
            raise ValueError(
                f"features have shape {tuple(feat.shape)}; expected (B, {self.num_heads}, N, {3 * D}) "
                "(TripPool [mean|max|min] of the estimator's heads and head dim)."
            )
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is out of range for an estimator of {self.num_layers} layers.")
        weight = (self.proj_q if which == "q" else self.proj_k)[layer]               # [H, 3D, D]
        return self.project_with(feat, weight)

    @staticmethod
    def project_with(feat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`project` with one layer's weight [H, 3D, D] given (no checks): fp32 [B, H, N, D]."""
        D = weight.shape[-1]
        delta = torch.matmul(feat.to(weight.dtype), weight)
        return feat[..., :D].float() + delta.float()

    @staticmethod
    def logits_with(q_feat: torch.Tensor, k_feat: torch.Tensor, weight_q: torch.Tensor,
                    weight_k: torch.Tensor) -> torch.Tensor:
        """`forward` with one layer's weights [H, 3D, D] given instead of the layer index (no checks).

        The sparse processors call this with weights their layer slot holds, so compiled code does not
        index the parameters by a Python layer number (one compiled block then serves every layer).
        """
        q_hat = VedaEstimator.project_with(q_feat, weight_q)
        k_hat = VedaEstimator.project_with(k_feat, weight_k)
        with torch.autocast(device_type=q_hat.device.type, enabled=False):
            return scaled_logits(q_hat, k_hat, 1.0 / math.sqrt(weight_q.shape[-1]))

    def forward(self, q_feat: torch.Tensor, k_feat: torch.Tensor, layer: int) -> torch.Tensor:
        """Tile logits.

        Args:
            q_feat, k_feat: fp32 [B, H, N, 3*D] TripPool features of query and key tiles (detached).
            layer: self-attention layer index.

        Returns:
            fp32 [B, H, N, N] logits q_hat . k_hat / sqrt(D).
        """
        q_hat = self.project(q_feat, layer, "q")
        k_hat = self.project(k_feat, layer, "k")
        with torch.autocast(device_type=q_hat.device.type, enabled=False):
            return scaled_logits(q_hat, k_hat, 1.0 / math.sqrt(self.head_dim))

    # ------------------------------------------------------------------ compatibility
    def layer_tiles(self, layer: int) -> list[tuple[int, int, int]]:
        """The per-head tile shapes of `layer` the estimator was distilled with."""
        return [tuple(s) for s in self.tile_shapes[layer]]  # type: ignore[misc]

    def check_compatible(self, *, model_class: str | None = None, num_layers: int | None = None,
                         num_heads: int | None = None, head_dim: int | None = None, block: int | None = None,
                         tile_shapes: Sequence[Sequence[tuple[int, int, int]]] | None = None) -> None:
        """Raise a `ValueError` naming every field that differs from what the estimator was trained for."""
        wanted = {"model_class": model_class, "num_layers": num_layers, "num_heads": num_heads,
                  "head_dim": head_dim, "block": block}
        bad = [f"{k}: estimator has {getattr(self, k)!r}, the model/config has {v!r}"
               + (f" (pass VedaConfig(block={self.block}), or --block {self.block})" if k == "block" else "")
               for k, v in wanted.items() if v is not None and v != getattr(self, k)]
        if tile_shapes is not None and not bad:
            for layer, heads in enumerate(tile_shapes):
                if layer < self.num_layers and [list(s) for s in heads] != self.tile_shapes[layer]:
                    bad.append(
                        f"tile shapes of layer {layer}: estimator was distilled with {self.layer_tiles(layer)}, "
                        f"the config asks for {[tuple(s) for s in heads]} ({self._tiling_hint()})"
                    )
                    break
        if bad:
            raise ValueError(f"the estimator {estimator_label(self)} does not match the transformer it is used with: "
                             + "; ".join(bad) + ".")

    def _tiling_hint(self) -> str:
        """How to pass the tile shapes the estimator was trained with (for the mismatch error)."""
        hint = ("leave VedaConfig(tiling=None) (no --tiling), the default, to use the tile shapes the estimator was "
                "trained with")
        shapes = {tuple(s) for heads in self.tile_shapes for s in heads}
        if len(shapes) == 1:
            shape = shapes.pop()
            hint += f", or pass VedaConfig(tiling={shape}) (--tiling {'x'.join(map(str, shape))})"
        tiling_file = os.path.join(self.source, "tiling.json") if self.source is not None else None
        if tiling_file is not None and os.path.isfile(tiling_file):
            try:                                    # named only when it holds the estimator's shapes (a tiling.json
                with open(tiling_file) as f:        # left by an earlier run into the same folder would not)
                    same = json.load(f).get("layers") == self.tile_shapes
            except (OSError, ValueError, AttributeError):
                same = False
            if same:
                hint += (f", or VedaConfig(tiling={tiling_file!r}) (--tiling {tiling_file}: the tiling it was "
                         "distilled with)")
        return hint

    # ------------------------------------------------------------------ hub mixin: safetensors only
    def _save_pretrained(self, save_directory: Path) -> None:
        """huggingface_hub's (the weights as `model.safetensors`), the file readable as the umask allows, like the
        config and card beside it (safetensors writes it owner-only)."""
        from .._io import chmod_by_umask

        super()._save_pretrained(save_directory)
        chmod_by_umask(Path(save_directory) / SAFETENSORS_NAME)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> "VedaEstimator":
        """huggingface_hub's `from_pretrained` (a local directory or a hub id); a config.json that is no JSON object,
        lacks a field or holds an unknown one raises a ValueError naming it (huggingface_hub would raise its own
        errors, or fill the field with the constructor's default and drop the unknown one), from the hub too."""
        from huggingface_hub.errors import (HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError)

        name = os.fspath(pretrained_model_name_or_path)
        load_args = hub_load_args()
        allowed = load_args + tuple(p for p in inspect.signature(cls.__init__).parameters if p != "self")
        unknown = sorted(k for k in kwargs if k not in allowed)
        if unknown or args:         # (huggingface_hub would hand them to the constructor: read as a bad config.json)
            given = ", ".join([repr(k) for k in unknown] + [f"{len(args)} positional"] * bool(args))
            raise TypeError(f"VedaEstimator.from_pretrained({name!r}) got unexpected argument(s) {given}; it takes "
                            f"the path or hub id and the keywords {', '.join(load_args)} (the estimator's fields "
                            "come from its config.json; the transformer it serves is checked by videosparse.apply).")
        try:
            config = _config_file(name, kwargs)
            if config is not None:          # (without one, every constructor argument is given)
                _check_estimator_config(config)
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, HFValidationError) as err:
            if os.path.isdir(name):
                raise
            # the revision belongs to a hub id; a path the hub refused never took it
            shown = f"{name}@{kwargs['revision']}" if kwargs.get("revision") and _HUB_ID.fullmatch(name) else name
            raise _hub_load_error(shown, err) from err    # a mistyped folder: name it, not the hub's connection

    @classmethod
    def _from_pretrained(cls, *, model_id: str, revision: str | None, cache_dir: str | Path | None,
                         force_download: bool, local_files_only: bool, token: str | bool | None,
                         map_location: str = "cpu", strict: bool = True, **model_kwargs):
        """Load weights from `model.safetensors` only (never pickle), strictly."""
        import safetensors.torch

        if not model_kwargs and os.path.isdir(model_id) and not os.path.isfile(os.path.join(model_id, "config.json")):
            raise ValueError(f"{model_id!r} holds no config.json; a VedaEstimator directory is what save_pretrained "
                             "or `videosparse distill` writes.")
        try:
            with torch.device("meta"):      # no random init to throw away (and the global RNG left as it was)
                model = cls(**model_kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the config.json of estimator {model_id!r} does not describe a VedaEstimator ({e}); "
                             "expected what save_pretrained or `videosparse distill` writes.") from None
        if os.path.isdir(model_id):
            model_file = os.path.join(model_id, SAFETENSORS_NAME)
            if not os.path.isfile(model_file):
                raise ValueError(f"{model_id!r} holds no {SAFETENSORS_NAME}; VedaEstimator loads safetensors "
                                 "weights only.")
        else:
            model_file = hf_hub_download(repo_id=model_id, filename=SAFETENSORS_NAME, revision=revision,
                                         cache_dir=cache_dir, force_download=force_download, token=token,
                                         local_files_only=local_files_only)
        try:
            params = dict(model.named_parameters())
            state = {name: t.to(params[name].dtype) if name in params and t.is_floating_point() else t
                     for name, t in safetensors.torch.load_file(model_file, device=map_location).items()}
            model.load_state_dict(state, strict=True, assign=True)
        except (safetensors.SafetensorError, RuntimeError, OSError) as e:
            raise ValueError(f"the weights {model_file!r} of estimator {model_id!r} cannot be loaded into the "
                             f"estimator its config.json describes ({' '.join(str(e).split())[:300]}).") from None
        bad = _non_finite(model)
        if bad:
            raise ValueError(f"the weights {model_file!r} of estimator {model_id!r} hold non-finite values in "
                             f"{', '.join(bad)} (a diverged distillation); distill it again.")
        # what names it in reports and reloads it from a config's to_dict: the snapshot folder of a cache given
        # (the default cache is found again), the revision of a hub id (as "owner/name@revision")
        if os.path.isdir(model_id):
            model.source = model_id
        elif cache_dir is not None:
            model.source = os.path.dirname(model_file)
        else:
            model.source = model_id if revision is None else f"{model_id}@{revision}"
        model.eval()
        return model.to(map_location)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _check_estimator_dir(path: str) -> None:
    """ValueError naming what is wrong when the directory `path` is no saved estimator (config.json, a JSON object,
    and the safetensors weights)."""
    missing = [n for n in ("config.json", SAFETENSORS_NAME) if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise ValueError(f"estimator directory {path!r} has no {' or '.join(missing)}; expected what "
                         "VedaEstimator.save_pretrained or `videosparse distill` writes (config.json and "
                         f"{SAFETENSORS_NAME}).")
    _check_estimator_config(os.path.join(path, "config.json"))


def hub_load_args() -> tuple[str, ...]:
    """The keywords `VedaEstimator.from_pretrained` takes besides constructor fields: the installed huggingface_hub's
    `ModelHubMixin.from_pretrained` keywords (they differ between versions) and `_from_pretrained`'s own."""
    from huggingface_hub import ModelHubMixin

    hub = [p.name for p in inspect.signature(ModelHubMixin.from_pretrained).parameters.values()
           if p.kind is p.KEYWORD_ONLY]
    return tuple(hub) + ("map_location", "strict")


def _config_file(path: str, hub_kwargs: dict[str, Any]) -> str | None:
    """The config.json of the estimator at `path` (a local directory, or a hub id: fetched as the mixin fetches it, so
    its later read is cached), or None where there is none (the mixin's own loading then says why)."""
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
        return config if os.path.isfile(config) else None
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return hf_hub_download(repo_id=path, filename="config.json", **{
            k: hub_kwargs[k] for k in ("revision", "cache_dir", "force_download", "token", "local_files_only")
            if k in hub_kwargs})
    except EntryNotFoundError as err:   # a repository without one; any other failure (no such repository, not
        if isinstance(err, LocalEntryNotFoundError):       # cached offline, no network) is raised now: the mixin
            raise                                          # would only try the same lookup again
        return None


def _estimator_config(source: str | os.PathLike) -> str | None:
    """The checked config.json of the estimator directory or hub id `source` (None: no such directory and no hub id
    in form, or a hub repository without one); a hub lookup that fails raises `load_estimator`'s ValueError."""
    path = _local(os.fspath(source))
    repo, revision = split_revision(path)
    if not os.path.isdir(path) and not _HUB_ID.fullmatch(repo):
        return None                     # (no estimator: loading it says so)
    try:
        config = _config_file(repo, {} if revision is None else {"revision": revision})
    except Exception as err:            # the same error load_estimator gives, before the weights are asked for
        raise _hub_load_error(path, err) from err
    if config is not None:
        _check_estimator_config(config)
    return config


def _recorded_component(config: str) -> str | None:
    with open(config) as f:
        return json.load(f).get("component")


def records_no_component(source: Any) -> bool:
    """Whether the estimator `source` (object, directory or hub id) has a config that names no component (saved
    before estimators recorded it); False for one that names one, and for a source with no config to read (its
    loading says what is wrong)."""
    if isinstance(source, VedaEstimator):
        return source.component is None
    if not isinstance(source, (str, os.PathLike)):
        return False
    try:
        config = _estimator_config(source)
        return config is not None and _recorded_component(config) is None
    except Exception:               # (not readable: the estimator's loading names the problem)
        return False


def distilled_component(source: Any) -> str | None:
    """The pipeline component an estimator (object, directory or hub id) was distilled from, from its config.json
    without loading its weights; None where it records none (saved before estimators recorded it) or has no config."""
    if isinstance(source, VedaEstimator):
        return source.component
    config = _estimator_config(source) if isinstance(source, (str, os.PathLike)) else None
    return None if config is None else _recorded_component(config)


def estimator_label(estimator: Any) -> str:
    """An estimator (or a tuple of them) as errors name it: its path or hub id, or its class for an object."""
    if isinstance(estimator, tuple):
        return "(" + ", ".join(map(estimator_label, estimator)) + ")"
    source = estimator if isinstance(estimator, (str, os.PathLike)) else getattr(estimator, "source", None)
    return repr(os.fspath(source)) if source is not None else f"<{type(estimator).__name__} object>"


def estimators_by_component(estimators: Sequence[Any], components: Sequence[str] | None = None) -> dict[str, Any]:
    """Several estimators (objects, directories or hub ids), one per transformer of a pipeline, by the component each
    was distilled from (read from its config.json). ValueError for one that records none, two of one component, or
    (given the pipeline's `components`) one distilled from a component not among them."""
    served: dict[str, Any] = {}
    for estimator in estimators:
        component = distilled_component(estimator)
        if component is None:
            where = f" one of {sorted(components)}" if components is not None else " a transformer"
            raise ValueError(f"the estimator {estimator_label(estimator)} records no component (saved before "
                             "estimators recorded the one they were distilled from), so it cannot be matched to"
                             f"{where}; name each: videosparse.apply(pipe, {{'transformer': VedaConfig(estimator=...), "
                             "'transformer_2': VedaConfig(...)}).")
        if components is not None and component not in components:
            raise ValueError(f"the estimator {estimator_label(estimator)} was distilled from {component!r}; this "
                             f"pipeline's transformers are {sorted(components)}.")
        if component in served:
            raise ValueError(f"the estimators {estimator_label(served[component])} and {estimator_label(estimator)} "
                             f"were both distilled from {component!r}; give at most one per transformer.")
        served[component] = estimator
    return served


_SAVED_FIELDS = ("model_class", "num_layers", "num_heads", "head_dim", "block", "tile_shapes")


def _check_estimator_config(config: str) -> None:
    """ValueError naming the file when `config` is not a JSON object (as save_pretrained writes it)."""
    try:
        with open(config) as f:
            fields = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"estimator config {config!r} cannot be read as JSON ({err}).") from None
    if not isinstance(fields, dict):
        raise ValueError(f"estimator config {config!r} holds a {type(fields).__name__}, not the JSON object "
                         "of fields VedaEstimator.save_pretrained writes.")
    # the constructor's defaults would fill a missing block or tile_shapes (4x4x8 tiles for an estimator trained on
    # others), and huggingface_hub drops a key the constructor does not take (a misspelt "tile_shape"): both silently
    missing = [k for k in _SAVED_FIELDS if k not in fields]
    unknown = sorted(set(fields) - set(inspect.signature(VedaEstimator.__init__).parameters) - {"self"})
    if missing or unknown:
        raise ValueError(f"estimator config {config!r} " + "; ".join(
            ([f"lacks {missing}"] if missing else []) + ([f"holds unknown fields {unknown}"] if unknown else []))
            + f"; save_pretrained and `videosparse distill` write {list(_SAVED_FIELDS)} (and init_std, density).")


def _local(path: str) -> str:
    """`path` with a leading "~" expanded where that names something on disk (a hub id never starts with "~")."""
    if path.startswith("~"):
        expanded = os.path.expanduser(path)
        if os.path.exists(expanded):
            return expanded
    return path


def split_revision(path: str) -> tuple[str, str | None]:
    """("owner/name", "revision") of a hub id written "owner/name@revision" (as `VedaEstimator.source` names one
    loaded at a revision; a hub id holds no "@", a revision may), else (path, None); an existing local path is never
    split. A ValueError where a local folder named like the hub id would be loaded in place of that revision."""
    repo, sep, revision = path.partition("@")
    if not (sep and revision and _HUB_ID.fullmatch(repo) and not os.path.exists(path)):
        return path, None
    if os.path.isdir(repo):         # huggingface_hub would load the folder and ignore the revision
        raise ValueError(f"estimator={path!r} is no local folder; read as revision {revision!r} of the hub id "
                         f"{repo!r}, the local folder {repo!r} would be loaded instead (huggingface_hub takes a folder "
                         "first): move it, or give the folder itself.")
    return repo, revision


def _hub_load_error(path: str, err: Exception) -> ValueError:
    return ValueError(f"estimator={path!r}: no such local directory (from {os.getcwd()!r}), and as a hub id it cannot "
                      f"be loaded ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}).")


def _non_finite(model: VedaEstimator) -> list[str]:
    """Names of the parameters holding NaN or inf: its scores would never be chosen, so only each query tile's own
    tile would run, silently."""
    return [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]


def load_estimator(source: Any) -> VedaEstimator:
    """A `VedaEstimator` from an object, a local directory or a hub id (safetensors only); ValueError for weights
    that hold NaN or inf."""
    if isinstance(source, VedaEstimator):
        bad = _non_finite(source)
        if bad:
            raise ValueError(f"estimator {source.source or 'built in memory'!r} holds non-finite values in "
                             f"{', '.join(bad)} (a diverged distillation or a failed update); distill it again.")
        return source
    if isinstance(source, (str, os.PathLike)):
        path = _local(os.fspath(source))
        repo, revision = split_revision(path)
        if os.path.isdir(path):
            _check_estimator_dir(path)
        elif os.path.isfile(path):
            raise ValueError(f"estimator={path!r} is a file; give the directory `videosparse distill` or "
                             "`VedaEstimator.save_pretrained` wrote (config.json and model.safetensors).")
        elif not _HUB_ID.fullmatch(repo):
            raise ValueError(f"estimator={path!r} is neither an existing directory nor a hub id (owner/name).")
        else:       # "runs/est" is a hub id in form, and a local folder the user may have meant
            from huggingface_hub.errors import (HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                                RepositoryNotFoundError)

            try:
                return VedaEstimator.from_pretrained(repo, revision=revision)
            except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, HFValidationError) as err:
                raise _hub_load_error(path, err) from err
        return VedaEstimator.from_pretrained(path)
    raise TypeError(f"estimator={source!r} must be a VedaEstimator, a directory or a hub id.")
