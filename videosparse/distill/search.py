"""Head-aware tiling search on a model's dense attention (the `videosparse search-tiling` command).

Runs the dense pipeline on the prompts under `videosparse.processors.observe`, and for the sampled
steps feeds every self-attention call, as it happens, to `videosparse.veda.tiling.TilingSearch`, which scores the
candidate tile shapes per (layer, head) and writes the JSON that `VedaConfig(tiling=path)` reads.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch

from .._run_checks import check_output
from ..models.loading import check_component
from ..veda.tiling import TilingSearch, TilingSearchResult
from .capture import load_capture_pipeline, sample_steps, transformer_info
from .config import TilingSearchConfig, read_prompts

logger = logging.getLogger(__name__)


def observe_sampled_records(cfg, pipe, call_kwargs: dict[str, Any], consume: Callable[[Any], None], *,
                            layers=None) -> int:
    """Run the dense pipeline once per prompt and hand each self-attention record of the sampled steps (q, k, v
    detached, on the pipeline's device) to `consume` as the forward makes it; none is kept, so memory stays that of
    one attention call. Steps follow `sample_steps(num_steps, cfg.steps_per_prompt, cfg.seed, i)`. Returns the
    records consumed."""
    from ..processors import observe

    transformer = getattr(pipe, cfg.component)
    prompts = read_prompts(cfg.prompts)
    num_steps = int(call_kwargs["num_inference_steps"])
    total = 0
    for i, prompt in enumerate(prompts):
        steps = set(sample_steps(num_steps, cfg.steps_per_prompt, cfg.seed, i))
        count = 0

        def keep(record) -> None:
            nonlocal count
            if record.step is not None and record.step not in steps:
                return
            if cfg.branches is not None and record.branch not in cfg.branches:
                return
            if layers is not None and record.layer not in layers:
                return
            record.q, record.k, record.v = record.q.detach(), record.k.detach(), record.v.detach()
            consume(record)
            count += 1

        with observe(transformer, keep), torch.no_grad():
            pipe(prompt, generator=torch.Generator("cpu").manual_seed(cfg.seed + i), output_type="latent",
                 **call_kwargs)
        logger.info("prompt %d/%d: %d attention records", i + 1, len(prompts), count)
        total += count
    return total


def run_tiling_search(cfg: TilingSearchConfig) -> TilingSearchResult:
    """Search per-(layer, head) tile shapes on a model and write `cfg.output` (JSON).

    Args:
        cfg: a `TilingSearchConfig` (model, prompts, steps, density, block, output, ...).

    Returns:
        The `TilingSearchResult` (its `.summary` compares the searched tiling with the best single shape).

    Example:
        >>> from videosparse.distill import TilingSearchConfig, run_tiling_search
        >>> res = run_tiling_search(TilingSearchConfig(model="reference", output="tiling.json"))   # doctest: +SKIP
    """
    read_prompts(cfg.prompts)                               # a bad prompts value fails before the model loads
    check_output("output=", cfg.output, parents=True)       # and an output that cannot be written, not after the search
    check_component(cfg.model, cfg.component)               # and a component the pipeline lacks (model_index.json)
    pipe, call_kwargs = load_capture_pipeline(cfg)
    transformer = getattr(pipe, cfg.component, None)
    if not isinstance(transformer, torch.nn.Module):
        raise ValueError(f"component={cfg.component!r} is not a transformer of {type(pipe).__name__}.")
    info = transformer_info(transformer)
    beyond = [layer for layer in cfg.layers or () if layer >= info.num_layers]
    if beyond:
        raise ValueError(f"layers={list(cfg.layers)} names {beyond}, but {info.model_class} has {info.num_layers} "
                         f"self-attention layers (0..{info.num_layers - 1}).")
    search = TilingSearch(density=cfg.density, block=cfg.block, max_padding=cfg.max_padding,
                          max_shapes_per_layer=cfg.max_shapes_per_layer, backend=cfg.backend)
    observe_sampled_records(cfg, pipe, call_kwargs, search.add,
                            layers=None if cfg.layers is None else set(cfg.layers))
    result = search.result(num_layers=info.num_layers, num_heads=info.num_heads,
                           meta={"model_class": info.model_class, "num_layers": info.num_layers,
                                 "num_heads": info.num_heads, "search_config": cfg.to_dict()})
    out = Path(cfg.output)
    if out.parent and not out.parent.exists():
        os.makedirs(out.parent, exist_ok=True)
    result.save(out)
    return result
