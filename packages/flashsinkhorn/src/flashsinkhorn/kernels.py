"""Streaming Sinkhorn primitives: the fused row-LogSumExp update and the plan application.

Everything in flashsinkhorn is built from ONE streaming primitive. For a batch of point
clouds ``X (B, N, D)``, ``Y (B, M, D)`` and a cost of the form

    C_ij = cx_i + cy_j - c2 * <X_i, Y_j>  [+ w_scale * W[lx_i, ly_j]]

(squared Euclidean: ``cx = s|x|^2, cy = s|y|^2, c2 = 2s``; dot-product / feature-map costs:
``cx = cy = 0``), :func:`softmin` computes, for every row ``i``,

    lse2_i = log2 sum_j exp2( log2e * [ logb_j + (g_j - cy_j + c2 <X_i, Y_j> - w W)/eps ] )
    out_i  = damping * (cx_i - eps * ln2 * lse2_i)        (the "softmin" / c-transform)

which is ``damping * (-eps) * LSE_j(logb_j + (g_j - C_ij)/eps)``: the Sinkhorn update of
the potential ``f`` from ``g``. With ``V (B, M, DV)`` it also returns the softmax average
``sum_j pi_ij V_j`` with ``pi_ij = softmax_j(logb_j + (g_j - C_ij)/eps)``, from which the plan
application ``P @ V`` (``P_ij = a_i b_j exp((f_i + g_j - C_ij)/eps)``) and the barycentric map
follow in O(N) work (:func:`plan_apply`).

The Triton kernel keeps a block of rows of X on chip and streams tiles of Y (row-stationary
traversal, like FlashAttention's forward): running max and sum per row (online LSE, base 2
with the 1/eps and log2(e) scales folded into one multiplier of the dot product), never an
N x M buffer. Backends:

- ``"triton"``: CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set before
  Python started (the CI exercises the kernel that way);
- ``"torch"``: a blockwise pure-torch path (row blocks against all columns), any device and
  dtype (float64 included), same math;
- ``"auto"``: triton on CUDA, torch otherwise.

Precision of the dot product (triton backend): ``"tf32"`` (default), ``"ieee"`` (full fp32),
``"tf32x3"``, or ``"bf16"`` (operands stored and multiplied in bfloat16, fp32 accumulation).
Everything else is fp32 inside the kernel.
"""

from __future__ import annotations

import math
import os

import torch

try:  # triton is an optional runtime dependency off Linux
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

__all__ = [
    "softmin",
    "plan_apply",
    "softmin_ref",
    "plan_apply_ref",
    "resolve_backend",
    "self_softmin",
    "PRECISIONS",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
PRECISIONS = ("tf32", "ieee", "tf32x3", "bf16")


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``"auto" | "triton" | "torch"`` to the backend used for tensors on ``device``."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch'; got {backend!r}")
    if backend == "auto":
        return "triton" if (device.type == "cuda" and HAS_TRITON) else "torch"
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' needs the triton package")
        if device.type != "cuda" and not _interpret():
            raise RuntimeError(
                "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before Python "
                "starts; use backend='torch' or 'auto' instead"
            )
    return backend


# ----------------------------------------------------------------------------------------
# float64 dense references (the oracle; small problems only: they build the N x M matrix)
# ----------------------------------------------------------------------------------------


def _cost_dense(x, y, cx, cy, c2, labels):
    C = cx[..., :, None] + cy[..., None, :] - c2 * (x @ y.transpose(-1, -2))
    if labels is not None:
        lx, ly, W, w_scale = labels
        C = C + w_scale * W[lx.long()[..., :, None], ly.long()[..., None, :]]
    return C


def softmin_ref(x, y, g, logb, cx, cy, *, eps, c2, damping=1.0, v=None, labels=None):
    """Dense float64 reference of :func:`softmin` (same arguments, batched (B, ...) inputs).

    Returns ``(out, lse2, vbar)`` with ``vbar = None`` when ``v`` is None.
    """
    d = torch.float64
    x, y, g, logb, cx, cy = (t.to(d) for t in (x, y, g, logb, cx, cy))
    lab = None
    if labels is not None:
        lx, ly, W, w_scale = labels
        lab = (lx, ly, W.to(d), w_scale)
    C = _cost_dense(x, y, cx, cy, c2, lab)
    S = logb[..., None, :] + (g[..., None, :] - C) / eps  # (B, N, M)
    lse = torch.logsumexp(S, dim=-1)
    out = damping * (-eps * lse)
    lse2 = (lse + cx / eps) / LN2  # kernel convention: cx excluded from the scores
    vbar = None
    if v is not None:
        vbar = torch.softmax(S, dim=-1) @ v.to(d)
    return out, lse2, vbar


def plan_apply_ref(x, y, a, b, f, g, v, *, eps, cost_scale=1.0):
    """Dense float64 ``P @ V`` for the squared-Euclidean cost ``cost_scale * |x - y|^2``."""
    d = torch.float64
    x, y, a, b, f, g, v = (t.to(d) for t in (x, y, a, b, f, g, v))
    C = cost_scale * torch.cdist(x, y) ** 2
    P = a[..., :, None] * b[..., None, :] * torch.exp((f[..., :, None] + g[..., None, :] - C) / eps)
    return P @ v


# ----------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------

