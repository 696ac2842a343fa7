"""The manifold-constrained hyper-connection (mHC) layer around any sublayer F.

A residual stream of n copies of width C per token, x (..., n, C), becomes

    x_next = H_res x + H_post^T F(H_pre x)

with the maps computed per token from ONE mixing GEMM of the flattened stream (the mHC
paper, arXiv 2512.24880, eqs. 14-19; Liger-Kernel's ``LigerMHC`` conventions):

    inv_r = 1 / sqrt(mean(vec(x)^2) + rms_eps)
    h     = vec(x) phi                            phi: (n C, n^2 + 2n), [pre | post | res]
    H_pre = sigmoid(alpha_pre h_pre inv_r + b_pre) + pre_eps
    H_post = post_mult sigmoid(alpha_post h_post inv_r + b_post)
    H_res = P(alpha_res h_res inv_r + b_res)      P: the exact Birkhoff projection, or
                                                  Sinkhorn-k (DeepSeek-V4 convention)

Read top to bottom: the GEMM helpers, the launchers around the C++ / CUDA kernels
(``csrc/hc_kernels.cuh``, ``csrc/hc_cpu.h``), the ``torch.library`` custom ops with fake
implementations and their autograd (the pre op's backward computes the whole stream
gradient: the post op hands it dL/dout through a zero-storage token, so the two parts of
dL/dx are never summed in a separate pass), and the public :func:`hyper_connection`. The
module is :class:`mhc_proj.nn.HyperConnection`; the float64 oracle
:func:`mhc_proj.reference.hyper_connection_ref`; the math and the byte counts
docs/mhc-proj-layer.md.

What is fused: per token, the "pre" kernel reads the stream once (sum of squares, the
maps, y = H_pre x), the "post" kernel reads it once (H_res x + H_post^T f), and their
backward kernels likewise. The two GEMMs (h = vec(x) phi forward; g_h phi^T and
vec(x)^T g_h backward) run in cuBLAS through torch; on CUDA with a bf16 stream phi enters
as two bf16 halves (hi + lo, 16 significant bits) in one GEMM with float32 output. The
projection of H_res runs the package's Birkhoff / Sinkhorn kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mhc_proj import _backend
from mhc_proj._config import (
    FALLBACK_MAX_ITER,
    HC_POST_MULT,
    HC_PRE_EPS,
    HC_RMS_EPS,
    MAX_ITER_F32,
    N_MAX,
    N_MIN,
    SINKHORN_EPS,
    SINKHORN_ITERS,
    TOL_F32,
)
from mhc_proj.birkhoff import _bwd as _birkhoff_bwd
from mhc_proj.birkhoff import _fwd as _birkhoff_fwd
from mhc_proj.sinkhorn import sinkhorn_bwd, sinkhorn_fwd

__all__ = ["hyper_connection", "HCMaps", "PROJECTIONS"]

PROJECTIONS = ("birkhoff", "sinkhorn")
_STREAM_CODE = {torch.float32: 0, torch.bfloat16: 2}


class HCMaps(NamedTuple):
    """The per-token maps of a call (float32): ``h_pre`` (..., n), ``h_post`` (..., n),
    ``h_res`` (..., n, n) (doubly stochastic for the exact projection)."""

    h_pre: torch.Tensor
    h_post: torch.Tensor
    h_res: torch.Tensor


# ---------------------------------------------------------------- GEMMs
def _split_bf16(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a = hi + lo to 16 significant bits, both bfloat16."""
    hi = a.to(torch.bfloat16)
    return hi, (a - hi.float()).to(torch.bfloat16)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 operands with float32 accumulation and output (cuBLAS)."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except TypeError:  # torch < 2.8: no mm(out_dtype=)
        return a.float() @ b.float()


