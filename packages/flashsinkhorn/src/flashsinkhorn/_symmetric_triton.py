"""One streaming pass for both potentials of a symmetric Sinkhorn iteration (Triton).

GeomLoss's symmetric update computes ``f_new`` from ``g`` and ``g_new`` from ``f`` (both
old). With (log2 units, ``q_ij = dot_scale <x_i, y_j>``, ``dot_scale = c2 log2e / eps``)

    RB_i = log2e (log a_i + (f_i - cx_i) / eps) + sigma / 2        (row bias)
    CB_j = log2e (log b_j + (g_j - cy_j) / eps) + sigma / 2        (column bias)
    p_ij = exp2(q_ij + RB_i + CB_j) = 2^sigma P_ij                  (the plan's entries)

the row sums ``R_i = sum_j p_ij`` and the column sums ``C_j = sum_i p_ij`` give both
updates (``lse2x_i = log2 R_i - RB_i - sigma / 2``, ``lse2y_j = log2 C_j - CB_j - sigma / 2``),
so ONE exp2 per score serves both directions: half the tensor-core and exp work of two
passes. This module computes R and C; :func:`flashsinkhorn.primitives.symmetric_update`
does the rest (shift, epilogue, exact recomputation of the rows and columns whose sums
leave the safe range).

The kernel is "row-stationary" like the softmin kernels, but computes the transposed tile
``<y_j, x_i>`` (BLOCK_N, BLOCK_M): the column sums of a tile are then row reductions of
the accumulator (within a thread and a few lanes), and the row sums are deferred: a
(BLOCK_N, BLOCK_M) accumulator summed once at the end. Each program (row block) writes
its column partial sums into a (B, row_blocks, W) buffer for a chunk of W columns (no
atomics: deterministic); the launcher reduces it and moves to the next chunk, so the
buffer stays below ``_config.SYM_PARTIAL_BYTES`` whatever N and M.
"""

from __future__ import annotations

import torch

from flashsinkhorn import _config
from flashsinkhorn._triton_tiles import (
    HAS_TRITON,
    _block_d,
    _bucket,
    _device,
    _load_rows,
    _tile_dot,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _symmetric_pass_kernel(
        X,
        Y,
        RB,
        CB,
        RSUM,
        CPART,
        N,
        M,
        D,
        c0,
        W,
        NB,
        N_KEY,
        W_KEY,
        dot_scale,
        BLOCK_D: tl.constexpr,
        NUM_D: tl.constexpr,
        EVEN_D: tl.constexpr,
        PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # RSUM (B, N) += this chunk's row sums; CPART (B, NB, W): column partial sums of
        # columns c0 .. c0 + W - 1 over this program's rows (padded rows have RB = -inf,
        # padded columns CB = -inf: exp2 gives 0 there)
        pid_m = tl.program_id(0)
        pid_b = tl.program_id(1).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < N
        offs_n = tl.arange(0, BLOCK_N)
        Xb = X + pid_b * N * D
        Yb = Y + pid_b * M * D
        rb = tl.load(RB + pid_b * N + rows, mask=row_mask, other=float("-inf"))
        x0 = rows  # placeholder, read only with one feature chunk
        if NUM_D == 1:
            x0 = _load_rows(Xb, rows, row_mask, tl.arange(0, BLOCK_D), D, D, EVEN_D)
        racc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        c1 = tl.minimum(c0 + W, M)
        part = CPART + (pid_b * NB + pid_m) * W - c0
        for start in range(c0, c1, BLOCK_N):
            cols = start + offs_n
            col_mask = cols < c1
            if NUM_D == 1:
                y = _load_rows(Yb, cols, col_mask, tl.arange(0, BLOCK_D), D, D, EVEN_D)
                s = tl.dot(y, tl.trans(x0), input_precision=PREC)
            else:
                s = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                s = _tile_dot(
                    Yb, Xb, cols, rows, col_mask, row_mask, D, D, D, s, NUM_D, EVEN_D, BLOCK_D, PREC
                )
            cb = tl.load(CB + pid_b * M + cols, mask=col_mask, other=float("-inf"))
            p = tl.exp2(s * dot_scale + cb[:, None] + rb[None, :])  # the one exp per score
            racc += p
            tl.store(part + cols, tl.sum(p, 1), mask=col_mask)
        rsum = tl.load(RSUM + pid_b * N + rows, mask=row_mask, other=0.0)
        tl.store(RSUM + pid_b * N + rows, rsum + tl.sum(racc, 0), mask=row_mask)

    # one feature chunk: autotuned (BLOCK_M is the launcher's: it sizes the partial buffer)
    _symmetric_pass_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
            for _, bn, w, st in _config.SYM_TUNE_SMALL_D
        ],
        key=["N_KEY", "W_KEY", "D", "PREC"],
        restore_value=["RSUM"],  # the row sums accumulate over chunks
    )(_symmetric_pass_kernel)


