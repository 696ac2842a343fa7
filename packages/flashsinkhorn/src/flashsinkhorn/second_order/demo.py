"""Short CPU demo of the second-order tools: ``python -m flashsinkhorn.second_order.demo``.

1. streaming HVP of the entropic OT loss against the dense float64 autograd Hessian;
2. double backward + Newton-CG: quadratic convergence on an OT-regularized problem;
3. Lanczos on the HVP: the smallest Hessian eigenvalue flags a saddle;
4. OTDD between two halves of scikit-learn's digits (synthetic blobs if sklearn is absent).
"""

from __future__ import annotations

import time

import torch

from flashsinkhorn.second_order import hvp, hvp_ref, ot_loss, otdd
from flashsinkhorn.second_order._plan import solve_potentials
from flashsinkhorn.second_order.optim import lanczos_min_eig, newton_cg


def _digits(n_per_side=150):
    try:
        from sklearn.datasets import load_digits

        X, y = load_digits(return_X_y=True)
        X = torch.tensor(X / 16.0, dtype=torch.float64)
        y = torch.tensor(y)
        src = "scikit-learn digits"
    except ImportError:  # pragma: no cover
        g = torch.Generator().manual_seed(0)
        y = torch.randint(0, 10, (1000,), generator=g)
        X = torch.randn(10, 64, generator=g, dtype=torch.float64)[y] + torch.randn(
            1000, 64, generator=g, dtype=torch.float64
        )
        src = "synthetic blobs"
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(1))
    i1, i2 = perm[:n_per_side], perm[n_per_side : 2 * n_per_side]
    return X[i1], y[i1], X[i2], y[i2], src


def main() -> None:
    t_all = time.time()
    g = torch.Generator().manual_seed(0)
    F64 = torch.float64

    # 1. HVP vs dense autograd
    x = 0.5 * torch.randn(12, 3, generator=g, dtype=F64)
    y = 0.5 * torch.randn(15, 3, generator=g, dtype=F64) + 0.3
    v = torch.randn(12, 3, generator=g, dtype=F64)
    t0 = time.time()
    h = hvp(x, y, v, eps=0.3, max_iter=500, cg_tol=1e-12, backend="torch")
    hr = hvp_ref(x, y, v, eps=0.3, n_iter=500)
    print(
        f"[1] HVP (n=12, m=15, d=3, eps=0.3): streaming implicit-CG vs dense float64 autograd "
        f"Hessian: rel. error {float((h - hr).norm() / hr.norm()):.1e} ({time.time() - t0:.1f} s)"
    )

    # 2. Newton-CG with double backward
    yy = torch.randn(20, 2, generator=g, dtype=F64)
    x0 = torch.randn(15, 2, generator=g, dtype=F64)

    def F(z):
        loss = ot_loss(z, yy, eps=0.5, max_iter=500, tol=1e-13, backend="torch", cg_tol=1e-12)
        return loss + 0.025 * ((z - x0) ** 2).sum()

    t0 = time.time()
    res = newton_cg(F, x0, max_iter=20, gtol=1e-11, cg_tol=1e-12)
    gn = ", ".join(f"{h[2]:.1e}" for h in res.history)
    print(
        f"[2] Newton-CG on OT(x, y) + mu/2 |x - x0|^2 (double backward): |grad| per "
        f"iteration: {gn} ({time.time() - t0:.1f} s)"
    )

    # 3. Lanczos at a symmetric configuration: every x_i at the same point
    xs = torch.zeros(20, 2, dtype=F64) + 1e-3 * torch.randn(20, 2, generator=g, dtype=F64)
    ys = torch.randn(20, 2, generator=g, dtype=F64)
    t0 = time.time()
    plan = solve_potentials(xs, ys, eps=0.1, max_iter=500, backend="torch")  # solve once
    pot = (plan.f, plan.g)
    lz = lanczos_min_eig(
        lambda u: hvp(xs, ys, u, eps=0.1, potentials=pot, cg_tol=1e-10, backend="torch"),
        torch.randn(20, 2, generator=g, dtype=F64),
        k=20,
    )
    print(
        f"[3] Lanczos on the HVP at collapsed x: lambda_min = {lz.eigenvalue:+.3e}, "
        f"lambda_max = {float(lz.ritz_values[-1]):+.3e} -> "
        f"{'saddle' if lz.eigenvalue < 0 else 'no negative curvature'} "
        f"({time.time() - t0:.1f} s)"
    )

    # 4. OTDD on digits
    x1, l1, x2, l2, src = _digits()
    t0 = time.time()
    kw = dict(eps=2.0, label_distance="gaussian", max_iter=200, tol=1e-7, backend="torch")
    r12 = otdd(x1, l1, x2, l2, **kw)
    r21 = otdd(x2, l2, x1, l1, **kw)
    r11 = otdd(x1, l1, x1, l1, **kw)
    scrambled = l1[torch.randperm(len(l1), generator=g)]
    rp = otdd(x1, l1, x1, scrambled, **kw)
    print(
        f"[4] OTDD ({src}, {len(x1)} vs {len(x2)} points, d=64, eps=2, Gaussian label "
        f"distances): OTDD(D1, D2) = {r12.value:.4f}, OTDD(D2, D1) = {r21.value:.4f}, "
        f"OTDD(D1, D1) = {r11.value:.1e}, D1 vs D1 with scrambled labels: {rp.value:.4f} "
        f"({time.time() - t0:.1f} s)"
    )
    print(f"demo done in {time.time() - t_all:.1f} s")


if __name__ == "__main__":
    main()
