"""The exact Birkhoff projection: T = argmin over doubly stochastic T of KL(T || exp(A)).

Read top to bottom: reference (float64, in :mod:`mhc_proj.reference`), launchers
``birkhoff_fwd`` / ``birkhoff_bwd`` around the C++ / CUDA kernels, the ``torch.library``
custom ops with fake implementations and the autograd formula (implicit backward, only T
saved), the public :func:`birkhoff_project`, and the :class:`BirkhoffProjection` module.

CUDA layouts for n = 4 float32 (forward stage 1 and backward), selected per call with
``MHC_PROJ_BIRKHOFF_LAYOUT`` (or the ``layout`` argument of the launchers):

- ``thread`` (default): one thread per matrix, 16-byte loads (H200: forward 1.92 ms,
  backward 0.913 ms at B = 16M, run 4).
- ``lane``: 16 lanes per matrix, two matrices per warp, register shuffles
  (``csrc/mhc_lane16.h``, the published layout). Same algorithm, tolerances, info words and
  float64 stage; opt-in: measured slower on the H200 (forward 12.0 ms, backward 2.39 ms at
  B = 16M; packages/mhc-proj/NOTES.md).
- ``thread-wave``: ``thread`` with the float64 stage (the re-solve of the ill-conditioned
  matrices, ~24% of them at N(0, 10^2)) on a grid of one wave of resident blocks instead of
  528 blocks (of which only 396 fit at once on the H200): bitwise the results of ``thread``.
- ``thread-fb2``: ``thread-wave`` whose warm-started polish updates its plan from the
  accepted step instead of recomputing 16 double exponentials per iteration (same
  decisions and tolerances; T agrees with ``thread`` to fp32 rounding). ``thread-fb2-occ3``:
  the same kernel capped at 3 resident blocks per SM (spills to L1).
- ``thread-c10``: ``thread-fb2`` whose fp32 stage starts the continuation in the logit
  scale from range 10 instead of 16 (fewer Newton iterations at large logits: the first
  stage is the slow one at N(0, 10^2)); N(0,1) inputs rarely have a range above 10.
- ``thread-c10ls``: ``thread-c10`` whose line searches (fp32 and float64) evaluate the
  objective change with one log1p instead of n (``armijo_log_sum``): ~100 fewer
  instructions per fp32 line-search trial; the same decisions up to rounding (CPU: bitwise
  ``thread`` at N(0,1) on 200k matrices).
  H200 (2026-12-01, NOTES.md), forward at B = 16M: ``thread-c10ls`` 1.65 / 5.42 ms at
  N(0,1) / N(0,10^2) against ``thread``'s 1.91 / 10.15, but 3.49 / 5.91 ms at N(0,2^2) /
  N(0,3^2) against 2.46 / 4.06 (a warp runs its plain and its continued solves one after
  the other); the others within 5% of ``thread`` at N(0,10^2) or slower.
- ``thread-flat``: ``thread-c10ls`` with the continuation stages and the plain solve in one
  Newton loop (``mhc::newton_project_flat``): bitwise ``thread-c10ls``'s results on the
  CPU; made for N(0,2^2)-N(0,3^2), not yet measured on a GPU.
  These six are opt-in (NOTES.md). The CPU runs the same math for the fb2, c10 and flat
  layouts (n = 4 float32), so the CPU tests check it; ``thread-wave`` is ``thread`` on the
  CPU.

Other CUDA cases (n != 4, float64) and the CPU have one layout and ignore the setting (it is
still validated, so a misspelt value fails everywhere).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mhc_proj import _backend
from mhc_proj.reference import birkhoff_project_ref, birkhoff_vjp_ref  # noqa: F401

__all__ = ["birkhoff_project", "BirkhoffProjection", "ProjectionInfo", "N_MIN", "N_MAX"]

N_MIN, N_MAX = 2, 8

# Defaults. fp32 stage: stop at an L1 marginal error of 4e-6 (the fp32 rounding floor of
# the check is ~1e-6); matrices that miss it, or whose Hessian has a pivot below
# PIVOT_MIN (nearly disconnected support: T and its VJP most sensitive to rounding), are
# re-solved in float64. float64 inputs are solved in float64 to 1e-13.
TOL_F32, MAX_ITER_F32 = 4e-6, 30
TOL_F64, MAX_ITER_F64 = 1e-13, 100
FALLBACK_TOL, FALLBACK_MAX_ITER = 1e-10, 200
PIVOT_MIN = 2e-4

_INFO_FALLBACK = 1 << 16
_INFO_CONVERGED = 1 << 17


class ProjectionInfo(NamedTuple):
    """Per-matrix solver report, each of shape ``logits.shape[:-2]``.

    ``iterations``: Newton iterations used (fp32 stage plus float64 re-solve), int32.
    ``converged``: the returned T meets the tolerance. ``fallback``: re-solved in float64.
    """

    iterations: torch.Tensor
    converged: torch.Tensor
    fallback: torch.Tensor


# ---------------------------------------------------------------- layouts
LAYOUT_ENV = "MHC_PROJ_BIRKHOFF_LAYOUT"
_LAYOUTS = {
    "lane": 0,
    "thread": 1,
    "thread-wave": 2,
    "thread-fb2": 3,
    "thread-fb2-occ3": 4,
    "thread-c10": 5,
    "thread-c10ls": 6,
    "thread-flat": 7,
}
# The default since 2026-12-01 (H200 run of packages/mhc-proj/results/run6-*: fwd at 16M
# 0.91x / 1.06x / 0.88x / 0.55x the time of "thread" at logits N(0, sigma^2), sigma 1 / 2 /
# 3 / 10; GPU tests vs thread and float64 passed): c10ls's math in one Newton loop.
DEFAULT_LAYOUT = "thread-flat"
# layout code -> the CPU birkhoff_fwd variant that runs the same math (n = 4 float32)
_CPU_VARIANT = {3: 1, 4: 1, 5: 2, 6: 3, 7: 4}


def layout_code(layout: str | int | None = None) -> int:
    """CUDA kernel layout code: ``layout`` if given (a name or its code), else the
    ``MHC_PROJ_BIRKHOFF_LAYOUT`` environment variable (read at each call), else
    ``DEFAULT_LAYOUT`` (``"thread-flat"``). ``"lane"`` = 0 (16 lanes per matrix),
    ``"thread"`` = 1 (thread per matrix; the default before 2026-12-01),
    ``"thread-wave"`` = 2, ``"thread-fb2"`` = 3, ``"thread-fb2-occ3"`` = 4, ``"thread-c10"``
    = 5, ``"thread-c10ls"`` = 6, ``"thread-flat"`` = 7 (thread per matrix with other float64
    stages, continuation, line search or loop structure, module docstring). Used for n = 4
    float32; the CPU has no lane layout and runs the thread variants' math."""
    return _backend.choice_code(layout, LAYOUT_ENV, _LAYOUTS, "Birkhoff layout", DEFAULT_LAYOUT)


