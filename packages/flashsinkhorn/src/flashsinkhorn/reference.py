"""Dense float64 references: the oracle of every kernel, test and benchmark accuracy column.

They build the n x m cost / score / plan matrices, so they are for small problems only.
The solvers import the schedule (:func:`eps_schedule`) and the unbalanced damping
(:func:`damping`) from here too: one definition of the math.

- :func:`cost_matrix_ref`: ``cost_scale * C(x, y)`` (+ label term), as :func:`solve` defines it.
- :func:`softmin_ref`: the streaming c-transform of :func:`flashsinkhorn.softmin`.
- :func:`symmetric_update_ref`: both updates of a symmetric iteration
  (:func:`flashsinkhorn.symmetric_update`).
- :func:`plan_apply_ref`: ``P @ V`` for the squared-Euclidean cost.
- :func:`sinkhorn_ref`: alternating log-domain Sinkhorn, the dual value of :func:`solve`.
- :func:`samples_loss_ref`: GeomLoss's ``SamplesLoss("sinkhorn", p=2)`` (value).
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.4426950408889634  # log2(e): the kernels work in base 2
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------------------
# shared definitions
# ----------------------------------------------------------------------------------------


def damping_factor(eps: float, rho: float | None) -> float:
    """The unbalanced update's factor ``1 / (1 + eps / rho)`` (1 for a balanced side)."""
    return 1.0 if rho is None else 1.0 / (1.0 + eps / rho)


def dual_point_terms(f, a, rho):
    """Per point: ``a_i f_i`` (balanced side) or ``rho a_i (1 - exp(-f_i / rho))``."""
    if rho is None:
        return a * f
    return rho * a * (1.0 - torch.exp(-f / rho))


def dual_terms(f, a, rho):
    """``<a, f>`` (balanced side) or ``rho <a, 1 - exp(-f / rho)>`` (KL-penalized side)."""
    return dual_point_terms(f, a, rho).sum(-1)


def eps_schedule(diameter2: float, eps: float, scaling: float) -> list[float]:
    """GeomLoss's eps-scaling list: ``diameter^2``, geometric steps by ``scaling^2``, ``eps``.

    ``diameter2`` and ``eps`` are in cost units (``diameter^p``, ``blur^p`` with p = 2).
    A diameter below blur (tiny or identical clouds) starts at ``blur^p``: GeomLoss starts
    at ``diameter^p`` there, an eps whose reciprocal overflows float32 (NaN) or, for a zero
    diameter, a numpy error.
    """
    import numpy as np

    if not (0 < scaling < 1):
        raise ValueError(f"scaling must lie in (0, 1); got {scaling}")
    p = 2
    blur = math.sqrt(eps)
    diameter = max(math.sqrt(diameter2), blur)
    return (
        [diameter**p]
        + [
            float(np.exp(e))
            for e in np.arange(p * np.log(diameter), p * np.log(blur), p * np.log(scaling))
        ]
        + [blur**p]
    )


def max_diameter(x, y) -> float:
    """Diagonal of the bounding box of both clouds (GeomLoss's default ``diameter``)."""
    D = x.shape[-1]
    xf, yf = x.reshape(-1, D), y.reshape(-1, D)
    mins = torch.stack((xf.min(dim=0)[0], yf.min(dim=0)[0])).min(dim=0)[0]
    maxs = torch.stack((xf.max(dim=0)[0], yf.max(dim=0)[0])).max(dim=0)[0]
    return (maxs - mins).norm().item()


def parse_rho(rho, name: str = "rho"):
    """KL marginal penalties in cost units: None, a number, or a pair ``(rho_x, rho_y)`` ->
    ``(rho_x, rho_y)`` with None for a balanced side (None or an infinite penalty)."""
    if rho is None:
        return None, None
    if isinstance(rho, (tuple, list)):
        if len(rho) != 2:
            raise ValueError(f"{name} must be a number or a pair ({name}_x, {name}_y); got {rho!r}")
        pair = tuple(rho)
    else:
        pair = (rho, rho)
    out = []
    for r in pair:
        if r is None:
            out.append(None)
            continue
        try:
            r = float(r)
        except (TypeError, ValueError):
            raise ValueError(
                f"{name} must be a positive number, a pair or None; got {r!r}"
            ) from None
        if not (r > 0):  # also rejects NaN
            raise ValueError(f"{name} must be positive (or None for a balanced side); got {r}")
        out.append(None if math.isinf(r) else r)
    return tuple(out)


