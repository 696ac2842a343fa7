"""GeomLoss-compatible ``SamplesLoss`` (loss="sinkhorn", p=2) on the streaming kernels.

Semantics follow ``geomloss.SamplesLoss`` 0.3.1 exactly for p = 2:

- cost ``C(x, y) = |x - y|^2 / 2``, ``eps = blur^2``, ``rho = reach^2``;
- GeomLoss's eps-scaling list ``[diameter^2, ..., blur^2]`` (ratio ``scaling^2``), the
  symmetric (averaged) updates, the damping ``1 / (1 + eps/rho)`` for unbalanced OT;
- the final "extrapolation" step, whose gradient is the one GeomLoss returns:
  ``d/dx_i = a_i (x_i - sum_j pi_ij y_j)`` (times ``exp(-f_i/rho)`` when unbalanced) with
  ``pi`` the row softmax of the last step, and ``d/da_i = f_i`` (balanced);
- ``debias=True``: the Sinkhorn divergence ``OT(a,b) - OT(a,a)/2 - OT(b,b)/2`` written
  with the four potentials (Feydy's thesis eq. 3.209); unbalanced weights ``(rho + eps/2)``
  in value and gradient (GeomLoss's ``UnbalancedWeight.backward`` with ``rho + eps`` is an
  ``nn.Module`` method that autograd never calls, so GeomLoss's gradients use
  ``rho + eps/2``; we return the same);
- ``loss(x, y)`` / ``loss(a, x, b, y)``, (N, D) inputs give a scalar, (B, N, D) a (B,) vector;
  ``potentials=True`` returns ``(F, G)`` of shapes (B, N), (B, M), and (1, N), (1, M) for
  (N, D) inputs, as GeomLoss does (not differentiable here).

Gradients are computed in the forward pass by the same streaming kernel (the softmax
average of the last step), so backward is elementwise. Under torch.compile the forward runs
as the custom op ``flashsinkhorn::sinkhorn_divergence`` (no graph break).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from flashsinkhorn import _loop, backends, distributed
from flashsinkhorn._hessian import (
    HvpTerm,
    differentiable_grads,
    no_second_order_in_weights,
    plan_from_potentials,
)
from flashsinkhorn._inputs import check_masses, check_values, prepare_inputs
from flashsinkhorn._loss_args import TOL_MAX_ITER, check_loss_args, check_multiscale_args
from flashsinkhorn.operands import centered_sqnorm, common_center
from flashsinkhorn.primitives import PRECISIONS, check_precision, problem_backend, resolve_backend
from flashsinkhorn.reference import damping_factor, eps_schedule, max_diameter, rho_from_reach
from flashsinkhorn.varlen import VarlenProblem, prepare_varlen, segment_ids, split

__all__ = ["SamplesLoss", "sinkhorn_divergence"]


def _side(F, F_self, rho, eps, w):
    """One side's per-point value term and its d/dw factor (GeomLoss): ``F`` the cross
    potential, ``F_self`` the self one (debias) or None, ``rho`` the side's KL penalty
    (None: balanced). Unbalanced terms are weighted by ``rho + eps / 2`` (GeomLoss's
    ``UnbalancedWeight``, see the module docstring)."""
    if rho is None:
        t = F if F_self is None else F - F_self
    else:
        e_self = 1.0 if F_self is None else torch.exp(-F_self / rho)
        t = (rho + eps / 2) * (e_self - torch.exp(-F / rho))
    return w * t, t


def _grad_factor(f, rho, eps):
    """d value / d f times the damping of d f / d C, per point (1 on a balanced side)."""
    if rho is None:
        return torch.ones_like(f)
    return torch.exp(-f / rho) * ((rho + eps / 2) / (rho + eps))


def _sinkhorn_forward(
    a,
    x,
    b,
    y,
    *,
    blur,
    reach,
    diameter,
    scaling,
    debias,
    precision,
    backend,
    need_grad_x,
    need_grad_y,
    verbose=False,
    comm=None,
    layout=None,
    multiscale=None,
    tol=None,
):
    """Runs the GeomLoss loop; returns value (B,), potentials, and gradient pieces.
    ``comm``: sharded over a process group (flashsinkhorn.distributed): x, y, a, b are this
    rank's shards; the passes, sums and the eps schedule are global. ``layout``: a ragged
    batch ``(cu_x, cu_y, sizes_x, sizes_y)`` of concatenated points (flashsinkhorn.varlen),
    one schedule for all its problems. ``multiscale``: the multiscale problem's options
    (``truncate``, ``cluster_scale``); ``tol``: after the schedule, iterate at the final
    blur until the L1 marginal error is below tol (certified on the multiscale backend,
    the estimate on the others)."""
    eps = blur**2
    # GeomLoss: rho = reach**2 for the cost |x - y|^2 / 2; a pair: one penalty per side
    rx, ry = rho_from_reach(reach, 0.5)
    if diameter is None:
        diameter = max_diameter(x, y) if comm is None else comm.diameter(x, y)
    eps_list = eps_schedule(diameter**2, eps, scaling)
    pxy, why = _build(a, x, b, y, backend, precision, comm, layout, eps=eps, multiscale=multiscale)
    if verbose:
        print(f"flashsinkhorn.SamplesLoss: backend {pxy.kind} ({why})", flush=True)
    # the self problems share what they can (the streaming problems: the kernel operands)
    selves = (pxy.self_problem("x"), pxy.self_problem("y")) if debias else ()
    # GeomLoss's loop: one symmetric averaged update per temperature, the self problems
    # alongside (the one loop of flashsinkhorn._loop, stages only)
    sched = _loop.Schedule(eps=eps_list[-1], stages=tuple(eps_list), rho_x=rx, rho_y=ry)
    certify = None
    if tol is not None:  # then alternating iterations at the final blur down to tol
        certify = pxy.float64_certifier(eps_list[-1], rx, ry)
        sched = dataclasses.replace(sched, max_iter=TOL_MAX_ITER, tol=tol)
    run = _loop.run(
        pxy, sched, certify, selves=selves, verbose=verbose, who="flashsinkhorn.SamplesLoss"
    )
    f_ba, g_ab = run.f, run.g
    if debias:
        f_aa, g_bb = run.selves
        pxx, pyy = selves
        if tol is not None:  # the self problems to tol too (symmetric updates keep f = g)
            sym = dataclasses.replace(sched, stages=(), update="symmetric")
            conv = []
            for S, p, r in ((pxx, f_aa, rx), (pyy, g_bb, ry)):
                own = S.float64_certifier(eps_list[-1], r, r)
                o = _loop.run(S, dataclasses.replace(sym, rho_x=r, rho_y=r), own, init=(p, p))
                conv.append(0.5 * (o.f + o.g))
            f_aa, g_bb = conv
    # last extrapolation (at the last eps): potentials and the softmax averages for grads
    e = eps_list[-1]
    kx, ky = damping_factor(e, rx), damping_factor(e, ry)
    # gradients assembled in place in the softmax-average buffers as soon as each is ready
    # (memory: at most three N x D buffers alive, also with debias)
    F_ba, _, Ty = pxy.sm_x(g_ab, e, kx, v=y if need_grad_x else None, guess=f_ba)
    G_ab, _, Tx = pxy.sm_y(f_ba, e, ky, v=x if need_grad_y else None, guess=g_ab)
    out = {"f_ba": F_ba, "g_ab": G_ab, "eps": e, "rho": (rx, ry), "family": pxy.kernel_family}
    own = pxy.float64_certifier(e, rx, ry)
    if own is not None:  # the multiscale backend: the certified bound of (F_ba, G_ab)
        err = own(F_ba, G_ab)[0]
    else:  # L1 marginal error of the last loop plan, from what the last step computed
        err = _loop.l1_err(pxy, "x", f_ba, F_ba, e) + _loop.l1_err(pxy, "y", g_ab, G_ab, e)
    out["marginal_error"] = err
    if verbose:
        print(
            f"flashsinkhorn.SamplesLoss: final marginal error (loop plan) "
            f"{float(out['marginal_error'].max()):.3g}",
            flush=True,
        )
    gx = gy = None
    if need_grad_x:
        gx = torch.sub(x, Ty, out=Ty).mul_((a * _grad_factor(F_ba, rx, e))[..., None])
    if need_grad_y:
        gy = torch.sub(y, Tx, out=Tx).mul_((b * _grad_factor(G_ab, ry, e))[..., None])
    F_aa = G_bb = None
    if debias:
        # the loop's potentials as the passes' guesses (the shift kernels: exact anyway)
        F_aa, _, Txx = pxx.sm_x(f_aa, e, kx, v=x if need_grad_x else None, guess=f_aa)
        if need_grad_x:
            gx.add_(Txx.sub_(x).mul_((a * _grad_factor(F_aa, rx, e))[..., None]))
        del Txx
        G_bb, _, Tyy = pyy.sm_x(g_bb, e, ky, v=y if need_grad_y else None, guess=g_bb)
        if need_grad_y:
            gy.add_(Tyy.sub_(y).mul_((b * _grad_factor(G_bb, ry, e))[..., None]))
        del Tyy
        out.update(f_aa=F_aa, g_bb=G_bb)
    # value and gradient pieces
    va, ga = _side(F_ba, F_aa, rx, e, a)
    vb, gb = _side(G_ab, G_bb, ry, e, b)
    value = pxy.total(va) + pxy.total(vb, "y")
    if not bool(torch.isfinite(value).all()):  # value is global: every rank raises together
        raise FloatingPointError(
            f"SamplesLoss: the loss is not finite at blur={blur:.3g} (eps = blur^2): the cost "
            "range over eps overflows float32; increase blur, rescale the points or pass "
            "float64 inputs"
        )
    out.update(value=value, gx=gx, gy=gy, ga=ga, gb=gb)
    return out


def _build(a, x, b, y, backend, precision, comm=None, layout=None, eps=None, multiscale=None):
    """The loss's problem (cost |x - y|^2 / 2 in kernel form, centered at the common mean)
    on ``backend``, sharded over ``comm``, or ragged (``layout``): ``(problem, why)``."""
    c = common_center(x, y) if comm is None else comm.center(x, y)
    hx, hy = 0.5 * centered_sqnorm(x, c), 0.5 * centered_sqnorm(y, c)
    fields = dict(X=x, Y=y, a=a, b=b, cx=hx, cy=hy, c2=1.0, cost="sqeuclidean", cost_scale=0.5)
    if layout is not None:  # a ragged batch: one launch per pass over all its problems
        cu_x, cu_y, sx, sy = layout
        family = "auto" if backend in ("auto", "dense", "streaming", "varlen") else backend
        prob = VarlenProblem(
            cu_x=cu_x,
            cu_y=cu_y,
            sizes_x=sx,
            sizes_y=sy,
            backend=family,
            precision=precision,
            center=c,
            **fields,
        )
        return prob, f"{len(sx)} ragged problems"
    if comm is None:
        kw = {"eps": eps, "multiscale": multiscale}
        return backends.build(backend, precision=precision, center=c, **kw, **fields)
    # the sharded problem: the streaming passes over the ranks' columns
    be = problem_backend(backend, x.device, x.dtype)
    return comm.problem(precision=precision, backend=be, center=c, **fields), "sharded"


# Before a double backward the potentials of GeomLoss's schedule (a fixed number of
# iterations: at scaling 0.5 its last plan's L1 marginal error is 0.1-0.8) are converged at
# the final eps, to this L1 marginal error (the estimate), at most this many iterations:
# the HVP solves the optimality conditions, which unconverged potentials do not satisfy
# (its error was 56 % at scaling 0.5 against the converged HVP, the gradient's 8 %).
POLISH_TOL = 1e-6
POLISH_MAX_ITER = 2000


def _converged_potentials(a, x, b, y, F_ba, G_ab, F_aa, G_bb, e, opts, precision):
    """The final-eps potentials of the loss's OT terms, iterated from the schedule's to
    ``POLISH_TOL`` (the one loop, warm-started; balanced problems)."""
    pxy, _ = _build(a, x, b, y, opts["backend"], precision, multiscale=opts.get("multiscale"))
    sched = _loop.Schedule(eps=e, max_iter=POLISH_MAX_ITER, tol=POLISH_TOL)
    out = _loop.run(pxy, sched, init=(F_ba, G_ab))
    F_ba, G_ab = out.f, out.g
    if opts["debias"]:  # the self problems: symmetric updates keep f = g
        sym = _loop.Schedule(eps=e, max_iter=POLISH_MAX_ITER, tol=POLISH_TOL, update="symmetric")
        conv = []
        for side, F in (("x", F_aa), ("y", G_bb)):
            o = _loop.run(pxy.self_problem(side), sym, init=(F, F))
            conv.append(0.5 * (o.f + o.g))
        F_aa, G_bb = conv
    return F_ba, G_ab, F_aa, G_bb


def _loss_grads(needs, ga, gx, gb, gy, gout, layout=None):
    """Backward of the loss: the forward's gradient pieces times ``gout`` (B,), for the
    inputs ``(a, x, b, y)`` whose ``needs`` flag is set (None for the others); a ragged
    ``layout`` spreads each problem's ``gout`` over its points."""
    if layout is None:
        go_x = go_y = gout[:, None]
    else:
        sx, sy = layout[2], layout[3]
        go_x = torch.repeat_interleave(gout, torch.tensor(sx, device=gout.device))[None]
        go_y = torch.repeat_interleave(gout, torch.tensor(sy, device=gout.device))[None]
    pieces = (ga, gx, gb, gy)
    factors = (go_x, go_x[..., None], go_y, go_y[..., None])
    return [
        (p * go).to(gout.dtype) if needs[i] else None
        for i, (p, go) in enumerate(zip(pieces, factors))
    ]


