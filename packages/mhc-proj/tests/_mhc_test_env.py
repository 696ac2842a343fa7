"""Environment variables of the test suite itself, read when a test asks (the package's
own settings are in mhc_proj._config; it reads no environment)."""

import os


def expect_cuda() -> str | None:
    """MHC_PROJ_EXPECT_CUDA: "1" when the build must have produced mhc_proj._cuda, "0" when
    it must not (CI sets it from whether nvcc exists); unset: not checked."""
    return os.environ.get("MHC_PROJ_EXPECT_CUDA")


def accuracy_out() -> str | None:
    """MHC_PROJ_ACCURACY_OUT: a markdown file the accuracy tests append their table to."""
    return os.environ.get("MHC_PROJ_ACCURACY_OUT") or None


def fuzz_examples(default: int) -> int:
    """MHC_PROJ_FUZZ_EXAMPLES: examples per fuzz test (test_fuzz.py; default: a few seconds
    of CPU); set to thousands for a long local run, which also draws fresh random examples
    instead of the fixed ones."""
    value = os.environ.get("MHC_PROJ_FUZZ_EXAMPLES")
    return int(value) if value else default
