"""``solve()``: streaming entropic OT between weighted point clouds, and its result object.

Conventions (the same as POT and OTT-JAX):

- cost ``C_ij``: ``cost="sqeuclidean"`` is ``C = |x - y|^2`` (no 1/2; SamplesLoss(p=2) uses
  ``|x - y|^2 / 2`` as GeomLoss does, by passing ``cost_scale=0.5``); ``"cosine"`` is
  ``1 - cos(x, y)``; ``"dot"`` is ``-<x, y>`` (any cost that is a dot product of feature
  maps: apply the feature maps to x and y yourself). Every cost is multiplied by
  ``cost_scale``. An optional label term ``label_cost=(lx, ly, W)`` adds ``W[lx_i, ly_j]``.
- plan ``P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)``; ``f`` (B, N), ``g`` (B, M).
- balanced problem: ``min_P <P, C> + eps KL(P | a x b)`` with marginals ``a``, ``b``;
  ``value = <a, f> + <b, g>`` (the dual value, equal to the primal at convergence).
- unbalanced (``reach=rho`` or ``(rho_x, rho_y)``, the KL marginal penalty, same units as
  the cost, POT's ``unbalanced``): the updates are damped by
  ``kappa = 1 / (1 + eps / rho)`` and ``value`` is the dual
  ``rho_x <a, 1 - e^{-f/rho_x}> + rho_y <b, 1 - e^{-g/rho_y}> - eps (<P, 1> - <a,1><b,1>)``.

Gradients of ``value`` with respect to x, y (through the cost, envelope theorem:
``dvalue/dx_i = sum_j P_ij d_x C(x_i, y_j)``) and the weights (``dvalue/da_i = f_i`` in
the balanced case) are computed by streaming kernels in the backward pass.
"""

from __future__ import annotations

from functools import partial

import torch

from flashsinkhorn import _loop, backends, distributed
from flashsinkhorn._inputs import (
    check_eps,
    check_label_range,
    check_masses,
    check_values,
    label_tuple,
    prepare_inputs,
)
from flashsinkhorn.operands import COSTS, cost_features
from flashsinkhorn.primitives import check_precision, problem_backend, resolve_backend
from flashsinkhorn.reference import parse_rho
from flashsinkhorn.result import SinkhornResult, certificate
from flashsinkhorn.value import OTValue, finite_value_or_raise, ot_value, ot_value_grads
from flashsinkhorn.varlen import VarlenProblem, prepare_varlen, segment_ids, split

__all__ = ["solve", "SinkhornResult"]


# ----------------------------------------------------------------------------------------
# torch.compile: the loop and the value as custom ops (fake impls, registered autograd)
# ----------------------------------------------------------------------------------------
#
# The loop has host syncs (convergence checks, eps-scaling diameter) and a data-dependent
# length, and the kernels are Triton launches: under torch.compile each piece below is one
# opaque op, so the compiled graph has no break. Eager calls do not go through them.
# A problem travels as its tensors ``X, Y, a, b`` (features and weights), ``Xk, Yk``
# (kernel operands), ``cx, cy``, optional labels ``lx, ly, W``, the optional centre of the
# dot products (a polish rebuilds the kernel operands from X, Y and it), then its scalars.

# The ops' leading arguments: one problem, as in _op_problem_args (the op rebuilds it with
# flashsinkhorn.backends.build from its backend_arg: the same implementation)
_PROBLEM = (
    "Tensor X, Tensor Y, Tensor a, Tensor b, Tensor cx, Tensor cy, Tensor? lx, Tensor? ly, "
    "Tensor? W, Tensor? center, float label_scale, float c2, str cost, str precision, "
    "str backend"
)
_NP = 15  # how many


def _op_problem_args(prob, X=None, Y=None, a=None, b=None):
    """A Problem as the ops' leading arguments; ``X, Y, a, b`` replace the problem's
    (detached) ones where given (the value op takes them with their graph)."""
    lx, ly, W, label_scale = prob.labels if prob.labels is not None else (None,) * 3 + (1.0,)
    X, Y = prob.X if X is None else X, prob.Y if Y is None else Y
    a, b = prob.a if a is None else a, prob.b if b is None else b
    return (
        *(X, Y, a, b, prob.cx, prob.cy, lx, ly, W, prob.center),
        *(label_scale, prob.c2, prob.cost, prob.precision, prob.backend_arg),
    )


