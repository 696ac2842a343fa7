"""Ragged batches (varlen.py): the one-launch kernel against its float64 reference, and
SamplesLoss on lists of clouds / concatenated points with cu_seqlens against one call per
problem (values and gradients), on the torch path and the Triton kernel (interpreter)."""

import pytest
import torch
from _helpers import needs_interpreter

import flashsinkhorn as fs
from flashsinkhorn.varlen import (
    VarlenProblem,
    offsets,
    prepare_varlen,
    softmin_varlen,
    softmin_varlen_ref,
)

BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def _ragged(sx, sy, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.rand(n, d, generator=g, dtype=dtype) for n in sx]
    ys = [torch.rand(m, d, generator=g, dtype=dtype) + 0.3 for m in sy]
    return xs, ys


@needs_interpreter
@pytest.mark.parametrize("dv", [None, 5, 40])
def test_kernel_matches_float64(dv):
    """Odd segment sizes (1 row, a segment longer than a block, fewer columns than rows),
    damping, V wider than a chunk."""
    g = torch.Generator().manual_seed(1)
    sx, sy = (5, 37, 1, 20), (9, 3, 30, 17)
    N, M, D = sum(sx), sum(sy), 7
    x, y = torch.rand(N, D, generator=g), torch.rand(M, D, generator=g)
    gg = 0.1 * torch.randn(M, generator=g)
    logb = torch.log(torch.rand(M, generator=g) + 0.1)
    cx, cy = (x * x).sum(1), (y * y).sum(1)
    v = None if dv is None else torch.randn(M, dv, generator=g)
    cux, cuy = offsets(sx, "cpu"), offsets(sy, "cpu")
    kw = dict(eps=0.1, c2=2.0, damping=0.9, v=v)
    out, lse2, vbar = softmin_varlen(x, y, gg, logb, cx, cy, cux, cuy, sx, precision="ieee", **kw)
    ref, ref_lse2, ref_v = softmin_varlen_ref(x, y, gg, logb, cx, cy, cux, cuy, **kw)
    assert float((out.double() - ref).abs().max()) < 1e-5
    assert float((lse2.double() - ref_lse2).abs().max() / ref_lse2.abs().max()) < 1e-6
    if dv is not None:
        assert float((vbar.double() - ref_v).abs().max()) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("debias,reach", [(False, None), (True, None), (True, 0.7)])
