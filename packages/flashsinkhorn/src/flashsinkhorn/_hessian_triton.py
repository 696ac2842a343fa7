"""The Hessian's plan products, streamed: ``P @ W`` and ``(P * Q) @ U`` (flashsinkhorn._hessian).

The kernel streams the columns of an implicit n x m matrix past a block of rows kept
on chip (row-stationary traversal); nothing of size n x m is ever stored. For point
clouds ``X (n, D)``, ``Y (m, D)`` and the cost

    C_ij = |x_i - y_j|^2 + L[lx_i, ly_j]            (L: optional label-cost table)

the kernels work with *shifted* potentials ``F_i = f_i - |x_i|^2 + eps log a_i`` and
``G_j = g_j - |y_j|^2 + eps log b_j``, so that the plan is

    P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps) = exp2(log2e/eps * (F_i + G_j + 2<x_i, y_j> - L))

- :func:`row_apply` returns ``P @ W`` and, optionally, ``(P * Q) @ U`` where
  ``Q_ij = <A_i, B_j>`` is a second streamed dot product (the Hessian needs it: the
  cross terms ``<v_i, y_j>`` of a Hessian-vector product).

The column versions are the same calls with the roles of the two clouds swapped.

Backends: ``"triton"`` (CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set
before Python started), ``"torch"`` (blockwise torch, any dtype, float64 included),
``"auto"`` (triton on CUDA, torch otherwise). ``precision`` picks the Triton dot mode for
the fp32 operands: ``"tf32x3"`` (default here: about fp32 accuracy on tensor cores),
``"ieee"`` or ``"tf32"``.
"""

from __future__ import annotations

import torch

# one backend rule, one set of constants and the shared tile helpers for the whole package
from flashsinkhorn._config import interpret as _interpret
from flashsinkhorn._triton_tiles import HAS_TRITON, _label_operands, _next_pow2
from flashsinkhorn.primitives import block_rows, resolve_backend
from flashsinkhorn.reference import LN2, LOG2E  # noqa: F401

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flashsinkhorn._triton_tiles import _label_tile, _tile_dot

# the second-order dot default is tf32x3 (about fp32 accuracy on tensor cores)
PRECISIONS = ("tf32x3", "ieee", "tf32")


def _p2(k: int, lo: int = 16) -> int:
    return max(lo, _next_pow2(k))


