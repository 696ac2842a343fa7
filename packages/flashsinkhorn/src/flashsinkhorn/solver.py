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

import math
import warnings
from dataclasses import dataclass, field

import torch

from flashsinkhorn._inputs import (
    check_eps,
    check_label_range,
    check_masses,
    check_values,
    label_tuple,
    prepare_inputs,
)
from flashsinkhorn.operands import COSTS, cost_features, kernel_operands
from flashsinkhorn.primitives import PRECISIONS, resolve_backend, self_softmin, softmin
from flashsinkhorn.reference import (
    LN2,
    damping_factor,
    dual_point_terms,
    eps_schedule,
    parse_reach,
)

__all__ = ["solve", "SinkhornResult", "Problem"]


# ----------------------------------------------------------------------------------------
# the problem: features, additive cost terms, weights
# ----------------------------------------------------------------------------------------


@dataclass
class Problem:
    """A batched OT problem in the kernel's form ``C = cx_i + cy_j - c2 <X_i, Y_j> (+ W)``."""

    X: torch.Tensor  # (B, N, D) features (normalized for cosine)
    Y: torch.Tensor  # (B, M, D)
    a: torch.Tensor  # (B, N)
    b: torch.Tensor  # (B, M)
    cx: torch.Tensor  # (B, N)
    cy: torch.Tensor  # (B, M)
    c2: float
    cost: str
    cost_scale: float
    labels: tuple | None = None  # (lx, ly, W, scale)
    precision: str = "tf32"
    backend: str = "auto"
    center: torch.Tensor | None = None  # (B, D): dot products use <X - c, Y - c>
    # kernel operands (X - c, Y - c, cast for the backend), prepared ONCE per problem; pass
    # another Problem's to share them (e.g. the debiasing problems, the autograd copy)
    Xk: torch.Tensor | None = field(default=None, repr=False)
    Yk: torch.Tensor | None = field(default=None, repr=False)
    loga: torch.Tensor = field(init=False)
    logb: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.loga = torch.log(self.a)
        self.logb = torch.log(self.b)
        if self.Xk is None or self.Yk is None:
            self.Xk, self.Yk = kernel_operands(
                self.X, self.Y, self.center, self.precision, self.backend
            )

    # sums over the problem's points and flags every rank must agree on: overridden by the
    # sharded problem (flashsinkhorn.distributed), whose points are spread over ranks
    def total(self, t):
        """``t.sum(-1)`` over the problem's points (B,)."""
        return t.sum(-1)

    def any_rank(self, flags):
        """The flags OR-ed over the ranks that share the problem (here: one)."""
        return tuple(flags)

    def self_update(self, f, eps, damping):
        """The debiasing update of a self-transport problem (x against itself): the
        symmetric kernel, each tile pair computed once (same result as ``sm_x``)."""
        return self_softmin(self.Xk, self.loga, f, self.cx, eps=eps, c2=self.c2,
                            damping=damping, precision=self.precision, center=None,
                            backend=self.backend)  # fmt: skip

    def dense_plan(self, f, g, eps, columns=None):
        """Dense plan (B, N, M) (tests, small problems). ``columns``: the column side's
        ``Y, g, b, cy`` if not this problem's (the sharded problem gathers them)."""
        c = columns or dict(Y=self.Y, g=g, b=self.b, cy=self.cy)
        X, Y = self.X.detach(), c["Y"].detach()
        if self.center is not None:
            X, Y = X - self.center[:, None, :], Y - self.center[:, None, :]
        C = self.cx[..., :, None] + c["cy"][..., None, :] - self.c2 * (X @ Y.transpose(-1, -2))
        if self.labels is not None:
            lx, ly, W, s = self.labels
            C = C + s * W.to(C.dtype)[lx.long()[..., :, None], ly.long()[..., None, :]]
        return (
            self.a[..., :, None]
            * c["b"][..., None, :]
            * torch.exp((f[..., :, None] + c["g"][..., None, :] - C) / eps)
        )

    @property
    def labels_t(self):
        if self.labels is None:
            return None
        lx, ly, W, s = self.labels
        return (ly, lx, W.t(), s)

    def sm_x(self, g, eps, damping=1.0, v=None, want_lse=False, guess=None):
        """f-side update: ``damping * softmin_j`` over the columns (rows = x); ``guess``:
        the current f (it selects the shift kernel, see :func:`flashsinkhorn.softmin`)."""
        return softmin(
            self.Xk,
            self.Yk,
            g,
            self.logb,
            self.cx,
            self.cy,
            eps=eps,
            c2=self.c2,
            damping=damping,
            v=v,
            labels=self.labels,
            precision=self.precision,
            backend=self.backend,
            want_lse=want_lse,
            guess=guess,
        )

    def sm_y(self, f, eps, damping=1.0, v=None, want_lse=False, guess=None):
        """g-side update (rows = y); ``guess``: the current g."""
        return softmin(
            self.Yk,
            self.Xk,
            f,
            self.loga,
            self.cy,
            self.cx,
            eps=eps,
            c2=self.c2,
            damping=damping,
            v=v,
            labels=self.labels_t,
            precision=self.precision,
            backend=self.backend,
            want_lse=want_lse,
            guess=guess,
        )


