"""Loading the pipeline a command runs on: a hub id, a local directory, or the embedded default."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("videosparse")


@dataclass
class LoadedPipeline:
    """A pipeline plus the call defaults that suit it (frames, size, steps, prompt)."""

    pipe: object
    name: str
    defaults: dict = field(default_factory=dict)


TINY_DEFAULTS = dict(prompt="a red circle moving left on a dark background", num_frames=17, height=256, width=256,
                     num_inference_steps=8, guidance_scale=5.0, max_sequence_length=32)
HUB_PROMPT = "A cat walks on the grass, realistic"     # the rest of a hub model's call: its pipeline's defaults


def pipeline_call_defaults(pipe) -> dict:
    """HUB_PROMPT plus the pipeline's own defaults for frames, size, steps and guidance (from
    its `__call__` signature: 129 frames 720x1280 for HunyuanVideo, ...); a default of None (CogVideoX derives
    its size from the transformer config) is left to the pipeline."""
    import inspect

    params = inspect.signature(type(pipe).__call__).parameters
    defaults = {"prompt": HUB_PROMPT}
    for name in ("num_frames", "height", "width", "num_inference_steps", "guidance_scale"):
        value = params[name].default if name in params else None          # a parameter it lacks is not passed
        if value is not None and value is not inspect.Parameter.empty:
            defaults[name] = value
    return defaults


def image_parameter(pipe):
    """The `image` parameter of an image-to-video pipeline's `__call__` (inspect.Parameter), else None."""
    import inspect

    return inspect.signature(type(pipe).__call__).parameters.get("image")


def _pipeline_components(model: str) -> tuple[dict[str, list], str | None]:
    """(`model`'s model_index.json entries that name a component, {name: [library, class]} with class None when
    absent; its pipeline class name), read without loading a weight; OSError / ValueError when it cannot be read."""
    from diffusers import DiffusionPipeline

    index = DiffusionPipeline.load_config(model)
    return {name: spec for name, spec in index.items() if not name.startswith("_") and isinstance(spec, list)
            and len(spec) == 2}, index.get("_class_name")


def check_component(model: str | None, component: str) -> None:
    """ValueError when `model`'s pipeline has no `component` (e.g. "transformer_2" of a Wan 2.1 model), read from
    its model_index.json before any weight loads; the embedded models, and a model whose index cannot be read here
    (the load then says why), are checked after their load instead."""
    if model in (None, "reference", "tiny"):
        return
    try:
        parts, _ = _pipeline_components(model)
    except (OSError, ValueError):
        return
    present = {name: spec for name, spec in parts.items() if spec[1] is not None}
    if component not in present:
        transformers = sorted(name for name, spec in present.items() if "Transformer" in str(spec[1]))
        raise ValueError(f"component={component!r}: {model!r} has no such component (its model_index.json lists "
                         f"{', '.join(sorted(present)) or 'none'}); its transformers: "
                         f"{', '.join(transformers) or 'none'}.")


