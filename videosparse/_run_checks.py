"""Checks of a run's settings before any work starts, shared by the command line, the evaluation and the
distillation: the seed, the device, and whether files can be made in a folder. Imports nothing from the rest of the
package (torch only when a device is checked).
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