# ----------------------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------------------


def _l1_err(prob, w, old, new, eps):
    # L1 marginal error of the plan with the old potential: sum_i w_i |exp((old-new)/eps) - 1|
    return prob.total(w * torch.expm1((old - new) / eps).abs())


def _eps_list(prob: Problem, eps, eps_scaling, diameter):
    """The annealing temperatures before ``eps`` (None without eps-scaling)."""
    if eps_scaling is None:
        return None
    if diameter is None:
        X, Y = prob.X.detach(), prob.Y.detach()
        lo = torch.minimum(X.amin(dim=(0, 1)), Y.amin(dim=(0, 1)))
        hi = torch.maximum(X.amax(dim=(0, 1)), Y.amax(dim=(0, 1)))
        diameter = float((hi - lo).norm())
    d2 = max(float(prob.cost_scale) * diameter**2, eps)
    return eps_schedule(d2, eps, eps_scaling)[:-1]


def _report(converged, n_iter, err, tol, warn):
    """``converged`` as reported (False without a tolerance); warns when not converged."""
    if tol is None or tol <= 0:
        return False
    if not converged and warn:
        warnings.warn(
            f"flashsinkhorn.solve: not converged after {n_iter} iterations "
            f"(marginal error {float(err.max()):.3g} > tol {tol}); increase max_iter or eps",
            RuntimeWarning,
            stacklevel=3,
        )
    return converged


