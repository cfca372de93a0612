"""Procedural text-to-video clips for the reference model: coloured shapes that move on plain backgrounds.

Every clip is one shape (circle, square, triangle, ring, cross) of one colour that moves left, right,
up or down, bounces, rotates or grows on a dark, light, gray or gradient background, with a prompt
made from templates ("a red circle moving left on a dark background"). Clips are rendered in batch
with tensor ops (anti-aliased signed distances), on any device, so training makes its data on the fly.

Coordinates are in units of the shorter side of the frame: x in [0, W/m], y in [0, H/m] with
m = min(H, W), y pointing down, so one clip description renders at any resolution.

    specs = sample_specs(8, generator=torch.Generator().manual_seed(0))
    video = render_clips(specs, num_frames=16, height=64, width=64)   # [8, 3, 16, 64, 64] in [-1, 1]
    prompts = [s.prompt for s in specs]
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.12, 0.12),
    "green": (0.12, 0.75, 0.22),
    "blue": (0.15, 0.30, 0.95),
    "yellow": (0.95, 0.88, 0.10),
    "orange": (1.00, 0.55, 0.05),
    "purple": (0.58, 0.20, 0.85),
    "cyan": (0.10, 0.85, 0.90),
    "pink": (1.00, 0.50, 0.78),
}
SHAPES = ("circle", "square", "triangle", "ring", "cross")
DIRECTIONS = ("left", "right", "up", "down")
OPPOSITE: dict[str, str] = {"left": "right", "right": "left", "up": "down", "down": "up"}
"""The direction a directional clip shows when played backwards."""
MOTIONS = DIRECTIONS + ("bouncing", "rotating", "growing")
BACKGROUNDS = ("dark", "light", "gray", "gradient")
SIZES = ("small", "large")
TEMPLATES = (
    "a {adj} {shape} {motion} on a {background} background",
    "{adj} {shape} {motion}, {background} background",
)
# every word a prompt can hold, in a fixed order (the tokenizer's vocabulary after its special tokens)
VOCABULARY = tuple(
    ["a", "an", "the", "on", "background", "moving", ","]
    + list(COLORS) + list(SHAPES) + list(MOTIONS) + list(BACKGROUNDS) + list(SIZES)
)
DEFAULT_PROMPT = "a red circle moving right on a dark background"

_GRAY = {"dark": (0.03, 0.12), "light": (0.84, 0.95), "gray": (0.44, 0.56)}
_MARGIN = 0.03


@dataclass(frozen=True)
class ClipSpec:
    """What one clip shows; `render_clips` draws the random details (position, speed, exact size, shade).

    Args:
        color: a key of `COLORS`.
        shape: one of `SHAPES`.
        motion: one of `MOTIONS`.
        background: one of `BACKGROUNDS`.
        size: "small", "large" or None (any size).
        template: index into `TEMPLATES`.
    """

    color: str
    shape: str
    motion: str
    background: str
    size: str | None = None
    template: int = 0

    def __post_init__(self) -> None:
        for name, value, allowed in (("color", self.color, tuple(COLORS)), ("shape", self.shape, SHAPES),
                                     ("motion", self.motion, MOTIONS), ("background", self.background, BACKGROUNDS),
                                     ("size", self.size, SIZES + (None,)),
                                     ("template", self.template, tuple(range(len(TEMPLATES))))):
            if value not in allowed:
                raise ValueError(f"ClipSpec.{name}={value!r} is not allowed; choose one of {allowed}.")

    @property
    def prompt(self) -> str:
        adj = self.color if self.size is None else f"{self.size} {self.color}"
        motion = f"moving {self.motion}" if self.motion in DIRECTIONS else self.motion
        return TEMPLATES[self.template].format(adj=adj, shape=self.shape, motion=motion, background=self.background)


def parse_prompt(prompt: str) -> ClipSpec:
    """The `ClipSpec` a template prompt describes (words outside the vocabulary are ignored).

    Raises:
        ValueError: if the prompt names no colour, shape, motion or background.
    """
    words = prompt.lower().replace(",", " , ").split()

    def pick(options, what):
        found = [w for w in words if w in options]
        if not found:
            raise ValueError(f"prompt {prompt!r} names no {what}; one of {tuple(options)} is needed.")
        return found[0]

    size = next((w for w in words if w in SIZES), None)
    return ClipSpec(pick(COLORS, "colour"), pick(SHAPES, "shape"), pick(MOTIONS, "motion"),
                    pick(BACKGROUNDS, "background"), size, 1 if "," in words else 0)


def sample_specs(n: int, generator: torch.Generator | None = None, *, p_size_word: float = 0.5,
                 p_directional: float | None = None) -> list[ClipSpec]:
    """`n` clip descriptions drawn uniformly (colour, shape, motion, background, template, size word).

    Args:
        p_directional: probability that a clip moves left / right / up / down (the other motions share the
            rest); None draws the motion uniformly over `MOTIONS` (4 / 7 directional).
    """
    if p_directional is not None and not 0.0 <= p_directional <= 1.0:
        raise ValueError(f"p_directional={p_directional} must lie in [0, 1].")
    seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    rng = random.Random(seed)
    others = [m for m in MOTIONS if m not in DIRECTIONS]
    out = []
    for _ in range(n):
        color = rng.choice(list(COLORS))
        shape = rng.choice(SHAPES)
        if p_directional is None:
            motion = rng.choice(MOTIONS)
        else:
            motion = rng.choice(DIRECTIONS) if rng.random() < p_directional else rng.choice(others)
        out.append(ClipSpec(
            color=color, shape=shape, motion=motion,
            background=rng.choice(BACKGROUNDS), size=rng.choice(SIZES) if rng.random() < p_size_word else None,
            template=rng.randrange(len(TEMPLATES)),
        ))
    return out


def check_travel(travel) -> tuple[float, float]:
    """`travel` as (shortest, longest) floats; ValueError unless 0 < shortest <= longest."""
    try:
        travel = tuple(float(t) for t in travel)
    except (TypeError, ValueError):
        raise ValueError(f"travel={travel!r} must be (shortest, longest) with 0 < shortest <= longest.") from None
    if len(travel) != 2 or not 0.0 < travel[0] <= travel[1]:
        raise ValueError(f"travel={travel} must be (shortest, longest) with 0 < shortest <= longest.")
    return travel


def _uniform(lo, hi, generator, device):
    """One uniform sample per element of the broadcast of lo and hi (float32 tensors)."""
    lo, hi = torch.broadcast_tensors(torch.as_tensor(lo, dtype=torch.float32), torch.as_tensor(hi, dtype=torch.float32))
    u = torch.rand(lo.shape, generator=generator)
    return (lo + (hi - lo) * u).to(device)


def _signed_distance(shape_id: torch.Tensor, u: torch.Tensor, v: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Approximate signed distance (negative inside) of each shape, in local rotated coordinates.

    shape_id: int64 [B,1,1,1]; u, v: [B,T,H,W]; r: [B,T,1,1] (the shape's outer radius).
    """
    au, av = u.abs(), v.abs()
    dist = torch.sqrt(u * u + v * v)
    circle = dist - r
    square = torch.maximum(au, av) - 0.85 * r
    # equilateral triangle pointing up (y down): outward edge normals at 90, 210 and 330 degrees
    rho = 0.62 * r
    tri = torch.maximum(torch.maximum(v, -0.866 * u - 0.5 * v), 0.866 * u - 0.5 * v) - rho
    ring = (dist - 0.75 * r).abs() - 0.25 * r
    arm = 0.34 * r
    cross = torch.minimum(torch.maximum(au - r, av - arm), torch.maximum(au - arm, av - r))
    stack = torch.stack([circle, square, tri, ring, cross])                 # [5,B,T,H,W]
    idx = shape_id.expand_as(u).unsqueeze(0)
    return torch.gather(stack, 0, idx).squeeze(0)


