"""Streaming HVP, double backward and implicit gradients against dense float64 autograd.

The oracle (``reference.py``) differentiates an unrolled dense log-domain Sinkhorn loop by
plain autograd; the code under test solves the implicit linear system by streaming CG.
"""

import os

import pytest
import torch

from flashsinkhorn.second_order import (
    hvp,
    hvp_ref,
    implicit_grad,
    inverse_hvp,
    ot_loss,
    ot_loss_ref,
    potentials_ref,
)

F64 = torch.float64
EPS = 0.3
NREF = 800  # unrolled iterations of the reference (converged at this eps and size)
# the self-terms OT(x, x) of the debiased loss converge slowly at small eps (their plan is
# nearly diagonal): the debiased cases use a larger temperature
EPS_DB = 1.0
TIGHT = dict(max_iter=NREF, tol=None, cg_tol=1e-12, backend="torch")
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _problem(n=6, m=5, d=3, seed=0, weights=True):
    g = torch.Generator().manual_seed(seed)
    x = 0.5 * torch.randn(n, d, generator=g, dtype=F64)
    y = 0.5 * torch.randn(m, d, generator=g, dtype=F64) + 0.2
    a = b = None
    if weights:
        a = torch.rand(n, generator=g, dtype=F64) + 0.5
        b = torch.rand(m, generator=g, dtype=F64) + 0.5
        a, b = a / a.sum(), b / b.sum()
    vx = torch.randn(n, d, generator=g, dtype=F64)
    vy = torch.randn(m, d, generator=g, dtype=F64)
    return x, y, a, b, vx, vy


def _close(h, r, tol):
    if isinstance(h, tuple):
        for hh, rr in zip(h, r):
            _close(hh, rr, tol)
        return
    err = float((h - r).abs().max())
    assert err <= tol * float(r.abs().max()), (err, float(r.abs().max()))


REACHES = [None, 1.0, (None, 0.7)]


@pytest.mark.parametrize("reach", REACHES, ids=["balanced", "unbalanced", "semi"])
@pytest.mark.parametrize("wrt", ["x", "y", "xy"])
def test_hvp_matches_dense_autograd_hessian(reach, wrt):
    x, y, a, b, vx, vy = _problem()
    v = {"x": vx, "y": vy, "xy": (vx, vy)}[wrt]
    h = hvp(x, y, v, a, b, eps=EPS, reach=reach, wrt=wrt, **TIGHT)
    r = hvp_ref(x, y, v, a, b, eps=EPS, reach=reach, wrt=wrt, n_iter=NREF)
    _close(h, r, 1e-9)


def test_full_hessian_matches_dense_autograd():
    """Every column of the Hessian in x (HVP on the basis) against autograd's Hessian."""
    x, y, a, b, _, _ = _problem(n=3, m=4, d=2)
    f = lambda xx: ot_loss_ref(xx, y, a, b, eps=EPS, n_iter=NREF)
    H = torch.autograd.functional.hessian(f, x).reshape(x.numel(), x.numel())
    cols = []
    for k in range(x.numel()):
        e = torch.zeros(x.numel(), dtype=F64)
        e[k] = 1
        cols.append(hvp(x, y, e.reshape(x.shape), a, b, eps=EPS, **TIGHT).reshape(-1))
    Hs = torch.stack(cols, 1)
    assert torch.allclose(Hs, H, atol=1e-9, rtol=1e-8)
    assert torch.allclose(Hs, Hs.T, atol=1e-9)


@pytest.mark.parametrize("reach", [None, 1.0], ids=["balanced", "unbalanced"])
@pytest.mark.parametrize("wrt", ["x", "xy"])
def test_hvp_debiased(reach, wrt):
    x, y, a, b, vx, vy = _problem(seed=1)
    v = vx if wrt == "x" else (vx, vy)
    h = hvp(x, y, v, a, b, eps=EPS_DB, reach=reach, wrt=wrt, debias=True, **TIGHT)
    r = hvp_ref(x, y, v, a, b, eps=EPS_DB, reach=reach, wrt=wrt, debias=True, n_iter=NREF)
    _close(h, r, 1e-9)


@pytest.mark.parametrize("reach", [None, 1.0], ids=["balanced", "unbalanced"])
def test_hvp_vs_finite_differences_of_streamed_gradient(reach):
    x, y, a, b, vx, _ = _problem(n=9, m=7, d=2, seed=2)

    def grad(xx):
        xx = xx.clone().requires_grad_(True)
        loss = ot_loss(xx, y, a, b, eps=EPS, reach=reach, max_iter=NREF, tol=1e-13, backend="torch")
        return torch.autograd.grad(loss, xx)[0]

    h = 1e-5
    fd = (grad(x + h * vx) - grad(x - h * vx)) / (2 * h)
    hv = hvp(x, y, vx, a, b, eps=EPS, reach=reach, **TIGHT)
    _close(hv, fd, 1e-6)


