"""solve(): potentials, values, gradients and plan applications against independent oracles
(float64 dense Sinkhorn, POT, a closed form, finite differences), invariances (hypothesis),
and the same on the GPU."""

import math
import warnings

import numpy as np
import pytest
import torch
from _helpers import BACKENDS, clouds, needs_interpreter
from hypothesis import given, settings
from hypothesis import strategies as st

import flashsinkhorn as fs
from flashsinkhorn.operands import centered_sqnorm, common_center
from flashsinkhorn.reference import cost_matrix_ref, sinkhorn_ref, softmin_ref
from flashsinkhorn.second_order._plan import solve_potentials
from flashsinkhorn.streaming import StreamingProblem as Problem

RHOS = [None, 0.5, (0.3, None)]


@pytest.mark.parametrize("rho", RHOS)
def test_potentials_and_value_match_dense_reference(rho):
    x, y, a, b = clouds(40, 31, 3)
    f0, g0, v0 = sinkhorn_ref(cost_matrix_ref(x, y), a, b, 0.05, rho)
    r = fs.solve(x, y, a, b, eps=0.05, rho=rho, tol=1e-10, max_iter=4000)
    assert r.converged and r.n_iter < 4000
    torch.testing.assert_close(r.f, f0, atol=1e-8, rtol=0)
    torch.testing.assert_close(r.g, g0, atol=1e-8, rtol=0)
    torch.testing.assert_close(r.value, v0, atol=1e-10, rtol=0)
    assert float(r.marginal_error) < 1e-10


@pytest.mark.parametrize("cost", ["cosine", "dot"])
def test_other_costs_match_dense_reference(cost):
    x, y, a, b = clouds(25, 30, 4, seed=1)
    C = cost_matrix_ref(x, y, cost)
    f0, g0, v0 = sinkhorn_ref(C, a, b, 0.1)
    r = fs.solve(x, y, a, b, eps=0.1, cost=cost, tol=1e-11, max_iter=4000)
    torch.testing.assert_close(r.value, v0, atol=1e-9, rtol=0)
    torch.testing.assert_close(r.plan, torch.exp((f0[:, None] + g0 - C) / 0.1) * a[:, None] * b)


def test_label_cost_matches_dense_reference():
    x, y, a, b = clouds(30, 28, 3, seed=2)
    gen = torch.Generator().manual_seed(0)
    lx, ly = torch.randint(0, 3, (30,), generator=gen), torch.randint(0, 2, (28,), generator=gen)
    W = torch.rand(3, 2, generator=gen, dtype=torch.float64)
    C = cost_matrix_ref(x, y, label_cost=(lx, ly, W))
    _, _, v0 = sinkhorn_ref(C, a, b, 0.05)
    r = fs.solve(x, y, a, b, eps=0.05, label_cost=(lx, ly, W), tol=1e-11, max_iter=4000)
    torch.testing.assert_close(r.value, v0, atol=1e-9, rtol=0)
    with pytest.raises(ValueError, match="labels_x"):
        fs.solve(x, y, a, b, eps=0.05, label_cost=(lx + 5, ly, W))


def test_balanced_matches_pot():
    ot = pytest.importorskip("ot")
    x, y, a, b = clouds(45, 38, 2, seed=3)
    C = cost_matrix_ref(x, y).numpy()
    res = ot.solve(C, a.numpy(), b.numpy(), reg=0.05, max_iter=5000, tol=1e-12)
    r = fs.solve(x, y, a, b, eps=0.05, tol=1e-11, max_iter=5000)
    np.testing.assert_allclose(r.plan.numpy(), res.plan, atol=1e-10)
    # POT's value is the primal <P, C> + eps KL(P | a x b): equal to our dual value
    assert abs(float(r.value) - float(res.value)) < 1e-8