def _run(prob: Problem, eps, rx, ry, max_iter, tol, schedule, check_every, eps_list):
    B, N = prob.cx.shape
    M = prob.cy.shape[1]
    dt = torch.float64 if prob.X.dtype == torch.float64 else torch.float32
    f = torch.zeros((B, N), dtype=dt, device=prob.X.device)
    g = torch.zeros((B, M), dtype=dt, device=prob.X.device)
    # eps-scaling warm start: one symmetric iteration per stage (GeomLoss)
    if eps_list:
        e0 = eps_list[0]
        g = prob.sm_y(f, e0, damping_factor(e0, ry))[0]
        f = prob.sm_x(torch.zeros_like(g), e0, damping_factor(e0, rx))[0]
        for e in eps_list:
            ft = prob.sm_x(g, e, damping_factor(e, rx), guess=f)[0]
            gt = prob.sm_y(f, e, damping_factor(e, ry), guess=g)[0]
            f, g = 0.5 * (f + ft), 0.5 * (g + gt)
    err = torch.full((B,), float("inf"), device=f.device)
    n_iter = 0
    converged = False
    check = tol is not None and tol > 0
    for it in range(1, max_iter + 1):
        # the marginal error (a few small elementwise kernels per side) is measured only
        # where it is read: on check iterations and the last one
        measure = it == max_iter or (check and it % check_every == 0)
        # the current potentials as guesses of the updates ("shift" kernel), except the
        # zeros the loop starts from without eps-scaling
        gf, gg = (f, g) if (eps_list or it > 1) else (None, None)
        if schedule == "alternating":
            fn = prob.sm_x(g, eps, damping_factor(eps, rx), guess=gf)[0]
            if measure:
                ea = _l1_err(prob, prob.a, f, fn, eps)
            gn = prob.sm_y(fn, eps, damping_factor(eps, ry), guess=gg)[0]
            if measure:
                eb = _l1_err(prob, prob.b, g, gn, eps)
            f, g = fn, gn
        else:  # symmetric (averaged) updates
            ft = prob.sm_x(g, eps, damping_factor(eps, rx), guess=gf)[0]
            gt = prob.sm_y(f, eps, damping_factor(eps, ry), guess=gg)[0]
            if measure:
                ea = _l1_err(prob, prob.a, f, ft, eps)
                eb = _l1_err(prob, prob.b, g, gt, eps)
            f, g = 0.5 * (f + ft), 0.5 * (g + gt)
        n_iter = it
        if measure:
            err = ea + eb
        if check and measure:
            e_max = float(err.max())  # the only host sync: every check_every iterations
            if not math.isfinite(e_max):
                raise FloatingPointError(
                    "Sinkhorn diverged (non-finite potentials); increase eps or check inputs"
                )
            if e_max < tol:
                converged = True
                break
    if prob.any_rank((not bool(torch.isfinite(f).all() & torch.isfinite(g).all()),))[0]:
        raise FloatingPointError("Sinkhorn produced non-finite potentials; increase eps")
    return f, g, err, n_iter, converged


# ----------------------------------------------------------------------------------------
# differentiable value (envelope theorem, streaming backward)
# ----------------------------------------------------------------------------------------


def _ot_value(prob, a, b, f, g, eps, rx, ry):
    """The dual value (B,) of the potentials (f, g) (no graph)."""
    total = prob.total
    if rx is None and ry is None:
        return total(a * f) + total(b * g)
    _, lse2, _ = prob.sm_x(g, eps, 1.0, want_lse=True)
    rows = a * torch.exp((f - prob.cx) / eps + LN2 * lse2)
    duals = total(dual_point_terms(f, a, rx)) + total(dual_point_terms(g, b, ry))
    return duals - eps * (total(rows) - total(a) * total(b))


def _ot_value_grads(prob, f, g, eps, rx, ry, gout, need):
    """``gout``-weighted gradients ``(gX, gY, ga, gb)`` of the value (None where ``need``,
    four bools, is False): envelope theorem, two streaming passes."""
    gX = gY = ga = gb = None
    go = gout[:, None]
    need_x, need_y, need_a, need_b = need
    # P @ Y and row sums; P^T @ X and column sums (streaming)
    _, lse2x, Ybar = prob.sm_x(g, eps, 1.0, v=prob.Y if need_x else None, want_lse=True)
    rows = prob.a * torch.exp((f - prob.cx) / eps + LN2 * lse2x)
    _, lse2y, Xbar = prob.sm_y(f, eps, 1.0, v=prob.X if need_y else None, want_lse=True)
    cols = prob.b * torch.exp((g - prob.cy) / eps + LN2 * lse2y)
    if need_x:
        gX = _feature_grad(prob.X, rows, Ybar, prob) * go[..., None]
    if need_y:
        gY = _feature_grad(prob.Y, cols, Xbar, prob) * go[..., None]
    bsum = prob.total(prob.b)[..., None]
    asum = prob.total(prob.a)[..., None]
    if need_a:
        base = f if rx is None else rx * (1.0 - torch.exp(-f / rx))
        ga = (base - eps * (rows / prob.a.clamp_min(1e-38) - bsum)) * go
    if need_b:
        base = g if ry is None else ry * (1.0 - torch.exp(-g / ry))
        gb = (base - eps * (cols / prob.b.clamp_min(1e-38) - asum)) * go
    return gX, gY, ga, gb