def _index_class(model: str) -> str | None:
    """The pipeline class a local model folder's model_index.json names (None: not a readable local folder)."""
    try:
        with open(os.path.join(model, "model_index.json")) as f:
            return json.load(f).get("_class_name")
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def size_stub(model: str | None):
    """What a size check reads of `model`'s pipeline (`vae_scale_factor_spatial`, `video_processor`,
    `transformer.config`) without loading a weight: its pipeline class built around a VAE made on the meta device from
    the VAE's config and its scheduler, next to the transformer's config. None for the embedded models, pipelines
    with a safety checker (Cosmos's constructor loads its guardrail models when given none), or when the files
    cannot be read or the class not built that way here (the check then runs after the load)."""
    if model in (None, "reference", "tiny"):
        return None
    import types

    import diffusers

    try:
        parts, pipeline_class = _pipeline_components(model)
        if "safety_checker" in parts:       # Cosmos builds its guardrail models in __init__ when given none
            return None
        transformer = parts.get("transformer", [None, None])[1]
        config = getattr(diffusers, transformer).load_config(model, subfolder="transformer")
        kwargs = {name: None for name in parts}
        vae_class = getattr(diffusers, parts["vae"][1])
        with torch.device("meta"):
            kwargs["vae"] = vae_class.from_config(vae_class.load_config(model, subfolder="vae"))
        if parts.get("scheduler", [None, None])[1]:
            scheduler_class = getattr(diffusers, parts["scheduler"][1])
            kwargs["scheduler"] = scheduler_class.from_config(scheduler_class.load_config(model, subfolder="scheduler"))
        pipe = getattr(diffusers, pipeline_class)(**kwargs)
    except Exception:                      # any file, class or constructor this cannot handle: checked after the load
        return None
    stub = type(type(pipe).__name__, (), {})()          # named as the pipeline, for the messages
    stub.vae_scale_factor_spatial = getattr(pipe, "vae_scale_factor_spatial", None)
    stub.video_processor = getattr(pipe, "video_processor", None)
    stub.vae_scale_factor_temporal = getattr(pipe, "vae_scale_factor_temporal", None)
    stub.transformer = types.SimpleNamespace(config=types.SimpleNamespace(**config))
    return stub


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def load_pipeline(model: str | None = None, device: str | None = None,
                  dtype: torch.dtype | None = None) -> LoadedPipeline:
    """Load `model` with diffusers' own loading code, or build the embedded default offline.

    Args:
        model: a hub id (e.g. "Wan-AI/Wan2.1-T2V-1.3B-Diffusers") or a local directory; None or
            "reference" for the embedded default (the small reference model trained for this package,
            shipped in it, loaded offline); "tiny" for a tiny random-weight Wan pipeline built from configs.
        device: "cuda", "cpu", ... (default: cuda when available).
        dtype: parameter dtype (default: bf16 on CUDA, fp32 on CPU).
    """
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    if isinstance(model, str) and model.startswith("~"):     # as check_model reads it; diffusers takes no ~
        model = os.path.expanduser(model)
    if model is None or model == "reference":
        from .reference import REFERENCE_CALL_DEFAULTS, load_reference_pipeline

        pipe = load_reference_pipeline(device=device, dtype=dtype)
        loaded = LoadedPipeline(pipe, "videosparse reference model (shipped, offline)", dict(REFERENCE_CALL_DEFAULTS))
    elif model == "tiny":
        from .tiny_wan import build_tiny_wan_pipeline

        pipe = build_tiny_wan_pipeline(dtype=dtype)
        loaded = LoadedPipeline(pipe, "tiny-wan (random weights, built offline)", dict(TINY_DEFAULTS))
    elif _index_class(model) == "ReferenceVideoPipeline":       # a retrained reference model's export
        from .reference import REFERENCE_CALL_DEFAULTS, load_reference_pipeline

        pipe = load_reference_pipeline(device=device, dtype=dtype, path=model)
        loaded = LoadedPipeline(pipe, f"videosparse reference model ({model})", dict(REFERENCE_CALL_DEFAULTS))
    else:
        from diffusers import DiffusionPipeline

        try:                            # weights from safetensors only: never unpickle a .bin
            pipe = DiffusionPipeline.from_pretrained(model, dtype=dtype, use_safetensors=True)
        except OSError as err:          # not on disk and no hub to fetch it from: diffusers' text, then ours
            folder = os.path.expanduser(model)
            pickled = os.path.isdir(folder) and any(
                name.endswith((".bin", ".pt", ".pth", ".ckpt")) for _, _, names in os.walk(folder) for name in names)
            if "safetensors" in str(err) and (pickled or not os.path.isdir(folder)):
                raise OSError(f"{err}\n{model!r}: videosparse loads weights from safetensors files only (a pickled "
                              ".bin can run code); convert them, e.g. load and `save_pretrained` where the source "
                              "is trusted.") from err
            if os.path.isdir(folder):   # a local folder: the hub's advice would not help
                what = ("has no model_index.json, so it is not a diffusers pipeline folder" if not
                        os.path.isfile(os.path.join(folder, "model_index.json")) else
                        "is a pipeline folder with a component missing or damaged (see above)")
                raise OSError(f"{err}\n{model!r} {what}; give the folder `save_pretrained` wrote, or a hub id.") from err
            from ..eval.synthetic_models import SYNTHETIC_MODELS

            # diffusers' text points to a stack trace the CLI does not print
            said = str(err).replace(" Please check out the root cause in the stacktrace above.", "")
            if model in SYNTHETIC_MODELS:
                raise OSError(f"{said}\n{model!r} names a random-weight model of `videosparse evaluate --synthetic`, "
                              "which has no pipeline to run: give a hub id such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers "
                              "or a local pipeline folder; the models that need no download are 'reference' and "
                              "'tiny'.") from err
            raise OSError(f"{said}\n{model!r} could not be loaded: download it first (`hf download {model}` where "
                          "there is network, then run with HF_HUB_OFFLINE=1) or pass a local directory; the models "
                          "that need no download are 'reference' and 'tiny'.") from err
        loaded = LoadedPipeline(pipe, model, pipeline_call_defaults(pipe))
    loaded.pipe.to(device)
    return loaded


