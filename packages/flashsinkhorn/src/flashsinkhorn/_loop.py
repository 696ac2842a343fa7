"""The Sinkhorn loop: the only one in the package (``solve``, ``SamplesLoss`` and
``second_order`` all run it on a :class:`flashsinkhorn.problem.Problem`).

A :class:`Schedule`, decided on the host before the first launch, says what runs:

- the annealing stages (GeomLoss's eps-scaling): a cold-start symmetric update at the first
  temperature, then one symmetric averaged update per temperature; self problems (the
  debiasing terms OT(a, a), OT(b, b)) ride along, one self update per stage;
- then ``max_iter`` iterations at the final ``eps``, alternating (f then g) or symmetric
  (averaged), with a stopping test when ``tol`` is given.

The stopping test has two levels:

- an estimate every ``check_every`` iterations, from the update itself (the row marginal of
  the plan before an update of f is ``a_i exp((f_i - f_new_i) / eps)``), computed on the
  device; the host reads it with a lag (an event recorded after the estimate, read at a later
  check unless more than ``_LAG`` are pending), so a check never drains the GPU queue and a
  small problem costs its launches, not a synchronisation per check;
- when an estimate passes ``tol``, the certificate (``certify``, the float64 measurement of
  the current potentials, :func:`flashsinkhorn.result.certificate`). Only the certificate
  declares convergence.

``Schedule(host_reads=False)`` (``solve`` under CUDA-graph capture) makes the whole loop
device-only: the estimate's test runs on the device (``stop |= est < tol``) and freezes the
potentials from that check on (the remaining iterations still launch: a captured graph has
a fixed length), and the float64 certificate runs once, at the end, also on the device;
``n_iter`` and ``converged`` are then 0-dim device tensors. No precision switch, no stall
test, no warning (each needs a host read): a certificate that fails where the estimate
passed is reported as ``converged = False``, never iterated past.

If the certificate fails on a low-precision loop (tf32 or bf16 dot operands: they solve a
problem whose cost is off by tf32's rounding, 2^-11 relative in the dot), the loop continues
at "tf32x3" (about fp32 accuracy) from where it is. If it fails at full precision and stops
improving, float32 cannot resolve the plan at this eps (its potentials carry rounding errors
of about 2^-24 |f|, i.e. 2^-24 |f| / eps in every exponent): the loop stops, unconverged,
and says so.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass, field

import torch

from flashsinkhorn.reference import damping_factor, eps_schedule

LOW_PRECISIONS = ("tf32", "bf16")
POLISH_PRECISION = "tf32x3"
# checks whose estimate may be in flight before the host waits for the oldest one
_LAG = 2


@dataclass(frozen=True)
class Schedule:
    """What the loop runs. ``stages``: annealing temperatures (one symmetric averaged update
    each, after a cold start at the first); ``eps``: the temperature of the ``max_iter``
    iterations that follow; ``update``: "alternating" or "symmetric"; ``tol``: the L1
    marginal error to reach (None: run every iteration); ``rho_x``, ``rho_y``: KL penalties
    (None: balanced side); ``host_reads``: False for the device-only loop (no host read
    from the first iteration to the end, see the module docstring)."""

    eps: float
    stages: tuple = ()
    rho_x: float | None = None
    rho_y: float | None = None
    max_iter: int = 0
    update: str = "alternating"
    tol: float | None = None
    check_every: int = 10
    host_reads: bool = True


@dataclass
class Outcome:
    """What the loop hands back: the potentials (``selves``: the self problems' potentials),
    the float64 certificate ``err``, ``marginals`` (rows, cols) or None, counts, and the
    problem of the last iterations (a tf32 loop that switched to tf32x3 returns that one).
    The device-only loop (``Schedule.host_reads=False``) gives ``n_iter`` and ``converged``
    as 0-dim device tensors."""

    f: torch.Tensor
    g: torch.Tensor
    prob: object
    selves: list = field(default_factory=list)
    err: torch.Tensor | None = None
    marginals: tuple | None = None
    n_iter: int | torch.Tensor = 0
    converged: bool | torch.Tensor = False
    stalled: bool = False
    estimate: float | None = None  # the last estimate the host read (None: none was)


def l1_err(prob, side, old, new, eps):
    """``sum_i w_i |exp((old_i - new_i) / eps) - 1|`` with ``w`` the ``side``'s weights
    ("x": a, "y": b): the L1 marginal error of the plan of the old potential (zero weights
    do not count), per problem (B,)."""
    w = prob.a if side == "x" else prob.b
    e = w * torch.expm1((old - new) / eps).abs()
    return prob.total(torch.where(w > 0, e, torch.zeros_like(e)), side)


def annealing(prob, eps, eps_scaling, diameter):
    """The annealing temperatures before ``eps`` (``()`` without eps-scaling). Without a
    ``diameter`` it is measured (the bounding box of both clouds: one host read)."""
    if eps_scaling is None:  # a backend that needs the annealing has its own ratio
        eps_scaling = prob.default_scaling
        if eps_scaling is None:
            return ()
    if diameter is None:
        X, Y = prob.X.detach(), prob.Y.detach()
        lo = torch.minimum(X.amin(dim=(0, 1)), Y.amin(dim=(0, 1)))
        hi = torch.maximum(X.amax(dim=(0, 1)), Y.amax(dim=(0, 1)))
        diameter = float((hi - lo).double().norm())
    d2 = max(float(prob.cost_scale) * diameter**2, eps)
    return tuple(eps_schedule(d2, eps, eps_scaling)[:-1])


def report(out: Outcome, tol, eps, warn, stacklevel=3):
    """Warn about an unconverged solve with the reason (max_iter, or the float32 floor)."""
    if tol is None or tol <= 0 or not warn or isinstance(out.converged, torch.Tensor):
        return  # (a device-only loop's result is not read here: the caller checks it)
    if out.converged:
        return
    err = float(out.err.max())
    if out.stalled:
        fmax = max(float(out.f.abs().max()), float(out.g.abs().max()))
        f64 = out.f.dtype == torch.float64
        floor = (2.0**-53 if f64 else 2.0**-24) * fmax / eps
        fix = "increase eps or tol" if f64 else "pass float64 inputs, or increase eps or tol"
        msg = (
            f"flashsinkhorn.solve: not converged: the float64-measured marginal error stalled "
            f"at {err:.3g} > tol {tol} after {out.n_iter} iterations: {out.f.dtype} "
            f"potentials of magnitude {fmax:.3g} carry rounding errors of about {floor:.2g} "
            f"eps at eps={eps:.3g}; {fix}"
        )
    else:
        msg = (
            f"flashsinkhorn.solve: not converged after {out.n_iter} iterations "
            f"(marginal error {err:.3g} > tol {tol}); increase max_iter or eps"
        )
    warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel)


def say(verbose, text, who="flashsinkhorn.solve"):
    """``verbose``: False, True (print) or a callable taking the line (the sharded solve
    measures on every rank and prints on one)."""
    if callable(verbose):
        verbose(f"{who}: {text}")
    elif verbose:
        print(f"{who}: {text}", flush=True)


def capturing(device) -> bool:
    """Whether work on ``device`` is being recorded into a CUDA graph now (then nothing may
    read the device: ``solve`` runs the device-only loop). False while torch.compile traces
    (the loop is a custom op there, and the query is not traceable)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return False
    return torch.cuda.is_current_stream_capturing()


class _Estimates:
    """The stopping test's estimates in flight: each is copied to the host behind an event
    and read when it has arrived, or when more than ``_LAG`` are pending (CPU tensors are
    read at once: there a read costs nothing)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.pending = deque()

    def push(self, it, est):
        if not self.cuda:
            self.pending.append((it, est, None))
            return
        host = torch.empty(est.shape, dtype=est.dtype, pin_memory=True)
        host.copy_(est, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((it, host, event))

    def ready(self):
        """The oldest estimate whose value is on the host now (or must be waited for):
        ``(iteration, est (B,) on the CPU)``, or None."""
        if not self.pending:
            return None
        it, est, event = self.pending[0]
        if event is not None and len(self.pending) <= _LAG and not event.query():
            return None
        self.pending.popleft()
        if event is not None:
            event.synchronize()
        return it, est

    def clear(self):
        self.pending.clear()


def _anneal(prob, sched, selves, verbose, who):
    """The annealing stages: returns ``(f, g, self potentials)``. A problem with levels
    (:meth:`flashsinkhorn.problem.Problem.stage_levels`: the multiscale backend's cell
    clouds) runs each stage on its level and carries the potentials to the next level when
    it changes (GeomLoss's multiscale jumps), ending on ``prob`` itself."""
    rx, ry = sched.rho_x, sched.rho_y
    if not sched.stages:
        return prob.zeros_x(), prob.zeros_y(), [s.zeros_x() for s in selves]
    temps = (*sched.stages, sched.eps)
    keys = prob.stage_levels(temps)
    skeys = [s.stage_levels(temps) for s in selves]
    cur, scur = keys[0], [k[0] for k in skeys]
    P, Ps = prob.at_level(cur), [s.at_level(k) for s, k in zip(selves, scur)]
    f, g = P.zeros_x(), P.zeros_y()
    sp = [s.zeros_x() for s in Ps]
    e0 = sched.stages[0]
    # the cold start: one symmetric update from zeros (one pass for both where it can)
    f, g = P.sym_update(f, g, e0, damping_factor(e0, rx), damping_factor(e0, ry))
    sp = [s.self_update(z, e0, damping_factor(e0, r)) for s, z, r in zip(Ps, sp, (rx, ry))]
    prev = e0
    for k, e in enumerate(temps):
        if keys[k] != cur or any(sk[k] != c for sk, c in zip(skeys, scur)):
            # a jump: the potentials of the last stage carried to the finer level
            kx, ky = damping_factor(prev, rx), damping_factor(prev, ry)
            f, g = prob.prolong(cur, keys[k], f, g, prev, kx, ky)
            sp = [
                s.prolong(c, sk[k], p, p, prev, kr, kr)[0]
                for s, c, sk, p, kr in zip(selves, scur, skeys, sp, (kx, ky))
            ]
            cur, scur = keys[k], [sk[k] for sk in skeys]
            P, Ps = prob.at_level(cur), [s.at_level(c) for s, c in zip(selves, scur)]
        if k == len(sched.stages):  # the final temperature's level: the loop's problem
            break
        kx, ky = damping_factor(e, rx), damping_factor(e, ry)
        ft, gt = P.sym_update(f, g, e, kx, ky)
        st = [s.self_update(p, e, k_) for s, p, k_ in zip(Ps, sp, (kx, ky))]
        if verbose:
            est = float((l1_err(P, "x", f, ft, e) + l1_err(P, "y", g, gt, e)).max())
            say(
                verbose,
                f"eps-scaling stage {k + 1}/{len(sched.stages)}, eps {e:.4g}, "
                f"marginal error (estimate) {est:.3g}",
                who,
            )
        f, g = 0.5 * (f + ft), 0.5 * (g + gt)
        sp = [0.5 * (p + t) for p, t in zip(sp, st)]
        prev = e
    return f, g, sp


def run(
    prob,
    sched: Schedule,
    certify=None,
    selves=(),
    verbose=False,
    who="flashsinkhorn.solve",
    init=None,
):
    """The loop on ``prob`` (and the self problems ``selves``, annealed alongside).
    ``certify(f, g) -> (err, rows, cols)`` is the float64 measurement (None: no certificate;
    with a ``tol`` the loop then stops on the estimate alone, and the caller reports what it
    measures itself). ``init``: ``(f, g)`` to start from instead of the annealing stages (a
    warm start). Returns an :class:`Outcome`."""
    eps, rx, ry = sched.eps, sched.rho_x, sched.rho_y
    if verbose and not sched.host_reads:
        raise ValueError("verbose=True reads the device at every check: not in a device-only loop")
    if init is None:
        f, g, sp = _anneal(prob, sched, selves, verbose, who)
    else:
        f, g, sp = init[0], init[1], []
    check = sched.tol is not None and sched.tol > 0
    tol = sched.tol
    cheap_tol = tol if check else None
    cert = None  # (err, rows, cols) of the current (f, g), or None when stale
    last_true = None
    # after a failed measurement at full precision, measure again at the latest after this
    # many iterations even if the estimate has not fallen (a stalled estimate must not run on)
    recheck = 10 * sched.check_every
    next_cert = sched.max_iter + 1
    # an estimate that stops falling (no 10 % gain over 2 recheck windows) within 64x of the
    # dtype's floor (rounding errors of 2^-24 |f| / eps in every exponent, 2^-53 in float64:
    # there the potentials jitter instead of settling, and the estimate can never pass tol)
    # is measured too; far above the floor a flat estimate is a plateau of slow convergence
    best_est, best_it = math.inf, 0
    last_est = None
    unit = 2.0**-53 if prob.potential_dtype == torch.float64 else 2.0**-24
    converged = stalled = False
    n_iter = 0
    estimates = _Estimates(prob.cx.device)
    kx, ky = damping_factor(eps, rx), damping_factor(eps, ry)
    # the device-only loop: the stopping test's flag and the iterations run, on the device
    on_device = not sched.host_reads
    if on_device:
        stop = torch.zeros((), dtype=torch.bool, device=f.device)
        n_dev = torch.zeros((), dtype=torch.int64, device=f.device)
    for it in range(1, sched.max_iter + 1):
        # the estimate (a few small elementwise kernels per side) only where it is read
        measure = it % sched.check_every == 0 and (check or bool(verbose))
        # the current potentials as guesses of the updates ("shift" kernel), except the
        # zeros the loop starts from without annealing
        warm = bool(sched.stages) or init is not None or it > 1
        if sched.update == "alternating":
            fn = prob.sm_x(g, eps, kx, guess=f if warm else None)[0]
            if measure:
                ea = l1_err(prob, "x", f, fn, eps)
            gn = prob.sm_y(fn, eps, ky, guess=g if warm else None)[0]
            if measure:
                eb = l1_err(prob, "y", g, gn, eps)
        else:  # symmetric (averaged) updates
            if warm:  # both from one pass where the backend has it
                ft, gt = prob.sym_update(f, g, eps, kx, ky)
            else:  # the cold start from zeros: running-max passes
                ft, gt = prob.sm_x(g, eps, kx)[0], prob.sm_y(f, eps, ky)[0]
            if measure:
                ea = l1_err(prob, "x", f, ft, eps)
                eb = l1_err(prob, "y", g, gt, eps)
            fn, gn = 0.5 * (f + ft), 0.5 * (g + gt)
        n_iter, cert = it, None
        if on_device:  # potentials frozen from the check whose estimate passed tol on
            f, g = (torch.where(stop, f, fn), torch.where(stop, g, gn)) if check else (fn, gn)
            n_dev += ~stop
            if measure and check:
                stop = stop | ((ea + eb).amax() < tol)
            continue
        f, g = fn, gn
        if not measure:
            continue
        # (peak: the global maximum on a sharded problem, so every rank decides alike)
        fmax = torch.maximum(prob.peak(f.abs()).amax(), prob.peak(g.abs(), "y").amax())
        estimates.push(it, torch.stack(((ea + eb).amax(), fmax.to(ea.dtype))))
        got = estimates.ready()
        if got is None:
            continue
        it_e, est, fmax = got[0], float(got[1][0]), float(got[1][1])
        last_est = est
        precision = "" if prob.precision == "tf32" else ", " + prob.precision
        say(
            verbose,
            f"iteration {it_e}, eps {eps:.4g}, marginal error (estimate) {est:.3g}{precision}",
            who,
        )  # noqa: E501
        if est < 0.9 * best_est:
            best_est, best_it = est, it_e
        stagnant = it_e - best_it >= 2 * recheck and est < 64 * unit * fmax / eps
        # an estimate that passes, a recheck that is due, a stagnant one, or one that is not
        # finite (the exponents overflow: the dtype's floor, which only the certificate tells)
        due = est < cheap_tol or it >= next_cert or stagnant or not math.isfinite(est)
        if not check or not due:
            continue
        if certify is None:  # the estimate alone decides (no float64 certificate asked for)
            if est < tol:
                break
            continue
        finite_or_raise(prob, f, g, eps)
        cert = certify(f, g)
        true = float(cert[0].max())
        say(verbose, f"iteration {it}, marginal error (float64) {true:.3g}", who)
        estimates.clear()  # the estimates in flight describe older potentials
        if true < tol:
            converged = True
            break
        if not prob.exact and prob.precision in LOW_PRECISIONS:
            # the low-precision cost is off by more than tol allows: continue exactly
            say(verbose, f"switching to precision {POLISH_PRECISION!r}", who)
            prob = prob.with_precision(POLISH_PRECISION)
            continue
        if (last_true is not None and true >= 0.5 * last_true) or est == 0.0:
            stalled = True  # float32's floor: iterating does not lower the true error
            break
        last_true = true
        best_est, best_it = est, it  # stagnation is measured afresh from here
        # ask the estimate for proportionally more before measuring again
        ratio = est * tol / true
        cheap_tol, next_cert = (ratio if math.isfinite(ratio) else tol), it + recheck
    out = Outcome(f=f, g=g, prob=prob, selves=sp, n_iter=n_iter, stalled=stalled, estimate=last_est)
    if on_device:
        out.n_iter, out.converged = n_dev, torch.zeros((), dtype=torch.bool, device=f.device)
    if certify is None:
        return out
    if on_device:  # non-finite potentials: the certificate's err is inf, not converged
        cert = certify(f, g)
        out.err, out.marginals = cert[0], cert[1:]
        if check:
            out.converged = cert[0].amax() < tol
        return out
    finite_or_raise(prob, f, g, eps)
    if cert is None:
        cert = certify(f, g)
        say(verbose, f"final marginal error (float64) {float(cert[0].max()):.3g}", who)
        # the last iterate may meet tol though no check read it (max_iter < check_every,
        # or an estimate still in flight)
        converged = check and float(cert[0].max()) < tol
    out.err, out.marginals, out.converged = cert[0], cert[1:], converged
    return out


def finite_or_raise(prob, f, g, eps):
    """Non-finite potentials are not a result: raise (every rank together)."""
    bad = not bool(torch.isfinite(f).all() & torch.isfinite(g).all())
    if prob.any_rank((bad,))[0]:
        raise FloatingPointError(
            f"Sinkhorn produced non-finite potentials at eps={eps:.3g}: increase eps, rescale "
            "the points or pass float64 inputs"
        )


__all__ = ["Schedule", "Outcome", "run", "report", "annealing", "l1_err", "say", "capturing"]
