"""Second order of entropic optimal transport, streamed (a namespace of flashsinkhorn).

Hessian-vector products of the entropic OT loss (and of the debiased Sinkhorn divergence)
with respect to the point positions, computed from streamed plan products only (never the
n x m plan): :func:`hvp`, a loss with double backward (:func:`ot_loss`), implicit
differentiation of the potentials (:func:`implicit_grad`), inverse-HVPs
(:func:`inverse_hvp`), and the OTDD dataset distance (:func:`otdd`,
:func:`otdd_gradient_flow`, :func:`label_distances`), with float64 references. The Hessian
machinery itself is in the core (``flashsinkhorn._hessian``: ``solve(...).value`` and
``SamplesLoss`` use it for double backward). Generic Krylov solvers and optimizers on HVP
closures (Newton-CG, trust region, Lanczos) are in :mod:`flashsinkhorn.second_order.optim`
(not part of the API). See docs/flashsinkhorn-second-order.md.
"""

from flashsinkhorn.second_order.hvp import (
    HvpInfo,
    ImplicitGrads,
    hvp,
    implicit_grad,
    inverse_hvp,
    ot_loss,
)
from flashsinkhorn.second_order.otdd import (
    OTDDResult,
    label_distances,
    otdd,
    otdd_gradient_flow,
    otdd_ref,
)
from flashsinkhorn.second_order.reference import hvp_ref, ot_loss_ref, potentials_ref

__all__ = [
    "HvpInfo",
    "ImplicitGrads",
    "OTDDResult",
    "hvp",
    "hvp_ref",
    "implicit_grad",
    "inverse_hvp",
    "label_distances",
    "ot_loss",
    "ot_loss_ref",
    "otdd",
    "otdd_gradient_flow",
    "otdd_ref",
    "potentials_ref",
]