# ---------------------------------------------------------------- launchers
def birkhoff_fwd(
    x: torch.Tensor,
    tol: float,
    max_iter: int,
    want_info: bool,
    fallback_tol: float = FALLBACK_TOL,
    fallback_max_iter: int = FALLBACK_MAX_ITER,
    pivot_min: float = PIVOT_MIN,
    layout: str | int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the forward on (B, n, n) contiguous float32/float64 ``x``.

    Returns T (same dtype) and the int32 info words (B,) (empty when not wanted).
    ``layout``: see :func:`layout_code` (CUDA n = 4 float32 only; ignored elsewhere).
    """
    code = layout_code(layout)
    b, n = x.shape[0], x.shape[-1]
    x = _backend.aligned(x)
    out = torch.empty_like(x)
    info = torch.empty(b if want_info else 0, dtype=torch.int32, device=x.device)
    if b == 0:
        return out, info
    mod = _backend.for_tensor(x)
    info_ptr = info.data_ptr() if want_info else 0
    if x.is_cuda:
        with _backend.on_device(x):
            # fallback work list: count, indices, then n fp32 potentials per entry
            work = torch.empty(1 + b + b * n, dtype=torch.int32, device=x.device)
            mod.birkhoff_fwd(
                x.data_ptr(), out.data_ptr(), info_ptr, work.data_ptr(), b, n,
                _backend.dtype_code(x), tol, max_iter, fallback_tol, fallback_max_iter,
                pivot_min, _backend.stream(x), code,
            )  # fmt: skip
    else:  # one layout on the CPU; the fb2 layouts' float64 stage is its variant 1
        fp32_4 = n == 4 and x.dtype == torch.float32
        variant = _CPU_VARIANT.get(code, 0) if fp32_4 else 0
        mod.birkhoff_fwd(
            x.data_ptr(), out.data_ptr(), info_ptr, b, n, _backend.dtype_code(x), tol,
            max_iter, fallback_tol, fallback_max_iter, pivot_min, variant,
        )  # fmt: skip
    return out, info


def birkhoff_bwd(
    t: torch.Tensor, grad: torch.Tensor, layout: str | int | None = None
) -> torch.Tensor:
    """Implicit VJP on (B, n, n) contiguous ``t`` and ``grad`` of the same dtype.
    ``layout``: see :func:`layout_code` (CUDA n = 4 float32 only; ignored elsewhere)."""
    code = layout_code(layout)
    b, n = t.shape[0], t.shape[-1]
    t, grad = _backend.aligned(t), _backend.aligned(grad)
    out = torch.empty_like(t)
    if b == 0:
        return out
    mod = _backend.for_tensor(t)
    if t.is_cuda:
        with _backend.on_device(t):
            mod.birkhoff_bwd(
                t.data_ptr(), grad.data_ptr(), out.data_ptr(), b, n, _backend.dtype_code(t),
                _backend.stream(t), code,
            )  # fmt: skip
    else:  # one layout on the CPU
        mod.birkhoff_bwd(
            t.data_ptr(), grad.data_ptr(), out.data_ptr(), b, n, _backend.dtype_code(t)
        )
    return out


# ---------------------------------------------------------------- custom ops
@torch.library.custom_op("mhc_proj::birkhoff_fwd", mutates_args=())
def _fwd_op(
    x: torch.Tensor, tol: float, max_iter: int, want_info: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return birkhoff_fwd(x, tol, max_iter, want_info)


@_fwd_op.register_fake
def _(x, tol, max_iter, want_info):
    info = x.new_empty((x.shape[0] if want_info else 0,), dtype=torch.int32)
    return torch.empty_like(x), info


@torch.library.custom_op("mhc_proj::birkhoff_bwd", mutates_args=())
def _bwd_op(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return birkhoff_bwd(t, grad)


@_bwd_op.register_fake
def _(t, grad):
    return torch.empty_like(t)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[0])


def _backward(ctx, grad_t, grad_info):
    (t,) = ctx.saved_tensors
    if grad_t is None:
        return None, None, None, None
    return _bwd_op(t, grad_t.to(t.dtype).contiguous()), None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _BirkhoffFunction(torch.autograd.Function):
    """Eager fast path: the same launchers without the custom-op dispatch overhead
    (tens of microseconds per call, which dominate at small batches). Under
    ``torch.compile`` the custom op above is used instead."""

    @staticmethod
    def forward(ctx, x, tol, max_iter, want_info, layout=None):
        t, info = birkhoff_fwd(x, tol, max_iter, want_info, layout=layout)
        ctx.save_for_backward(t)
        ctx.mark_non_differentiable(info)
        ctx.layout = layout  # None: the environment at backward time decides
        return t, info

    @staticmethod
    def backward(ctx, grad_t, grad_info):
        (t,) = ctx.saved_tensors
        g = grad_t.to(t.dtype).contiguous()
        return birkhoff_bwd(t, g, ctx.layout), None, None, None, None


class _BirkhoffProject(torch.autograd.Function):
    """Eager path without info, one autograd node for the whole public call: the cast to
    the compute dtype and the (..., n, n) <-> (B, n, n) reshapes happen inside forward
    and backward instead of as separate autograd nodes (each costs microseconds of host
    time per call, which is what eager calls at small batches measure)."""

    @staticmethod
    def forward(ctx, logits, compute_dtype, tol, max_iter, layout):
        n = logits.shape[-1]
        x = logits.to(compute_dtype).reshape(-1, n, n).contiguous()
        t, _ = birkhoff_fwd(x, tol, max_iter, False, layout=layout)
        ctx.save_for_backward(t)
        ctx.layout = layout  # None: the environment at backward time decides
        ctx.in_dtype = logits.dtype
        return t.view(logits.shape)

    @staticmethod
    def backward(ctx, grad_t):
        (t,) = ctx.saved_tensors
        g = grad_t.reshape(t.shape).to(t.dtype).contiguous()
        da = birkhoff_bwd(t, g, ctx.layout).view(grad_t.shape).to(ctx.in_dtype)
        return da, None, None, None, None


# ---------------------------------------------------------------- public API
def _check(logits: object) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor; got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(
            "logits must have a floating dtype (float32, bfloat16, float16 or float64); "
            f"got {logits.dtype}"
        )
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"logits must have shape (..., n, n); got {tuple(logits.shape)}")
    n = logits.shape[-1]
    if not N_MIN <= n <= N_MAX:
        raise ValueError(f"logits: n must be in {N_MIN}..{N_MAX}; got n={n}")
    if logits.device.type not in ("cpu", "cuda"):
        raise ValueError(f"logits must be on a CPU or CUDA device; got {logits.device}")
    return logits


def birkhoff_project(
    logits: torch.Tensor,
    *,
    tol: float | None = None,
    max_iter: int | None = None,
    return_info: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ProjectionInfo]:
    """Projects each n x n matrix of ``logits`` onto the Birkhoff polytope (exact, KL).

    T = diag(u) exp(A) diag(v) with all row and column sums 1, for every finite input.

    Args:
        logits: (..., n, n), n in 2..8, any leading dims and strides. float32, bfloat16
            and float16 are computed in float32; float64 is computed in float64.
        tol: stopping tolerance on the L1 marginal error per matrix (default 4e-6 for
            float32, 1e-13 for float64).
        max_iter: Newton iterations per continuation stage (default 30 / 100).
        return_info: also return a :class:`ProjectionInfo`.

    Returns:
        T of shape (..., n, n), float32 (float64 for float64 input); differentiable
        (implicit backward, only T saved). With ``return_info``: ``(T, info)``.

    The kernel layout (n = 4 float32) is read from ``MHC_PROJ_BIRKHOFF_LAYOUT`` at each
    call (``thread`` default, ``lane``, ``thread-wave``, ``thread-fb2``,
    ``thread-fb2-occ3``, ``thread-c10``, ``thread-c10ls``); see the module docstring.
    """
    return _project(logits, tol=tol, max_iter=max_iter, return_info=return_info)


def _project(
    logits: torch.Tensor,
    *,
    tol: float | None = None,
    max_iter: int | None = None,
    return_info: bool = False,
    layout: str | None = None,
):
    """:func:`birkhoff_project` with an explicit CUDA layout for the forward and the
    backward (eager path; under ``torch.compile`` the environment variable decides). Used
    by the benchmark."""
    if layout is not None:
        layout_code(layout)  # validate before the forward runs
    logits = _check(logits)
    shape = logits.shape
    n = shape[-1]
    if logits.dtype == torch.float64:
        dtype = torch.float64
        tol = TOL_F64 if tol is None else float(tol)
        max_iter = MAX_ITER_F64 if max_iter is None else int(max_iter)
    else:
        dtype = torch.float32
        tol = TOL_F32 if tol is None else float(tol)
        max_iter = MAX_ITER_F32 if max_iter is None else int(max_iter)
    if not tol > 0:
        raise ValueError(f"tol must be > 0; got {tol}")
    if max_iter < 0:
        raise ValueError(f"max_iter must be >= 0; got {max_iter}")
    compiling = torch.compiler.is_compiling()
    if not return_info and not compiling:
        return _BirkhoffProject.apply(logits, dtype, tol, max_iter, layout)
    x = logits.to(dtype).reshape(-1, n, n).contiguous()
    if compiling:
        t, info = _fwd_op(x, tol, max_iter, return_info)
    else:
        t, info = _BirkhoffFunction.apply(x, tol, max_iter, return_info, layout)
    t = t.reshape(shape)
    if not return_info:
        return t
    lead = shape[:-2]
    return t, ProjectionInfo(
        iterations=(info & 0xFFFF).reshape(lead),
        converged=((info & _INFO_CONVERGED) != 0).reshape(lead),
        fallback=((info & _INFO_FALLBACK) != 0).reshape(lead),
    )


class BirkhoffProjection(torch.nn.Module):
    """``nn.Module`` wrapper of :func:`birkhoff_project` (no parameters)."""

    def __init__(self, tol: float | None = None, max_iter: int | None = None) -> None:
        super().__init__()
        self.tol = tol
        self.max_iter = max_iter

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return birkhoff_project(logits, tol=self.tol, max_iter=self.max_iter)

    def extra_repr(self) -> str:
        return f"tol={self.tol}, max_iter={self.max_iter}"
