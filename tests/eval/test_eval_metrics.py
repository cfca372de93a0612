"""Video and attention metrics on constructed inputs with known values."""

import json
import math

import numpy as np
import pytest
import torch

from videosparse.eval.attention import spread_steps
from videosparse.eval.metrics import (dense_attention_tile_mass, load_lpips, psnr, psnr_per_frame, psnr_video,
                                      relative_l2, ssim, ssim_per_frame, tile_recall)
from videosparse._io import from_jsonable, to_jsonable
from videosparse.plan import plan_from_mask

from helpers import catch_probe_outputs


def _video(seed=0, shape=(3, 32, 40, 3)):
    rng = np.random.default_rng(seed)
    return rng.uniform(0.2, 0.8, size=shape).astype(np.float32)


def test_psnr_of_known_noise_levels():
    ref = _video()
    # constant offset 0.1 -> MSE 0.01 -> 20 dB per frame
    np.testing.assert_allclose(psnr_per_frame(ref + 0.1, ref), [20.0] * 3, atol=1e-4)
    # random signs of amplitude 0.05 -> MSE 0.0025 -> 26.0206 dB
    sign = np.where(np.random.default_rng(1).random(ref.shape) < 0.5, -1.0, 1.0).astype(np.float32)
    assert psnr(ref + 0.05 * sign, ref) == pytest.approx(10 * math.log10(1 / 0.0025), abs=1e-3)
    # one noisy frame: the other frames are infinite, so the mean is too
    noisy = ref.copy()
    noisy[1] += 0.1
    values = psnr_per_frame(noisy, ref)
    assert math.isinf(values[0]) and values[1] == pytest.approx(20.0, abs=1e-4)


def test_video_psnr_pools_the_error_over_frames():
    ref = _video()
    assert psnr_video(ref + 0.1, ref) == pytest.approx(20.0, abs=1e-4)
    noisy = ref.copy()
    noisy[1:] += 0.1                       # frame 0 identical: MSE = 2/3 * 0.01, finite
    assert psnr_video(noisy, ref) == pytest.approx(10 * math.log10(1 / (0.01 * 2 / 3)), abs=1e-4)
    assert math.isinf(psnr_video(ref, ref))


def test_identical_videos_give_inf_psnr_and_unit_ssim():
    ref = _video()
    assert all(math.isinf(v) and v > 0 for v in psnr_per_frame(ref, ref))
    assert math.isinf(psnr(ref, ref))
    assert ssim_per_frame(ref, ref) == pytest.approx([1.0] * 3, abs=1e-6)


def test_ssim_of_constant_frames_matches_the_formula():
    # constant frames a and b: the structure terms are C2/C2 = 1, SSIM = (2ab + C1) / (a^2 + b^2 + C1)
    a, b, c1 = 0.5, 0.6, (0.01 * 1.0) ** 2
    x = np.full((2, 24, 24, 3), a, np.float32)
    y = np.full((2, 24, 24, 3), b, np.float32)
    expected = (2 * a * b + c1) / (a * a + b * b + c1)
    assert ssim_per_frame(y, x) == pytest.approx([expected] * 2, abs=1e-5)
    assert ssim(y, x) == pytest.approx(expected, abs=1e-5)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="differ in shape"):
        psnr_per_frame(_video(shape=(2, 8, 8, 3)), _video(shape=(3, 8, 8, 3)))


def test_relative_l2_per_head():
    ref = torch.randn(2, 3, 50, 16)
    out = ref.clone()
    out[:, 1] *= 1.1
    err = relative_l2(out, ref)
    assert err.shape == (2, 3)
    torch.testing.assert_close(err[:, 1], torch.full((2,), 0.1, dtype=torch.float64), atol=1e-6, rtol=0)
    assert float(err[:, [0, 2]].abs().max()) == 0.0


