"""flashoptim: torch.optim optimizers with weight splitting and companded 8-bit states.

FlashAdamW keeps ~7.1 bytes per parameter (bf16 weight, int8 correction, int8 momentum,
uint8 variance, group scales, bf16 gradient) instead of 16, in one fused Triton kernel per
bucket of tensors on CUDA and the same arithmetic in plain torch on CPU. ``step_ref`` is the
float64 reference of one step (``flashoptim.reference`` has the quantizers).
"""

from .adamw import FlashAdam, FlashAdamW
from .checkpoint import master_weight
from .lion import FlashLion
from .memory import memory_report
from .optimizer import FlashOptimizer, NonFiniteGradError
from .reference import step_ref
from .release import GradientReleaseHandle, enable_gradient_release
from .sgd import FlashSGD, FlashSGDW

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
    "enable_gradient_release",
    "master_weight",
    "memory_report",
    "step_ref",
]
