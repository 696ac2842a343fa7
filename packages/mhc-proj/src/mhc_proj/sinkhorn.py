"""Sinkhorn-k compatibility projection (DeepSeek / TileKernels convention), fused.

P = softmax(A, -1) + eps; P /= colsum(P) + eps; then ``iters - 1`` times
P /= rowsum(P) + eps; P /= colsum(P) + eps. The backward is the exact derivative of
this truncated iteration (not of the exact projection): for parity with checkpoints
trained with Sinkhorn, and as the baseline of :func:`mhc_proj.birkhoff_project`.

Kernels: C++ on CPU (n = 2..8, float32/float64); CUDA for n = 4 float32. Forward, three
CUDA kernels:

- ``scaling`` (default): one thread per matrix in the scaling form of ``csrc/mhc_math.h``
  (``sinkhorn_fwd_scaling``: P = P0 ∘ r c^T, each step rescales one 4-float vector with
  approximate reciprocals; the same steps the ``thread`` backward replays). H200: 0.963 ms
  at B = 16M (2.3x faster than ``thread``; run 4, packages/mhc-proj/NOTES.md).
- ``thread``: one thread per matrix, the iteration on the full 16-float state with
  correctly rounded reciprocals (H200: 2.23 ms at B = 16M). The same accuracy against the
  float64 reference for eps from 1e-30 to 1e-2 (CPU, sigma 1 to 1e4); with eps = 0 and logits
  large enough that float32 softmax entries underflow to 0, both forms give NaN for the
  matrices with an all-zero line, the scaling form for somewhat more of them.
- ``lane``: 16 lanes per matrix (the published layout), shuffles for the sums.

Selected with ``MHC_PROJ_SINKHORN_FWD`` (read at each forward call) or the ``variant``
argument of :func:`sinkhorn_fwd`. On the CPU, ``scaling`` runs the same header code as the
CUDA kernel (IEEE divisions for its reciprocals) and the other two names the full-state
iteration. Backward, CUDA kernels:

- ``thread-e-occ3`` (default since 2026-12-01): one thread per matrix; one forward replay
  keeping the 4-float scaling vector of every step (as ``thread``), then a division-free
  reverse sweep on the rescaled adjoint e = dP (.) r c^T (``sinkhorn_vjp_rescaled`` in
  ``csrc/mhc_math.h``: per step one reduction and one rank-1 update, ~36 FP instructions
  instead of ~72), compiled for 3 resident blocks per SM. H200 (2026-12-01, same process):
  2.78 ms at B = 16M against ``thread``'s 3.84 ms, 0.230 against 0.319 ms at 1M
  (packages/mhc-proj/NOTES.md). The CPU runs the same reverse sweep for the ``thread-e*``
  names (any n and dtype).
- ``thread-e``: the same kernel with 2 resident blocks per SM (no spills; 2.96 ms at 16M).
- ``thread-rs`` and ``thread-r-occ3`` (opt-in, not GPU-measured yet): the same reverse
  sweep after a replay in reciprocal form (``sinkhorn_vjp_recip``: the step's denominator
  1/c' = P0^T r + eps / c is kept and c' is one reciprocal of it: 4 fewer instructions
  per step and a shorter dependency chain), G loaded after the replay (L2-prefetched at
  the start). ``thread-rs`` keeps the first 27 of the 39 step vectors in shared memory:
  128 registers, no spills, 4 blocks (16 warps) per SM; ``thread-r-occ3`` keeps all in
  registers at 3 blocks per SM (spills as ``thread-e-occ3``). The CPU runs the same math
  for both names. ``thread-rp`` (opt-in, not GPU-measured): the same math with two
  matrices in flight per thread, the reverse sweep of one interleaved step by step with
  the replay of the next (FMA and MUFU work in one instruction stream; the step vectors
  share 39 slots in mirrored order, 37 in shared memory); persistent grid of 3 blocks per
  SM, 164 registers, no spills. iters != 20 runs ``thread-rs``'s kernel.
- ``thread``: the recompute formulation of ``sinkhorn_vjp_scaling`` (the same replay, then
  the reverse sweep on dP with the step factors; the default until 2026-12-01, 3.84-3.88 ms
  at B = 16M). The CPU runs its code for ``thread``, ``thread-occ3`` and ``lane``.
- ``lane``: 16 lanes per matrix, the iteration's states kept in registers for iters = 20
  (local memory for other iters <= 64; 16.7 ms at 16M). It stays finite for eps below
  ~1e-38 (eps = 0), where the thread kernel's flushed subnormal denominators can give inf.
- ``thread-occ3``: the ``thread`` kernel compiled for 3 resident blocks per SM
  instead of 2 (iters = 20: 168 registers with L1-resident spills instead of 255 without);
  the same arithmetic, so the same results. H200: slower at B = 16M (4.31 vs 3.85 ms in
  run 4, 4.24 vs 3.91 in run 3); at 1M faster in run 3 only (0.354 vs 0.422 ms; run 4:
  0.342 vs 0.330).

Selected with ``MHC_PROJ_SINKHORN_BWD`` (read at each backward call) or the ``variant``
argument of :func:`sinkhorn_bwd`.

Other CUDA cases run the plain torch reference inside the op.
"""

