#!/usr/bin/env python
"""Does more estimator capacity raise held-out tile recall? Veda's per-head residual projection vs a per-head MLP.

Reads the captures `scripts/veda_report.py` leaves in its work dir (training prompts under
`estimator/cache/`, held-out prompts under `eval_cache/`: TripPool features and teacher heat per layer) and
trains, for every layer, the shipped form (`VedaEstimator`: q_hat = mean + f @ P, P (3D, D) per head) and
residual MLPs q_hat = mean + gelu(f @ W1 + b1) @ W2 (W1 (3D, hidden), W2 (hidden, D) per head, W2 initialised
like P so that the untrained MLP is the mean-pooled baseline too), each with the row-wise KL loss, minibatches of
`--batch` samples, AdamW and a cosine schedule. Reports KL, recall and off-diagonal recall at `--density` on the
training samples and on the held-out ones (as `veda_report.py` measures them), per form, with the teacher heat each
form's tiles keep against the oracle's (heat recall). Beside them, how stable the oracle itself is on the held-out
captures: the share of rows with a near tie at the budget (`oracle_near_ties`), and how far the oracles of the two
CFG branches of the same call agree (the same latents and step, another text).

The MLPs are a probe, not a shipped estimator form.

    python scripts/veda_report.py --work-dir outputs/veda_report    # once, for the captures
    python scripts/veda_capacity_probe.py --work-dir outputs/veda_report --out benchmarks/veda_capacity_probe.json

More data: `--train-cache` reads the training samples from another capture, e.g. the every-step one of
`videosparse distill` on the same 32 prompts (docs/results.md, "Quality": `veda-reference/cache`);
`--prompts N` and `--steps-per-prompt K` take its first N prompts and K of each prompt's steps (drawn as the
capture draws them, `--step-seed` its seed). With seed 0 and 2 steps that is exactly the 128 samples
`veda_report.py` trains on, so sizes compare on the same prompts and noise:

    python scripts/veda_capacity_probe.py --work-dir outputs/veda_report --train-cache veda-reference/cache \
        --steps-per-prompt 4 --hidden 0 --out 256.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from videosparse.distill.capture import sample_steps  # noqa: E402
from videosparse.distill.train import TileSampleDataset  # noqa: E402
from videosparse.veda.estimator import DEFAULT_INIT_STD, VedaEstimator, scaled_logits  # noqa: E402
from videosparse.veda.losses import oracle_near_ties, tile_kl_loss, tile_recall  # noqa: E402
from videosparse.veda.method import mean_pooled_logits  # noqa: E402


def load_layers(files: list[Path], num_layers: int) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{layer: (q features, k features, heat)} with the samples concatenated along the batch dim (fp32)."""
    data = TileSampleDataset(files, num_layers)
    samples = [data[i] for i in range(len(data))]
    return {l: tuple(torch.cat([s[l][i].float() for s in samples]) for i in range(3)) for l in range(num_layers)}


def select_samples(cache: Path, prompts: int | None, steps_per_prompt: int | None, step_seed: int) -> list[Path]:
    """A capture's sample files (`p{prompt:05d}_s{step:04d}_{branch}.safetensors`) of its first `prompts` prompts
    (None: all) and, per prompt, the `steps_per_prompt` steps `sample_steps` draws with `step_seed` from the steps the
    capture holds (None: all of them). Drawing steps needs a capture of every step: one that lacks a step raises."""
    files: dict[int, dict[int, list[Path]]] = {}                 # prompt -> step -> its branches' files
    for f in sorted(cache.glob("p*_s*.safetensors")):
        files.setdefault(int(f.name[1:6]), {}).setdefault(int(f.name.split("_")[1][1:]), []).append(f)
    if not files:
        return []
    num_steps = 1 + max(max(steps) for steps in files.values())
    partial = sorted(i for i, steps in files.items() if len(steps) < num_steps)
    if steps_per_prompt is not None and partial:
        raise ValueError(f"--steps-per-prompt {steps_per_prompt} draws from every captured step, but {cache} "
                         f"holds only some of the {num_steps} steps of prompt(s) {partial[:5]}; give a capture of "
                         "every step (`videosparse distill` without --steps-per-prompt) or leave it out.")
    return [f for i, steps in sorted(files.items()) if prompts is None or i < prompts
            for step in sample_steps(num_steps, steps_per_prompt, step_seed, i) for f in steps.get(step, [])]


