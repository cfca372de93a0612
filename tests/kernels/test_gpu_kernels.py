"""Triton kernels on a real GPU at real sizes vs the torch reference (marked `gpu`, skipped without CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import random_plan, rel_err

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1.2e-2, torch.float16: 3e-3}


def _banded(B, H, S, block, width, device):
    from videosparse.plan import plan_from_mask

    M = math.ceil(S / block)
    i = torch.arange(M, device=device)
    mask = ((i[:, None] - i[None, :]).abs() <= width).expand(B, H, M, M).contiguous()
    return plan_from_mask(mask, block, block)


def _backends():
    names = ["triton_generic"]
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        names[:0] = ["gluon_hopper", "hopper"]
    return names


@pytest.mark.parametrize("backend", ["gluon_hopper", "hopper", "triton_generic"])
@pytest.mark.parametrize("S,D,dtype,plan_kind,correction", [
    (16380, 128, torch.bfloat16, "random", False),
    (16380, 128, torch.bfloat16, "random", True),
    (16384, 128, torch.bfloat16, "dense", False),
    (9000, 64, torch.float16, "banded", True),
    (9000, 64, torch.bfloat16, "random", False),
    (5000, 128, torch.float16, "empty", False),
    (50, 64, torch.bfloat16, "dense", False),          # fewer rows than one TMA box
    (50, 128, torch.float16, "random", True),
    (5000, 128, torch.bfloat16, "empty", True),
    (16380, 128, torch.bfloat16, "valid", True),       # a key-padding limit per item (Plan.valid_keys)
    (9000, 64, torch.float16, "valid", False),
    # key limits where the keys end on a tile boundary (mutation find, session 59: the Gluon kernel's last-tile mask
    # switched on only for a partial last tile went unseen)
    (16384, 128, torch.bfloat16, "valid", False),
])
def test_kernel_matches_reference_at_real_size(backend, S, D, dtype, plan_kind, correction):
    _check_backend(backend, S, D, dtype, plan_kind, correction)


def _check_backend(backend, S, D, dtype, plan_kind, correction, block=128):
    """`_check` of block_sparse_attention(backend=backend); skipped where this GPU lacks the backend."""
    if backend not in _backends():
        pytest.skip(f"{backend} needs another GPU generation")
    from videosparse.kernels import block_sparse_attention

    _check(lambda q, k, v, plan: block_sparse_attention(q, k, v, plan, return_lse=True, backend=backend),
           S, D, dtype, plan_kind, correction, block)


def _check(run, S, D, dtype, plan_kind, correction, block=128):
    """run(q, k, v, plan) -> (out, lse) against the reference on fresh inputs, B=2, H=4, block x block tiles."""
    from videosparse.kernels import reference_attention
    from videosparse.plan import Plan, dense_plan
    from videosparse.sol.centroids import tile_centroids_torch

    B, H, dev = 2, 4, "cuda"
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=dtype) for _ in range(3))
    if plan_kind == "dense":
        plan = dense_plan(B, H, S, block, block, device=dev)
    elif plan_kind == "banded":
        plan = _banded(B, H, S, block, 3, dev)
    else:
        plan = random_plan(B, H, S, block, block, 0.15, seed=S, device=dev)
    if plan_kind == "empty":     # every second query tile attends to no tile: zero rows, lse -inf
        count = plan.kv_count.clone()
        count[:, :, ::2] = 0
        plan = Plan(plan.kv_index, count, block, block)
    if plan_kind == "valid":     # keys of item b valid up to a limit inside a tile; every 3rd query tile dense
        count = plan.kv_count.clone()
        index = plan.kv_index.clone()
        dense = dense_plan(B, H, S, block, block, device=dev)
        index = torch.nn.functional.pad(index, (0, dense.kv_index.shape[-1] - index.shape[-1]))
        index[:, :, ::3], count[:, :, ::3] = dense.kv_index[:, :, ::3], dense.kv_count[:, :, ::3]
        limits = torch.tensor([S - 77, S // 2 + 31], dtype=torch.int32, device=dev)
        plan = Plan(index.contiguous(), count, block, block).with_valid_keys(limits)
    if correction:
        plan = plan.with_correction(*tile_centroids_torch(k, v, block))
    out, lse = run(q, k, v, plan)
    ref, ref_lse = reference_attention(q, k, v, plan, D ** -0.5, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert float((lse[finite] - ref_lse[finite]).abs().max()) < 2e-2


@pytest.mark.parametrize("backend", ["gluon_hopper", "hopper", "triton_generic"])
@pytest.mark.parametrize("S,D,correction", [(200, 128, True), (200, 64, False), (32760, 128, False),
                                            (32760, 64, True)])
def test_non_finite_values_stay_in_their_head(backend, S, D, correction):
    """inf / NaN in the first keys, values and centroids of a head never reach the head before it, whose partial last
    key tile and centroid chunk end where they begin (the Hopper kernels read K / V as [heads, keys, D] boxes: zeros
    past a head's end); a NaN query row gives NaN out and lse, as the reference."""
    if backend not in _backends():
        pytest.skip(f"{backend} needs another GPU generation")
    from videosparse.kernels import block_sparse_attention, reference_attention
    from videosparse.plan import Plan, dense_plan
    from videosparse.sol.centroids import tile_centroids_torch

    B, H, dev = 2, 3, "cuda"
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    plan = dense_plan(B, H, S, 128, 128, device=dev)
    if correction:             # each row lists its own tile: every other tile goes through its centroid
        mq = plan.kv_count.shape[-1]
        own = torch.arange(mq, device=dev, dtype=torch.int32).view(1, 1, mq, 1).expand(B, H, mq, 1).contiguous()
        plan = Plan(own, torch.ones(B, H, mq, dtype=torch.int32, device=dev)).with_correction(
            *tile_centroids_torch(k, v, 128))
        plan.k_mean[0, 1, 0], plan.v_sum[0, 1, 0] = float("inf"), float("nan")
    k[0, 1, :3], v[0, 1, :3], v[0, 1, 3] = float("inf"), float("-inf"), float("nan")
    k[1, 0, :2] = float("nan")                  # item 1's first head follows item 0's last in memory
    q[0, 0, 5, 0] = float("nan")
    if backend == "hopper" and S > 4096:      # a launch this long gets preempted when the suite runs with -n 8, and
        from videosparse.kernels.triton_hopper import hopper_attention   # warp-specialized, that gives NaN anyway
        out, lse = hopper_attention(q, k, v, plan, D ** -0.5, True, warp_specialize=False)
    else:
        out, lse = block_sparse_attention(q, k, v, plan, return_lse=True, backend=backend, validate=False)
    ref, ref_lse = reference_attention(q, k, v, plan, D ** -0.5, return_lse=True)
    for b, h in ((0, 0), (0, 2)):               # the heads right before a poisoned one
        rows = torch.arange(S, device=dev) != 5 if (b, h) == (0, 0) else slice(None)
        bad = (~torch.isfinite(out[b, h, rows])).any(-1).nonzero().flatten()
        assert bad.numel() == 0, f"head {(b, h)}: {bad.numel()} non-finite rows, first {bad[:8].tolist()}"
        assert rel_err(out[b, h, rows], ref[b, h, rows]) < TOL[torch.bfloat16]
    assert lse[0, 0, 5].isnan() and ref_lse[0, 0, 5].isnan() and out[0, 0, 5].isnan().all()


@pytest.mark.parametrize("backend", ["gluon_hopper", "hopper", "triton_generic"])
@pytest.mark.parametrize("S,D,block,correction", [(16380, 128, 128, False), (16380, 64, 128, True),
                                                  (9000, 128, 64, True), (200, 64, 64, False)])
def test_key_limits_past_the_keys_act_as_the_keys(backend, S, D, block, correction):
    """An unvalidated plan (validate=False, or any call under torch.compile) whose key limits lie past Sk: every
    kernel clamps them to Sk, as the reference. Every row lists only the partial last key tile, so a kernel that took
    the limit as given would add the zero keys past a head's end (the Hopper kernels' 3D boxes) or the next head's
    first keys (poisoned with NaN here) to 1-in-30 of each row's keys, far above the fp16 tolerance."""
    if backend not in _backends() or (backend == "gluon_hopper" and block != 128):
        pytest.skip(f"{backend} needs another GPU generation or takes 128 x 128 tiles only")
    from videosparse.kernels import block_sparse_attention, reference_attention
    from videosparse.plan import Plan
    from videosparse.sol.centroids import tile_centroids_torch

    B, H, dev, dtype = 2, 3, "cuda", torch.float16
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=dtype) for _ in range(3))
    Mq = Mk = math.ceil(S / block)
    last = torch.full((B, H, Mq, 1), Mk - 1, dtype=torch.int32, device=dev)
    plan = Plan(last, torch.ones(B, H, Mq, dtype=torch.int32, device=dev), block, block)
    plan = plan.with_valid_keys(torch.tensor([S + 40, S + 3], dtype=torch.int32, device=dev))
    if correction:
        plan = plan.with_correction(*tile_centroids_torch(k, v, block))
    k[0, 1, :8], v[0, 1, :8] = float("nan"), float("nan")      # the head after (0, 0), in memory
    k[1, 0, :8], v[1, 0, :8] = float("nan"), float("nan")      # the head after item 0's last
    out, lse = block_sparse_attention(q, k, v, plan, return_lse=True, backend=backend, validate=False)
    ref, ref_lse = reference_attention(q, k, v, plan, D ** -0.5, return_lse=True)
    for b, h in ((0, 0), (0, 2), (1, 1)):
        assert torch.isfinite(out[b, h]).all(), f"head {(b, h)} read past its keys"
        assert rel_err(out[b, h], ref[b, h]) < TOL[dtype], (b, h)
        assert float((lse[b, h] - ref_lse[b, h]).abs().max()) < 2e-2


