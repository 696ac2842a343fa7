"""The Triton kernel of the multiscale backend's block-sparse pass, and its launcher.

One program per row tile of ``TILE`` sorted points walks the column tiles kept for it
(a CSR list) with an online LogSumExp, exactly as the streaming kernels walk every column
tile. Scores ``bias_j - scale |x_i - y_j|^2`` are formed from coordinate differences (a
static loop over the D <= 8 coordinates, no tensor-core dot: neighbouring points keep full
relative precision, and D is small where this backend runs). float32 runs in base 2
(``log2 e`` folded into bias and scale); float64 (the certificate's pass) in base e with
float64 ``exp``. With V (float32 only), the softmax average is accumulated by a
full-precision ``tl.dot`` (V padded to 16 columns).
"""

from __future__ import annotations

import torch

from flashsinkhorn import _config
from flashsinkhorn.reference import LOG2E

try:  # triton is an optional runtime dependency off Linux
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

__all__ = ["softmin_pass_triton"]


if HAS_TRITON:

    @triton.jit
    def _bs_softmin_kernel(
        X,
        Y,
        BIAS,
        PTR,
        NBR,
        LSE,
        V,
        VBAR,
        SCALE,
        DV,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        HAS_V: tl.constexpr,
        BASE2: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        rows = pid.to(tl.int64) * BLOCK + offs
        # scale = s / eps from memory in the pass's dtype (a float argument would be fp32:
        # the float64 certificate's exponents must not be rounded to float32)
        scale = tl.load(SCALE)
        p0 = tl.load(PTR + pid)
        p1 = tl.load(PTR + pid + 1)
        m_i = tl.full((BLOCK,), float("-inf"), dtype=BIAS.dtype.element_ty)
        l_i = tl.zeros((BLOCK,), dtype=BIAS.dtype.element_ty)
        if HAS_V:
            offs_v = tl.arange(0, BLOCK_DV)
            acc = tl.zeros((BLOCK, BLOCK_DV), dtype=tl.float32)
        for p in range(p0, p1):
            cols = tl.load(NBR + p).to(tl.int64) * BLOCK + offs
            d2 = tl.zeros((BLOCK, BLOCK), dtype=BIAS.dtype.element_ty)
            for k in tl.static_range(D):
                xk = tl.load(X + rows * D + k)
                yk = tl.load(Y + cols * D + k)
                diff = xk[:, None] - yk[None, :]
                d2 += diff * diff
            s = tl.load(BIAS + cols)[None, :] - scale * d2
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            if BASE2:
                alpha = tl.exp2(m_i - m_safe)
                e = tl.exp2(s - m_safe[:, None])
            else:
                alpha = tl.exp(m_i - m_safe)
                e = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(e, 1)
            m_i = m_new
            if HAS_V:
                vmask = offs_v[None, :] < DV
                v = tl.load(V + cols[:, None] * DV + offs_v[None, :], mask=vmask, other=0.0)
                acc = acc * alpha[:, None] + tl.dot(e, v, input_precision="ieee")
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        if BASE2:
            lse = (m_fin + tl.log2(l_i)) * 0.6931471805599453
        else:
            lse = m_fin + tl.log(l_i)
        tl.store(LSE + rows, lse)
        if HAS_V:
            out = acc / l_i[:, None]
            tl.store(VBAR + rows[:, None] * DV + offs_v[None, :], out, mask=offs_v[None, :] < DV)


def softmin_pass_triton(xr, yc, ptr, nbr, bias_pad, scale, v_pad=None):
    """:func:`flashsinkhorn._multiscale_pass.softmin_pass` on the Triton kernel: ``xr``
    (npad_rows, D), ``yc`` (npad_cols, D) padded sorted points, the CSR ``ptr``, ``nbr``,
    ``bias_pad`` (float32 or float64: the pass's dtype), ``v_pad`` (float32 passes only).
    Returns ``(lse, vbar or None)`` in the pass's dtype (natural logarithms)."""
    T = _config.MULTISCALE_TILE
    dt = bias_pad.dtype
    if dt not in (torch.float32, torch.float64):
        raise ValueError(f"the multiscale pass computes in float32 or float64; got {dt}")
    if v_pad is not None and dt != torch.float32:
        raise ValueError("the multiscale pass with V runs in float32")
    K, D = xr.shape[0] // T, xr.shape[1]
    base2 = dt == torch.float32
    X = xr.to(dt).contiguous()
    Y = yc.to(dt).contiguous()
    bias = (bias_pad * LOG2E if base2 else bias_pad).contiguous()
    sc = torch.full((1,), float(scale) * (LOG2E if base2 else 1.0), dtype=dt, device=xr.device)
    lse = torch.empty(K * T, dtype=dt, device=xr.device)
    ptr_c = ptr.to(torch.int64).contiguous()
    nbr_c = nbr.to(torch.int32).contiguous()
    if v_pad is None:
        V = vbar = lse  # unused placeholders
        DV, BDV = 1, 16
    else:
        V = v_pad.to(torch.float32).contiguous()
        DV = V.shape[1]
        BDV = max(16, triton.next_power_of_2(DV))
        vbar = torch.empty(K * T, DV, dtype=torch.float32, device=xr.device)
    _bs_softmin_kernel[(K,)](
        X=X,
        Y=Y,
        BIAS=bias,
        PTR=ptr_c,
        NBR=nbr_c,
        LSE=lse,
        V=V,
        VBAR=vbar,
        SCALE=sc,
        DV=DV,
        D=D,
        BLOCK=T,
        BLOCK_DV=BDV,
        HAS_V=v_pad is not None,
        BASE2=base2,
        num_warps=4,
    )
    return lse, (None if v_pad is None else vbar)
