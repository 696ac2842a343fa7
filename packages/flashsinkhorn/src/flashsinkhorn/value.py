"""The value of a solved problem, differentiable: ``solve(...).value`` and its gradients.

``ot_value``: the dual value (B,) of potentials ``(f, g)`` (balanced ``<a, f> + <b, g>``;
unbalanced the KL dual). ``ot_value_grads``: its gradients in the features and weights by
the envelope theorem (two plan applications). ``OTValue``: the autograd function; with
``create_graph=True`` the gradient in x, y comes back attached to the streaming HVP of
:mod:`flashsinkhorn._hessian` (double backward). Every function takes the problem of any
backend (its ``sm_x`` / ``sm_y`` with ``v`` and ``want_lse``, ``total``, ``expand``).
"""

from __future__ import annotations

import torch

from flashsinkhorn._hessian import (
    HvpTerm,
    differentiable_grads,
    no_second_order_in_weights,
    plan_from_potentials,
)
from flashsinkhorn.problem import Problem
from flashsinkhorn.reference import LN2, dual_point_terms

__all__ = ["ot_value", "ot_value_grads", "OTValue", "finite_value_or_raise"]


def ot_value(prob, a, b, f, g, eps, rx, ry):
    """The dual value (B,) of the potentials (f, g) (no graph)."""
    total = prob.total
    if rx is None and ry is None:
        return total(a * f) + total(b * g, "y")
    _, lse2, _ = prob.sm_x(g, eps, 1.0, want_lse=True)
    rows = a * torch.exp((f - prob.cx) / eps + LN2 * lse2)
    duals = total(dual_point_terms(f, a, rx)) + total(dual_point_terms(g, b, ry), "y")
    return duals - eps * (total(rows) - total(a) * total(b, "y"))


def ot_value_grads(prob, f, g, eps, rx, ry, gout, need):
    """``gout``-weighted gradients ``(gX, gY, ga, gb)`` of the value (None where ``need``,
    four bools, is False): envelope theorem, two streaming passes."""
    gX = gY = ga = gb = None
    # per-problem factors spread over each side's points (a ragged layout: its segments)
    go_x, go_y = prob.expand(gout, "x"), prob.expand(gout, "y")
    need_x, need_y, need_a, need_b = need
    # P @ Y and row sums; P^T @ X and column sums (streaming)
    _, lse2x, Ybar = prob.sm_x(g, eps, 1.0, v=prob.Y if need_x else None, want_lse=True)
    rows = prob.a * torch.exp((f - prob.cx) / eps + LN2 * lse2x)
    _, lse2y, Xbar = prob.sm_y(f, eps, 1.0, v=prob.X if need_y else None, want_lse=True)
    cols = prob.b * torch.exp((g - prob.cy) / eps + LN2 * lse2y)
    if need_x:
        gX = feature_grad(prob.X, rows, Ybar, prob) * go_x[..., None]
    if need_y:
        gY = feature_grad(prob.Y, cols, Xbar, prob) * go_y[..., None]
    bsum = prob.expand(prob.total(prob.b, "y"), "x")
    asum = prob.expand(prob.total(prob.a), "y")
    if need_a:
        base = f if rx is None else rx * (1.0 - torch.exp(-f / rx))
        ga = (base - eps * (rows / prob.a.clamp_min(1e-38) - bsum)) * go_x
    if need_b:
        base = g if ry is None else ry * (1.0 - torch.exp(-g / ry))
        gb = (base - eps * (cols / prob.b.clamp_min(1e-38) - asum)) * go_y
    return gX, gY, ga, gb


