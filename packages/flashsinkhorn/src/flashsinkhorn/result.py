"""What :func:`flashsinkhorn.solve` returns: potentials, value, certificates and the plan.

The names follow POT's and GeomLoss's ``OTResult``: ``value``, ``potentials``, ``plan``
(dense, small problems only), ``lazy_plan`` (streaming products, never stored),
``marginals`` / ``marginal_a`` / ``marginal_b``.

The certificate (``marginal_error``, ``converged``) is measured in float64 on the returned
potentials: :func:`certificate` recomputes the two half-updates of the problem rebuilt in
float64 from the user's points (the blockwise torch path), so a float32 or tf32 solve can
never report a better error than the plan of its own potentials has. It costs two float64
streaming passes per measurement (a few per solve).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashsinkhorn.reference import LN2, damping_factor

__all__ = ["SinkhornResult", "LazyPlan", "PLAN_MAX_ENTRIES"]

# SinkhornResult.plan / LazyPlan.dense refuse to allocate more entries than this by default
# (64M entries: 256 MB in float32); pass max_entries to go further on purpose.
PLAN_MAX_ENTRIES = 1 << 26


def certificate(prob64, f, g, eps, rx, ry):
    """Float64 truth of the potentials ``(f (B, N), g (B, M))`` on ``prob64``, the problem
    rebuilt in float64 from the user's points (``solver.float64_problem``; any backend
    computing in float64: it needs ``sm_x`` / ``sm_y`` with ``want_lse``, ``total``, ``peak``
    and ``cost_bound``).

    Returns ``(err (B,), rows (B, N), cols (B, M))``: ``rows = P 1`` and ``cols = P^T 1``
    of the plan ``P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)`` and the L1 fixed-point
    residual ``err = sum_i a_i |expm1((f_i - f~_i) / eps)| + sum_j b_j |...|`` with
    ``f~ = kappa_x softmin(g)``, ``g~ = kappa_y softmin(f)`` the updates. Balanced, ``err``
    is exactly ``|P 1 - a|_1 + |P^T 1 - b|_1``; unbalanced it is the residual of the
    optimality conditions in the same units.
    """
    d = torch.float64
    p = prob64
    with torch.no_grad():
        f, g = f.to(d), g.to(d)
        _, lse_x, _ = p.sm_x(g, eps, 1.0, want_lse=True)
        _, lse_y, _ = p.sm_y(f, eps, 1.0, want_lse=True)
        # log of the row sums over a_i: (f_i - softmin_i(g)) / eps, softmin = cx - eps ln2 lse2
        tx = (f - p.cx) / eps + LN2 * lse_x
        ty = (g - p.cy) / eps + LN2 * lse_y
        rows, cols = p.a * torch.exp(tx), p.b * torch.exp(ty)
        # residual of f = kappa * softmin(g): (f - kappa sm) / eps = tx + (1 - kappa) sm / eps
        kx, ky = damping_factor(eps, rx), damping_factor(eps, ry)
        rx_ = tx if kx == 1.0 else tx + (1.0 - kx) * (p.cx / eps - LN2 * lse_x)
        ry_ = ty if ky == 1.0 else ty + (1.0 - ky) * (p.cy / eps - LN2 * lse_y)
        # zero weights do not count (their rows carry no mass, whatever the potential)
        ex = torch.where(p.a > 0, p.a * torch.expm1(rx_).abs(), torch.zeros_like(p.a))
        ey = torch.where(p.b > 0, p.b * torch.expm1(ry_).abs(), torch.zeros_like(p.b))
        err = p.total(ex) + p.total(ey, "y")
        # float64's own resolution of the exponents (f_i + g_j - C_ij) / eps: each exponent
        # z is computed to delta (~64 ulps of its magnitude), and |expm1(z + delta)| <=
        # |expm1(z)| e^delta + expm1(delta): below expm1(delta) per unit of mass the
        # measurement cannot tell (points at 1e8 with eps 1e-3, say), and a large error is
        # known to a factor e^delta only. Both go in, so the reported error stays an upper
        # bound of the truth
        delta = _resolution(p, f, g, eps)
        err = err * torch.exp(delta) + (p.total(p.a) + p.total(p.b, "y")) * torch.expm1(delta)
        err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    return err, rows, cols


def _resolution(p, f, g, eps):
    """``64 * 2^-52 * (|f| + |g| + |C|)_max / eps`` per problem (B,): the float64 rounding
    of the certificate's exponents (maxima over all points: ``p.peak``)."""
    mag = p.peak(f.abs()) + p.peak(g.abs(), "y") + p.cost_bound()
    return 64 * 2.0**-52 * mag / eps