@pytest.mark.parametrize("max_elements", [1 << 30, 1])
def test_dense_attention_tile_mass(max_elements):
    B, H, S, D, bm, bn = 1, 2, 200, 16, 64, 32
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    out, mass = dense_attention_tile_mass(q, k, v, bm, bn, max_elements=max_elements)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert mass.shape == (B, H, math.ceil(S / bm), math.ceil(S / bn))
    rows = torch.tensor([64.0, 64.0, 64.0, 8.0])                    # real rows per query tile
    torch.testing.assert_close(mass.sum(-1), rows.expand(B, H, 4), atol=1e-4, rtol=1e-5)
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1)
    torch.testing.assert_close(mass[..., 1, 2], p[:, :, 64:128, 64:96].sum((-1, -2)), atol=1e-5, rtol=1e-5)


def test_tile_recall_against_constructed_oracle():
    # one row per (b, h, i); mass decreasing with the key-tile index, so the oracle keeps the first tiles
    Nk = 6
    mass = torch.arange(Nk, 0, -1, dtype=torch.float32).expand(1, 1, 3, Nk).contiguous()
    mask = torch.zeros(1, 1, 3, Nk, dtype=torch.bool)
    mask[0, 0, 0, [0, 1]] = True        # the oracle's two tiles: recall 1
    mask[0, 0, 1, [4, 5]] = True        # the two worst tiles: recall 0
    mask[0, 0, 2, [0, 5]] = True        # one of two: recall 0.5
    r = tile_recall(plan_from_mask(mask, 64, 64), mass)
    assert r["recall"] == pytest.approx(0.5)
    total = 3 * sum(range(1, Nk + 1))
    assert r["mass_kept"] == pytest.approx((6 + 5 + 2 + 1 + 6 + 1) / total)
    assert r["oracle_mass_kept"] == pytest.approx(3 * (6 + 5) / total)
    assert r["density"] == pytest.approx(6 / 18)
    # rows that keep every tile have no choice: left out of recall
    full = torch.ones(1, 1, 3, Nk, dtype=torch.bool)
    assert tile_recall(plan_from_mask(full, 64, 64), mass)["recall"] == 1.0


def test_spread_steps():
    assert spread_steps(10, 3) == [0, 4, 9] or spread_steps(10, 3) == [0, 5, 9]
    assert spread_steps(2, 3) == [0, 1]
    assert spread_steps(1, 3) == [0]
    with pytest.raises(ValueError):
        spread_steps(0)


def test_report_json_is_strict_and_round_trips_infinity():
    data = {"psnr": math.inf, "neg": -math.inf, "nan": math.nan, "t": torch.tensor([1.5]), "n": np.float32(2.0)}
    text = json.dumps(to_jsonable(data), allow_nan=False)
    back = from_jsonable(json.loads(text))
    assert math.isinf(back["psnr"]) and back["psnr"] > 0 and back["neg"] < 0 and math.isnan(back["nan"])
    assert back["t"] == [1.5] and back["n"] == 2.0


def test_lpips_unavailable_is_a_note_not_an_error():
    import importlib.util

    model, note = load_lpips("cpu")
    if importlib.util.find_spec("lpips") is None:
        assert model is None and "pip install lpips" in note
    else:
        assert (model is None) == (note is not None)


