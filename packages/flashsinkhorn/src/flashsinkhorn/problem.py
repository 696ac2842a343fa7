"""The coupling object: ``Problem``, the few operations every backend supplies to the loop.

A :class:`Problem` is ``B`` entropic OT problems between weighted point clouds in kernel form

    C_ij = cx_i + cy_j - c2 <X_i - c, Y_j - c>  [+ s W[lx_i, ly_j]]

with weights ``a``, ``b``. The one Sinkhorn loop (:mod:`flashsinkhorn._loop`), the value and
its gradients (:mod:`flashsinkhorn.solver`, :mod:`flashsinkhorn.samples_loss`), the lazy plan
and plan sampling see the data only through the operations below; a backend (a size regime,
a device, a layout) is a subclass that implements them:

- ``sm_x(g, eps, damping, v=None, want_lse=False, guess=None) -> (f_new, lse2, vbar)``: the
  row softmin ``f_new_i = damping * (cx_i - eps ln sum_j b_j exp((g_j - cy_j + c2 <X_i, Y_j>
  [- s W]) / eps))``; ``lse2`` (``want_lse``) its log2 sum of the scores (without ``cx``);
  ``vbar_i = sum_j pi_ij v_j`` with ``pi`` the row softmax (``v`` given: plan application);
  ``guess`` an estimate of ``f_new`` a backend may use (the current potential);
- ``sm_y(f, ...)``: the same over the columns (rows = y);
- ``sym_update(f, g, eps, damping_x, damping_y) -> (f_new, g_new)``: both updates of a
  symmetric iteration from the old potentials (one pass where the backend can);
- ``self_update(f, eps, damping)``: the update of a self problem (x against itself);
- ``sample_rows(g, eps, seed, guess=None)``: one column index per row, drawn from its row
  of the plan; ``guess`` an estimate of the rows' ``-eps`` LogSumExp of the scores (without
  ``cx``) a backend may use (``f - cx`` of a solved problem);
- ``total(t, side)`` / ``peak(t, side)``: a row vector of the ``side`` ("x": shaped like
  ``cx``, "y": like ``cy``) reduced to one value per problem, ``(B,)``;
  ``any_rank(flags)``: flags OR-ed over the ranks sharing the problem;
- ``with_precision(p)``; ``self_problem(side)`` (the debiasing problems); ``cost_bound()``;
  ``dense_plan(f, g, eps)``.

No operation synchronises with the host. Potentials are row vectors shaped like ``cx`` (f)
and ``cy`` (g). docs/design/flashsinkhorn.md ("Backends: the Problem interface") lists the
implementations and what the loop needs to certify.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

__all__ = ["Problem"]


@dataclass(kw_only=True)
class Problem:
    """Base class of every backend: the data in kernel form and the shared reductions.

    Fields: ``X (B, N, D)``, ``Y (B, M, D)`` the features (normalized for cosine), ``a``,
    ``b`` the weights, ``cx``, ``cy`` the additive cost terms, ``c2`` the dot's multiplier,
    ``cost`` / ``cost_scale`` (what the features were built from), ``labels`` an optional
    ``(lx, ly, W, scale)`` label cost, ``precision`` the dot precision, ``center`` an optional
    ``(B, D)`` common center of the dot products. ``kind`` (class attribute) names the
    implementation (recorded in results, printed by ``verbose=True``).
    """

    kind: ClassVar[str] = "abstract"
    # True where the passes compute the cost in the problem's dtype whatever ``precision``
    # says (a tf32 / bf16 loop then has nothing to polish)
    exact: ClassVar[bool] = True
    # the annealing ratio a solve without eps_scaling uses (None: no annealing); a backend
    # that needs potentials to plan its passes (multiscale) anneals anyway
    default_scaling: ClassVar[float | None] = None

    X: torch.Tensor
    Y: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    cx: torch.Tensor
    cy: torch.Tensor
    c2: float
    cost: str = "sqeuclidean"
    cost_scale: float = 1.0
    labels: tuple | None = None
    precision: str = "tf32"
    center: torch.Tensor | None = None
    loga: torch.Tensor = field(init=False, repr=False)
    logb: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        self.loga = torch.log(self.a)
        self.logb = torch.log(self.b)

    # -- shape ------------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        """How many problems (B)."""
        return self.X.shape[0]

    def zeros_x(self) -> torch.Tensor:
        """A potential f of zeros (the loop's start), in the potentials' dtype."""
        return torch.zeros(self.cx.shape, dtype=self.potential_dtype, device=self.cx.device)

    def zeros_y(self) -> torch.Tensor:
        return torch.zeros(self.cy.shape, dtype=self.potential_dtype, device=self.cy.device)

    @property
    def backend_arg(self) -> str:
        """The ``backend=`` argument that builds this implementation again
        (:func:`flashsinkhorn.backends.build`; the compiled solve's ops rebuild with it)."""
        return self.kind

    @property
    def kernel_family(self) -> str:
        """The kernel family of passes that run outside the problem (the second-order
        plan of a double backward): "torch" unless the problem runs the Triton kernels."""
        return "torch"

    @property
    def potential_dtype(self) -> torch.dtype:
        """float64 for float64 problems computed in float64, else float32."""
        return torch.float64 if self.X.dtype == torch.float64 else torch.float32

    # -- reductions over the problem's points (the sharded problem makes them global) -------

    def total(self, t: torch.Tensor, side: str = "x") -> torch.Tensor:
        """A row vector of the ``side`` cloud ("x": shaped like ``cx``, "y": like ``cy``)
        summed over the points of each problem, (B,) (here ``t.sum(-1)``; a ragged layout
        needs the side to find the problems' segments)."""
        return t.sum(-1)

    def peak(self, t: torch.Tensor, side: str = "x") -> torch.Tensor:
        """``t.amax(-1)`` per problem, (B,)."""
        return t.amax(-1)

    def expand(self, t: torch.Tensor, side: str = "x") -> torch.Tensor:
        """A per-problem value ``t`` (B,) broadcast against the ``side``'s row vectors:
        ``(B, 1)`` here (a ragged layout repeats it over each problem's segment)."""
        return t[:, None]

    def any_rank(self, flags) -> tuple:
        """The flags OR-ed over the ranks that share the problem (here: one)."""
        return tuple(flags)

    # -- the operations -------------------------------------------------------------------

    def sm_x(self, g, eps, damping=1.0, v=None, want_lse=False, guess=None):
        raise NotImplementedError(f"{type(self).__name__} does not implement sm_x")

    def sm_y(self, f, eps, damping=1.0, v=None, want_lse=False, guess=None):
        raise NotImplementedError(f"{type(self).__name__} does not implement sm_y")

    def sym_update(self, f, g, eps, damping_x=1.0, damping_y=1.0):
        """Both updates from the old ``(f, g)``; this default runs the two passes with the
        old potentials as guesses (a backend with a one-pass kernel overrides it)."""
        ft = self.sm_x(g, eps, damping_x, guess=f)[0]
        return ft, self.sm_y(f, eps, damping_y, guess=g)[0]

    def self_update(self, f, eps, damping):
        """The update of a self problem (rows and columns the same cloud)."""
        return self.sm_x(f, eps, damping, guess=f)[0]

    def sample_rows(self, g, eps, seed, guess=None):
        raise NotImplementedError(f"{type(self).__name__} does not implement sample_rows")

    def with_precision(self, precision: str) -> Problem:
        """The same problem at another dot precision."""
        return replace(self, precision=precision)

    def self_problem(self, side: str) -> Problem:
        """The problem of one cloud against itself (``side`` "x" or "y"), for the debiasing
        terms OT(a, a), OT(b, b): same cost and precision, no label cost."""
        return replace(self, **self._self_fields(side))

    def _self_fields(self, side):
        X, w, c = (self.X, self.a, self.cx) if side == "x" else (self.Y, self.b, self.cy)
        return {"X": X, "Y": X, "a": w, "b": w, "cx": c, "cy": c, "labels": None}

    @property
    def labels_t(self):
        """The label cost seen from the columns (rows = y)."""
        if self.labels is None:
            return None
        lx, ly, W, s = self.labels
        return (ly, lx, W.t(), s)

    def cost_bound(self) -> torch.Tensor:
        """``(B,)`` float64 bound on ``|C_ij|``: ``max|cx| + max|cy| + |c2| max|X - c|
        max|Y - c|`` (+ the label table's largest entry): the certificate's float64 rounding
        term scales with it."""
        X, Y = self.X.detach(), self.Y.detach()
        if self.center is not None:
            X, Y = X - self.center[:, None, :], Y - self.center[:, None, :]
        xn, yn = X.double().norm(dim=-1), Y.double().norm(dim=-1)
        mag = self.peak(self.cx.abs().double()) + self.peak(self.cy.abs().double(), "y")
        mag = mag + abs(self.c2) * self.peak(xn) * self.peak(yn, "y")
        if self.labels is not None:
            mag = mag + abs(self.labels[3]) * self.labels[2].abs().max().double()
        return mag

    # -- the ladder: coarse levels for the annealing (the multiscale backend) --------------

    def stage_levels(self, temperatures) -> list:
        """For each annealing temperature, the level of the problem it runs on (a key of
        :meth:`at_level`): the same for every stage unless the backend coarsens its clouds
        (GeomLoss's multiscale "jumps"). The last temperature always runs on this problem."""
        return [None] * len(temperatures)

    def at_level(self, key) -> Problem:
        """The problem of a level of :meth:`stage_levels` (here: this one)."""
        return self

    def prolong(self, src, dst, f, g, eps, damping_x=1.0, damping_y=1.0):
        """Potentials ``(f, g)`` of level ``src`` at temperature ``eps`` carried to the finer
        level ``dst`` (only a backend with levels has it)."""
        raise NotImplementedError(f"{type(self).__name__} has one level")

    def float64_certifier(self, eps, rho_x, rho_y, a64=None, b64=None):
        """The backend's own float64 certificate ``certify(f, g) -> (err, rows, cols)``, or
        None for the dense float64 measurement of :func:`flashsinkhorn.result.certificate`
        (a backend overrides it where that measurement costs more than a solve: multiscale).
        ``a64``, ``b64``: exact float64 weights when they are not the problem's."""
        return None

    def dense_cost(self, columns=None) -> torch.Tensor:
        """The cost matrix (B, N, M) in the problem's dtype (tests, small problems).
        ``columns``: the column side's ``Y, cy`` if not this problem's (sharded)."""
        c = columns or {"Y": self.Y, "cy": self.cy}
        X, Y = self.X.detach(), c["Y"].detach()
        if self.center is not None:
            X, Y = X - self.center[:, None, :], Y - self.center[:, None, :]
        base = self.cx[..., :, None] + c["cy"][..., None, :]
        # one fused GEMM (a plain X @ Y^T took 5.5 ms at 1000 x 1000, D = 3, one thread;
        # baddbmm 0.3 ms)
        C = torch.baddbmm(base, X, Y.transpose(-1, -2), alpha=-self.c2)
        if self.labels is not None:
            lx, ly, W, s = self.labels
            C = C + s * W.to(C.dtype)[lx.long()[..., :, None], ly.long()[..., None, :]]
        return C

    def dense_plan(self, f, g, eps, columns=None) -> torch.Tensor:
        """The plan (B, N, M) ``a_i b_j exp((f_i + g_j - C_ij) / eps)`` (tests, small
        problems). ``columns``: the column side's ``Y, g, b, cy`` if not this problem's."""
        c = columns or {"Y": self.Y, "g": g, "b": self.b, "cy": self.cy}
        C = self.dense_cost(columns=c)
        return (
            self.a[..., :, None]
            * c["b"][..., None, :]
            * torch.exp((f[..., :, None] + c["g"][..., None, :] - C) / eps)
        )