def test_unbalanced_matches_pot_plan_and_primal_value():
    ot = pytest.importorskip("ot")
    x, y, a, b = clouds(40, 30, 3, seed=4)
    eps, rho = 0.05, 0.5
    C = cost_matrix_ref(x, y)
    res = ot.solve(
        C.numpy(), a.numpy(), b.numpy(), reg=eps, unbalanced=rho, max_iter=5000, tol=1e-12
    )
    r = fs.solve(x, y, a, b, eps=eps, rho=rho, tol=1e-11, max_iter=5000)
    P = r.plan
    np.testing.assert_allclose(P.numpy(), res.plan, atol=1e-10)

    def kl(p, q):
        return (p * torch.log(p / q) - p + q).sum()

    primal = (
        (P * C).sum() + eps * kl(P, a[:, None] * b) + rho * kl(P.sum(1), a) + rho * kl(P.sum(0), b)
    )
    torch.testing.assert_close(r.value, primal, atol=1e-9, rtol=0)


@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_gaussian_closed_form(eps):
    """Entropic OT between 1D Gaussians (Janati et al. 2020, Mallasto et al. 2021)."""
    ma, sa, mb, sb = 0.0, 0.5, 0.8, 0.3
    t = torch.linspace(-7, 7, 400, dtype=torch.float64)
    w = torch.exp(-(t**2) / 2)
    w = w / w.sum()
    r = fs.solve(
        (ma + sa * t)[:, None], (mb + sb * t)[:, None], w, w, eps=eps, tol=1e-11, max_iter=5000
    )
    s2 = eps / 2
    D = math.sqrt(4 * sa**2 * sb**2 + s2**2)
    closed = (
        (ma - mb) ** 2 + sa**2 + sb**2 - D + s2 * (1 - math.log(2 * s2)) + s2 * math.log(D + s2)
    )
    assert abs(float(r.value) - closed) < 1e-8


def _fd(fun, t, idx, h=1e-6):
    out = []
    for i in idx:
        tp, tm = t.clone(), t.clone()
        tp.view(-1)[i] += h
        tm.view(-1)[i] -= h
        out.append((fun(tp) - fun(tm)) / (2 * h))
    return torch.stack(out)


@pytest.mark.parametrize("rho", RHOS)
@pytest.mark.parametrize("cost", ["sqeuclidean", "cosine"])
def test_gradients_match_finite_differences(rho, cost):
    x, y, a, b = clouds(12, 10, 3, seed=5)
    kw = dict(eps=0.1, rho=rho, cost=cost, tol=1e-12, max_iter=5000)

    def val(xx=x, yy=y, aa=a, bb=b):
        return fs.solve(xx, yy, aa, bb, **kw).value

    xs, ys, as_, bs = (t.clone().requires_grad_() for t in (x, y, a, b))
    fs.solve(xs, ys, as_, bs, **kw).value.backward()
    idx = [0, 5, 13, 29]
    torch.testing.assert_close(
        xs.grad.view(-1)[idx], _fd(lambda t: val(xx=t), x, idx), atol=1e-7, rtol=1e-5
    )
    torch.testing.assert_close(
        ys.grad.view(-1)[idx], _fd(lambda t: val(yy=t), y, idx), atol=1e-7, rtol=1e-5
    )
    if rho is None:
        # weights: compare directional derivatives along mass-preserving directions
        d = torch.zeros_like(a)
        d[0], d[3] = 1.0, -1.0
        fd = (val(aa=a + 1e-6 * d) - val(aa=a - 1e-6 * d)) / 2e-6
        assert abs(float((as_.grad * d).sum() - fd)) < 1e-6
    else:
        fd = _fd(lambda t: val(aa=t), a, [2])
        assert abs(float(as_.grad[2] - fd[0])) < 1e-6