@pytest.mark.parametrize("debias", [False, True])
def test_double_backward(debias):
    x, y, a, b, vx, vy = _problem(seed=3)
    eps = EPS_DB if debias else EPS
    xx = x.clone().requires_grad_(True)
    yy = y.clone().requires_grad_(True)
    loss = ot_loss(
        xx,
        yy,
        a,
        b,
        eps=eps,
        debias=debias,
        max_iter=NREF,
        tol=1e-13,
        backend="torch",
        cg_tol=1e-12,
    )
    ref = ot_loss_ref(x, y, a, b, eps=eps, debias=debias, n_iter=NREF)
    assert abs(float(loss) - float(ref)) < 1e-12
    gx, gy = torch.autograd.grad(loss, (xx, yy), create_graph=True)
    hx, hy = torch.autograd.grad((gx * vx).sum() + (gy * vy).sum(), (xx, yy))
    r = hvp_ref(x, y, (vx, vy), a, b, eps=eps, wrt="xy", debias=debias, n_iter=NREF)
    _close((hx, hy), r, 1e-9)


@pytest.mark.parametrize("reach", [None, 1.0], ids=["balanced", "unbalanced"])
def test_weight_gradients(reach):
    x, y, a, b, _, _ = _problem(seed=4)
    aa, bb = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    ga, gb = torch.autograd.grad(
        ot_loss(x, y, aa, bb, eps=EPS, reach=reach, max_iter=NREF, tol=1e-13, backend="torch"),
        (aa, bb),
    )
    ar, br = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    gar, gbr = torch.autograd.grad(ot_loss_ref(x, y, ar, br, eps=EPS, reach=reach), (ar, br))
    if reach is None:  # balanced: defined up to the gauge constant
        ga, gb, gar, gbr = ga - ga.mean(), gb - gb.mean(), gar - gar.mean(), gbr - gbr.mean()
    assert torch.allclose(ga, gar, atol=1e-9) and torch.allclose(gb, gbr, atol=1e-9)


@pytest.mark.parametrize("reach", [None, 1.0], ids=["balanced", "unbalanced"])
def test_implicit_grad_vs_autograd_and_finite_differences(reach):
    x, y, a, b, vx, _ = _problem(seed=5)
    g = torch.Generator().manual_seed(9)
    w1 = torch.randn(x.shape[0], generator=g, dtype=F64)
    w2 = torch.randn(y.shape[0], generator=g, dtype=F64)
    w2 = w2 + (w1.sum() - w2.sum()) / y.shape[0]  # gauge invariant: sum w1 == sum w2
    ig = implicit_grad(
        x, y, w1, w2, a, b, eps=EPS, reach=reach, max_iter=NREF, backend="torch", cg_tol=1e-13
    )
    xr, yr = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    f, gg = potentials_ref(xr, yr, a, b, eps=EPS, reach=reach, n_iter=NREF)
    gxr, gyr = torch.autograd.grad(w1 @ f + w2 @ gg, (xr, yr))
    assert torch.allclose(ig.x, gxr, atol=1e-10) and torch.allclose(ig.y, gyr, atol=1e-10)

    def L(xx):
        f, gg = potentials_ref(xx, y, a, b, eps=EPS, reach=reach, n_iter=NREF)
        return float(w1 @ f + w2 @ gg)

    h = 1e-5
    fd = (L(x + h * vx) - L(x - h * vx)) / (2 * h)
    assert abs(fd - float((ig.x * vx).sum())) < 1e-7 * (1 + abs(fd))


def test_inverse_hvp_solves_the_damped_system():
    x, y, a, b, vx, _ = _problem(n=8, m=8, d=2, seed=6)
    lam = 0.5
    z = inverse_hvp(x, y, vx, a, b, eps=EPS, damping=lam, tol=1e-10, max_iter=NREF, backend="torch")
    back = hvp(x, y, z, a, b, eps=EPS, **TIGHT) + lam * z
    assert torch.allclose(back, vx, atol=1e-7)


def test_potentials_argument_reuses_a_solve():
    x, y, a, b, vx, _ = _problem(seed=7)
    f, g = potentials_ref(x, y, a, b, eps=EPS, n_iter=NREF)
    h1 = hvp(x, y, vx, a, b, eps=EPS, potentials=(f, g), backend="torch", cg_tol=1e-12)
    h2 = hvp_ref(x, y, vx, a, b, eps=EPS, n_iter=NREF)
    _close(h1, h2, 1e-9)


