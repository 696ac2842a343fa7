"""Where the multiscale backend wins: a sweep of GeomLoss's schedule (SamplesLoss's loop,
cost |x - y|^2 / 2, scaling 0.5) on the multiscale problem against the exact backends, over
n = m and blur, d = 3, uniform clouds in the unit cube (issue #35: ``backend="auto"``'s
threshold comes from this sweep).

    PYTHONPATH=packages/flashsinkhorn/src python tools/flashsinkhorn/multiscale_sweep.py \\
        --device cpu --sizes 2048 8192 32768 --blurs 0.01 0.03 0.1 --json sweep.json

Each cell is the median of ``--repeat`` runs of the loop (problem construction included:
the multiscale problem's sorting and trees are part of its cost), in one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flashsinkhorn import _loop
from flashsinkhorn.multiscale import MultiscaleProblem
from flashsinkhorn.operands import centered_sqnorm, common_center
from flashsinkhorn.reference import eps_schedule, max_diameter
from flashsinkhorn.streaming import StreamingProblem


def problems(x, y, device):
    """The problem builders to compare: name -> () -> Problem."""
    n, m = x.shape[0], y.shape[0]
    a = torch.full((1, n), 1.0 / n, device=device)
    b = torch.full((1, m), 1.0 / m, device=device)
    X, Y = x[None], y[None]
    c = common_center(X, Y)
    hx, hy = 0.5 * centered_sqnorm(X, c), 0.5 * centered_sqnorm(Y, c)
    common = {"X": X, "Y": Y, "a": a, "b": b, "c2": 1.0, "cost_scale": 0.5}
    kernels = "auto" if device.type == "cuda" else "torch"
    out = {
        "multiscale": lambda: MultiscaleProblem(
            cx=a * 0, cy=b * 0, backend="triton" if device.type == "cuda" else "torch", **common
        ),
        "streaming": lambda: StreamingProblem(cx=hx, cy=hy, center=c, backend=kernels, **common),
    }
    try:  # the dense backend of issue #36, where it exists
        from flashsinkhorn.dense import DenseProblem  # noqa: PLC0415

        if n * m * 4 <= 1 << 30:
            out["dense"] = lambda: DenseProblem(cx=hx, cy=hy, center=c, **common)
    except ImportError:
        pass
    return out


def run_loop(make, eps_list, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    prob = make()
    sched = _loop.Schedule(eps=eps_list[-1], stages=tuple(eps_list))
    out = _loop.run(prob, sched)
    float(out.f.sum())  # wait for the device
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--blurs", type=float, nargs="+", default=[0.01, 0.03, 0.1])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for n in args.sizes:
        gen = torch.Generator().manual_seed(0)
        x = torch.rand(n, 3, generator=gen).to(device)
        y = (torch.rand(n, 3, generator=gen) * 0.8 + 0.1).to(device)
        for blur in args.blurs:
            eps_list = eps_schedule(max_diameter(x, y) ** 2, blur**2, 0.5)
            row = {"n": n, "blur": blur}
            for name, make in problems(x, y, device).items():
                run_loop(make, eps_list, device)  # warm-up (compiles)
                ts = [run_loop(make, eps_list, device) for _ in range(args.repeat)]
                row[name] = statistics.median(ts)
            exact = min(v for k, v in row.items() if k in ("streaming", "dense"))
            row["exact / multiscale"] = exact / row["multiscale"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    names = [k for k in rows[0] if k not in ("n", "blur")]
    print(f"\ndevice {args.device}; GeomLoss schedule (scaling 0.5), d = 3; seconds (median)")
    print("| n = m | blur | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in rows:
        cells = " | ".join(f"{r[k]:.3g}" for k in names)
        print(f"| {r['n']} | {r['blur']} | {cells} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": args.device, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
