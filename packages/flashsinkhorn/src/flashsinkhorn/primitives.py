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

- ``"triton"``: the portable Triton kernels only (CUDA tensors, or CPU tensors when
  ``TRITON_INTERPRET=1`` was set before Python started: CI runs them that way);
- ``"torch"``: a blockwise pure-torch path (row blocks against all columns), any device and
  dtype (float64 included), same math;
- ``"auto"``: the Triton kernels on CUDA, and on sm_90 GPUs (H100 / H200) the Gluon kernels
  for the passes they support (no labels or ``center``; tf32 / bf16; at least
  ``_config.SM90_MIN_SCORES`` scores): ``_softmin_hopper`` for the iteration passes,
  ``_plan_hopper`` for the passes with ``v``; torch otherwise.

Precision of the dot product (triton backend): ``"tf32"`` (default), ``"ieee"`` (full fp32),
``"tf32x3"``, or ``"bf16"`` (operands in bfloat16, fp32 accumulation); everything else is
fp32. The float64 references are in :mod:`flashsinkhorn.reference`.
"""

from __future__ import annotations

import math
import warnings

import torch

from flashsinkhorn import _config, _plan_hopper, _softmin_hopper, _symmetric_hopper
from flashsinkhorn._self_softmin_triton import self_softmin_triton
from flashsinkhorn._softmin_triton import softmin_rows_triton, softmin_triton
from flashsinkhorn._symmetric_triton import symmetric_sums_triton
from flashsinkhorn._triton_tiles import HAS_TRITON
from flashsinkhorn.reference import LN2, LOG2E

_FLT_MAX = 3.4028234663852886e38

__all__ = [
    "softmin",
    "plan_apply",
    "self_softmin",
    "symmetric_update",
    "resolve_backend",
    "problem_backend",
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


def problem_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend a solver keeps for all its passes: ``"torch"`` where ``backend``
    resolves to it (and for float64 inputs under ``"auto"``: the Triton kernels compute in
    fp32), else ``backend`` itself, so that ``"auto"`` keeps choosing the sm_90 kernel per
    pass and ``"triton"`` keeps meaning the portable kernels only."""
    be = resolve_backend(backend, device)
    if be == "torch" or (backend == "auto" and dtype == torch.float64):
        return "torch"
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


def sm90_pass_reason(x, y, precision, v=None, labels=None, center=None) -> str | None:
    """Why a ``backend="auto"`` pass on these kernel operands does not run the sm_90 Gluon
    kernel (None: it does). Cheap: no launch, no sync."""
    if x.device.type != "cuda":
        return "not a CUDA tensor"
    B, N, _ = x.shape
    if B * N * y.shape[1] < _config.SM90_MIN_SCORES:
        return f"fewer than {_config.SM90_MIN_SCORES} scores (_config.SM90_MIN_SCORES)"
    if v is not None and labels is None and center is None:
        return _plan_hopper.plan_reason(x, y, v, precision)
    return _softmin_hopper.unsupported_reason(x, y, precision, v=v, labels=labels, center=center)


# sm_90 kernels that raised on this host (a compile error of its triton, say): the kernel
# and the error, then the portable kernel for the rest of the process (sm90_call)
SM90_FAILED: dict[str, str] = {}


