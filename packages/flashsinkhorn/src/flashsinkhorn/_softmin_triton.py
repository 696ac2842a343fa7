"""The portable Triton kernels of the streaming c-transform, and their launchers.

For a batch of point clouds ``X (B, N, D)``, ``Y (B, M, D)`` and a cost of the form
``C_ij = cx_i + cy_j - c2 <X_i, Y_j> [+ w_scale W[lx_i, ly_j]]``, one pass computes for
every row i (base 2, with 1/eps and log2(e) folded into one multiplier of the dot):

    lse2_i = log2 sum_j exp2(bias_j + dot_scale <X_i, Y_j> [- w_scale log2e / eps W])
    out_i  = damping * (cx_i - eps ln2 lse2_i)

with the fused column vector ``bias_j = log2e (log b_j + (g_j - cy_j) / eps)``. A block of
BLOCK_M rows of X stays on chip while tiles of BLOCK_N columns of Y stream past it
(row-stationary, like FlashAttention's forward); nothing of size N x M is stored.

Kernels (one default per situation; docs/design/flashsinkhorn.md has the numbers):

- ``_softmin_kernel``: online (running-max) LogSumExp. Used where no estimate of the result
  exists (the first pass of a solve, a public ``softmin`` call without ``guess``) and for
  the plan application (``HAS_V``: also ``vbar_i = sum_j softmax_j(...) V_j``).
- ``_softmin_shift_kernel``: the Sinkhorn loops' passes, which know the potential being
  updated: it gives a fixed per-row shift, so each score costs one FFMA, one FADD, one exp2
  and one FADD (no running max, no rescale). Exact for any guess: rows whose shifted sum is
  out of range are recomputed with the running max in the same kernel.

The symmetric self-transport kernel (``_self_softmin_kernel``, the debiasing terms) lives
in ``_self_softmin_triton.py``; the tile and launch helpers (``_load_rows``, ``_tile_dot``,
``_pick``, ...) in ``_triton_tiles.py``. Precision of the dot (``PREC``): "tf32", "ieee",
"tf32x3"; bf16 operands arrive as bf16 tensors and use "tf32" (fp32 accumulation).
"""

from __future__ import annotations

import torch

from flashsinkhorn import _config
from flashsinkhorn._triton_tiles import (
    HAS_TRITON,
    _block_d,
    _bucket,
    _device,
    _label_operands,
    _next_pow2,
    _pick,
    _prune,
    _triton_configs,
)
from flashsinkhorn.reference import LN2, LOG2E

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flashsinkhorn._triton_tiles import (
        _label_tile,
        _load_rows,
        _lse_tile,
        _online_lse_step,
        _row_stationary_dot,
        _tile_scores,
    )


