"""flashsinkhorn: exact, differentiable entropic optimal transport between point clouds,
streamed by Triton kernels in O((n + m) d) memory.

Public API (docs/flashsinkhorn.md):

- :func:`solve` -> :class:`SinkhornResult`; :class:`SamplesLoss` (GeomLoss-compatible, p=2)
  and its functional form :func:`sinkhorn_divergence`;
- the streaming primitives :func:`softmin`, :func:`plan_apply`, :func:`self_softmin`,
  :func:`symmetric_update` (both updates of a symmetric iteration in one pass);
- plan sampling (:mod:`flashsinkhorn.sampling`): :func:`sample_plan` (a target index per
  source point from a result), the primitive :func:`softmax_sample`;
- the float64 references ``*_ref`` (:mod:`flashsinkhorn.reference`);
- second order (:mod:`flashsinkhorn.second_order`): :func:`hvp`, :func:`ot_loss`,
  :func:`implicit_grad`, :func:`inverse_hvp`, Newton-CG / trust region, OTDD.
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
from flashsinkhorn.second_order import *  # noqa: F403
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
    "cost_matrix_ref",
    "softmin_ref",
    "symmetric_update_ref",
    "plan_apply_ref",
    "sinkhorn_ref",
    "samples_loss_ref",
    "sample_plan",
    "softmax_sample",
    "softmax_sample_ref",
    *second_order.__all__,
]
