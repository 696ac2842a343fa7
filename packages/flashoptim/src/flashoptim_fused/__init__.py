"""flashoptim_fused (distribution ``flashoptim-fused``): torch.optim optimizers with weight
splitting and companded 8-bit states.

FlashAdamW keeps ~7.1 bytes per parameter (bf16 weight, int8 correction, int8 momentum,
uint8 variance, group scales, bf16 gradient) instead of 16, in one fused Triton kernel per
bucket of tensors on CUDA and the same arithmetic in plain torch on CPU; FlashMuon (Muon for
matrices, AdamW for the rest) 6.08 per matrix parameter at 512 x 2048. ``step_ref`` /
``muon_step_ref`` are the float64 references of one step (``flashoptim_fused.reference``
has the quantizers).
"""

from .adamw import FlashAdam, FlashAdamW
from .checkpoint import master_weight
from .lion import FlashLion
from .memory import memory_report
from .muon import FlashMuon
from .optimizer import FlashOptimizer, NonFiniteGradError
from .reference import muon_step_ref, step_ref
from .release import GradientReleaseHandle, enable_gradient_release
from .sgd import FlashSGD, FlashSGDW

__version__ = "0.2.0"

__all__ = [
    "FlashAdam",
    "FlashAdamW",
    "FlashLion",
    "FlashMuon",
    "FlashOptimizer",
    "FlashSGD",
    "FlashSGDW",
    "GradientReleaseHandle",
    "NonFiniteGradError",
    "enable_gradient_release",
    "master_weight",
    "memory_report",
    "muon_step_ref",
    "step_ref",
]
