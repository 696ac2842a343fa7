import os

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device (skipped automatically without one)"
    )
    config.addinivalue_line("markers", "slow: long-running test")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CUDA is not available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Environment variables of the test suite itself (the package's own switches are in
# mhc_proj._config), read when a test asks.
def expect_cuda() -> str | None:
    """MHC_PROJ_EXPECT_CUDA: "1" when the build must have produced mhc_proj._cuda, "0" when
    it must not (CI sets it from whether nvcc exists); unset: not checked."""
    return os.environ.get("MHC_PROJ_EXPECT_CUDA")


def accuracy_out() -> str | None:
    """MHC_PROJ_ACCURACY_OUT: a markdown file the accuracy tests append their table to."""
    return os.environ.get("MHC_PROJ_ACCURACY_OUT") or None
