"""The evaluation report: environment facts, strict-JSON storage, and the markdown tables.

`report.json` is strict JSON: non-finite floats (PSNR of dense vs itself is +inf) are stored as the
strings "inf", "-inf" and "nan"; `load_report` turns them back into floats.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
import uuid
from typing import Any

import numpy as np
import torch

from .._io import from_jsonable, to_jsonable, write_atomic

REPORT_FORMAT = 1


def save_report(report: dict, path: str) -> None:
    """Write `report` as strict JSON, atomically (`write_atomic`)."""
    write_atomic(path, json.dumps(to_jsonable(report), indent=1, allow_nan=False))


def _psnr_cell(summary: dict) -> str:
    """Mean PSNR of a method, with the number of its cells identical to dense (inf dB) when there are any."""
    text = _fmt(summary.get("psnr_db"), 2)
    equal = summary.get("cells_equal_to_dense") or 0
    return f"{text} ({equal} equal to dense)" if equal else text


def load_report(path: str) -> dict | None:
    """The report at `path` (non-finite floats restored), or None when there is none."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            report = from_jsonable(json.load(f))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); move it away (or, for a quality run, pass "
                         "--overwrite).") from None
    if report is not None and not isinstance(report, dict):
        raise ValueError(f"{path} holds a JSON {type(report).__name__}, not a videosparse report; move it away (or, "
                         "for a quality run, pass --overwrite).")
    return report


def remove_earlier_outputs(out_dir: str, keep: tuple[str, ...] = ()) -> list[str]:
    """For an overwrite: remove the files the report in `out_dir` names as its own (each quality cell's frames,
    its videos and plots, a synthetic section's dense output), so that none of them reads as the new run's; files it
    does not name, and those in `keep` (relative to `out_dir`), stay. Returns the paths removed (none when there is
    no readable report)."""
    try:
        old = load_report(os.path.join(out_dir, "report.json"))
    except ValueError:                  # not a report: nothing it names can be known
        return []
    if not old:
        return []
    names = [cell.get("frames_file") for cell in (old.get("cells") or {}).values() if isinstance(cell, dict)]
    artifacts = old.get("artifacts") or {}
    names += [*(artifacts.get("videos") or []), *(artifacts.get("plots") or [])]
    names += [f"dense_output_{name}.safetensors" for name in (old.get("synthetic") or {})]
    removed = []
    root = os.path.realpath(out_dir)
    for name in names:
        if not isinstance(name, str) or not name or name in keep:
            continue
        path = os.path.realpath(os.path.join(out_dir, name))
        if os.path.commonpath([root, path]) == root != path and os.path.isfile(path):     # inside out_dir only
            os.remove(path)
            removed.append(path)
    return removed


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def as_saved(obj: Any) -> Any:
    """`obj` as it reads back from a saved report (`save_report` then `load_report`: tuples become lists): the form
    in which a value of this run is compared with an earlier report's."""
    return from_jsonable(json.loads(json.dumps(to_jsonable(obj))))


def environment(device: str | torch.device) -> dict[str, Any]:
    """Versions, device and kernel backends: what every report carries beside its numbers."""
    from .. import __version__
    from ..kernels.dispatch import AUTO_ORDER

    device = torch.device(device)
    env: dict[str, Any] = {
        "videosparse": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "torchmetrics": _version("torchmetrics"),
        "triton": _version("triton"),
        "numpy": np.__version__,
        "device": str(device),
        "cpu_threads": torch.get_num_threads(),
        "kernel_backends_auto_order": list(AUTO_ORDER),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   sm_count=props.multi_processor_count)
    return env


# what of `environment` a measured time depends on: a rerun that keeps earlier measurements must match it
TIMING_KEYS = ("videosparse", "torch", "triton", "diffusers", "device", "gpu", "cuda", "cpu_threads")


