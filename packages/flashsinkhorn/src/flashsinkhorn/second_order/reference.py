"""Dense float64 references (the oracles of the tests; small problems only).

Everything here materializes the n x m cost and differentiates by plain autograd through
an unrolled log-domain Sinkhorn loop, so it shares no code and no derivation with the
streaming implicit-differentiation path it checks.
"""

from __future__ import annotations

import torch

from flashsinkhorn.reference import rho_from_reach


def _phi(f, rho):
    return f if rho is None else -rho * torch.expm1(-f / rho)


def _float64(x, y, a, b):
    """Float64 copies of the clouds and the weights (uniform when None)."""
    x = x.double()
    y = y.double()
    n, m = x.shape[0], y.shape[0]
    a = torch.full((n,), 1.0 / n, dtype=torch.float64) if a is None else a.double()
    b = torch.full((m,), 1.0 / m, dtype=torch.float64) if b is None else b.double()
    return x, y, a, b


def _rhos(reach):
    """GeomLoss's reach (None, a number or a pair) -> (rho_x, rho_y) = 2 reach**2 for the
    cost |x - y|^2 (None or inf: balanced)."""
    return rho_from_reach(reach, 1.0)


def _sinkhorn(x, y, a, b, eps, rx, ry, n_iter, labels=None):
    """Dense alternating log-domain Sinkhorn; returns ``(C, f, g)`` after ``n_iter`` steps."""
    kx = 1.0 if rx is None else 1.0 / (1.0 + eps / rx)
    ky = 1.0 if ry is None else 1.0 / (1.0 + eps / ry)
    C = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    if labels is not None:
        lx, ly, table = labels
        C = C + table.double()[lx.long()][:, ly.long()]
    la, lb = torch.log(a), torch.log(b)
    f = torch.zeros(x.shape[0], dtype=torch.float64)
    g = torch.zeros(y.shape[0], dtype=torch.float64)
    for _ in range(n_iter):
        f = -kx * eps * torch.logsumexp((g[None, :] - C) / eps + lb[None, :], dim=1)
        g = -ky * eps * torch.logsumexp((f[:, None] - C) / eps + la[:, None], dim=0)
    return C, f, g


def ot_loss_ref(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    reach=None,
    n_iter: int = 2000,
    labels=None,
    debias: bool = False,
) -> torch.Tensor:
    """Entropic OT dual objective (cost |x - y|^2 [+ table[lx, ly]]), dense, differentiable.

    Alternating log-domain Sinkhorn for ``n_iter`` iterations in float64, then the dual
    objective ``<a, phi(f)> + <b, phi(g)> - eps (sum P - sum a sum b)``. With
    ``debias=True``: ``OT(x, y) - OT(x, x) / 2 - OT(y, y) / 2``. Differentiable (to any
    order) by autograd through the unrolled loop.
    """
    x, y, a, b = _float64(x, y, a, b)
    if debias:
        lab_xx = lab_yy = None
        if labels is not None:
            lx, ly, table = labels
            lab_xx = (lx, lx, table[0])
            lab_yy = (ly, ly, table[1])
            labels = (lx, ly, table[2])
        kw = dict(eps=eps, reach=reach, n_iter=n_iter)
        return (
            ot_loss_ref(x, y, a, b, labels=labels, **kw)
            - 0.5 * ot_loss_ref(x, x, a, a, labels=lab_xx, **kw)
            - 0.5 * ot_loss_ref(y, y, b, b, labels=lab_yy, **kw)
        )
    rx, ry = _rhos(reach)
    C, f, g = _sinkhorn(x, y, a, b, eps, rx, ry, n_iter, labels)
    la, lb = torch.log(a), torch.log(b)
    P = torch.exp((f[:, None] + g[None, :] - C) / eps + la[:, None] + lb[None, :])
    return _phi(f, rx) @ a + _phi(g, ry) @ b - eps * (P.sum() - a.sum() * b.sum())


def potentials_ref(x, y, a=None, b=None, *, eps, reach=None, n_iter=2000):
    """Dense float64 potentials (f, g) after ``n_iter`` alternating iterations."""
    x, y, a, b = _float64(x, y, a, b)
    rx, ry = _rhos(reach)
    _, f, g = _sinkhorn(x, y, a, b, eps, rx, ry, n_iter)
    return f, g


def hvp_ref(
    x: torch.Tensor,
    y: torch.Tensor,
    v,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    reach=None,
    wrt: str = "x",
    debias: bool = False,
    n_iter: int = 2000,
):
    """Dense float64 Hessian-vector product of :func:`ot_loss_ref` by double autograd.

    ``v`` has the shape of x (wrt="x"), of y (wrt="y"), or is a pair (wrt="xy").
    """
    x = x.detach().double().requires_grad_(wrt in ("x", "xy"))
    y = y.detach().double().requires_grad_(wrt in ("y", "xy"))
    loss = ot_loss_ref(x, y, a, b, eps=eps, reach=reach, n_iter=n_iter, debias=debias)
    if wrt == "x":
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        (hx,) = torch.autograd.grad(gx, x, v.double())
        return hx
    if wrt == "y":
        (gy,) = torch.autograd.grad(loss, y, create_graph=True)
        (hy,) = torch.autograd.grad(gy, y, v.double())
        return hy
    gx, gy = torch.autograd.grad(loss, (x, y), create_graph=True)
    s = (gx * v[0].double()).sum() + (gy * v[1].double()).sum()
    return torch.autograd.grad(s, (x, y))


__all__ = ["ot_loss_ref", "potentials_ref", "hvp_ref"]
