"""The Hessian of the entropic OT loss, streamed: what double backward needs, in the core.

``solve(...).value`` and ``SamplesLoss`` are twice differentiable: with ``create_graph=True``
their gradient comes back attached (:func:`differentiable_grads`) to a function whose
backward is the Hessian-vector product of each OT term (:func:`hvp_plan`), computed from
plan products only (``_hessian_triton``: ``P @ W`` and ``(P * Q) @ U``), never the n x m
plan. :mod:`flashsinkhorn.second_order` builds its public functions (``hvp``,
``implicit_grad``, ``inverse_hvp``, ``ot_loss``, OTDD) on the same pieces.

Conventions (the second-order ones): cost ``C_ij = |x_i - y_j|^2`` (plus an optional
label-cost table ``L[lx_i, ly_j]``, OTDD), plan ``P_ij = a_i b_j exp((f_i + g_j - C_ij) /
eps)``, unbalanced marginal penalty ``rho * KL`` with ``rho = 2 reach**2`` (GeomLoss's
reach, a distance) and damping ``kappa = 1 / (1 + eps / rho)`` per side (1 on a balanced
side). The loss is the dual objective

    OT = <a, phi_x(f)> + <b, phi_y(g)> - eps * (sum(P) - sum(a) sum(b))

with ``phi(f) = f`` on a balanced side and ``phi(f) = -rho (exp(-f / rho) - 1)`` on an
unbalanced one; its gradient in x is ``2 (r_i x_i - (P y)_i)`` (envelope theorem,
r = P 1). A cost ``s |x - y|^2`` at eps is the same plan at ``eps / s`` with potentials
``f / s``, and its Hessian is ``s`` times the plan's.

The HVP along ``(vx, vy)`` solves the linearized optimality conditions: with
``delta_ij = 2 <x_i - y_j, vx_i - vy_j>``,

    [ diag(r)/kx   P          ] [df]   [u = sum_j P_ij delta_ij]
    [ P^T          diag(c)/ky ] [dg] = [w = sum_i P_ij delta_ij]

(c = P^T 1; singular along (1, -1) and consistent when balanced), by conjugate gradient on
the Schur complement ``(diag(c)/ky - P^T diag(kx / r) P) dg = w - P^T (kx u / r)``
preconditioned by ``diag(ky / c)``: two streamed plan products per CG iteration. Then with
``h_ij = df_i + dg_j - delta_ij``:

    (H v)_x,i = (2/eps) sum_j P_ij h_ij (x_i - y_j) + 2 (r_i vx_i - (P vy)_i)
    (H v)_y,j = (2/eps) sum_i P_ij h_ij (y_j - x_i) + 2 (c_j vy_j - (P^T vx)_j)

Working memory is O((n + m) d).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from flashsinkhorn._hessian_triton import resolve_backend, row_apply
from flashsinkhorn.reference import rho_from_reach

Tensor = torch.Tensor


def split_reach(reach):
    """reach (None, a number, or a pair) -> (reach_x, reach_y)."""
    if isinstance(reach, (tuple, list)):
        rx, ry = reach
        return rx, ry
    return reach, reach


def rho_pair(reach):
    """GeomLoss's reach (a distance) -> (rho_x, rho_y) = 2 reach**2 for the cost |x - y|^2
    (``geomloss.ot``'s convention; SamplesLoss's cost |x - y|^2 / 2 gives reach**2); None
    or inf means balanced on that side."""
    return rho_from_reach(reach, 1.0)


def kappa(rho, eps):
    return 1.0 if rho is None else 1.0 / (1.0 + eps / rho)


@dataclass
class Plan:
    """Potentials of a solved problem plus everything needed to stream its plan."""

    x: torch.Tensor  # centered compute copy (n, D)
    y: torch.Tensor  # centered compute copy (m, D)
    a: torch.Tensor
    b: torch.Tensor
    f: torch.Tensor
    g: torch.Tensor
    eps: float
    rho_x: float | None = None
    rho_y: float | None = None
    labels: tuple | None = None  # (lx, ly, table) with the label weight folded in
    backend: str = "auto"
    precision: str = "tf32x3"
    info: dict = field(default_factory=dict)

    @property
    def kx(self) -> float:
        return kappa(self.rho_x, self.eps)

    @property
    def ky(self) -> float:
        return kappa(self.rho_y, self.eps)

    @property
    def balanced(self) -> bool:
        return self.rho_x is None and self.rho_y is None

    def _shifted(self):
        F = self.f - (self.x * self.x).sum(1) + self.eps * torch.log(self.a)
        G = self.g - (self.y * self.y).sum(1) + self.eps * torch.log(self.b)
        return F, G

    def rows(self, W, A=None, B=None, U=None):
        """``P @ W`` (and ``(P * (A B^T)) @ U`` when A is given)."""
        F, G = self._shifted()
        return row_apply(
            self.x,
            self.y,
            F,
            G,
            self.eps,
            W,
            A=A,
            B=B,
            U=U,
            labels=self.labels,
            backend=self.backend,
            precision=self.precision,
        )

    def cols(self, W, A=None, B=None, U=None):
        """``P^T @ W`` (and ``(P * (B A^T))^T @ U`` with A (m, E), B (n, E))."""
        F, G = self._shifted()
        lab = None
        if self.labels is not None:
            lx, ly, t = self.labels
            lab = (ly, lx, t.T.contiguous())
        return row_apply(
            self.y,
            self.x,
            G,
            F,
            self.eps,
            W,
            A=A,
            B=B,
            U=U,
            labels=lab,
            backend=self.backend,
            precision=self.precision,
        )

    def value(self, r=None) -> torch.Tensor:
        """The dual objective (the entropic OT cost at the optimum)."""
        if r is None:
            r = self.rows(torch.ones_like(self.g))
        mass = r.sum() - self.a.sum() * self.b.sum()
        return (
            phi(self.f, self.rho_x) @ self.a + phi(self.g, self.rho_y) @ self.b - (self.eps * mass)
        )


def phi(f, rho):
    """The dual's per-point term (and its derivative in the weight): f on a balanced side,
    ``-rho (exp(-f / rho) - 1)`` on an unbalanced one."""
    if rho is None:
        return f
    return -rho * torch.expm1(-f / rho)


def center(x, y):
    """Translate both clouds by their common mean (the cost is translation invariant)."""
    t = (x.sum(0) + y.sum(0)) / (x.shape[0] + y.shape[0])
    return x - t, y - t


def dot(u: Tensor, v: Tensor) -> Tensor:
    return (u * v).sum()


@dataclass
class CGInfo:
    converged: bool
    iterations: int
    residual: float
    initial_residual: float
    negative_curvature: bool = False


def conjugate_gradient(
    matvec: Callable[[Tensor], Tensor],
    b: Tensor,
    *,
    x0: Tensor | None = None,
    M: Callable[[Tensor], Tensor] | None = None,
    tol: float = 1e-6,
    atol: float = 0.0,
    max_iter: int | None = None,
    project: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, CGInfo]:
    """Solve ``A x = b`` for symmetric positive (semi-)definite A by preconditioned CG.

    ``M``: the preconditioner, a function ``r -> M^{-1} r``. ``project``: applied to the
    residual every iteration (e.g. removing the null-space component of a consistent
    singular system). Stops when ``|r| <= max(tol * |b|, atol)``; returns ``(x, CGInfo)``.
    """
    max_iter = int(max_iter if max_iter is not None else 10 * b.numel())
    if project is not None:
        b = project(b)
    x = torch.zeros_like(b) if x0 is None else x0.clone()
    r = b - matvec(x) if x0 is not None else b.clone()
    if project is not None:
        r = project(r)
    r0 = float(torch.linalg.vector_norm(r))
    target = max(tol * float(torch.linalg.vector_norm(b)), atol)
    if r0 <= target:
        return x, CGInfo(True, 0, r0, r0)
    z = M(r) if M is not None else r
    p = z.clone()
    rz = dot(r, z)
    res = r0
    it = 0
    for it in range(1, max_iter + 1):
        Ap = matvec(p)
        pAp = dot(p, Ap)
        if float(pAp) <= 0:  # not positive definite along p: stop with what we have
            return x, CGInfo(False, it, res, r0, negative_curvature=True)
        alpha = rz / pAp
        x = x + alpha * p
        r = r - alpha * Ap
        if project is not None:
            r = project(r)
        res = float(torch.linalg.vector_norm(r))
        if res <= target:
            return x, CGInfo(True, it, res, r0)
        z = M(r) if M is not None else r
        rz_new = dot(r, z)
        p = z + (rz_new / rz) * p
        rz = rz_new
    return x, CGInfo(False, it, res, r0)


def schur_solve(plan: Plan, r, c, rhs_f, rhs_g, *, tol, max_iter, tikhonov=0.0):
    """Solve [[diag(r)/kx, P], [P^T, diag(c)/ky]] [zf; zg] = [rhs_f; rhs_g] for zg.

    Returns ``(zg, info)``; ``zf = kx (rhs_f - P zg) / r`` is left to the caller (who can
    fuse that row pass with others).
    """
    dx = r / plan.kx
    dy = c / plan.ky + tikhonov
    idx, idy = inverse_or_zero(dx), inverse_or_zero(dy)
    rhs = rhs_g - plan.cols(rhs_f * idx)
    project = None
    if plan.balanced and tikhonov == 0:

        def project(v):
            return v - v.mean()

    def matvec(z):
        return dy * z - plan.cols(plan.rows(z) * idx)

    zg, info = conjugate_gradient(
        matvec, rhs, M=lambda res: res * idy, tol=tol, max_iter=max_iter, project=project
    )
    return zg, info


def finite_or_raise(what, out, eps):
    """A non-finite H v (or gradient) of finite inputs means the plan over- or underflowed:
    eps is below the resolution of the cost in the compute dtype. Raise instead of NaN."""
    outs = out if isinstance(out, tuple) else (out,)
    if not all(bool(torch.isfinite(t).all()) for t in outs):
        raise FloatingPointError(
            f"{what}: non-finite result at eps={eps:.3g}: the plan over- or underflows (eps "
            "below the resolution of the cost); increase eps, rescale the points or pass "
            "float64 inputs"
        )


def inverse_or_zero(t):
    """``1 / t`` where ``t > 0``, else 0: a point whose plan row carries no mass (all its
    entries underflow, e.g. unbalanced points far from the other cloud) has no equation in
    the linearized conditions and contributes nothing to H v, instead of 0 / 0."""
    return torch.where(t > 0, 1.0 / torch.where(t > 0, t, torch.ones_like(t)), torch.zeros_like(t))


def weighted(apply, w, pts):
    """``(P w, P (w pts))`` in one streamed pass; ``apply`` is ``plan.rows`` (pts = y) or
    ``plan.cols`` (P^T, pts = x). ``w=None`` means ones: the masses and ``P pts``."""
    if w is None:
        ones = torch.ones(pts.shape[0], 1, dtype=pts.dtype, device=pts.device)
        R = apply(torch.cat([ones, pts], 1))
    else:
        R = apply(torch.cat([w[:, None], w[:, None] * pts], 1))
    return R[:, 0], R[:, 1:]


def first_pass(apply, pts, s, v, need, A, B):
    """Pass 1 of the HVP on one side, one streamed product: ``P 1``, ``P pts`` (if
    ``need``), ``P s`` and ``P v`` (when the other side moves: s, v given; ``P v`` only if
    ``need``), ``(P*Q) 1`` and ``(P*Q) pts`` (if ``need``), with ``Q = A B^T``.

    Rows: ``apply=plan.rows, pts=y, s=beta, v=vy``; columns: ``plan.cols, x, alpha, vx``
    with A and B swapped. Returns ``(P1, Ppts, Ps, Pv, PQ1, PQpts)``, None where skipped.
    """
    d = pts.shape[1]
    ones = torch.ones(pts.shape[0], 1, dtype=pts.dtype, device=pts.device)
    has = s is not None
    W = [ones] + ([pts] if need else []) + ([s[:, None]] if has else [])
    W += [v] if (has and need) else []
    U = torch.cat([ones, pts], 1) if need else ones[:, 0]
    R1, R2 = apply(torch.cat(W, 1), A=A, B=B, U=U)
    Ppts = Ps = Pv = PQpts = None
    k = 1
    if need:
        Ppts = R1[:, k : k + d]
        k += d
    if has:
        Ps = R1[:, k]
        k += 1
        if need:
            Pv = R1[:, k : k + d]
    if need:
        PQ1, PQpts = R2[:, 0], R2[:, 1:]
    else:
        PQ1 = R2
    return R1[:, 0], Ppts, Ps, Pv, PQ1, PQpts


def envelope_grads(plan: Plan, need_x=True, need_y=True):
    """Envelope-theorem gradients ``(2 (r x - P y), 2 (c y - P^T x))`` (compute dtype)."""
    gx = gy = None
    if need_x:
        r, Py = weighted(plan.rows, None, plan.y)
        gx = 2.0 * (r[:, None] * plan.x - Py)
    if need_y:
        c, PTx = weighted(plan.cols, None, plan.x)
        gy = 2.0 * (c[:, None] * plan.y - PTx)
    return gx, gy


def hvp_plan(
    plan: Plan, vx, vy, *, need_x=True, need_y=True, cg_tol=1e-6, cg_max_iter=300, tikhonov=0.0
):
    """Streaming HVP of the OT loss along (vx, vy) (either may be None = 0).

    Returns ``(hx, hy, CGInfo)``; hx (resp. hy) is None when not needed.
    """
    x, y, eps = plan.x, plan.y, plan.eps
    dt = x.dtype
    hasx, hasy = vx is not None, vy is not None
    if not (hasx or hasy):
        raise ValueError("need at least one of vx, vy")
    vx = vx.to(dt) if hasx else None
    vy = vy.to(dt) if hasy else None
    alpha = (x * vx).sum(1) if hasx else None
    beta = (y * vy).sum(1) if hasy else None
    if hasx and hasy:
        A, B = torch.cat([vx, x], 1), torch.cat([y, vy], 1)
    elif hasx:
        A, B = vx, y
    else:
        A, B = x, vy

    # row pass 1: r, P y, P beta, P vy ; (P*Q) 1, (P*Q) y
    r, Py, Pbeta, Pvy, Qr, QY = first_pass(plan.rows, y, beta, vy, need_x, A, B)
    # column pass 1: c, P^T x, P^T alpha, P^T vx ; (P*Q)^T 1, (P*Q)^T x
    c, PTx, PTalpha, PTvx, Qc, QX = first_pass(plan.cols, x, alpha, vx, need_y, B, A)

    # linearized optimality conditions
    u = -2.0 * Qr
    w = -2.0 * Qc
    if hasx:
        u = u + 2.0 * alpha * r
        w = w + 2.0 * PTalpha
    if hasy:
        u = u + 2.0 * Pbeta
        w = w + 2.0 * beta * c
    dg, info = schur_solve(plan, r, c, u, w, tol=cg_tol, max_iter=cg_max_iter, tikhonov=tikhonov)
    psi = dg - 2.0 * beta if hasy else dg

    # row pass 2: P psi, P (psi y)
    if need_x:
        Ppsi, PpsiY = weighted(plan.rows, psi, y)
    else:
        Ppsi = plan.rows(psi)
    Pdg = Ppsi + 2.0 * Pbeta if hasy else Ppsi
    df = plan.kx * (u - Pdg) * inverse_or_zero(r)
    phi = df - 2.0 * alpha if hasx else df

    hx = hy = None
    if need_x:
        s = phi * r + Ppsi + 2.0 * Qr
        hx = (2.0 / eps) * (x * s[:, None] - (phi[:, None] * Py + PpsiY + 2.0 * QY))
        if hasx:
            hx = hx + 2.0 * r[:, None] * vx
        if hasy:
            hx = hx - 2.0 * Pvy
    if need_y:
        PTphi, PTphiX = weighted(plan.cols, phi, x)
        s = PTphi + psi * c + 2.0 * Qc
        hy = (2.0 / eps) * (y * s[:, None] - (PTphiX + psi[:, None] * PTx + 2.0 * QX))
        if hasy:
            hy = hy + 2.0 * c[:, None] * vy
        if hasx:
            hy = hy - 2.0 * PTvx
    return hx, hy, info


class HvpTerm(NamedTuple):
    kind: str  # "xy", "xx" or "yy"
    batch: int
    plan: Plan
    weight: float  # multiplies the plan's Hessian
    ix: torch.Tensor | None  # rows of the batch's x (or y for "yy") in the plan (positive weights)
    iy: torch.Tensor | None


def plan_from_potentials(
    x, y, a, b, f, g, *, scale, eps, rho_x=None, rho_y=None, backend="auto", precision="tf32x3"
):
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
    plan = Plan(
        xc,
        yc,
        a.detach().to(dt),
        b.detach().to(dt),
        f.detach().to(dt) / s,
        g.detach().to(dt) / s,
        float(eps) / s,
        None if rho_x is None else rho_x / s,
        None if rho_y is None else rho_y / s,
        None,
        be,
        precision,
    )
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
                    hx, hy, _ = hvp_plan(t.plan, vx, vy, need_x=need_x, need_y=need_y, **kw)
                    if need_x:
                        _put(HX, k, t.ix, hx, t.weight)
                    if need_y:
                        _put(HY, k, t.iy, hy, t.weight)
                else:  # a self problem OT(z, z): both arguments move along v
                    gg, H, need = (ggX, HX, need_x) if t.kind == "xx" else (ggY, HY, need_y)
                    v = _take(gg, k, t.ix)
                    if v is None or not need:
                        continue
                    h1, h2, _ = hvp_plan(t.plan, v, v, **kw)
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
            "flashsinkhorn.second_order.implicit_grad for derivatives of the potentials in "
            "the weights"
        )


__all__ = [
    "Plan",
    "CGInfo",
    "HvpTerm",
    "center",
    "conjugate_gradient",
    "differentiable_grads",
    "envelope_grads",
    "hvp_plan",
    "no_second_order_in_weights",
    "plan_from_potentials",
    "schur_solve",
]