from __future__ import annotations

import torch

from mhc_proj import _backend
from mhc_proj.birkhoff import N_MAX, N_MIN
from mhc_proj.reference import sinkhorn_project_ref

__all__ = ["sinkhorn_project", "sinkhorn_fwd", "sinkhorn_bwd"]


def _use_cuda_kernel(x: torch.Tensor, iters: int) -> bool:
    return x.is_cuda and x.shape[-1] == 4 and x.dtype == torch.float32 and iters <= 64


def _sinkhorn_bwd_torch(x: torch.Tensor, g: torch.Tensor, iters: int, eps: float):
    """The same exact backward in plain torch ops (CUDA cases without a kernel): autograd
    is not available inside a custom op's implementation, so the step VJPs are explicit."""
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


FWD_ENV = "MHC_PROJ_SINKHORN_FWD"
_FWD_VARIANTS = {"lane": 0, "thread": 1, "scaling": 2}


FWD_DEFAULT = "scaling"


def fwd_variant_code(variant: str | int | None = None) -> int:
    """Forward kernel code: ``variant`` if given (a name or its code), else the
    ``MHC_PROJ_SINKHORN_FWD`` environment variable, else ``"scaling"``. ``"lane"`` = 0
    (16 lanes per matrix), ``"thread"`` = 1 (thread per matrix, full state),
    ``"scaling"`` = 2 (thread per matrix, scaling form; default)."""
    return _backend.choice_code(
        variant, FWD_ENV, _FWD_VARIANTS, "Sinkhorn forward variant", FWD_DEFAULT
    )


def sinkhorn_fwd(
    x: torch.Tensor, iters: int, eps: float, variant: str | int | None = None
) -> torch.Tensor:
    """Launches the forward on (B, n, n) contiguous ``x``. ``variant``: ``"scaling"`` (2,
    default), ``"thread"`` (1) or ``"lane"`` (0); None reads ``MHC_PROJ_SINKHORN_FWD``.
    CUDA kernels for n = 4 float32; on the CPU ``"scaling"`` selects the scaling form and
    the other two the full-state iteration."""
    code = fwd_variant_code(variant)
    b, n = x.shape[0], x.shape[-1]
    if b == 0:
        return torch.empty_like(x)
    if x.is_cuda and not _use_cuda_kernel(x, iters):
        return sinkhorn_project_ref(x, iters, eps)
    x = _backend.aligned(x)
    out = torch.empty_like(x)
    mod = _backend.for_tensor(x)
    if x.is_cuda:
        with _backend.on_device(x):
            mod.sinkhorn_fwd(x.data_ptr(), out.data_ptr(), b, iters, eps, code, _backend.stream(x))
    else:
        mod.sinkhorn_fwd(
            x.data_ptr(), out.data_ptr(), b, n, iters, eps, _backend.dtype_code(x), code
        )
    return out


