"""scripts/veda_capacity_probe.py on made-up captures: the untrained MLP is the mean-pooled baseline, training
lowers the KL on captures with a learnable signal, and the report holds every form and split."""

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import save_file

from helpers import load_script


def _write_captures(root, samples: int, layers=2, heads=2, head_dim=8, tiles=16, seed=0):
    """Captures whose teacher heat follows a fixed per-head linear map of the features (so there is signal)."""
    g = torch.Generator().manual_seed(seed)
    maps = torch.randn(layers, heads, 3 * head_dim, head_dim, generator=torch.Generator().manual_seed(99))
    root.mkdir(parents=True)
    for i in range(samples):
        t = {}
        for l in range(layers):
            qf, kf = (torch.randn(1, heads, tiles, 3 * head_dim, generator=g) for _ in range(2))
            t[f"q.{l}"], t[f"k.{l}"] = qf, kf
            t[f"heat.{l}"] = torch.softmax((qf @ maps[l]) @ (kf @ maps[l]).transpose(-1, -2), -1)
        save_file(t, str(root / f"p{i:05d}_s0000_cond.safetensors"))
    return {"num_layers": layers, "num_heads": heads, "head_dim": head_dim}


def test_probe_trains_every_form_and_reports_both_splits(tmp_path, monkeypatch):
    probe = load_script("veda_capacity_probe")
    info = _write_captures(tmp_path / "w" / "estimator" / "cache", 8)
    _write_captures(tmp_path / "w" / "eval_cache", 3, seed=1)
    (tmp_path / "w" / "eval_cache" / "model_info.json").write_text(json.dumps(info))
    held = tmp_path / "w" / "eval_cache" / "p00001_s0000_cond.safetensors"
    shutil.copy(held, held.with_name("p00001_s0000_uncond.safetensors"))  # a branch pair with the same attention
    qf = torch.randn(1, 2, 16, 24)
    _, mlp_logits = probe.layer_logits_fn(32, 2, 8)
    torch.testing.assert_close(mlp_logits(qf, qf), probe.mean_pooled_logits(qf, qf), rtol=1e-2, atol=1e-2)

    out = tmp_path / "probe.json"
    monkeypatch.setattr(sys, "argv", ["veda_capacity_probe.py", "--work-dir", str(tmp_path / "w"), "--hidden", "0",
                                      "32", "--steps", "60", "--batch", "4", "--learning-rate", "1e-2",
                                      "--out", str(out)])
    probe.main()
    report = json.loads(out.read_text())
    forms = report["forms"]
    assert set(forms) == {"untrained_mean_pool", "projection (shipped)", "mlp hidden 32"}
    for name in ("projection (shipped)", "mlp hidden 32"):
        assert forms[name]["train"]["kl"] < forms["untrained_mean_pool"]["train"]["kl"]
        assert 0 <= forms[name]["held_out"]["recall"] <= 1
        assert 0 < forms[name]["held_out"]["heat_recall"] <= 1
    assert report["samples"] == {"train": 8, "train_prompts": 8, "held_out": 4}
    oracle = report["oracle_held_out"]
    assert oracle["branch_pairs"] == 1 and oracle["cond_vs_uncond_recall"] == oracle["cond_vs_uncond_heat_recall"] == 1
    assert 0 <= oracle["near_tie_rows_1pct"] <= oracle["near_tie_rows_10pct"] <= 1
    assert set(report["held_out_ratio_vs_untrained"]) == {"projection (shipped)", "mlp hidden 32"}


def test_sample_selection_takes_the_first_prompts_and_the_steps_the_capture_would_draw(tmp_path):
    """`--prompts` / `--steps-per-prompt` on an every-step capture: the first N prompts, and of each the steps
    `sample_steps` draws with the capture's seed (both CFG branches), so a subset equals the smaller capture."""
    from videosparse.distill.capture import sample_steps

    probe = load_script("veda_capacity_probe")
    for i in range(4):
        for step in range(10):
            for branch in ("cond", "uncond"):
                (tmp_path / f"p{i:05d}_s{step:04d}_{branch}.safetensors").touch()
    (tmp_path / "p00000.done").touch()
    assert len(probe.select_samples(tmp_path, None, None, 0)) == 80
    got = probe.select_samples(tmp_path, 3, 2, 5)
    want = sorted(f"p{i:05d}_s{step:04d}_{branch}.safetensors" for i in range(3)
                  for step in sample_steps(10, 2, 5, i) for branch in ("cond", "uncond"))
    assert sorted(f.name for f in got) == want and len(want) == 12
    assert probe.select_samples(tmp_path / "missing", None, 2, 0) == []
    for branch in ("cond", "uncond"):                                      # prompt 3 misses one step
        (tmp_path / f"p00003_s0004_{branch}.safetensors").unlink()
    with pytest.raises(ValueError, match=r"only some of the 10 steps of prompt\(s\) \[3\]"):
        probe.select_samples(tmp_path, None, 2, 0)
    assert len(probe.select_samples(tmp_path, None, None, 0)) == 78     # all that is there, without drawing