if HAS_TRITON:

    def _no_autotune() -> bool:
        return _interpret() or os.environ.get("FLASHSINKHORN_NO_AUTOTUNE", "0") == "1"

    # (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_D is chosen by the launcher.
    _FIXED = (64, 64, 4, 2)
    if os.environ.get("FLASHSINKHORN_FIXED_CONFIG"):  # e.g. "128,64,8,3" (no-autotune runs)
        _FIXED = tuple(int(v) for v in os.environ["FLASHSINKHORN_FIXED_CONFIG"].split(","))
    # the plan-application variant (HAS_V, once per solve) is not autotuned: on the GPU it
    # uses a Hopper-sized tile unless a fixed config was requested
    _FIXED_V = _FIXED
    if not _no_autotune() and not os.environ.get("FLASHSINKHORN_FIXED_CONFIG"):
        _FIXED_V = (128, 64, 8, 3)
    # Wide plan application (DV > 64): every chunk of BLOCK_DV output columns recomputes
    # the scores, so with 64-wide chunks the gradient at d = 1024 runs 16 full score passes
    # per side. 256-wide chunks on 64 x 64 tiles with 8 warps keep the 64 x 256 accumulator
    # in registers (static sm_90 compile, triton 3.9: 255 registers, 8 bytes of stack; the
    # 128 x 64 tile with 64-wide chunks already spills 272 bytes at d >= 512) and cut the
    # score passes 4x. FLASHSINKHORN_NARROW_V=1 restores the 64-wide chunks (comparison).
    _FIXED_V_WIDE = (64, 64, 8, 3)
    _WIDE_DV = 256  # BLOCK_DV of the wide chunks
    if _no_autotune():
        _FIXED_V_WIDE = _FIXED
    WIDE_V = os.environ.get("FLASHSINKHORN_NARROW_V", "0") != "1"
    # Hopper (H200) candidates; d <= 128 is one tl.dot per tile (K = BLOCK_D)
    _TUNE_SMALL_D = [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 128, 4, 4),
                     (256, 64, 8, 3)]  # fmt: skip
    _TUNE_LARGE_D = [(128, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2)]

    def _configs():
        if _no_autotune():
            bm, bn, w, st = _FIXED
            return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)]
        seen, cfgs = set(), []
        for bm, bn, w, st in _TUNE_SMALL_D + _TUNE_LARGE_D:
            if (bm, bn, w, st) not in seen:
                seen.add((bm, bn, w, st))
                cfgs.append(
                    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                )
        return cfgs

    def _prune(configs, named_args, **kwargs):
        nd = kwargs.get("NUM_D", 1)
        allowed = set(_TUNE_SMALL_D if nd == 1 else _TUNE_LARGE_D)
        out = [
            c
            for c in configs
            if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in allowed
        ]
        return out or configs[:1]

    # -- tile helpers (inlined by the compiler), shared with second_order/_stream.py --------

    @triton.jit
    def _load_rows(P, idx, mask, offs_d, stride, D, EVEN_D: tl.constexpr):
        """Tile ``P[idx, offs_d]`` of a row-major operand with row stride ``stride``: rows
        outside ``mask`` (and, unless EVEN_D, features at or past D) read as 0."""
        if EVEN_D:
            m = mask[:, None]
        else:
            m = mask[:, None] & (offs_d[None, :] < D)
        return tl.load(P + idx[:, None] * stride + offs_d[None, :], mask=m, other=0.0)

    @triton.jit
    def _tile_dot(
        X, Y, rows, cols, row_mask, col_mask, sx, sy, D, acc, num_d,
        EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """``acc + <X_rows, Y_cols>`` for one tile, over ``num_d`` chunks of BLOCK_D features
        (``num_d`` a constexpr or a run-time ``cdiv(D, BLOCK_D)``)."""
        offs_d = tl.arange(0, BLOCK_D)
        for kd in range(num_d):
            dd = kd * BLOCK_D + offs_d
            xk = _load_rows(X, rows, row_mask, dd, sx, D, EVEN_D)
            yk = _load_rows(Y, cols, col_mask, dd, sy, D, EVEN_D)
            acc = tl.dot(xk, tl.trans(yk), acc, input_precision=PREC)
        return acc

    @triton.jit
    def _row_stationary_dot(
        x0, X, Y, rows, cols, row_mask, col_mask, D,
        NUM_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """``<X_rows, Y_cols>`` (BLOCK_M, BLOCK_N) for a kernel that keeps its row tile on
        chip: with one feature chunk (NUM_D == 1) ``x0`` is that preloaded row tile and only
        the column tile is loaded; otherwise both stream chunk by chunk (x0 unused)."""
        if NUM_D == 1:
            y = _load_rows(Y, cols, col_mask, tl.arange(0, BLOCK_D), D, D, EVEN_D)
            s = tl.dot(x0, tl.trans(y), input_precision=PREC)
        else:
            s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            s = _tile_dot(
                X, Y, rows, cols, row_mask, col_mask, D, D, D, s, NUM_D, EVEN_D, BLOCK_D, PREC
            )
        return s

    @triton.jit
    def _label_tile(LY, W, lx, cols, row_mask, col_mask, stride):
        """Label-cost tile ``W[lx_i, ly_j]`` (0 outside the masks); LY: this problem's column
        labels, lx: the row labels already loaded, stride: W's row stride."""
        ly = tl.load(LY + cols, mask=col_mask, other=0)
        return tl.load(
            W + lx[:, None] * stride + ly[None, :],
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )

    @triton.jit
    def _online_lse_step(m_i, l_i, s):
        """One tile of a streaming base-2 LogSumExp over the rows of ``s`` (BLOCK_M, BLOCK_N).

        Returns ``(m_new, l_new, alpha, p)``: running max and sum, the rescaling ``alpha`` of
        the old sum (also for accumulators) and ``p = exp2(s - m_new)`` (0 where s = -inf).
        """
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        return m_new, l_i, alpha, p

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
    ):
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

        for start in range(0, M, BLOCK_N):
            cols = start + offs_n
            col_mask = cols < M
            # scores in log2 units: bias_j + dot_scale * <x_i, y_j>
            s = _row_stationary_dot(
                x0, Xb, Yb, rows, cols, row_mask, col_mask, D,
                NUM_D, EVEN_D, BLOCK_D, PREC, BLOCK_M, BLOCK_N,
            )  # fmt: skip
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

        lse2 = m_i + tl.log2(l_i)
        if pid_v == 0:
            cx = tl.load(CX + pid_b64 * N + rows, mask=row_mask, other=0.0).to(tl.float32)
            out = damping * (cx - eps_ln2 * lse2)
            tl.store(OUT + pid_b64 * N + rows, out, mask=row_mask)
            if HAS_LSE:
                tl.store(LSE + pid_b64 * N + rows, lse2, mask=row_mask)
        if HAS_V:
            vbar = acc / l_i[:, None]
            tl.store(
                VBAR + pid_b64 * N * DV + rows[:, None] * DV + offs_v[None, :],
                vbar,
                mask=row_mask[:, None] & (offs_v[None, :] < DV),
            )


# ----------------------------------------------------------------------------------------
# Variants of the iteration kernel (no V): FLASHSINKHORN_SOFTMIN_VARIANT ("shift" is the default)
# ----------------------------------------------------------------------------------------
#
# In `_softmin_kernel` each tile waits for its own dot before its exps, so inside one CTA
# the tensor cores (wgmma) and the exp units (MUFU) take turns (NOTES.md, "What would
# remain"). The variants below try to overlap them, selected at launch by the environment
# variable FLASHSINKHORN_SOFTMIN_VARIANT (unset: "shift" where the caller passes a guess):
#
# - "pipe": software-pipelined loop, FA3's intra-warpgroup pipelining idea written in
#   Triton: the dot of column tile j + 1 is issued before the exp / online-LSE work of tile
#   j (first tile's dot peeled before the loop, last tile's exps after it). Triton's Hopper
#   pass (asyncLaunchDots, WGMMAPipeline.cpp) keeps a wgmma in flight across other work only
#   if its result is yielded to the next iteration AND a `wait 0` precedes every use of that
#   result in the loop body; otherwise it puts `wait 0` right after the dot. So the loop
#   starts with a tiny "fence" dot (BLOCK_M x 16 x 16 of zeros, kept alive by adding its
#   exact zero to the running sum) whose `wait 0` satisfies that rule; tile j + 1's dot is
#   then issued and stays in flight during tile j's exps. A second fence after the exps
#   (its input depends on the new running sum, so ptxas cannot hoist it) retires dot(j + 1)
#   before the loop's end copies its registers into the loop-carried tile: ptxas
#   serializes every wgmma of a kernel in which an in-flight accumulator is read ("C7514"),
#   which a single fence leaves happening (static sm_90 compile, scripts/
#   softmin_variants_sm90.py: with both fences the 8 HGMMA of a tile interleave with its
#   EX2 and no wait between them). tf32x3 splits the dot in three products that Triton
#   waits on one by one, so it gains nothing there.
# - "pipe_nofence": the same loop without the fences (control: Triton then waits right
#   after each dot, so the order changes but nothing overlaps).
# - "ws" (`tl.range(..., warp_specialize=True)`) was tried and removed: on Hopper with Triton
#   3.6 it compiled to the default kernel's SASS (H200 run 13: 1.03x at d = 64, within noise)
#   and failed to compile at 4 warps; the pass targets sm_100.
# - "stages": the default loop as `tl.range(..., num_stages=LOOP_STAGES)` (pipelines the
#   bias / label loads too, not only the dot operands).
# - "shift": no running max. The caller passes `guess`, an estimate of the potential the
#   pass returns (in the Sinkhorn loops: the potential being updated); the kernel turns it
#   into a fixed per-row shift sh_i = lse2 estimate - SHIFT_CENTER (log2 units) and sums
#   exp2(score - sh_i): per score one FFMA, one FADD, one exp2, one FADD, and per tile no
#   row max (FMNMX + shuffles), no rescale exp2 and no dependence of the exps on a
#   reduction. Exact whatever the guess: a row whose sum is not in [2^-60, FLT_MAX]
#   (overflow, everything flushed, NaN from a non-finite guess) is recomputed, in the same
#   kernel, by a second tile loop with the online max that runs only for row blocks that
#   have such a row (no host sync). Without a guess (first pass) the launcher runs the
#   default kernel (explicit fallback).
#
# Features: labels, damping, batch and every precision are supported by every variant; the
# plan-application pass (with V) always uses `_softmin_kernel` (explicit fallback).

SOFTMIN_VARIANTS = ("default", "pipe", "pipe_nofence", "stages", "shift")
_VARIANT_MODE = {"pipe": 1, "pipe_nofence": 2, "stages": 4, "shift": 8}
# "shift": the fixed shift aims the row sum at 2^SHIFT_CENTER, so the guess may be off by
# -92 .. +95 log2 units (about -64 .. +66 in units of eps) before a row needs the fallback
SHIFT_CENTER = 32.0
# diagnostics: set to a (1,) int32 tensor on the kernels' device and every "shift" launch
# adds the number of rows it recomputed with the running max (None: not counted)
SHIFT_FALLBACK_ROWS = None
# a row is safe when its shifted sum is in [2^-60, float32 max]: above is inf (an
# overflowed term) or NaN; below, the flushed terms (< 2^-126 each, at most M of them) may
# matter (relative error <= M 2^-66: below float32 rounding for M up to 2^40)
# (BLOCK_M, BLOCK_N, warps, stages) forced for the variant kernel (None: autotuned on the
# GPU, the fixed config under the interpreter); scripts/sweep_softmin_variants.py sets it
VARIANT_CONFIG = None
if os.environ.get("FLASHSINKHORN_VARIANT_CONFIG"):  # e.g. "128,64,8,3"
    VARIANT_CONFIG = tuple(int(v) for v in os.environ["FLASHSINKHORN_VARIANT_CONFIG"].split(","))


# The iteration passes' kernel when FLASHSINKHORN_SOFTMIN_VARIANT is unset: "shift" since
# the H200 run of 2026-12-01 evening (one 50k pass, d = 64: tf32 2.09 -> 1.94 ms, bf16 1.44
# -> 1.36, d = 512 tf32 10.40 -> 10.11; SamplesLoss fwd 34.4 -> 32.1 ms; 0 rows recomputed,
# outputs within 6e-8 of the running-max kernel; NOTES.md). Passes without a guess (the
# first one, plan applications, the public softmin without `guess`) run `_softmin_kernel`.
DEFAULT_SOFTMIN_VARIANT = "shift"


def softmin_variant() -> str:
    """The softmin kernel variant selected by FLASHSINKHORN_SOFTMIN_VARIANT (read at each
    launch; "" or unset means DEFAULT_SOFTMIN_VARIANT; "default" is the running-max kernel
    `_softmin_kernel`)."""
    v = os.environ.get("FLASHSINKHORN_SOFTMIN_VARIANT", "") or DEFAULT_SOFTMIN_VARIANT
    if v not in SOFTMIN_VARIANTS:
        raise ValueError(
            f"FLASHSINKHORN_SOFTMIN_VARIANT must be one of {SOFTMIN_VARIANTS}; got {v!r}"
        )
    return v


if HAS_TRITON:
    _SHIFT_C = tl.constexpr(SHIFT_CENTER)
    _SHIFT_LO = tl.constexpr(2.0**-60)
    _SHIFT_HI = tl.constexpr(3.4028234663852886e38)

    @triton.jit
    def _tile_scores(
        s, BIASb, LYb, W, lx, cols, row_mask, col_mask, K2,
        dot_scale, inv_eps2, w_scale, HAS_LABELS: tl.constexpr,
    ):  # fmt: skip
        """Scores (log2 units) of one tile from its dot ``s``: bias FMA and label term, the
        same arithmetic as `_softmin_kernel`'s loop body."""
        bias = tl.load(BIASb + cols, mask=col_mask, other=float("-inf"))
        s = s * dot_scale + bias[None, :]
        if HAS_LABELS:
            wv = _label_tile(LYb, W, lx, cols, row_mask, col_mask, K2)
            s = s - (w_scale * inv_eps2) * wv
        return s

    @triton.jit
    def _lse_tile(
        m_i, l_i, s, BIASb, LYb, W, lx, cols, row_mask, col_mask, K2,
        dot_scale, inv_eps2, w_scale, HAS_LABELS: tl.constexpr,
    ):  # fmt: skip
        """`_tile_scores` folded into the running max / sum."""
        s = _tile_scores(
            s, BIASb, LYb, W, lx, cols, row_mask, col_mask, K2,
            dot_scale, inv_eps2, w_scale, HAS_LABELS,
        )  # fmt: skip
        m_new, l_i, alpha, p = _online_lse_step(m_i, l_i, s)
        return m_new, l_i

    @triton.jit
    def _softmin_variant_kernel(
        X, Y, BIAS, CX, OUT, LSE, LX, LY, W, GUESS, FALLBACK,
        N, M, D, K2, N_KEY, M_KEY,
        dot_scale, inv_eps2, eps_ln2, damping, w_scale,
        BLOCK_D: tl.constexpr, NUM_D: tl.constexpr, EVEN_D: tl.constexpr,
        HAS_LABELS: tl.constexpr, HAS_LSE: tl.constexpr, PREC: tl.constexpr,
        MODE: tl.constexpr, COUNT_FALLBACK: tl.constexpr, LOOP_STAGES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
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

        if MODE == 8:
            # fixed shift (log2 units): the guess of out = damping (cx - eps ln2 lse2)
            # solved for lse2, minus SHIFT_CENTER; sum exp2(score - sh) with no running max
            cx = tl.load(CX + pid_b64 * N + rows, mask=row_mask, other=0.0).to(tl.float32)
            guess = tl.load(GUESS + pid_b64 * N + rows, mask=row_mask, other=0.0)
            sh = (cx - guess / damping) / eps_ln2 - _SHIFT_C
            l_s = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for start in range(0, M, BLOCK_N):
                cols = start + offs_n
                col_mask = cols < M
                s = _row_stationary_dot(
                    x0, Xb, Yb, rows, cols, row_mask, col_mask, D,
                    NUM_D, EVEN_D, BLOCK_D, PREC, BLOCK_M, BLOCK_N,
                )  # fmt: skip
                s = _tile_scores(
                    s, BIASb, LYb, W, lx, cols, row_mask, col_mask, K2,
                    dot_scale, inv_eps2, w_scale, HAS_LABELS,
                )  # fmt: skip
                l_s += tl.sum(tl.exp2(s - sh[:, None]), 1)
            # unsafe rows (NaN fails both tests): recomputed below with the running max
            safe = (l_s >= _SHIFT_LO) & (l_s <= _SHIFT_HI)
            bad = (safe == 0) & row_mask
            n_bad = tl.sum(bad.to(tl.int32), 0)
            if n_bad > 0:
                if COUNT_FALLBACK:  # diagnostics (tests, sweep): rows recomputed
                    tl.atomic_add(FALLBACK, n_bad)
                # not software-pipelined (num_stages=1): a second pipelined loop in the
                # kernel took the registers from 70 to 120 (static sm_90 compile, tf32,
                # 128 x 64, 8 warps); this loop runs only for blocks with a bad guess
                for start in tl.range(0, M, BLOCK_N, num_stages=1):
                    cols = start + offs_n
                    col_mask = cols < M
                    s = _row_stationary_dot(
                        x0, Xb, Yb, rows, cols, row_mask, col_mask, D,
                        NUM_D, EVEN_D, BLOCK_D, PREC, BLOCK_M, BLOCK_N,
                    )  # fmt: skip
                    m_i, l_i = _lse_tile(
                        m_i, l_i, s, BIASb, LYb, W, lx, cols, row_mask, col_mask, K2,
                        dot_scale, inv_eps2, w_scale, HAS_LABELS,
                    )  # fmt: skip
        elif MODE == 1 or MODE == 2:
            # software-pipelined: dot(tile j + 1) is issued before the exps of tile j
            last = (tl.cdiv(M, BLOCK_N) - 1) * BLOCK_N  # start of the last (maybe partial) tile
            s_nxt = _row_stationary_dot(
                x0, Xb, Yb, rows, offs_n, row_mask, offs_n < M, D,
                NUM_D, EVEN_D, BLOCK_D, PREC, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            if MODE == 1 and NUM_D == 1:
                fence_b = tl.zeros((16, 16), dtype=Y.dtype.element_ty)
                fence_a = tl.zeros((BLOCK_M, 16), dtype=Y.dtype.element_ty)
            for start in tl.range(0, last, BLOCK_N, num_stages=LOOP_STAGES):
                if MODE == 1 and NUM_D == 1:
                    # the fence dot: exact zeros that depend on the loop index (not
                    # hoisted, no wait on this tile's sums); its wait retires dot(j)
                    fence_c = tl.zeros((BLOCK_M, 16), dtype=tl.float32) * start
                    fz = tl.dot(fence_a, fence_b, fence_c, input_precision=PREC)
                    l_i = l_i + tl.sum(fz, 1)
                nxt = start + BLOCK_N + offs_n
                s_new = _row_stationary_dot(
                    x0, Xb, Yb, rows, nxt, row_mask, nxt < M, D,
                    NUM_D, EVEN_D, BLOCK_D, PREC, BLOCK_M, BLOCK_N,
                )  # fmt: skip
                cols = start + offs_n
                m_i, l_i = _lse_tile(
                    m_i, l_i, s_nxt, BIASb, LYb, W, lx, cols, row_mask, cols < M, K2,
                    dot_scale, inv_eps2, w_scale, HAS_LABELS,
                )  # fmt: skip
                if MODE == 1 and NUM_D == 1:
                    # second fence: retire dot(j + 1) after the exps, before the loop's end
                    # copies its registers into the loop-carried tile (ptxas serializes every
                    # wgmma of a kernel in which an in-flight accumulator is read)
                    # (its accumulator input depends on the new running sum, so that ptxas
                    # cannot issue it, and its wait, before the exps)
                    fence_c = l_i[:, None] * tl.zeros((1, 16), dtype=tl.float32)
                    fz = tl.dot(fence_a, fence_b, fence_c, input_precision=PREC)
                    l_i = l_i + tl.sum(fz, 1)
                s_nxt = s_new
            cols = last + offs_n
            m_i, l_i = _lse_tile(
                m_i, l_i, s_nxt, BIASb, LYb, W, lx, cols, row_mask, cols < M, K2,
                dot_scale, inv_eps2, w_scale, HAS_LABELS,
            )  # fmt: skip
        else:
            for start in tl.range(0, M, BLOCK_N, num_stages=LOOP_STAGES):
                cols = start + offs_n
                col_mask = cols < M
                s = _row_stationary_dot(
                    x0, Xb, Yb, rows, cols, row_mask, col_mask, D,
                    NUM_D, EVEN_D, BLOCK_D, PREC, BLOCK_M, BLOCK_N,
                )  # fmt: skip
                m_i, l_i = _lse_tile(
                    m_i, l_i, s, BIASb, LYb, W, lx, cols, row_mask, col_mask, K2,
                    dot_scale, inv_eps2, w_scale, HAS_LABELS,
                )  # fmt: skip

        if MODE == 8:
            # each row takes one of the two sums; the other one's log2 reads 1 (rows not
            # recomputed keep l_i = 0: no log2(0), which the interpreter reports as an error)
            lse2 = tl.where(
                bad,
                m_i + tl.log2(tl.where(bad, l_i, 1.0)),
                sh + tl.log2(tl.where(bad, 1.0, l_s)),
            )
        else:
            lse2 = m_i + tl.log2(l_i)
            cx = tl.load(CX + pid_b64 * N + rows, mask=row_mask, other=0.0).to(tl.float32)
        out = damping * (cx - eps_ln2 * lse2)
        tl.store(OUT + pid_b64 * N + rows, out, mask=row_mask)
        if HAS_LSE:
            tl.store(LSE + pid_b64 * N + rows, lse2, mask=row_mask)

    def _variant_configs():
        if _no_autotune():
            bm, bn, w, st = _FIXED
            return [
                triton.Config(
                    {"BLOCK_M": bm, "BLOCK_N": bn, "LOOP_STAGES": st}, num_warps=w, num_stages=st
                )
            ]
        return [
            triton.Config(
                {
                    "BLOCK_M": c.kwargs["BLOCK_M"],
                    "BLOCK_N": c.kwargs["BLOCK_N"],
                    "LOOP_STAGES": c.num_stages,
                },
                num_warps=c.num_warps,
                num_stages=c.num_stages,
            )  # fmt: skip
            for c in _configs()
        ]

    _softmin_variant_tuned = triton.autotune(
        configs=_variant_configs(),
        key=["N_KEY", "M_KEY", "D", "HAS_LABELS", "PREC", "MODE"],
        prune_configs_by=None if _no_autotune() else {"early_config_prune": _prune},
    )(_softmin_variant_kernel)


if HAS_TRITON:
    # autotuned entry point for the iteration kernel (no V); the plan-application variant
    # (HAS_V) runs once per solve and uses one fixed config (no compile storm on the GPU).
    _softmin_tuned = triton.autotune(
        configs=_configs(),
        key=["N_KEY", "M_KEY", "D", "HAS_LABELS", "PREC"],
        prune_configs_by=None if _no_autotune() else {"early_config_prune": _prune},
    )(_softmin_kernel)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _label_operands(lx, ly, W):
    """Label-cost operands in the kernels' form: int32 labels, fp32 contiguous table, and
    the table's row stride."""
    W = W.to(torch.float32).contiguous()
    return lx.to(torch.int32).contiguous(), ly.to(torch.int32).contiguous(), W, W.stride(0)


def _bucket(n: int) -> int:
    return min(_next_pow2(n), 1 << 16)


def _softmin_triton(
    x, y, g, logb, cx, cy, eps, c2, damping, v, labels, precision, want_lse, center, guess=None
):
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
    BLOCK_D = max(16, min(_next_pow2(D), 128 if D <= 128 else 64))
    NUM_D = triton.cdiv(D, BLOCK_D)
    if v is not None:
        DV = v.shape[-1]
        v = v.to(kdt).contiguous()
        if WIDE_V and DV > 64:
            BLOCK_DV, v_config = min(_next_pow2(DV), _WIDE_DV), _FIXED_V_WIDE
        else:
            BLOCK_DV, v_config = max(16, min(_next_pow2(DV), 64)), _FIXED_V
        n_v = triton.cdiv(DV, BLOCK_DV)
        vbar = torch.empty((B, N, DV), device=dev, dtype=f32)
    else:
        DV, BLOCK_DV, n_v = 0, 16, 1
        v = vbar = out
    if labels is not None:
        lx, ly, W, w_scale = labels
        lx, ly, W, K2 = _label_operands(lx, ly, W)
    else:
        lx = ly = W = out
        K2, w_scale = 1, 0.0
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B, n_v)  # noqa: E731
    variant = softmin_variant()
    if variant == "shift" and guess is None:
        variant = "default"  # no estimate of the result (first pass): the default kernel
    if variant != "default" and DV == 0:  # with V: always _softmin_kernel (fallback)
        guess = out if guess is None else guess.to(f32).contiguous()
        _launch_variant(
            variant, grid, dev, x, y, bias, cx, out, lse, lx, ly, W, N, M, D, K2,
            eps, c2, damping, w_scale, BLOCK_D, NUM_D, labels is not None, want_lse, prec,
            guess,
        )  # fmt: skip
        return out, (lse if want_lse else None), None
    extra = {}
    if DV > 0:
        kern = _softmin_kernel
        bm, bn, w, st = v_config
        extra = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
    else:
        kern = _softmin_tuned
    with torch.cuda.device(dev) if dev.type == "cuda" else _nullctx():
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
            N,
            M,
            D,
            DV,
            K2,
            _bucket(N),
            _bucket(M),
            float(c2 * LOG2E / eps),
            float(LOG2E / eps),
            float(eps * LN2),
            float(damping),
            float(w_scale),
            BLOCK_D=BLOCK_D,
            NUM_D=NUM_D,
            EVEN_D=BLOCK_D * NUM_D == D,
            BLOCK_DV=BLOCK_DV,
            HAS_V=DV > 0,
            HAS_LABELS=labels is not None,
            HAS_LSE=want_lse,
            PREC=prec,
            **extra,
        )
    return out, (lse if want_lse else None), (vbar if DV > 0 else None)


def _launch_variant(
    variant, grid, dev, x, y, bias, cx, out, lse, lx, ly, W, N, M, D, K2,
    eps, c2, damping, w_scale, BLOCK_D, NUM_D, has_labels, want_lse, prec, guess,
):  # fmt: skip
    """Launch `_softmin_variant_kernel` (autotuned, or at VARIANT_CONFIG when set); returns
    what Triton's launch returns (the compiled kernel: the sweep script reads its PTX).
    ``guess``: the (B, N) fp32 estimate of ``out`` ("shift"; any tensor otherwise)."""
    extra = {}
    kern = _softmin_variant_tuned
    if VARIANT_CONFIG is not None:
        bm, bn, w, st = VARIANT_CONFIG
        kern = _softmin_variant_kernel
        extra = dict(BLOCK_M=bm, BLOCK_N=bn, LOOP_STAGES=st, num_warps=w, num_stages=st)
    with torch.cuda.device(dev) if dev.type == "cuda" else _nullctx():
        return kern[grid](
            x, y, bias, cx, out, lse, lx, ly, W, guess,
            out if SHIFT_FALLBACK_ROWS is None else SHIFT_FALLBACK_ROWS,
            N, M, D, K2, _bucket(N), _bucket(M),
            float(c2 * LOG2E / eps), float(LOG2E / eps), float(eps * LN2), float(damping),
            float(w_scale),
            BLOCK_D=BLOCK_D, NUM_D=NUM_D, EVEN_D=BLOCK_D * NUM_D == D, HAS_LABELS=has_labels,
            HAS_LSE=want_lse, PREC=prec, MODE=_VARIANT_MODE[variant],
            COUNT_FALLBACK=SHIFT_FALLBACK_ROWS is not None, **extra,
        )  # fmt: skip


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------------------
# blockwise torch path (any device, any float dtype)
# ----------------------------------------------------------------------------------------


def _block_rows(n: int, m: int) -> int:
    """Rows per block of the torch paths: at most ~4M scores (n x m) per block."""
    return max(1, min(n, (1 << 22) // max(1, m)))


def _softmin_torch(x, y, g, logb, cx, cy, eps, c2, damping, v, labels, want_lse, center):
    B, N, D = x.shape
    M = y.shape[1]
    dt = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    x, y, g, logb, cx, cy = (t.to(dt) for t in (x, y, g, logb, cx, cy))
    if center is not None:
        y = y - center.to(dt)[:, None, :]
    bias = logb + (g - cy) / eps  # (B, M)
    yt = y.transpose(1, 2)
    out = torch.empty((B, N), dtype=dt, device=x.device)
    lse2 = torch.empty((B, N), dtype=dt, device=x.device) if want_lse else None
    vbar = None
    if v is not None:
        v = v.to(dt)
        vbar = torch.empty((B, N, v.shape[-1]), dtype=dt, device=x.device)
    rows = _block_rows(N, M)
    for i0 in range(0, N, rows):
        i1 = min(N, i0 + rows)
        xi = x[:, i0:i1] if center is None else x[:, i0:i1] - center.to(dt)[:, None, :]
        S = (c2 / eps) * torch.bmm(xi, yt) + bias[:, None, :]
        if labels is not None:
            lx, ly, W, w_scale = labels
            Wt = W.to(dt)[lx[:, i0:i1].long()[:, :, None], ly.long()[:, None, :]]
            S = S - (w_scale / eps) * Wt
        lse = torch.logsumexp(S, dim=-1)
        out[:, i0:i1] = damping * (cx[:, i0:i1] - eps * lse)
        if want_lse:
            lse2[:, i0:i1] = lse / LN2
        if v is not None:
            vbar[:, i0:i1] = torch.bmm(torch.softmax(S, dim=-1), v)
    return out, lse2, vbar


# ----------------------------------------------------------------------------------------
# public launchers
# ----------------------------------------------------------------------------------------


def softmin(
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
    v: torch.Tensor | None = None,
    labels: tuple | None = None,
    precision: str = "tf32",
    backend: str = "auto",
    want_lse: bool = False,
    center: torch.Tensor | None = None,
    guess: torch.Tensor | None = None,
):
    """Streaming c-transform (fused row-LSE update) for batched clouds.

    Args:
        x: (B, N, D) row points (features). y: (B, M, D) column points.
        g: (B, M) column potential. logb: (B, M) log column weights (-inf allowed).
        cx: (B, N), cy: (B, M) additive cost terms (``s|x|^2``, ``s|y|^2`` for sqeuclidean).
        eps: temperature (> 0). c2: multiplier of the dot product in the cost.
        damping: unbalanced factor ``1 / (1 + eps/rho)`` (1 for balanced).
        v: optional (B, M, DV): also return ``vbar_i = sum_j pi_ij v_j`` (row softmax).
        labels: optional ``(lx (B, N) int, ly (B, M) int, W (K1, K2), w_scale)`` adding
            ``w_scale * W[lx_i, ly_j]`` to the cost (OTDD's label cost), gathered in-kernel.
        precision: dot precision for the triton backend: "tf32", "ieee", "tf32x3", "bf16".
        backend: "auto", "triton" or "torch".
        want_lse: also return ``lse2`` (B, N): ``log2 sum_j exp2(score_ij)`` with the scores
            excluding ``cx`` (so ``out = damping * (cx - eps * ln2 * lse2)``).
        center: optional (B, D): the dot product uses ``<x_i - c, y_j - c>`` (the triton
            backend subtracts it in one pass before the kernel, an O((N + M) D) copy per
            call; loops should pass centered operands once and ``center=None``). For the
            squared-Euclidean cost pass ``cx = s|x - c|^2``, ``cy = s|y - c|^2``: same
            cost, smaller operands, better tf32/bf16 accuracy.
        guess: optional (B, N) estimate of ``out`` (in the Sinkhorn loops: the potential
            being updated). Read only by the "shift" kernel (the default of
            FLASHSINKHORN_SOFTMIN_VARIANT; triton backend, no ``v``), which uses it as a
            fixed per-row shift instead of a running max; the result is exact whatever the
            guess (rows it does not fit are recomputed with the running max in the same
            kernel). Ignored otherwise.

    Returns:
        ``(out, lse2_or_None, vbar_or_None)``; ``out = damping * softmin_j(...)`` (B, N).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    be = resolve_backend(backend, x.device)
    if be == "triton":
        return _softmin_triton(
            x, y, g, logb, cx, cy, eps, c2, damping, v, labels, precision, want_lse, center,
            guess,
        )  # fmt: skip
    return _softmin_torch(x, y, g, logb, cx, cy, eps, c2, damping, v, labels, want_lse, center)


def plan_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    f: torch.Tensor,
    g: torch.Tensor,
    v: torch.Tensor,
    cx: torch.Tensor,
    cy: torch.Tensor,
    *,
    eps: float,
    c2: float,
    labels: tuple | None = None,
    normalize: bool = False,
    precision: str = "tf32",
    backend: str = "auto",
):
    """Streaming ``P @ V`` with ``P_ij = a_i b_j exp((f_i + g_j - C_ij)/eps)``, batched.

    Shapes: x (B, N, D), y (B, M, D), a, f, cx (B, N), b, g, cy (B, M), v (B, M, K).
    With ``normalize=True`` returns the row-normalized average ``(P V)_i / (P 1)_i``
    (the barycentric map when ``v = y``). Never materializes P. Returns ``(out (B, N, K),
    row_sums (B, N))`` where ``row_sums = P @ 1``.
    """
    logb = torch.log(b)
    _, lse2, vbar = softmin(
        x,
        y,
        g,
        logb,
        cx,
        cy,
        eps=eps,
        c2=c2,
        v=v,
        labels=labels,
        precision=precision,
        backend=backend,
        want_lse=True,
    )
    dt = vbar.dtype
    # log row sum = log a_i + (f_i - cx_i)/eps + ln2 * lse2_i
    log_rows = torch.log(a.to(dt)) + (f.to(dt) - cx.to(dt)) / eps + LN2 * lse2.to(dt)
    rows = torch.exp(log_rows)
    if normalize:
        return vbar, rows
    return vbar * rows[..., None], rows


# ----------------------------------------------------------------------------------------
# symmetric self-transport (the debiasing terms OT(a, a), OT(b, b)): half the tiles
# ----------------------------------------------------------------------------------------
#
# For x against itself with C_ij = cx_i + cx_j - c2 <x_i, x_j>, cx = (c2/2)|x|^2, write
# (log2 units) A_i = log2e (log a_i + f_i / eps), kappa_i = log2e cx_i / eps and
# k_ij = log2e (c2 <x_i, x_j> / eps) - kappa_i - kappa_j = -log2e C_ij / eps (symmetric).
# The update needs S_i = sum_j exp2(A_j - A_i + k_ij) (then
# f_i <- -damping eps (log a_i + f_i/eps + ln S_i)). One tile (I, J), I < J, serves both
# row blocks: with M_J = max_J A, E_ij = k_ij + A_j - M_J and ONE exp2 per score,
#   S_i += exp2(M_J - A_i) sum_j exp2(E_ij)                               (rows of I)
#   S_j += exp2(M_I + M_J - 2 A_j) sum_i exp2(E_ij) exp2(A_i - M_I)        (rows of J)
# The fixed offsets are safe when the spread of A is moderate (checked by the caller, which
# falls back to two ordinary passes otherwise). Column sums are merged with atomics.

_SYM_SPREAD_MAX = 30.0  # log2 units

if HAS_TRITON:

    def _sym_configs():
        if _no_autotune():
            return [triton.Config({"BLOCK": 64}, num_warps=4, num_stages=2)]
        return [
            triton.Config({"BLOCK": 128}, num_warps=8, num_stages=2),
            triton.Config({"BLOCK": 128}, num_warps=8, num_stages=3),
            triton.Config({"BLOCK": 64}, num_warps=4, num_stages=3),
        ]

    @triton.jit
    def _self_row_block(
        Xb,
        Ab,
        Kb,
        Sb,
        I,
        NB,
        N,
        D,
        dot_scale,
        BLOCK_D: tl.constexpr,
        NUM_D: tl.constexpr,
        PREC: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        rows = I * BLOCK + offs
        rmask = rows < N
        a_i = tl.load(Ab + rows, mask=rmask, other=float("-inf"))
        k_i = tl.load(Kb + rows, mask=rmask, other=0.0)
        m_i = tl.max(a_i, 0)
        r_i = tl.exp2(a_i - m_i)  # 0 on padding
        a_i_safe = tl.where(rmask, a_i, m_i)
        x_i = rows  # placeholder, read only with one feature chunk
        if NUM_D == 1:
            x_i = _load_rows(Xb, rows, rmask, offs_d, D, D, False)
        rs = tl.zeros((BLOCK,), dtype=tl.float32)
        for J in range(I, NB):
            cols = J * BLOCK + offs
            cmask = cols < N
            a_j = tl.load(Ab + cols, mask=cmask, other=float("-inf"))
            k_j = tl.load(Kb + cols, mask=cmask, other=0.0)
            m_j = tl.max(a_j, 0)
            q = _row_stationary_dot(
                x_i, Xb, Xb, rows, cols, rmask, cmask, D, NUM_D, False, BLOCK_D, PREC, BLOCK, BLOCK
            )
            e = q * dot_scale - k_i[:, None] + (a_j - m_j - k_j)[None, :]
            p = tl.exp2(e)  # the one exp per score (0 on padded columns)
            rs += tl.exp2(m_j - a_i_safe) * tl.sum(p, 1)
            if J != I:
                cs = tl.sum(p * r_i[:, None], 0)
                a_j_safe = tl.where(cmask, a_j, m_j)
                tl.atomic_add(Sb + cols, tl.exp2(m_i + m_j - 2.0 * a_j_safe) * cs, mask=cmask)
        tl.atomic_add(Sb + rows, rs, mask=rmask)

    @triton.autotune(configs=_sym_configs(), key=["N_KEY", "D", "PREC"], reset_to_zero=["S"])
    @triton.jit
    def _self_softmin_kernel(
        X,
        A,
        KAPPA,
        S,
        N,
        D,
        N_KEY,
        dot_scale,
        BLOCK_D: tl.constexpr,
        NUM_D: tl.constexpr,
        PREC: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        pid_b = tl.program_id(1).to(tl.int64)
        NB = tl.cdiv(N, BLOCK)
        Xb = X + pid_b * N * D
        Ab = A + pid_b * N
        Kb = KAPPA + pid_b * N
        Sb = S + pid_b * N
        # program pid owns row blocks pid and NB - 1 - pid: the same work per program
        _self_row_block(
            Xb, Ab, Kb, Sb, pid, NB, N, D, dot_scale,
            BLOCK_D, NUM_D, PREC, BLOCK,
        )  # fmt: skip
        I2 = NB - 1 - pid
        if I2 > pid:
            _self_row_block(
                Xb, Ab, Kb, Sb, I2, NB, N, D, dot_scale,
                BLOCK_D, NUM_D, PREC, BLOCK,
            )  # fmt: skip


def self_softmin(
    x: torch.Tensor,
    loga: torch.Tensor,
    f: torch.Tensor,
    cx: torch.Tensor,
    *,
    eps: float,
    c2: float,
    damping: float = 1.0,
    precision: str = "tf32",
    center: torch.Tensor | None = None,
    backend: str = "auto",
    check: bool = True,
):
    """Self-transport update ``damping * softmin_j(eps, C(x_i, x_j), log a_j + f_j / eps)``.

    The same result as ``softmin(x, x, f, loga, cx, cx, ...)[0]`` for the squared-Euclidean
    cost (``cx = (c2/2) |x - c|^2``), but on the triton backend each symmetric tile pair is
    computed once (half the exps). Falls back to :func:`softmin` on the torch backend, when
    some weight is zero, or when the potentials' spread makes fixed offsets unsafe (one
    host sync, skipped with ``check=False``). Shapes: x (B, N, D), loga, f, cx (B, N).
    """
    be = resolve_backend(backend, x.device)
    A = (loga + f / eps) * LOG2E
    use_fast = be == "triton"
    if use_fast and check:
        spread = A.amax(dim=-1) - A.amin(dim=-1)
        use_fast = bool((spread < _SYM_SPREAD_MAX).all())  # False also for -inf / nan
    if not use_fast:
        return softmin(
            x, x, f, loga, cx, cx, eps=eps, c2=c2, damping=damping, precision=precision,
            backend=backend, center=center,
        )[0]  # fmt: skip
    B, N, D = x.shape
    f32 = torch.float32
    # centered and cast once here (not inside the kernel's loop)
    xx = x.to(f32) - center.to(f32)[:, None, :] if center is not None else x
    if precision == "bf16":
        xx, prec = xx.to(torch.bfloat16).contiguous(), "tf32"
    else:
        xx, prec = xx.to(f32).contiguous(), precision
    A = A.to(f32).contiguous()
    kappa = (cx * (LOG2E / eps)).to(f32).contiguous()
    S = torch.zeros((B, N), device=x.device, dtype=f32)
    BLOCK_D = max(16, min(_next_pow2(D), 128 if D <= 128 else 64))
    NUM_D = triton.cdiv(D, BLOCK_D)
    grid = lambda meta: (triton.cdiv(triton.cdiv(N, meta["BLOCK"]), 2), B)  # noqa: E731
    with torch.cuda.device(x.device) if x.device.type == "cuda" else _nullctx():
        _self_softmin_kernel[grid](
            xx, A, kappa, S, N, D, _bucket(N), float(c2 * LOG2E / eps),
            BLOCK_D=BLOCK_D, NUM_D=NUM_D, PREC=prec,
        )  # fmt: skip
    # f_i <- -damping * eps * ln2 * (A_i + log2 S_i)
    return (-damping * eps * LN2) * (A + torch.log2(S))


def _check_finite_scalar(name: str, val: float) -> None:
    if not math.isfinite(val) or val <= 0:
        raise ValueError(f"{name} must be a finite positive number; got {val}")
