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
* stochastic rounding (``stochastic_rounding=True``, the default) rounds the correction
  and the state codes: ``floor(x + u)`` with ``u`` drawn from a counter-based hash of
  (per-tensor seed, step, element index), identical on CPU and GPU and across resumes. The
  correction takes the hash as one fp32 draw, the variance and momentum codes 8 bits each
  (``V_BIT``, ``M_BIT``). Unbiased codes matter: with bf16 scales the group maximum sits
  below the top code, and an EMA increment below half a code (``(1 - beta2) * v`` is) is
  lost every step when rounded to nearest (docs/design/flashoptim.md, "Unbiased 8-bit states").
"""

from __future__ import annotations

import math

import torch

from .grid import GROUP, grouped, row_len, unpad_rows

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


def hash_ref(seed: int, step: int, idx: torch.Tensor) -> torch.Tensor:
    """The 32 random bits of element indices ``idx`` (int64) at this step: every stochastic
    rounding of the step draws from them (``uniform_ref``, ``code_draw_ref``)."""
    key = torch.tensor([(seed + (step * GOLDEN)) & M32], dtype=torch.int64, device=idx.device)
    key = mix32_ref(key)
    return mix32_ref((idx & M32) ^ key)


def uniform_ref(seed: int, step: int, idx: torch.Tensor) -> torch.Tensor:
    """The correction's stochastic-rounding draw u in [0, 1]: the hash bits as fp32 (rounded
    to nearest, as the GPU's I2F.U32 and numpy convert) times 2**-32; E[u] = 1/2."""
    return hash_ref(seed, step, idx).to(torch.float32) * (2.0**-32)


# the hash bits each state code rounds with: the variance code bits 15..22 (as stored in a
# float's mantissa: one LOP3 on the GPU), the momentum code bits 0..7. The correction reads
# all 32 as one fp32 draw, in which bits 15..22 weigh 2**-10 .. 2**-17: they change its
# rounding only when its threshold falls in one 2**-9 interval of u (correlation <= 2**-9)
V_BIT, M_BIT = 15, 0


def code_draw_ref(h: torch.Tensor, bit: int) -> torch.Tensor:
    """A state code's rounding draw from hash bits ``h``: (k + 1/2) / 256 for the 8 bits k
    from ``bit``, in [2**-9, 1 - 2**-9] (centred: the 8-bit draw is unbiased to 2**-9 of a
    code), float64."""
    k = (h >> bit) & 0xFF
    return (k.to(torch.float64) + 0.5) / 256.0


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


# the momentum's group scale is at least the smallest normal fp32 (1/s stays finite: a
# subnormal scale's reciprocal overflowed and its codes were garbage); a momentum group
# beyond the largest bf16 codes 0 (1/inf) and stores that largest value
MOM_SCALE_MIN = 2.0**-126
BF16_MAX = 3.3895313892515355e38  # also the cap of sqrt(v): its scale and codes stay finite


