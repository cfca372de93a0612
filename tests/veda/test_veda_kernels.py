"""TripPool and teacher: Triton kernels vs torch references, torch references vs naive definitions.

The Triton cases run under the interpreter in one child process (this file run as a script with
TRITON_INTERPRET=1), because the variable must be set before any @triton.jit is created and would
turn every other kernel of the pytest process into an interpreted one. The child prints one JSON line
per case; each parametrised test checks its own line. GPU tests (marked `gpu`) check real sizes.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from helpers import InterpreterCases, interpreter_child

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# name: kind, B, H, S, D, block, dtype, extra
CASES = {
    "trippool-fp32-partial": ("trippool", 2, 3, 300, 64, 64, "float32", ""),
    "trippool-bf16-partial-b128": ("trippool", 1, 2, 257, 64, 128, "bfloat16", ""),
    "trippool-fp16-video-tiles": ("trippool", 1, 2, 384, 32, 128, "float16", "num_tiles=2"),
    "trippool-fp32-strided": ("trippool", 2, 2, 200, 64, 64, "float32", "strided"),
    "teacher-fp32-partial": ("teacher", 2, 2, 300, 64, 64, "float32", ""),
    "teacher-fp32-lse-given": ("teacher", 1, 2, 257, 64, 128, "float32", "lse"),
    "teacher-bf16-video-tiles": ("teacher", 1, 2, 333, 64, 64, "bfloat16", "num_tiles=4"),
    "teacher-fp16-d32-b32": ("teacher", 1, 1, 100, 32, 32, "float16", ""),
    "teacher-fp32-fewer-keys": ("teacher", 1, 2, 300, 32, 64, "float32", "sk=130"),   # 5 query, 3 key tiles
}


def naive_heat(q: torch.Tensor, k: torch.Tensor, block: int, n: int | None = None) -> torch.Tensor:
    """fp64 heat from the full S x Sk probability matrix: max over each tile pair (the tiles both sides have)."""
    q, k = q.double(), k.double()
    B, H, S, D = q.shape
    p = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(D), -1)
    M = min(math.ceil(S / block), math.ceil(k.shape[2] / block))
    n = n or M
    out = torch.zeros(B, H, n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            out[:, :, i, j] = p[:, :, i * block:(i + 1) * block, j * block:(j + 1) * block].amax(dim=(-1, -2))
    return out


def naive_trippool(x: torch.Tensor, block: int) -> torch.Tensor:
    B, H, S, D = x.shape
    tiles = []
    for i in range(math.ceil(S / block)):
        t = x[:, :, i * block:(i + 1) * block].double()
        tiles.append(torch.cat([t.mean(2), t.amax(2), t.amin(2)], -1))
    return torch.stack(tiles, 2)


# ---------------------------------------------------------------- child side (TRITON_INTERPRET=1)
def _run_case(name: str) -> dict:
    from videosparse.kernels import block_sparse_attention
    from videosparse.plan import dense_plan
    from videosparse.veda.teacher import teacher_heat, teacher_heat_torch
    from videosparse.veda.trippool import trippool_qk, trippool_torch

    kind, B, H, S, D, block, dtype, extra = CASES[name]
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if extra == "strided":
        q, k = (torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2) for _ in range(2))
    else:
        q, k = (torch.randn(B, H, S, D, generator=g).mul(2.0).to(dtype) for _ in range(2))
    if extra.startswith("sk="):                 # fewer keys than queries: heat over the key side's tiles
        k = k[:, :, :int(extra[3:])]
    n = int(extra.split("=")[1]) if extra.startswith("num_tiles") else None
    if kind == "trippool":
        qf, kf = trippool_qk(q, k, block, n, backend="triton")
        rq, rk = trippool_torch(q, block, n), trippool_torch(k, block, n)
        return {"max_abs": max(float((qf - rq).abs().max()), float((kf - rk).abs().max())),
                "scale": float(rq.abs().max()), "dtype_ok": qf.dtype == torch.float32,
                "shape_ok": tuple(qf.shape) == (B, H, n or math.ceil(S / block), 3 * D)}
    lse = None
    if extra == "lse":
        v = torch.randn(B, H, S, D, generator=g)
        _, lse = block_sparse_attention(q.float(), k.float(), v, dense_plan(B, H, S, block, block), return_lse=True)
    heat = teacher_heat(q, k, block, lse=lse, num_tiles=n, backend="triton")
    ref = teacher_heat_torch(q, k, block, lse=lse, num_tiles=n)
    m = n or min(math.ceil(S / block), math.ceil(k.shape[2] / block))
    return {"max_abs": float((heat - ref).abs().max()), "scale": float(ref.max()),
            "dtype_ok": heat.dtype == torch.float32, "shape_ok": tuple(heat.shape) == (B, H, m, m)}


def _child_main(names: list[str]) -> None:
    interpreter_child(names, _run_case)


# ---------------------------------------------------------------- parent side (pytest)
INTERPRETER_CASES = InterpreterCases(__file__, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_equals_torch_under_interpreter(interpreter_results, name):
    res = interpreter_results[name]
    assert "error" not in res, res.get("error")
    assert res["shape_ok"] and res["dtype_ok"]
    # both sides upcast the same (b)f16 inputs to fp32: only fp32 rounding differs. The teacher's heat is
    # exp(q.k * scale - lse) <= 1 with logits up to ~30 here (q, k ~ N(0, 4), D = 64), so a rounding error of
    # eps32 * |logit| * sqrt(D) ~ 3e-5 in the exponent moves it by up to that much; CPU matmul blocking (and so
    # the rounding) can vary between runs: 1e-5 failed once in CI at 1.7e-5 on the same seeded inputs
    assert res["max_abs"] <= 5e-5 * max(1.0, res["scale"]), res


@pytest.mark.parametrize("S,block,D", [(300, 64, 32), (256, 128, 16), (129, 64, 16)])
def test_torch_teacher_equals_full_softmax_definition(S, block, D):
    from videosparse.veda.teacher import teacher_heat_torch

    q, k = torch.randn(2, 3, S, D) * 2, torch.randn(2, 3, S, D) * 2
    ref = naive_heat(q, k, block)
    heat = teacher_heat_torch(q, k, block, max_chunk_elems=3 * S * block)        # forces several chunks
    assert heat.dtype == torch.float32
    torch.testing.assert_close(heat.double(), ref, rtol=1e-5, atol=1e-7)
    # the video-tile restriction keeps the LSE over all keys
    sub = teacher_heat_torch(q, k, block, num_tiles=2)
    torch.testing.assert_close(sub.double(), ref[:, :, :2, :2], rtol=1e-5, atol=1e-7)


def test_torch_teacher_with_fewer_keys_than_queries_equals_the_definition():
    """Mutation find: the heat covers the tiles both sides have (Sk < S: the key side's); only S == Sk was run."""
    from videosparse.veda.teacher import teacher_heat, teacher_num_tiles

    assert teacher_num_tiles(300, 130, 64, None) == 3
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 300, 16, generator=g) * 2, torch.randn(1, 2, 130, 16, generator=g) * 2
    heat = teacher_heat(q, k, 64, backend="torch")
    assert heat.shape == (1, 2, 3, 3)
    torch.testing.assert_close(heat.double(), naive_heat(q, k, 64), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"num_tiles=4 must lie in \[1, 3\]"):
        teacher_heat(q, k, 64, num_tiles=4, backend="torch")


