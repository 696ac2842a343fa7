"""Hopper (sm_90) kernel of the streaming row-LSE pass ("softmin"), written in Gluon.

The same pass as the Triton kernels in ``_softmin_triton.py`` (``_softmin_kernel`` and
``_softmin_shift_kernel``): for every row ``i`` of a batch of clouds x (B, N, D) against
y (B, M, D),

    lse2_i = log2 sum_j exp2( dot_scale <x_i, y_j> + bias_j )      (log2 units)
    out_i  = damping * (cx_i - eps ln2 lse2_i)

with ``bias_j = log2e (log b_j + (g_j - cy_j) / eps)`` and ``dot_scale = c2 log2e / eps``.
Here the schedule is written out instead of left to Triton's pipeliner (design notes:
docs/design/flashsinkhorn-hopper.md):

- the operands move by TMA into a ring of shared-memory stages, each guarded by a "ready"
  mbarrier (transaction bytes) and, in the warp-specialized kernel, an "empty" mbarrier;
- the scores come from async wgmma (A = the CTA's rows of x, resident in shared memory
  when they fit, B = the column tile of y), accumulated in fp32 registers;
- warp specialization: one producer warp issues every TMA load, two consumer warpgroups
  (64 rows each) share the column tiles and run unsynchronized, so one does its exps while
  the other's wgmma runs;
- one feature chunk per tile (d <= 128 fp32, d <= 256 bf16): the wgmma of column tile
  j + 1 is issued before the exps of tile j ("pipe"), so the tensor cores and the exp
  units (MUFU) work at the same time inside one warpgroup too;
- several chunks per tile (larger d): a GEMM main loop per tile, chunks released as their
  wgmma retire, the two consumers taking turns to start a tile (FlashAttention-3's
  ping-pong) so that their exps do not coincide;
- per-row shift: with a guess of the result (the potential being updated, as the Sinkhorn
  loops pass it) the rows sum ``exp2(score - sh_i)`` with a fixed shift and no running
  max; rows whose sum is out of the safe range are recomputed by a second launch of the
  same kernel with the online max and one consumer warpgroup that issues its own loads
  (``FALLBACK``; it skips row blocks with no such row before touching memory), so the
  result is exact whatever the guess. Without a guess the main launch runs the online max
  itself.

The configurations that measured slower on the H200 (one consumer warpgroup, no overlap,
ping-pong turns at d = 64, 64-wide tiles, polynomial exp2 tiles) left with their numbers
in docs/design/flashsinkhorn-hopper.md.

Supported: CUDA sm_90, fp32 operands (tf32 products; round them to tf32 first, as
``operands.kernel_operands`` does) or bf16 operands, D with 16-byte rows (fp32: D % 4 == 0;
bf16: D % 8 == 0), up to 4096 features, any B, N, M. Everything else (labels, the V
average, other precisions, other GPUs, triton without Gluon) raises ``NotImplementedError``
naming the reason, which a dispatcher catches to run the Triton kernel instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from flashsinkhorn._gluon_ring import (
    HAS_GLUON,
    elem_bytes,
    one_chunk_width,
    operand_reason,
    tma_ready,
)
from flashsinkhorn._gluon_ring import compile_gluon_sm90 as compile_gluon_sm90

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashsinkhorn._gluon_ring import issue_tile, load_chunk, load_x, release_tile

__all__ = [
    "HopperConfig",
    "HAS_GLUON",
    "default_config",
    "fit_stages",
    "softmin_hopper",
    "softmin_rows_hopper",
    "unsupported_reason",
    "compile_for_sm90",
    "smem_bytes",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BLOCK_M = 64  # rows per consumer warpgroup (one wgmma M = 64 per warpgroup)
CONSUMER_REGS = 232  # per-thread registers of the consumer partitions (setmaxnreg)
PRODUCER_REGS = 24  # of the TMA producer warp
SMEM_LIMIT = 232448  # bytes of shared memory one CTA may use on sm_90 (227 KiB)
# the fixed shift aims every row sum at 2^SHIFT_CENTER (as the Triton "shift" variant)
SHIFT_CENTER = 32.0
SAFE_LO = 2.0**-60  # below: flushed terms (< 2^-126 each, at most M of them) may matter
SAFE_HI = 3.4028234663852886e38  # float32 max; above: inf (an overflowed term) or NaN


@dataclass(frozen=True)
class HopperConfig:
    """Launch configuration of the main (warp-specialized, two consumer) launch.

    block_n: columns per tile (wgmma N): 128, or 256 with several feature chunks per tile.
    block_k: features per shared-memory chunk. stages: chunks in the ring (with one chunk
    per tile at least 2: tile j + 1's chunk lands while tile j's is read). pingpong (several
    chunks per tile only): the consumers take turns to start a tile. x_resident: keep the
    CTA's rows of x in shared memory for the whole pass (else they stream through the ring
    with y).
    """

    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    pingpong: bool = False
    x_resident: bool = True

    @property
    def rows(self) -> int:
        """Rows of x per CTA of the main launch (two consumer warpgroups)."""
        return 2 * BLOCK_M


def smem_bytes(cfg: HopperConfig, D: int, dtype: torch.dtype) -> int:
    """Shared memory of the operand buffers (the compiler adds barriers and alignment)."""
    e = elem_bytes(dtype)
    nk = -(-D // cfg.block_k)
    x_chunks = 2 * nk if cfg.x_resident else cfg.stages * 2
    return (x_chunks * BLOCK_M + cfg.stages * cfg.block_n) * cfg.block_k * e


def default_config(D: int, dtype: torch.dtype) -> HopperConfig:
    """The configuration used when none is passed, per regime (H200 call 1, 2026-12-01,
    n = m = 50k; docs/design/flashsinkhorn-hopper.md): one feature chunk per tile: 128-wide
    tiles, 4 stages, x resident (d = 64: 1.224 ms tf32, 0.975 bf16); several chunks with x
    resident: 128-wide tiles, ping-pong (d = 512 bf16: 4.12 ms); x streamed: 256-wide tiles,
    ping-pong (d = 512 tf32: 6.92 ms against 8.60 at 128)."""
    e = elem_bytes(dtype)
    one_chunk = one_chunk_width(D)
    if one_chunk * e <= 512:  # d <= 128 fp32, d <= 256 bf16: one chunk per tile, x resident
        return fit_stages(HopperConfig(block_k=one_chunk, stages=4), D, dtype)
    bk = 128 // e  # one 128-byte swizzle row per chunk row
    cfg = HopperConfig(block_k=bk, stages=8, pingpong=True, x_resident=True)
    if smem_bytes(replace(cfg, stages=4), D, dtype) > SMEM_LIMIT - 8192:
        # x streams through the ring with y: wider tiles halve its share of the L2 traffic
        cfg = HopperConfig(block_n=256, block_k=bk, stages=4, pingpong=True, x_resident=False)
    return fit_stages(cfg, D, dtype)


def fit_stages(cfg: HopperConfig, D: int, dtype: torch.dtype) -> HopperConfig:
    """``cfg`` with as many of its stages as fit in shared memory (at least 2), with 8 KiB
    left for barriers, alignment and the compiler's scratch."""
    while cfg.stages > 2 and smem_bytes(cfg, D, dtype) > SMEM_LIMIT - 8192:
        cfg = replace(cfg, stages=cfg.stages - 1)
    return cfg