def oracle_stability(files: list[Path], num_layers: int, density: float) -> dict[str, float]:
    """How much tile recall the oracle itself leaves room for, over capture files (fp32 heat per layer).

    Returns:
        {"near_tie_rows_10pct", "near_tie_rows_1pct"}: the mean over files and layers of `oracle_near_ties` at 10% /
        1%; with captures of both CFG branches of a call (`..._cond` and `..._uncond`), also
        {"cond_vs_uncond_recall", "cond_vs_uncond_recall_offdiag", "cond_vs_uncond_heat_recall", "branch_pairs"}:
        the uncond oracle's top-k scored against the cond one's as `tile_recall` scores an estimator.
    """
    data = TileSampleDataset(files, num_layers)
    heats = {f.name: [data[i][l][2].float() for l in range(num_layers)] for i, f in enumerate(files)}
    out = {f"near_tie_rows_{int(w * 100)}pct": sum(oracle_near_ties(h, density, w) for hs in heats.values() for h in hs)
           / (len(heats) * num_layers) for w in (0.1, 0.01)}
    pairs = [(heats[n], heats[n.replace("_cond.", "_uncond.")]) for n in heats
             if n.endswith("_cond.safetensors") and n.replace("_cond.", "_uncond.") in heats]
    if pairs:
        scored = [tile_recall(u, c, density) for cs, us in pairs for c, u in zip(cs, us)]
        out.update({f"cond_vs_uncond_{k}": sum(r[k] for r in scored) / len(scored)
                    for k in ("recall", "recall_offdiag", "heat_recall")})
        out["branch_pairs"] = len(pairs)
    return out


class ResidualMLP(nn.Module):
    """Per-head q_hat = mean + gelu(f @ W1 + b1) @ W2, for features fp32 [B, H, N, 3D] -> [B, H, N, D]."""

    def __init__(self, heads: int, head_dim: int, hidden: int, init_std: float) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(heads, 3 * head_dim, hidden) / math.sqrt(3 * head_dim))
        self.b1 = nn.Parameter(torch.zeros(heads, 1, hidden))
        self.w2 = nn.Parameter(torch.randn(heads, hidden, head_dim) * init_std)

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        return feat[..., :self.w2.shape[-1]] + nn.functional.gelu(feat @ self.w1 + self.b1) @ self.w2


def layer_logits_fn(hidden: int, heads: int, head_dim: int):
    """(parameters, logits(qf, kf)) of one layer's estimator: the shipped projection when hidden == 0."""
    if hidden == 0:
        est = VedaEstimator("probe", num_layers=1, num_heads=heads, head_dim=head_dim, tile_shapes=(4, 4, 8))
        return list(est.parameters()), lambda qf, kf: est(qf, kf, 0)
    mq, mk = (ResidualMLP(heads, head_dim, hidden, DEFAULT_INIT_STD) for _ in range(2))
    return [*mq.parameters(), *mk.parameters()], lambda qf, kf: scaled_logits(mq(qf), mk(kf), 1 / math.sqrt(head_dim))


def scores(logits: torch.Tensor, heat: torch.Tensor, density: float) -> dict[str, float]:
    return {"kl": float(tile_kl_loss(logits, heat)), **tile_recall(logits, heat, density)}