@pytest.mark.parametrize("backend", ["hopper", "triton_generic"])
@pytest.mark.parametrize("S,D,dtype,plan_kind,correction", [
    (9000, 128, torch.bfloat16, "random", True),     # the Triton Hopper MERGE pass at 64 x 64 tiles
    (9000, 64, torch.float16, "banded", True),
    (5000, 128, torch.bfloat16, "empty", True),
    (4000, 64, torch.bfloat16, "random", False),
    (9000, 128, torch.bfloat16, "valid", True),
])
def test_triton_kernels_at_64x64_tiles(backend, S, D, dtype, plan_kind, correction):
    """64 x 64 tiles (a Veda per-head tile shape; the Gluon kernel takes 128 x 128 only) against the reference."""
    _check_backend(backend, S, D, dtype, plan_kind, correction, block=64)


@pytest.mark.parametrize("knobs", ["one_q_buffer", "register_store", "no_tail_split",
                                   "seven_programs", "release_flipped", "late_q_only", "overlap_all",
                                   "no_first_overlap", "no_unit_handoff"])
@pytest.mark.parametrize("S,D,dtype,plan_kind,correction", [
    (16380, 128, torch.bfloat16, "random", True),
    (9000, 64, torch.float16, "banded", False),
    (5000, 128, torch.bfloat16, "empty", True),
    (50, 64, torch.bfloat16, "dense", False),
])
def test_gluon_variants_match_reference(knobs, S, D, dtype, plan_kind, correction):
    """The Gluon kernel's non-default schedules (benchmark variants) give the reference's answer too."""
    if "gluon_hopper" not in _backends():
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    from videosparse.kernels.gluon_hopper import gluon_attention

    kwargs = {"one_q_buffer": dict(q_buffers=1),
              "register_store": dict(tma_store=False), "no_tail_split": dict(split_tail=False),
              # 7 persistent programs: the last wave's items cut into up to 7 parts (`tail_split`)
              "seven_programs": dict(num_programs=7, split_tail=True),
              # the release points of `_tile_loop` and the first step (default: both late at d128 only)
              "release_flipped": dict(late_k_release=D != 128),
              "late_q_only": dict(late_k_release=False, late_q_release=True),
              "overlap_all": dict(late_k_release=False, late_q_release=True, first_step_overlap=True),
              "no_first_overlap": dict(first_step_overlap=False),
              # each consumer loads the unit's item and kv_count itself (default: handed over by the loader)
              "no_unit_handoff": dict(unit_handoff=False)}[knobs]
    _check(lambda q, k, v, plan: gluon_attention(q, k, v, plan, D ** -0.5, return_lse=True, **kwargs),
           S, D, dtype, plan_kind, correction)


