"""Plan sampling (sampling.py): the Gumbel-max kernel and the torch path against the float64
reference draw by draw, and the draws against the dense plan's row distributions (a
chi-square test at a fixed seed: deterministic, not flaky), on fresh random problems.

CPU tests run the kernel under the interpreter (exact log2); the GPU test checks the
special-function log2 path against the same reference.
"""

import math

import pytest
import torch
from _helpers import needs_interpreter

import flashsinkhorn as fs
from flashsinkhorn.reference import LOG2E
from flashsinkhorn.sampling import _dense_scores, _keys, _log2_noise

scipy_stats = pytest.importorskip("scipy.stats")

SHAPES = [(1, 1, 1, 1), (2, 37, 53, 3), (1, 70, 130, 16), (1, 19, 23, 200), (3, 65, 129, 5)]


def _inputs(B, N, M, D, seed=0, dtype=torch.float32, labels=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, D, generator=gen, dtype=dtype) / D**0.5
    y = torch.randn(B, M, D, generator=gen, dtype=dtype) / D**0.5
    g = 0.1 * torch.randn(B, M, generator=gen, dtype=dtype)
    logb = torch.log(torch.rand(B, M, generator=gen, dtype=dtype) + 0.05)
    if M > 2:
        logb[0, M // 2] = float("-inf")  # a zero column weight is never drawn
    cy = (y * y).sum(-1)
    lab = None
    if labels:
        lx = torch.randint(0, 3, (B, N), generator=gen)
        ly = torch.randint(0, 4, (B, M), generator=gen)
        lab = (lx, ly, torch.rand(3, 4, generator=gen, dtype=dtype), 0.7)
    return x, y, g, logb, cy, lab


def _perturbed(x, y, g, logb, cy, lab, eps, seed, row_offset=0, col_offset=0):
    """The float64 perturbed scores ``log2e S - log2 E`` (B, N, M) the reference maximizes."""
    d = torch.float64
    lab64 = None if lab is None else (lab[0], lab[1], lab[2].to(d), lab[3])
    S = _dense_scores(*(t.to(d) for t in (x, y, g, logb, cy)), eps, 2.0, lab64)
    rk, ck = _keys(S.shape[0], S.shape[1], S.shape[2], seed, row_offset, col_offset, x.device)
    return LOG2E * S + _log2_noise(rk, ck)


def _assert_same_draws(got, ref, val, *, col_offset=0, gap=1e-4, max_frac=0.0):
    """``got`` equals the reference draw ``ref`` except in near ties: where they differ, the
    two columns' perturbed scores ``val`` (float64) are within ``gap`` (log2 units), and at
    most ``max_frac`` of the rows differ."""
    diff = got != ref
    if diff.any():
        b, i = diff.nonzero(as_tuple=True)
        v_ref = val[b, i, ref[b, i] - col_offset]
        v_got = val[b, i, got[b, i] - col_offset]
        assert ((v_ref - v_got).abs() < gap).all(), (v_ref - v_got).abs().max()
    assert diff.float().mean() <= max_frac, f"{int(diff.sum())} of {diff.numel()} rows differ"


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("shape", SHAPES)
def test_draws_match_float64_reference(backend, shape):
    """Same seed, same problem: the kernel (interpreter, ieee dot) and the float32 torch
    path draw the reference's column in every row (ties only within float rounding);
    labels, a zero column weight and global offsets included."""
    B, N, M, D = shape
    x, y, g, logb, cy, lab = _inputs(*shape, seed=sum(shape), labels=True)
    kw = dict(eps=0.3, c2=2.0, seed=987654321987, labels=lab, row_offset=11, col_offset=5)
    ref = fs.softmax_sample_ref(x, y, g, logb, cy, **kw)
    got = fs.softmax_sample(x, y, g, logb, cy, backend=backend, precision="ieee", **kw)
    assert got.dtype == torch.int64 and got.shape == (B, N)
    val = _perturbed(x, y, g, logb, cy, lab, 0.3, kw["seed"], 11, 5)
    _assert_same_draws(got, ref, val, col_offset=5)
    if M > 2:
        assert not (got[0] == 5 + M // 2).any()  # the zero-weight column
    # float64 on the torch path is the reference itself
    lab64 = (lab[0], lab[1], lab[2].double(), lab[3])
    got64 = fs.softmax_sample(*(t.double() for t in (x, y, g, logb, cy)), backend="torch",
                              **{**kw, "labels": lab64})  # fmt: skip
    assert torch.equal(got64, ref)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_draws_reproducible_and_independent_of_chunking(backend):
    """A draw is a function of (seed, global row, global column): the same seed repeats it,
    another seed changes most rows, a different tile config does not change it, and
    sampling two column chunks with their offsets and keeping the larger score gives the
    same draws as the whole row (what the sharded pass does)."""
    x, y, g, logb, cy, _ = _inputs(1, 90, 150, 4, seed=3)
    kw = dict(eps=0.5, c2=2.0, backend=backend, precision="ieee")
    a = fs.softmax_sample(x, y, g, logb, cy, seed=7, **kw)
    assert torch.equal(a, fs.softmax_sample(x, y, g, logb, cy, seed=7, **kw))
    assert (a != fs.softmax_sample(x, y, g, logb, cy, seed=8, **kw)).float().mean() > 0.8
    if backend == "triton":
        other = fs.softmax_sample(x, y, g, logb, cy, seed=7, config=(32, 16, 4, 1), **kw)
        assert torch.equal(a, other)
    c = 61
    j1, s1 = fs.softmax_sample(x, y[:, :c], g[:, :c], logb[:, :c], cy[:, :c], seed=7,
                               return_score=True, **kw)  # fmt: skip
    j2, s2 = fs.softmax_sample(x, y[:, c:], g[:, c:], logb[:, c:], cy[:, c:], seed=7,
                               col_offset=c, return_score=True, **kw)  # fmt: skip
    assert torch.equal(torch.where(s2 > s1, j2, j1), a)
    # rows: the second half of the rows with its row offset
    b = fs.softmax_sample(x[:, 40:], y, g, logb, cy, seed=7, row_offset=40, **kw)
    assert torch.equal(b, a[:, 40:])


def _replicated_problem(n_distinct, reps, m, d, seed):
    """Rows: ``n_distinct`` points, each repeated ``reps`` times (each copy an independent
    draw from the same row distribution), m columns with random weights and potential."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.rand(1, n_distinct, d, generator=gen)
    x = base.repeat_interleave(reps, dim=1)
    y = torch.rand(1, m, d, generator=gen)
    g = 0.05 * torch.randn(1, m, generator=gen)
    logb = torch.log(torch.rand(1, m, generator=gen) + 0.2)
    return base, x, y, g, logb, (y * y).sum(-1)


def _chi2_pvalues(idx, probs, n_distinct, reps):
    """Per distinct row: the chi-square p-value of its ``reps`` draws against ``probs``."""
    out = []
    for r in range(n_distinct):
        counts = torch.bincount(idx[0, r * reps : (r + 1) * reps], minlength=probs.shape[-1])
        expected = reps * probs[r]
        stat = float(((counts.double() - expected) ** 2 / expected).sum())
        out.append(float(scipy_stats.chi2.sf(stat, probs.shape[-1] - 1)))
    return out


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_draws_follow_the_row_distributions_chi_square(backend):
    """5 distinct rows x 3000 copies, 7 columns: each row's 3000 draws against its exact
    softmax probabilities (float64, no hash involved): every chi-square p-value > 1e-3
    (fixed seed: deterministic). The same counts against the distribution at 1.3 x eps fail
    that criterion (some p < 1e-6): the test can fail."""
    n_distinct, reps, m, eps = 5, 3000, 7, 0.15
    base, x, y, g, logb, cy = _replicated_problem(n_distinct, reps, m, 2, seed=11)
    idx = fs.softmax_sample(x, y, g, logb, cy, eps=eps, c2=2.0, seed=2024, backend=backend,
                            precision="ieee")  # fmt: skip

    def probs(e):
        S = _dense_scores(base.double(), y.double(), g.double(), logb.double(), cy.double(),
                          e, 2.0, None)  # fmt: skip
        return torch.softmax(S[0], dim=-1)

    p = _chi2_pvalues(idx, probs(eps), n_distinct, reps)
    assert min(p) > 1e-3, p
    assert min(_chi2_pvalues(idx, probs(1.3 * eps), n_distinct, reps)) < 1e-6


def test_hash_uniforms_are_uniform_and_rows_independent():
    """The noise's uniforms W over a 256 x 256 grid of (row, column): a KS test against
    U(0, 1), and no correlation between neighbouring rows or columns (|r| < 0.02)."""
    rk, ck = _keys(1, 256, 256, 5, 0, 0, torch.device("cpu"))
    e = torch.exp2(-_log2_noise(rk, ck))[0]  # E = -ln(1 - W) ~ Exp(1)
    w = -torch.expm1(-e)
    assert scipy_stats.kstest(w.flatten().numpy(), "uniform").pvalue > 1e-3
    for a, b in ((w[1:], w[:-1]), (w[:, 1:], w[:, :-1])):
        r = torch.corrcoef(torch.stack((a.flatten(), b.flatten())))[0, 1]
        assert abs(float(r)) < 0.02


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_sample_plan_follows_the_solved_plan(backend):
    """``sample_plan`` on a solve result (weights, unbalanced) draws from the rows of
    ``result.plan``: chi-square per distinct row, and draw by draw equal to the reference
    on the result's potentials."""
    n_distinct, reps, m = 4, 2500, 6
    base, x, y, _, _, _ = _replicated_problem(n_distinct, reps, m, 2, seed=5)
    gen = torch.Generator().manual_seed(1)
    b = torch.rand(m, generator=gen) + 0.3
    r = fs.solve(x[0], y[0], None, b / b.sum(), eps=0.1, rho=2.0, backend=backend,
                 precision="ieee", max_iter=300, tol=1e-6)  # fmt: skip
    idx = fs.sample_plan(r, seed=99)
    assert idx.shape == (n_distinct * reps,) and idx.dtype == torch.int64
    P = r.plan.double()
    rows = P[::reps] / P[::reps].sum(-1, keepdim=True)
    assert min(_chi2_pvalues(idx[None], rows, n_distinct, reps)) > 1e-3
    p = r._prob
    ref = fs.softmax_sample_ref(p.Xk, p.Yk, r._g, p.logb, p.cy, eps=r.eps, c2=p.c2, seed=99)
    val = _perturbed(p.Xk, p.Yk, r._g, p.logb, p.cy, None, r.eps, 99)
    _assert_same_draws(idx[None], ref, val)


def test_bad_arguments_raise():
    x, y, g, logb, cy, _ = _inputs(1, 5, 6, 2)
    kw = dict(eps=0.1, c2=2.0)
    with pytest.raises(ValueError, match="seed"):
        fs.softmax_sample(x, y, g, logb, cy, seed=-1, **kw)
    with pytest.raises(ValueError, match="seed"):
        fs.softmax_sample(x, y, g, logb, cy, seed=1.5, **kw)
    with pytest.raises(ValueError, match="g must be"):
        fs.softmax_sample(x, y, g[:, :3], logb, cy, seed=1, **kw)
    with pytest.raises(ValueError, match="eps"):
        fs.softmax_sample(x, y, g, logb, cy, seed=1, eps=0.0, c2=2.0)


@pytest.mark.gpu
def test_gpu_draws_and_distribution():
    """CUDA (the special-function log2, tf32 scores): draws equal the float64 reference on
    the kernel's operands except near ties (at most 0.1 % of rows, gap < 1e-3 log2 units),
    and the chi-square test of the row distributions passes."""
    dev = torch.device("cuda")
    x, y, g, logb, cy, lab = (t.to(dev) if torch.is_tensor(t) else t
                              for t in _inputs(2, 3000, 2000, 64, seed=4))  # fmt: skip
    kw = dict(eps=0.05, c2=2.0, seed=31337)
    got = fs.softmax_sample(x, y, g, logb, cy, **kw)
    xr = fs.operands.round_to_tf32(x.contiguous())  # the scores the tf32 dot computes exactly
    yr = fs.operands.round_to_tf32(y.contiguous())
    ref = fs.softmax_sample_ref(xr, yr, g, logb, cy, **kw)
    val = _perturbed(xr, yr, g, logb, cy, None, 0.05, kw["seed"])
    _assert_same_draws(got, ref, val, gap=1e-3, max_frac=1e-3)
    n_distinct, reps, m, eps = 5, 3000, 7, 0.15
    base, x, y, g, logb, cy = (t.to(dev) for t in _replicated_problem(n_distinct, reps, m, 2, 11))
    idx = fs.softmax_sample(x, y, g, logb, cy, eps=eps, c2=2.0, seed=2024, precision="ieee")
    S = _dense_scores(base.double(), y.double(), g.double(), logb.double(), cy.double(), eps,
                      2.0, None)  # fmt: skip
    assert min(_chi2_pvalues(idx.cpu(), torch.softmax(S[0], -1).cpu(), n_distinct, reps)) > 1e-3
    assert math.isfinite(float(got.float().mean()))
