"""Loads the compiled modules lazily and picks the one for a tensor's device.

Nothing here touches CUDA at import time: ``_cuda`` is imported on first use with a CUDA
tensor, and the stream is read from the caller's current stream at each launch.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import torch

_cuda_module: ModuleType | None = None
_cuda_error: BaseException | None = None
_cpu_module: ModuleType | None = None
# The current CUDA device and raw stream handle without building torch.cuda.Stream / device
# objects (what torch.compile's generated code calls); absent from CPU-only torch builds.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def cpu() -> ModuleType:
    global _cpu_module
    if _cpu_module is None:
        from mhc_proj import _cpu

        _cpu_module = _cpu
    return _cpu_module


def cuda_built() -> bool:
    """True when the CUDA extension ``mhc_proj._cuda`` was built and imports (it may still
    find no GPU: see :func:`cuda_available`)."""
    try:
        cuda()
    except RuntimeError:
        return False
    return True


def build_info() -> str:
    """What the build compiled, one line (written by CMakeLists.txt at build time), e.g.
    "CPU module + CUDA module for 90 (from CUDAARCHS)" or "CPU module only (nvcc found, no
    GPU visible; ...)"; "not recorded" for a source tree without that file."""
    path = Path(__file__).with_name("_build_info.txt")
    try:
        return path.read_text().strip()
    except OSError:
        return "not recorded (no _build_info.txt: not built by CMakeLists.txt)"


def cuda_available() -> bool:
    """True when CUDA tensors can be projected here: the CUDA extension imports, torch sees
    a CUDA device and the extension's own runtime sees one too. Queried at call time (this
    initializes CUDA); False on a machine without a GPU even if the extension was built."""
    if not cuda_built() or not torch.cuda.is_available():
        return False
    try:
        return cuda().device_count() > 0
    except RuntimeError:
        return False


def cuda() -> ModuleType:
    global _cuda_module, _cuda_error
    if _cuda_module is not None:
        return _cuda_module
    if _cuda_error is None:
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
    if x.is_cuda:
        return cuda()
    if x.is_cpu:
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
    index = x.get_device()
    current = _get_device() if _get_device is not None else torch.cuda.current_device()
    if index == current:
        return _NO_GUARD
    return torch.cuda.device(index)


def stream(x: torch.Tensor) -> int:
    """The raw handle of the current stream of ``x``'s GPU (``x`` is a CUDA tensor)."""
    if _raw_stream is not None:
        return _raw_stream(x.get_device())
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
