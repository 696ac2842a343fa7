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

``formulation="deepseek"`` is DeepSeek-V4's (and TileKernels'): the same maps with
pre_eps = hc_eps = 1e-6 by default, and the residual mix transposed,
x_next[j] = sum_i P[i, j] x[i] + H_post[j] F (its ``hc_post``); the kernels then apply
H_res = P^T (a transpose of T x n x n floats around the projection).

Read top to bottom: the options, the GEMM helpers, the launchers around the C++ / CUDA
kernels (``csrc/hc_kernels.cuh``, ``csrc/hc_cpu.h``), the ``torch.library`` custom ops
with fake implementations and their autograd (the pre op's backward computes the whole
stream gradient: the post op hands it dL/dout through a zero-storage token, so the two
parts of dL/dx are never summed in a separate pass), the same layer in torch ops (the path
of n > 8, of torch.func transforms and of a differentiated backward), and the public
:func:`hyper_connection`. The module is :class:`mhc_proj.nn.HyperConnection`; the float64
oracle :func:`mhc_proj.reference.hyper_connection_ref`; the math and the byte counts
docs/mhc-proj-layer.md.

Precision. Every map is float32, computed with autocast switched off around the layer's own
GEMMs (under ``torch.autocast`` only the sublayer runs in the autocast dtype: the layer's
result equals the run with an explicitly bf16 sublayer, bit for bit). A float32 stream
meets float32 phi in a float32 GEMM (torch's float32 matmul precision setting applies on
CUDA). A bf16 stream meets phi as two bf16 halves (hi + lo, 16 significant bits): on CUDA
one tensor-core GEMM with float32 output, on the CPU the same rounded phi in float32, so
the CPU path mirrors the CUDA one.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from mhc_proj import _backend, _checks
from mhc_proj._config import (
    DEEPSEEK_HC_EPS,
    HC_POST_MULT,
    HC_PRE_EPS,
    HC_RMS_EPS,
    MAX_ITER_F32,
    N_MAX,
    N_MAX_KERNEL,
    N_MIN,
    SINKHORN_EPS,
    SINKHORN_ITERS,
    SINKHORN_MAX_ITERS,
    TOL_F32,
)
from mhc_proj.birkhoff import birkhoff_bwd, birkhoff_fwd, birkhoff_project
from mhc_proj.sinkhorn import sinkhorn_bwd, sinkhorn_fwd, sinkhorn_project

__all__ = ["hyper_connection", "HCMaps", "PROJECTIONS", "FORMULATIONS", "layer_options"]

PROJECTIONS = ("birkhoff", "sinkhorn")
FORMULATIONS = ("mhc", "deepseek")
_STREAM_CODE = {torch.float32: 0, torch.bfloat16: 2}


class HCMaps(NamedTuple):
    """The per-token maps of a call (float32): ``h_pre`` (..., n), ``h_post`` (..., n),
    ``h_res`` (..., n, n): the projection P of the residual logits (doubly stochastic for
    the exact projection), in the formulation's convention: "mhc" applies x_next = P x,
    "deepseek" x_next = P^T x."""

    h_pre: torch.Tensor
    h_post: torch.Tensor
    h_res: torch.Tensor


class LayerOptions(NamedTuple):
    """The validated options of a call, in the order the custom op takes them."""

    projection: int  # 0 Birkhoff, 1 Sinkhorn-k
    iters: int
    sk_eps: float
    rms_eps: float
    pre_eps: float
    post_mult: float
    transpose: bool  # formulation "deepseek": H_res = P^T