# ----------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _exponent(
        X,
        Y,
        G,
        LY,
        LT,
        fi,
        lx,
        offs_m,
        offs_n,
        mask_m,
        mask_n,
        D,
        sxm,
        sym,
        slt,
        HAS_F: tl.constexpr,
        HAS_LABELS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """``[F_i +] G_j + 2<x_i, y_j> [- L[lx_i, ly_j]]`` for one (BLOCK_M, BLOCK_N) tile."""
        s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        s = _tile_dot(
            X,
            Y,
            offs_m,
            offs_n,
            mask_m,
            mask_n,
            sxm,
            sym,
            D,
            s,
            tl.cdiv(D, BLOCK_D),
            False,
            BLOCK_D,
            PRECISION,
        )
        gj = tl.load(G + offs_n, mask=mask_n, other=0.0)
        t = 2.0 * s + gj[None, :]
        if HAS_F:
            t = t + fi[:, None]
        if HAS_LABELS:
            t = t - _label_tile(LY, LT, lx, offs_n, mask_m, mask_n, slt)
        return t

    @triton.jit
    def _acc_product(
        acc, p, W, offs_n, mask_n, sw, offs_k, mask_k, VEC: tl.constexpr, PRECISION: tl.constexpr
    ):
        """``acc + p @ W[offs_n]`` with W a vector (VEC: acc (BLOCK_M,)) or a matrix."""
        if VEC:
            wv = tl.load(W + offs_n * sw, mask=mask_n, other=0.0)
            acc += tl.sum(p * wv[None, :], 1)
        else:
            wt = tl.load(
                W + offs_n[:, None] * sw + offs_k[None, :],
                mask=mask_n[:, None] & mask_k[None, :],
                other=0.0,
            )
            acc = tl.dot(p, wt, acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _store_rows(OUT, acc, offs_m, mask_m, so, offs_k, mask_k, VEC: tl.constexpr):
        if VEC:
            tl.store(OUT + offs_m * so, acc, mask=mask_m)
        else:
            tl.store(
                OUT + offs_m[:, None] * so + offs_k[None, :],
                acc,
                mask=mask_m[:, None] & mask_k[None, :],
            )

    @triton.jit
    def _row_apply_kernel(
        X,
        Y,
        F,
        G,
        LX,
        LY,
        LT,
        W,
        OUT1,
        A,
        B,
        U,
        OUT2,
        n,
        m,
        D,
        E,
        K1,
        K2,
        sxm,
        sym,
        slt,
        swm,
        sam,
        sbm,
        sum_,
        so1,
        so2,
        scale,  # log2(e) / eps
        HAS_LABELS: tl.constexpr,
        HAS_Q: tl.constexpr,
        W_VEC: tl.constexpr,
        U_VEC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K1: tl.constexpr,
        BLOCK_K2: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid = tl.program_id(0)
        pk = tl.program_id(1)  # chunk of the columns of W (large K1 is split over the grid)
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n
        fi = tl.load(F + offs_m, mask=mask_m, other=0.0)
        lx = offs_m  # placeholder, read only with labels
        if HAS_LABELS:
            lx = tl.load(LX + offs_m, mask=mask_m, other=0)
        offs_k1 = pk * BLOCK_K1 + tl.arange(0, BLOCK_K1)
        mk1 = offs_k1 < K1
        offs_k2 = tl.arange(0, BLOCK_K2)
        mk2 = offs_k2 < K2
        if W_VEC:
            acc1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        else:
            acc1 = tl.zeros((BLOCK_M, BLOCK_K1), dtype=tl.float32)
        if HAS_Q:
            if U_VEC:
                acc2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
            else:
                acc2 = tl.zeros((BLOCK_M, BLOCK_K2), dtype=tl.float32)
        for n0 in range(0, m, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < m
            t = _exponent(
                X,
                Y,
                G,
                LY,
                LT,
                fi,
                lx,
                offs_m,
                offs_n,
                mask_m,
                mask_n,
                D,
                sxm,
                sym,
                slt,
                True,
                HAS_LABELS,
                BLOCK_M,
                BLOCK_N,
                BLOCK_D,
                PRECISION,
            )
            p = tl.exp2(t * scale)
            p = tl.where(mask_m[:, None] & mask_n[None, :], p, 0.0)
            acc1 = _acc_product(acc1, p, W, offs_n, mask_n, swm, offs_k1, mk1, W_VEC, PRECISION)
            if HAS_Q:
                # Q_ij = <A_i, B_j>: the second streamed dot product
                q = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                q = _tile_dot(
                    A,
                    B,
                    offs_m,
                    offs_n,
                    mask_m,
                    mask_n,
                    sam,
                    sbm,
                    E,
                    q,
                    tl.cdiv(E, BLOCK_E),
                    False,
                    BLOCK_E,
                    PRECISION,
                )
                acc2 = _acc_product(
                    acc2, p * q, U, offs_n, mask_n, sum_, offs_k2, mk2, U_VEC, PRECISION
                )
        _store_rows(OUT1, acc1, offs_m, mask_m, so1, offs_k1, mk1, W_VEC)
        if HAS_Q:
            if pk == 0:
                _store_rows(OUT2, acc2, offs_m, mask_m, so2, offs_k2, mk2, U_VEC)


def _blocks(n: int, m: int, d: int) -> tuple[int, int, int]:
    if _interpret():
        return 16, 32, max(16, min(64, _p2(d)))
    bd = 64 if d > 64 else max(16, _p2(d))
    return 64, 64, bd


def _launch_setup(x, y, labels):
    """What both launchers share: fp32 contiguous clouds, label operands, tile sizes and
    the launch options. Returns ``(x, y, (lx, ly, table, table_stride, has_labels),
    (BLOCK_M, BLOCK_N, BLOCK_D), launch_kwargs)``."""
    x = x.float().contiguous()
    y = y.float().contiguous()
    if labels is None:
        z = torch.zeros(1, dtype=torch.int32, device=x.device)
        lab = (z, z, torch.zeros(1, dtype=torch.float32, device=x.device), 1, False)
    else:
        lab = (*_label_operands(*labels), True)
    opts = dict(num_warps=4, num_stages=2 if not _interpret() else 1)
    return x, y, lab, _blocks(x.shape[0], y.shape[0], x.shape[1]), opts


# ----------------------------------------------------------------------------------------
# Public primitives
# ----------------------------------------------------------------------------------------
def row_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    F: torch.Tensor,
    G: torch.Tensor,
    eps: float,
    W: torch.Tensor,
    *,
    A: torch.Tensor | None = None,
    B: torch.Tensor | None = None,
    U: torch.Tensor | None = None,
    labels=None,
    backend: str = "auto",
    precision: str = "tf32x3",
):
    """``P @ W`` and optionally ``(P * (A @ B.T)) @ U``, with P streamed, never stored.

    ``P_ij = exp((F_i + G_j + 2<x_i, y_j> - L_ij) / eps)``. W: (m,) or (m, K1);
    A (n, E), B (m, E), U: (m,) or (m, K2). Returns ``out1`` (shape of W with m -> n) or
    ``(out1, out2)`` when A is given.
    """
    be = resolve_backend(backend, x.device)
    has_q = A is not None
    if be == "torch":
        return _row_apply_torch(x, y, F, G, eps, W, A, B, U, labels)
    n, d = x.shape
    m = y.shape[0]
    x, y, (lx, ly, lt, slt, has_l), (bm, bn, bd), opts = _launch_setup(x, y, labels)
    F = F.float().contiguous()
    G = G.float().contiguous()
    w_vec = W.dim() == 1
    W2 = W.float().reshape(m, -1).contiguous()
    K1 = W2.shape[1]
    out1 = torch.empty(n, K1, dtype=torch.float32, device=x.device)
    if w_vec:
        bk1, nk = 16, 1
    else:
        bk1 = _p2(min(K1, 64 if not _interpret() else 32))
        nk = triton.cdiv(K1, bk1)
    if has_q:
        A2 = A.float().contiguous()
        B2 = B.float().contiguous()
        E = A2.shape[1]
        if U is None:
            U = torch.ones(m, dtype=torch.float32, device=x.device)
        u_vec = U.dim() == 1
        U2 = U.float().reshape(m, -1).contiguous()
        K2 = U2.shape[1]
        out2 = torch.empty(n, K2, dtype=torch.float32, device=x.device)
        be_ = max(16, min(64, _p2(E)))
        bk2 = 16 if u_vec else _p2(K2)
    else:
        A2 = B2 = U2 = out2 = x
        E = K2 = 1
        u_vec = True
        be_ = bk2 = 16
    _row_apply_kernel[(triton.cdiv(n, bm), nk)](
        x,
        y,
        F,
        G,
        lx,
        ly,
        lt,
        W2,
        out1,
        A2,
        B2,
        U2,
        out2,
        n,
        m,
        d,
        E,
        K1,
        K2,
        x.stride(0),
        y.stride(0),
        slt,
        W2.stride(0),
        A2.stride(0),
        B2.stride(0),
        U2.stride(0),
        out1.stride(0),
        out2.stride(0),
        LOG2E / eps,
        HAS_LABELS=has_l,
        HAS_Q=has_q,
        W_VEC=w_vec,
        U_VEC=u_vec,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=bd,
        BLOCK_E=be_,
        BLOCK_K1=bk1,
        BLOCK_K2=bk2,
        PRECISION=precision,
        **opts,
    )
    o1 = out1[:, 0] if w_vec else out1
    if not has_q:
        return o1
    return o1, (out2[:, 0] if u_vec else out2)


# ----------------------------------------------------------------------------------------
# Blockwise torch path (same math; any dtype)
# ----------------------------------------------------------------------------------------
def _exponent_rows(x, y, G, F, labels, i0, i1):
    """``[F_i +] G_j + 2<x_i, y_j> [- L[lx_i, ly_j]]`` for the rows i0:i1 (F None: omitted)."""
    t = 2.0 * x[i0:i1] @ y.T + G[None, :]
    if F is not None:
        t = t + F[i0:i1, None]
    if labels is not None:
        lx, ly, table = labels
        t = t - table[lx[i0:i1].long()][:, ly.long()].to(t.dtype)
    return t


def _row_apply_torch(x, y, F, G, eps, W, A, B, U, labels):
    n = x.shape[0]
    m = y.shape[0]
    bs = block_rows(n, m)
    out1 = torch.empty((n,) + tuple(W.shape[1:]), dtype=x.dtype, device=x.device)
    has_q = A is not None
    if has_q:
        if U is None:
            U = torch.ones(m, dtype=x.dtype, device=x.device)
        out2 = torch.empty((n,) + tuple(U.shape[1:]), dtype=x.dtype, device=x.device)
    for i0 in range(0, n, bs):
        i1 = min(n, i0 + bs)
        p = torch.exp(_exponent_rows(x, y, G, F, labels, i0, i1) / eps)
        out1[i0:i1] = p @ W
        if has_q:
            out2[i0:i1] = (p * (A[i0:i1] @ B.T)) @ U
    return out1 if not has_q else (out1, out2)


def dense_plan(x, y, F, G, eps, labels=None):
    """The n x m plan (float64 helpers and tests only)."""
    return torch.exp(_exponent_rows(x, y, G, F, labels, 0, x.shape[0]) / eps)


__all__ = ["row_apply", "resolve_backend", "dense_plan", "PRECISIONS", "LN2", "LOG2E"]
