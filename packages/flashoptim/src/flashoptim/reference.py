"""float64 reference of flashoptim's quantized step: the oracle of the CPU path and the kernel.

Storage formats (all per element unless noted):

* weight splitting: a bf16/fp16 parameter ``p`` plus an integer correction ``rho`` (int8 for
  24-bit master weights, int16 for 32-bit). With ``ulp`` the spacing of the narrow format
  at ``p`` (from ``p``'s exponent field, so nothing extra is stored) and
  ``q = ulp / 2**bits(rho)``, the master weight is ``theta = p + rho * q`` (exact in fp32).
  Splitting rounds ``theta`` to the nearest narrow value ``p`` and encodes
  ``e = theta - p`` (``|e| <= ulp / 2``) as ``rho = round(e / q)``, stochastically by default.
* momentum: ``phi(x) = 2x / (1 + |x|)`` of ``x = m / s`` then int8 (``round(127 phi)``);
  variance: ``sqrt(v) / s`` then uint8 (``round(255 .)``, never 0 for a nonzero ``v``).
  ``s`` is one scale per group of 32 elements: the group's absmax rounded *up* to a bf16
  value (8 exponent bits, the range of fp32: it cannot underflow like an fp16 scale) or kept
  in fp32 (``scale_dtype=torch.float32``). Encoding and decoding use the same stored ``s``.
* stochastic rounding draws ``u`` in [0, 1) from a counter-based hash of
  (per-tensor seed, step, element index): identical on CPU and GPU and across resumes.
"""

from __future__ import annotations

import math

import torch

GROUP = 32  # elements per scale
ADAM, SGD, LION = 0, 1, 2  # optimizer kinds (the kernel's KIND)
M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # the step's key for the rounding stream: step * GOLDEN mod 2**32
ECC_BITS = {None: 0, 24: 8, 32: 16}  # master_weight_bits -> correction bits
ECC_DTYPE = {8: torch.int8, 16: torch.int16}


# ------------------------------------------------------------------------------ hashing


def mix32_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def uniform_ref(seed: int, step: int, idx: torch.Tensor) -> torch.Tensor:
    """The stochastic-rounding draw u in [0, 1) for element indices ``idx`` (int64)."""
    key = torch.tensor([(seed + (step * GOLDEN)) & M32], dtype=torch.int64, device=idx.device)
    key = mix32_ref(key)
    h = mix32_ref((idx & M32) ^ key)
    return (h >> 8).to(torch.float32) * (2.0**-24)


# ---------------------------------------------------------- float64 reference (oracle)


def split_ref(theta: torch.Tensor, dtype: torch.dtype, bits: int, u: torch.Tensor | None = None):
    """float64 reference of weight splitting. Returns (narrow param, int correction).

    ``theta`` is the fp32 master value; ``u`` the rounding draw (None: round to nearest).
    """
    t = theta.to(torch.float64)
    p = theta.to(torch.float32).to(dtype)
    pf = p.to(torch.float64)
    ulp = ulp_ref(p)
    q = ulp / 2.0**bits
    if dtype == torch.bfloat16:
        q = torch.clamp(q, min=2.0**-126)
    r = (t - pf) / q
    code = torch.floor(r + (0.5 if u is None else u.to(torch.float64)))
    lim = 2 ** (bits - 1)
    return p, torch.clamp(code, -lim, lim - 1).to(ECC_DTYPE[bits])


def ulp_ref(p: torch.Tensor) -> torch.Tensor:
    """Spacing of p's format at p (the ulp above |p|'s binade), float64."""
    if p.dtype == torch.bfloat16:
        e = (p.view(torch.int16).to(torch.int64) >> 7) & 0xFF
        return torch.exp2((torch.clamp(e, min=1) - 127 - 7).to(torch.float64))
    e = (p.view(torch.int16).to(torch.int64) >> 10) & 0x1F
    return torch.exp2((torch.clamp(e, min=1) - 15 - 10).to(torch.float64))


