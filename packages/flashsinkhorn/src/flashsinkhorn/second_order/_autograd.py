"""Double backward for ``solve(...).value`` and ``SamplesLoss``: their gradients in x and y
as a differentiable function whose own backward is the streaming HVP of :mod:`.hvp`.

The first derivative is whatever the caller computed (the envelope gradient of ``solve``,
GeomLoss's extrapolation gradient of ``SamplesLoss``); :func:`differentiable_grads` returns
those same values, attached to the graph of ``(x, y)`` through :class:`_EnvelopeGrads`, so
``torch.autograd.grad(loss, x, create_graph=True)`` gives a gradient that can be
differentiated again (gradient penalties, Hessian-vector products). Its backward solves the
linearized optimality conditions of each OT term at the given potentials (``_hvp_plan``),
so the second derivative is the Hessian of the converged OT value: it matches finite
differences of the gradient to the accuracy of the convergence.

Each OT term is a :class:`HvpTerm`: a :class:`Plan` in the second-order convention (cost
``|x - y|^2``; a cost ``s |x - y|^2`` at ``eps`` is the same plan at ``eps / s`` with
potentials ``f / s``, and its Hessian is ``s`` times the plan's), the batch index, a
weight, and which points move (``"xy"``: a cross problem; ``"xx"`` / ``"yy"``: a
self-transport problem ``OT(x, x)`` whose two arguments move together).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashsinkhorn.second_order._plan import Plan, center
from flashsinkhorn.second_order._stream import resolve_backend


class HvpTerm(NamedTuple):
    kind: str  # "xy", "xx" or "yy"
    batch: int
    plan: Plan
    weight: float  # multiplies the plan's Hessian
    ix: torch.Tensor | None  # rows of the batch's x (or y for "yy") in the plan (positive weights)
    iy: torch.Tensor | None


def plan_from_potentials(x, y, a, b, f, g, *, scale, eps, rho_x=None, rho_y=None,
                         backend="auto", precision="tf32x3"):  # fmt: skip
    """The :class:`Plan` of potentials ``(f, g)`` for the cost ``scale * |x - y|^2`` at
    ``eps`` (unbatched (n, D), (m, D); KL penalties ``rho_x, rho_y`` in cost units or None),
    restricted to the points of positive weight (zero-weight points carry no mass and no
    derivative). Returns ``(plan, ix, iy)`` with the kept indices (None: all kept)."""
    be = resolve_backend(backend, x.device)
    dt = torch.float64 if (be == "torch" and x.dtype == torch.float64) else torch.float32
    ix = None if bool((a > 0).all()) else torch.nonzero(a > 0).flatten()
    iy = None if bool((b > 0).all()) else torch.nonzero(b > 0).flatten()
    sel = [(x, f, a, ix), (y, g, b, iy)]
    (x, f, a), (y, g, b) = ((p, q, w) if i is None else (p[i], q[i], w[i]) for p, q, w, i in sel)
    s = float(scale)
    xc, yc = center(x.detach().to(dt), y.detach().to(dt))
    plan = Plan(xc, yc, a.detach().to(dt), b.detach().to(dt), f.detach().to(dt) / s,
                g.detach().to(dt) / s, float(eps) / s, None if rho_x is None else rho_x / s,
                None if rho_y is None else rho_y / s, None, be, precision)  # fmt: skip
    return plan, ix, iy


def _take(v, k, idx):
    if v is None:
        return None
    v = v[k]
    return v if idx is None else v[idx]


def _put(out, k, idx, h, w):
    if idx is None:
        out[k] += w * h.to(out.dtype)
    else:
        out[k].index_add_(0, idx, w * h.to(out.dtype))


class _EnvelopeGrads(torch.autograd.Function):
    """(X, Y) -> the given gradients (gX, gY); backward: the HVP of the terms."""

    @staticmethod
    def forward(ctx, X, Y, holder):
        ctx.holder = holder
        ctx.set_materialize_grads(False)
        gX, gY = holder["grads"]
        return gX.clone(), gY.clone()

    @staticmethod
    def backward(ctx, ggX, ggY):
        if ggX is None and ggY is None:
            return None, None, None
        # the second-order code needs the cross terms' inputs even if one of them is 0
        from flashsinkhorn.second_order.hvp import _hvp_plan

        terms, (gX, gY) = ctx.holder["terms"], ctx.holder["grads"]
        need_x, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ref = ggX if ggX is not None else ggY
        HX = torch.zeros(gX.shape, dtype=ref.dtype, device=ref.device) if need_x else None
        HY = torch.zeros(gY.shape, dtype=ref.dtype, device=ref.device) if need_y else None
        kw = dict(cg_tol=ctx.holder.get("cg_tol", 1e-6), cg_max_iter=300)
        with torch.no_grad():
            for t in terms:
                k = t.batch
                if t.kind == "xy":
                    vx, vy = _take(ggX, k, t.ix), _take(ggY, k, t.iy)
                    if vx is None and vy is None:
                        continue
                    hx, hy, _ = _hvp_plan(t.plan, vx, vy, need_x=need_x, need_y=need_y, **kw)
                    if need_x:
                        _put(HX, k, t.ix, hx, t.weight)
                    if need_y:
                        _put(HY, k, t.iy, hy, t.weight)
                else:  # a self problem OT(z, z): both arguments move along v
                    gg, H, need = (ggX, HX, need_x) if t.kind == "xx" else (ggY, HY, need_y)
                    v = _take(gg, k, t.ix)
                    if v is None or not need:
                        continue
                    h1, h2, _ = _hvp_plan(t.plan, v, v, **kw)
                    _put(H, k, t.ix, h1 + h2, t.weight)
        return HX, HY, None


def differentiable_grads(X, Y, gX, gY, terms, cg_tol=None):
    """``(gX, gY)`` (B, N, D), (B, M, D), attached to ``(X, Y)``: their derivative is the sum
    of the terms' streaming HVPs. ``cg_tol`` (relative, of the Schur CG): by default 1e-10
    for float64 plans and 1e-6 (``ot_loss``'s default) otherwise."""
    if cg_tol is None:
        f64 = all(t.plan.x.dtype == torch.float64 for t in terms)
        cg_tol = 1e-10 if f64 else 1e-6
    holder = {"grads": (gX, gY), "terms": terms, "cg_tol": cg_tol}
    return _EnvelopeGrads.apply(X, Y, holder)


def no_second_order_in_weights(needs_weights, what):
    """Second derivatives through the weights are not implemented: say so at the first
    backward (``create_graph=True``) instead of returning a silently incomplete graph."""
    if needs_weights:
        raise RuntimeError(
            f"{what}: double backward (create_graph=True) is implemented for the points x and "
            "y; the weights a, b must not require grad (pass a.detach(), b.detach()), or use "
            "flashsinkhorn.implicit_grad for derivatives of the potentials in the weights"
        )
