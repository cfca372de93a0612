"""Figures of an evaluation (matplotlib, Agg backend, PNG).

* `plot_quality_vs_density`: PSNR and SSIM vs realised density, one line per method family.
* `plot_error_heatmap`: relative L2 error of the attention output vs dense, layer x sampled step,
  one panel per method.
* `plot_speedup_vs_density`: speedup vs density per method family, with the Amdahl estimate
  1 / ((1 - f) + f * d) for the measured dense attention share f, and its limit 1 / (1 - f).
"""

from __future__ import annotations

import io
import math
from collections import defaultdict

import numpy as np


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("the evaluation plots need matplotlib: pip install matplotlib") from err
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str, **kwargs) -> None:
    """Save `fig` as PNG to `path` atomically (`videosparse._io.write_atomic`: a run killed while saving leaves
    the old figure whole, or none), and close it."""
    from .._io import write_atomic

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=110, **kwargs)
    finally:
        _pyplot().close(fig)
    write_atomic(path, buffer.getvalue())


def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def _families(summary: dict, y_key: str, x_key: str = "realised_density") -> dict[str, list[tuple[float, float]]]:
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in summary.values():
        if s.get("method") == "dense":
            continue
        x, y = s.get(x_key), s.get(y_key)
        if _finite(x) and _finite(y):
            lines[s["family"]].append((x, y))
    return {k: sorted(v) for k, v in lines.items()}


def plot_quality_vs_density(summary: dict, path: str, title: str = "") -> str:
    """PSNR (dB) and SSIM vs dense, against realised density; one line per method family. The PSNR panel draws
    the mean over cells (the table's first PSNR column) and, dashed in the same colour, the pooled PSNR, which cells
    nearly identical to dense cannot pull up (`psnr_notes`).

    Args:
        summary: label -> per-method summary (keys family, method, realised_density, psnr_db, psnr_db_pooled, ssim).
        path: PNG to write.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in ((axes[0], "psnr_db", "PSNR vs dense (dB)"), (axes[1], "ssim", "SSIM vs dense")):
        fams = _families(summary, key)
        pooled = _families(summary, "psnr_db_pooled") if key == "psnr_db" else {}
        for fam, pts in fams.items():
            xs, ys = zip(*pts)
            line = ax.plot(xs, ys, marker="o", label=f"{fam} (mean over cells)" if fam in pooled else fam)[0]
            if fam in pooled:
                px, py = zip(*pooled[fam])
                ax.plot(px, py, marker="o", linestyle="--", color=line.get_color(), label=f"{fam} (pooled)")
        if not fams:
            ax.text(0.5, 0.5, "no sparse method with finite values", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set_xlabel("realised density (kept tile pairs / all)")
        ax.set_ylabel(name)
        ax.set_xlim(0, 1.05)
        ax.grid(alpha=0.3)
        if fams:
            ax.legend(fontsize=8)
    fig.suptitle(title or "Quality vs density (dense = reference)")
    fig.tight_layout()
    _save(fig, path)
    return path


def error_matrices(attention: dict) -> dict[str, tuple[list[int], list[int], np.ndarray]]:
    """label -> (layers, steps, mean relative L2 error [layers, steps]) over every analysed cell.

    Args:
        attention: report["attention"]: cell id -> {"method": label, "entries": {component: [entry, ...]}}.
    """
    acc: dict[str, dict[tuple[int, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    for cell in attention.values():
        for entries in cell.get("entries", {}).values():
            for e in entries:
                if e.get("step") is None:
                    continue
                acc[cell["method"]][(e["layer"], e["step"])].append(e["rel_l2"])
    out = {}
    for label, cells in acc.items():
        layers = sorted({l for l, _ in cells})
        steps = sorted({s for _, s in cells})
        m = np.full((len(layers), len(steps)), np.nan)
        for (l, s), vals in cells.items():
            m[layers.index(l), steps.index(s)] = float(np.mean(vals))
        out[label] = (layers, steps, m)
    return out


def heatmap_top(mats: dict) -> float:
    """The colour scale's top for `error_matrices`: the largest finite cell (an inf cell made it inf, and every
    finite cell drew in one colour), at least 1e-6."""
    return max([float(m[np.isfinite(m)].max()) for _, _, m in mats.values() if np.isfinite(m).any()] + [1e-6])


def plot_error_heatmap(attention: dict, path: str) -> str:
    """Per-layer heatmap (layer x sampled step) of the attention output's relative L2 error vs dense."""
    plt = _pyplot()
    mats = error_matrices(attention)
    n = max(1, len(mats))
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n + 1.5, 4), squeeze=False)
    vmax = heatmap_top(mats)
    image = None
    for ax, (label, (layers, steps, m)) in zip(axes[0], mats.items()):
        image = ax.imshow(m, aspect="auto", cmap="magma", vmin=0.0, vmax=vmax, origin="lower")
        ax.set_title(label, fontsize=9)
        ax.set_xticks(range(len(steps)), [str(s) for s in steps])
        ax.set_yticks(range(len(layers)), [str(l) for l in layers])
        ax.set_xlabel("denoising step")
        ax.set_ylabel("self-attention layer")
        for i, j in zip(*np.nonzero(np.isinf(m))):      # drawn blank, as the cells never sampled: say what they hold
            ax.text(j, i, str(m[i, j]), ha="center", va="center", fontsize=7, color="tab:blue")
    if not mats:
        axes[0][0].text(0.5, 0.5, "no attention-level samples", ha="center", va="center",
                        transform=axes[0][0].transAxes)
        axes[0][0].set_axis_off()
    if image is not None:
        fig.colorbar(image, ax=list(axes[0]), label="relative L2 error vs dense")
    fig.suptitle("Attention output error per layer (sampled steps)")
    _save(fig, path, bbox_inches="tight")
    return path


def plot_speedup_vs_density(points: dict, attention_share: float | None, path: str, title: str = "",
                            y_key: str = "speedup_transformer", x_key: str = "attention_work") -> str:
    """Achieved speedup vs density per method family, with the Amdahl estimate of the dense attention share.

    Args:
        points: label -> dict with family, method, `x_key` (density or attention work) and `y_key` (speedup).
        attention_share: f, the share of dense transformer time spent in attention (None: no bound drawn).
        path: PNG to write.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    fams = _families(points, y_key, x_key)
    for fam, pts in fams.items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", label=f"{fam} (measured)")
    if _finite(attention_share):
        f = min(max(float(attention_share), 0.0), 0.999)
        d = np.linspace(0.01, 1.0, 200)
        ax.plot(d, 1.0 / ((1 - f) + f * d), "k--", lw=1, label=f"Amdahl estimate, attention share {100 * f:.0f}%")
        ax.axhline(1.0 / (1 - f), color="gray", ls=":", lw=1, label=f"attention free: {1 / (1 - f):.2f}x")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set_xlabel("attention work (fraction of dense, = realised density when no dense steps)")
    ax.set_ylabel("speedup vs dense")
    ax.set_xlim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "Speedup vs density")
    fig.tight_layout()
    _save(fig, path)
    return path
