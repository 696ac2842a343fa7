"""The exact Birkhoff projection: T = argmin over doubly stochastic T of KL(T || exp(A)).

Read top to bottom: the float64 reference (in :mod:`mhc_proj.reference`), the launchers
``birkhoff_fwd`` / ``birkhoff_bwd`` around the C++ / CUDA kernels, the ``torch.library``
custom ops with fake implementations and the autograd formula (implicit backward, only T
saved), the eager autograd node, the public :func:`birkhoff_project`, and the
:class:`BirkhoffProjection` module.

Kernels (``csrc/``, one thread per matrix; the CPU module runs the same header code):
float32 inputs are solved by Newton in float32, and the matrices that miss the tolerance
or are ill-conditioned are re-solved in float64 (warm-started from their float32
potentials); float64 inputs are solved in float64. n = 4 float32 on CUDA is the tuned
kernel (continuation from logit range 10 inside one Newton loop, a one-log1p line search,
a plan-updating float64 polish; H200: 1.83 ms at B = 16M, N(0,1) logits); other n run the
generic kernels of the same algorithm. Design and measurements: docs/design/mhc-proj.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mhc_proj import _backend
from mhc_proj._config import (
    FALLBACK_MAX_ITER,
    FALLBACK_TOL,
    MAX_ITER_F32,
    MAX_ITER_F64,
    N_MAX,
    N_MIN,
    PIVOT_MIN,
    TOL_F32,
    TOL_F64,
)
from mhc_proj.reference import birkhoff_project_ref, birkhoff_vjp_ref  # noqa: F401

__all__ = ["birkhoff_project", "BirkhoffProjection", "ProjectionInfo"]

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


# ---------------------------------------------------------------- launchers
# ``_fwd`` / ``_bwd`` take contiguous tensors of any shape (..., n, n) (the kernels see
# B = numel / n^2 matrices one after the other), so the eager path needs no reshapes; the
# public launchers validate and call them.
def _fwd(x: torch.Tensor, tol: float, max_iter: int, info: torch.Tensor | None) -> torch.Tensor:
    """T for contiguous float32/float64 ``x`` (..., n, n); fills ``info`` (B,) int32 if given."""
    n = x.shape[-1]
    b = x.numel() // (n * n)
    if x.data_ptr() % 16:  # _backend.aligned: the CUDA kernels use 16-byte loads
        x = x.clone()
    out = torch.empty_like(x)
    if b == 0:
        return out
    info_ptr = 0 if info is None else info.data_ptr()
    dt = 1 if x.dtype == torch.float64 else 0
    if x.is_cuda:
        mod = _backend.cuda()
        with _backend.on_device(x):
            # the float64 stage's work list: count, indices, then n fp32 potentials per entry
            work = torch.empty(1 + b + b * n, dtype=torch.int32, device=x.device)
            mod.birkhoff_fwd(
                x.data_ptr(), out.data_ptr(), info_ptr, work.data_ptr(), b, n, dt, tol,
                max_iter, FALLBACK_TOL, FALLBACK_MAX_ITER, PIVOT_MIN, _backend.stream(x),
            )  # fmt: skip
    else:
        _backend.cpu().birkhoff_fwd(
            x.data_ptr(), out.data_ptr(), info_ptr, b, n, dt, tol, max_iter, FALLBACK_TOL,
            FALLBACK_MAX_ITER, PIVOT_MIN,
        )  # fmt: skip
    return out


def _bwd(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """dA for contiguous ``t`` and ``grad`` of the same shape (..., n, n) and dtype."""
    n = t.shape[-1]
    b = t.numel() // (n * n)
    if t.data_ptr() % 16:
        t = t.clone()
    if grad.data_ptr() % 16:
        grad = grad.clone()
    out = torch.empty_like(t)
    if b == 0:
        return out
    dt = 1 if t.dtype == torch.float64 else 0
    if t.is_cuda:
        mod = _backend.cuda()
        with _backend.on_device(t):
            mod.birkhoff_bwd(
                t.data_ptr(), grad.data_ptr(), out.data_ptr(), b, n, dt, _backend.stream(t)
            )
    else:
        _backend.cpu().birkhoff_bwd(t.data_ptr(), grad.data_ptr(), out.data_ptr(), b, n, dt)
    return out


def birkhoff_fwd(
    x: torch.Tensor, tol: float, max_iter: int, want_info: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the forward on (B, n, n) contiguous float32/float64 ``x``.

    Returns T (same dtype) and the int32 info words (B,) (empty when not wanted): bits
    0..15 iterations, bit 16 the float64 stage ran, bit 17 converged.
    """
    _backend.for_tensor(x)  # a clear error for other devices / a missing CUDA module
    info = torch.empty(x.shape[0] if want_info else 0, dtype=torch.int32, device=x.device)
    return _fwd(x, tol, max_iter, info if want_info else None), info