def test_torch_teacher_uses_given_lse():
    from videosparse.veda.teacher import dense_lse_torch, teacher_heat_torch

    q, k = torch.randn(1, 2, 200, 32), torch.randn(1, 2, 200, 32)
    lse = dense_lse_torch(q, k)
    torch.testing.assert_close(teacher_heat_torch(q, k, 64, lse=lse), teacher_heat_torch(q, k, 64))
    # a shifted LSE scales the heat by exp(-shift): proof that the given LSE is used
    shifted = teacher_heat_torch(q, k, 64, lse=lse + 1.0)
    torch.testing.assert_close(shifted, teacher_heat_torch(q, k, 64) * math.exp(-1.0))


@pytest.mark.parametrize("S,block", [(300, 64), (256, 128), (129, 64)])
def test_torch_trippool_equals_definition(S, block):
    from videosparse.veda.trippool import trippool_qk

    q, k = torch.randn(2, 3, S, 16), torch.randn(2, 3, S, 16)
    qf, kf = trippool_qk(q, k, block, backend="torch")
    torch.testing.assert_close(qf.double(), naive_trippool(q, block))
    torch.testing.assert_close(kf.double(), naive_trippool(k, block))


def test_forced_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    """backend="triton" on CPU tensors needs TRITON_INTERPRET=1; without it Triton failed deep in its driver."""
    from videosparse.veda.teacher import teacher_heat
    from videosparse.veda.trippool import trippool_qk

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 128, 32, dtype=torch.bfloat16)
    for call in (lambda: trippool_qk(q, q, 64, backend="triton"), lambda: teacher_heat(q, q, 64, backend="triton")):
        with pytest.raises(ValueError, match="backend='triton' cannot run .*: the Triton kernels need a CUDA GPU.*cpu"):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernels_equal_torch_at_wan_like_size(dtype):
    from videosparse.veda.teacher import teacher_heat, teacher_heat_torch
    from videosparse.veda.trippool import trippool_qk, trippool_torch

    g = torch.Generator("cuda").manual_seed(0)
    q, k = (torch.randn(1, 4, 32760, 128, device="cuda", generator=g, dtype=dtype) for _ in range(2))
    qf, kf = trippool_qk(q, k, 128)
    torch.testing.assert_close(qf, trippool_torch(q, 128), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kf, trippool_torch(k, 128), rtol=1e-5, atol=1e-5)
    heat = teacher_heat(q, k, 128, num_tiles=255)
    ref = teacher_heat_torch(q, k, 128, num_tiles=255)
    # bf16/fp16 products accumulate in fp32 on both sides, in different order
    torch.testing.assert_close(heat, ref, rtol=2e-2, atol=1e-6)


