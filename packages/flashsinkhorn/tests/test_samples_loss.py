"""SamplesLoss: GeomLoss semantics (values and gradients) for p = 2, against the float64
re-implementation and GeomLoss itself; on the GPU also batching, memory and tf32 accuracy."""

import math

import pytest
import torch
from _helpers import clouds, needs_interpreter

import flashsinkhorn as fs
from flashsinkhorn.reference import samples_loss_ref

CASES = [  # (debias, reach)
    (False, None),
    (True, None),
    (False, 0.7),
    (True, 0.7),
]


@pytest.mark.parametrize("debias,reach", CASES)
def test_matches_dense_geomloss_reimplementation(debias, reach):
    x, y, a, b = clouds(50, 40, 3)
    v = fs.SamplesLoss(blur=0.1, reach=reach, debias=debias)(a, x, b, y)
    ref = samples_loss_ref(a, x, b, y, blur=0.1, reach=reach, debias=debias)
    torch.testing.assert_close(v, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("debias,reach", CASES)
@pytest.mark.parametrize("batch", [None, 3])
def test_matches_geomloss_values_and_gradients(debias, reach, batch):
    geomloss = pytest.importorskip("geomloss")
    x, y, a, b = clouds(50, 40, 3, batch=batch, seed=1)
    outs = []
    for L in (
        geomloss.SamplesLoss(
            "sinkhorn", p=2, blur=0.1, reach=reach, debias=debias, backend="tensorized"
        ),
        fs.SamplesLoss("sinkhorn", p=2, blur=0.1, reach=reach, debias=debias),
    ):
        ts = [t.clone().requires_grad_() for t in (a, x, b, y)]
        v = L(*ts)
        v.sum().backward()
        outs.append([v.detach()] + [t.grad for t in ts])
    for u, w in zip(*outs):
        torch.testing.assert_close(u, w, atol=1e-12, rtol=1e-10)


def test_uniform_weight_call_and_shapes():
    geomloss = pytest.importorskip("geomloss")
    x, y, _, _ = clouds(30, 20, 2, seed=2)
    v = fs.SamplesLoss(blur=0.05)(x, y)
    assert v.dim() == 0
    ref = geomloss.SamplesLoss("sinkhorn", p=2, blur=0.05, backend="tensorized")(x, y)
    torch.testing.assert_close(v, ref, atol=1e-12, rtol=0)
    xb, yb, _, _ = clouds(30, 20, 2, batch=4, seed=2)
    assert fs.SamplesLoss(blur=0.05)(xb, yb).shape == (4,)


def test_potentials_mode_and_debias_zero_on_identical_inputs():
    x, y, a, b = clouds(25, 25, 2, seed=3)
    F, G = fs.SamplesLoss(blur=0.1, potentials=True)(a, x, b, y)
    assert F.shape == (1, 25) and G.shape == (1, 25)  # GeomLoss 0.3.1's shapes (was (25,))
    loss = fs.SamplesLoss(blur=0.1)
    assert abs(float(loss(a, x, a, x))) < 1e-12
    assert float(loss(a, x, b, y)) > 1e-3


def test_gradient_is_a_times_displacement_to_barycentre():
    """Near convergence GeomLoss's gradient is the envelope gradient a_i (x_i - T(x_i))."""
    x, y, a, b = clouds(20, 15, 2, seed=4)
    xs = x.clone().requires_grad_()
    v = fs.SamplesLoss(blur=0.4, debias=False, scaling=0.97)(a, xs, b, y)
    v.backward()
    r = fs.solve(x, y, a, b, eps=0.4**2, cost_scale=0.5, tol=1e-12, max_iter=20000)
    T = r.barycentric_map()
    torch.testing.assert_close(v.detach(), r.value, atol=2e-5, rtol=0)
    torch.testing.assert_close(xs.grad, a[:, None] * (x - T), atol=1e-4, rtol=0)


@needs_interpreter
@pytest.mark.parametrize("debias", [False, True])
def test_triton_backend_matches_float64(debias):
    x, y, a, b = clouds(60, 45, 3, batch=2, seed=5, dtype=torch.float32)
    ts = [t.clone().requires_grad_() for t in (a, x, b, y)]
    v = fs.SamplesLoss(blur=0.1, debias=debias, backend="triton", precision="ieee")(*ts)
    v.sum().backward()
    ts64 = [t.double().requires_grad_() for t in (a, x, b, y)]
    v64 = fs.SamplesLoss(blur=0.1, debias=debias, backend="torch")(*ts64)
    v64.sum().backward()
    torch.testing.assert_close(v.double(), v64.detach(), atol=2e-6, rtol=1e-5)
    for t, t64 in zip(ts, ts64):
        torch.testing.assert_close(t.grad.double(), t64.grad, atol=2e-6, rtol=1e-4)


def test_bad_arguments():
    x, y, a, b = clouds(5, 5, 2)
    with pytest.raises(ValueError, match="p=2"):
        fs.SamplesLoss(p=1)
    with pytest.raises(ValueError, match="sinkhorn"):
        fs.SamplesLoss("energy")
    with pytest.raises(ValueError, match="arguments"):
        fs.SamplesLoss()(x, y, a)
    with pytest.raises(ValueError, match="blur"):
        fs.SamplesLoss(blur=0.0)(x, y)
    with pytest.raises(ValueError, match="nonnegative"):
        fs.SamplesLoss()(-a, x, b, y)


def test_marginal_error_is_reported_and_warned():
    x, y, a, b = clouds(40, 30, 2, seed=6)
    loose = fs.SamplesLoss(blur=0.05, scaling=0.5, debias=False)
    loose(a, x, b, y)
    fine = fs.SamplesLoss(blur=0.3, scaling=0.99, debias=False)
    fine(a, x, b, y)
    assert loose.last_marginal_error.shape == ()
    # a finer schedule (many more iterations at a larger blur) converges the marginals
    assert float(fine.last_marginal_error) < 2e-2 < float(loose.last_marginal_error)
    with pytest.warns(RuntimeWarning, match="marginal error"):
        fs.SamplesLoss(blur=0.05, debias=False, warn_tol=1e-6)(a, x, b, y)


# ---------------------------------------------------------------------------------------
# the bad-input contract (issue 19) and GeomLoss's arguments (issue 20)
# ---------------------------------------------------------------------------------------


def test_unequal_masses_and_zero_sums_raise_like_solve():
    """Balanced OT needs equal masses: the old loss returned 11.7 for masses 20 and 15 and
    NaN (with a warning) for zero-sum weights; now both raise, naming the argument."""
    x, y, a, b = clouds(20, 15, 2, seed=7)
    loss = fs.SamplesLoss()
    with pytest.raises(ValueError, match=r"a.sum\(\) == b.sum\(\).*reach="):
        loss(torch.ones(20, dtype=x.dtype), x, torch.ones(15, dtype=x.dtype), y)
    with pytest.raises(ValueError, match="a must have a positive sum"):
        loss(torch.zeros_like(a), x, b, y)
    with pytest.raises(ValueError, match="b must have a positive sum"):
        fs.SamplesLoss(reach=1.0)(a, x, torch.zeros_like(b), y)
    # unbalanced: unequal masses are the point
    v = fs.SamplesLoss(reach=1.0)(2 * a, x, b, y)
    assert torch.isfinite(v)


def test_infinite_reach_is_balanced():
    """reach=inf gave NaN (inf * 0 in the unbalanced weights); it is the balanced loss."""
    x, y, a, b = clouds(20, 15, 2, seed=8)
    v_inf = fs.SamplesLoss(reach=float("inf"))(a, x, b, y)
    v = fs.SamplesLoss()(a, x, b, y)
    torch.testing.assert_close(v_inf, v, atol=0, rtol=0)


def test_reach_is_geomloss_distance_and_agrees_with_solve():
    """SamplesLoss(reach=r): rho = r^2 for the cost |x - y|^2 / 2, i.e. solve(rho=r^2,
    cost_scale=0.5). With a fine schedule (scaling 0.99: 2e-4 off; 0.999: 2e-5) the loss's
    potentials approach solve's; the other meaning (rho = 2 r^2 here) is 6e-2 off."""
    x, y, a, b = clouds(20, 15, 2, seed=9)
    F, G = fs.SamplesLoss(blur=0.5, reach=0.6, debias=False, scaling=0.99, potentials=True)(
        a, x, b, y
    )
    r = fs.solve(x, y, a, b, eps=0.25, rho=0.36, cost_scale=0.5, tol=1e-12, max_iter=5000)
    torch.testing.assert_close(F[0], r.f, atol=1e-3, rtol=0)
    torch.testing.assert_close(G[0], r.g, atol=1e-3, rtol=0)
    r2 = fs.solve(x, y, a, b, eps=0.25, rho=0.72, cost_scale=0.5, tol=1e-12, max_iter=5000)
    assert float((F[0] - r2.f).abs().max()) > 1e-2


def test_array_like_weights():
    x, y, a, b = clouds(12, 9, 2, seed=10)
    ref = fs.SamplesLoss()(a, x, b, y)
    torch.testing.assert_close(fs.SamplesLoss()(a.tolist(), x, b.numpy(), y), ref, atol=0, rtol=0)
    with pytest.raises(TypeError, match="b must be"):
        fs.SamplesLoss()(a, x, "b", y)


def test_geomloss_arguments_work_or_say_what_to_use(capsys):
    x, y, a, b = clouds(15, 12, 2, seed=11)
    ref = fs.SamplesLoss()(a, x, b, y)
    for backend in ("tensorized", "online"):  # GeomLoss's exact backends
        torch.testing.assert_close(fs.SamplesLoss(backend=backend)(a, x, b, y), ref)
    # GeomLoss's multiscale arguments: the exact backends ignore them (as GeomLoss's do)
    torch.testing.assert_close(fs.SamplesLoss(truncate=3, cluster_scale=0.1)(a, x, b, y), ref)
    with pytest.raises(ValueError, match="truncate"):
        fs.SamplesLoss(truncate=0)
    with pytest.raises(ValueError, match="cluster_scale"):
        fs.SamplesLoss(cluster_scale=-0.1)
    with pytest.raises(ValueError, match="backend"):
        fs.SamplesLoss(backend="keops")
    with pytest.raises(ValueError, match="precision"):
        fs.SamplesLoss(precision="fp8")
    fs.SamplesLoss(verbose=True)(a, x, b, y)
    out = capsys.readouterr().out
    assert "flashsinkhorn.SamplesLoss: eps" in out and "final marginal error" in out


@needs_interpreter
def test_bf16_under_the_interpreter_raises():
    """The interpreter's bf16 dot is wrong: SamplesLoss(precision="bf16") gave NaN."""
    x, y, _, _ = clouds(10, 8, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="bf16"):
        fs.SamplesLoss(precision="bf16", backend="triton")(x, y)


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------


def _uniform_gpu(n, m, d, seed=0, batch=None):
    gen = torch.Generator().manual_seed(seed)
    sh = () if batch is None else (batch,)
    s = 1 / math.sqrt(d)
    x = torch.rand(*sh, n, d, generator=gen) * s
    y = torch.rand(*sh, m, d, generator=gen) * s + 0.5 * s
    return x.cuda(), y.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("debias", [False, True])
@pytest.mark.parametrize("reach", [None, 0.5])
def test_matches_geomloss_on_gpu(debias, reach):
    geomloss = pytest.importorskip("geomloss")
    x, y = _uniform_gpu(4000, 3000, 3, seed=2)
    outs = []
    for L in (
        geomloss.SamplesLoss(
            "sinkhorn", p=2, blur=0.05, reach=reach, debias=debias, backend="tensorized"
        ),
        fs.SamplesLoss(blur=0.05, reach=reach, debias=debias, precision="ieee"),
    ):
        xx, yy = x.clone().requires_grad_(), y.clone().requires_grad_()
        v = L(xx, yy)
        v.backward()
        outs.append((v.detach(), xx.grad, yy.grad))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=2e-6, rtol=1e-4)
    for u, w in zip(outs[1][1:], outs[0][1:]):
        torch.testing.assert_close(u, w, atol=1e-7, rtol=1e-3)


