"""Ahead-of-time compile of the generic Triton kernel for Ampere (sm_80) on CPU: ptxas's register spills decide
its default warps per program (`triton_generic.default_num_warps`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import load_script

triton = pytest.importorskip("triton")


def _spill_store_bytes(kernel, capability: int) -> int:
    """Bytes of spill stores per thread that ptxas reports for the kernel's PTX (`inspect_gluon_sass.ptxas_notes`)."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    notes = " ".join(load_script("inspect_gluon_sass").ptxas_notes(kernel.asm["ptx"], tools, f"sm_{capability}"))
    found = re.search(r"(\d+) bytes spill stores", notes)
    assert found, notes
    return int(found.group(1))


@pytest.mark.parametrize("head_dim,block_m,block_n", [(128, 128, 64), (128, 64, 64), (64, 128, 64)])
def test_generic_default_warps_spill_least_on_ampere(head_dim, block_m, block_n):
    """The default number of warps spills no more than the other choice, and little (4 warps spilled 26.6 KB per
    thread at head dim 128 with 128x64 tiles, the default before)."""
    from videosparse.kernels import triton_generic

    if triton_generic.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set in this process: kernels are interpreted, not compiled")
    spills = {warps: _spill_store_bytes(triton_generic.compile_generic(
        capability=80, head_dim=head_dim, block_m=block_m, block_n=block_n, num_warps=warps), 80) for warps in (4, 8)}
    default = triton_generic.default_num_warps(block_m, block_n, head_dim)
    assert spills[default] == min(spills.values()) and spills[default] <= 1024, (default, spills)


@pytest.mark.parametrize("head_dim,block_m", [(128, 128), (64, 128), (128, 64)])
def test_generic_takes_128_key_tiles_in_two_steps_to_spill_less(head_dim, block_m):
    """128-key tiles go through the tile loop in steps of 64 keys (`default_key_chunk`): fewer spill bytes at sm_80
    than whole-tile steps (652 -> 224 at head dim 128 with 128x128 tiles, 120 -> 0 at head dim 64)."""
    from videosparse.kernels import triton_generic

    if triton_generic.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set in this process: kernels are interpreted, not compiled")
    assert triton_generic.default_key_chunk(128) == 64 and triton_generic.default_key_chunk(64) == 64
    spills = {chunk: _spill_store_bytes(triton_generic.compile_generic(
        capability=80, head_dim=head_dim, block_m=block_m, block_n=128, key_chunk=chunk), 80) for chunk in (128, 64)}
    assert spills[64] < spills[128] and spills[64] <= 700, spills
