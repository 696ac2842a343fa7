"""The streaming primitive (softmin / plan application) against the float64 dense oracle."""

import math

import pytest
import torch
from _helpers import BACKENDS, needs_interpreter

from flashsinkhorn.kernels import plan_apply, plan_apply_ref, resolve_backend, softmin, softmin_ref

SHAPES = [  # (B, N, M, D)
    (1, 1, 1, 1),
    (2, 37, 53, 3),
    (1, 70, 45, 100),
    (1, 19, 23, 784),
    (3, 65, 129, 16),
]


def _inputs(B, N, M, D, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, D, generator=gen, dtype=dtype) / D**0.5
    y = torch.randn(B, M, D, generator=gen, dtype=dtype) / D**0.5
    g = 0.1 * torch.randn(B, M, generator=gen, dtype=dtype)
    logb = torch.log(torch.rand(B, M, generator=gen, dtype=dtype) + 0.05)
    cx, cy = (x * x).sum(-1), (y * y).sum(-1)
    return x, y, g, logb, cx, cy


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_softmin_matches_reference(backend, shape):
    x, y, g, logb, cx, cy = _inputs(*shape)
    eps = 0.3
    ref, ref_lse2, _ = softmin_ref(x, y, g, logb, cx, cy, eps=eps, c2=2.0, damping=0.8)
    out, lse2, vbar = softmin(
        x,
        y,
        g,
        logb,
        cx,
        cy,
        eps=eps,
        c2=2.0,
        damping=0.8,
        backend=backend,
        precision="ieee",
        want_lse=True,
    )
    assert vbar is None
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse2.double(), ref_lse2, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dv", [1, 5, 70])
def test_softmin_average(backend, dv):
    x, y, g, logb, cx, cy = _inputs(2, 41, 67, 7, seed=1)
    v = torch.randn(2, 67, dv)
    _, _, ref = softmin_ref(x, y, g, logb, cx, cy, eps=0.2, c2=2.0, v=v)
    _, _, vbar = softmin(
        x, y, g, logb, cx, cy, eps=0.2, c2=2.0, v=v, backend=backend, precision="ieee"
    )
    torch.testing.assert_close(vbar.double(), ref, atol=3e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("dv", [65, 300])
def test_softmin_average_wide_and_narrow_chunks(monkeypatch, wide, dv):
    """DV > 64 runs in 256-wide output chunks (fewer score recomputes) unless narrowed;
    both split DV = 300 unevenly (256 + 44, or 5 x 64 with a ragged last chunk)."""
    from flashsinkhorn import kernels

    monkeypatch.setattr(kernels, "WIDE_V", wide)
    x, y, g, logb, cx, cy = _inputs(1, 29, 75, 9, seed=3)
    v = torch.randn(1, 75, dv, generator=torch.Generator().manual_seed(4))
    _, _, ref = softmin_ref(x, y, g, logb, cx, cy, eps=0.15, c2=2.0, v=v)
    _, _, vbar = softmin(
        x, y, g, logb, cx, cy, eps=0.15, c2=2.0, v=v, backend="triton", precision="ieee"
    )
    torch.testing.assert_close(vbar.double(), ref, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_label_cost_in_kernel(backend):
    B, N, M, D = 2, 33, 40, 5
    x, y, g, logb, cx, cy = _inputs(B, N, M, D, seed=2)
    gen = torch.Generator().manual_seed(3)
    lx = torch.randint(0, 3, (B, N), generator=gen)
    ly = torch.randint(0, 4, (B, M), generator=gen)
    W = torch.rand(3, 4, generator=gen)
    labels = (lx, ly, W, 0.7)
    ref, _, refv = softmin_ref(x, y, g, logb, cx, cy, eps=0.25, c2=2.0, labels=labels, v=y)
    out, _, vbar = softmin(
        x,
        y,
        g,
        logb,
        cx,
        cy,
        eps=0.25,
        c2=2.0,
        labels=labels,
        v=y,
        backend=backend,
        precision="ieee",
    )
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(vbar.double(), refv, atol=2e-5, rtol=1e-5)
    # the label term matters: without it the result differs
    plain, _, _ = softmin(x, y, g, logb, cx, cy, eps=0.25, c2=2.0, backend=backend)
    assert (plain - out).abs().max() > 1e-3


@needs_interpreter
def test_triton_equals_torch_path():
    x, y, g, logb, cx, cy = _inputs(2, 90, 77, 24, seed=4)
    kw = dict(eps=0.05, c2=2.0, precision="ieee", want_lse=True, v=y)
    t = softmin(x, y, g, logb, cx, cy, backend="triton", **kw)
    p = softmin(x, y, g, logb, cx, cy, backend="torch", **kw)
    for u, w in zip(t, p):
        torch.testing.assert_close(u, w, atol=5e-5, rtol=1e-5)


def test_zero_weight_columns_are_ignored():
    x, y, g, logb, cx, cy = _inputs(1, 10, 12, 3, seed=5)
    logb[:, :4] = float("-inf")
    out, _, _ = softmin(x, y, g, logb, cx, cy, eps=0.3, c2=2.0, backend="torch")
    ref, _, _ = softmin(
        x, y[:, 4:], g[:, 4:], logb[:, 4:], cx, cy[:, 4:], eps=0.3, c2=2.0, backend="torch"
    )
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_apply_matches_dense(backend):
    gen = torch.Generator().manual_seed(6)
    x, y = torch.rand(1, 30, 4, generator=gen), torch.rand(1, 26, 4, generator=gen)
    a, b = torch.full((1, 30), 1 / 30), torch.full((1, 26), 1 / 26)
    f, g = 0.1 * torch.randn(1, 30, generator=gen), 0.1 * torch.randn(1, 26, generator=gen)
    v = torch.randn(1, 26, 3, generator=gen)
    cx, cy = (x * x).sum(-1), (y * y).sum(-1)
    out, rows = plan_apply(
        x, y, a, b, f, g, v, cx, cy, eps=0.1, c2=2.0, backend=backend, precision="ieee"
    )
    ref = plan_apply_ref(x, y, a, b, f, g, v, eps=0.1)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    ones = plan_apply_ref(x, y, a, b, f, g, torch.ones(1, 26, 1), eps=0.1)[..., 0]
    torch.testing.assert_close(rows.double(), ones, atol=1e-6, rtol=1e-4)


def test_backend_errors():
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda", torch.device("cpu"))
    x, y, g, logb, cx, cy = _inputs(1, 4, 4, 2)
    with pytest.raises(ValueError, match="precision"):
        softmin(x, y, g, logb, cx, cy, eps=0.1, c2=2.0, precision="fp8")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [3, 150])
def test_center_subtracted_in_kernel(backend, d):
    """center=c computes <x - c, y - c>: shifted clouds with the shift as center agree."""
    x, y, g, logb, cx, cy = _inputs(2, 29, 38, d, seed=7)
    shift = 5.0 + torch.randn(2, d)
    ref, _, refv = softmin(x, y, g, logb, cx, cy, eps=0.2, c2=2.0, v=y, backend="torch")
    out, _, vbar = softmin(
        x + shift[:, None],
        y + shift[:, None],
        g,
        logb,
        cx,
        cy,
        eps=0.2,
        c2=2.0,
        v=y,
        backend=backend,
        precision="ieee",
        center=shift,
    )
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(vbar, refv, atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,N,D", [(1, 1, 3), (2, 70, 3), (1, 200, 20), (1, 130, 150)])
def test_self_softmin_symmetric_tiles(backend, B, N, D):
    """The half-tile symmetric self-transport update equals the plain softmin."""
    from flashsinkhorn.kernels import self_softmin

    gen = torch.Generator().manual_seed(N)
    x = torch.rand(B, N, D, generator=gen)
    c = x.mean(1)
    cx = 0.5 * ((x - c[:, None]) ** 2).sum(-1)
    loga = torch.log(torch.rand(B, N, generator=gen) + 0.2)
    loga = loga - torch.logsumexp(loga, -1, keepdim=True)
    f = 0.02 * torch.randn(B, N, generator=gen)
    ref, _, _ = softmin_ref(x - c[:, None], x - c[:, None], f, loga, cx, cx, eps=0.05, c2=1.0,
                            damping=0.9)  # fmt: skip
    out = self_softmin(x, loga, f, cx, eps=0.05, c2=1.0, damping=0.9, center=c,
                       precision="ieee", backend=backend)  # fmt: skip
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


@needs_interpreter
def test_self_softmin_falls_back_on_large_spread():
    from flashsinkhorn.kernels import self_softmin

    gen = torch.Generator().manual_seed(0)
    x = torch.rand(1, 50, 2, generator=gen)
    cx = 0.5 * (x**2).sum(-1)
    loga = torch.full((1, 50), -math.log(50))
    loga[0, 3] = float("-inf")  # a zero weight: the fast path must not be used
    f = torch.zeros(1, 50)
    ref, _, _ = softmin_ref(x, x, f, loga, cx, cx, eps=0.01, c2=1.0)
    out = self_softmin(x, loga, f, cx, eps=0.01, c2=1.0, backend="triton", precision="ieee")
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("D", [64, 256])
def test_softmin_even_d_fused_bias_and_tail(backend, D):
    """D a multiple of the D block (the kernel drops the D mask), a zero column weight
    (log b = -inf inside the fused column bias), a partial last column tile, and the
    plan-application variant, against the float64 oracle."""
    x, y, g, logb, cx, cy = _inputs(2, 70, 130, D, seed=3)
    logb[0, 5] = float("-inf")
    logb[1, 129] = float("-inf")
    v = torch.randn(2, 130, 3, generator=torch.Generator().manual_seed(4))
    ref, ref_lse2, refv = softmin_ref(x, y, g, logb, cx, cy, eps=0.2, c2=2.0, damping=0.7, v=v)
    out, lse2, vbar = softmin(
        x, y, g, logb, cx, cy, eps=0.2, c2=2.0, damping=0.7, v=v, want_lse=True,
        backend=backend, precision="ieee",
    )  # fmt: skip
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse2.double(), ref_lse2, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(vbar.double(), refv, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_problem_prepares_centered_operands_once(backend):
    """Problem centers (and casts) the kernel operands once; its updates equal softmin with
    center= (the per-call path), and a self problem shares one copy."""
    from flashsinkhorn.solver import Problem, centered_sqnorm, common_center

    gen = torch.Generator().manual_seed(11)
    x = torch.rand(2, 40, 5, generator=gen) + 3.0
    y = torch.rand(2, 33, 5, generator=gen) + 3.5
    a = torch.full((2, 40), 1 / 40)
    b = torch.full((2, 33), 1 / 33)
    c = common_center(x, y)
    cx, cy = centered_sqnorm(x, c), centered_sqnorm(y, c)
    p = Problem(x, y, a, b, cx, cy, 2.0, "sqeuclidean", 1.0, None, "ieee", backend, c)
    torch.testing.assert_close(p.Xk, x - c[:, None], atol=0, rtol=0)
    torch.testing.assert_close(p.Yk, y - c[:, None], atol=0, rtol=0)
    g = 0.05 * torch.randn(2, 33, generator=gen)
    f = 0.05 * torch.randn(2, 40, generator=gen)
    kw = dict(eps=0.1, c2=2.0, damping=0.9, precision="ieee", backend=backend)
    ref_f = softmin(x, y, g, p.logb, cx, cy, center=c, **kw)[0]
    ref_g = softmin(y, x, f, p.loga, cy, cx, center=c, **kw)[0]
    torch.testing.assert_close(p.sm_x(g, 0.1, 0.9)[0], ref_f, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(p.sm_y(f, 0.1, 0.9)[0], ref_g, atol=1e-6, rtol=1e-6)
    q = Problem(x, x, a, a, cx, cx, 2.0, "sqeuclidean", 1.0, None, "ieee", backend, c)
    assert q.Xk is q.Yk
    r = Problem(x, y, a, b, cx, cy, 2.0, "sqeuclidean", 1.0, None, "ieee", backend, c,
                Xk=p.Xk, Yk=p.Yk)  # fmt: skip
    assert r.Xk is p.Xk and r.Yk is p.Yk
