"""Video quality metrics vs a reference video (torchmetrics' PSNR and SSIM, per frame, averaged)."""

from __future__ import annotations

import numpy as np
import torch


def _frames(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    """[F, H, W, 3] in [0, 1] -> fp64 [F, 3, H, W]."""
    t = torch.as_tensor(np.asarray(x), dtype=torch.float64)
    if t.dim() != 4 or t.shape[-1] not in (1, 3):
        raise ValueError(f"frames must be [F, H, W, C] with C in (1, 3); got {tuple(t.shape)}.")
    return t.permute(0, 3, 1, 2)


def psnr(video: np.ndarray, reference: np.ndarray) -> float:
    """Mean over frames of the PSNR in dB (data range 1); inf when the videos are identical."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    a, b = _frames(video), _frames(reference)
    if a.shape != b.shape:
        raise ValueError(f"video {tuple(a.shape)} and reference {tuple(b.shape)} differ in shape.")
    values = [float(peak_signal_noise_ratio(x[None], y[None], data_range=1.0)) for x, y in zip(a, b)]
    return float(np.mean(values))


def ssim(video: np.ndarray, reference: np.ndarray) -> float:
    """Mean over frames of SSIM (Gaussian window 11, sigma 1.5, data range 1)."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    a, b = _frames(video), _frames(reference)
    if a.shape != b.shape:
        raise ValueError(f"video {tuple(a.shape)} and reference {tuple(b.shape)} differ in shape.")
    return float(structural_similarity_index_measure(a, b, data_range=1.0))
