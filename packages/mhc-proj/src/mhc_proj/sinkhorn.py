"""Sinkhorn-k compatibility projection (DeepSeek / TileKernels convention), fused.

P = softmax(A, -1) + eps; P /= colsum(P) + eps; then ``iters - 1`` times
P /= rowsum(P) + eps; P /= colsum(P) + eps. The backward is the exact derivative of
this truncated iteration (not of the exact projection): for parity with checkpoints
trained with Sinkhorn, and as the baseline of :func:`mhc_proj.birkhoff_project`.

Read top to bottom: the float64 reference (:func:`mhc_proj.reference.sinkhorn_project_ref`),
the launchers ``sinkhorn_fwd`` / ``sinkhorn_bwd``, the custom ops with their autograd, the
eager autograd node and the public :func:`sinkhorn_project`.

Kernels (``csrc/sinkhorn.h``; C++ on the CPU for n = 2..8, float32/float64; CUDA for n = 4
float32, iters <= 64), one thread per matrix. Forward in the scaling form P = P0 (.) r c^T:
each step rescales one 4-vector (H200: 0.963 ms at B = 16M). Backward: the forward replayed
in reciprocal form, then a division-free reverse sweep on the rescaled adjoint, with 27 of
the 39 step vectors of iters = 20 in shared memory (4 blocks per SM; H200: 2.00 ms at
16M). Other CUDA cases (n != 4, float64, iters > 64) run the same iteration in torch ops
inside the op. Design and measurements: docs/design/mhc-proj.md.
"""

from __future__ import annotations

import torch

from mhc_proj import _backend, _checks
from mhc_proj._config import (
    N_MAX_KERNEL,
    SINKHORN_CUDA_MAX_ITERS,
    SINKHORN_EPS,
    SINKHORN_ITERS,
    SINKHORN_MAX_ITERS,
)
from mhc_proj.reference import sinkhorn_project_ref

__all__ = ["sinkhorn_project", "sinkhorn_fwd", "sinkhorn_bwd"]


def _use_kernel(x: torch.Tensor, iters: int, eps: float) -> bool:
    """The compiled kernels: CPU n <= 8; CUDA n = 4 float32, iters <= 64. eps = 0 runs the
    log-domain iteration in torch ops instead (see ``_log_states``)."""
    if eps == 0:
        return False
    if not x.is_cuda:
        return x.shape[-1] <= N_MAX_KERNEL
    return x.shape[-1] == 4 and x.dtype == torch.float32 and iters <= SINKHORN_CUDA_MAX_ITERS


# eps = 0: the normalizations divide by sums of exp(a) that underflow to 0 in float32 for a
# column whose logits sit ~100 below its rows' maxima (0/0: NaN; at N(0, 100^2) logits 947
# of 4096 matrices, #29). With eps = 0 every step is an exact rescaling, so the iteration is
# the same in log space, L <- L - logsumexp(L) along rows / columns, where nothing
# underflows: finite for every finite input.
def _log_states(x: torch.Tensor, iters: int) -> list[torch.Tensor]:
    """log P after the row softmax and after each of the 2 iters - 1 normalizations."""
    states = [torch.log_softmax(x, dim=-1)]
    for k in range(2 * iters - 1):
        dim = -2 if k % 2 == 0 else -1
        states.append(states[-1] - torch.logsumexp(states[-1], dim=dim, keepdim=True))
    return states


def _sinkhorn_log_bwd(x: torch.Tensor, g: torch.Tensor, iters: int) -> torch.Tensor:
    """The exact VJP of the eps = 0 iteration (torch ops, differentiable): through
    L' = L - logsumexp_d(L), dL = dL' - softmax_d(L) sum_d(dL')."""
    states = _log_states(x, iters)
    d = g * torch.exp(states[-1])
    for k in range(2 * iters - 2, -1, -1):
        dim = -2 if k % 2 == 0 else -1
        d = d - torch.softmax(states[k], dim=dim) * d.sum(dim, keepdim=True)
    return d - torch.softmax(x, dim=-1) * d.sum(-1, keepdim=True)


def _sinkhorn_bwd_torch(x: torch.Tensor, g: torch.Tensor, iters: int, eps: float):
    """The same exact backward in plain torch ops (CUDA cases without a kernel; and any
    differentiated backward or torch.func transform, since it is differentiable): autograd
    is not available inside a custom op's implementation, so the step VJPs are explicit."""
    if eps == 0:
        return _sinkhorn_log_bwd(x, g, iters)
    sm = torch.softmax(x, dim=-1)
    p = sm + eps
    states = []
    for k in range(2 * iters - 1):
        states.append(p)
        p = p / (p.sum(-2 if k % 2 == 0 else -1, keepdim=True) + eps)
    d = g
    for k in range(2 * iters - 2, -1, -1):
        dim = -2 if k % 2 == 0 else -1
        pk = states[k]
        inv = 1.0 / (pk.sum(dim, keepdim=True) + eps)
        d = (d - (d * pk * inv).sum(dim, keepdim=True)) * inv
    return sm * (d - (d * sm).sum(-1, keepdim=True))


