import itertools

import pytest
import torch

from videosparse.layout import TileLayout, head_tiling

SHAPES_128 = [(8, 4, 4), (2, 8, 8), (4, 4, 8), (4, 8, 4), (8, 2, 8), (8, 8, 2)]
SHAPES_64 = [(4, 4, 4), (1, 8, 8), (4, 2, 8)]


@pytest.mark.parametrize("grid", [(3, 5, 7), (21, 6, 10), (1, 1, 1), (9, 17, 4)])
@pytest.mark.parametrize("text", [(0, "after"), (13, "before"), (200, "after")])
def test_round_trip_every_shape(grid, text):
    L, pos = text
    for tile, block in [(t, 128) for t in SHAPES_128] + [(t, 64) for t in SHAPES_64]:
        lay = TileLayout(grid, tile, block, L, pos)
        S = lay.seq_len
        x = torch.randn(2, S, 3, 5)
        y = lay.gather(x)
        assert y.shape == (2, 3, S, 5) and y.is_contiguous()
        assert torch.equal(lay.scatter(y), x)
        assert sorted(lay.perm.tolist()) == list(range(S))


def test_tile_contents_follow_contract():
    grid, tile = (5, 6, 7), (2, 2, 2)
    lay = TileLayout(grid, tile, 8)
    T, H, W = grid
    # tile order: geometric tiles block-major, tokens (t,h,w)-major inside, pads dropped
    expected = []
    for a, b, c in itertools.product(range(3), range(3), range(4)):
        for dt, dh, dw in itertools.product(range(2), range(2), range(2)):
            t, h, w = 2 * a + dt, 2 * b + dh, 2 * c + dw
            if t < T and h < H and w < W:
                expected.append(t * H * W + h * W + w)
    assert lay.perm.tolist() == expected
    assert lay.tile_len.tolist()[:-1] == [8] * (lay.num_tiles - 1)
    assert lay.tile_len.tolist()[-1] == T * H * W - 8 * (lay.num_tiles - 1)


def test_text_tokens_form_global_tiles():
    lay = TileLayout((2, 4, 5), (2, 2, 2), 8, text_len=11, text_position="before")
    # video 40 tokens = 5 full tiles; text 11 tokens -> 2 global tiles
    assert lay.num_video_tiles == 5 and lay.num_tiles == 7 and lay.num_global_tiles == 2
    assert lay.perm[40:].tolist() == list(range(11))
    lay2 = TileLayout((3, 4, 5), (2, 2, 2), 8, text_len=11, text_position="after")
    # 60 video tokens: 7 full video tiles, the mixed tile 7 is global
    assert lay2.num_video_tiles == 7 and lay2.num_tiles == 9
    assert lay2.perm[60:].tolist() == list(range(60, 71))


def test_head_tiling_round_trip_mixed_shapes():
    tiles = [(4, 4, 8), (2, 8, 8), (4, 4, 8), (8, 8, 2)]
    ht = head_tiling((7, 9, 11), tiles, 4, 128, text_len=5, text_position="before")
    x = torch.randn(2, ht.seq_len, 4, 8)
    y = ht.gather(x)
    for h, t in enumerate(tiles):
        single = TileLayout((7, 9, 11), t, 128, 5, "before").gather(x[:, :, h : h + 1])
        assert torch.equal(y[:, h : h + 1], single)
    assert torch.equal(ht.scatter(y), x)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(grid=(2, 2, 2), tile=(4, 4, 4), block=128), "product equals block"),
        (dict(grid=(0, 2, 2), tile=(4, 4, 8)), "positive"),
        (dict(grid=(2, 2, 2), text_len=3, text_position="middle"), "text_position"),
        (dict(grid=(2, 2, 2), text_len=2.5), "text_len=2.5 must be an int"),
    ],
)
def test_bad_layouts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TileLayout(**kwargs)


