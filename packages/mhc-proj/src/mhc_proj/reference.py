"""Float64 torch references (any n): the oracle for tests, benchmarks and users.

- :func:`birkhoff_project_ref` — the exact projection T = argmin KL(T || exp(A)) over
  doubly stochastic T, by batched Newton on the semi-dual in float64 with a backtracking
  line search on the objective and a log-domain Sinkhorn fallback step.
- :func:`birkhoff_vjp_ref` — the implicit vector-Jacobian product, textbook form, in
  float64 (solve of the grounded Hessian with ``torch.linalg.solve``).
- :func:`sinkhorn_project_ref` — the DeepSeek/TileKernels Sinkhorn-k convention, plain
  torch ops (differentiable by autograd).
- :func:`marginal_error` — L1 of row-sum and column-sum deviations from 1, per matrix.
- :func:`hyper_connection_ref` — the whole hyper-connection layer (RMS norm, mixing GEMM,
  maps, projection, H_pre x, sublayer, H_res x + H_post^T f) in one dtype, differentiable
  (the exact projection's backward is :func:`birkhoff_vjp_ref`).
"""

from __future__ import annotations

import torch

__all__ = [
    "birkhoff_project_ref",
    "birkhoff_vjp_ref",
    "sinkhorn_project_ref",
    "marginal_error",
    "hyper_connection_ref",
    "hyper_connection_stack_ref",
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


# Structural zeros and huge logit gaps (-inf entries, -1e30 masks): the same bounds as
# csrc/support.h, written here on their own (Python, per matrix, only for the matrices that
# have them). With P the entries of level <= v (levels l = -a of the row-shifted logits),
# every entry of T that no perfect matching inside P reaches is at most
# n! exp(-(w - n v) / n) when every other level w > n (v + 50): zero to double precision.
_GAP = 50.0


def _perfect_matching(adj: list[list[bool]]) -> bool:
    """Whether the bipartite pattern adj (rows x columns) has a perfect matching (Kuhn)."""
    n = len(adj)
    row_of_col = [-1] * n

    def augment(i: int, seen: list[bool]) -> bool:
        for j in range(n):
            if adj[i][j] and not seen[j]:
                seen[j] = True
                if row_of_col[j] < 0 or augment(row_of_col[j], seen):
                    row_of_col[j] = i
                    return True
        return False

    return all(augment(i, [False] * n) for i in range(n))


def _total_support(adj: list[list[bool]]) -> list[list[bool]]:
    """The entries of adj that lie on some perfect matching of adj: (i, j) does iff adj
    without row i and column j has one."""
    n = len(adj)
    keep = [[False] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if adj[i][j]:
                rest = [[adj[r][k] for k in range(n) if k != j] for r in range(n) if r != i]
                keep[i][j] = not rest or _perfect_matching(rest)
    return keep


def _reduce_support(a: list[list[float]]) -> list[list[float]] | None:
    """One matrix (float64 values, -inf allowed, no NaN / +inf) reduced to the problem
    Newton can solve with the same projection to double precision: entries on no perfect
    matching of the finite pattern become -inf (T is exactly 0 there); at the first level
    gap whose lower pattern has a perfect matching, every entry above it becomes -inf too
    (and the lower pattern's entries on none); a gap whose lower pattern has none (those
    entries carry mass) is compressed to width n (v + 50) with the offsets above it kept.
    None: the finite pattern has no perfect matching (no doubly stochastic T exists)."""
    n = len(a)
    inf = float("inf")

    def cut(keep):
        for i in range(n):
            a[i] = [a[i][j] if keep[i][j] else -inf for j in range(n)]

    def shift_rows():
        for i in range(n):
            m = max(a[i])
            a[i] = [v - m for v in a[i]]

    finite = [[v > -inf for v in row] for row in a]
    if not _perfect_matching(finite):
        return None
    cut(_total_support(finite))
    shift_rows()
    cur = 0.0
    while True:
        above = [-v for row in a for v in row if -v > cur and v > -inf]
        if not above:
            return a
        nxt = min(above)
        thr = n * (cur + _GAP)
        if nxt <= thr:
            cur = nxt
            continue
        lower = [[-v <= cur for v in row] for row in a]
        if _perfect_matching(lower):
            cut(_total_support(lower))
            shift_rows()
            return a
        a = [[-(thr + (-v - nxt)) if -v > cur and v > -inf else v for v in row] for row in a]
        cur = thr


def birkhoff_project_ref(
    logits: torch.Tensor, tol: float = 1e-13, max_iter: int = 500, return_iterations: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact Birkhoff projection in float64 (any n >= 1).

    ``logits``: (..., n, n), any float dtype. Returns float64 (..., n, n) doubly
    stochastic T = diag(u) exp(A) diag(v). ``-inf`` entries are structural zeros (T is 0
    there); logits of enormous range (-1e30 masks) are solved through the support
    reduction above. A matrix with a NaN or +inf entry, or whose finite entries admit no
    doubly stochastic matrix (no perfect matching), gives NaN. Accuracy: L1 marginal error
    <= tol where double precision resolves it (~1e-16 n times the logit range). With
    ``return_iterations``: also the Newton iterations per matrix (int32, shape (...,)).
    """
    if logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"logits must be (..., n, n); got {tuple(logits.shape)}")
    shape = logits.shape
    n = shape[-1]
    a = logits.detach().to(torch.float64).reshape(-1, n, n).clone()
    bad = (torch.isnan(a) | (a == float("inf"))).flatten(1).any(1)
    bad |= (a.amax(-1) == -float("inf")).any(-1)  # a row of -inf: infeasible
    a[bad] = 0.0
    a = a - a.amax(-1, keepdim=True)
    hard = ((a == -float("inf")) | (a < -n * _GAP)).flatten(1).any(1) & ~bad
    for b in hard.nonzero().flatten().tolist():
        reduced = _reduce_support(a[b].tolist())
        if reduced is None:
            bad[b] = True
            a[b] = 0.0
        else:
            a[b] = torch.tensor(reduced, dtype=torch.float64, device=a.device)
    beta = _log_col_step(a, torch.zeros(a.shape[0], n, dtype=torch.float64, device=a.device))
    eye = torch.eye(n - 1, dtype=torch.float64, device=a.device)
    iterations = torch.zeros(a.shape[0], dtype=torch.int32, device=a.device)
    for _ in range(max_iter):
        t = torch.softmax(a + beta[:, None, :], dim=-1)
        err = marginal_error(t)
        active = err > tol
        if not bool(active.any()):
            break
        iterations += active.int()
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
    if return_iterations:
        return t.reshape(shape), iterations.reshape(shape[:-2])
    return t.reshape(shape)


def _implicit_vjp(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The textbook implicit VJP on float64 (B, n, n) tensors, differentiable in t and g."""
    n = t.shape[-1]
    tg = t * g
    r = tg.sum(-1)
    s = tg.sum(-2)
    h = torch.eye(n, dtype=t.dtype, device=t.device) - t.transpose(-1, -2) @ t
    rhs = s - (t.transpose(-1, -2) @ r.unsqueeze(-1)).squeeze(-1)
    if n > 1:
        y = torch.linalg.solve(h[:, :-1, :-1], rhs[:, :-1].unsqueeze(-1)).squeeze(-1)
        y = torch.cat([y, torch.zeros_like(y[:, :1])], dim=1)
    else:
        y = torch.zeros_like(r)
    x = r - (t @ y.unsqueeze(-1)).squeeze(-1)
    return t * (g - x[:, :, None] - y[:, None, :])


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
    return _implicit_vjp(t, g).reshape(shape)


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


class _BirkhoffRef(torch.autograd.Function):
    """birkhoff_project_ref with the implicit backward (float64). The VJP is written in
    differentiable torch ops of (T, G), T being this node's output, so the backward is
    itself differentiable (a double backward through it is exact: as a function of a doubly
    stochastic T the formula is the projection's VJP), and setup_context makes the node
    composable with torch.func."""

    @staticmethod
    def forward(logits):
        return birkhoff_project_ref(logits)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        n = t.shape[-1]
        flat = _implicit_vjp(t.reshape(-1, n, n), grad.to(t.dtype).reshape(-1, n, n))
        return flat.reshape(t.shape)


def hyper_connection_ref(
    x: torch.Tensor,
    layer,
    phi: torch.Tensor,
    b: torch.Tensor,
    alpha_pre: torch.Tensor,
    alpha_post: torch.Tensor,
    alpha_res: torch.Tensor,
    *,
    projection: str = "birkhoff",
    formulation: str = "mhc",
    sinkhorn_iters: int = 20,
    sinkhorn_eps: float = 1e-6,
    rms_eps: float = 1e-6,
    pre_eps: float | None = None,
    post_mult: float = 2.0,
    dtype: torch.dtype = torch.float64,
    gemm_dtype: torch.dtype | None = None,
    return_maps: bool = False,
):
    """x_next = H_res x + H_post^T layer(H_pre x), everything computed in ``dtype``.

    ``x`` (..., n, C); ``phi`` (n C, n^2 + 2n) with columns [pre | post | res]; ``b``
    (n^2 + 2n,); scalar alphas. With r = sqrt(mean(vec(x)^2) + rms_eps) and h = vec(x) phi
    (in ``gemm_dtype`` if given, e.g. bfloat16 for a bf16 training step):
    H_pre = sigmoid(alpha_pre h_pre / r + b_pre) + pre_eps, H_post = post_mult
    sigmoid(alpha_post h_post / r + b_post), H_res = the exact Birkhoff projection
    (``projection="birkhoff"``, float64 only: :func:`birkhoff_project_ref`) or Sinkhorn-k
    (``"sinkhorn"``: :func:`sinkhorn_project_ref`) of alpha_res h_res / r + b_res, P.
    ``formulation="mhc"``: rows of P index the output stream, x_next_i = sum_j P[i, j] x_j
    (pre_eps default 0); ``"deepseek"`` (DeepSeek-V4's hc_post): x_next_j = sum_i P[i, j]
    x_i (pre_eps default 1e-6). ``layer`` is called on y = H_pre x in ``dtype``. Returns
    x_next in ``dtype`` (and, with ``return_maps``, (h_pre, h_post, P)).
    """
    if formulation not in ("mhc", "deepseek"):
        raise ValueError(f"formulation must be 'mhc' or 'deepseek'; got {formulation!r}")
    if pre_eps is None:
        pre_eps = 1e-6 if formulation == "deepseek" else 0.0
    n = x.shape[-2]
    xs = x.to(dtype)
    flat = xs.flatten(-2)
    inv_r = torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    g = gemm_dtype or dtype
    h = (flat.to(g) @ phi.to(g)).to(dtype) * inv_r
    bias = b.to(dtype)
    h_pre = torch.sigmoid(alpha_pre.to(dtype) * h[..., :n] + bias[:n]) + pre_eps
    h_post = post_mult * torch.sigmoid(alpha_post.to(dtype) * h[..., n : 2 * n] + bias[n : 2 * n])
    l_res = (alpha_res.to(dtype) * h[..., 2 * n :] + bias[2 * n :]).unflatten(-1, (n, n))
    if projection == "birkhoff":
        if dtype != torch.float64:
            raise ValueError("the Birkhoff reference runs in float64 (dtype=torch.float64)")
        h_res = _BirkhoffRef.apply(l_res)
    elif projection == "sinkhorn":
        h_res = sinkhorn_project_ref(l_res, sinkhorn_iters, sinkhorn_eps)
    else:
        raise ValueError(f"projection must be 'birkhoff' or 'sinkhorn'; got {projection!r}")
    y = (h_pre.unsqueeze(-1) * xs).sum(-2)
    f = layer(y).to(dtype)
    mix = h_res.transpose(-1, -2) if formulation == "deepseek" else h_res
    out = mix @ xs + h_post.unsqueeze(-1) * f.unsqueeze(-2)
    if return_maps:
        return out, (h_pre, h_post, h_res)
    return out


def hyper_connection_stack_ref(
    x: torch.Tensor, layers, *, dtype: torch.dtype = torch.float64, return_maps: bool = False
):
    """The chain ``for hc in layers: x = hc(x)`` of :func:`hyper_connection_ref`: the oracle
    of :func:`mhc_proj.hyper_connection_stack` (whose fused boundaries change the order of
    the work, never the function). ``layers``: objects with a HyperConnection's attributes
    (``layer``, ``phi``, ``b``, the alphas and options); each ``layer`` is called as it is,
    so pass float64 copies of the sublayers for a float64 chain. Returns x in ``dtype`` (and
    the list of each layer's (h_pre, h_post, h_res))."""
    maps = []
    for hc in layers:
        x = hyper_connection_ref(
            x,
            hc.layer,
            hc.phi,
            hc.b,
            hc.alpha_pre,
            hc.alpha_post,
            hc.alpha_res,
            projection=hc.projection,
            formulation=getattr(hc, "formulation", "mhc"),
            sinkhorn_iters=hc.tmax,
            sinkhorn_eps=hc.sinkhorn_eps,
            rms_eps=hc.rms_eps,
            pre_eps=hc.pre_eps,
            post_mult=hc.post_mult,
            dtype=dtype,
            return_maps=return_maps,
        )
        if return_maps:
            x, m = x
            maps.append(m)
    return (x, maps) if return_maps else x
