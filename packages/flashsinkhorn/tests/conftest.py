import os

# One kernel config in tests (set before flashsinkhorn is imported): correctness does not
# depend on the tile config, and autotuning every variant would dominate a GPU test run.
# The benchmark CLI exercises the autotuned path.
os.environ.setdefault("FLASHSINKHORN_NO_AUTOTUNE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped automatically)")
    config.addinivalue_line("markers", "slow: long-running test")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
