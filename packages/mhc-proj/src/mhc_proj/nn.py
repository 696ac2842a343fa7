"""``torch.nn`` modules of mhc-proj: :class:`HyperConnection` (the mHC layer) and
:class:`BirkhoffProjection` (the projection alone, re-exported)."""

from __future__ import annotations

import math

import torch

from mhc_proj import _checks
from mhc_proj._config import (
    DEEPSEEK_HC_EPS,
    HC_ALPHA_INIT,
    HC_PHI_STD,
    HC_POST_MULT,
    HC_RMS_EPS,
    N_MAX,
    N_MIN,
    SINKHORN_EPS,
    SINKHORN_ITERS,
)
from mhc_proj.birkhoff import BirkhoffProjection
from mhc_proj.layer import HCMaps, hyper_connection, layer_options

__all__ = ["HyperConnection", "BirkhoffProjection", "HCMaps"]


class HyperConnection(torch.nn.Module):
    """Manifold-constrained hyper-connection around a sublayer (mHC, arXiv 2512.24880).

    Wraps ``layer: (..., C) -> (..., C)``; the input is the residual stream x (..., n, C)
    (bfloat16 or float32; the maps are float32) and the output
    ``x_next = H_res x + H_post^T layer(H_pre x)`` of the same shape and dtype, with
    H_pre = sigmoid(.) + pre_eps, H_post = post_mult sigmoid(.) and H_res the exact Birkhoff
    projection (default) or Sinkhorn-k of logits from one GEMM of the RMS-normalised
    flattened stream (:func:`mhc_proj.layer.hyper_connection` has the formulas).

    Args (the names of Liger-Kernel's ``LigerMHC``; ``hc`` is the paper's n):
        layer: the sublayer F (attention, MLP, ...).
        hc: number of streams n, 2..16 (fused kernels up to 8). c: width C of one stream.
        projection: ``"birkhoff"`` (exact, doubly stochastic to 4e-6 in L1) or
            ``"sinkhorn"`` (``tmax`` iterations, 1..10000, with ``sinkhorn_eps`` in [0, 1]).
        formulation: ``"mhc"`` (x_next = P x) or ``"deepseek"`` (DeepSeek-V4 / TileKernels:
            x_next = P^T x, pre_eps = hc_eps = 1e-6); :meth:`from_deepseek` loads such
            weights.
        rms_eps, pre_eps, post_mult: 1e-6, 0.0 (1e-6 for "deepseek"), 2.0.
        alpha_init: initial alpha_pre = alpha_post = alpha_res (the paper: 0.01).
        phi_std: phi is initialised N(0, phi_std^2); the biases b start at 0, so H_pre =
            1/2, H_post = 1 and H_res is close to the uniform matrix at init.

    Parameters: ``phi`` (n C, n^2 + 2n) float32, ``b`` (n^2 + 2n,) float32, ``alpha_pre``,
    ``alpha_post``, ``alpha_res`` (scalars). ``forward(x, return_maps=True)`` also returns
    the call's :class:`HCMaps`. Every option is validated here (a ValueError naming it).
    """

    def __init__(
        self,
        layer: torch.nn.Module,
        *,
        hc: int,
        c: int,
        projection: str = "birkhoff",
        formulation: str = "mhc",
        tmax: int = SINKHORN_ITERS,
        sinkhorn_eps: float = SINKHORN_EPS,
        rms_eps: float = HC_RMS_EPS,
        pre_eps: float | None = None,
        post_mult: float = HC_POST_MULT,
        alpha_init: float = HC_ALPHA_INIT,
        phi_std: float = HC_PHI_STD,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        hc = _checks.integer("hc (the number of streams n)", hc, N_MIN, N_MAX)
        c = _checks.integer("c (the width of one stream)", c, 1, 2**31 - 1)
        opts = layer_options(
            projection=projection,
            formulation=formulation,
            sinkhorn_iters=tmax,
            sinkhorn_eps=sinkhorn_eps,
            rms_eps=rms_eps,
            pre_eps=pre_eps,
            post_mult=post_mult,
            iters_name="tmax",
        )
        alpha_init = _checks.finite("alpha_init", alpha_init)
        phi_std = _checks.positive("phi_std", phi_std, allow_zero=True)
        self.layer = layer
        self.hc, self.c, self.projection, self.formulation = hc, c, projection, formulation
        self.tmax, self.sinkhorn_eps = opts.iters, opts.sk_eps
        self.rms_eps, self.pre_eps, self.post_mult = opts.rms_eps, opts.pre_eps, opts.post_mult
        m = hc * hc + 2 * hc
        f32 = torch.float32
        self.phi = torch.nn.Parameter(torch.randn(hc * c, m, dtype=f32, device=device) * phi_std)
        self.b = torch.nn.Parameter(torch.zeros(m, dtype=f32, device=device))
        self.alpha_pre = torch.nn.Parameter(torch.tensor(alpha_init, device=device))
        self.alpha_post = torch.nn.Parameter(torch.tensor(alpha_init, device=device))
        self.alpha_res = torch.nn.Parameter(torch.tensor(alpha_init, device=device))

    @classmethod
    def from_deepseek(
        cls,
        layer: torch.nn.Module,
        *,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        hc_eps: float = DEEPSEEK_HC_EPS,
        sinkhorn_iters: int = SINKHORN_ITERS,
        rms_eps: float = HC_RMS_EPS,
        post_mult: float = HC_POST_MULT,
        projection: str = "sinkhorn",
    ) -> HyperConnection:
        """The layer of a DeepSeek-V4-style checkpoint (``hc_attn_fn`` / ``hc_attn_base`` /
        ``hc_attn_scale``, or the ``ffn`` ones): ``fn`` (n(n+2), n C), ``base`` (n(n+2),),
        ``scale`` (3,) float32. formulation="deepseek", phi = fn^T, b = base, the alphas =
        scale; hc_eps is both pre_eps and the Sinkhorn eps (V4's config: 1e-6, 20
        iterations). ``projection="sinkhorn"`` reproduces the checkpoint's outputs;
        ``"birkhoff"`` continues it with the exact projection."""
        if not isinstance(fn, torch.Tensor) or fn.dim() != 2:
            raise ValueError(f"fn must be a 2-D tensor (n(n+2), n C); got {fn!r:.60}")
        m, k = fn.shape
        n = math.isqrt(m + 1) - 1
        if n * (n + 2) != m or k % max(n, 1) or not N_MIN <= n <= N_MAX:
            raise ValueError(f"fn must have shape (n(n+2), n C), n in 2..16; got {tuple(fn.shape)}")
        if tuple(base.shape) != (m,) or tuple(scale.reshape(-1).shape) != (3,):
            raise ValueError(
                f"base must have shape ({m},) and scale (3,); "
                f"got {tuple(base.shape)} and {tuple(scale.shape)}"
            )
        hc_eps = _checks.positive("hc_eps", hc_eps, allow_zero=True, hi=1.0)
        mod = cls(
            layer,
            hc=n,
            c=k // n,
            projection=projection,
            formulation="deepseek",
            tmax=sinkhorn_iters,
            sinkhorn_eps=hc_eps,
            rms_eps=rms_eps,
            pre_eps=hc_eps,
            post_mult=post_mult,
            device=fn.device,
        )
        with torch.no_grad():
            mod.phi.copy_(fn.t())
            mod.b.copy_(base)
            for p, s in zip((mod.alpha_pre, mod.alpha_post, mod.alpha_res), scale.reshape(-1)):
                p.copy_(s)
        return mod

    def forward(
        self, x: torch.Tensor, return_maps: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, HCMaps]:
        if (
            not isinstance(x, torch.Tensor)
            or x.dim() < 2
            or tuple(x.shape[-2:]) != (self.hc, self.c)
        ):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (..., {self.hc}, {self.c}); got {got}")
        return hyper_connection(
            x,
            self.layer,
            self.phi,
            self.b,
            self.alpha_pre,
            self.alpha_post,
            self.alpha_res,
            projection=self.projection,
            formulation=self.formulation,
            sinkhorn_iters=self.tmax,
            sinkhorn_eps=self.sinkhorn_eps,
            rms_eps=self.rms_eps,
            pre_eps=self.pre_eps,
            post_mult=self.post_mult,
            return_maps=return_maps,
        )

    def extra_repr(self) -> str:
        extra = f", tmax={self.tmax}" if self.projection == "sinkhorn" else ""
        if self.formulation != "mhc":
            extra += f", formulation={self.formulation!r}"
        return f"hc={self.hc}, c={self.c}, projection={self.projection!r}{extra}"