# ----------------------------------------------------------------------------------------
# the running-max kernel
# ----------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _softmin_kernel(
        X,
        Y,
        BIAS,
        CX,
        OUT,
        LSE,
        V,
        VBAR,
        LX,
        LY,
        W,
        FLAGS,
        N,
        M,
        D,
        DV,
        K2,
        N_KEY,
        M_KEY,
        dot_scale,  # c2 * log2(e) / eps
        inv_eps2,  # log2(e) / eps (label term)
        eps_ln2,  # eps * ln(2)
        damping,
        w_scale,
        BLOCK_D: tl.constexpr,
        NUM_D: tl.constexpr,
        EVEN_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        HAS_V: tl.constexpr,
        HAS_LABELS: tl.constexpr,
        HAS_LSE: tl.constexpr,
        PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_FLAGS: tl.constexpr = False,
    ):
        # FLAGS (B, N) int8 with HAS_FLAGS: only the flagged rows are computed and stored (a
        # block without one skips the column loop); the recomputation of rows that a
        # symmetric one-pass update could not fit.
        # X, Y arrive in their final form (centered, cast) and BIAS is the fused column
        # vector log2e * (log b_j + (g_j - cy_j) / eps): the loop is load -> dot -> one FMA
        # per score -> online LSE, with nothing between the pipelined loads and tl.dot.
        pid_m = tl.program_id(0)
        pid_b = tl.program_id(1)
        pid_v = tl.program_id(2)
        pid_b64 = pid_b.to(tl.int64)

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < N
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)

        Xb = X + pid_b64 * N * D
        Yb = Y + pid_b64 * M * D
        BIASb = BIAS + pid_b64 * M

        x0 = rows  # placeholder, read only with one feature chunk
        if NUM_D == 1:
            x0 = _load_rows(Xb, rows, row_mask, offs_d, D, D, EVEN_D)
        if HAS_LABELS:
            lx = tl.load(LX + pid_b64 * N + rows, mask=row_mask, other=0)
        if HAS_V:
            offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
            acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
            Vb = V + pid_b64 * M * DV

        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)

        store_mask = row_mask
        m_end = M
        if HAS_FLAGS:
            flagged = tl.load(FLAGS + pid_b64 * N + rows, mask=row_mask, other=0) != 0
            store_mask = row_mask & flagged
            m_end = tl.where(tl.max(flagged.to(tl.int32), 0) > 0, M, 0)
        for start in range(0, m_end, BLOCK_N):
            cols = start + offs_n
            col_mask = cols < M
            # scores in log2 units: bias_j + dot_scale * <x_i, y_j>
            s = _row_stationary_dot(
                x0,
                Xb,
                Yb,
                rows,
                cols,
                row_mask,
                col_mask,
                D,
                NUM_D,
                EVEN_D,
                BLOCK_D,
                PREC,
                BLOCK_M,
                BLOCK_N,
            )
            bias = tl.load(BIASb + cols, mask=col_mask, other=float("-inf"))
            s = s * dot_scale + bias[None, :]
            if HAS_LABELS:
                wv = _label_tile(LY + pid_b64 * M, W, lx, cols, row_mask, col_mask, K2)
                s = s - (w_scale * inv_eps2) * wv
            m_new, l_i, alpha, p = _online_lse_step(m_i, l_i, s)
            if HAS_V:
                vj = tl.load(
                    Vb + cols[:, None] * DV + offs_v[None, :],
                    mask=col_mask[:, None] & (offs_v[None, :] < DV),
                    other=0.0,
                )
                acc = acc * alpha[:, None]
                acc = tl.dot(p.to(vj.dtype), vj, acc, input_precision=PREC)
            m_i = m_new

        lse2 = m_i + tl.log2(tl.where(store_mask, l_i, 1.0))  # skipped rows: no log2(0)
        if pid_v == 0:
            cx = tl.load(CX + pid_b64 * N + rows, mask=row_mask, other=0.0).to(tl.float32)
            out = damping * (cx - eps_ln2 * lse2)
            tl.store(OUT + pid_b64 * N + rows, out, mask=store_mask)
            if HAS_LSE:
                tl.store(LSE + pid_b64 * N + rows, lse2, mask=store_mask)
        if HAS_V:
            vbar = acc / l_i[:, None]
            tl.store(
                VBAR + pid_b64 * N * DV + rows[:, None] * DV + offs_v[None, :],
                vbar,
                mask=row_mask[:, None] & (offs_v[None, :] < DV),
            )


# ----------------------------------------------------------------------------------------
# the shift kernel: a fixed per-row shift from a guess of the result
# ----------------------------------------------------------------------------------------