def layer_options(
    *,
    projection: str = "birkhoff",
    formulation: str = "mhc",
    sinkhorn_iters: int = SINKHORN_ITERS,
    sinkhorn_eps: float = SINKHORN_EPS,
    rms_eps: float = HC_RMS_EPS,
    pre_eps: float | None = None,
    post_mult: float = HC_POST_MULT,
    iters_name: str = "sinkhorn_iters",
) -> LayerOptions:
    """Validates the layer's options (each bad one gets an error naming it) and fills the
    formulation's default pre_eps (0 for "mhc", DeepSeek's hc_eps 1e-6 for "deepseek")."""
    if projection not in PROJECTIONS:
        raise ValueError(f"projection must be one of {PROJECTIONS}; got {projection!r}")
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}; got {formulation!r}")
    if pre_eps is None:
        pre_eps = DEEPSEEK_HC_EPS if formulation == "deepseek" else HC_PRE_EPS
    return LayerOptions(
        projection=PROJECTIONS.index(projection),
        iters=_checks.integer(iters_name, sinkhorn_iters, 1, SINKHORN_MAX_ITERS),
        sk_eps=_checks.positive("sinkhorn_eps", sinkhorn_eps, allow_zero=True, hi=1.0),
        rms_eps=_checks.positive("rms_eps", rms_eps, allow_zero=True),
        pre_eps=_checks.finite("pre_eps", pre_eps),
        post_mult=_checks.finite("post_mult", post_mult),
        transpose=formulation == "deepseek",
    )


# ---------------------------------------------------------------- GEMMs
def _autocast_off(x: torch.Tensor):
    """The layer's own GEMMs run in the dtypes chosen here, not autocast's (under autocast a
    float32 GEMM returned bf16 and the pre kernel read it as float32: #29)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.autocast(device_type=dev, enabled=False)
    return contextlib.nullcontext()


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


def _mix_parts(x: torch.Tensor) -> int:
    """How many GEMM outputs per map the pre kernel sums: 2 for CUDA with a bf16 stream."""
    return 2 if x.is_cuda and x.dtype == torch.bfloat16 else 1


def _phi_as_used(phi: torch.Tensor, stream_dtype: torch.dtype) -> torch.Tensor:
    """phi as the GEMM sees it: float32 phi for a float32 stream, hi + lo for bf16."""
    if stream_dtype == torch.float32:
        return phi
    hi, lo = _split_bf16(phi)
    return hi.float() + lo.float()


def _mix(x2: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """h = x2 phi for x2 (T, K): (T, parts * M) float32 (CUDA, bf16: [x2 hi | x2 lo])."""
    with _autocast_off(x2):
        if _mix_parts(x2) == 2:
            hi, lo = _split_bf16(phi)
            return _mm_f32(x2, torch.cat([hi, lo], dim=1))
        return x2.float() @ _phi_as_used(phi, x2.dtype)


def _gemm_bwd(x2, phi, g_mix, need_phi: bool):
    """g_x's GEMM part g_mix phi^T (T, K) in the stream dtype, and dL/dphi = x2^T g_mix."""
    with _autocast_off(x2):
        if _mix_parts(x2) == 2:
            hi, _lo = _split_bf16(phi)
            gx = torch.mm(g_mix.to(torch.bfloat16), hi.t())
            g_phi = None
            if need_phi:
                ghi, glo = _split_bf16(g_mix)
                d = _mm_f32(x2.t(), torch.cat([ghi, glo], dim=1))
                m = g_mix.shape[1]
                g_phi = d[:, :m] + d[:, m:]
            return gx, g_phi
        gx = (g_mix @ _phi_as_used(phi, x2.dtype).t()).to(x2.dtype)
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


def _transposed(a: torch.Tensor, transpose: bool) -> torch.Tensor:
    return a.transpose(-1, -2).contiguous() if transpose else a


def _project(lres, projection, iters, sk_eps, transpose):
    """H_res (row = output stream) from the residual logits: P(lres), or P^T for DeepSeek's
    convention. The exact projection runs the float32 defaults of birkhoff_project."""
    if projection == 0:
        p = birkhoff_fwd(lres, TOL_F32, MAX_ITER_F32, False)[0]
    else:
        p = sinkhorn_fwd(lres, iters, sk_eps)
    return _transposed(p, transpose)


