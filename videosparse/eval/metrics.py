"""Quality metrics: video level vs a reference video (torchmetrics PSNR and SSIM per frame, LPIPS when
available) and attention level vs exact dense attention (relative L2 error, tile recall vs the oracle)."""

from __future__ import annotations

import math

import numpy as np
import torch


SSIM_WINDOW = 11        # torchmetrics' default Gaussian kernel size, which the SSIM functions below use


def _frames(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    """[F, H, W, 3] float in [0, 1] -> fp64 [F, 3, H, W] (ValueError for integer frames or values past [0, 1],
    e.g. 0..255, which the data range of 1 would misread)."""
    a = np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x)
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"frames must be float in [0, 1] (as diffusers' output_type='np' gives); got {a.dtype}.")
    t = torch.as_tensor(a, dtype=torch.float64)
    if t.dim() != 4 or t.shape[-1] not in (1, 3):
        raise ValueError(f"frames must be [F, H, W, C] with C in (1, 3); got {tuple(t.shape)}.")
    if t.shape[0] == 0:
        raise ValueError(f"frames {tuple(t.shape)} hold no frame.")
    lo, hi = (float(x) for x in t.aminmax())
    if math.isnan(lo) or math.isnan(hi):             # a NaN (a broken output) made both checks false: 0..255 passed
        numbers = t[~torch.isnan(t)]                  # (a copy, on this rare path only)
        lo, hi = (float(x) for x in numbers.aminmax()) if numbers.numel() else (0.0, 1.0)
    if lo < -1e-3 or hi > 1 + 1e-3:
        raise ValueError(f"frames must lie in [0, 1]; got values in [{lo:.3g}, {hi:.3g}].")
    return t.permute(0, 3, 1, 2)


