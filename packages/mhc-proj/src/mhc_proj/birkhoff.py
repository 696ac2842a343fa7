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

from mhc_proj import _backend, _checks
from mhc_proj._config import (
    FALLBACK_MAX_ITER,
    FALLBACK_TOL,
    MAX_ITER_F32,
    MAX_ITER_F64,
    MAX_ITER_LIMIT,
    N_MAX_KERNEL,
    PIVOT_MIN,
    RANGE_TOL_F64,
    TOL_F32,
    TOL_F64,
)
from mhc_proj.reference import birkhoff_project_ref, birkhoff_vjp_ref, marginal_error  # noqa: F401

__all__ = ["birkhoff_project", "BirkhoffProjection", "ProjectionInfo"]

_INFO_FALLBACK = 1 << 16
_INFO_CONVERGED = 1 << 17
_INFO_INFEASIBLE = 1 << 18


class ProjectionInfo(NamedTuple):
    """Per-matrix solver report, each of shape ``logits.shape[:-2]``.

    ``iterations``: Newton iterations used (fp32 stage plus float64 re-solve), int32.
    ``converged``: the returned T meets the tolerance, its marginal error summed in double
    from its stored values. The kernels certify T in the compute dtype (float64 for float64
    logits, else float32); where the returned dtype rounds it further (bfloat16 / float16,
    or float32 from float64 logits) the rounded T is checked again, so converged is False
    wherever the rounding alone breaks the tolerance (a bf16 T is off by ~1e-2).
    ``fallback``: re-solved in float64. ``infeasible``: the finite entries (-inf entries
    are structural zeros, exactly 0 in T) admit no doubly stochastic matrix (no perfect
    matching); T is NaN there, and converged False.
    """

    iterations: torch.Tensor
    converged: torch.Tensor
    fallback: torch.Tensor
    infeasible: torch.Tensor


# ---------------------------------------------------------------- launchers
# ``_fwd`` / ``_bwd`` take contiguous tensors of any shape (..., n, n) (the kernels see
# B = numel / n^2 matrices one after the other), so the eager path needs no reshapes; the
# public launchers validate and call them.
def _fwd(
    x: torch.Tensor,
    tol: float,
    max_iter: int,
    fb_max_iter: int,
    info: torch.Tensor | None,
    range_tol: float = 0.0,
) -> torch.Tensor:
    """T for contiguous float32/float64 ``x`` (..., n, n); fills ``info`` (B,) int32 if given.
    tol: the float32 stage's tolerance and the certificate of the stored T; the float64
    stage solves to min(FALLBACK_TOL, tol) in at most fb_max_iter iterations per stage.
    range_tol (float64 inputs): raise each matrix's tol to range_tol * n * its logit range."""
    n = x.shape[-1]
    b = x.numel() // (n * n)
    if n > N_MAX_KERNEL:
        return _fwd_torch(x, tol, max_iter, info)
    if x.data_ptr() % 16:  # _backend.aligned: the CUDA kernels use 16-byte loads
        x = x.clone()
    out = torch.empty_like(x)
    if b == 0:
        return out
    info_ptr = 0 if info is None else info.data_ptr()
    dt = 1 if x.dtype == torch.float64 else 0
    fb_tol = min(FALLBACK_TOL, tol)
    if x.is_cuda:
        mod = _backend.cuda()
        with _backend.on_device(x):
            # the float64 stage's work list: count, indices, then n fp32 potentials per entry
            work = torch.empty(1 + b + b * n, dtype=torch.int32, device=x.device)
            mod.birkhoff_fwd(
                x.data_ptr(),
                out.data_ptr(),
                info_ptr,
                work.data_ptr(),
                b,
                n,
                dt,
                tol,
                max_iter,
                fb_tol,
                fb_max_iter,
                PIVOT_MIN,
                range_tol,
                _backend.stream(x),
            )
    else:
        _backend.cpu().birkhoff_fwd(
            x.data_ptr(),
            out.data_ptr(),
            info_ptr,
            b,
            n,
            dt,
            tol,
            max_iter,
            fb_tol,
            fb_max_iter,
            PIVOT_MIN,
            range_tol,
        )
    return out


