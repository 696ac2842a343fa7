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
        decoupled_weight_decay: bool | None = None,
        **kw,
    ):
        # torch.optim.Adam's decoupled_weight_decay=True is AdamW; None: the class's own
        if decoupled_weight_decay is not None and bool(decoupled_weight_decay) != self._decoupled:
            if self._decoupled:
                raise ValueError(
                    "FlashAdamW decays decoupled; for L2 decay added to the gradient"
                    " (decoupled_weight_decay=False) use FlashAdam"
                )
            self._decoupled = True
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), **kw)

    def _check_group(self, group) -> None:
        super()._check_group(group)
        b1, b2 = group["betas"]
        if not 0.0 <= b1 < 1.0 or not 0.0 <= b2 < 1.0:
            raise ValueError(f"betas must be in [0, 1); got {group['betas']}")
        if not group["eps"] >= 0:
            raise ValueError(f"eps must be >= 0; got {group['eps']}")

    def _hp(self, group, p):
        b1, b2 = group["betas"]
        return dict(self._common_hp(group, p), b1=float(b1), b2=float(b2), eps=float(group["eps"]))


class FlashAdam(FlashAdamW):
    """Adam (L2 weight decay added to the gradient, torch.optim.Adam semantics)."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **kw):
        """``decoupled_weight_decay=True`` (torch.optim.Adam's keyword) makes it AdamW."""
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kw)
