"""Every switch of flashoptim in one place: environment variables, read at call time (each
launch asks again; nothing is read at import), and the step kernel's tuning configs.

* ``FLASHOPTIM_NO_AUTOTUNE=1``: the step kernel runs ``DEFAULT_CONFIG`` instead of timing
  ``CONFIGS`` on its first launch per mode (a deterministic first step; CI sets it).
* ``TRITON_INTERPRET=1`` (Triton's own): the kernels run on CPU tensors with numpy (tests);
  flashoptim then uses no inline PTX and no autotuning.

The package README's configuration table lists the same.
"""

from __future__ import annotations

import os

import triton

# (BLOCK, PF, num_warps): tile of BLOCK elements (2,048: 16 per thread at 4 warps), an L2
# prefetch of the next PF tiles. The two the autotuner chose between on the H200
# (2026-12-01, lean tile math): 4 warps for AdamW, Lion and the 2,050-tensor layout,
# 8 warps for SGD. docs/design/flashoptim.md has the configs that lost.
CONFIGS = [(2048, 1, 4), (2048, 1, 8)]
DEFAULT_CONFIG = CONFIGS[0]  # without autotuning (FLASHOPTIM_NO_AUTOTUNE=1, the interpreter)
# FlashMuon's two fused passes: not autotuned (its Newton-Schulz matmuls dominate the step)
MUON_CONFIG = (2048, 1, 4)


def interpret() -> bool:
    """Whether Triton runs kernels under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def autotune(device) -> bool:
    """Autotune the step kernel: on CUDA, unless ``FLASHOPTIM_NO_AUTOTUNE=1`` or the
    interpreter (which cannot run a multi-config autotuner)."""
    return (
        device.type == "cuda"
        and not interpret()
        and os.environ.get("FLASHOPTIM_NO_AUTOTUNE", "0") != "1"
    )


def triton_configs() -> list:
    return [triton.Config(dict(BLOCK=b, PF=pf), num_warps=w, num_stages=1) for b, pf, w in CONFIGS]
