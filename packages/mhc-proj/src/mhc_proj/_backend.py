"""Loads the compiled modules lazily and picks the one for a tensor's device.

Nothing here touches CUDA at import time: ``_cuda`` is imported on first use with a CUDA
tensor, and the stream is read from the caller's current stream at each launch.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

_cuda_module: ModuleType | None = None
_cuda_error: BaseException | None = None


def cpu() -> ModuleType:
    from mhc_proj import _cpu

    return _cpu


def cuda_available() -> bool:
    """True when the CUDA extension ``mhc_proj._cuda`` was built and imports."""
    try:
        cuda()
    except RuntimeError:
        return False
    return True


def cuda() -> ModuleType:
    global _cuda_module, _cuda_error
    if _cuda_module is None and _cuda_error is None:
        try:
            _cuda_module = importlib.import_module("mhc_proj._cuda")
        except ImportError as e:  # built without a CUDA compiler or with MHC_PROJ_CUDA=OFF
            _cuda_error = e
    if _cuda_module is None:
        raise RuntimeError(
            "mhc_proj was built without its CUDA module (mhc_proj._cuda): reinstall on a "
            "machine with nvcc and without -DMHC_PROJ_CUDA=OFF, or move the tensor to CPU "
            f"({_cuda_error})"
        )
    return _cuda_module


def for_tensor(x: torch.Tensor) -> ModuleType:
    if x.device.type == "cuda":
        return cuda()
    if x.device.type == "cpu":
        return cpu()
    raise ValueError(f"mhc_proj supports CPU and CUDA tensors; got device {x.device}")


class _NoGuard:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NO_GUARD = _NoGuard()


def on_device(x: torch.Tensor):
    """A device guard for ``x``'s GPU, skipped when it is already current (cheap path)."""
    if x.device.index is None or x.device.index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(x.device)


def stream(x: torch.Tensor) -> int:
    return torch.cuda.current_stream(x.device).cuda_stream


def dtype_code(x: torch.Tensor) -> int:
    return 1 if x.dtype == torch.float64 else 0


def aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its data pointer is 16-byte aligned (the CUDA kernels use 16-byte
    loads), else an aligned copy."""
    return x if x.data_ptr() % 16 == 0 else x.clone()


def smoke(x: torch.Tensor) -> torch.Tensor:
    """Copies a float32 tensor through the compiled module of its device (build check)."""
    x = x.contiguous().to(torch.float32)
    out = torch.empty_like(x)
    mod = for_tensor(x)
    if x.is_cuda:
        mod.smoke_copy(x.data_ptr(), out.data_ptr(), x.numel(), stream(x))
    else:
        mod.smoke_copy(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def choice_code(
    value: str | int | None, env: str, codes: dict[str, int], what: str, default: str = "thread"
) -> int:
    """Kernel selection code: ``value`` if given (a name of ``codes`` or one of its codes),
    else the environment variable ``env`` (read at each call), else ``default``. A bad
    value raises naming ``what`` and the choices."""
    if value is None:
        value = os.environ.get(env) or default
    if isinstance(value, int) and not isinstance(value, bool):
        if value in codes.values():
            return value
    elif value in codes:
        return codes[value]
    raise ValueError(
        f"{what} must be one of {sorted(codes)} (or codes {sorted(codes.values())}); got {value!r}"
    )
