"""flashsinkhorn: streaming Sinkhorn with Triton kernels.

Public API (see docs/flashsinkhorn.md):

- ``solve(x, y, a=None, b=None, *, eps, ...)`` -> :class:`SinkhornResult`
- ``SamplesLoss(...)``: GeomLoss-compatible loss (p=2).
- ``flashsinkhorn.kernels``: low-level streaming row-LSE update and plan application.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

try:  # the second-order subpackage (issue #6) is optional until it lands
    from flashsinkhorn.second_order import *  # noqa: F403
    from flashsinkhorn.second_order import __all__ as _so_all

    __all__ += list(_so_all)
except ModuleNotFoundError as _e:  # pragma: no cover - depends on checkout state
    if _e.name != "flashsinkhorn.second_order":
        raise
