"""The generic Triton kernel's launch options and defaults (`triton_generic.default_num_warps`,
`default_key_chunk`) against the sweep measured on an H200 running it as Ampere code, and its ahead-of-time
compile for sm_80 on CPU: the compile specializes like a real launch, and ptxas finds the defaults (nearly)
spill-free where the choice they replaced spilled."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import load_script

triton = pytest.importorskip("triton")

SWEEP = Path(__file__).resolve().parents[2] / "benchmarks" / "sweep_generic_sm80_on_h200.json"


def _compiled():
    from videosparse.kernels import triton_generic

    if triton_generic.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set in this process: kernels are interpreted, not compiled")
    return triton_generic


def _spill_store_bytes(kernel) -> int:
    """Bytes of spill stores per thread that ptxas reports for the kernel's PTX at sm_80."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    notes = " ".join(load_script("inspect_gluon_sass").ptxas_notes(kernel.asm["ptx"], tools, "sm_80"))
    found = re.search(r"(\d+) bytes spill stores", notes)
    assert found, notes
    return int(found.group(1))


def test_generic_defaults_are_within_5_percent_of_the_best_measured():
    """Per head dim and tile shape, the default warps / stages / key chunk reach >= 95% of the fastest launch
    options in benchmarks/sweep_generic_sm80_on_h200.json (`scripts/sweep_generic.py`)."""
    from videosparse.kernels import triton_generic as tg

    rows = json.loads(SWEEP.read_text())["rows"]
    assert {(r["head_dim"], r["block_m"], r["block_n"]) for r in rows} >= {(128, 128, 128), (128, 64, 64),
                                                                          (64, 128, 128), (64, 64, 64)}
    for r in rows:
        D, bm, bn = r["head_dim"], r["block_m"], r["block_n"]
        warps = tg.default_num_warps(bm, bn, D)
        pick = (warps, tg.default_num_stages(D), tg.default_key_chunk(bm, bn, warps))
        timed = {(c["warps"], c["stages"], c["key_chunk"]): c["tflops"] for c in r["configs"]}
        assert pick in timed, (D, bm, bn, pick, sorted(timed))
        assert timed[pick] >= 0.95 * max(timed.values()), (D, bm, bn, pick, timed)


def test_compile_generic_specializes_like_a_launch():
    """Contiguous rows and aligned pointers as at a real launch: K/V tiles arrive in 16-byte cp.async copies."""
    tg = _compiled()
    ptx = tg.compile_generic(capability=80, head_dim=128, block_m=64, block_n=64).asm["ptx"]
    sizes = set(re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", ptx))
    assert sizes == {"0x10"}, sizes


# opt-in shared memory per block: Ada (RTX 40xx, L40) and consumer Blackwell (RTX 50xx) have 99 KB, datacenter
# Blackwell 227 KB
SHARED_PER_BLOCK = {89: 101376, 100: 232448, 120: 101376}


@pytest.mark.parametrize("capability,head_dim", [(89, 128), (100, 128), (120, 128), (120, 64)])
def test_generic_compiles_for_ada_and_blackwell_within_their_shared_memory(capability, head_dim):
    """The kernel `backend="auto"` takes on every CUDA GPU but Hopper compiles there with the correction and 128x128
    tiles (the largest buffers), fits the shared memory of one block, and runs its GEMMs on tensor cores (tcgen05
    on sm_100, mma.sync elsewhere)."""
    k = _compiled().compile_generic(capability=capability, head_dim=head_dim, block_m=128, block_n=128,
                                    correction=True)
    assert k.metadata.shared <= SHARED_PER_BLOCK[capability], (k.metadata.shared, SHARED_PER_BLOCK[capability])
    assert ("tcgen05.mma" if capability == 100 else "mma.sync") in k.asm["ptx"]


@pytest.mark.parametrize("head_dim,block_m,block_n", [(128, 128, 128), (64, 128, 128)])
def test_generic_defaults_spill_little_on_ampere(head_dim, block_m, block_n):
    """The defaults spill at most 64 bytes per thread at sm_80; whole 128-key tiles at 4 warps (head dim 128: 7
    TFLOP/s in the sweep) spill far more, so the check can tell."""
    tg = _compiled()
    default = _spill_store_bytes(tg.compile_generic(capability=80, head_dim=head_dim, block_m=block_m,
                                                    block_n=block_n))
    whole_at_4 = _spill_store_bytes(tg.compile_generic(capability=80, head_dim=head_dim, block_m=block_m,
                                                       block_n=block_n, num_warps=4, key_chunk=block_n))
    assert default <= 64 and whole_at_4 > 8 * max(default, 64), (default, whole_at_4)


@pytest.mark.parametrize("key_chunk", [48, 8, 256])
def test_generic_key_chunk_must_divide_the_tile_width(key_chunk):
    """A key_chunk that does not divide the tile width (or is under 16) is refused before any launch."""
    import torch

    from videosparse.kernels import triton_generic
    from videosparse.plan import dense_plan

    q = torch.randn(1, 1, 200, 64)
    with pytest.raises(ValueError, match=rf"key_chunk={key_chunk}: must divide the tile width 128"):
        triton_generic.generic_attention(q, q, q, dense_plan(1, 1, 200), 0.125, key_chunk=key_chunk)
