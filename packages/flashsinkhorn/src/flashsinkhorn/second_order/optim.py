"""Krylov solvers and second-order optimizers on Hessian-vector-product closures.

Everything here is generic: a linear operator is a function ``v -> A v`` on tensors of any
shape, and an objective is a function ``x -> scalar tensor`` differentiable twice by
autograd (``flashsinkhorn.second_order.ot_loss`` is, through its streaming HVP).

- :func:`conjugate_gradient`: preconditioned CG, optional projection (singular systems);
- :func:`lanczos_min_eig`: smallest eigenvalue of a symmetric operator (saddle detection);
- :func:`newton_cg`: line-search Newton-CG (truncated CG, stops on negative curvature);
- :func:`trust_region`: trust-region Newton with the Steihaug-Toint CG subproblem solver.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashsinkhorn._hessian import CGInfo, conjugate_gradient, dot

Tensor = torch.Tensor


@dataclass
class LanczosResult:
    eigenvalue: float
    eigenvector: Tensor
    ritz_values: Tensor
    iterations: int


def lanczos_min_eig(
    matvec: Callable[[Tensor], Tensor],
    v0: Tensor,
    *,
    k: int = 30,
    tol: float = 1e-8,
    reorthogonalize: bool = True,
) -> LanczosResult:
    """Smallest eigenvalue (and vector) of a symmetric operator by ``k`` Lanczos steps.

    ``v0`` (any shape) is the start vector; the operator is applied ``<= k`` times. With
    full reorthogonalization (default) the Krylov basis is stored: k vectors of v0's size.
    A negative value at a stationary point of a loss means a saddle (or a maximum).
    """
    q = v0 / torch.linalg.vector_norm(v0)
    Q = [q]
    alphas, betas = [], []
    beta = 0.0
    q_prev = torch.zeros_like(q)
    for j in range(k):
        w = matvec(Q[-1])
        alpha = float(dot(w, Q[-1]))
        w = w - alpha * Q[-1] - beta * q_prev
        if reorthogonalize:
            for qi in Q:
                w = w - dot(w, qi) * qi
        alphas.append(alpha)
        beta = float(torch.linalg.vector_norm(w))
        if beta < tol or j == k - 1:
            break
        betas.append(beta)
        q_prev = Q[-1]
        Q.append(w / beta)
        if not reorthogonalize:
            Q = Q[-2:]
    T = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas[: len(alphas) - 1], dtype=torch.float64)
        T = T + torch.diag(off, 1) + torch.diag(off, -1)
    evals, evecs = torch.linalg.eigh(T)
    s = evecs[:, 0]
    if reorthogonalize:
        vec = sum(float(s[i]) * Q[i] for i in range(len(alphas)))
    else:
        vec = Q[-1]
    return LanczosResult(float(evals[0]), vec, evals, len(alphas))


def _grad_and_hvp(fun, x):
    """(value, grad, hvp closure) of ``fun`` at x by autograd (double backward)."""
    x = x.detach().requires_grad_(True)
    val = fun(x)
    (g,) = torch.autograd.grad(val, x, create_graph=True)

    def hvp(v):
        (h,) = torch.autograd.grad(g, x, v, retain_graph=True)
        return h.detach()

    return val.detach(), g.detach(), hvp


@dataclass
class OptimizeResult:
    x: Tensor
    fun: float
    grad_norm: float
    iterations: int
    converged: bool
    history: list = field(default_factory=list)


def newton_cg(
    fun: Callable[[Tensor], Tensor],
    x0: Tensor,
    *,
    max_iter: int = 50,
    gtol: float = 1e-6,
    cg_tol: float | None = None,
    cg_max_iter: int = 100,
    damping: float = 0.0,
    max_step: float | None = None,
    callback: Callable | None = None,
) -> OptimizeResult:
    """Line-search Newton-CG (truncated Newton) minimizing ``fun(x)``.

    Each iteration: gradient and Hessian-vector products of ``fun`` at x by autograd
    (one forward, one ``create_graph`` backward, then one extra backward per CG step),
    the Newton system ``(H + damping I) p = -g`` solved by CG to the forcing tolerance
    ``min(0.5, sqrt(|g|))`` (superlinear, quadratic in the limit) or ``cg_tol``, stopped on
    negative curvature (then the steepest-descent direction is used), and an Armijo
    backtracking line search. Stops when ``|g| <= gtol``, or at the accuracy floor of
    ``fun`` (no decrease found, or the gradient norm stalled for two iterations; then
    ``converged`` is False). ``history`` holds
    ``(iteration, value, grad_norm)``.
    """
    x = x0.detach().clone()
    hist = []
    val, g, hvp = _grad_and_hvp(fun, x)
    gn = float(torch.linalg.vector_norm(g))
    it = 0
    stalled = 0
    for it in range(1, max_iter + 1):
        hist.append((it - 1, float(val), gn))
        if callback is not None:
            callback(it - 1, x, float(val), gn)
        if gn <= gtol:
            return OptimizeResult(x, float(val), gn, it - 1, True, hist)
        eta = cg_tol if cg_tol is not None else min(0.5, math.sqrt(gn))
        op = (lambda v, h=hvp: h(v) + damping * v) if damping else hvp
        p, info = conjugate_gradient(op, -g, tol=eta, max_iter=cg_max_iter)
        if info.negative_curvature and info.iterations <= 1:
            p = -g
        if float(dot(p, g)) >= 0:
            p = -g
        if max_step is not None:
            pn = float(torch.linalg.vector_norm(p))
            if pn > max_step:
                p = p * (max_step / pn)
        t = 1.0
        slope = float(dot(p, g))
        accepted = False
        for _ in range(30):
            with torch.no_grad():
                v_new = float(fun(x + t * p))
            # (a rounding allowance on the value: near the optimum it no longer resolves)
            if v_new <= float(val) + 1e-4 * t * slope + 1e-15 * abs(float(val)):
                accepted = True
                break
            t *= 0.5
        if not accepted:  # no decrease along p: at the accuracy floor of fun and its gradient
            hist.append((it, float(val), gn))
            return OptimizeResult(x, float(val), gn, it, gn <= gtol, hist)
        x = (x + t * p).detach()
        gn_old = gn
        val, g, hvp = _grad_and_hvp(fun, x)
        gn = float(torch.linalg.vector_norm(g))
        stalled = stalled + 1 if gn >= 0.999 * gn_old else 0
        if stalled >= 2:  # the gradient stopped decreasing: accuracy floor of fun / grad
            hist.append((it, float(val), gn))
            return OptimizeResult(x, float(val), gn, it, gn <= gtol, hist)
    hist.append((it, float(val), gn))
    return OptimizeResult(x, float(val), gn, it, gn <= gtol, hist)


def steihaug_cg(hvp, g, radius, *, tol, max_iter):
    """Approximately minimize ``g.p + p.H p / 2`` over ``|p| <= radius`` (Steihaug-Toint)."""
    z = torch.zeros_like(g)
    r = g.clone()
    d = -r
    r0 = float(torch.linalg.vector_norm(r))
    if r0 == 0:
        return z, "zero"
    for _ in range(max_iter):
        Hd = hvp(d)
        dHd = float(dot(d, Hd))
        if dHd <= 0:
            return z + _to_boundary(z, d, radius) * d, "negative curvature"
        alpha = float(dot(r, r)) / dHd
        z_new = z + alpha * d
        if float(torch.linalg.vector_norm(z_new)) >= radius:
            return z + _to_boundary(z, d, radius) * d, "boundary"
        r_new = r + alpha * Hd
        if float(torch.linalg.vector_norm(r_new)) < tol * r0:
            return z_new, "converged"
        d = -r_new + (float(dot(r_new, r_new)) / float(dot(r, r))) * d
        z, r = z_new, r_new
    return z, "max_iter"


def _to_boundary(z, d, radius):
    """tau >= 0 with |z + tau d| = radius."""
    a = float(dot(d, d))
    b = 2 * float(dot(z, d))
    c = float(dot(z, z)) - radius**2
    return (-b + math.sqrt(max(b * b - 4 * a * c, 0.0))) / (2 * a)


def trust_region(
    fun: Callable[[Tensor], Tensor],
    x0: Tensor,
    *,
    radius: float = 1.0,
    max_radius: float = 1e3,
    eta: float = 0.1,
    max_iter: int = 100,
    gtol: float = 1e-6,
    cg_max_iter: int = 100,
    saddle_check: bool = True,
    saddle_tol: float = 1e-6,
    lanczos_k: int = 20,
    callback: Callable | None = None,
) -> OptimizeResult:
    """Trust-region Newton with the Steihaug-CG subproblem (Nocedal & Wright, Alg. 4.1/7.2).

    Moves along negative curvature to the trust-region boundary. At a stationary point
    (``|g| <= gtol``) it runs Lanczos on the HVP (``saddle_check``): if the smallest
    eigenvalue is below ``-saddle_tol * |lambda_max|`` it steps along that eigenvector to
    the boundary instead of stopping, so it escapes saddle points where Newton-CG stalls.
    ``history`` holds ``(iteration, value, grad_norm, radius, rho, step_kind)``.
    """
    x = x0.detach().clone()
    hist = []
    val, g, hvp = _grad_and_hvp(fun, x)
    gn = float(torch.linalg.vector_norm(g))
    gen = torch.Generator().manual_seed(0)
    it = 0
    for it in range(1, max_iter + 1):
        p = None
        if gn <= gtol:
            if saddle_check:  # a stationary point: is it a saddle? (Lanczos on the HVP)
                v0 = torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)
                lz = lanczos_min_eig(hvp, v0, k=min(x.numel(), lanczos_k))
                lam_max = float(lz.ritz_values[-1].abs())
                if lz.eigenvalue < -saddle_tol * max(lam_max, 1e-30):
                    e = lz.eigenvector / torch.linalg.vector_norm(lz.eigenvector)
                    p = -radius * e if float(dot(g, e)) > 0 else radius * e
                    why = "lanczos negative curvature"
            if p is None:
                hist.append((it - 1, float(val), gn, radius, None, "gtol"))
                return OptimizeResult(x, float(val), gn, it - 1, True, hist)
        if p is None:
            tol = min(0.5, math.sqrt(gn))
            p, why = steihaug_cg(hvp, g, radius, tol=tol, max_iter=cg_max_iter)
        pred = -(float(dot(g, p)) + 0.5 * float(dot(p, hvp(p))))
        with torch.no_grad():
            v_new = float(fun(x + p))
        actual = float(val) - v_new
        rho = actual / pred if pred > 0 else -1.0
        pn = float(torch.linalg.vector_norm(p))
        hist.append((it - 1, float(val), gn, radius, rho, why))
        if callback is not None:
            callback(it - 1, x, float(val), gn)
        if rho < 0.25:
            radius = 0.25 * pn if pn > 0 else 0.25 * radius
        elif rho > 0.75 and abs(pn - radius) <= 1e-6 * radius + 1e-12:
            radius = min(2 * radius, max_radius)
        if rho > eta:
            x = (x + p).detach()
            val, g, hvp = _grad_and_hvp(fun, x)
            gn = float(torch.linalg.vector_norm(g))
    hist.append((it, float(val), gn, radius, None, "end"))
    return OptimizeResult(x, float(val), gn, it, gn <= gtol, hist)


__all__ = [
    "CGInfo",
    "conjugate_gradient",
    "LanczosResult",
    "lanczos_min_eig",
    "OptimizeResult",
    "newton_cg",
    "steihaug_cg",
    "trust_region",
]
