"""Tests from a mutation pass over `videosparse.plan`, `videosparse.veda.tiling` and `videosparse.config`: each guards
a behaviour that a one-line change of the shipped code left every earlier test passing."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from videosparse.config import SolConfig, VedaConfig, config_from_dict
from videosparse.plan import Plan, plan_from_mask, row_budget_list, topk_plan, work_order
from videosparse.veda.tiling import CANDIDATES_128, Tiling, TilingSearch, load_tiling


# ------------------------------------------------------------------------------------------------ plan
def test_validate_refuses_a_listed_tile_that_starts_exactly_at_valid_keys():
    """Mutation find: validate's `past` check (`>=` made `>`) let a plan list a key tile that starts exactly at
    the item's valid_keys, a tile with no valid key at all."""
    q = k = torch.zeros(1, 1, 256, 8)
    plan = Plan(torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32), torch.full((1, 1, 2), 2, dtype=torch.int32),
                valid_keys=torch.tensor([128], dtype=torch.int32))
    with pytest.raises(ValueError, match="start at or past valid_keys"):
        plan.validate(q, k)
    plan.with_valid_keys(plan.valid_keys).validate(q, k)          # dropped by with_valid_keys: valid
    Plan(plan.kv_index, plan.kv_count, valid_keys=torch.tensor([129], dtype=torch.int32)).validate(q, k)


def test_plan_from_an_all_false_mask_keeps_one_index_slot():
    """Mutation find: plan_from_mask's Kmax floor of 1 (`max(count.max(), 1)`) dropped gave an all-empty mask a
    plan with no index column, which kernels cannot read a first entry of."""
    plan = plan_from_mask(torch.zeros(1, 2, 3, 4, dtype=torch.bool))
    assert tuple(plan.kv_index.shape) == (1, 2, 3, 1) and plan.kv_index.dtype == torch.int32
    assert not plan.kv_count.any() and not plan.to_dense_mask(4).any()


def test_row_budgets_are_at_least_one_when_density_times_columns_is_below_one():
    """Mutation find: row_budget_list's lower clamp to 1 dropped gave rows a budget of 0 when density * num_cols < 1
    (the docstring promises each budget in [1, num_cols]; the forced diagonal needs one)."""
    assert row_budget_list(0.1, 6, 5) == [1] * 6
    plan = topk_plan(torch.randn(1, 1, 5, 5, generator=torch.Generator().manual_seed(0)), 0.1)
    assert plan.kv_count.tolist() == [[[1] * 5]]
    assert plan.kv_index[..., 0].tolist() == [[[0, 1, 2, 3, 4]]]                  # the diagonal


def test_row_budgets_use_floor_differences_not_rounding():
    """Mutation find: row_budget_list with round() instead of floor() spread fractional budgets differently (and
    Python's round goes to even): row i gets floor((i + 1) x) - floor(i x)."""
    assert row_budget_list(0.25, 4, 10) == [2, 3, 2, 3]                         # x = 2.5


def test_row_budgets_absorb_the_float_products_rounding_error():
    """Mutation find: without the 1e-9 in row_budget_list, 0.29 * 100 = 28.999999999999996 gave a budget of 28 tiles
    for a density of 0.29 over 100 columns."""
    assert row_budget_list(0.29, 1, 100) == [29]
    assert row_budget_list(0.7, 1, 10) == [7]


def test_topk_plan_refuses_a_density_of_zero():
    """Mutation find: topk_plan's density check made `0.0 <= density` accepted a density of 0 (and silently kept the
    diagonal); it must lie in (0, 1]."""
    with pytest.raises(ValueError, match=r"density=0.0 must lie in \(0, 1\]"):
        topk_plan(torch.zeros(1, 1, 4, 4), 0.0)


def test_work_order_puts_only_rows_longer_than_twice_the_mean_first():
    """Mutation find: work_order's long-row test (`>` made `>=`) moved a row of exactly twice the mean kv_count of the
    non-empty rows ahead of the (b, h, m) order."""
    assert work_order(torch.tensor([1, 1, 4], dtype=torch.int32)).tolist() == [0, 1, 2]   # mean 2: 4 is not long
    assert work_order(torch.tensor([1, 1, 5, 0], dtype=torch.int32)).tolist() == [2, 0, 1, 3]


# ------------------------------------------------------------------------------------------------ tiling
def _write(path, **fields):
    path.write_text(json.dumps({"format": "videosparse-tiling", **fields}))
    return path


def test_a_tiling_file_without_a_version_is_read(tmp_path):
    """Mutation find: load_tiling's default version for a file that records none (0) changed to one past
    TILING_VERSION refused such files; only a newer recorded version is refused."""
    tiling = load_tiling(_write(tmp_path / "t.json", block=128, layers=[[[4, 4, 8]]]))
    assert tiling.layers == (((4, 4, 8),),)
    with pytest.raises(ValueError, match="version 2 is not one"):
        load_tiling(_write(tmp_path / "t2.json", version=2, block=128, layers=[[[4, 4, 8]]]))


def test_a_64_token_tiling_file_loads_without_a_block_given(tmp_path):
    """Mutation find: load_tiling checked shapes against a block other than the file's (`block or 128`) when called
    without `block`, refusing a valid 64-token file."""
    tiling = load_tiling(_write(tmp_path / "t.json", version=1, block=64, layers=[[[4, 4, 4], [1, 8, 8]]]))
    assert tiling.block == 64 and tiling.layers == (((4, 4, 4), (1, 8, 8)),)


