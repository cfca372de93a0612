"""Per-head tile shapes: the memory a layer's tiling keeps between calls and the time of its gathers and scatter
(GPU), against keeping the [heads, tokens] orders (what `HeadTiling` kept until 2026-12-06, and still keeps up to
`videosparse.layout.KEEP_HEAD_ORDERS_BYTES`).

Past that size `HeadTiling` keeps one order per distinct tile shape ([shapes, S] int64, and its inverse) and
expands the [heads, S] index for each gather and scatter. This times, at the real sizes, with half the heads in one
shape and half in another: q's gather with Wan's RoPE fused (`rope_gather`), v's gather (no RoPE), the output's
scatter, each with the expanded index and with a kept one, and checks that both give the same tensors.

    python scripts/bench_head_tiling.py            # -> benchmarks/head_tiling_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# name: (grid, heads, head dim, self-attention layers per forward)
SHAPES = {
    "Wan 1.3B 480P": ((21, 30, 52), 12, 128, 30),
    "Wan 14B 720P": ((21, 45, 80), 40, 128, 40),
}
TILES = ((4, 4, 8), (2, 8, 8))


def _cached_bytes(tiling, kept: bool) -> int:
    """Bytes of the CUDA tensors `tiling` keeps for its calls (`kept`: only the kept [heads, S] orders)."""
    import torch

    seen, total = set(), 0
    for key, value in tiling._device_cache.items():
        if kept != (isinstance(key, tuple) and key[0] == "kept"):
            continue
        for t in value if isinstance(value, tuple) else ():
            if torch.is_tensor(t) and t.is_cuda and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def _measure(keep_bytes: int) -> list[dict]:
    """One row per shape of `SHAPES`: the expanded (package) and kept (former) per-head orders' sizes and times
    (`keep_bytes`: the package's `KEEP_HEAD_ORDERS_BYTES`, set to 0 by the caller while this runs)."""
    import torch

    from _bench import bench
    from videosparse.layout import HeadTiling, head_tiling

    class KeptOrders(HeadTiling):
        """The former behaviour: the [heads, S] orders built once and kept."""

        def _head_order(self, device, inverse=False):
            if ("kept",) not in self._device_cache:
                self._device_cache[("kept",)] = self.head_indices(device)      # (perm, inv), as before
            return self._device_cache[("kept",)][int(inverse)]

    rows = []
    for name, (grid, H, D, layers) in SHAPES.items():
        tiles = [TILES[h * len(TILES) // H] for h in range(H)]
        now = head_tiling(grid, tiles, H)
        kept = KeptOrders(now.grid, now.tiles, now.block)
        S = now.seq_len
        g = torch.Generator("cuda").manual_seed(0)
        x = torch.randn(1, S, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
        angle = torch.rand(S, D // 2, device="cuda", generator=g) * 50
        rope = tuple(t.repeat_interleave(2, -1)[None, :, None] for t in (angle.cos(), angle.sin()))
        y = torch.randn(1, H, S, D, device="cuda", generator=g, dtype=torch.bfloat16)
        ops = {"q_gather_rope_ms": lambda t: t.gather(x, rope), "v_gather_ms": lambda t: t.gather(x),
               "scatter_ms": lambda t: t.scatter(y)}
        times = {}
        for label, tiling in (("expanded", now), ("kept", kept)):
            for op, fn in ops.items():
                times[f"{label}_{op}"] = bench(lambda: fn(tiling))
            times[f"{label}_cached_mb"] = _cached_bytes(tiling, label == "kept") / 2**20
        same = all(torch.equal(fn(now), fn(kept)) for fn in ops.values())
        step = {label: 2 * times[f"{label}_q_gather_rope_ms"] + times[f"{label}_v_gather_ms"]
                + times[f"{label}_scatter_ms"] for label in ("expanded", "kept")}
        rows.append(dict(shape=name, tokens=S, heads=H, head_dim=D, tiles=[list(t) for t in TILES], same_outputs=same,
                         package_keeps=2 * 8 * H * S <= keep_bytes,
                         **times, layer_ms_expanded=step["expanded"], layer_ms_kept=step["kept"],
                         added_ms_per_forward=layers * (step["expanded"] - step["kept"]),
                         saved_mb_per_forward_layers=layers * (times["kept_cached_mb"] - times["expanded_cached_mb"])))
        print(f"{name:14s} kept {times['kept_cached_mb']:5.1f} MB -> {times['expanded_cached_mb']:4.1f} MB a layer; "
              f"q+k gathers, v gather, scatter {step['kept']:.3f} -> {step['expanded']:.3f} ms a layer "
              f"(+{rows[-1]['added_ms_per_forward']:.2f} ms per forward of {layers} layers); same outputs: {same}",
              flush=True)
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    import torch

    from _bench import require_cuda, versions
    import videosparse.layout as layout_module

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/head_tiling_h200.json")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    keep_bytes = layout_module.KEEP_HEAD_ORDERS_BYTES
    layout_module.KEEP_HEAD_ORDERS_BYTES = 0            # `now` expands at every size (kept ones: `KeptOrders`)
    try:
        rows = _measure(keep_bytes)
    finally:                                            # (a caller in this process gets the package's setting back)
        layout_module.KEEP_HEAD_ORDERS_BYTES = keep_bytes
    Path(args.out).write_text(json.dumps(dict(
        what="per-head tile shapes (half the heads 4x4x8, half 2x8x8), bf16, batch 1: the index tensors a layer's "
             "HeadTiling keeps on the GPU and the time of its gathers (q with Wan's RoPE fused, v without) and "
             "scatter, expanding the [heads, S] index from per-shape orders on each call ('expanded', the package's "
             "past KEEP_HEAD_ORDERS_BYTES) vs keeping it ('kept', the former behaviour; package_keeps: the package "
             "keeps it at this size); "
             "layer_ms = 2 x q gather + v gather + scatter",
        versions=versions(), device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
