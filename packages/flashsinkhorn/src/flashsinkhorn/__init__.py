"""flashsinkhorn: streaming Sinkhorn with Triton kernels.

Public API (see docs/flashsinkhorn.md):

- ``solve(x, y, a=None, b=None, *, eps, ...)`` -> :class:`SinkhornResult`
- ``SamplesLoss(...)``: GeomLoss-compatible loss (p=2).
- ``flashsinkhorn.kernels``: low-level streaming row-LSE update and plan application.
"""

__version__ = "0.1.0"

from flashsinkhorn import kernels
from flashsinkhorn.kernels import plan_apply, softmin
from flashsinkhorn.samples_loss import SamplesLoss, samples_loss_ref, sinkhorn_divergence
from flashsinkhorn.solver import SinkhornResult, cost_matrix_ref, sinkhorn_ref, solve

__all__ = [
    "__version__",
    "kernels",
    "softmin",
    "plan_apply",
    "solve",
    "SinkhornResult",
    "sinkhorn_ref",
    "cost_matrix_ref",
    "SamplesLoss",
    "sinkhorn_divergence",
    "samples_loss_ref",
]

try:  # the second-order subpackage (issue #6); the core must import even if it is broken
    from flashsinkhorn.second_order import *  # noqa: F403
    from flashsinkhorn.second_order import __all__ as _so_all

    __all__ += list(_so_all)
except ModuleNotFoundError as _e:  # pragma: no cover - depends on checkout state
    if _e.name != "flashsinkhorn.second_order":
        raise
except Exception as _e:  # pragma: no cover - depends on checkout state
    import warnings as _warnings

    _warnings.warn(
        f"flashsinkhorn.second_order could not be imported: {_e!r}", RuntimeWarning, stacklevel=2
    )