BWD_ENV = "MHC_PROJ_SINKHORN_BWD"
_BWD_VARIANTS = {
    "lane": 0,
    "thread": 1,
    "thread-occ3": 2,
    "thread-e": 3,
    "thread-e-occ3": 4,
    "thread-r-occ3": 5,
    "thread-rs": 6,
    "thread-rp": 7,
}
_BWD_RESCALED = (3, 4)  # the CPU runs their reverse sweep too (its variant 3)
_BWD_RECIP = (5, 6)  # ... and the reciprocal-form replay of these (its variant 4)
_BWD_RECIP_PIPE = 7  # the two-matrix pipeline of that math (its variant 5)
# measured fastest on the H200: thread-rs since 2026-12-01 evening (run 10, one process:
# bwd 2.01 vs thread-e-occ3's 2.54 ms at 16M, fwd+bwd 2.97 vs 3.53; NOTES.md)
BWD_DEFAULT = "thread-rs"


def bwd_variant_code(variant: str | int | None = None) -> int:
    """CUDA backward kernel code: ``variant`` if given, else the ``MHC_PROJ_SINKHORN_BWD``
    environment variable, else ``BWD_DEFAULT`` (``"thread-rs"``).
    ``"lane"`` = 0 (16 lanes per matrix), ``"thread"`` = 1 (thread per matrix, recompute
    from scaling vectors), ``"thread-occ3"`` = 2 (the same kernel compiled for 3 resident
    blocks per SM), ``"thread-e"`` = 3 (thread per matrix, the division-free
    rescaled-adjoint reverse sweep; the CPU runs it too), ``"thread-e-occ3"`` = 4 (that
    kernel compiled for 3 resident blocks per SM; the default until 2026-12-01 evening),
    ``"thread-r-occ3"`` = 5 (the same sweep after a replay in reciprocal form, 3 blocks per
    SM), ``"thread-rs"`` = 6 (5 with the first 27 step vectors in shared memory, 4 blocks
    per SM; the default; the CPU runs the math of 5 and 6), ``"thread-rp"`` = 7 (that math
    with two matrices in flight per thread: the reverse sweep of one interleaved with the
    replay of the next; persistent, 3 blocks per SM; the CPU runs the same pipeline)."""
    return _backend.choice_code(
        variant, BWD_ENV, _BWD_VARIANTS, "Sinkhorn backward variant", BWD_DEFAULT
    )


