"""FlashSGD and FlashSGDW: SGD with momentum, weight splitting and a companded 8-bit
momentum."""

from __future__ import annotations

from .optimizer import FlashOptimizer
from .reference import SGD


class FlashSGD(FlashOptimizer):
    """SGD with momentum, dampening, nesterov and coupled weight decay (torch.optim.SGD).
    Options: ``FlashOptimizer``."""

    _kind = SGD
    _m_key = "momentum_buffer"
    _v_key = None
    _decoupled = False

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        **kw,
    ):
        d = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(params, d, **kw)

    def _check_group(self, group) -> None:
        super()._check_group(group)
        if not group["momentum"] >= 0:
            raise ValueError(f"momentum must be >= 0; got {group['momentum']}")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("nesterov momentum requires a momentum and zero dampening")

    def _has_mom(self, group) -> bool:
        return group["momentum"] != 0

    def _hp(self, group, p):
        return dict(
            self._common_hp(group, p),
            b1=float(group["momentum"]),
            dampening=float(group["dampening"]),
            nesterov=bool(group["nesterov"]),
        )


class FlashSGDW(FlashSGD):
    """SGD with decoupled weight decay: ``p *= 1 - lr * weight_decay`` before the update."""

    _decoupled = True
