"""mhc-proj: exact Birkhoff projection for manifold-constrained hyper-connections.

- :func:`birkhoff_project` — exact doubly stochastic projection (Newton forward,
  implicit backward), CPU (C++) and CUDA kernels, a ``torch.library`` custom op.
- :func:`sinkhorn_project` — the Sinkhorn-k compatibility projection (fused).
- :class:`mhc_proj.nn.HyperConnection` / :func:`hyper_connection` — the mHC layer around
  a sublayer, with fused pre / post kernels around the projection.
- :class:`HyperConnectionStack` / :func:`hyper_connection_stack` — a sequence of those
  layers with each boundary (post of one, norm + GEMM + projection + pre of the next)
  fused, and a batch-invariant ``deterministic`` mode.
- :mod:`mhc_proj.reference` — float64 torch oracles.
- :mod:`mhc_proj.torch`, :class:`MHCProjectionN4` / :class:`MHCProjectionN8` — the API of
  the mHC paper's own ``mhc_proj`` 0.1.0 package, as thin aliases.
"""

from mhc_proj._backend import build_info, cuda_available, cuda_built
from mhc_proj.birkhoff import BirkhoffProjection, ProjectionInfo, birkhoff_project
from mhc_proj.boundary import HyperConnectionStack, hyper_connection_stack
from mhc_proj.layer import HCMaps, hyper_connection
from mhc_proj.nn import HyperConnection
from mhc_proj.reference import (
    birkhoff_project_ref,
    birkhoff_vjp_ref,
    hyper_connection_ref,
    hyper_connection_stack_ref,
    marginal_error,
    sinkhorn_project_ref,
)
from mhc_proj.sinkhorn import sinkhorn_project
from mhc_proj.torch import MHCProjectionN4, MHCProjectionN8

__version__ = "0.1.0"

__all__ = [
    "BirkhoffProjection",
    "HCMaps",
    "HyperConnection",
    "HyperConnectionStack",
    "MHCProjectionN4",
    "MHCProjectionN8",
    "ProjectionInfo",
    "birkhoff_project",
    "birkhoff_project_ref",
    "birkhoff_vjp_ref",
    "build_info",
    "cuda_available",
    "cuda_built",
    "hyper_connection",
    "hyper_connection_ref",
    "hyper_connection_stack",
    "hyper_connection_stack_ref",
    "marginal_error",
    "sinkhorn_project",
    "sinkhorn_project_ref",
]