def sinkhorn_bwd(
    x: torch.Tensor, grad: torch.Tensor, iters: int, eps: float, variant: str | None = None
) -> torch.Tensor:
    """Exact VJP of the truncated iteration (recomputes the forward from ``x``).

    ``variant`` picks the CUDA kernel (n = 4 float32): ``"lane"``, ``"thread"``,
    ``"thread-occ3"``, ``"thread-e"``, ``"thread-e-occ3"``, ``"thread-r-occ3"``,
    ``"thread-rs"`` or ``"thread-rp"``; None reads ``MHC_PROJ_SINKHORN_BWD`` (default
    ``"thread-e-occ3"``).
    The CPU path runs the rescaled-adjoint reverse sweep for the ``thread-e*`` names, that
    sweep after the reciprocal-form replay for the ``thread-r*`` names (any n and dtype),
    else the ``thread`` kernel's recompute formulation."""
    code = bwd_variant_code(variant)
    b, n = x.shape[0], x.shape[-1]
    if b == 0:
        return torch.empty_like(x)
    if x.is_cuda and not _use_cuda_kernel(x, iters):
        return _sinkhorn_bwd_torch(x, grad, iters, eps)
    x, grad = _backend.aligned(x), _backend.aligned(grad)
    out = torch.empty_like(x)
    mod = _backend.for_tensor(x)
    if x.is_cuda:
        with _backend.on_device(x):
            mod.sinkhorn_bwd(
                x.data_ptr(),
                grad.data_ptr(),
                out.data_ptr(),
                b,
                iters,
                eps,
                code,
                _backend.stream(x),
            )
    else:
        if code == _BWD_RECIP_PIPE:
            cpu_variant = 5
        else:
            cpu_variant = 4 if code in _BWD_RECIP else 3 if code in _BWD_RESCALED else 1
        mod.sinkhorn_bwd(
            x.data_ptr(), grad.data_ptr(), out.data_ptr(), b, n, iters, eps,
            _backend.dtype_code(x), cpu_variant,
        )  # fmt: skip
    return out


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
    return _bwd_op(x, grad.to(x.dtype).contiguous(), ctx.iters, ctx.eps), None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _SinkhornFunction(torch.autograd.Function):
    """Eager fast path (no custom-op dispatch overhead); the op is used under compile."""

    @staticmethod
    def forward(ctx, x, iters, eps, bwd_variant=None, fwd_variant=None):
        ctx.save_for_backward(x)
        ctx.iters, ctx.eps, ctx.bwd_variant = iters, eps, bwd_variant
        return sinkhorn_fwd(x, iters, eps, fwd_variant)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        g = grad.to(x.dtype).contiguous()
        return sinkhorn_bwd(x, g, ctx.iters, ctx.eps, ctx.bwd_variant), None, None, None, None


def sinkhorn_project(logits: torch.Tensor, iters: int = 20, eps: float = 1e-6) -> torch.Tensor:
    """Sinkhorn-``iters`` projection of (..., n, n) ``logits`` (n in 2..8).

    float32/bfloat16/float16 computed in float32 (float32 output); float64 in float64.
    Differentiable (exact backward of the truncated iteration; saves the logits). The CUDA
    backward kernel is chosen by ``MHC_PROJ_SINKHORN_BWD`` (``thread-e-occ3`` default,
    ``thread-e``, ``thread-rs``, ``thread-rp``, ``thread-r-occ3``, ``thread``,
    ``thread-occ3``, ``lane``),
    the forward kernel by
    ``MHC_PROJ_SINKHORN_FWD`` (``scaling`` default, ``thread``, ``lane``).
    """
    return _project(logits, iters, eps)


def _project(
    logits: torch.Tensor,
    iters: int,
    eps: float,
    bwd_variant: str | None = None,
    fwd_variant: str | None = None,
):
    """:func:`sinkhorn_project` with explicit forward / backward kernels (eager path; under
    ``torch.compile`` the environment variables decide). Used by the benchmark."""
    if bwd_variant is not None:
        bwd_variant_code(bwd_variant)  # validate before the forward runs
    if fwd_variant is not None:
        fwd_variant_code(fwd_variant)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor; got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must have a floating dtype; got {logits.dtype}")
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"logits must have shape (..., n, n); got {tuple(logits.shape)}")
    n = logits.shape[-1]
    if not N_MIN <= n <= N_MAX:
        raise ValueError(f"logits: n must be in {N_MIN}..{N_MAX}; got n={n}")
    if int(iters) < 1:
        raise ValueError(f"iters must be >= 1; got {iters}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0; got {eps}")
    shape = logits.shape
    x = logits if logits.dtype == torch.float64 else logits.to(torch.float32)
    x = x.reshape(-1, n, n).contiguous()
    if torch.compiler.is_compiling():
        return _fwd_op(x, int(iters), float(eps)).reshape(shape)
    return _SinkhornFunction.apply(x, int(iters), float(eps), bwd_variant, fwd_variant).reshape(
        shape
    )
