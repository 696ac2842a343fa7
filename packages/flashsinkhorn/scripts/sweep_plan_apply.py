"""Sweep the wide plan-application config (the HAS_V softmin) on a CUDA GPU.

    PYTHONPATH=packages/flashsinkhorn/src python3 \
        packages/flashsinkhorn/scripts/sweep_plan_apply.py OUT.json

Times one softmin pass with V = y at n = m = 50k, d = 512 and 1024, for each (BLOCK_M,
BLOCK_N, warps, stages, BLOCK_DV), next to the plain pass (no V, autotuned), and checks each
config's vbar against float64 at n = 1000 (max abs error).
"""

from __future__ import annotations

import json
import math
import sys

import torch

from flashsinkhorn import kernels as K
from flashsinkhorn.bench import _problem
from flashsinkhorn.solver import centered_sqnorm, common_center, kernel_operands

CONFIGS = [  # (BLOCK_M, BLOCK_N, warps, stages, BLOCK_DV)
    (64, 64, 8, 3, 256), (64, 64, 8, 2, 256), (64, 32, 8, 3, 256), (64, 64, 4, 3, 128),
    (64, 64, 8, 3, 128), (128, 64, 8, 2, 128), (128, 32, 8, 2, 128), (64, 128, 8, 2, 128),
    (128, 64, 8, 3, 64), (64, 64, 4, 3, 64),
]  # fmt: skip


def _operands(n, d, dev):
    x, y = _problem(n, n, d, dev)
    x, y = x[None], y[None]
    c = common_center(x, y)
    cx, cy = centered_sqnorm(x, c), centered_sqnorm(y, c)
    xk, yk = kernel_operands(x, y, c, "tf32", "auto")
    g = 0.01 * torch.randn(1, n, device=dev)
    logb = torch.full((1, n), -math.log(n), device=dev)
    return dict(x=xk, y=yk, g=g, logb=logb, cx=cx, cy=cy)


def _pass(ops, with_v, dtype=None):
    o = {k: (v.to(dtype) if dtype is not None else v) for k, v in ops.items()}
    v = o["y"] if with_v else None
    return K.softmin(o["x"], o["y"], o["g"], o["logb"], o["cx"], o["cy"], eps=0.01, c2=2.0, v=v)


def _median_ms(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(out_path):
    dev = torch.device("cuda")
    rows = []
    for d in (512, 1024):
        big, small = _operands(50000, d, dev), _operands(1000, d, dev)
        ref = _pass(small, True, torch.float64)[2]
        plain = _median_ms(lambda big=big: _pass(big, False))
        rows.append(dict(d=d, config="plain pass (autotuned, no V)", ms=plain))
        print(f"d={d} plain pass {plain:.2f} ms", flush=True)
        for cfg in CONFIGS:
            K._FIXED_V_WIDE, K._WIDE_DV = cfg[:4], cfg[4]
            try:
                err = float((_pass(small, True)[2].double() - ref).abs().max())
                ms = _median_ms(lambda big=big: _pass(big, True))
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is a row
                err, ms = repr(e)[:160], None
            rows.append(dict(d=d, config=cfg, ms=ms, vbar_max_err_vs_f64_n1000=err))
            print(f"d={d} config={cfg} ms={ms} err={err}", flush=True)
            with open(out_path, "w") as fh:
                json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
