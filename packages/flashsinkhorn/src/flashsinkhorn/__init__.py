"""flashsinkhorn: exact, differentiable entropic optimal transport between point clouds, on
the one Sinkhorn loop and a backend for every size (dense, streaming Triton / Gluon).

Public API (docs/flashsinkhorn.md):

- :func:`solve` -> :class:`SinkhornResult` (with its :class:`LazyPlan`);
  :class:`SamplesLoss` (GeomLoss-compatible, p = 2) and its functional form
  :func:`sinkhorn_divergence`;
- the streaming primitives :func:`softmin`, :func:`plan_apply`, :func:`self_softmin`,
  :func:`symmetric_update` (both updates of a symmetric iteration in one pass);
- plan sampling: :func:`sample_plan` (a target index per source point of a result) and the
  primitive :func:`softmax_sample`;
- the float64 references ``*_ref`` (:mod:`flashsinkhorn.reference`);
- :mod:`flashsinkhorn.second_order`, a namespace: ``second_order.hvp``, ``ot_loss``,
  ``implicit_grad``, ``inverse_hvp``, OTDD.

Sharding over a process group: ``process_group=`` of :func:`solve` / :class:`SamplesLoss`
(:mod:`flashsinkhorn.distributed`).
"""

__version__ = "0.2.0"

from flashsinkhorn import second_order
from flashsinkhorn.primitives import plan_apply, self_softmin, softmin, symmetric_update
from flashsinkhorn.reference import (
    cost_matrix_ref,
    plan_apply_ref,
    samples_loss_ref,
    sinkhorn_ref,
    softmin_ref,
    symmetric_update_ref,
)
from flashsinkhorn.result import LazyPlan, SinkhornResult
from flashsinkhorn.samples_loss import SamplesLoss, sinkhorn_divergence
from flashsinkhorn.sampling import sample_plan, softmax_sample, softmax_sample_ref
from flashsinkhorn.solver import solve

__all__ = [
    "__version__",
    "solve",
    "SinkhornResult",
    "LazyPlan",
    "SamplesLoss",
    "sinkhorn_divergence",
    "softmin",
    "plan_apply",
    "self_softmin",
    "symmetric_update",
    "sample_plan",
    "softmax_sample",
    "cost_matrix_ref",
    "softmin_ref",
    "symmetric_update_ref",
    "plan_apply_ref",
    "sinkhorn_ref",
    "samples_loss_ref",
    "softmax_sample_ref",
    "second_order",
]
