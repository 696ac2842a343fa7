"""Second-order tools for entropic optimal transport, streaming.

Hessian-vector products of the entropic OT loss (and of the debiased Sinkhorn
divergence) with respect to the point positions, computed from streamed plan products
only (never the n x m plan), a loss with double backward, implicit differentiation of
the potentials, inverse-HVPs, the optimizers built on them (Newton-CG, Steihaug trust
region, Lanczos smallest eigenvalue), and the OTDD dataset distance. See
docs/flashsinkhorn-second-order.md. The shuffled-regression example
(``second_order.shuffled_regression``) is a module here but not part of the API; the HVP
benchmark is a case of ``python -m flashsinkhorn.bench``.
"""

from flashsinkhorn.second_order._plan import Plan, solve_potentials
from flashsinkhorn.second_order.hvp import (
    HvpInfo,
    ImplicitGrads,
    hvp,
    implicit_grad,
    inverse_hvp,
    ot_loss,
)
from flashsinkhorn.second_order.optim import (
    CGInfo,
    LanczosResult,
    OptimizeResult,
    conjugate_gradient,
    lanczos_min_eig,
    newton_cg,
    steihaug_cg,
    trust_region,
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
    "CGInfo",
    "HvpInfo",
    "ImplicitGrads",
    "LanczosResult",
    "OTDDResult",
    "OptimizeResult",
    "Plan",
    "conjugate_gradient",
    "hvp",
    "hvp_ref",
    "implicit_grad",
    "inverse_hvp",
    "label_distances",
    "lanczos_min_eig",
    "newton_cg",
    "ot_loss",
    "ot_loss_ref",
    "otdd",
    "otdd_gradient_flow",
    "otdd_ref",
    "potentials_ref",
    "solve_potentials",
    "steihaug_cg",
    "trust_region",
]