def _op_problem(args, cost_scale=1.0):
    """The Problem of the ops' leading arguments (inverse of :func:`_op_problem_args`)."""
    X, Y, a, b, cx, cy, lx, ly, W, center, label_scale, c2, cost, precision, backend = args
    labels = None if W is None else (lx, ly, W, label_scale)
    fields = dict(X=X, Y=Y, a=a, b=b, cx=cx, cy=cy, c2=c2, cost=cost, cost_scale=cost_scale)
    return backends.build(backend, labels=labels, precision=precision, center=center, **fields)[0]


def _potential_dtype(X, backend_arg):
    """The potentials' dtype of a problem rebuilt from ``backend_arg`` (the fake impls)."""
    f64 = X.dtype == torch.float64 and backend_arg in ("dense", "torch")
    return torch.float64 if f64 else torch.float32


@torch.library.custom_op(
    "flashsinkhorn::sinkhorn_potentials",
    mutates_args=(),
    schema=f"({_PROBLEM}, Tensor x_in, Tensor y_in, float cost_scale, float eps, float? rx, "
    "float? ry, int max_iter, float? tol, str schedule, int check_every, float? eps_scaling, "
    "float? diameter, bool warn, bool verbose) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _potentials_op(*args):
    """solve's loop: ``(f (B, N), g (B, M), marginal_error (B,), n_iter (), converged (),
    polished ())``; ``polished``: the loop switched to the polish precision, which the value
    op then takes too (as the eager solve's value does).

    First runs the data-dependent input checks that the compiled graph skips."""
    x_in, y_in, cost_scale, eps, rx, ry, max_iter, tol, schedule, check_every = args[_NP : _NP + 10]
    eps_scaling, diameter, warn, verbose = args[_NP + 10 :]
    prob = _op_problem(args[:_NP], cost_scale)
    check_values(x_in, y_in, prob.a, prob.b)
    check_masses(prob.a, prob.b, rx, ry)
    if prob.labels is not None:
        lx, ly, W, _ = prob.labels
        check_label_range("labels_x", lx, W, W.shape[0])
        check_label_range("labels_y", ly, W, W.shape[1])
    sched = _schedule(
        prob, eps, rx, ry, max_iter, tol, schedule, check_every, eps_scaling, diameter
    )
    certify = prob.float64_certifier(eps, rx, ry) or certifier(
        float64_problem(x_in, y_in, prob), prob, eps, rx, ry
    )
    out = _run_and_certify(prob, certify, sched, verbose)
    _loop.report(out, tol, eps, warn)
    dev = prob.X.device
    n_iter = torch.tensor(out.n_iter, dtype=torch.int64, device=dev)
    polished = torch.tensor(out.prob.precision != prob.precision, device=dev)
    return out.f, out.g, out.err, n_iter, torch.tensor(out.converged, device=dev), polished


@_potentials_op.register_fake
def _(*args):
    X, cx, cy, backend = args[0], args[4], args[5], args[_NP - 1]
    dt = _potential_dtype(X, backend)
    return (
        cx.new_empty(cx.shape, dtype=dt),
        cy.new_empty(cy.shape, dtype=dt),
        cx.new_empty(cx.shape[:1], dtype=torch.float64),
        cx.new_empty((), dtype=torch.int64),
        cx.new_empty((), dtype=torch.bool),
        cx.new_empty((), dtype=torch.bool),
    )


def float64_problem(x3, y3, prob, features=cost_features, make=None, a64=None, b64=None):
    """A thunk building ``prob`` again in float64 from the points ``x3, y3`` (B, N, D)
    (the features recomputed in float64: cosine normalizes in float64), dense while it fits
    ``backend="auto"``'s rule, else on the blockwise torch path: the certificate's problem.
    ``features`` / ``make``: the sharded (or ragged) problem's.
    ``a64``, ``b64``: the weights in float64 when they are not ``prob``'s (the default
    uniform weights are exactly 1/N, not their float32 rounding)."""

    def build():
        d = torch.float64
        X, Y, cx, cy, c2, c = features(
            x3.detach().to(d), y3.detach().to(d), prob.cost, prob.cost_scale
        )
        lab = None
        if prob.labels is not None:
            lx, ly, W, s = prob.labels
            lab = (lx, ly, W.to(d), s)
        a = prob.a.to(d) if a64 is None else a64
        b = prob.b.to(d) if b64 is None else b64
        fields = dict(X=X, Y=Y, a=a, b=b, cx=cx, cy=cy, c2=c2, cost=prob.cost)
        fields.update(cost_scale=prob.cost_scale, labels=lab, precision="ieee", center=c)
        if make is None:  # dense while it fits (exp2 passes), else the torch stream
            return backends.build("auto", **fields)[0]
        return make(backend="torch", **fields)

    return build


def certifier(build64, prob, eps, rx, ry):
    """``certify(f, g) -> (err, rows, cols)``: the float64 :func:`certificate` of the
    potentials in the dtype they are returned in (the float64 problem built once, lazily)."""
    dt = prob.potential_dtype
    cache = {}

    def certify(f, g):
        if "p" not in cache:
            cache["p"] = build64()
        return certificate(cache["p"], f.to(dt), g.to(dt), eps, rx, ry)

    return certify


def _schedule(
    prob, eps, rx, ry, max_iter, tol, schedule, check_every, eps_scaling, diameter, host_reads=True
):
    """solve's :class:`flashsinkhorn._loop.Schedule` (the annealing stages measure the
    diameter when none is given; ``host_reads=False``: the device-only loop)."""
    return _loop.Schedule(
        eps=eps,
        stages=_loop.annealing(prob, eps, eps_scaling, diameter),
        rho_x=rx,
        rho_y=ry,
        max_iter=max_iter,
        update=schedule,
        tol=tol,
        check_every=check_every,
        host_reads=host_reads,
    )


def _run_and_certify(prob, certify, sched, verbose):
    """The loop (no graph) and the float64 certificate of its potentials (what
    ``marginal_error`` and ``converged`` report), potentials in the returned dtype."""
    dt = prob.potential_dtype
    with torch.no_grad():
        out = _loop.run(prob, sched, certify, verbose=verbose)
    out.f, out.g = out.f.to(dt), out.g.to(dt)
    return out


_VALUE = "Tensor f, Tensor g, Tensor polished, float eps, float? rx, float? ry"  # after it


def _value_problem(args, polished):
    """The problem of the value ops: the loop's, at the polish precision if it switched."""
    prob = _op_problem(args)
    return prob.with_precision(_loop.POLISH_PRECISION) if bool(polished) else prob


@torch.library.custom_op(
    "flashsinkhorn::ot_value", mutates_args=(), schema=f"({_PROBLEM}, {_VALUE}) -> Tensor"
)
def _ot_value_op(*args):
    """solve's differentiable value (B,) (:class:`OTValue` as a custom op); ``X, Y, a, b``
    are the differentiable inputs."""
    f, g, polished, eps, rx, ry = args[_NP:]
    prob = _value_problem(args[:_NP], polished)
    with torch.no_grad():
        value = ot_value(prob, prob.a, prob.b, f, g, eps, rx, ry)
    return value.to(torch.promote_types(prob.a.dtype, f.dtype))


@_ot_value_op.register_fake
def _(*args):
    a, f = args[2], args[_NP]
    return f.new_empty(f.shape[:1], dtype=torch.promote_types(a.dtype, f.dtype))


@torch.library.custom_op(
    "flashsinkhorn::ot_value_backward",
    mutates_args=(),
    schema=f"(Tensor gout, {_PROBLEM}, {_VALUE}, bool need_x, bool need_y, bool need_a, "
    "bool need_b) -> (Tensor, Tensor, Tensor, Tensor)",
)
def _ot_value_backward_op(gout, *args):
    """``gout``-weighted ``(gX, gY, ga, gb)`` of :func:`_ot_value_op` (an empty tensor
    where not needed)."""
    (f, g, polished, eps, rx, ry), need = args[_NP:-4], args[-4:]
    prob = _value_problem(args[:_NP], polished)
    with torch.no_grad():
        grads = ot_value_grads(prob, f, g, eps, rx, ry, gout, need)
    return tuple(gr.to(t.dtype) if n else t.new_empty(0) for gr, t, n in zip(grads, args[:4], need))


@_ot_value_backward_op.register_fake
def _(gout, *args):
    return tuple(t.new_empty(t.shape if n else 0) for t, n in zip(args[:4], args[-4:]))


def _ot_value_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:10], *inputs[_NP : _NP + 3])  # X .. center, f, g, polished
    ctx.scalars = inputs[10:_NP], inputs[_NP + 3 :]  # label_scale .. backend; eps, rx, ry


