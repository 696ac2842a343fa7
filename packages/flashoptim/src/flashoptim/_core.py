"""The Triton step kernels of flashoptim (the float64 reference is ``reference.py``, the CPU
path ``_cpu.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._cpu import _narrow_q, _to_narrow_t, cpu_step, f32_c  # noqa: F401
from .reference import (  # noqa: F401
    ADAM,
    ECC_BITS as _ECC_BITS,
    ECC_DTYPE as _ECC_DTYPE,
    GOLDEN as _GOLDEN,
    GROUP,
    LION,
    M32 as _M32,
    SGD,
    dequantize_momentum_ref,
    dequantize_variance_ref,
    join_ref,
    mix32_ref as _mix32_t,
    pad_groups as _pad,
    quantize_momentum_ref,
    quantize_variance_ref,
    split_ref,
    step_ref,
    ulp_ref as _ulp_ref,
    uniform_ref,
)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)



# ----------------------------------------------------------------------- Triton kernels
#
# Two step kernels (v1: block table, v2: unit table) share the arithmetic of one tile
# (``_step_tile``) and differ only in their indexing. Triton inlines the helpers, so each
# kernel compiles as if the tile were written out in it.


@triton.jit
def _pow2(k):
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _ceil_scale(amax, SCALE_F32: tl.constexpr):
    if SCALE_F32:
        return amax
    b = amax.to(tl.uint32, bitcast=True)
    return ((b + 0xFFFF) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _correction_exp(p, P_DTYPE: tl.constexpr, ECC: tl.constexpr):
    """k with ``q = 2**k`` the value of one correction code at the narrow values ``p``: the
    spacing of p's format (from its exponent field) over 2**ECC; bf16 keeps q a normal fp32."""
    pbits = p.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    if P_DTYPE == 1:
        k = tl.maximum(tl.maximum((pbits >> 7) & 0xFF, 1) - 134 - ECC, -126)
    else:
        k = tl.maximum((pbits >> 10) & 0x1F, 1) - 25 - ECC
    return k