def _ceil_scale_ref(amax: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    if scale_dtype == torch.float32:
        return amax.to(torch.float32)
    s = amax.to(torch.float32).to(torch.bfloat16)
    low = s.to(torch.float64) < amax.to(torch.float64)
    bumped = (s.view(torch.int16) + 1).view(torch.bfloat16)
    return torch.where(low, bumped, s)


def _ungroup(x: torch.Tensor, n: int, row: int | None) -> torch.Tensor:
    """The real elements of a [groups, 32] tile of ``grouped`` (flat, ``n`` of them)."""
    return unpad_rows(x.reshape(-1), row)[:n] if row else x.reshape(-1)[:n]


def quantize_momentum_ref(m: torch.Tensor, scale_dtype=torch.bfloat16, u=None, row=None):
    """float64 reference: (int8 codes, scales) of a flat momentum tensor in groups of 32
    (``row``: of whole rows of that many elements, grouped within each row: ``grid.py``).
    ``u``: per-element rounding draws in (0, 1) (stochastic rounding of the codes, unbiased:
    E[code] = 127 phi); None rounds to nearest."""
    x = grouped(m.reshape(-1).to(torch.float64), row)
    s = _ceil_scale_ref(x.abs().amax(1), scale_dtype).clamp(min=MOM_SCALE_MIN)
    xn = x / s.to(torch.float64)[:, None]  # 0 where s = inf
    s = s.clamp(max=BF16_MAX) if scale_dtype == torch.bfloat16 else s
    phi = 2 * xn / (1 + xn.abs())
    add = 0.5 if u is None else grouped(u.reshape(-1).to(torch.float64), row)
    code = torch.clamp(torch.floor(phi * 127 + add), -127, 127)
    return _ungroup(code.to(torch.int8), m.numel(), row), s


def dequantize_momentum_ref(code: torch.Tensor, s: torch.Tensor, row=None) -> torch.Tensor:
    y = grouped(code.reshape(-1).to(torch.float64), row) / 127
    x = y / (2 - y.abs())
    return _ungroup(x * s.reshape(-1).to(torch.float64)[:, None], code.numel(), row)


def quantize_variance_ref(v: torch.Tensor, scale_dtype=torch.bfloat16, u=None, row=None):
    """float64 reference: (uint8 codes of sqrt(v)/s, scales s); nonzero v never codes 0.
    ``u``, ``row``: as in ``quantize_momentum_ref``."""
    sv = grouped(v.reshape(-1).to(torch.float64).clamp(min=0).sqrt().clamp(max=BF16_MAX), row)
    s = _ceil_scale_ref(sv.amax(1), scale_dtype)
    sf = s.to(torch.float64)[:, None]
    r = torch.where(sf > 0, sv / torch.where(sf > 0, sf, 1.0), 0.0)
    add = 0.5 if u is None else grouped(u.reshape(-1).to(torch.float64), row)
    code = torch.clamp(torch.floor(r * 255 + add), 0, 255)
    code = torch.where(sv > 0, code.clamp(min=1), code)
    return _ungroup(code.to(torch.uint8), v.numel(), row), s


def dequantize_variance_ref(code: torch.Tensor, s: torch.Tensor, row=None) -> torch.Tensor:
    c = grouped(code.reshape(-1).to(torch.float64), row)
    sv = c / 255 * s.reshape(-1).to(torch.float64)[:, None]
    return _ungroup(sv * sv, code.numel(), row)


def state_row(p: torch.Tensor, quant: bool) -> int | None:
    """The ``row`` argument of the quantizers for a parameter ``p`` (its local tensor):
    its row length where rows of at least a group end inside one (``grid.split``), else
    None: the flat grid of 32 (the same grid for rows of a multiple of 32; the optimizer
    keeps fp32 states for shorter rows, and the quantizers on a flat tensor use it)."""
    r = row_len(p)
    return r if quant and r >= GROUP and r % GROUP else None


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
    bits, quant = hp["ecc"], hp["quant"]
    row = state_row(p, quant)
    st = {k: v.reshape(-1) for k, v in st.items()}  # states of any shape, flat (as p)
    g64 = g.reshape(-1).to(torch.float64)
    if hp.get("maximize"):
        g64 = -g64
    if bits:
        th = join_ref(p.reshape(-1), st["c"], bits)
    else:
        th = p.reshape(-1).to(torch.float64)
    new = {}

    def dec_m():
        return dequantize_momentum_ref(st["m"], st["ms"], row) if quant else st["m"].double()

    lr, wd = hp["lr"], hp["wd"]
    if kind == ADAM:
        b1, b2, eps = hp["b1"], hp["b2"], hp["eps"]
        m = dec_m()
        v = dequantize_variance_ref(st["v"], st["vs"], row) if quant else st["v"].double()
        if hp["decoupled"]:
            th = th * (1 - lr * wd)
        else:
            g64 = g64 + wd * th
        m = m * b1 + (1 - b1) * g64
        v = v * b2 + (1 - b2) * g64 * g64
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        th = th - lr / bc1 * (m / (v.sqrt() / math.sqrt(bc2) + eps))
        mv = [("m", m, quantize_momentum_ref, M_BIT), ("v", v, quantize_variance_ref, V_BIT)]
    elif kind == SGD:
        mu, damp = hp["b1"], hp["dampening"]
        if hp["decoupled"]:
            th = th * (1 - lr * wd)
        else:
            g64 = g64 + wd * th
        if mu != 0:
            m = g64.clone() if step == 1 else dec_m() * mu + (1 - damp) * g64
            d = g64 + mu * m if hp["nesterov"] else m
            mv = [("m", m, quantize_momentum_ref, M_BIT)]
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
        mv = [("m", m, quantize_momentum_ref, M_BIT)]
    return _finish_ref(p, th, mv, new, hp, step, seed, idx_base)


def _finish_ref(p, th, mv, new, hp, step, seed, idx_base):
    """The end of a reference step: quantize the states ``mv`` (name, value, quantizer, the
    hash bits its codes round with) into ``new`` and split the master weights ``th`` into
    (narrow param, correction), stochastically from the step's hash when ``hp["sr"]``."""
    bits, quant, sr, sdt = hp["ecc"], hp["quant"], hp["sr"], hp["scale_dtype"]
    h = None
    if sr:
        idx = torch.arange(p.numel(), dtype=torch.int64, device=p.device) + idx_base
        h = hash_ref(seed, step, idx)
    row = state_row(p, quant)
    for name, val, qf, bit in mv:
        if quant:
            u = None if h is None else code_draw_ref(h, bit)
            new[name], new[name + "s"] = qf(val, sdt, u, row)
        else:
            new[name] = val.to(torch.float32)
    th32 = th.to(torch.float32)
    if bits:
        u = None if h is None else h.to(torch.float32) * (2.0**-32)
        pn, new["c"] = split_ref(th32, p.dtype, bits, u)
    else:
        pn = th32.to(p.dtype)
    return pn.view_as(p), new


# ------------------------------------------------------------------------------- Muon

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (torch.optim.Muon's)


def newton_schulz_ref(x: torch.Tensor, coefficients=NS_COEFFICIENTS, steps=5, eps=1e-7):
    """float64 reference of Muon's orthogonalisation of a matrix ``x`` (..., A, B): on the
    wide orientation (transposed when A > B), ``X = x / max(||x||_F, eps)``, then ``steps``
    times ``X = a X + (b S + c S^2) X`` with ``S = X X^T``. Returns float64, ``x``'s shape."""
    X = x.to(torch.float64)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    a, b, c = coefficients
    for _ in range(steps):
        s = X @ X.mT
        X = a * X + (b * s + c * s @ s) @ X
    return X.mT if tall else X


# Muon's momentum: a rank-MUON_RANK part P R^T (bf16 factors, P rows x k, R cols x k) plus
# the residual in int8 codes, rounded to nearest (docs/design/flashoptim.md, issue #31:
# the quantization error of the whole momentum lay in its top singular directions)
MUON_RANK = 4


def lowrank_ref(P: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """The stored low-rank part of a momentum: ``P R^T`` rounded to bf16 once (what the
    step materializes), as float64."""
    return (P.double() @ R.double().mT).to(torch.bfloat16).double()


def lowrank_factors_ref(u, g, R, mu: float, nesterov: bool):
    """float64 reference of the factors' update from a step's direction ``u`` (as the
    workspace holds it: bf16) and gradient ``g`` (sign applied), the last ``R`` (cols x k):
    one power iteration, ``P = orth(u R)``, then ``R = m^T P`` with the new momentum ``m``
    recovered from ``u`` (Nesterov: ``u = mu m + (1 - mu) g``). Both rounded to bf16.
    ``orth``: Cholesky QR with a ridge of 1e-12 of the trace (a zero ``u R`` gives P = 0
    and keeps the last ``R``)."""
    y = u.double() @ R.double()
    gram = y.mT @ y
    k = gram.shape[-1]
    trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
    chol = torch.linalg.cholesky(gram + (1e-12 * trace + 1e-300) * torch.eye(k).double())
    P = torch.linalg.solve_triangular(chol, y.mT, upper=False).mT
    m = (u.double() - (1 - mu) * g.double()) / mu if nesterov and mu > 0 else u.double()
    P = P.to(torch.bfloat16)
    R_new = (m.mT @ P.double()).to(torch.bfloat16)
    return P, torch.where(trace > 0, R_new, R.to(torch.bfloat16))


def muon_step_ref(p, g, st, hp, step, seed, idx_base=0, orthogonalize=None, factors=None):
    """float64 reference of one FlashMuon step on one matrix (the quantized algorithm).

    ``p`` (rows, ...) is orthogonalised as (rows, numel / rows); ``st``: the stored state
    (``m``/``ms`` residual codes and scales with the factors ``P``, ``R``, or an fp32
    ``m``; correction ``c``); ``hp``: the optimizer's hyperparameters (``FlashMuon._hp``)
    plus ``ratio`` (the shape-dependent lr scale) and ``ns`` (coefficients, steps, eps).
    ``orthogonalize`` (default: the float64 ``newton_schulz_ref`` with ``hp["ns"]``) maps the
    direction ``u`` (float64, the matrix's shape) to ``O``; ``factors`` (default:
    ``lowrank_factors_ref``) maps (u in bf16, g, R) to the new (P, R). Returns (param, new
    state, u, O), u and O flat float64::

        m = P R^T + dequant(codes);  m = m + (1 - mu)(g - m)
        u = m + (1 - mu)(g - m) (Nesterov) or m;  O = NS(u)
        theta = theta (1 - lr wd) - lr ratio O
        (P, R) = factors(u, g, R);  codes = round(m - P R^T)   (to nearest)
    """
    bits, quant = hp["ecc"], hp["quant"]
    shape = (p.shape[0], p.numel() // max(p.shape[0], 1))
    g64 = g.reshape(-1).to(torch.float64)
    if hp.get("maximize"):
        g64 = -g64
    pf = p.reshape(-1)
    th = join_ref(pf, st["c"].reshape(-1), bits) if bits else pf.to(torch.float64)
    mc = st["m"].reshape(-1)
    row = state_row(p, quant)
    low = quant and "P" in st
    m = dequantize_momentum_ref(mc, st["ms"], row) if quant else mc.to(torch.float64)
    if low:
        m = m + lowrank_ref(st["P"], st["R"]).reshape(-1)
    c = 1 - hp["mu"]
    m = m + c * (g64 - m)
    u = m + c * (g64 - m) if hp["nesterov"] else m
    if orthogonalize is None:
        o = newton_schulz_ref(u.view(shape), *hp["ns"])
    else:
        o = orthogonalize(u.view(shape))
    o = o.reshape(-1).to(torch.float64)
    lr, wd = hp["lr"], hp["wd"]
    th = th * (1 - lr * wd) - lr * hp["ratio"] * o
    new = {}
    if low:
        ub = u.to(torch.bfloat16).view(shape)
        fn = factors or (lambda u, g, R: lowrank_factors_ref(u, g, R, hp["mu"], hp["nesterov"]))
        new["P"], new["R"] = fn(ub, g64.view(shape), st["R"])
        resid = m - lowrank_ref(new["P"], new["R"]).reshape(-1)
        new["m"], new["ms"] = quantize_momentum_ref(resid, hp["scale_dtype"], None, row)
        pn, new = _finish_ref(p, th, [], new, hp, step, seed, idx_base)
        return pn, new, u, o
    mv = [("m", m, quantize_momentum_ref, M_BIT)]
    pn, new = _finish_ref(p, th, mv, new, hp, step, seed, idx_base)
    return pn, new, u, o