def test_plan_applications_match_dense_plan():
    x, y, a, b = clouds(33, 27, 3, seed=6)
    r = fs.solve(x, y, a, b, eps=0.08, tol=1e-11, max_iter=3000)
    P = r.plan
    V, U = torch.randn(27, 5, dtype=torch.float64), torch.randn(33, dtype=torch.float64)
    torch.testing.assert_close(r.apply(V), P @ V)
    torch.testing.assert_close(r.apply_transpose(U), P.T @ U)
    torch.testing.assert_close(r.barycentric_map(), (P @ y) / P.sum(1, keepdim=True))
    rows, cols = r.marginals
    torch.testing.assert_close(rows, a)
    torch.testing.assert_close(cols, b)


@pytest.mark.parametrize("schedule", ["alternating", "symmetric"])
def test_batched_equals_loop_and_eps_scaling(schedule):
    x, y, a, b = clouds(20, 17, 2, batch=3, seed=7)
    kw = dict(eps=0.02, tol=1e-10, max_iter=5000, schedule=schedule, eps_scaling=0.5)
    rb = fs.solve(x, y, a, b, **kw)
    assert rb.f.shape == (3, 20) and rb.value.shape == (3,)
    for k in range(3):
        rk = fs.solve(x[k], y[k], a[k], b[k], **kw)
        torch.testing.assert_close(rb.value[k], rk.value, atol=1e-9, rtol=0)
        torch.testing.assert_close(rb.apply(y)[k], rk.apply(y[k]), atol=1e-9, rtol=0)


@needs_interpreter
@pytest.mark.parametrize("rho", [None, 0.4])
def test_triton_solver_matches_torch_solver(rho):
    x, y, a, b = clouds(50, 37, 5, batch=2, seed=8, dtype=torch.float32)
    kw = dict(eps=0.05, rho=rho, tol=1e-5, max_iter=300, precision="ieee")
    rt = fs.solve(x, y, a, b, backend="triton", **kw)
    rp = fs.solve(x.double(), y.double(), a.double(), b.double(), backend="torch", **kw)
    assert rt.converged
    torch.testing.assert_close(rt.f.double(), rp.f, atol=2e-4, rtol=0)
    torch.testing.assert_close(rt.value.double(), rp.value, atol=1e-5, rtol=0)
    V = torch.randn(2, 37, 3)
    torch.testing.assert_close(rt.apply(V).double(), rp.apply(V.double()), atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_convergence_is_reported(backend):
    x, y, a, b = clouds(30, 30, 2, seed=9, dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="not converged"):
        r = fs.solve(x, y, a, b, eps=1e-3, max_iter=3, tol=1e-9, backend=backend)
    assert not r.converged and r.n_iter == 3 and float(r.marginal_error) > 1e-9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fs.solve(x, y, a, b, eps=1e-3, max_iter=3, tol=1e-9, backend=backend, warn=False)


def test_bad_inputs_raise_clear_errors():
    x, y, a, b = clouds(5, 4, 2)
    with pytest.raises(ValueError, match="same dimension"):
        fs.solve(x, y[:, :1], eps=0.1)
    with pytest.raises(ValueError, match=r"\(N, D\) or \(B, N, D\)"):
        fs.solve(x[0], y, eps=0.1)
    with pytest.raises(ValueError, match="nonnegative"):
        fs.solve(x, y, -a, b, eps=0.1)
    with pytest.raises(ValueError, match="shape"):
        fs.solve(x, y, a[:3], b, eps=0.1)
    for eps in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="eps"):
            fs.solve(x, y, eps=eps)
    with pytest.raises(ValueError, match="empty"):
        fs.solve(x[:0], y, eps=0.1)
    with pytest.raises(ValueError, match="dtype"):
        fs.solve(x, y.float(), eps=0.1)
    with pytest.raises(ValueError, match="dtype"):
        fs.solve(x, y, a.float(), b, eps=0.1)
    with pytest.raises(ValueError, match="device"):
        fs.solve(x, y.to("meta"), eps=0.1)
    bad = x.clone()
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        fs.solve(bad, y, eps=0.1)
    with pytest.raises(ValueError, match="rho"):
        fs.solve(x, y, eps=0.1, rho=-1.0)
    with pytest.raises(ValueError, match="cost"):
        fs.solve(x, y, eps=0.1, cost="l1")