def test_head_tilings_refuse_what_they_cannot_serve():
    """Review finds: a strided head selection returned every head's shape; a per-head tiling's scatter raised torch's
    "expanded size" error for a wrong token or head count."""
    ht = head_tiling((4, 4, 4), [(1, 4, 4), (4, 4, 1), (1, 4, 4), (4, 4, 1)], 4, 16)
    assert ht.select_heads(slice(1, 3)).tiles == ((4, 4, 1), (1, 4, 4))
    assert ht.select_heads(slice(1, 4)).tiles == ((4, 4, 1), (1, 4, 4), (4, 4, 1))     # cached per slice, not per start
    with pytest.raises(ValueError, match="tiling names 3 tile shapes but the layer has 4 heads"):
        head_tiling((4, 4, 4), [(1, 4, 4), (4, 4, 1), (1, 4, 4)], 4, 16)
    with pytest.raises(ValueError, match="contiguous run of heads"):
        ht.select_heads(slice(0, 4, 2))
    for shape in ((1, 4, ht.seq_len - 1, 8), (1, 3, ht.seq_len, 8)):
        with pytest.raises(ValueError, match=r"expected \(B, 4, 64, D\)"):
            ht.scatter(torch.zeros(shape))
    uniform = head_tiling((4, 4, 4), (1, 4, 4), 4, 16)      # one shape for every head: the head count still holds
    with pytest.raises(ValueError, match="x has 3 heads \\(x 1 groups\\) but the tiling names 4 tile shapes"):
        uniform.gather(torch.zeros(1, uniform.seq_len, 3, 8))
    with pytest.raises(ValueError, match=r"expected \(B, 4, 64, D\)"):
        uniform.scatter(torch.zeros(1, 3, uniform.seq_len, 8))
    assert uniform.gather(torch.zeros(1, uniform.seq_len, 2, 8), groups=2).shape == (1, 4, 64, 8)


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 12), (torch.bfloat16, 6)])
@pytest.mark.parametrize("tiles", [(4, 4, 8), ((4, 4, 8), (2, 8, 8), (8, 2, 8))])
def test_gather_scatter_wide_path_equals_plain_indexing(dtype, D, tiles):
    """The 16-byte-element fast path moves exactly the bits plain indexing moves, also for strided inputs."""
    ht = head_tiling((5, 7, 9), tiles, 3, 128)
    S = ht.seq_len
    fused = torch.randn(2, S, 3 * 3 * D).to(dtype)           # a chunk of a fused qkv projection: strided
    for x in (torch.randn(2, S, 3, D).to(dtype), fused[..., 3 * D : 6 * D].unflatten(2, (3, D))):
        if ht.uniform:
            perm = ht.first.indices("cpu")[0].expand(3, S)
        else:
            perm = ht.head_indices("cpu")[0]
        expected = torch.stack([x[:, perm[h], h] for h in range(3)], dim=1)
        y = ht.gather(x)
        assert y.is_contiguous() and torch.equal(y, expected)
        back = ht.scatter(y)
        assert torch.equal(back, x)
        if D * x.element_size() % 16 == 0:
            assert back.is_contiguous()                         # flatten(2, 3) after it needs no copy


def test_grids_and_tiles_must_be_integers_and_numpy_integers_are_taken():
    """Review find: a grid of (2.7, 4, 4) was truncated to (2, 4, 4) and a tile of (1.5, 4, 4) taken as (1, 4, 4),
    while `head_tiling` failed on numpy integers."""
    import numpy as np

    assert TileLayout((np.int64(2), 4, torch.tensor(4)), (1, 4, 4), 16).grid == (2, 4, 4)
    assert head_tiling((2, 4, 4), (np.int64(1), 4, 4), 2, 16).tiles == ((1, 4, 4), (1, 4, 4))
    for grid in ((2.7, 4, 4), (True, 4, 4), (2, 4)):
        with pytest.raises(ValueError, match="must be three positive ints"):
            TileLayout(grid, (1, 4, 4), 16)
    with pytest.raises(ValueError, match=r"tile=\(1.5, 4, 4\) must be three positive ints"):
        TileLayout((2, 4, 4), (1.5, 4, 4), 16)
    with pytest.raises(ValueError, match=r"tile shape \(1.5, 4, 4\) must be three positive ints"):
        head_tiling((2, 4, 4), [(1, 4, 4), (1.5, 4, 4)], 2, 16)