@pytest.mark.gpu
def test_batched_one_launch_equals_loop():
    x, y = _uniform_gpu(2048, 2048, 64, seed=3, batch=8)
    L = fs.SamplesLoss(blur=0.05, debias=False)
    vb = L(x, y)
    vl = torch.stack([L(x[i], y[i]) for i in range(8)])
    torch.testing.assert_close(vb, vl, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
def test_peak_memory_is_linear_at_100k():
    n, d = 100_000, 64
    x, y = _uniform_gpu(n, n, d, seed=5)
    x.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    v = fs.SamplesLoss(blur=0.05, debias=True)(x, y)
    v.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    inputs = 2 * n * d * 4
    assert torch.isfinite(v) and torch.isfinite(x.grad).all()
    assert extra < 4 * inputs, (
        f"peak extra {extra / 2**20:.1f} MiB vs inputs {inputs / 2**20:.1f} MiB"
    )


@pytest.mark.gpu
def test_non_finite_input_rejected_on_gpu():
    x, y = _uniform_gpu(100, 100, 3)
    x[3, 1] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        fs.SamplesLoss()(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 512])
def test_tf32_value_close_to_float64_on_gpu(d):
    # tf32 operands are rounded to nearest once per solve (operands.kernel_operands); before
    # that the H200 measured 2.3e-5 (d = 64) and 3.9e-5 (d = 512) at n = 10k, against a
    # float64 emulation of rounded operands at ~2e-7 (docs/design/flashsinkhorn.md)
    n = 6000
    x, y = _uniform_gpu(n, n, d, seed=7)
    w = torch.full((n,), 1.0 / n, device="cuda", dtype=torch.float64)
    ref = float(
        samples_loss_ref(w, x.double(), w, y.double(), blur=0.05, scaling=0.5, debias=False)
    )
    val = float(fs.SamplesLoss(blur=0.05, scaling=0.5, debias=False, precision="tf32")(x, y))
    assert abs(val - ref) / abs(ref) < 3e-6