def join_ref(p: torch.Tensor, code: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 master value from narrow ``p`` and correction ``code``."""
    q = ulp_ref(p) / 2.0**bits
    if p.dtype == torch.bfloat16:
        q = torch.clamp(q, min=2.0**-126)
    return p.to(torch.float64) + code.to(torch.float64) * q


def _ceil_scale_ref(amax: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    if scale_dtype == torch.float32:
        return amax.to(torch.float32)
    s = amax.to(torch.float32).to(torch.bfloat16)
    low = s.to(torch.float64) < amax.to(torch.float64)
    bumped = (s.view(torch.int16) + 1).view(torch.bfloat16)
    return torch.where(low, bumped, s)


def quantize_momentum_ref(m: torch.Tensor, scale_dtype=torch.bfloat16):
    """float64 reference: (int8 codes, scales) of a flat momentum tensor (groups of 32)."""
    x = pad_groups(m.to(torch.float64)).view(-1, GROUP)
    s = _ceil_scale_ref(x.abs().amax(1), scale_dtype)
    sf = s.to(torch.float64)[:, None]
    xn = torch.where(sf > 0, x / torch.where(sf > 0, sf, 1.0), 0.0)
    phi = 2 * xn / (1 + xn.abs())
    code = torch.clamp(torch.floor(phi * 127 + 0.5), -127, 127)
    return code.to(torch.int8).view(-1)[: m.numel()], s


def dequantize_momentum_ref(code: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    y = pad_groups(code.to(torch.float64)).view(-1, GROUP) / 127
    x = y / (2 - y.abs())
    return (x * s.to(torch.float64)[:, None]).view(-1)[: code.numel()]


def quantize_variance_ref(v: torch.Tensor, scale_dtype=torch.bfloat16):
    """float64 reference: (uint8 codes of sqrt(v)/s, scales s); nonzero v never codes 0."""
    sv = pad_groups(v.to(torch.float64).clamp(min=0).sqrt()).view(-1, GROUP)
    s = _ceil_scale_ref(sv.amax(1), scale_dtype)
    sf = s.to(torch.float64)[:, None]
    r = torch.where(sf > 0, sv / torch.where(sf > 0, sf, 1.0), 0.0)
    code = torch.clamp(torch.floor(r * 255 + 0.5), 0, 255)
    code = torch.where(sv > 0, code.clamp(min=1), code)
    return code.to(torch.uint8).view(-1)[: v.numel()], s


def dequantize_variance_ref(code: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    sv = pad_groups(code.to(torch.float64)).view(-1, GROUP) / 255 * s.to(torch.float64)[:, None]
    return (sv * sv).view(-1)[: code.numel()]


def pad_groups(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened and zero-padded to a whole number of groups of 32."""
    x = x.reshape(-1)
    r = (-x.numel()) % GROUP
    return torch.cat([x, x.new_zeros(r)]) if r else x


def step_ref(kind, p, g, st, hp, step, seed, idx_base=0):
    """float64 reference of one step of the quantized algorithm on one tensor.

    ``st``: dict with the stored state (``m``/``ms``/``v``/``vs`` codes and scales or fp32
    states, ``c`` correction); returns the new (param, state dict). Mirrors ``cpu_step``
    but computes the update in float64 from the decoded values.
    """
    bits, quant, sr, sdt = hp["ecc"], hp["quant"], hp["sr"], hp["scale_dtype"]
    n = p.numel()
    g64 = g.reshape(-1).to(torch.float64)
    if bits:
        th = join_ref(p.reshape(-1), st["c"], bits)
    else:
        th = p.reshape(-1).to(torch.float64)
    new = {}

    def dec_m():
        return dequantize_momentum_ref(st["m"], st["ms"]) if quant else st["m"].double()

    lr, wd = hp["lr"], hp["wd"]
    if kind == ADAM:
        b1, b2, eps = hp["b1"], hp["b2"], hp["eps"]
        m = dec_m()
        v = dequantize_variance_ref(st["v"], st["vs"]) if quant else st["v"].double()
        if hp["decoupled"]:
            th = th * (1 - lr * wd)
        else:
            g64 = g64 + wd * th
        m = m + (g64 - m) * (1 - b1)
        v = v * b2 + (1 - b2) * g64 * g64
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        th = th - lr / bc1 * (m / (v.sqrt() / math.sqrt(bc2) + eps))
        mv = [("m", m, quantize_momentum_ref), ("v", v, quantize_variance_ref)]
    elif kind == SGD:
        mu, damp = hp["b1"], hp["dampening"]
        if hp["decoupled"]:
            th = th * (1 - lr * wd)
        else:
            g64 = g64 + wd * th
        if mu != 0:
            m = g64.clone() if step == 1 else dec_m() * mu + (1 - damp) * g64
            d = g64 + mu * m if hp["nesterov"] else m
            mv = [("m", m, quantize_momentum_ref)]
        else:
            d, mv = g64, []
        th = th - lr * d
    else:
        b1, b2 = hp["b1"], hp["b2"]
        m = dec_m()
        th = th * (1 - lr * wd)
        c = m * b1 + (1 - b1) * g64
        th = th - lr * torch.sign(c)
        m = m * b2 + (1 - b2) * g64
        mv = [("m", m, quantize_momentum_ref)]
    for name, val, qf in mv:
        if quant:
            new[name], new[name + "s"] = qf(val, sdt)
        else:
            new[name] = val.to(torch.float32)
    th32 = th.to(torch.float32)
    if bits:
        u = None
        if sr:
            idx = torch.arange(n, dtype=torch.int64, device=p.device) + idx_base
            u = uniform_ref(seed, step, idx)
        pn, new["c"] = split_ref(th32, p.dtype, bits, u)
    else:
        pn = th32.to(p.dtype)
    return pn.view_as(p), new
