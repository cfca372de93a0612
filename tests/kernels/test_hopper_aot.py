"""Ahead-of-time compile of the Hopper kernels (Triton and Gluon) for sm_90 on CPU: warp specialization, TMA
and wgmma must be in them.

Triton 3.6 drops warp specialization silently (num_warps=8, a run-time `if` or a second dot outside
the loop), so a change that loses it, TMA or wgmma fails here before it reaches a GPU.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers import gluon_compiles, load_script, pinned_ptxas

triton = pytest.importorskip("triton")
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"   # ptxas, cuobjdump (ship with triton)

SHARED_LIMIT = 232448  # bytes of shared memory per block on sm_90
PINNED_PTXAS = pinned_ptxas()     # the SASS schedule checks hold for the pinned Triton's ptxas (see helpers)
schedule_check = pytest.mark.skipif(not PINNED_PTXAS, reason=f"SASS schedule of Triton 3.6's ptxas; this is "
                                                              f"Triton {triton.__version__}")
# the Gluon kernel compiles on Triton 3.6 and newer (on older ones its backend declines: test below)
needs_gluon_compile = pytest.mark.skipif(not gluon_compiles(), reason=f"the Gluon kernel needs Triton 3.6 or "
                                                                        f"newer; this is Triton {triton.__version__}")

# (head_dim, dtype, block_m, block_n, centroids, mask_last, merge[, has_limit: a plan with valid_keys])
VARIANTS = {
    "d128-exact-partial": (128, "bf16", 128, 128, False, True, False),
    "d128-exact-full-merge": (128, "bf16", 128, 128, False, False, True),
    "d128-centroids": (128, "bf16", 128, 128, True, False, False),
    "d64-exact-partial-merge": (64, "bf16", 128, 128, False, True, True),
    "d64-centroids": (64, "bf16", 128, 128, True, False, False),
    "d128-fp16-b64": (128, "fp16", 64, 64, False, True, False),
    "d128-exact-valid-keys-merge": (128, "bf16", 128, 128, False, True, True, True),
    "d64-exact-valid-keys-b64": (64, "bf16", 64, 64, False, True, False, True),
}


@pytest.fixture(scope="module")
def hopper_module():
    from videosparse.kernels import triton_hopper

    if triton_hopper.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set in this process: kernels are interpreted, not compiled")
    return triton_hopper


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hopper_kernel_compiles_with_tma_wgmma_and_warp_specialization(hopper_module, name, tmp_path):
    d, dtype, bm, bn, centroids, mask_last, merge, *has_limit = VARIANTS[name]
    k = hopper_module.compile_for_sm90(head_dim=d, dtype=dtype, block_m=bm, block_n=bn, centroids=centroids,
                                       mask_last=mask_last, merge=merge, has_limit=bool(has_limit))
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    assert "ttg.warp_specialize" in ttgir, "warp specialization was dropped"
    assert k.metadata.num_warps > 4, "no producer/consumer warp groups were added"
    assert "wgmma.mma_async" in ptx, "no wgmma in the PTX"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads in the PTX"
    assert k.metadata.shared <= SHARED_LIMIT, f"shared memory {k.metadata.shared} > {SHARED_LIMIT}"
    # no spill traffic in the tile loops, and none outside them (compiled as a launch specializes its arguments;
    # unspecialized, the exact pass that continues from the centroid pass's partial read 296 bytes at 128x128)
    _check_spills(k.asm["cubin"], tmp_path, allowed=0)


def _check_spills(cubin: bytes, where: Path, allowed: int) -> int:
    """Asserts that the kernel's tile loops (`inspect_gluon_sass.tile_loops`; at least one) hold no spill
    instruction and that it spills at most `allowed` bytes in all (with the pinned Triton's ptxas only); returns
    the number of tile loops."""
    inspect = load_script("inspect_gluon_sass")
    loops = inspect.tile_loops(inspect.sass_listing(cubin, Path(triton.__file__).parent / "backends" / "nvidia"
                                                    / "bin"))
    if not PINNED_PTXAS:
        return len(loops)
    assert loops and all(inspect.local_memory_ops(body) == 0 for body in loops), "spills in a tile loop"
    spills = _spill_bytes(cubin, where)
    assert spills is None or spills <= allowed, f"registers spill to {spills} bytes of local memory / stack"
    return len(loops)


def _spill_bytes(cubin: bytes, where: Path):
    """LOCAL + STACK bytes of the kernel from cuobjdump (shipped with triton): ptxas puts register spills on the
    stack frame (STACK), not in LOCAL. None when cuobjdump is missing."""
    tool = TOOLS / "cuobjdump"
    if not tool.exists():
        return None
    f = where / "k.cubin"
    f.write_bytes(cubin)
    text = subprocess.run([str(tool), "--dump-resource-usage", str(f)], capture_output=True, text=True).stdout
    found = [re.findall(rf"{key}:(\d+)", text) for key in ("LOCAL", "STACK")]
    return sum(max(map(int, v)) for v in found if v) if any(found) else None


def test_aot_check_detects_lost_warp_specialization(hopper_module):
    """The same compile with warp specialization off must not pass the check above."""
    k = hopper_module.compile_for_sm90(head_dim=64, warp_specialize=False)
    assert "ttg.warp_specialize" not in k.asm["ttgir"]


def test_hopper_refuses_stage_counts_that_return_nan():
    """num_stages > 2 with warp specialization compiles but returns NaN on the H200: refused before launch."""
    import torch

    from videosparse.kernels import triton_hopper
    from videosparse.plan import dense_plan

    q = torch.randn(1, 1, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_stages=3 with warp specialization"):
        triton_hopper.hopper_attention(q, q, q, dense_plan(1, 1, 128), 0.125, num_stages=3)


# Gluon kernel: (head_dim, dtype, num_stages, correction, mask_last, q_buffers, split_tail[, has_limit])
GLUON_VARIANTS = {
    "d128-bf16-default-partial": (128, "bf16", 2, False, True, 2, False),
    "d128-bf16-3stages-1qbuf-partial": (128, "bf16", 3, False, True, 1, False),
    "d128-bf16-2stages-1qbuf-correction": (128, "bf16", 2, True, True, 1, False),
    "d128-fp16-2stages-2qbufs-correction": (128, "fp16", 2, True, False, 2, False),
    "d64-bf16-2stages-2qbufs-correction-partial": (64, "bf16", 2, True, True, 2, False),
    "d128-bf16-2stages-2qbufs-split-tail": (128, "bf16", 2, False, True, 2, True),
    "d64-fp16-2stages-2qbufs-correction-split-tail": (64, "fp16", 2, True, True, 2, True),
    "d128-bf16-valid-keys-correction": (128, "bf16", 2, True, True, 2, False, True),
    "d64-bf16-valid-keys-split-tail": (64, "bf16", 2, False, True, 2, True, True),
}


@needs_gluon_compile
@pytest.mark.parametrize("name", list(GLUON_VARIANTS))
def test_gluon_kernel_compiles_with_two_consumer_warpgroups_tma_and_wgmma(name, tmp_path):
    pytest.importorskip("triton.experimental.gluon")
    from videosparse.kernels import gluon_hopper

    d, dtype, stages, correction, mask_last, q_buffers, split, *has_limit = GLUON_VARIANTS[name]
    k = gluon_hopper.compile_for_sm90(head_dim=d, dtype=dtype, num_stages=stages, correction=correction,
                                      mask_last=mask_last, q_buffers=q_buffers, split_tail=split,
                                      has_limit=bool(has_limit))
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    assert "ttg.warp_specialize" in ttgir
    assert k.metadata.num_warps == 12, "expected 4 (consumer 0) + 4 (consumer 1) + 4 (loader warp, rounded) warps"
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert "setmaxnreg" in ptx, "no register reallocation between loader and consumers"
    assert k.metadata.shared <= SHARED_LIMIT, f"shared memory {k.metadata.shared} > {SHARED_LIMIT}"
    # no spill traffic in the tile loops; at head dim 128 the consumers sit at their 240 registers and, depending
    # on the launch's argument values, spill up to 56 bytes around the item loop (0 or 16 by default, 56 with the
    # correction and the tail split; 0 at 12 x 32,768 and 40 x 75,600)
    assert _check_spills(k.asm["cubin"], tmp_path, allowed=64 if d == 128 else 0) == 2


@needs_gluon_compile
def test_gluon_kernel_stores_outputs_with_tma():
    """The default schedule (two Q buffers) writes outputs with TMA stores from shared memory and waits for them
    to read it; register stores (tma_store=False) and one Q buffer have none."""
    pytest.importorskip("triton.experimental.gluon")
    from videosparse.kernels import gluon_hopper

    tma_store = "cp.async.bulk.tensor.2d.global.shared"
    ptx = gluon_hopper.compile_for_sm90().asm["ptx"]
    assert tma_store in ptx and "cp.async.bulk.wait_group.read" in ptx
    assert tma_store not in gluon_hopper.compile_for_sm90(tma_store=False).asm["ptx"]
    assert tma_store not in gluon_hopper.compile_for_sm90(q_buffers=1).asm["ptx"]


def test_gluon_backend_declines_cpu_and_unsupported_inputs_with_reasons():
    import torch

    pytest.importorskip("triton.experimental.gluon")
    from videosparse.kernels.gluon_hopper import BACKEND
    from videosparse.plan import dense_plan

    q = torch.randn(1, 1, 200, 96)
    why = " ".join(BACKEND.not_supported_reasons(q, q, q, dense_plan(1, 1, 200, 64, 64)))
    for part in ("compute capability 9.x", "float32", "head dim 96", "64x64"):
        assert part in why


def test_gluon_backend_falls_back_when_a_newer_triton_cannot_compile_it(monkeypatch):
    """Gluon's API has changed with every Triton release: on a Triton newer than the newest the kernel was checked
    on, a compile error warns once and runs the generic Triton kernel (not the Triton Hopper one, unsafe when
    preempted), and the backend declines from then on; on a checked Triton it is a bug of the kernel and raises."""
    import warnings

    import torch

    pytest.importorskip("triton.experimental.gluon")
    from videosparse.kernels import gluon_hopper
    from videosparse.plan import dense_plan

    def broken(*args, **kwargs):
        raise triton.CompilationError(None, None, "AttributeError(\"module 'gl' has no attribute 'barrier'\")")

    assert gluon_hopper.triton_version() == tuple(int(p) for p in triton.__version__.split(".")[:2])
    monkeypatch.setattr(gluon_hopper, "gluon_attention", broken)
    monkeypatch.setattr(gluon_hopper, "generic_attention", lambda *args, **kwargs: "generic ran")
    backend, q, plan = gluon_hopper.GluonHopperBackend(), torch.zeros(1, 1, 128, 128), dense_plan(1, 1, 128)
    monkeypatch.setattr(gluon_hopper, "triton_version", lambda: gluon_hopper.NEWEST_CHECKED_TRITON)
    with pytest.raises(triton.CompilationError):
        backend(q, q, q, plan, 0.1, False)
    monkeypatch.setattr(gluon_hopper, "triton_version", lambda: (3, 10))
    gluon_hopper.probe_kernel("auto", "cpu", torch.float32, 1, 64, 64, False)
    with pytest.warns(RuntimeWarning, match=r"does not compile on Triton .* newer than the 3\.9 .*has no attribute "
                                            r"'barrier'.*the generic Triton kernel runs instead"):
        assert backend(q, q, q, plan, 0.1, False) == "generic ran"
    assert any("does not compile on Triton" in why for why in backend.not_supported_reasons(q, q, q, plan))
    assert gluon_hopper.probe_kernel.cache_info().currsize == 0      # sessions re-ask which backend serves them
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend(q, q, q, plan, 0.1, False) == "generic ran"
    assert gluon_hopper.BACKEND.compile_failure is None       # the registry's instance is untouched


def test_gluon_backend_declines_on_a_triton_older_than_it_compiles_on(monkeypatch):
    """Gluon before Triton 3.6 (3.5 comes with torch 2.9) has no device-side TMA descriptors: the kernel does not
    compile there, and its first call raised CompilationError (its fallback was only for newer Tritons). Now the
    backend declines with a reason, warning once where it would have served the inputs (on sm_90), so auto and
    backend="triton" run the generic Triton kernel."""
    import warnings

    import torch

    pytest.importorskip("triton.experimental.gluon")
    from videosparse.kernels import dispatch, gluon_hopper, triton_hopper
    from videosparse.plan import dense_plan

    monkeypatch.setattr(gluon_hopper.GluonHopperBackend, "warned_old_triton", False)
    monkeypatch.setattr(triton_hopper, "_hopper_available", lambda device: True)     # as on an sm_90 GPU
    backend, plan = gluon_hopper.GluonHopperBackend(), dense_plan(1, 2, 300)
    q = torch.randn(1, 2, 300, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(gluon_hopper, "triton_version", lambda: gluon_hopper.OLDEST_TRITON)
    assert backend.not_supported_reasons(q, q, q, plan) == []
    monkeypatch.setattr(gluon_hopper, "triton_version", lambda: (3, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # inputs it declines anyway (64 x 64 tiles): the reason, no warning
        assert len(backend.not_supported_reasons(q, q, q, dense_plan(1, 2, 300, 64, 64))) == 2
    with pytest.warns(RuntimeWarning, match=r"Gluon Hopper kernel needs Triton 3\.6 or newer .*this is Triton "
                                            r".*generic Triton kernel runs instead"):
        why = backend.not_supported_reasons(q, q, q, plan)
    assert len(why) == 1 and "needs Triton 3.6 or newer" in why[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # once
        assert backend.not_supported_reasons(q, q, q, plan) == why
    generic = dispatch.get_backend("triton_generic")
    monkeypatch.setattr(generic, "not_supported_reasons", lambda *args: [])        # as on a GPU
    assert dispatch.select_backend(q, q, q, plan, backend="triton") is generic
    with pytest.raises(ValueError, match=r"gluon_hopper: needs Triton 3\.6 or newer"):
        dispatch.select_backend(q, q, q, plan, backend="gluon_hopper")


def test_gluon_backend_declines_correction_bias_rows_past_tma_coordinates():
    """The loader stages the correction's bias rows by 1D TMA boxes, whose int32 coordinates reach 2^31 elements:
    a larger plan (here 2^17 items x 16,384 chunk columns, as meta tensors) goes to another backend, with a reason;
    the same plan without the correction does not hit it."""
    import torch

    pytest.importorskip("triton.experimental.gluon")
    from videosparse.kernels.gluon_hopper import BACKEND
    from videosparse.plan import Plan

    S, items = 2 ** 28, 2 ** 17
    k = torch.empty(1, 1, S, 128, device="meta", dtype=torch.bfloat16)
    index = torch.empty(1, 1, items, 4, device="meta", dtype=torch.int32)
    count = torch.empty(1, 1, items, device="meta", dtype=torch.int32)
    plan = Plan(index, count, 128, 128)
    nk = S // 128
    centroids = torch.empty(1, 1, nk, 128, device="meta")
    corrected = plan.with_correction(centroids, centroids, torch.empty(nk, device="meta", dtype=torch.int32))
    assert "2^31" in " ".join(BACKEND.not_supported_reasons(k, k, k, corrected))
    assert "2^31" not in " ".join(BACKEND.not_supported_reasons(k, k, k, plan))
    # a head dim padded to 128 (Allegro's 96): the dispatch asks with a one-token stand-in of k, so the same limit
    from videosparse.kernels.dispatch import PaddedHeadDim
    k96, c96 = k[..., :96], centroids[..., :96]
    corrected96 = plan.with_correction(c96, c96, corrected.tile_len)
    assert "2^31" in " ".join(PaddedHeadDim(BACKEND, 128).not_supported_reasons(k96, k96, k96, corrected96))


def test_gluon_refuses_buffers_that_do_not_fit_shared_memory():
    import torch

    pytest.importorskip("triton.experimental.gluon")
    from videosparse.kernels.gluon_hopper import gluon_attention
    from videosparse.plan import dense_plan

    q = torch.randn(1, 1, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        gluon_attention(q, q, q, dense_plan(1, 1, 256), 0.1, num_stages=3, q_buffers=2)
    with pytest.raises(ValueError, match="q_buffers"):
        gluon_attention(q, q, q, dense_plan(1, 1, 256), 0.1, q_buffers=3)


def test_sass_overlap_count_reads_the_instructions_between_the_two_gemm_waits():
    inspect = load_script("inspect_gluon_sass")
    ops = ["HGMMA a", "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2 R1, R2", "FMUL", "MUFU.EX2 R3, R4",
           "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R5, R6",
           "WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R7, R8"]
    assert inspect.overlap_per_loop(ops) == [2, 0]


def test_sass_tile_loops_are_the_inner_conditional_loops_with_gemms_and_exponentials():
    inspect = load_script("inspect_gluon_sass")
    listing = [(0x00, "MOV R1, R2"), (0x10, "HGMMA a"), (0x20, "MUFU.EX2 R3, R4"), (0x30, "LDL R5, [R1]"),
               (0x40, "@P0 BRA 0x10"),                        # tile loop: back edge on a predicate
               (0x50, "STL [R1], R5"), (0x60, "@!P1 BRA 0x80"), (0x70, "BRA 0x10"),   # mbarrier retry path
               (0x80, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R0"), (0x90, "@!P1 BRA 0x80"), (0xa0, "EXIT")]
    loops = inspect.tile_loops(listing)
    assert [len(body) for body in loops] == [4]
    assert [inspect.local_memory_ops(body) for body in loops] == [1]
    assert inspect.local_memory_ops([op for _, op in listing]) == 2


def test_ptxas_overlap_probe_compiles_its_loops_for_sm90():
    pytest.importorskip("triton.experimental.gluon")
    probe = load_script("probe_ptxas_overlap")
    counts = probe.main(["--variants", "single", "pairs"])
    assert len(counts["single"]) == 1 and len(counts["pairs"]) == 2      # one count per loop step
    assert all(0 <= c <= 66 for cs in counts.values() for c in cs)


def test_loop_carry_probe_reads_the_outer_loops_iter_args():
    """scripts/probe_triton_loop_carry.py: its two control kernels carry the reassigned value (the bound-only one
    does not in Triton 3.6, a frontend bug docs/kernel_notes.md describes; not asserted, so a fixed Triton passes)."""
    pytest.importorskip("triton.experimental.gluon")
    result = load_script("probe_triton_loop_carry").main()
    assert result["also_in_body"] and result["no_inner_loop"], result
    assert isinstance(result["bound_only"], bool)


@schedule_check
@pytest.mark.parametrize("head_dim,late_k,late_q,correction", [
    (128, None, None, False), (128, None, None, True), (64, None, None, False), (64, True, None, False),
    (128, False, True, False), (64, False, True, False), (128, True, False, False)])
def test_gluon_late_release_keeps_the_tile_loop_softmax_under_the_pv_gemm(head_dim, late_k, late_q, correction):
    """With P in registers, ptxas hoists the wait for P_{j-1} V_{j-1} above the softmax of S_j when nothing
    separates them (0 exponentials under the GEMM); the step's conditional Q release placed after the softmax
    (`late_q_release`, with `late_k_release` by default; on at head dim 128) is a branch between them, and every
    exponential of the tile loop stays between the two waits, in both consumers, wherever the K arrive goes. A
    change that loses this fails here."""
    pytest.importorskip("triton.experimental.gluon")


    from videosparse.kernels import gluon_hopper

    inspect = load_script("inspect_gluon_sass")
    k = gluon_hopper.compile_for_sm90(head_dim=head_dim, correction=correction, late_k_release=late_k,
                                      late_q_release=late_q)
    counts = inspect.overlap_per_loop(inspect.sass_ops(k.asm["cubin"], TOOLS))
    half = len(counts) // 2          # per consumer: the item's first step, then the tile loop's copies
    loops = counts[1:half] + counts[half + 1:]
    assert len(counts) % 2 == 0 and loops, counts
    late_k = gluon_hopper.default_late_k_release(head_dim) if late_k is None else late_k
    if late_k if late_q is None else late_q:
        assert min(loops) >= 64, f"exponentials under the P.V GEMM per loop: {counts}"
    else:
        assert max(loops) == 0, counts


@schedule_check
@pytest.mark.parametrize("head_dim", [128, 64])
def test_gluon_first_step_overlap_keeps_every_softmax_under_a_pv_gemm(head_dim):
    """`first_step_overlap=True` (with only the Q release late in the tile loop): the item's first softmax stays
    under the previous item's last P.V too, so every loop of both consumers counts 64-66 exponentials; without
    it the first step counts 0. It is the default."""
    pytest.importorskip("triton.experimental.gluon")

    from videosparse.kernels import gluon_hopper

    inspect = load_script("inspect_gluon_sass")

    def counts(first):
        k = gluon_hopper.compile_for_sm90(head_dim=head_dim, late_k_release=False, late_q_release=True,
                                          first_step_overlap=first)
        return inspect.overlap_per_loop(inspect.sass_ops(k.asm["cubin"], TOOLS))

    on, off = counts(True), counts(False)
    assert len(on) == 4 and min(on) >= 64, on
    assert off[0] == off[2] == 0 and min(off[1], off[3]) >= 64, off
    # on by default (with the default releases): each consumer's first step is under a P.V GEMM
    default = inspect.overlap_per_loop(inspect.sass_ops(gluon_hopper.compile_for_sm90(head_dim=head_dim).asm["cubin"],
                                                        TOOLS))
    assert default[0] >= 64 and default[len(default) // 2] >= 64, default


@schedule_check
@pytest.mark.parametrize("head_dim,correction", [(128, False), (64, True)])
def test_gluon_unit_handoff_takes_the_unit_decode_off_the_consumers(head_dim, correction):
    """`unit_handoff=True`: the consumers read each unit's item and kv_count from shared memory after the Q
    barrier (the loader stores them before its arrive, behind a warp barrier) instead of loading them from
    global memory: two global loads fewer per consumer, the same softmax overlap, no spills in the tile loops."""
    pytest.importorskip("triton.experimental.gluon")
    from videosparse.kernels import gluon_hopper

    inspect = load_script("inspect_gluon_sass")

    def look(handoff):
        k = gluon_hopper.compile_for_sm90(head_dim=head_dim, correction=correction, unit_handoff=handoff)
        listing = inspect.sass_listing(k.asm["cubin"], TOOLS)
        ops = [op for _, op in listing]
        return (sum(bool(re.search(r"(^|\s)LDG", op)) for op in ops), inspect.overlap_per_loop(ops),
                [inspect.local_memory_ops(body) for body in inspect.tile_loops(listing)], k.asm["ptx"])

    loads, overlap, loop_spills, ptx = look(True)
    base_loads, base_overlap, _, _ = look(False)
    assert loads == base_loads - 4, (loads, base_loads)
    assert overlap == base_overlap and loop_spills == [0, 0]
    code = [line.strip() for line in ptx.splitlines()
            if line.strip() and not line.strip().startswith((".loc", "$L", "//"))]
    ordered = [i for i, line in enumerate(code) if line.startswith("st.shared.b32")
               and code[i + 1].startswith("bar.warp.sync")
               and any("mbarrier.arrive.expect_tx" in later for later in code[i + 2:i + 5])]
    assert ordered, "the loader's store of the unit must precede a warp barrier and the Q barrier's arrive"


@schedule_check
@pytest.mark.parametrize("head_dim,q_buffers", [(128, 2), (64, 2), (128, 1)])
def test_gluon_correction_bias_loads_hide_under_the_score_gemm(head_dim, q_buffers):
    """With the zero-order correction, each centroid step's bias row (32 values per thread) is read from shared
    memory, where the loader staged it with the chunk, after its score GEMM is issued and before the wait for it,
    and no step loads from global memory there; a change that moves the read behind the wait, or back to global
    memory, fails here. Without the correction no load sits there. Checked on the early release schedule
    (`late_k_release=False`): with the late one (the default at head dim 128) ptxas duplicates the score wait into
    the exact-tile and centroid branches, which this count does not follow."""
    pytest.importorskip("triton.experimental.gluon")

    from videosparse.kernels import gluon_hopper

    inspect = load_script("inspect_gluon_sass")

    def loads_before_score_waits(**kwargs):
        ops = inspect.sass_ops(gluon_hopper.compile_for_sm90(head_dim=head_dim, q_buffers=q_buffers,
                                                             late_k_release=False, **kwargs).asm["cubin"], TOOLS)
        counts, start = [], 0
        for i, op in enumerate(ops):
            if op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1"):     # wait for S_j, P_{j-1} V_{j-1} may run on
                seg = ops[start:i]
                first_gemm = next((k for k, x in enumerate(seg) if x.startswith("HGMMA")), len(seg))
                counts.append((sum(bool(re.search(r"(^|\s)LDG", x)) for x in seg[first_gemm:]),     # global
                               sum(bool(re.search(r"(^|\s)LDS", x)) for x in seg[first_gemm:])))    # shared
            if "DEPBAR" in op:
                start = i
        return counts

    with_corr = loads_before_score_waits(correction=True)
    assert len(with_corr) == 4 and all(g == 0 and s >= 16 for g, s in with_corr), with_corr
    assert loads_before_score_waits(correction=False) == [(0, 0)] * 4
    # the loader stages the rows with one 1D TMA box per chunk; without the correction there is none
    staged = "cp.async.bulk.tensor.1d.shared::cluster.global"
    assert staged in gluon_hopper.compile_for_sm90(head_dim=head_dim, q_buffers=q_buffers, correction=True).asm["ptx"]
    assert staged not in gluon_hopper.compile_for_sm90(head_dim=head_dim, q_buffers=q_buffers).asm["ptx"]


@pytest.mark.parametrize("out_dtype,chunk,d_p2,valid", [("bf16", 128, 128, False), ("fp16", 64, 64, False),
                                                        ("fp32", 128, 128, False), ("bf16", 128, 128, True)])
def test_correction_inputs_kernel_compiles_for_sm90(hopper_module, out_dtype, chunk, d_p2, valid):
    """The one-launch correction inputs kernel compiles for sm_90 (the interpreter tests do not compile it)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from videosparse.kernels._triton_utils import _correction_inputs_kernel

    sig = dict(KV_INDEX="*i32", KV_COUNT="*i32", TILE_LEN="*i32", K_MEAN="*fp32", V_SUM="*fp32",
               KM_OUT="*" + out_dtype, VM_OUT="*" + out_dtype, BIAS="*fp32", VALID_KEYS="*i32", N_ITEMS="i32",
               NK="i32", NCP="i32", KMAX="i32", N_ROWS="i32", D="i32", ITEMS_PER_B="i32", ROWS_PER_B="i32",
               BLOCK_N="i32", D_P2="constexpr", CHUNK="constexpr", KB="constexpr", ROWS="constexpr",
               HAS_VALID="constexpr")
    src = ASTSource(_correction_inputs_kernel, sig, dict(D_P2=d_p2, CHUNK=chunk, KB=32, ROWS=16, HAS_VALID=valid))
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert ".entry _correction_inputs_kernel" in k.asm["ptx"]
    assert k.metadata.shared <= SHARED_LIMIT