def _warn(value, err, warn_tol, stacklevel):
    """The loss's warning: a marginal error above ``warn_tol`` (a non-finite value has
    raised in the forward)."""
    if warn_tol is not None and err is not None and float(err.max()) > warn_tol:
        warnings.warn(
            f"flashsinkhorn.SamplesLoss: the eps-scaling schedule ended with L1 marginal error "
            f"{float(err.max()):.3g} > warn_tol={warn_tol}; use a larger scaling (more "
            "iterations) or a larger blur",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


class _SinkhornLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, x, b, y, opts, info):
        need_x, need_y = ctx.needs_input_grad[1], ctx.needs_input_grad[3]
        if opts.get("comm") is not None:  # sharded: the final passes are the same on all ranks
            need_x, need_y = opts["comm"].any((need_x, need_y))
        with torch.no_grad():
            out = _sinkhorn_forward(
                a.detach(),
                x.detach(),
                b.detach(),
                y.detach(),
                need_grad_x=need_x,
                need_grad_y=need_y,
                **opts,
            )
        ctx.save_for_backward(out["ga"], out["gx"], out["gb"], out["gy"], x, y)
        # what a double backward needs: the final potentials (and the self ones)
        ctx.second = (
            a.detach(),
            b.detach(),
            out["f_ba"],
            out["g_ab"],
            out.get("f_aa"),
            out.get("g_bb"),
            out["eps"],
            out["rho"],
            out["family"],
            opts,
        )
        info["marginal_error"] = out["marginal_error"]
        return out["value"].to(x.dtype)

    @staticmethod
    def backward(ctx, gout):
        ga, gx, gb, gy, x, y = ctx.saved_tensors
        need = ctx.needs_input_grad[:4]  # a, x, b, y
        if torch.is_grad_enabled() and (need[1] or need[3]):  # create_graph=True
            gX, gY = _differentiable_grads(ctx, need, x, y, gx, gy)
            go = gout[:, None, None]
            return (
                None,
                gX * go if need[1] else None,
                None,
                gY * go if need[3] else None,
                None,
                None,
            )
        grads = _loss_grads(need, ga, gx, gb, gy, gout, ctx.second[-1].get("layout"))
        return (*grads, None, None)