def _ot_value_bwd(ctx, gout):
    *tensors, f, g, polished = ctx.saved_tensors
    problem_scalars, value_scalars = ctx.scalars
    need = tuple(ctx.needs_input_grad[:4])
    grads = _ot_value_backward_op(
        gout, *tensors, *problem_scalars, f, g, polished, *value_scalars, *need
    )
    return (*(gr if n else None for gr, n in zip(grads, need)),) + (None,) * (_NP + 2)


_ot_value_op.register_autograd(_ot_value_bwd, setup_context=_ot_value_setup)


def _solve_compiled(prob, x3, y3, X, Y, a, b, loop, eps_scaling, diameter, warn, verbose):
    """solve's loop and value through the custom ops (``X, Y, a, b`` carry the graph).
    Returns ``(f, g, err, n_iter, converged, value)`` (n_iter, converged: 0-dim tensors)."""
    eps, rx, ry, max_iter, tol, schedule, check_every = loop
    f, g, err, n_iter, converged, polished = _potentials_op(
        *_op_problem_args(prob),
        *(x3.detach(), y3.detach(), prob.cost_scale, eps, rx, ry, max_iter, tol, schedule),
        *(check_every, eps_scaling, diameter, warn, verbose),
    )
    value = _ot_value_op(*_op_problem_args(prob, X, Y, a, b), f, g, polished, eps, rx, ry)
    return f, g, err, n_iter, converged, value