def rho_from_reach(reach, cost_scale: float):
    """GeomLoss's ``reach`` (a distance; a number or a pair, None or inf: balanced) as the
    KL penalties ``(rho_x, rho_y)`` of the cost ``cost_scale * |x - y|^2``:
    ``rho = 2 * cost_scale * reach**2``. That is GeomLoss's ``rho = reach**p`` for its
    ``SamplesLoss`` cost ``|x - y|^2 / 2`` (cost_scale 1/2) and ``geomloss.ot``'s
    ``rho = 2 reach**2`` for ``|x - y|^2`` (cost_scale 1, the second-order functions)."""
    rx, ry = parse_rho(reach, "reach")
    k = 2.0 * float(cost_scale)
    return (None if rx is None else k * rx * rx), (None if ry is None else k * ry * ry)


# ----------------------------------------------------------------------------------------
# the streaming primitive
# ----------------------------------------------------------------------------------------


def _cost_dense(x, y, cx, cy, c2, labels):
    C = cx[..., :, None] + cy[..., None, :] - c2 * (x @ y.transpose(-1, -2))
    if labels is not None:
        lx, ly, W, w_scale = labels
        C = C + w_scale * W[lx.long()[..., :, None], ly.long()[..., None, :]]
    return C


def softmin_ref(x, y, g, logb, cx, cy, *, eps, c2, damping=1.0, v=None, labels=None):
    """Dense float64 reference of :func:`flashsinkhorn.softmin` (same arguments, batched
    (B, ...) inputs). Returns ``(out, lse2, vbar)`` with ``vbar = None`` when ``v`` is None."""
    d = torch.float64
    x, y, g, logb, cx, cy = (t.to(d) for t in (x, y, g, logb, cx, cy))
    lab = None
    if labels is not None:
        lx, ly, W, w_scale = labels
        lab = (lx, ly, W.to(d), w_scale)
    C = _cost_dense(x, y, cx, cy, c2, lab)
    S = logb[..., None, :] + (g[..., None, :] - C) / eps  # (B, N, M)
    lse = torch.logsumexp(S, dim=-1)
    out = damping * (-eps * lse)
    lse2 = (lse + cx / eps) / LN2  # kernel convention: cx excluded from the scores
    vbar = None
    if v is not None:
        vbar = torch.softmax(S, dim=-1) @ v.to(d)
    return out, lse2, vbar


def symmetric_update_ref(
    x, y, f, g, loga, logb, cx, cy, *, eps, c2, damping_x=1.0, damping_y=1.0, labels=None
):
    """Dense float64 reference of :func:`flashsinkhorn.symmetric_update`: ``(f_new, g_new)``,
    each the c-transform of the other side's old potential (two :func:`softmin_ref`)."""
    lab_t = None
    if labels is not None:
        lx, ly, W, w_scale = labels
        lab_t = (ly, lx, W.transpose(-1, -2), w_scale)
    f_new = softmin_ref(x, y, g, logb, cx, cy, eps=eps, c2=c2, damping=damping_x, labels=labels)[0]
    g_new = softmin_ref(y, x, f, loga, cy, cx, eps=eps, c2=c2, damping=damping_y, labels=lab_t)[0]
    return f_new, g_new


def plan_apply_ref(x, y, a, b, f, g, v, *, eps, cost_scale=1.0):
    """Dense float64 ``P @ V`` for the squared-Euclidean cost ``cost_scale * |x - y|^2``."""
    d = torch.float64
    x, y, a, b, f, g, v = (t.to(d) for t in (x, y, a, b, f, g, v))
    C = cost_scale * torch.cdist(x, y) ** 2
    P = a[..., :, None] * b[..., None, :] * torch.exp((f[..., :, None] + g[..., None, :] - C) / eps)
    return P @ v


# ----------------------------------------------------------------------------------------
# solve() and SamplesLoss
# ----------------------------------------------------------------------------------------


