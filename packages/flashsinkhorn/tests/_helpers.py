"""Shared helpers for the flashsinkhorn tests."""

import os

import pytest
import torch

from flashsinkhorn.problem import Problem

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

# The Triton kernels run on CPU tensors only under the interpreter.
needs_interpreter = pytest.mark.skipif(
    not (INTERPRET and HAS_TRITON), reason="needs TRITON_INTERPRET=1 set before Python starts"
)

BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def clouds(n, m, d, *, batch=None, dtype=torch.float64, seed=0, shift=0.3):
    gen = torch.Generator().manual_seed(seed)
    sh = () if batch is None else (batch,)
    x = torch.rand(*sh, n, d, generator=gen, dtype=dtype)
    y = torch.rand(*sh, m, d, generator=gen, dtype=dtype) + shift
    a = torch.rand(*sh, n, generator=gen, dtype=dtype) + 0.1
    b = torch.rand(*sh, m, generator=gen, dtype=dtype) + 0.1
    return x, y, a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True)


class PlainProblem(Problem):
    """Dense log-domain passes in plain torch ops with no host read (the dense backend's
    CPU range test is one), for tests that count the loop's own reads; ``want_lse`` is
    not needed by the loop."""

    kind = "plain"

    def _pass(self, pot, logw, eps, damping, cols):
        C = self.dense_cost()
        C = C.transpose(-1, -2) if cols else C
        lse = torch.logsumexp(logw[..., None, :] + (pot[..., None, :] - C) / eps, -1)
        return damping * (-eps) * lse

    def sm_x(self, g, eps, damping=1.0, v=None, want_lse=False, guess=None):
        return self._pass(g, self.logb, eps, damping, False), None, None

    def sm_y(self, f, eps, damping=1.0, v=None, want_lse=False, guess=None):
        return self._pass(f, self.loga, eps, damping, True), None, None
