"""The multiscale backend: a coupling problem whose passes skip the tile pairs that a bound
proves negligible, a ladder of coarse cell clouds for the eps schedule, and a certificate
that stays an upper bound of the true marginal error.

For clouds in few dimensions and a small blur, most of the n x m plan is numerically zero:
at temperature eps the plan's density between points at distance t is at most
``exp(-(s t^2 - f_i - g_j) / eps)``. :class:`MultiscaleProblem` sorts both clouds along a
Morton curve (``_multiscale_tiles``), cuts them into tiles of 64 points, and computes a
pass only over the tile pairs whose mass bound (from the tiles' radii and an affine model
of the current potentials) exceeds ``exp(-truncate^2 / 2)`` times their product mass
(GeomLoss's ``truncate``: the kernel's support in standard deviations).

Its operations are the ones every coupling problem supplies to the Sinkhorn loop (``sm_x``,
``sm_y``, ``sym_update``, ``self_update``, ``total``), plus the ladder: :meth:`stage_levels`
maps each temperature of the eps schedule to a cloud of grid cells of side at most the
kernel's width ``sqrt(eps / 2s)`` (GeomLoss's ``cluster_scale`` is the finest side),
:meth:`at_level` gives the coupling problem of those cells, and :meth:`prolong` carries
potentials from a coarse level to a finer one (a first-order expansion of the coarse
c-transform around each cell centroid, whose gradient is ``2 s (c - T(c))`` with ``T`` the
coarse plan's barycentric map).

:meth:`certificate` is the float64 upper bound of the L1 marginal error (docs/flashsinkhorn.md,
"Multiscale"): computed pairs summed in float64, skipped pairs entered at their mass bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from flashsinkhorn import _config
from flashsinkhorn import _multiscale_pass as passes
from flashsinkhorn._multiscale_tiles import (
    SortedCloud,
    cell_index,
    coarse_cloud,
    fit_potential,
    keep_set,
    log_tau,
    sort_clouds,
)
from flashsinkhorn.problem import Problem
from flashsinkhorn.reference import LN2, damping_factor

__all__ = ["MultiscaleProblem", "MAX_DIM", "auto_reason"]

# Morton codes of D coordinates keep 63 / D bits each, and the bound's slack grows with
# the tiles' radii, which shrink like n^(-1/D): past a few dimensions every pair is kept
MAX_DIM = 8
# backend="auto" picks the multiscale problem for clouds of at most this many coordinates
AUTO_MAX_DIM = 3
# a keep set is recomputed at every new eps and after this many passes at one eps
REFRESH = 4
# the default finest cells: the smallest grid whose cells hold this many points on average
CELL_POINTS = 2


@dataclass(kw_only=True)
class MultiscaleProblem(Problem):
    """A :class:`flashsinkhorn.problem.Problem` whose passes skip negligible tile pairs.

    The cost is ``(c2 / 2) |X - Y|^2`` on the features (``cost="sqeuclidean"``: the points,
    ``c2 = 2 cost_scale``; ``"cosine"``: the unit rows, ``c2 = cost_scale``), computed from
    coordinate differences: ``cx``, ``cy`` are zero here (the streaming primitives'
    convention for ``lse2`` with ``cx = 0``), ``center`` is not used.

    ``truncate``: a tile pair is skipped when its mass bound is below
    ``exp(-truncate^2 / 2)`` times its product mass (None: nothing is skipped).
    ``cluster_scale``: side of the finest cells of the ladder (None: the smallest grid whose
    cells hold 2 points on average). ``backend``: "triton" (CUDA, or CPU under
    ``TRITON_INTERPRET=1``) or "torch". ``parts``: the sorted clouds of each problem when
    already built (coarse levels, self problems).
    """

    kind: ClassVar[str] = "multiscale"
    exact: ClassVar[bool] = True
    # its passes are planned from the potentials (the bound): it always anneals, GeomLoss's
    # ratio unless the caller gives one
    default_scaling: ClassVar[float | None] = 0.5

    backend: str = "torch"
    truncate: float | None = 5.0
    cluster_scale: float | None = None
    parts: list | None = field(default=None, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.cost not in ("sqeuclidean", "cosine") or self.labels is not None:
            raise ValueError(
                "backend='multiscale' computes costs that are squared distances of the "
                f"features (cost 'sqeuclidean' or 'cosine', no label_cost); got cost="
                f"{self.cost!r}{' with label_cost' if self.labels is not None else ''}"
            )
        if self.X.shape[-1] > MAX_DIM:
            raise ValueError(
                f"backend='multiscale' takes points of at most {MAX_DIM} coordinates; got "
                f"D={self.X.shape[-1]}: use backend='auto'"
            )
        x, y, a, b = self.X.detach(), self.Y.detach(), self.a, self.b
        self.is_self = self.Y is self.X and self.b is self.a
        self.cx = torch.zeros_like(self.cx)
        self.cy = torch.zeros_like(self.cy)
        self.scale = 0.5 * float(self.c2)  # the cost is scale |X - Y|^2
        self.log_tau = log_tau(self.truncate)
        if self.parts is None:
            self.parts = []
            for k in range(x.shape[0]):
                if self.is_self:
                    xc = sort_clouds(x[k], x[k], a[k], a[k])[0]
                    self.parts.append((xc, xc))
                else:
                    self.parts.append(sort_clouds(x[k], y[k], a[k], b[k]))
        self._keeps = [None] * len(self.parts)  # per problem: [eps, passes, KeepSet]
        self._levels = {}  # coarse problems by their cell shifts

    # -- what the loop needs besides the passes --------------------------------------------

    @property
    def kernel_family(self) -> str:
        """ "triton" or "torch": the kernels of the passes (and of a double backward's plan)."""
        return self.backend

    def with_precision(self, precision):
        """The passes have one precision (exact float32 differences): this problem."""
        return self

    def self_problem(self, side):
        """The problem of one cloud against itself (debiasing), sharing its sorted cloud."""
        X, w = (self.X, self.a) if side == "x" else (self.Y, self.b)
        c = self.cx if side == "x" else self.cy
        i = 0 if side == "x" else 1
        return MultiscaleProblem(
            X=X,
            Y=X,
            a=w,
            b=w,
            cx=c,
            cy=c,
            c2=self.c2,
            cost=self.cost,
            cost_scale=self.cost_scale,
            precision=self.precision,
            backend=self.backend,
            truncate=self.truncate,
            cluster_scale=self.cluster_scale,
            parts=[(p[i], p[i]) for p in self.parts],
        )

    def cost_bound(self):
        """``(B,)`` bound on the cost: ``scale`` times the squared diagonal of each
        problem's bounding cube."""
        sides = [p[0].side ** 2 * p[0].d for p in self.parts]
        return self.scale * torch.tensor(sides, dtype=torch.float64, device=self.X.device)

    def dense_cost(self, columns=None):
        """The cost matrix (B, N, M) (tests, small problems)."""
        Y = self.Y if columns is None else columns["Y"]
        return self.scale * torch.cdist(self.X.detach(), Y.detach()) ** 2

    # -- the passes -------------------------------------------------------------------------

    def _keep(self, k, fs, gs, eps):
        """The keep set of problem k for potentials ``fs``, ``gs`` (sorted, padded; None:
        not known) at ``eps``: the cached one while it is fresh (or nothing is known),
        else recomputed."""
        st = self._keeps[k]
        known = fs is not None and gs is not None
        if st is not None and (not known or (st[0] == eps and st[1] < REFRESH)):
            st[1] += 1
            return st[2]
        xc, yc = self.parts[k]
        if known:
            fx, gy = fit_potential(xc, fs), fit_potential(yc, gs)
            lt = self.log_tau
        else:  # nothing known about the potentials: every pair (a first pass only)
            fx = fit_potential(xc, xc.w_pad.new_zeros(xc.npad))
            gy = fit_potential(yc, yc.w_pad.new_zeros(yc.npad))
            lt = -math.inf
        ks = keep_set(xc, fx, yc, gy, eps, self.scale, lt)
        self._keeps[k] = [eps, 1, ks]
        return ks

    def _pass(self, k, side, pot, eps, damping, v, guess):
        """One side's update for problem k: ``(out (n,), lse (n,), vbar)`` in the caller's
        order; side 0 updates f (rows x) from g, side 1 g from f."""
        xc, yc = self.parts[k]
        rc, cc = (xc, yc) if side == 0 else (yc, xc)
        ps = cc.sorted_values(pot)
        gs = None if guess is None else rc.sorted_values(guess)
        ks = self._keep(k, gs, ps, eps) if side == 0 else self._keep(k, ps, gs, eps)
        if side == 0:
            ptr, nbr = ks.row_ptr, ks.cols
        else:
            ptr, nbr = ks.col_ptr, ks.rows_by_col
        bias = torch.log(cc.w_pad.to(ps.dtype)) + ps / eps
        vs = None if v is None else cc.sorted_values(v)
        lse, vbar = passes.softmin_pass(
            rc, cc, ptr, nbr, bias, self.scale / eps, vs, backend=self.backend
        )
        lse = rc.user_values(lse)
        out = (-damping * eps) * lse
        return out, lse, None if vbar is None else rc.user_values(vbar)

    def _batched(self, side, pot, eps, damping, v, guess):
        outs = [
            self._pass(
                k,
                side,
                pot[k],
                eps,
                damping,
                None if v is None else v[k],
                None if guess is None else guess[k],
            )
            for k in range(len(self.parts))
        ]
        n = (self.X if side == 0 else self.Y).shape[1]
        out = torch.stack([_fit_len(o[0], n) for o in outs])
        lse2 = torch.stack([_fit_len(o[1], n) for o in outs]) / LN2
        vbar = None if v is None else torch.stack([_fit_len(o[2], n) for o in outs])
        return out, lse2, vbar

    def sm_x(self, g, eps, damping=1.0, v=None, want_lse=False, guess=None):
        """f-side update ``damping * softmin_j`` over the kept tiles: ``(f (B, N), lse2,
        vbar)`` with ``lse2 = log2 sum_j b_j exp((g_j - C_ij) / eps)`` (the streaming
        primitives' convention with ``cx = 0``) and, with ``v``, the softmax average."""
        return self._batched(0, g, eps, damping, v, guess)

    def sm_y(self, f, eps, damping=1.0, v=None, want_lse=False, guess=None):
        """g-side update (rows = y); ``guess``: the current g."""
        return self._batched(1, f, eps, damping, v, guess)

    def sym_update(self, f, g, eps, damping_x=1.0, damping_y=1.0):
        """Both updates of a symmetric iteration from the old ``(f, g)`` (one keep set)."""
        ft = self.sm_x(g, eps, damping_x, guess=f)[0]
        return ft, self.sm_y(f, eps, damping_y, guess=g)[0]

    def self_update(self, f, eps, damping):
        """The debiasing update of a self-transport problem (x against itself)."""
        return self.sm_x(f, eps, damping, guess=f)[0]

    def sample_rows(self, g, eps, seed, guess=None):
        raise NotImplementedError(
            "sample_plan is not implemented on backend='multiscale' (its passes skip tile "
            "pairs); solve with backend='auto' to sample the plan"
        )

    def pairs(self):
        """Tile pairs of each problem's current keep set (None where none was built)."""
        return [None if st is None else st[2].pairs for st in self._keeps]

    # -- the ladder -------------------------------------------------------------------------

    def stage_levels(self, eps_list):
        """For each temperature of a schedule, the level it runs on: a tuple of cell shifts
        (one per problem of the batch; 0: the points). A stage runs on the coarsest cells
        of side at most the kernel's width ``sqrt(eps / 2s)`` and at least the finest side
        (``cluster_scale``); the last stage always on the points."""
        finest = [self._finest_shift(k) for k in range(len(self.parts))]
        out = []
        for i, e in enumerate(eps_list):
            width = math.sqrt(e / (2.0 * self.scale))
            key = []
            for k, (xc, _) in enumerate(self.parts):
                top = xc.bits  # one cell
                sh = math.floor(math.log2(max(width, 1e-300) / xc.side) + xc.bits)
                sh = min(sh, top)
                key.append(0 if (i == len(eps_list) - 1 or sh < finest[k]) else sh)
            out.append(tuple(key))
        return out

    def _finest_shift(self, k):
        xc, yc = self.parts[k]
        if self.cluster_scale is not None:
            return max(1, math.floor(math.log2(self.cluster_scale / xc.side) + xc.bits))
        for sh in range(1, xc.bits + 1):
            cells = max(_count_cells(xc, sh), _count_cells(yc, sh))
            if cells * CELL_POINTS <= max(xc.n, yc.n):
                return sh
        return xc.bits

    def at_level(self, key):
        """The coupling problem of a level (``key`` from :meth:`stage_levels`): this one for
        the points, else the problem of the cells (their centroids and masses, in Morton
        order; problems of a batch padded with zero-mass copies of their last cell)."""
        if all(sh == 0 for sh in key):
            return self
        if key not in self._levels:
            parts = []
            for k, sh in enumerate(key):
                xc, yc = self.parts[k]
                xk = coarse_cloud(xc, sh) if sh else xc
                yk = xk if self.is_self else (coarse_cloud(yc, sh) if sh else yc)
                parts.append((xk, yk))
            X, A = _stack([p[0] for p in parts])
            if self.is_self:
                Y, Bw = X, A
            else:
                Y, Bw = _stack([p[1] for p in parts])
            self._levels[key] = MultiscaleProblem(
                X=X,
                Y=Y,
                a=A,
                b=Bw,
                cx=A.new_zeros(A.shape),
                cy=Bw.new_zeros(Bw.shape),
                c2=self.c2,
                cost=self.cost,
                cost_scale=self.cost_scale,
                precision=self.precision,
                backend=self.backend,
                truncate=self.truncate,
                parts=parts,
            )
        return self._levels[key]

    def prolong(self, src, dst, f, g, eps, damping_x=1.0, damping_y=1.0):
        """Potentials of level ``src`` carried to the finer level ``dst`` (keys of
        :meth:`stage_levels`): ``F(x) ~ F(c) + kappa 2 s <c - T(c), x - c>`` around the
        centroid c of the coarse cell of x, with ``F`` the coarse c-transform of g at eps
        and T its barycentric map (one coarse pass with V per side). For a self problem
        ``g`` is ignored and ``(f, f)`` comes back."""
        P, Q = self.at_level(src), self.at_level(dst)
        F, _, Tx = P.sm_x(g if not self.is_self else f, eps, damping_x, v=P.Y, guess=f)
        fs = _prolong_side(P, Q, F, Tx, damping_x, 0)
        if self.is_self:
            return fs, fs
        G, _, Ty = P.sm_y(f, eps, damping_y, v=P.X, guess=g)
        return fs, _prolong_side(P, Q, G, Ty, damping_y, 1)

    # -- the certificate --------------------------------------------------------------------

    def float64_certifier(self, eps, rho_x, rho_y, a64=None, b64=None):
        """The loop's certificate: :meth:`certificate` (the dense float64 pass of the other
        backends would cost O(n m))."""

        def certify(f, g):
            return self.certificate(f, g, eps, rho_x, rho_y, a64=a64, b64=b64)

        return certify

    def certificate(self, f, g, eps, rx, ry, a64=None, b64=None):
        """Float64 upper bound of the L1 marginal error of ``(f (B, N), g (B, M))``:
        ``(err (B,), rows (B, N), cols (B, M))``, rows and cols the marginals over the
        computed pairs (lower bounds of the true ones). Balanced: ``err >= |P 1 - a|_1 +
        |P^T 1 - b|_1``; unbalanced: the same residual of the optimality conditions as the
        dense certificate (:func:`flashsinkhorn.result.certificate`). ``a64``, ``b64``: the
        exact float64 weights when they are not the problem's (uniform 1/N)."""
        B = len(self.parts)
        errs, rows, cols = [], [], []
        kx, ky = damping_factor(eps, rx), damping_factor(eps, ry)
        for k in range(B):
            w = (None if a64 is None else a64[k], None if b64 is None else b64[k])
            e, r, c = self._certify_one(k, f[k], g[k], eps, kx, ky, w)
            errs.append(e)
            rows.append(_fit_len(r, self.X.shape[1]))
            cols.append(_fit_len(c, self.Y.shape[1]))
        err = torch.stack(errs)
        err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
        return err, torch.stack(rows), torch.stack(cols)

    def _certify_one(self, k, f, g, eps, kx, ky, w64):
        d = torch.float64
        xc, yc = self.parts[k]
        fs, gs = xc.sorted_values(f.to(d)), yc.sorted_values(g.to(d))
        fx, gy = fit_potential(xc, fs), fit_potential(yc, gs)
        ks = keep_set(xc, fx, yc, gy, eps, self.scale, self.log_tau)
        pts = (xc.pts_pad.to(d), yc.pts_pad.to(d))
        sc = self.scale / eps
        be = self.backend
        wx, wy = (
            c.w_pad.to(d) if w is None else _weights_pad(c, w[: c.n].to(d))
            for c, w in ((xc, w64[0]), (yc, w64[1]))
        )
        lse_r, _ = passes.softmin_pass(
            xc, yc, ks.row_ptr, ks.cols, torch.log(wy) + gs / eps, sc, backend=be, pts=pts
        )
        lse_c, _ = passes.softmin_pass(
            yc,
            xc,
            ks.col_ptr,
            ks.rows_by_col,
            torch.log(wx) + fs / eps,
            sc,
            backend=be,
            pts=pts[::-1],
        )
        # float64's rounding of the exponents (as the dense certificate): every exponent
        # and every bound is known to delta, so the skipped rates grow by e^delta too
        span2 = xc.side**2 * xc.d
        mag = float(fs.abs().max() + gs.abs().max()) + self.scale * span2
        delta = 64 * 2.0**-52 * mag / eps
        T = xc.pts_pad.shape[0] // xc.K
        ex = passes.interval_error(
            wx,
            torch.exp(fs / eps + lse_r),
            ks.rate_row.repeat_interleave(T) * math.exp(delta),
            lambda r, w=wx, fs=fs: (1 - kx) * fs / eps + kx * torch.log(r),
        )
        ey = passes.interval_error(
            wy,
            torch.exp(gs / eps + lse_c),
            ks.rate_col.repeat_interleave(T) * math.exp(delta),
            lambda r, gs=gs: (1 - ky) * gs / eps + ky * torch.log(r),
        )
        err = (ex[: xc.n].sum() + ey[: yc.n].sum()) * math.exp(delta)
        err = err + (wx.sum() + wy.sum()) * math.expm1(delta)
        rows = xc.user_values(wx * torch.exp(fs / eps + lse_r))
        cols = yc.user_values(wy * torch.exp(gs / eps + lse_c))
        return err, rows, cols


def _weights_pad(cloud, w):
    """Weights of the caller's order in the cloud's tile order, zero on the padding."""
    v = cloud.sorted_values(w).clone()
    v[cloud.n :] = 0
    return v


def _fit_len(t, n):
    """A per-point vector of one problem padded (zeros) to the batch's length n."""
    if t.shape[0] == n:
        return t
    pad = t.new_zeros(n - t.shape[0], *t.shape[1:])
    return torch.cat([t, pad])


def _stack(clouds: list[SortedCloud]):
    """Points (B, n_max, D) and weights (B, n_max) of clouds in their caller's order;
    shorter ones padded with zero-weight copies of their last point."""
    n = max(c.n for c in clouds)
    pts, ws = [], []
    for c in clouds:
        p, w = c.user_values(c.pts_pad), c.user_values(c.w_pad)
        pts.append(torch.cat([p, p[-1:].expand(n - c.n, -1)]))
        ws.append(torch.cat([w, w.new_zeros(n - c.n)]))
    return torch.stack(pts), torch.stack(ws)


def _count_cells(cloud: SortedCloud, shift: int) -> int:
    return int(torch.unique(cloud.codes >> (cloud.d * shift)).numel())


def _prolong_side(P, Q, F, T, damping, side):
    """One side of :meth:`MultiscaleProblem.prolong`: for every point of Q's clouds on
    ``side`` (0: x), its coarse cell in P and the expansion of F there (all in the
    levels' caller orders)."""
    s = P.scale
    n = (Q.X if side == 0 else Q.Y).shape[1]
    PX, QX = (P.X, Q.X) if side == 0 else (P.Y, Q.Y)
    out = []
    for k in range(len(P.parts)):
        pc, qc = P.parts[k][side], Q.parts[k][side]
        idx = cell_index(qc, pc) if pc is not qc else torch.arange(qc.n, device=F.device)
        c = PX[k][idx].to(F.dtype)
        grad = (2 * s * damping) * (c - T[k][idx])
        v = F[k][idx] + (grad * (QX[k][: qc.n].to(F.dtype) - c)).sum(-1)
        out.append(_fit_len(v, n))
    return torch.stack(out)


def auto_reason(fields, eps, above_exact):
    """Why ``backend="auto"`` runs the problem of ``fields`` (Problem's keyword fields) at
    temperature ``eps`` on the multiscale backend, or None. ``above_exact``: the exact
    backends' rule chose the streaming problem (past the dense budget) and, on CUDA, the
    scores ``B N M`` reach ``_config.MULTISCALE_MIN_SCORES_CUDA``. Then it does for clouds of
    at most ``AUTO_MAX_DIM`` coordinates, a squared-distance cost without labels, and a
    kernel of width ``sqrt(eps / c2)`` at most ``_config.MULTISCALE_MAX_WIDTH`` times the
    clouds' diameter (one host read)."""
    X, Y = fields["X"], fields["Y"]
    d = X.shape[-1]
    if not above_exact or eps is None or d > AUTO_MAX_DIM:
        return None
    if fields.get("cost", "sqeuclidean") not in ("sqeuclidean", "cosine"):
        return None
    if fields.get("labels") is not None:
        return None
    Xd, Yd = X.detach().reshape(-1, d), Y.detach().reshape(-1, d)
    lo = torch.minimum(Xd.amin(0), Yd.amin(0))
    hi = torch.maximum(Xd.amax(0), Yd.amax(0))
    diameter = float((hi - lo).double().norm())
    width = math.sqrt(eps / float(fields["c2"]))
    if not width <= _config.MULTISCALE_MAX_WIDTH * diameter:
        return None
    return (
        f"{d}-D clouds, kernel width {width:.3g} <= MULTISCALE_MAX_WIDTH of the diameter "
        f"{diameter:.3g}, past the exact backends' dense budget"
    )
