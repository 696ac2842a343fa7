"""The ``varlen`` backend: a ragged batch of OT problems in one launch per pass, no padding.

Problem ``k`` pairs the rows ``cu_x[k]:cu_x[k + 1]`` of the concatenated points ``X (1,
sum N_k, D)`` with the rows ``cu_y[k]:cu_y[k + 1]`` of ``Y (1, sum M_k, D)``
(flash-attention's ``cu_seqlens`` convention); a list of clouds is concatenated into that
form. Potentials and weights are row vectors ``(1, sum N_k)`` / ``(1, sum M_k)``;
``total`` / ``peak`` reduce them per problem over its segment, ``(B,)``.

A pass is one Triton launch over every row block of every problem: a block table maps a
program to its problem and first row; the program streams that problem's columns only
(running-max LogSumExp in base 2, the softmax average of ``V`` alongside). The CPU path
(and float64) runs each problem's rows against its columns with torch, one problem after
the other (on the CPU there are no launches to save).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from flashsinkhorn import _config
from flashsinkhorn.primitives import resolve_backend
from flashsinkhorn.problem import Problem
from flashsinkhorn.reference import LN2, LOG2E

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    HAS_TRITON = False

__all__ = ["VarlenProblem", "offsets", "softmin_varlen", "softmin_varlen_ref"]


def offsets(sizes, device) -> torch.Tensor:
    """``cu_seqlens`` (B + 1,) int64 of segment sizes."""
    cu = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(list(sizes), dtype=torch.int64).cumsum(0)
    return cu.to(device)


def segment_ids(sizes, device) -> torch.Tensor:
    """The problem of every concatenated point, (sum sizes,) int64."""
    b = torch.arange(len(sizes), device=device)
    return torch.repeat_interleave(b, torch.tensor(list(sizes), device=device))


# ----------------------------------------------------------------------------------------
# the kernel: one program per (problem, row block), the problem's columns streamed
# ----------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _varlen_softmin_kernel(
        X,
        Y,
        BIAS,
        CX,
        OUT,
        LSE,
        V,
        VBAR,
        BLK_PROB,
        BLK_ROW,
        CU_X,
        CU_Y,
        D,
        DV,
        dot_scale,  # c2 * log2(e) / eps
        eps_ln2,  # eps * ln(2)
        damping,
        HAS_V: tl.constexpr,
        PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
        # BIAS is the fused column vector log2e * (log b_j + (g_j - cy_j) / eps); rows and
        # columns are global indices into the concatenated clouds
        pid = tl.program_id(0)
        pid_v = tl.program_id(1)
        k = tl.load(BLK_PROB + pid)
        row0 = tl.load(BLK_ROW + pid)
        r_end = tl.load(CU_X + k + 1)
        c0 = tl.load(CU_Y + k)
        c1 = tl.load(CU_Y + k + 1)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < r_end
        offs_d = tl.arange(0, BLOCK_D)
        offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
        for j0 in range(c0, c1, BLOCK_N):
            cols = j0 + tl.arange(0, BLOCK_N)
            col_mask = cols < c1
            s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                dd = d0 + offs_d
                xk = tl.load(
                    X + rows[:, None].to(tl.int64) * D + dd[None, :],
                    mask=row_mask[:, None] & (dd[None, :] < D),
                    other=0.0,
                )
                yk = tl.load(
                    Y + cols[:, None].to(tl.int64) * D + dd[None, :],
                    mask=col_mask[:, None] & (dd[None, :] < D),
                    other=0.0,
                )
                s = tl.dot(xk, tl.trans(yk), s, input_precision=PREC)
            bias = tl.load(BIAS + cols, mask=col_mask, other=float("-inf"))
            s = s * dot_scale + bias[None, :]
            s = tl.where(col_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if HAS_V:
                vt = tl.load(
                    V + cols[:, None].to(tl.int64) * DV + offs_v[None, :],
                    mask=col_mask[:, None] & (offs_v[None, :] < DV),
                    other=0.0,
                )
                acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
            m_i = m_new
        lse2 = m_i + tl.log2(l_i)
        if pid_v == 0:
            cx = tl.load(CX + rows, mask=row_mask, other=0.0)
            tl.store(OUT + rows, damping * (cx - eps_ln2 * lse2), mask=row_mask)
            tl.store(LSE + rows, lse2, mask=row_mask)
        if HAS_V:
            vbar = acc / l_i[:, None]
            tl.store(
                VBAR + rows[:, None].to(tl.int64) * DV + offs_v[None, :],
                vbar,
                mask=row_mask[:, None] & (offs_v[None, :] < DV),
            )


def _pow2(n, lo=16):
    p = lo
    while p < n:
        p *= 2
    return p


def block_table(sizes_x, cu_x, block_m):
    """``(blk_prob, blk_row)`` int32 / int64 of every row block of every problem."""
    counts = [(n + block_m - 1) // block_m for n in sizes_x]
    dev = cu_x.device
    prob = torch.repeat_interleave(
        torch.arange(len(sizes_x), device=dev), torch.tensor(counts, device=dev)
    )
    first = torch.zeros(len(counts) + 1, dtype=torch.int64)
    first[1:] = torch.tensor(counts).cumsum(0)
    within = torch.arange(int(first[-1]), device=dev) - first.to(dev)[prob]
    return prob.to(torch.int32), (cu_x[prob] + within * block_m).to(torch.int64)


def softmin_varlen(
    x,
    y,
    g,
    logb,
    cx,
    cy,
    cu_x,
    cu_y,
    sizes_x,
    *,
    eps,
    c2,
    damping=1.0,
    v=None,
    precision="tf32",
    table=None,
):
    """The row softmin of every problem of a ragged batch in one launch (Triton).

    x (Nt, D), y (Mt, D) float32 (centered), g, logb, cy (Mt,), cx (Nt,); ``cu_x``, ``cu_y``
    (B + 1,) offsets, ``sizes_x`` the host sizes of x's segments. Returns ``(out (Nt,),
    lse2 (Nt,), vbar (Nt, DV) or None)`` as :func:`flashsinkhorn.softmin`'s batched ones.
    """
    N, D = x.shape
    bias = (LOG2E * (logb + (g - cy) / eps)).float().contiguous()
    block_m, block_n = (16, 16) if _config.interpret() else (64, 64)
    blk_prob, blk_row = table if table is not None else block_table(sizes_x, cu_x, block_m)
    out = torch.empty(N, dtype=torch.float32, device=x.device)
    lse = torch.empty(N, dtype=torch.float32, device=x.device)
    dv = 0 if v is None else v.shape[-1]
    block_dv = 16 if v is None else min(_pow2(dv), 64)
    vbar = None if v is None else torch.empty((N, dv), dtype=torch.float32, device=x.device)
    grid = (blk_prob.numel(), 1 if v is None else triton.cdiv(dv, block_dv))
    prec = {"tf32x3": "tf32x3", "tf32": "tf32"}.get(precision, "ieee")
    _varlen_softmin_kernel[grid](
        x.float().contiguous(),
        y.float().contiguous(),
        bias,
        cx.float().contiguous(),
        out,
        lse,
        x if v is None else v.float().contiguous(),
        out if v is None else vbar,
        blk_prob,
        blk_row,
        cu_x,
        cu_y,
        D,
        max(dv, 1),
        c2 * LOG2E / eps,
        eps * LN2,
        damping,
        HAS_V=v is not None,
        PREC=prec,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=min(_pow2(D), 64),
        BLOCK_DV=block_dv,
    )
    return out, lse, vbar


def softmin_varlen_ref(x, y, g, logb, cx, cy, cu_x, cu_y, *, eps, c2, damping=1.0, v=None):
    """Float64 reference of :func:`softmin_varlen`: each problem's dense softmin."""
    d = torch.float64
    outs, lses, vbars = [], [], []
    cux, cuy = cu_x.tolist(), cu_y.tolist()
    for k in range(len(cux) - 1):
        i0, i1, j0, j1 = cux[k], cux[k + 1], cuy[k], cuy[k + 1]
        xs, ys = x[i0:i1].to(d), y[j0:j1].to(d)
        C = cx[i0:i1].to(d)[:, None] + cy[j0:j1].to(d)[None, :] - c2 * xs @ ys.T
        S = logb[j0:j1].to(d)[None, :] + (g[j0:j1].to(d)[None, :] - C) / eps
        lse = torch.logsumexp(S, -1)
        outs.append(damping * (-eps) * lse)
        lses.append((lse + cx[i0:i1].to(d) / eps) / LN2)
        if v is not None:
            vbars.append(torch.softmax(S, -1) @ v[j0:j1].to(d))
    vb = torch.cat(vbars) if v is not None else None
    return torch.cat(outs), torch.cat(lses), vb