def check_size(pipe, call: dict) -> None:
    """ValueError for a height/width the model cannot tile: multiples of the VAE's spatial factor times the
    transformer's patch (16 for Wan, CogVideoX, HunyuanVideo; 32 for LTX-Video). The VAE factor is the
    pipeline's `vae_scale_factor_spatial`, else its video processor's (every video pipeline builds one with it)."""
    vae = getattr(pipe, "vae_scale_factor_spatial", None)
    if not isinstance(vae, int):
        vae = getattr(getattr(getattr(pipe, "video_processor", None), "config", None), "vae_scale_factor", None)
    patch = getattr(getattr(getattr(pipe, "transformer", None), "config", None), "patch_size", None)
    if not isinstance(vae, int) or patch is None:
        return
    multiple = vae * (patch[-1] if isinstance(patch, (tuple, list)) else int(patch))
    for name in ("height", "width"):
        value = call.get(name)
        if value is not None and value % multiple:
            raise ValueError(f"--{name}={value} must be a multiple of {multiple} for {type(pipe).__name__} "
                             f"(VAE factor {vae} x patch); e.g. {max(multiple, value // multiple * multiple)}.")
    _check_rope_table(pipe, call, vae, patch)


def _check_rope_table(pipe, call: dict, vae: int, patch) -> None:
    """ValueError for a video longer, taller or wider in patches than the transformer's RoPE tables
    (`rope_max_seq_len`, Wan's family: diffusers' RoPE then fails with a view error deep in the forward)."""
    config = pipe.transformer.config
    limit = getattr(config, "rope_max_seq_len", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return
    pt, ph, pw = patch if isinstance(patch, (tuple, list)) and len(patch) == 3 else (1, int(patch), int(patch))
    temporal = getattr(pipe, "vae_scale_factor_temporal", None)
    frames = call.get("num_frames")
    sizes = {"height": (call.get("height"), vae * ph), "width": (call.get("width"), vae * pw)}
    if isinstance(temporal, int) and isinstance(frames, int):
        sizes["frames"] = (frames, None)
    for name, (value, factor) in sizes.items():
        if value is None:
            continue
        if name == "frames":        # as Wan's pipelines round it: up to a multiple of the VAE's factor, plus 1
            latent = (value - 1) // temporal + 1 if value % temporal == 1 else value // temporal + 1
            patches, largest = latent // pt, (limit * pt - 1) * temporal + 1
        else:
            patches, largest = value // factor, limit * factor
        if patches > limit:
            model = getattr(config, "_class_name", None) or type(pipe.transformer).__name__
            raise ValueError(f"--{name}={value} gives {patches} patches along it, past the {limit} that {model}'s "
                             f"RoPE tables hold (rope_max_seq_len); give at most {largest}.")
