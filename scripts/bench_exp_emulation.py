"""Does emulating half of the softmax exp2 on the FMA units (FA4's trick) speed up the Hopper kernel? (GPU)

Times the default kernel and `exp_emulation=2` (every second exp2 of each thread as a degree-3
polynomial in inline PTX, the rest on the MUFU), twice each, on random top-k plans; prints a table and
writes benchmarks/exp_emulation_h200.json (or $OUT/exp_probe.json).

    python scripts/bench_exp_emulation.py
"""
import os, sys, json
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
import torch.nn.functional as F
from _bench import bench, rel
from bench_kernel import random_plan, plan_density
from videosparse.kernels.triton_hopper import hopper_attention
rows = []
for H, S, D in ((12, 32768, 128), (12, 32768, 64), (48, 17550, 64), (12, 32760, 128)):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D, device="cuda", generator=g).bfloat16() for _ in range(3))
    for dens in (1.0, 0.1, 0.05):
        plan = random_plan(1, H, S, dens, 128, "cuda")
        d = plan_density(plan, S)
        flops = 4.0 * S * S * D * H * d
        base = hopper_attention(q, k, v, plan, D ** -0.5)
        ref_err = rel(base.float(), F.scaled_dot_product_attention(q, k, v).float()) if dens == 1.0 else None
        for name, kw in (("default", {}), ("exp_emu2", dict(exp_emulation=2)), ("default", {}), ("exp_emu2", dict(exp_emulation=2))):
            fn = lambda: hopper_attention(q, k, v, plan, D ** -0.5, **kw)
            out = fn()
            ms = bench(fn, warmup=25, rep=100)
            r = dict(H=H, S=S, D=D, density=d, variant=name, ms=ms, tflops=flops / ms / 1e9,
                     rel_vs_default=rel(out.float(), base.float()), default_vs_sdpa=ref_err)
            rows.append(r); print(json.dumps(r), flush=True)
out = os.path.join(os.environ["OUT"], "exp_probe.json") if "OUT" in os.environ else "benchmarks/exp_emulation_h200.json"
json.dump(rows, open(out, "w"), indent=1)
print("| H x S d | density | default TFLOP/s | exp_emu2 | rel diff |")
for i in range(0, len(rows), 4):
    a, b, c, e = rows[i:i + 4]
    print(f"| {a['H']}x{a['S']} d{a['D']} | {a['density']:.3f} | {min(a['ms'], c['ms']) and a['tflops']:.0f}/{c['tflops']:.0f} | {b['tflops']:.0f}/{e['tflops']:.0f} | {b['rel_vs_default']:.2e} |")