def _differentiable_grads(ctx, need, x, y, gx, gy):
    """The loss's gradients in x, y attached to (x, y), with the streaming HVP of its OT
    terms as their derivative (flashsinkhorn._hessian): cost |x - y|^2 / 2 is the
    second-order plan at 2 eps with potentials 2 F, and its Hessian is half the plan's."""

    no_second_order_in_weights(need[0] or need[2], "SamplesLoss")
    a, b, F_ba, G_ab, F_aa, G_bb, e, rho, family, opts = ctx.second
    if opts.get("layout") is not None:
        raise RuntimeError(
            "SamplesLoss on a ragged batch: double backward (create_graph=True) is not "
            "implemented; call the loss per problem for second derivatives"
        )
    if opts.get("comm") is not None:
        raise RuntimeError(
            "SamplesLoss(process_group=...): double backward (create_graph=True) is not "
            "implemented for sharded problems"
        )
    if rho != (None, None):
        raise RuntimeError(
            "SamplesLoss: double backward (create_graph=True) is implemented for balanced "
            "problems (reach=None); for unbalanced OT use flashsinkhorn.second_order.ot_loss(x, y, "
            "eps=2 * blur**2, reach=reach), twice differentiable (its value is twice ours)"
        )
    prec = "ieee" if opts["precision"] == "ieee" else "tf32x3"
    with torch.no_grad():
        F_ba, G_ab, F_aa, G_bb = _converged_potentials(
            a, x.detach(), b, y.detach(), F_ba, G_ab, F_aa, G_bb, e, opts, prec
        )
    kw = dict(scale=0.5, eps=e, backend=family, precision=prec)
    terms = []
    for k in range(x.shape[0]):
        plan, ix, iy = plan_from_potentials(x[k], y[k], a[k], b[k], F_ba[k], G_ab[k], **kw)
        terms.append(HvpTerm("xy", k, plan, 0.5, ix, iy))
        if opts["debias"]:  # - OT(a, a) / 2 - OT(b, b) / 2
            for kind, z, w, F in (("xx", x, a, F_aa), ("yy", y, b, G_bb)):
                plan, iz, _ = plan_from_potentials(z[k], z[k], w[k], w[k], F[k], F[k], **kw)
                terms.append(HvpTerm(kind, k, plan, -0.25, iz, iz))
    zx = torch.zeros(x.shape, dtype=F_ba.dtype, device=x.device) if gx is None else gx
    zy = torch.zeros(y.shape, dtype=F_ba.dtype, device=y.device) if gy is None else gy
    return differentiable_grads(x, y, zx, zy, terms)