def _check_config(cfg: HopperConfig, D: int, dtype: torch.dtype) -> None:
    e = elem_bytes(dtype)
    nk = -(-D // cfg.block_k)
    if cfg.block_n not in (128, 256):
        raise ValueError(f"config.block_n must be 128 or 256; got {cfg.block_n}")
    row = cfg.block_k * e  # bytes per chunk row: TMA boxes of at most one 128-byte swizzle
    if cfg.block_k % 16 or row < 32 or cfg.block_k > 256 or (row > 128 and row % 128):
        raise ValueError(
            "config.block_k must be a multiple of 16, at most 256, with 32 to 128 bytes per "
            f"row or a multiple of 128; got {cfg.block_k}"
        )
    if nk == 1 and cfg.block_n != 128:
        # one chunk per tile keeps two accumulators live (tile j + 1 and tile j)
        raise ValueError("config.block_n must be 128 with one feature chunk per tile")
    if nk == 1 and cfg.pingpong:
        raise ValueError("config.pingpong needs several feature chunks per tile")
    if cfg.stages < 2:
        # one chunk: tile j + 1 lands while tile j is read; several: a chunk's stage is
        # released only after the next chunk's wgmma is issued
        raise ValueError(f"config.stages must be >= 2; got {cfg.stages}")
    if smem_bytes(cfg, D, dtype) > SMEM_LIMIT:
        raise ValueError(
            f"config needs {smem_bytes(cfg, D, dtype)} bytes of shared memory at D = {D} "
            f"({dtype}); sm_90 allows {SMEM_LIMIT}"
        )


def unsupported_reason(
    x: torch.Tensor,
    y: torch.Tensor,
    precision: str = "tf32",
    *,
    v=None,
    labels=None,
    center=None,
) -> str | None:
    """Why :func:`softmin_hopper` cannot run these operands (None: it can). Cheap (no
    launch, no sync); the dispatcher may call it before trying the kernel."""
    if v is not None:
        return "the V average (plan application) is not implemented in the Hopper kernel"
    if labels is not None:
        return "the label cost is not implemented in the Hopper kernel"
    if center is not None:
        return "center= is not implemented in the Hopper kernel (pass centered operands)"
    return operand_reason(x, y, precision)


if HAS_GLUON:
    _SAFE_LO = gl.constexpr(SAFE_LO)
    _SAFE_HI = gl.constexpr(SAFE_HI)
    _SHIFT_C = gl.constexpr(SHIFT_CENTER)
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)

    # SPEC, the kernel's compile-time mode, one constexpr tuple (the partitions of
    # warp_specialize receive it whole):
    # (NUM_K, STAGES, NUM_WG, X_RESIDENT, PIPE, PINGPONG, ONLINE, HAS_LSE, COUNT, FALLBACK)
    # The main launch is warp-specialized with NUM_WG = 2 consumers; the FALLBACK launch has
    # one warpgroup that issues its own loads (NUM_WG = 1, no PIPE, no PINGPONG).

    @gluon.jit
    def _lse_tile(S, bias, sh, l, m, dot_scale, ONLINE: gl.constexpr):
        """Fold a column tile's dots S (BLOCK_M, BN) into the row sums. Shift mode: one FFMA
        (scale and column bias), one FADD (the row's fixed shift), one exp2 and one FADD per
        score. ONLINE: the running max m and the rescale of l (FlashAttention's)."""
        s = S * dot_scale + gl.expand_dims(bias, 0)
        if ONLINE:
            m_new = gl.maximum(m, gl.max(s, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m - m_safe)
            p = gl.exp2(s - gl.expand_dims(m_safe, 1))
            l = l * alpha + gl.sum(p, 1)
            m = m_new
        else:
            l = l + gl.sum(gl.exp2(s - gl.expand_dims(sh, 1)), 1)
        return l, m

    @gluon.jit
    def _consumer(args, SPEC: gl.constexpr, WG: gl.constexpr, INLINE_LOADS: gl.constexpr):
        """One warpgroup's pass over every column tile for its 64 rows, then its epilogue."""
        (
            x_desc,
            y_desc,
            x_smem,
            y_smem,
            ready,
            empty,
            x_bar,
            turn,
            bias_ptr,
            cx_ptr,
            guess_ptr,
            out_ptr,
            lse_ptr,
            flag_ptr,
            cnt_ptr,
            b,
            row0,
            N,
            Mpad,
            n_tiles,
            xrow0,
            yrow0,
            dot_scale,
            eps_ln2,
            damping,
        ) = args
        NUM_K: gl.constexpr = SPEC[0]
        X_RESIDENT: gl.constexpr = SPEC[3]
        PIPE: gl.constexpr = SPEC[4]
        ONLINE: gl.constexpr = SPEC[6]
        HAS_LSE: gl.constexpr = SPEC[7]
        COUNT: gl.constexpr = SPEC[8]
        FALLBACK: gl.constexpr = SPEC[9]
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
        ring = (x_desc, y_desc, x_smem, y_smem, ready, empty)

        rows = row0 + WG * BM + gl.arange(0, BM, layout=ROW)
        row_mask = rows < N
        cols = gl.arange(0, BN, layout=COL)
        base_r = b * N
        bias_row = bias_ptr + b * Mpad
        cx = gl.load(cx_ptr + base_r + rows, mask=row_mask, other=0.0)
        if ONLINE:
            sh = cx  # unused
        else:
            guess = gl.load(guess_ptr + base_r + rows, mask=row_mask, other=0.0)
            # the guess of out = damping (cx - eps ln2 lse2), solved for lse2, minus the
            # center: the row sums land near 2^SHIFT_CENTER when the guess is right
            sh = (cx - guess / damping) / eps_ln2 - _SHIFT_C
        l = gl.zeros([BM], gl.float32, ROW)
        m = gl.full([BM], float("-inf"), gl.float32, ROW)
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
                l, m = _lse_tile(S, bias, sh, l, m, dot_scale, ONLINE)
                S = warpgroup_mma_wait(0, deps=(acc,))
                release_tile(j + 1, total, *ring, xrow0, yrow0, SPEC, INLINE_LOADS, False)
                bias = bias_next
            l, m = _lse_tile(S, bias, sh, l, m, dot_scale, ONLINE)
        else:
            for j in range(n_tiles):
                acc = issue_tile(
                    j, total, *ring, turn, xrow0, yrow0, SPEC, WG, MMA, INLINE_LOADS, EARLY
                )
                bias = gl.load(bias_row + j * BN + cols)
                S = warpgroup_mma_wait(0, deps=(acc,))
                release_tile(j, total, *ring, xrow0, yrow0, SPEC, INLINE_LOADS, EARLY)
                l, m = _lse_tile(S, bias, sh, l, m, dot_scale, ONLINE)

        # epilogue: lse2, out, and (shift mode) which rows the fallback launch must redo
        if ONLINE:
            lse2 = m + gl.log2(l)
        else:
            lse2 = sh + gl.log2(l)
        out = damping * (cx - eps_ln2 * lse2)
        if FALLBACK:
            flags = gl.load(flag_ptr + base_r + rows, mask=row_mask, other=0)
            st_mask = row_mask & (flags != 0)
        else:
            st_mask = row_mask
        gl.store(out_ptr + base_r + rows, out, mask=st_mask)
        if HAS_LSE:
            gl.store(lse_ptr + base_r + rows, lse2, mask=st_mask)
        if not ONLINE:
            bad = (((l >= _SAFE_LO) & (l <= _SAFE_HI)) == 0) & row_mask  # NaN fails both
            gl.store(flag_ptr + base_r + rows, bad.to(gl.int8), mask=row_mask)
            if COUNT:  # diagnostics (tests, check script): rows handed to the fallback
                gl.atomic_add(cnt_ptr, gl.sum(bad.to(gl.int32), 0))

    @gluon.jit
    def _producer(args, SPEC: gl.constexpr, WG: gl.constexpr, INLINE_LOADS: gl.constexpr):
        """The "ws" producer warp: x once (when resident), then every ring chunk in order,
        each after its stage's empty barrier says all consumers are done with it."""
        (
            x_desc,
            y_desc,
            x_smem,
            y_smem,
            ready,
            empty,
            x_bar,
            turn,
            bias_ptr,
            cx_ptr,
            guess_ptr,
            out_ptr,
            lse_ptr,
            flag_ptr,
            cnt_ptr,
            b,
            row0,
            N,
            Mpad,
            n_tiles,
            xrow0,
            yrow0,
            dot_scale,
            eps_ln2,
            damping,
        ) = args
        NUM_K: gl.constexpr = SPEC[0]
        STAGES: gl.constexpr = SPEC[1]
        if SPEC[3]:  # X_RESIDENT
            load_x(x_desc, x_smem, x_bar, xrow0, SPEC)
        for t in range(n_tiles * NUM_K):
            s = t % STAGES
            # mbarriers start in the completed state of phase "-1": the first round passes
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            load_chunk(t, x_desc, y_desc, x_smem, y_smem, ready, xrow0, yrow0, SPEC)

    @gluon.jit
    def _softmin_sm90_kernel(
        x_desc,
        y_desc,
        bias_ptr,
        cx_ptr,
        guess_ptr,
        out_ptr,
        lse_ptr,
        flag_ptr,
        cnt_ptr,
        N,
        M,
        Mpad,
        n_tiles,
        dot_scale,
        eps_ln2,
        damping,
        SPEC: gl.constexpr,
    ):
        NUM_K: gl.constexpr = SPEC[0]
        STAGES: gl.constexpr = SPEC[1]
        NUM_WG: gl.constexpr = SPEC[2]
        X_RESIDENT: gl.constexpr = SPEC[3]
        FALLBACK: gl.constexpr = SPEC[9]
        BM: gl.constexpr = x_desc.block_type.shape[0]
        pid = gl.program_id(0)
        b = gl.program_id(1).to(gl.int64)
        row0 = pid * (BM * NUM_WG)
        go = True
        if FALLBACK:
            # the second launch of shift mode: only row blocks with a flagged row run
            FL: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
            r = row0 + gl.arange(0, BM * NUM_WG, layout=FL)
            flags = gl.load(flag_ptr + b * N + r, mask=r < N, other=0)
            go = gl.max(flags.to(gl.int32), 0) > 0
        if go:
            xrow0 = (b * N + row0).to(gl.int32)
            yrow0 = (b * M).to(gl.int32)
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
            # ping-pong: turn[w] says consumer w may issue its next tile's wgmma
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
                mbarrier.init(empty.index(i), count=NUM_WG)
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
                bias_ptr,
                cx_ptr,
                guess_ptr,
                out_ptr,
                lse_ptr,
                flag_ptr,
                cnt_ptr,
                b,
                row0,
                N,
                Mpad,
                n_tiles,
                xrow0,
                yrow0,
                dot_scale,
                eps_ln2,
                damping,
            )
            if not FALLBACK:
                gl.warp_specialize(
                    [
                        (_consumer, (args, SPEC, 0, False)),
                        (_consumer, (args, SPEC, 1, False)),
                        (_producer, (args, SPEC, 0, False)),
                    ],
                    [4, 1],
                    [_CONSUMER_REGS, _PRODUCER_REGS],
                )
            else:
                # one warpgroup: x and the first STAGES chunks now, each refill as soon as
                # the wgmma that read the stage has retired (in release)
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
    x_block = [BLOCK_M, cfg.block_k]
    y_block = [cfg.block_n, cfg.block_k]
    x_desc = TensorDescriptor.from_tensor(
        x2, x_block, gl.NVMMASharedLayout.get_default_for(x_block, gdt)
    )
    y_desc = TensorDescriptor.from_tensor(
        y2, y_block, gl.NVMMASharedLayout.get_default_for(y_block, gdt)
    )
    return x_desc, y_desc


