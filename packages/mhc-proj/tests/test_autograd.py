"""Autograd conventions of both ops beyond the first derivative (#19, #20): double backward
(gradient penalties, Hessian-vector products) against float64 finite differences and
``gradgradcheck``; torch.func (grad, vmap, jacrev, jvp / jacfwd, hessian) against plain
autograd; forward-mode AD; the output dtype convention for bfloat16 / float16 logits;
torch.compile(fullgraph=True) over the new options.

Oracles: finite differences of first derivatives in float64 (first derivatives are checked
against the float64 references in test_birkhoff.py / test_sinkhorn.py), and autograd on
the same functions (torch.func must agree with it bitwise or to float64 rounding).
"""

import pytest
import torch

from mhc_proj import birkhoff_project, sinkhorn_project
from mhc_proj.reference import sinkhorn_project_ref

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
OPS = {
    "birkhoff": lambda a: birkhoff_project(a),
    "sinkhorn": lambda a: sinkhorn_project(a, iters=6, eps=1e-3),
}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _penalty(op, a, w):
    """A gradient penalty: ||d/dA <W, op(A)>||^2, differentiable in A (create_graph)."""
    (g,) = torch.autograd.grad((op(a) * w).sum(), a, create_graph=True)
    return (g**2).sum()


# ---------------------------------------------------------------- double backward (#19)
@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("n", [2, 4, 5])
def test_gradgradcheck_float64(name, n):
    x = (torch.randn(3, n, n, generator=_gen(n), dtype=torch.float64) * 2).requires_grad_(True)
    assert torch.autograd.gradgradcheck(OPS[name], (x,), atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_gradient_penalty_vs_finite_differences(device, name):
    """The gradient of a gradient penalty was 0.47 off a true 4.9 (the backward ran as a
    non-differentiable kernel). Against a central difference of the penalty in float64
    (the penalty itself needs only first derivatives), and the float32 path against the
    float64 one."""
    op = OPS[name]
    g = _gen(1)
    x = torch.randn(16, 4, 4, generator=g, dtype=torch.float64).to(device)
    w = torch.randn(16, 4, 4, generator=g, dtype=torch.float64).to(device)
    v = torch.randn(16, 4, 4, generator=g, dtype=torch.float64).to(device)
    xr = x.clone().requires_grad_(True)
    (gp,) = torch.autograd.grad(_penalty(op, xr, w), xr)
    h = 1e-5
    fp = _penalty(op, (x + h * v).requires_grad_(True), w).detach()
    fm = _penalty(op, (x - h * v).requires_grad_(True), w).detach()
    fd = (fp - fm) / (2 * h)
    an = (gp * v).sum()
    assert float((an - fd).abs()) <= 1e-6 * max(1.0, float(fd.abs()))
    xf = x.float().requires_grad_(True)
    (gf,) = torch.autograd.grad(_penalty(op, xf, w.float()), xf)
    assert float((gf.double() - gp).abs().max()) <= 1e-3 * float(gp.abs().max())


def test_hessian_vector_product_and_create_graph_value():
    """The first-order value under create_graph is the kernel's (bitwise the plain
    backward's up to the torch formula's float64 rounding), and an HVP matches the Hessian
    from torch.autograd.functional."""
    x = torch.randn(4, 4, dtype=torch.float64, generator=_gen(2))
    gr = torch.randn(4, 4, dtype=torch.float64, generator=_gen(3))
    xa = x.clone().requires_grad_(True)
    (d_plain,) = torch.autograd.grad(birkhoff_project(xa), xa, gr)
    (d_graph,) = torch.autograd.grad(birkhoff_project(xa), xa, gr, create_graph=True)
    assert d_graph.requires_grad
    assert float((d_graph - d_plain).abs().max()) <= 1e-14

    def f(a):
        return (birkhoff_project(a) ** 3).sum()

    v = torch.randn(4, 4, dtype=torch.float64, generator=_gen(4))
    _, hvp = torch.autograd.functional.hvp(f, x, v)
    hess = torch.autograd.functional.hessian(f, x).reshape(16, 16)
    assert float((hvp.reshape(16) - hess @ v.reshape(16)).abs().max()) <= 1e-10


# ---------------------------------------------------------------- torch.func (#20)
@pytest.mark.parametrize("name", list(OPS))
def test_torch_func_grad_vmap_jacrev(name):
    """torch.func failed (the Functions had no setup_context): grad, vmap over any dim,
    vmap of grad, jacrev, against plain autograd and the unbatched calls."""
    op = OPS[name]
    x = torch.randn(5, 4, 4, generator=_gen(5), dtype=torch.float64)

    def f(a):
        return (op(a) ** 2).sum()

    xr = x.clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(f(xr), xr)
    assert float((torch.func.grad(f)(x) - g_ref).abs().max()) <= 1e-13
    assert torch.equal(torch.func.vmap(op)(x), op(x))
    assert torch.equal(torch.func.vmap(op, in_dims=2)(x.permute(1, 2, 0)), op(x))
    nested = torch.func.vmap(torch.func.vmap(op))(x.reshape(5, 1, 4, 4)).reshape(5, 4, 4)
    assert torch.equal(nested, op(x))
    per = torch.stack([torch.func.grad(f)(xi) for xi in x])
    assert float((torch.func.vmap(torch.func.grad(f))(x) - per).abs().max()) <= 1e-13
    # jacrev runs the backward's torch formula, autograd the kernel: float64 rounding apart
    jac = torch.func.jacrev(op)(x[0])
    jac_ref = torch.autograd.functional.jacobian(op, x[0])
    assert float((jac - jac_ref).abs().max()) <= 1e-12


def test_forward_mode_birkhoff():
    """jvp / jacfwd / hessian: the projection's Jacobian is symmetric, so the forward-mode
    rule is the VJP at the tangent (checked against the reverse-mode Jacobian)."""
    x = torch.randn(3, 4, 4, generator=_gen(6), dtype=torch.float64)
    v = torch.randn(3, 4, 4, generator=_gen(7), dtype=torch.float64)
    _, jv = torch.func.jvp(birkhoff_project, (x,), (v,))
    jac = torch.autograd.functional.jacobian(birkhoff_project, x[0]).reshape(16, 16)
    assert float((jv[0].reshape(16) - jac @ v[0].reshape(16)).abs().max()) <= 1e-12
    assert float((jac - jac.T).abs().max()) <= 1e-14
    xr = x.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(birkhoff_project, (xr,), check_forward_ad=True)

    def f(a):
        return (birkhoff_project(a) ** 3).sum()

    h = torch.func.hessian(f)(x[0])
    assert float((h - torch.autograd.functional.hessian(f, x[0])).abs().max()) <= 1e-12


def test_vmap_with_info_and_options():
    x = torch.randn(3, 2, 4, 4, generator=_gen(8))
    t, info = torch.func.vmap(lambda a: birkhoff_project(a, return_info=True, tol=1e-5))(x)
    t2, info2 = birkhoff_project(x, return_info=True, tol=1e-5)
    assert torch.equal(t, t2) and torch.equal(info.iterations, info2.iterations)
    assert torch.equal(info.converged, info2.converged)


# ---------------------------------------------------------------- output dtype (#20)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_return_their_dtype(device, dtype):
    """bf16 logits gave float32 T, so T @ h_bf16 raised. T now comes back in the input dtype
    (computed in float32: exactly the float32 result rounded), or in float32 on request;
    gradients come back in the logits' dtype either way."""
    g = _gen(9)
    x = (torch.randn(8, 4, 4, generator=g) * 2).to(device=device, dtype=dtype)
    h = torch.randn(8, 4, 16, generator=g).to(device=device, dtype=dtype)
    for op in (birkhoff_project, sinkhorn_project):
        t = op(x)
        assert t.dtype == dtype
        assert (t @ h).dtype == dtype  # the mHC residual mix
        t32 = op(x, out_dtype=torch.float32)
        assert t32.dtype == torch.float32 and torch.equal(t, t32.to(dtype))
        xr = x.clone().requires_grad_(True)
        (op(xr) @ h).float().sum().backward()
        assert xr.grad.dtype == dtype and torch.isfinite(xr.grad).all()
    ref = sinkhorn_project_ref(x.double().cpu(), 20, 1e-6)
    assert float((sinkhorn_project(x, out_dtype=torch.float32).cpu() - ref).abs().max()) < 2e-6


def test_out_dtype_float64_and_float32_inputs():
    x = torch.randn(4, 3, 3, generator=_gen(10))
    t64 = birkhoff_project(x, out_dtype=torch.float64)
    assert t64.dtype == torch.float64 and torch.equal(t64, birkhoff_project(x).double())
    xd = x.double()
    assert birkhoff_project(xd, out_dtype=torch.float32).dtype == torch.float32


# ---------------------------------------------------------------- torch.compile
def test_compile_fullgraph_options():
    """fullgraph compile over out_dtype, return_info and an explicit max_iter: no graph
    break, the same values as eager."""
    torch._dynamo.reset()

    def f(a):
        t, info = birkhoff_project(a, return_info=True, max_iter=20, out_dtype=torch.float32)
        p = sinkhorn_project(a, iters=5)
        return (t**2).sum() + p.float().pow(3).sum(), info.converged

    x = torch.randn(6, 4, 4, generator=_gen(11)).to(torch.bfloat16).requires_grad_(True)
    y, conv = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    (gx,) = torch.autograd.grad(y, x)
    x2 = x.detach().clone().requires_grad_(True)
    y2, conv2 = f(x2)
    (gx2,) = torch.autograd.grad(y2, x2)
    assert torch.equal(conv, conv2) and torch.allclose(y.float(), y2.float())
    assert torch.equal(gx, gx2)
