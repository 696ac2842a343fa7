"""The streaming primitives: ``softmin`` (the c-transform), ``plan_apply``, ``self_softmin``.

Everything in flashsinkhorn is built from one streaming pass. For batched clouds
``X (B, N, D)``, ``Y (B, M, D)`` and a cost ``C_ij = cx_i + cy_j - c2 <X_i, Y_j>
[+ w_scale W[lx_i, ly_j]]`` (squared Euclidean: ``cx = s|x|^2, cy = s|y|^2, c2 = 2s``;
dot-product / feature-map costs: ``cx = cy = 0``), :func:`softmin` computes for every row

    out_i = damping * (-eps) * LSE_j(logb_j + (g_j - C_ij) / eps)

(the Sinkhorn update of ``f`` from ``g``) and, with ``V (B, M, DV)``, the softmax average
``vbar_i = sum_j pi_ij V_j``, from which :func:`plan_apply` (``P @ V`` with
``P_ij = a_i b_j exp((f_i + g_j - C_ij)/eps)``) and the barycentric map follow.

Backends:

- ``"triton"``: the Triton kernels (CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1``
  was set before Python started: CI runs them that way);
- ``"torch"``: a blockwise pure-torch path (row blocks against all columns), any device and
  dtype (float64 included), same math;
- ``"auto"``: triton on CUDA, torch otherwise.

Precision of the dot product (triton backend): ``"tf32"`` (default), ``"ieee"`` (full fp32),
``"tf32x3"``, or ``"bf16"`` (operands in bfloat16, fp32 accumulation); everything else is
fp32. The float64 references are in :mod:`flashsinkhorn.reference`.
"""

from __future__ import annotations

import math

import torch

from flashsinkhorn import _config
from flashsinkhorn._softmin_triton import HAS_TRITON, self_softmin_triton, softmin_triton
from flashsinkhorn.reference import LN2, LOG2E

__all__ = [
    "softmin",
    "plan_apply",
    "self_softmin",
    "resolve_backend",
    "check_precision",
    "PRECISIONS",
]

PRECISIONS = ("tf32", "ieee", "tf32x3", "bf16")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``"auto" | "triton" | "torch"`` to the backend used for tensors on ``device``."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch'; got {backend!r}")
    if backend == "auto":
        return "triton" if (device.type == "cuda" and HAS_TRITON) else "torch"
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' needs the triton package")
        if device.type != "cuda" and not _config.interpret():
            raise RuntimeError(
                "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before Python "
                "starts; use backend='torch' or 'auto' instead"
            )
    return backend