# ----------------------------------------------------------------------------------------
# torch.compile: the whole forward as one custom op (fake impl, registered autograd)
# ----------------------------------------------------------------------------------------
#
# The schedule's length depends on the data (the diameter) and the kernels are Triton
# launches: under torch.compile the forward is one opaque op and the backward (elementwise)
# is traced. Eager calls keep the autograd.Function above.


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.custom_op(
    "flashsinkhorn::sinkhorn_divergence",
    mutates_args=(),
    schema="(Tensor a, Tensor x, Tensor b, Tensor y, float blur, float? reach_x, float? reach_y, "
    "float? diameter, float scaling, bool debias, str precision, str backend, "
    "bool need_grad_x, bool need_grad_y, bool warn, float? warn_tol, bool verbose) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _divergence_op(
    a,
    x,
    b,
    y,
    blur,
    reach_x,
    reach_y,
    diameter,
    scaling,
    debias,
    precision,
    backend,
    need_grad_x,
    need_grad_y,
    warn,
    warn_tol,
    verbose,
):
    """:func:`sinkhorn_divergence`'s forward on batched inputs (a (B, N), x (B, N, D), ...).

    Returns ``(value (B,)`` in x's dtype, then in the compute dtype (float64 for float64
    x, else float32): ``ga (B, N), gx (B, N, D), gb (B, M), gy (B, M, D)`` (gx, gy empty
    when not needed), ``marginal_error (B,)`` and the potentials ``F (B, N), G (B, M)``
    (debiased when ``debias``). Runs the data-dependent input checks first and, with
    ``warn``, warns as the eager path does.
    """
    check_values(x, y, a, b)
    if reach_x is None and reach_y is None:
        check_masses(a, b, None, None, "reach")
    opts = dict(
        blur=blur,
        reach=(reach_x, reach_y),
        diameter=diameter,
        scaling=scaling,
        debias=debias,
        precision=precision,
        backend=backend,
        verbose=verbose,
    )
    with torch.no_grad():
        out = _sinkhorn_forward(
            a, x, b, y, need_grad_x=need_grad_x, need_grad_y=need_grad_y, **opts
        )
    value = out["value"].to(x.dtype)
    if warn:
        _warn(value, out["marginal_error"], warn_tol, stacklevel=2)
    F, G = out["f_ba"], out["g_ab"]
    if debias:
        F, G = F - out["f_aa"], G - out["g_bb"]
    cdt = _compute_dtype(x)
    empty = x.new_empty(0, dtype=cdt)
    gx = out["gx"].to(cdt) if need_grad_x else empty
    gy = out["gy"].to(cdt) if need_grad_y else empty.clone()
    # copies: outputs must not alias each other (balanced, no debias: ga is F)
    return (
        value,
        out["ga"].to(cdt),
        gx,
        out["gb"].to(cdt),
        gy,
        out["marginal_error"].to(cdt),
        F.to(cdt, copy=True),
        G.to(cdt, copy=True),
    )