class _OTValue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, Y, a, b, f, g, prob, eps, rx, ry):
        with torch.no_grad():
            value = _ot_value(prob, a, b, f, g, eps, rx, ry)
        ctx.prob, ctx.eps, ctx.rx, ctx.ry = prob, eps, rx, ry
        ctx.save_for_backward(f, g)
        return value

    @staticmethod
    def backward(ctx, gout):
        f, g = ctx.saved_tensors
        need = ctx.prob.any_rank(ctx.needs_input_grad[:4])  # the passes are the same on all ranks
        with torch.no_grad():
            grads = _ot_value_grads(ctx.prob, f, g, ctx.eps, ctx.rx, ctx.ry, gout, need)
        grads = tuple(gr if n else None for gr, n in zip(grads, ctx.needs_input_grad[:4]))
        return (*grads, None, None, None, None, None, None)


def _feature_grad(X, rows, Ybar, prob):
    """sum_j P_ij d/dX_i C_ij = rows_i * (d cx_i / dX_i - c2 * Ybar_i)."""
    if prob.cost == "dot":
        return -prob.c2 * rows[..., None] * Ybar
    # sqeuclidean and cosine (on the sphere): cx = (c2 / 2) |X|^2
    return prob.c2 * rows[..., None] * (X - Ybar)


# ----------------------------------------------------------------------------------------
# torch.compile: the loop and the value as custom ops (fake impls, registered autograd)
# ----------------------------------------------------------------------------------------
#
# The loop has host syncs (convergence checks, eps-scaling diameter) and a data-dependent
# length, and the kernels are Triton launches: under torch.compile each piece below is one
# opaque op, so the compiled graph has no break. Eager calls do not go through them.
# A problem travels as its tensors ``X, Y, a, b`` (features and weights), ``Xk, Yk``
# (kernel operands), ``cx, cy``, optional labels ``lx, ly, W``, then its scalars.

# The ops' leading arguments: one problem, as in _op_problem_args
_PROBLEM = (
    "Tensor X, Tensor Y, Tensor a, Tensor b, Tensor Xk, Tensor Yk, Tensor cx, Tensor cy, "
    "Tensor? lx, Tensor? ly, Tensor? W, float label_scale, float c2, str cost, "
    "str precision, str backend"
)
_NP = 16  # how many


def _op_problem_args(prob: Problem, X=None, Y=None, a=None, b=None):
    """A Problem as the ops' leading arguments; ``X, Y, a, b`` replace the problem's
    (detached) ones where given (the value op takes them with their graph)."""
    lx, ly, W, label_scale = prob.labels if prob.labels is not None else (None,) * 3 + (1.0,)
    X, Y = prob.X if X is None else X, prob.Y if Y is None else Y
    a, b = prob.a if a is None else a, prob.b if b is None else b
    return (X, Y, a, b, prob.Xk, prob.Yk, prob.cx, prob.cy, lx, ly, W, label_scale, prob.c2,
            prob.cost, prob.precision, prob.backend)  # fmt: skip


def _op_problem(args, cost_scale=1.0):
    """The Problem of the ops' leading arguments (inverse of :func:`_op_problem_args`)."""
    X, Y, a, b, Xk, Yk, cx, cy, lx, ly, W, label_scale, c2, cost, precision, backend = args
    labels = None if W is None else (lx, ly, W, label_scale)
    return Problem(X, Y, a, b, cx, cy, c2, cost, cost_scale, labels, precision, backend,
                   None, Xk=Xk, Yk=Yk)  # fmt: skip


