"""GPU-only inline PTX of the step kernel, each with what the interpreter computes instead.

``ASM`` (a constexpr: True on CUDA, False under ``TRITON_INTERPRET=1``, which cannot run
inline asm) picks the PTX. The interpreter side computes the same values exactly (exact
division, ``tl.floor``, integer conversions), which is what the CPU path (``_cpu.py``)
mirrors; the PTX side differs from it by an ulp at times (approximate reciprocals), which
moves ties only (tests/_checks.py ``assert_ties``). Offline sm_90 instruction counts of each
choice: docs/design/flashoptim.md.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _floor_bits(t, ASM: tl.constexpr, MINUS1: tl.constexpr):
    """int32 bits of ``floor(t) + 1.5 * 2**23`` (MINUS1: ``floor(t) - 1 + 1.5 * 2**23``, for a
    draw given as 1 + u) for |t| < 2**22: their low 8 (16) bits are the floor (minus 1) as
    int8 (int16) two's complement, or as uint8 in [0, 255]. One ``add.rm`` either way: the
    sum lies in [2**23, 2**24), where fp32 spacing is 1."""
    if MINUS1:
        C: tl.constexpr = 12582911.0
    else:
        C: tl.constexpr = 12582912.0
    if ASM:
        if MINUS1:
            f = tl.inline_asm_elementwise(
                "add.rm.f32 $0, $1, 0f4B3FFFFF;",
                "=f,f",
                [t],
                dtype=tl.float32,
                is_pure=True,
                pack=1,
            )
        else:
            f = tl.inline_asm_elementwise(
                "add.rm.f32 $0, $1, 0f4B400000;",
                "=f,f",
                [t],
                dtype=tl.float32,
                is_pure=True,
                pack=1,
            )
    else:
        f = tl.floor(t) + C
    return f.to(tl.int32, bitcast=True)


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
# bf16 value (``_step_kernel._q_bf16``) or 1/q, as fp32 bits, in 3 SIMD16 ops per pair plus
# the unpack; the 16-bit constants per ECC: (K1, K2) = ((8 + ECC) << 7, (7 + ECC) << 7):
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
