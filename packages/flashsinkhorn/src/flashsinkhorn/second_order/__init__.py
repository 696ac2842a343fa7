"""Second-order tools for entropic optimal transport, streaming.

Hessian-vector products of the entropic OT loss (and of the debiased Sinkhorn
divergence) with respect to the point positions, computed from plan applications only
(never the n x m plan), implicit differentiation of the potentials, inverse-HVPs, and
the optimizers built on them (Newton-CG, Steihaug trust region, Lanczos smallest
eigenvalue), plus the OTDD dataset distance.
"""

from flashsinkhorn.second_order.core import (
    bench_hvp,
    conjugate_gradient,
    hvp,
    hvp_ref,
    implicit_grad,
    inverse_hvp,
    lanczos_min_eig,
    newton_cg,
    ot_loss_ref,
    otdd,
    otdd_ref,
    trust_region,
)

__all__ = [
    "bench_hvp",
    "conjugate_gradient",
    "hvp",
    "hvp_ref",
    "implicit_grad",
    "inverse_hvp",
    "lanczos_min_eig",
    "newton_cg",
    "ot_loss_ref",
    "otdd",
    "otdd_ref",
    "trust_region",
]