def render_clips(
    specs: list[ClipSpec],
    num_frames: int = 16,
    height: int = 64,
    width: int = 64,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    return_params: bool = False,
    travel: tuple[float, float] = (0.3, 0.6),
):
    """Render clips of the given descriptions.

    Random details (start position, travel, speed, exact radius, shade of colour and background)
    come from `generator` (a CPU generator; the draws are moved to `device`).

    Args:
        specs: one `ClipSpec` per clip.
        num_frames, height, width: clip size in frames and pixels.
        generator: CPU `torch.Generator` for the random details.
        device: where the clips are rendered.
        return_params: also return a dict of per-clip tensors (`cx`, `cy`, `r`, `angle`: [B, T]).
        travel: (shortest, longest) distance a left / right / up / down clip moves, in units of the shorter
            side (capped by the room the frame leaves); the start is drawn so the whole path fits.

    Returns:
        float32 [B, 3, T, H, W] in [-1, 1] (and the parameter dict if `return_params`).
    """
    if not specs:
        raise ValueError("render_clips needs at least one ClipSpec.")
    if num_frames < 2 or height < 8 or width < 8:
        raise ValueError(f"clip size (num_frames={num_frames}, height={height}, width={width}) is too small; "
                         "need num_frames >= 2 and height, width >= 8.")
    travel_lo, travel_hi = check_travel(travel)
    B, T = len(specs), num_frames
    m = float(min(height, width))
    X, Y = width / m, height / m
    g = generator

    def per_clip(values):
        return torch.tensor(values, dtype=torch.float32)

    motion = [s.motion for s in specs]
    size_lo = per_clip([{"small": 0.07, "large": 0.14, None: 0.07}[s.size] for s in specs])
    size_hi = per_clip([{"small": 0.10, "large": 0.18, None: 0.18}[s.size] for s in specs])
    r0 = _uniform(size_lo, size_hi, g, "cpu")                                # [B]
    s = torch.linspace(0.0, 1.0, T)[None, :]                                  # [1,T]
    cx = torch.zeros(B, T)
    cy = torch.zeros(B, T)
    r = r0[:, None].expand(B, T).clone()
    angle = torch.zeros(B, T)
    for i, mo in enumerate(motion):
        ri = float(r0[i])
        lo = ri + _MARGIN
        if mo in DIRECTIONS:
            extent = X if mo in ("left", "right") else Y
            other = Y if mo in ("left", "right") else X
            room = max(0.0, extent - 2 * lo)            # the whole path stays inside the frame
            shortest = min(travel_lo, room)
            longest = max(shortest, min(travel_hi, room))
            travel = float(_uniform(shortest, longest, g, "cpu"))
            start = float(_uniform(lo, max(lo, extent - lo - travel), g, "cpu"))
            pos = start + travel * s[0]
            if mo in ("left", "up"):
                pos = extent - pos
            fixed = float(_uniform(lo, other - lo, g, "cpu"))
            if mo in ("left", "right"):
                cx[i], cy[i] = pos, fixed
            else:
                cx[i], cy[i] = fixed, pos
        elif mo == "bouncing":
            floor = Y - lo
            amp = float(_uniform(0.25, max(0.26, min(0.5, Y - 2 * lo)), g, "cpu"))
            bounces = float(_uniform(1.0, 2.0, g, "cpu"))
            phase = float(_uniform(0.0, math.pi, g, "cpu"))
            cx[i] = float(_uniform(lo, X - lo, g, "cpu"))
            cy[i] = floor - amp * torch.sin(math.pi * bounces * s[0] + phase).abs()
        elif mo == "rotating":
            turn = float(_uniform(0.5 * math.pi, math.pi, g, "cpu")) * (1 if float(_uniform(0, 1, g, "cpu")) < 0.5 else -1)
            angle[i] = float(_uniform(0.0, math.pi, g, "cpu")) + turn * s[0]
            cx[i] = float(_uniform(lo, X - lo, g, "cpu"))
            cy[i] = float(_uniform(lo, Y - lo, g, "cpu"))
        else:  # growing
            start_r = float(_uniform(0.05, 0.09, g, "cpu"))
            end_r = float(_uniform(max(0.15, 1.6 * start_r), 0.22, g, "cpu"))
            r[i] = start_r + (end_r - start_r) * s[0]
            cx[i] = float(_uniform(end_r + _MARGIN, X - end_r - _MARGIN, g, "cpu"))
            cy[i] = float(_uniform(end_r + _MARGIN, Y - end_r - _MARGIN, g, "cpu"))

    color = per_clip([COLORS[sp.color] for sp in specs])
    color = (color + (torch.rand(B, 3, generator=g) - 0.5) * 0.12).clamp(0.0, 1.0)
    bg_level = torch.stack([_uniform(*_GRAY.get(sp.background, (0.03, 0.12)), g, "cpu") for sp in specs])
    grad_end = _uniform(0.45, 0.6, g, "cpu").expand(B).clone()

    dev = torch.device(device)
    ys = (torch.arange(height, device=dev, dtype=torch.float32) + 0.5) / m
    xs = (torch.arange(width, device=dev, dtype=torch.float32) + 0.5) / m
    cx_, cy_, r_, ang = (t.to(dev)[:, :, None, None] for t in (cx, cy, r, angle))
    dx = xs[None, None, None, :] - cx_
    dy = ys[None, None, :, None] - cy_
    cos, sin = torch.cos(ang), torch.sin(ang)
    u = cos * dx + sin * dy
    v = -sin * dx + cos * dy
    shape_id = torch.tensor([SHAPES.index(sp.shape) for sp in specs], device=dev).view(B, 1, 1, 1)
    sd = _signed_distance(shape_id, u, v, r_)
    alpha = (0.5 - sd * m).clamp(0.0, 1.0)                                    # [B,T,H,W], one pixel of AA

    is_grad = torch.tensor([sp.background == "gradient" for sp in specs], device=dev).view(B, 1, 1)
    flat = bg_level.to(dev).view(B, 1, 1).expand(B, height, width)
    ramp = bg_level.to(dev).view(B, 1, 1) + (grad_end.to(dev).view(B, 1, 1) - bg_level.to(dev).view(B, 1, 1)) \
        * (ys / ys[-1]).view(1, height, 1)
    bg = torch.where(is_grad, ramp.expand(B, height, width), flat)            # [B,H,W] gray level
    col = color.to(dev).view(B, 3, 1, 1, 1)
    a = alpha[:, None]                                                        # [B,1,T,H,W]
    video = a * col + (1 - a) * bg[:, None, None]
    video = video * 2.0 - 1.0
    if return_params:
        return video, {"cx": cx, "cy": cy, "r": r, "angle": angle}
    return video


