"""Hopper (sm_90) kernel of the symmetric iteration's one pass, written in Gluon.

The same sums as ``_symmetric_triton.symmetric_sums_triton`` (its docstring has the
math): for clouds x (B, N, D), y (B, M, D) and fp32 biases rb (B, N), cb (B, M) in log2
units, ``p_ij = exp2(dot_scale <x_i, y_j> + rb_i + cb_j)``, the row sums ``R_i`` and the
column sums ``C_j``, one exp2 per score.

The schedule is the softmin pass's (``_softmin_hopper``: TMA ring with ready / empty
mbarriers, one producer warp, two consumer warpgroups with async wgmma, the next tile's
wgmma issued before this tile's exps with one feature chunk per tile, a GEMM main loop with
ping-pong turns with several), with the operands' roles swapped: the CTA's 128 rows of x
are the wgmma's B operand (shared by both consumers, resident in shared memory when they
fit), and each stage holds two 64-row boxes of the next 128 columns of y, one per
consumer, as its A operand. The accumulator is the transposed tile (64 columns of y x 128
rows of x), so

- a tile's column sums are row reductions of the accumulator (within a thread, then the
  4 lanes of a quad), stored as this CTA's partial sums of those columns (a (B, NB, W)
  buffer for a chunk of W columns; no atomics: deterministic);
- the row sums are deferred: each thread adds its two accumulator rows into a (4, 8, 128)
  running sum (one FADD per score, no shuffle), reduced across lanes and warps once at the
  end; each consumer adds its partial to its own slice of a (2, B, N) buffer.

Supported: what ``_softmin_hopper.unsupported_reason`` accepts (sm_90, tf32 / bf16
operands with 16-byte rows); anything else raises ``NotImplementedError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from flashsinkhorn._gluon_ring import (
    HAS_GLUON,
    compile_gluon_sm90,
    elem_bytes,
    one_chunk_width,
    tma_ready,
)
from flashsinkhorn._softmin_hopper import LOG2E, SMEM_LIMIT, unsupported_reason
from flashsinkhorn._symmetric_triton import column_chunk

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashsinkhorn._gluon_ring import tma_load, turn_after

__all__ = [
    "SymmetricConfig",
    "default_symmetric_config",
    "symmetric_sums_hopper",
    "unsupported_reason",
    "compile_symmetric_for_sm90",
    "self_sums_hopper",
]

ROWS = 128  # rows of x per CTA (the wgmma N, shared by the two consumers)
BOX = 64  # columns of y per consumer and tile (the wgmma M)
COLS = 2 * BOX  # columns of y per tile
CONSUMER_REGS = 232
PRODUCER_REGS = 24


@dataclass(frozen=True)
class SymmetricConfig:
    """block_k: features per shared-memory chunk; stages: chunks in the ring (>= 2);
    pingpong (several chunks per tile only): the consumers take turns to start a tile;
    x_resident: the CTA's 128 rows of x stay in shared memory (else they stream with y)."""

    block_k: int = 64
    stages: int = 4
    pingpong: bool = False
    x_resident: bool = True


