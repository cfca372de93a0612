import subprocess
import sys

import pytest
import torch

from videosparse.config import DenseConfig, SolConfig, VedaConfig, config_from_dict


@pytest.mark.parametrize("cfg", [DenseConfig(), VedaConfig(density=0.2, tiling=(8, 4, 4), dense_layers=(0, 3)),
                                 SolConfig(density=0.15), SolConfig(tau=1.5, block=128, correction=False),
                                 VedaConfig(dense_steps=0.2, correction=True)])
def test_round_trip(cfg):
    d = cfg.to_dict()
    assert d["method"] == cfg.method and d["version"] == 1
    assert config_from_dict(d) == cfg


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: VedaConfig(density=0.0), "density=0.0"),
        (lambda: VedaConfig(density=1.5), r"\(0, 1\]"),
        (lambda: VedaConfig(tiling=(4, 4, 4)), "block size is 128"),
        (lambda: VedaConfig(block=96), "block=96"),
        (lambda: VedaConfig(block=128.0), r"block=128.0 .* ints \(64, 128\)"),
        (lambda: SolConfig(density=0.3, block=64.0), "block=64.0"),
        (lambda: VedaConfig(dense_steps=-1), "dense_steps=-1"),
        (lambda: VedaConfig(dense_steps=1.5), "dense_steps=1.5"),
        # 1.0 as a fraction would be every step: refused, the int 1 is one step (mutation testing: `<=` survived)
        (lambda: VedaConfig(dense_steps=1.0), r"dense_steps=1.0 as a float .* \[0, 1\); pass an int"),
        (lambda: VedaConfig(dense_layers=(-2,)), "dense_layers"),
        (lambda: VedaConfig(backend="cuda"), "backend='cuda'"),
        (lambda: SolConfig(), "exactly one of density or tau"),
        (lambda: SolConfig(density=0.1, tau=1.0), "exactly one"),
        (lambda: SolConfig(tau=1.0, band=-1), "band=-1"),
        (lambda: config_from_dict({"method": "magic"}), "method='magic'"),
        (lambda: config_from_dict({"method": "veda", "bogus": 1}), "bogus"),
        (lambda: config_from_dict({"method": "veda", "version": "1"}), "version='1'"),
        (lambda: config_from_dict({"method": "veda", "version": 99}), "config version 99 is newer than this"),
        (lambda: VedaConfig(dense_layers=3), "dense_layers=3"),
        (lambda: VedaConfig(dense_layers=None), "dense_layers=None"),
        (lambda: VedaConfig(dense_layers={0: 1}), r"dense_layers=\{0: 1\}"),
        (lambda: VedaConfig(dense_layers=torch.tensor(3)), r"dense_layers=tensor\(3\) must be a tuple or list"),
        (lambda: SolConfig(density=0.1, correction=1), "correction=1 must be a bool"),
        (lambda: VedaConfig(tiling=(True, 4, 32)), r"tile shape \(True, 4, 32\)"),
        (lambda: SolConfig(tau=float("nan")), "tau=nan"),
        (lambda: SolConfig(tau=float("inf")), "tau=inf"),
        # ints past the float range: the field's ValueError, not an OverflowError from float()
        (lambda: SolConfig(tau=10**400), r"tau=10{400} must be a finite number"),
        (lambda: SolConfig(tau=-10**400), r"tau=-10{400} must be a finite number"),
        (lambda: SolConfig(density=10**400), r"density=10{400} must be a number in \(0, 1\]"),
        (lambda: VedaConfig(density=10**400), r"density=10{400} must be a number in \(0, 1\]"),
        # a band past int64 overflowed in the first sparse call (the tile index math)
        (lambda: SolConfig(tau=1.0, band=10**20), r"band=10{20} must be an int in \[0, 9223372036854775807\]"),
        (lambda: SolConfig(tau=1.0, band=2**63), r"band=9223372036854775808 must be an int in \[0, "),
        # corrupted dicts: a TypeError or ValueError naming the value and what is allowed
        (lambda: config_from_dict(None), r"config None must be a dict as to_dict\(\) writes it"),
        (lambda: config_from_dict("veda"), r"config 'veda' must be a dict .*\(a str is not\)"),
        (lambda: config_from_dict({"method": ["veda"]}), r"method=\['veda'\] is not known; choose one of"),
        (lambda: config_from_dict({"method": "veda", 1: 2, "x": 3}), r"unknown fields \[1, 'x'\] for VedaConfig"),
    ],
)
def test_bad_values_name_the_value(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_dense_step_count():
    assert VedaConfig(dense_steps=3).dense_step_count(50) == 3
    assert VedaConfig(dense_steps=0.2).dense_step_count(50) == 10
    assert VedaConfig(dense_steps=0.2).dense_step_count(None) == 0
    # the product's float error does not cost a step (0.29 * 100 = 28.999999999999996)
    assert VedaConfig(dense_steps=0.29).dense_step_count(100) == 29
    assert VedaConfig(dense_steps=0.58).dense_step_count(50) == 29
    assert VedaConfig(dense_steps=0.57).dense_step_count(100) == 57
    assert VedaConfig(dense_steps=0.25).dense_step_count(10) == 2


def test_config_backends_are_the_dispatch_names():
    """A config may name any backend the dispatch knows (escape hatch: e.g. "hopper" instead of the Gluon kernel)."""
    from videosparse.config import BACKENDS
    from videosparse.kernels.dispatch import _REGISTRY

    assert set(BACKENDS) == {"auto", "triton"} | set(_REGISTRY)
    assert VedaConfig(backend="hopper").backend == "hopper"
    assert SolConfig(density=0.1, backend="triton_generic").backend == "triton_generic"


def test_numpy_scalars_become_plain_numbers():
    np = pytest.importorskip("numpy")
    cfg = VedaConfig(density=np.float32(0.25), block=np.int64(64), dense_steps=np.int64(2), dense_layers=[np.int64(1)])
    with pytest.raises(TypeError, match=r"dense_layers=array\(3\) must be a tuple or list"):
        VedaConfig(dense_layers=np.array(3))
    d = cfg.to_dict()
    assert (d["density"], d["block"], d["dense_steps"], d["dense_layers"]) == (0.25, 64, 2, [1])
    assert type(d["block"]) is int and type(d["dense_steps"]) is int and type(d["density"]) is float
    assert config_from_dict(d) == cfg
    assert SolConfig(tau=np.float64(1.5), band=np.int32(2)).to_dict()["band"] == 2
    flags = VedaConfig(correction=np.True_), SolConfig(density=0.1, correction=torch.tensor(False))
    assert [type(c.correction) for c in flags] == [bool, bool] and [c.correction for c in flags] == [True, False]


def test_zero_dim_tensors_become_plain_numbers():
    """A 0-dim torch tensor (a density read off a tensor, layer indices from torch.arange) is the number it holds."""
    cfg = VedaConfig(density=torch.tensor(0.25), dense_steps=torch.tensor(2), dense_layers=torch.tensor([3, 1]))
    assert (cfg.density, cfg.dense_steps, cfg.dense_layers) == (0.25, 2, (1, 3))
    assert type(cfg.dense_steps) is int and all(type(v) is int for v in cfg.dense_layers)
    assert SolConfig(tau=torch.tensor(1.5), band=torch.tensor(2), block=torch.tensor(64)).block == 64
    with pytest.raises(ValueError, match="block=128.0"):
        VedaConfig(block=torch.tensor(128.0))


def test_dense_layers_have_one_spelling():
    assert VedaConfig(dense_layers=(3, 0, 3)) == VedaConfig(dense_layers=[0, 3])
    assert SolConfig(density=0.2, dense_layers=(1, 0)).dense_layers == (0, 1)


def test_tile_shapes_may_be_numpy_ints():
    """Integer-like tile sizes are accepted like a numpy density is; bools and floats are not."""
    np = pytest.importorskip("numpy")
    cfg = VedaConfig(tiling=(np.int64(8), np.int32(4), np.int64(4)))
    assert cfg == VedaConfig(tiling=(8, 4, 4)) and all(type(v) is int for v in cfg.tiling)
    assert config_from_dict(cfg.to_dict()) == cfg
    sol = SolConfig(density=0.1, block=np.int64(64), tiling=[np.int16(1), np.int64(8), np.int64(8)])
    assert sol.tiling == (1, 8, 8)
    for bad in [(np.bool_(True), 4, 32), (8.0, 4, 4), (np.float64(8), 4, 4)]:
        with pytest.raises(ValueError, match="three positive ints"):
            VedaConfig(tiling=bad)


def test_a_default_tile_shape_follows_the_block_through_replace():
    """A config that left the tile shape to its default keeps it unset, so `dataclasses.replace` to the other block
    size gives that block's default (it raised about a 4x4x8 the user never set: review 55); a shape given stays."""
    import dataclasses

    for cfg in (SolConfig(density=0.2), VedaConfig(density=0.2)):
        small = dataclasses.replace(cfg, block=64)
        assert small.tiling is None and dataclasses.replace(small, block=128) == cfg
    assert SolConfig(density=0.2).tile_shape == (4, 4, 8) and SolConfig(density=0.2, block=64).tile_shape == (4, 4, 4)
    with pytest.raises(ValueError, match=r"tile shape \(2, 8, 8\) has pt\*ph\*pw = 128"):
        dataclasses.replace(SolConfig(density=0.2, tiling=(2, 8, 8)), block=64)
    # one config, one identity (the review of that change: reports written before it no longer resumed): the
    # default given explicitly, as reports store it, is the default, and to_dict still writes the shape that runs
    assert SolConfig(density=0.2, tiling="4x4x8") == SolConfig(density=0.2)
    assert hash(SolConfig(density=0.2, tiling=(4, 4, 8))) == hash(SolConfig(density=0.2))
    assert SolConfig(density=0.2).to_dict()["tiling"] == [4, 4, 8]
    assert SolConfig(density=0.2, block=64).to_dict()["tiling"] == [4, 4, 4]
    assert config_from_dict(SolConfig(density=0.2).to_dict()) == SolConfig(density=0.2)
    assert config_from_dict(SolConfig(density=0.2, tiling=(2, 8, 8)).to_dict()).tiling == (2, 8, 8)


def test_tile_shapes_may_be_numpy_arrays_or_tensors_and_an_empty_tiling_is_refused_at_once():
    """Review 55: a 1-D array of three ints is the shape (a TypeError before); `tiling=""` failed only at apply as a
    missing file; a tiling search's numpy shape budget is an int."""
    np = pytest.importorskip("numpy")
    from videosparse.veda import TilingSearch

    assert VedaConfig(tiling=np.array([4, 4, 8])) == VedaConfig(tiling=(4, 4, 8))
    assert SolConfig(density=0.1, tiling=torch.tensor([2, 8, 8])).tiling == (2, 8, 8)
    with pytest.raises(ValueError, match="three positive ints"):
        VedaConfig(tiling=np.array([4.0, 4.0, 8.0]))
    for empty in ("", "  "):
        with pytest.raises(ValueError, match="must be a tile shape like 4x4x8, the path of a tiling JSON"):
            VedaConfig(tiling=empty)
    assert TilingSearch(density=0.3, max_shapes_per_layer=np.int64(1)).max_shapes_per_layer == 1


def test_density_is_checked_alike_by_configs_the_tiling_search_and_the_estimator():
    """Review 61: `TilingSearch` and `VedaEstimator` took any real density with checks of their own (a 0-dim
    tensor was refused there, taken by the configs); all three now take numpy and 0-dim torch numbers as floats."""
    np = pytest.importorskip("numpy")
    from videosparse.veda import TilingSearch, VedaEstimator

    def estimator(density):
        return VedaEstimator(num_layers=1, num_heads=2, head_dim=8, model_class="WanTransformer3DModel", density=density)

    for value in (np.float32(0.25), torch.tensor(0.25), np.int64(1)):
        want = float(value)
        assert VedaConfig(density=value).density == want
        assert type(TilingSearch(density=value).density) is float and TilingSearch(density=value).density == want
        assert type(estimator(value).density) is float and estimator(value).density == want
    for bad in (0, 1.5, float("nan"), True, "0.1", torch.tensor([0.1])):
        for make in (lambda d: VedaConfig(density=d), lambda d: TilingSearch(density=d), estimator):
            with pytest.raises(ValueError, match=r"density=.* must be a number in \(0, 1\]"):
                make(bad)
    assert estimator(None).density is None


def test_a_tile_shape_with_the_wrong_number_of_sizes_is_refused_at_once_and_errors_name_the_field(tmp_path,
                                                                                                   monkeypatch):
    """Review 59: VedaConfig(tiling="4x4") was taken as a tiling file's path and failed only at apply ("tiling file
    '4x4' does not exist"); a tile shape's errors did not name the field."""
    for text in ("4x4", "4 x 4 x 8 x 1", "16"):
        with pytest.raises(ValueError, match="must be a tile shape like 4x4x8, the path of a tiling JSON"):
            VedaConfig(tiling=text)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "4x4").write_text("{}")          # a file of that name is a path like any other
    assert VedaConfig(tiling="4x4").tiling == "4x4"
    assert VedaConfig(tiling="tilings/wan.json").tiling == "tilings/wan.json"     # checked at apply
    for cls, extra in ((VedaConfig, {}), (SolConfig, {"density": 0.1})):
        with pytest.raises(ValueError, match=r"^tiling: tile shape \(4, 4, 4\) has pt\*ph\*pw = 64"):
            cls(tiling=(4, 4, 4), **extra)
        with pytest.raises(ValueError, match=r"^tiling: tile shape \(0, 4, 32\) must be three positive ints"):
            cls(tiling=(0, 4, 32), **extra)


