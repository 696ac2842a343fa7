"""The fused layer boundary: a stack of mHC layers with post(l) and pre(l + 1) in one pass.

In a stack of hyper-connections x_{l+1} = H_res^l x_l + H_post^l^T F_l(H_pre^l x_l), the
unfused layers read and write the n-stream residual three times per boundary: the post-mix
of layer l writes x_{l+1}, the mixing GEMM of layer l + 1 reads it, the pre kernel reads it
again. Here one op per boundary computes (``csrc/boundary.h`` has the math)

    x1 = H_post^l f + H_res^l x            written once, and multiplied by phi^{l+1} while
    h  = vec(x1) phi^{l+1}                 it is on chip (tensor cores, float32 accumulation)

then layer l + 1's maps, its exact projection and y = H_pre x1 (the layer's pre kernel); the
backward recomputes x1 from x and f instead of reading it, and forms all of dL/dx1, the
post-mix's backward and dL/dphi in one pass. The first layer's pre-mix and the last layer's
post-mix are the same op with one half switched off.

Read top to bottom: the split geometry, the launchers, the ``torch.library`` custom ops
with fake implementations and their autograd, :func:`hyper_connection_stack` and the
module :class:`HyperConnectionStack`. The float64 oracle is the chain of
:func:`mhc_proj.reference.hyper_connection_ref`; the design and its HBM floor are in
docs/design/mhc-proj.md ("The fused layer boundary").

Batch invariance: each token's sums run over the chunks of its split in a fixed order and
the splits' partials are added in order s = 0..S-1; nothing depends on the token's position.
The number of splits S is the only thing that depends on the batch: by default, on CUDA,
more splits for fewer tokens (to fill the GPU); ``deterministic=True`` fixes S from (n, C)
alone, so a token's maps, output and gradients are bitwise the same in any batch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from mhc_proj import _backend
from mhc_proj._config import BND_SPLIT_COLUMNS, FALLBACK_MAX_ITER, MAX_ITER_F32, TOL_F32
from mhc_proj.birkhoff import birkhoff_bwd, birkhoff_fwd
from mhc_proj.layer import PROJECTIONS, HCMaps
from mhc_proj.nn import HyperConnection
from mhc_proj.sinkhorn import sinkhorn_bwd, sinkhorn_fwd

__all__ = ["hyper_connection_stack", "HyperConnectionStack"]

_STREAM_CODE = {torch.float32: 0, torch.bfloat16: 2}
_N_MIN, _N_MAX = 2, 8  # the boundary kernels' instantiations (csrc/boundary_n.cu)
# the CUDA kernels' blocks (boundary_kernels.cuh): tokens per forward block, per backward
# block (n <= 4 / n > 4), and the blocks per SM each wants at least
_FWD_TILE, _FWD_BLOCKS_PER_SM = 128, 4
_BWD_BLOCKS_PER_SM = 2


def _bwd_group(n: int) -> int:
    return 256 if n <= 4 else 128


def _width(n: int) -> int:
    """Columns per chunk (csrc/boundary.h, bnd_width)."""
    return 64 if n <= 2 else (32 if n <= 4 else 16)


def _mpad(n: int) -> int:
    return (n * n + 2 * n + 15) // 16 * 16


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def splits(
    tokens: int,
    n: int,
    c: int,
    *,
    deterministic: bool,
    device: torch.device,
    backward: bool = False,
) -> tuple[int, int]:
    """(S, chunks per split) of a boundary launch. Deterministic (and on the CPU): splits
    of BND_SPLIT_COLUMNS columns, a function of (n, C) only. Default on CUDA: more splits
    when the token blocks alone would not fill the GPU, so S depends on the token count."""
    nchunks = -(-c // _width(n))
    cps = max(1, BND_SPLIT_COLUMNS // _width(n))
    if not deterministic and device.type == "cuda" and tokens > 0:
        if backward:
            blocks, want = -(-tokens // _bwd_group(n)), _BWD_BLOCKS_PER_SM
        else:
            blocks, want = -(-tokens // _FWD_TILE), _FWD_BLOCKS_PER_SM
        target = want * _sm_count(device.index if device.index is not None else 0)
        if blocks * -(-nchunks // cps) < target:
            cps = max(1, -(-nchunks // min(nchunks, -(-target // blocks))))
    cps = min(cps, nchunks)
    return -(-nchunks // cps), cps


# ---------------------------------------------------------------- launchers
def _launch(name: str, *args, stream_of: torch.Tensor):
    mod = _backend.for_tensor(stream_of)
    if stream_of.is_cuda:
        with _backend.on_device(stream_of):
            getattr(mod, name)(*args, _backend.stream(stream_of))
    else:
        getattr(mod, name)(*args)


def _ptr(t: torch.Tensor) -> int:
    """The data pointer, 0 for an absent (empty) operand."""
    return t.data_ptr() if t.numel() else 0


def _phi_operands(phi: torch.Tensor, n: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' phi: CPU, float32 (n C, M) as is (the second operand unused); CUDA,
    padded to (n, Cp, MP) (zero rows / columns) and split into bf16 hi + lo."""
    if not phi.is_cuda:
        return phi, phi
    m, w = n * n + 2 * n, _width(n)
    cp = -(-c // w) * w
    pad = phi.new_zeros(n, cp, _mpad(n))
    pad[:, :c, :m] = phi.view(n, c, m)
    hi = pad.to(torch.bfloat16)
    return hi, (pad - hi.float()).to(torch.bfloat16)


def _sum_splits(part: torch.Tensor) -> torch.Tensor:
    """part (S, ...) summed over S in order (float32)."""
    out = part.new_empty(part.shape[1:])
    _launch(
        "bnd_sum_splits",
        part.data_ptr(),
        out.data_ptr(),
        part.shape[0],
        out.numel(),
        stream_of=part,
    )
    return out


def _project(lres, projection, iters, sk_eps, transpose):
    """H_res (row = output stream): the projection P of the logits, P^T for DeepSeek's
    formulation (the layer's convention, mhc_proj.layer)."""
    if projection == 0:
        p = birkhoff_fwd(lres, TOL_F32, MAX_ITER_F32, False, FALLBACK_MAX_ITER)[0]
    else:
        p = sinkhorn_fwd(lres, iters, sk_eps)
    return p.transpose(-1, -2).contiguous() if transpose else p


def _forward(
    x,
    f,
    maps_prev,
    hres_prev,
    phi,
    bias,
    alpha,
    has_post,
    has_pre,
    projection,
    iters,
    sk_eps,
    rms_eps,
    pre_eps,
    post_mult,
    transpose,
    deterministic,
):
    t, n, c = x.shape
    m = n * n + 2 * n
    f32 = torch.float32
    code = _STREAM_CODE[x.dtype]
    x_next = torch.empty_like(x) if has_post else x.new_empty(0)
    empty = x.new_empty(0, dtype=f32)
    s, cps = splits(t, n, c, deterministic=deterministic, device=x.device)
    h_part = x.new_empty(s, t, m, dtype=f32) if has_pre else empty
    phi_a, phi_b = _phi_operands(phi, n, c) if has_pre else (empty, empty)
    args = [_ptr(x), _ptr(f), _ptr(maps_prev), _ptr(hres_prev), _ptr(phi_a)]
    if x.is_cuda:
        args.append(_ptr(phi_b))
    args += [_ptr(x_next), _ptr(h_part), t, n, c, code, has_post, has_pre, s, cps]
    _launch("bnd_fwd_main", *args, stream_of=x)
    if not has_pre:  # absent outputs: distinct empty tensors (outputs may not alias)
        return (x_next, x.new_empty(0)) + tuple(x.new_empty(0, dtype=f32) for _ in range(5))
    mix = _sum_splits(h_part)
    x1 = x_next if has_post else x
    y = x.new_empty(t, c)
    maps = x.new_empty(t, 2 * n, dtype=f32)
    lres = x.new_empty(t, n, n, dtype=f32)
    inv_r = x.new_empty(t, dtype=f32)
    _launch(
        "hc_pre_fwd",
        x1.data_ptr(),
        mix.data_ptr(),
        1,
        alpha.data_ptr(),
        bias.data_ptr(),
        y.data_ptr(),
        maps.data_ptr(),
        lres.data_ptr(),
        inv_r.data_ptr(),
        t,
        n,
        c,
        code,
        rms_eps,
        pre_eps,
        post_mult,
        stream_of=x,
    )
    h_res = _project(lres, projection, iters, sk_eps, transpose)
    return x_next, y, maps, h_res, mix, inv_r, lres


def _backward(
    g_next,
    g_y,
    g_maps,
    g_hres,
    x,
    f,
    maps_prev,
    hres_prev,
    x_next,
    phi,
    alpha,
    maps,
    h_res,
    mix,
    inv_r,
    lres,
    has_post,
    has_pre,
    projection,
    iters,
    sk_eps,
    pre_eps,
    post_mult,
    transpose,
    deterministic,
    need_phi,
):
    t, n, c = x.shape
    m, nmap = n * n + 2 * n, n * n + n
    f32 = torch.float32
    code = _STREAM_CODE[x.dtype]
    empty = x.new_empty(0, dtype=f32)
    g_mix = coef = empty
    if has_pre:
        if transpose:  # H_res = P^T: the projection's VJP takes P and dL/dP
            h_res, g_hres = (a.transpose(-1, -2).contiguous() for a in (h_res, g_hres))
        if projection == 0:
            g_lres = birkhoff_bwd(h_res, g_hres)
        else:
            g_lres = sinkhorn_bwd(lres, g_hres, iters, sk_eps)
        g_logit = x.new_empty(t, m, dtype=f32)
        g_mix = torch.empty_like(g_logit)
        g_alpha = x.new_empty(t, 3, dtype=f32)
        coef = x.new_empty(t, dtype=f32)
        x1 = x_next if has_post else x
        _launch(
            "hc_pre_bwd_reduce",
            g_y.data_ptr(),
            x1.data_ptr(),
            maps.data_ptr(),
            g_maps.data_ptr(),
            g_lres.data_ptr(),
            mix.data_ptr(),
            1,
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
    s, cps = splits(t, n, c, deterministic=deterministic, device=x.device, backward=True)
    groups = -(-t // _bwd_group(n)) if x.is_cuda else 1
    w = _width(n)
    cp = -(-c // w) * w
    dphi = empty
    if has_pre:  # the CUDA kernel writes every element, the CPU loop accumulates
        shape = (groups, n, cp, _mpad(n))
        dphi = x.new_empty(shape, dtype=f32) if x.is_cuda else x.new_zeros(shape, dtype=f32)
    dh_part = x.new_empty(s, t, nmap, dtype=f32) if has_post else empty
    g_x = torch.empty_like(x)
    g_f = x.new_empty(t, c) if has_post else x.new_empty(0)
    phi_a, phi_b = _phi_operands(phi, n, c) if has_pre else (empty, empty)
    args = [
        _ptr(x),
        _ptr(f),
        _ptr(maps_prev),
        _ptr(hres_prev),
        _ptr(g_next),
        _ptr(g_y),
        _ptr(maps),
        _ptr(coef),
        _ptr(inv_r),
        _ptr(g_mix),
        _ptr(phi_a),
    ]
    if x.is_cuda:
        args.append(_ptr(phi_b))
    args += [
        _ptr(g_x),
        _ptr(g_f),
        _ptr(dh_part),
        _ptr(dphi),
        t,
        n,
        c,
        code,
        has_post,
        has_pre,
        s,
        cps,
    ]
    if x.is_cuda:
        args.append(groups)
    _launch("bnd_bwd_main", *args, stream_of=x)
    if has_post:
        dh = _sum_splits(dh_part)
        g_maps_prev = torch.cat([torch.zeros_like(dh[:, :n]), dh[:, n * n :]], dim=1)
        g_hres_prev = dh[:, : n * n].reshape(t, n, n).contiguous()  # the fake's strides
    else:
        g_maps_prev, g_hres_prev = x.new_empty(0, dtype=f32), x.new_empty(0, dtype=f32)
    if has_pre:
        g_phi = dphi.sum(0)[:, :c, :m].reshape(n * c, m) if need_phi else torch.zeros_like(phi)
        g_bias, g_alpha = g_logit.sum(0), g_alpha.sum(0)
    else:
        g_phi, g_bias, g_alpha = (x.new_empty(0, dtype=f32) for _ in range(3))
    return g_x, g_f, g_maps_prev, g_hres_prev, g_phi, g_bias, g_alpha


# ---------------------------------------------------------------- custom ops
# x: (T, n, C) contiguous bf16 / float32; f (T, C) in x's dtype, maps_prev (T, 2n) and
# hres_prev (T, n, n) float32 (has_post; else empty); phi (n C, M), bias (M,), alpha (3,)
# float32 (has_pre); projection 0 (Birkhoff) or 1 (Sinkhorn-k); transpose: DeepSeek's
# formulation (H_res = P^T). Absent outputs are empty.
@torch.library.custom_op("mhc_proj::bnd_fwd", mutates_args=())
def _fwd_op(
    x: torch.Tensor,
    f: torch.Tensor,
    maps_prev: torch.Tensor,
    hres_prev: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    has_post: bool,
    has_pre: bool,
    projection: int,
    iters: int,
    sk_eps: float,
    rms_eps: float,
    pre_eps: float,
    post_mult: float,
    transpose: bool,
    deterministic: bool,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    # autocast stays on inside a custom op: nothing here may be recast behind our back
    with torch.autocast(x.device.type, enabled=False):
        return _forward(
            x,
            f,
            maps_prev,
            hres_prev,
            phi,
            bias,
            alpha,
            has_post,
            has_pre,
            projection,
            iters,
            sk_eps,
            rms_eps,
            pre_eps,
            post_mult,
            transpose,
            deterministic,
        )


@_fwd_op.register_fake
def _(x, f, maps_prev, hres_prev, phi, bias, alpha, has_post, has_pre, *args):
    t, n, c = x.shape
    f32 = torch.float32
    x_next = torch.empty_like(x) if has_post else x.new_empty(0)
    if not has_pre:
        return (x_next, x.new_empty(0)) + tuple(x.new_empty(0, dtype=f32) for _ in range(5))
    m = n * n + 2 * n
    return (
        x_next,
        x.new_empty(t, c),
        x.new_empty(t, 2 * n, dtype=f32),
        x.new_empty(t, n, n, dtype=f32),
        x.new_empty(t, m, dtype=f32),
        x.new_empty(t, dtype=f32),
        x.new_empty(t, n, n, dtype=f32),
    )


@torch.library.custom_op("mhc_proj::bnd_bwd", mutates_args=())
def _bwd_op(
    g_next: torch.Tensor,
    g_y: torch.Tensor,
    g_maps: torch.Tensor,
    g_hres: torch.Tensor,
    x: torch.Tensor,
    f: torch.Tensor,
    maps_prev: torch.Tensor,
    hres_prev: torch.Tensor,
    x_next: torch.Tensor,
    phi: torch.Tensor,
    alpha: torch.Tensor,
    maps: torch.Tensor,
    h_res: torch.Tensor,
    mix: torch.Tensor,
    inv_r: torch.Tensor,
    lres: torch.Tensor,
    has_post: bool,
    has_pre: bool,
    projection: int,
    iters: int,
    sk_eps: float,
    pre_eps: float,
    post_mult: float,
    transpose: bool,
    deterministic: bool,
    need_phi: bool,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    with torch.autocast(x.device.type, enabled=False):
        return _backward(
            g_next,
            g_y,
            g_maps,
            g_hres,
            x,
            f,
            maps_prev,
            hres_prev,
            x_next,
            phi,
            alpha,
            maps,
            h_res,
            mix,
            inv_r,
            lres,
            has_post,
            has_pre,
            projection,
            iters,
            sk_eps,
            pre_eps,
            post_mult,
            transpose,
            deterministic,
            need_phi,
        )


@_bwd_op.register_fake
def _(
    g_next,
    g_y,
    g_maps,
    g_hres,
    x,
    f,
    maps_prev,
    hres_prev,
    x_next,
    phi,
    alpha,
    maps,
    h_res,
    mix,
    inv_r,
    lres,
    has_post,
    has_pre,
    *args,
):
    t, n, c = x.shape

    def e():
        return x.new_empty(0, dtype=torch.float32)

    post = (x.new_empty(0), e(), e())
    if has_post:
        post = (x.new_empty(t, c), torch.empty_like(maps_prev), torch.empty_like(hres_prev))
    pre = (e(), e(), e())
    if has_pre:
        pre = (torch.empty_like(phi), alpha.new_empty(phi.shape[1]), alpha.new_empty(3))
    return (torch.empty_like(x), *post, *pre)


def _fwd_setup(ctx, inputs, output):
    x, f, maps_prev, hres_prev, phi, _bias, alpha, has_post, has_pre, *rest = inputs
    projection, iters, sk_eps, _rms_eps, pre_eps, post_mult, transpose, deterministic = rest
    x_next, _y, maps, h_res, mix, inv_r, lres = output
    ctx.save_for_backward(
        x, f, maps_prev, hres_prev, x_next, phi, alpha, maps, h_res, mix, inv_r, lres
    )
    ctx.args = (
        has_post,
        has_pre,
        projection,
        iters,
        sk_eps,
        pre_eps,
        post_mult,
        transpose,
        deterministic,
    )
    ctx.need_phi = has_pre and ctx.needs_input_grad[4]


def _fwd_autograd(ctx, g_next, g_y, g_maps, g_hres, *_unused):
    x, f, maps_prev, hres_prev, x_next, phi, alpha, maps, h_res, mix, inv_r, lres = (
        ctx.saved_tensors
    )
    has_post, has_pre = ctx.args[:2]
    t, n, c = x.shape
    # an output nobody used has no gradient: zeros (an empty g_next is read as zero)
    g_next = x.new_empty(0) if g_next is None or not has_post else g_next.to(x.dtype)
    if has_pre:
        g_y = x.new_zeros(t, c) if g_y is None else g_y.to(x.dtype)
        g_maps = torch.zeros_like(maps) if g_maps is None else g_maps.float()
        g_hres = torch.zeros_like(h_res) if g_hres is None else g_hres.float()
    else:
        g_y = x.new_empty(0)
        g_maps = g_hres = maps
    g_x, g_f, g_mp, g_hr, g_phi, g_bias, g_alpha = _bwd_op(
        g_next.contiguous(),
        g_y.contiguous(),
        g_maps.contiguous(),
        g_hres.contiguous(),
        x,
        f,
        maps_prev,
        hres_prev,
        x_next,
        phi,
        alpha,
        maps,
        h_res,
        mix,
        inv_r,
        lres,
        *ctx.args,
        ctx.need_phi,
    )
    post = (g_f, g_mp, g_hr) if has_post else (None, None, None)
    pre = (g_phi, g_bias, g_alpha) if has_pre else (None, None, None)
    return (g_x,) + post + pre + (None,) * 10


_fwd_op.register_autograd(_fwd_autograd, setup_context=_fwd_setup)


# ---------------------------------------------------------------- public API
def _alphas(hc: HyperConnection) -> torch.Tensor:
    return torch.stack([hc.alpha_pre, hc.alpha_post, hc.alpha_res]).reshape(3).float()


def _pre_args(hc: HyperConnection, deterministic: bool) -> tuple:
    return (
        PROJECTIONS.index(hc.projection),
        hc.tmax,
        hc.sinkhorn_eps,
        hc.rms_eps,
        hc.pre_eps,
        hc.post_mult,
        hc.formulation == "deepseek",
        deterministic,
    )


def _param_dtype(layer) -> torch.dtype | None:
    """The dtype of the sublayer's first floating parameter (None: none): the sublayer sees
    y in it, as in the layer (mhc_proj.layer: a bf16 stream around a float32 sublayer)."""
    if isinstance(layer, torch.nn.Module):
        for p in layer.parameters():
            if p.is_floating_point():
                return p.dtype
    return None


def _check(x, layers):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if len(layers) == 0:
        raise ValueError("layers must hold at least one HyperConnection; got none")
    for i, hc in enumerate(layers):
        if not isinstance(hc, HyperConnection):
            raise TypeError(
                f"layers[{i}] must be a mhc_proj.HyperConnection; got {type(hc).__name__}"
            )
    n, c = layers[0].hc, layers[0].c
    for i, hc in enumerate(layers):
        if (hc.hc, hc.c) != (n, c):
            raise ValueError(
                f"every layer must have the same hc and c: layers[0] has "
                f"(hc, c) = {(n, c)}, layers[{i}] {(hc.hc, hc.c)}"
            )
        if hc.phi.device != x.device:
            raise ValueError(
                f"layers[{i}].phi must be on x's device {x.device}; got {hc.phi.device}"
            )
    if x.dtype not in _STREAM_CODE:
        raise TypeError(f"x (the residual stream) must be bfloat16 or float32; got {x.dtype}")
    if x.dim() < 2 or tuple(x.shape[-2:]) != (n, c):
        raise ValueError(f"x must have shape (..., {n}, {c}); got {tuple(x.shape)}")
    if not (x.is_cuda or x.is_cpu):
        raise ValueError(f"x must be on a CPU or CUDA device; got {x.device}")
    if not _N_MIN <= n <= _N_MAX:
        raise ValueError(f"the fused boundary runs n = 2..8 streams; got hc = {n}")


def hyper_connection_stack(
    x: torch.Tensor,
    layers: Sequence[HyperConnection],
    *,
    deterministic: bool = False,
    return_maps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, list[HCMaps]]:
    """Runs the hyper-connections ``layers`` one after the other on the stream x, with
    each boundary between two layers fused (the module docstring); the same function as
    ``for hc in layers: x = hc(x)``.

    Args:
        x: the stream (..., n, C), bfloat16 or float32; every layer's ``hc`` is n and ``c``
            is C.
        layers: :class:`mhc_proj.HyperConnection` modules (their sublayers, parameters and
            options: projection, formulation, tmax, sinkhorn_eps, rms_eps, pre_eps,
            post_mult); each sublayer sees y in its parameters' dtype, as in the layer.
        deterministic: batch-invariant sums: a token's maps, output and gradients do not
            depend on the batch it is in (bitwise), at a cost when few tokens are in flight
            (docs/mhc-proj-layer.md, "The fused boundary").
        return_maps: also return each layer's float32 :class:`HCMaps`.

    Returns:
        x after the last layer (x's shape and dtype), and the maps if asked. Differentiable
        in x, the sublayers' parameters and every layer's phi, b and alphas.
    """
    _check(x, layers)
    shape = x.shape
    n, c = shape[-2], shape[-1]
    xs = x.reshape(-1, n, c).contiguous()
    f32 = torch.float32
    empty32 = xs.new_empty(0, dtype=f32)
    cur, f, maps_prev, hres_prev = xs, xs.new_empty(0), empty32, empty32
    all_maps = []
    for i, hc in enumerate(layers):
        x_next, y, maps, h_res, *_ = _fwd_op(
            cur,
            f,
            maps_prev,
            hres_prev,
            hc.phi.float().contiguous(),
            hc.b.float(),
            _alphas(hc),
            i > 0,
            True,
            *_pre_args(hc, deterministic),
        )
        if i > 0:
            cur = x_next
        y = y.reshape(*shape[:-2], c)
        pdt = _param_dtype(hc.layer)
        out = hc.layer(y if pdt is None or pdt == y.dtype else y.to(pdt))
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (*shape[:-2], c):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"layers[{i}].layer must map (..., C) to (..., C) = {(*shape[:-2], c)}; got {got}"
            )
        f = out.to(x.dtype).reshape(-1, c).contiguous()
        maps_prev, hres_prev = maps, h_res
        if return_maps:
            lead = shape[:-2]
            all_maps.append(
                HCMaps(
                    maps[:, :n].reshape(*lead, n),
                    maps[:, n:].reshape(*lead, n),
                    (h_res.transpose(-1, -2) if hc.formulation == "deepseek" else h_res).reshape(
                        *lead, n, n
                    ),
                )
            )
    last = layers[-1]
    x_out = _fwd_op(
        cur,
        f,
        maps_prev,
        hres_prev,
        empty32,
        empty32,
        empty32,
        True,
        False,
        *_pre_args(last, deterministic),
    )[0].reshape(shape)
    return (x_out, all_maps) if return_maps else x_out


class HyperConnectionStack(torch.nn.Module):
    """A sequence of :class:`mhc_proj.HyperConnection` layers run with fused boundaries.

    ``HyperConnectionStack(layers)(x)`` computes ``for hc in layers: x = hc(x)`` with the
    post-mix of each layer, the next layer's RMS norm, mixing GEMM, projection and pre-mix
    in one pass (:func:`hyper_connection_stack`). The parameters are the layers' own
    (``stack.layers[i].phi`` ...), so a model built from ``HyperConnection`` blocks keeps
    its weights and state dict layout under ``layers``.

    Args:
        layers: the HyperConnection modules, all with the same ``hc`` and ``c``.
        deterministic: batch-invariant results (:func:`hyper_connection_stack`).
    """

    def __init__(self, layers: Sequence[HyperConnection], *, deterministic: bool = False):
        super().__init__()
        layers = list(layers)
        for i, hc in enumerate(layers):
            if not isinstance(hc, HyperConnection):
                raise TypeError(
                    f"layers[{i}] must be a mhc_proj.HyperConnection; got {type(hc).__name__}"
                )
        self.layers = torch.nn.ModuleList(layers)
        self.deterministic = bool(deterministic)

    def forward(
        self, x: torch.Tensor, return_maps: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, list[HCMaps]]:
        return hyper_connection_stack(
            x, list(self.layers), deterministic=self.deterministic, return_maps=return_maps
        )

    def extra_repr(self) -> str:
        return f"deterministic={self.deterministic}"