def _potential_dtype(X, backend):
    return torch.float64 if (X.dtype == torch.float64 and backend == "torch") else torch.float32


@torch.library.custom_op(
    "flashsinkhorn::sinkhorn_potentials",
    mutates_args=(),
    schema=f"({_PROBLEM}, float cost_scale, float eps, float? rx, float? ry, int max_iter, "
    "float? tol, str schedule, int check_every, float? eps_scaling, float? diameter, "
    "bool warn) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _potentials_op(*args):
    """solve's loop: ``(f (B, N), g (B, M), marginal_error (B,), n_iter (), converged ())``.

    First runs the data-dependent input checks that the compiled graph skips."""
    cost_scale, eps, rx, ry, max_iter, tol, schedule, check_every, eps_scaling, diameter, warn = (
        args[_NP:]
    )  # fmt: skip
    prob = _op_problem(args[:_NP], cost_scale)
    check_values(prob.X, prob.Y, prob.a, prob.b)
    check_masses(prob.a, prob.b, rx, ry)
    if prob.labels is not None:
        lx, ly, W, _ = prob.labels
        check_label_range("labels_x", lx, W, W.shape[0])
        check_label_range("labels_y", ly, W, W.shape[1])
    eps_list = _eps_list(prob, eps, eps_scaling, diameter)
    with torch.no_grad():
        f, g, err, n_iter, converged = _run(
            prob, eps, rx, ry, max_iter, tol, schedule, check_every, eps_list
        )
    converged = _report(converged, n_iter, err, tol, warn)
    dt = _potential_dtype(prob.X, prob.backend)
    err = err.to(torch.promote_types(prob.a.dtype, dt))
    dev = prob.X.device
    n_iter = torch.tensor(n_iter, dtype=torch.int64, device=dev)
    return f.to(dt), g.to(dt), err, n_iter, torch.tensor(converged, device=dev)


@_potentials_op.register_fake
def _(*args):
    X, a, cx, cy, backend = args[0], args[2], args[6], args[7], args[15]
    dt = _potential_dtype(X, backend)
    return (
        cx.new_empty(cx.shape, dtype=dt),
        cy.new_empty(cy.shape, dtype=dt),
        cx.new_empty(cx.shape[:1], dtype=torch.promote_types(a.dtype, dt)),
        cx.new_empty((), dtype=torch.int64),
        cx.new_empty((), dtype=torch.bool),
    )


_VALUE = "Tensor f, Tensor g, float eps, float? rx, float? ry"  # after the problem


@torch.library.custom_op(
    "flashsinkhorn::ot_value", mutates_args=(), schema=f"({_PROBLEM}, {_VALUE}) -> Tensor"
)
def _ot_value_op(*args):
    """solve's differentiable value (B,) (:class:`_OTValue` as a custom op); ``X, Y, a, b``
    are the differentiable inputs."""
    prob, (f, g, eps, rx, ry) = _op_problem(args[:_NP]), args[_NP:]
    with torch.no_grad():
        value = _ot_value(prob, prob.a, prob.b, f, g, eps, rx, ry)
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
    prob, (f, g, eps, rx, ry), need = _op_problem(args[:_NP]), args[_NP:-4], args[-4:]
    with torch.no_grad():
        grads = _ot_value_grads(prob, f, g, eps, rx, ry, gout, need)
    return tuple(gr.to(t.dtype) if n else t.new_empty(0) for gr, t, n in zip(grads, args[:4], need))


@_ot_value_backward_op.register_fake
def _(gout, *args):
    return tuple(t.new_empty(t.shape if n else 0) for t, n in zip(args[:4], args[-4:]))


def _ot_value_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:11], *inputs[_NP : _NP + 2])  # X .. W, f, g
    ctx.scalars = inputs[11:_NP], inputs[_NP + 2 :]  # label_scale .. backend; eps, rx, ry