def test_frames_outside_the_unit_range_are_refused():
    import numpy as np
    import pytest

    from videosparse.eval.metrics import psnr_video, ssim_per_frame

    a = np.random.default_rng(0).random((2, 8, 8, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="float in \\[0, 1\\]"):
        psnr_video((a * 255).astype(np.uint8), (a * 255).astype(np.uint8))
    with pytest.raises(ValueError, match="must lie in \\[0, 1\\]"):
        ssim_per_frame(a * 255, a * 255)


def test_attention_probe_records_the_calls_the_processor_ran_dense(monkeypatch):
    """Review find: the probe measured every call outside the config's dense schedule as sparse, also those the
    processor ran dense because no kernel served them (on a GPU: a dtype no fast kernel takes), so the attention
    table reported sparse errors for a run that was dense."""
    import videosparse
    from videosparse.eval.attention import AttentionProbe
    from videosparse.kernels.probe import KernelProbe
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline
    from videosparse.processors import observe
    from videosparse.processors import session as session_module

    tr = build_tiny_wan_pipeline().transformer
    kw = dict(hidden_states=torch.randn(1, 4, 3, 16, 24, generator=torch.Generator().manual_seed(0)),
              timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 8, 32))

    def probe_run():
        session = videosparse.apply(tr, videosparse.VedaConfig(density=0.5, dense_steps=0, dense_layers=(1,)))
        probe = AttentionProbe(session["transformer"])
        with observe(tr, probe), torch.no_grad():
            tr(**kw)
        stats = session["transformer"].stats()
        videosparse.remove(tr)
        return {e["layer"]: e for e in probe.entries}, stats

    entries, stats = probe_run()
    assert entries[0]["sparse"] and 0 < entries[0]["rel_l2"] < 1 and stats["sparse_calls"] == 1
    assert not entries[1]["sparse"] and entries[1]["dense_reason"] == "dense layer"
    monkeypatch.setattr(session_module, "probe_kernel",
                        lambda *args: KernelProbe("reference", "no fast kernel serves x"))
    entries, stats = probe_run()
    assert stats["sparse_calls"] == 0
    assert not entries[0]["sparse"] and entries[0]["dense_reason"] == "no fast kernel serves x"
    assert entries[0]["rel_l2"] == 0.0 and entries[1]["dense_reason"] == "dense layer"


def test_tile_recall_leaves_out_rows_that_keep_no_tile():
    """Review find: a row with no kept tile (e.g. past a key limit) counted as recall 0."""
    mass = torch.tensor([[[[0.6, 0.3, 0.1], [0.2, 0.7, 0.1]]]])
    mask = torch.tensor([[[[True, False, False], [False, False, False]]]])
    assert tile_recall(plan_from_mask(mask, 64, 64), mass)["recall"] == 1.0


def test_metric_inputs_that_used_to_slip_by_or_fail_obscurely():
    """Review finds: one NaN pixel made both range checks false (0..255 frames scored SSIM 1.0); frames under 6
    pixels failed inside torch's padding and an empty video with an IndexError."""
    a = np.random.default_rng(0).random((2, 8, 8, 3)).astype(np.float32) * 255
    a[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="must lie in \\[0, 1\\]"):
        ssim_per_frame(a, a)
    small = np.zeros((2, 5, 40, 3), dtype=np.float32)
    for metric in (ssim, ssim_per_frame):
        with pytest.raises(ValueError, match="at least 6 x 6 pixels"):
            metric(small, small)
    assert psnr_video(small, small) == math.inf                # PSNR has no window
    with pytest.raises(ValueError, match="hold no frame"):
        psnr_video(small[:0], small[:0])


def test_tile_recall_counts_tied_tiles_as_the_oracles():
    """Review find: with tied masses (uniform attention, or tiles whose mass underflowed to 0) the oracle was
    whichever tiles the sort put first, so a plan keeping as much mass as the oracle read recall 0."""
    uniform = torch.full((1, 1, 1, 6), 1 / 6)
    plan = plan_from_mask(torch.tensor([[[[False, False, False, False, True, True]]]]), 64, 64)
    r = tile_recall(plan, uniform)
    assert r["recall"] == 1.0 and r["mass_kept"] == pytest.approx(r["oracle_mass_kept"])
    mass = torch.tensor([[[[0.6, 0.4, 0.0, 0.0]]]])            # two tiles of zero mass: either one counts
    plan = plan_from_mask(torch.tensor([[[[True, True, False, True]]]]), 64, 64)
    assert tile_recall(plan, mass)["recall"] == 1.0
    plan = plan_from_mask(torch.tensor([[[[True, False, True, True]]]]), 64, 64)
    assert tile_recall(plan, mass)["recall"] == pytest.approx(2 / 3)