def timing_environment(device: str | torch.device) -> dict[str, Any]:
    """The part of `environment(device)` that times depend on (versions, device, GPU, CPU threads)."""
    env = environment(device)
    return {key: env[key] for key in TIMING_KEYS if key in env}


def changed_keys(old: dict | None, new: dict, prefix: str = "") -> list[str]:
    """"key: old -> new" for every key whose value differs between the two (either side may lack it; nested dicts
    as "a.b: ...")."""
    old = old if isinstance(old, dict) else {}
    changed = []
    for key in [*new, *(k for k in old if k not in new)]:
        was, now = old.get(key), new.get(key)
        if isinstance(was, dict) and isinstance(now, dict):
            changed += changed_keys(was, now, f"{prefix}{key}.")
        elif was != now:
            changed.append(f"{prefix}{key}: {was} -> {now}")
    return changed


UNRECORDED_RUN = "a run before runs were recorded"


def new_run_id() -> str:
    """Names one run of the evaluation (start time, process id, a random suffix), stored as `timed_in` with each
    cell or row it times: a rerun into the same directory joins its measurements to the report's."""
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pid {os.getpid()} {uuid.uuid4().hex[:6]}"


def runs_of(rows: list[dict]) -> list[str]:
    """The sorted runs that timed `rows` (their `timed_in`; rows from before it was recorded: `UNRECORDED_RUN`)."""
    return sorted({r.get("timed_in") or UNRECORDED_RUN for r in rows})


def rerun_timing_notes(runs: dict[str, list[str]], prefix: str = "") -> list[str]:
    """A note for each method timed in another run of the evaluation than the dense one, or over several runs.

    Args:
        runs: method label -> the runs that timed its cells or row (`runs_of`), dense first.
        prefix: put before each label (a synthetic model's name).

    Its speedups then compare separate processes (or calls), whose clocks, caches and compiled kernels can differ.
    """
    if not runs:
        return []
    dense_label, base = next(iter(runs.items()))
    notes = []
    for label, mine in runs.items():
        if not mine or not base or (mine == base and len(mine) == 1):
            continue
        where = f"over {len(mine)} runs of the evaluation" if len(mine) > 1 else f"in another run than {dense_label}"
        notes.append(f"{prefix}{label}: timed {where} (a rerun into this directory joins its measurements to the "
                     "report): its speedups compare separate processes; --overwrite times every method in one run.")
    return notes


# ------------------------------------------------------------------------------------------ markdown
def _steps(summary: dict) -> str:
    """"steps 4, 9": the sampled steps every method ran sparse at (from any summary row)."""
    common = next((row["attn_common_steps"] for row in summary.values() if "attn_common_steps" in row), None)
    return "steps " + ", ".join(map(str, common)) if common else "steps not recorded"


# what the per-method Amdahl column means (`amdahl_bound` in the JSON): an estimate, not a bound
AMDAHL_ESTIMATE = ("1 / ((1 - f) + f * w) with f the dense attention share and w the method's attention work: the "
                   "speedup if its attention cost w times the dense arm's attention time (mask building free). A "
                   "sparse kernel faster per tile pair than the dense arm's kernel beats it; the hard limit is the "
                   "bound with attention free")


def _fmt(value: Any, digits: int = 3, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if math.isnan(value):
            return "NaN"                       # a broken output, not a value left out ("–")
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _fmt_density(value: Any) -> str:
    """A requested density as given (0.125, 0.004, 1), not rounded to a fixed number of digits."""
    return f"{value:g}" if isinstance(value, float) and math.isfinite(value) else _fmt(value)


def calls_per_forward(row: dict) -> str:
    """"sparse/dense" attention calls per forward (the session counts the warm-up forwards too)."""
    n = row.get("calls_counted_forwards")
    if not n:                                       # a report written before the count was kept: totals
        return f"{row.get('sparse_calls')}/{row.get('dense_calls')} (all forwards)"
    return "/".join(f"{row.get(k, 0) / n:g}" for k in ("sparse_calls", "dense_calls"))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _environment_lines(env: dict) -> list[str]:
    keys = ("device", "gpu", "compute_capability", "torch", "diffusers", "triton", "videosparse",
            "kernel_backends_auto_order")
    return [", ".join(f"{k} {env[k]}" for k in keys if env.get(k) is not None)]


def render_markdown(report: dict) -> str:
    """report.md: what was run, the quality table, the speed table (with the Amdahl estimates), notes."""
    lines: list[str] = ["# videosparse evaluation", ""]
    env = report.get("environment", {})
    lines += ["**Environment:** " + _environment_lines(env)[0], ""]
    if report.get("mode") == "synthetic":
        lines += _synthetic_markdown(report)
    else:
        lines += _quality_markdown(report)
    notes = report.get("notes") or []
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines) + "\n"