def solve(
    x,
    y,
    a=None,
    b=None,
    *,
    eps: float,
    rho=None,
    cost: str = "sqeuclidean",
    cost_scale: float = 1.0,
    max_iter: int = 1000,
    tol: float | None = 1e-5,
    schedule: str = "alternating",
    eps_scaling: float | None = None,
    diameter: float | None = None,
    check_every: int = 10,
    label_cost: tuple | None = None,
    precision: str = "tf32",
    backend: str = "auto",
    warn: bool = True,
    verbose: bool = False,
    reach=None,
    process_group=None,
    cu_seqlens=None,
) -> SinkhornResult:
    """Entropic OT between weighted point clouds by streaming Sinkhorn.

    Args:
        x: (N, D) or (B, N, D) source points. y: (M, D) or (B, M, D) target points.
            Tensors, or numpy arrays / array-likes (converted with ``torch.as_tensor``:
            a float64 numpy array runs in float64 on the CPU; the result holds tensors).
        a: (N,) / (B, N) nonnegative source weights (default uniform 1/N); b likewise.
            Balanced problems need ``a.sum() == b.sum()``.
        eps: entropic temperature (> 0), in cost units.
        rho: None (balanced), a number or ``(rho_x, rho_y)``: KL marginal penalties in
            cost units (POT's ``unbalanced``); a side with None (or inf) stays balanced.
            GeomLoss's ``reach`` r (a distance) is ``rho = 2 * cost_scale * r**2``.
        cost: "sqeuclidean" (``|x - y|^2``), "cosine" (``1 - cos``), "dot" (``-<x, y>``);
            the cost is multiplied by ``cost_scale`` (0.5 gives GeomLoss's p = 2 cost).
        max_iter: iterations at the final eps. tol: stop when the L1 marginal error
            ``|P 1 - a|_1 + |P^T 1 - b|_1`` of the potentials, measured in float64, falls
            below tol (an on-device estimate every ``check_every`` iterations decides when
            to measure). None: run max_iter iterations.
        schedule: "alternating" (f then g) or "symmetric" (GeomLoss's averaged updates).
        eps_scaling: None, or a ratio in (0, 1): anneal eps from ``diameter^2`` with
            GeomLoss's schedule (one symmetric iteration per stage) before iterating.
        label_cost: optional ``(labels_x (N,), labels_y (M,), W (K1, K2))``: adds
            ``W[labels_x[i], labels_y[j]]`` to the cost, gathered inside the kernel.
        precision: "tf32" (default), "ieee", "tf32x3", "bf16" dot operands (triton
            backend; "bf16" is refused under TRITON_INTERPRET=1). With ``tol``, a tf32 or
            bf16 loop whose float64 error stays above tol finishes in "tf32x3".
        backend: "auto" (dense while the cost matrix fits, else the streaming kernels:
            triton on CUDA for float32/16 inputs, torch blockwise on CPU and for float64;
            the multiscale problem for large clouds of at most 3 coordinates and a narrow
            kernel, :mod:`flashsinkhorn.backends`), "dense", "streaming", "triton",
            "torch", "multiscale" (block-sparse passes, its own certificate;
            docs/flashsinkhorn.md "Multiscale").
        verbose: print the eps-scaling stages and, every ``check_every`` iterations, the
            iteration, eps and marginal error (one host sync each).
        reach: not an argument of solve (``rho`` is): raises a TypeError that says so.
        process_group: a ``torch.distributed`` group (NCCL for CUDA tensors, gloo for CPU):
            x, y, a, b are this rank's shards of the global clouds (concatenated in rank
            order); the result is the global coupling (:mod:`flashsinkhorn.distributed`).
            None (default): one process.
        cu_seqlens: a ragged batch (:mod:`flashsinkhorn.varlen`): x (sum N_k, D), y (sum
            M_k, D) concatenated, ``cu_seqlens=(cu_x, cu_y)`` their (B + 1,) offsets; or x,
            y (and a, b) lists of clouds. One launch per pass for all problems; the
            result's potentials, marginals and barycentric map are lists, value and
            marginal_error (B,).

    Returns:
        :class:`SinkhornResult` (``value``, ``potentials``, ``plan``, ``lazy_plan``,
        ``marginals``, ``marginal_error``, ``converged``, ``n_iter``; ``apply``,
        ``apply_transpose``, ``barycentric_map``). A non-converged run is reported
        (``converged=False``) and warned about when ``warn`` is true. ``value`` is
        differentiable in x, y, a, b, and twice in x, y (sqeuclidean, cosine). Under
        torch.compile the loop and the value run as custom ops (no graph break) and
        ``n_iter``, ``converged`` are 0-dim tensors. Under CUDA-graph capture
        (``torch.cuda.graph``) nothing reads the device: the stopping test freezes the
        potentials on the device, the data-dependent input checks and the warning are
        skipped, ``n_iter`` and ``converged`` are 0-dim tensors (the package README's
        "CUDA graphs").
    """
    if reach is not None:
        raise TypeError(
            "solve() takes rho= (the KL penalty in cost units; reach= meant that before "
            "flashsinkhorn 0.2); reach is GeomLoss's distance, rho = 2 * cost_scale * reach**2"
        )
    # recorded into a CUDA graph: no host read from here to the result (the device-only loop)
    first = x[0] if isinstance(x, (list, tuple)) and len(x) else x
    capture = isinstance(first, torch.Tensor) and _loop.capturing(first.device)
    if capture:
        _check_capturable(process_group, cu_seqlens, x, verbose, eps_scaling, diameter)
    ragged = cu_seqlens is not None or isinstance(x, (list, tuple))
    if backend == "multiscale" and (process_group is not None or ragged):
        raise NotImplementedError(
            "backend='multiscale' solves on one process and one (B, N, D) batch: not with "
            "process_group= or a ragged batch (cu_seqlens= or lists of clouds); use "
            "backend='auto' there"
        )
    if process_group is not None:  # sharded over the ranks of a torch.distributed group
        share = distributed.sharding(process_group)
        if torch.compiler.is_compiling():
            raise NotImplementedError("solve(process_group=...) does not run under torch.compile")
        if not distributed.alone(share):  # (a group of one rank: the solve below)
            args = dict(eps=eps, rho=rho, cost=cost, cost_scale=cost_scale, max_iter=max_iter)
            args.update(tol=tol, schedule=schedule, eps_scaling=eps_scaling, diameter=diameter)
            args.update(check_every=check_every, label_cost=label_cost, precision=precision)
            return _solve_sharded(x, y, a, b, share, backend, warn, verbose, **args)
    eps, rx, ry, max_iter, check_every, tol = _check_args(
        eps, rho, cost, schedule, max_iter, check_every, tol, eps_scaling, diameter
    )
    backends.check_backend(backend)
    if ragged:
        args = dict(eps=eps, rx=rx, ry=ry, max_iter=max_iter, check_every=check_every, tol=tol)
        args.update(schedule=schedule, eps_scaling=eps_scaling, diameter=diameter, cost=cost)
        args.update(cost_scale=cost_scale, precision=precision, label_cost=label_cost)
        return _solve_varlen(x, y, a, b, cu_seqlens, backend, warn, verbose, **args)
    # under torch.compile the data-dependent checks run inside the custom op (_solve_compiled);
    # under CUDA-graph capture they cannot run (host reads): the eager warm-up call runs them
    compiling = torch.compiler.is_compiling()
    check_data = not (compiling or capture)
    x3, y3, a2, b2, batched = prepare_inputs(x, y, a, b, check_data=check_data)
    if check_data:
        check_masses(a2, b2, rx, ry)
        if cost == "cosine":
            _check_nonzero_rows(x3, y3)
    X, Y, cx, cy, c2, center = cost_features(x3, y3, cost, cost_scale)
    B, N, M = X.shape[0], X.shape[1], Y.shape[1]
    labels = label_tuple(label_cost, B, N, M, X.device, check_range=check_data)
    fields = dict(X=X.detach(), Y=Y.detach(), a=a2.detach(), b=b2.detach(), cx=cx.detach())
    fields.update(cy=cy.detach(), c2=c2, cost=cost, cost_scale=cost_scale, labels=labels)
    prob, why = backends.build(backend, eps=eps, precision=precision, center=center, **fields)
    check_precision(precision, resolve_backend(prob.kernel_family, x3.device))
    _loop.say(verbose, f"backend {prob.kind} ({why})")
    loop = (eps, rx, ry, max_iter, tol, schedule, check_every)
    exact = [_uniform64(t) if w is None else None for w, t in ((a, x3), (b, y3))]
    build64 = float64_problem(x3, y3, prob, a64=exact[0], b64=exact[1])
    # the backend's own float64 certificate where the dense measurement would cost O(n m)
    certify = prob.float64_certifier(eps, rx, ry, a64=exact[0], b64=exact[1]) or certifier(
        build64, prob, eps, rx, ry
    )
    marginals = None
    if compiling:
        f, g, err, n_iter, converged, value = _solve_compiled(
            prob, x3, y3, X, Y, a2, b2, loop, eps_scaling, diameter, warn, verbose
        )
    else:
        sched = _schedule(prob, *loop, eps_scaling, diameter, host_reads=not capture)
        out = _run_and_certify(prob, certify, sched, verbose)
        _loop.report(out, tol, eps, warn)
        f, g, err, n_iter, converged = out.f, out.g, out.err, out.n_iter, out.converged
        marginals = out.marginals
        prob = out.prob  # the problem of the last iterations (tf32x3 after a polish)
        # the differentiable value: graph to x, y (through the features) and a, b
        value = OTValue.apply(X, Y, a2, b2, f, g, prob, eps, rx, ry)
        if not capture:  # (captured: a non-finite value is returned as is)
            finite_value_or_raise(prob, value, eps)
    return SinkhornResult(
        f=f if batched else f[0],
        g=g if batched else g[0],
        value=value if batched else value[0],
        marginal_error=err if batched else err[0],
        n_iter=n_iter,
        converged=converged,
        eps=eps,
        precision=prob.precision,
        backend=prob.kind,
        _prob=prob,
        _batched=batched,
        _f=f,
        _g=g,
        _marginals=marginals,
        _certify=certify,
    )


