"""The checks a run makes before any work (`videosparse._run_checks`): the seed's bounds, the devices refused by name,
and the output paths written in place (a stream, a FIFO)."""

import os
import re

import pytest
import torch

from videosparse._run_checks import SEED_RANGE, check_device, check_output, check_seed


def test_seeds_are_taken_up_to_both_ends_of_the_range_torch_generators_take():
    """The bounds are torch's own: the extreme seeds seed a generator, one past either end is refused by name."""
    low, high = -(2 ** 63), 2 ** 64 - 1
    assert SEED_RANGE == (low, high)
    for seed in (low, -1, 0, high):
        check_seed("--seed", seed)
        torch.Generator().manual_seed(seed)             # (what the check stands for: torch takes it)
    for seed in (low - 1, high + 1):
        with pytest.raises(ValueError, match=rf"^--seed {seed} is out of the range torch's generators take "
                                             rf"\[{low}, {high}\]\.$"):
            check_seed("--seed", seed)


def test_a_cuda_device_without_a_gpu_and_the_meta_device_are_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        with pytest.raises(ValueError, match=r"torch sees no CUDA GPU here; use 'cpu'\.$"):
            check_device(device)
    with pytest.raises(ValueError, match=r"^device='meta' holds no data; use 'cuda' or 'cpu'\.$"):
        check_device("meta")
    check_device("cpu")
    check_device(None)


def test_the_process_stdout_and_stderr_are_outputs_even_when_they_are_pipes():
    """`--json /proc/self/fd/1` is written through sys.stdout (`_io.STANDARD_STREAMS`), whatever fd 1 is: a pipe's
    /proc link names no file, and no file can be made in /proc/self/fd, yet the path is writable."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc")
    read_end, write_end = os.pipe()
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        for path in ("/proc/self/fd/1", "/proc/self/fd/2", "/dev/fd/1", "/dev/stdout", "/dev/stderr"):
            check_output("--json", path)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, read_end, write_end):
            os.close(fd)
    with pytest.raises(ValueError, match="cannot be written: no file can be made in '/proc/self/fd'"):
        check_output("--json", "/proc/self/fd/s.json")     # (the folder itself takes no new file)


def test_a_fifo_that_may_not_be_written_is_named_before_the_run(tmp_path, monkeypatch):
    """A FIFO (or a device) is written in place, so only its write permission counts. As root every path is
    writable, so the permission is faked for this one path."""
    fifo = str(tmp_path / "out.fifo")
    os.mkfifo(fifo)
    check_output("--out", fifo)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, *a, **k: False if os.fspath(path) == fifo
                        else real_access(path, mode, *a, **k))
    with pytest.raises(ValueError, match="^" + re.escape(f"--out {fifo!r} cannot be written (no write permission).")):
        check_output("--out", fifo)

