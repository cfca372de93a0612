"""scripts/veda_capacity_probe.py on made-up captures: the untrained MLP is the mean-pooled baseline, training
lowers the KL on captures with a learnable signal, and the report holds every form and split."""

import json
import sys

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
    assert report["samples"] == {"train": 8, "held_out": 3}
    assert set(report["held_out_ratio_vs_untrained"]) == {"projection (shipped)", "mlp hidden 32"}
