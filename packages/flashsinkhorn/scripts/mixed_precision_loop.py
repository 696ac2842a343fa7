"""CPU experiment: how many exact Sinkhorn iterations after a tf32 phase restore exact potentials?

    PYTHONPATH=packages/flashsinkhorn/src python3 \
        packages/flashsinkhorn/scripts/mixed_precision_loop.py [N] [EPS] [SCALE]

The HVP problem of the GPU script (n = m, d = 64, points of ``second_order.bench._problem``
times SCALE, uniform weights, eps), 100 alternating log-domain iterations in float64 with the
cost's dot product computed either exactly or from operands rounded to tf32 (10 explicit
mantissa bits, round to nearest even: what one tensor-core pass sees; centered first, as the
kernels do). Prints the max potential error against the exact run (shift removed: potentials
are unique up to (f + c, g - c)) for all-tf32 and for k final exact iterations.
"""

from __future__ import annotations

import math
import sys

import torch

from flashsinkhorn.second_order.bench import _problem

ITERS = 100


def _tf32(t: torch.Tensor) -> torch.Tensor:
    bits = t.float().view(torch.int32)
    bits = (bits + 0x1000 + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32).double()


def main(n: int, eps: float, scale: float) -> None:
    x, y, _ = _problem(n, n, 64, torch.device("cpu"))
    x, y = scale * x.double(), scale * y.double()
    center = 0.5 * (x.mean(0) + y.mean(0))
    x, y = x - center, y - center
    sq = (x * x).sum(1)[:, None] + (y * y).sum(1)[None, :]
    exact, rounded = sq - 2 * x @ y.T, sq - 2 * _tf32(x) @ _tf32(y).T
    logw = torch.full((n,), -math.log(n), dtype=torch.float64)

    def run(costs):
        f = torch.zeros(n, dtype=torch.float64)
        g = torch.zeros(n, dtype=torch.float64)
        for c in costs:
            f = -eps * torch.logsumexp(logw[None, :] + (g[None, :] - c) / eps, dim=1)
            g = -eps * torch.logsumexp(logw[:, None] + (f[:, None] - c) / eps, dim=0)
        return f, g

    fe, ge = run([exact] * ITERS)

    def err(f, g):
        shift = 0.5 * ((f - fe).mean() - (g - ge).mean())
        return max(float((f - fe - shift).abs().max()), float((g - ge + shift).abs().max()))

    print(f"n={n} d=64 eps={eps} scale={scale}, {ITERS} iterations")
    print(f"  all tf32 operands: max potential error {err(*run([rounded] * ITERS)):.3e}")
    for k in (1, 2, 5, 10, 20):
        e = err(*run([rounded] * (ITERS - k) + [exact] * k))
        print(f"  {ITERS - k} tf32 + {k} exact: {e:.3e}")
    print(f"  exact run, change over its last iteration: {err(*run([exact] * (ITERS - 1))):.3e}")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]) if a else 2000, float(a[1]) if len(a) > 1 else 0.01,
         float(a[2]) if len(a) > 2 else 1.0)  # fmt: skip
