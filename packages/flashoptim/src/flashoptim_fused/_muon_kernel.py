"""FlashMuon's two fused passes around the Newton-Schulz orthogonalisation, each one launch
over every matrix of a workspace wave (float64 reference: ``reference.muon_step_ref``; the
same fp32 arithmetic in torch: ``_cpu.muon_momentum_cpu`` / ``muon_update_cpu`` /
``muon_requantize_cpu``; the orchestration: ``muon.py``; the low-rank part:
``_muon_lowrank``).

* ``_momentum_kernel`` (before the orthogonalisation): decode the int8 momentum and add its
  low-rank part (bf16, from the workspace), take the EMA ``m += (1 - mu)(g - m)``
  (``maximize``: on ``-g``), and write the Nesterov direction ``u = m + (1 - mu)(g - m)`` (or
  ``m``) rounded to bf16 into the wave's workspace; without a low-rank part it stores the
  codes (rounded to nearest) too. Bytes per element (bf16 gradient, bf16 scales): 2 (g) + 1
  (codes) + 0.0625 (scales) + 2 (low-rank part) + 2 (u) = 7.06.
* ``_update_kernel`` (after it, the workspace now holding the orthogonalised ``O``):
  reconstruct the master weight, ``theta = theta (1 - lr wd) - lr ratio O`` (``ratio``: the
  tensor's shape-dependent scale, from its table row), split it back into the bf16 parameter
  and its correction (stochastic rounding); with a low-rank part, the momentum formed again
  as in the first pass minus the new low-rank part, stored as codes rounded to nearest.
  Bytes per element (bf16, int8 correction): 2 + 2 (p) + 1 + 1 (correction) + 2 (O), and
  2 (g) + 1 + 1 (codes) + 0.125 (scales) + 2 + 2 (the two low-rank parts) = 16.125.

Both use the step kernel's tables (``_plan.build_table``, 10 columns per tensor; here column 5
is the element offset of the tensor's matrix in the workspace and column 6 the fp32 bits of
its ratio), chunks of 8,192 elements, tiles of BLOCK as [groups, 32], the L2 prefetch and
the device non-finite flag, and the step kernel's shared tile helpers; one config, no
autotuning (``_config.MUON_CONFIG``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _config
from ._plan import P_CODE, use_asm
from ._ptx import _bf16_f32, _prefetch_range
from ._step_kernel import (
    CHUNK,
    _array_ptr,
    _chunk,
    _decode_momentum,
    _join_master,
    _round_bf16,
    _rounding_stream,
    _store_master,
    _store_momentum,
)
from .reference import GROUP


@triton.jit
def _prefetch(
    a,
    b,
    c,
    s,
    start,
    lim,
    ne_c_on: tl.constexpr,
    ng_on: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    """L2 prefetch of the next tile: ``a`` and ``b`` (elements), ``c`` (elements, if
    ``ne_c_on``) and the group scales ``s`` (if ``ng_on``) from element ``start`` on."""
    ne = tl.minimum(lim - start, BLOCK).to(tl.int32)
    ngr = (ne + GROUP_SIZE - 1) // GROUP_SIZE
    z = ne * 0
    ne_c = z
    ng = ngr * 0
    if ne_c_on:
        ne_c = ne
    if ng_on:
        ng = ngr
    _prefetch_range(a, b, c, a, s, a, s, start, ne, ne_c, z, ng, z, z, GROUP_SIZE)


@triton.jit
def _new_momentum(
    gp,
    mp,
    msp,
    lop,
    off,
    mask,
    goff,
    gmask,
    one_m_mu,
    QUANT: tl.constexpr,
    LOWRANK: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    ASM: tl.constexpr,
):
    """(gradient, the momentum after this step's EMA) of a tile: the stored momentum
    (int8 codes, plus the low-rank part ``P R^T`` in bf16 at ``lop`` when LOWRANK; or fp32),
    then ``m + (1 - mu)(g - m)``. Both passes compute it the same way (pass 2 requantizes)."""
    g_raw = tl.load(gp + off, mask=mask, other=0.0)
    if QUANT:
        mc_raw = tl.load(mp + off, mask=mask, other=0)
        msc_raw = tl.load(msp + goff, mask=gmask, other=0.0)
    else:
        m = tl.load(mp + off, mask=mask, other=0.0)
    if g_raw.dtype == tl.bfloat16:
        g = _bf16_f32(g_raw, ASM)
    else:
        g = g_raw.to(tl.float32)
    if MAXIMIZE:
        g = -g
    if QUANT:
        m = _decode_momentum(mc_raw, msc_raw, ASM)
    if LOWRANK:
        m = m + _bf16_f32(tl.load(lop + off, mask=mask, other=0.0), ASM)
    if ASM:  # one explicit fma each: a fixed contraction order (as the step kernel)
        m = tl.fma(g - m, one_m_mu, m)
    else:
        m = m + (g - m) * one_m_mu
    return g, m


@triton.jit
def _momentum_tile(
    gp,
    mp,
    msp,
    up,
    lop,
    off,
    mask,
    goff,
    gmask,
    one_m_mu,
    QUANT: tl.constexpr,
    LOWRANK: tl.constexpr,
    NESTEROV: tl.constexpr,
    SCALE_F32: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    ASM: tl.constexpr,
):
    """One tile of pass 1: ``u`` into the workspace; the momentum stored in place unless
    LOWRANK (pass 2 stores it then, against the new low-rank part)."""
    g, m = _new_momentum(
        gp, mp, msp, lop, off, mask, goff, gmask, one_m_mu, QUANT, LOWRANK, MAXIMIZE, ASM
    )
    if NESTEROV:  # torch's g.lerp(m, mu) = m + (1 - mu)(g - m)
        if ASM:
            u = tl.fma(g - m, one_m_mu, m)
        else:
            u = m + (g - m) * one_m_mu
    else:
        u = m
    if not QUANT:
        tl.store(mp + off, m, mask=mask)
    elif not LOWRANK:  # codes rounded to nearest (issue #31: no fresh noise per step)
        _store_momentum(m, mp, msp, off, mask, goff, gmask, 0, 0, SCALE_F32, False, ASM, False)
    tl.store(up + off, _round_bf16(u, ASM), mask=mask)


@triton.jit(do_not_specialize=["nunits", "epoch"])
def _momentum_kernel(
    units,  # int32 [nunits, 2]: tensor index, chunk index within the tensor
    nunits,
    tab,
    g_base,
    m_base,
    ms_base,
    u_base,  # the wave's bf16 workspace
    lo_base,  # the low-rank parts of the stored momenta, bf16, at the workspace's offsets
    one_m_mu,
    skip_flag,
    epoch,
    QUANT: tl.constexpr,
    LOWRANK: tl.constexpr,
    NESTEROV: tl.constexpr,
    SCALE_F32: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    ALIGNED: tl.constexpr,
    N16: tl.constexpr,
    CHECK_SKIP: tl.constexpr,
    ASM: tl.constexpr,
    UNIT: tl.constexpr,
    BLOCK: tl.constexpr,
    PF: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DRAW_HOIST: tl.constexpr,
    INDEX64: tl.constexpr,
):
    if CHECK_SKIP:
        if tl.load(skip_flag) == epoch:
            return
    NG: tl.constexpr = BLOCK // GROUP_SIZE
    rows = tl.arange(0, NG)
    tile = rows[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    for w in range(tl.program_id(0), nunits, tl.num_programs(0)):
        row, lu, n = _chunk(units, w, tab, N16, INDEX64)
        ng = (n + GROUP_SIZE - 1) // GROUP_SIZE
        gp = _array_ptr(g_base, row, 1, ALIGNED)
        mp = _array_ptr(m_base, row, 3, ALIGNED)
        msp = ms_base
        if QUANT:
            msp = _array_ptr(ms_base, row, 4, False)
        up = _array_ptr(u_base, row, 5, ALIGNED)
        lop = lo_base
        if LOWRANK:
            lop = _array_ptr(lo_base, row, 5, ALIGNED)
        base = lu * UNIT
        nt = (tl.minimum(n - base, UNIT) + BLOCK - 1) // BLOCK
        lim = tl.minimum(n, base + UNIT)
        for s in range(0, nt):
            start = base + s * BLOCK
            if ASM and ALIGNED and PF > 0:
                _prefetch(gp, mp, mp, msp, start + BLOCK, lim, False, QUANT, BLOCK, GROUP_SIZE)
            off = start + tile
            goff = start // GROUP_SIZE + rows
            _momentum_tile(
                gp,
                mp,
                msp,
                up,
                lop,
                off,
                off < n,
                goff,
                goff < ng,
                one_m_mu,
                QUANT,
                LOWRANK,
                NESTEROV,
                SCALE_F32,
                MAXIMIZE,
                ASM,
            )


@triton.jit
def _update_tile(
    pp,
    cp,
    op,
    off,
    mask,
    key,
    ib,
    alpha,
    decay_mult,
    ECC: tl.constexpr,
    SR: tl.constexpr,
    P_DTYPE: tl.constexpr,
    ASM: tl.constexpr,
    DRAW_HOIST: tl.constexpr,
):
    """One tile of pass 2, in place on the parameter and its correction."""
    p = tl.load(pp + off, mask=mask, other=0.0)
    c_raw = 0  # (no correction: unused)
    if ECC > 0:
        c_raw = tl.load(cp + off, mask=mask, other=0)
    o = _bf16_f32(tl.load(op + off, mask=mask, other=0.0), ASM)
    th = _join_master(p, c_raw, P_DTYPE, ECC, ASM)
    if ASM:
        th = tl.fma(th, decay_mult, -(alpha * o))
    else:
        th = th * decay_mult
        th = th - alpha * o
    _store_master(th, pp, cp, off, mask, key, ib, P_DTYPE, ECC, SR, ASM, DRAW_HOIST)


@triton.jit
def _requantize_tile(
    gp,
    mp,
    msp,
    lop,
    lnp,
    off,
    mask,
    goff,
    gmask,
    one_m_mu,
    SCALE_F32: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    ASM: tl.constexpr,
):
    """Pass 2 of a low-rank momentum: this step's momentum formed again as pass 1 formed it
    (the same fp32 operations on the same stored values), minus the new low-rank part at
    ``lnp``, stored as int8 codes rounded to nearest."""
    _, m = _new_momentum(
        gp, mp, msp, lop, off, mask, goff, gmask, one_m_mu, True, True, MAXIMIZE, ASM
    )
    r = m - _bf16_f32(tl.load(lnp + off, mask=mask, other=0.0), ASM)
    _store_momentum(r, mp, msp, off, mask, goff, gmask, 0, 0, SCALE_F32, False, ASM, False)


@triton.jit(do_not_specialize=["nunits", "step_mix", "epoch"])
def _update_kernel(
    units,
    nunits,
    tab,
    p_base,
    c_base,
    o_base,  # the wave's bf16 workspace, holding the orthogonalised updates
    g_base,  # LOWRANK: gradients, momentum codes and scales, old and new low-rank parts
    m_base,
    ms_base,
    lo_base,
    ln_base,
    lr,
    decay_mult,  # 1 - lr * weight_decay
    one_m_mu,
    step_mix,
    skip_flag,
    epoch,
    ECC: tl.constexpr,
    SR: tl.constexpr,
    P_DTYPE: tl.constexpr,
    LOWRANK: tl.constexpr,
    SCALE_F32: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    ALIGNED: tl.constexpr,
    N16: tl.constexpr,
    CHECK_SKIP: tl.constexpr,
    ASM: tl.constexpr,
    UNIT: tl.constexpr,
    BLOCK: tl.constexpr,
    PF: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DRAW_HOIST: tl.constexpr,
    INDEX64: tl.constexpr,
):
    if CHECK_SKIP:
        if tl.load(skip_flag) == epoch:
            return
    NG: tl.constexpr = BLOCK // GROUP_SIZE
    rows = tl.arange(0, NG)
    tile = rows[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    for w in range(tl.program_id(0), nunits, tl.num_programs(0)):
        row, lu, n = _chunk(units, w, tab, N16, INDEX64)
        pp = _array_ptr(p_base, row, 0, ALIGNED)
        cp = c_base
        if ECC > 0:
            cp = _array_ptr(c_base, row, 2, ALIGNED)
        op = _array_ptr(o_base, row, 5, ALIGNED)
        gp, mp, msp, lop, lnp = g_base, m_base, ms_base, lo_base, ln_base
        if LOWRANK:
            gp = _array_ptr(g_base, row, 1, ALIGNED)
            mp = _array_ptr(m_base, row, 3, ALIGNED)
            msp = _array_ptr(ms_base, row, 4, False)
            lop = _array_ptr(lo_base, row, 5, ALIGNED)
            lnp = _array_ptr(ln_base, row, 5, ALIGNED)
        ng = (n + GROUP_SIZE - 1) // GROUP_SIZE
        key, ib = _rounding_stream(row, step_mix, ECC, SR, False)
        # lr times the tensor's shape-dependent scale (fp32 bits in column 6), in fp32
        alpha = lr * tl.load(row + 6).to(tl.int32).to(tl.float32, bitcast=True)
        base = lu * UNIT
        nt = (tl.minimum(n - base, UNIT) + BLOCK - 1) // BLOCK
        lim = tl.minimum(n, base + UNIT)
        for s in range(0, nt):
            start = base + s * BLOCK
            if ASM and ALIGNED and PF > 0:
                _prefetch(pp, op, cp, op, start + BLOCK, lim, ECC > 0, False, BLOCK, GROUP_SIZE)
            off = start + tile
            _update_tile(
                pp,
                cp,
                op,
                off,
                off < n,
                key,
                ib,
                alpha,
                decay_mult,
                ECC,
                SR,
                P_DTYPE,
                ASM,
                DRAW_HOIST,
            )
            if LOWRANK:
                goff = start // GROUP_SIZE + rows
                _requantize_tile(
                    gp,
                    mp,
                    msp,
                    lop,
                    lnp,
                    off,
                    off < n,
                    goff,
                    goff < ng,
                    one_m_mu,
                    SCALE_F32,
                    MAXIMIZE,
                    ASM,
                )


# ------------------------------------------------------------------------------ launches


def _grid(ent: dict) -> tuple:
    """One program per chunk on CUDA; 3 under the interpreter (the loop covers any grid)."""
    n = ent["work"].shape[0]
    return (n,) if ent["tab"].is_cuda else (min(n, 3),)


def _common(ent: dict, skip, epoch: int) -> tuple[tuple, dict]:
    block, pf, warps = _config.MUON_CONFIG
    meta = dict(
        ALIGNED=ent["aligned"],
        N16=ent["n16"],
        CHECK_SKIP=skip is not None,
        ASM=use_asm(ent["tab"].device),
        UNIT=CHUNK,
        BLOCK=block,
        PF=pf,
        GROUP_SIZE=GROUP,
        DRAW_HOIST=ent["ib8"],
        INDEX64=ent["index64"],
        num_warps=warps,
    )
    return (ent["skip"] if skip is None else skip, epoch if skip is not None else 0), meta


def launch_momentum(ent: dict, ws: torch.Tensor, lo, hp: dict, skip=None, epoch=0) -> None:
    """Pass 1 over one wave: ``u`` into ``ws``, the momentum of every tensor in place unless
    ``lo`` (the low-rank parts of the stored momenta, bf16, at the workspace's offsets: pass
    2 stores the momentum then)."""
    nunits = ent["work"].shape[0]
    if nunits == 0:
        return
    b = ent["bases"]  # parameter, gradient, correction, momentum codes, scales, -, -
    flag, meta = _common(ent, skip, epoch)
    _momentum_kernel[_grid(ent)](
        ent["work"],
        nunits,
        ent["tab"],
        b[1],
        b[3],
        b[4],
        ws,
        ws if lo is None else lo,
        1 - hp["mu"],
        *flag,
        QUANT=hp["quant"],
        LOWRANK=lo is not None,
        NESTEROV=hp["nesterov"],
        SCALE_F32=hp["scale_dtype"] == torch.float32,
        MAXIMIZE=hp.get("maximize", False),
        **meta,
    )


def launch_update(
    ent: dict, ws: torch.Tensor, lo, ln, hp: dict, step_mix: int, skip=None, epoch=0
) -> None:
    """Pass 2 over one wave: every parameter and correction in place from ``O`` in ``ws``
    (``step_mix``: the step's key of the rounding stream, ``(step * GOLDEN) mod 2**32``);
    with ``lo`` / ``ln`` (the old and new low-rank parts) the momentum too."""
    nunits = ent["work"].shape[0]
    if nunits == 0:
        return
    b = ent["bases"]
    flag, meta = _common(ent, skip, epoch)
    low = lo is not None
    _update_kernel[_grid(ent)](
        ent["work"],
        nunits,
        ent["tab"],
        b[0],
        b[2],
        ws,
        b[1],
        b[3],
        b[4],
        lo if low else ws,
        ln if low else ws,
        hp["lr"],
        1 - hp["lr"] * hp["wd"],
        1 - hp["mu"],
        step_mix,
        *flag,
        ECC=hp["ecc"],
        SR=hp["sr"],
        P_DTYPE=P_CODE[ent["dtype"]],
        LOWRANK=low,
        SCALE_F32=hp["scale_dtype"] == torch.float32,
        MAXIMIZE=hp.get("maximize", False),
        **meta,
    )
