"""Tiled clouds, the grid cells of the coarse levels, and the bound that lets a
block-sparse pass skip a pair of tiles (the multiscale backend; docs/design/flashsinkhorn.md,
"Multiscale").

- A *tile* is ``TILE`` consecutive points of a cloud ordered by a balanced k-d tree
  (median splits along the widest axis, every leaf ``TILE`` points but the last): compact
  boxes, the blocks of the kernels. The tiles are grouped ``GROUP`` by ``GROUP`` (subtrees
  of the k-d tree) into a tree whose top has at most ``TOP`` nodes, used to find the tile
  pairs worth computing without looking at all of them. (Morton runs and k-means clusters
  made worse tiles: 3.5x and 1.5x more kept scores, design note.)
- A *cell* of side ``h = side * 2^(shift - bits)`` is the set of points sharing the high
  bits of their Morton (Z-order) codes on the grid over both clouds' bounding cube: the
  clusters of the coarse levels (GeomLoss's ``grid_cluster``, its ``cluster_scale``), each
  represented by its weighted centroid and mass. A coarse level is itself a tiled cloud.

The bound (derived in the design note). For the cost ``s |x - y|^2``, potentials written
per node as ``f_i = alpha_I + <beta_I, x_i - c_I> + e_i`` with ``|e_i| <= rho_I`` and
``|x_i - c_I| <= r_I`` (likewise ``g``), every exponent of the pair of nodes (I, J),
``E_ij = f_i + g_j - s |x_i - y_j|^2``, is at most :func:`pair_bound`; the plan's mass on
the pair is then at most ``A_I B_J exp(E_max / eps)``.
"""

from __future__ import annotations

import math

import torch

from flashsinkhorn import _config

__all__ = [
    "SortedCloud",
    "kd_order",
    "sort_clouds",
    "coarse_cloud",
    "cell_index",
    "fit_potential",
    "pair_bound",
    "KeepSet",
    "keep_set",
]


# ----------------------------------------------------------------------------------------
# Morton order
# ----------------------------------------------------------------------------------------


