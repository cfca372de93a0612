"""Checks of the reference model: prompt adherence of generated clips, and structure of its attention.

* `analyse_clip` finds the object of a generated clip (saturated pixels: every background is gray,
  every object colour is saturated), names its colour (nearest palette colour of the median object
  pixel) and measures how its centroid moves between the first and the last quarter of the frames.
  `adherence_rate` generates one clip per prompt and counts the prompts whose colour and direction
  both match.
* `attention_tile_mass` runs the dense model and, for chosen self-attention layers, measures which
  fraction of the attention mass the best `top_fraction` of key tiles (per query tile, chosen from the
  dense attention itself: the oracle) capture, with 128-token 3D tiles of `videosparse.layout.TileLayout`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import numpy as np
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, _get_qkv_projections

from ..layout import TileLayout
from ..rope import apply_interleaved_rope
from .reference import video_token_grid
from .reference_data import COLORS, DIRECTIONS, parse_prompt

def _adherence_prompts() -> tuple[str, ...]:
    shapes = ("circle", "square", "triangle", "ring", "cross")
    backgrounds = ("dark", "light", "gray", "gradient")
    pairs = [(c, d) for c in COLORS for d in DIRECTIONS]
    return tuple(f"a {c} {shapes[i % 5]} moving {d} on a {backgrounds[(i // 5) % 4]} background"
                 for i, (c, d) in enumerate(pairs))


ADHERENCE_PROMPTS: tuple[str, ...] = _adherence_prompts()
"""32 prompts: every colour with every direction, shapes and backgrounds cycled."""

_PALETTE_NAMES = tuple(COLORS)
_PALETTE = np.array([COLORS[c] for c in _PALETTE_NAMES], dtype=np.float32)


@dataclass
class ClipAnalysis:
    """What `analyse_clip` found: colour name (or None), displacement (dx, dy) in units of the shorter side
    (y down), direction ("left", "right", "up", "down" or None if it moved less than `min_move`), and the
    fraction of frames in which an object was found."""

    color: str | None
    dx: float
    dy: float
    direction: str | None
    found_fraction: float


def analyse_clip(frames: np.ndarray, *, saturation: float = 0.3, min_pixels: int = 3,
                 min_move: float = 0.08) -> ClipAnalysis:
    """Find the coloured object of a clip and how it moves.

    Args:
        frames: float [T, H, W, 3] in [0, 1] (a pipeline's np output for one clip).
        saturation: max(rgb) - min(rgb) above which a pixel belongs to the object.
        min_pixels: object pixels a frame needs for its centroid to count.
        min_move: smallest centroid travel (units of the shorter side) that counts as a direction.
    """
    frames = np.asarray(frames, dtype=np.float32)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [T, H, W, 3], got shape {frames.shape}.")
    T, H, W, _ = frames.shape
    sat = frames.max(-1) - frames.min(-1)
    mask = sat > saturation                                                   # [T,H,W]
    counts = mask.reshape(T, -1).sum(1)
    valid = counts >= min_pixels
    if not valid.any():
        return ClipAnalysis(None, 0.0, 0.0, None, 0.0)
    pixels = frames[mask]
    median = np.median(pixels, axis=0)
    color = _PALETTE_NAMES[int(np.argmin(((_PALETTE - median) ** 2).sum(1)))]
    ys, xs = np.mgrid[0:H, 0:W].astype(np.float32)
    m = float(min(H, W))
    cx = np.array([(xs * mk).sum() / max(mk.sum(), 1) for mk in mask]) / m
    cy = np.array([(ys * mk).sum() / max(mk.sum(), 1) for mk in mask]) / m
    idx = np.flatnonzero(valid)
    q = max(1, T // 4)
    first = idx[idx < q] if (idx < q).any() else idx[:1]
    last = idx[idx >= T - q] if (idx >= T - q).any() else idx[-1:]
    dx = float(cx[last].mean() - cx[first].mean())
    dy = float(cy[last].mean() - cy[first].mean())
    direction = None
    if max(abs(dx), abs(dy)) >= min_move:
        direction = ("right" if dx > 0 else "left") if abs(dx) >= abs(dy) else ("down" if dy > 0 else "up")
    return ClipAnalysis(color, dx, dy, direction, float(valid.mean()))


def clip_adheres(prompt: str, frames: np.ndarray) -> dict:
    """Whether a clip shows the prompt's colour moving in the prompt's direction (plus the analysis)."""
    spec = parse_prompt(prompt)
    if spec.motion not in DIRECTIONS:
        raise ValueError(f"prompt {prompt!r} has motion {spec.motion!r}; adherence is measured for "
                         f"directional motions {DIRECTIONS}.")
    a = analyse_clip(frames)
    color_ok = a.color == spec.color
    direction_ok = a.direction == spec.motion
    return {"prompt": prompt, "ok": color_ok and direction_ok, "color_ok": color_ok,
            "direction_ok": direction_ok, **asdict(a)}


@torch.no_grad()
def adherence_rate(pipe, prompts: Sequence[str] = ADHERENCE_PROMPTS, *, num_frames: int = 16, height: int = 64,
                   width: int = 64, num_inference_steps: int = 10, guidance_scale: float = 4.0, seed: int = 0,
                   batch_size: int = 8) -> dict:
    """Generate one clip per prompt (noise seeded per prompt index) and score each with `clip_adheres`.

    Returns:
        {"rate": fraction of prompts passing, "color_rate", "direction_rate", "per_prompt": [...]}.
    """
    results = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        noise = torch.stack([
            torch.randn(3, num_frames, height, width, generator=torch.Generator().manual_seed(seed + start + i))
            for i in range(len(chunk))])
        frames = pipe(chunk, num_frames=num_frames, height=height, width=width,
                      num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                      latents=noise.to(pipe.transformer.device), output_type="np").frames
        results += [clip_adheres(p, f) for p, f in zip(chunk, frames)]
    n = max(1, len(results))
    return {"rate": sum(r["ok"] for r in results) / n, "color_rate": sum(r["color_ok"] for r in results) / n,
            "direction_rate": sum(r["direction_ok"] for r in results) / n, "num_prompts": len(results),
            "per_prompt": results}


@torch.no_grad()
def direction_word_separation(pipe, template: str = "a {color} circle moving {direction} on a dark background") -> dict:
    """How differently the text encoder encodes opposite directions, relative to different axes.

    For every colour, the largest per-token distance between the encodings of "left" and "right" (and of "up"
    and "down") prompts, divided by the one between "left" and "up" prompts. Near 0: the encoder has merged
    the two directions of an axis, so no sampler setting can make the model follow them (the weights
    shipped after three training stages are at 0.14: left/right 0.57, up/down 2.0, left/up 9.4; random
    weights at about 1); a model that follows the direction words needs a ratio well away from 0.

    Returns:
        {"opposite_over_axis": mean ratio, "left_right": mean distance, "up_down": ..., "left_up": ...}
    """
    from .reference import encode_text

    device = pipe.text_encoder.device

    def enc(direction):
        prompts = [template.format(color=c, direction=direction) for c in COLORS]
        return encode_text(pipe.tokenizer, pipe.text_encoder, prompts, device).float()

    e = {d: enc(d) for d in DIRECTIONS}

    def dist(a, b):
        return (e[a] - e[b]).norm(dim=-1).amax(dim=-1)                 # [colours]

    lr, ud, lu = dist("left", "right"), dist("up", "down"), dist("left", "up")
    return {"opposite_over_axis": float(((lr + ud) / 2 / lu).mean()), "left_right": float(lr.mean()),
            "up_down": float(ud.mean()), "left_up": float(lu.mean())}


@torch.no_grad()
def direction_prompt_gap(pipe, *, sigmas: Sequence[float] = (0.99, 0.95, 0.9, 0.8, 0.6), num_clips: int = 16,
                         num_frames: int = 16, height: int = 32, width: int = 32, seed: int = 1) -> dict:
    """Whether the transformer uses the direction word: its x0 error on rendered left / right / up / down clips
    when prompted with the true direction, the opposite one, or nothing (same clips, same noise).

    The x0 error of a velocity prediction v at noise level s is s**2 times the velocity MSE. A model that
    follows the direction word has a lower error with the true word than with the opposite one at high noise,
    where the clip itself does not show its motion yet; equal errors mean the word is ignored.

    Returns:
        {"sigma": [...], "correct": [...], "opposite": [...], "empty": [...]} (x0 MSE per noise level).
    """
    from .reference_data import render_clips, reversed_twin, sample_specs
    from .reference_train import flow_matching_loss

    device = pipe.transformer.device
    dtype = pipe.transformer.dtype
    g = torch.Generator().manual_seed(seed)
    specs = sample_specs(num_clips, g, p_directional=1.0)
    video = render_clips(specs, num_frames, height, width, generator=g).to(device, dtype)
    noise = torch.randn(video.shape, generator=g).to(device, dtype)
    prompt_sets = {"correct": [s.prompt for s in specs], "opposite": [reversed_twin(s).prompt for s in specs],
                   "empty": [""] * num_clips}
    out: dict = {"sigma": [float(s) for s in sigmas], **{k: [] for k in prompt_sets}}
    for name, prompts in prompt_sets.items():
        for s in sigmas:
            level = torch.full((num_clips,), float(s), device=device)
            loss = flow_matching_loss(pipe.transformer, pipe.text_encoder, pipe.tokenizer, video, prompts, level, noise)
            out[name].append(round(float(loss) * s * s, 5))
    return out


def tile_mass_fraction(q: torch.Tensor, k: torch.Tensor, layout: TileLayout, top_fraction: float = 0.1,
                       chunk: int = 512) -> torch.Tensor:
    """Per head and query tile, the attention mass held by the top `top_fraction` of key tiles (oracle).

    Args:
        q, k: [H, S, D] (one batch element, after qk-norm and RoPE, diffusers token order).
        layout: tile layout of the S video tokens.
        top_fraction: fraction of key tiles kept (rounded up, at least 1).

    Returns:
        float32 [H, num_tiles]: the mass each query tile's best key tiles hold (1.0 = all of it).
    """
    Hh, S, D = q.shape
    perm = layout.perm.to(q.device)
    q, k = q[:, perm].float(), k[:, perm].float()
    n_tiles = layout.num_tiles
    block = layout.block
    keep = max(1, math.ceil(top_fraction * n_tiles))
    tile_of_key = torch.arange(S, device=q.device) // block
    mass = torch.zeros(Hh, n_tiles, n_tiles, device=q.device)
    tile_of_query = torch.arange(S, device=q.device) // block
    scale = 1.0 / math.sqrt(D)
    for s0 in range(0, S, chunk):
        p = torch.softmax((q[:, s0:s0 + chunk] @ k.transpose(-1, -2)) * scale, dim=-1)   # [H, c, S]
        per_tile = torch.zeros(Hh, p.shape[1], n_tiles, device=q.device).index_add_(2, tile_of_key, p)
        mass.index_add_(1, tile_of_query[s0:s0 + chunk], per_tile)
    mass = mass / layout.tile_len.to(q.device, torch.float32)[None, :, None]   # each row sums to 1
    return mass.topk(keep, dim=-1).values.sum(-1)


class _TileMassProcessor(WanAttnProcessor):
    """Stock Wan attention that, for self-attention calls, also records the oracle top-tile mass."""

    def __init__(self, layer: int, sink: dict, state: dict, top_fraction: float, tile: tuple[int, int, int]):
        super().__init__()
        self.layer, self.sink, self.state, self.top_fraction, self.tile = layer, sink, state, top_fraction, tile

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is None and self.state.get("grid") is not None:
            query, key, _ = _get_qkv_projections(attn, hidden_states, None)
            query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
            key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
            if rotary_emb is not None:
                query, key = apply_interleaved_rope(query, *rotary_emb), apply_interleaved_rope(key, *rotary_emb)
            layout = TileLayout(grid=self.state["grid"], tile=self.tile, block=math.prod(self.tile))
            for b in range(query.shape[0]):
                frac = tile_mass_fraction(query[b].transpose(0, 1), key[b].transpose(0, 1), layout,
                                          self.top_fraction)
                self.sink.setdefault(self.layer, []).append(frac.mean(dim=1).cpu())
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


@torch.no_grad()
def attention_tile_mass(pipe, prompts: Sequence[str], *, layers: Iterable[int] | None = None,
                        num_frames: int = 16, height: int = 64, width: int = 64, num_inference_steps: int = 10,
                        guidance_scale: float = 4.0, tile: tuple[int, int, int] = (4, 4, 8),
                        top_fraction: float = 0.1, seed: int = 0) -> dict:
    """Mean oracle top-tile attention mass per self-attention layer, over steps, branches, heads and prompts.

    The pipeline's processors are swapped for recording ones during the call and restored afterwards.

    Returns:
        {"per_layer": {layer: mass}, "per_layer_head": {layer: [mass per head]}, "mean": mass over layers,
         "uniform": the mass a uniform attention would give (= kept tiles / tiles), "tile": ..., "grid": ...}
    """
    transformer = pipe.transformer
    blocks = transformer.blocks
    layers = list(range(len(blocks))) if layers is None else list(layers)
    grid = video_token_grid(num_frames, height, width, transformer.config.patch_size)
    sink: dict[int, list[torch.Tensor]] = {}
    state = {"grid": grid}
    originals = {i: blocks[i].attn1.processor for i in layers}
    try:
        for i in layers:
            blocks[i].attn1.set_processor(_TileMassProcessor(i, sink, state, top_fraction, tile))
        for j, prompt in enumerate(prompts):
            noise = torch.randn(1, 3, num_frames, height, width, generator=torch.Generator().manual_seed(seed + j))
            pipe(prompt, num_frames=num_frames, height=height, width=width, num_inference_steps=num_inference_steps,
                 guidance_scale=guidance_scale, latents=noise.to(transformer.device), output_type="latent")
    finally:
        for i, proc in originals.items():
            blocks[i].attn1.set_processor(proc)
    layout = TileLayout(grid=grid, tile=tile, block=math.prod(tile))
    per_head = {i: torch.stack(sink[i]).mean(0) for i in layers}
    return {
        "per_layer": {i: float(per_head[i].mean()) for i in layers},
        "per_layer_head": {i: [round(float(v), 4) for v in per_head[i]] for i in layers},
        "mean": float(torch.stack([per_head[i].mean() for i in layers]).mean()),
        "uniform": max(1, math.ceil(top_fraction * layout.num_tiles)) / layout.num_tiles,
        "tile": list(tile), "grid": list(grid), "num_tiles": layout.num_tiles, "top_fraction": top_fraction,
    }
