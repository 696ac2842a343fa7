"""Streaming primitives of the second-order code: row LogSumExp and weighted plan products.

Both primitives stream the columns of an implicit n x m matrix past a block of rows kept
on chip (row-stationary traversal); nothing of size n x m is ever stored. For point
clouds ``X (n, D)``, ``Y (m, D)`` and the cost

    C_ij = |x_i - y_j|^2 + L[lx_i, ly_j]            (L: optional label-cost table)

the kernels work with *shifted* potentials ``F_i = f_i - |x_i|^2 + eps log a_i`` and
``G_j = g_j - |y_j|^2 + eps log b_j``, so that the plan is

    P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps) = exp2(log2e/eps * (F_i + G_j + 2<x_i, y_j> - L))

- :func:`row_lse` returns ``-eps * LSE_j[(G_j + 2<x_i, y_j> - L_ij) / eps]`` per row (the
  Sinkhorn update, before adding back ``|x_i|^2``);
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

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

# one backend rule and one set of constants for the whole package (core kernels module)
from flashsinkhorn.kernels import LN2, LOG2E, _interpret, resolve_backend  # noqa: E402, F401

# the second-order dot default is tf32x3 (about fp32 accuracy on tensor cores)
PRECISIONS = ("tf32x3", "ieee", "tf32")


def _p2(k: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(k))) if HAS_TRITON else max(lo, k)


# ----------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _scores(
        X,
        Y,
        offs_m,
        offs_n,
        n,
        m,
        D,
        sxm,
        sym,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """<x_i, y_j> for one (BLOCK_M, BLOCK_N) tile, looping over D in BLOCK_D chunks."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        mask_m = offs_m < n
        mask_n = offs_n < m
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            md = offs_d < D
            xt = tl.load(
                X + offs_m[:, None] * sxm + offs_d[None, :],
                mask=mask_m[:, None] & md[None, :],
                other=0.0,
            )
            yt = tl.load(
                Y + offs_n[:, None] * sym + offs_d[None, :],
                mask=mask_n[:, None] & md[None, :],
                other=0.0,
            )
            acc = tl.dot(xt, tl.trans(yt), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _row_lse_kernel(
        X,
        Y,
        G,
        LX,
        LY,
        LT,
        OUT,
        n,
        m,
        D,
        sxm,
        sym,
        slt,
        scale,  # log2(e) / eps
        HAS_LABELS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n
        if HAS_LABELS:
            lx = tl.load(LX + offs_m, mask=mask_m, other=0)
        run_max = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)
        run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for n0 in range(0, m, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < m
            s = _scores(
                X, Y, offs_m, offs_n, n, m, D, sxm, sym, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION
            )
            gj = tl.load(G + offs_n, mask=mask_n, other=0.0)
            t = 2.0 * s + gj[None, :]
            if HAS_LABELS:
                ly = tl.load(LY + offs_n, mask=mask_n, other=0)
                lab = tl.load(
                    LT + lx[:, None] * slt + ly[None, :],
                    mask=mask_m[:, None] & mask_n[None, :],
                    other=0.0,
                )
                t = t - lab
            t = tl.where(mask_n[None, :], t * scale, -float("inf"))
            new_max = tl.maximum(run_max, tl.max(t, axis=1))
            safe = tl.where(new_max == -float("inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp2(run_max - safe) + tl.sum(tl.exp2(t - safe[:, None]), 1)
            run_max = new_max
        lse2 = run_max + tl.log2(run_sum)
        tl.store(OUT + offs_m, -lse2 / scale, mask=mask_m)

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
        if HAS_LABELS:
            lx = tl.load(LX + offs_m, mask=mask_m, other=0)
        offs_k1 = pk * BLOCK_K1 + tl.arange(0, BLOCK_K1)
        mk1 = offs_k1 < K1
        offs_k2 = tl.arange(0, BLOCK_K2)
        mk2 = offs_k2 < K2
        if W_VEC:
            acc1v = tl.zeros((BLOCK_M,), dtype=tl.float32)
        else:
            acc1 = tl.zeros((BLOCK_M, BLOCK_K1), dtype=tl.float32)
        if HAS_Q:
            if U_VEC:
                acc2v = tl.zeros((BLOCK_M,), dtype=tl.float32)
            else:
                acc2 = tl.zeros((BLOCK_M, BLOCK_K2), dtype=tl.float32)
        for n0 in range(0, m, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < m
            s = _scores(
                X, Y, offs_m, offs_n, n, m, D, sxm, sym, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION
            )
            gj = tl.load(G + offs_n, mask=mask_n, other=0.0)
            t = 2.0 * s + gj[None, :] + fi[:, None]
            if HAS_LABELS:
                ly = tl.load(LY + offs_n, mask=mask_n, other=0)
                lab = tl.load(
                    LT + lx[:, None] * slt + ly[None, :],
                    mask=mask_m[:, None] & mask_n[None, :],
                    other=0.0,
                )
                t = t - lab
            p = tl.exp2(t * scale)
            p = tl.where(mask_m[:, None] & mask_n[None, :], p, 0.0)
            if W_VEC:
                wv = tl.load(W + offs_n * swm, mask=mask_n, other=0.0)
                acc1v += tl.sum(p * wv[None, :], 1)
            else:
                wt = tl.load(
                    W + offs_n[:, None] * swm + offs_k1[None, :],
                    mask=mask_n[:, None] & mk1[None, :],
                    other=0.0,
                )
                acc1 = tl.dot(p, wt, acc1, input_precision=PRECISION)
            if HAS_Q:
                q = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for e0 in range(0, E, BLOCK_E):
                    offs_e = e0 + tl.arange(0, BLOCK_E)
                    me = offs_e < E
                    at = tl.load(
                        A + offs_m[:, None] * sam + offs_e[None, :],
                        mask=mask_m[:, None] & me[None, :],
                        other=0.0,
                    )
                    bt = tl.load(
                        B + offs_n[:, None] * sbm + offs_e[None, :],
                        mask=mask_n[:, None] & me[None, :],
                        other=0.0,
                    )
                    q = tl.dot(at, tl.trans(bt), q, input_precision=PRECISION)
                pq = p * q
                if U_VEC:
                    uv = tl.load(U + offs_n * sum_, mask=mask_n, other=0.0)
                    acc2v += tl.sum(pq * uv[None, :], 1)
                else:
                    ut = tl.load(
                        U + offs_n[:, None] * sum_ + offs_k2[None, :],
                        mask=mask_n[:, None] & mk2[None, :],
                        other=0.0,
                    )
                    acc2 = tl.dot(pq, ut, acc2, input_precision=PRECISION)
        if W_VEC:
            tl.store(OUT1 + offs_m * so1, acc1v, mask=mask_m)
        else:
            tl.store(
                OUT1 + offs_m[:, None] * so1 + offs_k1[None, :],
                acc1,
                mask=mask_m[:, None] & mk1[None, :],
            )
        if HAS_Q:
            if pk == 0:
                if U_VEC:
                    tl.store(OUT2 + offs_m * so2, acc2v, mask=mask_m)
                else:
                    tl.store(
                        OUT2 + offs_m[:, None] * so2 + offs_k2[None, :],
                        acc2,
                        mask=mask_m[:, None] & mk2[None, :],
                    )


def _blocks(n: int, m: int, d: int) -> tuple[int, int, int]:
    if _interpret():
        return 16, 32, max(16, min(64, _p2(d)))
    bd = 64 if d > 64 else max(16, _p2(d))
    return 64, 64, bd


def _labels_args(labels, device):
    if labels is None:
        z = torch.zeros(1, dtype=torch.int32, device=device)
        return z, z, torch.zeros(1, dtype=torch.float32, device=device), 1, False
    lx, ly, table = labels
    table = table.float().contiguous()
    return (
        lx.to(torch.int32).contiguous(),
        ly.to(torch.int32).contiguous(),
        table,
        table.stride(0),
        True,
    )


# ----------------------------------------------------------------------------------------
# Public primitives
# ----------------------------------------------------------------------------------------
def row_lse(
    x: torch.Tensor,
    y: torch.Tensor,
    G: torch.Tensor,
    eps: float,
    *,
    labels=None,
    backend: str = "auto",
    precision: str = "tf32x3",
) -> torch.Tensor:
    """``-eps * LSE_j[(G_j + 2<x_i, y_j> - L[lx_i, ly_j]) / eps]`` for each row i.

    x (n, D), y (m, D), G (m,); labels: None or ``(lx (n,), ly (m,), table (Kx, Ky))``.
    Returns (n,) in the dtype of x (float32 on the triton backend).
    """
    be = resolve_backend(backend, x.device)
    if be == "torch":
        return _row_lse_torch(x, y, G, eps, labels)
    n, d = x.shape
    m = y.shape[0]
    x = x.float().contiguous()
    y = y.float().contiguous()
    G = G.float().contiguous()
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    lx, ly, lt, slt, has_l = _labels_args(labels, x.device)
    bm, bn, bd = _blocks(n, m, d)
    _row_lse_kernel[(triton.cdiv(n, bm),)](
        x,
        y,
        G,
        lx,
        ly,
        lt,
        out,
        n,
        m,
        d,
        x.stride(0),
        y.stride(0),
        slt,
        LOG2E / eps,
        HAS_LABELS=has_l,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=bd,
        PRECISION=precision,
        num_warps=4,
        num_stages=2 if not _interpret() else 1,
    )
    return out


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
    x = x.float().contiguous()
    y = y.float().contiguous()
    F = F.float().contiguous()
    G = G.float().contiguous()
    w_vec = W.dim() == 1
    W2 = W.float().reshape(m, -1).contiguous()
    K1 = W2.shape[1]
    out1 = torch.empty(n, K1, dtype=torch.float32, device=x.device)
    bm, bn, bd = _blocks(n, m, d)
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
    lx, ly, lt, slt, has_l = _labels_args(labels, x.device)
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
        num_warps=4,
        num_stages=2 if not _interpret() else 1,
    )
    o1 = out1[:, 0] if w_vec else out1
    if not has_q:
        return o1
    return o1, (out2[:, 0] if u_vec else out2)


# ----------------------------------------------------------------------------------------
# Blockwise torch path (same math; any dtype)
# ----------------------------------------------------------------------------------------
def _block_rows(n: int, m: int) -> int:
    return max(1, min(n, (1 << 22) // max(m, 1)))


def _label_block(labels, i0, i1):
    lx, ly, table = labels
    return table[lx[i0:i1].long()][:, ly.long()]


def _row_lse_torch(x, y, G, eps, labels):
    n = x.shape[0]
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    bs = _block_rows(n, y.shape[0])
    for i0 in range(0, n, bs):
        i1 = min(n, i0 + bs)
        t = 2.0 * x[i0:i1] @ y.T + G[None, :]
        if labels is not None:
            t = t - _label_block(labels, i0, i1).to(t.dtype)
        out[i0:i1] = -eps * torch.logsumexp(t / eps, dim=1)
    return out


def _row_apply_torch(x, y, F, G, eps, W, A, B, U, labels):
    n = x.shape[0]
    m = y.shape[0]
    bs = _block_rows(n, m)
    out1 = torch.empty((n,) + tuple(W.shape[1:]), dtype=x.dtype, device=x.device)
    has_q = A is not None
    if has_q:
        if U is None:
            U = torch.ones(m, dtype=x.dtype, device=x.device)
        out2 = torch.empty((n,) + tuple(U.shape[1:]), dtype=x.dtype, device=x.device)
    for i0 in range(0, n, bs):
        i1 = min(n, i0 + bs)
        t = 2.0 * x[i0:i1] @ y.T + G[None, :] + F[i0:i1, None]
        if labels is not None:
            t = t - _label_block(labels, i0, i1).to(t.dtype)
        p = torch.exp(t / eps)
        out1[i0:i1] = p @ W
        if has_q:
            out2[i0:i1] = (p * (A[i0:i1] @ B.T)) @ U
    return out1 if not has_q else (out1, out2)


def dense_plan(x, y, F, G, eps, labels=None):
    """The n x m plan (float64 helpers and tests only)."""
    t = 2.0 * x @ y.T + G[None, :] + F[:, None]
    if labels is not None:
        lx, ly, table = labels
        t = t - table[lx.long()][:, ly.long()].to(t.dtype)
    return torch.exp(t / eps)


__all__ = ["row_lse", "row_apply", "resolve_backend", "dense_plan", "PRECISIONS", "LN2", "LOG2E"]
