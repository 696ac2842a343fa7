"""Streaming Hessian-vector products, implicit differentiation and a twice-differentiable loss.

The loss is the entropic OT cost ``OT(a, x; b, y)`` of ``_plan.py`` (cost |x - y|^2). Its
gradient in x is ``2 (r_i x_i - (P y)_i)`` with ``r = P 1``. Differentiating once more
along a direction ``(vx, vy)`` needs the response of the potentials: with
``delta_ij = 2 <x_i - y_j, vx_i - vy_j>`` (the change of the cost) the optimality
conditions, linearized, give the (n + m) system

    [ diag(r)/kx   P          ] [df]   [u = sum_j P_ij delta_ij]
    [ P^T          diag(c)/ky ] [dg] = [w = sum_i P_ij delta_ij]

(c = P^T 1; kx, ky the unbalanced dampings, 1 when balanced; balanced, the system is
singular along (1, -1) and consistent). We eliminate df and solve the Schur complement

    (diag(c)/ky - P^T diag(kx / r) P) dg = w - P^T (kx u / r)

by conjugate gradient preconditioned by diag(ky / c) (projected onto the mean-zero vectors
when balanced): two streamed plan-vector products per iteration. With
``h_ij = df_i + dg_j - delta_ij`` the Hessian-vector product is

    (H v)_x,i = (2/eps) sum_j P_ij h_ij (x_i - y_j) + 2 (r_i vx_i - (P vy)_i)
    (H v)_y,j = (2/eps) sum_i P_ij h_ij (y_j - x_i) + 2 (c_j vy_j - (P^T vx)_j)

and every sum is a streamed product ``P @ W`` or ``(P * Q) @ U`` with
``Q_ij = <vx_i, y_j> + <x_i, vy_j>`` (see ``_stream.row_apply``): one row pass and one
column pass before the CG, one (two for y) after it. Working memory is O((n + m) d): no
n x m buffer and no Hessian block is ever formed.

The debiased Sinkhorn divergence ``S = OT(x, y) - OT(x, x)/2 - OT(y, y)/2`` adds the
self-terms, whose HVP moves both arguments of ``OT(x, x)`` at once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashsinkhorn._hessian import (
    CGInfo,
    Plan,
    conjugate_gradient,
    envelope_grads,
    finite_or_raise,
    hvp_plan,
    inverse_or_zero,
    phi,
    schur_solve,
    split_reach,
    weighted,
)
from flashsinkhorn.second_order._plan import solve_potentials


# ----------------------------------------------------------------------------------------
# building blocks on a solved Plan
# ----------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------
class HvpInfo(NamedTuple):
    cg: list  # CGInfo of each Schur solve (one per OT term)
    sinkhorn: list  # solver info of each OT term


def _resolve_loop_precision(loop_precision, precision, reach, debias):
    """hvp's "auto" loop precision: the tf32 loop with an exact tail where the GPU run
    showed it leaves H v unchanged (balanced, no debias, tf32x3 passes); elsewhere each
    iteration at ``precision`` (unbalanced: no gauge freedom, so a tf32 offset would have
    to contract away within the tail; debias: the self-solves were not measured)."""
    if loop_precision != "auto":
        return loop_precision
    if precision == "tf32x3" and reach is None and not debias:
        return "tf32"
    return None


def hvp(
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
    potentials=None,
    max_iter: int = 100,
    tol: float | None = None,
    eps_schedule=None,
    cg_tol: float = 1e-6,
    cg_max_iter: int = 300,
    tikhonov: float = 0.0,
    backend: str = "auto",
    precision: str = "tf32x3",
    loop_precision: str | None = "auto",
    exact_tail: int = 5,
    return_info: bool = False,
):
    """Hessian-vector product of the entropic OT loss (or debiased divergence), streaming.

    Args:
        x (n, D), y (m, D): point clouds; a (n,), b (m,): positive weights (uniform if None).
        v: the direction: shape of x (``wrt="x"``), of y (``wrt="y"``), or a pair
            ``(vx, vy)`` (``wrt="xy"``, the joint Hessian; either entry may be None).
        eps: temperature; cost is ``|x - y|^2``. reach: None (balanced), a float, or
            ``(reach_x, reach_y)`` (semi-unbalanced): GeomLoss's reach, a distance,
            ``rho = 2 reach**2`` for this cost (SamplesLoss(reach=r) is the same penalty).
        debias: HVP of ``OT(x, y) - OT(x, x)/2 - OT(y, y)/2`` instead of ``OT(x, y)``.
        potentials: ``(f, g)`` from a previous solve (``flashsinkhorn.solve`` or
            :func:`solve_potentials`, convention ``P = a b exp((f + g - C)/eps)``) to skip
            the Sinkhorn loop (``debias=False`` only).
        max_iter, tol, eps_schedule: the Sinkhorn loop (``max_iter`` iterations at eps).
        cg_tol, cg_max_iter: relative tolerance and cap of the Schur-complement CG.
        tikhonov: optional ridge on the Schur complement (0: exact, projected CG).
        backend: "auto" | "triton" | "torch"; precision: Triton dot mode (tf32x3 | ieee | tf32).
        loop_precision, exact_tail: dot mode of the Sinkhorn iterations but the last
            ``exact_tail`` (see :func:`solve_potentials`); the HVP passes use ``precision``.
            "auto" (default): "tf32" when ``precision="tf32x3"`` on a balanced problem
            without debias, else every iteration at ``precision``; None: every iteration at
            ``precision``. Why "auto" is safe there: the balanced plan, hence H v, does not
            see the gauge (f + c, g - c) that tf32 rounding shifts, and the exact tail
            removes the rest (H200, n = 10k: relative error vs float64 1.40e-6 with and
            without the tf32 loop; docs/design/flashsinkhorn.md). A loop that
            has not converged (its exact tail still moves the potentials) is redone with
            every iteration at ``precision`` (``solve_potentials``' fallback).

    Returns:
        ``H v`` with the shape of v (a pair for ``wrt="xy"``), plus an :class:`HvpInfo`
        when ``return_info``.
    """
    if wrt not in ("x", "y", "xy"):
        raise ValueError(f"wrt must be 'x', 'y' or 'xy'; got {wrt!r}")
    if wrt == "xy":
        vx, vy = v
    elif wrt == "x":
        vx, vy = v, None
    else:
        vx, vy = None, v
    if vx is not None and vx.shape != x.shape:
        raise ValueError(f"v (for x) must have shape {tuple(x.shape)}; got {tuple(vx.shape)}")
    if vy is not None and vy.shape != y.shape:
        raise ValueError(f"v (for y) must have shape {tuple(y.shape)}; got {tuple(vy.shape)}")
    if debias and potentials is not None:
        raise ValueError("potentials= is only supported with debias=False")
    loop_precision = _resolve_loop_precision(loop_precision, precision, reach, debias)
    skw = dict(
        max_iter=max_iter,
        tol=tol,
        eps_schedule=eps_schedule,
        backend=backend,
        precision=precision,
        loop_precision=loop_precision,
        exact_tail=exact_tail,
    )
    need_x, need_y = wrt in ("x", "xy"), wrt in ("y", "xy")
    plan = solve_potentials(x, y, a, b, eps=eps, reach=reach, potentials=potentials, **skw)
    hx, hy, info = hvp_plan(
        plan,
        vx,
        vy,
        need_x=need_x,
        need_y=need_y,
        cg_tol=cg_tol,
        cg_max_iter=cg_max_iter,
        tikhonov=tikhonov,
    )
    cgs, sks = [info], [plan.info]
    if debias:
        rx, ry = split_reach(reach)
        for pts, w, vv, need, rr in ((x, a, vx, need_x, rx), (y, b, vy, need_y, ry)):
            if not need or vv is None:
                continue
            sp = solve_potentials(pts, pts, w, w, eps=eps, reach=rr, symmetric=True, **skw)
            h1, h2, inf = hvp_plan(
                sp, vv, vv, cg_tol=cg_tol, cg_max_iter=cg_max_iter, tikhonov=tikhonov
            )
            if pts is x:
                hx = hx - 0.5 * (h1 + h2)
            else:
                hy = hy - 0.5 * (h1 + h2)
            cgs.append(inf)
            sks.append(sp.info)
    ref = vx if vx is not None else vy
    if wrt == "x":
        out = hx.to(ref.dtype)
    elif wrt == "y":
        out = hy.to(ref.dtype)
    else:
        out = (hx.to(ref.dtype), hy.to(ref.dtype))
    finite_or_raise("hvp", out, eps)
    return (out, HvpInfo(cgs, sks)) if return_info else out


class ImplicitGrads(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    cg: CGInfo


def implicit_grad(
    x: torch.Tensor,
    y: torch.Tensor,
    grad_f: torch.Tensor | None,
    grad_g: torch.Tensor | None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    reach=None,
    potentials=None,
    max_iter: int = 100,
    tol: float | None = None,
    cg_tol: float = 1e-6,
    cg_max_iter: int = 300,
    backend: str = "auto",
    precision: str = "tf32x3",
) -> ImplicitGrads:
    """Gradient of ``L(f*, g*)`` w.r.t. x, y, a, b by implicit differentiation (streaming).

    ``grad_f`` (n,) and ``grad_g`` (m,) are dL/df and dL/dg at the optimal potentials
    (None = 0). The adjoint of the linearized optimality conditions is solved by the
    same preconditioned Schur-complement CG as :func:`hvp`; the result does not depend on
    how the potentials were reached (only on the fixed point), unlike backpropagating
    through the Sinkhorn iterations. For balanced OT the potentials are defined up to
    ``(f + t, g - t)``: only gauge-invariant losses (``sum(grad_f) == sum(grad_g)``) have a
    gradient, and the gauge component of (grad_f, grad_g) is dropped. Gradients w.r.t. the
    weights are defined up to an additive constant when the total masses are fixed.
    """
    plan = solve_potentials(
        x,
        y,
        a,
        b,
        eps=eps,
        reach=reach,
        potentials=potentials,
        max_iter=max_iter,
        tol=tol,
        backend=backend,
        precision=precision,
    )
    dt = plan.x.dtype
    n, m = plan.x.shape[0], plan.y.shape[0]
    gf = torch.zeros(n, dtype=dt, device=x.device) if grad_f is None else grad_f.to(dt)
    gg = torch.zeros(m, dtype=dt, device=x.device) if grad_g is None else grad_g.to(dt)
    if plan.balanced:  # drop the gauge component (1, -1) of the right-hand side
        t = (gf.sum() - gg.sum()) / (n + m)
        gf, gg = gf - t, gg + t
    r, Py = weighted(plan.rows, None, plan.y)
    c, PTx = weighted(plan.cols, None, plan.x)
    lg, info = schur_solve(plan, r, c, gf, gg, tol=cg_tol, max_iter=cg_max_iter)
    Plg, PlgY = weighted(plan.rows, lg, plan.y)
    lf = plan.kx * (gf - Plg) * inverse_or_zero(r)
    PTlf, PTlfX = weighted(plan.cols, lf, plan.x)
    gx = 2.0 * (lf[:, None] * (r[:, None] * plan.x - Py) + plan.x * Plg[:, None] - PlgY)
    gy = 2.0 * (lg[:, None] * (c[:, None] * plan.y - PTx) + plan.y * PTlf[:, None] - PTlfX)
    ga = -plan.eps * Plg / plan.a
    gb = -plan.eps * PTlf / plan.b
    return ImplicitGrads(gx.to(x.dtype), gy.to(y.dtype), ga, gb, info)


def inverse_hvp(
    x: torch.Tensor,
    y: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    reach=None,
    damping: float = 0.0,
    tol: float = 1e-6,
    max_cg_iter: int = 100,
    inner_cg_tol: float = 1e-8,
    max_iter: int = 100,
    backend: str = "auto",
    precision: str = "tf32x3",
    return_info: bool = False,
):
    """Solve ``(H_x + damping I) z = v`` for the Hessian in x of the OT loss (nested CG).

    The outer CG applies :func:`hvp` (one Sinkhorn solve, reused); each application runs
    the inner Schur-complement CG to ``inner_cg_tol``. H is positive semi-definite only
    near a minimizer (and has a d-dimensional null space from translations in the
    balanced case): use ``damping > 0`` elsewhere.
    """
    plan = solve_potentials(
        x, y, a, b, eps=eps, reach=reach, max_iter=max_iter, backend=backend, precision=precision
    )
    dt = plan.x.dtype

    def matvec(z):
        hz, _, _ = hvp_plan(plan, z, None, need_y=False, cg_tol=inner_cg_tol)
        return hz + damping * z if damping else hz

    z, info = conjugate_gradient(matvec, v.to(dt), tol=tol, max_iter=max_cg_iter)
    return (z.to(v.dtype), info) if return_info else z.to(v.dtype)


# ----------------------------------------------------------------------------------------
# a loss with double backward
# ----------------------------------------------------------------------------------------
class _Holder:
    """Carries the solved plan and settings between the autograd nodes."""

    def __init__(self, plan: Plan, cfg: dict):
        self.plan = plan
        self.cfg = cfg


class _GradFn(torch.autograd.Function):
    """(x, y) -> envelope gradients; its backward is the streaming HVP."""

    @staticmethod
    def forward(ctx, x, y, holder):
        ctx.holder = holder
        ctx.set_materialize_grads(False)
        gx, gy = envelope_grads(holder.plan)
        return gx.to(x.dtype), gy.to(y.dtype)

    @staticmethod
    def backward(ctx, ggx, ggy):
        if ggx is None and ggy is None:
            return None, None, None
        h = ctx.holder
        hx, hy, _ = hvp_plan(
            h.plan,
            ggx.detach() if ggx is not None else None,
            ggy.detach() if ggy is not None else None,
            need_x=ctx.needs_input_grad[0],
            need_y=ctx.needs_input_grad[1],
            cg_tol=h.cfg["cg_tol"],
            cg_max_iter=h.cfg["cg_max_iter"],
        )
        dtx = ggx.dtype if ggx is not None else ggy.dtype
        return (
            hx.to(dtx) if hx is not None else None,
            hy.to(dtx) if hy is not None else None,
            None,
        )


class _OTLossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, a, b, cfg):
        plan = solve_potentials(x.detach(), y.detach(), a, b, **cfg["solve"])
        holder = _Holder(plan, cfg)
        ctx.holder = holder
        ctx.save_for_backward(x, y)
        R = plan.rows(torch.ones_like(plan.g))
        ctx.r = R
        return plan.value(R).to(x.dtype)

    @staticmethod
    def backward(ctx, gout):
        x, y = ctx.saved_tensors
        h = ctx.holder
        p = h.plan
        gx = gy = ga = gb = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            gx, gy = _GradFn.apply(x, y, h)
            gx = gout * gx
            gy = gout * gy
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            c = p.cols(torch.ones_like(p.f))
            phi_f = phi(p.f, p.rho_x)
            phi_g = phi(p.g, p.rho_y)
            ga = gout * (phi_f - p.eps * (ctx.r / p.a - p.b.sum())).to(x.dtype)
            gb = gout * (phi_g - p.eps * (c / p.b - p.a.sum())).to(x.dtype)
        return gx, gy, ga, gb, None


def ot_loss(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    reach=None,
    debias: bool = False,
    max_iter: int = 100,
    tol: float | None = 1e-6,
    eps_schedule=None,
    cg_tol: float = 1e-6,
    cg_max_iter: int = 300,
    backend: str = "auto",
    precision: str = "tf32x3",
) -> torch.Tensor:
    """Entropic OT loss (cost |x - y|^2), differentiable twice in x and y, streaming.

    ``torch.autograd.grad(loss, x, create_graph=True)`` gives the envelope gradient; a
    second backward through it runs the streaming HVP (implicit response of the
    potentials included). Weights get first-order gradients only (they are constants of
    the second-order graph). ``debias=True``: ``OT(x,y) - OT(x,x)/2 - OT(y,y)/2``.
    Returns a 0-dim tensor in x's dtype.
    """
    n, m = x.shape[0], y.shape[0]
    dt = x.dtype
    if a is None:
        a = torch.full((n,), 1.0 / n, dtype=dt, device=x.device)
    if b is None:
        b = torch.full((m,), 1.0 / m, dtype=dt, device=x.device)
    rx, ry = split_reach(reach)

    def cfg(rr, sym):
        return {
            "solve": dict(
                eps=eps,
                reach=rr,
                max_iter=max_iter,
                tol=tol,
                symmetric=sym,
                eps_schedule=eps_schedule,
                backend=backend,
                precision=precision,
            ),
            "cg_tol": cg_tol,
            "cg_max_iter": cg_max_iter,
        }

    val = _OTLossFn.apply(x, y, a, b, cfg(reach, False))
    if debias:
        val = val - 0.5 * _OTLossFn.apply(x, x, a, a, cfg((rx, rx), True))
        val = val - 0.5 * _OTLossFn.apply(y, y, b, b, cfg((ry, ry), True))
    return val


__all__ = ["hvp", "implicit_grad", "inverse_hvp", "ot_loss", "HvpInfo", "ImplicitGrads"]
