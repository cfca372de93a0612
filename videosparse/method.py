"""The interface between the processors and a tile-selection method (Veda, Sol, ...).

A `SparseMethod` is made once per `videosparse.apply` for one transformer and one config. The
processors hand it q, k, v already in tile order and ask for a `Plan`; it may keep per-layer caches
(calibrated thresholds, loaded estimator weights). It never sees diffusers objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .config import DEFAULT_TILES
from .layout import HeadTiling
from .plan import Plan


@dataclass(frozen=True)
class ModelInfo:
    """What a method may need to know about the transformer it serves."""

    model_class: str
    num_layers: int
    num_heads: int
    head_dim: int
    patch_size: tuple[int, int, int]
    text_position: str | None = None        # "before"/"after" for joint attention, None otherwise


class SparseMethod:
    """Base class: per-layer tile shapes and plan building for one config.

    Args:
        config: the method's config (e.g. `VedaConfig`).
        info: the `ModelInfo` of the transformer.
    """

    def __init__(self, config, info: ModelInfo) -> None:
        self.config = config
        self.info = info
        # per-layer state a method may keep (Sol's calibrated thresholds); each processor hands its
        # layer's dict to `plan` as `state`, so compiled code never looks it up by the layer index
        self.layer_states: dict[int, dict] = {}

    def layer_state(self, layer: int) -> dict:
        """The state dict of `layer` (made on first request)."""
        return self.layer_states.setdefault(layer, {})

    def prepare(self, device: torch.device | str) -> None:
        """Called eagerly (outside compiled graphs) before the first forward on `device` and when the
        grid or device changes: move weights, fill `layer_states`. The base method does nothing."""

    def release(self) -> None:
        """Free the device memory `prepare` took (the session is removed); a later call may `prepare` again. The base
        method holds none."""

    def on_layout(self, layer: int, layout: HeadTiling) -> None:
        """Called eagerly for every layer's new tile layout (a new grid); e.g. to warn about it. Does nothing here."""

    def head_state(self, layer: int, state: dict, heads: slice, group=None) -> dict:
        """`state` for a call over heads `heads` of `layer` only (one rank's heads under Ulysses context
        parallelism; `group`: the process group whose ranks hold the other heads); methods with per-head state
        (Veda's estimator) slice it, methods with state shared by all heads (Sol's threshold) reach the other
        ranks through `group`. The base returns `state`."""
        return state

    @property
    def block(self) -> int:
        return self.config.block

    def tile_shapes(self, layer: int, num_heads: int) -> tuple[int, int, int] | Sequence[tuple[int, int, int]]:
        """One (pt, ph, pw) for every head of `layer`, or one per head: the config's `tiling`, the block's default where
        it is None (what `SolConfig.tile_shape` gives)."""
        return self.config.tiling if self.config.tiling is not None else DEFAULT_TILES[self.block]

    def plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: HeadTiling, layer: int,
             state: dict | None = None, valid_keys: torch.Tensor | None = None,
             skip_padded_queries: bool = False) -> Plan:
        """The plan for one call.

        Args:
            q, k, v: [B, H, S, D] in tile order (each head in its own tile shape), contiguous.
            layout: the `HeadTiling` used to gather them (num_tiles, num_video_tiles, tile_len).
            layer: index of the self-attention layer (0-based).
            state: `layer_state(layer)`, passed by the processors (None: looked up from `layer`).
            valid_keys, skip_padded_queries: the key padding the caller applies to the plan afterwards
                (`Plan.with_valid_keys`), for a method whose target density counts the tiles computed (Sol's).
        """
        raise NotImplementedError

    def stats(self) -> dict:
        """Method-specific statistics for reports (e.g. calibrated thresholds); may sync the host."""
        return {}