def test_a_broken_lpips_install_is_a_note(tmp_path, monkeypatch):
    """Review find: `import lpips` sat outside the guard, so a torch / torchvision mismatch raising at import ended
    the evaluation at its first cell."""
    import sys

    package = tmp_path / "site" / "lpips"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "lpips", raising=False)
    hub = tmp_path / "hub"
    (hub / "checkpoints").mkdir(parents=True)
    (hub / "checkpoints" / "alexnet-owt-7be5be79.pth").write_bytes(b"")
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))
    model, note = load_lpips("cpu")
    assert model is None and "torchvision::nms" in note


def test_heatmap_scale_and_drawing_with_a_non_finite_cell(tmp_path):
    """Review find: the heatmap's colour scale took inf from an inf cell (np.nanmax skips NaN only), so the finite
    cells all drew in one colour and the colour bar read -0.1..0.1."""
    from videosparse.eval.plots import error_matrices, heatmap_top, plot_error_heatmap

    entries = [{"layer": 0, "step": 0, "rel_l2": 0.2}, {"layer": 1, "step": 0, "rel_l2": math.inf},
               {"layer": 0, "step": 3, "rel_l2": math.nan}]
    attention = {"c": {"method": "veda@0.1", "entries": {"transformer": entries}}}
    assert heatmap_top(error_matrices(attention)) == pytest.approx(0.2)
    assert heatmap_top({}) == 1e-6
    assert plot_error_heatmap(attention, str(tmp_path / "h.png")) == str(tmp_path / "h.png")


def test_plots_are_saved_atomically(tmp_path, monkeypatch):
    """The plots were saved in place: a run killed while saving one left a partial PNG. A save that fails now leaves
    the figure before it whole and no temporary file, and names the path."""
    import os

    from videosparse.eval.plots import plot_quality_vs_density, plot_speedup_vs_density

    summary = {"veda@0.1": {"family": "veda", "method": "veda@0.1", "realised_density": 0.1, "psnr_db": 30.0,
                            "ssim": 0.9, "speedup_transformer": 2.0, "attention_work": 0.1}}
    path = tmp_path / "q.png"
    plot_quality_vs_density(summary, str(path))
    before = path.read_bytes()
    assert before.startswith(b"\x89PNG")

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="q.png.*No space left"):
        plot_speedup_vs_density(summary, 0.8, str(path))
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["q.png"]


def test_attention_probe_divides_the_calls_error_by_the_dense_output(monkeypatch):
    """Mutation testing: the headline per-call attn rel L2 must be ||sparse - dense|| / ||dense|| (as the per-head
    values), not divided by ||sparse||; the probe's own sparse and dense outputs are caught and the number recomputed."""
    import videosparse
    from videosparse.eval.attention import AttentionProbe
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline
    from videosparse.processors import observe

    outputs = catch_probe_outputs(monkeypatch)
    torch.manual_seed(0)
    tr = build_tiny_wan_pipeline().transformer
    kw = dict(hidden_states=torch.randn(1, 4, 3, 16, 24, generator=torch.Generator().manual_seed(0)),
              timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 8, 32))
    session = videosparse.apply(tr, videosparse.SolConfig(density=0.2, dense_steps=0, block=64, tiling=(1, 8, 8)))
    probe = AttentionProbe(session["transformer"], layers=[0])
    with observe(tr, probe), torch.no_grad():
        tr(**kw)
    videosparse.remove(tr)
    (entry,) = probe.entries
    sparse, dense = outputs["sparse"].double(), outputs["dense"][0].double()
    assert entry["sparse"] and float((sparse - dense).norm() / sparse.norm()) > 1.05 * entry["rel_l2"]
    assert entry["rel_l2"] == pytest.approx(float((sparse - dense).norm() / dense.norm()), rel=1e-4)
    assert min(entry["rel_l2_per_head"]) - 1e-6 <= entry["rel_l2"] <= max(entry["rel_l2_per_head"]) + 1e-6


