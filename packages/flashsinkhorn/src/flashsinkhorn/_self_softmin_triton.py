"""The symmetric self-transport update (the debiasing terms OT(a, a), OT(b, b)) on the
portable Triton backend: half the tiles of two ordinary c-transform passes.
"""

from __future__ import annotations

import torch

from flashsinkhorn import _config
from flashsinkhorn._triton_tiles import HAS_TRITON, _block_d, _bucket, _device
from flashsinkhorn.reference import LN2, LOG2E

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flashsinkhorn._triton_tiles import _load_rows, _row_stationary_dot


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

if HAS_TRITON:

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
            Xb,
            Ab,
            Kb,
            Sb,
            pid,
            NB,
            N,
            D,
            dot_scale,
            BLOCK_D,
            NUM_D,
            PREC,
            BLOCK,
        )
        I2 = NB - 1 - pid
        if I2 > pid:
            _self_row_block(
                Xb,
                Ab,
                Kb,
                Sb,
                I2,
                NB,
                N,
                D,
                dot_scale,
                BLOCK_D,
                NUM_D,
                PREC,
                BLOCK,
            )

    _self_softmin_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK": b}, num_warps=w, num_stages=st)
            for b, w, st in _config.SELF_TUNE
        ],
        key=["N_KEY", "D", "PREC"],
        reset_to_zero=["S"],
    )(_self_softmin_kernel)


def self_softmin_triton(x, A, cx, eps, c2, damping, precision, center):
    """The symmetric self-transport update on the Triton backend: returns
    ``-damping eps ln2 (A_i + log2 S_i)`` with ``A = log2e (log a + f / eps)`` given
    (see :func:`flashsinkhorn.self_softmin`)."""
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
    BLOCK_D, NUM_D = _block_d(D)
    if _config.no_autotune():
        blk, w, st = _config.SELF_FIXED
        kern, cfg = _self_softmin_kernel, dict(BLOCK=blk, num_warps=w, num_stages=st)
    else:
        kern, cfg = _self_softmin_tuned, {}
    grid = lambda meta: (triton.cdiv(triton.cdiv(N, meta["BLOCK"]), 2), B)  # noqa: E731
    with _device(x):
        kern[grid](
            xx,
            A,
            kappa,
            S,
            N,
            D,
            _bucket(N),
            float(c2 * LOG2E / eps),
            BLOCK_D=BLOCK_D,
            NUM_D=NUM_D,
            PREC=prec,
            **cfg,
        )
    # f_i <- -damping * eps * ln2 * (A_i + log2 S_i)
    return (-damping * eps * LN2) * (A + torch.log2(S))