def _uniform64(t, n=None):
    """The default weights 1/n of the clouds ``t`` (B, N, D) in float64 (exactly 1/n, not
    their float32 rounding: the certificate measures against them); ``n`` the global size
    of a sharded cloud (default N)."""
    n = t.shape[1] if n is None else n
    return torch.full(t.shape[:2], 1.0 / n, dtype=torch.float64, device=t.device)


def _check_capturable(process_group, cu_seqlens, x, verbose, eps_scaling, diameter):
    """The arguments of a solve recorded into a CUDA graph: what would read the device
    (the sharded and ragged solves, ``verbose``, a measured diameter) is refused."""
    if process_group is not None or cu_seqlens is not None or isinstance(x, (list, tuple)):
        raise NotImplementedError(
            "solve under CUDA-graph capture runs (B, N, D) tensors on one device: no "
            "process_group, cu_seqlens or lists of clouds"
        )
    if verbose:
        raise ValueError(
            "verbose=True prints values read from the device: not under CUDA-graph capture"
        )
    if eps_scaling is not None and diameter is None:
        raise ValueError(
            "diameter must be given with eps_scaling under CUDA-graph capture (measuring it "
            "reads the device)"
        )


def _check_args(eps, rho, cost, schedule, max_iter, check_every, tol, eps_scaling, diameter):
    """solve's scalar arguments, checked: ``(eps, rho_x, rho_y, max_iter, check_every, tol)``
    or a ValueError naming the argument (also used by the sharded solve)."""
    eps = check_eps(eps)
    rx, ry = parse_rho(rho)
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {COSTS}; got {cost!r}")
    if schedule not in ("alternating", "symmetric"):
        raise ValueError(f"schedule must be 'alternating' or 'symmetric'; got {schedule!r}")
    max_iter = _positive_int(max_iter, "max_iter")
    check_every = _positive_int(check_every, "check_every")
    tol = _check_tol(tol)
    if eps_scaling is not None and not _in_open_interval(eps_scaling, 0.0, 1.0):
        raise ValueError(f"eps_scaling must be None or lie in (0, 1); got {eps_scaling!r}")
    if diameter is not None and not _in_open_interval(diameter, 0.0, float("inf")):
        raise ValueError(f"diameter must be None or a finite positive number; got {diameter!r}")
    return eps, rx, ry, max_iter, check_every, tol