def test_a_text_slot_makes_the_partial_last_video_tile_global_without_text():
    plain = TileLayout((3, 5, 7), (1, 4, 16), 64)                  # 105 tokens: 1 full tile and a partial one
    slot = TileLayout((3, 5, 7), (1, 4, 16), 64, text_slot=True)
    beside_text = TileLayout((3, 5, 7), (1, 4, 16), 64, text_len=10)
    assert (plain.num_video_tiles, plain.num_global_tiles) == (2, 0)
    assert (slot.num_video_tiles, slot.num_global_tiles) == (1, 1) == (beside_text.num_video_tiles,
                                                                       beside_text.num_global_tiles)
    assert torch.equal(slot.perm, plain.perm)
    assert head_tiling((3, 5, 7), (1, 4, 16), 2, 64, text_slot=True).num_global_tiles == 1


def test_layout_checks_sizes_groups_and_per_head_lists():
    """Review finds: a fractional text_len and a float block were taken (a float tile count); groups=0 without RoPE
    gave zero heads; a per-head tiling took a list grid (unhashable) and a zero tile until first use; a malformed
    per-head list raised a bare TypeError."""
    from fractions import Fraction

    from videosparse.layout import HeadTiling

    for kwargs, match in ((dict(text_len=Fraction(5, 2)), "text_len=Fraction"), (dict(text_len="3"), "text_len='3'"),
                          (dict(block=16.0, tile=(1, 4, 4)), "block=16.0"), (dict(block=True, tile=(1, 1, 1)), "block")):
        with pytest.raises(ValueError, match=match):
            TileLayout(**{"grid": (2, 4, 4), "tile": (1, 4, 4), "block": 16, **kwargs})
    layout = TileLayout((2, 4, 4), (1, 4, 4), 16)
    for groups in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="groups=.* must be an int >= 1"):
            layout.gather(torch.zeros(1, 32, 2, 8), groups=groups)
    ht = HeadTiling([2, 4, 4], ((1, 4, 4), (1, 4, 4)), 16)
    assert ht.grid == (2, 4, 4) and hash(ht) == hash(HeadTiling((2, 4, 4), ((1, 4, 4), (1, 4, 4)), 16))
    with pytest.raises(ValueError, match="tile shape \\(0, 4, 4\\) must be three positive ints"):
        HeadTiling((2, 4, 4), ((0, 4, 4), (1, 4, 4)), 16)
    with pytest.raises(ValueError, match="product equals block=16"):
        HeadTiling((2, 4, 4), ((2, 4, 4), (1, 4, 4)), 16)
    for tiles in ((4, 4), [(1, 4, 4), 7]):
        with pytest.raises(ValueError, match="tile shape|one \\(pt, ph, pw\\) per head|tiling names"):
            head_tiling((2, 4, 4), tiles, 2, 16)


def test_replaced_layouts_build_their_own_indices():
    """Review find: dataclasses.replace passed the device cache on, so a layout of another grid or tile gathered with
    the first one's permutation (a wrong order, or a wrong shape with no error)."""
    from dataclasses import replace

    a = TileLayout((2, 4, 4), (1, 4, 4), 16)
    a.gather(torch.zeros(1, 32, 1, 8))
    for b in (replace(a, grid=(3, 4, 4)), replace(a, tile=(2, 2, 4))):
        x = torch.randn(1, b.seq_len, 2, 8)
        fresh = TileLayout(b.grid, b.tile, 16)
        assert torch.equal(b.gather(x), fresh.gather(x))
    ht = head_tiling((2, 4, 4), [(1, 4, 4), (4, 4, 1)], 2, 16)
    ht.head_indices("cpu")
    swapped = replace(ht, tiles=((4, 4, 1), (1, 4, 4)))
    assert torch.equal(swapped.head_indices("cpu")[0], ht.head_indices("cpu")[0].flip(0))


@pytest.mark.parametrize("per_head", [False, True])
def test_indices_first_built_in_inference_mode_serve_autograd_later(per_head):
    """Review find: index tensors first built inside torch.inference_mode were inference tensors, cached, and a later
    forward that autograd records raised "Inference tensors cannot be saved for backward"."""
    ht = head_tiling((2, 4, 4), [(1, 4, 4), (4, 4, 1)] if per_head else (1, 4, 4), 2, 16)
    tiling = ht.select_heads(slice(0, 2))
    with torch.inference_mode():
        tiling.gather(torch.randn(1, 32, 2, 8))
    x = torch.randn(1, 32, 2, 8, requires_grad=True)
    tiling.scatter(tiling.gather(x) * 2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2))