@pytest.mark.parametrize("debias", [False, True])
@pytest.mark.parametrize("reach", [(0.8, None), (None, 0.8), (0.5, 1.5)])
def test_semi_unbalanced_reach_pair(debias, reach):
    """reach=(r, None) (semi-unbalanced, as solve(rho=(r, None)) and flash-sinkhorn take it)
    raised an unnamed TypeError; now one KL penalty per side: the value against the float64
    GeomLoss loop with per-side dampings, the potentials against solve(rho=pair) at a fine
    schedule, and a pair (r, r) equal to the number r (value and gradient)."""
    x, y, a, b = clouds(14, 11, 2, seed=21)
    b = 1.3 * b  # unequal masses: fine with an unbalanced side
    loss = fs.SamplesLoss(blur=0.3, reach=reach, debias=debias)
    v = loss(a, x, b, y)
    ref = samples_loss_ref(a, x, b, y, blur=0.3, reach=reach, debias=debias)
    torch.testing.assert_close(v, ref, atol=1e-12, rtol=1e-10)
    if not debias:
        rho = tuple(None if r is None else r * r for r in reach)  # GeomLoss: rho = reach^2
        # the schedule's error falls with 1 - scaling (semi-unbalanced more slowly than
        # balanced: 3e-4 here at 0.999, 2e-3 at 0.99)
        pot = fs.SamplesLoss(blur=0.5, reach=reach, debias=False, scaling=0.999, potentials=True)
        F, G = pot(a, x, b, y)
        r = fs.solve(x, y, a, b, eps=0.25, rho=rho, cost_scale=0.5, tol=1e-12, max_iter=9000)
        torch.testing.assert_close(F[0], r.f, atol=1e-3, rtol=0)
        torch.testing.assert_close(G[0], r.g, atol=1e-3, rtol=0)
    xs, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    one = fs.SamplesLoss(blur=0.3, reach=0.7, debias=debias)(a, xs, b, y)
    pair = fs.SamplesLoss(blur=0.3, reach=(0.7, 0.7), debias=debias)(a, xp, b, y)
    torch.testing.assert_close(pair, one, atol=0, rtol=0)
    one.backward()
    pair.backward()
    torch.testing.assert_close(xp.grad, xs.grad, atol=0, rtol=0)
    with pytest.raises(ValueError, match="reach"):
        fs.SamplesLoss(reach=(1.0, -1.0))(a, x, b, y)


