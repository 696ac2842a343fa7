"""GPU diagnostic: potentials error vs float64 for the tf32 loop with k exact last iterations.

Usage (GPU host, repo root): PYTHONPATH=packages/flashsinkhorn/src python3
packages/flashsinkhorn/scripts/loop_tail_gpu.py OUT.json. Raw max error (``max_err``) and the
error without the balanced gauge shift (``gf_``: (f + c, g - c) is the same plan)."""

import json
import sys
import time

import torch

from flashsinkhorn import solve_potentials
from flashsinkhorn.second_order.bench import _problem


def max_err(p32, p64):
    scale = max(1.0, float(p64.f.abs().max()), float(p64.g.abs().max()))
    df, dg = p32.f.double() - p64.f, p32.g.double() - p64.g
    return max(float(df.abs().max()), float(dg.abs().max())) / scale


def gauge_free(p32, p64):
    df, dg = p32.f.double() - p64.f, p32.g.double() - p64.g
    c = 0.5 * (float(df.mean()) - float(dg.mean()))
    scale = max(1.0, float(p64.f.abs().max()), float(p64.g.abs().max()))
    return max(float((df - c).abs().max()), float((dg + c).abs().max())) / scale


out = []
for n, m in ((1500, 1300), (10000, 10000)):
    x, y, _ = _problem(n, m, 64, torch.device("cuda"))
    kw = dict(eps=0.01, max_iter=100)
    t0 = time.time()
    p64 = solve_potentials(x.double(), y.double(), backend="torch", **kw)
    row = {"n": n, "m": m, "f64_s": round(time.time() - t0, 2)}
    runs = {
        "tf32x3": solve_potentials(x, y, **kw),
        "tf32": solve_potentials(x, y, precision="tf32", **kw),
    }
    for k in (5, 10, 20, 40, 60):
        runs[f"tail{k}"] = solve_potentials(x, y, loop_precision="tf32", exact_tail=k, **kw)
    for key, p in runs.items():
        row[key] = max_err(p, p64)
        row["gf_" + key] = gauge_free(p, p64)
    # how far the float64 loop itself moves in its last iterations (convergence of the loop)
    p64b = solve_potentials(x.double(), y.double(), backend="torch", eps=0.01, max_iter=95)
    row["f64_95_vs_100"] = max_err(p64b, p64)
    print(json.dumps(row), flush=True)
    out.append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