def test_tiny_eps_does_not_give_silent_garbage():
    x, y, a, b = clouds(20, 20, 2, seed=10, dtype=torch.float32)
    r = fs.solve(x, y, a, b, eps=1e-4, max_iter=2000, tol=1e-4, warn=False)
    assert torch.isfinite(r.f).all() and torch.isfinite(r.g).all()
    if r.converged:
        rows, cols = r.marginals
        assert float((rows - a).abs().sum() + (cols - b).abs().sum()) < 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_weights_equal_dropping_the_points(backend):
    x, y, a, b = clouds(20, 16, 2, seed=11, dtype=torch.float32)
    a0, b0 = a.clone(), b.clone()
    a0[[2, 7]] = 0.0
    b0[5] = 0.0
    with pytest.raises(ValueError, match="a.sum"):
        fs.solve(x, y, a0, b0, eps=0.05)
    a0, b0 = a0 / a0.sum(), b0 / b0.sum()
    keep_x = torch.tensor([i for i in range(20) if i not in (2, 7)])
    keep_y = torch.tensor([j for j in range(16) if j != 5])
    # tol 3e-6: float32 potentials resolve this plan's marginals to about 1e-6 (float64
    # truth; the certificate refuses 1e-6, which the old loop-estimate claimed)
    kw = dict(eps=0.05, tol=3e-6, max_iter=3000, backend=backend, precision="ieee")
    r0 = fs.solve(x, y, a0, b0, **kw)
    r1 = fs.solve(x[keep_x], y[keep_y], a0[keep_x], b0[keep_y], **kw)
    assert r0.converged and r1.converged
    torch.testing.assert_close(r0.value, r1.value, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r0.f[keep_x], r1.f, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_problem_prepares_centered_operands_once(backend):
    """Problem centers (and casts) the kernel operands once; its updates equal the float64
    softmin of the centered clouds, and a self problem shares one copy."""
    gen = torch.Generator().manual_seed(11)
    x = torch.rand(2, 40, 5, generator=gen) + 3.0
    y = torch.rand(2, 33, 5, generator=gen) + 3.5
    a = torch.full((2, 40), 1 / 40)
    b = torch.full((2, 33), 1 / 33)
    c = common_center(x, y)
    cx, cy = centered_sqnorm(x, c), centered_sqnorm(y, c)
    kw = dict(c2=2.0, precision="ieee", backend=backend, center=c)
    p = Problem(X=x, Y=y, a=a, b=b, cx=cx, cy=cy, **kw)
    torch.testing.assert_close(p.Xk, x - c[:, None], atol=0, rtol=0)
    torch.testing.assert_close(p.Yk, y - c[:, None], atol=0, rtol=0)
    g = 0.05 * torch.randn(2, 33, generator=gen)
    f = 0.05 * torch.randn(2, 40, generator=gen)
    xc, yc = x - c[:, None], y - c[:, None]
    kw = dict(eps=0.1, c2=2.0, damping=0.9)
    ref_f = softmin_ref(xc, yc, g, p.logb, cx, cy, **kw)[0]
    ref_g = softmin_ref(yc, xc, f, p.loga, cy, cx, **kw)[0]
    torch.testing.assert_close(p.sm_x(g, 0.1, 0.9)[0].double(), ref_f, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(p.sm_y(f, 0.1, 0.9)[0].double(), ref_g, atol=2e-5, rtol=1e-5)
    # and equal to the per-call path (softmin(center=c) subtracts the center itself)
    kw = dict(kw, precision="ieee", backend=backend)
    per_call = fs.softmin(x, y, g, p.logb, cx, cy, center=c, **kw)[0]
    torch.testing.assert_close(p.sm_x(g, 0.1, 0.9)[0], per_call, atol=1e-6, rtol=1e-6)
    pk = dict(c2=2.0, precision="ieee", backend=backend, center=c)
    q = Problem(X=x, Y=x, a=a, b=a, cx=cx, cy=cx, **pk)
    assert q.Xk is q.Yk
    r = Problem(X=x, Y=y, a=a, b=b, cx=cx, cy=cy, Xk=p.Xk, Yk=p.Yk, **pk)
    assert r.Xk is p.Xk and r.Yk is p.Yk


@needs_interpreter
@pytest.mark.parametrize(
    "schedule,eps_scaling", [("alternating", 0.5), ("symmetric", 0.5), ("symmetric", None)]
)
def test_triton_loop_with_guesses_matches_float64(monkeypatch, schedule, eps_scaling):
    """solve()'s loop on the Triton backend: the alternating iterations pass the current
    potentials as guesses (the shift kernel), the cold start's zeros none (the running-max
    kernel); the symmetric iterations (eps-scaling stages, schedule="symmetric" after the
    cold start) run one pass for both potentials (symmetric_update). Against the float64
    torch loop, unbalanced, both schedules."""
    import flashsinkhorn.primitives as sm

    guesses, one_pass = [], []
    real_pass, real_sums = sm._triton_pass, sm.symmetric_sums_triton

    def spy(*args, **kw):
        guesses.append(args[-1] is not None)
        return real_pass(*args, **kw)

    def spy_sums(*args, **kw):
        one_pass.append(1)
        return real_sums(*args, **kw)

    monkeypatch.setattr(sm, "_triton_pass", spy)
    monkeypatch.setattr(sm, "symmetric_sums_triton", spy_sums)
    x, y, a, b = clouds(45, 38, 3, seed=3)
    kw = dict(eps=0.05, eps_scaling=eps_scaling, max_iter=30, tol=None, schedule=schedule, rho=2.0)
    r64 = fs.solve(x, y, a, b, backend="torch", **kw)
    r = fs.solve(
        x.float(), y.float(), a.float(), b.float(), backend="triton", precision="ieee", **kw
    )
    if schedule == "alternating":
        expect = [False] * (0 if eps_scaling else 2) + [True] * (60 if eps_scaling else 58)
        sym_loop = 0
    else:
        expect = [] if eps_scaling else [False, False]
        sym_loop = 30 if eps_scaling else 29
    assert guesses == expect + [False]  # + the unbalanced value's pass
    warm = len(one_pass) - sym_loop  # the eps-scaling stages and their start from zeros
    assert warm >= 3 if eps_scaling else warm == 0
    torch.testing.assert_close(r.f.double(), r64.f, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(r.g.double(), r64.g, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(r.value.double(), r64.value, atol=2e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# the bad-input contract and the certificate (issue 19), POT / GeomLoss conventions (20)
# ---------------------------------------------------------------------------------------


def truth_l1(r, x, y, a, b, eps, cost="sqeuclidean", cost_scale=1.0):
    """Dense float64 ``|P 1 - a|_1 + |P^T 1 - b|_1`` of the returned potentials' plan."""
    C = cost_matrix_ref(x, y, cost, cost_scale)
    f, g, a, b = r.f.double(), r.g.double(), a.double(), b.double()
    P = a[:, None] * b[None, :] * torch.exp((f[:, None] + g[None, :] - C) / eps)
    return float((P.sum(1) - a).abs().sum() + (P.sum(0) - b).abs().sum())


@pytest.mark.parametrize("scale,eps", [(1.0, 1e-12), (1e6, 0.05)])
def test_no_false_convergence_at_float32_resolution(scale, eps):
    """eps below float32's resolution of the cost (tiny eps, or points scaled by 1e6): the
    old loop stopped after 10 iterations with converged=True, marginal_error=0 while the
    plan's marginals were inf. Now: not converged, the error is the float64 truth, and
    the warning names the cause."""
    x, y, a, b = clouds(50, 40, 3, seed=12, dtype=torch.float32)
    x, y = x * scale, y * scale
    with pytest.warns(RuntimeWarning, match="float32 potentials"):
        r = fs.solve(x, y, a, b, eps=eps)
    assert not r.converged
    assert float(r.marginal_error) >= truth_l1(r, x, y, a, b, eps)
    assert not bool(torch.isfinite(r.marginal_a).all())


def test_float32_floor_stops_unconverged_instead_of_claiming_tol():
    """fp32 potentials resolve the plan's marginals only to ~2^-24 |f| / eps: a tol below
    that floor stops (stalled) with the true error, which the old estimate hid."""
    x, y, a, b = clouds(40, 30, 2, seed=14, dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="stalled"):
        r = fs.solve(x, y, a, b, eps=2e-3, tol=1e-7, eps_scaling=0.5, max_iter=5000)
    assert not r.converged and r.n_iter < 5000
    assert abs(float(r.marginal_error) - truth_l1(r, x, y, a, b, 2e-3)) < 1e-9
    r64 = fs.solve(
        x.double(),
        y.double(),
        a.double(),
        b.double(),
        eps=2e-3,
        tol=1e-7,
        eps_scaling=0.5,
        max_iter=5000,
    )
    assert r64.converged and truth_l1(r64, x, y, a, b, 2e-3) < 1e-7


def test_last_iterate_meeting_tol_is_converged_without_a_check():
    """max_iter < check_every: no check runs, the final certificate decides. It said
    converged=False with a float64 error of 6e-13 against tol 1e-5 (the flag stayed at its
    initial value); a tol the last iterate misses still gives False."""
    x, y, a, b = clouds(30, 20, 2, seed=3, dtype=torch.float64)
    r = fs.solve(x, y, a, b, eps=5.0, max_iter=4, tol=1e-5, warn=False)
    assert r.n_iter == 4 and r.converged
    assert float(r.marginal_error) >= truth_l1(r, x, y, a, b, 5.0) and r.marginal_error < 1e-5
    r = fs.solve(x, y, a, b, eps=5.0, max_iter=1, tol=1e-14, warn=False)
    assert not r.converged and float(r.marginal_error) >= 1e-14


@needs_interpreter
def test_tf32_solve_certifies_the_float64_truth():
    """tf32 dot operands solve a problem whose cost is off by 2^-11 relative: the old
    certificate said 8e-6 where the float64 truth was 3e-3. The loop now finishes in
    tf32x3 until the float64 error of the returned potentials is below tol."""
    x, y, a, b = clouds(60, 50, 6, seed=13, dtype=torch.float32)
    r = fs.solve(x, y, a, b, eps=0.05, backend="triton")  # precision="tf32"
    t = truth_l1(r, x, y, a, b, 0.05)
    assert r.converged and t < 1e-5 and r.precision == "tf32x3"
    assert abs(float(r.marginal_error) - t) <= 1e-10


def test_reach_has_one_meaning():
    """``reach`` is GeomLoss's distance everywhere (SamplesLoss: rho = reach**2 for the cost
    |x - y|^2 / 2; the second-order functions: rho = 2 reach**2 for |x - y|^2); solve
    takes the penalty itself as ``rho`` and refuses ``reach`` with a message."""
    x, y, a, b = clouds(20, 15, 2, seed=15)
    with pytest.raises(TypeError, match="rho="):
        fs.solve(x, y, a, b, eps=0.1, reach=0.5)
    r = 0.6
    s = fs.solve(x, y, a, b, eps=0.1, rho=2 * r**2, tol=1e-12, max_iter=5000)
    p = solve_potentials(x, y, a, b, eps=0.1, reach=r, max_iter=5000, tol=1e-12, backend="torch")
    torch.testing.assert_close(p.f, s.f, atol=1e-9, rtol=0)
    torch.testing.assert_close(p.g, s.g, atol=1e-9, rtol=0)
    # an infinite penalty is balanced, as None
    inf = fs.solve(x, y, a, b, eps=0.1, rho=float("inf"), tol=1e-12, max_iter=5000)
    bal = fs.solve(x, y, a, b, eps=0.1, tol=1e-12, max_iter=5000)
    torch.testing.assert_close(inf.value, bal.value, atol=0, rtol=0)


def test_weights_and_points_as_array_likes():
    """Lists and numpy arrays (POT's inputs) are converted; the old code raised
    AttributeError: 'list' object has no attribute 'dim'."""
    x, y, a, b = clouds(12, 9, 2, seed=16)
    ref = fs.solve(x, y, a, b, eps=0.1)
    r = fs.solve(x.numpy(), y.numpy(), a.tolist(), b.numpy(), eps=0.1)
    torch.testing.assert_close(r.value, ref.value, atol=0, rtol=0)
    assert isinstance(r.value, torch.Tensor) and r.f.dtype == torch.float64
    with pytest.raises(TypeError, match="a must be"):
        fs.solve(x, y, {"w": 1}, b, eps=0.1)
    with pytest.raises(TypeError, match="x must be"):
        fs.solve("points", y, eps=0.1)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(max_iter=0), "max_iter"),
        (dict(max_iter=2.7), "max_iter"),
        (dict(check_every=0), "check_every"),
        (dict(tol=-1.0), "tol"),
        (dict(tol="a"), "tol"),
        (dict(eps_scaling=1.5), "eps_scaling"),
        (dict(diameter=-1.0), "diameter"),
        (dict(rho=(1.0, 2.0, 3.0)), "rho"),
        (dict(rho="x"), "rho"),
        (dict(schedule="x"), "schedule"),
        (dict(precision="fp8"), "precision"),
        (dict(backend="cuda"), "backend"),
    ],
)
def test_bad_arguments_name_themselves(kw, match):
    x, y, a, b = clouds(5, 4, 2)
    with pytest.raises(ValueError, match=match):
        fs.solve(x, y, a, b, **dict(dict(eps=0.1), **kw))


def test_zero_sum_weights_and_zero_cosine_points_raise():
    x, y, a, b = clouds(6, 5, 2)
    with pytest.raises(ValueError, match="a must have a positive sum"):
        fs.solve(x, y, torch.zeros_like(a), b, eps=0.1, rho=1.0)
    z = x.clone()
    z[2] = 0.0
    with pytest.raises(ValueError, match="nonzero"):
        fs.solve(z, y, a, b, eps=0.1, cost="cosine")
    with pytest.raises(ValueError, match="overflow"):
        fs.solve(x * 1e160, y, a, b, eps=0.1)


@needs_interpreter
def test_bf16_under_the_interpreter_raises():
    """The interpreter computes bf16 dot products wrongly (softmin off by 1.6e9, solve
    -8e9 before): refused with a message, also on the public primitives."""
    x, y, a, b = clouds(10, 8, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="bf16"):
        fs.solve(x, y, a, b, eps=0.1, precision="bf16", backend="triton")
    X, Y = x[None], y[None]
    z = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="bf16"):
        fs.softmin(
            X, Y, z, z, torch.zeros(1, 10), z, eps=0.1, c2=2.0, precision="bf16", backend="triton"
        )
    # the torch backend computes in float32 whatever precision says: allowed
    fs.solve(x, y, a, b, eps=0.1, precision="bf16", backend="torch")


def test_verbose_prints_stages_iterations_and_the_certificate(capsys):
    x, y, a, b = clouds(15, 12, 2, seed=17)
    fs.solve(x, y, a, b, eps=0.05, eps_scaling=0.5, verbose=True)
    out = capsys.readouterr().out
    assert "eps-scaling stage 1/" in out and "iteration 10, eps 0.05" in out
    assert "marginal error (float64)" in out
    fs.solve(x, y, a, b, eps=0.05)
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------------------
# invariances of any correct entropic OT solver (hypothesis, torch path, float64)
# ---------------------------------------------------------------------------------------

shapes = st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(1, 4), st.integers(0, 2**16))
KW = dict(eps=0.2, tol=1e-11, max_iter=5000, warn=False)