def mean_over_layers(per_layer: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(d[k] for d in per_layer) / len(per_layer) for k in per_layer[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", default="outputs/veda_report", help="a veda_report.py work dir (its captures)")
    ap.add_argument("--hidden", type=int, nargs="+", default=[0, 256, 1024], help="0 = the shipped projection")
    ap.add_argument("--steps", type=int, default=600, help="optimizer steps per layer")
    ap.add_argument("--batch", type=int, default=32, help="samples per step")
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's")
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--train-cache", default=None, help="training captures (default: WORK_DIR/estimator/cache)")
    ap.add_argument("--prompts", type=int, default=None, help="use the first N prompts of the training captures")
    ap.add_argument("--steps-per-prompt", type=int, default=None,
                    help="use K of each prompt's captured steps (as the capture samples them; default: all)")
    ap.add_argument("--step-seed", type=int, default=0, help="the step-sampling seed (a capture's --seed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/veda_capacity_probe.json")
    args = ap.parse_args()
    work = Path(args.work_dir)
    train_cache = Path(args.train_cache) if args.train_cache else work / "estimator" / "cache"
    train_files = select_samples(train_cache, args.prompts, args.steps_per_prompt, args.step_seed)
    held_files = sorted((work / "eval_cache").glob("p*.safetensors"))
    if not train_files or not held_files:
        raise SystemExit(f"no captures in {train_cache} or {work / 'eval_cache'}; run scripts/veda_report.py "
                         f"--work-dir {work} first.")
    info = json.loads((work / "eval_cache" / "model_info.json").read_text())
    layers, heads, head_dim = info["num_layers"], info["num_heads"], info["head_dim"]
    train, held = load_layers(train_files, layers), load_layers(held_files, layers)
    splits = {"train": train, "held_out": held}

    forms = {"untrained_mean_pool": {s: mean_over_layers(
        [scores(mean_pooled_logits(d[l][0], d[l][1]), d[l][2], args.density) for l in range(layers)])
        for s, d in splits.items()}}
    print("untrained", forms["untrained_mean_pool"], flush=True)
    oracle = oracle_stability(held_files, layers, args.density)
    print("oracle (held out)", oracle, flush=True)
    for hidden in args.hidden:
        torch.manual_seed(args.seed)
        t0, per_split = time.time(), {s: [] for s in splits}
        for l in range(layers):
            qf, kf, heat = train[l]
            params, logits = layer_logits_fn(hidden, heads, head_dim)
            opt = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
            for _ in range(args.steps):
                idx = torch.randint(0, qf.shape[0], (args.batch,))
                loss = tile_kl_loss(logits(qf[idx], kf[idx]), heat[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
            with torch.no_grad():
                for s, d in splits.items():
                    per_split[s].append(scores(logits(d[l][0], d[l][1]), d[l][2], args.density))
        name = "projection (shipped)" if hidden == 0 else f"mlp hidden {hidden}"
        forms[name] = {s: mean_over_layers(v) for s, v in per_split.items()}
        forms[name]["parameters_per_layer"] = sum(p.numel() for p in params)
        forms[name]["train_s"] = time.time() - t0
        print(name, forms[name], flush=True)

    base = forms["untrained_mean_pool"]["held_out"]
    report = {
        "what": "held-out tile recall of Veda's per-head residual projection vs per-head residual MLPs, trained on the "
                "same captures of the reference model",
        "work_dir": str(work), "train_cache": str(train_cache),
        "samples": {"train": len(train_files), "train_prompts": len({f.name[:6] for f in train_files}),
                    "held_out": len(held_files)},
        "model": info, "settings": vars(args), "forms": forms, "oracle_held_out": oracle,
        "held_out_ratio_vs_untrained": {n: {k: f["held_out"][k] / base[k] for k in
                                            ("recall", "recall_offdiag", "heat_recall", "heat_recall_offdiag")}
                                        for n, f in forms.items() if n != "untrained_mean_pool"},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "device": "cpu",
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
