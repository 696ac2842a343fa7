"""The Triton tile helpers and launch helpers that the portable kernel modules share.

``_softmin_triton`` (the c-transform's running-max and shift kernels), ``_self_softmin_triton``
(the symmetric self-transport update), ``_symmetric_triton``, ``_sample_triton`` and
``_hessian_triton`` build their kernels from these ``@triton.jit`` pieces (inlined by the
compiler) and launch them with the same size buckets, feature chunking, label operands and
config choice. Precision of the dot (``PREC``): "tf32", "ieee", "tf32x3"; bf16 operands
arrive as bf16 tensors and use "tf32" (fp32 accumulation).
"""

from __future__ import annotations

import torch

from flashsinkhorn import _config

try:  # triton is an optional runtime dependency off Linux
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False


def _triton_configs(space):
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bm, bn, w, st in dict.fromkeys(space)  # each config once
    ]


def _prune(configs, named_args, **kwargs):
    """Autotune only over the D regime's space (one feature chunk or several)."""
    allowed = set(_config.TUNE_SMALL_D if kwargs.get("NUM_D", 1) == 1 else _config.TUNE_LARGE_D)
    out = [
        c
        for c in configs
        if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in allowed
    ]
    return out or configs[:1]


# ----------------------------------------------------------------------------------------
# tile helpers (inlined by the compiler)
# ----------------------------------------------------------------------------------------

if HAS_TRITON:

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
        X,
        Y,
        rows,
        cols,
        row_mask,
        col_mask,
        sx,
        sy,
        D,
        acc,
        num_d,
        EVEN_D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PREC: tl.constexpr,
    ):
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
        x0,
        X,
        Y,
        rows,
        cols,
        row_mask,
        col_mask,
        D,
        NUM_D: tl.constexpr,
        EVEN_D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
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
    def _tile_scores(
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
        HAS_LABELS: tl.constexpr,
    ):
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
        HAS_LABELS: tl.constexpr,
    ):
        """`_tile_scores` folded into the running max / sum."""
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
        m_new, l_i, alpha, p = _online_lse_step(m_i, l_i, s)
        return m_new, l_i


# ----------------------------------------------------------------------------------------
# launch helpers
# ----------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _bucket(n: int) -> int:
    """Autotune key of a size: its power-of-two bucket (at most 2^16)."""
    return min(_next_pow2(n), 1 << 16)


def _block_d(D: int) -> tuple[int, int]:
    """``(BLOCK_D, NUM_D)``: one chunk up to D = 128, else 64-wide feature chunks."""
    block_d = max(16, min(_next_pow2(D), 128 if D <= 128 else 64))
    return block_d, triton.cdiv(D, block_d)


def _label_operands(lx, ly, W):
    """Label-cost operands in the kernels' form: int32 labels, fp32 contiguous table, and
    the table's row stride."""
    W = W.to(torch.float32).contiguous()
    return lx.to(torch.int32).contiguous(), ly.to(torch.int32).contiguous(), W, W.stride(0)


def _device(t):
    """The CUDA device context of a launch (a no-op for CPU tensors, the interpreter)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else _NullContext()


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _pick(tuned, kernel, config):
    """The kernel to launch and its config kwargs: ``config`` if given, the fixed config
    without autotuning, else the autotuner (which chooses per problem)."""
    if config is None and not _config.no_autotune():
        return tuned, {}
    bm, bn, w, st = config or _config.FIXED
    return kernel, dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