def test_the_lazily_imported_api_is_listed_by_dir():
    """Review 55: `apply`, `remove`, ... are imported on first use and were missing from `dir(videosparse)`."""
    import videosparse

    assert {"apply", "remove", "sessions", "observe", "processors", "VedaConfig"} <= set(dir(videosparse))
    # review 59: the docs name VedaEstimator, which only videosparse.veda had; dir() listed the module's importlib
    assert videosparse.VedaEstimator is videosparse.veda.VedaEstimator and "VedaEstimator" in dir(videosparse)
    assert "importlib" not in dir(videosparse)
    # and the subpackages the docs call through the top-level module, in a fresh process (here they are imported)
    code = ("import sys, videosparse; assert 'diffusers' not in sys.modules; "
            "print(videosparse.models.load_reference_pipeline.__name__, videosparse.veda.VedaEstimator.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["load_reference_pipeline", "VedaEstimator"], out.stderr


def test_tile_shapes_may_be_written_as_the_cli_writes_them():
    """"4x4x8" is the shape (4, 4, 8) for both methods, as `--tiling 4x4x8` is; any other string is Veda's tiling
    JSON path; a wrong product is caught at construction either way."""
    assert VedaConfig(tiling="4x4x8") == VedaConfig(tiling=(4, 4, 8))
    assert SolConfig(density=0.2, tiling=" 2X8x8 ").tiling == (2, 8, 8)
    assert VedaConfig(tiling="runs/tiling.json").tiling == "runs/tiling.json"
    assert VedaConfig(tiling="²x4x8").tiling == "²x4x8"       # not ASCII digits: a file name, not a shape
    with pytest.raises(ValueError, match=r"tile shape \(4, 4, 4\) has pt\*ph\*pw = 64"):
        VedaConfig(tiling="4x4x4")
    with pytest.raises(ValueError, match="three positive ints"):
        SolConfig(density=0.2, tiling="runs/tiling.json")


def test_in_memory_estimator_marker_is_not_loaded():
    """The dict entry of an estimator that was never saved is refused with a way out, not taken for a path."""
    with pytest.raises(ValueError, match=r"never saved.*save_pretrained"):
        config_from_dict({"method": "veda", "estimator": "<in-memory VedaEstimator, never saved>"})


def test_estimator_must_be_a_path_a_hub_id_or_an_estimator():
    """Review find: estimator=123, True, [1] or "" were accepted (a list then broke hash()); a path-like one is
    kept as its str, as `to_dict` writes it."""
    import re
    from pathlib import Path

    for bad in (123, True, [1], 1.5):     # (a list is one estimator per transformer: its bad entry is named)
        named = bad[0] if isinstance(bad, list) else bad
        with pytest.raises(TypeError, match=re.escape(f"estimator={named!r} must be None, a directory or hub id")):
            VedaConfig(estimator=bad)
    with pytest.raises(ValueError, match="estimator='' must name a trained estimator"):
        VedaConfig(estimator="")
    assert VedaConfig(estimator=Path("runs/est")).estimator == "runs/est"
    assert hash(VedaConfig(estimator="org/est")) == hash(VedaConfig(estimator="org/est"))
    from videosparse.veda.estimator import VedaEstimator

    est = VedaEstimator("WanTransformer3DModel", num_layers=1, num_heads=2, head_dim=16, block=128,
                        tile_shapes=(4, 4, 8))
    assert VedaConfig(estimator=est).estimator is est
    several = VedaConfig(estimator=[Path("runs/high"), est])       # one per transformer of a pipeline: a tuple
    assert several.estimator == ("runs/high", est) and hash(several) == hash(several)
    for bad in ([], (None, "runs/high")):
        with pytest.raises(ValueError, match="names no estimator|holds None"):
            VedaConfig(estimator=bad)
    with pytest.raises(TypeError, match=r"must be None, a directory or hub id"):
        VedaConfig(estimator=("runs/high", 3))
    with pytest.raises(TypeError, match="nests a tuple or list"):     # (review find: it was taken, then written as
        VedaConfig(estimator=(("a", "b"), "c"))                       # an in-memory estimator)
    with pytest.raises(ValueError, match="never saved"):            # as to_dict writes the in-memory one
        config_from_dict(several.to_dict())


def test_path_like_tiling_equals_its_dict_round_trip():
    """Review find: VedaConfig(tiling=Path(...)) differed from its dict round trip (to_dict writes a str)."""
    from pathlib import Path

    cfg = VedaConfig(tiling=Path("runs/tiling.json"))
    assert cfg.tiling == "runs/tiling.json" and config_from_dict(cfg.to_dict()) == cfg


def test_a_band_past_the_tile_count_keeps_meaning_all_and_an_absurd_one_is_refused_in_a_method_spec():
    """Review find: band=10**20 (or the spec sol@0.5:band=99999999999999999999) was accepted and overflowed at the
    first sparse call; the int64 range stays allowed (any band >= the tile count forces every tile)."""
    from videosparse.eval.spec import parse_method_spec

    assert SolConfig(tau=1.0, band=2**63 - 1).band == 2**63 - 1 and SolConfig(density=0.2, band=10**6).band == 10**6
    with pytest.raises(ValueError, match=r"band=99999999999999999999 must be an int in \[0, 9223372036854775807\]"):
        parse_method_spec("sol@0.5:band=99999999999999999999")


def test_dir_lists_the_subpackages_before_their_import_and_no_private_names():
    """Mutation find: dir(videosparse) must name the subpackages in a fresh process, before any is imported (the
    in-process test sees them as imported modules either way), and none of the module's private helpers
    (_importlib, _SUBPACKAGES) or dunders other than __version__."""
    code = ("import sys, videosparse; names = dir(videosparse); "
            "assert 'videosparse.models' not in sys.modules; "
            "print(sorted(n for n in ('distill', 'eval', 'kernels', 'models', 'sol', 'veda') if n in names)); "
            "print(sorted(n for n in names if n.startswith('_')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    listed, private = out.stdout.strip().splitlines()
    assert listed == "['distill', 'eval', 'kernels', 'models', 'sol', 'veda']"
    assert private == "['__version__']"


def test_shared_fields_keep_their_places_in_the_saved_json_and_positional_calls():
    """The sparse configs share the checks and the schedule's queries of dense_steps, dense_layers, correction and
    backend (`_SparseConfig`), while each keeps those fields where its saved JSON, repr and positional order have
    had them."""
    assert list(VedaConfig().to_dict()) == ["method", "version", "density", "estimator", "tiling", "block",
                                            "dense_steps", "dense_layers", "correction", "backend"]
    assert list(SolConfig(density=0.1).to_dict()) == ["method", "version", "density", "tau", "block", "tiling", "band",
                                                      "correction", "dense_steps", "dense_layers", "backend"]
    assert VedaConfig(0.3).density == 0.3 and SolConfig(None, 1.5).tau == 1.5
    assert repr(VedaConfig()).startswith("VedaConfig(density=0.1, estimator=None, tiling=None, block=128,")
    for cfg in (VedaConfig(dense_layers=[3, 1, 3]), SolConfig(density=0.1, dense_layers=[3, 1, 3])):
        assert cfg.dense_layers == (1, 3) and cfg.is_dense_layer(3) and not cfg.is_dense_layer(2)
        assert cfg.dense_step_count(10) == 2
        fields = {k: v for k, v in cfg.to_dict().items() if k not in ("method", "version")}
        with pytest.raises(ValueError, match=r"backend='cuda' is not supported; choose one of \('auto', 'triton'"):
            type(cfg)(**{**fields, "backend": "cuda"})
    assert not DenseConfig().is_dense_layer(0) and DenseConfig().dense_step_count(10) == 0


def test_the_kernel_names_have_one_source():
    """`config.BACKENDS` and the names `videosparse.kernels` registers both come from `config.TRITON_KERNELS`, in the
    order they always had."""
    from videosparse.config import BACKENDS
    from videosparse.kernels.dispatch import AUTO_ORDER, TRITON_BACKENDS

    assert BACKENDS == ("auto", "triton", "reference", "gluon_hopper", "hopper", "triton_generic")
    kernels = ("gluon_hopper", "triton_generic", "hopper", "reference")
    assert [n for n in AUTO_ORDER if n in kernels] == ["gluon_hopper", "triton_generic", "reference"]
    assert [n for n in TRITON_BACKENDS if n in kernels] == ["gluon_hopper", "triton_generic", "hopper"]
