"""solve()'s Sinkhorn loop: eps-scaling warm start, fixed-eps iterations, stopping test.

The stopping test has two levels:

- a cheap estimate every ``check_every`` iterations, from the update itself (the row
  marginal of the plan before an update of f is ``a_i exp((f_i - f_new_i) / eps)``; a few
  elementwise kernels, one host sync);
- when the estimate passes ``tol``, the certificate (:func:`flashsinkhorn.result.certificate`):
  the marginal error of the current potentials recomputed in float64 from the points.
  Only the certificate can declare convergence.

If the certificate fails on a low-precision loop (tf32 or bf16 dot operands on the triton
backend: they solve a problem whose cost is off by tf32's rounding, 2^-11 relative in the
dot), the loop continues at "tf32x3" (about fp32 accuracy) from where it is. If it fails at
full precision and stops improving, float32 cannot resolve the plan at this eps (its
potentials carry rounding errors of about 2^-24 |f|, i.e. 2^-24 |f| / eps in every exponent):
the loop stops, unconverged, and says so.
"""

from __future__ import annotations

import warnings

import torch

from flashsinkhorn.reference import damping_factor, eps_schedule

LOW_PRECISIONS = ("tf32", "bf16")
POLISH_PRECISION = "tf32x3"


def l1_err(prob, w, old, new, eps):
    """``sum_i w_i |exp((old_i - new_i) / eps) - 1|``: the L1 marginal error of the plan of
    the old potential (zero weights do not count), summed over the problem's points."""
    e = w * torch.expm1((old - new) / eps).abs()
    return prob.total(torch.where(w > 0, e, torch.zeros_like(e)))


def eps_list(prob, eps, eps_scaling, diameter):
    """The annealing temperatures before ``eps`` (None without eps-scaling)."""
    if eps_scaling is None:
        return None
    if diameter is None:
        X, Y = prob.X.detach(), prob.Y.detach()
        lo = torch.minimum(X.amin(dim=(0, 1)), Y.amin(dim=(0, 1)))
        hi = torch.maximum(X.amax(dim=(0, 1)), Y.amax(dim=(0, 1)))
        diameter = float((hi - lo).double().norm())
    d2 = max(float(prob.cost_scale) * diameter**2, eps)
    return eps_schedule(d2, eps, eps_scaling)[:-1]


class Outcome:
    """What the loop hands back: potentials, float64 certificate, counts, the final problem."""

    def __init__(self, f, g, err, marginals, n_iter, converged, stalled, prob):
        self.f, self.g, self.err, self.marginals = f, g, err, marginals
        self.n_iter, self.converged, self.stalled, self.prob = n_iter, converged, stalled, prob


def report(out: Outcome, tol, eps, warn, stacklevel=3):
    """Warn about an unconverged solve with the reason (max_iter, or the float32 floor)."""
    if tol is None or tol <= 0 or out.converged or not warn:
        return
    err = float(out.err.max())
    if out.stalled:
        fmax = max(float(out.f.abs().max()), float(out.g.abs().max()))
        floor = 2.0**-24 * fmax / eps
        msg = (
            f"flashsinkhorn.solve: not converged: the float64-measured marginal error stalled "
            f"at {err:.3g} > tol {tol} after {out.n_iter} iterations: float32 potentials of "
            f"magnitude {fmax:.3g} carry rounding errors of about {floor:.2g} eps at "
            f"eps={eps:.3g}; pass float64 inputs, or increase eps or tol"
        )
    else:
        msg = (
            f"flashsinkhorn.solve: not converged after {out.n_iter} iterations "
            f"(marginal error {err:.3g} > tol {tol}); increase max_iter or eps"
        )
    warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel)


def _say(verbose, text):
    """``verbose``: False, True (print) or a callable taking the line (the sharded solve
    measures on every rank and prints on one)."""
    if callable(verbose):
        verbose(f"flashsinkhorn.solve: {text}")
    elif verbose:
        print(f"flashsinkhorn.solve: {text}", flush=True)