def _ot_value_bwd(ctx, gout):
    *tensors, f, g = ctx.saved_tensors
    problem_scalars, value_scalars = ctx.scalars
    need = tuple(ctx.needs_input_grad[:4])
    grads = _ot_value_backward_op(gout, *tensors, *problem_scalars, f, g, *value_scalars, *need)
    return (*(gr if n else None for gr, n in zip(grads, need)),) + (None,) * (_NP + 1)


_ot_value_op.register_autograd(_ot_value_bwd, setup_context=_ot_value_setup)


def _solve_compiled(prob, X, Y, a, b, loop, eps_scaling, diameter, warn):
    """solve's loop and value through the custom ops (``X, Y, a, b`` carry the graph).
    Returns ``(f, g, err, n_iter, converged, value)`` (n_iter, converged: 0-dim tensors)."""
    eps, rx, ry, max_iter, tol, schedule, check_every = loop
    f, g, err, n_iter, converged = _potentials_op(
        *_op_problem_args(prob), prob.cost_scale, eps, rx, ry, max_iter, tol, schedule,
        check_every, eps_scaling, diameter, warn,
    )  # fmt: skip
    value = _ot_value_op(*_op_problem_args(prob, X, Y, a, b), f, g, eps, rx, ry)
    return f, g, err, n_iter, converged, value


# ----------------------------------------------------------------------------------------
# result
# ----------------------------------------------------------------------------------------


@dataclass
class SinkhornResult:
    """Output of :func:`solve`. Unbatched inputs give unbatched fields.

    Attributes:
        f: (N,) or (B, N) potential on x. g: (M,) or (B, M) potential on y.
        value: () or (B,) OT value (dual formula; differentiable w.r.t. x, y, a, b).
        marginal_error: () or (B,) L1 marginal error (row + column) measured on device in
            the last iteration (for unbalanced problems: the fixed-point residual).
        n_iter: iterations at the final eps. converged: ``marginal_error < tol`` reached.
    """

    f: torch.Tensor
    g: torch.Tensor
    value: torch.Tensor
    marginal_error: torch.Tensor
    n_iter: int
    converged: bool
    eps: float
    _prob: Problem = field(repr=False)
    _batched: bool = field(repr=False, default=False)
    _f: torch.Tensor = field(repr=False, default=None)
    _g: torch.Tensor = field(repr=False, default=None)

    def _unb(self, t):
        return t if self._batched else t[0]

    def _batch(self, V, n, name):
        if not self._batched:
            if V.dim() == 1:
                V = V[:, None]
                return V.unsqueeze(0), True
            return V.unsqueeze(0), False
        if V.dim() == 2:
            return V[..., None], True
        return V, False

    def apply(self, V: torch.Tensor) -> torch.Tensor:
        """``P @ V`` for V of shape (M,), (M, K) (or (B, M[, K])), streaming, no N x M buffer."""
        p = self._prob
        Vb, squeeze = self._batch(V, p.Y.shape[1], "V")
        if Vb.shape[1] != p.Y.shape[1]:
            raise ValueError(f"V must have {p.Y.shape[1]} rows; got {tuple(V.shape)}")
        _, lse2, vbar = p.sm_x(self._g, self.eps, 1.0, v=Vb.to(p.Y.dtype), want_lse=True)
        rows = p.a * torch.exp((self._f - p.cx) / self.eps + LN2 * lse2)
        out = vbar * rows[..., None]
        out = out[..., 0] if squeeze else out
        return self._unb(out)

    def apply_transpose(self, U: torch.Tensor) -> torch.Tensor:
        """``P^T @ U`` for U of shape (N,), (N, K) (or batched), streaming."""
        p = self._prob
        Ub, squeeze = self._batch(U, p.X.shape[1], "U")
        if Ub.shape[1] != p.X.shape[1]:
            raise ValueError(f"U must have {p.X.shape[1]} rows; got {tuple(U.shape)}")
        _, lse2, ubar = p.sm_y(self._f, self.eps, 1.0, v=Ub.to(p.X.dtype), want_lse=True)
        cols = p.b * torch.exp((self._g - p.cy) / self.eps + LN2 * lse2)
        out = ubar * cols[..., None]
        out = out[..., 0] if squeeze else out
        return self._unb(out)

    def barycentric_map(self) -> torch.Tensor:
        """``T(x_i) = (P Y)_i / (P 1)_i``, shape like x (in feature space for cosine)."""
        p = self._prob
        _, _, ybar = p.sm_x(self._g, self.eps, 1.0, v=p.Y)
        return self._unb(ybar)

    def marginals(self):
        """Exact plan marginals ``(P 1, P^T 1)`` (two streaming passes)."""
        p = self._prob
        _, lx, _ = p.sm_x(self._g, self.eps, 1.0, want_lse=True)
        _, ly, _ = p.sm_y(self._f, self.eps, 1.0, want_lse=True)
        r = p.a * torch.exp((self._f - p.cx) / self.eps + LN2 * lx)
        c = p.b * torch.exp((self._g - p.cy) / self.eps + LN2 * ly)
        return self._unb(r), self._unb(c)

    def plan(self) -> torch.Tensor:
        """Dense plan (B, N, M): for small problems and tests only (allocates N x M; for a
        sharded result, this rank's rows against all columns)."""
        return self._unb(self._prob.dense_plan(self._f, self._g, self.eps))


