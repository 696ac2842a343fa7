"""CG, Lanczos, Newton-CG and the Steihaug trust region."""

import math

import pytest
import torch

from flashsinkhorn._hessian import conjugate_gradient
from flashsinkhorn.second_order import hvp, ot_loss
from flashsinkhorn.second_order.optim import lanczos_min_eig, newton_cg, trust_region

F64 = torch.float64


def _spd(n, seed=0, shift=0.1):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, n, generator=g, dtype=F64)
    return A @ A.T / n + shift * torch.eye(n, dtype=F64)


def test_cg_solves_spd_system_with_preconditioner():
    A = _spd(30)
    b = torch.randn(30, dtype=F64, generator=torch.Generator().manual_seed(1))
    d = A.diag()
    x, info = conjugate_gradient(lambda v: A @ v, b, M=lambda r: r / d, tol=1e-12)
    assert info.converged and torch.allclose(A @ x, b, atol=1e-10)


def test_cg_projected_singular_consistent_system():
    # graph Laplacian: null space = constants; consistent right-hand side (mean zero)
    A = _spd(20, shift=0.0)
    L = torch.diag(A.abs().sum(1)) - A.abs()
    b = torch.randn(20, dtype=F64, generator=torch.Generator().manual_seed(2))
    b = b - b.mean()
    x, info = conjugate_gradient(lambda v: L @ v, b, tol=1e-11, project=lambda v: v - v.mean())
    assert info.converged and torch.allclose(L @ x, b, atol=1e-9)


def test_lanczos_smallest_eigenvalue_of_indefinite_operator():
    A = _spd(40, seed=3) - 0.7 * torch.eye(40, dtype=F64)
    lam = torch.linalg.eigvalsh(A)[0]
    v0 = torch.randn(40, dtype=F64, generator=torch.Generator().manual_seed(4))
    res = lanczos_min_eig(lambda v: A @ v, v0, k=40)
    assert abs(res.eigenvalue - float(lam)) < 1e-8
    assert torch.allclose(A @ res.eigenvector, res.eigenvalue * res.eigenvector, atol=1e-6)


def test_lanczos_on_ot_hessian_matches_dense_eigenvalue():
    g = torch.Generator().manual_seed(5)
    x = 0.5 * torch.randn(4, 2, generator=g, dtype=F64)
    y = 0.5 * torch.randn(5, 2, generator=g, dtype=F64)
    kw = dict(eps=0.3, max_iter=800, cg_tol=1e-12, backend="torch")
    cols = [hvp(x, y, e.reshape(4, 2), **kw).reshape(-1) for e in torch.eye(8, dtype=F64)]
    lam = torch.linalg.eigvalsh(torch.stack(cols, 1))[0]
    v0 = torch.randn(4, 2, generator=g, dtype=F64)
    res = lanczos_min_eig(lambda v: hvp(x, y, v, **kw), v0, k=8)
    assert abs(res.eigenvalue - float(lam)) < 1e-8


def _quadratic_convergence(gnorms):
    """Some step in the asymptotic regime has |g_{k+1}| <= C |g_k|^2 with a modest C."""
    pairs = [(a, b) for a, b in zip(gnorms, gnorms[1:]) if 1e-12 < a < 1e-2 and b > 1e-14]
    return pairs and all(b <= 50 * a * a for a, b in pairs[-2:])


def test_newton_cg_converges_quadratically_on_an_ot_problem():
    # F(x) = OT_eps(x, y) + mu/2 |x - x0|^2: smooth, strongly convex near its minimizer
    g = torch.Generator().manual_seed(6)
    y = torch.randn(12, 2, generator=g, dtype=F64)
    x0 = torch.randn(10, 2, generator=g, dtype=F64)
    mu = 0.05

    def F(x):
        loss = ot_loss(x, y, eps=0.5, max_iter=1000, tol=1e-14, backend="torch", cg_tol=1e-13)
        return loss + 0.5 * mu * ((x - x0) ** 2).sum()

    res = newton_cg(F, x0, max_iter=30, gtol=1e-11, cg_tol=1e-12)
    g = [h[2] for h in res.history]
    assert res.converged, g
    assert _quadratic_convergence(g), g


def test_newton_cg_on_rosenbrock():
    f = lambda z: (1 - z[0]) ** 2 + 100 * (z[1] - z[0] ** 2) ** 2
    res = newton_cg(f, torch.tensor([-1.2, 1.0], dtype=F64), max_iter=100, gtol=1e-10)
    assert res.converged and torch.allclose(res.x, torch.ones(2, dtype=F64), atol=1e-6)


def test_trust_region_escapes_a_saddle():
    # f = x^2 - y^2 + y^4: (0, 0) is a saddle, minima at y = +-1/sqrt(2)
    f = lambda z: z[0] ** 2 - z[1] ** 2 + z[1] ** 4
    res = trust_region(f, torch.tensor([0.5, 0.0], dtype=F64), radius=0.5, gtol=1e-10)
    assert res.converged
    assert abs(abs(float(res.x[1])) - 1 / math.sqrt(2)) < 1e-6 and abs(float(res.x[0])) < 1e-6
    assert any("negative curvature" in str(h[5]) for h in res.history)


def test_newton_cg_stalls_where_trust_region_does_not():
    # exactly at the saddle the gradient vanishes: Newton-CG stops, Lanczos sees lambda < 0
    f = lambda z: z[0] ** 2 - z[1] ** 2 + z[1] ** 4
    z = torch.zeros(2, dtype=F64)
    res = newton_cg(f, z, gtol=1e-10)
    assert res.converged and float(res.x.abs().max()) == 0.0
    zz = z.clone().requires_grad_(True)
    (gr,) = torch.autograd.grad(f(zz), zz, create_graph=True)
    hv = lambda v: torch.autograd.grad(gr, zz, v, retain_graph=True)[0]
    assert lanczos_min_eig(hv, torch.tensor([1.0, 1.0], dtype=F64), k=2).eigenvalue < -1.9


@pytest.mark.gpu
def test_newton_cg_gpu_float32():
    g = torch.Generator().manual_seed(7)
    y = torch.randn(3000, 2, generator=g).cuda()
    x0 = torch.randn(2500, 2, generator=g).cuda()

    def F(x):
        return ot_loss(x, y, eps=0.2, max_iter=300) + 0.5 * 1e-3 * ((x - x0) ** 2).sum()

    res = newton_cg(F, x0, max_iter=15, gtol=1e-5)
    assert res.history[-1][2] < 1e-2 * res.history[0][2]
