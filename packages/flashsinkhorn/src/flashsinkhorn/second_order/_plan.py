"""A solved entropic OT problem, held by its potentials, with streaming plan products.

Conventions (the same as ``flashsinkhorn.solve``): cost ``C_ij = |x_i - y_j|^2`` (plus an
optional label-cost table ``L[lx_i, ly_j]``, used by OTDD), plan
``P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)``, unbalanced marginal penalty
``rho * KL`` with ``rho = 2 reach**2`` (GeomLoss's reach, a distance) and damping
``kappa = 1 / (1 + eps / rho)`` per side
(``kappa = 1`` on a balanced side). The loss is the dual objective

    OT = <a, phi_x(f)> + <b, phi_y(g)> - eps * (sum(P) - sum(a) sum(b))

with ``phi(f) = f`` on a balanced side and ``phi(f) = -rho (exp(-f / rho) - 1)`` on an
unbalanced one; at the optimum this is the entropic OT cost, and its gradient in x is
``2 (r_i x_i - (P y)_i)`` (envelope theorem, r = P 1).

:func:`solve_potentials` runs flashsinkhorn's one Sinkhorn loop (:mod:`flashsinkhorn._loop`,
on the problem ``backends.build`` picks: dense or streaming) in this convention, so that
this subpackage also works on its own; potentials from ``flashsinkhorn.solve`` can be
passed instead.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flashsinkhorn import _loop, backends
from flashsinkhorn._hessian import Plan, center, kappa, rho_pair
from flashsinkhorn._hessian_triton import PRECISIONS, resolve_backend


def _check_inputs(x, y, a, b, eps):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a (N, D) tensor; got {getattr(x, 'shape', type(x))}")
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise ValueError(f"y must be a (M, D) tensor; got {getattr(y, 'shape', type(y))}")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same D; got {x.shape[1]} and {y.shape[1]}")
    if x.shape[0] == 0 or y.shape[0] == 0:
        raise ValueError("x and y must be non-empty")
    if x.device != y.device or x.dtype != y.dtype:
        raise ValueError("x and y must share device and dtype")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps must be a positive number; got {eps!r}")
    n, m = x.shape[0], y.shape[0]
    dt = x.dtype if x.dtype == torch.float64 else torch.float32
    if a is None:
        a = torch.full((n,), 1.0 / n, dtype=dt, device=x.device)
    if b is None:
        b = torch.full((m,), 1.0 / m, dtype=dt, device=x.device)
    if a.shape != (n,):
        raise ValueError(f"a must have shape ({n},); got {tuple(a.shape)}")
    if b.shape != (m,):
        raise ValueError(f"b must have shape ({m},); got {tuple(b.shape)}")
    if bool((a <= 0).any()) or bool((b <= 0).any()):
        raise ValueError("weights a and b must be positive")
    if not bool(torch.isfinite(x).all()) or not bool(torch.isfinite(y).all()):
        raise ValueError("x and y must be finite")
    return a.to(dt), b.to(dt)


def _problem(xc, yc, a, b, lab, backend, precision):
    """The cost ``|x - y|^2`` (+ label table) as a :class:`flashsinkhorn.problem.Problem` of
    one batch on ``backend`` (``backends.build``: dense or streaming by size)."""
    labels = None
    if lab is not None:
        labels = (lab[0][None], lab[1][None], lab[2], 1.0)
    fields = dict(X=xc[None], Y=yc[None], a=a[None], b=b[None], c2=2.0, labels=labels)
    fields.update(cx=(xc * xc).sum(1)[None], cy=(yc * yc).sum(1)[None], precision=precision)
    return backends.build(backend, **fields)[0]


def solve_potentials(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    reach=None,
    max_iter: int = 100,
    tol: float | None = None,
    check_every: int = 10,
    eps_schedule=None,
    symmetric: bool = False,
    labels=None,
    potentials=None,
    backend: str = "auto",
    precision: str = "tf32x3",
    loop_precision: str | None = None,
    exact_tail: int = 5,
) -> Plan:
    """Entropic OT potentials on flashsinkhorn's one loop; returns a :class:`Plan` (the
    second-order convention: potentials + streamed plan products).

    x (n, D), y (m, D); a (n,), b (m,) positive weights (uniform when None); ``eps`` the
    final temperature; ``reach`` (float or (reach_x, reach_y), None = balanced; GeomLoss's
    distance) gives ``rho = 2 reach**2``. ``eps_schedule``: annealing temperatures run
    before eps (one symmetric averaged update each, GeomLoss's eps-scaling), then
    ``max_iter`` iterations at eps. ``tol``: stop when the L1 marginal error estimate,
    checked every ``check_every`` iterations, falls below it. ``symmetric``: averaged
    (GeomLoss-style) updates instead of alternating ones. ``labels``: ``(lx (n,), ly (m,),
    table (Kx, Ky))`` adds ``table[lx_i, ly_j]`` to the cost. ``potentials=(f, g)`` skips
    the solve (e.g. from ``flashsinkhorn.solve``). ``backend``: as ``flashsinkhorn.solve``'s
    (``"auto"``: dense or streaming by size).
    ``loop_precision`` (opt-in, e.g. "tf32" with ``precision="tf32x3"``): the dot precision
    of the iterations before the last ``exact_tail`` ones (with ``tol``: until the estimate
    passes, then ``exact_tail`` more iterations at ``precision``). Where the loop converges,
    the exact iterations contract the cheaper mode's error away
    (docs/design/flashsinkhorn.md); the returned plan's own products use ``precision``.
    """
    a, b = _check_inputs(x, y, a, b, eps)
    if loop_precision is not None and loop_precision not in PRECISIONS:
        raise ValueError(
            f"loop_precision must be None or one of {PRECISIONS}, got {loop_precision!r}"
        )
    if isinstance(exact_tail, bool) or not isinstance(exact_tail, int) or exact_tail < 1:
        raise ValueError(f"exact_tail must be an int >= 1, got {exact_tail!r}")
    be = resolve_backend(backend if backend in ("auto", "triton", "torch") else "auto", x.device)
    dt = x.dtype if (be == "torch" and x.dtype == torch.float64) else torch.float32
    xc, yc = center(x.detach().to(dt), y.detach().to(dt))
    a = a.detach().to(dt)
    b = b.detach().to(dt)
    rx, ry = rho_pair(reach)
    lab = None
    if labels is not None:
        lx, ly, table = labels
        lab = (lx.to(x.device), ly.to(x.device), table.detach().to(device=x.device, dtype=dt))
    plan = Plan(xc, yc, a, b, None, None, float(eps), rx, ry, lab, be, precision)
    if potentials is not None:
        plan.f = potentials[0].detach().to(dt)
        plan.g = potentials[1].detach().to(dt)
        plan.info = {"iterations": 0, "marginal_error": None}
        return plan
    prob = _problem(xc, yc, a, b, lab, backend, precision)
    sched = _loop.Schedule(
        eps=float(eps),
        stages=tuple(float(e) for e in (eps_schedule or ())),
        rho_x=rx,
        rho_y=ry,
        max_iter=int(max_iter),
        update="symmetric" if symmetric else "alternating",
        tol=tol,
        check_every=check_every,
    )
    fast = loop_precision is not None and loop_precision != precision and exact_tail < max_iter
    # the loop starts from g = c-transform of f = 0 at the first temperature (not f from
    # g = 0): Newton on OT losses of unconverged potentials (the shuffled-regression
    # example at 300 iterations) converges to |grad| 1e-12 from there and stalls at 4e-6
    # from the other start (its line search sees the loss and the envelope gradient
    # disagree more)
    e0 = float(sched.stages[0] if sched.stages else eps)
    first = prob.with_precision(loop_precision) if fast else prob
    f0 = first.zeros_x()
    start = (f0, first.sm_y(f0, e0, kappa(ry, e0))[0])
    if not fast:
        out = _loop.run(prob, sched, init=None if sched.stages else start)
        info = {"iterations": out.n_iter, "loop_precision_iterations": 0}
    else:
        # the cheap loop (at most max_iter - exact_tail iterations, or until the estimate
        # passes tol), then exact_tail iterations at precision, the last one apart: its
        # change decides whether the cheap iterations only left a bias the tail removed
        cheap = _loop.run(
            first,
            replace(sched, max_iter=max_iter - exact_tail),
            init=None if sched.stages else start,
        )
        tail = replace(sched, stages=(), max_iter=exact_tail - 1, tol=None)
        out = _loop.run(prob, tail, init=(cheap.f, cheap.g))
        f_prev, g_prev = out.f, out.g
        out = _loop.run(prob, replace(tail, max_iter=1), init=(f_prev, g_prev))
        change = _gauge_free_change(out.f - f_prev, out.g - g_prev, rx is None and ry is None)
        scale = max(1.0, float(out.f.abs().max()), float(out.g.abs().max()))
        if change > TAIL_TOL * scale:
            # still moving after the exact tail: the loop has not converged, so the cheap
            # iterations' rounding changed the trajectory, not just a bias the tail removes
            # (GPU run 11: H v off by 7e-4 on such a problem). Redo every iteration exactly.
            plan = solve_potentials(
                x,
                y,
                a,
                b,
                eps=eps,
                reach=reach,
                max_iter=max_iter,
                tol=tol,
                check_every=check_every,
                eps_schedule=eps_schedule,
                symmetric=symmetric,
                labels=labels,
                backend=backend,
                precision=precision,
            )
            plan.info["loop_precision_fallback"] = True
            return plan
        info = {"iterations": cheap.n_iter + exact_tail, "loop_precision_iterations": cheap.n_iter}
        # the last iteration's estimate (the L1 marginal error of the plan before it)
        last = _loop.l1_err(prob, "x", f_prev, out.f, eps)
        out.estimate = float((last + _loop.l1_err(prob, "y", g_prev, out.g, eps)).max())
    plan.f, plan.g = out.f[0].to(dt), out.g[0].to(dt)
    plan.info = dict(info, marginal_error=out.estimate, loop_precision_fallback=False)
    return plan


# Largest change of the potentials (relative to max(1, |f|, |g|), gauge removed) over the last
# exact iteration for which the loop_precision schedule is kept. Converged loops change by
# rounding noise there (~1e-7); the unconverged GPU test problem by ~4e-4 per iteration.
TAIL_TOL = 1e-5


def _gauge_free_change(df, dg, balanced):
    """max |change| of (f, g) after removing a common shift (f + c, g - c) when balanced
    (that direction is the same plan, and the loop leaves it where rounding put it)."""
    c = 0.5 * (float(df.mean()) - float(dg.mean())) if balanced else 0.0
    return max(float((df - c).abs().max()), float((dg + c).abs().max()))


__all__ = ["solve_potentials"]
