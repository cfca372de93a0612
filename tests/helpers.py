"""Shared test helpers: naive attention, random plans, loading a script from scripts/."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

from videosparse.plan import Plan, plan_from_mask


# the reference model (`videosparse.models.reference`) at its smallest, for tests of its plumbing, not its output
TINY_REFERENCE = dict(num_layers=1, num_attention_heads=1, ffn_dim=64)
TINY_REFERENCE_TEXT = dict(num_layers=1, ffn_dim=64)


def tiny_reference_pipeline():
    """The reference pipeline with random weights (seed 0) at the TINY_REFERENCE sizes."""
    from videosparse.models.reference import build_reference_pipeline

    return build_reference_pipeline(seed=0, transformer_overrides=TINY_REFERENCE, text_overrides=TINY_REFERENCE_TEXT)


def load_script(name: str):
    """The module of scripts/<name>.py (scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pinned_ptxas() -> bool:
    """True with the Triton the test extra pins (3.6). The ahead-of-time tests' schedule checks (spills, registers,
    which loads sit under which GEMM) hold for the ptxas it ships; later Tritons ship later ptxas versions that
    schedule otherwise (on Triton 3.9 the kernels compile, pass the GPU tests and run ~2% slower than on 3.6, with a
    few spills in the Gluon kernel's loops and 168 registers in TripPool at head dim 128)."""
    import triton

    return triton.__version__.startswith("3.6.")


def gluon_compiles() -> bool:
    """Whether the installed Triton compiles the Gluon Hopper kernel (`gluon_hopper.OLDEST_TRITON` and newer: Gluon
    before 3.6, torch 2.9's 3.5, has no device-side TMA descriptors, and the backend declines there)."""
    try:
        from videosparse.kernels.gluon_hopper import OLDEST_TRITON, triton_version
    except ImportError:                         # no Gluon in this Triton at all
        return False
    return triton_version() >= OLDEST_TRITON


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def random_plan(B: int, H: int, S: int, block_m: int, block_n: int, density: float, *, seed: int = 0,
                device="cpu", sk: int | None = None) -> Plan:
    """A random tile mask with at least one tile per row, as a Plan."""
    g = torch.Generator().manual_seed(seed)
    Mq, Nk = math.ceil(S / block_m), math.ceil((sk or S) / block_n)
    mask = torch.rand(B, H, Mq, Nk, generator=g) < density
    first = torch.randint(0, Nk, (B, H, Mq, 1), generator=g)
    mask.scatter_(-1, first, True)
    p = plan_from_mask(mask, block_m, block_n)
    return Plan(p.kv_index.to(device), p.kv_count.to(device), block_m, block_n)


def naive_attention(q, k, v, plan: Plan, scale: float | None = None, correction: bool = False):
    """fp64 attention with an explicit token mask built from the plan (and centroid keys if corrected)."""
    B, H, S, D = q.shape
    Sk = k.shape[2]
    scale = scale or 1.0 / math.sqrt(D)
    Nk = math.ceil(Sk / plan.block_n)
    tmask = plan.to_dense_mask(Nk)                                         # [B,H,Mq,Nk]
    tok = tmask.repeat_interleave(plan.block_m, 2)[:, :, :S].repeat_interleave(plan.block_n, 3)[..., :Sk]
    q, k, v = q.double(), k.double(), v.double()
    if not correction:
        s = (q @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(~tok, float("-inf"))
        p = torch.softmax(s, -1)
        return p @ v
    # every skipped tile's keys replaced by its mean key (values stay)
    tile_of = torch.arange(Sk) // plan.block_n
    kpad = torch.zeros(B, H, Nk * plan.block_n, D, dtype=torch.float64)
    kpad[:, :, :Sk] = k
    lens = torch.bincount(tile_of, minlength=Nk).double()
    kmean = kpad.view(B, H, Nk, plan.block_n, D).sum(3) / lens[:, None]
    s_exact = (q @ k.transpose(-1, -2)) * scale
    s_mean = (q @ kmean[:, :, tile_of].transpose(-1, -2)) * scale
    s = torch.where(tok, s_exact, s_mean)
    return torch.softmax(s, -1) @ v



# ------------------------------------------------------------------ Triton interpreter in a child process
# Triton decides interpreted vs compiled mode when it is imported, so interpreter tests run their cases
# in one child process started with TRITON_INTERPRET=1; the pytest process itself is never switched.

def interpreter_child(names, run_case) -> None:
    """Child side: run each named case and print one `CASE {json}` line (errors as tracebacks)."""
    import json
    import traceback

    for name in names:
        try:
            res = run_case(name)
        except Exception:  # reported to the parent, which fails that case with the traceback
            res = {"error": traceback.format_exc()}
        print("CASE " + json.dumps({"name": name, **res}), flush=True)


class InterpreterCases:
    """Parent side: the named cases of `script` (a test module whose __main__ calls `interpreter_child`), run in one
    child process under the interpreter.

    A module declares it at module level, `INTERPRETER_CASES = InterpreterCases(__file__, names)`, and its tests take
    the `interpreter_results` fixture (tests/conftest.py), {case name: result dict}. The parent only waits on the
    child, so conftest starts the children of the collected modules in the background, one at a time in collection
    order, as soon as collection ends: they run beside the tests before theirs. `results()` starts the child itself
    if the background has not (a single test run, or an xdist worker).
    """

    def __init__(self, script, names, timeout: int = 600) -> None:
        self.script = Path(script).resolve()
        self.names = list(names)
        self.timeout = timeout
        # the environment as the module is collected: a child may start while a test has monkeypatched os.environ
        self._env = dict(os.environ, TRITON_INTERPRET="1")
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._outcome: tuple[int | None, str, str] | None = None     # (returncode, stdout, stderr)
        self._stopped = False

    def run(self) -> tuple[int | None, str, str]:
        """Run the child unless it has run (blocking; the first caller runs it, later ones wait for it)."""
        with self._lock:
            if self._outcome is None:
                self._outcome = self._run_child()
            return self._outcome

    def _run_child(self) -> tuple[int | None, str, str]:
        if self._stopped:
            return None, "", "the interpreter child was stopped before it ran (the test session ended)"
        tests_dir = Path(__file__).resolve().parent
        env = dict(self._env)
        env["PYTHONPATH"] = os.pathsep.join([str(tests_dir.parent), str(tests_dir), env.get("PYTHONPATH", "")])
        self._proc = subprocess.Popen([sys.executable, str(self.script), *self.names], env=env, cwd=tests_dir.parent,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if self._stopped:                          # `stop` came between the check above and the start
            self._proc.kill()
        try:
            out, err = self._proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, err = self._proc.communicate()
            err += f"\n(killed after its timeout of {self.timeout} s)"
        return self._proc.returncode, out, err

    def stop(self) -> None:
        """Start no child from now on, and kill a running one (the session is over)."""
        self._stopped = True
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    def results(self) -> dict:
        """{case name: result dict}; fails the test when the child reports nothing."""
        import json

        import pytest

        pytest.importorskip("triton")
        returncode, out, err = self.run()
        results = {}
        for line in out.splitlines():
            if line.startswith("CASE "):
                res = json.loads(line[5:])
                results[res.pop("name")] = res
        if not results:
            pytest.fail(f"interpreter child produced no results (rc={returncode}):\n{err[-4000:]}")
        return results


def run_interpreter_children_in_background(children: list[InterpreterCases]) -> threading.Thread:
    """Run `children` one after another in a daemon thread (each `run()` once; see `InterpreterCases`)."""
    def run_all():
        for child in children:
            child.run()

    thread = threading.Thread(target=run_all, name="interpreter-children", daemon=True)
    thread.start()
    return thread


class NoAutogradBackend:
    """A kernel backend stand-in for the CPU: the torch reference run under no_grad, so that, like the Triton
    kernels, it has no autograd of its own (register it with `videosparse.kernels.dispatch`)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def not_supported_reasons(self, q, k, v, plan) -> list[str]:
        return []

    def __call__(self, q, k, v, plan, scale, return_lse):
        from videosparse.kernels import reference_attention

        with torch.no_grad():
            return reference_attention(q, k, v, plan, scale, return_lse)


def gradient_free_centroid_kernel(monkeypatch) -> None:
    """Make the centroid dispatch pick a gradient-free 'kernel' wherever it is free to choose, as on CUDA."""
    from videosparse.sol import centroids, triton_centroids

    def no_grad_stats(q, k, v, block):
        with torch.no_grad():
            q_mean = None if q is None else centroids.tile_means_torch(q, block)
            return (q_mean, *centroids.tile_centroids_torch(k, v, block))

    monkeypatch.setattr(centroids, "_use_triton", lambda x, backend: backend in ("auto", "triton"))
    monkeypatch.setattr(triton_centroids, "tile_stats_triton", no_grad_stats)


def catch_probe_outputs(monkeypatch) -> dict:
    """Spy on `eval.attention`'s kernels: the dict gets the first sparse output ("sparse") and the first dense
    (output, tile mass) pair ("dense") an `AttentionProbe` computes, to recompute its numbers from them."""
    from videosparse.eval import attention

    outputs = {}
    real_sparse, real_dense = attention.block_sparse_attention, attention.dense_attention_tile_mass
    monkeypatch.setattr(attention, "block_sparse_attention",
                        lambda *a, **kw: outputs.setdefault("sparse", real_sparse(*a, **kw)))
    monkeypatch.setattr(attention, "dense_attention_tile_mass",
                        lambda *a, **kw: outputs.setdefault("dense", real_dense(*a, **kw)))
    return outputs
