"""OTDD: the optimal transport dataset distance (Alvarez-Melis & Fusi, 2020), streaming.

Two labeled datasets ``D1 = {(x_i, l_i)}`` and ``D2 = {(x'_j, l'_j)}`` are compared by
entropic OT on the product space of features and labels with the cost

    C_ij = feature_weight * |x_i - x'_j|^2 + label_weight * W[l_i, l'_j]

where ``W[k, k']`` is a distance between the label-conditional feature distributions
(class k of one dataset against class k' of the other): the debiased Sinkhorn divergence
between the two classes' point clouds (``label_distance="sinkhorn"``, streamed), or the
2-Wasserstein distance between Gaussians fitted to them (``"gaussian"``: means and
covariances, Bures formula). The outer problem streams the same kernels as everything
else in this subpackage, with the small table W read inside the kernel: nothing of size
n x m is formed, so memory is O((n + m) d) plus the table.

With ``debias=True`` (default) the value is the Sinkhorn divergence
``OT(D1, D2) - OT(D1, D1)/2 - OT(D2, D2)/2``: symmetric and zero between a dataset and
itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashsinkhorn._hessian import envelope_grads
from flashsinkhorn.second_order._plan import solve_potentials
from flashsinkhorn.second_order.reference import ot_loss_ref


class OTDDResult(NamedTuple):
    value: float
    label_distances: torch.Tensor  # (K1 + K2, K1 + K2) over the classes of D1 then D2
    classes1: torch.Tensor
    classes2: torch.Tensor
    terms: dict  # the OT values: "xy", and "xx", "yy" when debiased


def _remap(labels: torch.Tensor):
    classes, idx = torch.unique(labels, return_inverse=True)
    return classes, idx


def _gaussian_w2(groups, dt):
    """Bures-Wasserstein^2 between Gaussian fits of each group, (K, K).

    ``|mu_i - mu_j|^2 + tr S_i + tr S_j - 2 tr (S_i^1/2 S_j S_i^1/2)^1/2``, with batched
    eigendecompositions (one call for the K roots, one for the K (K - 1) / 2 pairs).
    """
    mus, covs = [], []
    for g in groups:
        g = g.to(dt)
        mu = g.mean(0)
        gc = g - mu
        mus.append(mu)
        covs.append(gc.T @ gc / max(g.shape[0], 1))
    mu = torch.stack(mus)
    S = torch.stack(covs)
    w, V = torch.linalg.eigh(S)
    R = (V * w.clamp_min(0).sqrt()[:, None, :]) @ V.transpose(1, 2)
    K = len(groups)
    iu, ju = torch.triu_indices(K, K, 1, device=S.device)
    W = torch.zeros(K, K, dtype=dt, device=S.device)
    tr = torch.diagonal(S, dim1=1, dim2=2).sum(1)
    for c0 in range(0, len(iu), 64):  # chunks bound the (pairs, D, D) buffer
        i, j = iu[c0 : c0 + 64], ju[c0 : c0 + 64]
        M = R[i] @ S[j] @ R[i]
        lam = torch.linalg.eigvalsh(0.5 * (M + M.transpose(1, 2))).clamp_min(0)
        bures = (tr[i] + tr[j] - 2 * lam.sqrt().sum(1)).clamp_min(0)
        val = ((mu[i] - mu[j]) ** 2).sum(1) + bures
        W[i, j] = val
        W[j, i] = val
    return W


def _sinkhorn_w(groups, eps, skw):
    """Debiased Sinkhorn divergence between every pair of groups, (K, K), streamed."""
    K = len(groups)
    self_ot = []
    for g in groups:
        self_ot.append(float(solve_potentials(g, g, eps=eps, symmetric=True, **skw).value()))
    W = torch.zeros(K, K, dtype=torch.float64)
    for i in range(K):
        for j in range(i + 1, K):
            ot = float(solve_potentials(groups[i], groups[j], eps=eps, **skw).value())
            W[i, j] = W[j, i] = max(ot - 0.5 * (self_ot[i] + self_ot[j]), 0.0)
    return W


def label_distances(
    x1, l1, x2, l2, *, eps: float, method: str = "sinkhorn", **skw
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distance table between all classes of D1 then D2: ``(W (K1+K2, K1+K2), c1, c2)``."""
    c1, i1 = _remap(l1)
    c2, i2 = _remap(l2)
    groups = [x1[i1 == k] for k in range(len(c1))] + [x2[i2 == k] for k in range(len(c2))]
    if method == "gaussian":
        dt = torch.float64 if x1.dtype == torch.float64 or x1.device.type == "cpu" else x1.dtype
        W = _gaussian_w2(groups, dt)
    elif method == "sinkhorn":
        W = _sinkhorn_w(groups, eps, skw)
    else:
        raise ValueError(f"method must be 'sinkhorn' or 'gaussian'; got {method!r}")
    return W.to(x1.device), c1, c2


