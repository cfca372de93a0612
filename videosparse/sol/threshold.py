"""Sol-Attn routing: Gaussian-calibrated, query-dependent threshold, density calibration, plan packing.

For query tile i and key tile j (video tiles only; text tiles are global and always kept):

    routing statistic   s_ij  = scale * q̄_i · kc_j           q̄_i = mean query, kc_j = mean key
    Gaussian fit        μ, σ² = mean and (population) variance of the video-tile centroids kc_j,
                                per (batch, head) and per channel d
    threshold           thr_i = scale * (q̄_i · μ + τ * sqrt(Σ_d q̄_{i,d}² σ²_d))
    exact tile          s_ij > thr_i,  or |i - j| <= band,  or j / i is a global tile

Every test is done on the z-score z_ij = (s_ij - a_i) / b_i with a_i = scale * q̄_i·μ and
b_i = scale * sqrt(Σ_d q̄_{i,d}² σ²_d), i.e. s_ij > thr_i  <=>  z_ij > τ. The numerator is computed
as scale * q̄_i · (kc_j - μ), which avoids cancelling two large numbers. Band pairs get z = +inf,
pairs with b_i = 0 get ±inf (kept iff s_ij > a_i, whatever τ) or 0 at s_ij = a_i, so one comparison
`z > τ` gives the whole video part of the mask and the density calibration is a bisection over the
same tensor.

Everything here is vectorized over batch, heads and tiles: no Python loop over tiles, and no
host synchronisation except the one `int(count.max())` that sizes the packed plan (pass `width`
to avoid it); the calibration (once per shape and layer) is a custom op, so torch.compile sees one node.
"""

from __future__ import annotations

import torch

from ..plan import Plan


