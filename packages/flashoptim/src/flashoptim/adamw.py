"""FlashAdamW and FlashAdam: Adam with weight splitting and companded 8-bit states."""

from __future__ import annotations

from .optimizer import FlashOptimizer
from .reference import ADAM


class FlashAdamW(FlashOptimizer):
    """AdamW (decoupled weight decay, torch.optim.AdamW semantics) with weight splitting and
    companded 8-bit states. ~7.1 bytes/param with bf16 params and grads (5.1 with release).
    Options: ``FlashOptimizer``."""

    _kind = ADAM
    _decoupled = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **kw,
    ):
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"betas must be in [0, 1); got {betas}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0; got {eps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), **kw)

    def _hp(self, group, p):
        b1, b2 = group["betas"]
        return dict(self._common_hp(group, p), b1=float(b1), b2=float(b2), eps=float(group["eps"]))


class FlashAdam(FlashAdamW):
    """Adam (L2 weight decay added to the gradient, torch.optim.Adam semantics)."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **kw):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kw)
