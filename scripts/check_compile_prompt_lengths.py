#!/usr/bin/env python
"""Compiled HunyuanVideo over prompts of different valid lengths: one graph (GPU).

A HunyuanVideo transformer at its real width (2 dual- and 2 single-stream blocks, random weights, bf16), 9 x 80 x 80
latents (14,400 video tokens) and 256 text tokens of which 200 / 37 / 120 / 256 are valid; Veda at density 0.2
under `torch.compile` (Inductor) against eager: the relative error per prompt and Dynamo's graph count.

    python scripts/check_compile_prompt_lengths.py --out benchmarks/compile_prompt_lengths_h200.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from diffusers import HunyuanVideoTransformer3DModel
from torch._dynamo.utils import counters

import videosparse

LENGTHS = (200, 37, 120, 256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/compile_prompt_lengths_h200.json")
    args = ap.parse_args()
    from _bench import require_cuda

    require_cuda(__file__)
    torch.manual_seed(0)
    tr = HunyuanVideoTransformer3DModel(num_layers=2, num_single_layers=2, num_refiner_layers=1)
    tr = tr.to("cuda", torch.bfloat16).eval()
    videosparse.apply(tr, videosparse.VedaConfig(density=0.2))

    def run(model, valid: int) -> torch.Tensor:
        g = torch.Generator("cuda").manual_seed(1)
        kw = dict(device="cuda", dtype=torch.bfloat16)
        inputs = dict(hidden_states=torch.randn(1, 16, 9, 80, 80, generator=g, **kw),
                      timestep=torch.tensor([500], device="cuda"),
                      encoder_hidden_states=torch.randn(1, 256, 4096, generator=g, **kw),
                      encoder_attention_mask=(torch.arange(256, device="cuda") < valid)[None].to(torch.bfloat16),
                      pooled_projections=torch.randn(1, 768, generator=g, **kw),
                      guidance=torch.tensor([6000.0], **kw))
        with torch.no_grad(), tr.cache_context("cond", step_index=5, num_inference_steps=10):
            return model(**inputs, return_dict=False)[0].float()

    eager = {n: run(tr, n) for n in LENGTHS}
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(tr)
    rows = []
    for n in LENGTHS:
        start = time.time()
        out = run(compiled, n)
        torch.cuda.synchronize()
        rows.append(dict(valid_text=n, seconds=round(time.time() - start, 2),
                         rel_l2_vs_eager=float((out - eager[n]).norm() / eager[n].norm()),
                         unique_graphs=counters["stats"]["unique_graphs"]))
        print(rows[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(what=__doc__.splitlines()[0] + " " + " ".join(__doc__.split("\n\n")[1].split()), rows=rows,
                       device=torch.cuda.get_device_name()), f, indent=1)


if __name__ == "__main__":
    main()
