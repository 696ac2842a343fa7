"""The ``dense`` backend: the cost matrix in memory, every pass a few fused tensor ops.

For problems whose ``B x N x M`` cost fits a memory budget (``_config.DENSE_MAX_BYTES``),
``-C`` is built once (one batched matrix product, in the problem's dtype: float32 or
float64, never tf32) and every softmin is a ``logsumexp_j(-C_ij / eps + h_j)`` over it: no
kernel-launch overhead beyond a handful of tensor ops per pass, and no GEMM per pass.
CPU and GPU, batched (B, N, D) problems.

A symmetric update on the CPU computes both potentials from ONE exp per score: the plan
``P_ij = exp(log a_i + log b_j + (f_i + g_j - C_ij) / eps)`` of the old potentials is built
by two broadcast adds over the stored matrix and exponentiated in place (``exp2``); its row
and column sums give ``f_new`` and ``g_new``. The passes with a guess of their result (the
Sinkhorn loops' current potentials) also take one exp2 per score around it. Rows or columns
whose sums leave ``[2^-60, FLT_MAX]`` are recomputed by the max-subtracted pass (a host read
that is free on the CPU). On the GPU every pass is the max-subtracted one (no host read; the
passes are launch-bound at these sizes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from flashsinkhorn import _config
from flashsinkhorn.problem import Problem
from flashsinkhorn.reference import LN2, LOG2E
from flashsinkhorn.sampling import softmax_sample

__all__ = ["DenseProblem", "dense_bytes"]

# the range in which a row's sum of exp2 around a guess is exact: [SHIFT_LO = 2^-60,
# FLT_MAX) as in the streaming kernels (below, terms flushed to zero could matter; above,
# an overflow), in log2 units
_LOG2_LO, _LOG2_HI = math.log2(_config.SHIFT_LO), 128.0


def _in_range(log2_sums) -> bool:
    """All log2 sums (NaN fails) within ``[_LOG2_LO, _LOG2_HI)``: one host read."""
    lo, hi = torch.aminmax(log2_sums)
    # two scalar reads instead of three more tensor ops (a NaN compares False: fails)
    return _LOG2_LO <= float(lo) and float(hi) < _LOG2_HI


def dense_bytes(B: int, N: int, M: int, dtype: torch.dtype) -> int:
    """Bytes of one dense cost matrix (the budget ``_config.DENSE_MAX_BYTES`` counts them)."""
    return B * N * M * (8 if dtype == torch.float64 else 4)


@dataclass(kw_only=True)
class DenseProblem(Problem):
    """A :class:`flashsinkhorn.problem.Problem` with ``-C log2(e)`` (B, N, M) in memory.

    Scores are kept in log2 units and exponentiated with ``exp2``: on the CPU torch's
    float32 ``exp`` takes a slow path for arguments below about -87 (a Sinkhorn plan is
    mostly such entries: 26 ms against 0.64 ms for ``exp2`` over 10^6 scores in [-150, 0],
    one thread; GeomLoss's tensorized softmin pays it)."""

    kind: ClassVar[str] = "dense"

    negC2: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.negC2 is None:
            with torch.no_grad():
                C = self.dense_cost().to(self.potential_dtype)
                self.negC2 = C.mul_(-LOG2E).contiguous()
        # one-exp symmetric updates need positive weights (a zero weight's row has no plan
        # mass to measure its potential with); decided once, on the CPU only (a free read)
        self._one_exp = self.negC2.device.type == "cpu" and bool(
            (self.a > 0).all() & (self.b > 0).all()
        )

    def self_problem(self, side):
        """The debiasing problem of one cloud (its own N x N matrix)."""
        return replace(self, negC2=None, **self._self_fields(side))

    def _cast(self, *ts):
        dt = self.negC2.dtype
        return tuple(t if t is None or t.dtype == dt else t.to(dt) for t in ts)

    def _buffer(self):
        """A (B, N, M) scratch matrix for the CPU passes, kept with the problem (allocating
        it per pass cost about as much as the pass's baddbmm: 1000 x 1000, one thread)."""
        buf = getattr(self, "_scratch", None)
        if buf is None:
            buf = self._scratch = torch.empty_like(self.negC2)
        return buf

    def _exp_scores(self, row, col, eps):
        """``exp2(-C log2e / eps + row_i + col_j)`` (log2 units) into the scratch matrix: two
        broadcast adds (0.15 ms per 10^6 scores on one thread, against 0.28 for one
        ``baddbmm`` carrying both vectors) and one in-place ``exp2``."""
        P = torch.add(col[..., None, :], self.negC2, alpha=1.0 / eps, out=self._buffer())
        return P.add_(row[..., :, None]).exp2_()

    def _pass(self, h2, c_row, eps, damping, v, want_lse, cols, guess):
        """One softmin of the scores ``-C log2e / eps + h2`` (log2 units) over the columns
        (``cols=False``: rows = x) or over the rows (``True``). With a ``guess`` of the
        result on the CPU: one exp2 per score around it, out-of-range rows again by the
        safe pass (module docstring). Returns ``(out, lse2, vbar)`` as ``sm_x``."""
        dim = -2 if cols else -1
        if guess is not None and self.negC2.device.type == "cpu":
            shift = guess * (LOG2E / eps)
            E = self._exp_scores(h2, shift, eps) if cols else self._exp_scores(shift, h2, eps)
            s = E.sum(dim)
            ls = torch.log2(s)
            vbar = None
            if v is not None:
                Et = E.transpose(-1, -2) if cols else E
                vbar = torch.bmm(Et, v.to(E.dtype)) / s[..., None]
            if not _in_range(ls):  # one free read on the CPU
                ok = (ls >= _LOG2_LO) & (ls < _LOG2_HI)
                lse_s, vbar_s = self._safe_lse2(h2, eps, v, cols)
                ls = torch.where(ok, ls, lse_s + shift)
                if v is not None:
                    vbar = torch.where(ok[..., None], vbar, vbar_s)
            lse = ls.sub_(shift)
        else:
            lse, vbar = self._safe_lse2(h2, eps, v, cols)
        # -C includes -cx: lse is of the full scores
        out = damping * (-eps * LN2) * lse
        lse2 = (lse + (LOG2E / eps) * c_row) if want_lse else None
        return out, lse2, vbar

    def _safe_lse2(self, h2, eps, v, cols):
        """The running-max pass: ``log2 sum exp2`` of the scores with their maximum
        subtracted (any range), and the softmax average of ``v``."""
        C = self.negC2.transpose(-1, -2) if cols else self.negC2
        S = torch.add(h2[..., None, :], C, alpha=1.0 / eps)
        m = S.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows without mass
        E = S.sub_(m).exp2_()
        s = E.sum(-1)
        lse = torch.log2(s) + m[..., 0]
        vbar = None if v is None else torch.bmm(E, v.to(E.dtype)) / s[..., None]
        return lse, vbar

    def sm_x(self, g, eps, damping=1.0, v=None, want_lse=False, guess=None):
        """Row softmin (the score matrix is ``-C``: its row LSE already holds ``-cx``)."""
        g, guess = self._cast(g, guess)
        # one fused op on the cached log2 weights (a pass at n = 300 is ~10 ops of ~10 us)
        h2 = torch.add(self._log2_weights()[1], g, alpha=LOG2E / eps)
        return self._pass(h2, self.cx.to(g.dtype), eps, damping, v, want_lse, False, guess)

    def sm_y(self, f, eps, damping=1.0, v=None, want_lse=False, guess=None):
        f, guess = self._cast(f, guess)
        h2 = torch.add(self._log2_weights()[0], f, alpha=LOG2E / eps)
        return self._pass(h2, self.cy.to(f.dtype), eps, damping, v, want_lse, True, guess)

    def sym_update(self, f, g, eps, damping_x=1.0, damping_y=1.0):
        """Both updates; on the CPU from one exp2 per score (module docstring)."""
        if not self._one_exp:
            return super().sym_update(f, g, eps, damping_x, damping_y)
        f, g = self._cast(f, g)
        loga2, logb2 = self._log2_weights()
        # the plan of the old potentials: P_ij = exp2(-C_ij log2e / eps + u_i + v_j)
        k = LOG2E / eps
        P = self._exp_scores(torch.add(loga2, f, alpha=k), torch.add(logb2, g, alpha=k), eps)
        # softmin(g)_i = f_i - eps ln2 (log2 rowsum_i - log2 a_i); few ops: at n = 300 a
        # symmetric update is about 15 tensor operations of ~10 us each
        lr, lc = torch.log2(P.sum(-1)), torch.log2(P.sum(-2))
        ok = _in_range(torch.cat((lr, lc), dim=-1))
        ft = torch.add(f, lr.sub(loga2), alpha=-eps * LN2)
        gt = torch.add(g, lc.sub(logb2), alpha=-eps * LN2)
        ft = ft if damping_x == 1.0 else ft.mul_(damping_x)
        gt = gt if damping_y == 1.0 else gt.mul_(damping_y)
        if not ok:  # out of range: those rows / columns again, exactly (a free CPU read)
            bad_r = ~((lr >= _LOG2_LO) & (lr < _LOG2_HI))
            bad_c = ~((lc >= _LOG2_LO) & (lc < _LOG2_HI))
            ft = torch.where(bad_r, self.sm_x(g, eps, damping_x)[0], ft)
            gt = torch.where(bad_c, self.sm_y(f, eps, damping_y)[0], gt)
        return ft, gt

    def _log2_weights(self):
        """``log2e * log a``, ``log2e * log b`` in the matrix's dtype, made once."""
        w = getattr(self, "_logw2", None)
        if w is None:
            w = self._logw2 = self._cast(LOG2E * self.loga, LOG2E * self.logb)
        return w

    def self_update(self, f, eps, damping):
        """The update of a self problem: the row pass around the current potential."""
        return self.sm_x(f, eps, damping, guess=f)[0]

    def sample_rows(self, g, eps, seed, guess=None):
        """One column per row: the streaming torch path's draw on the features (the same
        hash and indices as the streaming backend; a one-off pass, the stored matrix is not
        needed)."""
        X, Y = self.X, self.Y
        if self.center is not None:
            X, Y = X - self.center[:, None, :], Y - self.center[:, None, :]
        return softmax_sample(
            X,
            Y,
            g,
            self.logb,
            self.cy,
            eps=eps,
            c2=self.c2,
            seed=seed,
            labels=self.labels,
            precision="ieee",
            backend="torch",
        )

    def cost_bound(self):
        return self.negC2.abs().amax(dim=(-2, -1)).double() / LOG2E