def _prep(x1, l1, x2, l2, feature_weight):
    for name, x, lab in (("x1", x1, l1), ("x2", x2, l2)):
        if x.dim() != 2:
            raise ValueError(f"{name} must be (N, D); got {tuple(x.shape)}")
        if lab.shape != (x.shape[0],):
            raise ValueError(f"labels of {name} must have shape ({x.shape[0]},)")
    if x1.shape[1] != x2.shape[1]:
        raise ValueError(f"x1 and x2 must have the same D; got {x1.shape[1]}, {x2.shape[1]}")
    s = float(feature_weight) ** 0.5
    return x1 * s if s != 1 else x1, x2 * s if s != 1 else x2


def otdd(
    x1: torch.Tensor,
    labels1: torch.Tensor,
    x2: torch.Tensor,
    labels2: torch.Tensor,
    *,
    eps: float,
    label_distance: str = "sinkhorn",
    feature_weight: float = 1.0,
    label_weight: float = 1.0,
    debias: bool = True,
    inner_eps: float | None = None,
    W: torch.Tensor | None = None,
    max_iter: int = 200,
    tol: float | None = 1e-5,
    eps_schedule=None,
    backend: str = "auto",
    precision: str = "tf32x3",
) -> OTDDResult:
    """Optimal transport dataset distance between (x1, labels1) and (x2, labels2).

    x1 (n, D), x2 (m, D) features; labels1 (n,), labels2 (m,) integer class labels.
    ``eps``: temperature of the outer problem (cost units: squared feature distance);
    ``inner_eps``: of the class-to-class problems (default eps). ``W``: a precomputed
    table from :func:`label_distances` (skips that step). Returns an :class:`OTDDResult`.
    """
    x1, x2 = _prep(x1, labels1, x2, labels2, feature_weight)
    skw = dict(
        max_iter=max_iter, tol=tol, eps_schedule=eps_schedule, backend=backend, precision=precision
    )
    if W is None:
        W, c1, c2 = label_distances(
            x1, labels1, x2, labels2, eps=inner_eps or eps, method=label_distance, **skw
        )
    else:
        c1, _ = _remap(labels1)
        c2, _ = _remap(labels2)
    _, i1 = _remap(labels1)
    _, i2 = _remap(labels2)
    K1 = len(c1)
    T = label_weight * W.float() if x1.dtype != torch.float64 else label_weight * W.double()
    T11, T22, T12 = T[:K1, :K1], T[K1:, K1:], T[:K1, K1:]
    ot12 = solve_potentials(x1, x2, eps=eps, labels=(i1, i2, T12), **skw).value()
    terms = {"xy": float(ot12)}
    val = ot12
    if debias:
        ot11 = solve_potentials(
            x1, x1, eps=eps, labels=(i1, i1, T11), symmetric=True, **skw
        ).value()
        ot22 = solve_potentials(
            x2, x2, eps=eps, labels=(i2, i2, T22), symmetric=True, **skw
        ).value()
        terms.update(xx=float(ot11), yy=float(ot22))
        val = ot12 - 0.5 * (ot11 + ot22)
    return OTDDResult(float(val), W, c1, c2, terms)


