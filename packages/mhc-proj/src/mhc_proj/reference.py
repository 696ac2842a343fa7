"""Float64 torch references (any n): the oracle for tests, benchmarks and users.

- :func:`birkhoff_project_ref` — the exact projection T = argmin KL(T || exp(A)) over
  doubly stochastic T, by batched Newton on the semi-dual in float64 with a backtracking
  line search on the objective and a log-domain Sinkhorn fallback step.
- :func:`birkhoff_vjp_ref` — the implicit vector-Jacobian product, textbook form, in
  float64 (solve of the grounded Hessian with ``torch.linalg.solve``).
- :func:`sinkhorn_project_ref` — the DeepSeek/TileKernels Sinkhorn-k convention, plain
  torch ops (differentiable by autograd).
- :func:`marginal_error` — L1 of row-sum and column-sum deviations from 1, per matrix.
"""

from __future__ import annotations

import torch

__all__ = [
    "birkhoff_project_ref",
    "birkhoff_vjp_ref",
    "sinkhorn_project_ref",
    "marginal_error",
]


def marginal_error(t: torch.Tensor) -> torch.Tensor:
    """Per-matrix L1 marginal error ``sum_i |r_i - 1| + sum_j |c_j - 1|`` in float64.

    ``t``: (..., n, n). Returns (...,).
    """
    t = t.double()
    return (t.sum(-1) - 1).abs().sum(-1) + (t.sum(-2) - 1).abs().sum(-1)


def _semi_dual(a: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(a + beta[:, None, :], dim=-1).sum(-1) - beta.sum(-1)


def _log_col_step(a: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    x = a + beta[:, None, :]
    x = x - torch.logsumexp(x, dim=-1, keepdim=True)
    beta = beta - torch.logsumexp(x, dim=-2)
    return beta - beta[:, -1:]


def birkhoff_project_ref(
    logits: torch.Tensor, tol: float = 1e-13, max_iter: int = 500
) -> torch.Tensor:
    """Exact Birkhoff projection in float64 (any n >= 1).

    ``logits``: (..., n, n), any float dtype. Returns float64 (..., n, n) doubly
    stochastic T = diag(u) exp(A) diag(v). Matrices with non-finite entries give NaN.
    """
    if logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"logits must be (..., n, n); got {tuple(logits.shape)}")
    shape = logits.shape
    n = shape[-1]
    a = logits.detach().to(torch.float64).reshape(-1, n, n).clone()
    bad = ~torch.isfinite(a).flatten(1).all(1)
    a[bad] = 0.0
    a = a - a.amax(-1, keepdim=True)
    beta = _log_col_step(a, torch.zeros(a.shape[0], n, dtype=torch.float64, device=a.device))
    eye = torch.eye(n - 1, dtype=torch.float64, device=a.device)
    for _ in range(max_iter):
        t = torch.softmax(a + beta[:, None, :], dim=-1)
        err = marginal_error(t)
        active = err > tol
        if not bool(active.any()):
            break
        idx = active.nonzero().squeeze(1)
        ta, ba, aa = t[idx], beta[idx], a[idx]
        c = ta.sum(-2)
        h = torch.diag_embed(c) - ta.transpose(-1, -2) @ ta
        h = h[:, :-1, :-1] + 1e-300 * eye
        g = (c - 1)[:, :-1]
        d = torch.linalg.solve_ex(h, -g.unsqueeze(-1))[0].squeeze(-1)
        d = torch.cat([d, torch.zeros_like(d[:, :1])], dim=1)
        d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))
        dmax = d.abs().amax(-1).clamp_min(1e-300)
        step = torch.clamp(64.0 / dmax, max=1.0)
        f0 = _semi_dual(aa, ba)
        slope = ((c - 1) * d).sum(-1)
        done = torch.zeros_like(step, dtype=torch.bool)
        for _ in range(40):
            f1 = _semi_dual(aa, ba + step[:, None] * d)
            # rounding allowance: f is known to ~eps * |f| only
            thr = f0 + 1e-4 * step * slope + 1e-14 * (f0.abs() + 1)
            ok = (f1 <= thr) & ~done & (slope < 0)
            done = done | ok
            step = torch.where(done, step, step * 0.5)
            if bool(done.all()):
                break
        new_b = torch.where(done[:, None], ba + step[:, None] * d, _log_col_step(aa, ba))
        beta[idx] = new_b - new_b[:, -1:]
    t = torch.softmax(a + beta[:, None, :], dim=-1)
    t[bad] = float("nan")
    return t.reshape(shape)


def birkhoff_vjp_ref(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Implicit VJP of the Birkhoff projection in float64, textbook form.

    With r = rowsum(T * G), s = colsum(T * G): solve (I - T^T T) y = s - T^T r on the
    leading (n-1) block (y_n = 0), x = r - T y, dA = T * (G - x 1^T - 1 y^T).
    ``t``, ``grad``: (..., n, n). Returns float64 (..., n, n).
    """
    shape = t.shape
    n = shape[-1]
    t = t.detach().to(torch.float64).reshape(-1, n, n)
    g = grad.detach().to(torch.float64).reshape(-1, n, n)
    tg = t * g
    r = tg.sum(-1)
    s = tg.sum(-2)
    h = torch.eye(n, dtype=torch.float64, device=t.device) - t.transpose(-1, -2) @ t
    rhs = s - (t.transpose(-1, -2) @ r.unsqueeze(-1)).squeeze(-1)
    y = torch.zeros_like(r)
    if n > 1:
        y[:, :-1] = torch.linalg.solve(h[:, :-1, :-1], rhs[:, :-1].unsqueeze(-1)).squeeze(-1)
    x = r - (t @ y.unsqueeze(-1)).squeeze(-1)
    da = t * (g - x[:, :, None] - y[:, None, :])
    return da.reshape(shape)


def sinkhorn_project_ref(logits: torch.Tensor, iters: int = 20, eps: float = 1e-6) -> torch.Tensor:
    """Sinkhorn-k in the DeepSeek/TileKernels convention (plain torch, differentiable).

    P = softmax(A, -1) + eps; P /= P.sum(-2) + eps; then ``iters - 1`` times
    P /= P.sum(-1) + eps; P /= P.sum(-2) + eps. Computed in the input dtype.
    """
    p = torch.softmax(logits, dim=-1) + eps
    p = p / (p.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        p = p / (p.sum(-1, keepdim=True) + eps)
        p = p / (p.sum(-2, keepdim=True) + eps)
    return p