def _pre_forward(
    x, phi, alpha, bias, projection, iters, sk_eps, rms_eps, pre_eps, post_mult, transpose
):
    t, n, c = x.shape
    m = n * n + 2 * n
    if tuple(phi.shape) != (n * c, m):
        raise ValueError(f"phi must have shape ({n * c}, {m}); got {tuple(phi.shape)}")
    mix = _mix(x.view(t, n * c), phi)
    y = x.new_empty(t, c)
    maps = x.new_empty(t, 2 * n, dtype=torch.float32)
    lres = x.new_empty(t, n, n, dtype=torch.float32)
    inv_r = x.new_empty(t, dtype=torch.float32)
    _launch(
        "hc_pre_fwd",
        x.data_ptr(),
        mix.data_ptr(),
        mix.shape[1] // m,
        alpha.data_ptr(),
        bias.data_ptr(),
        y.data_ptr(),
        maps.data_ptr(),
        lres.data_ptr(),
        inv_r.data_ptr(),
        t,
        n,
        c,
        _STREAM_CODE[x.dtype],
        rms_eps,
        pre_eps,
        post_mult,
        stream_of=x,
    )
    h_res = _project(lres, projection, iters, sk_eps, transpose)
    token = x.new_zeros(()).expand(x.shape)  # carries dL/dout from the post op (no storage)
    return y, maps, h_res, token, mix, inv_r, lres


def _post_forward(x, f, maps, h_res):
    t, n, c = x.shape
    out = torch.empty_like(x)
    _launch(
        "hc_post_fwd",
        x.data_ptr(),
        f.data_ptr(),
        maps.data_ptr(),
        h_res.data_ptr(),
        out.data_ptr(),
        t,
        n,
        c,
        _STREAM_CODE[x.dtype],
        stream_of=x,
    )
    return out


def _post_backward(g_out, x, f, maps):
    t, n, c = x.shape
    g_f = torch.empty_like(f)
    g_hpost = x.new_empty(t, n, dtype=torch.float32)
    g_hres = x.new_empty(t, n, n, dtype=torch.float32)
    _launch(
        "hc_post_bwd",
        g_out.data_ptr(),
        x.data_ptr(),
        f.data_ptr(),
        maps.data_ptr(),
        g_f.data_ptr(),
        g_hpost.data_ptr(),
        g_hres.data_ptr(),
        t,
        n,
        c,
        _STREAM_CODE[x.dtype],
        stream_of=x,
    )
    return g_f, torch.cat([torch.zeros_like(g_hpost), g_hpost], dim=1), g_hres


def _pre_backward(
    g_y,
    g_maps,
    g_hres,
    g_out,
    x,
    phi,
    alpha,
    maps,
    h_res,
    mix,
    inv_r,
    lres,
    projection,
    iters,
    sk_eps,
    pre_eps,
    post_mult,
    transpose,
    need_phi,
):
    t, n, c = x.shape
    m = n * n + 2 * n
    g_p = _transposed(g_hres, transpose)  # dL/dP from dL/dH_res
    if projection == 0:
        g_lres = birkhoff_bwd(_transposed(h_res, transpose), g_p)
    else:
        g_lres = sinkhorn_bwd(lres, g_p, iters, sk_eps)
    g_logit = x.new_empty(t, m, dtype=torch.float32)
    g_mix = torch.empty_like(g_logit)
    g_alpha = x.new_empty(t, 3, dtype=torch.float32)
    coef = x.new_empty(t, dtype=torch.float32)
    code = _STREAM_CODE[x.dtype]
    _launch(
        "hc_pre_bwd_reduce",
        g_y.data_ptr(),
        x.data_ptr(),
        maps.data_ptr(),
        g_maps.data_ptr(),
        g_lres.data_ptr(),
        mix.data_ptr(),
        mix.shape[1] // m,
        inv_r.data_ptr(),
        alpha.data_ptr(),
        g_logit.data_ptr(),
        g_mix.data_ptr(),
        g_alpha.data_ptr(),
        coef.data_ptr(),
        t,
        n,
        c,
        code,
        pre_eps,
        post_mult,
        stream_of=x,
    )
    gx, g_phi = _gemm_bwd(x.view(t, n * c), phi, g_mix, need_phi)
    g_x = torch.empty_like(x)
    _launch(
        "hc_pre_bwd",
        g_out.data_ptr(),
        g_y.data_ptr(),
        gx.data_ptr(),
        x.data_ptr(),
        maps.data_ptr(),
        h_res.data_ptr(),
        coef.data_ptr(),
        inv_r.data_ptr(),
        g_x.data_ptr(),
        t,
        n,
        c,
        code,
        stream_of=x,
    )
    if g_phi is None:
        g_phi = torch.zeros_like(phi)
    return g_x, g_phi, g_alpha.sum(0), g_logit.sum(0)


