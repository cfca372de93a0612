"""Mutation finds of session 66 on the evaluation's helpers: the side-by-side comparison video (`eval/video.py`), the
attention probe (`eval/attention.py`) on hand-made calls of a real session, and the figures (`eval/plots.py`), read
back from the matplotlib figures before they are saved."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from videosparse.eval import attention, plots
from videosparse.eval.attention import AttentionProbe, spread_steps
from videosparse.eval.metrics import relative_l2
from videosparse.eval.video import side_by_side

from helpers import catch_probe_outputs


def _stored(x: float) -> np.float32:
    """A value in [0, 1] as it comes back from an 8-bit frame."""
    return np.float32(round(min(max(x, 0.0), 1.0) * 255) / 255)


# ----------------------------------------------------------------------------------------- comparison video
def test_side_by_side_layout_gap_padding_and_labels():
    # Mutation finds: the gap columns black instead of white; the default gap of 1 column; the padding black, put
    # above the panels, or of H % 16 rows instead of -H % 16; the panels stored over 256 levels; values outside
    # [0, 1] wrapped around in uint8 instead of clipped; the label box white (or no label drawn); no gap before the
    # second of three panels
    a, b = np.full((2, 20, 40, 3), 0.2, dtype=np.float32), np.full((2, 20, 40, 3), 0.6, dtype=np.float32)
    a[:, 19, 39], b[:, 19, 39] = 1.3, -0.2
    out = side_by_side([a, b, a], ["a", "b", "c"])
    assert out.shape == (2, 32, 128, 3) and out.dtype == np.float32         # 3 * 40 + 2 * 2 = 124 -> 128, 20 -> 32
    for x0, value in ((0, 0.2), (42, 0.6), (84, 0.2)):
        panel = out[:, :20, x0:x0 + 40]
        assert (panel[:, 16:19] == _stored(value)).all()
        assert (panel[:, 19, 39] == _stored(1.3 if value == 0.2 else -0.2)).all()
        assert (panel[:, 0, 0] == 0.0).all() and (panel[:, :14, :12] > 0.7).any()      # black box, white text
    for x0 in (40, 82):
        assert (out[:, :, x0:x0 + 2] == 1.0).all()                           # white gaps
    assert (out[:, 20:] == 1.0).all() and (out[:, :, 124:] == 1.0).all()    # white padding below and right


def test_side_by_side_refuses_no_videos_and_videos_of_other_shapes():
    # Mutation finds: the empty-list check and the shape check dropped
    with pytest.raises(ValueError, match="one label per video"):
        side_by_side([], [])
    a = np.zeros((2, 16, 16, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="differ in shape"):
        side_by_side([a, a[:, :8]], ["a", "b"])


# ----------------------------------------------------------------------------------------- attention probe
def test_spread_steps_of_one_is_the_last_step():
    # Mutation find: a count of 1 took the first step (the noisiest), not the last
    assert spread_steps(5, 1) == [4] and spread_steps(1, 1) == [0] and spread_steps(7, 3) == [0, 3, 6]


def _record(q, k, v, grid, **kw):
    base = dict(step=0, layer=0, branch="cond", grid=grid, text_len=0, text_position=None, dense_reason=None,
                text_slot=False, item=None)
    return SimpleNamespace(q=q, k=k, v=v, **{**base, **kw})


def test_the_probe_measures_only_the_chosen_steps_and_layers_once_each():
    # Mutation find: the step filter dropped (every step measured where a few were asked for)
    q = torch.zeros(1, 40, 3, 8)
    probe = AttentionProbe(session=None, steps=[1], layers=[0])
    for step, layer in ((0, 0), (1, 1), (1, 0), (1, 0), (2, 0)):
        probe(_record(q, q, q, (1, 5, 8), step=step, layer=layer, dense_reason="dense step"))
    assert [(e["step"], e["layer"]) for e in probe.entries] == [(1, 0)]


def test_a_dense_call_is_recorded_as_exact():
    # Mutation finds: a call run dense recorded recall 0, one per-head error for all heads, or tokens times heads
    q = torch.zeros(1, 40, 3, 8)
    probe = AttentionProbe(session=None)
    probe(_record(q, q, q, (1, 5, 8), dense_reason="dense step"))
    assert probe.entries == [{"step": 0, "layer": 0, "branch": "cond", "tokens": 40, "sparse": False,
                              "dense_reason": "dense step", "rel_l2": 0.0, "rel_l2_per_head": [0.0] * 3,
                              "recall": 1.0, "mass_kept": 1.0, "oracle_mass_kept": 1.0, "density": 1.0}]


@pytest.fixture(scope="module")
def session():
    import videosparse
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    tr = build_tiny_wan_pipeline().transformer
    s = videosparse.apply(tr, videosparse.VedaConfig(density=0.5, dense_steps=0))["transformer"]
    yield s
    videosparse.remove(tr)


def _qkv(B=2, S=384, H=2, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, D, generator=g) for _ in range(3)]


def test_probe_per_head_errors_are_means_over_the_batch(session, monkeypatch):
    # Mutation find: the per-head errors were those of the first batch item only
    outputs = catch_probe_outputs(monkeypatch)
    probe = AttentionProbe(session)
    probe(_record(*_qkv(), (3, 8, 16)))
    (entry,) = probe.entries
    want = relative_l2(outputs["sparse"], outputs["dense"][0])
    assert entry["sparse"] and not torch.allclose(want[0], want[1])
    assert entry["rel_l2_per_head"] == pytest.approx(want.mean(0).tolist(), rel=1e-6)


def test_probe_error_of_an_all_zero_output_is_zero(session):
    # Mutation find: the call's error divided by an unclamped ||dense|| (0 / 0: NaN for a layer whose v is 0)
    q, k, v = _qkv(B=1)
    probe = AttentionProbe(session)
    probe(_record(q, k, torch.zeros_like(v), (3, 8, 16)))
    assert probe.entries[0]["rel_l2"] == 0.0


def test_probe_attends_in_the_autocast_dtype(session, monkeypatch):
    # Mutation find: the probe ran the kernel in the inputs' dtype under autocast, where the processor attends in
    # the autocast dtype
    dtypes = []
    real_sparse = attention.block_sparse_attention
    monkeypatch.setattr(attention, "block_sparse_attention",
                        lambda q, *a, **kw: dtypes.append(q.dtype) or real_sparse(q, *a, **kw))
    probe = AttentionProbe(session)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probe(_record(*_qkv(B=1), (3, 8, 16)))
    assert dtypes == [torch.bfloat16] and math.isfinite(probe.entries[0]["rel_l2"])


def test_probe_puts_the_text_tokens_of_the_call_in_the_global_tiles(session, monkeypatch):
    # Mutation finds: the layout built with text_position "after" for any call, or without the call's text_len
    # (text tokens ahead of the video were taken for video tokens)
    gathered = []
    real_sparse = attention.block_sparse_attention
    monkeypatch.setattr(attention, "block_sparse_attention",
                        lambda q, *a, **kw: gathered.append(q) or real_sparse(q, *a, **kw))
    q, k, v = _qkv(B=1, S=384 + 128)
    q[:, :128, :, 0] = 1e3                                   # the text tokens, ahead of the 384 video tokens
    probe = AttentionProbe(session)
    probe(_record(q, k, v, (3, 8, 16), text_len=128, text_position="before"))
    marked = (gathered[0][0, :, :, 0] == 1e3).nonzero()[:, 1].view(2, -1)
    assert torch.equal(marked, torch.arange(384, 512).expand(2, -1)) and probe.entries[0]["tokens"] == 512


# ----------------------------------------------------------------------------------------- figures
@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions make, kept open instead of saved."""
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, **kw: figs.append(fig))
    yield figs
    for fig in figs:
        plt.close(fig)