def _fwd_torch(x: torch.Tensor, tol: float, max_iter: int, info: torch.Tensor | None):
    """n > N_MAX_KERNEL (no compiled kernel): the float64 Newton solve of
    :func:`mhc_proj.reference.birkhoff_project_ref` (structural zeros and masks included),
    to min(tol, 1e-13), T returned in x's dtype. The info words describe that T: converged
    from its own marginal error, fallback set (a float64 solve), infeasible where a finite
    input has no doubly stochastic matrix on its support."""
    t64, iters = birkhoff_project_ref(
        x, tol=min(tol, TOL_F64), max_iter=max(max_iter, MAX_ITER_F64), return_iterations=True
    )
    out = t64.to(x.dtype)
    if info is not None:
        n = x.shape[-1]
        flat = out.reshape(-1, n, n)
        nan_in = (torch.isnan(x) | (x == float("inf"))).reshape(-1, n * n).any(1)
        nan_out = torch.isnan(flat).reshape(-1, n * n).any(1)
        word = iters.reshape(-1).clamp_max(0xFFFF) | _INFO_FALLBACK
        word = word | torch.where(marginal_error(flat) <= tol, _INFO_CONVERGED, 0)
        word = word | torch.where(nan_out & ~nan_in, _INFO_INFEASIBLE, 0)
        info.copy_(word.reshape(info.shape).to(torch.int32))
    return out