@pytest.mark.parametrize("S,D,plan_kind,correction,programs", [
    (9000, 64, "banded", True, None),      # B*H*Mq = 568 items on 132 SMs: 40 left, 3 parts
    (5000, 128, "empty", True, None),      # 320 items: 56 left, 2 parts; empty items among them
    (2560, 128, "dense", False, None),     # 160 items: 28 left, 4 parts of 5 tiles
    (2000, 128, "random", False, 6),       # 128 items on 6 programs: 2 left, up to 3 parts of 1-2 tiles
    (5000, 128, "valid", True, None),      # a key-padding limit per item: the masked tile in the last part
])
def test_gluon_tail_split_matches_whole_items(S, D, plan_kind, correction, programs):
    """The split tail (parts merged by `combine_parts`) gives the reference's answer, and the unsplit kernel's
    within bf16 rounding."""
    if "gluon_hopper" not in _backends():
        pytest.skip("the Gluon kernel needs an sm_90 GPU")
    from videosparse.kernels.gluon_hopper import gluon_attention
    from videosparse.kernels.tail_split import tail_split

    outs, parts, run_inputs = {}, [], []

    def run(q, k, v, plan, split):
        run_inputs.append((q, k, v, plan))
        sms = programs or torch.cuda.get_device_properties(q.device).multi_processor_count
        parts.append(tail_split(plan.kv_count.numel(), sms, plan.kv_index.shape[-1])[1])
        outs[split] = gluon_attention(q, k, v, plan, D ** -0.5, return_lse=True, split_tail=split,
                                      num_programs=programs)
        return outs[split]

    _check(lambda q, k, v, plan: (run(q, k, v, plan, False), run(q, k, v, plan, True))[1],
           S, D, torch.bfloat16, plan_kind, correction)
    assert parts[-1] > 1, "the case was meant to split its last wave"
    assert rel_err(outs[True][0], outs[False][0]) < 8e-3
    finite = torch.isfinite(outs[False][1])
    assert torch.equal(torch.isfinite(outs[True][1]), finite)
    assert float((outs[True][1][finite] - outs[False][1][finite]).abs().max()) < 1e-3
    # without return_lse the parts still need theirs to be combined (mutation find, session 59: parts that stored
    # their LSE only when asked for one went unseen)
    q, k, v, plan = run_inputs[0]
    alone = gluon_attention(q, k, v, plan, D ** -0.5, split_tail=True, num_programs=programs)
    assert torch.equal(alone, outs[True][0])