def test_samples_loss_on_a_ragged_batch_equals_one_call_per_problem(backend, debias, reach):
    xs, ys = _ragged((5, 40, 1, 17), (9, 3, 30, 17), 3, seed=2)
    kw = dict(blur=0.1, diameter=2.0, debias=debias, reach=reach)
    xg = [x.clone().requires_grad_() for x in xs]
    v = fs.SamplesLoss(backend=backend, **kw)(xg, ys)
    v.sum().backward()
    assert v.shape == (4,)
    for k, (x, y) in enumerate(zip(xs, ys)):
        xr = x.clone().requires_grad_()
        r = fs.SamplesLoss(backend="torch", **kw)(xr, y)
        r.backward()
        torch.testing.assert_close(v[k], r, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(xg[k].grad, xr.grad, atol=2e-6, rtol=1e-4)


def test_cu_seqlens_form_weights_and_potentials():
    xs, ys = _ragged((6, 11, 3), (7, 2, 9), 2, seed=3, dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    a_s = [torch.rand(x.shape[0], generator=g, dtype=torch.float64) + 0.1 for x in xs]
    b_s = [torch.rand(y.shape[0], generator=g, dtype=torch.float64) + 0.1 for y in ys]
    b_s = [bb * aa.sum() / bb.sum() for aa, bb in zip(a_s, b_s)]  # balanced per problem
    loss = fs.SamplesLoss(blur=0.2, diameter=2.0)
    v_list = loss(a_s, xs, b_s, ys)
    cu = (offsets([6, 11, 3], "cpu"), offsets([7, 2, 9], "cpu"))
    v_cat = loss(torch.cat(a_s), torch.cat(xs), torch.cat(b_s), torch.cat(ys), cu_seqlens=cu)
    torch.testing.assert_close(v_cat, v_list, atol=0, rtol=0)
    ref = [
        fs.samples_loss_ref(a, x, b, y, blur=0.2, diameter=2.0)
        for a, x, b, y in zip(a_s, xs, b_s, ys)
    ]
    torch.testing.assert_close(v_list, torch.stack(ref), atol=1e-10, rtol=1e-9)
    F, G = fs.SamplesLoss(blur=0.2, diameter=2.0, potentials=True)(a_s, xs, b_s, ys)
    assert [f.shape[0] for f in F] == [6, 11, 3] and [h.shape[0] for h in G] == [7, 2, 9]


def test_segment_reductions_know_their_side():
    """total / peak of a row vector per problem, with as many x as y points (Nt = Mt) but
    other segments: the side decides."""
    x3, y3, a2, b2, cux, cuy, sx, sy = prepare_varlen(*_ragged((2, 5), (6, 1), 2, seed=5))
    p = VarlenProblem(
        X=x3,
        Y=y3,
        a=a2,
        b=b2,
        cx=a2,
        cy=b2,
        c2=2.0,
        cu_x=cux,
        cu_y=cuy,
        sizes_x=sx,
        sizes_y=sy,
        backend="torch",
    )
    t = torch.arange(7.0)[None]
    torch.testing.assert_close(p.total(t, "x"), torch.tensor([1.0, 20.0]))
    torch.testing.assert_close(p.total(t, "y"), torch.tensor([15.0, 6.0]))
    torch.testing.assert_close(p.peak(t, "y"), torch.tensor([5.0, 6.0]))


def test_ragged_errors_name_the_argument():
    xs, ys = _ragged((3, 4), (2, 5), 2)
    loss = fs.SamplesLoss()
    with pytest.raises(ValueError, match="as many clouds"):
        loss(xs, ys[:1])
    with pytest.raises(ValueError, match=r"y\[1\] must be \(N, D\) with N >= 1"):
        loss(xs, [ys[0], torch.zeros(0, 2)])
    with pytest.raises(ValueError, match="cu_x must start at 0"):
        loss(
            torch.cat(xs),
            torch.cat(ys),
            cu_seqlens=(torch.tensor([0, 3, 6]), offsets([2, 5], "cpu")),
        )
    with pytest.raises(RuntimeError, match="ragged batch: double backward"):
        xg = [x.clone().requires_grad_() for x in xs]
        (gx,) = torch.autograd.grad(loss(xg, ys).sum(), xg[0], create_graph=True)
        gx.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rho", [None, (0.5, None)])
def test_solve_on_a_ragged_batch_equals_one_solve_per_problem(backend, rho):
    dtype = torch.float64 if backend == "torch" else torch.float32
    xs, ys = _ragged((5, 33, 1, 12), (9, 3, 21, 12), 3, seed=6, dtype=dtype)
    kw = dict(eps=0.1, rho=rho, tol=1e-6, max_iter=3000)
    xg = [x.clone().requires_grad_() for x in xs]
    r = fs.solve(xg, ys, backend=backend, **kw)
    r.value.sum().backward()
    assert r.backend == "varlen" and bool(r.converged)
    assert r.value.shape == (4,) and [f.shape[0] for f in r.f] == [5, 33, 1, 12]
    maps = r.barycentric_map()
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    for k, (x, y) in enumerate(zip(xs, ys)):
        xr = x.clone().requires_grad_()
        one = fs.solve(xr, y, backend="torch", **kw)
        one.value.backward()
        torch.testing.assert_close(r.value[k], one.value, atol=tol, rtol=tol)
        torch.testing.assert_close(xg[k].grad, xr.grad, atol=10 * tol, rtol=1e-4)
        torch.testing.assert_close(maps[k], one.barycentric_map(), atol=10 * tol, rtol=1e-4)
    # the certificate is per problem, measured in float64
    assert r.marginal_error.shape == (4,) and float(r.marginal_error.max()) < 1e-6
    with pytest.raises(NotImplementedError, match="ragged"):
        r.dense_plan()


@pytest.mark.gpu
@pytest.mark.parametrize("precision,tol", [("ieee", 2e-5), ("tf32", 2e-3)])
def test_kernel_on_cuda(precision, tol):
    """The compiled kernel (64 x 64 tiles) on odd sizes, with V, against float64."""
    g = torch.Generator().manual_seed(7)
    sx, sy = (1, 130, 64, 65, 500), (300, 7, 129, 64, 1)
    N, M, D = sum(sx), sum(sy), 70
    x, y = torch.rand(N, D, generator=g) / 8, torch.rand(M, D, generator=g) / 8
    gg = 0.01 * torch.randn(M, generator=g)
    logb = torch.log(torch.rand(M, generator=g) + 0.1)
    cx, cy, v = (x * x).sum(1), (y * y).sum(1), torch.randn(M, 33, generator=g)
    cux, cuy = offsets(sx, "cpu"), offsets(sy, "cpu")
    ref = softmin_varlen_ref(x, y, gg, logb, cx, cy, cux, cuy, eps=0.05, c2=2.0, v=v)
    c = [t.cuda() for t in (x, y, gg, logb, cx, cy, cux, cuy)]
    out = softmin_varlen(*c, sx, eps=0.05, c2=2.0, v=v.cuda(), precision=precision)
    for o, r in zip(out, ref):
        assert float((o.double().cpu() - r).abs().max() / r.abs().max()) < tol


@pytest.mark.gpu
def test_samples_loss_ragged_on_cuda():
    xs, ys = _ragged((500, 4000, 1, 1700), (900, 3, 3000, 17), 3, seed=8)
    xs, ys = [x.cuda() for x in xs], [y.cuda() for y in ys]
    xg = [x.clone().requires_grad_() for x in xs]
    kw = dict(blur=0.05, diameter=2.0, precision="ieee")
    v = fs.SamplesLoss(**kw)(xg, ys)
    v.sum().backward()
    for k, (x, y) in enumerate(zip(xs, ys)):
        xr = x.clone().requires_grad_()
        r = fs.SamplesLoss(**kw)(xr, y)
        r.backward()
        assert abs(float(v[k]) - float(r)) < 1e-5 * max(1.0, abs(float(r)))
        assert float((xg[k].grad - xr.grad).abs().max()) < 1e-5