@_divergence_op.register_fake
def _(
    a,
    x,
    b,
    y,
    blur,
    reach_x,
    reach_y,
    diameter,
    scaling,
    debias,
    precision,
    backend,
    need_grad_x,
    need_grad_y,
    warn,
    warn_tol,
    verbose,
):
    (B, N, D), M = x.shape, y.shape[1]
    cdt = _compute_dtype(x)
    return (
        x.new_empty(B),
        x.new_empty((B, N), dtype=cdt),
        x.new_empty((B, N, D) if need_grad_x else 0, dtype=cdt),
        x.new_empty((B, M), dtype=cdt),
        x.new_empty((B, M, D) if need_grad_y else 0, dtype=cdt),
        x.new_empty(B, dtype=cdt),
        x.new_empty((B, N), dtype=cdt),
        x.new_empty((B, M), dtype=cdt),
    )


def _divergence_setup(ctx, inputs, output):
    ctx.save_for_backward(*output[1:5])  # ga, gx, gb, gy


def _divergence_bwd(ctx, gout, *unused):
    grads = _loss_grads(ctx.needs_input_grad, *ctx.saved_tensors, gout)
    return (*grads,) + (None,) * 13  # the op's 13 non-tensor inputs


_divergence_op.register_autograd(_divergence_bwd, setup_context=_divergence_setup)


def _op_options(opts):
    """The forward's options as the custom op takes them (the reach pair as two floats)."""
    out = {k: v for k, v in opts.items() if k != "reach"}
    return dict(out, reach_x=opts["reach"][0], reach_y=opts["reach"][1])