def _check_args(eps, reach, cost, schedule, precision, max_iter, check_every):
    """solve's scalar arguments: ``(eps, rho_x, rho_y)`` or a ValueError naming one."""
    eps = check_eps(eps)
    rx, ry = parse_reach(reach)
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {COSTS}; got {cost!r}")
    if schedule not in ("alternating", "symmetric"):
        raise ValueError(f"schedule must be 'alternating' or 'symmetric'; got {schedule!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    if int(max_iter) < 1:
        raise ValueError(f"max_iter must be >= 1; got {max_iter}")
    if int(check_every) < 1:
        raise ValueError(f"check_every must be >= 1; got {check_every}")
    return eps, rx, ry


def solve(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    reach=None,
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
    process_group=None,
) -> SinkhornResult:
    """Entropic OT between weighted point clouds by streaming Sinkhorn.

    Args:
        x: (N, D) or (B, N, D) source points. y: (M, D) or (B, M, D) target points.
        a: (N,) / (B, N) nonnegative source weights (default uniform 1/N); b likewise.
        eps: entropic temperature (> 0), in cost units.
        reach: None (balanced), rho, or (rho_x, rho_y): KL marginal penalties (cost units,
            POT's ``unbalanced``); a side with None stays balanced (semi-unbalanced).
        cost: "sqeuclidean" (``|x - y|^2``), "cosine" (``1 - cos``), "dot" (``-<x, y>``);
            the cost is multiplied by ``cost_scale`` (0.5 gives GeomLoss's p = 2 cost).
        max_iter: iterations at the final eps. tol: stop when the L1 marginal error
            (row + column, computed on device from the updates) falls below tol; checked
            every ``check_every`` iterations (one host sync each). None: run max_iter.
        schedule: "alternating" (f then g) or "symmetric" (GeomLoss's averaged updates).
        eps_scaling: None, or a ratio in (0, 1): anneal eps from ``diameter^2`` with
            GeomLoss's schedule (one symmetric iteration per stage) before iterating.
        label_cost: optional ``(labels_x (N,), labels_y (M,), W (K1, K2))``: adds
            ``W[labels_x[i], labels_y[j]]`` to the cost, gathered inside the kernel.
        precision: "tf32" (default), "ieee", "tf32x3", "bf16" dot operands (triton backend).
        backend: "auto" (triton on CUDA for float32/16 inputs, torch blockwise on CPU and
            for float64), "triton", "torch".
        process_group: a ``torch.distributed`` group (NCCL for CUDA tensors, gloo for CPU):
            x, y, a, b are this rank's shards of the global clouds (concatenated in rank
            order); the result is the global coupling (:mod:`flashsinkhorn.distributed`).
            None (default): one process.

    Returns:
        :class:`SinkhornResult` with ``f``, ``g``, ``value``, ``marginal_error``, ``n_iter``,
        ``converged`` and streaming ``apply``, ``apply_transpose``, ``barycentric_map``.
        A non-converged run is reported (``converged=False``) and warned about when
        ``warn`` is true. Under torch.compile the loop and the value run as custom ops
        (no graph break) and ``n_iter``, ``converged`` are 0-dim tensors.
    """
    if process_group is not None:  # sharded over the ranks of a torch.distributed group
        from flashsinkhorn import distributed  # noqa: PLC0415 (it imports this module)

        return distributed.solve(
            x, y, a, b, process_group=process_group, eps=eps, reach=reach, cost=cost,
            cost_scale=cost_scale, max_iter=max_iter, tol=tol, schedule=schedule,
            eps_scaling=eps_scaling, diameter=diameter, check_every=check_every,
            label_cost=label_cost, precision=precision, backend=backend, warn=warn,
        )  # fmt: skip
    eps, rx, ry = _check_args(eps, reach, cost, schedule, precision, max_iter, check_every)
    # under torch.compile the data-dependent checks run inside the custom op (_solve_compiled)
    compiling = torch.compiler.is_compiling()
    x3, y3, a2, b2, batched = prepare_inputs(x, y, a, b, check_values=not compiling)
    if not compiling:
        check_masses(a2, b2, rx, ry)
    be = resolve_backend(backend, x3.device)
    if backend == "auto" and x3.dtype == torch.float64:
        be = "torch"  # float64 stays float64 (the Triton kernels compute in fp32)
    X, Y, cx, cy, c2, center = cost_features(x3, y3, cost, cost_scale)
    B, N, M = X.shape[0], X.shape[1], Y.shape[1]
    labels = label_tuple(label_cost, B, N, M, X.device, check_range=not compiling)
    prob = Problem(
        X.detach(),
        Y.detach(),
        a2.detach(),
        b2.detach(),
        cx.detach(),
        cy.detach(),
        c2,
        cost,
        cost_scale,
        labels,
        precision,
        be,
        center,
    )
    loop = (eps, rx, ry, int(max_iter), tol, schedule, int(check_every))
    if compiling:
        f, g, err, n_iter, converged, value = _solve_compiled(
            prob, X, Y, a2, b2, loop, eps_scaling, diameter, warn
        )
    else:
        eps_list = _eps_list(prob, eps, eps_scaling, diameter)
        with torch.no_grad():
            f, g, err, n_iter, converged = _run(prob, *loop, eps_list)
        converged = _report(converged, n_iter, err, tol, warn)
        # the differentiable value: graph to x, y (through the features) and a, b
        prob_g = Problem(
            X, Y, a2, b2, cx, cy, c2, cost, cost_scale, labels, precision, be, center,
            Xk=prob.Xk, Yk=prob.Yk,
        )  # fmt: skip
        prob_g.X, prob_g.Y = X.detach(), Y.detach()
        prob_g.cx, prob_g.cy = cx.detach(), cy.detach()
        prob_g.a, prob_g.b = a2.detach(), b2.detach()
        value = _OTValue.apply(X, Y, a2, b2, f, g, prob_g, eps, rx, ry)
    res = SinkhornResult(
        f=f if batched else f[0],
        g=g if batched else g[0],
        value=value if batched else value[0],
        marginal_error=err if batched else err[0],
        n_iter=n_iter,
        converged=converged,
        eps=eps,
        _prob=prob,
        _batched=batched,
        _f=f,
        _g=g,
    )
    return res