def _ssim_frames(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    """`_frames`, and frames large enough for SSIM's reflect-padded window (ValueError otherwise)."""
    t = _frames(x)
    if min(t.shape[-2:]) <= SSIM_WINDOW // 2:
        raise ValueError(f"SSIM needs frames of at least {SSIM_WINDOW // 2 + 1} x {SSIM_WINDOW // 2 + 1} pixels (its "
                         f"{SSIM_WINDOW}-pixel window is reflect-padded); got {tuple(t.shape[-2:])}.")
    return t


def psnr(video: np.ndarray, reference: np.ndarray) -> float:
    """Mean over frames of the PSNR in dB (data range 1); inf when any frame is identical to its reference."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    a, b = _frames(video), _frames(reference)
    if a.shape != b.shape:
        raise ValueError(f"video {tuple(a.shape)} and reference {tuple(b.shape)} differ in shape.")
    values = [float(peak_signal_noise_ratio(x[None], y[None], data_range=1.0)) for x, y in zip(a, b)]
    return float(np.mean(values))


def ssim(video: np.ndarray, reference: np.ndarray) -> float:
    """Mean over frames of SSIM (Gaussian window 11, sigma 1.5, data range 1)."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    a, b = _ssim_frames(video), _ssim_frames(reference)
    if a.shape != b.shape:
        raise ValueError(f"video {tuple(a.shape)} and reference {tuple(b.shape)} differ in shape.")
    return float(structural_similarity_index_measure(a, b, data_range=1.0))


def psnr_per_frame(video: np.ndarray, reference: np.ndarray) -> list[float]:
    """PSNR in dB (data range 1) of every frame; inf where a frame equals its reference.

    Args:
        video, reference: float [F, H, W, C] in [0, 1].
    """
    from torchmetrics.functional.image import peak_signal_noise_ratio

    a, b = _frames(video), _frames(reference)
    if a.shape != b.shape:
        raise ValueError(f"video {tuple(a.shape)} and reference {tuple(b.shape)} differ in shape.")
    return [float(peak_signal_noise_ratio(x[None], y[None], data_range=1.0)) for x, y in zip(a, b)]


def psnr_video(video: np.ndarray, reference: np.ndarray) -> float:
    """PSNR in dB (data range 1) of the whole video: the MSE pooled over every frame and pixel.

    Finite unless the videos are identical (then inf). Unlike the mean of per-frame PSNRs, one frame
    that happens to match exactly (e.g. a background clipped to 0 in both) does not make it infinite.

    Args:
        video, reference: float [F, H, W, C] in [0, 1].
    """
    from torchmetrics.functional.image import peak_signal_noise_ratio

    a, b = _frames(video), _frames(reference)
    if a.shape != b.shape:
        raise ValueError(f"video {tuple(a.shape)} and reference {tuple(b.shape)} differ in shape.")
    return float(peak_signal_noise_ratio(a, b, data_range=1.0))


def ssim_per_frame(video: np.ndarray, reference: np.ndarray) -> list[float]:
    """SSIM of every frame (Gaussian window 11, sigma 1.5, data range 1); 1.0 for identical frames.

    torchmetrics' form: the frame reflect-padded by the window's half width and the whole SSIM map averaged. The
    form of Wang et al. / scikit-image averages only the map's valid region (no padding); on small frames the two
    differ (a 5-pixel border is 29% of a 64x64 frame; ~0.007 apart on random smooth frames), so compare values
    from the same form.

    Computed in fp32 (torchmetrics' Gaussian convolutions run ~10x slower in fp64 on CPU; the
    difference is below 1e-6).
    """
    from torchmetrics.functional.image import structural_similarity_index_measure

    a, b = _ssim_frames(video).float(), _ssim_frames(reference).float()
    if a.shape != b.shape:
        raise ValueError(f"video {tuple(a.shape)} and reference {tuple(b.shape)} differ in shape.")
    values = structural_similarity_index_measure(a, b, data_range=1.0, reduction="none")
    return [float(v) for v in values]


# torchvision's AlexNet weights, which `lpips.LPIPS(net="alex")` loads through torch.hub.
_ALEXNET_WEIGHTS = "alexnet-owt-7be5be79.pth"


def load_lpips(device: str | torch.device = "cpu"):
    """LPIPS (AlexNet) when the `lpips` package and its weights are on this machine, without downloading.

    Returns:
        (model, None) when available, else (None, a note saying what is missing and how to add it).
    """
    import importlib.util
    import os

    if importlib.util.find_spec("lpips") is None:
        return None, "LPIPS skipped: the lpips package is not installed (pip install lpips)."
    weights = os.path.join(torch.hub.get_dir(), "checkpoints", _ALEXNET_WEIGHTS)
    if not os.path.isfile(weights):
        return None, (f"LPIPS skipped: torchvision's AlexNet weights are not in the torch hub cache ({weights}); "
                      "they are fetched once by `python -c \"import lpips; lpips.LPIPS(net='alex')\"` on a machine "
                      "with internet access.")
    try:
        import lpips         # inside: a torch / torchvision mismatch raises at import

        model = lpips.LPIPS(net="alex", verbose=False).eval().to(device)
    except Exception as err:  # a broken or partial install: report it, never fail the evaluation
        return None, f"LPIPS skipped: loading it failed ({type(err).__name__}: {err})."
    return model, None


def lpips_distance(model, video: np.ndarray, reference: np.ndarray, batch: int = 8) -> float:
    """Mean over frames of the LPIPS distance (0 = identical) with a model from `load_lpips`.

    Args:
        video, reference: float [F, H, W, 3] in [0, 1].
    """
    a, b = _frames(video), _frames(reference)
    if a.shape != b.shape:
        raise ValueError(f"video {tuple(a.shape)} and reference {tuple(b.shape)} differ in shape.")
    device = next(model.parameters()).device
    values = []
    with torch.no_grad():
        for i in range(0, a.shape[0], batch):
            x = a[i:i + batch].float().to(device) * 2 - 1
            y = b[i:i + batch].float().to(device) * 2 - 1
            values.append(model(x, y).flatten().cpu())
    return float(torch.cat(values).mean())


# ---------------------------------------------------------------------------------- attention level
def relative_l2(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative L2 error ||out - ref|| / ||ref|| per (batch, head), fp64 [B, H].

    Args:
        out, ref: [B, H, S, D] (any float dtype; compared in fp32, summed in fp64).
    """
    if out.shape != ref.shape:
        raise ValueError(f"out {tuple(out.shape)} and ref {tuple(ref.shape)} differ in shape.")
    diff = (out.float() - ref.float()).pow(2).sum((-1, -2), dtype=torch.float64)
    norm = ref.float().pow(2).sum((-1, -2), dtype=torch.float64)
    return (diff / norm.clamp_min(1e-300)).sqrt()


def dense_attention_tile_mass(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int, block_n: int,
    scale: float | None = None, max_elements: int = 1 << 27,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact dense attention and its probability mass per (query tile, key tile), in fp32.

    The query rows are processed in chunks of whole query tiles so that at most about
    `max_elements` attention probabilities exist at once.

    Args:
        q: [B, H, S, D]; k, v: [B, H, Sk, D], in tile order.
        block_m, block_n: tokens per query tile / key tile.
        scale: softmax scale, default 1/sqrt(D).

    Returns:
        out: fp32 [B, H, S, D], softmax(q k^T * scale) v.
        mass: fp32 [B, H, Mq, Nk], sum over the rows of query tile i and the keys of key tile j of
            the attention probabilities (each row sums to 1, so a row of `mass` sums to the tile's rows).
    """
    B, H, S, D = q.shape
    Sk = k.shape[2]
    scale = scale if scale is not None else D ** -0.5
    Mq, Nk = -(-S // block_m), -(-Sk // block_n)
    kf, vf = k.float(), v.float()
    tiles_per_chunk = max(1, max_elements // max(1, B * H * Sk * block_m))
    out = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
    mass = torch.empty(B, H, Mq, Nk, dtype=torch.float32, device=q.device)
    pad = Nk * block_n - Sk
    for t0 in range(0, Mq, tiles_per_chunk):
        t1 = min(Mq, t0 + tiles_per_chunk)
        r0, r1 = t0 * block_m, min(S, t1 * block_m)
        p = torch.softmax((q[:, :, r0:r1].float() @ kf.transpose(-1, -2)) * scale, dim=-1)   # [B,H,r,Sk]
        out[:, :, r0:r1] = p @ vf
        cols = torch.nn.functional.pad(p, (0, pad)).view(B, H, r1 - r0, Nk, block_n).sum(-1)  # [B,H,r,Nk]
        row_pad = (t1 - t0) * block_m - (r1 - r0)
        cols = torch.nn.functional.pad(cols, (0, 0, 0, row_pad))
        mass[:, :, t0:t1] = cols.view(B, H, t1 - t0, block_m, Nk).sum(3)
    return out, mass


def tile_recall(plan, mass: torch.Tensor) -> dict[str, float]:
    """How well a plan's tiles match the oracle: the top tiles by true attention mass, same budget per row.

    For every (batch, head, query tile) row with `c = kv_count` tiles, the oracle keeps the `c`
    tiles of largest `mass` (tiles tied at the c-th largest fill its last places as the plan's do); recall is
    |plan ∩ oracle| / c. Rows that keep every tile or none (no choice, e.g. text rows, or rows past a key limit) are
    left out of the recall average.

    Args:
        plan: a `videosparse.plan.Plan` over Mq query tiles and Nk key tiles.
        mass: fp32 [B, H, Mq, Nk] from `dense_attention_tile_mass`.

    Returns:
        dict with `recall` (mean over rows with a choice; 1.0 if there are none), `mass_kept`
        (attention mass on the plan's tiles / all mass) and `oracle_mass_kept` (the same for the
        oracle), `density` (kept pairs / all pairs).
    """
    B, H, Mq, Nk = mass.shape
    chosen = plan.to_dense_mask(Nk)
    if tuple(chosen.shape) != (B, H, Mq, Nk):
        raise ValueError(f"plan covers {tuple(chosen.shape)} tiles but mass is {tuple(mass.shape)}.")
    count = plan.kv_count.long()
    rank = mass.argsort(dim=-1, descending=True).argsort(dim=-1)          # 0 = largest mass
    oracle = rank < count[..., None]
    # the oracle that best matches the plan among those the ties allow (tiles tied at the c-th largest mass, e.g. ones
    # whose mass underflowed to 0, fill the oracle's last places in any order): every kept tile above the c-th mass,
    # and kept tiles at it up to the places left
    kth = mass.sort(dim=-1, descending=True).values.gather(-1, (count - 1).clamp_min(0)[..., None])
    above, at = mass > kth, mass == kth
    places = count - above.sum(-1)
    hits = ((chosen & above).sum(-1) + torch.minimum((chosen & at).sum(-1), places)).float()
    choice = (count > 0) & (count < Nk)
    recall = float((hits[choice] / count[choice].clamp_min(1).float()).mean()) if bool(choice.any()) else 1.0
    total = float(mass.sum(dtype=torch.float64))
    return {
        "recall": recall,
        "mass_kept": float(mass[chosen].sum(dtype=torch.float64)) / total,
        "oracle_mass_kept": float(mass[oracle].sum(dtype=torch.float64)) / total,
        "density": float(chosen.sum()) / chosen.numel(),
    }
