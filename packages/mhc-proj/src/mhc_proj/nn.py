"""``torch.nn`` modules of mhc-proj: :class:`HyperConnection` (the mHC layer) and
:class:`BirkhoffProjection` (the projection alone, re-exported)."""

from __future__ import annotations

import torch

from mhc_proj._config import (
    HC_ALPHA_INIT,
    HC_PHI_STD,
    HC_POST_MULT,
    HC_PRE_EPS,
    HC_RMS_EPS,
    N_MAX,
    N_MIN,
    SINKHORN_EPS,
    SINKHORN_ITERS,
)
from mhc_proj.birkhoff import BirkhoffProjection
from mhc_proj.layer import PROJECTIONS, HCMaps, hyper_connection

__all__ = ["HyperConnection", "BirkhoffProjection", "HCMaps"]


class HyperConnection(torch.nn.Module):
    """Manifold-constrained hyper-connection around a sublayer (mHC, arXiv 2512.24880).

    Wraps ``layer: (..., C) -> (..., C)``; the input is the residual stream x (..., n, C)
    (bfloat16 or float32; the maps are float32) and the output
    ``x_next = H_res x + H_post^T layer(H_pre x)`` of the same shape and dtype, with
    H_pre = sigmoid(.), H_post = 2 sigmoid(.) and H_res the exact Birkhoff projection
    (default) or Sinkhorn-k of logits from one GEMM of the RMS-normalised flattened
    stream (:func:`mhc_proj.layer.hyper_connection` has the formulas).

    Args (the names of Liger-Kernel's ``LigerMHC``; ``hc`` is the paper's n):
        layer: the sublayer F (attention, MLP, ...).
        hc: number of streams n, 2..8. c: width C of one stream.
        projection: ``"birkhoff"`` (exact, doubly stochastic to 4e-6 in L1) or
            ``"sinkhorn"`` (``tmax`` iterations with ``sinkhorn_eps``, DeepSeek-V4).
        rms_eps, pre_eps, post_mult: 1e-6, 0.0, 2.0.
        alpha_init: initial alpha_pre = alpha_post = alpha_res (the paper: 0.01).
        phi_std: phi is initialised N(0, phi_std^2); the biases b start at 0, so H_pre =
            1/2, H_post = 1 and H_res is close to the uniform matrix at init.

    Parameters: ``phi`` (n C, n^2 + 2n) float32, ``b`` (n^2 + 2n,) float32, ``alpha_pre``,
    ``alpha_post``, ``alpha_res`` (scalars). ``forward(x, return_maps=True)`` also returns
    the call's :class:`HCMaps`.
    """

    def __init__(
        self,
        layer: torch.nn.Module,
        *,
        hc: int,
        c: int,
        projection: str = "birkhoff",
        tmax: int = SINKHORN_ITERS,
        sinkhorn_eps: float = SINKHORN_EPS,
        rms_eps: float = HC_RMS_EPS,
        pre_eps: float = HC_PRE_EPS,
        post_mult: float = HC_POST_MULT,
        alpha_init: float = HC_ALPHA_INIT,
        phi_std: float = HC_PHI_STD,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not N_MIN <= int(hc) <= N_MAX:
            raise ValueError(f"hc (the number of streams n) must be in 2..8; got {hc}")
        if int(c) < 1:
            raise ValueError(f"c (the width of one stream) must be >= 1; got {c}")
        if projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}; got {projection!r}")
        self.layer = layer
        self.hc, self.c, self.projection = int(hc), int(c), projection
        self.tmax, self.sinkhorn_eps = int(tmax), float(sinkhorn_eps)
        self.rms_eps, self.pre_eps = float(rms_eps), float(pre_eps)
        self.post_mult = float(post_mult)
        m = self.hc * self.hc + 2 * self.hc
        f32 = torch.float32
        self.phi = torch.nn.Parameter(
            torch.randn(self.hc * self.c, m, dtype=f32, device=device) * phi_std
        )
        self.b = torch.nn.Parameter(torch.zeros(m, dtype=f32, device=device))
        self.alpha_pre = torch.nn.Parameter(torch.tensor(float(alpha_init), device=device))
        self.alpha_post = torch.nn.Parameter(torch.tensor(float(alpha_init), device=device))
        self.alpha_res = torch.nn.Parameter(torch.tensor(float(alpha_init), device=device))

    def forward(
        self, x: torch.Tensor, return_maps: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, HCMaps]:
        if x.dim() < 2 or tuple(x.shape[-2:]) != (self.hc, self.c):
            raise ValueError(f"x must have shape (..., {self.hc}, {self.c}); got {tuple(x.shape)}")
        return hyper_connection(
            x, self.layer, self.phi, self.b, self.alpha_pre, self.alpha_post, self.alpha_res,
            projection=self.projection, sinkhorn_iters=self.tmax,
            sinkhorn_eps=self.sinkhorn_eps, rms_eps=self.rms_eps, pre_eps=self.pre_eps,
            post_mult=self.post_mult, return_maps=return_maps,
        )  # fmt: skip

    def extra_repr(self) -> str:
        extra = f", tmax={self.tmax}" if self.projection == "sinkhorn" else ""
        return f"hc={self.hc}, c={self.c}, projection={self.projection!r}{extra}"
