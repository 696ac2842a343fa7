"""Hopper (sm_90) kernel of plan sampling's first level, written in Gluon.

The same outputs as ``sampling._sample_blocks_kernel`` (the math is in
:mod:`flashsinkhorn.sampling`): for every row i and every column tile t (a block of 128
global columns: tile t holds the local columns ``[128 t - off, 128 t + 128 - off)``),
``lz_it = log2 sum_{j in t} exp2(s_ij)`` with ``s_ij = dot_scale <x_i, y_j> + bias_j``,
and per row the best ``lz_it - log2 E_it`` over the tiles that take part, its tile, and
the log2 sums of the first and last tiles.

The schedule is the softmin pass's (``_softmin_hopper``, the TMA ring of ``_gluon_ring``:
one producer warp, two consumer warpgroups of 64 rows, the next tile's wgmma issued before
this tile's exps with one feature chunk per tile, a GEMM main loop with ping-pong turns
with several), and the tile's row sums become one log2 sum per (row, tile) instead of being
added up: one exp2 per score, and per (row, tile) a log2, the block's noise (a hash and two
logs) and a compare. With a guess of the row's LogSumExp the exps take the guess's fixed
per-row shift; a row whose total leaves [2^-60, FLT_MAX] (an overflowed tile, NaN) is
recomputed by a second launch with one warpgroup and each tile's own max (exact; a tile
below 2^-126 of the shifted scale, flushed to zero, carries less than 2^-158 of the row's
mass). Without a guess the main launch takes each tile's own max.

Supported: what ``_gluon_ring.operand_reason`` accepts; no label cost (the dispatcher runs
the Triton kernel for those).
"""

from __future__ import annotations

import math

import torch

from flashsinkhorn._gluon_ring import HAS_GLUON, compile_gluon_sm90, operand_reason, tma_ready
from flashsinkhorn._softmin_hopper import (
    BLOCK_M,
    LN2,
    LOG2E,
    HopperConfig,
    default_config,
    fit_stages,
)

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashsinkhorn._gluon_ring import issue_tile, load_chunk, load_x, produce, release_tile

__all__ = ["sample_blocks_hopper", "compile_sample_for_sm90", "sample_config"]

TILE = 128  # columns per tile: one sampling block (_config.SAMPLE_BLOCK)
SAFE_LO = 2.0**-60
# the blocks compete by cross-multiplying their shifted sums with noises up to 2^5: rows
# above 2^100 go to the fallback launch, so that no product overflows
SAFE_HI = 2.0**100
SHIFT_CENTER = 32.0


def sample_config(D: int, dtype: torch.dtype) -> HopperConfig:
    """The softmin pass's configuration for D, with 128-wide tiles (a tile is a block)."""
    cfg = default_config(D, dtype)
    if cfg.block_n != TILE:
        cfg = fit_stages(
            HopperConfig(
                block_n=TILE,
                block_k=cfg.block_k,
                stages=6,
                pingpong=cfg.pingpong,
                x_resident=cfg.x_resident,
            ),
            D,
            dtype,
        )
    return cfg