SUMMARY = {
    "dense": {"family": "dense", "method": "dense", "realised_density": 1.0, "psnr_db": 40.0, "ssim": 1.0,
              "speedup_transformer": 1.0, "attention_work": 1.0},
    "veda@0.5": {"family": "veda", "method": "veda@0.5", "realised_density": 0.5, "psnr_db": 30.0, "ssim": 0.9,
                 "speedup_transformer": 1.5, "attention_work": 0.6},
    "veda@0.2": {"family": "veda", "method": "veda@0.2", "realised_density": 0.2, "psnr_db": 25.0, "ssim": 0.8,
                 "speedup_transformer": 2.5, "attention_work": 0.3},
    "veda@0.1": {"family": "veda", "method": "veda@0.1", "realised_density": 0.1, "psnr_db": math.inf,
                 "ssim": None, "speedup_transformer": 3.0, "attention_work": 0.15},
    "sol@0.3": {"family": "sol", "method": "sol@0.3", "realised_density": 0.3, "psnr_db": math.nan,
                "ssim": 0.7, "speedup_transformer": 2.0, "attention_work": 0.35},
}


def _lines(ax) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_quality_plot_draws_finite_sparse_points_sorted_by_density(figures):
    # Mutation finds: dense drawn as a family; points with one finite coordinate kept (and_/or); inf kept (the
    # finiteness test dropped); points left in summary order; the SSIM panel drew the PSNR
    plots.plot_quality_vs_density(SUMMARY, "unused.png")
    psnr, ssim = figures[0].axes[:2]
    assert _lines(psnr) == {"veda": ([0.2, 0.5], [25.0, 30.0])}
    assert _lines(ssim) == {"veda": ([0.2, 0.5], [0.8, 0.9]), "sol": ([0.3], [0.7])}


