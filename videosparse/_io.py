"""File IO shared by every layer: strict-JSON conversion and atomic, durable writes.

`to_jsonable` / `from_jsonable` store non-finite floats as "inf" / "-inf" / "nan" (strict JSON); `write_atomic` and
`replace_durably` publish a file only once its bytes are on the disk, so a stopped write leaves the old file whole.
Imports nothing from the rest of the package.
"""

from __future__ import annotations

import math
import os
import stat
import sys
from typing import Any

import numpy as np
import torch

_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def to_jsonable(obj: Any) -> Any:
    """A JSON-safe copy: non-finite floats -> "inf"/"-inf"/"nan", tensors and numpy values -> Python."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return to_jsonable(obj.detach().cpu().tolist())
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, (np.floating, np.integer, np.bool_)):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def from_jsonable(obj: Any) -> Any:
    """Inverse of `to_jsonable` for the non-finite floats."""
    if isinstance(obj, dict):
        return {k: from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    if isinstance(obj, str) and obj in _NONFINITE:
        return _NONFINITE[obj]
    return obj


_FILE_FLAGS = os.O_RDWR if os.name == "nt" else os.O_RDONLY     # Windows fsyncs only a descriptor open for writing


def sync_to_disk(path: str | os.PathLike) -> None:
    """fsync a file, or every file under a folder and the folders themselves, so that their bytes are on the disk
    before a rename publishes them (`replace_durably`). A folder whose file system takes no fsync is skipped."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        _fsync(path, _FILE_FLAGS)
        return
    for root, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(root, name), _FILE_FLAGS)
        _fsync(root, os.O_RDONLY, folder=True)


def _fsync(path: str, flags: int, folder: bool = False) -> None:
    """fsync `path`; for a folder best-effort (some file systems refuse fsync on one, EINVAL, and a folder that may
    be written but not listed, or any folder on Windows, cannot be opened): its files are what must reach the disk,
    and a rename already done is not reported as a failed write."""
    try:
        fd = os.open(path, flags)
    except OSError:
        if folder:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not folder:
            raise
    finally:
        os.close(fd)


def chmod_by_umask(path: str | os.PathLike) -> None:
    """Give `path` the mode a plain `open(path, "w")` would (0o666 less the umask): safetensors creates its files
    owner-only (0o600), which a shared serving account could not read."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask: read from /proc where Linux shows it (setting it to read it back would, for an instant,
    give another thread's new files mode 0o666), else set and restored."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def replace_durably(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """`os.replace(src, dst)` for a file or folder just written: its bytes are synced first and the rename itself
    after (its folder synced), so a power loss leaves the old `dst` or the whole new one, never an empty or partial
    file under the final name (a rename alone may reach the disk before the data)."""
    sync_to_disk(src)
    os.replace(src, dst)
    _fsync(os.path.dirname(os.path.abspath(os.fspath(dst))), os.O_RDONLY, folder=True)


# the paths that name this process's stdout / stderr (`write_atomic` writes them through sys.stdout / sys.stderr)
STANDARD_STREAMS = {f"{prefix}{fd}": name for fd, name in ((1, "stdout"), (2, "stderr"))
                     for prefix in ("/dev/fd/", "/proc/self/fd/")} | {"/dev/stdout": "stdout", "/dev/stderr": "stderr"}


def writes_in_place(path: str | os.PathLike) -> bool:
    """Whether `write_atomic` writes into `path` as it is rather than renaming a new file over it: an existing path
    that is no regular file (a FIFO, a character device like /dev/null), or one under /dev or /proc, which names a
    stream the process holds open (/dev/stdout, /proc/self/fd/1: a rename over the file a shell redirected stdout to
    would leave the shell writing to an unlinked one)."""
    shown = os.fspath(path)
    try:            # (stat, not realpath: /dev/fd/N of a pipe resolves to "pipe:[inode]", which names no path)
        mode = os.stat(shown).st_mode
    except (OSError, ValueError):
        return False
    return not stat.S_ISDIR(mode) and (not stat.S_ISREG(mode) or os.path.abspath(shown).startswith(("/dev/", "/proc/")))


def write_atomic(path: str | os.PathLike, text: str | bytes) -> None:
    """Write `text` (or bytes) to `path` atomically: into a hidden temporary file beside it, then renamed over it,
    so that a write stopped half-way leaves the old file whole; the temporary file goes when anything fails, and an
    OSError names `path`. Where `writes_in_place(path)` (a FIFO, /dev/null, /dev/stdout) it is written directly; a
    symlink is not replaced: its target is written."""
    shown = os.fspath(path)
    stream = STANDARD_STREAMS.get(shown)
    if stream is not None:          # through Python's stream: a reopened /dev/stdout would write at its own offset
        stream = getattr(sys, stream)
        stream.flush()
        if isinstance(text, bytes):
            stream.buffer.write(text)
        else:
            stream.write(text)
        stream.flush()
        return
    special = writes_in_place(shown)
    path = shown if special else os.path.realpath(shown)
    folder, name = os.path.split(path)
    tmp = path if special else os.path.join(folder, f".{name}.tmp")
    try:
        if os.path.isdir(path):
            raise IsADirectoryError("it is a directory")
        with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        if not special:
            replace_durably(tmp, path)
    except OSError as err:
        raise OSError(f"{shown!r} could not be written: {err.strerror or err}") from err
    finally:
        if not special and os.path.exists(tmp):
            os.remove(tmp)