def test_tile_recall_leaves_out_rows_that_keep_every_tile():
    """Mutation testing: rows that keep every tile (text or global rows) have no choice to get right; averaged in,
    two full rows turned the recall of two wrong video rows from 0 into 0.5."""
    mass = torch.arange(6, 0, -1, dtype=torch.float32).expand(1, 1, 4, 6).contiguous()
    mask = torch.zeros(1, 1, 4, 6, dtype=torch.bool)
    mask[0, 0, :2, 4:] = True               # video rows: the two smallest of six tiles (the oracle keeps 0 and 1)
    mask[0, 0, 2:] = True                   # text rows: every tile
    assert tile_recall(plan_from_mask(mask, 64, 64), mass)["recall"] == 0.0
    mask[0, 0, 0, :2] = True                # one video row keeps the oracle's two tiles
    mask[0, 0, 0, 4:] = False
    mask[0, 0, 1, [0, 5]] = True            # the other: one right, one wrong of its two
    mask[0, 0, 1, 4] = False
    assert tile_recall(plan_from_mask(mask, 64, 64), mass)["recall"] == pytest.approx(0.75)


def test_psnr_is_the_mean_of_the_frames_psnr():
    """Mutation find: psnr() took the median of the per-frame values and no test noticed; with frames at 20, 26.02
    and 40 dB the mean (28.67) and the median (26.02) differ."""
    ref = np.full((3, 16, 16, 3), 0.5)
    video = ref + np.array([0.1, 0.05, 0.01])[:, None, None, None]
    per_frame = psnr_per_frame(video, ref)
    np.testing.assert_allclose(per_frame, [20.0, 10 * math.log10(1 / 0.0025), 40.0], atol=1e-4)
    assert psnr(video, ref) == pytest.approx(float(np.mean(per_frame)), abs=1e-6)
    assert psnr(video, ref) == pytest.approx((20.0 + 10 * math.log10(400) + 40.0) / 3, abs=1e-4)


def test_ssim_compares_the_colour_channels():
    """Mutation find: ssim() on the grey mean of the channels gave 1.0 for a video with its channels reversed (same
    mean, different colours); it compares RGB, as ssim_per_frame does, and is the mean of the per-frame values."""
    ref = np.random.default_rng(0).random((2, 16, 16, 3))
    swapped = ref[..., ::-1].copy()
    assert ssim(swapped, ref) < 0.9
    assert ssim(swapped, ref) == pytest.approx(float(np.mean(ssim_per_frame(swapped, ref))), abs=1e-6)
    video = np.clip(ref + 0.1 * np.random.default_rng(1).standard_normal(ref.shape), 0, 1)
    assert ssim(video, ref) == pytest.approx(float(np.mean(ssim_per_frame(video, ref))), abs=1e-6)


def test_lpips_gets_both_videos_scaled_to_minus_one_one():
    """Mutation find: LPIPS expects inputs in [-1, 1]; a video passed in [0, 1] went unnoticed, since the tests only
    covered lpips being unavailable. A stub model records what it is given."""
    from videosparse.eval.metrics import lpips_distance

    seen = []

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x, y):
            seen.append((x.clone(), y.clone()))
            return (x - y).abs().mean((1, 2, 3))

    video = np.linspace(0, 1, 2 * 8 * 8 * 3).reshape(2, 8, 8, 3)
    reference = video[::-1].copy()
    value = lpips_distance(Stub(), video, reference)
    (x, y), = seen
    torch.testing.assert_close(x, torch.as_tensor(video).permute(0, 3, 1, 2).float() * 2 - 1)
    torch.testing.assert_close(y, torch.as_tensor(reference).permute(0, 3, 1, 2).float() * 2 - 1)
    assert value == pytest.approx(float((x - y).abs().mean()), rel=1e-6)
