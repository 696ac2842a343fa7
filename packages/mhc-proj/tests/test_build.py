"""The build contract: which compiled modules exist, and that each runs end to end."""

import importlib
import importlib.util
import os

import pytest
import torch

from mhc_proj import _backend


def test_cpu_module_smoke():
    from mhc_proj import _cpu

    assert _cpu.device_count() == 0
    x = torch.randn(1000)
    assert torch.equal(_backend.smoke(x), x)


def test_cuda_module_present_exactly_when_expected():
    expect = os.environ.get("MHC_PROJ_EXPECT_CUDA")
    if expect is None:
        pytest.skip("MHC_PROJ_EXPECT_CUDA is not set")
    found = importlib.util.find_spec("mhc_proj._cuda") is not None
    if found:
        importlib.import_module("mhc_proj._cuda")  # importable, not just present
    assert found == (expect == "1")


def test_cuda_missing_gives_clear_error(monkeypatch):
    monkeypatch.setattr(_backend, "_cuda_module", None)
    monkeypatch.setattr(_backend, "_cuda_error", ImportError("no module named mhc_proj._cuda"))
    with pytest.raises(RuntimeError, match="built without its CUDA module"):
        _backend.cuda()
    assert not _backend.cuda_available()


@pytest.mark.gpu
def test_cuda_module_smoke():
    cuda = _backend.cuda()
    assert cuda.device_count() == torch.cuda.device_count()
    x = torch.randn(12345, device="cuda")
    assert torch.equal(_backend.smoke(x), x)
