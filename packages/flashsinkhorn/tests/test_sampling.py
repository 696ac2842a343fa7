"""Plan sampling (sampling.py): the two-level draw (a Gumbel-max over blocks of 128 columns
on their LogSumExps, then over the winning block's columns) on the Triton kernels and the
torch path against the float64 reference draw by draw; the draws against the dense plan's
row distributions (chi-square tests at fixed seeds: deterministic, not flaky), on fresh
random problems; column chunks merged into the same draws as whole rows.

CPU tests run the kernels under the interpreter; the GPU tests check the CUDA kernels (and
on sm_90 the Gluon first level, its shift and its fallback) against the same reference.
"""

import math

import pytest
import torch
from _helpers import needs_interpreter

import flashsinkhorn as fs
from flashsinkhorn import sampling as S
from flashsinkhorn.reference import LN2, LOG2E

scipy_stats = pytest.importorskip("scipy.stats")

SHAPES = [(1, 1, 1, 1), (2, 37, 53, 3), (1, 70, 300, 16), (1, 19, 23, 200), (3, 65, 129, 5)]
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


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


def _margins(x, y, g, logb, cy, lab, eps, seed, row_offset=0, col_offset=0):
    """(B, N) float64: per row the smaller of the two levels' gaps between the best and the
    second-best perturbed value (log2 units) of the reference draw: a draw that differs from
    the reference only where this is within the scores' rounding is a near tie."""
    d = torch.float64
    lab64 = None if lab is None else (lab[0], lab[1], lab[2].to(d), lab[3])
    s2 = LOG2E * S._dense_scores(*(t.to(d) for t in (x, y, g, logb, cy)), eps, 2.0, lab64)
    B, N, M = s2.shape
    rk, ck, bk = S._keys(B, N, M, seed, row_offset, col_offset, x.device)
    off, n_tiles, _ = S._layout(M, col_offset)
    t2 = S._tiled(s2, off, n_tiles)
    val = torch.logsumexp(t2 * LN2, -1) / LN2 + S._log2_noise(rk[..., None], bk)
    top = val.topk(min(2, n_tiles), -1)
    gap1 = top.values[..., 0] - top.values[..., -1]
    if n_tiles == 1:
        gap1 = torch.full_like(gap1, math.inf)
    best = top.indices[..., 0]
    cols = best[..., None] * S.BLOCK - off + torch.arange(S.BLOCK)
    ok = (cols >= 0) & (cols < M)
    cc = cols.clamp(0, M - 1)
    v = torch.gather(s2, 2, cc) + S._log2_noise(rk[..., None], ck[cc])
    v = torch.where(ok, v, torch.full_like(v, -math.inf)).topk(2, -1).values
    gap2 = v[..., 0] - v[..., 1]
    return torch.minimum(gap1, torch.nan_to_num(gap2, posinf=math.inf))


