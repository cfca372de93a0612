"""Checks of a run's settings before any work starts, shared by the command line, the evaluation and the
distillation: the seed, the device, whether files can be made in a folder, and whether an output path can be written.
Imports nothing from the rest of the package but `_io` (torch only when a device is checked).
"""

from __future__ import annotations

import os
from typing import Any


# the seeds torch's generators take
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)


def check_seed(flag: str, seed: int) -> None:
    """ValueError for a seed torch.Generator.manual_seed cannot take."""
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(f"{flag} {seed} is out of the range torch's generators take [{SEED_RANGE[0]}, "
                         f"{SEED_RANGE[1]}].")


def cannot_make_files_in(folder: str | os.PathLike) -> str | None:
    """Why no file can be made in the existing folder `folder` (read-only, not ours, /proc), or None: a throwaway
    file is made and removed, since os.access says yes to root there."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as err:
        return str(err.strerror or err)


def check_device(device: Any) -> None:
    """ValueError unless `device` is None or a torch device this machine has (cuda needs a GPU)."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a torch device; use 'cuda', 'cuda:1' or 'cpu'.") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: torch sees no CUDA GPU here; use 'cpu'.")
    if dev.type == "meta":
        raise ValueError(f"device={device!r} holds no data; use 'cuda' or 'cpu'.")
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError, ImportError) as err:
        reason = str(err).splitlines()[0].split(". ")[0][:160]
        raise ValueError(f"device={device!r} is not usable here ({reason}); use 'cpu'.") from None


def check_output(flag: str, path: Any, *, folder: bool = False, parents: bool = False, writable: bool = True) -> None:
    """ValueError naming `flag`, before any work, when the output `path` (a file; with `folder`, a directory made
    with its parents when missing) cannot be written: not a path, an empty path, a directory given for a file (or a
    path ending in a separator) or a file for a folder, a file's folder missing, a part of the path that is a file,
    or (with `writable`) a folder in which no file can be made (read-only, not ours, /proc). An existing file that
    is no regular file (a FIFO, /dev/null) is written in place: it only has to be writable. `parents`: a file's
    missing folders are made with it (where they can be).

    `flag` is a command-line flag ("--out": errors read "--out 'x.mp4' ...") or a config field ending in "="
    ("output=": errors read "output='x.json' ..."). The configs check at construction with `writable=False` (what
    the path says, without making a file), their runs check again in full."""
    field = flag.endswith("=")

    def named(value) -> str:
        return f"{flag}{value!r}" if field else f"{flag} {value!r}"

    what = "directory" if folder else "file"
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{named(path)} must be a {what} path.")
    path = os.fspath(path)
    if not path:
        raise ValueError(f"{named(path) if field else flag} is empty; give a {what} path.")
    if folder and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{named(path)} is a file; give a directory (made when missing).")
    if not folder and os.path.isdir(path):
        raise ValueError(f"{named(path)} is a directory; give a file path.")
    if not folder and path.endswith(("/", os.sep)):
        raise ValueError(f"{named(path)} ends with a path separator; give a file path.")
    from ._io import STANDARD_STREAMS, writes_in_place

    if not folder and path in STANDARD_STREAMS:     # written through sys.stdout / sys.stderr (a pipe too)
        return
    if not folder and writes_in_place(path):        # a FIFO, a device, /dev/stdout
        if writable and not os.access(path, os.W_OK):
            raise ValueError(f"{named(path)} cannot be written (no write permission).")
        return
    home = existing = path if folder else os.path.dirname(path) or "."
    while not os.path.exists(existing):                 # the nearest part of the path that is there, as spelt
        existing = os.path.dirname(existing) or "."
    if not os.path.isdir(existing):
        raise ValueError(f"{named(path)} cannot be written: {existing!r} is a file, not a folder.")
    if not folder and existing != home and not parents:
        raise ValueError(f"{named(path)}: the folder {home!r} does not exist.")
    why = cannot_make_files_in(existing) if writable else None
    if why is not None:
        raise ValueError(f"{named(path)} cannot be written: no file can be made in {existing!r} ({why}).")