if HAS_GLUON:
    _SAFE_LO = gl.constexpr(SAFE_LO)
    _SAFE_HI = gl.constexpr(SAFE_HI)
    _SHIFT_C = gl.constexpr(SHIFT_CENTER)

    # SPEC: (NUM_K, STAGES, NUM_WG, X_RESIDENT, PIPE, PINGPONG) as _gluon_ring, then
    # (ONLINE, FALLBACK)

    @gluon.jit
    def _exp_noise(x):
        """``E = -ln(1 - W) ~ Exp(1)`` for pair keys ``x = rk ^ bk`` (uint32): the hash, W
        (``sampling._log2_exp``'s arithmetic, without its final log2)."""
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        r = x * 0x846CA68B
        w = gl.minimum(
            r.to(gl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10,
            0.99999994039535522,
        )
        series = w * (1.0 + w * (0.5 + w * (0.33333333 + w * (0.25 + w * 0.2))))
        return gl.where(w < 0.0625, series, -0.69314718055994531 * gl.log2(1.0 - w))

    @gluon.jit
    def _fold(t, S, bias, st, ctx, ONLINE: gl.constexpr):
        """Tile t's block into the row state ``st``. Shift mode: ``(l, bl, bE, tile, l0,
        lt)``: the block wins where ``lt / E > bl / bE`` (its shifted sum over its noise,
        compared by cross-multiplication: one log per (row, block), inside E); ONLINE (each
        tile its own max): ``(best, _, _, tile, lz0, lz)`` with the log2 sums themselves."""
        sh, rk, bk_ptr, n_tiles, first_in, last_in, dot_scale = ctx
        l, bl, bE, tile, l0, lt = st
        T = S * dot_scale + gl.expand_dims(bias, 0)
        E = _exp_noise(rk ^ gl.load(bk_ptr + t).to(gl.uint32))
        take = ((t > 0) | (first_in != 0)) & ((t < n_tiles - 1) | (last_in != 0))
        if ONLINE:
            m = gl.max(T, 1)
            m_safe = gl.where(m == float("-inf"), 0.0, m)
            lt = m_safe + gl.log2(gl.sum(gl.exp2(T - gl.expand_dims(m_safe, 1)), 1))
            val = lt - gl.log2(E)
            better = (val > l) & take  # l holds the best value; ties keep the earlier block
            l = gl.where(better, val, l)
        else:
            lt = gl.sum(gl.exp2(T - gl.expand_dims(sh, 1)), 1)
            l = l + lt
            better = (lt * bE > bl * E) & take  # ties keep the earlier block
            bl = gl.where(better, lt, bl)
            bE = gl.where(better, E, bE)
        tile = gl.where(better, t, tile)
        l0 = gl.where(t == 0, lt, l0)
        return l, bl, bE, tile, l0, lt

    @gluon.jit
    def _consumer(args, SPEC: gl.constexpr, WG: gl.constexpr, INLINE_LOADS: gl.constexpr):
        """One warpgroup's pass over every column tile for its 64 rows, then its stores."""
        ring, ptrs, sizes, scal, x_bar, turn = args
        x_desc, y_desc, x_smem, y_smem, ready, empty = ring
        bias_ptr, sh_ptr, rk_ptr, bk_ptr, val_ptr, tile_ptr, lz0_ptr, lzl_ptr, flag_ptr = ptrs
        b, row0, N, Mpad, n_tiles, xrow0, yrow0, first_in, last_in = sizes
        dot_scale = scal
        NUM_K: gl.constexpr = SPEC[0]
        X_RESIDENT: gl.constexpr = SPEC[3]
        PIPE: gl.constexpr = SPEC[4]
        ONLINE: gl.constexpr = SPEC[6]
        FALLBACK: gl.constexpr = SPEC[7]
        BN: gl.constexpr = y_desc.block_type.shape[0]
        BM: gl.constexpr = x_desc.block_type.shape[0]
        KI: gl.constexpr = 256 // y_desc.dtype.primitive_bitwidth  # wgmma K: 8 tf32, 16 bf16
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, KI]
        )
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        COL: gl.constexpr = gl.SliceLayout(0, MMA)
        EARLY: gl.constexpr = not PIPE
        total = n_tiles * NUM_K

        rows = row0 + WG * BM + gl.arange(0, BM, layout=ROW)
        row_mask = rows < N
        cols = gl.arange(0, BN, layout=COL)
        base_r = b * N
        bias_row = bias_ptr + b * Mpad
        rk = gl.load(rk_ptr + base_r + rows, mask=row_mask, other=0).to(gl.uint32)
        sh = gl.load(sh_ptr + base_r + rows, mask=row_mask, other=0.0)  # guess - SHIFT_CENTER
        zero = gl.zeros([BM], gl.float32, ROW)
        if ONLINE:  # (best value, -, -, tile, lz of tile 0, lz of the last)
            ninf = gl.full([BM], float("-inf"), gl.float32, ROW)
            st = (ninf, zero, zero, gl.zeros([BM], gl.int32, ROW), ninf, ninf)
        else:  # (total, best block's sum, its noise, tile, sum of tile 0, of the last)
            st = (zero, zero, zero + 1.0, gl.zeros([BM], gl.int32, ROW), zero, zero)
        ctx = (sh, rk, bk_ptr, n_tiles, first_in, last_in, dot_scale)
        if X_RESIDENT:
            mbarrier.wait(x_bar, 0)

        if PIPE:
            acc = issue_tile(
                0, total, *ring, turn, xrow0, yrow0, SPEC, WG, MMA, INLINE_LOADS, False
            )
            S = warpgroup_mma_wait(0, deps=(acc,))
            release_tile(0, total, *ring, xrow0, yrow0, SPEC, INLINE_LOADS, False)
            bias = gl.load(bias_row + cols)
            for j in range(n_tiles - 1):
                # tile j + 1 goes to the tensor cores, then tile j's exps run meanwhile
                acc = issue_tile(
                    j + 1, total, *ring, turn, xrow0, yrow0, SPEC, WG, MMA, INLINE_LOADS, False
                )
                bias_next = gl.load(bias_row + (j + 1) * BN + cols)
                st = _fold(j, S, bias, st, ctx, ONLINE)
                S = warpgroup_mma_wait(0, deps=(acc,))
                release_tile(j + 1, total, *ring, xrow0, yrow0, SPEC, INLINE_LOADS, False)
                bias = bias_next
            st = _fold(n_tiles - 1, S, bias, st, ctx, ONLINE)
        else:
            for j in range(n_tiles):
                acc = issue_tile(
                    j, total, *ring, turn, xrow0, yrow0, SPEC, WG, MMA, INLINE_LOADS, EARLY
                )
                bias = gl.load(bias_row + j * BN + cols)
                S = warpgroup_mma_wait(0, deps=(acc,))
                release_tile(j, total, *ring, xrow0, yrow0, SPEC, INLINE_LOADS, EARLY)
                st = _fold(j, S, bias, st, ctx, ONLINE)

        l, bl, bE, tile, l0, lt = st
        if ONLINE:
            best, lz0, lz = l, l0, lt
        else:  # back to log2 units: the shift plus the logs of the kept sums
            best = sh + gl.log2(bl / bE)
            lz0 = sh + gl.log2(l0)
            lz = sh + gl.log2(lt)
        if FALLBACK:
            flags = gl.load(flag_ptr + base_r + rows, mask=row_mask, other=0)
            st_mask = row_mask & (flags != 0)
        else:
            st_mask = row_mask
        gl.store(val_ptr + base_r + rows, best, mask=st_mask)
        gl.store(tile_ptr + base_r + rows, tile, mask=st_mask)
        gl.store(lz0_ptr + base_r + rows, lz0, mask=st_mask)
        gl.store(lzl_ptr + base_r + rows, lz, mask=st_mask)
        if not ONLINE:
            bad = (((l >= _SAFE_LO) & (l <= _SAFE_HI)) == 0) & row_mask  # NaN fails both
            gl.store(flag_ptr + base_r + rows, bad.to(gl.int8), mask=row_mask)

    @gluon.jit
    def _sample_sm90_kernel(
        x_desc,
        y_desc,
        bias_ptr,
        sh_ptr,
        rk_ptr,
        bk_ptr,
        val_ptr,
        tile_ptr,
        lz0_ptr,
        lzl_ptr,
        flag_ptr,
        N,
        M,
        Mpad,
        n_tiles,
        off,
        first_in,
        last_in,
        dot_scale,
        SPEC: gl.constexpr,
    ):
        NUM_K: gl.constexpr = SPEC[0]
        STAGES: gl.constexpr = SPEC[1]
        NUM_WG: gl.constexpr = SPEC[2]
        X_RESIDENT: gl.constexpr = SPEC[3]
        FALLBACK: gl.constexpr = SPEC[7]
        BM: gl.constexpr = x_desc.block_type.shape[0]
        pid = gl.program_id(0)
        b = gl.program_id(1).to(gl.int64)
        row0 = pid * (BM * NUM_WG)
        go = True
        if FALLBACK:
            FL: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
            r = row0 + gl.arange(0, BM * NUM_WG, layout=FL)
            flags = gl.load(flag_ptr + b * N + r, mask=r < N, other=0)
            go = gl.max(flags.to(gl.int32), 0) > 0
        if go:
            xrow0 = (b * N + row0).to(gl.int32)
            # tile t starts at local column 128 t - off: rows before this problem's first
            # (TMA zeros, or the previous problem's points) meet a bias of -inf
            yrow0 = (b * M - off).to(gl.int32)
            if X_RESIDENT:
                x_smem = gl.allocate_shared_memory(
                    x_desc.dtype, [NUM_WG * NUM_K] + x_desc.block_type.shape, x_desc.layout
                )
            else:
                x_smem = gl.allocate_shared_memory(
                    x_desc.dtype, [STAGES * NUM_WG] + x_desc.block_type.shape, x_desc.layout
                )
            y_smem = gl.allocate_shared_memory(
                y_desc.dtype, [STAGES] + y_desc.block_type.shape, y_desc.layout
            )
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            x_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
                mbarrier.init(empty.index(i), count=NUM_WG)
            mbarrier.init(x_bar, count=1)
            for i in gl.static_range(2):
                mbarrier.init(turn.index(i), count=1)
            ring = (x_desc, y_desc, x_smem, y_smem, ready, empty)
            ptrs = (bias_ptr, sh_ptr, rk_ptr, bk_ptr, val_ptr, tile_ptr, lz0_ptr, lzl_ptr, flag_ptr)
            sizes = (b, row0, N, Mpad, n_tiles, xrow0, yrow0, first_in, last_in)
            args = (ring, ptrs, sizes, dot_scale, x_bar, turn)
            if not FALLBACK:
                pargs = (x_desc, y_desc, x_smem, y_smem, ready, empty, x_bar, n_tiles, xrow0, yrow0)
                gl.warp_specialize(
                    [
                        (_consumer, (args, SPEC, 0, False)),
                        (_consumer, (args, SPEC, 1, False)),
                        (produce, (pargs, SPEC)),
                    ],
                    [4, 1],
                    [232, 24],
                )
            else:
                if X_RESIDENT:
                    load_x(x_desc, x_smem, x_bar, xrow0, SPEC)
                total = n_tiles * NUM_K
                for t in gl.static_range(STAGES):
                    if t < total:
                        load_chunk(t, x_desc, y_desc, x_smem, y_smem, ready, xrow0, yrow0, SPEC)
                _consumer(args, SPEC, 0, True)
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(i))
                mbarrier.invalidate(empty.index(i))
            mbarrier.invalidate(x_bar)
            for i in gl.static_range(2):
                mbarrier.invalidate(turn.index(i))


