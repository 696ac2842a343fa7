"""The build contract: which compiled modules exist, what they export, and that each runs
end to end (mhc_proj._backend loads them)."""

import importlib
import importlib.util

import pytest
import torch
from _mhc_test_env import expect_cuda

from mhc_proj import _backend

# What the shipped modules export: the kernels the Python layer calls, nothing else (no
# test emulators, no cost counters, no kernel variants).
CPU_EXPORTS = {
    "birkhoff_fwd",
    "birkhoff_bwd",
    "sinkhorn_fwd",
    "sinkhorn_bwd",
    "smoke_copy",
    "device_count",
}
# the hyper-connection layer's kernels (csrc/hc_cpu.h, csrc/cuda_hc.cu)
CPU_EXPORTS |= {"hc_pre_fwd", "hc_post_fwd", "hc_post_bwd", "hc_pre_bwd_reduce", "hc_pre_bwd"}
# the fused layer boundary's (csrc/boundary_cpu.cpp, csrc/cuda_boundary.cu)
CPU_EXPORTS |= {"bnd_fwd_main", "bnd_bwd_main", "bnd_sum_splits"}
CUDA_EXPORTS = CPU_EXPORTS


def _exports(mod):
    return {k for k in dir(mod) if not k.startswith("_")}


def test_cpu_module_smoke_and_exports():
    from mhc_proj import _cpu

    assert _cpu.device_count() == 0
    x = torch.randn(1000)
    assert torch.equal(_backend.smoke(x), x)
    assert _exports(_cpu) == CPU_EXPORTS


def test_cuda_module_present_exactly_when_expected():
    expect = expect_cuda()
    if expect is None:
        pytest.skip("MHC_PROJ_EXPECT_CUDA is not set")
    found = importlib.util.find_spec("mhc_proj._cuda") is not None
    if found:
        mod = importlib.import_module("mhc_proj._cuda")  # importable, not just present
        assert _exports(mod) == CUDA_EXPORTS
    assert found == (expect == "1")


def test_cuda_missing_gives_clear_error(monkeypatch):
    monkeypatch.setattr(_backend, "_cuda_module", None)
    monkeypatch.setattr(_backend, "_cuda_error", ImportError("no module named mhc_proj._cuda"))
    with pytest.raises(RuntimeError, match="built without its CUDA module"):
        _backend.cuda()
    assert not _backend.cuda_available()


def test_cuda_available_means_a_usable_device(monkeypatch):
    """cuda_available() was True on a machine without a GPU (it meant "the module imported",
    #19); now it needs the module, torch's CUDA and a device the module's runtime sees.
    cuda_built() answers the build question alone."""
    import mhc_proj

    class FakeModule:
        def __init__(self, count):
            self.count = count

        def device_count(self):
            return self.count

    monkeypatch.setattr(_backend, "_cuda_module", FakeModule(1))
    assert mhc_proj.cuda_built()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not mhc_proj.cuda_available()  # built, but torch sees no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert mhc_proj.cuda_available()
    monkeypatch.setattr(_backend, "_cuda_module", FakeModule(0))
    assert not mhc_proj.cuda_available()  # the module's runtime sees no device


def test_cuda_available_on_this_machine():
    import mhc_proj

    found = importlib.util.find_spec("mhc_proj._cuda") is not None
    assert mhc_proj.cuda_built() == found
    assert mhc_proj.cuda_available() == (found and torch.cuda.is_available())


def test_other_devices_rejected():
    with pytest.raises(ValueError, match="CPU and CUDA tensors; got device meta"):
        _backend.for_tensor(torch.empty(2, 4, 4, device="meta"))


@pytest.mark.gpu
def test_cuda_module_smoke():
    cuda = _backend.cuda()
    assert cuda.device_count() == torch.cuda.device_count()
    x = torch.randn(12345, device="cuda")
    assert torch.equal(_backend.smoke(x), x)


def test_build_info_says_what_was_built():
    """#29: the build states in one line what it compiled (CMake prints it; the package
    keeps it): the CPU module always, the CUDA module with its architectures exactly when
    mhc_proj._cuda exists."""
    import mhc_proj

    info = mhc_proj.build_info()
    if info.startswith("not recorded"):
        pytest.skip("a source tree without _build_info.txt (not installed by CMakeLists.txt)")
    found = importlib.util.find_spec("mhc_proj._cuda") is not None
    assert info.startswith("CPU module")
    assert ("CUDA module for" in info) == found
