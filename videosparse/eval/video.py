"""Side-by-side comparison videos (dense | method | ...), each panel labelled."""

from __future__ import annotations

import numpy as np


def label_frames(frames: np.ndarray, text: str) -> np.ndarray:
    """A copy of float frames [F, H, W, 3] in [0, 1] with `text` drawn in the top-left corner (PIL)."""
    from PIL import Image, ImageDraw

    out = np.empty_like(frames)
    for i, frame in enumerate(frames):
        img = Image.fromarray((np.clip(frame, 0, 1) * 255).round().astype(np.uint8))
        draw = ImageDraw.Draw(img)
        box = draw.textbbox((2, 1), text)
        draw.rectangle((0, 0, box[2] + 2, box[3] + 2), fill=(0, 0, 0))
        draw.text((2, 1), text, fill=(255, 255, 255))
        out[i] = np.asarray(img, dtype=np.float32) / 255.0
    return out


def side_by_side(videos: list[np.ndarray], labels: list[str], gap: int = 2, multiple: int = 16) -> np.ndarray:
    """Panels next to each other: float [F, H', W', 3] with W' >= n*W + (n-1)*gap.

    Args:
        videos: float [F, H, W, 3] in [0, 1], all of one shape.
        labels: one caption per video (drawn on its panel).
        gap: white columns between panels.
        multiple: height and width are padded (white, bottom/right) to multiples of this, so video
            encoders need not rescale (which would blur the comparison).
    """
    if not videos or len(videos) != len(labels):
        raise ValueError(f"need one label per video; got {len(videos)} videos and {len(labels)} labels.")
    shape = videos[0].shape
    for v in videos:
        if v.shape != shape:
            raise ValueError(f"videos differ in shape: {v.shape} vs {shape}.")
    F, H = shape[0], shape[1]
    spacer = np.ones((F, H, gap, 3), dtype=np.float32)
    panels = []
    for i, (v, text) in enumerate(zip(videos, labels)):
        if i:
            panels.append(spacer)
        panels.append(label_frames(v.astype(np.float32), text))
    out = np.concatenate(panels, axis=2)
    pad_h, pad_w = (-out.shape[1]) % multiple, (-out.shape[2]) % multiple
    if pad_h or pad_w:
        out = np.pad(out, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), constant_values=1.0)
    return out