if __name__ == "__main__":
    _child_main(sys.argv[1:])


def test_teacher_and_trippool_refuse_bad_lse_shapes_and_blocks():
    """Review finds: the torch teacher broadcast an lse of the wrong shape (heat up to 130, promised in [0, 1]) or cut
    a longer one, where the Triton path refuses it; block 0 / negative gave ZeroDivisionError or a num_tiles message."""
    from videosparse.veda.teacher import teacher_heat
    from videosparse.veda.trippool import trippool_qk, trippool_torch

    q = torch.randn(2, 2, 100, 16)
    for lse in (torch.zeros(2, 2, 1), torch.zeros(1, 2, 100), torch.zeros(2, 2, 128)):
        with pytest.raises(ValueError, match=r"lse has shape .*; expected \(2, 2, 100\)"):
            teacher_heat(q, q, 32, lse=lse, backend="torch")
    for block in (0, -16, 2.5):
        with pytest.raises(ValueError, match=f"block={block} must be a positive int"):
            teacher_heat(q, q, block, backend="torch")
        with pytest.raises(ValueError, match=f"block={block} must be a positive int"):
            trippool_qk(q, q, block, backend="torch")
        with pytest.raises(ValueError, match=f"block={block} must be a positive int"):
            trippool_torch(q, block)
    # Mutation finds: a bool block is no tile size (True == 1 gave 1-token tiles), and num_tiles outside
    # [1, ceil(S / block)] is refused (more than there are silently gave them all, 0 an empty tensor)
    with pytest.raises(ValueError, match="block=True must be a positive int"):
        trippool_torch(q, True)
    with pytest.raises(ValueError, match="block=True must be a positive int"):
        teacher_heat(q, q, True, backend="torch")
    for n in (0, 3, -1):
        with pytest.raises(ValueError, match=rf"num_tiles={n} must lie in \[1, 2\] for S=100, block=64"):
            trippool_torch(q, 64, n)
