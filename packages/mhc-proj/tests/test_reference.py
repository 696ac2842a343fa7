"""The float64 oracles of mhc_proj.reference, checked against independent computations.

Every kernel test compares against these functions, so they are pinned here to things that
do not share their code: a long plain Sinkhorn iteration (which converges to the same
projection), central finite differences (for the implicit VJP), and the algebraic form
T = diag(u) exp(A) diag(v) of the solution.
"""

import pytest
import torch

from mhc_proj import birkhoff_project
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
    y[4, 2, 1] = float("inf")
    y[5, 0, 0] = float("-inf")  # a structural zero (#29: the package's contract)
    y[6, 1] = float("-inf")  # a row of -inf: no doubly stochastic matrix
    ty = birkhoff_project_ref(y)
    bad = torch.zeros(16, dtype=torch.bool)
    bad[[3, 4, 6]] = True
    assert torch.isnan(ty[bad]).all()
    assert ty[5, 0, 0] == 0 and float(marginal_error(ty[5])) <= 1e-13
    keep = torch.ones(16, dtype=torch.bool)
    keep[[3, 4, 5, 6]] = False
    assert torch.equal(ty[keep], birkhoff_project_ref(x[keep]))
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


@pytest.mark.parametrize("rate", [0.25, 0.5, 0.75])
def test_birkhoff_ref_masked_logits(rate):
    """#29: -1e30-masked logits (finite: masked entries carry the mass the support needs)
    missed by up to 4.0 in marginal error (9 / 126 / 136 of 500 matrices at these rates);
    now doubly stochastic to 1e-12 and equal to the package's float64 kernel. -inf masks:
    structural zeros, NaN exactly where the kernel reports infeasible."""
    g = _gen(int(rate * 100))
    x = torch.randn(150, 4, 4, generator=g, dtype=torch.float64)
    mask = torch.rand(150, 4, 4, generator=g, dtype=torch.float64) < rate
    t = birkhoff_project_ref(torch.where(mask, -1e30, x))
    assert float(marginal_error(t).max()) <= 1e-12
    ours = birkhoff_project(torch.where(mask, -1e30, x))
    assert float((t - ours).abs().max()) <= 1e-10
    small = torch.tensor([[0.0, -1e30, -1e30], [0.0, -1e30, -1e30], [0.5, 0.0, 0.0]])
    assert float(marginal_error(birkhoff_project_ref(small))) <= 1e-12  # was 4.0 / 2.0
    xi = torch.where(mask, -float("inf"), x)
    ti = birkhoff_project_ref(xi)
    ours, info = birkhoff_project(xi, return_info=True)
    nan = torch.isnan(ti).flatten(1).any(1)
    assert torch.equal(nan, info.infeasible) and torch.isnan(ti[nan]).all()
    assert bool((ti[~nan][mask[~nan]] == 0).all())
    assert float(marginal_error(ti[~nan]).max()) <= 1e-12
    assert float((ti[~nan] - ours[~nan]).abs().max()) <= 1e-10
