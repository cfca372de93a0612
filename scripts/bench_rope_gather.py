"""RoPE fused with the tile-order gather vs the processors' torch rotation then the gather (GPU), per q or k tensor at
the real sizes of the models that use each style: Wan's interleaved tables, diffusers' `apply_rotary_emb` pairs on the
video rows of a joint sequence (HunyuanVideo, HunyuanVideo 1.5, CogVideoX), angles per pair (Mochi's per head,
Kandinsky 5's shared by the heads), rotate-half (Cosmos-Predict2.5, Cosmos 3 with its 8 KV heads repeated to 32, and
Allegro's in each third of its head dim 96).
Checks each fused output against the float64 rotation first.

    python scripts/bench_rope_gather.py            # -> benchmarks/rope_gather_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# name: (style, grid, query heads, KV heads, head dim, text rows, text position, self-attention layers per forward)
SHAPES = {
    "Wan 1.3B 480P": ("interleaved", (21, 30, 52), 12, 12, 128, 0, "after", 30),
    "Wan 14B 720P": ("interleaved", (21, 45, 80), 40, 40, 128, 0, "after", 40),
    "HunyuanVideo 720P": ("pairs", (33, 45, 80), 24, 24, 128, 256, "after", 60),
    "HunyuanVideo 1.5 480P": ("pairs", (31, 30, 53), 16, 16, 128, 256, "after", 54),
    "CogVideoX 5B": ("pairs", (13, 30, 45), 48, 48, 64, 226, "before", 42),
    "Mochi 1 480P": ("head_pairs", (28, 30, 53), 24, 24, 128, 256, "after", 48),
    "Kandinsky 5.0 Video Pro": ("shared_pairs", (31, 48, 64), 32, 32, 128, 0, "after", 60),
    "Cosmos-Predict2.5 2B": ("half", (24, 44, 80), 16, 16, 128, 0, "after", 28),
    "Cosmos 3 720P": ("half", (48, 23, 40), 32, 8, 128, 256, "after", 36),
    "Allegro 720P": ("half3", (22, 45, 80), 24, 24, 96, 0, "after", 32),
}


def _inputs(style, S, video, text, text_position, H_kv, D, device):
    """x [1, S, H_kv, D] bf16 and the rope object of `style` (fp32 tables, the video rows for pairs)."""
    import torch

    from videosparse.rope import HalfRope, HeadPairRope, PairRope

    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(1, S, H_kv, D, device=device, generator=g, dtype=torch.bfloat16)
    rows = video if style in ("pairs", "head_pairs") else S
    if style in ("head_pairs", "shared_pairs"):    # one angle per pair and head, or per pair for all heads
        heads = H_kv if style == "head_pairs" else 1
        angle = torch.rand(rows, heads, D // 2, device=device, generator=g, dtype=torch.float64) * 50
        return x, HeadPairRope(angle.cos().float(), angle.sin().float())
    angle = torch.rand(rows, D // 2, device=device, generator=g, dtype=torch.float64) * 50
    if style in ("half", "half3"):      # each section's two halves share their angles
        sections = 3 if style == "half3" else 1
        cos, sin = (torch.cat([p for part in t.chunk(sections, -1) for p in (part, part)], -1).float()
                    for t in (angle.cos(), angle.sin()))
        return x, HalfRope(cos[None, :, None], sin[None, :, None], sections)
    cos, sin = (t.repeat_interleave(2, -1).float() for t in (angle.cos(), angle.sin()))
    if style == "pairs":
        return x, PairRope(cos, sin, text if text_position == "before" else 0)
    return x, (cos[None, :, None], sin[None, :, None])


def main(argv=None):
    import torch

    from _bench import bench, rel, require_cuda, versions
    from videosparse.layout import TileLayout
    from videosparse.rope import apply_rope

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/rope_gather_h200.json")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)
    require_cuda(__file__)
    rows = []
    for name in args.shapes:
        style, grid, H, H_kv, D, text, position, layers = SHAPES[name]
        video = grid[0] * grid[1] * grid[2]
        S, groups = video + text, H // H_kv
        x, rope = _inputs(style, S, video, text, position, H_kv, D, "cuda")
        layout = TileLayout(grid, (4, 4, 8), text_len=text, text_position=position)
        fused = layout.gather(x, rope, groups)
        doubled = [t.double() if torch.is_tensor(t) else t for t in rope]
        exact = type(rope)(*doubled) if hasattr(rope, "_fields") else tuple(doubled)
        ref = layout.gather(apply_rope(x.double(), exact), groups=groups)
        err = rel(fused, ref)
        stock_err = rel(layout.gather(apply_rope(x, rope), groups=groups), ref)
        del ref
        torch_ms = bench(lambda: layout.gather(apply_rope(x, rope), groups=groups))
        fused_ms = bench(lambda: layout.gather(x, rope, groups))
        rows.append(dict(shape=name, style=style, tokens=S, heads=H, kv_heads=H_kv, head_dim=D, text=text,
                         torch_ms=torch_ms, fused_ms=fused_ms, speedup=torch_ms / fused_ms, rel_err_fused=err,
                         rel_err_torch=stock_err, saved_ms_per_forward=2 * layers * (torch_ms - fused_ms)))
        print(f"{name:24s} {style:11s} torch {torch_ms:7.3f} ms  fused {fused_ms:6.3f} ms  "
              f"{torch_ms / fused_ms:5.1f}x  rel err fused {err:.1e} (torch {stock_err:.1e})  "
              f"~{rows[-1]['saved_ms_per_forward']:.0f} ms per forward (q and k, {layers} layers)", flush=True)
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(dict(
        what="per q or k tensor (bf16, fp32 tables): the processors' torch rotation (videosparse.rope.apply_rope, the "
             "stock math) then the tile-order gather, vs the fused rope_gather kernel (layout.gather(x, rope, "
             "groups)); rel_err against the float64 rotation; saved_ms_per_forward = 2 x layers x the difference",
        versions=versions(), device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
