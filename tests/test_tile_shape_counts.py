"""A tile shape is exactly three sizes, and a per-head tiling exactly one shape per head (`videosparse.validation`)."""

import pytest

from videosparse.config import VedaConfig
from videosparse.layout import head_tiling
from videosparse.validation import check_tile, int_triple, one_per_head


def test_four_sizes_whose_product_is_the_block_are_no_tile_shape():
    assert int_triple((4, 4, 8, 1)) is None and int_triple([2, 4, 4, 4]) is None
    for bad in ((4, 4, 8, 1), [1, 4, 4, 8]):
        with pytest.raises(ValueError, match="must be three positive ints"):
            check_tile(bad, 128)
    with pytest.raises(ValueError, match=r"tiling: tile shape \(4, 4, 8, 1\) must be three positive ints"):
        VedaConfig(tiling=(4, 4, 8, 1))


def test_more_tile_shapes_than_heads_are_refused_as_fewer_are():
    shapes = [(4, 4, 8), (8, 4, 4), (4, 8, 4)]
    with pytest.raises(ValueError, match="^tiling names 3 tile shapes but the layer has 2 heads.$"):
        one_per_head(shapes, 2)
    with pytest.raises(ValueError, match="tiling names 3 tile shapes but the layer has 2 heads"):
        head_tiling((4, 8, 8), shapes, num_heads=2)
    assert head_tiling((4, 8, 8), shapes[:2], num_heads=2).tiles == ((4, 4, 8), (8, 4, 4))
