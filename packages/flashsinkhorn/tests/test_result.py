"""solve()'s result: POT / GeomLoss OTResult names, the lazy plan and the dense-plan guard,
against the dense float64 plan and POT."""

import numpy as np
import pytest
import torch
from _helpers import clouds

import flashsinkhorn as fs
from flashsinkhorn.reference import cost_matrix_ref

OTRESULT_NAMES = [
    "value",
    "plan",
    "lazy_plan",
    "potentials",
    "potential_a",
    "potential_b",
    "marginals",
    "marginal_a",
    "marginal_b",
]


def _solved(batch=None):
    x, y, a, b = clouds(12, 9, 2, batch=batch, seed=20)
    return x, y, a, b, fs.solve(x, y, a, b, eps=0.1, tol=1e-12, max_iter=5000)


def test_otresult_names_match_pot():
    ot = pytest.importorskip("ot")
    x, y, a, b, r = _solved()
    for name in OTRESULT_NAMES:
        assert hasattr(ot.utils.OTResult, name) and hasattr(r, name), name
    C = cost_matrix_ref(x, y)
    res = ot.solve(C.numpy(), a.numpy(), b.numpy(), reg=0.1, max_iter=5000, tol=1e-13)
    np.testing.assert_allclose(r.plan.numpy(), res.plan, atol=1e-10)
    assert abs(float(r.value) - float(res.value)) < 1e-9
    np.testing.assert_allclose(r.marginal_a.numpy(), res.marginal_a, atol=1e-10)
    np.testing.assert_allclose(r.marginal_b.numpy(), res.marginal_b, atol=1e-10)
    assert r.potentials[0] is r.f and r.potential_b is r.g


@pytest.mark.parametrize("batch", [None, 2])
def test_lazy_plan_against_the_dense_float64_plan(batch):
    x, y, a, b, r = _solved(batch)
    C = cost_matrix_ref(x, y)
    P = (
        a[..., :, None]
        * b[..., None, :]
        * torch.exp((r.f[..., :, None] + r.g[..., None, :] - C) / 0.1)
    )
    torch.testing.assert_close(r.plan, P, atol=1e-12, rtol=1e-10)
    lp = r.lazy_plan
    assert lp.shape == tuple(P.shape)
    V = torch.randn(*P.shape[:-2], 9, 3, dtype=torch.float64)
    U = torch.randn(*P.shape[:-2], 12, dtype=torch.float64)
    torch.testing.assert_close(lp @ V, P @ V)
    torch.testing.assert_close(lp.apply_transpose(U), (P.transpose(-1, -2) @ U[..., None])[..., 0])
    torch.testing.assert_close(lp.dense(), P)
    rows, cols = lp.marginals
    torch.testing.assert_close(rows, P.sum(-1), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(cols, P.sum(-2), atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match="V must have 9 rows"):
        lp @ torch.randn(*P.shape[:-2], 8, 3, dtype=torch.float64)


def test_dense_plan_size_guard(monkeypatch):
    import flashsinkhorn.result as result

    *_, r = _solved()
    with pytest.raises(ValueError, match="108 entries > max_entries=50.*lazy_plan"):
        r.dense_plan(max_entries=50)
    with pytest.raises(ValueError, match="max_entries"):
        r.lazy_plan.dense(max_entries=50)
    monkeypatch.setattr(result, "PLAN_MAX_ENTRIES", 100)
    with pytest.raises(ValueError, match="max_entries=100"):
        _ = r.plan
    assert r.dense_plan(max_entries=None).shape == (12, 9)