def _in_open_interval(v, lo, hi):
    try:
        return lo < float(v) < hi
    except (TypeError, ValueError):
        return False


def _positive_int(v, name):
    try:
        ok = not isinstance(v, bool) and float(v).is_integer() and int(v) >= 1
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a positive integer; got {v!r}")
    return int(v)


def _check_tol(tol):
    try:
        ok = tol is None or float(tol) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"tol must be None or a nonnegative number; got {tol!r}")
    return None if tol is None else float(tol)


def _check_nonzero_rows(x, y):
    for name, t in (("x", x), ("y", y)):
        if bool((t.abs().amax(-1) == 0).any()):
            raise ValueError(f"cost='cosine' needs nonzero points; {name} has a zero row")


# ----------------------------------------------------------------------------------------
# sharded over a process group (flashsinkhorn.distributed: the problem's passes exchange
# the other ranks' columns; everything else is the single-process code)
# ----------------------------------------------------------------------------------------


def _solve_sharded(x, y, a, b, share, backend, warn, verbose, **kw):
    """:func:`solve` with x, y, a, b this rank's shards of the global clouds."""
    group = share.group
    eps, rho, cost, cost_scale = kw["eps"], kw["rho"], kw["cost"], kw["cost_scale"]
    with distributed.collective_errors(group):
        eps, rx, ry, max_iter, check_every, tol = _check_args(
            eps,
            rho,
            cost,
            kw["schedule"],
            kw["max_iter"],
            kw["check_every"],
            kw["tol"],
            kw["eps_scaling"],
            kw["diameter"],
        )
        if kw["label_cost"] is not None:
            raise ValueError("label_cost is not supported with process_group")
        x3, y3, a2, b2, batched = prepare_inputs(x, y, a, b)
        distributed.check_device(group, x3)
        backends.check_backend(backend)
    agree = dict(kw, eps=eps, rho=(rx, ry), max_iter=max_iter, tol=tol, check_every=check_every)
    agree.update(backend=backend, verbose=bool(verbose), batched=batched)
    agree.update(weights=(a is None, b is None), exchange=share.exchange)
    agree.update(chunk_bytes=share.chunk_bytes, label_cost=None)
    agree["requires_grad"] = tuple(t.requires_grad for t in (x3, y3, a2, b2))
    comm = distributed.Communicator.create(group, x3, y3, agree, share.exchange, share.chunk_bytes)
    a2, b2 = distributed.global_weights(comm, a2, b2, a, b)
    if rx is None and ry is None:
        ma, mb = comm.total(a2), comm.total(b2)
        if bool(((ma - mb).abs() > 1e-5 * torch.maximum(ma, mb)).any()):
            raise ValueError(
                "balanced OT needs a.sum() == b.sum() over all ranks; got "
                f"{ma.tolist()[:4]} and {mb.tolist()[:4]}: normalize the weights "
                "or pass rho= for unbalanced OT"
            )
    # the streaming kernels' family: "auto" stays "auto" (the sm_90 kernel per pass)
    family = "auto" if backend in ("auto", "dense", "streaming") else backend
    be = problem_backend(family, x3.device, x3.dtype)
    precision = kw["precision"]
    check_precision(precision, resolve_backend(family, x3.device))
    X, Y, cx, cy, c2, center = distributed.features(comm, x3, y3, cost, cost_scale)
    prob = distributed.sharded_problem(
        comm, X, Y, a2, b2, cx, cy, c2, cost, cost_scale, precision, be, center
    )
    diameter = kw["diameter"]
    if kw["eps_scaling"] is not None and diameter is None:
        diameter = comm.diameter(prob.X, prob.Y)
    # the float64 certificate on the sharded problem rebuilt in float64 (global sums)
    exact = [
        None if w is not None else _uniform64(t, sum(comm.sizes[k]))
        for w, t, k in ((a, x3, "x"), (b, y3, "y"))
    ]
    build64 = float64_problem(
        x3,
        y3,
        prob,
        features=lambda *t: distributed.features(comm, *t),
        make=comm.problem,
        a64=exact[0],
        b64=exact[1],
    )
    certify = certifier(build64, prob, eps, rx, ry)
    # every rank measures (collectives), rank 0 prints
    say = (lambda line: print(line, flush=True) if comm.rank == 0 else None) if verbose else False
    loop = (eps, rx, ry, max_iter, tol, kw["schedule"], check_every)
    sched = _schedule(prob, *loop, kw["eps_scaling"], diameter)
    out = _run_and_certify(prob, certify, sched, say)
    _loop.report(out, tol, eps, warn)
    prob = out.prob  # the problem of the last iterations (tf32x3 after a polish)
    f, g, err = out.f, out.g, out.err
    value = OTValue.apply(X, Y, a2, b2, f, g, prob, eps, rx, ry)
    finite_value_or_raise(prob, value, eps)
    return SinkhornResult(
        f=f if batched else f[0],
        g=g if batched else g[0],
        value=value if batched else value[0],
        marginal_error=err if batched else err[0],
        n_iter=out.n_iter,
        converged=out.converged,
        eps=eps,
        precision=prob.precision,
        backend=prob.kind,
        _prob=prob,
        _batched=batched,
        _f=f,
        _g=g,
        _marginals=out.marginals,
        _certify=certify,
    )


