"""Double backward of ``solve(...).value`` and ``SamplesLoss`` (flashsinkhorn/_hessian.py):
Hessian-vector products and gradient penalties against dense float64 autograd through an
unrolled Sinkhorn loop and against finite differences of the streamed gradient."""

import pytest
import torch
from _helpers import needs_interpreter

import flashsinkhorn as fs
from flashsinkhorn.reference import cost_matrix_ref, sinkhorn_ref
from flashsinkhorn.second_order import hvp_ref, ot_loss_ref

F64 = torch.float64
SOLVE = dict(tol=1e-12, max_iter=3000, warn=False)


def _problem(n=7, m=6, d=3, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g, dtype=F64)
    y = torch.rand(m, d, generator=g, dtype=F64) + 0.3
    a = torch.rand(n, generator=g, dtype=F64) + 0.5
    b = torch.rand(m, generator=g, dtype=F64) + 0.5
    vx, vy = torch.randn(n, d, generator=g, dtype=F64), torch.randn(m, d, generator=g, dtype=F64)
    cast = [t.to(dtype) for t in (x, y, a / a.sum(), b / b.sum(), vx, vy)]
    return cast


def _dense_value(x, y, a, b, eps, rho, cost, cost_scale):
    C = cost_matrix_ref(x, y, cost, cost_scale)
    return sinkhorn_ref(C, a, b, eps, rho, n_iter=800)[2]


def _hvp(value_fn, x, y, vx, vy):
    """(H v)_x, (H v)_y of value_fn at (x, y) by double autograd."""
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    gx, gy = torch.autograd.grad(value_fn(xs, ys), (xs, ys), create_graph=True)
    return torch.autograd.grad((gx * vx).sum() + (gy * vy).sum(), (xs, ys))


def _rel(h, r):
    return max(float((hh.double() - rr).abs().max() / rr.abs().max()) for hh, rr in zip(h, r))


def _close(h, r, rtol):
    assert _rel(h, r) <= rtol, (_rel(h, r), rtol)


def _samples_loss_check(L, x, y, a, b, vx, vy, debias, rtol):
    """SamplesLoss(blur) is half the |x - y|^2 OT loss at eps = 2 blur^2. GeomLoss's schedule
    stops short of the fixed point, so its gradient is off the converged one by some
    relative error e; the HVP (at the schedule's potentials) must be as good: <= 3 e + rtol
    against the dense float64 Hessian of the converged loss."""
    eps = 2 * L.blur**2
    dd = [t.double() for t in (x, y, a, b, vx, vy)]
    ref = tuple(
        0.5 * r
        for r in hvp_ref(
            dd[0], dd[1], (dd[4], dd[5]), dd[2], dd[3], eps=eps, wrt="xy", debias=debias, n_iter=300
        )
    )
    xs, xr = x.clone().requires_grad_(), dd[0].clone().requires_grad_()
    (g,) = torch.autograd.grad(L(a, xs, b, y), xs)
    (gr,) = torch.autograd.grad(
        0.5 * ot_loss_ref(xr, dd[1], dd[2], dd[3], eps=eps, debias=debias, n_iter=300), xr
    )
    grad_err = _rel((g,), (gr,))
    h = _hvp(lambda u, w: L(a, u, b, w), x, y, vx, vy)
    assert _rel(h, ref) <= 3 * grad_err + rtol, (_rel(h, ref), grad_err)
    return grad_err


@pytest.mark.parametrize(
    "rho,cost,cost_scale",
    [
        (None, "sqeuclidean", 0.5),
        (0.7, "sqeuclidean", 1.0),
        ((None, 0.7), "sqeuclidean", 1.0),
        (0.7, "cosine", 2.0),
    ],
)
def test_solve_value_hvp_matches_dense_float64_autograd(rho, cost, cost_scale):
    x, y, a, b, vx, vy = _problem()
    kw = dict(eps=0.2, rho=rho, cost=cost, cost_scale=cost_scale)
    ours = _hvp(lambda u, w: fs.solve(u, w, a, b, **kw, **SOLVE).value, x, y, vx, vy)
    ref = _hvp(lambda u, w: _dense_value(u, w, a, b, 0.2, rho, cost, cost_scale), x, y, vx, vy)
    _close(ours, ref, 1e-7)