if HAS_TRITON:
    _SHIFT_C = tl.constexpr(_config.SHIFT_CENTER)
    _SHIFT_LO = tl.constexpr(_config.SHIFT_LO)
    _SHIFT_HI = tl.constexpr(3.4028234663852886e38)  # float32 max

    @triton.jit
    def _softmin_shift_kernel(
        X,
        Y,
        BIAS,
        CX,
        OUT,
        LSE,
        LX,
        LY,
        W,
        GUESS,
        FALLBACK,
        N,
        M,
        D,
        K2,
        N_KEY,
        M_KEY,
        dot_scale,
        inv_eps2,
        eps_ln2,
        damping,
        w_scale,
        BLOCK_D: tl.constexpr,
        NUM_D: tl.constexpr,
        EVEN_D: tl.constexpr,
        HAS_LABELS: tl.constexpr,
        HAS_LSE: tl.constexpr,
        PREC: tl.constexpr,
        COUNT_FALLBACK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # GUESS (B, N): an estimate of OUT (in the loops: the potential being updated).
        # FALLBACK: a (1,) int32 counter of recomputed rows when COUNT_FALLBACK (else unused).
        pid_m = tl.program_id(0)
        pid_b64 = tl.program_id(1).to(tl.int64)

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < N
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)

        Xb = X + pid_b64 * N * D
        Yb = Y + pid_b64 * M * D
        BIASb = BIAS + pid_b64 * M
        LYb = LY + pid_b64 * M

        x0 = rows  # placeholder, read only with one feature chunk
        if NUM_D == 1:
            x0 = _load_rows(Xb, rows, row_mask, offs_d, D, D, EVEN_D)
        lx = rows  # placeholder, read only with labels
        if HAS_LABELS:
            lx = tl.load(LX + pid_b64 * N + rows, mask=row_mask, other=0)

        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)

        # fixed shift (log2 units): the guess of out = damping (cx - eps ln2 lse2) solved
        # for lse2, minus SHIFT_CENTER; sum exp2(score - sh) with no running max
        cx = tl.load(CX + pid_b64 * N + rows, mask=row_mask, other=0.0).to(tl.float32)
        guess = tl.load(GUESS + pid_b64 * N + rows, mask=row_mask, other=0.0)
        sh = (cx - guess / damping) / eps_ln2 - _SHIFT_C
        l_s = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(0, M, BLOCK_N):
            cols = start + offs_n
            col_mask = cols < M
            s = _row_stationary_dot(
                x0,
                Xb,
                Yb,
                rows,
                cols,
                row_mask,
                col_mask,
                D,
                NUM_D,
                EVEN_D,
                BLOCK_D,
                PREC,
                BLOCK_M,
                BLOCK_N,
            )
            s = _tile_scores(
                s,
                BIASb,
                LYb,
                W,
                lx,
                cols,
                row_mask,
                col_mask,
                K2,
                dot_scale,
                inv_eps2,
                w_scale,
                HAS_LABELS,
            )
            l_s += tl.sum(tl.exp2(s - sh[:, None]), 1)
        # unsafe rows (NaN fails both tests): recomputed below with the running max
        safe = (l_s >= _SHIFT_LO) & (l_s <= _SHIFT_HI)
        bad = (safe == 0) & row_mask
        n_bad = tl.sum(bad.to(tl.int32), 0)
        if n_bad > 0:
            if COUNT_FALLBACK:  # diagnostics (tests, benchmarks): rows recomputed
                tl.atomic_add(FALLBACK, n_bad)
            # not software-pipelined (num_stages=1): a second pipelined loop in the kernel
            # took the registers from 70 to 120 (static sm_90 compile, tf32, 128 x 64,
            # 8 warps); this loop runs only for blocks with a bad guess
            for start in tl.range(0, M, BLOCK_N, num_stages=1):
                cols = start + offs_n
                col_mask = cols < M
                s = _row_stationary_dot(
                    x0,
                    Xb,
                    Yb,
                    rows,
                    cols,
                    row_mask,
                    col_mask,
                    D,
                    NUM_D,
                    EVEN_D,
                    BLOCK_D,
                    PREC,
                    BLOCK_M,
                    BLOCK_N,
                )
                m_i, l_i = _lse_tile(
                    m_i,
                    l_i,
                    s,
                    BIASb,
                    LYb,
                    W,
                    lx,
                    cols,
                    row_mask,
                    col_mask,
                    K2,
                    dot_scale,
                    inv_eps2,
                    w_scale,
                    HAS_LABELS,
                )

        # each row takes one of the two sums; the other one's log2 reads 1 (rows not
        # recomputed keep l_i = 0: no log2(0), which the interpreter reports as an error)
        lse2 = tl.where(
            bad,
            m_i + tl.log2(tl.where(bad, l_i, 1.0)),
            sh + tl.log2(tl.where(bad, 1.0, l_s)),
        )
        out = damping * (cx - eps_ln2 * lse2)
        tl.store(OUT + pid_b64 * N + rows, out, mask=row_mask)
        if HAS_LSE:
            tl.store(LSE + pid_b64 * N + rows, lse2, mask=row_mask)

    # autotuned entry points (configs built here; whether to autotune is decided per launch)
    _softmin_tuned = triton.autotune(
        configs=_triton_configs(_config.TUNE_SMALL_D + _config.TUNE_LARGE_D),
        key=["N_KEY", "M_KEY", "D", "HAS_LABELS", "PREC"],
        prune_configs_by={"early_config_prune": _prune},
    )(_softmin_kernel)
    _softmin_shift_tuned = triton.autotune(
        configs=_triton_configs(_config.TUNE_SMALL_D + _config.TUNE_LARGE_D),
        key=["N_KEY", "M_KEY", "D", "HAS_LABELS", "PREC"],
        prune_configs_by={"early_config_prune": _prune},
        reset_to_zero=["FALLBACK"],  # the counter (when counting) is not bumped by the bench
    )(_softmin_shift_kernel)


