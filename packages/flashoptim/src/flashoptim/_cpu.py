"""The CPU path: one step in plain torch fp32, op for op the arithmetic of the Triton kernel.

``cpu_step`` is what ``backend="torch"`` (and ``"auto"`` on CPU tensors) runs. It computes
each value with the same fp32 operations in the same order as the kernel's tile math
(``_step_kernel._tile_update``), so under ``TRITON_INTERPRET=1`` (numpy's correctly rounded
fp32) the two agree bit for bit; on a GPU the kernel's approximate reciprocals, sqrt and
fused multiply-adds move ties (tests/_checks.py). Two torch ops are not correctly rounded
and are replaced: the fp32 ``sqrt`` (``_sqrt_rn``) and ``scalar / tensor`` (computed by torch
as ``scalar * (1 / tensor)``).
"""

from __future__ import annotations

import math

import torch

from .reference import ADAM, GROUP, M32, SGD, uniform_ref

C127 = 1.0 / 127.0  # rounded to fp32 where used
C255 = 1.0 / 255.0


def _pow2_t(k: torch.Tensor) -> torch.Tensor:
    """2**k as fp32 for int64 k in [-126, 127], built from bits (exact)."""
    return ((k + 127) << 23).to(torch.int32).view(torch.float32)


def _narrow_q(pbits: torch.Tensor, is_bf16: bool, shift: int):
    """(q, 1/q) for narrow values given as int64 bit patterns."""
    if is_bf16:
        e = torch.clamp((pbits >> 7) & 0xFF, min=1)
        k = torch.clamp(e - 134 - shift, min=-126)
    else:
        e = torch.clamp((pbits >> 10) & 0x1F, min=1)
        k = e - 25 - shift
    return _pow2_t(k), _pow2_t(-k)


def _to_narrow_t(theta: torch.Tensor, is_bf16: bool) -> torch.Tensor:
    """Round-to-nearest-even fp32 -> bf16 through integer ops (as the kernel does)."""
    if not is_bf16:
        return theta.to(torch.float16)
    b = theta.view(torch.int32).to(torch.int64) & M32
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return r.to(torch.int32).to(torch.int16).view(torch.bfloat16)  # wraps to int16 bits


def _ceil_scale_t(amax: torch.Tensor, scale_f32: bool) -> torch.Tensor:
    """Smallest bf16 >= amax (as fp32), via bits; or amax itself for fp32 scales."""
    if scale_f32:
        return amax
    b = amax.view(torch.int32).to(torch.int64)
    return (((b + 0xFFFF) >> 16) << 16).to(torch.int32).view(torch.float32)


