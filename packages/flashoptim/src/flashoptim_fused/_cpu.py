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

from ._plan import flat
from .grid import pad_rows, row_index, row_len, unpad_rows
from .reference import ADAM, BF16_MAX, GROUP, M32, M_BIT, MOM_SCALE_MIN, SGD, V_BIT, hash_ref

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


def code_offset_t(h: torch.Tensor, bit: int) -> torch.Tensor:
    """1 + a state code's rounding draw, fp32 in [1 + 2**-9, 2 - 2**-9], from the hash bits
    ``h`` (int64): the 8 bits k from ``bit`` are the mantissa's top 8 bits, the next bit set
    (``reference.code_draw_ref`` plus 1, exactly). The code is then ``floor(x + it) - 1``."""
    k = (h >> bit) & 0xFF
    return ((k << 15) | 0x3F804000).to(torch.int32).view(torch.float32)


def join_t(pf: torch.Tensor, c: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The fp32 master weight ``p + c * q`` of a flat parameter ``pf`` and its correction
    ``c`` (``bits`` 0: the parameter itself)."""
    if not bits:
        return pf.to(torch.float32)
    pb = pf.view(torch.int16).to(torch.int64) & 0xFFFF
    q, _ = _narrow_q(pb, pf.dtype == torch.bfloat16, bits)
    return pf.to(torch.float32) + c.to(torch.float32) * q


def groups_t(x: torch.Tensor) -> torch.Tensor:
    """A flat tensor zero-padded to whole groups, as [groups, 32]."""
    pad = (-x.numel()) % GROUP
    return (torch.cat([x, x.new_zeros(pad)]) if pad else x).view(-1, GROUP)


def decode_momentum_t(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 momentum of flat int8 ``codes`` and their group ``scales``."""
    y = groups_t(codes.to(torch.float32)) * f32_c(C127)
    x = y / (2.0 - y.abs())
    return (x * scales.to(torch.float32)[:, None]).reshape(-1)[: codes.numel()]


def encode_momentum_t(
    m: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, scale_f32: bool, h=None
):
    """Quantize the flat fp32 momentum ``m`` into ``codes`` and ``scales`` (in place); ``h``:
    the step's hash bits per element (stochastic rounding of the codes), None: nearest."""
    mg = groups_t(m)
    s = _ceil_scale_t(mg.abs().amax(1), scale_f32).clamp(min=MOM_SCALE_MIN)
    inv = 1.0 / s  # finite (s >= 2**-126), 0 where s = inf
    s = s if scale_f32 else s.clamp(max=BF16_MAX)
    x = mg * inv[:, None]
    phi = 2.0 * x / (1.0 + x.abs())
    if h is None:
        code = torch.clamp(torch.floor(phi * 127.0 + 0.5), -127, 127)
    else:  # |phi * 127| <= 127 (+ an ulp): floor(. + 1 + u) - 1 in [-127, 127], no clamp
        code = torch.floor(phi * 127.0 + groups_t(code_offset_t(h, M_BIT))) - 1.0
    codes.copy_(code.reshape(-1)[: m.numel()].view_as(codes))
    scales.copy_(s)


def split_t(th, pf, c, bits, sr, seed, step, idx_base, h=None) -> None:
    """Store the fp32 master weights ``th`` as the nearest narrow value in the flat parameter
    ``pf`` and the rest in its correction ``c`` (stochastic rounding with the draws of
    (seed, step, idx_base + i) when ``sr``; ``h``: those hash bits, if computed already); an
    fp32 ``pf`` takes ``th``."""
    if pf.dtype == torch.float32:
        pf.copy_(th)
        return
    is_bf16 = pf.dtype == torch.bfloat16
    pn = _to_narrow_t(th, is_bf16)
    if bits:
        pnb = pn.view(torch.int16).to(torch.int64) & 0xFFFF
        _, invq = _narrow_q(pnb, is_bf16, bits)
        r = (th - pn.to(torch.float32)) * invq
        if sr:
            if h is None:
                idx = torch.arange(th.numel(), dtype=torch.int64, device=th.device) + idx_base
                h = hash_ref(seed, step, idx)
            code = torch.floor(r + h.to(torch.float32) * (2.0**-32))
        else:
            code = torch.floor(r + 0.5)
        lim = 2 ** (bits - 1)
        c.copy_(torch.clamp(code, -lim, lim - 1).view_as(c))
    pf.copy_(pn)


def cpu_step(kind, p, g, st, hp, step, seed, idx_base=0, idx=None) -> None:
    """One in-place step on one local tensor in plain torch fp32 (the kernel's arithmetic).

    ``p``: parameter (fp32, bf16 or fp16), ``g`` its gradient, ``st`` the state dict with
    ``m``/``ms``/``v``/``vs``/``c`` tensors as allocated by the optimizer. Groups of 32 run
    over the flat tensor; ``idx``: the rounding stream's element indices (default
    ``idx_base + arange``).
    """
    f32 = torch.float32
    n = p.numel()
    # flat views in memory order, same storage (every array has the parameter's strides)
    st = {k: v.view(-1) if v.dim() <= 1 else flat(v) for k, v in st.items() if v is not None}
    bits, quant, sr = hp["ecc"], hp["quant"], hp["sr"]
    scale_f32 = hp["scale_dtype"] == torch.float32
    pf = flat(p)
    gf = flat(g).to(f32)
    if hp.get("maximize"):
        gf = -gf
    th = join_t(pf, st.get("c"), bits)
    h = None  # the step's hash bits per element: every stochastic rounding draws from them
    if sr and (bits or quant):
        if idx is None:
            idx = torch.arange(n, dtype=torch.int64, device=p.device) + idx_base
        h = hash_ref(seed, step, idx)

    def dec_m():
        return decode_momentum_t(st["m"], st["ms"]) if quant else st["m"].reshape(-1)

    def enc_m(m):
        if quant:
            encode_momentum_t(m, st["m"], st["ms"], scale_f32, h)
        else:
            st["m"].copy_(m)

    lr = f32_c(hp["lr"])
    if kind == ADAM:
        m = dec_m()
        if quant:
            c = groups_t(st["v"].to(f32))
            sv = c * st["vs"].to(f32)[:, None] * f32_c(C255)
            v = (sv * sv).reshape(-1)[:n]
        else:
            v = st["v"].reshape(-1)
        if hp["decoupled"]:
            th = th * f32_c(1 - hp["lr"] * hp["wd"])
        else:
            gf = gf + f32_c(hp["wd"]) * th
        m = m * f32_c(hp["b1"]) + f32_c(1 - hp["b1"]) * gf
        # ((1 - b2) g) g: finite up to |g| ~ 1.8e20, as torch's addcmul (g * g overflowed at 1.8e19)
        v = v * f32_c(hp["b2"]) + (f32_c(1 - hp["b2"]) * gf) * gf
        step_size = f32_c(hp["lr"] / (1 - hp["b1"] ** step))
        isb = f32_c(1 / math.sqrt(1 - hp["b2"] ** step))
        sv = _sqrt_rn(v).clamp(max=BF16_MAX)  # v = inf: finite scale and codes, update 0
        denom = sv * isb + f32_c(hp["eps"])
        th = th - step_size * (m / denom)
        enc_m(m)
        if quant:
            svg = groups_t(sv)
            s = _ceil_scale_t(svg.amax(1), scale_f32)
            # 255 / s, not 255 * (1 / s) (torch's scalar / tensor): one rounding, as the kernel
            inv = torch.where(s > 0, torch.full_like(s, 255.0) / torch.where(s > 0, s, 1.0), 0.0)
            if h is None:
                code = torch.clamp(torch.floor(svg * inv[:, None] + 0.5), 0, 255)
                code = torch.where(svg > 0, code.clamp(min=1), code)
            else:  # the kernel's max(t, lo) with lo = 2 (code 1) where svg != 0, else 1
                t = svg * inv[:, None] + groups_t(code_offset_t(h, V_BIT))
                t = torch.maximum(t, torch.where(svg <= 0, 1.0, 2.0))
                code = torch.floor(t) - 1.0
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
    split_t(th, pf, st.get("c"), bits, sr, seed, step, idx_base, h)


def cpu_step_rows(kind, p, g, st, hp, step, seed, idx_base=0) -> None:
    """``cpu_step`` on a parameter whose rows end inside a group (``grid.split``): every
    per-element array is zero-padded per row to whole groups (what the kernel's per-row
    table entries mask), stepped, and its real elements copied back; the group scales are
    stepped in place. Padded elements are zero everywhere and move no group maximum."""
    r = row_len(p)
    pf = flat(p)
    rows = pf.numel() // r
    per_el = {k: v for k, v in st.items() if v is not None and k not in ("ms", "vs")}
    padded = {k: pad_rows(flat(v), r) for k, v in per_el.items()}
    scales = {k: st[k].view(-1) for k in ("ms", "vs") if st.get(k) is not None}
    pp = pad_rows(pf, r)
    idx = row_index(rows, r, idx_base, pf.device)
    cpu_step(kind, pp, pad_rows(flat(g), r), dict(padded, **scales), hp, step, seed, idx=idx)
    pf.copy_(unpad_rows(pp, r))
    for k, v in per_el.items():
        flat(v).copy_(unpad_rows(padded[k], r))


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt (the interpreter's numpy sqrt, IEEE ``sqrt.rn``): torch's
    CPU fp32 sqrt is not (one ulp off for ~16% of random inputs on an AVX-512 host); the
    float64 sqrt rounded to fp32 is (53 >= 2 * 24 + 2 bits: no double-rounding error)."""
    return x.double().sqrt().float()


def f32_c(x: float) -> torch.Tensor:
    """A Python float rounded to fp32 (a 0-d tensor), as a kernel scalar argument is."""
    return torch.tensor(x, dtype=torch.float32)


def _rows_padded(g, hp: dict):
    """(padding, unpadding) of FlashMuon's per-element arrays: rows that end inside a group
    (``grid.split``) zero-padded per row to whole groups, as in ``cpu_step_rows`` (what the
    kernels' per-row table entries mask); the identity elsewhere."""
    r = row_len(g)
    if hp["quant"] and r % GROUP:
        return (lambda x: pad_rows(flat(x), r)), (lambda x: unpad_rows(x, r))
    return flat, (lambda x: x)


def _new_momentum_t(g, m, ms, hp: dict, lo=None):
    """(gradient, the momentum after this step's EMA), flat fp32, as the kernels' tile
    (``_muon_kernel._new_momentum``): the stored momentum (codes ``m`` with the scales
    ``ms``, plus the low-rank part ``lo`` (bf16) when given; or fp32 ``m``), then
    ``m + (1 - mu)(g - m)``."""
    gf = g.to(torch.float32)
    if hp.get("maximize"):
        gf = -gf
    mf = decode_momentum_t(m, ms.view(-1)) if hp["quant"] else m
    if lo is not None:
        mf = mf + lo.to(torch.float32)
    return gf, mf + (gf - mf) * f32_c(1 - hp["mu"])


def muon_momentum_cpu(g, st: dict, hp: dict, u_out, lo=None) -> None:
    """FlashMuon's pass 1 on one local tensor (``_muon_kernel._momentum_tile``): the
    direction ``u`` (Nesterov: ``m + (1 - mu)(g - m)``, else ``m``) rounded to bf16 into the
    flat ``u_out``, all in memory order; the momentum stored in ``st`` (``m``, ``ms``: codes
    rounded to nearest) unless ``lo`` (its low-rank part, flat bf16: pass 2 stores it)."""
    pad, unpad = _rows_padded(g, hp)
    m = pad(st["m"])
    gf, mf = _new_momentum_t(pad(g), m, st.get("ms"), hp, None if lo is None else pad(lo))
    u = mf + (gf - mf) * f32_c(1 - hp["mu"]) if hp["nesterov"] else mf
    if not hp["quant"]:
        m.copy_(mf)
    elif lo is None:
        encode_momentum_t(mf, m, st["ms"].view(-1), hp["scale_dtype"] == torch.float32)
        flat(st["m"]).copy_(unpad(m))
    u_out.copy_(unpad(_to_narrow_t(u, True)))


def muon_requantize_cpu(g, st: dict, hp: dict, lo, ln) -> None:
    """Pass 2's momentum of a low-rank momentum (``_muon_kernel._requantize_tile``): this
    step's momentum formed again as pass 1 formed it, minus the new low-rank part ``ln``,
    stored as codes rounded to nearest."""
    pad, unpad = _rows_padded(g, hp)
    m = pad(st["m"])
    _, mf = _new_momentum_t(pad(g), m, st["ms"], hp, pad(lo))
    r = mf - pad(ln).to(torch.float32)
    encode_momentum_t(r, m, st["ms"].view(-1), hp["scale_dtype"] == torch.float32)
    flat(st["m"]).copy_(unpad(m))


def muon_update_cpu(p, c, o, hp: dict, ratio: float, step: int, seed: int, idx_base=0) -> None:
    """FlashMuon's pass 2 on one local tensor (``_muon_kernel._update_tile``): the master
    weight ``theta (1 - lr wd) - (lr ratio) O`` of the orthogonalised update ``o`` (bf16, in
    the parameter's memory order), split back into ``p`` and its correction ``c`` (None: no
    correction)."""
    pf = flat(p)
    cf = None if c is None else flat(c)
    th = join_t(pf, cf, hp["ecc"])
    th = th * f32_c(1 - hp["lr"] * hp["wd"])
    th = th - (f32_c(hp["lr"]) * f32_c(ratio)) * o.reshape(-1).to(torch.float32)
    split_t(th, pf, cf, hp["ecc"], hp["sr"], seed, step, idx_base)
