"""Synthetic speed mode: a real-size transformer from its published config, random weights, one forward.

The speed half of the story for models whose weights cannot be loaded here: the transformer is built
from the published architecture (no download), in bf16 on the GPU, and one forward at the model's
default resolution is timed dense vs each method (the same `videosparse.apply` path a user takes,
mask building included). Attention and plan time come from `timing.AttentionTimer` (compiled: the dense
forward's SDPA calls in a profiled forward, `timing.profile_sdpa`), so the Amdahl estimate of the measured dense
attention share is printed beside the achieved speedup.

Random weights give near-uniform attention, so which tiles are chosen says nothing about quality;
the kernel's work at a density does not depend on it. The output's relative error vs dense is
reported only as a sanity check that the sparse path ran.

The models, their default videos and token grids are in `synthetic_models.py`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .._io import replace_durably
from .report import (REPORT_FORMAT, as_saved, changed_keys, environment, load_report, new_run_id, render_markdown,
                     remove_earlier_outputs, rerun_timing_notes, runs_of, save_report, timing_environment)
from .spec import MethodSpec, label_family
from .synthetic_models import (SyntheticSetup, build_transformer, check_feasible, check_supported, count_parameters,
                               make_inputs, synthetic_setup)
from .timing import AttentionTimer, TransformerTimer, profile_sdpa

logger = logging.getLogger("videosparse")


@dataclass
class SyntheticResult:
    """Everything measured for one model: per method forward/attention/plan times and statistics."""

    name: str
    setup: SyntheticSetup
    estimates: dict
    methods: dict[str, dict] = field(default_factory=dict)
    compile_mode: str | None = None


COMPILE_MODES: dict[str, dict] = {
    "default": {},
    "reduce-overhead": {"mode": "reduce-overhead"},                      # CUDA graphs
    "max-autotune-no-cudagraphs": {"mode": "max-autotune-no-cudagraphs"},
    "aot_eager": {"backend": "aot_eager"},                              # traces only: a check, not a speed
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dense_attention_seconds(setup: SyntheticSetup, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """Self-attention time of one dense forward, timed outside the model: layers x one SDPA call.

    The fallback for a compiled forward whose profile has no usable SDPA reading (CUDA graphs replay kernels without
    their ops; `timing.SdpaProfile.problem` sets impossible readings aside): SDPA is the same kernel
    compiled or not, but one call after an idle gap runs at a higher clock than the same call inside a forward
    under load (10.5 vs 11.4 ms at the Wan 1.3B shape on the H200), so this reads the share ~10% low.
    """
    shape = (1, setup.model.heads, setup.attention_tokens, setup.model.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    F = torch.nn.functional.scaled_dot_product_attention
    F(q, k, v)
    times = []
    for _ in range(max(repeats, 1)):
        _sync(device)
        t0 = time.perf_counter()
        F(q, k, v)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * setup.num_layers


@contextlib.contextmanager
def method_applied(transformer, config, compile_mode: str | None = None):
    """Apply `config` to `transformer`, wrapped in `torch.compile` when `compile_mode` (a key of
    `COMPILE_MODES`) is given. Yields (the module to call, its SparseSession); on exit the processors are
    removed and Dynamo is reset."""
    from ..processors import apply, remove

    session = apply(transformer, config)["transformer"]
    try:
        model = transformer
        if compile_mode is not None:
            torch._dynamo.reset()
            model = torch.compile(transformer, **COMPILE_MODES[compile_mode])
        yield model, session
    finally:
        remove(transformer)
        if compile_mode is not None:
            torch._dynamo.reset()


def first_output(result) -> torch.Tensor:
    """The sample of a transformer forward's tuple (or output object): its first item, stacked when the model returns
    one tensor per batch item (Wan-Animate-2)."""
    out = result[0]
    return torch.stack(out) if isinstance(out, (list, tuple)) else out


def every_step_sparse(config):
    """`config` with no dense steps: a synthetic forward stands for a sparse denoising step (there is no
    schedule to count steps in, and a fractional `dense_steps` would warn on every method)."""
    return replace(config, dense_steps=0) if getattr(config, "dense_steps", 0) else config


def warmup_forwards(warmup: int, compile_mode: str | None) -> int:
    """The untimed forwards `time_method` runs per method: `warmup`, and at least 2 compiled (the first calls
    compile the dense-step and the sparse-step graphs)."""
    return max(warmup, 2) if compile_mode is not None else warmup


def time_method(transformer, inputs: dict, spec: MethodSpec, warmup: int, repeats: int,
                compile_mode: str | None = None, sdpa_keys: int | None = None) -> tuple[dict, torch.Tensor]:
    """Apply `spec` to `transformer`, run `warmup` + `repeats` forwards on `inputs`, remove it; returns the row of
    the report (median forward, attention and plan seconds, realised density, fallbacks...) and the last output.

    Compiled, the graph hides the processors: attention is then timed only with `sdpa_keys` (for the dense
    method), as the scaled-dot-product attention calls with that many keys in one more, profiled forward
    (`row["attention_profile"]`); a reading that cannot be the forward's (another number of calls than the timed
    forwards made per forward, more time than the profiled or the timed forward took) leaves `attention_s` None."""
    config = every_step_sparse(spec.config)
    device = next(transformer.parameters()).device
    forward, attention, plan, profiled = [], [], [], None
    with method_applied(transformer, config, compile_mode) as (model, session), torch.no_grad():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if compile_mode is not None:
            # compiled: time whole forwards from outside (the graph hides the processors)
            for _ in range(warmup_forwards(warmup, compile_mode)):
                model(**inputs)
            for _ in range(repeats):
                _sync(device)
                t0 = time.perf_counter()
                out = first_output(model(**inputs))
                _sync(device)
                forward.append(time.perf_counter() - t0)
            plan = [None]
            stats = session.stats(all_ranks=True)   # before the profiled forward: every row counts the same forwards
            attention = [None]
            if sdpa_keys is not None:
                prof = profile_sdpa(lambda: model(**inputs), sdpa_keys, device)
                forwards = warmup_forwards(warmup, compile_mode) + repeats
                expected = stats["dense_calls"] // forwards if stats["dense_calls"] % forwards == 0 else None
                problem = prof.problem(expected, statistics.median(forward))
                attention = [None if problem else prof.seconds]
                profiled = {**asdict(prof), "problem": problem}
        else:
            for _ in range(warmup):
                transformer(**inputs)
            for _ in range(repeats):
                ttimer, atimer = TransformerTimer([transformer]), AttentionTimer([transformer])
                with ttimer(), atimer():
                    out = first_output(transformer(**inputs))
                forward.append(ttimer.times[-1])
                attention.append(atimer.attention_total)
                plan.append(atimer.plan_total)
            stats = session.stats(all_ranks=True)   # context parallel (bench_context_parallel.py): all heads
    layers = stats["layers"].values()
    kept = sum((l["density"] or 0.0) * l["sparse_calls"] for l in layers)
    calls = stats["sparse_calls"] + stats["dense_calls"]
    row = {
        "config": config.to_dict(), "forward_s": statistics.median(forward), "forward_s_all": forward,
        "attention_s": None if attention[0] is None else statistics.median(attention), "attention_s_all": attention,
        "plan_s": None if plan[0] is None else statistics.median(plan),
        "realised_density": stats["density"] if spec.method != "dense" else 1.0,
        "attention_work": (stats["dense_calls"] + kept) / calls if calls else 1.0,
        "sparse_calls": stats["sparse_calls"], "dense_calls": stats["dense_calls"],
        "calls_counted_forwards": warmup_forwards(warmup, compile_mode) + repeats,      # warm-up ones included
        "layer_density": [l["density"] for l in layers],
        "load_balance": [l["load_balance"] for l in layers],
        "fallbacks": sorted({r for l in layers for r in l["fallbacks"]}),
        "kernel_backend": stats.get("kernel_backend"),
    }
    if profiled is not None:
        row["attention_profile"] = profiled
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row, out


def check_run_options(compile_mode: str | None, warmup: int, repeats: int) -> None:
    """Refuse an unknown compile mode, warmup < 0 or repeats < 1 (ValueError naming the value), before any build."""
    if compile_mode is not None and compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode={compile_mode!r} is not known; choose one of {sorted(COMPILE_MODES)}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an int >= 0.")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int >= 1.")


def run_synthetic_model(name: str, specs: list[MethodSpec], device: str | torch.device, dtype: torch.dtype, *,
                        frames: int | None = None, height: int | None = None, width: int | None = None,
                        layers: int | None = None, warmup: int = 1, repeats: int = 3,
                        progress: bool = True, compile_mode: str | None = None, done: dict | None = None,
                        dense_output_path: str | None = None, on_method=None, run: str | None = None) -> SyntheticResult:
    """Time one forward of a synthetic model, dense vs each method.

    Args:
        name: a key of `SYNTHETIC_MODELS`.
        specs: the methods, dense first (`parse_method_specs`).
        device, dtype: where and in what precision (bf16 on CUDA is what the targets assume).
        frames, height, width: video size override (default: the model's default resolution).
        layers: build only this many transformer blocks (default: all).
        warmup: untimed forwards per method (kernel compilation, Sol's calibration; at least 2 compiled).
        repeats: timed forwards per method (medians are reported).
        compile_mode: None (eager) or a key of `COMPILE_MODES`: the transformer runs under
            `torch.compile` with the method applied, compiled dense vs compiled sparse; attention
            and plan times are then not separable, and the dense attention share comes from the SDPA
            calls of a profiled dense forward (`timing.profile_sdpa`), or, when the profile has no usable
            reading, from SDPA timed outside the model (`_dense_attention_seconds`).
        done: rows of methods measured by an earlier run (label -> row): kept, not run again.
        dense_output_path: safetensors file holding the dense output, so that a resumed run can still
            report each method's error vs dense; written after the dense forward.
        on_method: called with the `SyntheticResult` after every method (the caller saves the report,
            so a run cut short keeps what it measured).
        run: names this run in each row it times (`timed_in`; default `report.new_run_id()`).

    Raises:
        ValueError: unknown model, no processor for its class, a size that cannot run on `device`, an unknown
            compile mode, warmup < 0 or repeats < 1 (all before the model is built); a spec the built model refuses
            (`check_specs_apply`: before its first forward).
    """
    check_run_options(compile_mode, warmup, repeats)
    run = run or new_run_id()
    device = torch.device(device)
    setup = synthetic_setup(name, frames, height, width, layers)
    check_supported(setup)
    params = count_parameters(setup)
    est = check_feasible(setup, device, dtype, params)
    result = SyntheticResult(name, setup, est, compile_mode=compile_mode)
    t0 = time.perf_counter()
    transformer = build_transformer(setup, device, dtype)
    inputs = make_inputs(setup, device, dtype)
    if setup.model.prepare is not None:
        setup.model.prepare(setup, transformer, inputs)
    result.estimates["build_s"] = time.perf_counter() - t0
    from .generate import check_specs_apply

    check_specs_apply(transformer, specs, str(device))   # a spec the model refuses: before the dense forward
    logger.info("synthetic %s: %.2fB params, grid %s (%d tokens), built in %.1f s", name, params / 1e9, setup.grid,
                setup.tokens, result.estimates["build_s"])
    from tqdm.auto import tqdm

    done = done or {}
    reference = None
    if dense_output_path and specs[0].label in done and os.path.exists(dense_output_path):
        from safetensors.torch import load_file

        try:
            reference = load_file(dense_output_path, device=str(device))["dense_output"].float()
        except Exception as err:        # damaged (a run killed while writing it before writes were atomic): redo
            logger.warning("%s cannot be read (%s); the dense forward runs again", dense_output_path, err)
            done = {label: row for label, row in done.items() if label != specs[0].label}
    for spec in tqdm(specs, desc=f"synthetic {name}", disable=not progress, leave=False):
        if spec.label in done:
            result.methods[spec.label] = done[spec.label]
            continue
        dense = spec.method == "dense"
        row, out = time_method(transformer, inputs, spec, warmup, repeats, compile_mode,
                               sdpa_keys=setup.attention_tokens if dense else None)
        if compile_mode is not None and dense:
            row["attention_timed"] = "in a profiled forward"
            if row["attention_s"] is None:   # no usable SDPA time in the profile (CUDA graphs, or set aside)
                row["attention_s"] = _dense_attention_seconds(setup, device, dtype, repeats)
                problem = row.get("attention_profile", {}).get("problem")
                row["attention_timed"] = "outside the model" + (f", the profile set aside: {problem}"
                                                                if problem else "")
        if reference is None and spec.method == "dense":
            reference = out.float()
            if dense_output_path:
                from safetensors.torch import save_file

                saved = Path(dense_output_path).absolute()
                saved.parent.mkdir(parents=True, exist_ok=True)
                tmp = saved.with_name(f".{saved.name}.tmp")     # renamed over it: a killed write leaves no half file
                save_file({"dense_output": out.detach().contiguous().cpu()}, str(tmp))
                replace_durably(tmp, saved)
        row["timed_in"] = run
        row["output_rel_l2_vs_dense"] = (
            None if reference is None
            else float((out.float() - reference).norm() / reference.norm().clamp_min(1e-30)))
        result.methods[spec.label] = row
        if on_method is not None:
            on_method(result)
        logger.info("synthetic %s %s: forward %.3f s, attention %s, density %s", name, spec.label,
                    row["forward_s"], "not separable" if row["attention_s"] is None else f"{row['attention_s']:.3f} s",
                    row["realised_density"])
    del transformer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def summarize_synthetic(result: SyntheticResult, dtype: torch.dtype, warmup: int, repeats: int) -> dict:
    """The report section of one model: per-method rows with speedups and Amdahl estimates."""
    methods = result.methods
    dense = next(iter(methods.values()))
    f = min(dense["attention_s"] / dense["forward_s"], 0.999999) if dense["forward_s"] else None
    for row in methods.values():
        row["attention_share"] = (row["attention_s"] / row["forward_s"]
                                  if row["forward_s"] and row["attention_s"] is not None else None)
        row["speedup"] = dense["forward_s"] / row["forward_s"] if row["forward_s"] else None
        row["speedup_attention"] = dense["attention_s"] / row["attention_s"] if row["attention_s"] else None
        row["amdahl_bound"] = 1.0 / ((1 - f) + f * row["attention_work"]) if f is not None else None
    setup = result.setup
    cfg = setup.config
    return {
        "model": result.name, "description": setup.model.description, "transformer_class": setup.model.transformer_cls,
        "config": cfg,
        "config_summary": f"{setup.model.transformer_cls}, {setup.model.heads} heads x {setup.model.head_dim}, "
                          f"{setup.num_layers} layers",
        "shape": setup.describe(), "dtype": str(dtype), "warmup": warmup,
        "warmup_run": warmup_forwards(warmup, result.compile_mode), "repeats": repeats,
        "compile": result.compile_mode,
        "estimates": result.estimates, "dense_attention_share": f,
        "amdahl_bound_free_attention": 1.0 / (1 - f) if f is not None else None,
        "methods": methods,
    }


def beyond_bound_notes(sections: dict[str, dict], slack: float = 1.05) -> list[str]:
    """A note for each method whose measured speedup exceeds, by more than `slack`, the bound of its model with
    attention costing nothing, or is above 1 while its attention ran slower than dense's: no sparse attention can do
    either, so its times are noise (other load, clocks)."""
    notes = []
    for name, section in sections.items():
        bound = section.get("amdahl_bound_free_attention")
        for label, row in section.get("methods", {}).items():
            speedup, times = row.get("speedup"), row.get("forward_s_all") or []
            if bound and speedup and speedup > slack * bound:
                spread = f" (its timed forwards took {min(times):.3g} to {max(times):.3g} s)" if times else ""
                notes.append(f"{name} {label}: speedup {speedup:.2f}x above {bound:.2f}x, the bound with attention "
                             f"free{spread}: noisy timings, not a speedup sparse attention can give.")
            elif speedup and speedup > 1 and (attn := row.get("speedup_attention")) and attn < 1:
                spread = f" (dense's timed forwards took {min(dense_times):.3g} to {max(dense_times):.3g} s)" \
                    if (dense_times := section["methods"].get("dense", {}).get("forward_s_all")) else ""
                notes.append(f"{name} {label}: forward speedup {speedup:.2f}x while its attention ran slower than "
                             f"dense's ({attn:.2f}x): the gain is outside attention, so timing noise{spread}, not "
                             "sparse attention.")
    return notes


def run_synthetic(names: list[str], specs: list[MethodSpec], out_dir: str, *, device: str | None = None,
                  dtype: torch.dtype | None = None, frames: int | None = None, height: int | None = None,
                  width: int | None = None, layers: int | None = None, warmup: int = 1, repeats: int = 3,
                  progress: bool = True, compile_mode: str | None = None, overwrite: bool = False) -> dict:
    """Synthetic speed mode for several models; writes report.json, report.md and one speedup plot per model.

    The report is saved after every method; a rerun with the same sizes, dtype and compile mode keeps
    the methods already measured (and the dense output saved beside the report) and runs the rest;
    `overwrite=True` discards the report in `out_dir` and measures everything again.

    Returns:
        The report dict ("synthetic": model name -> section from `summarize_synthetic`).
    """
    from .plots import plot_speedup_vs_density
    from .._io import write_atomic

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    check_run_options(compile_mode, warmup, repeats)   # refuse before writing anything
    for name in names:
        setup = synthetic_setup(name, frames, height, width, layers)
        check_supported(setup)
        check_feasible(setup, device, dtype, count_parameters(setup))
    path = os.path.join(out_dir, "report.json")
    report = None if overwrite else load_report(path)
    report = report or {"format": REPORT_FORMAT, "mode": "synthetic", "synthetic": {}}
    if report.get("mode") != "synthetic":
        raise ValueError(f"{path} holds a quality report; write the synthetic run to another directory "
                         "(or pass overwrite=True, --overwrite, to replace it).")
    report["synthetic"] = report.get("synthetic", {})
    labels = [s.label for s in specs]
    configs = {s.label: as_saved(every_step_sparse(s.config).to_dict()) for s in specs}
    timed_on = as_saved(timing_environment(device))
    run = new_run_id()

    def other_settings(name: str, old: dict) -> list[str]:
        """What of `old` (a model's section of the report) differs from this run's settings."""
        shape = synthetic_setup(name, frames, height, width, layers).describe()
        # a report written before a derived key (e.g. attention_tokens) existed still matches on the keys it has
        differ = [f"shape {old.get('shape')} vs {shape}"] if not old.get("shape") or any(
            shape.get(k) != v for k, v in old["shape"].items()) else []
        for what, was, now in (("dtype", old.get("dtype"), str(dtype)), ("compile", old.get("compile"), compile_mode),
                               ("warm-up forwards", old.get("warmup"), warmup),
                               ("repeats", old.get("repeats"), repeats)):
            if was != now:
                differ.append(f"{what} {was} vs {now}")
        if old.get("timed_on") != timed_on:           # another device, GPU, thread count or version
            differ.append("environment (" + ", ".join(changed_keys(old.get("timed_on"), timed_on)) + ")")
        return differ

    for name in names:           # as the help says: a report of other settings is refused, before anything runs
        if report["synthetic"].get(name) and (differ := other_settings(name, report["synthetic"][name])):
            raise ValueError(f"{path} holds {name} measured with other settings ({'; '.join(differ)}); pass "
                             "--overwrite (overwrite=True) to replace the report, or write to another --out.")
    removed: list = []          # an overwrite removes the earlier report's files once, when this one is first saved
    own_outputs = tuple(f"dense_output_{name}.safetensors" for name in names)     # (written before that)
    for name in names:
        old = report["synthetic"].get(name)
        done = {}
        if old and next(iter(old.get("methods", {})), None) == labels[0]:
            # a row is kept only for the same configuration (a spec label does not name e.g. --backend)
            done = {label: row for label, row in old["methods"].items()
                    if label in labels and row.get("config") == configs[label]}
            if labels[0] not in done:       # a dense row of other settings: every speedup would be against it
                done = {}
        if list(done) == labels:
            logger.info("synthetic %s: already in %s, skipped", name, path)
            continue

        def save(result, name=name):
            if overwrite and not removed:       # with the first result, as the report itself is replaced
                removed.append(remove_earlier_outputs(out_dir, keep=own_outputs))
            report["synthetic"][name] = dict(summarize_synthetic(result, dtype, warmup, repeats), timed_on=timed_on)
            report["environment"] = environment(device)
            os.makedirs(os.path.join(out_dir, "plots"), exist_ok=True)    # made with the first result: a run
            save_report(report, path)                                      # refused before it leaves nothing

        run_synthetic_model(name, specs, device, dtype, frames=frames, height=height, width=width, layers=layers,
                            warmup=warmup, repeats=repeats, progress=progress, compile_mode=compile_mode,
                            done=done, dense_output_path=os.path.join(out_dir, f"dense_output_{name}.safetensors"),
                            on_method=save, run=run)
    plots = []
    os.makedirs(os.path.join(out_dir, "plots"), exist_ok=True)
    for name, section in report["synthetic"].items():
        points = {label: dict(row, family=label_family(label), method=row["config"]["method"])
                  for label, row in section["methods"].items()}
        plot = os.path.join(out_dir, "plots", f"speedup_vs_density_{name}.png")
        plot_speedup_vs_density(points, section["dense_attention_share"], plot,
                                f"{name}: transformer forward speedup", y_key="speedup")
        plots.append(os.path.relpath(plot, out_dir))
    notes = ["Random weights: attention is near-uniform, so the chosen tiles say nothing about quality; "
             "`output rel L2` only checks that the sparse path ran."]
    if device.type == "cpu":
        notes.append("Run on CPU: the sparse path uses the torch reference kernel, so times say nothing about GPU "
                     "speed.")
    if compile_mode == "aot_eager":
        notes.append("compile mode aot_eager checks that the model traces; its times are not a compiled speed.")
    notes += beyond_bound_notes(report["synthetic"])
    for name, section in report["synthetic"].items():
        notes += rerun_timing_notes({label: runs_of([row]) for label, row in section["methods"].items()}, f"{name} ")
    fallbacks = sorted({f for s in report["synthetic"].values() for r in s["methods"].values() for f in r["fallbacks"]})
    if fallbacks:
        notes.append("Some attention calls fell back to dense: " + "; ".join(fallbacks))
    report.update(environment=report.get("environment") or environment(device), notes=notes,
                  artifacts={"plots": plots, "report_md": "report.md", "report_json": "report.json"},
                  updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
    save_report(report, path)
    write_atomic(os.path.join(out_dir, "report.md"), render_markdown(report))
    return report


def default_synthetic_specs() -> list[str]:
    """The densities the issue asks for: Veda at 0.25, 0.1 and 0.05."""
    return ["veda@0.25", "veda@0.1", "veda@0.05"]


__all__ = ["SyntheticResult", "run_synthetic", "run_synthetic_model", "time_method", "default_synthetic_specs"]