class OTValue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, Y, a, b, f, g, prob, eps, rx, ry):
        with torch.no_grad():
            value = ot_value(prob, a, b, f, g, eps, rx, ry)
        ctx.prob, ctx.eps, ctx.rx, ctx.ry = prob, eps, rx, ry
        ctx.save_for_backward(X, Y, f, g)
        return value

    @staticmethod
    def backward(ctx, gout):
        X, Y, f, g = ctx.saved_tensors
        need = ctx.needs_input_grad[:4]
        # create_graph=True: the gradient in x, y gets a graph whose backward is the HVP
        second = torch.is_grad_enabled() and (need[0] or need[1])
        if second:
            check_second_order(ctx.prob, need)
        with torch.no_grad():
            unit = torch.ones_like(gout) if second else gout
            # sharded: the passes are the same on all ranks (any rank needing one runs it)
            grads = ot_value_grads(
                ctx.prob, f, g, ctx.eps, ctx.rx, ctx.ry, unit, ctx.prob.any_rank(need)
            )
        grads = tuple(gr if n else None for gr, n in zip(grads, need))
        if second:
            gX, gY = differentiable_value_grads(X, Y, grads[0], grads[1], ctx, f, g)
            go = gout[:, None, None]
            grads = (gX * go if need[0] else None, gY * go if need[1] else None, None, None)
        return (*grads, None, None, None, None, None, None)


def check_second_order(prob, need):

    if prob.kind == "varlen":
        raise RuntimeError(
            "solve(...).value of a ragged batch: double backward (create_graph=True) is not "
            "implemented; solve the problems one by one for second derivatives"
        )
    if type(prob).total is not Problem.total:  # sharded
        raise RuntimeError(
            "solve(..., process_group=...).value: double backward (create_graph=True) is not "
            "implemented for sharded problems"
        )
    if prob.cost == "dot" or prob.labels is not None:
        raise RuntimeError(
            "solve(...).value: double backward (create_graph=True) is implemented for "
            "cost='sqeuclidean' and 'cosine' without label_cost; got cost="
            f"{prob.cost!r}{' with label_cost' if prob.labels is not None else ''}"
        )
    no_second_order_in_weights(need[2] or need[3], "solve(...).value")


def differentiable_value_grads(X, Y, gX, gY, ctx, f, g):
    """The value's gradients (gX, gY) attached to (X, Y), with the streaming HVP of each
    problem of the batch as their derivative (flashsinkhorn._hessian)."""

    prob = ctx.prob
    precision = "ieee" if prob.precision == "ieee" else "tf32x3"
    terms = []
    for k in range(X.shape[0]):
        # sqeuclidean s|x - y|^2: c2 = 2s; cosine s(1 - <X, Y>) = (s/2)|X - Y|^2: c2 = s
        plan, ix, iy = plan_from_potentials(
            prob.X[k],
            prob.Y[k],
            prob.a[k],
            prob.b[k],
            f[k],
            g[k],
            scale=prob.c2 / 2,
            eps=ctx.eps,
            rho_x=ctx.rx,
            rho_y=ctx.ry,
            backend=prob.kernel_family,
            precision=precision,
        )
        terms.append(HvpTerm("xy", k, plan, prob.c2 / 2, ix, iy))
    zeros = torch.zeros
    gX = zeros(X.shape, dtype=f.dtype, device=X.device) if gX is None else gX
    gY = zeros(Y.shape, dtype=f.dtype, device=Y.device) if gY is None else gY
    return differentiable_grads(X, Y, gX, gY, terms)


def feature_grad(X, rows, Ybar, prob):
    """sum_j P_ij d/dX_i C_ij = rows_i * (d cx_i / dX_i - c2 * Ybar_i)."""
    if prob.cost == "dot":
        return -prob.c2 * rows[..., None] * Ybar
    # sqeuclidean and cosine (on the sphere): cx = (c2 / 2) |X|^2
    return prob.c2 * rows[..., None] * (X - Ybar)


def finite_value_or_raise(prob, value, eps):
    """Finite potentials whose unbalanced dual value overflows (the plan's mass is inf in
    float32 when eps is below the cost's resolution) are not a result: raise."""
    bad = not bool(torch.isfinite(value.detach()).all())
    if prob.any_rank((bad,))[0]:
        raise FloatingPointError(
            f"the dual value of the potentials is not finite at eps={eps:.3g} (the plan's "
            "mass overflows): increase eps, rescale the points or pass float64 inputs"
        )
