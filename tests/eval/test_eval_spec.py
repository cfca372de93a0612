"""Method-spec syntax: every form maps onto the config it names; bad specs name what is wrong."""

import pytest

from videosparse.config import DenseConfig, SolConfig, VedaConfig
from videosparse.eval.spec import parse_method_spec, parse_method_specs


@pytest.mark.parametrize("text, config", [
    ("dense", DenseConfig()),
    ("veda@0.5", VedaConfig(density=0.5)),
    ("veda", VedaConfig(density=0.1)),
    ("veda@0.1:dense_steps=0.2", VedaConfig(density=0.1, dense_steps=0.2)),
    ("veda@0.1:dense_steps=3:dense_layers=0,29", VedaConfig(density=0.1, dense_steps=3, dense_layers=(0, 29))),
    ("veda@0.1:dense_steps=1e-1", VedaConfig(density=0.1, dense_steps=0.1)),
    ("veda@0.1:tiling=8x4x4:correction=on", VedaConfig(density=0.1, tiling=(8, 4, 4), correction=True)),
    ("veda@0.2:block=64:tiling=1x8x8", VedaConfig(density=0.2, block=64, tiling=(1, 8, 8))),
    ("sol@0.5", SolConfig(density=0.5)),
    ("sol", SolConfig(density=0.15)),
    ("sol:tau=1.5", SolConfig(tau=1.5)),
    ("sol@0.15:band=0:correction=off", SolConfig(density=0.15, band=0, correction=False)),
    (" sol @0.3 ", SolConfig(density=0.3)),
])
def test_specs_map_onto_configs(text, config):
    spec = parse_method_spec(text)
    assert spec.config == config
    assert spec.label == "".join(text.split())


def test_backend_default_applies_only_where_unset():
    assert parse_method_spec("veda@0.1", backend="reference").config.backend == "reference"
    assert parse_method_spec("veda@0.1:backend=auto", backend="reference").config.backend == "auto"
    assert parse_method_spec("dense", backend="reference").config == DenseConfig()


@pytest.mark.parametrize("text, match", [
    ("", "malformed"),
    ("flash@0.1", "method 'flash' is not known"),
    ("veda@2", "density=2.0"),
    ("veda@x", r"density='x' is not a valid value for density: a number in \(0, 1\]"),
    ("veda@0.1:foo=1", "no field 'foo'"),
    ("veda@0.1:dense_steps", "KEY=VALUE"),
    ("veda@0.1:correction=maybe", "correction='maybe' is not a valid value for correction: one of on/true/"),
    ("veda@0.1:dense_steps=x", r"int count \(e.g. 4\) or a float fraction"),
    ("veda@0.1:dense_layers=a,b", "comma-separated layer indices"),
    ("veda@0.1:tiling=4x4x4", "pt\\*ph\\*pw = 64"),
    ("dense@0.5", "takes no density"),
    ("sol@0.1:tau=1.0", "exactly one of density or tau"),
    ("veda@0.1:density=0.2", "given twice"),
])
def test_bad_specs_raise_naming_the_problem(text, match):
    with pytest.raises(ValueError, match=match):
        parse_method_spec(text)


def test_grid_puts_dense_first_and_rejects_duplicates():
    specs = parse_method_specs(["veda@0.5", "sol@0.5"])
    assert [s.label for s in specs] == ["dense", "veda@0.5", "sol@0.5"]
    specs = parse_method_specs(["sol@0.5", "dense"])
    assert [s.label for s in specs] == ["dense", "sol@0.5"]
    with pytest.raises(ValueError, match="same config"):
        parse_method_specs(["veda@0.5", "veda@0.50"])


def test_family_and_density():
    s = parse_method_spec("veda@0.1:dense_steps=0.2")
    assert s.family == "veda:dense_steps=0.2" and s.density == 0.1
    assert parse_method_spec("dense").density == 1.0
    assert parse_method_spec("sol@0.3").family == "sol"
    # one family however the spec is spelled (the density as a field, the other fields in any order)
    assert {parse_method_spec(t).family for t in ("veda@0.1:block=64:dense_steps=0", "veda:density=0.3:block=64:"
                                                  "dense_steps=0", "veda@0.2:dense_steps=0:block=64")} == \
        {"veda:block=64:dense_steps=0"}


def test_blanks_inside_a_value_stay():
    """Review find: every blank was dropped, so `estimator=/tmp/my est` named /tmp/myest; blanks around the
    separators still go."""
    spec = parse_method_spec(" veda @ 0.1 : block = 64 : estimator = /tmp/my est ")
    assert spec.label == "veda@0.1:block=64:estimator=/tmp/my est"
    assert spec.config.estimator == "/tmp/my est" and spec.config.block == 64


def test_a_tile_shape_with_blanks_is_a_shape():
    """Review find: with blanks kept inside values, `tiling=4 x 4 x 8` became a path."""
    assert parse_method_spec("veda@0.1:tiling=4 x 4 x 8").config.tiling == (4, 4, 8)


def test_several_estimators_one_per_transformer(tmp_path, monkeypatch):
    """`estimator=A,B`: one estimator per transformer of a pipeline (Wan 2.2's experts), a tuple in the config; an
    empty entry is refused, naming the form; a folder whose name holds a comma is one estimator (review find), and a
    path split at a comma is named as one of several."""
    from videosparse.eval.spec import check_spec_files

    spec = parse_method_spec("veda@0.1:estimator=runs/high,runs/low")
    assert spec.config.estimator == ("runs/high", "runs/low")
    with pytest.raises(ValueError, match=r"estimator 'runs/high' \(of the estimators, one per transformer, that "
                                         r"the commas separate\)"):
        check_spec_files([spec])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "d0.1,lr1e-3").mkdir(parents=True)
    assert parse_method_spec("veda@0.1:estimator=runs/d0.1,lr1e-3").config.estimator == "runs/d0.1,lr1e-3"
    assert parse_method_spec("veda@0.1:estimator=runs/high").config.estimator == "runs/high"
    for text in ("veda:estimator=runs/high,", "veda:estimator=a,,b"):
        with pytest.raises(ValueError, match="several separated by single commas"):
            parse_method_spec(text)


@pytest.mark.parametrize("word, value", [("on", True), ("true", True), ("yes", True), ("1", True), ("YES", True),
                                         ("off", False), ("false", False), ("no", False), ("0", False)])
def test_every_spelling_of_a_switch_maps_to_its_value(word, value):
    """Mutation find: `correction=yes` was read as off and no test noticed; every spelling the error message
    offers maps onto the value it names."""
    assert parse_method_spec(f"veda@0.1:correction={word}").config.correction is value
    assert parse_method_spec(f"sol@0.1:correction={word}").config.correction is value


def test_a_tau_only_sol_spec_has_no_nominal_density():
    """Mutation find: a Sol spec with a fixed tau and no density reported 1.0, which plots it at dense's density;
    it has none and reports nan (a Sol spec with a density still reports it)."""
    import math

    assert math.isnan(parse_method_spec("sol:tau=1.5").density)
    assert parse_method_spec("sol@0.3").density == 0.3