# ----------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------


def softmin_triton(
    x,
    y,
    g,
    logb,
    cx,
    cy,
    eps,
    c2,
    damping,
    v,
    labels,
    precision,
    want_lse,
    center,
    guess=None,
    fallback_rows=None,
    config=None,
):
    """One streaming pass on the Triton backend (arguments as :func:`flashsinkhorn.softmin`).

    Kernel: ``_softmin_kernel`` with ``v`` (plan application, at the fixed plan-application
    config) or without ``guess`` (cold start); ``_softmin_shift_kernel`` otherwise.
    ``fallback_rows``: optional (1,) int32 tensor on the device to which the shift kernel
    adds the number of rows it recomputed with the running max. ``config``: force one
    ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for a pass without ``v`` (tests sweep the
    autotune space with it); None: autotuned, or the fixed config without autotuning.
    Returns ``(out, lse2_or_None, vbar_or_None)``.
    """
    B, N, D = x.shape
    M = y.shape[1]
    dev = x.device
    f32 = torch.float32
    # Operands reach the kernel in their final form: centering and casts happen here (once
    # per call; callers that iterate, like Problem, pass prepared operands and center=None),
    # never between the kernel's pipelined loads and tl.dot.
    if center is not None:
        same = y is x
        c = center.to(f32)[:, None, :]
        x = x.to(f32) - c
        y = x if same else y.to(f32) - c
    kdt = torch.bfloat16 if precision == "bf16" else f32
    prec = "tf32" if precision == "bf16" else precision
    x = x.to(kdt).contiguous()
    y = y.to(kdt).contiguous()
    # the one fused column vector (log2 units): log2e * (log b_j + (g_j - cy_j) / eps)
    bias = torch.sub(g.to(f32), cy.to(f32)).mul_(LOG2E / eps).add_(logb.to(f32), alpha=LOG2E)
    bias = bias.contiguous()
    cx = cx.to(f32).contiguous()
    out = torch.empty((B, N), device=dev, dtype=f32)
    lse = torch.empty((B, N), device=dev, dtype=f32) if want_lse else out
    BLOCK_D, NUM_D = _block_d(D)
    if labels is not None:
        lx, ly, W, w_scale = labels
        lx, ly, W, K2 = _label_operands(lx, ly, W)
    else:
        lx = ly = W = out  # placeholders, never read
        K2, w_scale = 1, 0.0
    scalars = (
        float(c2 * LOG2E / eps),
        float(LOG2E / eps),
        float(eps * LN2),
        float(damping),
        float(w_scale),
    )
    flags = dict(
        BLOCK_D=BLOCK_D,
        NUM_D=NUM_D,
        EVEN_D=BLOCK_D * NUM_D == D,
        HAS_LABELS=labels is not None,
        HAS_LSE=want_lse,
        PREC=prec,
    )
    if v is None and guess is not None:
        kern, cfg = _pick(_softmin_shift_tuned, _softmin_shift_kernel, config)
        grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B)  # noqa: E731
        with _device(x):
            kern[grid](
                x,
                y,
                bias,
                cx,
                out,
                lse,
                lx,
                ly,
                W,
                guess.to(f32).contiguous(),
                out if fallback_rows is None else fallback_rows,
                N,
                M,
                D,
                K2,
                _bucket(N),
                _bucket(M),
                *scalars,
                COUNT_FALLBACK=fallback_rows is not None,
                **flags,
                **cfg,
            )
        return out, (lse if want_lse else None), None
    if v is not None:
        DV = v.shape[-1]
        v = v.to(kdt).contiguous()
        if DV > 64:
            BLOCK_DV = min(_next_pow2(DV), _config.WIDE_DV)
        else:
            BLOCK_DV = max(16, min(_next_pow2(DV), 64))
        n_v = triton.cdiv(DV, BLOCK_DV)
        vbar = torch.empty((B, N, DV), device=dev, dtype=f32)
        bm, bn, w, st = _config.plan_apply_config(DV)
        kern, cfg = _softmin_kernel, dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
    else:
        DV, BLOCK_DV, n_v = 0, 16, 1
        v = vbar = out  # placeholders, never read
        kern, cfg = _pick(_softmin_tuned, _softmin_kernel, config)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B, n_v)  # noqa: E731
    with _device(x):
        kern[grid](
            x,
            y,
            bias,
            cx,
            out,
            lse,
            v,
            vbar,
            lx,
            ly,
            W,
            out,
            N,
            M,
            D,
            DV,
            K2,
            _bucket(N),
            _bucket(M),
            *scalars,
            BLOCK_DV=BLOCK_DV,
            HAS_V=DV > 0,
            **flags,
            **cfg,
        )
    return out, (lse if want_lse else None), (vbar if DV > 0 else None)