def _quality_markdown(report: dict) -> list[str]:
    model, settings, shapes = report.get("model", {}), report.get("settings", {}), report.get("shapes", {})
    call = settings.get("call", {})
    lines = [
        f"**Model:** {model.get('name')} ({model.get('transformer_class')}, {model.get('dtype')}); "
        f"{call.get('num_frames')} frames {call.get('height')}x{call.get('width')}, "
        f"{call.get('num_inference_steps')} steps, guidance {call.get('guidance_scale')}; "
        f"token grid {shapes.get('grid')} = {shapes.get('video_tokens')} tokens, "
        f"{shapes.get('heads')} heads x {shapes.get('head_dim')}, {shapes.get('layers')} self-attention layers.",
        "",
        f"**Prompts:** {len(settings.get('prompts', []))}; **seeds:** {settings.get('seeds')}. Every method runs "
        "with the same seeds; quality is measured against dense (the same processors with `DenseConfig`).",
        "",
        "## Quality vs dense",
        "",
    ]
    summary = report.get("summary", {})
    rows = []
    for label, s in summary.items():
        rows.append([f"`{label}`", _fmt_density(s.get("nominal_density")), _fmt(s.get("realised_density")),
                     _fmt(s.get("attention_work")), _psnr_cell(s), _fmt(s.get("psnr_db_pooled"), 2),
                     _fmt(s.get("ssim"), 4),
                     _fmt(s.get("lpips"), 4), _fmt(s.get("attn_rel_l2_common", s.get("attn_rel_l2")), 4),
                     _fmt(s.get("tile_recall_common", s.get("tile_recall"))),
                     _fmt(s.get("mass_kept")), _fmt(s.get("oracle_mass_kept")), str(s.get("cells", 0))])
    lines += _table(["method", "density", "realised", "attn work", "PSNR dB", "pooled PSNR", "SSIM", "LPIPS",
                     "attn rel L2", "tile recall", "mass kept", "oracle mass", "cells"], rows)
    lines += [
        "",
        "*PSNR*: of the whole video (MSE pooled over frames; per-frame values are in report.json), mean over "
        "the cells that differ from dense (cells identical to dense are counted apart), as papers average it; "
        "*pooled PSNR*: of the MSE pooled over all the method's cells, identical ones included (robust to a cell "
        "that differs from dense in a few pixels, whose 80+ dB would pull the mean up). *realised*: kept tile "
        "pairs / all pairs over the sparse calls; *attn work*: the fraction of dense "
        "attention work done, dense-scheduled calls included. *attn rel L2* and *tile recall*: means over the "
        f"sampled (step, layer) calls at the steps where every method runs sparse ({_steps(summary)}; a method "
        "with dense steps runs sparse at fewer of the sampled steps, and the error is largest early), of the "
        f"first {settings.get('attention_sampling', {}).get('cells', 1)} (prompt, seed) cell(s), first CFG branch; the "
        "means over all of a "
        "method's sparse samples and per step are in report.json (`attn_rel_l2`, `attn_rel_l2_by_step`). *mass "
        "kept*: over all its sparse samples. Recall is vs the oracle (top tiles by true attention mass at the same "
        "per-row budget).",
        "",
        "## Speed",
        "",
    ]
    rows = []
    for label, s in summary.items():
        rows.append([f"`{label}`", _fmt(s.get("wall_s"), 2), _fmt(s.get("transformer_s"), 3),
                     _fmt(s.get("attention_s"), 3), _fmt(s.get("plan_s"), 3),
                     _fmt(100 * s["attention_share"] if s.get("attention_share") is not None else None, 1, "%"),
                     _fmt(s.get("speedup_transformer"), 2, "x"), _fmt(s.get("amdahl_bound"), 2, "x"),
                     _fmt(s.get("speedup_e2e"), 2, "x"), _fmt(s.get("speedup_attention"), 2, "x"),
                     ", ".join(s.get("kernels") or []) or "–"])
    lines += _table(["method", "e2e s", "transformer s", "attention s", "plan s", "attn share",
                     "transformer speedup", "Amdahl est.", "e2e speedup", "attention speedup", "kernel"], rows)
    dense = summary.get(next(iter(summary), ""), {})
    if dense.get("amdahl_bound_free_attention") is not None:
        lines += ["", f"Dense attention is {_fmt(100 * dense['attention_share'], 1)}% of transformer time: with "
                  f"attention free the transformer could run at most "
                  f"{_fmt(dense['amdahl_bound_free_attention'], 2)}x faster. The *Amdahl est.* column is "
                  f"{AMDAHL_ESTIMATE}. Times are per generation (*e2e*: the whole pipeline call; the others: "
                  "summed over its denoising steps), medians over the cells."]
    lines += ["", "## Artifacts", ""]
    for kind, paths in (report.get("artifacts") or {}).items():
        for p in paths if isinstance(paths, list) else [paths]:
            lines.append(f"- {kind}: `{p}`")
    return lines + [""]