# ----------------------------------------------------------------------------------------
# a ragged batch (flashsinkhorn.varlen: one launch per pass over every problem)
# ----------------------------------------------------------------------------------------


def _solve_varlen(x, y, a, b, cu_seqlens, backend, warn, verbose, **kw):
    """:func:`solve` of a ragged batch: lists of clouds or concatenated points."""
    if torch.compiler.is_compiling():
        raise NotImplementedError("a ragged solve does not run under torch.compile")
    if kw["label_cost"] is not None:
        raise ValueError("label_cost is not supported for ragged batches")
    eps, rx, ry = kw["eps"], kw["rx"], kw["ry"]
    x3, y3, a2, b2, cu_x, cu_y, sx, sy = prepare_varlen(x, y, a, b, cu_seqlens)
    check_values(x3, y3, a2, b2)
    if rx is None and ry is None:
        ma = torch.zeros(len(sx), dtype=a2.dtype, device=a2.device)
        ma = ma.index_add(0, segment_ids(sx, a2.device), a2[0])
        mb = torch.zeros_like(ma).index_add(0, segment_ids(sy, b2.device), b2[0])
        check_masses(ma[None], mb[None], rx, ry)
    X, Y, cx, cy, c2, center = cost_features(x3, y3, kw["cost"], kw["cost_scale"])
    family = "auto" if backend in ("auto", "dense", "streaming") else backend
    check_precision(kw["precision"], resolve_backend(family, x3.device))
    make = partial(VarlenProblem, cu_x=cu_x, cu_y=cu_y, sizes_x=sx, sizes_y=sy)
    prob = make(
        X=X.detach(),
        Y=Y.detach(),
        a=a2.detach(),
        b=b2.detach(),
        cx=cx.detach(),
        cy=cy.detach(),
        c2=c2,
        cost=kw["cost"],
        cost_scale=kw["cost_scale"],
        precision=kw["precision"],
        backend=family,
        center=center,
    )
    _loop.say(verbose, f"backend varlen ({len(sx)} ragged problems)")
    uniform = [
        torch.cat([torch.full((n,), 1.0 / n, dtype=torch.float64) for n in sizes])[None].to(
            x3.device
        )
        for sizes in (sx, sy)
    ]
    a64 = uniform[0] if a is None else None
    b64 = uniform[1] if b is None else None
    certify = certifier(
        float64_problem(x3, y3, prob, make=make, a64=a64, b64=b64), prob, eps, rx, ry
    )
    loop = (eps, rx, ry, kw["max_iter"], kw["tol"], kw["schedule"], kw["check_every"])
    sched = _schedule(prob, *loop, kw["eps_scaling"], kw["diameter"])
    out = _run_and_certify(prob, certify, sched, verbose)
    _loop.report(out, kw["tol"], eps, warn)
    prob = out.prob
    value = OTValue.apply(X, Y, a2, b2, out.f, out.g, prob, eps, rx, ry)
    finite_value_or_raise(prob, value, eps)
    return SinkhornResult(
        f=split(out.f, sx),
        g=split(out.g, sy),
        value=value,
        marginal_error=out.err,
        n_iter=out.n_iter,
        converged=out.converged,
        eps=eps,
        precision=prob.precision,
        backend=prob.kind,
        _prob=prob,
        _batched=True,
        _f=out.f,
        _g=out.g,
        _marginals=out.marginals,
        _certify=certify,
        _sizes=(sx, sy),
    )