def test_solve_gradient_penalty_matches_finite_differences_and_hvp_ref():
    """A gradient penalty |d value / dx|^2 (WGAN-GP style): its gradient is 2 H (d value/dx),
    checked against central differences of the penalty and the second-order oracle."""
    x, y, a, b, _, _ = _problem(seed=1)

    def penalty(u):
        u = u.clone().requires_grad_()
        (gx,) = torch.autograd.grad(
            fs.solve(u, y, a, b, eps=0.2, **SOLVE).value, u, create_graph=True
        )
        return (gx**2).sum(), gx, u

    p, gx, u = penalty(x)
    (dp,) = torch.autograd.grad(p, u)
    # second-order oracle (cost |x - y|^2, balanced): d p / dx = 2 H gx
    torch.testing.assert_close(
        dp, 2 * hvp_ref(x, y, gx.detach(), a, b, eps=0.2), rtol=1e-7, atol=1e-9
    )
    h = 1e-5
    for i in (0, 4, 11, 20):
        e = torch.zeros_like(x).view(-1)
        e[i] = h
        fd = (penalty(x + e.view_as(x))[0] - penalty(x - e.view_as(x))[0]) / (2 * h)
        assert abs(float(fd - dp.view(-1)[i])) < 1e-6 * max(1.0, abs(float(fd)))