class LazyPlan:
    """The transport plan ``P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)`` of a solve, held
    by its potentials: products stream through the kernels, nothing of size N x M is kept.

    ``P @ V`` (``apply``), ``P.T @ U`` (``apply_transpose``), ``barycentric_map()``,
    ``marginals`` (float64, as the certificate measured them) and ``dense()``
    (``max_entries``-guarded). ``shape`` is (N, M) or (B, N, M).
    """

    def __init__(self, result: SinkhornResult):
        self._r = result

    @property
    def shape(self):
        p = self._r._prob
        B, N, M = p.X.shape[0], p.X.shape[1], p.Y.shape[1]
        return (B, N, M) if self._r._batched else (N, M)

    def __matmul__(self, V):
        return self.apply(V)

    def apply(self, V):
        return self._r.apply(V)

    def apply_transpose(self, U):
        return self._r.apply_transpose(U)

    def barycentric_map(self):
        return self._r.barycentric_map()

    @property
    def marginals(self):
        return self._r.marginals

    def dense(self, max_entries: int | None = PLAN_MAX_ENTRIES):
        return self._r.dense_plan(max_entries)


@dataclass
class SinkhornResult:
    """Output of :func:`solve`. Unbatched inputs give unbatched fields.

    Attributes:
        f: (N,) or (B, N) potential on x. g: (M,) or (B, M) potential on y
            (``potentials`` is the pair, POT's name).
        value: () or (B,) OT value (dual formula; differentiable w.r.t. x, y, a, b, twice
            w.r.t. x, y for the squared-Euclidean and cosine costs).
        marginal_error: () or (B,) float64: L1 error of the marginals of the returned
            potentials' plan, ``|P 1 - a|_1 + |P^T 1 - b|_1``, measured in float64 from the
            points (unbalanced: the residual of the optimality conditions in those units).
        converged: ``marginal_error < tol`` was reached (False without a tolerance).
        n_iter: iterations at the final eps. eps: the final temperature.
        precision: the dot precision of the last iterations (a tf32 / bf16 solve with a
            tolerance finishes in "tf32x3" when tf32's rounding of the cost keeps the
            float64 error above tol).
        backend: the implementation that ran ("dense", "streaming", "sharded", ...;
            ``backend="auto"``'s choice, printed by ``verbose=True``).

    ``potentials`` / ``potential_a`` / ``potential_b``, ``plan`` (dense, guarded by
    ``PLAN_MAX_ENTRIES``), ``lazy_plan``, ``marginals`` / ``marginal_a`` / ``marginal_b``
    follow POT's and GeomLoss's ``OTResult``; ``apply(V)``,
    ``apply_transpose(U)``, ``barycentric_map()`` stream.
    """

    f: torch.Tensor
    g: torch.Tensor
    value: torch.Tensor
    marginal_error: torch.Tensor
    n_iter: int
    converged: bool
    eps: float
    precision: str = "tf32"
    backend: str = "streaming"
    _prob: object = field(repr=False, default=None)
    _batched: bool = field(repr=False, default=False)
    _f: torch.Tensor = field(repr=False, default=None)
    _g: torch.Tensor = field(repr=False, default=None)
    _marginals: tuple = field(repr=False, default=None)
    _certify: object = field(repr=False, default=None)  # (f, g) -> (err, rows, cols)
    _sizes: tuple | None = field(repr=False, default=None)  # a ragged batch's segment sizes

    def _unb(self, t):
        return t if self._batched else t[0]

    def _batch(self, V):
        if not self._batched:
            if V.dim() == 1:
                return V[:, None].unsqueeze(0), True
            return V.unsqueeze(0), False
        if V.dim() == 2:
            return V[..., None], True
        return V, False

    @property
    def potentials(self):
        """``(f, g)`` (POT's name)."""
        return self.f, self.g

    @property
    def potential_a(self):
        return self.f

    @property
    def potential_b(self):
        return self.g

    @property
    def lazy_plan(self) -> LazyPlan:
        return LazyPlan(self)

    @property
    def plan(self) -> torch.Tensor:
        """Dense plan (N, M) or (B, N, M); raises above ``PLAN_MAX_ENTRIES`` entries (use
        ``lazy_plan`` / ``apply``, or ``dense_plan(max_entries=None)`` on purpose)."""
        return self.dense_plan(PLAN_MAX_ENTRIES)

    @property
    def marginals(self):
        """``(P 1, P^T 1)`` of the returned potentials' plan, computed in float64 (the
        certificate's measurement), in the potentials' dtype."""
        if self._marginals is None:  # (under torch.compile the loop's op returns no marginals)
            self._marginals = self._certify(self._f, self._g)[1:]
        rows, cols = self._marginals
        rows, cols = rows.to(self._f.dtype), cols.to(self._f.dtype)
        if self._sizes is not None:  # a ragged batch: one tensor per problem
            return _split(rows, self._sizes[0]), _split(cols, self._sizes[1])
        return self._unb(rows), self._unb(cols)

    @property
    def marginal_a(self):
        return self.marginals[0]

    @property
    def marginal_b(self):
        return self.marginals[1]

    def _apply(self, V, name, side):
        if self._sizes is not None:
            raise NotImplementedError(
                "plan products of a ragged batch are not implemented (barycentric_map is)"
            )
        p = self._prob
        n = p.Y.shape[1] if side == "x" else p.X.shape[1]
        if not isinstance(V, torch.Tensor):
            V = torch.as_tensor(V, dtype=p.X.dtype, device=p.X.device)
        Vb, squeeze = self._batch(V)
        if Vb.dim() != 3 or Vb.shape[1] != n or Vb.shape[0] != p.X.shape[0]:
            raise ValueError(
                f"{name} must have {n} rows ({n},), ({n}, K) or batched; got {tuple(V.shape)}"
            )
        if side == "x":
            # the potentials as guesses of the passes' results (the sm_90 kernel's shift)
            _, lse2, vbar = p.sm_x(
                self._g, self.eps, 1.0, v=Vb.to(p.Y.dtype), want_lse=True, guess=self._f
            )
            w = p.a * torch.exp((self._f - p.cx) / self.eps + LN2 * lse2)
        else:
            _, lse2, vbar = p.sm_y(
                self._f, self.eps, 1.0, v=Vb.to(p.X.dtype), want_lse=True, guess=self._g
            )
            w = p.b * torch.exp((self._g - p.cy) / self.eps + LN2 * lse2)
        out = vbar * w[..., None]
        return self._unb(out[..., 0] if squeeze else out)

    def apply(self, V: torch.Tensor) -> torch.Tensor:
        """``P @ V`` for V of shape (M,), (M, K) (or (B, M[, K])), streaming, no N x M buffer."""
        return self._apply(V, "V", "x")

    def apply_transpose(self, U: torch.Tensor) -> torch.Tensor:
        """``P^T @ U`` for U of shape (N,), (N, K) (or batched), streaming."""
        return self._apply(U, "U", "y")

    def barycentric_map(self) -> torch.Tensor:
        """``T(x_i) = (P Y)_i / (P 1)_i``, shape like x (in feature space for cosine)."""
        p = self._prob
        _, _, ybar = p.sm_x(self._g, self.eps, 1.0, v=p.Y, guess=self._f)
        if self._sizes is not None:
            return _split(ybar, self._sizes[0])
        return self._unb(ybar)

    def dense_plan(self, max_entries: int | None = PLAN_MAX_ENTRIES) -> torch.Tensor:
        """The dense plan (allocates B x N x M); ``max_entries=None`` lifts the guard."""
        p = self._prob
        if self._sizes is not None:
            raise NotImplementedError("a ragged batch has no dense (B, N, M) plan")
        B, N, M = p.X.shape[0], p.X.shape[1], p.Y.shape[1]
        if max_entries is not None and B * N * M > max_entries:
            raise ValueError(
                f"the dense plan has {B * N * M} entries > max_entries={max_entries}: use "
                "lazy_plan / apply(V) (streaming), or dense_plan(max_entries=None) on purpose"
            )
        P = p.dense_plan(self._f, self._g, self.eps)
        return self._unb(P)


def _split(t, sizes):
    """A concatenated ``(1, sum sizes, ...)`` tensor as a list per problem."""
    return list(torch.split(t[0], list(sizes)))
