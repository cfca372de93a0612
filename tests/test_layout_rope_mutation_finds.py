"""Mutation finds over `videosparse.layout` and `videosparse.rope`: each test closes a gap a mutant of those modules
survived (the targeted tests and the processors' passed with it); its docstring names what it guards."""

from __future__ import annotations

import pytest
import torch

from videosparse.layout import TileLayout, head_tiling, tile_lengths


def test_tile_lengths_on_odd_lengths_are_int32_block_then_the_rest():
    """Mutation find: `tile_lengths` (and `TileLayout.tile_len`) are int32 as documented, block tokens per tile and the
    rest in the last one (an int64 default survived)."""
    for seq_len, block in ((1, 8), (8, 8), (9, 8), (210, 8), (105, 64), (4096, 128)):
        lens = tile_lengths(seq_len, block)
        n = -(-seq_len // block)
        assert lens.dtype == torch.int32 and lens.tolist() == [block] * (n - 1) + [seq_len - block * (n - 1)]
        assert tile_lengths(seq_len, block, dtype=torch.float32).dtype == torch.float32
    layout = TileLayout((3, 5, 7), (1, 4, 16), 64, text_len=10)
    assert layout.tile_len.dtype == torch.int32 and layout.tile_len.tolist() == [64, 51]


def test_cache_key_names_the_device_with_its_index(monkeypatch):
    """Mutation finds: the index caches are keyed by the device with its index (two GPUs of one process keep their own
    index tensors; a key of the device type alone survived), and a bare "cuda" by the current GPU (an inverted index
    check survived)."""
    from videosparse.layout import _cache_key

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _cache_key("cuda") == "cuda:3" == _cache_key(torch.device("cuda"))
    assert _cache_key("cuda:1") == "cuda:1" and _cache_key(torch.device("cuda", 0)) == "cuda:0"
    assert _cache_key("cpu") == "cpu" and _cache_key("meta") == "meta"
    layout = TileLayout((2, 4, 4), (1, 4, 4), 16)
    assert layout.indices("meta")[0].device.type == "meta" and layout.indices("cpu")[0].device.type == "cpu"


def test_index_tensors_first_moved_in_inference_mode_are_normal_tensors():
    """Mutation finds: the index tensors copied to another device and the tile lengths, first built inside
    `torch.inference_mode`, are normal tensors (a later forward that autograd records saves them); building either
    without `_normal_tensors` survived, since on the CPU `.to("cpu")` returns the (normal) cached order itself."""
    layout = TileLayout((3, 5, 7), (1, 4, 16), 64, text_len=10)
    with torch.inference_mode():
        perm, inv = layout.indices("meta")
        tile_len = layout.tile_len
    assert not perm.is_inference() and not inv.is_inference() and not tile_len.is_inference()
    ht = head_tiling((2, 4, 4), [(1, 4, 4), (4, 4, 1)], 2, 16)
    with torch.inference_mode():
        ht.warm("meta")
    assert not any(t.is_inference() for v in ht._device_cache.values() for t in v)


@pytest.mark.parametrize("large", [False, True])
def test_per_head_gather_follows_each_heads_order_when_the_orders_are_not_kept(large, monkeypatch):
    """Mutation find: past `KEEP_HEAD_ORDERS_BYTES` the per-head orders are expanded per call; swapping perm and inv
    there survived, as the round trip (gather by inv, scatter by perm) still held. The gather must put head h's
    tokens in its own tile order, and the narrow (inverse-order) scatter must undo it."""
    import videosparse.layout as layout_module

    monkeypatch.setattr(layout_module, "KEEP_HEAD_ORDERS_BYTES", 0 if large else 2**20)
    grid, tiles = (3, 5, 7), [(1, 4, 4), (4, 4, 1), (2, 2, 4)]
    ht = head_tiling(grid, tiles, 3, 16, text_len=5, text_position="before")
    for D in (8, 3):                             # 32-byte rows: the wide gather / scatter; 12-byte rows: the plain one
        x = torch.randn(2, ht.seq_len, 3, D)
        y = ht.gather(x)
        for h, t in enumerate(tiles):
            perm = TileLayout(grid, t, 16, 5, "before").perm
            assert torch.equal(y[:, h], x[:, perm, h])
        assert torch.equal(ht.scatter(y), x)
        y = torch.randn_like(y)
        back = ht.scatter(y)
        for h, t in enumerate(tiles):
            assert torch.equal(back[:, :, h], TileLayout(grid, t, 16, 5, "before").scatter(y[:, h : h + 1])[:, :, 0])


def test_a_head_selection_keeps_the_text_slot_and_the_text():
    """Mutation finds: `select_heads` (one rank's heads under Ulysses context parallelism) must keep every field of
    the tiling; dropping `text_slot` survived, which gives that rank's heads one global tile fewer than the
    others' for an item whose padded text has no valid token. An explicit step of 1 is a contiguous run too (refusing
    it survived)."""
    for ht in (head_tiling((3, 5, 7), (1, 4, 16), 4, 64, text_slot=True),
               head_tiling((3, 5, 7), [(1, 4, 16), (2, 4, 8)] * 2, 4, 64, text_slot=True),
               head_tiling((3, 5, 7), (1, 4, 16), 4, 64, text_len=10, text_position="before")):
        part = ht.select_heads(slice(1, 3))
        assert (part.text_slot, part.text_len, part.text_position, part.block) == (ht.text_slot, ht.text_len,
                                                                                   ht.text_position, ht.block)
        assert (part.num_video_tiles, part.num_global_tiles) == (ht.num_video_tiles, ht.num_global_tiles) == (1, 1)
    assert ht.select_heads(slice(0, 2, 1)).tiles == ht.select_heads(slice(0, 2)).tiles    # step 1 is contiguous too


def test_gather_and_scatter_refuse_tensors_that_are_not_4d_or_of_another_length():
    """Mutation finds: without the 4-dims check a (B, S, H*D) tensor was gathered as (B, H*D, S), a silently wrong
    shape; without the token check of a per-head tiling's gather a wrong length failed deep in torch.gather. Both
    directions name the expected layout; a per-head tiling needs one tile shape per head (an empty tuple of shapes
    was taken until first use)."""
    from videosparse.layout import HeadTiling

    layout = TileLayout((2, 4, 4), (1, 4, 4), 16)
    for bad in (torch.zeros(1, 32, 16), torch.zeros(1, 32, 2, 8, 1)):
        with pytest.raises(ValueError, match=r"x has shape .*; expected 4 dims with 32 tokens in dim 1"):
            layout.gather(bad)
    with pytest.raises(ValueError, match=r"y has shape \(1, 2, 32\); expected 4 dims with 32 tokens in dim 2"):
        layout.scatter(torch.zeros(1, 2, 32))
    ht = head_tiling((2, 4, 4), [(1, 4, 4), (4, 4, 1)], 2, 16)
    for S in (31, 33):
        with pytest.raises(ValueError, match=f"x has shape \\(1, {S}, 2, 8\\); expected 4 dims with 32 tokens in dim 1"):
            ht.gather(torch.zeros(1, S, 2, 8))
    with pytest.raises(ValueError, match="tiles must name one tile shape per head; got none"):
        HeadTiling((2, 4, 4), (), 16)


def test_warm_keeps_the_per_head_orders_before_the_first_call():
    """Mutation find: `warm` (called outside any compiled graph) builds the index tensors a call uses: the layout's
    (perm, inv) for one shape, the per-head [H, S] orders of a small per-head tiling (building only the per-shape
    orders survived, which leaves the expansion to the first, possibly compiled, call)."""
    from videosparse.layout import _cache_key

    uniform = head_tiling((2, 4, 4), (1, 4, 4), 2, 16)
    uniform.warm("cpu")
    assert _cache_key("cpu") in uniform.first._device_cache
    ht = head_tiling((2, 4, 4), [(1, 4, 4), (4, 4, 1), (1, 4, 4)], 3, 16)
    ht.warm("cpu")
    perm, inv = ht._device_cache[(_cache_key("cpu"), "heads")]
    assert perm.shape == inv.shape == (3, 32)
    for h, t in enumerate(ht.tiles):
        assert torch.equal(perm[h], ht.layouts[t].perm) and torch.equal(inv[h], ht.layouts[t].inv)


def test_half_rope_sections_must_split_the_head_dim_into_even_parts():
    """Mutation find: with `sections` the head dim splits into that many parts of even width; a check of equal parts
    alone survived, which rotated each 3-wide part of a head dim of 9 by a lopsided half without a word."""
    from videosparse.rope import HalfRope, apply_half_rope, apply_rope

    for D in (9, 15):
        x = torch.randn(1, 4, 2, D)
        with pytest.raises(ValueError, match=f"sections=3 does not split head dim {D} into equal even parts"):
            apply_half_rope(x, x, x, 3)
        with pytest.raises(ValueError, match=f"sections=3 does not split head dim {D}"):
            apply_rope(x, HalfRope(x, x, 3))
    x, cos, sin = torch.randn(3, 1, 5, 2, 18, dtype=torch.float64)      # 3 parts of 6: each rotated on its own
    half = torch.cat([torch.cat([-p[..., 3:], p[..., :3]], -1) for p in x.chunk(3, -1)], -1)
    torch.testing.assert_close(apply_half_rope(x, cos, sin, 3), x * cos + half * sin, rtol=0, atol=1e-12)


@pytest.mark.parametrize("sections", [1, 3])
def test_half_rope_with_fp32_tables_keeps_the_dtype_of_x(sections):
    """Mutation find: rotate-half RoPE returns x's dtype, as the fused gather does (Allegro passes fp32 tables with
    bf16 activations); dropping the cast back survived, as every CPU test ran x and its tables in one dtype. The
    values are the fp32 rotation rounded once."""
    from videosparse.layout import head_tiling
    from videosparse.rope import HalfRope, apply_half_rope

    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 24, 2, 12, generator=g).to(torch.bfloat16)
    cos, sin = torch.randn(2, 1, 24, 1, 12, generator=g)
    out = apply_half_rope(x, cos, sin, sections)
    half = torch.cat([torch.cat([-p[..., p.shape[-1] // 2:], p[..., :p.shape[-1] // 2]], -1)
                      for p in x.float().chunk(sections, -1)], -1)
    assert out.dtype == torch.bfloat16 and torch.equal(out, (x.float() * cos + half * sin).to(torch.bfloat16))
    layout = head_tiling((2, 3, 4), (1, 2, 4), 2, 8)
    gathered = layout.gather(x, HalfRope(cos, sin, sections))
    assert gathered.dtype == torch.bfloat16 and torch.equal(gathered, layout.gather(out))


def test_the_fused_gather_refuses_per_head_and_foreign_device_tables():
    """Mutation finds: the fused kernel reads Wan's and rotate-half tables as [1, S, 1, D] (one row for every head)
    on x's device; dropping the check of the head dim (per-head tables [1, S, H, D] would be read as head 0's) or of
    the device survived. Forced onto the kernel, each is refused with its reason."""
    from videosparse.rope import HalfRope, rope_gather

    x = torch.randn(1, 8, 2, 8)
    perm = torch.arange(8)
    cos, sin = torch.randn(2, 1, 8, 2, 8)
    for rope in ((cos, sin), HalfRope(cos, sin)):
        with pytest.raises(ValueError, match=r"freqs_cos has shape \(1, 8, 2, 8\), not \(1, 8, 1, 8\)"):
            rope_gather(x, perm, rope, backend="triton")
    cos, sin = torch.randn(2, 1, 8, 1, 8, device="meta")
    with pytest.raises(ValueError, match="freqs_cos is on meta, x on cpu"):
        rope_gather(x, perm, (cos, sin), backend="triton")


def test_the_fused_gather_refuses_tensor_subclasses_and_tangents_on_the_tables():
    """Mutation finds: the fused kernel reads plain tensors and drops tangents; a tensor subclass (quantized
    activations) and a forward-mode tangent on the rotary tables alone (not on x) must each send the call to the torch
    path, with its reason when the kernel is forced (dropping either check survived)."""
    import torch.autograd.forward_ad as fwAD

    from videosparse.rope import rope_gather

    class Tagged(torch.Tensor):
        pass

    x = torch.randn(1, 8, 2, 8)
    perm = torch.arange(8)
    cos, sin = torch.randn(2, 1, 8, 1, 8)
    with pytest.raises(ValueError, match="x is a Tagged \\(a tensor subclass"):
        rope_gather(x.as_subclass(Tagged), perm, (cos, sin), backend="triton")
    with fwAD.dual_level():
        dual = fwAD.make_dual(cos, torch.ones_like(cos))
        with pytest.raises(ValueError, match="forward-mode AD gives x or the tables a tangent"):
            rope_gather(x, perm, (dual, sin), backend="triton")