def run(prob, loop, stages, certify, verbose=False) -> Outcome:
    """The loop. ``loop = (eps, rx, ry, max_iter, tol, schedule, check_every)``; ``stages``:
    the eps-scaling temperatures before eps (or None); ``certify(f, g) -> (err, rows, cols)``
    is the float64 measurement."""
    eps, rx, ry, max_iter, tol, schedule, check_every = loop
    B, N = prob.cx.shape
    M = prob.cy.shape[1]
    dt = torch.float64 if prob.X.dtype == torch.float64 else torch.float32
    f = torch.zeros((B, N), dtype=dt, device=prob.X.device)
    g = torch.zeros((B, M), dtype=dt, device=prob.X.device)
    # eps-scaling warm start: one symmetric iteration per stage (GeomLoss)
    if stages:  # each symmetric update: one pass for both potentials where it can
        e0 = stages[0]
        f, g = prob.sym_update(f, g, e0, damping_factor(e0, rx), damping_factor(e0, ry))
        for k, e in enumerate(stages):
            ft, gt = prob.sym_update(f, g, e, damping_factor(e, rx), damping_factor(e, ry))
            if verbose:
                est = float((l1_err(prob, prob.a, f, ft, e) + l1_err(prob, prob.b, g, gt, e)).max())
                _say(verbose, f"eps-scaling stage {k + 1}/{len(stages)}, eps {e:.4g}, "
                              f"marginal error (estimate) {est:.3g}")  # fmt: skip
            f, g = 0.5 * (f + ft), 0.5 * (g + gt)
    check = tol is not None and tol > 0
    cheap_tol = tol if check else None
    cert = None  # (err, rows, cols) of the current (f, g), or None when stale
    last_true = None
    # after a failed measurement at full precision, measure again at the latest after this
    # many checks even if the estimate has not fallen (a stalled estimate must not run on)
    recheck = 10 * check_every
    next_cert = max_iter + 1
    converged = stalled = False
    n_iter = 0
    for it in range(1, max_iter + 1):
        # the estimate (a few small elementwise kernels per side) only where it is read
        measure = it % check_every == 0 and (check or bool(verbose))
        # the current potentials as guesses of the updates ("shift" kernel), except the
        # zeros the loop starts from without eps-scaling
        gf, gg = (f, g) if (stages or it > 1) else (None, None)
        if schedule == "alternating":
            fn = prob.sm_x(g, eps, damping_factor(eps, rx), guess=gf)[0]
            if measure:
                ea = l1_err(prob, prob.a, f, fn, eps)
            gn = prob.sm_y(fn, eps, damping_factor(eps, ry), guess=gg)[0]
            if measure:
                eb = l1_err(prob, prob.b, g, gn, eps)
            f, g = fn, gn
        else:  # symmetric (averaged) updates
            kx, ky = damping_factor(eps, rx), damping_factor(eps, ry)
            if gf is None:  # the cold start from zeros: running-max passes
                ft, gt = prob.sm_x(g, eps, kx)[0], prob.sm_y(f, eps, ky)[0]
            else:  # both from one pass where the backend has it
                ft, gt = prob.sym_update(f, g, eps, kx, ky)
            if measure:
                ea = l1_err(prob, prob.a, f, ft, eps)
                eb = l1_err(prob, prob.b, g, gt, eps)
            f, g = 0.5 * (f + ft), 0.5 * (g + gt)
        n_iter, cert = it, None
        if not measure:
            continue
        est = float((ea + eb).max())  # the only host sync: every check_every iterations
        _say(verbose, f"iteration {it}, eps {eps:.4g}, marginal error (estimate) {est:.3g}"
                      f"{'' if prob.precision == 'tf32' else ', ' + prob.precision}")  # fmt: skip
        if not check or not (est < cheap_tol or it >= next_cert):  # NaN / inf: iterate on
            continue
        _finite_or_raise(prob, f, g, eps)
        cert = certify(f, g)
        true = float(cert[0].max())
        _say(verbose, f"iteration {it}, marginal error (float64) {true:.3g}")
        if true < tol:
            converged = True
            break
        if prob.backend != "torch" and prob.precision in LOW_PRECISIONS:
            # the low-precision cost is off by more than tol allows: continue exactly
            _say(verbose, f"switching to precision {POLISH_PRECISION!r}")
            prob = prob.with_precision(POLISH_PRECISION)
            continue
        if (last_true is not None and true > 0.5 * last_true) or est == 0.0:
            stalled = True  # float32's floor: iterating does not lower the true error
            break
        last_true = true
        # ask the estimate for proportionally more before measuring again
        cheap_tol, next_cert = est * tol / true, it + recheck
    _finite_or_raise(prob, f, g, eps)
    if cert is None:
        cert = certify(f, g)
        _say(verbose, f"final marginal error (float64) {float(cert[0].max()):.3g}")
    return Outcome(f, g, cert[0], cert[1:], n_iter, converged, stalled, prob)


def _finite_or_raise(prob, f, g, eps):
    bad = not bool(torch.isfinite(f).all() & torch.isfinite(g).all())
    if prob.any_rank((bad,))[0]:  # every rank raises together
        raise FloatingPointError(
            f"Sinkhorn produced non-finite potentials at eps={eps:.3g}: increase eps, rescale "
            "the points or pass float64 inputs"
        )


__all__ = ["run", "report", "eps_list", "l1_err", "Outcome"]