def test_potentials_of_2d_inputs_have_geomloss_shapes():
    """potentials=True on (N, D) inputs returned (N,), (M,); GeomLoss 0.3.1 returns (1, N),
    (1, M) (the drop-in promise); batched inputs give (B, N), (B, M)."""
    x, y, a, b = clouds(9, 7, 2, seed=22)
    F, G = fs.SamplesLoss(blur=0.2, potentials=True)(a, x, b, y)
    assert F.shape == (1, 9) and G.shape == (1, 7)
    xb, yb, ab, bb = clouds(9, 7, 2, batch=3, seed=22)
    F, G = fs.SamplesLoss(blur=0.2, potentials=True)(ab, xb, bb, yb)
    assert F.shape == (3, 9) and G.shape == (3, 7)


def test_column_weights_are_accepted():
    """Weights of shape (N, 1) (flash-sinkhorn and GeomLoss take them) were rejected."""
    x, y, a, b = clouds(9, 7, 2, seed=23)
    ref = fs.SamplesLoss(blur=0.2)(a, x, b, y)
    torch.testing.assert_close(fs.SamplesLoss(blur=0.2)(a[:, None], x, b[:, None], y), ref)
    r = fs.solve(x, y, a[:, None], b[:, None], eps=0.1)
    torch.testing.assert_close(r.value, fs.solve(x, y, a, b, eps=0.1).value)
    xb, yb, ab, bb = clouds(9, 7, 2, batch=2, seed=23)
    refb = fs.SamplesLoss(blur=0.2)(ab, xb, bb, yb)
    torch.testing.assert_close(fs.SamplesLoss(blur=0.2)(ab[..., None], xb, bb[..., None], yb), refb)
    with pytest.raises(ValueError, match=r"a must be \(9,\) or \(9, 1\)"):
        fs.SamplesLoss(blur=0.2)(a[None].expand(2, 9), x, b, y)


def test_empty_batch_names_the_argument():
    """A (0, N, D) batch failed inside torch's max() instead of naming the argument."""
    x, y = torch.rand(0, 5, 2), torch.rand(0, 4, 2)
    with pytest.raises(ValueError, match="at least one problem"):
        fs.SamplesLoss()(x, y)
    with pytest.raises(ValueError, match="at least one problem"):
        fs.solve(x, y, eps=0.1)
