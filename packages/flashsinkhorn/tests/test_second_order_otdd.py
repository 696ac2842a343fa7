"""OTDD: against the dense float64 computation, symmetry, zero to itself, gradient flow."""

import os

import pytest
import torch

from flashsinkhorn.second_order import otdd, otdd_gradient_flow, otdd_ref

F64 = torch.float64
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _datasets(n1=16, n2=20, d=4, k=2, seed=0, shift=0.3):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(k, d, generator=g, dtype=F64)
    l1 = torch.arange(n1) % k
    l2 = torch.arange(n2) % k
    x1 = centers[l1] + 0.4 * torch.randn(n1, d, generator=g, dtype=F64)
    x2 = centers[l2] + shift + 0.4 * torch.randn(n2, d, generator=g, dtype=F64)
    return x1, l1, x2, l2


EPS = 1.0
KW = dict(eps=EPS, max_iter=600, tol=1e-12, backend="torch")
KWG = dict(KW, label_distance="gaussian")


@pytest.mark.parametrize("method", ["sinkhorn", "gaussian"])
def test_otdd_matches_dense_float64(method):
    x1, l1, x2, l2 = _datasets()
    r = otdd(x1, l1, x2, l2, label_distance=method, **KW)
    ref = otdd_ref(x1, l1, x2, l2, eps=EPS, label_distance=method, n_iter=600)
    assert abs(r.value - ref) < 1e-9 * max(1.0, abs(ref))
    assert r.value > 0.05  # the datasets differ (shifted): a test that can fail


def test_otdd_symmetric_and_zero_to_itself():
    x1, l1, x2, l2 = _datasets(seed=1)
    r12 = otdd(x1, l1, x2, l2, **KWG)
    r21 = otdd(x2, l2, x1, l1, **KWG)
    r11 = otdd(x1, l1, x1, l1, **KWG)
    assert abs(r12.value - r21.value) < 1e-8
    assert abs(r11.value) < 1e-6 * r12.value
    W = r12.label_distances
    assert torch.allclose(W, W.T) and float(W.diag().abs().max()) == 0.0


def test_otdd_labels_matter():
    """Same features, labels scrambled: a positive distance (same labels: about zero)."""
    x1, l1, _, _ = _datasets(seed=2)
    scrambled = l1[torch.randperm(len(l1), generator=torch.Generator().manual_seed(0))]
    assert not torch.equal(scrambled, l1)
    d_same = otdd(x1, l1, x1, l1, **KWG).value
    d_scr = otdd(x1, l1, x1, scrambled, **KWG).value
    d_nolab = otdd(x1, l1, x1, scrambled, label_weight=0.0, **KWG).value
    assert d_scr > 0.05 and abs(d_same) < 1e-6 and abs(d_nolab) < 1e-6


def test_gradient_flow_decreases_otdd():
    x1, l1, x2, l2 = _datasets(seed=3, shift=1.0)
    _, hist = otdd_gradient_flow(
        x1, l1, x2, l2, eps=EPS, steps=4, lr=0.2, max_iter=300, tol=1e-10, backend="torch"
    )
    vals = [v for _, v in hist]
    assert vals[-1] < 0.5 * vals[0]
    assert all(b <= a + 1e-9 for a, b in zip(vals, vals[1:]))


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (set by the nox session)")
def test_otdd_triton_interpreter_matches_torch():
    x1, l1, x2, l2 = _datasets(n1=20, n2=18, d=5)
    kw = dict(eps=EPS, max_iter=40, tol=None, label_distance="gaussian")
    r64 = otdd(x1, l1, x2, l2, backend="torch", **kw)
    r32 = otdd(x1.float(), l1, x2.float(), l2, backend="triton", **kw)
    assert abs(r32.value - r64.value) < 1e-4 * max(1.0, abs(r64.value))


@pytest.mark.gpu
def test_otdd_gpu_matches_torch_float64():
    x1, l1, x2, l2 = _datasets(n1=3000, n2=2500, d=50, k=5)
    kw = dict(eps=1.0, max_iter=200, tol=None, label_distance="gaussian")
    x1, l1, x2, l2 = (t.cuda() for t in (x1, l1, x2, l2))
    r64 = otdd(x1, l1, x2, l2, backend="torch", **kw)  # float64 on the GPU
    r32 = otdd(x1.float(), l1, x2.float(), l2, **kw)
    assert abs(r32.value - r64.value) < 1e-3 * max(1.0, abs(r64.value))