def column_chunk(row_blocks: int, B: int, M: int, block_n: int) -> int:
    """Columns per launch of a one-pass kernel: the (B, row_blocks, W) fp32 partial buffer
    within ``_config.SYM_PARTIAL_BYTES``, W a multiple of ``block_n``, at least
    ``_config.SYM_MIN_CHUNK_TILES`` tiles (each launch reloads the rows and refills its
    pipeline), at most M rounded up to whole tiles."""
    w = _config.SYM_PARTIAL_BYTES // (4 * B * row_blocks)
    w = max(w // block_n, _config.SYM_MIN_CHUNK_TILES) * block_n
    return min(w, -(-M // block_n) * block_n)


def symmetric_sums_triton(x, y, rb, cb, *, eps, c2, precision, chunk=None):
    """Row and column sums ``(R (B, N), C (B, M))`` of ``p_ij = exp2(dot_scale <x_i, y_j> +
    rb_i + cb_j)`` (fp32), one exp2 per score. x (B, N, D), y (B, M, D): kernel operands
    (fp32, or bf16 for ``precision="bf16"``); rb (B, N), cb (B, M) fp32 (log2 units).
    ``chunk``: columns per launch (tests; None: :func:`column_chunk`)."""
    B, N, D = x.shape
    M = y.shape[1]
    f32 = torch.float32
    prec = "tf32" if precision == "bf16" else precision
    BLOCK_D, NUM_D = _block_d(D)
    if _config.no_autotune() or NUM_D > 1:
        bm, bn, w, st = _config.FIXED if _config.no_autotune() else _config.SYM_LARGE_D
        kern, cfg = _symmetric_pass_kernel, dict(BLOCK_N=bn, num_warps=w, num_stages=st)
    else:
        bm = _config.SYM_TUNE_SMALL_D[0][0]
        bn = max(c[1] for c in _config.SYM_TUNE_SMALL_D)
        kern, cfg = _symmetric_pass_tuned, {}
    NB = -(-N // bm)
    W = chunk or column_chunk(NB, B, M, bn)
    rsum = torch.zeros((B, N), device=x.device, dtype=f32)
    csum = torch.empty((B, M), device=x.device, dtype=f32)
    part = torch.empty((B, NB, W), device=x.device, dtype=f32)
    rb, cb = rb.to(f32).contiguous(), cb.to(f32).contiguous()
    with _device(x):
        for c0 in range(0, M, W):
            w = min(W, M - c0)
            kern[(NB, B)](
                x,
                y,
                rb,
                cb,
                rsum,
                part,
                N,
                M,
                D,
                c0,
                W,
                NB,
                _bucket(N),
                _bucket(W),
                float(c2 * 1.4426950408889634 / eps),
                BLOCK_D=BLOCK_D,
                NUM_D=NUM_D,
                EVEN_D=BLOCK_D * NUM_D == D,
                PREC=prec,
                BLOCK_M=bm,
                **cfg,
            )
            csum[:, c0 : c0 + w] = part[:, :, :w].sum(dim=1)  # deterministic, no atomics
    return rsum, csum