_GPU_LOAD = """
import sys, time, torch
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
a @ a; torch.cuda.synchronize(); print("ready", flush=True)
t = time.time()
while time.time() - t < 120:
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


def test_auto_kernels_stay_exact_while_another_process_uses_the_gpu():
    """With another process on the GPU the driver time-slices and preempts running kernels; the Triton Hopper kernel
    (automatic warp specialization) returned NaN rows then (scripts/probe_preemption.py). What auto picks (the Gluon
    kernel at 128x128 tiles on sm_90, the generic one at 64x64 tiles and elsewhere) must stay exact through launches
    long enough to be preempted (~6 ms each)."""
    import subprocess
    import sys

    from videosparse.kernels import block_sparse_attention, reference_attention, select_backend
    from videosparse.plan import dense_plan

    load = subprocess.Popen([sys.executable, "-c", _GPU_LOAD], stdout=subprocess.PIPE, text=True)
    try:
        assert load.stdout.readline().strip() == "ready"
        B, H, S, D = 2, 3, 32760, 128
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for block in (128, 64):
            plan = dense_plan(B, H, S, block, block, device="cuda")
            assert select_backend(q, k, v, plan).name != "hopper"
            ref = reference_attention(q, k, v, plan, D ** -0.5)
            for _ in range(4):
                out = block_sparse_attention(q, k, v, plan)
                bad = (~torch.isfinite(out)).any(-1).sum().item()
                assert bad == 0, f"{block}x{block} tiles: {bad} non-finite rows"
                assert rel_err(out, ref) < TOL[torch.bfloat16]
    finally:
        load.kill()
        load.wait()


def test_auto_picks_the_fastest_backend_on_this_gpu():
    from videosparse.kernels import select_backend
    from videosparse.plan import dense_plan

    q = torch.randn(1, 2, 1000, 128, device="cuda", dtype=torch.bfloat16)
    impl = select_backend(q, q, q, dense_plan(1, 2, 1000, device="cuda"))
    assert impl.name == _backends()[0]
    q64 = q[..., :64].contiguous()
    assert select_backend(q64, q64, q64, dense_plan(1, 2, 1000, device="cuda")).name == _backends()[0]
    # fp32 on the GPU is not a Triton case: auto falls back to the reference
    assert select_backend(q.float(), q.float(), q.float(), dense_plan(1, 2, 1000, device="cuda")).name == "reference"


@pytest.mark.parametrize("S,D,dtype,correction", [(9000, 96, torch.bfloat16, True), (5000, 80, torch.float16, False),
                                                   (4000, 48, torch.bfloat16, False)])
def test_other_head_dims_run_padded_on_the_fastest_backend(S, D, dtype, correction):
    """Head dims the kernels do not take (Allegro's 96) run on the fastest one zero-padded to 64 / 128."""
    from videosparse.kernels import block_sparse_attention, select_backend
    from videosparse.plan import dense_plan

    q = torch.empty(1, 2, 1000, D, device="cuda", dtype=dtype)
    assert select_backend(q, q, q, dense_plan(1, 2, 1000, device="cuda")).name == \
        f"{_backends()[0]}+pad{64 if D <= 64 else 128}"
    _check(lambda q, k, v, plan: block_sparse_attention(q, k, v, plan, return_lse=True), S, D, dtype, "random",
           correction)


def test_padded_head_dim_under_torch_compile():
    """The padded path inside the custom op (`kernels.ops`): compiled fullgraph equals eager at head dim 96."""
    from videosparse.kernels import block_sparse_attention
    from videosparse.sol.centroids import tile_centroids_torch

    q, k, v = (torch.randn(1, 4, 3000, 96, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    plan = random_plan(1, 4, 3000, 128, 128, 0.3, seed=1, device="cuda")
    plan = plan.with_correction(*tile_centroids_torch(k, v, 128))

    def attend(q, k, v):
        return block_sparse_attention(q, k, v, plan, validate=False)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)(q, k, v)
    assert torch.equal(compiled, attend(q, k, v))


@pytest.mark.parametrize("S,block,density", [(75600, 128, 0.1), (17550, 64, 0.3), (1000, 128, 1.0)])
def test_correction_inputs_kernel_matches_torch_at_real_size(S, block, density):
    """The one-launch correction inputs equal their torch version (Kmax 60+ at the Wan 14B shape)."""
    from videosparse.kernels._triton_utils import correction_inputs, correction_inputs_torch
    from videosparse.sol.centroids import tile_centroids_torch

    B, H, D = 1, 4, 128
    k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    plan = random_plan(B, H, S, block, block, density, seed=S, device="cuda")
    plan = plan.with_correction(*tile_centroids_torch(k, v, block))
    Nk = math.ceil(S / block)
    got = correction_inputs(plan, Nk, block, k.dtype)
    want = correction_inputs_torch(plan, Nk, block, k.dtype)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])        # bf16 tolerance: Triton's fp32 division may differ by an ulp
    finite = torch.isfinite(want[2])
    assert torch.equal(torch.isinf(got[2]), ~finite)
    assert torch.allclose(got[2][finite], want[2][finite], atol=1e-6, rtol=0)


