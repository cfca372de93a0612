"""Every Triton / Gluon kernel launch and ahead-of-time compile in the package passes `COMPILE_OPTIONS`.

FP fusion (a*b+c as one FMA, e.g. the softmax's scale-and-subtract) is on by default up to Triton 3.9, which warns
that the default turns it off from 3.10; the kernels were tuned and tested with it on, so every launch asks for it
by name. Checked on the source (a launch is `kernel[grid](...)` of a function decorated `@triton.jit` or
`@gluon.jit`), since the interpreter drops compile options, and on a compiled kernel's metadata.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import videosparse

PACKAGE = Path(videosparse.__file__).parent


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def _passes_options(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "COMPILE_OPTIONS" for n in ast.walk(node))


def _launch_sites(root: Path):
    """(file:line, call, is_compile) of every `jit_fn[grid](...)` and every `triton.compile(...)` under root."""
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        jit = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and any(map(_is_jit, f.decorator_list))}
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            f = call.func
            launch = isinstance(f, ast.Subscript) and isinstance(f.value, ast.Name) and f.value.id in jit
            aot = isinstance(f, ast.Attribute) and f.attr == "compile" and getattr(f.value, "id", None) == "triton"
            if launch or aot:
                yield f"{path.relative_to(root)}:{call.lineno}", call, aot


def _missing(sites) -> list[str]:
    """The sites whose launch has no `**COMPILE_OPTIONS` (or whose compile's `options=` does not hold it)."""
    return [where for where, call, aot in sites
            if not (_passes_options(next((kw.value for kw in call.keywords if kw.arg == "options"), ast.Pass()))
                    if aot else any(kw.arg is None and _passes_options(kw.value) for kw in call.keywords))]


def test_every_launch_and_compile_pins_the_compile_options():
    sites = list(_launch_sites(PACKAGE))
    missing = _missing(sites)
    assert len([s for s in sites if not s[2]]) >= 14, [s[0] for s in sites]     # the launches this test knows of
    assert len([s for s in sites if s[2]]) >= 4, [s[0] for s in sites]
    assert not missing, f"launches / compiles without **COMPILE_OPTIONS: {missing}"


def test_the_check_sees_a_launch_or_compile_without_the_options(tmp_path):
    """The source check above flags a launch and a compile that leave the options out, and no others."""
    (tmp_path / "k.py").write_text(
        "import triton\n@triton.jit\ndef _k(X):\n    pass\n\n"
        "def run(x):\n    _k[(1,)](x, num_warps=4)\n    _k[(1,)](x, **COMPILE_OPTIONS)\n"
        "    triton.compile(src, options=dict(num_warps=4))\n    triton.compile(src, options=dict(**COMPILE_OPTIONS))\n")
    sites = list(_launch_sites(tmp_path))
    assert [(where, aot) for where, _, aot in sites] == [("k.py:7", False), ("k.py:8", False), ("k.py:9", True),
                                                         ("k.py:10", True)]
    assert _missing(sites) == ["k.py:7", "k.py:9"]


def test_compiled_kernels_have_fp_fusion_on():
    pytest.importorskip("triton")
    from videosparse.kernels import triton_hopper
    from videosparse.kernels._triton_utils import COMPILE_OPTIONS

    if triton_hopper.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set in this process: kernels are interpreted, not compiled")
    assert COMPILE_OPTIONS == {"enable_fp_fusion": True}
    assert triton_hopper.compile_for_sm90(head_dim=64).metadata.enable_fp_fusion is True


# launchers reached only from a guarded one (their callers' inputs set the device): name -> the guarded callers
INNER_LAUNCHERS = {
    "correction_inputs": "gluon_attention, hopper_attention, generic_attention, triton_attention_backward",
    "combine_parts": "gluon_attention",
    "centroid_pass": "hopper_attention",
    "prepare_backward": "triton_attention_backward (and scripts/sweep_backward.py, one device)",
    "launch_dq": "triton_attention_backward",
    "launch_dkdv": "triton_attention_backward",
    "centroid_gradients": "triton_attention_backward",
}


def test_every_launcher_runs_on_its_inputs_device():
    """Every function that launches a kernel is decorated `on_input_device` (Triton launches on the current device,
    not the inputs'), or is one of the inner launchers above that only guarded functions call."""
    unguarded, seen = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        jit = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and any(map(_is_jit, f.decorator_list))}
        for fn in tree.body:
            if not isinstance(fn, ast.FunctionDef) or fn.name in jit:
                continue
            launches = any(isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript)
                           and isinstance(c.func.value, ast.Name) and c.func.value.id in jit for c in ast.walk(fn))
            if not launches:
                continue
            seen.add(fn.name)
            guarded = any(isinstance(d, ast.Name) and d.id == "on_input_device" for d in fn.decorator_list)
            if not guarded and fn.name not in INNER_LAUNCHERS:
                unguarded.append(f"{path.relative_to(PACKAGE)}:{fn.lineno} {fn.name}")
    assert len(seen) >= 17, sorted(seen)
    assert set(INNER_LAUNCHERS) <= seen, set(INNER_LAUNCHERS) - seen
    assert not unguarded, f"launchers without @on_input_device: {unguarded}"