def sm90_call(kernel: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (an sm_90 Gluon launcher), or None where the caller runs the
    portable kernel instead: the launcher declines the inputs (``NotImplementedError``), or
    ``kernel`` (a name with the compile-time mode, e.g. ``"plan d=64 dv=64 float32"``)
    raised once before in this process. Any other exception (a Gluon compile error on this
    host's triton) is recorded in :data:`SM90_FAILED`, warned about once and answered with
    None: the result then comes from the Triton kernel, which the GPU tests compare with."""
    if kernel in SM90_FAILED:
        return None
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        return None
    except Exception as e:  # noqa: BLE001 - any failure of the optional kernel
        SM90_FAILED[kernel] = f"{type(e).__name__}: {str(e)[:2000]}"
        warnings.warn(
            f"flashsinkhorn: the sm_90 kernel '{kernel}' failed ({type(e).__name__}: "
            f"{str(e)[:300]}); the portable Triton kernel runs instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _triton_pass(
    x,
    y,
    g,
    logb,
    cx,
    cy,
    eps,
    c2,
    damping,
    v,
    labels,
    precision,
    want_lse,
    center,
    guess,
    backend="triton",
):
    """The one place where the kernel of a softmin pass on the Triton backend is chosen.

    ``backend="auto"`` on an sm_90 GPU: the Gluon kernels for the passes they support
    (:func:`sm90_pass_reason`), ``_plan_hopper`` with ``v`` and ``_softmin_hopper``
    without, the Triton kernel if they decline or fail (:func:`sm90_call`). Otherwise the
    portable kernels of ``_softmin_triton``: the shift kernel when ``guess`` is given and
    there is no ``v`` (the Sinkhorn loops' passes), the running-max kernel otherwise (cold
    start, plan application).
    """
    if backend == "auto" and labels is None and center is None and x.is_cuda:
        kdt = torch.bfloat16 if precision == "bf16" else torch.float32
        xk, yk = x.to(kdt), y.to(kdt)
        if sm90_pass_reason(xk, yk, precision) is None:
            D, mode = x.shape[2], f"{kdt}".replace("torch.", "")
            if v is not None:
                res = sm90_call(
                    f"plan d={D} dv={v.shape[2]} {mode}",
                    _plan_hopper.plan_hopper,
                    xk,
                    yk,
                    v,
                    g,
                    logb,
                    cx,
                    cy,
                    eps=eps,
                    c2=c2,
                    damping=damping,
                    precision=precision,
                    want_lse=want_lse,
                    guess=guess,
                )
                if res is not None:
                    return res
            else:
                res = sm90_call(
                    f"softmin d={D} {mode}",
                    _softmin_hopper.softmin_hopper,
                    xk,
                    yk,
                    g,
                    logb,
                    cx,
                    cy,
                    eps=eps,
                    c2=c2,
                    damping=damping,
                    precision=precision,
                    want_lse=want_lse,
                    guess=guess,
                )
                if res is not None:
                    return res[0], res[1], None
    return softmin_triton(
        x,
        y,
        g,
        logb,
        cx,
        cy,
        eps,
        c2,
        damping,
        v,
        labels,
        precision,
        want_lse,
        center,
        guess,
    )


# ----------------------------------------------------------------------------------------
# blockwise torch path (any device, any float dtype)
# ----------------------------------------------------------------------------------------


def block_rows(n: int, m: int) -> int:
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
    rows = block_rows(N, M)
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
        backend: "auto" (on sm_90 the Gluon kernel for the passes it supports), "triton"
            (the portable Triton kernels only) or "torch".
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
            the running max in the same kernel). With ``v`` on sm_90 (``backend="auto"``) the
            Gluon plan application uses it the same way. Ignored otherwise.

    Returns:
        ``(out, lse2_or_None, vbar_or_None)``; ``out = damping * softmin_j(...)`` (B, N).
    """
    _check_operands(x, y, g, logb, cx, cy, eps, v, guess)
    be = resolve_backend(backend, x.device)
    check_precision(precision, be)
    if be == "triton":
        return _triton_pass(
            x,
            y,
            g,
            logb,
            cx,
            cy,
            eps,
            c2,
            damping,
            v,
            labels,
            precision,
            want_lse,
            center,
            guess,
            backend=backend,
        )
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
    # f is the c-transform of g where (f, g) solve the problem: the sm_90 kernel's shift
    # (exact whatever f: rows it does not fit are recomputed)
    _, lse2, vbar = softmin(
        x,
        y,
        g,
        logb,
        cx,
        cy,
        eps=eps,
        c2=c2,
        v=v,
        labels=labels,
        precision=precision,
        backend=backend,
        want_lse=True,
        guess=f,
    )
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
    host sync, skipped with ``check=False``); with ``backend="auto"`` on sm_90 it runs the
    plain Gluon pass (with ``f`` as the shift kernel's guess) where that applies.
    Shapes: x (B, N, D), loga, f, cx (B, N).
    """
    be = resolve_backend(backend, x.device)
    check_precision(precision, be)
    kdt = torch.bfloat16 if precision == "bf16" else torch.float32
    if backend == "auto" and center is None and be == "triton":
        xk = x.to(kdt)
        if sm90_pass_reason(xk, xk, precision) is None:
            # sm_90: the symmetric Gluon kernel (each tile pair once, rows and columns from
            # one exp: N^2 / 2 scores); if it fails, the plain Gluon pass in shift mode
            ft = _self_update_sm90(xk, loga, f, cx, eps, c2, damping, precision)
            if ft is not None:
                return ft
            return softmin(
                xk,
                xk,
                f,
                loga,
                cx,
                cx,
                eps=eps,
                c2=c2,
                damping=damping,
                precision=precision,
                backend=backend,
                guess=f,
            )[0]
    A = (loga + f / eps) * LOG2E
    use_fast = be == "triton"
    if use_fast and check:
        spread = A.amax(dim=-1) - A.amin(dim=-1)
        use_fast = bool((spread < _config.SELF_SPREAD_MAX).all())  # False for -inf / nan
    if not use_fast:
        return softmin(
            x,
            x,
            f,
            loga,
            cx,
            cx,
            eps=eps,
            c2=c2,
            damping=damping,
            precision=precision,
            backend=backend,
            center=center,
        )[0]
    return self_softmin_triton(x, A, cx, eps, c2, damping, precision, center)


def _self_update_sm90(xk, loga, f, cx, eps, c2, damping, precision):
    """The self-transport update on the sm_90 symmetric kernel (``self_sums_hopper``), or
    None if it failed. The math of :func:`symmetric_update` with y = x: row sums of
    ``exp2(q_ij + rb_i + rb_j)`` with the shift ``sigma`` putting a mean weight's sum at
    2^SHIFT_CENTER; rows whose sum left the safe range recomputed exactly."""
    f32 = torch.float32
    loga, f, cx = loga.to(f32), f.to(f32), cx.to(f32)
    N = xk.shape[1]
    mean_w = torch.logsumexp(loga, -1) - math.log(N)
    sigma = torch.nan_to_num(_config.SHIFT_CENTER - LOG2E * mean_w, 0.0, 0.0, 0.0)
    half = (0.5 * sigma)[:, None]
    rb = (loga + (f - cx) / eps) * LOG2E + half
    rsum = sm90_call(
        f"self d={xk.shape[2]} {precision}",
        _symmetric_hopper.self_sums_hopper,
        xk,
        rb,
        eps=eps,
        c2=c2,
        precision=precision,
    )
    if rsum is None:
        return None
    ft = damping * (cx - (eps * LN2) * (torch.log2(rsum) - rb - half))
    bad = ((rsum >= _config.SHIFT_LO) & (rsum <= _FLT_MAX)).logical_not_()
    _recompute_rows(xk, xk, f, loga, cx, cx, eps, c2, damping, precision, bad, ft, True)
    return ft


def one_pass_reason(x, y, labels, backend) -> str | None:
    """Why :func:`symmetric_update` on these operands runs two passes instead of one (None:
    one pass). ``backend`` as resolved (``"triton"`` or ``"torch"``)."""
    if backend != "triton":
        return "the torch backend runs the two passes"
    if labels is not None:
        return "the label cost is not implemented in the one-pass kernels"
    B, N, _ = x.shape
    if x.device.type == "cuda" and B * N * y.shape[1] < _config.ONE_PASS_MIN_SCORES:
        return f"fewer than {_config.ONE_PASS_MIN_SCORES} scores (_config.ONE_PASS_MIN_SCORES)"
    return None


def _check_symmetric(x, y, f, g, loga, logb, cx, cy, eps):
    if x.dim() != 3 or y.dim() != 3 or y.shape[0] != x.shape[0] or y.shape[2] != x.shape[2]:
        raise ValueError(
            f"x must be (B, N, D) and y (B, M, D); got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    B, N, _ = x.shape
    M = y.shape[1]
    for name, t, n in (
        ("f", f, N),
        ("loga", loga, N),
        ("cx", cx, N),
        ("g", g, M),
        ("logb", logb, M),
        ("cy", cy, M),
    ):
        if tuple(t.shape) != (B, n):
            raise ValueError(f"{name} must be ({B}, {n}); got {tuple(t.shape)}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite positive number; got {eps!r}")


def symmetric_update(
    x: torch.Tensor,
    y: torch.Tensor,
    f: torch.Tensor,
    g: torch.Tensor,
    loga: torch.Tensor,
    logb: torch.Tensor,
    cx: torch.Tensor,
    cy: torch.Tensor,
    *,
    eps: float,
    c2: float,
    damping_x: float = 1.0,
    damping_y: float = 1.0,
    labels: tuple | None = None,
    precision: str = "tf32",
    backend: str = "auto",
    stats: dict | None = None,
):
    """Both updates of a symmetric (GeomLoss) Sinkhorn iteration from the old potentials:

        f_new = softmin(x, y, g, logb, cx, cy, damping=damping_x, ...)[0]    (B, N)
        g_new = softmin(y, x, f, loga, cy, cx, damping=damping_y, ...)[0]    (B, M)

    (shapes and conventions of :func:`softmin`; ``labels`` as for the x side). On the
    triton backend one streaming pass computes both (``backend="auto"`` on sm_90: the
    Gluon kernel of ``_symmetric_hopper``, else the Triton one) from the plan's entries
    ``P_ij = exp(log a_i + log b_j + (f_i + g_j - C_ij) / eps)``: its row sums give f_new,
    its column sums g_new, one exp per score (half the work of two passes). Rows and
    columns whose sums leave ``[2^-60, FLT_MAX]`` (potentials far from each other, zero
    weights, non-finite values) are recomputed with the running-max kernel, so the result
    is exact whatever the potentials. Two ordinary passes (with the old potentials as
    guesses) run on the torch backend, with labels, and on CUDA below
    ``_config.ONE_PASS_MIN_SCORES`` scores (:func:`one_pass_reason`).

    ``stats`` (a dict, optional) receives ``"kernel"`` (which path ran) and, for the one
    pass, ``"rows_recomputed"`` / ``"cols_recomputed"`` (device tensors, no sync).
    Returns ``(f_new, g_new)``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    _check_symmetric(x, y, f, g, loga, logb, cx, cy, eps)
    be = resolve_backend(backend, x.device)
    stats = {} if stats is None else stats
    reason = one_pass_reason(x, y, labels, be)
    if reason is not None:
        stats["kernel"] = f"two passes ({reason})"
        kw = dict(eps=eps, c2=c2, precision=precision, backend=backend)
        lab_t = None if labels is None else (labels[1], labels[0], labels[2].t(), labels[3])
        ft = softmin(x, y, g, logb, cx, cy, damping=damping_x, labels=labels, guess=f, **kw)[0]
        gt = softmin(y, x, f, loga, cy, cx, damping=damping_y, labels=lab_t, guess=g, **kw)[0]
        return ft, gt
    f32 = torch.float32
    kdt = torch.bfloat16 if precision == "bf16" else f32
    xk, yk = x.to(kdt).contiguous(), y.to(kdt).contiguous()
    B, N, _ = x.shape
    M = y.shape[1]
    loga, logb, f, g, cx, cy = (t.to(f32) for t in (loga, logb, f, g, cx, cy))
    # one shift sigma (log2) for the whole problem: row sums land near a_i 2^sigma, column
    # sums near b_j 2^sigma; sigma puts a mean weight at 2^SHIFT_CENTER in both directions
    mean_w = torch.logsumexp(loga, -1) - math.log(N) + torch.logsumexp(logb, -1) - math.log(M)
    sigma = torch.nan_to_num(_config.SHIFT_CENTER - 0.5 * LOG2E * mean_w, 0.0, 0.0, 0.0)
    half = (0.5 * sigma)[:, None]
    rb = (loga + (f - cx) / eps) * LOG2E + half
    cb = (logb + (g - cy) / eps) * LOG2E + half
    rsum = None
    if backend == "auto" and _symmetric_hopper.unsupported_reason(xk, yk, precision) is None:
        # the sm_90 Gluon kernel (CUDA, tf32 / bf16, 16-byte rows)
        res = sm90_call(
            f"symmetric d={x.shape[2]} {precision}",
            _symmetric_hopper.symmetric_sums_hopper,
            xk,
            yk,
            rb,
            cb,
            eps=eps,
            c2=c2,
            precision=precision,
        )
        if res is not None:
            rsum, csum = res
            stats["kernel"] = "one pass (sm_90 Gluon)"
    if rsum is None:
        rsum, csum = symmetric_sums_triton(xk, yk, rb, cb, eps=eps, c2=c2, precision=precision)
        stats["kernel"] = "one pass (Triton)"
    ft = damping_x * (cx - (eps * LN2) * (torch.log2(rsum) - rb - half))
    gt = damping_y * (cy - (eps * LN2) * (torch.log2(csum) - cb - half))
    # sums out of range (NaN fails both tests): those rows / columns again, exactly
    bad_r = ((rsum >= _config.SHIFT_LO) & (rsum <= _FLT_MAX)).logical_not_()
    bad_c = ((csum >= _config.SHIFT_LO) & (csum <= _FLT_MAX)).logical_not_()
    stats["rows_recomputed"], stats["cols_recomputed"] = bad_r.sum(), bad_c.sum()
    gluon = stats["kernel"] == "one pass (sm_90 Gluon)"
    _recompute_rows(xk, yk, g, logb, cx, cy, eps, c2, damping_x, precision, bad_r, ft, gluon)
    _recompute_rows(yk, xk, f, loga, cy, cx, eps, c2, damping_y, precision, bad_c, gt, gluon)
    return ft, gt


def _recompute_rows(xk, yk, g, logb, cx, cy, eps, c2, damping, precision, bad, out, gluon):
    """The rows of a one pass whose sums left the safe range, recomputed in place in
    ``out`` with the running max: on sm_90 the Gluon pass's fallback launch (``gluon``),
    else the Triton kernel. On CUDA always launched (blocks without a flagged row exit at
    once: no host sync); on CPU (the interpreter) only when a row is flagged."""
    if xk.device.type == "cpu" and not bool(bad.any()):
        return
    if gluon:
        res = sm90_call(
            f"softmin rows d={xk.shape[2]} {precision}",
            _softmin_hopper.softmin_rows_hopper,
            xk,
            yk,
            g,
            logb,
            cx,
            cy,
            eps=eps,
            c2=c2,
            damping=damping,
            precision=precision,
            flags=bad,
            out=out,
        )
        if res is not None:
            return
    softmin_rows_triton(xk, yk, g, logb, cx, cy, eps, c2, damping, precision, bad, out)