@pytest.mark.parametrize("kernel", ["gluon_hopper", "triton_hopper", "triton_generic"])
def test_ahead_of_time_compiles_are_the_launched_kernels(kernel):
    """The AOT compiles that the CPU SASS and spill tests read (`compile_for_sm90`, `compile_generic`, specialized by
    `launch_signature`) hold the same SASS as the kernel a launch with those arguments compiles."""
    from pathlib import Path

    import triton

    from helpers import load_script
    from videosparse.kernels import gluon_hopper, triton_generic, triton_hopper
    from videosparse.plan import dense_plan

    if torch.cuda.get_device_capability()[0] != 9 and kernel != "triton_generic":
        pytest.skip("Hopper kernels need sm_90")
    S, D, block = {"gluon_hopper": (32760, 128, 128), "triton_hopper": (32760, 128, 64),
                   "triton_generic": (32768, 128, 128)}[kernel]
    q, k, v = (torch.randn(1, 12, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    plan = dense_plan(1, 12, S, block, block, device="cuda")
    if kernel == "gluon_hopper":
        gluon_hopper.gluon_attention(q, k, v, plan, D ** -0.5, return_lse=True, split_tail=False)
        fn, aot = gluon_hopper._gluon_fwd, gluon_hopper.compile_for_sm90(head_dim=D, seq_len=S)
    elif kernel == "triton_hopper":
        triton_hopper.hopper_attention(q, k, v, plan, D ** -0.5, return_lse=True)
        fn, aot = triton_hopper._hopper_fwd, triton_hopper.compile_for_sm90(head_dim=D, block_m=block, block_n=block,
                                                                              seq_len=S)
    else:
        triton_generic.generic_attention(q, k, v, plan, D ** -0.5, return_lse=True)
        major, minor = torch.cuda.get_device_capability()
        fn, aot = triton_generic._generic_fwd, triton_generic.compile_generic(capability=10 * major + minor,
                                                                              head_dim=D, seq_len=S)
    torch.cuda.synchronize()
    sass = load_script("inspect_gluon_sass").sass_ops
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    launched = [sass(c.asm["cubin"], tools) for c in fn.device_caches[torch.cuda.current_device()][0].values()]
    assert sass(aot.asm["cubin"], tools) in launched, [len(ops) for ops in launched]


@pytest.mark.parametrize("backend,head_dim", [("gluon_hopper", 128), ("hopper", 64), ("triton_generic", 128),
                                              ("triton_generic", 64)])
def test_gpu_kernels_train_with_the_triton_backward(backend, head_dim, monkeypatch):
    """The GPU kernels' forward takes the Triton backward kernels (counted): gradients for q, k, v through out and
    lse, the correction's centroids and a key limit per item included, against the reference's backward in fp64
    on the CPU."""
    if backend not in _backends():
        pytest.skip(f"{backend} needs sm_90")
    from videosparse.kernels import block_sparse_attention, triton_backward
    from videosparse.kernels.reference import reference_attention_backward
    from videosparse.sol.centroids import tile_centroids, tile_centroids_torch

    calls = []
    original = triton_backward.triton_attention_backward
    monkeypatch.setattr(triton_backward, "triton_attention_backward", lambda *a: calls.append(1) or original(*a))
    B, H, S, D = 2, 4, 4100, head_dim
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(B, H, S, D, generator=g) for _ in range(3)]
    w, w_lse = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, generator=g)
    plan = random_plan(B, H, S, 128, 128, 0.3, seed=3).with_valid_keys(torch.tensor([S, S - 700], dtype=torch.int32))
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in base)
    p = plan.to("cuda").with_correction(*tile_centroids(k, v, 128))
    out, lse = block_sparse_attention(q, k, v, p, return_lse=True, backend=backend)
    ((out.float() * w.cuda()).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * w_lse.cuda()).sum()).backward()
    assert len(calls) == 1
    q64, k64, v64 = (t.double().requires_grad_() for t in base)
    p64 = plan.with_correction(*tile_centroids_torch(k64, v64, 128))
    # autograd through the centroids to k, v: the fp64 reference's backward as a Function of q, k, v
    dq, dk, dv, dkm, dvs = reference_attention_backward(q64, k64, v64, p64, D ** -0.5, w.double(), w_lse.double())
    torch.autograd.backward([p64.k_mean, p64.v_sum], [dkm, dvs])
    want = [t.detach() for t in (dq, dk + k64.grad, dv + v64.grad)]
    for got, ref in zip((q.grad, k.grad, v.grad), want):
        assert torch.isfinite(got).all() and rel_err(got.double().cpu(), ref) < 3e-2