def test_quality_plot_draws_the_pooled_psnr_beside_the_mean(figures):
    """Review find: the report notes that a mean PSNR pulled up by cells nearly identical to dense is not the robust
    figure, and the plot drew only that mean (61 and 64 dB on the reference model at 5 steps). The pooled PSNR is
    drawn dashed in the family's colour; a family without it keeps its plain label."""
    summary = {**SUMMARY,
               "veda@0.5": {**SUMMARY["veda@0.5"], "psnr_db": 61.4, "psnr_db_pooled": 27.4},
               "veda@0.2": {**SUMMARY["veda@0.2"], "psnr_db_pooled": 24.0}}
    plots.plot_quality_vs_density(summary, "unused.png")
    psnr = figures[0].axes[0]
    lines = _lines(psnr)
    assert lines == {"veda (mean over cells)": ([0.2, 0.5], [25.0, 61.4]), "veda (pooled)": ([0.2, 0.5], [24.0, 27.4])}
    mean, pooled = psnr.get_lines()
    assert pooled.get_linestyle() == "--" and pooled.get_color() == mean.get_color()
    plots.plot_quality_vs_density(SUMMARY, "unused.png")
    assert list(_lines(figures[1].axes[0])) == ["veda"]


def test_speedup_plot_axes_and_amdahl_estimate(figures):
    # Mutation finds: x and y keys swapped; the default x key the realised density instead of the attention work;
    # the Amdahl curve 1 / ((1 - f) + d); a negative attention share not clamped to 0
    plots.plot_speedup_vs_density(SUMMARY, 0.8, "unused.png")
    lines = _lines(figures[0].axes[0])
    assert lines["veda (measured)"] == ([0.15, 0.3, 0.6], [3.0, 2.5, 1.5])
    assert lines["sol (measured)"] == ([0.35], [2.0])
    d, amdahl = lines["Amdahl estimate, attention share 80%"]
    assert np.allclose(amdahl, 1 / (0.2 + 0.8 * np.asarray(d)))
    plots.plot_speedup_vs_density(SUMMARY, -0.5, "unused.png")
    d, amdahl = _lines(figures[1].axes[0])["Amdahl estimate, attention share 0%"]
    assert np.allclose(amdahl, 1.0)


def test_error_matrices_average_each_cell_and_skip_entries_without_a_step():
    # Mutation finds: a cell took the largest (or the last) of its errors, not their mean; entries without a step
    # (calls outside the denoising loop) were placed; the matrix filled as steps x layers
    entries = [{"layer": 0, "step": 0, "rel_l2": 0.1}, {"layer": 0, "step": 0, "rel_l2": 0.3},
               {"layer": 1, "step": 4, "rel_l2": 0.5}, {"layer": 2, "step": 0, "rel_l2": 0.7},
               {"layer": 0, "step": None, "rel_l2": 9.0}]
    mats = plots.error_matrices({"c": {"method": "sol@0.2", "entries": {"transformer": entries}}})
    layers, steps, m = mats["sol@0.2"]
    assert layers == [0, 1, 2] and steps == [0, 4]
    assert np.allclose(m, [[0.2, np.nan], [np.nan, 0.5], [0.7, np.nan]], equal_nan=True)


def test_error_heatmap_of_no_samples_draws_one_empty_panel(figures):
    # Mutation find: no panel at all for a report without attention samples (plt.subplots(1, 0) raised)
    plots.plot_error_heatmap({}, "unused.png")
    assert [t.get_text() for t in figures[0].axes[0].texts] == ["no attention-level samples"]
