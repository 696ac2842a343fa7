"""flashoptim: torch.optim optimizers with weight splitting and companded 8-bit states.

FlashAdamW keeps ~7.1 bytes per parameter (bf16 weight, int8 correction, int8 momentum,
uint8 variance, group scales, bf16 gradient) instead of 16, in one fused Triton kernel per
step on CUDA and the same arithmetic in plain torch on CPU.
"""

from ._core import cpu_step, step_ref
from .memory import memory_report
from .optimizers import (
    FlashAdam,
    FlashAdamW,
    FlashLion,
    FlashOptimizer,
    FlashSGD,
    FlashSGDW,
    NonFiniteGradError,
    master_weight,
)
from .release import GradientReleaseHandle, enable_gradient_release

__version__ = "0.1.0"

__all__ = [
    "FlashAdam",
    "FlashAdamW",
    "FlashLion",
    "FlashOptimizer",
    "FlashSGD",
    "FlashSGDW",
    "GradientReleaseHandle",
    "NonFiniteGradError",
    "cpu_step",
    "enable_gradient_release",
    "master_weight",
    "memory_report",
    "step_ref",
]
