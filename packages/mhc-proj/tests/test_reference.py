"""The float64 oracles of mhc_proj.reference, checked against independent computations.

Every kernel test compares against these functions, so they are pinned here to things that
do not share their code: a long plain Sinkhorn iteration (which converges to the same
projection), central finite differences (for the implicit VJP), and the algebraic form
T = diag(u) exp(A) diag(v) of the solution.
"""

import pytest
import torch

from mhc_proj.reference import (
    birkhoff_project_ref,
    birkhoff_vjp_ref,
    marginal_error,
    sinkhorn_project_ref,
)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_birkhoff_ref_is_doubly_stochastic_diagonal_scaling(n):
    """Row and column sums 1, and log T - A = f_i + g_j (the KL projection's form): every
    mixed second difference of log T - A vanishes."""
    x = torch.randn(33, n, n, generator=_gen(n), dtype=torch.float64) * 3
    t = birkhoff_project_ref(x)
    assert t.dtype == torch.float64 and t.shape == x.shape
    assert float(marginal_error(t).max()) <= 1e-12
    m = t.log() - x
    mixed = m - m[:, :1, :] - m[:, :, :1] + m[:, :1, :1]
    assert float(mixed.abs().max()) <= 1e-9


def test_birkhoff_ref_matches_converged_sinkhorn():
    """Sinkhorn with eps = 0 converges to the same projection (moderate logits, where 3000
    iterations are far past convergence in float64)."""
    x = torch.randn(200, 4, 4, generator=_gen(1), dtype=torch.float64)
    s = sinkhorn_project_ref(x, iters=3000, eps=0.0)
    assert float((birkhoff_project_ref(x) - s).abs().max()) <= 1e-12


def test_birkhoff_ref_invariances_and_bad_entries():
    x = torch.randn(16, 4, 4, generator=_gen(2), dtype=torch.float64) * 5
    r = torch.randn(16, 4, 1, generator=_gen(3), dtype=torch.float64) * 7
    c = torch.randn(16, 1, 4, generator=_gen(4), dtype=torch.float64) * 7
    t = birkhoff_project_ref(x)
    assert float((birkhoff_project_ref(x + r + c) - t).abs().max()) <= 1e-12
    perm = torch.tensor([2, 0, 3, 1])
    tp = birkhoff_project_ref(x[:, perm][:, :, perm])
    assert float((tp - t[:, perm][:, :, perm]).abs().max()) <= 1e-12
    y = x.clone()
    y[3, 1, 2] = float("nan")
    y[5, 0, 0] = float("-inf")
    ty = birkhoff_project_ref(y)
    bad = torch.zeros(16, dtype=torch.bool)
    bad[[3, 5]] = True
    assert torch.isnan(ty[bad]).all()
    assert torch.equal(ty[~bad], birkhoff_project_ref(x[~bad]))
    with pytest.raises(ValueError, match=r"\(\.\.\., n, n\)"):
        birkhoff_project_ref(torch.zeros(2, 3, 4))


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_birkhoff_vjp_ref_matches_finite_differences(n):
    """<G, dT(A)[V]> from birkhoff_vjp_ref against a central difference of the reference."""
    g = _gen(10 + n)
    x = torch.randn(64, n, n, generator=g, dtype=torch.float64) * 2
    gr = torch.randn(64, n, n, generator=g, dtype=torch.float64)
    v = torch.randn(64, n, n, generator=g, dtype=torch.float64)
    da = birkhoff_vjp_ref(birkhoff_project_ref(x), gr)
    h = 1e-5
    fp = (birkhoff_project_ref(x + h * v) * gr).sum((-1, -2))
    fm = (birkhoff_project_ref(x - h * v) * gr).sum((-1, -2))
    fd = (fp - fm) / (2 * h)
    an = (da * v).sum((-1, -2))
    assert float((an - fd).abs().max()) <= 1e-7 * (1 + float(fd.abs().max()))
    # dA sums to zero along rows and columns (T is invariant to row / column constants)
    assert float(da.sum(-1).abs().max()) <= 1e-12 and float(da.sum(-2).abs().max()) <= 1e-12


def test_sinkhorn_ref_convention():
    """softmax + eps, a column step, then iters - 1 (row, column) steps, each dividing by the
    line sum + eps (DeepSeek / TileKernels), written out here for one matrix."""
    x = torch.randn(3, 3, generator=_gen(20), dtype=torch.float64) * 2
    eps, iters = 1e-3, 4
    p = torch.exp(x - x.max(1, keepdim=True).values)
    p = p / p.sum(1, keepdim=True) + eps
    for k in range(2 * iters - 1):
        axis = 0 if k % 2 == 0 else 1
        p = p / (p.sum(axis, keepdim=True) + eps)
    assert float((sinkhorn_project_ref(x, iters=iters, eps=eps) - p).abs().max()) <= 1e-15
    assert sinkhorn_project_ref(x.float()).dtype == torch.float32


def test_marginal_error():
    t = torch.tensor([[[0.5, 0.5], [0.5, 0.5]], [[1.0, 0.5], [0.0, 0.5]]])
    e = marginal_error(t)
    assert e.dtype == torch.float64 and e.shape == (2,)
    assert float(e[0]) == 0.0 and abs(float(e[1]) - 1.0) <= 1e-15  # rows 1.5, 0.5; cols 1, 1