# ---------------------------------------------------------------- launchers
def sinkhorn_fwd(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Launches the forward on (B, n, n) contiguous float32/float64 ``x``."""
    b, n = x.shape[0], x.shape[-1]
    if b == 0:
        return torch.empty_like(x)
    if not _use_kernel(x, iters, eps):
        if eps == 0:
            return torch.exp(_log_states(x, iters)[-1])
        return sinkhorn_project_ref(x, iters, eps)
    x = _backend.aligned(x)
    out = torch.empty_like(x)
    mod = _backend.for_tensor(x)
    if x.is_cuda:
        with _backend.on_device(x):
            mod.sinkhorn_fwd(x.data_ptr(), out.data_ptr(), b, iters, eps, _backend.stream(x))
    else:
        mod.sinkhorn_fwd(x.data_ptr(), out.data_ptr(), b, n, iters, eps, _backend.dtype_code(x))
    return out


def sinkhorn_bwd(x: torch.Tensor, grad: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Exact VJP of the truncated iteration at (B, n, n) contiguous logits ``x`` (it
    recomputes the forward from ``x``); ``grad`` of the same shape and dtype."""
    b, n = x.shape[0], x.shape[-1]
    if b == 0:
        return torch.empty_like(x)
    if not _use_kernel(x, iters, eps):
        return _sinkhorn_bwd_torch(x, grad, iters, eps)
    x, grad = _backend.aligned(x), _backend.aligned(grad)
    out = torch.empty_like(x)
    mod = _backend.for_tensor(x)
    if x.is_cuda:
        with _backend.on_device(x):
            mod.sinkhorn_bwd(
                x.data_ptr(), grad.data_ptr(), out.data_ptr(), b, iters, eps, _backend.stream(x)
            )
    else:
        mod.sinkhorn_bwd(
            x.data_ptr(),
            grad.data_ptr(),
            out.data_ptr(),
            b,
            n,
            iters,
            eps,
            _backend.dtype_code(x),
        )
    return out


# ---------------------------------------------------------------- custom ops
@torch.library.custom_op("mhc_proj::sinkhorn_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return sinkhorn_fwd(x, iters, eps)


@_fwd_op.register_fake
def _(x, iters, eps):
    return torch.empty_like(x)


@torch.library.custom_op("mhc_proj::sinkhorn_bwd", mutates_args=())
def _bwd_op(x: torch.Tensor, grad: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return sinkhorn_bwd(x, grad, iters, eps)


@_bwd_op.register_fake
def _(x, grad, iters, eps):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, iters, eps = inputs
    ctx.save_for_backward(x)
    ctx.iters, ctx.eps = iters, eps


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    g = grad.to(x.dtype)
    if torch.is_grad_enabled():  # a differentiated backward: torch ops
        return _sinkhorn_bwd_torch(x, g, ctx.iters, ctx.eps), None, None
    return _bwd_op(x, g.contiguous(), ctx.iters, ctx.eps), None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- eager autograd, public API
class _SinkhornFunction(torch.autograd.Function):
    """Eager fast path (no custom-op dispatch overhead); the op is used under compile.
    ``setup_context`` and ``vmap`` make it composable with torch.func; a differentiated
    backward (or one under a transform) runs the explicit VJP in torch ops."""

    @staticmethod
    def forward(x, iters, eps):
        return sinkhorn_fwd(x, iters, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, iters, eps = inputs
        ctx.save_for_backward(x)
        ctx.iters, ctx.eps = iters, eps

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        g = grad.to(x.dtype)
        active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
        if torch.is_grad_enabled() or active():
            return _sinkhorn_bwd_torch(x, g, ctx.iters, ctx.eps), None, None
        return sinkhorn_bwd(x, g.contiguous(), ctx.iters, ctx.eps), None, None

    @staticmethod
    def vmap(info, in_dims, x, iters, eps):
        # x is (B, n, n); the vmapped dim joins the batch
        bdim = in_dims[0]
        if bdim is None:
            return _SinkhornFunction.apply(x, iters, eps), None
        x = x.movedim(bdim, 0)
        v, b, n = x.shape[0], x.shape[1], x.shape[-1]
        out = _SinkhornFunction.apply(x.reshape(v * b, n, n).contiguous(), iters, eps)
        return out.reshape(v, b, n, n), 0


def sinkhorn_project(
    logits: torch.Tensor,
    iters: int = SINKHORN_ITERS,
    eps: float = SINKHORN_EPS,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Sinkhorn-``iters`` projection of (..., n, n) ``logits`` (n in 2..16; kernels up to
    8 on the CPU, n = 4 float32 on CUDA; torch ops otherwise).

    float32/bfloat16/float16 computed in float32, float64 in float64; returned in
    ``out_dtype`` (default: the dtype of ``logits``). ``iters``: an int in 1..10000;
    ``eps``: in [0, 1]; ``eps = 0`` runs the same iteration in log space (torch ops: finite
    for every finite input, where the sums of exp(a) underflow in float32). -inf entries get
    weight 0 in the softmax (P0 = eps there); NaN or +inf entries, or a row of -inf, give a
    NaN matrix. Differentiable (exact backward of the truncated iteration; saves the
    logits), twice differentiable, composable with torch.func.
    """
    _checks.logits(logits)
    iters = _checks.integer("iters", iters, 1, SINKHORN_MAX_ITERS)
    eps = _checks.positive("eps", eps, allow_zero=True, hi=1.0)
    out_dtype = _checks.out_dtype(out_dtype, logits.dtype)
    n = logits.shape[-1]
    shape = logits.shape
    x = logits if logits.dtype == torch.float64 else logits.to(torch.float32)
    x = x.reshape(-1, n, n).contiguous()
    if torch.compiler.is_compiling():
        p = _fwd_op(x, iters, eps)
    else:
        p = _SinkhornFunction.apply(x, iters, eps)
    p = p.reshape(shape)
    return p if p.dtype == out_dtype else p.to(out_dtype)
