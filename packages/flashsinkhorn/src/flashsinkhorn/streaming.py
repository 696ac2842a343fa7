"""The ``streaming`` backend: the tiled kernels, O((n + m) d) memory, any size.

Every pass streams tiles of one cloud past a block of rows of the other (FlashAttention's
forward): the portable Triton kernels (``_softmin_triton``, ``_symmetric_triton``), the
hand-scheduled sm_90 Gluon kernels on H100 / H200 (``_softmin_hopper``,
``_symmetric_hopper``, chosen per pass by :func:`flashsinkhorn.primitives.softmin` under
``backend="auto"``), and a blockwise torch path on CPU and for float64. Nothing of size
n x m is stored. The kernel operands ``X - c``, ``Y - c`` (cast, tf32-rounded) are prepared
once per problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from flashsinkhorn.operands import kernel_operands
from flashsinkhorn.primitives import self_softmin, softmin, symmetric_update
from flashsinkhorn.problem import Problem
from flashsinkhorn.sampling import softmax_sample

__all__ = ["StreamingProblem"]


@dataclass(kw_only=True)
class StreamingProblem(Problem):
    """A :class:`flashsinkhorn.problem.Problem` on the streaming kernels.

    ``backend``: the kernel family, ``"auto"`` (Triton on CUDA with the sm_90 Gluon kernel
    per pass where it applies), ``"triton"`` (the portable Triton kernels only) or
    ``"torch"`` (the blockwise torch path). ``Xk``, ``Yk``: the kernel operands, prepared
    once; pass another problem's to share them (the debiasing problems, the autograd copy).
    """

    kind: ClassVar[str] = "streaming"

    backend: str = "auto"
    Xk: torch.Tensor | None = field(default=None, repr=False)
    Yk: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.Xk is None or self.Yk is None:
            self.Xk, self.Yk = kernel_operands(
                self.X, self.Y, self.center, self.precision, self.backend
            )

    @property
    def backend_arg(self) -> str:
        return "streaming" if self.backend == "auto" else self.backend

    @property
    def kernel_family(self) -> str:
        return self.backend

    @property
    def potential_dtype(self) -> torch.dtype:
        """float64 on the torch path for float64 inputs; the kernels return float32."""
        f64 = self.X.dtype == torch.float64 and self.backend == "torch"
        return torch.float64 if f64 else torch.float32

    @property
    def exact(self) -> bool:  # type: ignore[override]
        """The torch path computes in the problem's dtype; the kernels in ``precision``."""
        return self.backend == "torch"

    def with_precision(self, precision):
        """The same problem at another dot precision (its own kernel operands)."""
        return replace(self, precision=precision, Xk=None, Yk=None)

    def self_problem(self, side):
        """The debiasing problem of one cloud, sharing this problem's kernel operands."""
        K = self.Xk if side == "x" else self.Yk
        return replace(self, Xk=K, Yk=K, **self._self_fields(side))

    def sm_x(self, g, eps, damping=1.0, v=None, want_lse=False, guess=None):
        """f-side update over the columns; ``guess`` (the current f) selects the shift
        kernel (see :func:`flashsinkhorn.softmin`)."""
        return softmin(
            self.Xk,
            self.Yk,
            g,
            self.logb,
            self.cx,
            self.cy,
            eps=eps,
            c2=self.c2,
            damping=damping,
            v=v,
            labels=self.labels,
            precision=self.precision,
            backend=self.backend,
            want_lse=want_lse,
            guess=guess,
        )

    def sm_y(self, f, eps, damping=1.0, v=None, want_lse=False, guess=None):
        """g-side update over the rows (rows = y); ``guess``: the current g."""
        return softmin(
            self.Yk,
            self.Xk,
            f,
            self.loga,
            self.cy,
            self.cx,
            eps=eps,
            c2=self.c2,
            damping=damping,
            v=v,
            labels=self.labels_t,
            precision=self.precision,
            backend=self.backend,
            want_lse=want_lse,
            guess=guess,
        )

    def sym_update(self, f, g, eps, damping_x=1.0, damping_y=1.0):
        """Both updates from one streaming pass where the kernels have it
        (:func:`flashsinkhorn.symmetric_update`)."""
        return symmetric_update(
            self.Xk,
            self.Yk,
            f,
            g,
            self.loga,
            self.logb,
            self.cx,
            self.cy,
            eps=eps,
            c2=self.c2,
            damping_x=damping_x,
            damping_y=damping_y,
            labels=self.labels,
            precision=self.precision,
            backend=self.backend,
        )

    def self_update(self, f, eps, damping):
        """The debiasing update of a self problem: the symmetric self kernel (each tile pair
        once) or the sm_90 pass (same result as ``sm_x``)."""
        return self_softmin(
            self.Xk,
            self.loga,
            f,
            self.cx,
            eps=eps,
            c2=self.c2,
            damping=damping,
            precision=self.precision,
            center=None,
            backend=self.backend,
        )

    def sample_rows(self, g, eps, seed, guess=None):
        """One column per row (:func:`flashsinkhorn.softmax_sample`: a Gumbel-max over
        blocks of columns in the streaming pass, then inside the winning block); ``guess``
        the sm_90 pass's fixed shift."""
        return softmax_sample(
            self.Xk,
            self.Yk,
            g,
            self.logb,
            self.cy,
            eps=eps,
            c2=self.c2,
            seed=seed,
            labels=self.labels,
            precision=self.precision,
            backend=self.backend,
            guess=guess,
        )

    def cost_bound(self):
        """As :meth:`Problem.cost_bound`, from the prepared operands (no copy)."""
        xn, yn = self.Xk.double().norm(dim=-1), self.Yk.double().norm(dim=-1)
        mag = self.peak(self.cx.abs().double()) + self.peak(self.cy.abs().double(), "y")
        mag = mag + abs(self.c2) * self.peak(xn) * self.peak(yn, "y")
        if self.labels is not None:
            mag = mag + abs(self.labels[3]) * self.labels[2].abs().max().double()
        return mag