# ----------------------------------------------------------------------------------------
# the problem
# ----------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class VarlenProblem(Problem):
    """A :class:`flashsinkhorn.problem.Problem` of ragged problems (module docstring).

    ``cu_x``, ``cu_y``: (B + 1,) int64 offsets on the points' device; ``sizes_x``,
    ``sizes_y``: the same on the host; ``backend`` "triton" (the kernel) or "torch"."""

    kind: ClassVar[str] = "varlen"

    cu_x: torch.Tensor
    cu_y: torch.Tensor
    sizes_x: tuple
    sizes_y: tuple
    backend: str = "auto"
    Xk: torch.Tensor | None = field(default=None, repr=False)
    Yk: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        super().__post_init__()
        self.backend = resolve_backend(self.backend, self.X.device)
        if self.X.dtype == torch.float64:
            self.backend = "torch"  # float64 stays float64
        if self.Xk is None or self.Yk is None:
            with torch.no_grad():
                X, Y = self.X.detach()[0], self.Y.detach()[0]
                if self.center is not None:
                    X, Y = X - self.center[0], Y - self.center[0]
                dt = torch.float32 if self.backend == "triton" else X.dtype
                self.Xk, self.Yk = X.to(dt).contiguous(), Y.to(dt).contiguous()
        self._seg = {
            "x": segment_ids(self.sizes_x, self.X.device),
            "y": segment_ids(self.sizes_y, self.X.device),
        }
        self._tables = {}

    @property
    def batch(self) -> int:
        return len(self.sizes_x)

    @property
    def potential_dtype(self):
        f64 = self.X.dtype == torch.float64 and self.backend == "torch"
        return torch.float64 if f64 else torch.float32

    @property
    def exact(self) -> bool:  # type: ignore[override]
        return self.backend == "torch"

    @property
    def backend_arg(self) -> str:
        return "varlen"

    def with_precision(self, precision):
        return replace(self, precision=precision, Xk=self.Xk, Yk=self.Yk)

    def self_problem(self, side):
        X, w, c, cu, sz, K = (
            (self.X, self.a, self.cx, self.cu_x, self.sizes_x, self.Xk)
            if side == "x"
            else (self.Y, self.b, self.cy, self.cu_y, self.sizes_y, self.Yk)
        )
        fields = dict(X=X, Y=X, a=w, b=w, cx=c, cy=c, labels=None, cu_x=cu, cu_y=cu)
        return replace(self, sizes_x=sz, sizes_y=sz, Xk=K, Yk=K, **fields)

    # -- reductions over each problem's segment -------------------------------------------

    def total(self, t, side="x"):
        seg = self._seg[side]
        out = torch.zeros(self.batch, dtype=t.dtype, device=t.device)
        return out.index_add_(0, seg, t.reshape(-1))

    def peak(self, t, side="x"):
        seg = self._seg[side]
        out = torch.full((self.batch,), float("-inf"), dtype=t.dtype, device=t.device)
        return out.scatter_reduce_(0, seg, t.reshape(-1), reduce="amax")

    def expand(self, t, side="x"):
        return t[self._seg[side]][None]

    # -- the passes -------------------------------------------------------------------------

    def _pass(self, side, pot, eps, damping, v, want_lse):
        if side == "x":
            rows, cols, logw, crow, ccol = self.Xk, self.Yk, self.logb, self.cx, self.cy
            cu_r, cu_c, sizes = self.cu_x, self.cu_y, self.sizes_x
        else:
            rows, cols, logw, crow, ccol = self.Yk, self.Xk, self.loga, self.cy, self.cx
            cu_r, cu_c, sizes = self.cu_y, self.cu_x, self.sizes_y
        pot, logw, crow, ccol = pot[0], logw[0], crow[0], ccol[0]
        vv = None if v is None else v[0]
        if self.backend == "triton":
            if side not in self._tables:
                bm = 16 if _config.interpret() else 64
                self._tables[side] = block_table(sizes, cu_r, bm)
            out, lse2, vbar = softmin_varlen(
                rows,
                cols,
                pot,
                logw,
                crow,
                ccol,
                cu_r,
                cu_c,
                sizes,
                eps=eps,
                c2=self.c2,
                damping=damping,
                v=vv,
                precision=self.precision,
                table=self._tables[side],
            )
        else:
            out, lse2, vbar = self._torch_pass(
                rows, cols, pot, logw, crow, ccol, cu_r, cu_c, eps, damping, vv
            )
        return out[None], (lse2[None] if want_lse else None), (None if v is None else vbar[None])

    def _torch_pass(self, rows, cols, pot, logw, crow, ccol, cu_r, cu_c, eps, damping, v):
        """Each problem's rows against its columns (torch, in the problem's dtype)."""
        dt = rows.dtype
        out = torch.empty(rows.shape[0], dtype=dt, device=rows.device)
        lse2 = torch.empty_like(out)
        vbar = (
            None
            if v is None
            else torch.empty((rows.shape[0], v.shape[-1]), dtype=dt, device=rows.device)
        )
        bias = logw.to(dt) + (pot.to(dt) - ccol.to(dt)) / eps
        for k, (i0, i1, j0, j1) in enumerate(self._ranges(cu_r, cu_c)):
            del k
            S = (self.c2 / eps) * rows[i0:i1] @ cols[j0:j1].T + bias[j0:j1][None, :]
            lse = torch.logsumexp(S, -1)
            out[i0:i1] = damping * (crow[i0:i1].to(dt) - eps * lse)
            lse2[i0:i1] = lse / LN2
            if v is not None:
                vbar[i0:i1] = torch.softmax(S, -1) @ v[j0:j1].to(dt)
        return out, lse2, vbar

    @staticmethod
    def _ranges(cu_r, cu_c):
        r, c = cu_r.tolist(), cu_c.tolist()
        return [(r[k], r[k + 1], c[k], c[k + 1]) for k in range(len(r) - 1)]

    def sm_x(self, g, eps, damping=1.0, v=None, want_lse=False, guess=None):
        return self._pass("x", g, eps, damping, v, want_lse)

    def sm_y(self, f, eps, damping=1.0, v=None, want_lse=False, guess=None):
        return self._pass("y", f, eps, damping, v, want_lse)

    def cost_bound(self):
        xn, yn = self.Xk.double().norm(dim=-1)[None], self.Yk.double().norm(dim=-1)[None]
        mag = self.peak(self.cx.abs().double()) + self.peak(self.cy.abs().double(), "y")
        return mag + abs(self.c2) * self.peak(xn) * self.peak(yn, "y")

    def dense_plan(self, f, g, eps, columns=None):
        raise NotImplementedError("a ragged batch has no (B, N, M) plan; use lazy products")

    def sample_rows(self, g, eps, seed, guess=None):
        raise NotImplementedError("plan sampling of ragged batches is not implemented")


