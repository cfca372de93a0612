"""Autograd helpers the layers below the kernels need as well (the layouts and RoPE use `carries_tangent` to pick
their torch paths): kept apart from `videosparse.kernels` so that importing those layers loads no kernel module.
Imports only torch.
"""

from __future__ import annotations

import torch


def carries_tangent(*tensors) -> bool:
    """Whether forward-mode AD (`torch.autograd.forward_ad`, a JVP) carries a tangent on any of `tensors` (None
    skipped). The kernels, their custom ops and the layouts' fast paths drop tangents: such calls take the torch
    paths, which carry them. While torch.compile traces, where tangents cannot be looked at, any open dual level
    counts (Dynamo guards on the level). Cheap when no dual level is open (the usual case)."""
    from torch.autograd import forward_ad

    if forward_ad._current_level < 0:
        return False
    if torch.compiler.is_compiling():
        return True
    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)