# ---------------------------------------------------------------- the layer in torch ops
# The same maps and mix with autograd: the path of n > N_MAX_KERNEL (no kernels), of
# torch.func transforms (the custom ops' autograd does not compose with them), and the
# recompute of a differentiated backward (create_graph=True: gradient penalties, HVPs).
def maps_torch(
    x, phi, alpha, bias, projection, iters, sk_eps, rms_eps, pre_eps, post_mult, transpose
):
    """(y, maps, h_res) of the pre op for x (T, n, C), differentiable: y in x's dtype, maps
    (T, 2n) = [H_pre | H_post] and H_res (T, n, n) (row = output stream) float32."""
    t, n, c = x.shape
    with _autocast_off(x):
        xf = x.float().reshape(t, n * c)
        # float64 sum of squares: a finite stream up to 3.4e38 does not overflow it
        ms = x.double().reshape(t, n * c).square().mean(-1, keepdim=True)
        inv_r = torch.rsqrt(ms + rms_eps).float()
        scale = torch.cat([alpha[0].expand(n), alpha[1].expand(n), alpha[2].expand(n * n)])
        logits = (xf @ _phi_as_used(phi, x.dtype)) * inv_r * scale + bias
        h_pre = torch.sigmoid(logits[:, :n]) + pre_eps
        h_post = post_mult * torch.sigmoid(logits[:, n : 2 * n])
        lres = logits[:, 2 * n :].reshape(t, n, n)
        if projection == 0:
            p = birkhoff_project(lres)
        else:
            p = sinkhorn_project(lres, iters, sk_eps)
        h_res = p.transpose(-1, -2) if transpose else p
        y = (h_pre.unsqueeze(-1) * x.float()).sum(1).to(x.dtype)
    return y, torch.cat([h_pre, h_post], dim=1), h_res


def post_torch(x, f, maps, h_res):
    """x_next = H_res x + H_post^T f for x (T, n, C), f (T, C), in x's dtype."""
    n = x.shape[1]
    with _autocast_off(x):
        out = maps[:, n:].unsqueeze(-1) * f.float().unsqueeze(1) + h_res @ x.float()
    return out.to(x.dtype)


def _pre_grads_torch(inputs, opts, grads):
    """The pre op's backward as a differentiable function of its inputs and the output
    gradients: the forward recomputed in torch ops, then autograd.grad with create_graph."""
    with torch.enable_grad():
        leaves = [a if a.requires_grad else a.detach().requires_grad_(True) for a in inputs]
        outs = maps_torch(*leaves, *opts)
        pairs = [(o, g.to(o.dtype)) for o, g in zip(outs, grads) if g is not None]
        got = torch.autograd.grad(
            [o for o, _ in pairs],
            leaves,
            [g for _, g in pairs],
            create_graph=True,
            allow_unused=True,
        )
    return [torch.zeros_like(a) if g is None else g for a, g in zip(leaves, got)]