def _spec(cfg: HopperConfig, D: int, online, has_lse, count, fallback_pass):
    """The kernel's SPEC constexpr tuple (see the comment above stage_bytes): the main
    launch has two consumers, the fallback launch one warpgroup without pipe or turns."""
    nk = -(-D // cfg.block_k)
    num_wg = 1 if fallback_pass else 2
    pipe = nk == 1 and not fallback_pass
    pingpong = cfg.pingpong and not fallback_pass
    return (
        nk,
        cfg.stages,
        num_wg,
        cfg.x_resident,
        pipe,
        pingpong,
        online,
        has_lse,
        count,
        fallback_pass,
    )


def _launch(
    grid,
    x2,
    y2,
    bias,
    cx,
    guess,
    out,
    lse,
    flags,
    cnt,
    N,
    M,
    Mpad,
    n_tiles,
    D,
    dot_scale,
    eps_ln2,
    damping,
    cfg,
    *,
    online,
    has_lse,
    count,
    fallback_pass,
):
    x_desc, y_desc = _descriptors(x2, y2, cfg)
    return _softmin_sm90_kernel[grid](
        x_desc,
        y_desc,
        bias,
        cx,
        guess,
        out,
        lse,
        flags,
        cnt,
        N,
        M,
        Mpad,
        n_tiles,
        float(dot_scale),
        float(eps_ln2),
        float(damping),
        SPEC=_spec(cfg, D, online, has_lse, count, fallback_pass),
        num_warps=4,
    )


def softmin_hopper(
    x: torch.Tensor,
    y: torch.Tensor,
    g: torch.Tensor,
    logb: torch.Tensor,
    cx: torch.Tensor,
    cy: torch.Tensor,
    *,
    eps: float,
    c2: float,
    damping: float = 1.0,
    precision: str = "tf32",
    want_lse: bool = False,
    guess: torch.Tensor | None = None,
    v=None,
    labels=None,
    center=None,
    config: HopperConfig | None = None,
    fallback_rows: torch.Tensor | None = None,
):
    """The iteration pass of :func:`flashsinkhorn.softmin` on sm_90 (same arguments and
    results).

    x: (B, N, D), y: (B, M, D) kernel operands (fp32 rounded to tf32 for
    ``precision="tf32"``, bf16 for ``"bf16"``), g, logb, cy: (B, M), cx: (B, N), guess:
    optional (B, N) estimate of ``out`` (then a fixed per-row shift replaces the running
    max; exact whatever the guess). ``config``: a :class:`HopperConfig` (None: the
    default for D and the dtype); ``fallback_rows``: optional (1,) int32 CUDA tensor to
    which the launch adds the number of rows recomputed with the running max.

    Returns ``(out (B, N) fp32, lse2 (B, N) or None)``. Raises ``NotImplementedError``
    (with the reason) for inputs it does not handle: see :func:`unsupported_reason`.
    """
    reason = unsupported_reason(x, y, precision, v=v, labels=labels, center=center)
    if reason is not None:
        raise NotImplementedError(reason)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite positive number; got {eps}")
    if not (math.isfinite(damping) and damping > 0):
        raise ValueError(f"damping must be a finite positive number; got {damping}")
    B, N, D = x.shape
    M = y.shape[1]
    cfg = config or default_config(D, x.dtype)
    _check_config(cfg, D, x.dtype)
    dev = x.device
    f32 = torch.float32
    x2 = tma_ready(x).view(B * N, D)
    y2 = tma_ready(y).view(B * M, D)
    n_tiles = -(-M // cfg.block_n)
    Mpad = n_tiles * cfg.block_n
    # fused column bias (log2 units), padded with -inf to whole tiles: the padding columns
    # (and the next problem's points a tile may read past M) contribute exp2(-inf) = 0
    bias = torch.full((B, Mpad), float("-inf"), device=dev, dtype=f32)
    torch.sub(g.to(f32), cy.to(f32), out=bias[:, :M]).mul_(LOG2E / eps)
    bias[:, :M].add_(logb.to(f32), alpha=LOG2E)
    cx = cx.to(f32).contiguous()
    out = torch.empty((B, N), device=dev, dtype=f32)
    lse = torch.empty((B, N), device=dev, dtype=f32) if want_lse else out
    online = guess is None
    guess = cx if online else guess.to(f32).contiguous()
    flags = torch.empty((B, N), device=dev, dtype=torch.int8) if not online else out
    cnt = fallback_rows if fallback_rows is not None else out
    dot_scale, eps_ln2 = c2 * LOG2E / eps, eps * LN2
    grid = (-(-N // cfg.rows), B)
    with torch.cuda.device(dev):
        _launch(
            grid,
            x2,
            y2,
            bias,
            cx,
            guess,
            out,
            lse,
            flags,
            cnt,
            N,
            M,
            Mpad,
            n_tiles,
            D,
            dot_scale,
            eps_ln2,
            damping,
            cfg,
            online=online,
            has_lse=want_lse,
            count=fallback_rows is not None,
            fallback_pass=False,
        )
        if not online:  # one warpgroup per 64 rows, only where a row was flagged
            _launch(
                (-(-N // BLOCK_M), B),
                x2,
                y2,
                bias,
                cx,
                guess,
                out,
                lse,
                flags,
                cnt,
                N,
                M,
                Mpad,
                n_tiles,
                D,
                dot_scale,
                eps_ln2,
                damping,
                cfg,
                online=True,
                has_lse=want_lse,
                count=False,
                fallback_pass=True,
            )
    return out, (lse if want_lse else None)


def softmin_rows_hopper(x, y, g, logb, cx, cy, *, eps, c2, damping, precision, flags, out):
    """Recompute, in place in ``out`` (B, N), the rows of a pass whose ``flags`` (B, N) are
    nonzero: the fallback launch alone (one warpgroup per 64 rows with the online max; row
    blocks without a flagged row exit after reading their flags, no host sync). Operands
    as :func:`softmin_hopper`; the one passes' exact recomputation of the rows and columns
    whose sums left the safe range (``primitives.symmetric_update``, the self update)."""
    reason = unsupported_reason(x, y, precision)
    if reason is not None:
        raise NotImplementedError(reason)
    B, N, D = x.shape
    M = y.shape[1]
    cfg = default_config(D, x.dtype)
    f32 = torch.float32
    n_tiles = -(-M // cfg.block_n)
    Mpad = n_tiles * cfg.block_n
    bias = torch.full((B, Mpad), float("-inf"), device=x.device, dtype=f32)
    torch.sub(g.to(f32), cy.to(f32), out=bias[:, :M]).mul_(LOG2E / eps)
    bias[:, :M].add_(logb.to(f32), alpha=LOG2E)
    cx = cx.to(f32).contiguous()
    flags = flags.to(torch.int8).contiguous()
    x2, y2 = tma_ready(x).view(B * N, D), tma_ready(y).view(B * M, D)
    with torch.cuda.device(x.device):
        _launch(
            (-(-N // BLOCK_M), B),
            x2,
            y2,
            bias,
            cx,
            cx,
            out,
            out,
            flags,
            out,
            N,
            M,
            Mpad,
            n_tiles,
            D,
            c2 * LOG2E / eps,
            eps * LN2,
            damping,
            cfg,
            online=True,
            has_lse=False,
            count=False,
            fallback_pass=True,
        )
    return out


# ----------------------------------------------------------------------------------------
# offline compilation (no GPU): the CPU test and the check script read resources and SASS
# ----------------------------------------------------------------------------------------


def compile_for_sm90(
    D: int,
    dtype: torch.dtype = torch.float32,
    config: HopperConfig | None = None,
    *,
    online: bool = False,
    has_lse: bool = False,
    count: bool = False,
    fallback_pass: bool = False,
):
    """Compile the kernel for sm_90 without a GPU (triton.compile with an explicit target;
    the operands are small CPU tensors, only their dtypes and alignment matter). Returns
    Triton's compiled kernel: ``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``."""
    if not HAS_GLUON:
        raise NotImplementedError("triton with the Hopper Gluon API is not installed")
    cfg = config or default_config(D, dtype)
    _check_config(cfg, D, dtype)
    rows = 256
    x2 = torch.zeros(rows, D, dtype=dtype)
    y2 = torch.zeros(rows, D, dtype=dtype)
    f = torch.zeros(rows, dtype=torch.float32)
    i8 = torch.zeros(rows, dtype=torch.int8)
    i32 = torch.zeros(1, dtype=torch.int32)
    x_desc, y_desc = _descriptors(x2, y2, cfg)
    args = (x_desc, y_desc, f, f, f, f, f, i8, i32, rows, rows, rows, 2, 1.0, 1.0, 1.0)
    kwargs = dict(SPEC=_spec(cfg, D, online, has_lse, count, fallback_pass), num_warps=4)
    return compile_gluon_sm90(_softmin_sm90_kernel, args, kwargs)