def test_bad_inputs_are_named():
    x, y, a, b, vx, vy = _problem()
    with pytest.raises(ValueError, match="wrt"):
        hvp(x, y, vx, eps=EPS, wrt="z")
    with pytest.raises(ValueError, match="v"):
        hvp(x, y, vy, eps=EPS, wrt="x")
    with pytest.raises(ValueError, match="eps"):
        hvp(x, y, vx, eps=0.0)
    with pytest.raises(ValueError, match="same D"):
        hvp(x, y[:, :2], vx, eps=EPS)
    with pytest.raises(ValueError, match="positive"):
        hvp(x, y, vx, -a, b, eps=EPS)
    with pytest.raises(ValueError, match="finite"):
        hvp(x * float("nan"), y, vx, eps=EPS)


# ---- the Triton kernels themselves (interpreter on CPU in CI, the GPU with the marker) ----
def _triton_case(device, n=37, m=29, d=5, reach=None, wrt="x"):
    x, y, a, b, vx, vy = _problem(n=n, m=m, d=d, seed=8)
    v = {"x": vx, "y": vy, "xy": (vx, vy)}[wrt]
    kw = dict(eps=EPS, reach=reach, wrt=wrt, max_iter=100, cg_tol=1e-7)
    to = lambda t, dt: (  # noqa: E731
        tuple(u.to(device, dt) for u in t) if isinstance(t, tuple) else t.to(device, dt)
    )
    # the float64 reference on the same device (torch backend: on the GPU in float64)
    h64 = hvp(*(to(t, F64) for t in (x, y, v, a, b)), backend="torch", **kw)
    h64 = tuple(h.cpu() for h in h64) if isinstance(h64, tuple) else h64.cpu()
    h32 = hvp(*(to(t, torch.float32) for t in (x, y, v, a, b)), backend="triton", **kw)
    if isinstance(h64, tuple):
        for p, q in zip(h32, h64):
            assert float((p.double().cpu() - q).norm() / q.norm()) < 1e-4
    else:
        assert float((h32.double().cpu() - h64).norm() / h64.norm()) < 1e-4


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (set by the nox session)")
@pytest.mark.parametrize("reach,wrt", [(None, "x"), (1.0, "xy")])
def test_triton_kernels_interpreter(reach, wrt):
    _triton_case("cpu", reach=reach, wrt=wrt)


@pytest.mark.gpu
@pytest.mark.parametrize("reach,wrt", [(None, "x"), (None, "y"), (1.0, "xy"), ((None, 1.0), "x")])
def test_triton_kernels_gpu(reach, wrt):
    _triton_case("cuda", n=1500, m=1300, d=70, reach=reach, wrt=wrt)


@pytest.mark.gpu
def test_double_backward_gpu():
    x, y, a, b, vx, _ = (t.cuda() for t in _problem(n=3000, m=2500, d=64, seed=10))
    ref = hvp(x, y, vx, a, b, eps=EPS_DB, max_iter=300, backend="torch", debias=True).cpu()
    xx = x.float().cuda().requires_grad_(True)
    loss = ot_loss(
        xx,
        y.float().cuda(),
        a.float().cuda(),
        b.float().cuda(),
        eps=EPS_DB,
        debias=True,
        max_iter=300,
    )
    (gx,) = torch.autograd.grad(loss, xx, create_graph=True)
    (hx,) = torch.autograd.grad(gx, xx, vx.float().cuda())
    assert float((hx.double().cpu() - ref).norm() / ref.norm()) < 1e-4


@pytest.mark.parametrize(
    "given,precision,reach,debias,expected",
    [
        ("auto", "tf32x3", None, False, "tf32"),  # the measured case: tf32 loop, exact tail
        ("auto", "tf32x3", 1.0, False, None),  # unbalanced: no gauge to absorb the offset
        ("auto", "tf32x3", None, True, None),  # debias: self-solves not measured
        ("auto", "ieee", None, False, None),
        ("auto", "tf32", None, False, None),
        (None, "tf32x3", None, False, None),  # explicit: every iteration at precision
        ("tf32", "tf32x3", 1.0, True, "tf32"),
    ],
)
def test_hvp_loop_precision_auto(given, precision, reach, debias, expected):
    from flashsinkhorn.second_order.hvp import _resolve_loop_precision

    assert _resolve_loop_precision(given, precision, reach, debias) == expected


def test_hvp_default_loop_equals_explicit_schedule():
    """hvp's default ("auto") is the tf32 loop on a balanced problem: the same numbers as
    asking for it, and (torch backend: one fp32/float64 mode) as the exact loop."""
    x, y, a, b, vx, _ = _problem(n=9, m=7, d=3, seed=12)
    kw = dict(eps=EPS, max_iter=200, cg_tol=1e-10, backend="torch")
    h_auto = hvp(x, y, vx, a, b, **kw)
    assert torch.equal(h_auto, hvp(x, y, vx, a, b, loop_precision="tf32", **kw))
    assert torch.equal(h_auto, hvp(x, y, vx, a, b, loop_precision=None, **kw))