def morton_bits(d: int) -> int:
    """Bits per coordinate of the codes: 63 bits in all, at most 21 per coordinate."""
    return max(1, min(21, 63 // d))


def morton_codes(pts, lo, side, bits):
    """Z-order codes (int64) of ``pts`` (n, D) on the grid of ``2^bits`` cells per axis
    over the cube ``[lo, lo + side]^D`` (float64 arithmetic: exact cell indices)."""
    n, d = pts.shape
    q = ((pts.double() - lo) * ((1 << bits) / side)).floor().clamp_(0, (1 << bits) - 1)
    q = q.to(torch.int64).t().contiguous()
    table = _spread_table(d, pts.device)
    code = torch.zeros(n, dtype=torch.int64, device=pts.device)
    for k in range(d):  # bit b of axis k goes to position b * D + k, a byte at a time
        for byte in range(0, bits, 8):
            code |= table[(q[k] >> byte) & 255] << (byte * d + k)
    return code


def _spread_table(d, device):
    """``table[v]``: the 8 bits of v spread to positions 0, d, 2d, ... (int64)."""
    v = torch.arange(256, dtype=torch.int64)
    out = torch.zeros(256, dtype=torch.int64)
    for bit in range(8):
        out |= ((v >> bit) & 1) << (bit * d)
    return out.to(device)


# ----------------------------------------------------------------------------------------
# sorted clouds and tiles
# ----------------------------------------------------------------------------------------


class SortedCloud:
    """One cloud of one problem of the batch, in tile order.

    ``pts`` (n, D) and ``w`` (n,) in tile order (a balanced k-d tree's leaves); ``order``
    (n,): the index in the caller's order of each of them; ``codes`` (n,): the Morton codes
    of the caller's points, in the caller's order (at a coarse level: the keys of its
    cells, sorted, which is that level's order); ``shift``: how many low bits per axis the
    codes dropped (0 at the fine level). Padded to ``npad`` (a multiple of TILE) for the
    kernels: ``pts_pad`` repeats the last point, ``w_pad`` is 0 there. Tile geometry
    (float64, over each tile's points of positive weight, or all of them where none has):
    ``center`` (K, D), ``radius`` (K,), ``mass`` (K,); the tree above the tiles: ``tree``
    (list of (center, radius, mass, count), top last).
    """

    def __init__(self, pts, w, order, codes, shift, bits, lo, side):
        self.pts, self.w, self.order, self.codes = pts, w, order, codes
        self.shift, self.bits, self.lo, self.side = shift, bits, lo, side
        self.n, self.d = pts.shape
        T = _config.MULTISCALE_TILE
        self.K = -(-self.n // T)
        self.npad = self.K * T
        pad = self.npad - self.n
        self.pts_pad = torch.cat([pts, pts[-1:].expand(pad, -1)]) if pad else pts
        self.w_pad = torch.cat([w, w.new_zeros(pad)]) if pad else w
        self.valid = torch.arange(self.npad, device=pts.device) < self.n
        self._geometry()

    @property
    def h(self) -> float:
        """Side of the level's cells (0 at the fine level: points are not cells)."""
        return 0.0 if self.shift == 0 else self.side * 2.0 ** (self.shift - self.bits)

    def active(self):
        """(K, T) mask of the points each tile's bounds cover: positive weight, or every
        real point of a tile without one (its mass is 0: its bounds only steer the pass)."""
        T = _config.MULTISCALE_TILE
        pos = (self.w_pad > 0).view(self.K, T)
        real = self.valid.view(self.K, T)
        return torch.where(pos.any(1, keepdim=True), pos, real)

    def _geometry(self):
        T = _config.MULTISCALE_TILE
        act = self.active()
        P = self.pts_pad.double().view(self.K, T, self.d)
        cnt = act.sum(1, keepdim=True).double()
        c = (P * act[..., None]).sum(1) / cnt
        r = torch.where(act, (P - c[:, None, :]).norm(dim=-1), torch.zeros((), dtype=P.dtype))
        self.center, self.radius = c, r.amax(1)
        self.mass = self.w_pad.double().view(self.K, T).sum(1)
        self.count = cnt[:, 0]
        self.tree = [(self.center, self.radius, self.mass, self.count)]
        while self.tree[-1][0].shape[0] > _config.MULTISCALE_TOP:
            self.tree.append(_group_geometry(*self.tree[-1]))

    def sorted_values(self, v_user):
        """Per-point values (n,) or (n, k) of the caller's order, sorted and padded (the
        padding repeats the last point's value)."""
        v = v_user[self.order]
        pad = self.npad - self.n
        return torch.cat([v, v[-1:].expand(pad, *v.shape[1:])]) if pad else v

    def user_values(self, v_sorted):
        """Inverse of :meth:`sorted_values` (the padding dropped)."""
        out = torch.empty_like(v_sorted[: self.n])
        out[self.order] = v_sorted[: self.n]
        return out


def _group_geometry(center, radius, mass, count):
    """The next tree level: GROUP consecutive nodes per group; radius bounds every child
    ball (``max |c_child - c| + r_child``)."""
    G = _config.MULTISCALE_GROUP
    k = center.shape[0]
    kg = -(-k // G)
    idx = torch.arange(kg * G, device=center.device).clamp_max(k - 1).view(kg, G)
    real = (torch.arange(kg * G, device=center.device) < k).view(kg, G)
    cnt = torch.where(real, count[idx], torch.zeros((), dtype=count.dtype))
    c = (center[idx] * cnt[..., None]).sum(1) / cnt.sum(1, keepdim=True).clamp_min(1)
    reach = (center[idx] - c[:, None, :]).norm(dim=-1) + radius[idx]
    r = torch.where(real, reach, torch.zeros((), dtype=reach.dtype)).amax(1)
    m = torch.where(real, mass[idx], torch.zeros((), dtype=mass.dtype)).sum(1)
    return c, r, m, cnt.sum(1)


def kd_order(pts, T):
    """The order of the leaves of a balanced k-d tree over ``pts`` (n, D): each segment of
    more than T points is sorted along its widest axis and split after ``T * ceil(t / 2)``
    points (t its tiles), so every leaf but the last holds T points and starts at a multiple
    of T. log2(n / T) rounds of two stable sorts."""
    n, d = pts.shape
    dev = pts.device
    order = torch.arange(n, device=dev)
    start = torch.zeros(n, dtype=torch.bool, device=dev)
    start[0] = True
    P = pts.detach().float()
    while True:
        seg = torch.cumsum(start.long(), 0) - 1
        starts = torch.nonzero(start)[:, 0]
        cnt = torch.diff(starts, append=torch.tensor([n], device=dev))
        if int(cnt.max()) <= T:
            return order
        Q = P[order]
        nseg = starts.numel()
        idx = seg[:, None].expand(-1, d)
        lo = torch.full((nseg, d), math.inf, device=dev).scatter_reduce(0, idx, Q, "amin")
        hi = torch.full((nseg, d), -math.inf, device=dev).scatter_reduce(0, idx, Q, "amax")
        axis = (hi - lo).argmax(1)
        coord = Q.gather(1, axis[seg][:, None])[:, 0]
        o1 = torch.argsort(coord, stable=True)
        order = order[o1[torch.argsort(seg[o1], stable=True)]]
        tiles = (cnt + T - 1) // T
        split = cnt > T
        start = start.clone()
        start[(starts + T * ((tiles + 1) // 2))[split]] = True


def _cloud(pts, w, codes, shift, bits, lo, side):
    """A tiled cloud of points given in their caller's order."""
    order = kd_order(pts, _config.MULTISCALE_TILE)
    return SortedCloud(
        pts=pts[order],
        w=w[order],
        order=order,
        codes=codes,
        shift=shift,
        bits=bits,
        lo=lo,
        side=side,
    )


def sort_clouds(x, y, a, b):
    """The two fine clouds of one problem ``x (N, D), y (M, D), a (N,), b (M,)``, tiled,
    with their Morton codes on the common bounding cube: ``(SortedCloud x, SortedCloud y)``."""
    d = x.shape[1]
    bits = morton_bits(d)
    lo = torch.minimum(x.detach().amin(0), y.detach().amin(0)).double()
    hi = torch.maximum(x.detach().amax(0), y.detach().amax(0)).double()
    side = float((hi - lo).max()) * (1 + 2.0**-20) or 1.0  # a point cloud of one position
    out = []
    for p, w in ((x, a), (y, b)):
        codes = morton_codes(p.detach(), lo, side, bits)
        out.append(_cloud(p.detach(), w, codes, 0, bits, lo, side))
    return tuple(out)


def coarse_cloud(fine: SortedCloud, shift: int) -> SortedCloud:
    """The cells of side ``side * 2^(shift - bits)`` of a fine cloud as a tiled cloud:
    weighted centroids (plain means for cells of zero mass) and masses; its caller's order
    is the order of the cells' Morton keys."""
    keys = fine.codes[fine.order] >> (fine.d * (shift - fine.shift))  # in tile order
    keys_u, inv, cnt = torch.unique(keys, return_inverse=True, return_counts=True)
    k, dev = keys_u.shape[0], fine.pts.device
    dt = torch.float64
    m = torch.zeros(k, dtype=dt, device=dev).index_add_(0, inv, fine.w.to(dt))
    wsum = torch.zeros(k, fine.d, dtype=dt, device=dev)
    wsum.index_add_(0, inv, fine.pts.to(dt) * fine.w.to(dt)[:, None])
    psum = torch.zeros(k, fine.d, dtype=dt, device=dev).index_add_(0, inv, fine.pts.to(dt))
    c = torch.where((m > 0)[:, None], wsum / m.clamp_min(1e-300)[:, None], psum / cnt[:, None])
    return _cloud(
        c.to(fine.pts.dtype), m.to(fine.w.dtype), keys_u, shift, fine.bits, fine.lo, fine.side
    )


def cell_index(child: SortedCloud, parent: SortedCloud):
    """For each point of ``child`` (a finer level of the same cloud), in the child's caller
    order, the index (in the parent's caller order) of the parent cell that contains it."""
    keys = child.codes >> (child.d * (parent.shift - child.shift))
    return torch.searchsorted(parent.codes, keys)


# ----------------------------------------------------------------------------------------
# potentials per node: an affine model and its residual bound
# ----------------------------------------------------------------------------------------


def fit_potential(cloud: SortedCloud, f_pad):
    """Per tile, ``f_i = alpha + <beta, x_i - c> + e_i`` with ``|e_i| <= rho`` over the
    tile's active points (float64): least-squares slope (ridge-regularized: duplicated or
    coplanar points), then the residual's midrange and half-range. Returns a list, one
    ``(alpha, beta, rho)`` per tree level (tiles first): each level's bounds hold for every
    point below it."""
    T, K, d = _config.MULTISCALE_TILE, cloud.K, cloud.d
    act = cloud.active()
    P = cloud.pts_pad.double().view(K, T, d) - cloud.center[:, None, :]
    F = f_pad.double().view(K, T)
    am = act.double()
    cnt = am.sum(1)
    fbar = (F * am).sum(1) / cnt
    Pa = P * am[..., None]
    cov = Pa.transpose(1, 2) @ P  # (K, d, d)
    rhs = (Pa * (F - fbar[:, None])[..., None]).sum(1)  # (K, d)
    lam = 1e-9 * cov.diagonal(dim1=1, dim2=2).sum(-1) + 1e-300
    eye = torch.eye(d, dtype=cov.dtype, device=cov.device)
    beta = torch.linalg.solve(cov + lam[:, None, None] * eye, rhs[..., None])[..., 0]
    beta = torch.where(torch.isfinite(beta), beta, torch.zeros_like(beta))
    e = F - (P * beta[:, None, :]).sum(-1)
    big = torch.tensor(float("inf"), dtype=e.dtype, device=e.device)
    hi = torch.where(act, e, -big).amax(1)
    lo = torch.where(act, e, big).amin(1)
    fits = [((hi + lo) / 2, beta, (hi - lo) / 2)]
    for lvl in range(1, len(cloud.tree)):
        fits.append(_group_fit(cloud.tree[lvl - 1], cloud.tree[lvl], fits[-1]))
    return fits


def _group_fit(child_geo, geo, child_fit):
    """A group's affine model bounding its children's: slope the children's mean (weighted
    by their point counts), offset and residual from the children's ranges (every child
    model differs from the group's by an affine function, bounded on the child's ball)."""
    G = _config.MULTISCALE_GROUP
    cc, cr, _, ccount = child_geo
    c = geo[0]
    alpha, beta, rho = child_fit
    k = cc.shape[0]
    kg = c.shape[0]
    idx = torch.arange(kg * G, device=c.device).clamp_max(k - 1).view(kg, G)
    real = (torch.arange(kg * G, device=c.device) < k).view(kg, G)
    w = torch.where(real, ccount[idx], torch.zeros((), dtype=ccount.dtype))
    bg = (beta[idx] * w[..., None]).sum(1) / w.sum(1, keepdim=True).clamp_min(1)
    off = alpha[idx] + (bg[:, None, :] * (c[:, None, :] - cc[idx])).sum(-1)
    # child model at x: alpha_t + <beta_t, x - c_t>; group model: alpha_G + <bg, x - c>
    # difference: (alpha_t + <bg, c - c_t>) - alpha_G + <beta_t - bg, x - c_t>
    slack = (beta[idx] - bg[:, None, :]).norm(dim=-1) * cr[idx] + rho[idx]
    big = torch.tensor(float("inf"), dtype=off.dtype, device=off.device)
    hi = torch.where(real, off + slack, -big).amax(1)
    lo = torch.where(real, off - slack, big).amin(1)
    return (hi + lo) / 2, bg, (hi - lo) / 2


# ----------------------------------------------------------------------------------------
# the pair bound
# ----------------------------------------------------------------------------------------


def pair_bound(ci, ri, fi, cj, rj, gj, s):
    """Upper bound of ``f_i + g_j - s |x_i - y_j|^2`` over node pairs (elementwise over the
    pairs: centers (P, D), radii (P,), fits ``(alpha, beta, rho)`` (P,), (P, D), (P,)).

    With ``D = c_I - c_J``, ``u = beta_I - 2 s D``, ``v = beta_J + 2 s D``, ``R = r_I + r_J``
    and ``base = alpha_I + alpha_J + rho_I + rho_J - s |D|^2``, the minimum of four bounds
    (design note): ``base + |u| r_I + |v| r_J``; ``base + |beta_I + beta_J| r_J + phi(|u|)``
    and its mirror; and the ball bound ``fmax_I + gmax_J - s (|D| - R)_+^2`` with
    ``phi(t) = max_{|w| <= R} (t |w| - s |w|^2)``.
    """
    a_i, b_i, p_i = fi
    a_j, b_j, p_j = gj
    D = ci - cj
    dist = D.norm(dim=-1)
    R = ri + rj
    u = (b_i - 2 * s * D).norm(dim=-1)
    v = (b_j + 2 * s * D).norm(dim=-1)
    uv = (b_i + b_j).norm(dim=-1)
    base = a_i + a_j + p_i + p_j - s * dist * dist

    def phi(t):
        return torch.where(t <= 2 * s * R, t * t / (4 * s), t * R - s * R * R)

    e = torch.minimum(base + u * ri + v * rj, base + uv * rj + phi(u))
    e = torch.minimum(e, base + uv * ri + phi(v))
    fmax = a_i + p_i + b_i.norm(dim=-1) * ri
    gmax = a_j + p_j + b_j.norm(dim=-1) * rj
    gap = (dist - R).clamp_min(0)
    return torch.minimum(e, fmax + gmax - s * gap * gap)


# ----------------------------------------------------------------------------------------
# the keep set: tile pairs whose mass bound exceeds tau times their product mass
# ----------------------------------------------------------------------------------------


class KeepSet:
    """The tile pairs a block-sparse pass computes, both ways.

    ``rows`` (P,), ``cols`` (P,) int64 sorted by row then column; ``row_ptr`` (K+1,) and
    ``col_ptr`` (L+1,), ``by_col`` (P,): the permutation of the pairs sorted by column (the
    column pass). ``rate_row`` (K,), ``rate_col`` (L,) (float64): for each row tile, a bound
    of ``sum_{j skipped} b_j exp((f_i + g_j - C_ij) / eps)`` valid for every row i of the
    tile (so the skipped mass of row i is at most ``a_i rate_row[I]``); likewise columns.
    """

    def __init__(self, rows, cols, K, L, rate_row, rate_col):
        self.rows, self.cols = rows, cols
        self.K, self.L = K, L
        dev = rows.device
        self.row_ptr = _ptr(rows, K, dev)
        self.by_col = torch.sort(cols * K + rows).indices  # stable order for the col pass
        self.col_ptr = _ptr(cols[self.by_col], L, dev)
        self.rows_by_col = rows[self.by_col]
        self.rate_row, self.rate_col = rate_row, rate_col

    @property
    def pairs(self) -> int:
        return int(self.rows.shape[0])


def _ptr(sorted_idx, k, dev):
    counts = torch.bincount(sorted_idx, minlength=k)
    ptr = torch.zeros(k + 1, dtype=torch.int64, device=dev)
    ptr[1:] = torch.cumsum(counts, 0)
    return ptr


def keep_set(xc: SortedCloud, fx, yc: SortedCloud, gy, eps, s, log_tau, chunk=1 << 22):
    """Tile pairs of ``xc`` x ``yc`` to compute at temperature ``eps``: top-down through the
    trees, a pair of nodes is refined (its children pairs examined) unless its exponent
    bound is at most ``eps * log_tau`` (``log_tau = -inf``: nothing is skipped). Each row
    node keeps its best pair and each column node its best (a row of a pass is never
    empty). ``fx``, ``gy``: :func:`fit_potential` of each side. Returns a :class:`KeepSet`
    with the skipped pairs' rates (float64: the certificate's)."""
    G = _config.MULTISCALE_GROUP
    dev = xc.pts.device
    nl_x, nl_y = len(xc.tree), len(yc.tree)
    lvl = max(nl_x, nl_y) - 1
    thr = eps * log_tau
    rate_r = [
        torch.zeros(xc.tree[k][0].shape[0], dtype=torch.float64, device=dev) for k in range(nl_x)
    ]
    rate_c = [
        torch.zeros(yc.tree[k][0].shape[0], dtype=torch.float64, device=dev) for k in range(nl_y)
    ]
    lx, ly = min(lvl, nl_x - 1), min(lvl, nl_y - 1)  # each tree stops at its own top
    I = torch.arange(xc.tree[lx][0].shape[0], device=dev)
    J = torch.arange(yc.tree[ly][0].shape[0], device=dev)
    I, J = I.repeat_interleave(J.shape[0]), J.repeat(I.shape[0])
    while True:
        keep = torch.empty(I.shape[0], dtype=torch.bool, device=dev)
        for lo in range(0, I.shape[0], chunk):  # memory: a few float64 arrays per pair
            sl = slice(lo, lo + chunk)
            i, j = I[sl], J[sl]
            E = _bound_at(xc, fx, lx, i, yc, gy, ly, j, s)
            mi, mj = xc.tree[lx][2][i], yc.tree[ly][2][j]
            keep[sl] = _decide(
                E, mi, mj, thr, i, j, xc.tree[lx][0].shape[0], yc.tree[ly][0].shape[0]
            )
            skip = ~keep[sl]
            if bool(skip.any()):
                dens = torch.exp(E[skip] / eps)
                rate_r[lx].index_add_(0, i[skip], dens * mj[skip])
                rate_c[ly].index_add_(0, j[skip], dens * mi[skip])
        I, J = I[keep], J[keep]
        if lx == 0 and ly == 0:
            break
        # refine: the level above the tiles descends on the side that has levels left
        down_x, down_y = lx >= ly and lx > 0, ly >= lx and ly > 0
        I, J = _children(
            I,
            J,
            G,
            xc.tree[lx - 1][0].shape[0] if down_x else None,
            yc.tree[ly - 1][0].shape[0] if down_y else None,
        )
        lx, ly = lx - int(down_x), ly - int(down_y)
    # a safety net: by induction every tile keeps a pair (its parent's best pair has a
    # child with mass), but a NaN bound would drop it
    I, J = _cover(I, J, xc, fx, yc, gy, s)
    order = torch.argsort(I * yc.K + J)
    I, J = I[order], J[order]
    rr = _push_down(rate_r, xc, G)
    rc = _push_down(rate_c, yc, G)
    return KeepSet(I, J, xc.K, yc.K, rr, rc)


def _bound_at(xc, fx, lx, i, yc, gy, ly, j, s):
    cx_, rx_, _, _ = xc.tree[lx]
    cy_, ry_, _, _ = yc.tree[ly]
    ax, bx, px = fx[lx]
    ay, by, py = gy[ly]
    return pair_bound(
        cx_[i], rx_[i], (ax[i], bx[i], px[i]), cy_[j], ry_[j], (ay[j], by[j], py[j]), s
    )


def _decide(E, mi, mj, thr, i, j, ki, kj):
    """Keep a pair whose bound exceeds ``thr`` (both nodes carrying mass), each row node's
    best pair among columns with mass and each column node's best among rows with mass
    (so no row or column of a pass is left without a term that counts)."""
    ninf = torch.tensor(float("-inf"), dtype=E.dtype, device=E.device)
    keep = (E > thr) & (mi > 0) & (mj > 0)
    for idx, k, other in ((i, ki, mj), (j, kj, mi)):
        Em = torch.where(other > 0, E, ninf)
        best = torch.full((k,), float("-inf"), dtype=E.dtype, device=E.device)
        best = best.scatter_reduce(0, idx, Em, "amax")
        keep |= (Em >= best[idx]) & (best[idx] > ninf)
    return keep


def _children(I, J, G, kx, ky):
    """Children pairs of node pairs: each side descends one level where its ``k`` (the
    number of nodes below) is given, else stays."""
    if kx is not None:
        a = torch.arange(G, device=I.device)
        I = (I[:, None] * G + a).reshape(-1)
        J = J.repeat_interleave(G)
        ok = I < kx
        I, J = I[ok], J[ok]
    if ky is not None:
        b = torch.arange(G, device=J.device)
        J = (J[:, None] * G + b).reshape(-1)
        I = I.repeat_interleave(G)
        ok = J < ky
        I, J = I[ok], J[ok]
    return I, J


def _cover(I, J, xc, fx, yc, gy, s):
    """Add, for every tile without a kept pair on a side, its best pair (largest bound
    among the other side's tiles with mass)."""
    dev = I.device
    for side in (0, 1):
        k = xc.K if side == 0 else yc.K
        have = torch.zeros(k, dtype=torch.bool, device=dev)
        have[I if side == 0 else J] = True
        miss = (~have).nonzero()[:, 0]
        if miss.numel() == 0:
            continue
        other_mass = yc.mass if side == 0 else xc.mass
        other = torch.arange(other_mass.numel(), device=dev)
        mi, oj = miss.repeat_interleave(other.numel()), other.repeat(miss.numel())
        if side == 0:
            E = _bound_at(xc, fx, 0, mi, yc, gy, 0, oj, s)
        else:
            E = _bound_at(xc, fx, 0, oj, yc, gy, 0, mi, s)
        E = torch.nan_to_num(E, nan=float("-inf")).view(miss.numel(), other.numel())
        E = torch.where(other_mass > 0, E, torch.tensor(float("-inf"), dtype=E.dtype, device=dev))
        best = E.argmax(1)
        if side == 0:
            I, J = torch.cat([I, miss]), torch.cat([J, best])
        else:
            I, J = torch.cat([I, best]), torch.cat([J, miss])
    return I, J


def _push_down(rates, cloud, G):
    """Per-tile rates: each level's skipped rate added to every tile below the node."""
    r = rates[-1]
    for lvl in range(len(rates) - 2, -1, -1):
        k = rates[lvl].shape[0]
        r = rates[lvl] + r.repeat_interleave(G)[:k]
    return r


def log_tau(truncate) -> float:
    """GeomLoss's ``truncate`` (the kernel's support in standard deviations) as the log
    density threshold of a skipped pair: ``-truncate^2 / 2``; None: skip nothing."""
    return -math.inf if truncate is None else -0.5 * float(truncate) ** 2