def sinkhorn_divergence(
    a,
    x,
    b,
    y,
    *,
    blur=0.05,
    reach=None,
    diameter=None,
    scaling=0.5,
    debias=True,
    potentials=False,
    precision="tf32",
    backend="auto",
    warn_tol=None,
    info=None,
    verbose=False,
    process_group=None,
    cu_seqlens=None,
    truncate=5.0,
    cluster_scale=None,
    tol=None,
):
    """Functional form of :class:`SamplesLoss` (p=2). a (B, N) or None, x (B, N, D), ...

    ``info`` (a dict, optional) receives ``marginal_error``: the L1 marginal error (B,) of
    the last plan of the schedule, on device. ``warn_tol``: warn when it exceeds this.
    ``verbose``: print each eps stage with the marginal error of its plan.
    Ragged batches (``varlen``): x, y lists of clouds ``(N_k, D)``, ``(M_k, D)`` (a, b lists
    or None), or concatenated points with ``cu_seqlens=(cu_x, cu_y)``: one launch per pass
    for all problems, a (B,) value, gradients per point.
    ``process_group``: a ``torch.distributed`` group; a, x, b, y are then this rank's shards
    of the global clouds and the loss is the global one (:mod:`flashsinkhorn.distributed`).
    ``truncate``, ``cluster_scale``: GeomLoss's, for the multiscale backend (ignored by the
    exact ones); ``tol``: iterate at the final blur until the L1 marginal error is below
    tol (certified on the multiscale backend).
    """
    ms = check_multiscale_args(backend, truncate, cluster_scale, tol, process_group, cu_seqlens)
    if process_group is not None:  # sharded over the ranks of a torch.distributed group
        share = distributed.sharding(process_group)
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                "SamplesLoss(process_group=...) does not run under torch.compile"
            )
        if not distributed.alone(share):  # (a group of one rank: the loss below)
            args = dict(blur=blur, reach=reach, diameter=diameter, scaling=scaling)
            args.update(debias=debias, potentials=potentials, precision=precision)
            return _divergence_sharded(a, x, b, y, share, backend, warn_tol, info, **args)
    blur, reach, scaling, diameter = check_loss_args(blur, reach, scaling, diameter, precision)
    if cu_seqlens is not None or isinstance(x, (list, tuple)):
        kw = dict(blur=blur, reach=reach, diameter=diameter, scaling=scaling, debias=debias)
        kw.update(potentials=potentials, precision=precision, verbose=verbose)
        return _divergence_varlen(a, x, b, y, cu_seqlens, backend, warn_tol, info, **kw)
    # under torch.compile the data-dependent checks run inside the custom op
    compiling = torch.compiler.is_compiling()
    x3, y3, a2, b2, batched = prepare_inputs(x, y, a, b, check_data=not compiling)
    # clear errors for a bad backend or bf16 under the interpreter, before any work
    family = "auto" if backend in ("auto", "dense", "streaming", "multiscale") else backend
    check_precision(precision, resolve_backend(family, x3.device))
    if reach == (None, None) and not compiling:
        check_masses(a2, b2, None, None, "reach")  # GeomLoss would return a number: we say why not
    opts = dict(
        blur=blur,
        reach=reach,
        diameter=diameter,
        scaling=scaling,
        debias=bool(debias),
        precision=precision,
        backend=backend,
        verbose=bool(verbose),
    )
    if ms:  # the multiscale options (the compiled op does not take them)
        if compiling:
            raise NotImplementedError(
                "SamplesLoss(backend='multiscale', truncate=, cluster_scale=, tol=) does not run "
                "under torch.compile"
            )
        opts.update(ms)
    info = {} if info is None else info
    if compiling:
        grad = torch.is_grad_enabled() and not potentials
        need_x, need_y = grad and x3.requires_grad, grad and y3.requires_grad
        value, *_, err, F, G = _divergence_op(
            a2,
            x3,
            b2,
            y3,
            **_op_options(opts),
            need_grad_x=need_x,
            need_grad_y=need_y,
            warn=not potentials,
            warn_tol=warn_tol,
        )
        if not potentials:
            info["marginal_error"] = err
    elif potentials:
        with torch.no_grad():
            out = _sinkhorn_forward(a2, x3, b2, y3, need_grad_x=False, need_grad_y=False, **opts)
        F, G = out["f_ba"], out["g_ab"]
        info["marginal_error"] = out["marginal_error"]  # of OT(a, b)'s (F_ba, G_ab)
        if debias:
            F, G = F - out["f_aa"], G - out["g_bb"]
    else:
        value = _SinkhornLoss.apply(a2, x3, b2, y3, opts, info)
        _warn(value, info.get("marginal_error"), warn_tol, stacklevel=2)
    if potentials:
        # (B, N), (B, M); (1, N), (1, M) for 2-D inputs, as GeomLoss 0.3.1 returns them
        return F.to(x3.dtype), G.to(x3.dtype)
    err = info.get("marginal_error")
    if not batched and err is not None:
        info["marginal_error"] = err[0]
    return value if batched else value[0]


