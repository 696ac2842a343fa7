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

:func:`solve_potentials` is a small streaming Sinkhorn (alternating or symmetric updates,
optional eps-scaling, optional label costs) so that this subpackage also works on its own;
potentials from ``flashsinkhorn.solve`` can be passed instead.
"""

from __future__ import annotations

import torch

from flashsinkhorn._hessian import Plan, center, kappa, rho_pair
from flashsinkhorn._hessian_triton import PRECISIONS, resolve_backend, row_lse
from flashsinkhorn.primitives import softmin


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


# solve_potentials on the triton backend runs its updates on the main solver's kernel for
# D <= this and the tensor-core precisions (one feature chunk: no register spill at tf32x3
# or tf32 without labels in a static sm_90 compile, at any d = 64 tuned config); otherwise
# on the second-order row_lse kernel (docs/design/flashsinkhorn.md, second order).
_MAIN_KERNEL_MAX_D = 128
_MAIN_KERNELPRECISIONS = ("tf32x3", "tf32")


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
    """Streaming log-domain Sinkhorn; returns a :class:`Plan` (potentials + plan products).

    x (n, D), y (m, D); a (n,), b (m,) positive weights (uniform when None); ``eps`` the
    final temperature; ``reach`` (float or (reach_x, reach_y), None = balanced; GeomLoss's
    distance) gives ``rho = 2 reach**2``. ``max_iter`` full iterations at the final eps
    (after one iteration per value of ``eps_schedule`` when given). ``tol``: stop when the
    L1 marginal error, checked every ``check_every`` iterations, falls below it.
    ``symmetric``: averaged (GeomLoss-style) updates instead of alternating ones. ``labels``:
    ``(lx (n,), ly (m,), table (Kx, Ky))`` adds ``table[lx_i, ly_j]`` to the cost.
    ``potentials=(f, g)`` skips the solve (e.g. from ``flashsinkhorn.solve``).
    ``loop_precision`` (opt-in, e.g. "tf32" with ``precision="tf32x3"``): the Triton dot mode
    of the iterations before the last ``exact_tail`` ones (with ``tol``: until the error
    check passes, then ``exact_tail`` more iterations at ``precision``). Where the loop
    converges, the exact iterations contract the cheaper mode's error away
    (docs/design/flashsinkhorn.md); the returned plan's own products use ``precision``.
    """
    a, b = _check_inputs(x, y, a, b, eps)
    if loop_precision is not None and loop_precision not in PRECISIONS:
        raise ValueError(f"loop_precision must be None or one of {PRECISIONS}, got "
                         f"{loop_precision!r}")  # fmt: skip
    if isinstance(exact_tail, bool) or not isinstance(exact_tail, int) or exact_tail < 1:
        raise ValueError(f"exact_tail must be an int >= 1, got {exact_tail!r}")
    be = resolve_backend(backend, x.device)
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
    x2 = (xc * xc).sum(1)
    y2 = (yc * yc).sum(1)
    loga = torch.log(a)
    logb = torch.log(b)
    lab_t = None if lab is None else (lab[1], lab[0], lab[2].T.contiguous())

    precisions = {precision, loop_precision or precision}
    main = xc.shape[1] <= _MAIN_KERNEL_MAX_D and precisions <= set(_MAIN_KERNELPRECISIONS)
    if be == "triton" and main:
        # The main solver's kernel (flashsinkhorn.primitives.softmin: the streaming
        # kernels, row tile kept on chip) computes the whole update in one launch:
        # kappa (|x_i|^2 - eps LSE_j[log b_j + (g_j - |y_j|^2 + 2<x_i, y_j> - L_ij) / eps]).
        # Operands are prepared once here (batch of one, int32 labels, fp32 tables), so the
        # launcher copies nothing per call. D > 128 and precision "ieee" keep row_lse's
        # kernel (there the main kernel spills too in a static sm_90 compile).
        sx, sy = xc.contiguous()[None], yc.contiguous()[None]
        x2b, y2b, logab, logbb = x2[None], y2[None], loga[None], logb[None]
        klab = klab_t = None
        # "auto" lets softmin run the sm_90 Gluon pass where it applies (tf32 loops)
        kbe = "auto" if backend == "auto" else "triton"
        if lab is not None:
            lx32, ly32 = lab[0].to(torch.int32)[None], lab[1].to(torch.int32)[None]
            klab = (lx32, ly32, lab[2].float().contiguous(), 1.0)
            klab_t = (ly32, lx32, lab_t[2].float().contiguous(), 1.0)

        def upd_f(g, e, prec):
            return softmin(
                sx, sy, g[None], logbb, x2b, y2b, eps=e, c2=2.0, damping=kappa(rx, e),
                labels=klab, precision=prec, backend=kbe,
            )[0][0]  # fmt: skip

        def upd_g(f, e, prec):
            return softmin(
                sy, sx, f[None], logab, y2b, x2b, eps=e, c2=2.0, damping=kappa(ry, e),
                labels=klab_t, precision=prec, backend=kbe,
            )[0][0]  # fmt: skip

    else:

        def upd_f(g, e, prec):
            G = g - y2 + e * logb
            return kappa(rx, e) * (
                x2 + row_lse(xc, yc, G, e, labels=lab, backend=be, precision=prec)
            )

        def upd_g(f, e, prec):
            F = f - x2 + e * loga
            return kappa(ry, e) * (
                y2 + row_lse(yc, xc, F, e, labels=lab_t, backend=be, precision=prec)
            )

    eps_list = [float(e) for e in (eps_schedule or [])] + [float(eps)] * int(max_iter)
    n_iter = len(eps_list)
    # iterations at loop_precision before the exact tail: all but the last exact_tail, or
    # with tol until the check passes (exact_left counts the tail down once it starts)
    fast = loop_precision is not None and loop_precision != precision
    exact_left = None
    fast_iters = 0
    f = torch.zeros_like(x2)
    g = torch.zeros_like(y2)
    if eps_list:
        # a first c-transform at the first temperature
        g = upd_g(f, eps_list[0], loop_precision if fast else precision)
    err = None
    it = 0
    for it, e in enumerate(eps_list, 1):
        if fast and exact_left is None and it > n_iter - exact_tail:
            exact_left = n_iter - it + 1
        prec = loop_precision if (fast and exact_left is None) else precision
        fast_iters += prec != precision
        if exact_left == 1:
            f_prev, g_prev = f, g  # the last iteration's change decides the fallback below
        if symmetric:
            f_new, g_new = upd_f(g, e, prec), upd_g(f, e, prec)
            f, g = 0.5 * (f + f_new), 0.5 * (g + g_new)
        else:
            f = upd_f(g, e, prec)
            g_new = upd_g(f, e, prec)
            last = exact_left == 1
            if tol is not None and it >= n_iter - max_iter and (it % check_every == 0 or last):
                # column marginal error of the plan (f, g): sum_j |b_j exp((g - g_new)/eps) - b_j|
                if rx is None and ry is None:
                    err = float((b * torch.expm1((g - g_new) / e).abs()).sum())
                else:  # no fixed marginal: the change of the potential, in units of eps
                    err = float((g - g_new).abs().max() / e)
            g = g_new
            if exact_left is not None:
                exact_left -= 1
                if exact_left == 0:
                    break
            elif err is not None and err < tol:
                if not fast:
                    break
                exact_left = exact_tail  # converged at loop_precision: polish, then stop
    if fast and exact_left == 0:
        change = _gauge_free_change(f - f_prev, g - g_prev, rx is None and ry is None)
        if change > TAIL_TOL * max(1.0, float(f.abs().max()), float(g.abs().max())):
            # still moving after the exact tail: the loop has not converged, so the cheap
            # iterations' rounding changed the trajectory, not just a bias the tail removes
            # (GPU run 11: H v off by 7e-4 on such a problem). Redo every iteration exactly.
            plan = solve_potentials(
                x, y, a, b, eps=eps, reach=reach, max_iter=max_iter, tol=tol,
                check_every=check_every, eps_schedule=eps_schedule, symmetric=symmetric,
                labels=labels, backend=backend, precision=precision,
            )  # fmt: skip
            plan.info["loop_precision_fallback"] = True
            return plan
    plan.f, plan.g = f, g
    plan.info = {"iterations": it, "marginal_error": err, "loop_precision_iterations": fast_iters,
                 "loop_precision_fallback": False}  # fmt: skip
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