def _tensor_core_path(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16


def _mix(x2: torch.Tensor, phi: torch.Tensor) -> tuple[torch.Tensor, int]:
    """h = x2 phi for x2 (T, K): (T, parts * M) float32 and parts. CUDA with a bf16 stream:
    one GEMM against [phi_hi | phi_lo] (parts 2, summed by the pre kernel); else float32
    with phi_hi + phi_lo, so every path sees the same rounded phi."""
    hi, lo = _split_bf16(phi)
    if _tensor_core_path(x2):
        return _mm_f32(x2, torch.cat([hi, lo], dim=1)), 2
    return x2.float() @ (hi.float() + lo.float()), 1


def _gemm_bwd(x2, phi, g_mix, need_phi: bool):
    """g_x's GEMM part g_mix phi^T (T, K) in the stream dtype, and dL/dphi = x2^T g_mix."""
    hi, lo = _split_bf16(phi)
    if _tensor_core_path(x2):
        gx = torch.mm(g_mix.to(torch.bfloat16), hi.t())
        g_phi = None
        if need_phi:
            ghi, glo = _split_bf16(g_mix)
            d = _mm_f32(x2.t(), torch.cat([ghi, glo], dim=1))
            m = g_mix.shape[1]
            g_phi = d[:, :m] + d[:, m:]
        return gx, g_phi
    phi_q = hi.float() + lo.float()
    gx = (g_mix @ phi_q.t()).to(x2.dtype)
    g_phi = x2.float().t() @ g_mix if need_phi else None
    return gx, g_phi


# ---------------------------------------------------------------- launchers
def _launch(name: str, *args, stream_of: torch.Tensor):
    mod = _backend.for_tensor(stream_of)
    if stream_of.is_cuda:
        with _backend.on_device(stream_of):
            getattr(mod, name)(*args, _backend.stream(stream_of))
    else:
        getattr(mod, name)(*args)


def _project(lres, projection, iters, sk_eps, tol, max_iter):
    if projection == 0:
        # the float32 defaults of birkhoff_project: the float64 re-solve gets its own cap
        return _birkhoff_fwd(lres, tol, max_iter, FALLBACK_MAX_ITER, None)
    return sinkhorn_fwd(lres, iters, sk_eps)


def _pre_forward(x, phi, alpha, bias, projection, iters, sk_eps, tol, max_iter, rms_eps,
                 pre_eps, post_mult):  # fmt: skip
    t, n, c = x.shape
    m = n * n + 2 * n
    mix, parts = _mix(x.view(t, n * c), phi)
    y = x.new_empty(t, c)
    maps = x.new_empty(t, 2 * n, dtype=torch.float32)
    lres = x.new_empty(t, n, n, dtype=torch.float32)
    inv_r = x.new_empty(t, dtype=torch.float32)
    if m != mix.shape[1] // parts:
        raise ValueError(f"phi must have n^2 + 2n = {m} columns; got {mix.shape[1] // parts}")
    _launch(
        "hc_pre_fwd", x.data_ptr(), mix.data_ptr(), parts, alpha.data_ptr(), bias.data_ptr(),
        y.data_ptr(), maps.data_ptr(), lres.data_ptr(), inv_r.data_ptr(), t, n, c,
        _STREAM_CODE[x.dtype], rms_eps, pre_eps, post_mult, stream_of=x,
    )  # fmt: skip
    h_res = _project(lres, projection, iters, sk_eps, tol, max_iter)
    token = x.new_zeros(()).expand(x.shape)  # carries dL/dout from the post op (no storage)
    return y, maps, h_res, token, mix, inv_r, lres


def _post_forward(x, f, maps, h_res):
    t, n, c = x.shape
    out = torch.empty_like(x)
    _launch(
        "hc_post_fwd", x.data_ptr(), f.data_ptr(), maps.data_ptr(), h_res.data_ptr(),
        out.data_ptr(), t, n, c, _STREAM_CODE[x.dtype], stream_of=x,
    )  # fmt: skip
    return out


def _post_backward(g_out, x, f, maps):
    t, n, c = x.shape
    g_f = torch.empty_like(f)
    g_hpost = x.new_empty(t, n, dtype=torch.float32)
    g_hres = x.new_empty(t, n, n, dtype=torch.float32)
    _launch(
        "hc_post_bwd", g_out.data_ptr(), x.data_ptr(), f.data_ptr(), maps.data_ptr(),
        g_f.data_ptr(), g_hpost.data_ptr(), g_hres.data_ptr(), t, n, c, _STREAM_CODE[x.dtype],
        stream_of=x,
    )  # fmt: skip
    return g_f, torch.cat([torch.zeros_like(g_hpost), g_hpost], dim=1), g_hres


def _pre_backward(g_y, g_maps, g_hres, g_out, x, phi, alpha, maps, h_res, mix, inv_r, lres,
                  projection, iters, sk_eps, pre_eps, post_mult, need_phi):  # fmt: skip
    t, n, c = x.shape
    m = n * n + 2 * n
    parts = mix.shape[1] // m
    if projection == 0:
        g_lres = _birkhoff_bwd(h_res, g_hres)
    else:
        g_lres = sinkhorn_bwd(lres, g_hres, iters, sk_eps)
    g_logit = x.new_empty(t, m, dtype=torch.float32)
    g_mix = torch.empty_like(g_logit)
    g_alpha = x.new_empty(t, 3, dtype=torch.float32)
    coef = x.new_empty(t, dtype=torch.float32)
    code = _STREAM_CODE[x.dtype]
    _launch(
        "hc_pre_bwd_reduce", g_y.data_ptr(), x.data_ptr(), maps.data_ptr(), g_maps.data_ptr(),
        g_lres.data_ptr(), mix.data_ptr(), parts, inv_r.data_ptr(), alpha.data_ptr(),
        g_logit.data_ptr(), g_mix.data_ptr(), g_alpha.data_ptr(), coef.data_ptr(), t, n, c,
        code, pre_eps, post_mult, stream_of=x,
    )  # fmt: skip
    gx, g_phi = _gemm_bwd(x.view(t, n * c), phi, g_mix, need_phi)
    g_x = torch.empty_like(x)
    _launch(
        "hc_pre_bwd", g_out.data_ptr(), g_y.data_ptr(), gx.data_ptr(), x.data_ptr(),
        maps.data_ptr(), h_res.data_ptr(), coef.data_ptr(), g_x.data_ptr(), t, n, c, code,
        stream_of=x,
    )  # fmt: skip
    if g_phi is None:
        g_phi = torch.zeros_like(phi)
    return g_x, g_phi, g_alpha.sum(0), g_logit.sum(0)


# ---------------------------------------------------------------- custom ops
# x: (T, n, C) contiguous bf16 / float32; phi (n C, M), alpha (3,), bias (M,) float32;
# projection 0 (Birkhoff) or 1 (Sinkhorn-k).
@torch.library.custom_op("mhc_proj::hc_pre", mutates_args=())
def _pre_op(
    x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor,
    projection: int, iters: int, sk_eps: float, tol: float, max_iter: int, rms_eps: float,
    pre_eps: float, post_mult: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:  # fmt: skip
    return _pre_forward(x, phi, alpha, bias, projection, iters, sk_eps, tol, max_iter, rms_eps,
                        pre_eps, post_mult)  # fmt: skip


@_pre_op.register_fake
def _(x, phi, alpha, bias, projection, iters, sk_eps, tol, max_iter, rms_eps, pre_eps,
      post_mult):  # fmt: skip
    t, n, c = x.shape
    m = n * n + 2 * n
    parts = 2 if _tensor_core_path(x) else 1
    f32 = torch.float32
    return (
        x.new_empty(t, c), x.new_empty(t, 2 * n, dtype=f32), x.new_empty(t, n, n, dtype=f32),
        x.new_empty(()).expand(x.shape), x.new_empty(t, parts * m, dtype=f32),
        x.new_empty(t, dtype=f32), x.new_empty(t, n, n, dtype=f32),
    )  # fmt: skip


@torch.library.custom_op("mhc_proj::hc_pre_bwd", mutates_args=())
def _pre_bwd_op(
    g_y: torch.Tensor, g_maps: torch.Tensor, g_hres: torch.Tensor, g_out: torch.Tensor,
    x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, maps: torch.Tensor,
    h_res: torch.Tensor, mix: torch.Tensor, inv_r: torch.Tensor, lres: torch.Tensor,
    projection: int, iters: int, sk_eps: float, pre_eps: float, post_mult: float,
    need_phi: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _pre_backward(g_y, g_maps, g_hres, g_out, x, phi, alpha, maps, h_res, mix, inv_r,
                         lres, projection, iters, sk_eps, pre_eps, post_mult, need_phi)  # fmt: skip


@_pre_bwd_op.register_fake
def _(g_y, g_maps, g_hres, g_out, x, phi, alpha, maps, h_res, mix, inv_r, lres, *args):
    m = phi.shape[1]
    return torch.empty_like(x), torch.empty_like(phi), alpha.new_empty(3), alpha.new_empty(m)


def _pre_setup(ctx, inputs, output):
    x, phi, alpha, _bias, projection, iters, sk_eps, _tol, _mi, _re, pre_eps, post_mult = inputs
    _y, maps, h_res, _token, mix, inv_r, lres = output
    ctx.save_for_backward(x, phi, alpha, maps, h_res, mix, inv_r, lres)
    ctx.args = (projection, iters, sk_eps, pre_eps, post_mult)
    ctx.need_phi = ctx.needs_input_grad[1]


def _pre_autograd(ctx, g_y, g_maps, g_hres, g_token, *_unused):
    x, phi, alpha, maps, h_res, mix, inv_r, lres = ctx.saved_tensors
    t, n, c = x.shape
    g_y = torch.zeros(t, c, dtype=x.dtype, device=x.device) if g_y is None else g_y
    g_maps = torch.zeros_like(maps) if g_maps is None else g_maps
    g_hres = torch.zeros_like(h_res) if g_hres is None else g_hres
    g_out = torch.zeros_like(x) if g_token is None else g_token
    g_x, g_phi, g_alpha, g_bias = _pre_bwd_op(
        g_y.to(x.dtype).contiguous(), g_maps.float().contiguous(), g_hres.float().contiguous(),
        g_out.to(x.dtype).contiguous(), x, phi, alpha, maps, h_res, mix, inv_r, lres,
        *ctx.args, ctx.need_phi,
    )  # fmt: skip
    return (g_x, g_phi, g_alpha, g_bias) + (None,) * 8


_pre_op.register_autograd(_pre_autograd, setup_context=_pre_setup)


@torch.library.custom_op("mhc_proj::hc_post", mutates_args=())
def _post_op(
    token: torch.Tensor, x: torch.Tensor, f: torch.Tensor, maps: torch.Tensor,
    h_res: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    return _post_forward(x, f, maps, h_res)


@_post_op.register_fake
def _(token, x, f, maps, h_res):
    return torch.empty_like(x)


@torch.library.custom_op("mhc_proj::hc_post_bwd", mutates_args=())
def _post_bwd_op(
    g_out: torch.Tensor, x: torch.Tensor, f: torch.Tensor, maps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _post_backward(g_out, x, f, maps)


@_post_bwd_op.register_fake
def _(g_out, x, f, maps):
    t, n, _c = x.shape
    f32 = torch.float32
    return torch.empty_like(f), maps.new_empty(t, 2 * n), x.new_empty(t, n, n, dtype=f32)


def _post_setup(ctx, inputs, output):
    _token, x, f, maps, _h_res = inputs
    ctx.save_for_backward(x, f, maps)


def _post_autograd(ctx, g_out):
    x, f, maps = ctx.saved_tensors
    g_out = g_out.to(x.dtype).contiguous()
    g_f, g_maps, g_hres = _post_bwd_op(g_out, x, f, maps)
    # dL/dout goes to the pre op's backward as the token's gradient (it also computes the
    # H_res^T dL/dout part of dL/dx there); x's own edge carries nothing
    return g_out, None, g_f, g_maps, g_hres


_post_op.register_autograd(_post_autograd, setup_context=_post_setup)


# ---------------------------------------------------------------- public API
def _scalar(name: str, a, device) -> torch.Tensor:
    if not isinstance(a, torch.Tensor):
        return torch.tensor(float(a), dtype=torch.float32, device=device)
    if a.numel() != 1:
        raise ValueError(f"{name} must be a scalar (one element); got shape {tuple(a.shape)}")
    return a.reshape(()).float()


def _check(x, phi, bias, projection):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in _STREAM_CODE:
        raise TypeError(f"x (the residual stream) must be bfloat16 or float32; got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must have shape (..., n, C); got {tuple(x.shape)}")
    n, c = x.shape[-2], x.shape[-1]
    if not N_MIN <= n <= N_MAX:
        raise ValueError(f"x: the number of streams n = x.shape[-2] must be in 2..8; got {n}")
    if not (x.is_cuda or x.is_cpu):
        raise ValueError(f"x must be on a CPU or CUDA device; got {x.device}")
    m = n * n + 2 * n
    if tuple(phi.shape) != (n * c, m):
        raise ValueError(
            f"phi must have shape (n*C, n*n + 2n) = ({n * c}, {m}); got {tuple(phi.shape)}"
        )
    if tuple(bias.shape) != (m,):
        raise ValueError(f"b must have shape ({m},); got {tuple(bias.shape)}")
    for name, tensor in (("phi", phi), ("b", bias)):
        if tensor.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}; got {tensor.device}")
    if projection not in PROJECTIONS:
        raise ValueError(f"projection must be one of {PROJECTIONS}; got {projection!r}")


def hyper_connection(
    x: torch.Tensor,
    layer,
    phi: torch.Tensor,
    b: torch.Tensor,
    alpha_pre: torch.Tensor | float,
    alpha_post: torch.Tensor | float,
    alpha_res: torch.Tensor | float,
    *,
    projection: str = "birkhoff",
    sinkhorn_iters: int = SINKHORN_ITERS,
    sinkhorn_eps: float = SINKHORN_EPS,
    rms_eps: float = HC_RMS_EPS,
    pre_eps: float = HC_PRE_EPS,
    post_mult: float = HC_POST_MULT,
    return_maps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, HCMaps]:
    """x_next = H_res x + H_post^T layer(H_pre x) for a residual stream x (..., n, C).

    Args:
        x: the stream, (..., n, C), n in 2..8, bfloat16 or float32, any leading dims.
        layer: the sublayer F, a callable (..., C) -> (..., C); it sees y = H_pre x in x's
            dtype, its output is cast to x's dtype.
        phi: (n C, n^2 + 2n) mixing weights, columns [pre (n) | post (n) | res (n^2)];
            computed in float32 (bf16 hi + lo halves in the GEMM on CUDA).
        b: (n^2 + 2n,) biases; alpha_pre / alpha_post / alpha_res: scalar scales.
        projection: ``"birkhoff"`` (exact, default) or ``"sinkhorn"`` (Sinkhorn-k,
            ``sinkhorn_iters`` / ``sinkhorn_eps`` in the DeepSeek-V4 convention).
        rms_eps, pre_eps, post_mult: as in the module docstring (defaults 1e-6, 0, 2).
        return_maps: also return the float32 :class:`HCMaps` of the call.

    Returns:
        x_next of x's shape and dtype (and the maps). Differentiable in x, the sublayer's
        parameters, phi, b and the alphas.
    """
    _check(x, phi, b, projection)
    shape = x.shape
    n, c = shape[-2], shape[-1]
    xs = x.reshape(-1, n, c).contiguous()
    alpha = torch.stack(
        [_scalar(k, a, x.device) for k, a in
         (("alpha_pre", alpha_pre), ("alpha_post", alpha_post), ("alpha_res", alpha_res))]
    )  # fmt: skip
    if int(sinkhorn_iters) < 1:
        raise ValueError(f"sinkhorn_iters must be >= 1; got {sinkhorn_iters}")
    if not sinkhorn_eps >= 0:
        raise ValueError(f"sinkhorn_eps must be >= 0; got {sinkhorn_eps}")
    if not rms_eps >= 0:
        raise ValueError(f"rms_eps must be >= 0; got {rms_eps}")
    proj = PROJECTIONS.index(projection)
    y, maps, h_res, token, *_ = _pre_op(
        xs, phi.float(), alpha, b.float(), proj, int(sinkhorn_iters), float(sinkhorn_eps),
        TOL_F32, MAX_ITER_F32, float(rms_eps), float(pre_eps), float(post_mult),
    )  # fmt: skip
    f = layer(y.reshape(*shape[:-2], c))
    if not isinstance(f, torch.Tensor) or tuple(f.shape) != (*shape[:-2], c):
        got = tuple(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
        raise ValueError(f"layer must map (..., C) to (..., C) = {(*shape[:-2], c)}; got {got}")
    f = f.to(x.dtype).reshape(-1, c).contiguous()
    out = _post_op(token, xs, f, maps, h_res).reshape(shape)
    if not return_maps:
        return out
    lead = shape[:-2]
    return out, HCMaps(
        maps[:, :n].reshape(*lead, n), maps[:, n:].reshape(*lead, n), h_res.reshape(*lead, n, n)
    )