def test_groups_take_numpy_and_torch_ints_and_a_fresh_layout_compiles_whole():
    """Review finds on the checks added: numpy / torch integer groups were refused; the inference-mode query ran
    before the compiling check, a graph break at an index-cache miss under torch.compile."""
    import numpy as np

    layout = TileLayout((2, 4, 4), (1, 4, 4), 16)
    x = torch.randn(1, 32, 2, 8)
    for groups in (np.int64(2), torch.tensor(2)):
        assert torch.equal(layout.gather(x, groups=groups), layout.gather(x, groups=2))
    fresh = TileLayout((2, 4, 4), (2, 2, 4), 16)
    fresh.perm, fresh.inv           # (a cached_property takes a lock on Python 3.11, which Dynamo cannot enter)
    compiled = torch.compile(lambda t: fresh.gather(t), fullgraph=True, backend="eager")     # a device-cache miss
    assert torch.equal(compiled(x), TileLayout((2, 4, 4), (2, 2, 4), 16).gather(x))


@pytest.mark.parametrize("large", [False, True])
def test_per_head_tiling_keeps_one_order_per_shape_not_per_head_when_large(large, monkeypatch):
    """A per-head tiling kept [heads, tokens] orders and their inverses between calls (48 MB a layer at Wan 14B 720P);
    past `KEEP_HEAD_ORDERS_BYTES` it keeps one order per distinct tile shape and expands the per-head index for each
    call (below, the kept orders save the expansion: 5% of the gathers' time at Wan 1.3B 480P)."""
    import videosparse.layout as layout_module

    monkeypatch.setattr(layout_module, "KEEP_HEAD_ORDERS_BYTES", 0 if large else 2**20)
    H = 6
    ht = head_tiling((5, 8, 8), [(1, 4, 4) if h % 3 else (4, 4, 1) for h in range(H)], H, 16)
    x = torch.randn(2, ht.seq_len, H, 8)
    y = ht.gather(x)
    assert torch.equal(ht.scatter(y), x) and torch.equal(ht.scatter(y.to(torch.float64)), x.to(torch.float64))
    narrow = x[..., :3].contiguous()                   # 12-byte rows: the inverse order's gather, not the wide scatter
    assert torch.equal(ht.scatter(ht.gather(narrow)), narrow)
    kept = [t for v in ht._device_cache.values() if isinstance(v, tuple) for t in v if torch.is_tensor(t)]
    per_head = 0 if large else 2 * H * ht.seq_len
    assert sum(t.numel() for t in kept) == 2 * 2 * ht.seq_len + H + per_head   # (perm, inv) of 2 shapes, rows
    perm, inv = ht.head_indices("cpu")
    assert perm.shape == inv.shape == (H, ht.seq_len)
    for h, t in enumerate(ht.tiles):
        assert torch.equal(perm[h], ht.layouts[t].perm) and torch.equal(inv[h], ht.layouts[t].inv)


def test_a_tensor_subclass_is_gathered_without_the_wide_view():
    """Review 55: optimum-quanto's quantized activations (W8A8) are a tensor subclass that views its int8 payload
    under the 16-byte reinterpretation while reporting float32: the gathered q came back with a quarter of its head
    dim. Subclasses take the plain index path, which keeps their own semantics."""
    from videosparse.layout import _wide_view

    class Tagged(torch.Tensor):
        pass

    x = torch.randn(1, 40, 2, 8)
    tagged = x.as_subclass(Tagged)
    assert _wide_view(x.transpose(1, 2)) is not None and _wide_view(tagged.transpose(1, 2)) is None
    layout = head_tiling((2, 4, 5), (1, 2, 4), 2, 8, 0)
    out = layout.gather(tagged)
    assert isinstance(out, Tagged) and torch.equal(out.as_subclass(torch.Tensor), layout.gather(x))


def test_layout_and_rope_import_no_kernel_module():
    """Imports flow one way (STYLE §4: config / layout / plan below the kernels): importing the layouts and RoPE, in a
    fresh process, loads nothing of `videosparse.kernels` (they once took `carries_tangent` from kernels.autograd)."""
    import subprocess
    import sys

    code = ("import sys, videosparse.layout, videosparse.rope; "
            "print(sorted(m for m in sys.modules if m.startswith(('videosparse.kernels', 'videosparse.eval'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