def check_precision(precision: str, backend: str) -> None:
    """``precision`` must be one of PRECISIONS; bf16 on the triton backend needs a GPU: the
    Triton interpreter computes bf16 dot products wrongly (off by orders of magnitude)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    if precision == "bf16" and backend == "triton" and _config.interpret():
        raise ValueError(
            "precision='bf16' on backend='triton' needs a GPU: the Triton interpreter "
            "(TRITON_INTERPRET=1) computes bf16 dot products wrongly; use precision='tf32' "
            "or 'ieee', or backend='torch' (exact float32)"
        )


def _check_operands(x, y, g, logb, cx, cy, eps, v, guess):
    """Shapes and eps of a softmin call (no data-dependent check: no host sync)."""
    if x.dim() != 3:
        raise ValueError(f"x must be (B, N, D); got {tuple(x.shape)}")
    B, N, D = x.shape
    if y.dim() != 3 or y.shape[0] != B or y.shape[2] != D:
        raise ValueError(f"y must be ({B}, M, {D}) like x (B, N, D); got {tuple(y.shape)}")
    M = y.shape[1]
    for name, t, n in (("g", g, M), ("logb", logb, M), ("cx", cx, N), ("cy", cy, M)):
        if tuple(t.shape) != (B, n):
            raise ValueError(f"{name} must be ({B}, {n}); got {tuple(t.shape)}")
    if guess is not None and tuple(guess.shape) != (B, N):
        raise ValueError(f"guess must be ({B}, {N}) like the result; got {tuple(guess.shape)}")
    if v is not None and (v.dim() != 3 or tuple(v.shape[:2]) != (B, M)):
        raise ValueError(f"v must be ({B}, {M}, DV); got {tuple(v.shape)}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite positive number; got {eps!r}")


def _triton_pass(
    x, y, g, logb, cx, cy, eps, c2, damping, v, labels, precision, want_lse, center, guess
):  # fmt: skip
    """The one place where the Triton kernel of a softmin pass is chosen.

    Every pass runs the portable streaming kernels of ``_softmin_triton``: the shift kernel
    when ``guess`` is given and there is no ``v`` (the Sinkhorn loops' passes), the
    running-max kernel otherwise (cold start, plan application). A kernel written for one
    architecture joins here as one branch placed before the portable call, taken only for
    the devices, dtypes and arguments it supports, e.g.
    ``if v is None and _hopper.supports(x, precision, labels): return _hopper.softmin(...)``.
    """
    return softmin_triton(
        x, y, g, logb, cx, cy, eps, c2, damping, v, labels, precision, want_lse, center,
        guess,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------
# blockwise torch path (any device, any float dtype)
# ----------------------------------------------------------------------------------------


def _block_rows(n: int, m: int) -> int:
    """Rows per block of the torch paths: at most ~4M scores (n x m) per block."""
    return max(1, min(n, (1 << 22) // max(1, m)))


def _softmin_torch(x, y, g, logb, cx, cy, eps, c2, damping, v, labels, want_lse, center):
    B, N, D = x.shape
    M = y.shape[1]
    dt = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    x, y, g, logb, cx, cy = (t.to(dt) for t in (x, y, g, logb, cx, cy))
    if center is not None:
        y = y - center.to(dt)[:, None, :]
    bias = logb + (g - cy) / eps  # (B, M)
    yt = y.transpose(1, 2)
    out = torch.empty((B, N), dtype=dt, device=x.device)
    lse2 = torch.empty((B, N), dtype=dt, device=x.device) if want_lse else None
    vbar = None
    if v is not None:
        v = v.to(dt)
        vbar = torch.empty((B, N, v.shape[-1]), dtype=dt, device=x.device)
    rows = _block_rows(N, M)
    for i0 in range(0, N, rows):
        i1 = min(N, i0 + rows)
        xi = x[:, i0:i1] if center is None else x[:, i0:i1] - center.to(dt)[:, None, :]
        S = (c2 / eps) * torch.bmm(xi, yt) + bias[:, None, :]
        if labels is not None:
            lx, ly, W, w_scale = labels
            Wt = W.to(dt)[lx[:, i0:i1].long()[:, :, None], ly.long()[:, None, :]]
            S = S - (w_scale / eps) * Wt
        lse = torch.logsumexp(S, dim=-1)
        out[:, i0:i1] = damping * (cx[:, i0:i1] - eps * lse)
        if want_lse:
            lse2[:, i0:i1] = lse / LN2
        if v is not None:
            vbar[:, i0:i1] = torch.bmm(torch.softmax(S, dim=-1), v)
    return out, lse2, vbar


# ----------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------


def softmin(
    x: torch.Tensor,
    y: torch.Tensor,
    g: torch.Tensor,
    logb: torch.Tensor,
    cx: torch.Tensor,
    cy: torch.Tensor,
    *,
    eps: float,
    c2: float,
    damping: float = 1.0,
    v: torch.Tensor | None = None,
    labels: tuple | None = None,
    precision: str = "tf32",
    backend: str = "auto",
    want_lse: bool = False,
    center: torch.Tensor | None = None,
    guess: torch.Tensor | None = None,
):
    """Streaming c-transform (fused row-LSE update) for batched clouds.

    Args:
        x: (B, N, D) row points (features). y: (B, M, D) column points.
        g: (B, M) column potential. logb: (B, M) log column weights (-inf allowed).
        cx: (B, N), cy: (B, M) additive cost terms (``s|x|^2``, ``s|y|^2`` for sqeuclidean).
        eps: temperature (> 0). c2: multiplier of the dot product in the cost.
        damping: unbalanced factor ``1 / (1 + eps/rho)`` (1 for balanced).
        v: optional (B, M, DV): also return ``vbar_i = sum_j pi_ij v_j`` (row softmax).
        labels: optional ``(lx (B, N) int, ly (B, M) int, W (K1, K2), w_scale)`` adding
            ``w_scale * W[lx_i, ly_j]`` to the cost (OTDD's label cost), gathered in-kernel.
        precision: dot precision for the triton backend: "tf32", "ieee", "tf32x3", "bf16".
        backend: "auto", "triton" or "torch".
        want_lse: also return ``lse2`` (B, N): ``log2 sum_j exp2(score_ij)`` with the scores
            excluding ``cx`` (so ``out = damping * (cx - eps * ln2 * lse2)``).
        center: optional (B, D): the dot product uses ``<x_i - c, y_j - c>`` (the triton
            backend subtracts it in one pass before the kernel, an O((N + M) D) copy per
            call; loops should pass centered operands once and ``center=None``). For the
            squared-Euclidean cost pass ``cx = s|x - c|^2``, ``cy = s|y - c|^2``: same
            cost, smaller operands, better tf32/bf16 accuracy.
        guess: optional (B, N) estimate of ``out`` (in the Sinkhorn loops: the potential
            being updated). On the triton backend without ``v`` it selects the shift
            kernel, which uses it as a fixed per-row shift instead of a running max; the
            result is exact whatever the guess (rows it does not fit are recomputed with
            the running max in the same kernel). Ignored otherwise.

    Returns:
        ``(out, lse2_or_None, vbar_or_None)``; ``out = damping * softmin_j(...)`` (B, N).
    """
    _check_operands(x, y, g, logb, cx, cy, eps, v, guess)
    be = resolve_backend(backend, x.device)
    check_precision(precision, be)
    if be == "triton":
        return _triton_pass(
            x, y, g, logb, cx, cy, eps, c2, damping, v, labels, precision, want_lse, center,
            guess,
        )  # fmt: skip
    return _softmin_torch(x, y, g, logb, cx, cy, eps, c2, damping, v, labels, want_lse, center)


def plan_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    f: torch.Tensor,
    g: torch.Tensor,
    v: torch.Tensor,
    cx: torch.Tensor,
    cy: torch.Tensor,
    *,
    eps: float,
    c2: float,
    labels: tuple | None = None,
    normalize: bool = False,
    precision: str = "tf32",
    backend: str = "auto",
):
    """Streaming ``P @ V`` with ``P_ij = a_i b_j exp((f_i + g_j - C_ij)/eps)``, batched.

    Shapes: x (B, N, D), y (B, M, D), a, f, cx (B, N), b, g, cy (B, M), v (B, M, K).
    With ``normalize=True`` returns the row-normalized average ``(P V)_i / (P 1)_i``
    (the barycentric map when ``v = y``). Never materializes P. Returns ``(out (B, N, K),
    row_sums (B, N))`` where ``row_sums = P @ 1``.
    """
    logb = torch.log(b)
    _, lse2, vbar = softmin(
        x, y, g, logb, cx, cy, eps=eps, c2=c2, v=v, labels=labels, precision=precision,
        backend=backend, want_lse=True,
    )  # fmt: skip
    dt = vbar.dtype
    # log row sum = log a_i + (f_i - cx_i)/eps + ln2 * lse2_i
    log_rows = torch.log(a.to(dt)) + (f.to(dt) - cx.to(dt)) / eps + LN2 * lse2.to(dt)
    rows = torch.exp(log_rows)
    if normalize:
        return vbar, rows
    return vbar * rows[..., None], rows


def self_softmin(
    x: torch.Tensor,
    loga: torch.Tensor,
    f: torch.Tensor,
    cx: torch.Tensor,
    *,
    eps: float,
    c2: float,
    damping: float = 1.0,
    precision: str = "tf32",
    center: torch.Tensor | None = None,
    backend: str = "auto",
    check: bool = True,
):
    """Self-transport update ``damping * softmin_j(eps, C(x_i, x_j), log a_j + f_j / eps)``.

    The same result as ``softmin(x, x, f, loga, cx, cx, ...)[0]`` for the squared-Euclidean
    cost (``cx = (c2/2) |x - c|^2``), but on the triton backend each symmetric tile pair is
    computed once (half the exps). Falls back to :func:`softmin` on the torch backend, when
    some weight is zero, or when the potentials' spread makes fixed offsets unsafe (one
    host sync, skipped with ``check=False``). Shapes: x (B, N, D), loga, f, cx (B, N).
    """
    be = resolve_backend(backend, x.device)
    check_precision(precision, be)
    A = (loga + f / eps) * LOG2E
    use_fast = be == "triton"
    if use_fast and check:
        spread = A.amax(dim=-1) - A.amin(dim=-1)
        use_fast = bool((spread < _config.SELF_SPREAD_MAX).all())  # False for -inf / nan
    if not use_fast:
        return softmin(
            x, x, f, loga, cx, cx, eps=eps, c2=c2, damping=damping, precision=precision,
            backend=backend, center=center,
        )[0]  # fmt: skip
    return self_softmin_triton(x, A, cx, eps, c2, damping, precision, center)
