"""FlashLion: Lion with weight splitting and a companded 8-bit momentum."""

from __future__ import annotations

from .optimizer import FlashOptimizer
from .reference import LION


class FlashLion(FlashOptimizer):
    """Lion (Chen et al. 2023): ``p -= lr * sign(b1 m + (1-b1) g)``; ``m = b2 m + (1-b2) g``;
    decoupled weight decay ``p *= 1 - lr * wd``. Options: ``FlashOptimizer``."""

    _kind = LION
    _m_key = "exp_avg"
    _v_key = None
    _decoupled = True

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **kw):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), **kw)

    def _check_group(self, group) -> None:
        super()._check_group(group)
        b1, b2 = group["betas"]
        # b1 = 1: the update is sign(m); b2 = 1 would freeze the momentum at its zero start
        if not 0.0 <= b1 <= 1.0 or not 0.0 <= b2 < 1.0:
            raise ValueError(
                f"betas must be (b1, b2) with b1 in [0, 1] and b2 in [0, 1); got {group['betas']}"
            )

    def _hp(self, group, p):
        b1, b2 = group["betas"]
        return dict(self._common_hp(group, p), b1=float(b1), b2=float(b2))