def smem_bytes(cfg: SymmetricConfig, D: int, dtype: torch.dtype) -> int:
    """Shared memory of the operand buffers (the compiler adds barriers and alignment)."""
    nk = -(-D // cfg.block_k)
    x_chunks = nk if cfg.x_resident else cfg.stages
    return (x_chunks * ROWS + cfg.stages * COLS) * cfg.block_k * elem_bytes(dtype)


def default_symmetric_config(D: int, dtype: torch.dtype) -> SymmetricConfig:
    """The softmin pass's regimes (``_softmin_hopper.default_config``, measured there) with
    128 rows of x per CTA: one feature chunk per tile, 4 stages, x resident; several chunks:
    128-byte chunk rows, ping-pong turns, x resident while 4 stages fit beside it."""
    e = elem_bytes(dtype)
    one_chunk = one_chunk_width(D)
    if one_chunk * e <= 512:
        return _fit(SymmetricConfig(block_k=one_chunk, stages=4), D, dtype)
    cfg = SymmetricConfig(block_k=128 // e, stages=8, pingpong=True, x_resident=True)
    if smem_bytes(replace(cfg, stages=4), D, dtype) > SMEM_LIMIT - 8192:
        cfg = replace(cfg, x_resident=False)
    return _fit(cfg, D, dtype)


def _fit(cfg, D, dtype):
    while cfg.stages > 2 and smem_bytes(cfg, D, dtype) > SMEM_LIMIT - 8192:
        cfg = replace(cfg, stages=cfg.stages - 1)
    return cfg


def _check_config(cfg: SymmetricConfig, D: int, dtype: torch.dtype) -> None:
    row = cfg.block_k * elem_bytes(dtype)
    nk = -(-D // cfg.block_k)
    if cfg.block_k % 16 or row < 32 or cfg.block_k > 256 or (row > 128 and row % 128):
        raise ValueError(
            "config.block_k must be a multiple of 16, at most 256, with 32 to 128 bytes per "
            f"row or a multiple of 128; got {cfg.block_k}"
        )
    if cfg.stages < 2:
        raise ValueError(f"config.stages must be >= 2; got {cfg.stages}")
    if nk == 1 and cfg.pingpong:
        raise ValueError("config.pingpong needs several feature chunks per tile")
    if smem_bytes(cfg, D, dtype) > SMEM_LIMIT:
        raise ValueError(
            f"config needs {smem_bytes(cfg, D, dtype)} bytes of shared memory at D = {D} "
            f"({dtype}); sm_90 allows {SMEM_LIMIT}"
        )


if HAS_GLUON:
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)

    # SPEC: (NUM_K, STAGES, X_RESIDENT, PIPE, PINGPONG, SELF), one constexpr tuple

    @gluon.constexpr_function
    def _stage_bytes(y_bytes, x_bytes, x_resident):
        """Bytes one ring stage receives: two y boxes, plus the x chunk when streamed."""
        return 2 * y_bytes if x_resident else 2 * y_bytes + x_bytes

    @gluon.jit
    def _load_chunk(t, x_desc, y_desc, x_smem, y_smem, ready, xrow0, yrow0, SPEC: gl.constexpr):
        """TMA loads of ring chunk ``t`` (tile t // NUM_K, feature chunk t % NUM_K) into
        stage t % STAGES: consumer w's box of y columns, and x's chunk when it streams."""
        NUM_K: gl.constexpr = SPEC[0]
        STAGES: gl.constexpr = SPEC[1]
        X_RESIDENT: gl.constexpr = SPEC[2]
        BOXM: gl.constexpr = y_desc.block_type.shape[0]
        BK: gl.constexpr = y_desc.block_type.shape[1]
        s = t % STAGES
        j = t // NUM_K
        k = t % NUM_K
        bar = ready.index(s)
        nbytes: gl.constexpr = _stage_bytes(
            y_desc.block_type.nbytes, x_desc.block_type.nbytes, X_RESIDENT
        )
        mbarrier.expect(bar, nbytes)
        for w in gl.static_range(2):
            tma_load(y_desc, [yrow0 + (2 * j + w) * BOXM, k * BK], bar, y_smem.index(2 * s + w))
        if not X_RESIDENT:
            tma_load(x_desc, [xrow0, k * BK], bar, x_smem.index(s))

    @gluon.jit
    def _issue_tile(
        j,
        x_smem,
        y_smem,
        ready,
        empty,
        turn,
        SPEC: gl.constexpr,
        WG: gl.constexpr,
        MMA: gl.constexpr,
        EARLY_RELEASE: gl.constexpr,
        BOXM: gl.constexpr,
        XR: gl.constexpr,
    ):
        """Issue the async wgmma of tile ``j`` (this consumer's 64 columns of y against the
        CTA's 128 rows of x), chunk by chunk as they land; EARLY_RELEASE: a GEMM main loop
        (at most one wgmma in flight, the previous chunk's stage released). Returns the
        in-flight accumulator (64, 128)."""
        NUM_K: gl.constexpr = SPEC[0]
        STAGES: gl.constexpr = SPEC[1]
        X_RESIDENT: gl.constexpr = SPEC[2]
        PINGPONG: gl.constexpr = SPEC[4]
        TURN_AFTER: gl.constexpr = turn_after(NUM_K, STAGES)
        if PINGPONG:
            mbarrier.wait(turn.index(WG), (j & 1) ^ (1 - WG))
        acc = gl.zeros([BOXM, XR], gl.float32, MMA)
        for k in gl.static_range(NUM_K):
            t = j * NUM_K + k
            s = t % STAGES
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
            if X_RESIDENT:
                b = x_smem.index(k).permute((1, 0))
            else:
                b = x_smem.index(s).permute((1, 0))
            acc = warpgroup_mma(y_smem.index(2 * s + WG), b, acc, use_acc=k > 0, is_async=True)
            if PINGPONG and k == TURN_AFTER - 1:
                mbarrier.arrive(turn.index(1 - WG), count=1)
            if EARLY_RELEASE and k > 0:
                acc = warpgroup_mma_wait(1, deps=(acc,))
                mbarrier.arrive(empty.index((t - 1) % STAGES), count=1)
        return acc

    @gluon.jit
    def _release_tile(j, empty, SPEC: gl.constexpr, EARLY_RELEASE: gl.constexpr):
        """Release the stages of tile ``j`` still held after its final wgmma wait."""
        NUM_K: gl.constexpr = SPEC[0]
        STAGES: gl.constexpr = SPEC[1]
        if EARLY_RELEASE:
            mbarrier.arrive(empty.index((j * NUM_K + NUM_K - 1) % STAGES), count=1)
        else:
            for k in gl.static_range(NUM_K):
                mbarrier.arrive(empty.index((j * NUM_K + k) % STAGES), count=1)

    @gluon.jit
    def _tile_sums(T, rbp, racc):
        """One exp2 per score of the tile T = dot_scale S + cb (64 columns of y, 128 rows
        of x) with the rows' biases at ``rbp``; returns the running row sums with this tile
        added and the tile's column sums (64,). The row biases are read again per tile
        (L1 hits; the pass writes no rb): held in registers for the whole pass they
        crowded out the second accumulator, and ptxas issued tile j + 1's wgmma after tile
        j's exps (static sm_90 compile, triton 3.6)."""
        p = gl.exp2(T + gl.expand_dims(gl.load(rbp), 0))
        # rows of the accumulator: warp (4) x register half (2) x lane row (8); the sum over
        # the register half stays within the thread
        racc = racc + gl.sum(gl.reshape(p, [4, 2, 8, p.shape[1]]), 1)
        return racc, gl.sum(p, 1)

    @gluon.jit
    def _store_cols(part_row, rsum_ptr, b, N, cols, csum, c1, j, SELF: gl.constexpr):
        """A tile's column sums: this CTA's partial sums of the chunk (no atomics), or
        (SELF, the debiasing terms: x against itself, tiles J >= I of row block I) added
        to those columns' row sums, except on the diagonal tile (its rows' sums have
        them)."""
        if SELF:
            gl.atomic_add(rsum_ptr + b * N + cols, csum, mask=(cols < c1) & (j > 0))
        else:
            gl.store(part_row + cols, csum, mask=cols < c1)

    @gluon.jit
    def _consumer(args, SPEC: gl.constexpr, WG: gl.constexpr):
        """One consumer's pass over the chunk's tiles (its 64-column half of each), then
        its partial row sums."""
        (
            x_desc,
            y_desc,
            x_smem,
            y_smem,
            ready,
            empty,
            x_bar,
            turn,
            rb_ptr,
            cb_ptr,
            rsum_ptr,
            part_ptr,
            b,
            row0,
            N,
            NP,
            M,
            c0,
            c1,
            W,
            NB,
            n_tiles,
            xrow0,
            yrow0,
            dot_scale,
        ) = args
        X_RESIDENT: gl.constexpr = SPEC[2]
        PIPE: gl.constexpr = SPEC[3]
        SELF: gl.constexpr = SPEC[5]
        EARLY: gl.constexpr = not PIPE
        BOXM: gl.constexpr = y_desc.block_type.shape[0]
        XR: gl.constexpr = x_desc.block_type.shape[0]
        KI: gl.constexpr = 256 // y_desc.dtype.primitive_bitwidth  # wgmma K: 8 tf32, 16 bf16
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, XR, KI]
        )
        YCOL: gl.constexpr = gl.SliceLayout(1, MMA)  # along the accumulator's rows: y
        XROW: gl.constexpr = gl.SliceLayout(0, MMA)  # along its columns: x

        xr = row0 + gl.arange(0, XR, layout=XROW)
        rbp = rb_ptr + b * NP + xr  # padded with -inf to whole row blocks: no mask
        yc = c0 + WG * BOXM + gl.arange(0, BOXM, layout=YCOL)  # this consumer's columns
        cb_row = cb_ptr + b * M
        part_row = part_ptr + (b * NB + gl.program_id(0)) * W - c0
        zero = gl.zeros([BOXM, XR], gl.float32, MMA)
        racc = gl.sum(gl.reshape(zero, [4, 2, 8, XR]), 1)
        if X_RESIDENT:
            mbarrier.wait(x_bar, 0)

        if PIPE:
            acc = _issue_tile(0, x_smem, y_smem, ready, empty, turn, SPEC, WG, MMA, False, BOXM, XR)
            cb = gl.load(cb_row + yc, mask=yc < c1, other=float("-inf"))
            S = warpgroup_mma_wait(0, deps=(acc,))
            _release_tile(0, empty, SPEC, False)
            # the scale and column bias right after the wait: the accumulator's registers
            # are then free for tile j + 1's wgmma while tile j's exps run (no copies)
            T = S * dot_scale + gl.expand_dims(cb, 1)
            for j in range(n_tiles - 1):
                acc = _issue_tile(
                    j + 1, x_smem, y_smem, ready, empty, turn, SPEC, WG, MMA, False, BOXM, XR
                )
                cols = yc + (j + 1) * (2 * BOXM)
                cb = gl.load(cb_row + cols, mask=cols < c1, other=float("-inf"))
                racc, csum = _tile_sums(T, rbp, racc)
                cols = yc + j * (2 * BOXM)
                _store_cols(part_row, rsum_ptr, b, N, cols, csum, c1, j, SELF)
                S = warpgroup_mma_wait(0, deps=(acc,))
                _release_tile(j + 1, empty, SPEC, False)
                T = S * dot_scale + gl.expand_dims(cb, 1)
            racc, csum = _tile_sums(T, rbp, racc)
            cols = yc + (n_tiles - 1) * (2 * BOXM)
            _store_cols(part_row, rsum_ptr, b, N, cols, csum, c1, n_tiles - 1, SELF)
        else:
            for j in range(n_tiles):
                acc = _issue_tile(
                    j, x_smem, y_smem, ready, empty, turn, SPEC, WG, MMA, EARLY, BOXM, XR
                )
                cols = yc + j * (2 * BOXM)
                cb = gl.load(cb_row + cols, mask=cols < c1, other=float("-inf"))
                S = warpgroup_mma_wait(0, deps=(acc,))
                _release_tile(j, empty, SPEC, EARLY)
                racc, csum = _tile_sums(S * dot_scale + gl.expand_dims(cb, 1), rbp, racc)
                _store_cols(part_row, rsum_ptr, b, N, cols, csum, c1, j, SELF)

        # this consumer's row sums over the chunk, added to its own slice of (2, B, N)
        rs = gl.convert_layout(gl.sum(gl.sum(racc, 1), 0), XROW)  # lanes, then warps
        if SELF:  # other CTAs add these rows' column sums
            gl.atomic_add(rsum_ptr + b * N + xr, rs, mask=xr < N)
        else:
            out = rsum_ptr + (WG * gl.num_programs(1) + b) * N + xr
            old = gl.load(out, mask=xr < N, other=0.0)
            gl.store(out, old + rs, mask=xr < N)

    @gluon.jit
    def _producer(args, SPEC: gl.constexpr, WG: gl.constexpr):
        """The producer warp: x once (when resident), then every ring chunk in order, each
        after its stage's empty barrier says both consumers are done with it."""
        (
            x_desc,
            y_desc,
            x_smem,
            y_smem,
            ready,
            empty,
            x_bar,
            turn,
            rb_ptr,
            cb_ptr,
            rsum_ptr,
            part_ptr,
            b,
            row0,
            N,
            NP,
            M,
            c0,
            c1,
            W,
            NB,
            n_tiles,
            xrow0,
            yrow0,
            dot_scale,
        ) = args
        NUM_K: gl.constexpr = SPEC[0]
        STAGES: gl.constexpr = SPEC[1]
        if SPEC[2]:  # X_RESIDENT
            BK: gl.constexpr = x_desc.block_type.shape[1]
            mbarrier.expect(x_bar, NUM_K * x_desc.block_type.nbytes)
            for k in gl.static_range(NUM_K):
                tma_load(x_desc, [xrow0, k * BK], x_bar, x_smem.index(k))
        for t in range(n_tiles * NUM_K):
            s = t % STAGES
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            _load_chunk(t, x_desc, y_desc, x_smem, y_smem, ready, xrow0, yrow0, SPEC)

    @gluon.jit
    def _symmetric_sm90_kernel(
        x_desc,
        y_desc,
        rb_ptr,
        cb_ptr,
        rsum_ptr,
        part_ptr,
        N,
        NP,
        M,
        c0,
        c1,
        W,
        NB,
        n_tiles,
        dot_scale,
        SPEC: gl.constexpr,
    ):
        NUM_K: gl.constexpr = SPEC[0]
        STAGES: gl.constexpr = SPEC[1]
        X_RESIDENT: gl.constexpr = SPEC[2]
        XR: gl.constexpr = x_desc.block_type.shape[0]
        b = gl.program_id(1).to(gl.int64)
        row0 = gl.program_id(0) * XR
        if SPEC[5]:  # SELF: row block I against the column tiles J >= I of the same cloud
            c0 = row0
            n_tiles = (N - row0 + XR - 1) // XR
        xrow0 = (b * N + row0).to(gl.int32)
        yrow0 = (b * M + c0).to(gl.int32)
        if X_RESIDENT:
            x_smem = gl.allocate_shared_memory(
                x_desc.dtype, [NUM_K] + x_desc.block_type.shape, x_desc.layout
            )
        else:
            x_smem = gl.allocate_shared_memory(
                x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout
            )
        y_smem = gl.allocate_shared_memory(
            y_desc.dtype, [2 * STAGES] + y_desc.block_type.shape, y_desc.layout
        )
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        x_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        mbarrier.init(x_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        args = (
            x_desc,
            y_desc,
            x_smem,
            y_smem,
            ready,
            empty,
            x_bar,
            turn,
            rb_ptr,
            cb_ptr,
            rsum_ptr,
            part_ptr,
            b,
            row0,
            N,
            NP,
            M,
            c0,
            c1,
            W,
            NB,
            n_tiles,
            xrow0,
            yrow0,
            dot_scale,
        )
        gl.warp_specialize(
            [
                (_consumer, (args, SPEC, 0)),
                (_consumer, (args, SPEC, 1)),
                (_producer, (args, SPEC, 0)),
            ],
            [4, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
        mbarrier.invalidate(x_bar)
        for i in gl.static_range(2):
            mbarrier.invalidate(turn.index(i))


def _descriptors(x2, y2, cfg: SymmetricConfig):
    gdt = gl.bfloat16 if x2.dtype == torch.bfloat16 else gl.float32
    x_block, y_block = [ROWS, cfg.block_k], [BOX, cfg.block_k]
    x_desc = TensorDescriptor.from_tensor(
        x2, x_block, gl.NVMMASharedLayout.get_default_for(x_block, gdt)
    )
    y_desc = TensorDescriptor.from_tensor(
        y2, y_block, gl.NVMMASharedLayout.get_default_for(y_block, gdt)
    )
    return x_desc, y_desc


def _spec(cfg: SymmetricConfig, D: int, self_pass: bool = False):
    nk = -(-D // cfg.block_k)
    return (nk, cfg.stages, cfg.x_resident, nk == 1, cfg.pingpong, self_pass)


def symmetric_sums_hopper(x, y, rb, cb, *, eps, c2, precision, config=None, chunk=None):
    """Row and column sums ``(R (B, N), C (B, M))`` of ``exp2(c2 log2e / eps <x_i, y_j> +
    rb_i + cb_j)`` on sm_90 (arguments and results as ``symmetric_sums_triton``).
    ``config``: a :class:`SymmetricConfig` (None: the default for D and the dtype);
    ``chunk``: columns per launch (a multiple of 128; None: the buffer cap's)."""
    reason = unsupported_reason(x, y, precision)
    if reason is not None:
        raise NotImplementedError(reason)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite positive number; got {eps}")
    B, N, D = x.shape
    M = y.shape[1]
    cfg = config or default_symmetric_config(D, x.dtype)
    _check_config(cfg, D, x.dtype)
    dev, f32 = x.device, torch.float32
    x_desc, y_desc = _descriptors(tma_ready(x).view(B * N, D), tma_ready(y).view(B * M, D), cfg)
    NB = -(-N // ROWS)
    W = chunk or column_chunk(NB, B, M, COLS)
    if W % COLS:
        raise ValueError(f"chunk must be a multiple of {COLS}; got {W}")
    rsum = torch.zeros((2, B, N), device=dev, dtype=f32)  # one slice per consumer
    csum = torch.empty((B, M), device=dev, dtype=f32)
    part = torch.empty((B, NB, W), device=dev, dtype=f32)
    NP = NB * ROWS  # rb padded with -inf to whole row blocks (the kernel reads it unmasked)
    rbp = torch.full((B, NP), float("-inf"), device=dev, dtype=f32)
    rbp[:, :N] = rb
    cb = cb.to(f32).contiguous()
    spec = _spec(cfg, D)
    with torch.cuda.device(dev):
        for c0 in range(0, M, W):
            c1 = min(M, c0 + W)
            _symmetric_sm90_kernel[(NB, B)](
                x_desc,
                y_desc,
                rbp,
                cb,
                rsum,
                part,
                N,
                NP,
                M,
                c0,
                c1,
                W,
                NB,
                -(-(c1 - c0) // COLS),
                float(c2 * LOG2E / eps),
                SPEC=spec,
                num_warps=4,
            )
            csum[:, c0:c1] = part[:, :, : c1 - c0].sum(dim=1)  # deterministic, no atomics
    return rsum.sum(0), csum


def self_sums_hopper(x, rb, *, eps, c2, precision, config=None):
    """Row sums ``R (B, N)`` of ``exp2(c2 log2e / eps <x_i, x_j> + rb_i + rb_j)`` on sm_90:
    the debiasing (self-transport) update's one pass. The plan of x against itself is
    symmetric: row block I streams only the column tiles J >= I (one CTA per row block,
    the longest first) and each tile J > I gives the rows of I their sums and, from the
    same exps, the rows of J theirs (fp32 atomics; the diagonal tile gives its rows only):
    N^2 / 2 scores instead of N^2. Arguments as :func:`symmetric_sums_hopper`."""
    reason = unsupported_reason(x, x, precision)
    if reason is not None:
        raise NotImplementedError(reason)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite positive number; got {eps}")
    B, N, D = x.shape
    cfg = config or default_symmetric_config(D, x.dtype)
    _check_config(cfg, D, x.dtype)
    dev, f32 = x.device, torch.float32
    x2 = tma_ready(x).view(B * N, D)
    x_desc, y_desc = _descriptors(x2, x2, cfg)
    NB = -(-N // ROWS)
    NP = NB * ROWS
    rbp = torch.full((B, NP), float("-inf"), device=dev, dtype=f32)
    rbp[:, :N] = rb
    rsum = torch.zeros((B, N), device=dev, dtype=f32)
    with torch.cuda.device(dev):
        _symmetric_sm90_kernel[(NB, B)](
            x_desc,
            y_desc,
            rbp,
            rbp[:, :N].contiguous(),
            rsum,
            rsum,
            N,
            NP,
            N,
            0,
            N,
            COLS,
            NB,
            NB,
            float(c2 * LOG2E / eps),
            SPEC=_spec(cfg, D, True),
            num_warps=4,
        )
    return rsum


def compile_symmetric_for_sm90(D: int, dtype=torch.float32, config=None, self_pass=False):
    """The kernel compiled for sm_90 without a GPU (``.asm``, ``.metadata``): CPU tests and
    the check script read its resources and SASS."""
    if not HAS_GLUON:
        raise NotImplementedError("triton with the Hopper Gluon API is not installed")
    cfg = config or default_symmetric_config(D, dtype)
    _check_config(cfg, D, dtype)
    rows = 256
    x_desc, y_desc = _descriptors(
        torch.zeros(rows, D, dtype=dtype), torch.zeros(rows, D, dtype=dtype), cfg
    )
    f = torch.zeros(rows, dtype=torch.float32)
    args = (x_desc, y_desc, f, f, f, f, rows, rows, rows, 0, rows, rows, 2, 2, 1.0)
    kwargs = dict(SPEC=_spec(cfg, D, self_pass), num_warps=4)
    return compile_gluon_sm90(_symmetric_sm90_kernel, args, kwargs)