def _bwd(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """dA for contiguous ``t`` and ``grad`` of the same shape (..., n, n) and dtype."""
    n = t.shape[-1]
    b = t.numel() // (n * n)
    if n > N_MAX_KERNEL:
        return birkhoff_vjp_torch(t, grad)
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
    x: torch.Tensor,
    tol: float,
    max_iter: int,
    want_info: bool,
    fb_max_iter: int | None = None,
    range_tol: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the forward on (B, n, n) contiguous float32/float64 ``x``.

    Returns T (same dtype) and the int32 info words (B,) (empty when not wanted): bits
    0..15 iterations, bit 16 the float64 stage ran, bit 17 converged, bit 18 infeasible.
    fb_max_iter: the float64 stage's iteration cap (default FALLBACK_MAX_ITER); range_tol:
    float64 inputs' tolerance floor per unit of logit range (``_fwd``).
    """
    _backend.for_tensor(x)  # a clear error for other devices / a missing CUDA module
    fb = FALLBACK_MAX_ITER if fb_max_iter is None else fb_max_iter
    info = torch.empty(x.shape[0] if want_info else 0, dtype=torch.int32, device=x.device)
    return _fwd(x, tol, max_iter, fb, info if want_info else None, range_tol), info


def birkhoff_bwd(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Implicit VJP on (B, n, n) contiguous ``t`` and ``grad`` of the same dtype."""
    _backend.for_tensor(t)
    return _bwd(t, grad)


def birkhoff_vjp_torch(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The implicit VJP in torch ops, in float64, returned in ``t``'s dtype: the backward
    used when the backward itself is differentiated (``create_graph=True``: gradient
    penalties, Hessian-vector products) or runs under a ``torch.func`` transform.

    The kernels' arrangement (``csrc/vjp.h``): the grounded Laplacian of W = T^T T (off the
    diagonal) solved for y, then dA_ij = T_ij (r_i Z_ij - sum_k T_ik Z_ik), Z = G - 1 y^T.
    As a function of a doubly stochastic T it is the VJP of the projection exactly, so
    autograd through it (T being the projection's output) gives the second derivative. A
    relative 1e-14 of each node's degree on the diagonal keeps the solve defined for
    disconnected supports (any per-component gauge gives the same dA).
    """
    dtype = t.dtype
    t = t.to(torch.float64)
    g = grad.to(torch.float64)
    n = t.shape[-1]
    r = t.sum(-1, keepdim=True)
    rhs = (t * (r * g - (t * g).sum(-1, keepdim=True))).sum(-2)
    off = 1.0 - torch.eye(n, dtype=t.dtype, device=t.device)
    w = (t.transpose(-1, -2) @ t) * off
    deg = w.sum(-1)
    lap = torch.diag_embed(deg * (1.0 + 1e-14) + 1e-300) - w
    y = torch.linalg.solve(lap[..., :-1, :-1], rhs[..., :-1].unsqueeze(-1)).squeeze(-1)
    y = torch.cat([y, torch.zeros_like(y[..., :1])], dim=-1)
    z = g - y.unsqueeze(-2)
    da = t * (r * z - (t * z).sum(-1, keepdim=True))
    return da.to(dtype)


def _vjp(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """dA at the saved T: the kernel; under a torch.func transform the same formula in torch
    ops; in a differentiated backward (create_graph) the kernel's value with the torch
    formula's derivatives (value + (f - f.detach()): the first derivative does not change
    with create_graph, the second is exact)."""
    if grad.dtype != t.dtype:
        grad = grad.to(t.dtype)
    if _transforms_active():
        return birkhoff_vjp_torch(t, grad)
    da = _bwd(t.detach(), grad.detach().contiguous())
    if torch.is_grad_enabled() and (t.requires_grad or grad.requires_grad):
        f = birkhoff_vjp_torch(t, grad)
        da = da + (f - f.detach())
    return da


def _transforms_active() -> bool:
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


# ---------------------------------------------------------------- custom ops
@torch.library.custom_op("mhc_proj::birkhoff_fwd", mutates_args=())
def _fwd_op(
    x: torch.Tensor,
    tol: float,
    max_iter: int,
    fb_max_iter: int,
    range_tol: float,
    want_info: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return birkhoff_fwd(x, tol, max_iter, want_info, fb_max_iter, range_tol)


@_fwd_op.register_fake
def _(x, tol, max_iter, fb_max_iter, range_tol, want_info):
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
        return None, None, None, None, None, None
    g = grad_t.to(t.dtype)
    da = _bwd_op(t, g.contiguous())
    if torch.is_grad_enabled() and (t.requires_grad or g.requires_grad):
        f = birkhoff_vjp_torch(t, g)  # a differentiated backward: as _vjp
        da = da + (f - f.detach())
    return da, None, None, None, None, None


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
    also returns the info words in the shape ``logits.shape[:-2]`` (not differentiable).
    ``setup_context`` and ``vmap`` make it composable with torch.func (grad, vmap, jacrev);
    the backward is twice differentiable (``_vjp``)."""

    @staticmethod
    def forward(logits, compute_dtype, tol, max_iter, fb_max_iter, range_tol, want_info):
        x = logits if logits.dtype == compute_dtype else logits.to(compute_dtype)
        if not want_info:
            return _fwd(x.contiguous(), tol, max_iter, fb_max_iter, None, range_tol)
        info = torch.empty(logits.shape[:-2], dtype=torch.int32, device=logits.device)
        return _fwd(x.contiguous(), tol, max_iter, fb_max_iter, info, range_tol), info

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, want_info = inputs[0], inputs[-1]
        ctx.in_dtype = logits.dtype
        ctx.want_info = want_info
        t = output[0] if want_info else output
        ctx.save_for_backward(t)
        ctx.save_for_forward(t)
        if want_info:
            ctx.mark_non_differentiable(output[1])
            ctx.set_materialize_grads(False)  # no zero gradient for info; grad_t may be None

    @staticmethod
    def backward(ctx, grad_t, *grad_info):
        if grad_t is None:
            return None, None, None, None, None, None, None
        (t,) = ctx.saved_tensors
        da = _vjp(t, grad_t)
        if ctx.in_dtype != t.dtype:
            da = da.to(ctx.in_dtype)
        return da, None, None, None, None, None, None

    @staticmethod
    def jvp(ctx, d_logits, *_):
        # forward mode: the Jacobian is symmetric (T is the gradient of the convex
        # F(A) = max_T <A, T> + H(T)), so J v is the VJP at v
        (t,) = ctx.saved_tensors
        dt = _vjp(t, d_logits)
        return (dt, None) if ctx.want_info else dt

    @staticmethod
    def vmap(info, in_dims, logits, *options):
        # the op maps over any leading dims: the vmapped dim becomes one more of them
        bdim = in_dims[0]
        want_info = options[-1]
        if bdim is not None:
            logits = logits.movedim(bdim, 0)
        out = _BirkhoffProject.apply(logits, *options)
        d = None if bdim is None else 0
        return out, ((d, d) if want_info else d)


def _direct_apply(fn: type[torch.autograd.Function]):
    """``fn.apply`` without its Python wrapper (~2 us per call on the CPU host), or None
    when this torch lacks the pieces. ``Function.apply`` binds default arguments (these
    callers pass every argument), unwraps dead functorch wrappers and then calls the C++
    apply (which runs ``setup_context``); the caller uses it only while no functorch
    transform is active (else ``fn.apply``), and unwraps the tensor itself."""
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
def _options(logits, tol, max_iter):
    """(compute dtype, tol, max_iter, the float64 stage's max_iter, range_tol), validated."""
    if logits.dtype == torch.float64:
        dtype, tol_default, iter_default = torch.float64, TOL_F64, MAX_ITER_F64
    else:
        dtype, tol_default, iter_default = torch.float32, TOL_F32, MAX_ITER_F32
    range_tol = RANGE_TOL_F64 if tol is None and dtype == torch.float64 else 0.0
    tol = tol_default if tol is None else _checks.positive("tol", tol)
    if max_iter is None:
        return dtype, tol, iter_default, FALLBACK_MAX_ITER, range_tol
    max_iter = _checks.integer("max_iter", max_iter, 0, MAX_ITER_LIMIT)
    return dtype, tol, max_iter, max_iter, range_tol


def birkhoff_project(
    logits: torch.Tensor,
    *,
    tol: float | None = None,
    max_iter: int | None = None,
    return_info: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ProjectionInfo]:
    """Projects each n x n matrix of ``logits`` onto the Birkhoff polytope (exact, KL).

    T = diag(u) exp(A) diag(v) with all row and column sums 1. ``-inf`` entries are
    structural zeros (T is exactly 0 there); NaN and +inf entries give a NaN matrix.

    Args:
        logits: (..., n, n), n in 2..16 (compiled kernels up to 8; beyond, the float64
            torch solve of :mod:`mhc_proj.reference`), any leading dims and strides.
            float32, bfloat16 and float16 are computed in float32; float64 in float64.
        tol: stopping tolerance on the L1 marginal error per matrix (default 4e-6 for
            float32; for float64 1e-13, or 16 n 2^-52 times the matrix's logit range where
            that is larger: the double rounding floor); ``info.converged`` certifies it on
            the T that is stored (below ~1e-6 a float32 T cannot meet it: converged is
            then False).
        max_iter: Newton iterations per continuation stage, an int in 0..10000 (default 30
            for float32 with 200 in the float64 re-solve, 100 for float64; a given value
            caps every stage).
        return_info: also return a :class:`ProjectionInfo`.
        out_dtype: the dtype of T (default: the dtype of ``logits``); e.g. torch.float32 to
            keep H_res in float32 for bfloat16 logits (a bf16 T has marginal errors up to
            ~1e-2: bf16 keeps 8 significant bits).

    Returns:
        T of shape (..., n, n) in ``out_dtype``; differentiable (implicit backward, only T
        saved; twice differentiable; composable with torch.func). With ``return_info``:
        ``(T, info)``.

    Matrices whose finite entries admit no doubly stochastic matrix (e.g. a row or column
    of -inf, or no perfect matching) come back NaN with ``info.infeasible`` set. Eager calls
    run one ``autograd.Function`` (no ``torch.library`` dispatch); under ``torch.compile``
    the custom ops ``mhc_proj::birkhoff_fwd`` / ``birkhoff_bwd`` (the same kernels, bitwise
    the same results).
    """
    _checks.logits(logits)
    dtype, tol, max_iter, fb_max_iter, range_tol = _options(logits, tol, max_iter)
    opts = (dtype, tol, max_iter, fb_max_iter, range_tol)
    return_info = _checks.flag("return_info", return_info)
    out_dtype = _checks.out_dtype(out_dtype, logits.dtype)
    if not torch.compiler.is_compiling():
        if not return_info:
            t = _project_apply(logits, *opts, False)
            return t if t.dtype == out_dtype else t.to(out_dtype)
        t, info = _project_apply(logits, *opts, True)
        out = t if t.dtype == out_dtype else t.to(out_dtype)
        return out, _info(info, out, tol, dtype)
    shape = logits.shape
    n = shape[-1]
    x = logits.to(dtype).reshape(-1, n, n).contiguous()
    t, info = _fwd_op(x, tol, max_iter, fb_max_iter, range_tol, return_info)
    out = t.reshape(shape).to(out_dtype)
    if not return_info:
        return out
    return out, _info(info.reshape(shape[:-2]), out, tol, dtype)


def _info(info: torch.Tensor, out: torch.Tensor, tol: float, dtype: torch.dtype) -> ProjectionInfo:
    """The report of the returned T ``out``. The kernels certify T in the compute dtype; an
    out_dtype that rounds it (bfloat16 / float16 for any input, float32 for float64 input)
    is certified again on its own entries (a bf16 T is off by ~1e-2: converged False)."""
    # .bitwise_and(c).bool() is (info & c) != 0 with one op fewer (~2 us each on the CPU)
    converged = info.bitwise_and(_INFO_CONVERGED).bool()
    if torch.finfo(out.dtype).eps > torch.finfo(dtype).eps:  # rounded from the compute dtype
        converged = converged & (marginal_error(out) <= tol)
    return ProjectionInfo(
        iterations=info.bitwise_and(0xFFFF),
        converged=converged,
        fallback=info.bitwise_and(_INFO_FALLBACK).bool(),
        infeasible=info.bitwise_and(_INFO_INFEASIBLE).bool(),
    )


class BirkhoffProjection(torch.nn.Module):
    """``nn.Module`` wrapper of :func:`birkhoff_project` (no parameters)."""

    def __init__(
        self,
        tol: float | None = None,
        max_iter: int | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tol = tol
        self.max_iter = max_iter
        self.out_dtype = out_dtype

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return birkhoff_project(
            logits, tol=self.tol, max_iter=self.max_iter, out_dtype=self.out_dtype
        )

    def extra_repr(self) -> str:
        return f"tol={self.tol}, max_iter={self.max_iter}, out_dtype={self.out_dtype}"