def _assert_same_draws(got, ref, margin, *, gap=1e-4, max_frac=0.0):
    """``got`` equals the reference draw ``ref`` except in near ties (``margin`` below
    ``gap`` log2 units), at most ``max_frac`` of the rows."""
    diff = got != ref
    if diff.any():
        assert (margin[diff] < gap).all(), margin[diff].max()
    assert diff.float().mean() <= max_frac, f"{int(diff.sum())} of {diff.numel()} rows differ"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_draws_match_float64_reference(backend, shape):
    """Same seed, same problem: the kernels (interpreter, ieee dot) and the float32 torch
    path draw the reference's column in every row (ties only within float rounding);
    labels, a zero column weight and global offsets (a first block cut short) included."""
    B, N, M, D = shape
    x, y, g, logb, cy, lab = _inputs(*shape, seed=sum(shape), labels=True)
    kw = dict(eps=0.3, c2=2.0, seed=987654321987, labels=lab, row_offset=11, col_offset=5)
    ref = fs.softmax_sample_ref(x, y, g, logb, cy, **kw)
    got = fs.softmax_sample(x, y, g, logb, cy, backend=backend, precision="ieee", **kw)
    assert got.dtype == torch.int64 and got.shape == (B, N)
    assert ((got >= 5) & (got < 5 + M)).all()
    margin = _margins(x, y, g, logb, cy, lab, 0.3, kw["seed"], 11, 5)
    _assert_same_draws(got, ref, margin)
    if M > 2:
        assert not (got[0] == 5 + M // 2).any()  # the zero-weight column
    # float64 on the torch path is the reference itself
    lab64 = (lab[0], lab[1], lab[2].double(), lab[3])
    got64 = fs.softmax_sample(
        *(t.double() for t in (x, y, g, logb, cy)), backend="torch", **{**kw, "labels": lab64}
    )
    assert torch.equal(got64, ref)


def _chunked(x, y, g, logb, cy, cuts, backend, seed=7, **kw):
    """Draws over the column chunks ``cuts`` merged by DrawMerger."""
    B, N, M = x.shape[0], x.shape[1], y.shape[1]
    merger = S.DrawMerger(S.row_keys(B, N, seed, 0, x.device), seed)
    for c0, c1 in zip(cuts[:-1], cuts[1:]):
        merger.add(
            S.sample_chunk(
                x,
                y[:, c0:c1],
                g[:, c0:c1],
                logb[:, c0:c1],
                cy[:, c0:c1],
                seed=seed,
                backend=backend,
                col_offset=c0,
                first_complete=c0 % S.BLOCK == 0,
                last_complete=c1 % S.BLOCK == 0 or c1 == M,
                **kw,
            )
        )
    return merger.result()[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_draws_reproducible_and_independent_of_chunking(backend):
    """A draw is a function of (seed, global row, global column): the same seed repeats it,
    another seed changes most rows, a different tile config does not change it, and column
    chunks (cutting blocks, one chunk inside a block, chunks of one column) merged by
    DrawMerger give the whole rows' draws (what the sharded pass does)."""
    x, y, g, logb, cy, _ = _inputs(1, 90, 300, 4, seed=3)
    kw = dict(eps=0.5, c2=2.0, backend=backend, precision="ieee")
    a = fs.softmax_sample(x, y, g, logb, cy, seed=7, **kw)
    assert torch.equal(a, fs.softmax_sample(x, y, g, logb, cy, seed=7, **kw))
    assert (a != fs.softmax_sample(x, y, g, logb, cy, seed=8, **kw)).float().mean() > 0.8
    if backend == "triton":
        other = fs.softmax_sample(x, y, g, logb, cy, seed=7, config=(32, 16, 4, 1), **kw)
        assert torch.equal(a, other)
    for cuts in ([0, 61, 91, 130, 131, 300], [0, 128, 256, 300], [0, 127, 129, 300]):
        assert torch.equal(_chunked(x, y, g, logb, cy, cuts, **kw), a), cuts
    # rows: the second half of the rows with its row offset
    b = fs.softmax_sample(x[:, 40:], y, g, logb, cy, seed=7, row_offset=40, **kw)
    assert torch.equal(b, a[:, 40:])
    # chunks out of order are refused
    merger = S.DrawMerger(S.row_keys(1, 90, 7, 0, x.device), 7)
    merger.add(
        S.sample_chunk(
            x, y[:, :61], g[:, :61], logb[:, :61], cy[:, :61], seed=7, last_complete=False, **kw
        )
    )
    with pytest.raises(ValueError, match="out of order"):
        merger.add(
            S.sample_chunk(
                x,
                y[:, 200:],
                g[:, 200:],
                logb[:, 200:],
                cy[:, 200:],
                seed=7,
                col_offset=200,
                first_complete=False,
                **kw,
            )
        )


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


def _chi2_pvalues(idx, probs, n_distinct, reps, bins=None):
    """Per distinct row: the chi-square p-value of its ``reps`` draws against ``probs``,
    over the columns or over ``bins`` (a (M,) int tensor of bin indices)."""
    out = []
    for r in range(n_distinct):
        draws = idx[0, r * reps : (r + 1) * reps]
        p = probs[r]
        if bins is not None:
            draws = bins[draws]
            p = torch.zeros(int(bins.max()) + 1, dtype=p.dtype).index_add_(0, bins, p)
        counts = torch.bincount(draws, minlength=p.shape[-1])
        expected = reps * p
        stat = float(((counts.double() - expected) ** 2 / expected).sum())
        out.append(float(scipy_stats.chi2.sf(stat, p.shape[-1] - 1)))
    return out


def _row_probs(base, y, g, logb, cy, e):
    s = S._dense_scores(
        base.double(), y.double(), g.double(), logb.double(), cy.double(), e, 2.0, None
    )
    return torch.softmax(s[0], dim=-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_draws_follow_the_row_distributions_chi_square(backend):
    """5 distinct rows x 3000 copies, 7 columns (one block: the in-block level): each row's
    3000 draws against its exact softmax probabilities (float64, no hash involved): every
    chi-square p-value > 1e-3 (fixed seed: deterministic). The same counts against the
    distribution at 1.3 x eps fail that criterion (some p < 1e-6): the test can fail."""
    n_distinct, reps, m, eps = 5, 3000, 7, 0.15
    base, x, y, g, logb, cy = _replicated_problem(n_distinct, reps, m, 2, seed=11)
    idx = fs.softmax_sample(
        x, y, g, logb, cy, eps=eps, c2=2.0, seed=2024, backend=backend, precision="ieee"
    )
    p = _chi2_pvalues(idx, _row_probs(base, y, g, logb, cy, eps), n_distinct, reps)
    assert min(p) > 1e-3, p
    wrong = _row_probs(base, y, g, logb, cy, 1.3 * eps)
    assert min(_chi2_pvalues(idx, wrong, n_distinct, reps)) < 1e-6


def test_draws_across_blocks_chi_square():
    """The block level: 4 distinct rows x 4000 copies over 700 columns (6 blocks, the mass
    spread over all of them), counted in 14 bins of 50 columns that straddle the blocks:
    p-values > 1e-3; the counts against the distribution at 1.3 x eps fail (p < 1e-6).
    The torch path (the interpreter would take minutes; the Triton kernels' draws equal
    the reference's above, and the GPU test runs this on the CUDA kernels)."""
    backend = "torch"
    n_distinct, reps, m, eps = 4, 4000, 700, 0.1
    base, x, y, g, logb, cy = _replicated_problem(n_distinct, reps, m, 2, seed=5)
    idx = fs.softmax_sample(
        x, y, g, logb, cy, eps=eps, c2=2.0, seed=99, backend=backend, precision="ieee"
    )
    probs = _row_probs(base, y, g, logb, cy, eps)
    blocks = probs.view(n_distinct, -1)[:, : 5 * S.BLOCK].reshape(n_distinct, 5, -1).sum(-1)
    assert (blocks > 0.08).all()  # every block matters
    bins = torch.arange(m) // 50
    assert min(_chi2_pvalues(idx, probs, n_distinct, reps, bins)) > 1e-3
    wrong = _row_probs(base, y, g, logb, cy, 1.3 * eps)
    assert min(_chi2_pvalues(idx, wrong, n_distinct, reps, bins)) < 1e-6


def test_hash_uniforms_are_uniform_and_rows_independent():
    """The noise's uniforms W over a 256 x 256 grid of (row, column) and of (row, block): a
    KS test against U(0, 1), and no correlation between neighbouring rows or columns
    (|r| < 0.02), nor between a column's and a block's noise of the same index."""
    rk, ck, _ = S._keys(1, 256, 256, 5, 0, 0, torch.device("cpu"))
    _, _, bk = S._keys(1, 256, 256 * S.BLOCK, 5, 0, 0, torch.device("cpu"))
    ws = []
    for keys in (ck, bk):
        e = torch.exp2(-S._log2_noise(rk[..., None], keys))[0]  # E = -ln(1 - W) ~ Exp(1)
        w = -torch.expm1(-e)
        assert scipy_stats.kstest(w.flatten().numpy(), "uniform").pvalue > 1e-3
        for a, b in ((w[1:], w[:-1]), (w[:, 1:], w[:, :-1])):
            r = torch.corrcoef(torch.stack((a.flatten(), b.flatten())))[0, 1]
            assert abs(float(r)) < 0.02
        ws.append(w)
    r = torch.corrcoef(torch.stack((ws[0].flatten(), ws[1].flatten())))[0, 1]
    assert abs(float(r)) < 0.02


def test_sample_plan_follows_the_solved_plan():
    """``sample_plan`` on a solve result (weights, unbalanced) draws from the rows of
    ``result.plan``: chi-square per distinct row, and draw by draw equal to the reference
    on the result's potentials (the torch backend keeps the 10k-row solve fast)."""
    backend = "torch"
    n_distinct, reps, m = 4, 2500, 6
    base, x, y, _, _, _ = _replicated_problem(n_distinct, reps, m, 2, seed=5)
    gen = torch.Generator().manual_seed(1)
    b = torch.rand(m, generator=gen) + 0.3
    r = fs.solve(
        x[0],
        y[0],
        None,
        b / b.sum(),
        eps=0.1,
        rho=2.0,
        backend=backend,
        precision="ieee",
        max_iter=300,
        tol=1e-6,
    )
    idx = fs.sample_plan(r, seed=99)
    assert idx.shape == (n_distinct * reps,) and idx.dtype == torch.int64
    P = r.plan.double()
    rows = P[::reps] / P[::reps].sum(-1, keepdim=True)
    assert min(_chi2_pvalues(idx[None], rows, n_distinct, reps)) > 1e-3
    p = r._prob
    ref = fs.softmax_sample_ref(p.Xk, p.Yk, r._g, p.logb, p.cy, eps=r.eps, c2=p.c2, seed=99)
    margin = _margins(p.Xk, p.Yk, r._g, p.logb, p.cy, None, r.eps, 99)
    _assert_same_draws(idx[None], ref, margin)


def test_bad_arguments_raise():
    x, y, g, logb, cy, _ = _inputs(1, 5, 6, 2)
    kw = dict(eps=0.1, c2=2.0)
    with pytest.raises(ValueError, match="seed"):
        fs.softmax_sample(x, y, g, logb, cy, seed=-1, **kw)
    with pytest.raises(ValueError, match="seed"):
        fs.softmax_sample(x, y, g, logb, cy, seed=1.5, **kw)
    with pytest.raises(ValueError, match="g must be"):
        fs.softmax_sample(x, y, g[:, :3], logb, cy, seed=1, **kw)
    with pytest.raises(ValueError, match="guess must be"):
        fs.softmax_sample(x, y, g, logb, cy, seed=1, guess=torch.zeros(1, 4), **kw)
    with pytest.raises(ValueError, match="eps"):
        fs.softmax_sample(x, y, g, logb, cy, seed=1, eps=0.0, c2=2.0)
    with pytest.raises(ValueError, match="precision"):
        fs.softmax_sample(x, y, g, logb, cy, seed=1, precision="fp8", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_gpu_draws_and_distribution(precision):
    """CUDA (tf32 / bf16 scores; on sm_90 the Gluon first level): draws equal the float64
    reference on the kernel's operands except near ties (at most 0.1 % of rows), with a
    good guess, a hostile one (the fallback launch) and none; column chunks merge into the
    same draws; the chi-square tests of both levels pass."""
    dev = torch.device("cuda")
    x, y, g, logb, cy, _ = (
        t.to(dev) if torch.is_tensor(t) else t for t in _inputs(2, 3000, 2000, 64, seed=4)
    )
    kw = dict(eps=0.05, c2=2.0, seed=31337, precision=precision)
    if precision == "tf32":  # the tf32 dot's products are exact on rounded operands
        xr, yr = (
            fs.operands.round_to_tf32(x.contiguous()),
            fs.operands.round_to_tf32(y.contiguous()),
        )
    else:
        xr, yr = x.bfloat16(), y.bfloat16()
    ref = fs.softmax_sample_ref(xr, yr, g, logb, cy, eps=0.05, c2=2.0, seed=31337)
    margin = _margins(xr.float(), yr.float(), g, logb, cy, None, 0.05, 31337)
    s = S._dense_scores(
        xr.double(), yr.double(), g.double(), logb.double(), cy.double(), 0.05, 2.0, None
    )
    lse = -0.05 * torch.logsumexp(s, -1)
    bad = lse.float().clone()
    bad[:, ::3] += 1e4 * 0.05
    bad[0, 7] = float("nan")
    for guess in (None, lse.float(), bad):
        got = fs.softmax_sample(xr, yr, g, logb, cy, guess=guess, **kw)
        _assert_same_draws(got, ref, margin, gap=1e-3, max_frac=1e-3)
    cuts = [0, 300, 1000, 1001, 2000]
    got = _chunked(
        xr, yr, g, logb, cy, cuts, "auto", seed=31337, eps=0.05, c2=2.0, precision=precision
    )
    _assert_same_draws(got, ref, margin, gap=1e-3, max_frac=1e-3)
    # 7 columns: the Triton kernels (ieee); 700 columns, 16000 rows: 11M scores, on sm_90
    # the Gluon first level (tf32, operands rounded: exact products)
    for n_distinct, reps, m, eps, bins, prec in (
        (5, 3000, 7, 0.15, None, "ieee"),
        (4, 4000, 700, 0.1, 50, "tf32"),
    ):
        base, x, y, g, logb, cy = (
            t.to(dev) for t in _replicated_problem(n_distinct, reps, m, 2, 11)
        )
        base, x, y = (fs.operands.round_to_tf32(t.contiguous()) for t in (base, x, y))
        idx = fs.softmax_sample(x, y, g, logb, cy, eps=eps, c2=2.0, seed=2024, precision=prec)
        probs = _row_probs(base, y, g, logb, cy, eps).cpu()
        b = None if bins is None else torch.arange(m) // bins
        assert min(_chi2_pvalues(idx.cpu(), probs, n_distinct, reps, b)) > 1e-3