@pytest.mark.parametrize("dtype,correction", [(torch.bfloat16, True), (torch.float16, False)])
def test_reference_backend_gradients_on_the_gpu(dtype, correction):
    """The reference backend's row-recomputing backward on CUDA in half precision against fp64 autograd through the
    reference loop on the CPU; its peak memory stays near that of q, k, v (not the rows' probabilities)."""
    from videosparse.kernels import block_sparse_attention
    from videosparse.kernels.reference import reference_attention
    from videosparse.sol.centroids import tile_centroids_torch

    B, H, S, D = 1, 4, 4100, 128
    g = torch.Generator().manual_seed(11)
    base = [torch.randn(B, H, S, D, generator=g) for _ in range(3)]
    plan = random_plan(B, H, S, 128, 128, 0.3, seed=4)
    grads = []
    for device, cast in (("cuda", dtype), ("cpu", torch.float64)):
        q, k, v = (t.to(device, cast).requires_grad_() for t in base)
        p = plan.to(device)
        if correction:
            p = p.with_correction(*tile_centroids_torch(k, v, 128))
        if device == "cuda":
            # the process's first matmuls allocate cuBLAS workspaces through the caching allocator: before the count
            for t in (torch.float32, dtype):
                torch.ones(8, 8, device=device, dtype=t) @ torch.ones(8, 8, device=device, dtype=t)
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            out = block_sparse_attention(q, k, v, p, backend="reference")
        else:
            out = reference_attention(q, k, v, p, D ** -0.5)
        out.float().square().sum().backward()
        if device == "cuda":
            assert torch.cuda.max_memory_allocated() - start < 40 * q.numel() * q.element_size()
        grads.append([t.grad.double().cpu() for t in (q, k, v)])
    for got, want in zip(*grads):
        assert rel_err(got, want) < 3e-2


def test_auto_says_once_when_it_runs_the_reference_on_the_gpu(caplog):
    """Review 59: fp32 inputs (or a head dim past 128) on CUDA ran the torch reference under "auto" without a word."""
    import logging

    from videosparse.kernels import _REFERENCE_ON_CUDA_NOTED, block_sparse_attention, reference_attention

    _REFERENCE_ON_CUDA_NOTED.clear()
    q, k, v = (torch.randn(1, 2, 300, 64, device="cuda") for _ in range(3))
    plan = random_plan(1, 2, 300, 128, 128, 0.5, device="cuda")
    with caplog.at_level(logging.WARNING, logger="videosparse.kernels"):
        out = block_sparse_attention(q, k, v, plan)
        block_sparse_attention(q, k, v, plan)
        block_sparse_attention(q.half(), k.half(), v.half(), plan)            # a kernel serves: no word
    said = [r.getMessage() for r in caplog.records if "found no kernel" in r.getMessage()]
    assert len(said) == 1 and "torch.float32, head dim 64, 128x128 tiles" in said[0]
    torch.testing.assert_close(out, reference_attention(q, k, v, plan, 64 ** -0.5), rtol=0, atol=0)