def _synthetic_markdown(report: dict) -> list[str]:
    syn = report.get("synthetic", {})
    lines = []
    for name, model in syn.items():
        shape = model.get("shape", {})
        lines += [
            f"## Synthetic {name}: one transformer forward, random weights",
            "",
            f"Config: {model.get('config_summary')}; input {shape.get('video')} -> token grid {shape.get('grid')} = "
            f"{shape.get('tokens')} tokens; {model.get('dtype')}; {model.get('repeats')} timed forwards after "
            f"{model.get('warmup_run', model.get('warmup'))} warm-up (median).",
            "",
        ]
        rows = []
        for label, r in model.get("methods", {}).items():
            rows.append([f"`{label}`", _fmt(r.get("realised_density")), _fmt(r.get("forward_s"), 3),
                         _fmt(r.get("attention_s"), 3), _fmt(r.get("plan_s"), 3),
                         _fmt(100 * r["attention_share"] if r.get("attention_share") is not None else None, 1, "%"),
                         _fmt(r.get("speedup"), 2, "x"), _fmt(r.get("amdahl_bound"), 2, "x"),
                         _fmt(r.get("speedup_attention"), 2, "x"), calls_per_forward(r),
                         _fmt(r.get("output_rel_l2_vs_dense"), 4), r.get("kernel_backend") or "–"])
        lines += _table(["method", "realised density", "forward s", "attention s", "plan s", "attn share",
                         "speedup", "Amdahl est.", "attention speedup", "sparse/dense calls per forward",
                         "output rel L2", "kernel"], rows)
        bound = model.get("amdahl_bound_free_attention")
        timed = next(iter(model.get("methods", {}).values()), {}).get("attention_timed")
        how = f" (compiled: its SDPA calls timed {timed})" if timed else ""
        lines += ["", f"Dense attention share {_fmt(100 * model.get('dense_attention_share', float('nan')), 1)}%"
                  f"{how}: bound with attention free {_fmt(bound, 2)}x. *Amdahl est.*: {AMDAHL_ESTIMATE}.", ""]
    return lines