# ----------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------


def _as_list(t, name):
    if not isinstance(t, (list, tuple)) or not t:
        raise ValueError(f"{name} must be a non-empty list of tensors for a ragged batch")
    for k, u in enumerate(t):
        if not isinstance(u, torch.Tensor):
            raise TypeError(f"{name}[{k}] must be a torch.Tensor; got {type(u).__name__}")
    return list(t)


def prepare_varlen(x, y, a=None, b=None, cu_seqlens=None):
    """A ragged batch, checked: lists of clouds ``x[k] (N_k, D)``, ``y[k] (M_k, D)`` (and
    weights ``a[k] (N_k,)``, ``b[k] (M_k,)`` or None: uniform), or concatenated points
    ``x (sum N_k, D)``, ``y (sum M_k, D)`` with ``cu_seqlens=(cu_x, cu_y)`` (B + 1,
    nondecreasing, from 0). Returns ``(x (1, Nt, D), y (1, Mt, D), a (1, Nt), b (1, Mt),
    cu_x, cu_y, sizes_x, sizes_y)``; a zero-size problem is an error naming it."""
    if cu_seqlens is None:
        xs, ys = _as_list(x, "x"), _as_list(y, "y")
        if len(xs) != len(ys):
            raise ValueError(f"x and y must hold as many clouds; got {len(xs)} and {len(ys)}")
        for name, lst in (("x", xs), ("y", ys)):
            for k, u in enumerate(lst):
                if u.dim() != 2 or u.shape[0] == 0:
                    raise ValueError(
                        f"{name}[{k}] must be (N, D) with N >= 1; got {tuple(u.shape)}"
                    )
        sizes_x, sizes_y = tuple(u.shape[0] for u in xs), tuple(u.shape[0] for u in ys)
        xc, yc = torch.cat(xs), torch.cat(ys)
        ac = None if a is None else torch.cat(_weights_list(a, "a", sizes_x))
        bc = None if b is None else torch.cat(_weights_list(b, "b", sizes_y))
    else:
        try:
            cu_x, cu_y = cu_seqlens
        except (TypeError, ValueError):
            raise ValueError("cu_seqlens must be a pair (cu_x, cu_y) of (B + 1,) offsets") from None
        xc, yc, ac, bc = x, y, a, b
        sizes_x, sizes_y = _sizes(cu_x, "cu_x", x), _sizes(cu_y, "cu_y", y)
        if len(sizes_x) != len(sizes_y):
            raise ValueError("cu_seqlens: cu_x and cu_y must have the same length B + 1")
    if xc.dim() != 2 or yc.dim() != 2 or xc.shape[1] != yc.shape[1]:
        raise ValueError(
            f"x and y must be (N, D) clouds of one D; got {tuple(xc.shape)}, {tuple(yc.shape)}"
        )
    for name, w, n in (("a", ac, xc.shape[0]), ("b", bc, yc.shape[0])):
        if w is not None and tuple(w.shape) != (n,):
            raise ValueError(f"{name} must hold one weight per point ({n},); got {tuple(w.shape)}")
    dev = xc.device
    cu_x, cu_y = offsets(sizes_x, dev), offsets(sizes_y, dev)
    if ac is None:
        ac = torch.cat([torch.full((n,), 1.0 / n, dtype=xc.dtype, device=dev) for n in sizes_x])
    if bc is None:
        bc = torch.cat([torch.full((m,), 1.0 / m, dtype=xc.dtype, device=dev) for m in sizes_y])
    return xc[None], yc[None], ac[None], bc[None], cu_x, cu_y, sizes_x, sizes_y


def _weights_list(w, name, sizes):
    ws = _as_list(w, name)
    if len(ws) != len(sizes):
        raise ValueError(f"{name} must hold one weight vector per cloud ({len(sizes)})")
    for k, (u, n) in enumerate(zip(ws, sizes)):
        if tuple(u.shape) != (n,):
            raise ValueError(f"{name}[{k}] must be ({n},); got {tuple(u.shape)}")
    return ws


def _sizes(cu, name, pts):
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a (B + 1,) integer tensor of offsets")
    v = [int(t) for t in cu.tolist()]  # one host read: the launch grid needs the sizes
    sizes = tuple(v[k + 1] - v[k] for k in range(len(v) - 1))
    if v[0] != 0 or v[-1] != pts.shape[0] or min(sizes) < 1:
        raise ValueError(
            f"{name} must start at 0, end at the number of points ({pts.shape[0]}) and give "
            f"every problem at least one point; got {v[:4]}..."
        )
    return sizes


def split(t, sizes):
    """A concatenated row vector or point tensor ``(1, sum sizes, ...)`` as a list per problem."""
    return list(torch.split(t[0], list(sizes)))
