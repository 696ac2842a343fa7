"""Property tests (hypothesis) of solve() on the torch path: invariances that any correct
entropic OT solver must satisfy."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flashsinkhorn as fs  # noqa: E402

shapes = st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(1, 4), st.integers(0, 2**16))


def _data(n, m, d, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=gen, dtype=torch.float64)
    y = torch.rand(m, d, generator=gen, dtype=torch.float64)
    a = torch.rand(n, generator=gen, dtype=torch.float64) + 0.05
    b = torch.rand(m, generator=gen, dtype=torch.float64) + 0.05
    return x, y, a / a.sum(), b / b.sum()


KW = dict(eps=0.2, tol=1e-11, max_iter=5000, warn=False)


@settings(max_examples=15, deadline=None)
@given(shapes, st.floats(-5, 5))
def test_translation_and_permutation_invariance(shape, shift):
    n, m, d, seed = shape
    x, y, a, b = _data(n, m, d, seed)
    r = fs.solve(x, y, a, b, **KW)
    r_shift = fs.solve(x + shift, y + shift, a, b, **KW)
    assert abs(float(r.value - r_shift.value)) < 1e-9
    p, q = torch.randperm(n), torch.randperm(m)
    r_perm = fs.solve(x[p], y[q], a[p], b[q], **KW)
    assert abs(float(r.value - r_perm.value)) < 1e-9
    torch.testing.assert_close(r_perm.f, r.f[p], atol=1e-8, rtol=0)


@settings(max_examples=15, deadline=None)
@given(shapes)
def test_value_bounds_and_symmetry(shape):
    n, m, d, seed = shape
    x, y, a, b = _data(n, m, d, seed)
    r = fs.solve(x, y, a, b, **KW)
    rt = fs.solve(y, x, b, a, **KW)
    assert abs(float(r.value - rt.value)) < 1e-9  # OT_eps(a, b) = OT_eps(b, a)
    P = r.plan()
    C = fs.cost_matrix_ref(x, y)
    # entropic cost >= linear cost of its plan - eps * H bound: value >= <P, C> (KL >= 0)
    assert float(r.value) >= float((P * C).sum()) - 1e-9
    # ... and <= the cost of the independent coupling (KL(a x b | a x b) = 0)
    assert float(r.value) <= float((a[:, None] * b[None, :] * C).sum()) + 1e-9