def softmin_rows_triton(x, y, g, logb, cx, cy, eps, c2, damping, precision, flags, out):
    """Recompute, in place in ``out`` (B, N), the rows of a pass whose ``flags`` (B, N) are
    nonzero, with the running-max kernel (exact whatever the potentials; row blocks without
    a flagged row skip their column loop). Operands as :func:`softmin_triton` (prepared:
    no center); one fixed tile config (the pass is rare)."""
    B, N, D = x.shape
    M = y.shape[1]
    f32 = torch.float32
    prec = "tf32" if precision == "bf16" else precision
    bias = torch.sub(g.to(f32), cy.to(f32)).mul_(LOG2E / eps).add_(logb.to(f32), alpha=LOG2E)
    BLOCK_D, NUM_D = _block_d(D)
    bm, bn, w, st = _config.FIXED
    flags = flags.to(torch.int8).contiguous()
    with _device(x):
        _softmin_kernel[(triton.cdiv(N, bm), B, 1)](
            x,
            y,
            bias,
            cx.to(f32).contiguous(),
            out,
            out,
            out,
            out,
            out,
            out,
            out,
            flags,
            N,
            M,
            D,
            0,
            1,
            _bucket(N),
            _bucket(M),
            float(c2 * LOG2E / eps),
            float(LOG2E / eps),
            float(eps * LN2),
            float(damping),
            0.0,
            BLOCK_D=BLOCK_D,
            NUM_D=NUM_D,
            EVEN_D=BLOCK_D * NUM_D == D,
            BLOCK_DV=16,
            HAS_V=False,
            HAS_LABELS=False,
            HAS_LSE=False,
            PREC=prec,
            BLOCK_M=bm,
            BLOCK_N=bn,
            HAS_FLAGS=True,
            num_warps=w,
            num_stages=st,
        )
    return out