def birkhoff_bwd(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Implicit VJP on (B, n, n) contiguous ``t`` and ``grad`` of the same dtype."""
    _backend.for_tensor(t)
    return _bwd(t, grad)


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


# ---------------------------------------------------------------- eager autograd
# Eager calls skip the torch.library dispatch (tens of microseconds per call, which is what
# eager calls at small and medium batches measure); torch.compile sees the custom ops
# above (``birkhoff_project`` branches on torch.compiler.is_compiling()). Both run the same
# kernels on the same contiguous data, so their results are bitwise equal (tests).
class _BirkhoffProject(torch.autograd.Function):
    """The eager path, one autograd node for the whole public call: the cast to the compute
    dtype happens inside forward and backward instead of as separate autograd nodes (each
    costs microseconds of host time per call), and the kernels run on the (..., n, n)
    tensors as they are (contiguous), so no reshape or view either. With ``want_info`` it
    also returns the info words in the shape ``logits.shape[:-2]`` (not differentiable)."""

    @staticmethod
    def forward(ctx, logits, compute_dtype, tol, max_iter, want_info=False):
        x = logits if logits.dtype == compute_dtype else logits.to(compute_dtype)
        ctx.in_dtype = logits.dtype
        if not want_info:
            t = _fwd(x.contiguous(), tol, max_iter, None)
            ctx.save_for_backward(t)
            return t
        info = torch.empty(logits.shape[:-2], dtype=torch.int32, device=logits.device)
        t = _fwd(x.contiguous(), tol, max_iter, info)
        ctx.save_for_backward(t)
        ctx.mark_non_differentiable(info)
        ctx.set_materialize_grads(False)  # no zero gradient for info; grad_t may be None
        return t, info

    @staticmethod
    def backward(ctx, grad_t, *grad_info):
        if grad_t is None:
            return None, None, None, None, None
        (t,) = ctx.saved_tensors
        if grad_t.dtype != t.dtype:
            grad_t = grad_t.to(t.dtype)
        da = _bwd(t, grad_t.contiguous())
        if ctx.in_dtype != t.dtype:
            da = da.to(ctx.in_dtype)
        return da, None, None, None, None


def _direct_apply(fn: type[torch.autograd.Function]):
    """``fn.apply`` without its Python wrapper (~2 us per call on the CPU host), or None
    when this torch lacks the pieces. ``Function.apply`` binds default arguments (only for
    functions with a ``setup_context``; these have none), unwraps dead functorch wrappers and
    then calls the C++ apply; the caller uses it only while no functorch transform is
    active (else ``fn.apply``, whose error it keeps), and unwraps the tensor itself."""
    try:
        c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, fn)
        unwrap = torch._C._functorch.unwrap_if_dead
        active = torch._C._are_functorch_transforms_active
    except (AttributeError, KeyError, TypeError):
        return None

    def apply(logits, *args):
        if active():
            return fn.apply(logits, *args)
        return c_apply(unwrap(logits), *args)

    return apply


_project_apply = _direct_apply(_BirkhoffProject) or _BirkhoffProject.apply


# ---------------------------------------------------------------- public API
def _check(logits: object) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor; got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(
            "logits must have a floating dtype (float32, bfloat16, float16 or float64); "
            f"got {logits.dtype}"
        )
    shape = logits.shape
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise ValueError(f"logits must have shape (..., n, n); got {tuple(shape)}")
    n = shape[-1]
    if not N_MIN <= n <= N_MAX:
        raise ValueError(f"logits: n must be in {N_MIN}..{N_MAX}; got n={n}")
    if not (logits.is_cuda or logits.is_cpu):
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

    Eager calls run one ``autograd.Function`` (no ``torch.library`` dispatch); under
    ``torch.compile`` the custom ops ``mhc_proj::birkhoff_fwd`` / ``birkhoff_bwd`` (the same
    kernels, bitwise the same results).
    """
    _check(logits)
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
    if not torch.compiler.is_compiling():
        if not return_info:
            return _project_apply(logits, dtype, tol, max_iter)
        t, info = _project_apply(logits, dtype, tol, max_iter, True)
        return t, _info(info)
    shape = logits.shape
    n = shape[-1]
    x = logits.to(dtype).reshape(-1, n, n).contiguous()
    t, info = _fwd_op(x, tol, max_iter, return_info)
    t = t.reshape(shape)
    if not return_info:
        return t
    return t, _info(info.reshape(shape[:-2]))


def _info(info: torch.Tensor) -> ProjectionInfo:
    # .bitwise_and(c).bool() is (info & c) != 0 with one op fewer (~2 us each on the CPU)
    return ProjectionInfo(
        iterations=info.bitwise_and(0xFFFF),
        converged=info.bitwise_and(_INFO_CONVERGED).bool(),
        fallback=info.bitwise_and(_INFO_FALLBACK).bool(),
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