def _data(n, m, d, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=gen, dtype=torch.float64)
    y = torch.rand(m, d, generator=gen, dtype=torch.float64)
    a = torch.rand(n, generator=gen, dtype=torch.float64) + 0.05
    b = torch.rand(m, generator=gen, dtype=torch.float64) + 0.05
    return x, y, a / a.sum(), b / b.sum()


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
    P = r.plan
    C = fs.cost_matrix_ref(x, y)
    # entropic cost >= linear cost of its plan - eps * H bound: value >= <P, C> (KL >= 0)
    assert float(r.value) >= float((P * C).sum()) - 1e-9
    # ... and <= the cost of the independent coupling (KL(a x b | a x b) = 0)
    assert float(r.value) <= float((a[:, None] * b[None, :] * C).sum()) + 1e-9


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------


def _uniform_gpu(n, m, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    s = 1 / math.sqrt(d)
    x = torch.rand(n, d, generator=gen) * s
    y = torch.rand(m, d, generator=gen) * s + 0.5 * s
    return x.cuda(), y.cuda()


@pytest.mark.gpu
def test_triton_matches_float64_on_gpu():
    x, y = _uniform_gpu(3001, 2999, 64, seed=1)
    kw = dict(eps=0.02, cost_scale=0.5, tol=1e-5, max_iter=1000, precision="ieee")
    rt = fs.solve(x, y, backend="triton", **kw)
    rp = fs.solve(x.double(), y.double(), backend="torch", **kw)
    assert rt.converged and rp.converged
    torch.testing.assert_close(rt.value.double(), rp.value, atol=1e-6, rtol=1e-5)
    V = torch.randn(2999, 5, device="cuda")
    torch.testing.assert_close(rt.apply(V).double(), rp.apply(V.double()), atol=1e-6, rtol=1e-3)


@pytest.mark.gpu
def test_label_cost_on_gpu():
    x, y, a, b = clouds(300, 250, 5, seed=4)
    gen = torch.Generator().manual_seed(0)
    lx, ly = torch.randint(0, 4, (300,), generator=gen), torch.randint(0, 3, (250,), generator=gen)
    W = torch.rand(4, 3, generator=gen, dtype=torch.float64)
    kw = dict(eps=0.05, label_cost=(lx, ly, W), tol=1e-8, max_iter=3000, warn=False)
    r64 = fs.solve(x, y, a, b, **kw)
    r = fs.solve(
        *(t.float().cuda() for t in (x, y, a, b)),
        **dict(kw, label_cost=(lx.cuda(), ly.cuda(), W.float().cuda())),
        precision="ieee",
    )
    assert abs(float(r.value) - float(r64.value)) < 1e-5


def test_float64_floor_warning_names_float64():
    """solve(x64, y64, tol=1e-13) stalls at float64's floor and warned about "float32
    potentials"; the warning names the potentials' dtype and does not ask for float64
    (here the float64 certificate stalls at 1.1e-12)."""
    x, y, a, b = clouds(30, 25, 2, seed=31)
    with pytest.warns(RuntimeWarning, match="float64 potentials") as rec:
        r = fs.solve(x, y, a, b, eps=0.1, tol=1e-14, max_iter=20000)
    assert not r.converged and r.f.dtype == torch.float64
    assert all("float32" not in str(w.message) for w in rec)