def _divergence_sharded(a, x, b, y, share, backend, warn_tol, info, **kw):
    """:func:`sinkhorn_divergence` over a process group: a, x, b, y are this rank's shards;
    the value (and marginal error) is global, the gradients go to this rank's points,
    ``potentials=True`` returns this rank's potentials."""
    group = share.group
    with distributed.collective_errors(group):
        blur, reach, scaling, diameter = check_loss_args(
            kw["blur"], kw["reach"], kw["scaling"], kw["diameter"], kw["precision"]
        )
        x3, y3, a2, b2, batched = prepare_inputs(x, y, a, b)
        distributed.check_device(group, x3)
    debias, potentials = bool(kw["debias"]), bool(kw["potentials"])
    agree = dict(blur=blur, reach=reach, diameter=diameter, scaling=scaling, debias=debias)
    agree.update(potentials=potentials, precision=kw["precision"], backend=backend)
    agree.update(batched=batched, weights=(a is None, b is None), exchange=share.exchange)
    agree.update(chunk_bytes=share.chunk_bytes)
    comm = distributed.Communicator.create(group, x3, y3, agree, share.exchange, share.chunk_bytes)
    a2, b2 = distributed.global_weights(comm, a2, b2, a, b)
    opts = dict(blur=blur, reach=reach, diameter=diameter, scaling=scaling, debias=debias)
    opts.update(precision=kw["precision"], backend=backend, comm=comm)
    info = {} if info is None else info
    if potentials:
        with torch.no_grad():
            out = _sinkhorn_forward(a2, x3, b2, y3, need_grad_x=False, need_grad_y=False, **opts)
        F, G = out["f_ba"], out["g_ab"]
        if debias:
            F, G = F - out["f_aa"], G - out["g_bb"]
        # (B, N), (B, M); (1, N), (1, M) for 2-D inputs, as GeomLoss 0.3.1 returns them
        return F.to(x3.dtype), G.to(x3.dtype)
    value = _SinkhornLoss.apply(a2, x3, b2, y3, opts, info)
    _warn(value, info.get("marginal_error"), warn_tol, stacklevel=3)
    if not batched and info.get("marginal_error") is not None:
        info["marginal_error"] = info["marginal_error"][0]
    return value if batched else value[0]


def _divergence_varlen(a, x, b, y, cu_seqlens, backend, warn_tol, info, **kw):
    """:func:`sinkhorn_divergence` of a ragged batch (flashsinkhorn.varlen): one schedule
    (the largest diameter), one launch per pass, values (B,), gradients per point."""
    if torch.compiler.is_compiling():
        raise NotImplementedError("a ragged SamplesLoss batch does not run under torch.compile")
    x3, y3, a2, b2, cu_x, cu_y, sx, sy = prepare_varlen(x, y, a, b, cu_seqlens)
    check_values(x3, y3, a2, b2)
    layout = (cu_x, cu_y, sx, sy)
    if kw["reach"] == (None, None):  # balanced: every problem's masses equal
        zeros = torch.zeros(len(sx), dtype=a2.dtype, device=a2.device)
        ma = zeros.index_add(0, segment_ids(sx, a2.device), a2[0])
        mb = zeros.index_add(0, segment_ids(sy, b2.device), b2[0])
        check_masses(ma[None], mb[None], None, None, "reach")
    opts = {k: v for k, v in kw.items() if k != "potentials"}
    opts.update(debias=bool(opts["debias"]), backend=backend, layout=layout)
    info = {} if info is None else info
    if kw["potentials"]:
        with torch.no_grad():
            out = _sinkhorn_forward(a2, x3, b2, y3, need_grad_x=False, need_grad_y=False, **opts)
        F, G = out["f_ba"], out["g_ab"]
        if opts["debias"]:
            F, G = F - out["f_aa"], G - out["g_bb"]
        return split(F.to(x3.dtype), sx), split(G.to(x3.dtype), sy)
    value = _SinkhornLoss.apply(a2, x3, b2, y3, opts, info)
    _warn(value, info.get("marginal_error"), warn_tol, stacklevel=3)
    return value