def _descriptors(x2, y2, cfg: HopperConfig):
    gdt = gl.bfloat16 if x2.dtype == torch.bfloat16 else gl.float32
    blocks = ([BLOCK_M, cfg.block_k], [cfg.block_n, cfg.block_k])
    return tuple(
        TensorDescriptor.from_tensor(t, blk, gl.NVMMASharedLayout.get_default_for(blk, gdt))
        for t, blk in zip((x2, y2), blocks)
    )


def _spec(cfg: HopperConfig, D: int, online: bool, fallback_pass: bool):
    nk = -(-D // cfg.block_k)
    pipe = nk == 1 and not fallback_pass
    return (
        nk,
        cfg.stages,
        1 if fallback_pass else 2,
        cfg.x_resident,
        pipe,
        cfg.pingpong and not fallback_pass,
        online,
        fallback_pass,
    )


def sample_blocks_hopper(
    x, y, bias, rk, bk, *, eps, c2, precision, off, first_in, last_in, guess=None, config=None
):
    """The first level of :func:`flashsinkhorn.sampling.sample_chunk` on sm_90: returns
    ``(val, tile int32, lz0, lzl)`` (B, N) as the Triton kernel. x (B, N, D), y (B, M, D):
    kernel operands; bias (B, M) the fused column vector in log2 units; rk (B, N), bk
    (n_tiles,): row and block keys (int32 bits); off: the chunk's column offset within its
    block; guess: optional (B, N) estimate of ``-eps ln sum_j exp(S_ij)``. Raises
    ``NotImplementedError`` for inputs it does not take."""
    reason = operand_reason(x, y, precision)
    if reason is not None:
        raise NotImplementedError(reason)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite positive number; got {eps}")
    B, N, D = x.shape
    M = y.shape[1]
    cfg = config or sample_config(D, x.dtype)
    if cfg.block_n != TILE:
        raise ValueError(f"config.block_n must be {TILE} (a tile is a sampling block)")
    dev, f32 = x.device, torch.float32
    n_tiles = bk.shape[0]
    Mpad = n_tiles * TILE
    bias_p = torch.full((B, Mpad), float("-inf"), device=dev, dtype=f32)
    bias_p[:, off : off + M] = bias
    val, lz0, lzl = (torch.empty((B, N), device=dev, dtype=f32) for _ in range(3))
    tile = torch.empty((B, N), device=dev, dtype=torch.int32)
    online = guess is None
    if online:
        sh = val  # unused (a (B, N) buffer: the kernel reads its rows' entries anyway)
    else:  # the shift in log2 units: the guess's LogSumExp minus the center
        sh = (guess.to(f32) * (-1.0 / (eps * LN2)) - SHIFT_CENTER).contiguous()
    flags = torch.empty((B, N), device=dev, dtype=torch.int8) if not online else tile
    descs = _descriptors(tma_ready(x).view(B * N, D), tma_ready(y).view(B * M, D), cfg)
    bufs = (bias_p, sh, rk.contiguous(), bk.contiguous(), val, tile, lz0, lzl, flags)
    sizes = (N, M, Mpad, n_tiles, off, int(first_in), int(last_in), float(c2 * LOG2E / eps))
    with torch.cuda.device(dev):
        _sample_sm90_kernel[(-(-N // (2 * BLOCK_M)), B)](
            *descs, *bufs, *sizes, SPEC=_spec(cfg, D, online, False), num_warps=4
        )
        if not online:  # one warpgroup per 64 rows, only where a row was flagged
            _sample_sm90_kernel[(-(-N // BLOCK_M), B)](
                *descs, *bufs, *sizes, SPEC=_spec(cfg, D, True, True), num_warps=4
            )
    return val, tile, lz0, lzl


def compile_sample_for_sm90(
    D: int, dtype=torch.float32, config=None, *, online=False, fallback_pass=False
):
    """The kernel compiled for sm_90 without a GPU (``.asm``, ``.metadata``)."""
    if not HAS_GLUON:
        raise NotImplementedError("triton with the Hopper Gluon API is not installed")
    cfg = config or sample_config(D, dtype)
    rows = 256
    descs = _descriptors(torch.zeros(rows, D, dtype=dtype), torch.zeros(rows, D, dtype=dtype), cfg)
    f = torch.zeros(rows, dtype=torch.float32)
    i32 = torch.zeros(rows, dtype=torch.int32)
    i8 = torch.zeros(rows, dtype=torch.int8)
    args = (*descs, f, f, i32, i32, f, i32, f, f, i8, rows, rows, rows, 2, 0, 1, 1, 1.0)
    kwargs = dict(SPEC=_spec(cfg, D, online, fallback_pass), num_warps=4)
    return compile_gluon_sm90(_sample_sm90_kernel, args, kwargs)
