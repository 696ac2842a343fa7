"""A short CPU tour of flashsinkhorn: ``python -m flashsinkhorn.demo`` (a few seconds)."""

from __future__ import annotations

import math
import time

import torch

import flashsinkhorn as fs


def main() -> None:
    torch.manual_seed(0)
    print(f"flashsinkhorn {fs.__version__}: streaming Sinkhorn, no N x M matrix in memory\n")

    # 1. solve(): entropic OT between two weighted clouds, with plan applications
    x = torch.randn(300, 3, dtype=torch.float64)
    y = torch.randn(200, 3, dtype=torch.float64) * 0.5 + 1.0
    t0 = time.perf_counter()
    r = fs.solve(x, y, eps=0.2, tol=1e-8)
    print(
        f"1. solve(x (300,3), y (200,3), eps=0.2): OT_eps = {float(r.value):.6f}, "
        f"{r.n_iter} iterations, converged={r.converged}, "
        f"marginal error {float(r.marginal_error):.1e} ({time.perf_counter() - t0:.2f} s)"
    )
    T = r.barycentric_map()
    m = [round(v, 3) for v in T.mean(0).tolist()]
    print(f"   barycentric map T(x) (300,3): mean {m} (the mean of y: ~[1, 1, 1])")
    rows, cols = r.marginals
    print(f"   plan marginals: |P1 - a|_1 = {float((rows - 1 / 300).abs().sum()):.1e}")

    # 2. closed form: entropic OT between 1D Gaussians (Janati et al. 2020)
    t = torch.linspace(-7, 7, 400, dtype=torch.float64)
    w = torch.exp(-(t**2) / 2)
    w = w / w.sum()
    eps = 0.1
    r = fs.solve((0.5 * t)[:, None], (0.8 + 0.3 * t)[:, None], w, w, eps=eps, tol=1e-10)
    s2 = eps / 2
    D = math.sqrt(4 * 0.25 * 0.09 + s2**2)
    closed = 0.64 + 0.25 + 0.09 - D + s2 * (1 - math.log(2 * s2)) + s2 * math.log(D + s2)
    print(
        f"2. Gaussians N(0,0.5^2) -> N(0.8,0.3^2): solve {float(r.value):.10f}, "
        f"closed form {closed:.10f}"
    )

    # 3. GeomLoss-compatible loss with gradients, batched
    L = fs.SamplesLoss("sinkhorn", p=2, blur=0.05, scaling=0.5, debias=True)
    xb = torch.rand(4, 300, 2, requires_grad=True)
    yb = torch.rand(4, 250, 2) + 0.3
    t0 = time.perf_counter()
    v = L(xb, yb)
    v.sum().backward()
    print(
        f"3. SamplesLoss (B=4, 300 vs 250 points): S_eps = {[round(u, 5) for u in v.tolist()]}, "
        f"|grad| = {float(xb.grad.norm()):.4f} ({time.perf_counter() - t0:.2f} s)"
    )

    # 4. a few steps of gradient flow: x moves toward y
    x = torch.rand(200, 2, requires_grad=True)
    y = torch.rand(200, 2) * 0.5 + 0.8
    for it in range(41):
        loss = fs.SamplesLoss(blur=0.05)(x, y)
        (g,) = torch.autograd.grad(loss, [x])
        if it % 20 == 0:
            print(f"4. gradient flow step {it:2d}: S_eps(x, y) = {float(loss.detach()):.5f}")
        with torch.no_grad():
            x -= 200 * g  # step 1 / a_i: x_i <- T(x_i)-ish
    r = fs.solve(x.detach(), y, eps=0.05)
    print(f"\nbackend (auto): {r.backend} (dense up to a memory budget, streaming kernels above)")


if __name__ == "__main__":
    main()