class SamplesLoss(torch.nn.Module):
    """Drop-in for ``geomloss.SamplesLoss`` with ``loss="sinkhorn", p=2``.

    Call as ``loss(x, y)`` or ``loss(a, x, b, y)`` with x (N, D) / (B, N, D) and weights
    (N,) / (B, N) (tensors, or numpy arrays and lists, converted). GeomLoss conventions:
    cost ``|x - y|^2 / 2``, ``eps = blur**2``, ``rho = reach**2`` (``reach`` a distance;
    None or inf: balanced). Balanced problems need ``a.sum() == b.sum()`` (GeomLoss does
    not check and returns a number; we raise). Twice differentiable in x, y when balanced
    (``create_graph=True``: the streaming HVP of flashsinkhorn.second_order).

    GeomLoss's arguments: ``backend`` "tensorized" and "online" (both exact in GeomLoss)
    run our exact kernels ("auto"); "multiscale" runs our multiscale problem
    (:mod:`flashsinkhorn.multiscale`: block-sparse passes over the tile pairs a bound cannot
    skip, annealing on grid cells of side down to ``cluster_scale``, kernel truncated at
    ``truncate`` standard deviations; ``"auto"`` picks it for large clouds of at most 3
    coordinates and a narrow kernel), and ``truncate`` / ``cluster_scale`` configure it
    (the exact backends ignore them, as GeomLoss's do). ``verbose=True`` prints each eps
    stage with the marginal error of its plan. Extra arguments: ``precision`` ("tf32",
    "ieee", "tf32x3", "bf16"), ``backend`` "dense" / "streaming" / "triton" / "torch",
    ``warn_tol``, and ``tol``: after the schedule, iterate at the final blur until the L1
    marginal error is below tol (certified on the multiscale backend, the estimate on the
    exact ones; at most 2000 iterations).

    Convergence is reported, not hidden: after each call ``self.last_marginal_error``
    holds the L1 marginal error (row + column) of the schedule's last plan (a tensor on
    the device, no sync); on the multiscale backend, the certified upper bound of the
    error of the returned potentials' plan (float64). GeomLoss's schedule runs a fixed
    number of iterations and does not drive this to zero (about 0.4-0.8 for 300-point
    clouds at blur 0.05, scaling 0.5; the loss value is still accurate thanks to the final
    extrapolation); set ``warn_tol`` to get a ``RuntimeWarning`` above a threshold (one
    host sync per call), or ``tol`` to iterate until it holds.
    """

    def __init__(
        self,
        loss: str = "sinkhorn",
        p: int = 2,
        blur: float = 0.05,
        reach: float | None = None,
        diameter: float | None = None,
        scaling: float = 0.5,
        truncate=5.0,
        cost=None,
        kernel=None,
        cluster_scale=None,
        debias: bool = True,
        potentials: bool = False,
        verbose: bool = False,
        backend: str = "auto",
        precision: str = "tf32",
        warn_tol: float | None = None,
        process_group=None,
        tol: float | None = None,
    ):
        super().__init__()
        self.warn_tol = warn_tol
        self.process_group = process_group
        self.last_marginal_error = None
        if loss != "sinkhorn":
            raise ValueError(
                f"flashsinkhorn.SamplesLoss supports loss='sinkhorn' only; got {loss!r}"
            )
        if p != 2:
            raise ValueError(f"flashsinkhorn.SamplesLoss supports p=2 only; got p={p}")
        if cost is not None or kernel is not None:
            raise ValueError("custom cost/kernel are not supported (p=2 squared Euclidean only)")
        # GeomLoss's multiscale arguments (ignored by the exact backends, as in GeomLoss)
        check_multiscale_args(backend, truncate, cluster_scale, tol, None, None)
        self.truncate, self.cluster_scale, self.tol = truncate, cluster_scale, tol
        if backend in ("tensorized", "online"):  # GeomLoss's exact backends: ours is exact
            backend = "auto"
        if backend not in ("auto", "dense", "streaming", "triton", "torch", "multiscale"):
            raise ValueError(
                "backend must be 'auto', 'dense', 'streaming', 'triton', 'torch', 'multiscale' "
                f"(or GeomLoss's 'tensorized' / 'online'); got {backend!r}"
            )
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
        self.blur, self.reach, self.diameter, self.scaling = blur, reach, diameter, scaling
        self.debias, self.potentials, self.backend, self.precision = (
            debias,
            potentials,
            backend,
            precision,
        )
        self.verbose = bool(verbose)

    def forward(self, *args, cu_seqlens=None):
        """``loss(x, y)`` or ``loss(a, x, b, y)``; lists of clouds, or concatenated points
        with ``cu_seqlens=(cu_x, cu_y)``: a ragged batch (values (B,))."""
        if len(args) == 2:
            x, y = args
            a = b = None
        elif len(args) == 4:
            a, x, b, y = args
        else:
            raise ValueError(f"call as loss(x, y) or loss(a, x, b, y); got {len(args)} arguments")
        info = {}
        out = sinkhorn_divergence(
            a,
            x,
            b,
            y,
            blur=self.blur,
            reach=self.reach,
            diameter=self.diameter,
            scaling=self.scaling,
            debias=self.debias,
            potentials=self.potentials,
            precision=self.precision,
            backend=self.backend,
            warn_tol=self.warn_tol,
            info=info,
            verbose=self.verbose,
            process_group=self.process_group,
            cu_seqlens=cu_seqlens,
            truncate=self.truncate,
            cluster_scale=self.cluster_scale,
            tol=self.tol,
        )
        self.last_marginal_error = info.get("marginal_error")
        return out