def reversed_twin(spec: ClipSpec) -> ClipSpec:
    """The description of a directional clip played backwards: the same clip moving the opposite way."""
    if spec.motion not in DIRECTIONS:
        raise ValueError(f"only directional clips have a reversed twin; {spec.motion!r} is not one of {DIRECTIONS}.")
    return ClipSpec(spec.color, spec.shape, OPPOSITE[spec.motion], spec.background, spec.size, spec.template)


def clip_batch(
    batch_size: int,
    num_frames: int = 16,
    height: int = 64,
    width: int = 64,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    p_empty_prompt: float = 0.0,
    p_directional: float | None = None,
    twin_fraction: float = 0.0,
    return_twins: bool = False,
    travel: tuple[float, float] = (0.3, 0.6),
):
    """A training batch: random clips [B, 3, T, H, W] in [-1, 1] and their prompts.

    With probability `p_empty_prompt` a prompt is replaced by "" (for classifier-free guidance).

    Time-reversed twins (`twin_fraction` > 0): a share `twin_fraction` of the batch is made of pairs; the last
    ``n = int(batch_size * twin_fraction / 2)`` clips are the first n clips (all directional) played backwards, with the opposite direction in their prompts. A
    clip moving left played backwards is exactly a clip moving right (same distribution of start and travel),
    so the twins are ordinary samples; in pairs they differ only in the order of the frames and in the
    direction word, which gives the model a clean signal for the one thing it cannot get from any single
    frame. A twin keeps its source's empty-prompt draw.

    Args:
        p_directional: see `sample_specs` (None: motions uniform).
        twin_fraction: share of the batch in (source, time-reversed twin) pairs (0 to 1; 0.5: a quarter twins).
        return_twins: also return `twin_of`, int64 [B]: for a twin the index of its source clip, else -1
            (training gives a twin its source's noise level and time-reversed noise).
        travel: see `render_clips`.

    Returns:
        (video, prompts), or (video, prompts, twin_of) if `return_twins`.
    """
    if not 0.0 <= twin_fraction <= 1.0:
        raise ValueError(f"twin_fraction={twin_fraction} must lie in [0, 1].")
    n_twins = int(batch_size * twin_fraction / 2)
    specs = sample_specs(n_twins, generator, p_directional=1.0) if n_twins else []   # twin sources first
    specs += sample_specs(batch_size - 2 * n_twins, generator, p_directional=p_directional)
    video = render_clips(specs, num_frames, height, width, generator=generator, device=device, travel=travel)
    video = torch.cat([video, video[:n_twins].flip(2)])
    specs = specs + [reversed_twin(sp) for sp in specs[:n_twins]]
    twin_of = torch.cat([torch.full((batch_size - n_twins,), -1, dtype=torch.long), torch.arange(n_twins)])
    drop = torch.rand(batch_size, generator=generator) < p_empty_prompt
    drop = torch.where(twin_of >= 0, drop[twin_of.clamp(min=0)], drop)
    prompts = ["" if d else sp.prompt for sp, d in zip(specs, drop.tolist())]
    if return_twins:
        return video, prompts, twin_of
    return video, prompts
