"""solve(): potentials, values, gradients and plan applications against independent oracles."""

import math
import warnings

import numpy as np
import pytest
import torch
from _helpers import BACKENDS, clouds, needs_interpreter

import flashsinkhorn as fs
from flashsinkhorn.solver import cost_matrix_ref, sinkhorn_ref

REACHES = [None, 0.5, (0.3, None)]


@pytest.mark.parametrize("reach", REACHES)
def test_potentials_and_value_match_dense_reference(reach):
    x, y, a, b = clouds(40, 31, 3)
    f0, g0, v0 = sinkhorn_ref(cost_matrix_ref(x, y), a, b, 0.05, reach)
    r = fs.solve(x, y, a, b, eps=0.05, reach=reach, tol=1e-10, max_iter=4000)
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
    torch.testing.assert_close(r.plan(), torch.exp((f0[:, None] + g0 - C) / 0.1) * a[:, None] * b)


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
    np.testing.assert_allclose(r.plan().numpy(), res.plan, atol=1e-10)
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
    r = fs.solve(x, y, a, b, eps=eps, reach=rho, tol=1e-11, max_iter=5000)
    P = r.plan()
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


@pytest.mark.parametrize("reach", REACHES)
@pytest.mark.parametrize("cost", ["sqeuclidean", "cosine"])
def test_gradients_match_finite_differences(reach, cost):
    x, y, a, b = clouds(12, 10, 3, seed=5)
    kw = dict(eps=0.1, reach=reach, cost=cost, tol=1e-12, max_iter=5000)

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
    if reach is None:
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
    P = r.plan()
    V, U = torch.randn(27, 5, dtype=torch.float64), torch.randn(33, dtype=torch.float64)
    torch.testing.assert_close(r.apply(V), P @ V)
    torch.testing.assert_close(r.apply_transpose(U), P.T @ U)
    torch.testing.assert_close(r.barycentric_map(), (P @ y) / P.sum(1, keepdim=True))
    rows, cols = r.marginals()
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
@pytest.mark.parametrize("reach", [None, 0.4])
def test_triton_solver_matches_torch_solver(reach):
    x, y, a, b = clouds(50, 37, 5, batch=2, seed=8, dtype=torch.float32)
    kw = dict(eps=0.05, reach=reach, tol=1e-5, max_iter=300, precision="ieee")
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
    with pytest.raises(ValueError, match="reach"):
        fs.solve(x, y, eps=0.1, reach=-1.0)
    with pytest.raises(ValueError, match="cost"):
        fs.solve(x, y, eps=0.1, cost="l1")


def test_tiny_eps_does_not_give_silent_garbage():
    x, y, a, b = clouds(20, 20, 2, seed=10, dtype=torch.float32)
    r = fs.solve(x, y, a, b, eps=1e-4, max_iter=2000, tol=1e-4, warn=False)
    assert torch.isfinite(r.f).all() and torch.isfinite(r.g).all()
    if r.converged:
        rows, cols = r.marginals()
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
    kw = dict(eps=0.05, tol=1e-6, max_iter=3000, backend=backend, precision="ieee")
    r0 = fs.solve(x, y, a0, b0, **kw)
    r1 = fs.solve(x[keep_x], y[keep_y], a0[keep_x], b0[keep_y], **kw)
    assert r0.converged and r1.converged
    torch.testing.assert_close(r0.value, r1.value, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r0.f[keep_x], r1.f, atol=1e-4, rtol=0)
