"""The shared value checks (`videosparse.validation`), and the places where their copies used to disagree."""

import argparse

import numpy as np
import pytest
import torch

from videosparse.config import SolConfig, VedaConfig
from videosparse.validation import bool_word, check_finite, check_tile, int_at_least, int_triple, one_per_head


def test_tile_shapes_take_any_integer_type_and_name_what_is_wrong():
    assert check_tile((np.int64(4), torch.tensor(4), 8), 128) == (4, 4, 8)
    assert all(type(v) is int for v in check_tile(np.array([8, 4, 4]), 128))
    for bad in ((4, 4), (4.0, 4, 8), (True, 4, 32), "448", {4, 8, 2}, None, (0, 4, 32)):
        with pytest.raises(ValueError, match="must be three positive ints"):
            check_tile(bad, 128)
    with pytest.raises(ValueError, match=r"^tile=\(4, 4, 4\) has pt\*ph\*pw = 64, but the block size is 128: .*=128\.$"):
        check_tile((4, 4, 4), 128, "tile")
    assert int_triple(b"\x04\x04\x08") is None


def test_config_tiling_takes_torch_integers_as_the_layouts_do():
    """The configs' tile check took only ints and numpy ints, the layouts' also 0-dim torch ints; the shared one
    takes all three (stored as Python ints)."""
    cfg = VedaConfig(tiling=(torch.tensor(4), 4, np.int32(8)))
    assert cfg.tiling == (4, 4, 8) and all(type(v) is int for v in cfg.tiling)
    assert SolConfig(density=0.1, tiling=(torch.tensor(8), 4, 4)).tiling == (8, 4, 4)


def test_one_shape_or_one_per_head():
    """`VedaMethod.head_shapes` and the distillation's per-head list took only Python ints as one shape (a numpy
    shape fell into the per-head branch and failed); all now share `one_per_head`."""
    assert one_per_head((4, 4, 8), 2) == [(4, 4, 8)] * 2
    assert one_per_head(np.array([4, 4, 8]), 2) == [(4, 4, 8)] * 2
    assert one_per_head([(4, 4, 8), [8, 4, 4], (4, 8, 4)], 3) == [(4, 4, 8), (8, 4, 4), (4, 8, 4)]
    assert one_per_head([(4, 4, 8), "x"], 2) == [(4, 4, 8), "x"]        # left for the caller's check to name
    with pytest.raises(ValueError, match="tiling names 2 tile shapes but the layer has 3 heads"):
        one_per_head([(4, 4, 8), (8, 4, 4)], 3)


def test_int_and_finite_checks_name_the_field_and_the_bound():
    assert int_at_least(np.int64(3), 1, "epochs") == 3
    with pytest.raises(ValueError, match=r"^epochs=0 must be an int >= 1\.$"):
        int_at_least(0, 1, "epochs")
    with pytest.raises(ValueError, match=r"^groups=1.5 must be an int >= 1 \(heads\)\.$"):
        int_at_least(1.5, 1, "groups", "heads")
    with pytest.raises(ValueError, match=r"^tau=inf must be a finite number within the float range \(sds\)\.$"):
        check_finite("tau", float("inf"), what="sds")
    with pytest.raises(ValueError, match=r"^lr=0 must be a finite number > 0 or None\.$"):
        check_finite("lr", 0, 0.0, strict=True, optional=True)


def test_bool_words_are_one_set():
    """Method specs took on/off besides true/false, yes/no, 1/0; the distill flags did not. Both take all now."""
    from videosparse.cli.config_args import add_config_arguments, config_from_namespace
    from videosparse.distill.config import DistillConfig
    from videosparse.eval.spec import parse_method_spec

    assert [bool_word(w) for w in ("on", " OFF ", "True", "no", "1")] == [True, False, True, False, True]
    with pytest.raises(ValueError, match="'maybe' is not a bool; use true or false"):
        bool_word("maybe")
    assert parse_method_spec("sol@0.2:correction=no").config.correction is False
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, DistillConfig)
    assert config_from_namespace(parser.parse_args(["--resume", "off"]), DistillConfig).resume is False
    assert config_from_namespace(parser.parse_args(["--resume", "On"]), DistillConfig).resume is True


def test_distill_configs_take_numpy_ints_as_plain_ints(tmp_path):
    """The distill configs' int check refused numpy ints (the method configs took them); both take them now, stored
    as Python ints so that the config still saves as JSON."""
    from videosparse.distill.config import DistillConfig

    cfg = DistillConfig(output_dir=str(tmp_path / "run"), epochs=np.int64(3), max_steps=np.int32(5), seed=np.int64(2))
    assert (cfg.epochs, cfg.max_steps, cfg.seed) == (3, 5, 2) and type(cfg.epochs) is int
    cfg.save(tmp_path / "c.json")
    assert DistillConfig.load(tmp_path / "c.json") == cfg
