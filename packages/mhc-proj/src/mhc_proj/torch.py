"""The API of the mHC paper's own ``mhc_proj`` package (0.1.0: the same distribution and
import name), as thin aliases of this package's projection, so code written for it runs
here. ``mhc_proj.torch`` holds its low-level functions; ``mhc_proj.MHCProjectionN4`` /
``MHCProjectionN8`` its modules.

Differences (README, "Not the paper's mhc_proj"): any leading dims, CPU and CUDA, float32
(and bf16 / fp16 / float64) inputs; ``tol`` is this package's L1 marginal tolerance (the
float32 solve reaches ~1e-6 on most matrices and re-solves the rest in float64, so the
paper's default 1e-6 is met, at some extra cost over this package's default 4e-6). The
paper's Sinkhorn modules (``MHCSinkhornN4``: exp, then row / column normalisation) are not
aliased: their iteration differs from DeepSeek's Sinkhorn-k (:func:`sinkhorn_project`).
"""

from __future__ import annotations

import torch

from mhc_proj import _checks
from mhc_proj.birkhoff import birkhoff_bwd, birkhoff_project

__all__ = [
    "birkhoff_proj_n4",
    "birkhoff_proj_n4_backward",
    "birkhoff_proj_n8",
    "birkhoff_proj_n8_backward",
    "MHCProjectionN4",
    "MHCProjectionN8",
]

PAPER_TOL = 1e-6  # the paper package's default tol


def _square(name: str, x: object, n: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor; got {type(x).__name__}")
    if x.dim() < 2 or tuple(x.shape[-2:]) != (n, n):
        raise ValueError(f"{name} must end with dimensions {n} x {n}; got {tuple(x.shape)}")
    return x


def _forward(r: torch.Tensor, tol: float, n: int) -> dict[str, torch.Tensor]:
    _square("R", r, n)
    tol = _checks.positive("tol", tol)
    with torch.no_grad():
        return {"T": birkhoff_project(r, tol=tol)}


def _backward(g: torch.Tensor, t: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    _square("G", g, n)
    _square("T", t, n)
    if g.shape != t.shape:
        raise ValueError(
            f"G and T must have the same shape; got {tuple(g.shape)} and {tuple(t.shape)}"
        )
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    tt = t.detach().to(dtype).reshape(-1, n, n).contiguous()
    gg = g.detach().to(dtype).reshape(-1, n, n).contiguous()
    return {"D": birkhoff_bwd(tt, gg).reshape(t.shape).to(t.dtype)}


def birkhoff_proj_n4(R: torch.Tensor, tol: float = PAPER_TOL) -> dict[str, torch.Tensor]:  # noqa: N803
    """{"T": the exact projection of R (..., 4, 4)} (no autograd graph), as the paper's."""
    return _forward(R, tol, 4)


def birkhoff_proj_n4_backward(G: torch.Tensor, T: torch.Tensor) -> dict[str, torch.Tensor]:  # noqa: N803
    """{"D": the implicit VJP at T (..., 4, 4) of the output gradient G}, as the paper's."""
    return _backward(G, T, 4)


def birkhoff_proj_n8(R: torch.Tensor, tol: float = PAPER_TOL) -> dict[str, torch.Tensor]:  # noqa: N803
    """{"T": the exact projection of R (..., 8, 8)}."""
    return _forward(R, tol, 8)


def birkhoff_proj_n8_backward(G: torch.Tensor, T: torch.Tensor) -> dict[str, torch.Tensor]:  # noqa: N803
    """{"D": the implicit VJP at T (..., 8, 8) of G}."""
    return _backward(G, T, 8)


class MHCProjectionN4(torch.nn.Module):
    """The paper package's module: ``MHCProjectionN4(tol=1e-6)(x)`` projects x (..., 4, 4)
    (differentiable: implicit backward), here :func:`mhc_proj.birkhoff_project`."""

    n = 4

    def __init__(self, tol: float = PAPER_TOL) -> None:
        super().__init__()
        self.tol = _checks.positive("tol", tol)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return birkhoff_project(_square("x", x, self.n), tol=self.tol)

    def extra_repr(self) -> str:
        return f"tol={self.tol}"


class MHCProjectionN8(MHCProjectionN4):
    """``MHCProjectionN8(tol=1e-6)(x)`` for x (..., 8, 8)."""

    n = 8