def cost_matrix_ref(x, y, cost="sqeuclidean", cost_scale=1.0, label_cost=None):
    """Dense float64 cost matrix (B, N, M) (or (N, M)), the oracle for tests."""
    x, y = x.double(), y.double()
    if cost == "sqeuclidean":
        C = ((x[..., :, None, :] - y[..., None, :, :]) ** 2).sum(-1)
    elif cost == "cosine":
        xn = x / x.norm(dim=-1, keepdim=True)
        yn = y / y.norm(dim=-1, keepdim=True)
        C = 1.0 - xn @ yn.transpose(-1, -2)
    elif cost == "dot":
        C = -(x @ y.transpose(-1, -2))
    else:
        raise ValueError(f"cost must be 'sqeuclidean', 'cosine' or 'dot'; got {cost!r}")
    C = cost_scale * C
    if label_cost is not None:
        lx, ly, W = label_cost
        C = C + W.double()[lx.long()[..., :, None], ly.long()[..., None, :]]
    return C


def sinkhorn_ref(C, a, b, eps, rho=None, n_iter=2000):
    """Dense float64 log-domain Sinkhorn (alternating). ``C`` (N, M); ``rho``: None
    (balanced), a KL penalty or a pair in cost units (as :func:`flashsinkhorn.solve`);
    returns ``(f, g, value)``. ``value`` uses the same dual formula as ``solve``.
    """
    C, a, b = C.double(), a.double(), b.double()
    rx, ry = parse_rho(rho)
    f = torch.zeros_like(a)
    g = torch.zeros_like(b)
    la, lb = a.log(), b.log()
    kx, ky = damping_factor(eps, rx), damping_factor(eps, ry)
    for _ in range(n_iter):
        f = -kx * eps * torch.logsumexp(lb[None, :] + (g[None, :] - C) / eps, dim=1)
        g = -ky * eps * torch.logsumexp(la[:, None] + (f[:, None] - C) / eps, dim=0)
    P = a[:, None] * b[None, :] * torch.exp((f[:, None] + g[None, :] - C) / eps)
    if rx is None and ry is None:
        value = (a * f).sum() + (b * g).sum()
    else:
        value = dual_terms(f, a, rx) + dual_terms(g, b, ry) - eps * (P.sum() - a.sum() * b.sum())
    return f, g, value


def samples_loss_ref(a, x, b, y, *, blur=0.05, reach=None, diameter=None, scaling=0.5, debias=True):
    """Dense float64 GeomLoss-tensorized re-implementation (value only), 2D inputs.
    ``reach``: a number, or a pair ``(reach_x, reach_y)`` (one KL penalty per side, None:
    balanced side)."""
    x, y, a, b = x.double(), y.double(), a.double(), b.double()
    eps = blur**2
    rx, ry = rho_from_reach(reach, 0.5)
    if diameter is None:
        diameter = max_diameter(x, y)
    eps_list = eps_schedule(diameter**2, eps, scaling)

    def C(u, v):
        return 0.5 * torch.cdist(u, v) ** 2

    def sm(e, Cm, h):
        return -e * torch.logsumexp(h[None, :] - Cm / e, dim=1)

    Cxy, Cyx, Cxx, Cyy = C(x, y), C(y, x), C(x, x), C(y, y)
    la, lb = a.log(), b.log()
    e = eps_list[0]
    dx, dy = damping_factor(e, rx), damping_factor(e, ry)
    g_ab, f_ba = dy * sm(e, Cyx, la), dx * sm(e, Cxy, lb)
    f_aa, g_bb = dx * sm(e, Cxx, la), dy * sm(e, Cyy, lb)
    for e in eps_list:
        dx, dy = damping_factor(e, rx), damping_factor(e, ry)
        ft, gt = dx * sm(e, Cxy, lb + g_ab / e), dy * sm(e, Cyx, la + f_ba / e)
        fa, gb = dx * sm(e, Cxx, la + f_aa / e), dy * sm(e, Cyy, lb + g_bb / e)
        f_ba, g_ab, f_aa, g_bb = (
            0.5 * (f_ba + ft),
            0.5 * (g_ab + gt),
            0.5 * (f_aa + fa),
            0.5 * (g_bb + gb),
        )
    f_ba, g_ab, f_aa, g_bb = (
        dx * sm(e, Cxy, lb + g_ab / e),
        dy * sm(e, Cyx, la + f_ba / e),
        dx * sm(e, Cxx, la + f_aa / e),
        dy * sm(e, Cyy, lb + g_bb / e),
    )

    def side(w, F, F_self, rho):
        if rho is None:
            return (w * (F - F_self)).sum() if debias else (w * F).sum()
        e_self = (-F_self / rho).exp() if debias else 1.0
        return (w * (rho + e / 2) * (e_self - (-F / rho).exp())).sum()

    return side(a, f_ba, f_aa, rx) + side(b, g_ab, g_bb, ry)