def test_solve_batched_double_backward_equals_per_problem():
    xs, ys, vxs, vys = [], [], [], []
    for k in range(2):
        x, y, _, _, vx, vy = _problem(seed=10 + k)
        xs, ys, vxs, vys = xs + [x], ys + [y], vxs + [vx], vys + [vy]
    X, Y, VX, VY = (torch.stack(t) for t in (xs, ys, vxs, vys))
    hb = _hvp(lambda u, w: fs.solve(u, w, eps=0.2, **SOLVE).value.sum(), X, Y, VX, VY)
    for k in range(2):
        hk = _hvp(lambda u, w: fs.solve(u, w, eps=0.2, **SOLVE).value, xs[k], ys[k], vxs[k], vys[k])
        torch.testing.assert_close(hb[0][k], hk[0], rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(hb[1][k], hk[1], rtol=1e-9, atol=1e-11)


def test_solve_zero_weights_double_backward():
    """Zero-weight points carry no mass: their rows of H v are 0 and the rest equals the
    problem without them."""
    x, y, a, b, vx, vy = _problem(n=8, seed=2)
    a0 = a.clone()
    a0[[1, 5]] = 0.0
    a0 = a0 / a0.sum()
    keep = torch.tensor([0, 2, 3, 4, 6, 7])
    h0 = _hvp(lambda u, w: fs.solve(u, w, a0, b, eps=0.2, **SOLVE).value, x, y, vx, vy)
    h1 = _hvp(
        lambda u, w: fs.solve(u, w, a0[keep], b, eps=0.2, **SOLVE).value, x[keep], y, vx[keep], vy
    )
    assert float(h0[0][[1, 5]].abs().max()) == 0.0
    torch.testing.assert_close(h0[0][keep], h1[0], rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(h0[1], h1[1], rtol=1e-7, atol=1e-9)


def test_double_backward_refusals_are_clear():
    x, y, a, b, _, _ = _problem()
    xs = x.clone().requires_grad_()
    v = fs.solve(xs, y, eps=0.2, cost="dot", **SOLVE).value
    with pytest.raises(RuntimeError, match="cost='sqeuclidean' and 'cosine'"):
        torch.autograd.grad(v, xs, create_graph=True)
    aw = a.clone().requires_grad_()
    v = fs.solve(xs, y, aw, b, eps=0.2, **SOLVE).value
    with pytest.raises(RuntimeError, match="weights a, b must not require grad"):
        torch.autograd.grad(v, (xs, aw), create_graph=True)
    # first order with weights is unchanged
    gx, ga = torch.autograd.grad(fs.solve(xs, y, aw, b, eps=0.2, **SOLVE).value, (xs, aw))
    assert gx.shape == x.shape and ga.shape == a.shape
    # SamplesLoss: unbalanced double backward refuses and names what to use
    loss = fs.SamplesLoss(blur=0.5, reach=1.0)(xs, y)
    with pytest.raises(RuntimeError, match="ot_loss"):
        torch.autograd.grad(loss, xs, create_graph=True)


@pytest.mark.parametrize("debias", [False, True])
def test_samples_loss_hvp_matches_dense_float64_autograd(debias):
    x, y, a, b, vx, vy = _problem(seed=3)
    L = fs.SamplesLoss(blur=0.7, scaling=0.99, debias=debias, backend="torch")
    assert _samples_loss_check(L, x, y, a, b, vx, vy, debias, 1e-7) < 2e-4
    # the first-order gradient is GeomLoss's, whatever create_graph says
    xs = x.clone().requires_grad_()
    (g1,) = torch.autograd.grad(L(a, xs, b, y), xs)
    (g2,) = torch.autograd.grad(L(a, xs, b, y), xs, create_graph=True)
    torch.testing.assert_close(g1, g2.detach(), rtol=0, atol=0)


@needs_interpreter
def test_double_backward_on_the_triton_kernels():
    x, y, a, b, vx, vy = _problem(n=37, m=29, d=5, seed=4, dtype=torch.float32)
    kw = dict(eps=0.2, backend="triton", precision="ieee", tol=1e-6, max_iter=500, warn=False)
    ours = _hvp(lambda u, w: fs.solve(u, w, a, b, **kw).value, x, y, vx, vy)
    ref = hvp_ref(
        x.double(),
        y.double(),
        (vx.double(), vy.double()),
        a.double(),
        b.double(),
        eps=0.2,
        wrt="xy",
    )
    _close(ours, ref, 1e-5)
    L = fs.SamplesLoss(blur=0.7, scaling=0.9, backend="triton", precision="ieee")
    _samples_loss_check(L, x, y, a, b, vx, vy, True, 1e-5)


@pytest.mark.gpu
def test_double_backward_on_gpu():
    x, y, a, b, vx, vy = (t.float().cuda() for t in _problem(n=120, m=97, d=16, seed=5))
    cpu = [t.double().cpu() for t in (x, y, vx, vy, a, b)]
    kw = dict(eps=0.2, tol=1e-5, max_iter=1000, warn=False)
    ours = _hvp(lambda u, w: fs.solve(u, w, a, b, **kw).value, x, y, vx, vy)
    ref = hvp_ref(cpu[0], cpu[1], (cpu[2], cpu[3]), cpu[4], cpu[5], eps=0.2, wrt="xy", n_iter=500)
    _close(tuple(h.cpu() for h in ours), ref, 1e-4)
    L = fs.SamplesLoss(blur=0.7, scaling=0.9)
    _samples_loss_check(L, x, y, a, b, vx, vy, True, 1e-4)


@pytest.mark.parametrize("debias", [False, True])
def test_samples_loss_hvp_at_the_default_scaling_is_the_converged_hvp(monkeypatch, debias):
    """GeomLoss's default schedule (scaling 0.5) stops far from the fixed point; the double
    backward converges the final-eps potentials first, so H v is the converged loss's
    Hessian, not the Hessian at the schedule's potentials (which was tens of % off: checked
    here with the convergence step switched off). The gradient stays GeomLoss's."""
    from flashsinkhorn import samples_loss

    x, y, a, b, vx, vy = _problem(n=9, m=8, seed=6)
    L = fs.SamplesLoss(blur=0.3, scaling=0.5, debias=debias)
    eps = 2 * L.blur**2
    ref = tuple(
        0.5 * r
        for r in hvp_ref(x, y, (vx, vy), a, b, eps=eps, wrt="xy", debias=debias, n_iter=3000)
    )
    h = _hvp(lambda u, w: L(a, u, b, w), x, y, vx, vy)
    assert _rel(h, ref) < 1e-5, _rel(h, ref)
    monkeypatch.setattr(samples_loss, "POLISH_MAX_ITER", 0)
    h0 = _hvp(lambda u, w: L(a, u, b, w), x, y, vx, vy)
    assert _rel(h0, ref) > 1e-2