# ---------------------------------------------------------------- custom ops
# x: (T, n, C) contiguous bf16 / float32, n <= N_MAX_KERNEL; phi (n C, M), alpha (3,),
# bias (M,) float32; the options as in LayerOptions.
@torch.library.custom_op("mhc_proj::hc_pre", mutates_args=())
def _pre_op(
    x: torch.Tensor,
    phi: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor,
    projection: int,
    iters: int,
    sk_eps: float,
    rms_eps: float,
    pre_eps: float,
    post_mult: float,
    transpose: bool,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    return _pre_forward(
        x, phi, alpha, bias, projection, iters, sk_eps, rms_eps, pre_eps, post_mult, transpose
    )


@_pre_op.register_fake
def _(x, phi, alpha, bias, *opts):
    t, n, c = x.shape
    m = n * n + 2 * n
    f32 = torch.float32
    return (
        x.new_empty(t, c),
        x.new_empty(t, 2 * n, dtype=f32),
        x.new_empty(t, n, n, dtype=f32),
        x.new_empty(()).expand(x.shape),
        x.new_empty(t, _mix_parts(x) * m, dtype=f32),
        x.new_empty(t, dtype=f32),
        x.new_empty(t, n, n, dtype=f32),
    )


@torch.library.custom_op("mhc_proj::hc_pre_bwd", mutates_args=())
def _pre_bwd_op(
    g_y: torch.Tensor,
    g_maps: torch.Tensor,
    g_hres: torch.Tensor,
    g_out: torch.Tensor,
    x: torch.Tensor,
    phi: torch.Tensor,
    alpha: torch.Tensor,
    maps: torch.Tensor,
    h_res: torch.Tensor,
    mix: torch.Tensor,
    inv_r: torch.Tensor,
    lres: torch.Tensor,
    projection: int,
    iters: int,
    sk_eps: float,
    pre_eps: float,
    post_mult: float,
    transpose: bool,
    need_phi: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _pre_backward(
        g_y,
        g_maps,
        g_hres,
        g_out,
        x,
        phi,
        alpha,
        maps,
        h_res,
        mix,
        inv_r,
        lres,
        projection,
        iters,
        sk_eps,
        pre_eps,
        post_mult,
        transpose,
        need_phi,
    )


@_pre_bwd_op.register_fake
def _(g_y, g_maps, g_hres, g_out, x, phi, alpha, maps, h_res, mix, inv_r, lres, *args):
    m = phi.shape[1]
    return torch.empty_like(x), torch.empty_like(phi), alpha.new_empty(3), alpha.new_empty(m)


def _pre_setup(ctx, inputs, output):
    x, phi, alpha, bias, *opts = inputs
    _y, maps, h_res, _token, mix, inv_r, lres = output
    ctx.save_for_backward(x, phi, alpha, bias, maps, h_res, mix, inv_r, lres)
    ctx.opts = LayerOptions(*opts)
    ctx.need_phi = ctx.needs_input_grad[1]


def _pre_autograd(ctx, g_y, g_maps, g_hres, g_token, *_unused):
    x, phi, alpha, bias, maps, h_res, mix, inv_r, lres = ctx.saved_tensors
    o = ctx.opts
    none = (None,) * len(o)
    if torch.is_grad_enabled():
        # a differentiated backward: the post op's backward (also in torch ops then) sent
        # dL/dout through x's own edge, not the token, so g_token is not used here
        return (*_pre_grads_torch((x, phi, alpha, bias), o, (g_y, g_maps, g_hres)), *none)
    t, n, c = x.shape
    g_y = torch.zeros(t, c, dtype=x.dtype, device=x.device) if g_y is None else g_y
    g_maps = torch.zeros_like(maps) if g_maps is None else g_maps
    g_hres = torch.zeros_like(h_res) if g_hres is None else g_hres
    g_out = torch.zeros_like(x) if g_token is None else g_token
    g_x, g_phi, g_alpha, g_bias = _pre_bwd_op(
        g_y.to(x.dtype).contiguous(),
        g_maps.float().contiguous(),
        g_hres.float().contiguous(),
        g_out.to(x.dtype).contiguous(),
        x,
        phi,
        alpha,
        maps,
        h_res,
        mix,
        inv_r,
        lres,
        o.projection,
        o.iters,
        o.sk_eps,
        o.pre_eps,
        o.post_mult,
        o.transpose,
        ctx.need_phi,
    )
    return (g_x, g_phi, g_alpha, g_bias, *none)


_pre_op.register_autograd(_pre_autograd, setup_context=_pre_setup)


@torch.library.custom_op("mhc_proj::hc_post", mutates_args=())
def _post_op(
    token: torch.Tensor,
    x: torch.Tensor,
    f: torch.Tensor,
    maps: torch.Tensor,
    h_res: torch.Tensor,
) -> torch.Tensor:
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
    _token, x, f, maps, h_res = inputs
    ctx.save_for_backward(x, f, maps, h_res)


def _post_autograd(ctx, g_out):
    x, f, maps, h_res = ctx.saved_tensors
    if torch.is_grad_enabled():
        # a differentiated backward: the post op's VJP in torch ops, dL/dx through x's edge
        n = x.shape[1]
        with _autocast_off(x):
            g = g_out.float()
            g_f = (maps[:, n:].unsqueeze(-1) * g).sum(1).to(f.dtype)
            g_hpost = (g * f.float().unsqueeze(1)).sum(-1)
            g_hres = g @ x.float().transpose(1, 2)
            g_x = (h_res.transpose(1, 2) @ g).to(x.dtype)
        g_maps = torch.cat([torch.zeros_like(g_hpost), g_hpost], dim=1)
        return None, g_x, g_f, g_maps, g_hres
    g_out = g_out.to(x.dtype).contiguous()
    g_f, g_maps, g_hres = _post_bwd_op(g_out, x, f, maps)
    # dL/dout goes to the pre op's backward as the token's gradient (it also computes the
    # H_res^T dL/dout part of dL/dx there); x's own edge carries nothing
    return g_out, None, g_f, g_maps, g_hres


_post_op.register_autograd(_post_autograd, setup_context=_post_setup)


# ---------------------------------------------------------------- public API
def _scalar(name: str, a, device) -> torch.Tensor:
    if not isinstance(a, torch.Tensor):
        return torch.tensor(_checks.finite(name, a), dtype=torch.float32, device=device)
    if a.numel() != 1:
        raise ValueError(f"{name} must be a scalar (one element); got shape {tuple(a.shape)}")
    return a.reshape(()).float()


def _check(x, phi, bias):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in _STREAM_CODE:
        raise TypeError(f"x (the residual stream) must be bfloat16 or float32; got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must have shape (..., n, C); got {tuple(x.shape)}")
    n, c = x.shape[-2], x.shape[-1]
    if not N_MIN <= n <= N_MAX:
        raise ValueError(
            f"x: the number of streams n = x.shape[-2] must be in {N_MIN}..{N_MAX}; got {n}"
        )
    if not (x.is_cuda or x.is_cpu):
        raise ValueError(f"x must be on a CPU or CUDA device; got {x.device}")
    m = n * n + 2 * n
    for name, tensor, shape in (("phi", phi, (n * c, m)), ("b", bias, (m,))):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise TypeError(f"{name} must be a floating torch.Tensor; got {type(tensor)}")
        if tuple(tensor.shape) != shape:
            what = "(n*C, n*n + 2n) = " if name == "phi" else ""
            raise ValueError(f"{name} must have shape {what}{shape}; got {tuple(tensor.shape)}")
        if tensor.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}; got {tensor.device}")


def _param_dtype(layer) -> torch.dtype | None:
    """The dtype of the sublayer's first floating parameter (None: no parameters)."""
    if isinstance(layer, torch.nn.Module):
        for p in layer.parameters():
            if p.is_floating_point():
                return p.dtype
    return None


def _sublayer(layer, y: torch.Tensor, lead, c: int, dtype: torch.dtype) -> torch.Tensor:
    """F(y) as (T, C) in the stream dtype. y enters in the sublayer's parameter dtype (a bf16
    stream around a float32 sublayer, as LigerMHC does); under autocast the sublayer's ops
    then run in the autocast dtype as they would anywhere else."""
    y = y.reshape(*lead, c)
    pdt = _param_dtype(layer)
    f = layer(y if pdt is None or pdt == y.dtype else y.to(pdt))
    if not isinstance(f, torch.Tensor) or tuple(f.shape) != (*lead, c):
        got = tuple(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
        raise ValueError(f"layer must map (..., C) to (..., C) = {(*lead, c)}; got {got}")
    return f.to(dtype).reshape(-1, c).contiguous()


def _transforms_active() -> bool:
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


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
    formulation: str = "mhc",
    sinkhorn_iters: int = SINKHORN_ITERS,
    sinkhorn_eps: float = SINKHORN_EPS,
    rms_eps: float = HC_RMS_EPS,
    pre_eps: float | None = None,
    post_mult: float = HC_POST_MULT,
    return_maps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, HCMaps]:
    """x_next = H_res x + H_post^T layer(H_pre x) for a residual stream x (..., n, C).

    Args:
        x: the stream, (..., n, C), n in 2..16 (fused kernels up to 8, torch ops beyond),
            bfloat16 or float32, any leading dims.
        layer: the sublayer F, a callable (..., C) -> (..., C); it sees y = H_pre x in its
            parameters' dtype (else x's dtype), its output is cast to x's dtype. Under
            ``torch.autocast`` it runs in autocast, the layer's own ops do not.
        phi: (n C, n^2 + 2n) mixing weights, columns [pre (n) | post (n) | res (n^2)],
            computed in float32 (bf16 hi + lo halves for a bf16 stream).
        b: (n^2 + 2n,) biases; alpha_pre / alpha_post / alpha_res: scalar scales.
        projection: ``"birkhoff"`` (exact, default) or ``"sinkhorn"`` (Sinkhorn-k,
            ``sinkhorn_iters`` in 1..10000 / ``sinkhorn_eps`` in [0, 1], DeepSeek-V4's).
        formulation: ``"mhc"`` (x_next = P x, the paper's and Liger's) or ``"deepseek"``
            (x_next = P^T x and pre_eps = 1e-6: DeepSeek-V4's / TileKernels').
        rms_eps (>= 0), pre_eps (default 0, "deepseek" 1e-6), post_mult (2): as in the module
            docstring; every option is validated.
        return_maps: also return the float32 :class:`HCMaps` of the call.

    Returns:
        x_next of x's shape and dtype (and the maps). Differentiable in x, the sublayer's
        parameters, phi, b and the alphas; twice differentiable; composable with torch.func.
    """
    o = layer_options(
        projection=projection,
        formulation=formulation,
        sinkhorn_iters=sinkhorn_iters,
        sinkhorn_eps=sinkhorn_eps,
        rms_eps=rms_eps,
        pre_eps=pre_eps,
        post_mult=post_mult,
    )
    _check(x, phi, b)
    return_maps = _checks.flag("return_maps", return_maps)
    shape = x.shape
    lead, n, c = shape[:-2], shape[-2], shape[-1]
    xs = x.reshape(-1, n, c).contiguous()
    alpha = torch.stack(
        [
            _scalar(k, a, x.device)
            for k, a in (
                ("alpha_pre", alpha_pre),
                ("alpha_post", alpha_post),
                ("alpha_res", alpha_res),
            )
        ]
    )
    if n > N_MAX_KERNEL or _transforms_active():
        y, maps, h_res = maps_torch(xs, phi.float(), alpha, b.float(), *o)
        out = post_torch(xs, _sublayer(layer, y, lead, c, x.dtype), maps, h_res)
    else:
        y, maps, h_res, token, *_ = _pre_op(xs, phi.float(), alpha, b.float(), *o)
        out = _post_op(token, xs, _sublayer(layer, y, lead, c, x.dtype), maps, h_res)
    out = out.reshape(shape)
    if not return_maps:
        return out
    p = h_res.transpose(-1, -2) if o.transpose else h_res
    return out, HCMaps(
        maps[:, :n].reshape(*lead, n), maps[:, n:].reshape(*lead, n), p.reshape(*lead, n, n)
    )
