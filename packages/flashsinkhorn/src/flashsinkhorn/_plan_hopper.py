"""Hopper (sm_90) kernel of the plan application: the softmin pass with a value matrix V.

For x (B, N, D), y (B, M, D) and V (B, M, DV) the pass computes, for every row i (log2
units, as ``_softmin_hopper``: ``s_ij = dot_scale <x_i, y_j> + bias_j``),

    lse2_i = log2 sum_j exp2(s_ij)
    out_i  = damping (cx_i - eps ln2 lse2_i)
    vbar_i = sum_j exp2(s_ij - lse2_i) V_j                      (the row softmax average)

the pass with ``v`` of :func:`flashsinkhorn.softmin`, from which the envelope gradients,
the extrapolation step, ``plan_apply`` and the barycentric maps follow. It streams the same
tiles as the iteration pass (the shared TMA ring of ``_gluon_ring``: one producer warp,
two consumer warpgroups of 64 rows, the next tile's score wgmma issued before this tile's
exps with one feature chunk per tile) and adds a second ring of V tiles: per column tile,
one exp2 per score gives the weights P (64 x BN, registers), and ``O += P @ V_tile`` runs
on the tensor cores (wgmma with A = P from registers, B = the V tile from shared memory,
fp32 accumulator O of 64 x BLOCK_DV per warpgroup).

- V travels transposed: ``Vt (B, DVpad, Mpad)``, written once per call by the launcher
  (zeros in the padding; tf32 operands rounded to nearest), because tf32 wgmma needs both
  operands K-major (here K = the columns of y).
- Weights: exp2 of the shifted score with the guess's fixed per-row shift (no running
  max, no rescale of O), rounded to tf32 by nearest (the tensor cores would truncate: a
  bias of 2^-11 in every weight) or to bf16, and the row sums add the rounded weights (tf32)
  so that vbar is a convex combination of the V rows.
- Rows whose sum leaves [2^-60, 2^64] (the accumulator stays finite for |V| < 2^64) or
  whose accumulator is not finite are recomputed by a second launch with one warpgroup and
  the online max (O rescaled per tile), only in the row blocks that hold such a row; no
  guess: the main launch runs the online max. Exact whatever the guess.
- DV wider than BLOCK_DV runs one program per chunk of output columns (grid axis 2); each
  recomputes the scores (registers: O is 64 x BLOCK_DV per warpgroup).

Supported: what ``_gluon_ring.operand_reason`` accepts (sm_90, tf32 / bf16 operands with
16-byte rows) and any DV >= 1; anything else raises ``NotImplementedError`` naming the
reason, which the dispatcher (``primitives``) catches to run the Triton kernel.
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
    operand_reason,
    tma_ready,
)
from flashsinkhorn._softmin_hopper import BLOCK_M, LN2, LOG2E, SHIFT_CENTER, SMEM_LIMIT

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashsinkhorn._gluon_ring import (
        issue_tile,
        load_chunk,
        load_x,
        release_tile,
        tma_load,
    )

__all__ = [
    "PlanConfig",
    "default_plan_config",
    "plan_hopper",
    "plan_reason",
    "compile_plan_for_sm90",
    "plan_smem_bytes",
]

CONSUMER_REGS = 232
PRODUCER_REGS = 24
SAFE_LO = 2.0**-60
# the row sums aim at 2^SHIFT_CENTER; up to 2^64 the accumulator of weights times V stays
# finite for |V| < 2^64 (fp32 max 2^128); a larger sum goes to the fallback launch
SAFE_HI_V = 2.0**64


@dataclass(frozen=True)
class PlanConfig:
    """Launch configuration of the plan application.

    block_n: columns of y per tile (64 or 128; the K of the P @ V wgmma). block_k: features
    per chunk of the score ring. stages: chunks in the score ring; v_stages: V tiles in
    theirs. block_dv: output columns per program (the N of the P @ V wgmma, a power of
    two from 16 to 256). pingpong (several feature chunks per tile): the consumers take turns
    to start a tile. x_resident: the CTA's rows of x stay in shared memory.
    """

    block_n: int = 128
    block_k: int = 64
    stages: int = 2
    v_stages: int = 2
    block_dv: int = 64
    pingpong: bool = False
    x_resident: bool = True


def plan_smem_bytes(cfg: PlanConfig, D: int, dtype: torch.dtype) -> int:
    """Shared memory of the operand buffers (the compiler adds barriers and alignment)."""
    e = elem_bytes(dtype)
    nk = -(-D // cfg.block_k)
    x_chunks = 2 * nk if cfg.x_resident else cfg.stages * 2
    score = (x_chunks * BLOCK_M + cfg.stages * cfg.block_n) * cfg.block_k * e
    return score + cfg.v_stages * cfg.block_dv * cfg.block_n * e


def _fit(cfg: PlanConfig, D: int, dtype: torch.dtype) -> PlanConfig:
    """Fewer score stages (at least 2) until the buffers fit with 8 KiB to spare."""
    while cfg.stages > 2 and plan_smem_bytes(cfg, D, dtype) > SMEM_LIMIT - 8192:
        cfg = replace(cfg, stages=cfg.stages - 1)
    return cfg


def default_plan_config(D: int, DV: int, dtype: torch.dtype) -> PlanConfig:
    """The configuration used when none is passed. Not measured yet (the GPU script
    ``tools/flashsinkhorn/gpu_hopper.sh`` times the alternatives): the softmin pass's
    regimes (one feature chunk per tile with x resident; 128-byte chunks with ping-pong
    beyond); with one chunk per tile 128-wide tiles and output chunks of at most 64
    columns, or 64-wide tiles and 128 (registers: two score tiles, the weights and O live
    together); with several, 64-wide tiles and 256 (one score tile at a time)."""
    e = elem_bytes(dtype)
    one_chunk = one_chunk_width(D)
    dv = max(16, 1 << (int(DV) - 1).bit_length())  # TMA boxes: powers of two
    if one_chunk * e <= 512:
        # registers with one chunk per tile (two score tiles live, the weights, O): 64 x 128
        # tiles with O up to 64 wide, 64 x 64 tiles with O up to 128 wide (d = 128 bf16
        # with a 128 x 128 tile and a 128-wide O spilled 88 B in the static compile)
        bn = 128 if dv <= 64 else 64
        cfg = PlanConfig(block_n=bn, block_k=one_chunk, stages=4, block_dv=min(dv, 128))
        for v_stages in (2, 1):
            cfg = replace(cfg, v_stages=v_stages)
            if plan_smem_bytes(replace(cfg, stages=2), D, dtype) <= SMEM_LIMIT - 8192:
                return _fit(cfg, D, dtype)
    bk = 128 // e
    cfg = PlanConfig(block_n=64, block_k=bk, stages=6, block_dv=min(dv, 256), pingpong=True)
    if plan_smem_bytes(replace(cfg, stages=3), D, dtype) > SMEM_LIMIT - 8192:
        cfg = replace(cfg, x_resident=False)
    return _fit(cfg, D, dtype)


def _check_config(cfg: PlanConfig, D: int, dtype: torch.dtype) -> None:
    e = elem_bytes(dtype)
    nk = -(-D // cfg.block_k)
    if cfg.block_n not in (64, 128):
        raise ValueError(f"config.block_n must be 64 or 128; got {cfg.block_n}")
    row = cfg.block_k * e
    if cfg.block_k % 16 or row < 32 or cfg.block_k > 256 or (row > 128 and row % 128):
        raise ValueError(
            "config.block_k must be a multiple of 16, at most 256, with 32 to 128 bytes per "
            f"row or a multiple of 128; got {cfg.block_k}"
        )
    if cfg.block_dv % 16 or not 16 <= cfg.block_dv <= 256:
        raise ValueError(
            f"config.block_dv must be a multiple of 16 in [16, 256]; got {cfg.block_dv}"
        )
    if cfg.block_dv * cfg.block_n > 128 * 128:
        # registers: O (64 x block_dv) beside the score tile and its weights (64 x block_n)
        raise ValueError(f"config.block_dv x block_n must be at most 128 x 128; got {cfg}")
    if nk == 1 and cfg.pingpong:
        raise ValueError("config.pingpong needs several feature chunks per tile")
    if cfg.stages < 2 or cfg.v_stages < 1:
        raise ValueError(f"config.stages must be >= 2 and v_stages >= 1; got {cfg}")
    if plan_smem_bytes(cfg, D, dtype) > SMEM_LIMIT:
        raise ValueError(
            f"config needs {plan_smem_bytes(cfg, D, dtype)} bytes of shared memory at D = {D} "
            f"({dtype}); sm_90 allows {SMEM_LIMIT}"
        )


def plan_reason(x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, precision: str) -> str | None:
    """Why :func:`plan_hopper` cannot run these operands (None: it can). No launch, no sync."""
    reason = operand_reason(x, y, precision)
    if reason is not None:
        return reason
    if v.dim() != 3 or tuple(v.shape[:2]) != (y.shape[0], y.shape[1]) or v.shape[2] == 0:
        return f"v must be (B, M, DV) with DV >= 1 like y (B, M, D); got {tuple(v.shape)}"
    if v.device != x.device:
        return "v must be on the operands' device"
    return None


if HAS_GLUON:
    _SAFE_LO = gl.constexpr(SAFE_LO)
    _SAFE_HI = gl.constexpr(SAFE_HI_V)
    _SHIFT_C = gl.constexpr(SHIFT_CENTER)
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)

    # SPEC: (NUM_K, STAGES, NUM_WG, X_RESIDENT, PIPE, PINGPONG) as _gluon_ring, then
    # (ONLINE, HAS_LSE, COUNT, FALLBACK, VSTAGES)

    @gluon.jit
    def _load_v(j, v_desc, v_smem, vready, vrow0, VSTAGES: gl.constexpr):
        """TMA load of the V tile of column tile ``j`` (BLOCK_DV x BN of Vt) into V stage
        j % VSTAGES, signalled on its ready barrier."""
        BN: gl.constexpr = v_desc.block_type.shape[1]
        s = j % VSTAGES
        mbarrier.expect(vready.index(s), v_desc.block_type.nbytes)
        tma_load(v_desc, [vrow0, j * BN], vready.index(s), v_smem.index(s))

    @gluon.jit
    def _weights(
        T, sh, l, m, O, ONLINE: gl.constexpr, ROUND_TF32: gl.constexpr, OROW: gl.constexpr
    ):
        """The tile's weights from its scores T (64 x BN): one exp2 per score, rounded for
        the tensor cores; the row sums l (and, ONLINE, the running max m with O rescaled)."""
        if ONLINE:
            m_new = gl.maximum(m, gl.max(T, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m - m_safe)
            p = gl.exp2(T - gl.expand_dims(m_safe, 1))
            l = l * alpha
            O = O * gl.expand_dims(gl.convert_layout(alpha, OROW), 1)
            m = m_new
        else:
            p = gl.exp2(T - gl.expand_dims(sh, 1))
        if ROUND_TF32:
            # round to nearest tf32 (10 mantissa bits): the wgmma would truncate
            bits = (p.to(gl.int32, bitcast=True) + 0x1000) & -8192
            p = bits.to(gl.float32, bitcast=True)
        l = l + gl.sum(p, 1)
        return p, l, m, O

    @gluon.jit
    def _apply_v(j, p, O, v_smem, vready, VSTAGES: gl.constexpr, PA: gl.constexpr):
        """Issue ``O += P @ V_j`` (async wgmma, A = the weights from registers)."""
        s = j % VSTAGES
        q = p.to(v_smem.dtype)
        if v_smem.dtype.primitive_bitwidth == 32:
            # tf32: the accumulator holds columns 2a, 2a + 1 of every 8 in lane a of a quad,
            # the A operand wants a, a + 4 there. Relabel the columns (8 k + 2 a + r ->
            # 8 k + 4 r + a): the registers stay where they are (no shuffle), and the
            # launcher stores the V rows in the same order (transposed_values)
            BM: gl.constexpr = p.shape[0]
            BN: gl.constexpr = p.shape[1]
            q = gl.reshape(gl.permute(gl.reshape(q, [BM, BN // 8, 4, 2]), (0, 1, 3, 2)), [BM, BN])
        pa = gl.convert_layout(q, PA)
        mbarrier.wait(vready.index(s), (j // VSTAGES) & 1)
        O = warpgroup_mma(pa, v_smem.index(s).permute((1, 0)), O, is_async=True)
        return O, pa

    @gluon.jit
    def _release_v(
        j,
        n_tiles,
        v_desc,
        v_smem,
        vready,
        vempty,
        vrow0,
        VSTAGES: gl.constexpr,
        INLINE_LOADS: gl.constexpr,
    ):
        """The P @ V wgmma of tile ``j`` has retired: refill its stage (the fallback launch
        loads tile j + VSTAGES itself; the consumers of the main launch tell the producer)."""
        if INLINE_LOADS:
            if j + VSTAGES < n_tiles:
                _load_v(j + VSTAGES, v_desc, v_smem, vready, vrow0, VSTAGES)
        else:
            mbarrier.arrive(vempty.index(j % VSTAGES), count=1)

    @gluon.jit
    def _consumer(args, SPEC: gl.constexpr, WG: gl.constexpr, INLINE_LOADS: gl.constexpr):
        """One warpgroup's pass over every column tile for its 64 rows, then its epilogue."""
        ring, vbufs, ptrs, sizes, scal, x_bar, turn = args
        x_desc, y_desc, x_smem, y_smem, ready, empty = ring
        v_desc, v_smem, vready, vempty = vbufs
        bias_ptr, cx_ptr, guess_ptr, out_ptr, lse_ptr, vbar_ptr, flag_ptr, cnt_ptr = ptrs
        b, row0, N, Mpad, n_tiles, DV, xrow0, yrow0, vrow0 = sizes
        dot_scale, eps_ln2, damping = scal
        NUM_K: gl.constexpr = SPEC[0]
        X_RESIDENT: gl.constexpr = SPEC[3]
        PIPE: gl.constexpr = SPEC[4]
        ONLINE: gl.constexpr = SPEC[6]
        HAS_LSE: gl.constexpr = SPEC[7]
        COUNT: gl.constexpr = SPEC[8]
        FALLBACK: gl.constexpr = SPEC[9]
        VSTAGES: gl.constexpr = SPEC[10]
        BN: gl.constexpr = y_desc.block_type.shape[0]
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BDV: gl.constexpr = v_desc.block_type.shape[0]
        BITS: gl.constexpr = y_desc.dtype.primitive_bitwidth
        KI: gl.constexpr = 256 // BITS  # wgmma K: 8 tf32, 16 bf16
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, KI]
        )
        MMA_O: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BDV, KI]
        )
        PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_O, k_width=32 // BITS)
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        COL: gl.constexpr = gl.SliceLayout(0, MMA)
        OROW: gl.constexpr = gl.SliceLayout(1, MMA_O)
        OCOL: gl.constexpr = gl.SliceLayout(0, MMA_O)
        ROUND: gl.constexpr = BITS == 32
        EARLY: gl.constexpr = not PIPE
        total = n_tiles * NUM_K
        vring = (v_desc, v_smem, vready, vempty, vrow0)

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
            sh = (cx - guess / damping) / eps_ln2 - _SHIFT_C
        l = gl.zeros([BM], gl.float32, ROW)
        m = gl.full([BM], float("-inf"), gl.float32, ROW)
        O = gl.zeros([BM, BDV], gl.float32, MMA_O)
        if X_RESIDENT:
            mbarrier.wait(x_bar, 0)

        if PIPE:
            acc = issue_tile(
                0, total, *ring, turn, xrow0, yrow0, SPEC, WG, MMA, INLINE_LOADS, False
            )
            S = warpgroup_mma_wait(0, deps=(acc,))
            release_tile(0, total, *ring, xrow0, yrow0, SPEC, INLINE_LOADS, False)
            T = S * dot_scale + gl.expand_dims(gl.load(bias_row + cols), 0)
            for j in range(n_tiles - 1):
                # the scores of tile j + 1 go to the tensor cores, tile j's exps run meanwhile,
                # then its P @ V queues behind them
                acc = issue_tile(
                    j + 1, total, *ring, turn, xrow0, yrow0, SPEC, WG, MMA, INLINE_LOADS, False
                )
                bias_next = gl.load(bias_row + (j + 1) * BN + cols)
                p, l, m, O = _weights(T, sh, l, m, O, ONLINE, ROUND, OROW)
                O, pa = _apply_v(j, p, O, v_smem, vready, VSTAGES, PA)
                S, O, pa = warpgroup_mma_wait(0, deps=(acc, O, pa))
                release_tile(j + 1, total, *ring, xrow0, yrow0, SPEC, INLINE_LOADS, False)
                _release_v(j, n_tiles, *vring, VSTAGES, INLINE_LOADS)
                T = S * dot_scale + gl.expand_dims(bias_next, 0)
            p, l, m, O = _weights(T, sh, l, m, O, ONLINE, ROUND, OROW)
            O, pa = _apply_v(n_tiles - 1, p, O, v_smem, vready, VSTAGES, PA)
            O, pa = warpgroup_mma_wait(0, deps=(O, pa))
            _release_v(n_tiles - 1, n_tiles, *vring, VSTAGES, INLINE_LOADS)
        else:
            for j in range(n_tiles):
                acc = issue_tile(
                    j, total, *ring, turn, xrow0, yrow0, SPEC, WG, MMA, INLINE_LOADS, EARLY
                )
                bias = gl.load(bias_row + j * BN + cols)
                S = warpgroup_mma_wait(0, deps=(acc,))
                release_tile(j, total, *ring, xrow0, yrow0, SPEC, INLINE_LOADS, EARLY)
                T = S * dot_scale + gl.expand_dims(bias, 0)
                p, l, m, O = _weights(T, sh, l, m, O, ONLINE, ROUND, OROW)
                O, pa = _apply_v(j, p, O, v_smem, vready, VSTAGES, PA)
                O, pa = warpgroup_mma_wait(0, deps=(O, pa))
                _release_v(j, n_tiles, *vring, VSTAGES, INLINE_LOADS)

        # epilogue: out and lse2 (first output chunk), vbar, and (shift mode) the flags
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
        first = gl.program_id(2) == 0
        gl.store(out_ptr + base_r + rows, out, mask=st_mask & first)
        if HAS_LSE:
            gl.store(lse_ptr + base_r + rows, lse2, mask=st_mask & first)
        l_o = gl.convert_layout(l, OROW)
        vbar = O / gl.expand_dims(l_o, 1)
        orows = row0 + WG * BM + gl.arange(0, BM, layout=OROW)
        ocols = gl.program_id(2) * BDV + gl.arange(0, BDV, layout=OCOL)
        st_o = gl.expand_dims(gl.convert_layout(st_mask, OROW), 1) & gl.expand_dims(ocols < DV, 0)
        vptr = vbar_ptr + (base_r + gl.expand_dims(orows, 1).to(gl.int64)) * DV
        gl.store(vptr + gl.expand_dims(ocols, 0), vbar, mask=st_o)
        if not ONLINE:
            osum = gl.sum(O, 1)
            finite = gl.convert_layout((osum - osum) == 0.0, ROW)  # inf and NaN fail
            bad = ((((l >= _SAFE_LO) & (l <= _SAFE_HI)) & finite) == 0) & row_mask
            # every output chunk flags its bad rows (the flags start at zero)
            gl.store(flag_ptr + base_r + rows, gl.full([BM], 1, gl.int8, ROW), mask=bad)
            if COUNT:  # diagnostics: rows handed to the fallback (first output chunk)
                gl.atomic_add(cnt_ptr, gl.sum((bad & first).to(gl.int32), 0))

    @gluon.jit
    def _producer(args, SPEC: gl.constexpr, WG: gl.constexpr, INLINE_LOADS: gl.constexpr):
        """The producer warp: x once (when resident), then per column tile its score chunks
        and its V tile, each after its stage's empty barrier says both consumers are done."""
        ring, vbufs, ptrs, sizes, scal, x_bar, turn = args
        x_desc, y_desc, x_smem, y_smem, ready, empty = ring
        v_desc, v_smem, vready, vempty = vbufs
        b, row0, N, Mpad, n_tiles, DV, xrow0, yrow0, vrow0 = sizes
        NUM_K: gl.constexpr = SPEC[0]
        STAGES: gl.constexpr = SPEC[1]
        VSTAGES: gl.constexpr = SPEC[10]
        if SPEC[3]:  # X_RESIDENT
            load_x(x_desc, x_smem, x_bar, xrow0, SPEC)
        for j in range(n_tiles):
            for k in gl.static_range(NUM_K):
                t = j * NUM_K + k
                s = t % STAGES
                # mbarriers start in the completed state of phase "-1": the first round passes
                mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
                load_chunk(t, x_desc, y_desc, x_smem, y_smem, ready, xrow0, yrow0, SPEC)
            vs = j % VSTAGES
            mbarrier.wait(vempty.index(vs), ((j // VSTAGES) & 1) ^ 1)
            _load_v(j, v_desc, v_smem, vready, vrow0, VSTAGES)

    @gluon.jit
    def _plan_sm90_kernel(
        x_desc,
        y_desc,
        v_desc,
        bias_ptr,
        cx_ptr,
        guess_ptr,
        out_ptr,
        lse_ptr,
        vbar_ptr,
        flag_ptr,
        cnt_ptr,
        N,
        M,
        Mpad,
        n_tiles,
        DV,
        DVpad,
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
        VSTAGES: gl.constexpr = SPEC[10]
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BDV: gl.constexpr = v_desc.block_type.shape[0]
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
            yrow0 = (b * M).to(gl.int32)
            vrow0 = (b * DVpad + gl.program_id(2) * BDV).to(gl.int32)
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
            v_smem = gl.allocate_shared_memory(
                v_desc.dtype, [VSTAGES] + v_desc.block_type.shape, v_desc.layout
            )
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            vready = gl.allocate_shared_memory(gl.int64, [VSTAGES, 1], mbarrier.MBarrierLayout())
            vempty = gl.allocate_shared_memory(gl.int64, [VSTAGES, 1], mbarrier.MBarrierLayout())
            x_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
                mbarrier.init(empty.index(i), count=NUM_WG)
            for i in gl.static_range(VSTAGES):
                mbarrier.init(vready.index(i), count=1)
                mbarrier.init(vempty.index(i), count=NUM_WG)
            mbarrier.init(x_bar, count=1)
            for i in gl.static_range(2):
                mbarrier.init(turn.index(i), count=1)
            ring = (x_desc, y_desc, x_smem, y_smem, ready, empty)
            ptrs = (bias_ptr, cx_ptr, guess_ptr, out_ptr, lse_ptr, vbar_ptr, flag_ptr, cnt_ptr)
            sizes = (b, row0, N, Mpad, n_tiles, DV, xrow0, yrow0, vrow0)
            args = (
                ring,
                (v_desc, v_smem, vready, vempty),
                ptrs,
                sizes,
                (dot_scale, eps_ln2, damping),
                x_bar,
                turn,
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
                # one warpgroup: x, the first score chunks and V tiles now, each refill as
                # soon as the wgmma that read its stage has retired
                if X_RESIDENT:
                    load_x(x_desc, x_smem, x_bar, xrow0, SPEC)
                total = n_tiles * NUM_K
                for t in gl.static_range(STAGES):
                    if t < total:
                        load_chunk(t, x_desc, y_desc, x_smem, y_smem, ready, xrow0, yrow0, SPEC)
                for j in gl.static_range(VSTAGES):
                    if j < n_tiles:
                        _load_v(j, v_desc, v_smem, vready, vrow0, VSTAGES)
                _consumer(args, SPEC, 0, True)
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(i))
                mbarrier.invalidate(empty.index(i))
            for i in gl.static_range(VSTAGES):
                mbarrier.invalidate(vready.index(i))
                mbarrier.invalidate(vempty.index(i))
            mbarrier.invalidate(x_bar)
            for i in gl.static_range(2):
                mbarrier.invalidate(turn.index(i))


def _descriptors(x2, y2, vt2, cfg: PlanConfig):
    gdt = gl.bfloat16 if x2.dtype == torch.bfloat16 else gl.float32
    blocks = ([BLOCK_M, cfg.block_k], [cfg.block_n, cfg.block_k], [cfg.block_dv, cfg.block_n])
    return tuple(
        TensorDescriptor.from_tensor(t, blk, gl.NVMMASharedLayout.get_default_for(blk, gdt))
        for t, blk in zip((x2, y2, vt2), blocks)
    )


def _spec(cfg: PlanConfig, D: int, online: bool, has_lse: bool, count: bool, fallback_pass: bool):
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
        cfg.v_stages,
    )


def transposed_values(v: torch.Tensor, cfg: PlanConfig, Mpad: int, dtype: torch.dtype):
    """``Vt (B, DVpad, Mpad)`` in the kernel's dtype, zeros in the padding. fp32: values
    rounded to tf32 by nearest (the tensor cores would truncate them), and within every 8
    columns column ``8 k + 4 r + a`` holds V row ``8 k + 2 a + r`` (the order in which the
    kernel's weights reach the wgmma, see ``_apply_v``)."""
    B, M, DV = v.shape
    dvpad = -(-DV // cfg.block_dv) * cfg.block_dv
    vt = torch.zeros((B, dvpad, Mpad), device=v.device, dtype=dtype)
    vt[:, :DV, :M] = v.transpose(1, 2)
    if dtype == torch.float32:
        vt.view(torch.int32).add_(0x1000).bitwise_and_(~0x1FFF)  # to nearest, on the bits
        # the kernel's order of the columns within each 8 (its weights' relabelling)
        vt = vt.view(B, dvpad, Mpad // 8, 4, 2).transpose(3, 4).reshape(B, dvpad, Mpad)
    return vt


def plan_hopper(
    x: torch.Tensor,
    y: torch.Tensor,
    v: torch.Tensor,
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
    config: PlanConfig | None = None,
    fallback_rows: torch.Tensor | None = None,
):
    """The pass with ``v`` of :func:`flashsinkhorn.softmin` on sm_90: returns
    ``(out (B, N), lse2 (B, N) or None, vbar (B, N, DV))`` (fp32).

    x, y: kernel operands (fp32 rounded to tf32 for "tf32", bf16 for "bf16"); v (B, M, DV)
    any float dtype (cast and rounded here); g, logb, cy (B, M); cx, guess (B, N) as in
    ``softmin_hopper``. ``config``: a :class:`PlanConfig` (None: the default);
    ``fallback_rows``: optional (1,) int32 CUDA tensor counting the recomputed rows.
    Raises ``NotImplementedError`` with the reason for inputs it does not take.
    """
    reason = plan_reason(x, y, v, precision)
    if reason is not None:
        raise NotImplementedError(reason)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite positive number; got {eps}")
    B, N, D = x.shape
    M, DV = y.shape[1], v.shape[2]
    cfg = config or default_plan_config(D, DV, x.dtype)
    _check_config(cfg, D, x.dtype)
    dev, f32 = x.device, torch.float32
    n_tiles = -(-M // cfg.block_n)
    Mpad = n_tiles * cfg.block_n
    vt = transposed_values(v, cfg, Mpad, x.dtype)
    n_dv = vt.shape[1] // cfg.block_dv
    descs = _descriptors(
        tma_ready(x).view(B * N, D), tma_ready(y).view(B * M, D), vt.view(-1, Mpad), cfg
    )
    bias = torch.full((B, Mpad), float("-inf"), device=dev, dtype=f32)
    torch.sub(g.to(f32), cy.to(f32), out=bias[:, :M]).mul_(LOG2E / eps)
    bias[:, :M].add_(logb.to(f32), alpha=LOG2E)
    cx = cx.to(f32).contiguous()
    out = torch.empty((B, N), device=dev, dtype=f32)
    lse = torch.empty((B, N), device=dev, dtype=f32) if want_lse else out
    vbar = torch.empty((B, N, DV), device=dev, dtype=f32)
    online = guess is None
    guess = cx if online else guess.to(f32).contiguous()
    flags = torch.zeros((B, N), device=dev, dtype=torch.int8)
    cnt = fallback_rows if fallback_rows is not None else out
    scal = (float(c2 * LOG2E / eps), float(eps * LN2), float(damping))
    bufs = (bias, cx, guess, out, lse, vbar, flags, cnt, N, M, Mpad, n_tiles, DV, vt.shape[1])
    with torch.cuda.device(dev):
        spec = _spec(cfg, D, online, want_lse, fallback_rows is not None, False)
        _plan_sm90_kernel[(-(-N // (2 * BLOCK_M)), B, n_dv)](
            *descs, *bufs, *scal, SPEC=spec, num_warps=4
        )
        if not online:  # one warpgroup per 64 rows, only where a row was flagged
            spec = _spec(cfg, D, True, want_lse, False, True)
            _plan_sm90_kernel[(-(-N // BLOCK_M), B, n_dv)](
                *descs, *bufs, *scal, SPEC=spec, num_warps=4
            )
    return out, (lse if want_lse else None), vbar


def compile_plan_for_sm90(
    D: int,
    DV: int,
    dtype: torch.dtype = torch.float32,
    config: PlanConfig | None = None,
    *,
    online: bool = False,
    has_lse: bool = False,
    count: bool = False,
    fallback_pass: bool = False,
):
    """The kernel compiled for sm_90 without a GPU (``.asm``, ``.metadata``): CPU tests and
    the check scripts read its resources and SASS."""
    if not HAS_GLUON:
        raise NotImplementedError("triton with the Hopper Gluon API is not installed")
    cfg = config or default_plan_config(D, DV, dtype)
    _check_config(cfg, D, dtype)
    rows = 256
    vt = torch.zeros(-(-DV // cfg.block_dv) * cfg.block_dv, rows, dtype=dtype)
    descs = _descriptors(
        torch.zeros(rows, D, dtype=dtype), torch.zeros(rows, D, dtype=dtype), vt, cfg
    )
    f = torch.zeros(rows, dtype=torch.float32)
    i8 = torch.zeros(rows, dtype=torch.int8)
    i32 = torch.zeros(1, dtype=torch.int32)
    args = (*descs, f, f, f, f, f, f, i8, i32, rows, rows, rows, 2, DV, vt.shape[0], 1.0, 1.0, 1.0)
    kwargs = dict(SPEC=_spec(cfg, D, online, has_lse, count, fallback_pass), num_warps=4)
    return compile_gluon_sm90(_plan_sm90_kernel, args, kwargs)