def gaussian_fit(k_mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Diagonal Gaussian of the key-tile centroids, per (batch, head).

    Args:
        k_mean: float [B, H, N, D], the centroids to fit (the video tiles).

    Returns:
        mu, var: fp32 [B, H, D], mean and population variance (divisor N) over the tiles.
    """
    mu, var, _ = _fit_centred(k_mean)
    return mu, var


def _fit_centred(k_mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gaussian_fit`'s (mu, var) and the centred centroids k_mean - mu (fp32 [B, H, N, D]), all taken relative to
    the first centroid: equal centroids then give var and centred exactly 0 (a plain mean's rounding left ~1e-16,
    and z-scores of rounding noise over +-2)."""
    c = k_mean.float()
    c0 = c[:, :, :1] if c.shape[2] else c.new_zeros(c.shape[0], c.shape[1], 1, c.shape[3])
    shifted = c - c0
    offset = shifted.mean(2)
    centred = shifted - offset[:, :, None]
    return c0[:, :, 0] + offset, centred.square().mean(2), centred


def sol_threshold(
    q_mean: torch.Tensor, mu: torch.Tensor, var: torch.Tensor, tau: float | torch.Tensor, scale: float
) -> torch.Tensor:
    """thr_i = scale * (q̄_i·μ + τ * sqrt(Σ_d q̄_{i,d}² σ²_d)).

    Args:
        q_mean: float [B, H, M, D] mean query per query tile.
        mu, var: fp32 [B, H, D] from `gaussian_fit`.
        tau: standard deviations above the mean proxy score (a float or a 0-dim tensor).
        scale: softmax scale.

    Returns:
        fp32 [B, H, M].
    """
    qf = q_mean.float()
    mean = (qf * mu[:, :, None]).sum(-1)
    std = (qf.square() * var[:, :, None]).sum(-1).sqrt()
    return scale * (mean + tau * std)


def routing_scores(q_mean: torch.Tensor, k_mean: torch.Tensor, scale: float) -> torch.Tensor:
    """Routing statistic s_ij = scale * q̄_i · kc_j: fp32 [B, H, M, N] from [B, H, M, D] and [B, H, N, D]."""
    return (q_mean.float() @ k_mean.float().transpose(-1, -2)) * scale


def band_mask(num_tiles: int, band: int, device: torch.device | str | None = None) -> torch.Tensor:
    """bool [num_tiles, num_tiles]: True where |i - j| <= band."""
    i = torch.arange(num_tiles, device=device)
    return (i[:, None] - i[None, :]).abs() <= band


def _unit_max_abs(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """fp32 x times the power of two that brings its max |x| over `dims` near 1 (an all-zero slice stays zero). A power
    of two scales without rounding, so z-scores of inputs in range keep every bit (the calibrated tau too)."""
    if x.numel() == 0:
        return x
    peak = x.abs().amax(dims, keepdim=True)
    exponent = torch.log2(torch.where(peak > 0, peak, 1.0)).floor().clamp(-126, 127)
    return x * torch.exp2(-exponent)


def routing_zscores(q_mean: torch.Tensor, k_mean: torch.Tensor, scale: float, band: int) -> torch.Tensor:
    """z_ij = (s_ij - a_i) / b_i over the video tiles, +inf on the diagonal band.

    Args:
        q_mean: float [B, H, M, D] mean query of the video query tiles.
        k_mean: float [B, H, N, D] mean key of the video key tiles (the Gaussian is fitted to them).
        scale: softmax scale (> 0; it cancels in z, as does any positive scaling of a query row or of one head's
            centroids, so z is computed on copies scaled by powers of two to max-abs ~1: fp32 squares of values past
            ~1e19 or under ~1e-23 would otherwise overflow or underflow).
        band: key tiles with |i - j| <= band are forced (z = +inf).

    Returns:
        fp32 [B, H, M, N]; tile (i, j) passes the threshold of τ iff z_ij > τ. Where b_i == 0
        (zero query mean or zero centroid variance) z is +inf if s_ij > a_i, -inf if s_ij < a_i and 0 at
        s_ij == a_i (so a density calibration can still reach every tile).
    """
    centred = _unit_max_abs(_fit_centred(_unit_max_abs(k_mean.float(), (2, 3)))[2], (2, 3))
    var = centred.square().mean(2)
    qf = _unit_max_abs(q_mean.float(), (3,))
    d = (qf @ centred.transpose(-1, -2)) * scale                           # (s_ij - a_i) x the row's scalings
    b = (qf.square() * var[:, :, None]).sum(-1, keepdim=True).sqrt() * scale
    z = torch.where(b > 0, d / b.clamp_min(torch.finfo(torch.float32).tiny),
                    torch.where(d > 0, float("inf"), torch.where(d < 0, float("-inf"), 0.0)))   # no host copies
    M, N = z.shape[-2:]
    if band >= 0 and M and N:
        forced = band_mask(max(M, N), band, z.device)[:M, :N]
        z = z.masked_fill(forced, float("inf"))
    return z


def _check_global_tiles(num_global_tiles) -> None:
    G = num_global_tiles                 # a SymInt under torch.compile's dynamic shapes
    if isinstance(G, bool) or not isinstance(G, (int, torch.SymInt)) or G < 0:
        raise ValueError(f"num_global_tiles={G!r} must be an int >= 0.")


def forced_pairs(num_video_tiles: int, num_global_tiles: int, band: int) -> int:
    """Exact (query tile, key tile) pairs per (batch, head) before any threshold: globals and band."""
    _check_global_tiles(num_global_tiles)
    Mv, N = num_video_tiles, num_video_tiles + num_global_tiles
    band_pairs = Mv + 2 * sum(Mv - d for d in range(1, min(band, Mv - 1) + 1))    # diagonals past Mv - 1 are empty
    return N * N - Mv * Mv + min(band_pairs, Mv * Mv)


def calibrate_tau(
    z: torch.Tensor, density: float | torch.Tensor, num_global_tiles: int, *, iters: int = 48,
    valid_key_tiles: torch.Tensor | None = None, skip_padded_queries: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """τ whose plan density (globals and band included) is closest to `density`, by bisection.

    The realised density of a plan over N = Mv + G tiles is (forced pairs + #{z > τ, non-forced})
    / N², averaged over batch and heads; it falls as τ grows. The bisection runs on the device
    for a fixed number of steps (no host sync), keeps the bracket [lo, hi] with
    count(lo) >= target > count(hi), and returns whichever end lands closer to the target.

    Args:
        z: fp32 [B, H, Mv, Mv] from `routing_zscores` (band pairs already +inf: they count as kept at any τ).
        density: target fraction of all tile pairs, in (0, 1]; or a 0-dim tensor of it on z's device, not checked
            (under torch.compile a Python float is a constant of the graph: one graph per value).
        num_global_tiles: G, global tiles after the video tiles.
        iters: bisection steps (48 halve any fp32 bracket down to adjacent floats).
        valid_key_tiles: int [B] or None: item b's key tiles that hold a valid token (Mv <= K_b <= N; the plan's
            `with_valid_keys` drops the others, padded text tiles). The density then counts what is computed: K_b
            key tiles per query row, over N query rows, or K_b with `skip_padded_queries`.
        skip_padded_queries: with `valid_key_tiles`, the query tiles past it are not computed either.

    Returns:
        tau: fp32 0-dim tensor on z's device, in the middle of the gap between the two finite scores
        around the threshold (so that recomputing a score with other rounding does not flip its tile);
        realized: fp64 0-dim tensor, the plan density at tau. If the target is below the forced density,
        tau is the largest fp32 value: only the forced (+inf) pairs are kept, on this input and any other.
    """
    if not isinstance(density, torch.Tensor):
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density={density} must lie in (0, 1].")
        density = torch.tensor(float(density), dtype=torch.float64, device=z.device)
    elif density.dim() != 0:
        raise ValueError(f"density has shape {tuple(density.shape)}; a tensor density must be 0-dim.")
    _check_global_tiles(num_global_tiles)
    if z.dim() != 4 or z.shape[-1] != z.shape[-2]:
        raise ValueError(f"z must be [B, H, Mv, Mv]; got {tuple(z.shape)}.")
    if valid_key_tiles is not None and valid_key_tiles.shape != (z.shape[0],):
        raise ValueError(f"valid_key_tiles has shape {tuple(valid_key_tiles.shape)}; expected ({z.shape[0]},), one "
                         "count per batch item.")
    return _calibrate_tau_op(z, density, int(num_global_tiles), int(iters), valid_key_tiles,
                             bool(skip_padded_queries))


@torch.library.custom_op("videosparse::sol_calibrate_tau", mutates_args=())
def _calibrate_tau_op(z: torch.Tensor, density: torch.Tensor, num_global_tiles: int, iters: int,
                      valid_key_tiles: torch.Tensor | None = None,
                      skip_padded_queries: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`calibrate_tau` as one opaque node for torch.compile (its bisection loop runs eagerly, on the device)."""
    B, H, Mv, _ = z.shape
    N = Mv + num_global_tiles
    if valid_key_tiles is None:
        total = B * H * N * N
    else:               # pairs of computed tiles: K_b keys for each of N (or K_b) query rows (no host sync)
        keys = valid_key_tiles.to(z.device, torch.float64)
        total = H * (keys * (keys if skip_padded_queries else N)).sum()
    forced = total - B * H * Mv * Mv                                      # global rows/cols
    target = density.to(z.device, torch.float64) * total - forced        # video pairs wanted
    finite = torch.isfinite(z)
    big = torch.finfo(torch.float32).max
    hi = torch.where(finite, z, -big).amax() if z.numel() else torch.zeros((), device=z.device)
    lo = torch.where(finite, z, big).amin() - 1.0 if z.numel() else torch.zeros((), device=z.device)
    any_finite = finite.any()                                           # else only forced / degenerate pairs
    hi, lo = torch.where(any_finite, hi, 0.0), torch.where(any_finite, lo, 0.0)   # (no host sync)

    def count(t: torch.Tensor) -> torch.Tensor:
        return (z > t).sum(dtype=torch.float64)

    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        above = count(mid) >= target
        lo = torch.where(above, mid, lo)
        hi = torch.where(above, hi, mid)
    c_lo, c_hi = count(lo), count(hi)
    take_lo = (c_lo - target).abs() < (c_hi - target).abs()
    tau = torch.where(take_lo, lo, hi).float()
    realized = (torch.where(take_lo, c_lo, c_hi) + forced) / total
    return _centre_in_gap(z, tau, finite).clone(), realized.double()


def _centre_in_gap(z: torch.Tensor, tau: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """Move τ to the middle of the gap between the finite scores around it, keeping #{z > τ}.

    The bisection ends within float rounding of the marginal score itself, so that tile would sit on the
    threshold and flip whenever the same input is recomputed with other rounding (another batch
    composition, another kernel). With no finite score above τ it becomes the largest float (only the
    +inf pairs, band and degenerate rows, pass on any later input too), with none below the lowest (every
    finite score passes). Device-side, no host sync.
    """
    if not z.numel():
        return tau
    big = torch.finfo(torch.float32).max
    below, above = finite & (z <= tau), finite & (z > tau)
    a = torch.where(below, z, -big).amax()                               # highest score left out
    b = torch.where(above, z, big).amin()                                # lowest score kept
    mid = 0.5 * a + 0.5 * b
    tau = torch.where((mid >= a) & (mid < b), mid, tau)                  # (adjacent floats: stays)
    tau = torch.where(below.any(), tau, torch.full_like(tau, -big))
    return torch.where(above.any(), tau, torch.full_like(tau, big))


@_calibrate_tau_op.register_fake
def _(z, density, num_global_tiles, iters, valid_key_tiles=None, skip_padded_queries=False):
    return z.new_empty((), dtype=torch.float32), z.new_empty((), dtype=torch.float64)


def pack_mask(mask: torch.Tensor, block_m: int, block_n: int, *, width: int | None = None) -> Plan:
    """Pack a tile mask into a `Plan` without sorting (prefix sums + one scatter).

    Args:
        mask: bool [B, H, M, N], True = compute the tile exactly.
        block_m, block_n: tokens per query / key tile.
        width: Kmax of the packed rows. None uses the largest row count (one host sync); pass N
            (or any bound >= the largest count) to keep the call free of syncs.

    Returns:
        `Plan` with kv_index int32 [B, H, M, width] (ascending, packed left, zeros after kv_count)
        and kv_count int32 [B, H, M].
    """
    if mask.dtype != torch.bool or mask.dim() != 4:
        raise ValueError(f"mask must be bool [B, H, M, N]; got {mask.dtype} {tuple(mask.shape)}.")
    B, H, M, N = mask.shape
    count = mask.sum(-1, dtype=torch.int32)
    if width is None and mask.device.type == "meta":    # no values to read: the full width (shapes only)
        width = max(N, 1)
    elif width is None:
        width = max(int(count.max()), 1) if count.numel() else 1
    elif width < 1 or width > N:
        raise ValueError(f"width={width} must lie in [1, N={N}] (N = number of key tiles).")
    pos = mask.cumsum(-1, dtype=torch.int32) - 1
    pos = torch.where(mask & (pos < width), pos, width).long()          # unused tiles (and any past a too-small
    #                                                                       width, which `Plan.validate` reports
    #                                                                       through kv_count > Kmax) to a spill slot
    cols = torch.arange(N, dtype=torch.int32, device=mask.device).expand(B, H, M, N)
    index = torch.zeros(B, H, M, width + 1, dtype=torch.int32, device=mask.device)
    index.scatter_(-1, pos, cols)
    index = index[..., :width]
    index.masked_fill_(torch.arange(width, device=mask.device) >= count[..., None], 0)
    return Plan(index.contiguous(), count, block_m, block_n)


def sol_mask(z: torch.Tensor, tau: float | torch.Tensor, num_global_tiles: int) -> torch.Tensor:
    """bool [B, H, N, N] over all tiles: the video part is z > τ, global rows and columns are True.

    Args:
        z: fp32 [B, H, Mv, Mv] from `routing_zscores`.
        tau: the threshold in standard deviations (float or 0-dim tensor); any finite τ keeps the forced pairs
            (z = +inf): τ is clamped to z's finite range, where a Python float past it would round to +inf.
        num_global_tiles: G; N = Mv + G.
    """
    _check_global_tiles(num_global_tiles)
    top = torch.finfo(z.dtype).max
    tau = tau.clamp(-top, top) if isinstance(tau, torch.Tensor) else min(max(float(tau), -top), top)
    video = z > tau
    G = num_global_tiles
    if G == 0:
        return video
    return torch.nn.functional.pad(video, (0, G, 0, G), value=True)


def sol_plan_from_zscores(
    z: torch.Tensor, tau: float | torch.Tensor, num_global_tiles: int, block: int, *, width: int | None = None
) -> Plan:
    """The Sol plan (without correction tensors) for z-scores and a threshold τ.

    Args:
        z: fp32 [B, H, Mv, Mv] from `routing_zscores`.
        tau: threshold in standard deviations.
        num_global_tiles: G global tiles after the video tiles (kept by every row; their rows dense).
        block: tokens per tile (block_m == block_n).
        width: as in `pack_mask`.

    Returns:
        `Plan` over Mv + G query and key tiles.
    """
    return pack_mask(sol_mask(z, tau, num_global_tiles), block, block, width=width)