def cpu_step(kind, p, g, st, hp, step, seed, idx_base=0) -> None:
    """One in-place step on one local tensor in plain torch fp32 (the kernel's arithmetic).

    ``p``: parameter (fp32, bf16 or fp16), ``g`` its gradient, ``st`` the state dict with
    ``m``/``ms``/``v``/``vs``/``c`` tensors as allocated by the optimizer.
    """
    f32 = torch.float32
    n = p.numel()
    st = {k: v.view(-1) for k, v in st.items() if v is not None}  # flat views, same storage
    bits, quant, sr = hp["ecc"], hp["quant"], hp["sr"]
    is_bf16 = p.dtype == torch.bfloat16
    pf = p.reshape(-1)
    gf = g.reshape(-1).to(f32)
    if bits:
        pb = pf.view(torch.int16).to(torch.int64) & 0xFFFF
        q, _ = _narrow_q(pb, is_bf16, bits)
        th = pf.to(f32) + st["c"].to(f32) * q
    else:
        th = pf.to(f32)
    pad = (-n) % GROUP

    def grp(x):
        return (torch.cat([x, x.new_zeros(pad)]) if pad else x).view(-1, GROUP)

    def dec_m():
        if not quant:
            return st["m"].reshape(-1)
        y = grp(st["m"].to(f32)) * f32_c(C127)
        x = y / (2.0 - y.abs())
        return (x * st["ms"].to(f32)[:, None]).reshape(-1)[:n]

    def enc_m(m):
        if not quant:
            st["m"].copy_(m)
            return
        mg = grp(m)
        s = _ceil_scale_t(mg.abs().amax(1), hp["scale_dtype"] == torch.float32)
        inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
        x = mg * inv[:, None]
        phi = 2.0 * x / (1.0 + x.abs())
        code = torch.clamp(torch.floor(phi * 127.0 + 0.5), -127, 127)
        st["m"].copy_(code.reshape(-1)[:n])
        st["ms"].copy_(s)

    lr = f32_c(hp["lr"])
    if kind == ADAM:
        m = dec_m()
        if quant:
            c = grp(st["v"].to(f32))
            sv = c * st["vs"].to(f32)[:, None] * f32_c(C255)
            v = (sv * sv).reshape(-1)[:n]
        else:
            v = st["v"].reshape(-1)
        if hp["decoupled"]:
            th = th * f32_c(1 - hp["lr"] * hp["wd"])
        else:
            gf = gf + f32_c(hp["wd"]) * th
        m = m + (gf - m) * f32_c(1 - hp["b1"])
        v = v * f32_c(hp["b2"]) + f32_c(1 - hp["b2"]) * (gf * gf)
        step_size = f32_c(hp["lr"] / (1 - hp["b1"] ** step))
        isb = f32_c(1 / math.sqrt(1 - hp["b2"] ** step))
        sv = _sqrt_rn(v)
        denom = sv * isb + f32_c(hp["eps"])
        th = th - step_size * (m / denom)
        enc_m(m)
        if quant:
            svg = grp(sv)
            s = _ceil_scale_t(svg.amax(1), hp["scale_dtype"] == torch.float32)
            # 255 / s, not 255 * (1 / s) (torch's scalar / tensor): one rounding, as the kernel
            inv = torch.where(s > 0, torch.full_like(s, 255.0) / torch.where(s > 0, s, 1.0), 0.0)
            code = torch.clamp(torch.floor(svg * inv[:, None] + 0.5), 0, 255)
            code = torch.where(svg > 0, code.clamp(min=1), code)
            st["v"].copy_(code.reshape(-1)[:n])
            st["vs"].copy_(s)
        else:
            st["v"].copy_(v)
    elif kind == SGD:
        mu = hp["b1"]
        if hp["decoupled"]:
            th = th * f32_c(1 - hp["lr"] * hp["wd"])
        else:
            gf = gf + f32_c(hp["wd"]) * th
        if mu != 0:
            if step == 1:
                m = gf
            else:
                m = dec_m() * f32_c(mu) + f32_c(1 - hp["dampening"]) * gf
            d = gf + f32_c(mu) * m if hp["nesterov"] else m
            enc_m(m)
        else:
            d = gf
        th = th - lr * d
    else:
        m = dec_m()
        th = th * f32_c(1 - hp["lr"] * hp["wd"])
        c = m * f32_c(hp["b1"]) + f32_c(1 - hp["b1"]) * gf
        th = th - lr * torch.sign(c)
        m = m * f32_c(hp["b2"]) + f32_c(1 - hp["b2"]) * gf
        enc_m(m)
    if p.dtype == torch.float32:
        pf.copy_(th)
        return
    pn = _to_narrow_t(th, is_bf16)
    if bits:
        pnb = pn.view(torch.int16).to(torch.int64) & 0xFFFF
        _, invq = _narrow_q(pnb, is_bf16, bits)
        r = (th - pn.to(f32)) * invq
        if sr:
            idx = torch.arange(n, dtype=torch.int64, device=p.device) + idx_base
            code = torch.floor(r + uniform_ref(seed, step, idx))
        else:
            code = torch.floor(r + 0.5)
        lim = 2 ** (bits - 1)
        st["c"].copy_(torch.clamp(code, -lim, lim - 1).view_as(st["c"]))
    pf.copy_(pn)


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt (the interpreter's numpy sqrt, IEEE ``sqrt.rn``): torch's
    CPU fp32 sqrt is not (one ulp off for ~16% of random inputs on an AVX-512 host); the
    float64 sqrt rounded to fp32 is (53 >= 2 * 24 + 2 bits: no double-rounding error)."""
    return x.double().sqrt().float()


def f32_c(x: float) -> torch.Tensor:
    """A Python float rounded to fp32 (a 0-d tensor), as a kernel scalar argument is."""
    return torch.tensor(x, dtype=torch.float32)