def test_tiles_for_a_layer_past_the_file_is_a_value_error():
    """Mutation find: tiles_for's range check (`< len` made `<= len`) let the layer one past the file through to an
    IndexError instead of the ValueError naming the layers covered."""
    tiling = Tiling((((4, 4, 8),),) * 2)
    assert tiling.tiles_for(1, 1) == ((4, 4, 8),)
    with pytest.raises(ValueError, match=r"covers layers 0..1; layer 2"):
        tiling.tiles_for(2, 1)


def test_check_model_names_a_recorded_head_count_that_differs():
    """Mutation find: check_model stopped comparing the file's recorded num_heads with the model's; a file searched
    for 4 heads was taken for a 2-head model when its layers happen to list 2 shapes."""
    tiling = Tiling((((4, 4, 8),) * 2,), 128, {"num_heads": 4})
    with pytest.raises(ValueError, match=r"num_heads=4 \(the model's: 2\)"):
        tiling.check_model("M", 1, 2, "t.json")
    Tiling((((4, 4, 8),) * 2,), 128, {}).check_model("M", 1, 2, "t.json")        # nothing recorded: no complaint


def test_check_model_reads_every_layers_head_count():
    """Mutation find: check_model looking at the first layer's head shapes only let a file whose later layer lists
    another number of heads pass."""
    tiling = Tiling((((4, 4, 8),) * 2, ((4, 4, 8),) * 3), 128, {})
    with pytest.raises(ValueError, match=r"3 head shapes in layer 1 \(the model's heads: 2\)"):
        tiling.check_model("M", 2, 2, "t.json")


def test_searched_component_is_none_unless_recorded_as_a_string():
    """Mutation find: searched_component returned whatever the JSON held ("component": 3), which the processors then
    compared with component names; only a string names a component."""
    assert Tiling((((4, 4, 8),),), 128, {"search_config": {"component": 3}}).searched_component is None
    assert Tiling((((4, 4, 8),),), 128, {"search_config": {"component": "transformer_2"}}).searched_component \
        == "transformer_2"


def test_a_shape_padding_exactly_max_padding_is_allowed():
    """Mutation find: the padding rule made strict (`pads < max_padding`) excluded every shape at max_padding=0 on a
    grid all candidates tile without padding, so the search fell back to the first candidate only."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 512, 1, 16, generator=g) for _ in range(3))
    search = TilingSearch(density=0.5, max_padding=0.0, backend="reference")
    search.add(SimpleNamespace(layer=0, q=q, k=k, v=v, grid=(8, 8, 8), text_len=0, text_position=None))
    assert search.allowed_per_layer[0] == list(CANDIDATES_128)


# ------------------------------------------------------------------------------------------------ config
def test_dense_step_count_rounds_a_fraction_down():
    """Mutation find: dense_step_count with round() instead of floor() ran 2 of 10 steps dense at dense_steps=0.15
    (and 8 of 30 at 0.25): a fraction's share of the steps is rounded down."""
    assert VedaConfig(dense_steps=0.15).dense_step_count(10) == 1
    assert SolConfig(density=0.1, dense_steps=0.25).dense_step_count(30) == 7


def test_dense_steps_of_zero_is_accepted():
    """Mutation find: the dense_steps check made `<= 0` refused the int 0 (all-sparse), which the docs tell users to
    pass."""
    assert VedaConfig(dense_steps=0).dense_step_count(50) == 0
    assert SolConfig(density=0.1, dense_steps=0).dense_step_count(50) == 0
    with pytest.raises(ValueError, match="dense_steps=-1 must be >= 0"):
        VedaConfig(dense_steps=-1)


def test_a_negative_dense_layer_is_refused():
    """Mutation find: the dense_layers check loosened (`layer < -1`) accepted -1, which is_dense_layer never matches."""
    for cfg in (lambda: VedaConfig(dense_layers=(-1,)), lambda: SolConfig(density=0.1, dense_layers=[0, -1])):
        with pytest.raises(ValueError, match="ints >= 0; got -1"):
            cfg()


def test_sol_band_zero_is_accepted_and_a_bool_band_is_refused():
    """Mutation find: SolConfig's band range made `1 <= band` refused band=0 (only the diagonal forced); the bool
    check dropped accepted band=True as 1."""
    assert SolConfig(density=0.1, band=0).band == 0
    with pytest.raises(ValueError, match="band=True must be an int"):
        SolConfig(density=0.1, band=True)


def test_config_version_zero_and_newer_versions_are_refused():
    """Mutation find: config_from_dict's version checks (`< 1` made `< 0`, `> CONFIG_VERSION` loosened) accepted a
    version 0 or a newer config than this videosparse writes."""
    with pytest.raises(ValueError, match="version=0 must be an int >= 1"):
        config_from_dict({"method": "veda", "version": 0})
    with pytest.raises(ValueError, match="version 2 is newer"):
        config_from_dict({"method": "veda", "version": 2})
    assert config_from_dict({"method": "veda", "version": 1}) == VedaConfig()


def test_an_estimator_tuple_of_one_is_its_one_entry():
    """Mutation find: without the unwrap of a one-entry tuple, VedaConfig(estimator=("dir",)) stayed a tuple, a config
    unequal to VedaConfig(estimator="dir") that the processors read as one estimator per transformer."""
    assert VedaConfig(estimator=("some/dir",)).estimator == "some/dir"
    assert VedaConfig(estimator=["some/dir"]) == VedaConfig(estimator="some/dir")
