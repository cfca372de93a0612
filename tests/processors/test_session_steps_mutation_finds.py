"""Tests from a mutation pass over `SparseSession` (prepare's layouts cache and once-per-shape `on_layout`
announcements, stats) and the family timestep directions the context hook hands step counting (the counters' own
finds are in `test_step_counting_edges.py`): each guards a behaviour that a one-line change left every other test
passing."""

import pytest
import torch

import videosparse
from videosparse.models.tiny_wan import build_tiny_wan_pipeline
from videosparse.processors.session import LayerStats

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def wan_transformer():
    return build_tiny_wan_pipeline().transformer


def _applied(transformer, **config):
    config = dict(dict(density=0.5, tiling=(1, 4, 16), block=64, dense_steps=0), **config)
    videosparse.remove(transformer)
    return videosparse.apply(transformer, videosparse.VedaConfig(**config))["transformer"]


def test_on_layout_sees_every_layer_once_per_shape_and_again_after_the_grid_came_back(wan_transformer):
    """Mutation find: `prepare` hands the method every layer's layouts (`on_layout`) on the first sparse forward of a
    shape, not on dense ones, not again for the same shape, and again for a grid the session comes back to (its
    layouts were dropped and rebuilt with the other grid's)."""
    session = _applied(wan_transformer)
    seen = []
    session.method.on_layout = lambda layer, layout: seen.append((layer, layout.grid))
    a, b = (2, 4, 16), (2, 8, 16)
    session.prepare(a, 8, CPU, torch.float32, sparse=False)
    assert seen == []
    for _ in range(3):
        session.prepare(a, 8, CPU, torch.float32)
    assert seen == [(0, a), (1, a)]
    session.prepare(b, 8, CPU, torch.float32)
    session.prepare(a, 8, CPU, torch.float32)
    assert seen == [(0, a), (1, a), (0, b), (1, b), (0, a), (1, a)]
    videosparse.remove(wan_transformer)


def test_the_layouts_cache_keeps_the_most_recently_used_lengths(wan_transformer):
    """Mutation find: the layouts cache drops the least recently used text length (a length used again moves to the
    end): after lengths 5, 9, 5, 7 the layouts of 5 are still the cached ones, those of 9 are rebuilt."""
    session = _applied(wan_transformer)
    grid = (2, 4, 16)
    layout_of = {}
    for length in (5, 9, 5, 7):
        session.prepare(grid, length, CPU, torch.float32)
        layout_of.setdefault(length, session.slots[0].layouts[length])
    session.prepare(grid, 5, CPU, torch.float32)
    assert session.slots[0].layouts[5] is layout_of[5]
    session.prepare(grid, 9, CPU, torch.float32)
    assert session.slots[0].layouts[9] is not layout_of[9]
    videosparse.remove(wan_transformer)


def test_a_forward_with_a_text_slot_gets_layouts_built_with_it(wan_transformer):
    """Mutation find: the `prepare` key holds the context's `text_slot`: a forward whose padded text has no valid token
    (text_slot, text length 0) after one with no text at all, same grid, gets layouts with the text part (the partial
    last video tile global), not the cached ones without it."""
    session = _applied(wan_transformer, density=0.9)
    grid = (1, 4, 15)                                 # 60 video tokens: one partial 64-token tile
    tiles = []
    for text_slot in (False, True, False):
        session.context.text_slot = text_slot
        session.prepare(grid, 0, CPU, torch.float32)
        layout = session.slots[0].layouts[0]
        tiles.append((layout.text_slot, layout.num_video_tiles, layout.num_global_tiles))
    assert tiles == [(False, 1, 0), (True, 0, 1), (False, 1, 0)]
    session.context.text_slot = False
    videosparse.remove(wan_transformer)


def test_stats_name_the_kernel_when_only_some_layers_ran_sparse(wan_transformer):
    """Mutation find: `stats()['kernel_backend']` names the kernel the sparse calls ran on as soon as any layer ran
    sparse (with `dense_layers`, some layers never do), not only when every layer did."""
    session = _applied(wan_transformer, dense_layers=(0,))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        wan_transformer(hidden_states=torch.randn(1, 4, 3, 16, 24, generator=g), timestep=torch.tensor([500]),
                        encoder_hidden_states=torch.randn(1, 8, 32, generator=g))
    stats = session.stats()
    assert [layer["sparse_calls"] for layer in stats["layers"].values()] == [0, 1]
    assert stats["kernel_backend"] == "reference"
    videosparse.remove(wan_transformer)


def test_load_balance_is_the_longest_row_over_the_mean_row():
    """Mutation find: `LayerStats.as_dict()['load_balance']` is (longest row x rows) / kept pairs (>= 1; 1 for rows
    of equal length), not its inverse."""
    stats = LayerStats()
    stats.record_sparse(torch.tensor([[[1, 3]]]), 4)           # 2 rows of 4 key tiles: 1 and 3 kept
    d = stats.as_dict()
    assert (d["kept_pairs"], d["total_pairs"], d["density"], d["load_balance"]) == (4, 8, 0.5, 1.5)


def test_a_bare_transformers_cache_context_steps_take_the_family_direction(wan_transformer):
    """Mutation find: applied to a bare transformer (no scheduler) whose forwards come in a cache context without a
    step index, steps counted by timestep take the family's known direction (Wan: falling): after a stray forward at
    t=500, a call from 1000 is a new call, steps 0, 1, 2 (not 1, 0, 1 as a rising schedule's)."""
    _applied(wan_transformer, dense_steps=1)
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 4, 3, 16, 24, generator=g), torch.randn(1, 8, 32, generator=g)
    seen = []
    with videosparse.processors.observe(wan_transformer, lambda r: seen.append(r.step) if r.layer == 0 else None):
        for t in (500, 1000, 750, 500):
            with wan_transformer.cache_context("cond"), torch.no_grad():
                wan_transformer(hidden_states=x, timestep=torch.tensor([t]), encoder_hidden_states=text)
    assert seen == [0, 0, 1, 2]
    videosparse.remove(wan_transformer)
