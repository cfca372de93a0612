"""Edges of the configs' field checks (`videosparse.config`): a float dense_steps of 0.0, and a tiling of a type no
tile shape or path has."""

import pytest

from videosparse.config import SolConfig, VedaConfig, config_from_dict


def test_a_dense_steps_fraction_of_zero_runs_no_step_dense():
    for cfg in (VedaConfig(dense_steps=0.0), SolConfig(density=0.1, dense_steps=0.0)):
        assert cfg.dense_steps == 0.0 and isinstance(cfg.dense_steps, float)
        assert cfg.dense_step_count(50) == 0 and cfg.dense_step_count(None) == 0
        assert config_from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("tiling", [12.5, 4, b"4x4x8", {"tiles": (4, 4, 8)}])
def test_a_tiling_that_is_neither_a_shape_nor_a_path_is_a_type_error_naming_it(tiling):
    with pytest.raises(TypeError, match=r"^tiling=.* must be a tile shape \(pt, ph, pw\) or a path to a tiling JSON\.$"):
        VedaConfig(tiling=tiling)