def otdd_ref(
    x1,
    labels1,
    x2,
    labels2,
    *,
    eps,
    label_distance="sinkhorn",
    feature_weight=1.0,
    label_weight=1.0,
    debias=True,
    inner_eps=None,
    n_iter=2000,
) -> float:
    """Dense float64 OTDD (small problems): same definition, every matrix materialized."""
    x1 = x1.double() * float(feature_weight) ** 0.5
    x2 = x2.double() * float(feature_weight) ** 0.5
    c1, i1 = _remap(labels1)
    c2, i2 = _remap(labels2)
    groups = [x1[i1 == k] for k in range(len(c1))] + [x2[i2 == k] for k in range(len(c2))]
    K = len(groups)
    ie = inner_eps or eps
    if label_distance == "gaussian":
        W = _gaussian_w2(groups, torch.float64)
    else:
        W = torch.zeros(K, K, dtype=torch.float64)
        for i in range(K):
            for j in range(i + 1, K):
                W[i, j] = W[j, i] = ot_loss_ref(
                    groups[i], groups[j], eps=ie, n_iter=n_iter, debias=True
                ).clamp_min(0)
    T = label_weight * W
    K1 = len(c1)
    kw = dict(eps=eps, n_iter=n_iter)
    v = ot_loss_ref(x1, x2, labels=(i1, i2, T[:K1, K1:]), **kw)
    if debias:
        v = v - 0.5 * ot_loss_ref(x1, x1, labels=(i1, i1, T[:K1, :K1]), **kw)
        v = v - 0.5 * ot_loss_ref(x2, x2, labels=(i2, i2, T[K1:, K1:]), **kw)
    return float(v)


def otdd_gradient_flow(
    x1: torch.Tensor,
    labels1: torch.Tensor,
    x2: torch.Tensor,
    labels2: torch.Tensor,
    *,
    eps: float,
    steps: int = 10,
    lr: float = 0.5,
    label_distance: str = "gaussian",
    label_weight: float = 1.0,
    max_iter: int = 100,
    tol: float | None = 1e-4,
    eps_schedule=None,
    backend: str = "auto",
    precision: str = "tf32x3",
    callback=None,
) -> tuple[torch.Tensor, list]:
    """Move the features of D1 along the Wasserstein gradient of the debiased OTDD to D2.

    Each step recomputes the label distances (with the current features of D1), solves
    the three streamed problems and takes ``x1 <- x1 - lr * grad / a`` (the Wasserstein
    gradient: the Euclidean one divided by the point weight ``a = 1/n``). Labels stay.
    Returns ``(x1_final, history)`` with history a list of ``(step, otdd_value)``.
    """
    x = x1.detach().clone()
    n = x.shape[0]
    skw = dict(
        max_iter=max_iter, tol=tol, eps_schedule=eps_schedule, backend=backend, precision=precision
    )
    _, i1 = _remap(labels1)
    _, i2 = _remap(labels2)
    hist = []
    for step in range(steps + 1):
        W, c1, _ = label_distances(x, labels1, x2, labels2, eps=eps, method=label_distance, **skw)
        K1 = len(c1)
        T = (label_weight * W).to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        p12 = solve_potentials(x, x2, eps=eps, labels=(i1, i2, T[:K1, K1:]), **skw)
        p11 = solve_potentials(x, x, eps=eps, labels=(i1, i1, T[:K1, :K1]), symmetric=True, **skw)
        p22 = solve_potentials(x2, x2, eps=eps, labels=(i2, i2, T[K1:, K1:]), symmetric=True, **skw)
        val = float(p12.value() - 0.5 * (p11.value() + p22.value()))
        hist.append((step, val))
        if callback is not None:
            callback(step, x, val)
        if step == steps:
            break
        g12, _ = envelope_grads(p12, need_y=False)
        g11x, g11y = envelope_grads(p11)
        grad = g12 - 0.5 * (g11x + g11y)
        x = x - lr * n * grad.to(x.dtype)
    return x, hist


__all__ = ["otdd", "otdd_ref", "label_distances", "otdd_gradient_flow", "OTDDResult"]