@triton.jit
def _array_ptr(base, row, COL: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer to one array of a tensor: ``base`` plus the element offset that column COL of
    the tensor's table row holds (ALIGNED: a multiple of 16, so accesses can vectorize)."""
    o = tl.load(row + COL)
    if ALIGNED:
        o = tl.multiple_of(o, 16)
    return base + o


@triton.jit
def _tensor_arrays(
    row,
    p_base,
    g_base,
    c_base,
    m_base,
    ms_base,
    v_base,
    vs_base,
    KIND: tl.constexpr,
    ECC: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_MOM: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """Pointers to the arrays of the tensor whose table row is ``row``: parameter, gradient,
    correction, momentum codes and scales, variance codes and scales. An array the mode does
    not use (and so the table does not locate) stays at its base pointer."""
    pp = _array_ptr(p_base, row, 0, ALIGNED)
    gp = _array_ptr(g_base, row, 1, ALIGNED)
    cp, mp, msp, vp, vsp = c_base, m_base, ms_base, v_base, vs_base
    if ECC > 0:
        cp = _array_ptr(c_base, row, 2, ALIGNED)
    if HAS_MOM:
        mp = _array_ptr(m_base, row, 3, ALIGNED)
        if QUANT:
            msp = _array_ptr(ms_base, row, 4, False)
    if KIND == 0:
        vp = _array_ptr(v_base, row, 5, ALIGNED)
        if QUANT:
            vsp = _array_ptr(vs_base, row, 6, False)
    return pp, gp, cp, mp, msp, vp, vsp


@triton.jit
def _rounding_stream(row, step_mix, ECC: tl.constexpr, SR: tl.constexpr):
    """(key, index base) of the stochastic rounding draws of the tensor whose table row is
    ``row``: the key mixes its seed with the step, the base is its global index of element 0
    (mod 2**32). Both stay 0 where nothing is rounded stochastically."""
    key = 0
    ib = 0
    if ECC > 0:
        if SR:
            key = _mix32(tl.load(row + 8).to(tl.uint32) + step_mix.to(tl.uint32))
            ib = tl.load(row + 9).to(tl.uint32)  # idx base mod 2**32
    return key, ib


@triton.jit
def _step_tile(
    pp,  # pointers to the tensor's arrays (_tensor_arrays)
    gp,
    cp,
    mp,
    msp,
    vp,
    vsp,
    off,  # element offsets within the tensor, a 2-D tile [groups, 32]
    mask,
    goff,  # group offsets within the tensor [groups]
    gmask,
    key,  # stochastic rounding stream (_rounding_stream)
    ib,
    lr,
    b1,
    one_m_b1,
    b2,
    one_m_b2,
    eps,
    wd,
    decay_mult,
    step_size,
    inv_sqrt_bc2,
    one_m_damp,
    first,
    KIND: tl.constexpr,
    ECC: tl.constexpr,
    QUANT: tl.constexpr,
    SR: tl.constexpr,
    P_DTYPE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_MOM: tl.constexpr,
    SCALE_F32: tl.constexpr,
):
    """One tile of the step, in place: decode the master weight and the states, update,
    requantize the states, split the master weight. The kernels bring the indexing."""
    p = tl.load(pp + off, mask=mask, other=0.0)
    g = tl.load(gp + off, mask=mask, other=0.0).to(tl.float32)
    if ECC > 0:
        c = tl.load(cp + off, mask=mask, other=0)
        k = _correction_exp(p, P_DTYPE, ECC)
        th = p.to(tl.float32) + c.to(tl.float32) * _pow2(k)
    else:
        th = p.to(tl.float32)

    if HAS_MOM:
        if QUANT:
            mc = tl.load(mp + off, mask=mask, other=0).to(tl.float32)
            msc = tl.load(msp + goff, mask=gmask, other=0.0).to(tl.float32)
            y = mc * 0.007874015718698502  # fp32(1/127)
            x = y / (2.0 - tl.abs(y))
            m = x * msc[:, None]
        else:
            m = tl.load(mp + off, mask=mask, other=0.0)

    if KIND == 0:  # Adam / AdamW
        if QUANT:
            vc = tl.load(vp + off, mask=mask, other=0).to(tl.float32)
            vsc = tl.load(vsp + goff, mask=gmask, other=0.0).to(tl.float32)
            sv = vc * vsc[:, None] * 0.003921568859368563  # fp32(1/255)
            v = sv * sv
        else:
            v = tl.load(vp + off, mask=mask, other=0.0)
        if DECOUPLED:
            th = th * decay_mult
        else:
            g = g + wd * th
        m = m + (g - m) * one_m_b1
        v = v * b2 + one_m_b2 * (g * g)
        svg = tl.sqrt(v)  # once: the denominator and the variance code
        th = th - step_size * (m / (svg * inv_sqrt_bc2 + eps))
    elif KIND == 1:  # SGD
        if DECOUPLED:
            th = th * decay_mult
        else:
            g = g + wd * th
        if HAS_MOM:
            m = tl.where(first != 0, g, m * b1 + one_m_damp * g)
            if NESTEROV:
                d = g + b1 * m
            else:
                d = m
        else:
            d = g
        th = th - lr * d
    else:  # Lion
        th = th * decay_mult
        cc = m * b1 + one_m_b1 * g
        sgn = tl.where(cc > 0, 1.0, tl.where(cc < 0, -1.0, 0.0))
        th = th - lr * sgn
        m = m * b2 + one_m_b2 * g

    # requantize the states
    if HAS_MOM:
        if QUANT:
            ms_new = _ceil_scale(tl.max(tl.abs(m), axis=1), SCALE_F32)
            inv = tl.where(ms_new > 0, 1.0 / tl.where(ms_new > 0, ms_new, 1.0), 0.0)
            x = m * inv[:, None]
            phi = 2.0 * x / (1.0 + tl.abs(x))
            code = tl.minimum(tl.maximum(tl.floor(phi * 127.0 + 0.5), -127.0), 127.0)
            tl.store(mp + off, code.to(tl.int8), mask=mask)
            tl.store(msp + goff, ms_new.to(msp.dtype.element_ty), mask=gmask)
        else:
            tl.store(mp + off, m, mask=mask)
    if KIND == 0:
        if QUANT:
            vs_new = _ceil_scale(tl.max(svg, axis=1), SCALE_F32)
            inv = tl.where(vs_new > 0, 255.0 / tl.where(vs_new > 0, vs_new, 1.0), 0.0)
            code = tl.minimum(tl.maximum(tl.floor(svg * inv[:, None] + 0.5), 0.0), 255.0)
            code = tl.where(svg > 0, tl.maximum(code, 1.0), code)
            tl.store(vp + off, code.to(tl.uint8), mask=mask)
            tl.store(vsp + goff, vs_new.to(vsp.dtype.element_ty), mask=gmask)
        else:
            tl.store(vp + off, v, mask=mask)

    # split the master weight
    if P_DTYPE == 0:
        tl.store(pp + off, th, mask=mask)
    else:
        if P_DTYPE == 1:
            b = th.to(tl.uint32, bitcast=True)
            nb = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16)
            pn = nb.to(tl.bfloat16, bitcast=True)
        else:
            pn = th.to(tl.float16)
        tl.store(pp + off, pn, mask=mask)
        if ECC > 0:
            k = _correction_exp(pn, P_DTYPE, ECC)
            r = (th - pn.to(tl.float32)) * _pow2(-k)
            if SR:
                h = _mix32((off.to(tl.uint32) + ib) ^ key)
                u = (h >> 8).to(tl.float32) * 5.960464477539063e-08  # 2**-24
                code = tl.floor(r + u)
            else:
                code = tl.floor(r + 0.5)
            LIM: tl.constexpr = 1 << (ECC - 1)
            code = tl.minimum(tl.maximum(code, -LIM), LIM - 1)
            tl.store(cp + off, code.to(cp.dtype.element_ty), mask=mask)


@triton.jit
def _device_scalars(sp):
    """The step's run-time scalars read from a device buffer (capturable mode): int32 [14]
    holding lr, b1, 1-b1, b2, 1-b2, eps, wd, decay_mult, step_size, inv_sqrt_bc2, 1-damp as
    fp32 bit patterns, then first, step_mix (uint32 bits) and the skip flag."""
    lr = tl.load(sp + 0).to(tl.float32, bitcast=True)
    b1 = tl.load(sp + 1).to(tl.float32, bitcast=True)
    one_m_b1 = tl.load(sp + 2).to(tl.float32, bitcast=True)
    b2 = tl.load(sp + 3).to(tl.float32, bitcast=True)
    one_m_b2 = tl.load(sp + 4).to(tl.float32, bitcast=True)
    eps = tl.load(sp + 5).to(tl.float32, bitcast=True)
    wd = tl.load(sp + 6).to(tl.float32, bitcast=True)
    decay_mult = tl.load(sp + 7).to(tl.float32, bitcast=True)
    step_size = tl.load(sp + 8).to(tl.float32, bitcast=True)
    inv_sqrt_bc2 = tl.load(sp + 9).to(tl.float32, bitcast=True)
    one_m_damp = tl.load(sp + 10).to(tl.float32, bitcast=True)
    first = tl.load(sp + 11)
    step_mix = tl.load(sp + 12).to(tl.uint32, bitcast=True)
    return (
        lr,
        b1,
        one_m_b1,
        b2,
        one_m_b2,
        eps,
        wd,
        decay_mult,
        step_size,
        inv_sqrt_bc2,
        one_m_damp,
        first,
        step_mix,
    )


@triton.jit
def _nonfinite(gp, off, mask):
    """int32 tile: 1 where the gradient is inf or NaN, else 0."""
    g = tl.load(gp + off, mask=mask, other=0.0).to(tl.float32)
    return ((g - g) != 0.0).to(tl.int32)  # inf - inf and NaN - NaN are NaN


# ---------------------------------------------------------- kernel v1 (block table)


@triton.jit
def _v1_block(blocks, tab, N16: tl.constexpr, BLOCK: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """v1 indexing of this program's block: (table row of its tensor, first element, the
    tensor's numel, the block's element offsets as a 2-D tile [groups, 32], int64)."""
    pid = tl.program_id(0)
    t = tl.load(blocks + 2 * pid)
    start = tl.load(blocks + 2 * pid + 1).to(tl.int64)
    row = tab + t.to(tl.int64) * 10
    n = tl.load(row + 7)
    if N16:  # every numel in the bucket is a multiple of 16: masks stay vectorizable
        n = tl.multiple_of(n, 16)
    # 2-D tiles [groups, 32]: group reductions along axis 1, no reshapes (layout shuffles)
    NG: tl.constexpr = BLOCK // GROUP_SIZE
    off = start + tl.arange(0, NG)[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    return row, start, n, off


@triton.jit(do_not_specialize=["first", "step_mix"])
def _step_kernel(
    blocks,  # int32 [nblocks, 2]: tensor index, first element of the block
    tab,  # int64 [T, 10]: offsets of p, g, c, m, ms, v, vs (elements), numel, seed, idx base
    p_base,
    g_base,
    c_base,
    m_base,
    ms_base,
    v_base,
    vs_base,
    lr,
    b1,
    one_m_b1,
    b2,
    one_m_b2,
    eps,
    wd,
    decay_mult,
    step_size,
    inv_sqrt_bc2,
    one_m_damp,
    first,
    step_mix,  # (step * 0x9E3779B9) mod 2**32, the step's key for stochastic rounding
    skip_flag,  # int32 [1]: nonzero -> do nothing (non-finite gradients found)
    KIND: tl.constexpr,
    ECC: tl.constexpr,  # 0, 8 or 16 correction bits
    QUANT: tl.constexpr,
    SR: tl.constexpr,
    P_DTYPE: tl.constexpr,  # 0 fp32, 1 bf16, 2 fp16
    DECOUPLED: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_MOM: tl.constexpr,
    SCALE_F32: tl.constexpr,
    CHECK_SKIP: tl.constexpr,
    ALIGNED: tl.constexpr,
    N16: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SCALARS_ON_DEVICE: tl.constexpr,  # capturable: ``lr`` is a pointer to _device_scalars
):
    if CHECK_SKIP:
        if tl.load(skip_flag) != 0:
            return
    if SCALARS_ON_DEVICE:
        sp = lr
        if tl.load(sp + 13) != 0:
            return
        (
            lr,
            b1,
            one_m_b1,
            b2,
            one_m_b2,
            eps,
            wd,
            decay_mult,
            step_size,
            inv_sqrt_bc2,
            one_m_damp,
            first,
            step_mix,
        ) = _device_scalars(sp)
    row, start, n, off = _v1_block(blocks, tab, N16, BLOCK, GROUP_SIZE)
    mask = off < n
    goff = start // GROUP_SIZE + tl.arange(0, BLOCK // GROUP_SIZE)
    gmask = goff < (n + GROUP_SIZE - 1) // GROUP_SIZE
    pp, gp, cp, mp, msp, vp, vsp = _tensor_arrays(
        row,
        p_base,
        g_base,
        c_base,
        m_base,
        ms_base,
        v_base,
        vs_base,
        KIND,
        ECC,
        QUANT,
        HAS_MOM,
        ALIGNED,
    )
    key, ib = _rounding_stream(row, step_mix, ECC, SR)
    _step_tile(
        pp,
        gp,
        cp,
        mp,
        msp,
        vp,
        vsp,
        off,
        mask,
        goff,
        gmask,
        key,
        ib,
        lr,
        b1,
        one_m_b1,
        b2,
        one_m_b2,
        eps,
        wd,
        decay_mult,
        step_size,
        inv_sqrt_bc2,
        one_m_damp,
        first,
        KIND,
        ECC,
        QUANT,
        SR,
        P_DTYPE,
        DECOUPLED,
        NESTEROV,
        HAS_MOM,
        SCALE_F32,
    )


@triton.jit
def _nonfinite_kernel(
    blocks,
    tab,
    g_base,
    flag,  # int32 [1], set to 1 if any gradient element is inf or NaN
    ALIGNED: tl.constexpr,
    N16: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    """Pre-pass over the gradients of a bucket (same block table as the step kernel)."""
    row, start, n, off = _v1_block(blocks, tab, N16, BLOCK, GROUP_SIZE)
    bad = _nonfinite(_array_ptr(g_base, row, 1, ALIGNED), off, off < n)
    nbad = tl.sum(tl.sum(bad, axis=1), axis=0)
    if nbad > 0:
        tl.atomic_max(flag, 1)


# ------------------------------------------------------- kernel v2 (bandwidth layout)
#
# Same arithmetic, codes, scales, rounding and RNG stream as ``_step_kernel``; different
# indexing. The v1 kernel reads each block's first element from a table, so Triton cannot
# prove any alignment of ``off``: every access is scalar with its own 64-bit address (and
# int64 index math), which costs registers and instructions on an instruction-bound step.
# v2: a table of fixed UNITs (tensor, local unit index); ``start = unit * UNIT + s * BLOCK``
# is a provable multiple of BLOCK, offsets are int32 per tensor (base pointers per tensor
# are scalars), so loads and stores vectorize (16 bytes) and masks keep the N16 constancy;
# a persistent grid (a few programs per SM) loops over the units; sqrt(v) once.

V2_UNIT = 2048  # elements per table entry; every BLOCK of v2 divides it
V2_DEFAULT = dict(BLOCK=1024, WAVES=8)  # the one config without autotuning
V2_DEFAULT_WARPS = 4


@triton.jit
def _v2_unit(units, u, tab, N16: tl.constexpr):
    """v2 indexing of unit ``u``: (table row of its tensor, unit index within the tensor,
    the tensor's numel as int32)."""
    t = tl.load(units + 2 * u)
    lu = tl.load(units + 2 * u + 1)
    row = tab + t * 10
    n = tl.load(row + 7).to(tl.int32)
    if N16:
        n = tl.multiple_of(n, 16)
    return row, lu, n


@triton.jit(do_not_specialize=["nunits", "first", "step_mix"])
def _step_kernel_v2(
    units,  # int32 [nunits, 2]: tensor index, unit index within the tensor
    nunits,
    tab,  # int64 [T, 10]: as for _step_kernel
    p_base,
    g_base,
    c_base,
    m_base,
    ms_base,
    v_base,
    vs_base,
    lr,
    b1,
    one_m_b1,
    b2,
    one_m_b2,
    eps,
    wd,
    decay_mult,
    step_size,
    inv_sqrt_bc2,
    one_m_damp,
    first,
    step_mix,
    KIND: tl.constexpr,
    ECC: tl.constexpr,
    QUANT: tl.constexpr,
    SR: tl.constexpr,
    P_DTYPE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_MOM: tl.constexpr,
    SCALE_F32: tl.constexpr,
    ALIGNED: tl.constexpr,
    N16: tl.constexpr,
    UNIT: tl.constexpr,
    BLOCK: tl.constexpr,
    WAVES: tl.constexpr,  # programs per SM (used by the grid only; 0: one unit per program)
    GROUP_SIZE: tl.constexpr,
    SCALARS_ON_DEVICE: tl.constexpr,  # capturable: ``lr`` is a pointer to _device_scalars
):
    if SCALARS_ON_DEVICE:
        sp = lr
        if tl.load(sp + 13) != 0:  # non-finite gradients found on device: skip the step
            return
        (
            lr,
            b1,
            one_m_b1,
            b2,
            one_m_b2,
            eps,
            wd,
            decay_mult,
            step_size,
            inv_sqrt_bc2,
            one_m_damp,
            first,
            step_mix,
        ) = _device_scalars(sp)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    NG: tl.constexpr = BLOCK // GROUP_SIZE
    rows = tl.arange(0, NG)
    tile = rows[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # int32 [NG, 32]
    for u in range(pid, nunits, nprog):
        row, lu, n = _v2_unit(units, u, tab, N16)
        ng = (n + GROUP_SIZE - 1) // GROUP_SIZE
        pp, gp, cp, mp, msp, vp, vsp = _tensor_arrays(
            row,
            p_base,
            g_base,
            c_base,
            m_base,
            ms_base,
            v_base,
            vs_base,
            KIND,
            ECC,
            QUANT,
            HAS_MOM,
            ALIGNED,
        )
        key, ib = _rounding_stream(row, step_mix, ECC, SR)
        for s in range(0, UNIT // BLOCK):  # a loop, not unrolled: one copy of the body
            start = lu * UNIT + s * BLOCK  # int32, a provable multiple of BLOCK
            if start < n:
                off = start + tile
                mask = off < n
                goff = start // GROUP_SIZE + rows
                gmask = goff < ng
                _step_tile(
                    pp,
                    gp,
                    cp,
                    mp,
                    msp,
                    vp,
                    vsp,
                    off,
                    mask,
                    goff,
                    gmask,
                    key,
                    ib,
                    lr,
                    b1,
                    one_m_b1,
                    b2,
                    one_m_b2,
                    eps,
                    wd,
                    decay_mult,
                    step_size,
                    inv_sqrt_bc2,
                    one_m_damp,
                    first,
                    KIND,
                    ECC,
                    QUANT,
                    SR,
                    P_DTYPE,
                    DECOUPLED,
                    NESTEROV,
                    HAS_MOM,
                    SCALE_F32,
                )


@triton.jit(do_not_specialize=["nunits"])
def _nonfinite_kernel_v2(
    units,
    nunits,
    tab,
    g_base,
    flag,
    ALIGNED: tl.constexpr,
    N16: tl.constexpr,
    UNIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Finiteness pre-pass over a bucket's gradients with v2's unit table (one unit each)."""
    row, lu, n = _v2_unit(units, tl.program_id(0), tab, N16)
    gp = _array_ptr(g_base, row, 1, ALIGNED)
    nbad = 0
    for s in tl.static_range(UNIT // BLOCK):
        off = lu * UNIT + s * BLOCK + tl.arange(0, BLOCK)
        nbad += tl.sum(_nonfinite(gp, off, off < n), axis=0)
    if nbad > 0:
        tl.atomic_max(flag, 1)


# ------------------------------------------------- v2 autotuning (CUDA only, opt-out)

_TUNE: dict = {"tensors": (), "snap": None}


def _tune_pre_hook(kwargs, reset_only=False):
    """Autotuning runs the in-place kernel many times on the live bucket. Triton's
    ``restore_value`` would clone only the *base* tensors named as arguments, but the kernel
    writes every tensor of the bucket through the offset table; so the first benchmark run
    snapshots all of them (``_TUNE['tensors']``, set by the launcher) and the call that
    follows the benchmarks (``reset_only=True``) restores them, before the real launch."""
    if reset_only:
        snap = _TUNE["snap"]
        if snap is not None:
            for t, s in zip(_TUNE["tensors"], snap, strict=True):
                t.copy_(s)
        _TUNE["snap"] = None
        return
    if _TUNE["snap"] is None:
        _TUNE["snap"] = [t.clone() for t in _TUNE["tensors"]]


def _tune_post_hook(kwargs, exception=None):
    return None


def _v2_configs():
    cfg = triton.Config
    return [
        cfg(dict(BLOCK=1024, WAVES=8), num_warps=4, num_stages=1),
        cfg(dict(BLOCK=1024, WAVES=0), num_warps=4, num_stages=1),
        cfg(dict(BLOCK=2048, WAVES=4), num_warps=8, num_stages=1),
        cfg(dict(BLOCK=512, WAVES=16), num_warps=4, num_stages=1),
        cfg(dict(BLOCK=1024, WAVES=8), num_warps=4, num_stages=3),
    ]


def _quick_bench(fn, quantiles):
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_TUNE_KEY = ["nunits", "KIND", "ECC", "QUANT", "SR", "P_DTYPE", "HAS_MOM", "SCALE_F32", "N16"]
_step_kernel_v2_tuned = triton.autotune(
    configs=_v2_configs(),
    key=_TUNE_KEY,
    pre_hook=_tune_pre_hook,
    post_hook=_tune_post_hook,
    do_bench=_quick_bench,
)(_step_kernel_v2)


# ------------------------------------------- kernel v3 (v2 indexing, cheaper element math)
#
# Same unit table, persistent grid and autotuning as v2; the tile ``_step_tile_v3`` cuts
# the instructions per element of the instruction-bound step (measured offline on sm_90
# SASS, ``scripts/sass_count.py``):
#
# * divisions: Triton's fp32 ``/`` is ``div.full.f32`` (range checks, 2 predicated scalings,
#   MUFU.RCP, multiply: ~10 instructions); v3 multiplies by ``rcp.approx`` (one MUFU.RCP).
#   All per-element denominators lie in [1, 2] (``2 - |y|``, ``1 + |x|``) or are >= eps.
# * floor + clamp + float->int: ``floor(t)`` of ``|t| < 2**22`` is the low bits of
#   ``t + 1.5 * 2**23`` added with rounding toward minus infinity (``add.rm.f32``: one
#   full-rate FADD); the code's two's complement byte is the low byte of that sum's bits, so
#   FRND.FLOOR and F2I (the 16/clk conversion pipe) go away; the clamp moves before the
#   floor (monotone: identical codes).
# * codes -> fp32 through int32 (uint8: I2FP; LLVM narrows the int8 ones back to I2F.S16).
# * variance code ``>= 1`` for nonzero v folded into the clamp (``min(svg, 2**-100) * 2**100``).
# * bf16 rounding by ``cvt.rn.bf16.f32``; q = 2**k of the correction from the fp32 exponent bits.
#
# GPU only (``ASM=True``): inline PTX. The interpreter cannot run inline asm, so ``ASM=False``
# computes the same values with ``tl.floor`` and exact division: the interpreter results are
# bitwise those of v2 (and of ``cpu_step``). On the GPU, ``rcp.approx`` + multiply differs
# from ``div.full`` by an ulp at times: the same contract as v2 vs the CPU path (codes +-1 at
# ties, GPU tests). ``CHECK_SKIP``: the kernel returns at once when the device flag the
# finiteness pre-pass wrote is set, so the host syncs once *after* the step (no bubble
# between the pre-pass and the step; a skipped step is undone on the host).


@triton.jit
def _rcp(d, ASM: tl.constexpr):
    """1/d: rcp.approx.ftz.f32 on the GPU (d normal, not tiny), exact under the interpreter."""
    if ASM:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return 1.0 / d


@triton.jit
def _div(n, d, ASM: tl.constexpr):
    """n / d with d in [1, 2] (or bounded away from 0): n * rcp(d) on the GPU."""
    if ASM:
        return n * _rcp(d, ASM)
    else:
        return n / d


@triton.jit
def _div_safe(n, d, ASM: tl.constexpr):
    """n / d for any positive d incl. subnormal (per-group scales): n * rcp.approx.f32(d)
    (no ftz) on the GPU, exact under the interpreter."""
    if ASM:
        r = tl.inline_asm_elementwise(
            "rcp.approx.f32 $0, $1;", "=f,f", [d], dtype=tl.float32, is_pure=True, pack=1
        )
        return n * r
    else:
        return n / d


@triton.jit
def _floor_bits(t, ASM: tl.constexpr):
    """int32 bits of ``floor(t) + 1.5 * 2**23`` for |t| < 2**22: their low 8 (16) bits are
    floor(t) as int8 (int16) two's complement, or as uint8 for floor(t) in [0, 255]."""
    if ASM:
        f = tl.inline_asm_elementwise(
            "add.rm.f32 $0, $1, 0f4B400000;", "=f,f", [t], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        f = tl.floor(t) + 12582912.0
    return f.to(tl.int32, bitcast=True)


@triton.jit
def _q_bf16(pf, ECC: tl.constexpr):
    """fp32 bits of q = 2**k, the value of one correction code at bf16 values ``pf`` (given
    as fp32): ``_pow2(_correction_exp(p, 1, ECC))`` with three integer ops on the exponent
    field (k + 127 = max(E - 7 - ECC, 1) for the biased exponent E, 0 included)."""
    e = pf.to(tl.int32, bitcast=True) & 0x7F800000
    return tl.maximum(e - ((7 + ECC) << 23), 1 << 23)


@triton.jit
def _store_scales(ptr, s, mask, SCALE_F32: tl.constexpr):
    """Store the group scales ``s`` ([groups], the layout ``tl.max`` left them in) where
    ``mask``: one predicated ``st.global`` per thread from registers (the threads of a group
    hold the same value and write the same address), instead of ``tl.store``'s conversion to
    a blocked layout through shared memory (STS, 2 BAR.SYNC, LDS per scale and tile). bf16
    scales are ceil-rounded, so their fp32 bits' high half is the bf16 value."""
    b = s.to(tl.uint32, bitcast=True)
    if SCALE_F32:
        st: tl.constexpr = "st.global.b32"
    else:
        st: tl.constexpr = "st.global.b16"
        b = b >> 16
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p " + st + " [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r",
        [ptr.to(tl.int64), b, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _bf16_f32(x, ASM: tl.constexpr):
    """bf16 -> fp32; on the GPU two integer ops per register of two (SHL of the low half, AND
    of the high one), where ptxas unpacks a high half with PRMT and a shift."""
    if ASM:
        y = tl.inline_asm_elementwise(
            "{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }",
            "=r,=r,r",
            [x],
            dtype=tl.uint32,
            is_pure=True,
            pack=2,
        )
        return y.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


# bf16 pairs (two 16-bit halves of one register): q = 2**k of the correction code at each
# bf16 value (``_q_bf16``) or 1/q, as fp32 bits, in 3 SIMD16 ops per pair plus the unpack;
# the 16-bit constants per ECC: (K1, K2) = ((8 + ECC) << 7, (7 + ECC) << 7):
#   q:   max(h & 0x7F80, K1) - K2             (>= 0x80, no borrow between the halves)
#   1/q: min((0x7F00 + K2) - (h & 0x7F80), 0x7F00 + K2 - K1)  (exponents of q, 1/q sum to 254)


@triton.jit
def _q_bf16x2(p, ECC: tl.constexpr, INV: tl.constexpr):
    """fp32 q (INV: 1/q) of the correction code at the bf16 values ``p`` (GPU only): the
    same bits as ``_q_bf16`` (INV: ``0x7F000000 - _q_bf16``) on the register of two."""
    if ECC == 8:
        if INV:
            op: tl.constexpr = "sub.u32 e, 0x86808680, e; mov.b32 k, 0x7E807E80; min.u16x2 e, e, k;"
        else:
            op: tl.constexpr = "mov.b32 k, 0x08000800; max.u16x2 e, e, k; sub.u32 e, e, 0x07800780;"
    else:
        if INV:
            op: tl.constexpr = "sub.u32 e, 0x8A808A80, e; mov.b32 k, 0x7E807E80; min.u16x2 e, e, k;"
        else:
            op: tl.constexpr = "mov.b32 k, 0x0C000C00; max.u16x2 e, e, k; sub.u32 e, e, 0x0B800B80;"
    y = tl.inline_asm_elementwise(
        "{ .reg .b32 e, k; and.b32 e, $2, 0x7F807F80; "
        + op
        + " shl.b32 $0, e, 16; and.b32 $1, e, 0xFFFF0000; }",
        "=r,=r,r",
        [p],
        dtype=tl.uint32,
        is_pure=True,
        pack=2,
    )
    return y.to(tl.float32, bitcast=True)


@triton.jit
def _draw_lean(off, ib, key, LEAN: tl.constexpr):
    """v3's rounding draw ``(_mix32((off + ib) ^ key) >> 8) * 2**-24``, bit for bit, in fewer
    integer ops. With x = a ^ key, a = off + ib: x ^ (x >> 16) = hi ^ (hi >> 16) ^ (a & 7)
    for hi = (a & ~7) ^ key (the low 3 bits of a do not reach bit 16). LEAN 2 (the launcher
    has checked ib % 8 == 0 for every tensor of the bucket): a thread's 8 consecutive
    elements share hi, so the first round is one XOR per element. Last round: (h >> 8) as
    a float is (h & ~0xFF) * 2**-8 exactly (at most 24 significant bits): one LOP3 fewer."""
    if LEAN == 2:
        a = off.to(tl.uint32) + (ib & 0xFFFFFFF8)
        hi = (a & 0xFFFFFFF8) ^ key
        x = (hi ^ (hi >> 16)) ^ (a & 7)
    else:
        x = (off.to(tl.uint32) + ib) ^ key
        x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    h = (x ^ (x >> 16)) & 0xFFFFFF00
    return h.to(tl.float32) * 2.3283064365386963e-10  # 2**-32


# v4 lean parts (``PARTS`` bits; FLASHOPTIM_LEAN_PARTS, read at launch): GPU-only inline PTX
LEAN_ST = 1  # group scales stored from registers (predicated st.global.b16/.b32)
LEAN_UNPACK = 2  # bf16 -> fp32 of p, g and the new weight by SHL / AND on the register pair
LEAN_CVT = 4  # the new weight rounded by cvt.rn.bf16x2.f32 per pair
LEAN_Q2 = 8  # q and 1/q of the correction on bf16 pairs (SIMD16 max/min)
LEAN_PIN = 16  # explicit fma for every two-product sum (also at LEAN 0; changes LEAN 0's bits)
LEAN_ALL = 31


@triton.jit
def _tile_loads_v3(
    pp,
    gp,
    cp,
    mp,
    msp,
    vp,
    vsp,
    off,
    mask,
    goff,
    gmask,
    KIND: tl.constexpr,
    ECC: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_MOM: tl.constexpr,
):
    """The loads of one tile, raw (as stored): parameter, gradient, correction, momentum
    codes or values and scales, variance codes or values and scales. An array the mode does
    not use comes back as a copy of ``p`` (never read after)."""
    p = tl.load(pp + off, mask=mask, other=0.0)
    g = tl.load(gp + off, mask=mask, other=0.0)
    c = p
    mc = p
    msc = p
    vc = p
    vsc = p
    if ECC > 0:
        c = tl.load(cp + off, mask=mask, other=0)
    if HAS_MOM:
        if QUANT:
            mc = tl.load(mp + off, mask=mask, other=0)
            msc = tl.load(msp + goff, mask=gmask, other=0.0)
        else:
            mc = tl.load(mp + off, mask=mask, other=0.0)
    if KIND == 0:
        if QUANT:
            vc = tl.load(vp + off, mask=mask, other=0)
            vsc = tl.load(vsp + goff, mask=gmask, other=0.0)
        else:
            vc = tl.load(vp + off, mask=mask, other=0.0)
    return p, g, c, mc, msc, vc, vsc


@triton.jit
def _tile_update_v3(
    p,
    g_raw,
    c_raw,
    mc_raw,
    msc_raw,
    vc_raw,
    vsc_raw,
    pp,
    gp,
    cp,
    mp,
    msp,
    vp,
    vsp,
    off,
    mask,
    goff,
    gmask,
    key,
    ib,
    lr,
    b1,
    one_m_b1,
    b2,
    one_m_b2,
    eps,
    wd,
    decay_mult,
    step_size,
    inv_sqrt_bc2,
    one_m_damp,
    first,
    KIND: tl.constexpr,
    ECC: tl.constexpr,
    QUANT: tl.constexpr,
    SR: tl.constexpr,
    P_DTYPE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_MOM: tl.constexpr,
    SCALE_F32: tl.constexpr,
    ASM: tl.constexpr,
    LEAN: tl.constexpr = 0,
    PARTS: tl.constexpr = 0,
):
    """The rest of ``_step_tile_v3`` after its loads (``_tile_loads_v3``): decode, update,
    requantize and store, split the master weight and store.

    ``PARTS`` (GPU only, ``ASM``): which inline-PTX parts the lean math uses (``LEAN_ST`` scale
    stores from registers, ``LEAN_UNPACK`` bf16 -> fp32 by shift/mask, ``LEAN_CVT``
    ``cvt.rn.bf16x2``, ``LEAN_Q2`` SIMD16 q and 1/q) and ``LEAN_PIN``: every sum of two
    single-use products written as one explicit ``fma`` (at LEAN 0 too), so that LLVM's
    operand order (which differs between the old and the lean code, and between the 8
    elements of a thread) no longer picks which product is fused."""
    ST: tl.constexpr = ASM and LEAN > 0 and (PARTS & 1) != 0
    UNPACK: tl.constexpr = ASM and LEAN > 0 and (PARTS & 2) != 0
    CVT: tl.constexpr = ASM and LEAN > 0 and (PARTS & 4) != 0
    Q2: tl.constexpr = ASM and LEAN > 0 and (PARTS & 8) != 0
    PIN: tl.constexpr = ASM and (PARTS & 16) != 0
    if UNPACK and g_raw.dtype == tl.bfloat16:
        g = _bf16_f32(g_raw, ASM)
    else:
        g = g_raw.to(tl.float32)
    if ECC > 0:
        c = c_raw.to(tl.int32).to(tl.float32)
        if P_DTYPE == 1:
            if UNPACK:
                pf = _bf16_f32(p, ASM)
            else:
                pf = p.to(tl.float32)
            if Q2:
                q = _q_bf16x2(p, ECC, False)
            else:
                q = _q_bf16(pf, ECC).to(tl.float32, bitcast=True)
            th = pf + c * q
        else:
            th = p.to(tl.float32) + c * _pow2(_correction_exp(p, P_DTYPE, ECC))
    else:
        th = p.to(tl.float32)

    if HAS_MOM:
        if QUANT:
            mc = mc_raw.to(tl.int32).to(tl.float32)
            msc = msc_raw.to(tl.float32)
            y = mc * 0.007874015718698502  # fp32(1/127)
            x = _div(y, 2.0 - tl.abs(y), ASM)
            m = x * msc[:, None]
        else:
            m = mc_raw

    if KIND == 0:  # Adam / AdamW
        if QUANT:
            vc = vc_raw.to(tl.int32).to(tl.float32)
            vsc = vsc_raw.to(tl.float32)
            sv = vc * vsc[:, None] * 0.003921568859368563  # fp32(1/255)
            v = sv * sv
        else:
            v = vc_raw
        if DECOUPLED:
            if not PIN:
                th = th * decay_mult
        else:
            g = g + wd * th
        if PIN:  # old (PTX): fma(one_m_b1, g - m, m); m = x * msc has two uses
            m = tl.fma(g - m, one_m_b1, m)
        else:
            m = m + (g - m) * one_m_b1
        if PIN and DECOUPLED:  # the old code's choice (PTX, all 8): one_m_b2 * (g * g) fused
            v = tl.fma(g * g, one_m_b2, v * b2)
        elif PIN:  # coupled decay: old fuses v * b2 (all 8)
            v = tl.fma(v, b2, one_m_b2 * (g * g))
        else:
            v = v * b2 + one_m_b2 * (g * g)
        svg = tl.sqrt(v)
        if PIN and DECOUPLED:  # old: th * decay_mult fused
            th = tl.fma(th, decay_mult, -(step_size * _div(m, svg * inv_sqrt_bc2 + eps, ASM)))
        else:
            th = th - step_size * _div(m, svg * inv_sqrt_bc2 + eps, ASM)
    elif KIND == 1:  # SGD
        if DECOUPLED:
            if not PIN:
                th = th * decay_mult
        else:
            g = g + wd * th
        if HAS_MOM:
            if PIN and NESTEROV:  # old: m * b1 fused on 6 of a thread's 8 elements
                m = tl.where(first != 0, g, tl.fma(m, b1, one_m_damp * g))
            elif PIN:  # old: one_m_damp * g fused (all 8)
                m = tl.where(first != 0, g, tl.fma(g, one_m_damp, m * b1))
            else:
                m = tl.where(first != 0, g, m * b1 + one_m_damp * g)
            if NESTEROV:
                d = g + b1 * m
            else:
                d = m
        else:
            d = g
        if PIN and DECOUPLED:  # old: th * decay_mult fused
            th = tl.fma(th, decay_mult, -(lr * d))
        else:
            th = th - lr * d
    else:  # Lion
        if PIN:  # old's choices: th * decay_mult, one_m_b1 * g, one_m_b2 * g fused
            cc = tl.fma(g, one_m_b1, m * b1)
            sgn = tl.where(cc > 0, 1.0, tl.where(cc < 0, -1.0, 0.0))
            th = tl.fma(th, decay_mult, -(lr * sgn))
            m = tl.fma(g, one_m_b2, m * b2)
        else:
            th = th * decay_mult
            cc = m * b1 + one_m_b1 * g
            sgn = tl.where(cc > 0, 1.0, tl.where(cc < 0, -1.0, 0.0))
            th = th - lr * sgn
            m = m * b2 + one_m_b2 * g

    if HAS_MOM:
        if QUANT:
            ms_new = _ceil_scale(tl.max(tl.abs(m), axis=1), SCALE_F32)
            nz = tl.where(ms_new > 0, ms_new, 1.0)
            inv = tl.where(ms_new > 0, _div_safe(1.0, nz, ASM), 0.0)
            x = m * inv[:, None]
            # 2x / (1 + |x|) * 127 == (x / (1 + |x|)) * 254 bitwise (2x is exact). s >= max|m|
            # so |x| <= 1 + 2**-22 and t < 127.5 + 2**-14: floor(t) lies in [-127, 127]
            # and v2's clamp is a no-op (non-finite m, check_finite=False: other garbage)
            t = _div(x, 1.0 + tl.abs(x), ASM) * 254.0 + 0.5
            tl.store(mp + off, _floor_bits(t, ASM).to(tl.int8), mask=mask)
            if ST:
                _store_scales(msp + goff, ms_new, gmask, SCALE_F32)
            else:
                tl.store(msp + goff, ms_new.to(msp.dtype.element_ty), mask=gmask)
        else:
            tl.store(mp + off, m, mask=mask)
    if KIND == 0:
        if QUANT:
            vs_new = _ceil_scale(tl.max(svg, axis=1), SCALE_F32)
            nz = tl.where(vs_new > 0, vs_new, 1.0)
            inv = tl.where(vs_new > 0, _div_safe(255.0, nz, ASM), 0.0)
            # floor(max(t, lo)) with lo = 1 where svg > 0 (a nonzero v never codes 0) and 0
            # where svg == 0 (then t = 0.5): a nonzero svg = sqrt(v) is >= sqrt(2**-149) >
            # 2**-100, so min(svg, 2**-100) * 2**100 is that lo (exact, no overflow). svg <= s,
            # so t < 255.5 + 2**-12 and v2's clamp at 255 is a no-op.
            if LEAN > 0:  # the same lo (1 for svg > 0 or NaN, 0 for svg == 0) in one FSET
                lo = tl.where(svg <= 0.0, 0.0, 1.0)
            else:
                lo = tl.minimum(svg, 7.888609052210118e-31) * 1.2676506002282294e30
            t = tl.maximum(svg * inv[:, None] + 0.5, lo)
            tl.store(vp + off, _floor_bits(t, ASM).to(tl.uint8), mask=mask)
            if ST:
                _store_scales(vsp + goff, vs_new, gmask, SCALE_F32)
            else:
                tl.store(vsp + goff, vs_new.to(vsp.dtype.element_ty), mask=gmask)
        else:
            tl.store(vp + off, v, mask=mask)

    if P_DTYPE == 0:
        tl.store(pp + off, th, mask=mask)
    else:
        if P_DTYPE == 1:
            if CVT:  # cvt.rn.bf16x2.f32: one F2FP per two, the same RNE
                pn = tl.inline_asm_elementwise(
                    "cvt.rn.bf16x2.f32 $0, $2, $1;",
                    "=r,f,f",
                    [th],
                    dtype=tl.bfloat16,
                    is_pure=True,
                    pack=2,
                )
            elif ASM:  # cvt.rn.bf16.f32 (one F2F): same RNE as below for finite th
                pn = th.to(tl.bfloat16)
            else:  # the interpreter's bf16 cast is not RNE: integer rounding as in v2
                b = th.to(tl.uint32, bitcast=True)
                nb = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16)
                pn = nb.to(tl.bfloat16, bitcast=True)
        else:
            pn = th.to(tl.float16)
        tl.store(pp + off, pn, mask=mask)
        if ECC > 0:
            if UNPACK and P_DTYPE == 1:
                pnf = _bf16_f32(pn, ASM)
            else:
                pnf = pn.to(tl.float32)
            if P_DTYPE == 1 and Q2:
                iq = _q_bf16x2(pn, ECC, True)
            elif P_DTYPE == 1:  # 1/q = 2**-k: biased exponents of q and 1/q sum to 254
                iq = (0x7F000000 - _q_bf16(pnf, ECC)).to(tl.float32, bitcast=True)
            else:
                iq = _pow2(-_correction_exp(pn, P_DTYPE, ECC))
            r = (th - pnf) * iq
            if SR:
                if LEAN > 0:
                    u = _draw_lean(off, ib, key, LEAN)
                else:
                    h = _mix32((off.to(tl.uint32) + ib) ^ key)
                    u = (h >> 8).to(tl.float32) * 5.960464477539063e-08  # 2**-24
                t = r + u
            else:
                t = r + 0.5
            # |r| <= 2**(ECC-1) (|th - pn| <= ulp/2), so floor(t) >= -LIM: only the top
            # (th halfway, rounded down to even, plus u) needs v2's clamp
            LIM: tl.constexpr = 1 << (ECC - 1)
            t = tl.minimum(t, LIM - 1)
            tl.store(cp + off, _floor_bits(t, ASM).to(cp.dtype.element_ty), mask=mask)


@triton.jit
def _step_tile_v3(
    pp,
    gp,
    cp,
    mp,
    msp,
    vp,
    vsp,
    off,
    mask,
    goff,
    gmask,
    key,
    ib,
    lr,
    b1,
    one_m_b1,
    b2,
    one_m_b2,
    eps,
    wd,
    decay_mult,
    step_size,
    inv_sqrt_bc2,
    one_m_damp,
    first,
    KIND: tl.constexpr,
    ECC: tl.constexpr,
    QUANT: tl.constexpr,
    SR: tl.constexpr,
    P_DTYPE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_MOM: tl.constexpr,
    SCALE_F32: tl.constexpr,
    ASM: tl.constexpr,
    LEAN: tl.constexpr = 0,
    PARTS: tl.constexpr = 0,
):
    """``_step_tile`` with v3's cheaper element math (same codes under the interpreter):
    ``_tile_loads_v3`` then ``_tile_update_v3``."""
    p, g, c, mc, msc, vc, vsc = _tile_loads_v3(
        pp, gp, cp, mp, msp, vp, vsp, off, mask, goff, gmask, KIND, ECC, QUANT, HAS_MOM
    )
    _tile_update_v3(
        p,
        g,
        c,
        mc,
        msc,
        vc,
        vsc,
        pp,
        gp,
        cp,
        mp,
        msp,
        vp,
        vsp,
        off,
        mask,
        goff,
        gmask,
        key,
        ib,
        lr,
        b1,
        one_m_b1,
        b2,
        one_m_b2,
        eps,
        wd,
        decay_mult,
        step_size,
        inv_sqrt_bc2,
        one_m_damp,
        first,
        KIND,
        ECC,
        QUANT,
        SR,
        P_DTYPE,
        DECOUPLED,
        NESTEROV,
        HAS_MOM,
        SCALE_F32,
        ASM,
        LEAN,
        PARTS,
    )


@triton.jit(do_not_specialize=["nunits", "first", "step_mix"])
def _step_kernel_v3(
    units,  # int32 [nunits, 2]: as for _step_kernel_v2
    nunits,
    tab,
    p_base,
    g_base,
    c_base,
    m_base,
    ms_base,
    v_base,
    vs_base,
    lr,
    b1,
    one_m_b1,
    b2,
    one_m_b2,
    eps,
    wd,
    decay_mult,
    step_size,
    inv_sqrt_bc2,
    one_m_damp,
    first,
    step_mix,
    skip_flag,  # int32 [1] written by _nonfinite_kernel_v3 (CHECK_SKIP): nonzero -> no step
    KIND: tl.constexpr,
    ECC: tl.constexpr,
    QUANT: tl.constexpr,
    SR: tl.constexpr,
    P_DTYPE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_MOM: tl.constexpr,
    SCALE_F32: tl.constexpr,
    ALIGNED: tl.constexpr,
    N16: tl.constexpr,
    CHECK_SKIP: tl.constexpr,
    ASM: tl.constexpr,  # inline PTX (GPU); False under the interpreter
    UNIT: tl.constexpr,
    BLOCK: tl.constexpr,
    WAVES: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SCALARS_ON_DEVICE: tl.constexpr,
):
    if CHECK_SKIP:
        if tl.load(skip_flag) != 0:
            return
    if SCALARS_ON_DEVICE:
        sp = lr
        if tl.load(sp + 13) != 0:
            return
        (
            lr,
            b1,
            one_m_b1,
            b2,
            one_m_b2,
            eps,
            wd,
            decay_mult,
            step_size,
            inv_sqrt_bc2,
            one_m_damp,
            first,
            step_mix,
        ) = _device_scalars(sp)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    NG: tl.constexpr = BLOCK // GROUP_SIZE
    rows = tl.arange(0, NG)
    tile = rows[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    for u in range(pid, nunits, nprog):
        row, lu, n = _v2_unit(units, u, tab, N16)
        ng = (n + GROUP_SIZE - 1) // GROUP_SIZE
        pp, gp, cp, mp, msp, vp, vsp = _tensor_arrays(
            row,
            p_base,
            g_base,
            c_base,
            m_base,
            ms_base,
            v_base,
            vs_base,
            KIND,
            ECC,
            QUANT,
            HAS_MOM,
            ALIGNED,
        )
        key, ib = _rounding_stream(row, step_mix, ECC, SR)
        for s in range(0, UNIT // BLOCK):
            start = lu * UNIT + s * BLOCK
            if start < n:
                off = start + tile
                mask = off < n
                goff = start // GROUP_SIZE + rows
                gmask = goff < ng
                _step_tile_v3(
                    pp,
                    gp,
                    cp,
                    mp,
                    msp,
                    vp,
                    vsp,
                    off,
                    mask,
                    goff,
                    gmask,
                    key,
                    ib,
                    lr,
                    b1,
                    one_m_b1,
                    b2,
                    one_m_b2,
                    eps,
                    wd,
                    decay_mult,
                    step_size,
                    inv_sqrt_bc2,
                    one_m_damp,
                    first,
                    KIND,
                    ECC,
                    QUANT,
                    SR,
                    P_DTYPE,
                    DECOUPLED,
                    NESTEROV,
                    HAS_MOM,
                    SCALE_F32,
                    ASM,
                )


# programs per SM of the v3 finiteness pre-pass: 12 x 4 warps of <= 40 registers (triton 3.6,
# sm_90: 32 for bf16/fp16 gradients, 40 for fp32) stay resident together (a persistent grid
# whose programs do not all fit runs its last ones alone, after the others), ~48 KB of
# gradient loads in flight per SM
V3_PREPASS_WAVES = 12


@triton.jit(do_not_specialize=["nunits"])
def _nonfinite_kernel_v3(
    units,
    nunits,
    tab,
    g_base,
    flag,  # int32 [1]: set to 1 if any gradient element of the bucket is inf or NaN
    ALIGNED: tl.constexpr,
    N16: tl.constexpr,
    G_DTYPE: tl.constexpr,  # 0 fp32, 1 bf16, 2 fp16
    UNIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Finiteness pre-pass, v3: a persistent grid loops over the units; per element one AND
    and one (packed 16-bit) max of the exponent field, one reduction and at most one atomic
    per program. An element is inf/NaN iff its exponent field is all ones, which is also
    the largest value the masked field can take: max(field) == all-ones."""
    if G_DTYPE == 0:
        EXP: tl.constexpr = 0x7F800000
    elif G_DTYPE == 1:
        EXP: tl.constexpr = 0x7F80
    else:
        EXP: tl.constexpr = 0x7C00
    if G_DTYPE == 0:
        acc = tl.zeros([BLOCK], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.int16)
    for u in range(tl.program_id(0), nunits, tl.num_programs(0)):
        row, lu, n = _v2_unit(units, u, tab, N16)
        gp = _array_ptr(g_base, row, 1, ALIGNED)
        for s in tl.static_range(UNIT // BLOCK):
            off = lu * UNIT + s * BLOCK + tl.arange(0, BLOCK)
            g = tl.load(gp + off, mask=off < n, other=0.0)
            if G_DTYPE == 0:
                e = g.to(tl.int32, bitcast=True) & EXP
            else:
                e = g.to(tl.int16, bitcast=True) & EXP
            acc = tl.maximum(acc, e)  # fields are >= 0 as signed ints too
    if tl.max(acc, axis=0) == EXP:
        tl.atomic_max(flag, 1)


def _v3_configs():
    """v2's two best shapes plus BLOCK 2048: per unit one tile, so the per-unit indexing
    (table loads, 64-bit bases, rounding key) is paid once per 2048 elements; offline sm_90
    SASS per element (AdamW): 1024/4 warps 95.4 (64 regs), 2048/8 warps 88.8 (64 regs),
    2048/4 warps 80.0 (128 regs, no spills, half the occupancy). v2's (512, 16/SM) and
    3-stage configs are dropped (v2's tuner picked 1024 / 4 warps in every recorded run)."""
    cfg = triton.Config
    return [
        cfg(dict(BLOCK=1024, WAVES=0), num_warps=4, num_stages=1),
        cfg(dict(BLOCK=1024, WAVES=8), num_warps=4, num_stages=1),
        cfg(dict(BLOCK=2048, WAVES=0), num_warps=8, num_stages=1),
        cfg(dict(BLOCK=2048, WAVES=4), num_warps=8, num_stages=1),
        cfg(dict(BLOCK=2048, WAVES=4), num_warps=4, num_stages=1),
    ]


_step_kernel_v3_tuned = triton.autotune(
    configs=_v3_configs(),
    key=_TUNE_KEY,
    pre_hook=_tune_pre_hook,
    post_hook=_tune_post_hook,
    do_bench=_quick_bench,
)(_step_kernel_v3)


# --------------------------------- kernel v4 (v3's element math, chunks, L2 prefetch ahead)
#
# v3 measured 2.10 ms for 537M AdamW elements (74% of the copy ceiling, ~95 SASS per element)
# with one 2,048-element unit per program: each program loads a tile, waits, computes,
# stores, and only the other resident programs (8 per SM at 64 registers) keep HBM busy
# meanwhile. v4 changes the indexing and the memory pipeline, not the arithmetic
# (``_tile_update_v3`` is v3's, so the codes are v3's bit for bit):
#
# * a work-table entry is a CHUNK of ``V4_UNIT`` = 8,192 elements of one tensor (v3: 2,048):
#   the chain of dependent table loads (unit -> tensor row -> array offsets), the 64-bit base
#   pointers and the rounding key (~144 SASS per warp: ~9 per element at v3's one unit per
#   program, ~2.3 here) are paid once per 8 tiles of 1,024 instead of once per 2; the tile
#   loop runs over the tiles the tensor has (a dynamic bound), so small tensors do not pay
#   for empty tiles. Not larger: one program per chunk runs ~8 x 8 tiles' time on its SM
#   (~34 us for the 537M case), and the last programs of the grid set the end (tail).
# * ``PF`` > 0 (GPU, ALIGNED buckets): at every tile s = 0 mod PF, thread 0 of the program
#   asks the TMA unit to prefetch tiles s+1 .. s+PF of the chunk, every array, into L2
#   (``cp.async.bulk.prefetch.L2``: one instruction per array, no registers, no data
#   returned), so the loads of the coming tiles are in flight while this one computes and
#   the program's own loads hit L2. Bytes held in L2: <= PF tiles x ~7 KB per program
#   (PF 2: ~15 MB at 8 programs per SM on 132 SMs; the H200's L2 is 50 MB). Cost: ~100
#   (mostly uniform-datapath) instructions per warp per prefetch, ~12 per element at PF 1,
#   ~3 at PF 4 (sass_count.py --pf): the tuner weighs that against the latency hidden.
#   (A register double-buffer of the next tile's loads was tried offline first: 113.6 SASS
#   per element instead of 95.4, the int8 vectors unpacked into loop-carried registers.)
#
# ``CHECK_SKIP`` compares the device flag with a per-step ``epoch`` (the pre-pass writes
# ``atomic_max(flag, epoch)``): one persistent flag per device, no memset launch per step.

V4_UNIT = 8192  # elements per work-table entry (chunk); every BLOCK of v4 divides it
V4_DEFAULT = dict(BLOCK=1024, WAVES=0, PF=2)
V4_DEFAULT_WARPS = 4


@triton.jit
def _nbytes16(ne, ptr):
    """Bytes of ``ne`` elements of ``ptr``'s type, rounded up to a multiple of 16 (the bulk
    prefetch's unit; the 16-byte blocks past a tensor's last element stay inside its
    allocation, whose size is a multiple of 512 bytes); 0 when ``ne`` <= 0."""
    nb = tl.maximum(ne, 0) * (ptr.dtype.element_ty.primitive_bitwidth // 8)
    return (nb + 15) & -16


@triton.jit
def _prefetch_range(
    pp, gp, cp, mp, msp, vp, vsp, start, ne, ne_c, ne_m, ng_m, ne_v, ng_v, GROUP_SIZE: tl.constexpr
):
    """Thread 0 of the program asks the TMA unit to prefetch elements [start, start + ne)
    (groups [start / 32, + ng_*)) of the seven arrays into L2: one
    ``cp.async.bulk.prefetch.L2.global`` each (sm_90), no registers, no data returned.
    Addresses must be 16-byte aligned (the launcher uses it only for ALIGNED buckets and
    BLOCK-aligned ``start``); an array the mode does not use is passed with a count of 0."""
    z = tl.zeros([1], dtype=tl.int32)
    g0 = start // GROUP_SIZE
    tl.inline_asm_elementwise(
        """{
        .reg .pred p, q;
        .reg .u32 t;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        setp.ne.s32 q, $8, 0;
        and.pred q, q, p;
        @q cp.async.bulk.prefetch.L2.global [$1], $8;
        setp.ne.s32 q, $9, 0;
        and.pred q, q, p;
        @q cp.async.bulk.prefetch.L2.global [$2], $9;
        setp.ne.s32 q, $10, 0;
        and.pred q, q, p;
        @q cp.async.bulk.prefetch.L2.global [$3], $10;
        setp.ne.s32 q, $11, 0;
        and.pred q, q, p;
        @q cp.async.bulk.prefetch.L2.global [$4], $11;
        setp.ne.s32 q, $12, 0;
        and.pred q, q, p;
        @q cp.async.bulk.prefetch.L2.global [$5], $12;
        setp.ne.s32 q, $13, 0;
        and.pred q, q, p;
        @q cp.async.bulk.prefetch.L2.global [$6], $13;
        setp.ne.s32 q, $14, 0;
        and.pred q, q, p;
        @q cp.async.bulk.prefetch.L2.global [$7], $14;
        mov.u32 $0, 0;
        }""",
        "=r,l,l,l,l,l,l,l,r,r,r,r,r,r,r",
        [  # addresses as int64 (triton 3.6 will not broadcast pointers of mixed types)
            (pp + start + z).to(tl.int64),
            (gp + start + z).to(tl.int64),
            (cp + start + z).to(tl.int64),
            (mp + start + z).to(tl.int64),
            (msp + g0 + z).to(tl.int64),
            (vp + start + z).to(tl.int64),
            (vsp + g0 + z).to(tl.int64),
            _nbytes16(ne, pp) + z,
            _nbytes16(ne, gp) + z,
            _nbytes16(ne_c, cp) + z,
            _nbytes16(ne_m, mp) + z,
            _nbytes16(ng_m, msp) + z,
            _nbytes16(ne_v, vp) + z,
            _nbytes16(ng_v, vsp) + z,
        ],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_tiles(
    pp,
    gp,
    cp,
    mp,
    msp,
    vp,
    vsp,
    start,  # first element (a multiple of BLOCK)
    ntl,  # tiles to prefetch (>= 0)
    lim,  # elements past ``lim`` are not prefetched (the chunk's or the tensor's end)
    KIND: tl.constexpr,
    ECC: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_MOM: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    """L2 prefetch of ``ntl`` tiles from ``start`` of every array the mode reads."""
    ne = tl.minimum(lim - start, ntl * BLOCK)
    ngr = (ne + GROUP_SIZE - 1) // GROUP_SIZE
    ne_c = ne * 0
    ne_m = ne * 0
    ng_m = ngr * 0
    ne_v = ne * 0
    ng_v = ngr * 0
    if ECC > 0:
        ne_c = ne
    if HAS_MOM:
        ne_m = ne
        if QUANT:
            ng_m = ngr
    if KIND == 0:
        ne_v = ne
        if QUANT:
            ng_v = ngr
    _prefetch_range(
        pp, gp, cp, mp, msp, vp, vsp, start, ne, ne_c, ne_m, ng_m, ne_v, ng_v, GROUP_SIZE
    )


@triton.jit(do_not_specialize=["nunits", "first", "step_mix", "epoch"])
def _step_kernel_v4(
    units,  # int32 [nunits, 2]: tensor index, chunk index within the tensor
    nunits,
    tab,
    p_base,
    g_base,
    c_base,
    m_base,
    ms_base,
    v_base,
    vs_base,
    lr,
    b1,
    one_m_b1,
    b2,
    one_m_b2,
    eps,
    wd,
    decay_mult,
    step_size,
    inv_sqrt_bc2,
    one_m_damp,
    first,
    step_mix,
    skip_flag,  # int32 [1] written by the v4 pre-pass (CHECK_SKIP): == epoch -> no step
    epoch,
    KIND: tl.constexpr,
    ECC: tl.constexpr,
    QUANT: tl.constexpr,
    SR: tl.constexpr,
    P_DTYPE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_MOM: tl.constexpr,
    SCALE_F32: tl.constexpr,
    ALIGNED: tl.constexpr,
    N16: tl.constexpr,
    CHECK_SKIP: tl.constexpr,
    ASM: tl.constexpr,
    UNIT: tl.constexpr,
    BLOCK: tl.constexpr,
    WAVES: tl.constexpr,
    PF: tl.constexpr,  # L2 prefetch of PF tiles every PF tiles (0: none; ASM and ALIGNED only)
    GROUP_SIZE: tl.constexpr,
    SCALARS_ON_DEVICE: tl.constexpr,
    LEAN: tl.constexpr = 0,  # 0: v3's tile math; 1, 2: the leaner one (_tile_update_v3)
    PARTS: tl.constexpr = 0,  # GPU-only parts (LEAN_* bits, _tile_update_v3); PIN also at LEAN 0
):
    if CHECK_SKIP:
        if tl.load(skip_flag) == epoch:
            return
    if SCALARS_ON_DEVICE:
        sp = lr
        if tl.load(sp + 13) != 0:
            return
        (
            lr,
            b1,
            one_m_b1,
            b2,
            one_m_b2,
            eps,
            wd,
            decay_mult,
            step_size,
            inv_sqrt_bc2,
            one_m_damp,
            first,
            step_mix,
        ) = _device_scalars(sp)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    NG: tl.constexpr = BLOCK // GROUP_SIZE
    rows = tl.arange(0, NG)
    tile = rows[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    for u in range(pid, nunits, nprog):
        row, lu, n = _v2_unit(units, u, tab, N16)
        ng = (n + GROUP_SIZE - 1) // GROUP_SIZE
        pp, gp, cp, mp, msp, vp, vsp = _tensor_arrays(
            row,
            p_base,
            g_base,
            c_base,
            m_base,
            ms_base,
            v_base,
            vs_base,
            KIND,
            ECC,
            QUANT,
            HAS_MOM,
            ALIGNED,
        )
        key, ib = _rounding_stream(row, step_mix, ECC, SR)
        base = lu * UNIT  # int32, a multiple of UNIT
        nt = (tl.minimum(n - base, UNIT) + BLOCK - 1) // BLOCK  # tiles of this chunk, >= 1
        lim = tl.minimum(n, base + UNIT)  # the chunk's end
        for s in range(0, nt):
            start = base + s * BLOCK
            if ASM and ALIGNED and PF > 0:
                if s % PF == 0:  # tiles s+1 .. s+PF of the chunk into L2
                    _prefetch_tiles(
                        pp,
                        gp,
                        cp,
                        mp,
                        msp,
                        vp,
                        vsp,
                        start + BLOCK,
                        PF,
                        lim,
                        KIND,
                        ECC,
                        QUANT,
                        HAS_MOM,
                        BLOCK,
                        GROUP_SIZE,
                    )
            off = start + tile
            goff = start // GROUP_SIZE + rows
            _step_tile_v3(
                pp,
                gp,
                cp,
                mp,
                msp,
                vp,
                vsp,
                off,
                off < n,
                goff,
                goff < ng,
                key,
                ib,
                lr,
                b1,
                one_m_b1,
                b2,
                one_m_b2,
                eps,
                wd,
                decay_mult,
                step_size,
                inv_sqrt_bc2,
                one_m_damp,
                first,
                KIND,
                ECC,
                QUANT,
                SR,
                P_DTYPE,
                DECOUPLED,
                NESTEROV,
                HAS_MOM,
                SCALE_F32,
                ASM,
                LEAN,
                PARTS,
            )


# programs per SM of the v4 pre-pass (as v3's: 12 x 4 warps stay resident together)
V4_PREPASS_WAVES = 12


V4_PREPASS_SUB = 2048  # elements per trip of the v4 pre-pass (v3's unit: fine load balance)


@triton.jit(do_not_specialize=["nunits", "mark"])
def _nonfinite_kernel_v4(
    units,
    nunits,
    tab,
    g_base,
    flag,  # int32 [1]: atomic_max(flag, mark) if any gradient element is inf or NaN
    mark,  # the step's epoch (eager v4) or 1 (zeroed flags: capturable, host-side check)
    ALIGNED: tl.constexpr,
    N16: tl.constexpr,
    G_DTYPE: tl.constexpr,  # 0 fp32, 1 bf16, 2 fp16
    UNIT: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """v3's exponent-field pre-pass over v4's chunk table, SUB elements per trip of the
    persistent loop (chunk ``w // (UNIT / SUB)``, part ``w % (UNIT / SUB)``, so the grid
    stays balanced at v3's granularity): per element one AND and one packed max, one
    reduction and at most one atomic per program; ``mark`` instead of 1."""
    S: tl.constexpr = UNIT // SUB
    if G_DTYPE == 0:
        EXP: tl.constexpr = 0x7F800000
    elif G_DTYPE == 1:
        EXP: tl.constexpr = 0x7F80
    else:
        EXP: tl.constexpr = 0x7C00
    if G_DTYPE == 0:
        acc = tl.zeros([BLOCK], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.int16)
    for w in range(tl.program_id(0), nunits * S, tl.num_programs(0)):
        row, lu, n = _v2_unit(units, w // S, tab, N16)
        gp = _array_ptr(g_base, row, 1, ALIGNED)
        for k in tl.static_range(SUB // BLOCK):
            off = lu * UNIT + (w % S) * SUB + k * BLOCK + tl.arange(0, BLOCK)
            g = tl.load(gp + off, mask=off < n, other=0.0)
            if G_DTYPE == 0:
                e = g.to(tl.int32, bitcast=True) & EXP
            else:
                e = g.to(tl.int16, bitcast=True) & EXP
            acc = tl.maximum(acc, e)
    if tl.max(acc, axis=0) == EXP:
        tl.atomic_max(flag, mark)


def _v4_configs():
    """v3's pick (BLOCK 1024, 4 warps, 8 elements per thread) with L2 prefetch of 2 tiles,
    none, or 4 tiles, one chunk per program; persistent (8 per SM) at PF 2; BLOCK 2048 /
    8 warps at PF 1 (2,048 elements ahead); BLOCK 2048 / 4 warps at PF 1 (16 elements per
    thread: the lean math's fastest on the H200, 2026-12-01 evening, 0.89x of the 1024 / PF 2
    step). The tuner's pick (printed by the bench) says which pays."""
    cfg = triton.Config
    return [
        cfg(dict(BLOCK=2048, WAVES=0, PF=1), num_warps=4, num_stages=1),
        cfg(dict(BLOCK=1024, WAVES=0, PF=2), num_warps=4, num_stages=1),
        cfg(dict(BLOCK=1024, WAVES=0, PF=0), num_warps=4, num_stages=1),
        cfg(dict(BLOCK=1024, WAVES=0, PF=4), num_warps=4, num_stages=1),
        cfg(dict(BLOCK=1024, WAVES=8, PF=2), num_warps=4, num_stages=1),
        cfg(dict(BLOCK=2048, WAVES=0, PF=1), num_warps=8, num_stages=1),
    ]


_step_kernel_v4_tuned = triton.autotune(
    configs=_v4_configs(),
    key=_TUNE_KEY + ["LEAN", "PARTS"],
    pre_hook=_tune_pre_hook,
    post_hook=_tune_post_hook,
    do_bench=_quick_bench,
)(_step_kernel_v4)
