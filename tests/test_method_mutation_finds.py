"""Tests from a mutation pass over the Sol and Veda methods (`videosparse/sol/method.py`, `videosparse/veda/method.py`):
the density-floor warnings' boundaries and keys, the padded-key tile rounding of a Sol calibration and `release`."""

import logging

import torch

from videosparse import SolConfig, VedaConfig
from videosparse.layout import head_tiling
from videosparse.method import ModelInfo
from videosparse.sol.method import SolMethod
from videosparse.veda.estimator import VedaEstimator
from videosparse.veda.method import VedaMethod

INFO = ModelInfo("WanTransformer3DModel", 2, 2, 64, (1, 2, 2))


def _sol_warnings(caplog, density, text_len):
    layout = head_tiling((4, 4, 16), (1, 4, 16), 2, block=64, text_len=text_len)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="videosparse.sol.method"):
        SolMethod(SolConfig(block=64, density=density, tiling=(1, 4, 16)), INFO).on_layout(0, layout)
    return [r.getMessage() for r in caplog.records if "below the density" in r.getMessage()]


def test_sol_floor_warning_is_strict_and_counts_the_global_tiles(caplog):
    """Mutation find: a target equal to the forced density (4 video tiles, band 1: 10/16) is reachable, no warning
    (`>=` survived); with 2 text tiles the forced pairs are 30/36, so 0.5 warns (the floor without the global tiles,
    10/36, survived: the Sol warning test had no text tiles)."""
    assert _sol_warnings(caplog, 0.625, 0) == []
    warned = _sol_warnings(caplog, 0.5, 128)
    assert len(warned) == 1 and "2 global tiles of 6) 0.833" in warned[0], warned


def test_sol_calibration_counts_a_partly_valid_key_tile_as_computed():
    """Mutation find: `valid_keys` is rounded up to key tiles (a tile holding one valid key is computed); rounding
    down survived. 6 valid keys in the last of 2 text tiles calibrate as all keys valid."""
    layout = head_tiling((4, 4, 16), (1, 4, 16), 2, block=64, text_len=128)         # 4 video + 2 text tiles
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, layout.seq_len, 64) for _ in range(3))
    results = []
    for valid in (layout.seq_len, layout.seq_len - 58):
        method = SolMethod(SolConfig(block=64, density=0.6, tiling=(1, 4, 16)), INFO)
        method.plan(q, k, v, layout, 0, valid_keys=torch.tensor([valid]))
        results.append(list(method.calibrations().values()))
    assert results[0] == results[1], results


def test_sol_release_drops_the_density_tensors():
    """Mutation find: `release` must drop the cached density tensors (device memory); a no-op release survived."""
    method = SolMethod(SolConfig(block=64, density=0.5), INFO)
    method.prepare("cpu")
    assert method._density_tensors
    method.release()
    assert method._density_tensors == {}


def _veda_warnings(caplog, density, layouts):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        method = VedaMethod(VedaConfig(density=density, block=64), INFO)
        for layout in layouts:
            method.on_layout(0, layout)
    return [r.getMessage() for r in caplog.records if "cannot be lower" in r.getMessage()]


def test_veda_floor_warning_boundaries(caplog):
    """Mutation find: 4 video tiles, no text: one tile per row is a floor of 0.25. At 0.2 that is exactly 1.25x the
    target: no warning (`>=` survived); at 0.19 it is 1.32x: a warning (a 1.5x factor survived)."""
    layout = head_tiling((4, 4, 16), (1, 4, 16), 2, block=64)
    assert _veda_warnings(caplog, 0.2, [layout]) == []
    warned = _veda_warnings(caplog, 0.19, [layout])
    assert len(warned) == 1 and "gives 0.250" in warned[0], warned


def test_veda_floor_warning_is_once_per_video_and_global_tile_count(caplog):
    """Mutation find: the warning is once per (video tiles, global tiles); keyed by the video tile count alone (the
    Veda test changed both counts together) survived. Same 4 video tiles with 2, then 1 text tile: two warnings."""
    layouts = [head_tiling((4, 4, 16), (1, 4, 16), 2, block=64, text_len=t) for t in (128, 64, 128)]
    warned = _veda_warnings(caplog, 0.05, layouts)
    assert len(warned) == 2 and "2 global tiles" in warned[0] and "1 global tile " in warned[1], warned


def test_veda_release_and_head_state_weights():
    """Mutation find: `release` pops every layer's device weights (a `get` in place of the `pop` survived), and
    `head_state` hands a rank only its heads' weights (the unsliced weights survived)."""
    torch.manual_seed(0)
    est = VedaEstimator("WanTransformer3DModel", 2, 2, 64, block=64, init_std=1.0)
    method = VedaMethod(VedaConfig(density=0.5, block=64, estimator=est), INFO)
    method.prepare("cpu")
    proj_q, proj_k = method.head_state(1, method.layer_state(1), slice(1, 2))["weights"]
    assert proj_q.shape[0] == proj_k.shape[0] == 1
    assert torch.equal(proj_q, method.estimator.proj_q[1][1:2])
    assert torch.equal(proj_k, method.estimator.proj_k[1][1:2])
    assert all("weights" in method.layer_state(layer) for layer in range(2))
    method.release()
    assert not any("weights" in method.layer_state(layer) for layer in range(2))
