"""birkhoff_project: C++ / CUDA paths against the float64 reference, autograd, the op."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mhc_proj
from mhc_proj import BirkhoffProjection, birkhoff_project, marginal_error
from mhc_proj.reference import birkhoff_project_ref, birkhoff_vjp_ref

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize(
    "dtype,dist_tol,marg_tol", [(torch.float32, 2e-5, 1e-5), (torch.float64, 1e-11, 1e-12)]
)
def test_forward_matches_reference(device, n, dtype, dist_tol, marg_tol):
    x = (torch.randn(257, n, n, generator=_gen(n), dtype=torch.float64) * 3).to(dtype)
    t = birkhoff_project(x.to(device)).cpu()
    assert t.dtype == dtype
    ref = birkhoff_project_ref(x)
    assert marginal_error(t).max() <= marg_tol
    assert (t.double() - ref).abs().max() <= dist_tol


@pytest.mark.parametrize("device", DEVICES)
def test_shapes_strides_dtypes(device):
    x = torch.randn(3, 4, 4, 5, generator=_gen(1)).to(device)
    xt = x.transpose(-1, -2)[..., :4]  # (3, 4, 5, 4) -> non-contiguous slice (3, 4, 4, 4)
    xt = x.permute(0, 3, 1, 2)[:, :4]  # (3, 4, 4, 4), non-contiguous
    assert not xt.is_contiguous()
    t = birkhoff_project(xt)
    assert t.shape == xt.shape and t.dtype == torch.float32
    ref = birkhoff_project_ref(xt.cpu())
    assert (t.cpu().double() - ref).abs().max() < 2e-5
    for dt in (torch.bfloat16, torch.float16):
        th = birkhoff_project(xt.to(dt))
        assert th.dtype == torch.float32
        assert (th.cpu().double() - birkhoff_project_ref(xt.to(dt).cpu())).abs().max() < 2e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gradient_leading_dims_strides_dtypes(device, dtype):
    """The eager path casts and reshapes inside one autograd node: the gradient comes back
    in the input's dtype and shape, for non-contiguous inputs with leading dims."""
    x = torch.randn(2, 4, 4, 3, generator=_gen(3), dtype=torch.float64) * 2
    xt = x.permute(0, 3, 1, 2).to(device=device, dtype=dtype)  # (2, 3, 4, 4), strided
    assert not xt.is_contiguous()
    xt.requires_grad_(True)
    gr = torch.randn(2, 3, 4, 4, generator=_gen(4), dtype=torch.float64)
    t = birkhoff_project(xt)
    (da,) = torch.autograd.grad(t, xt, gr.to(device=device, dtype=t.dtype))
    assert da.dtype == dtype and da.shape == xt.shape
    ref_t = birkhoff_project_ref(xt.detach().cpu().double())
    ref = birkhoff_vjp_ref(ref_t, gr)
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float64: 1e-10}[dtype]
    assert (da.cpu().double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    x = torch.randn(0, 3, 4, 4, device=device, requires_grad=True)
    t = birkhoff_project(x)
    assert t.shape == (0, 3, 4, 4)
    t.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
def test_huge_logits_and_nan_isolation(device):
    g = _gen(2)
    x = torch.randn(512, 4, 4, generator=g) * 1e4
    x[7, 1, 2] = float("nan")
    x[9, 0, 0] = float("inf")
    t, info = birkhoff_project(x.to(device), return_info=True)
    t = t.cpu()
    bad = torch.zeros(512, dtype=torch.bool)
    bad[[7, 9]] = True
    assert torch.isnan(t[bad]).all()
    assert torch.isfinite(t[~bad]).all()
    assert marginal_error(t[~bad]).max() <= 1e-4
    assert not info.converged.cpu()[bad].any()
    assert info.converged.cpu()[~bad].all()
    # the other matrices are exactly what they are without the bad ones
    t2 = birkhoff_project(x[~bad].to(device)).cpu()
    assert torch.equal(t2, t[~bad])


@pytest.mark.parametrize("device", DEVICES)
def test_return_info(device):
    x = torch.randn(6, 5, 4, 4, generator=_gen(3)).to(device)
    x[0, 0] *= 300  # a hard matrix
    t, info = birkhoff_project(x, return_info=True)
    assert info.iterations.shape == (6, 5) and info.iterations.dtype == torch.int32
    assert info.converged.dtype == torch.bool and bool(info.converged.all())
    assert int(info.iterations.min()) >= 0 and int(info.iterations.max()) > 0
    assert info.fallback.dtype == torch.bool
    t_only = birkhoff_project(x)
    assert torch.equal(t, t_only)
    # a tolerance that fp32 cannot meet goes to the float64 re-solve
    t2, info2 = birkhoff_project(x, tol=1e-9, return_info=True)
    assert int(info2.fallback.sum()) >= 15 and bool(info2.converged.all())
    assert marginal_error(t2[info2.fallback]).max() <= 1e-6


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_gradcheck_float64(n):
    x = (torch.randn(3, n, n, generator=_gen(n), dtype=torch.float64) * 2).requires_grad_(True)
    assert torch.autograd.gradcheck(birkhoff_project, (x,), atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sigma", [1.0, 10.0])
def test_backward_fp32_vs_float64_vjp(device, sigma):
    g = _gen(4)
    x = torch.randn(2000, 4, 4, generator=g) * sigma
    gr = torch.randn(2000, 4, 4, generator=g)
    xd = x.to(device).requires_grad_(True)
    birkhoff_project(xd).backward(gr.to(device))
    ref = birkhoff_vjp_ref(birkhoff_project_ref(x), gr)
    err = (xd.grad.cpu().double() - ref).abs().flatten(1).amax(1)
    rel = err / ref.abs().flatten(1).amax(1)
    assert float(rel.quantile(0.99)) <= 1e-4


def test_finite_differences_fp32():
    # directional derivative of <G, T(A)> against a central difference in float64
    g = _gen(5)
    x = torch.randn(64, 4, 4, generator=g, dtype=torch.float64)
    gr = torch.randn(64, 4, 4, generator=g, dtype=torch.float64)
    v = torch.randn(64, 4, 4, generator=g, dtype=torch.float64)
    xf = x.float().requires_grad_(True)
    birkhoff_project(xf).backward(gr.float())
    h = 1e-5
    fp = (birkhoff_project_ref(x + h * v) * gr).sum((-1, -2))
    fm = (birkhoff_project_ref(x - h * v) * gr).sum((-1, -2))
    fd = (fp - fm) / (2 * h)
    an = (xf.grad.double() * v).sum((-1, -2))
    assert (an - fd).abs().max() <= 1e-4 * (1 + fd.abs().max())


def test_opcheck():
    x = torch.randn(5, 4, 4, generator=_gen(6))
    torch.library.opcheck(torch.ops.mhc_proj.birkhoff_fwd.default, (x, 4e-6, 30, True))
    torch.library.opcheck(torch.ops.mhc_proj.birkhoff_fwd.default, (x.double(), 1e-13, 50, False))
    t = birkhoff_project(x)
    torch.library.opcheck(torch.ops.mhc_proj.birkhoff_bwd.default, (t, torch.randn_like(t)))


def test_torch_compile_fullgraph():
    torch._dynamo.reset()

    def f(a):
        return (birkhoff_project(a * 2.0) ** 2).sum() + mhc_proj.sinkhorn_project(a).pow(3).sum()

    x = torch.randn(7, 4, 4, generator=_gen(7), requires_grad=True)
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    y = cf(x)
    (gx,) = torch.autograd.grad(y, x)
    x2 = x.detach().clone().requires_grad_(True)
    y2 = f(x2)
    (gx2,) = torch.autograd.grad(y2, x2)
    assert torch.allclose(y, y2) and torch.allclose(gx, gx2)


def test_module():
    m = BirkhoffProjection(tol=1e-5)
    x = torch.randn(2, 3, 4, 4, generator=_gen(8))
    assert torch.equal(m(x), birkhoff_project(x, tol=1e-5))
    assert "tol=1e-05" in repr(m)


@pytest.mark.parametrize(
    "bad,exc,match",
    [
        (torch.zeros(3, 4, 5), ValueError, r"\(\.\.\., n, n\); got \(3, 4, 5\)"),
        (torch.zeros(4), ValueError, r"\(\.\.\., n, n\)"),
        (torch.zeros(2, 9, 9), ValueError, "n must be in 2..8; got n=9"),
        (torch.zeros(2, 1, 1), ValueError, "n must be in 2..8; got n=1"),
        (torch.zeros(2, 4, 4, dtype=torch.int64), TypeError, "floating dtype.*int64"),
        (torch.zeros(2, 4, 4, dtype=torch.complex64), TypeError, "floating dtype.*complex64"),
        ([[1.0, 0.0], [0.0, 1.0]], TypeError, "torch.Tensor; got list"),
    ],
)
def test_bad_input(bad, exc, match):
    with pytest.raises(exc, match=match):
        birkhoff_project(bad)
    with pytest.raises(exc):
        mhc_proj.sinkhorn_project(bad)


def test_bad_options():
    x = torch.zeros(2, 4, 4)
    with pytest.raises(ValueError, match="tol must be > 0"):
        birkhoff_project(x, tol=0.0)
    with pytest.raises(ValueError, match="max_iter must be >= 0"):
        birkhoff_project(x, max_iter=-1)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 8),
    b=st.integers(1, 9),
    log_scale=st.floats(-3, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_doubly_stochastic(n, b, log_scale, seed):
    x = torch.randn(b, n, n, generator=_gen(seed)) * (10.0**log_scale)
    t, info = birkhoff_project(x, return_info=True)
    assert torch.isfinite(t).all() and (t >= 0).all()
    assert bool(info.converged.all())
    assert marginal_error(t).max() <= 1e-4
    # invariance: adding row and column constants does not change T
    r = torch.randn(b, n, 1, generator=_gen(seed + 1))
    c = torch.randn(b, 1, n, generator=_gen(seed + 2))
    if 10.0**log_scale < 100:
        t2 = birkhoff_project(x + r + c)
        assert (t2 - t).abs().max() <= 1e-4 * max(1.0, math.sqrt(n))


# ---------------------------------------------------------------- eager fast path vs the op
def _op_path(x, gr):
    """T and dA through the torch.library ops and their registered autograd (what
    torch.compile sees), on the (B, n, n) compute-dtype copy of ``x``."""
    n = x.shape[-1]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    tol, it = (1e-13, 100) if dtype == torch.float64 else (4e-6, 30)
    xr = x.detach().clone().requires_grad_(x.requires_grad)
    xc = xr.to(dtype).reshape(-1, n, n).contiguous()
    t, _ = torch.ops.mhc_proj.birkhoff_fwd.default(xc, tol, it, False)
    t = t.reshape(x.shape)
    if not x.requires_grad:
        return t, None
    t.backward(gr)
    return t.detach(), xr.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 4, 4), (2, 3, 4, 4), (4, 4), (7, 3, 3), (2, 1, 6, 6)])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_fast_path_bitwise_op_path(device, dtype, shape, strided, requires_grad):
    """The eager path (one autograd.Function, no reshapes, C++ apply) gives bitwise the
    results of the custom ops with their registered autograd, forward and gradient, and of
    ``Function.apply`` and the return_info path."""
    from mhc_proj.birkhoff import _BirkhoffProject

    g = _gen(sum(shape) + 10 * strided)
    base = torch.randn(*shape[:-1], shape[-1] + 3, generator=g, dtype=torch.float64) * 3
    base = base.to(device=device, dtype=dtype)
    x = base[..., : shape[-1]] if strided else base[..., : shape[-1]].contiguous()
    assert x.is_contiguous() != strided
    gr = torch.randn(shape, generator=g, dtype=torch.float64).to(device)
    gr = gr.to(torch.float64 if dtype == torch.float64 else torch.float32)
    x.requires_grad_(requires_grad)
    t = birkhoff_project(x)
    assert t.shape == x.shape and t.requires_grad == requires_grad
    t_op, d_op = _op_path(x, gr)
    assert torch.equal(t.detach(), t_op)
    t_info, _ = birkhoff_project(x.detach(), return_info=True)
    assert torch.equal(t.detach(), t_info)
    c_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    tol, it = (1e-13, 100) if dtype == torch.float64 else (4e-6, 30)
    t_apply = _BirkhoffProject.apply(x, c_dtype, tol, it, None)
    assert torch.equal(t_apply.detach(), t_op)
    if requires_grad:
        t.backward(gr)
        assert x.grad.dtype == dtype and x.grad.shape == x.shape
        d_fast = x.grad.clone()
        x.grad = None
        t_apply.backward(gr)
        assert torch.equal(x.grad, d_fast)
        # the op path's gradient is computed in the compute dtype, then cast by autograd
        assert torch.equal(d_op, d_fast)
        x.grad = None
        xi = x.detach().clone().requires_grad_(True)
        birkhoff_project(xi, return_info=True)[0].backward(gr)
        assert torch.equal(xi.grad, d_fast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_bitwise_eager(dtype):
    """torch.compile (fullgraph, the custom ops) and the eager path: the same T and dA."""
    torch._dynamo.reset()
    x = (torch.randn(2, 5, 4, 4, generator=_gen(11), dtype=torch.float64) * 2).to(dtype)
    gr = torch.randn(2, 5, 4, 4, generator=_gen(12), dtype=dtype)
    cf = torch.compile(lambda a: birkhoff_project(a), fullgraph=True, backend="aot_eager")
    xc = x.clone().requires_grad_(True)
    tc = cf(xc)
    tc.backward(gr)
    xe = x.clone().requires_grad_(True)
    te = birkhoff_project(xe)
    te.backward(gr)
    assert torch.equal(tc.detach(), te.detach()) and torch.equal(xc.grad, xe.grad)


def test_layout_env_cache(monkeypatch):
    """The environment is read at each call; the name lookup is cached for the last value,
    a bad value raises at each call, and a value changed back is honoured."""
    from mhc_proj.birkhoff import LAYOUT_ENV, layout_code

    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    assert layout_code() == 7
    monkeypatch.setenv(LAYOUT_ENV, "thread")
    assert layout_code() == 1 and layout_code() == 1
    monkeypatch.setenv(LAYOUT_ENV, "lane")
    assert layout_code() == 0
    monkeypatch.setenv(LAYOUT_ENV, "")
    assert layout_code() == 7
    x = torch.randn(3, 4, 4, generator=_gen(13))
    monkeypatch.setenv(LAYOUT_ENV, "bogus")
    for _ in range(2):
        with pytest.raises(ValueError, match="Birkhoff layout"):
            birkhoff_project(x)
    monkeypatch.setenv(LAYOUT_ENV, "thread-c10")
    assert layout_code() == 5
    t5 = birkhoff_project(x * 10)
    monkeypatch.delenv(LAYOUT_ENV)
    from mhc_proj.birkhoff import birkhoff_fwd

    assert torch.equal(t5, birkhoff_fwd((x * 10).contiguous(), 4e-6, 30, False, layout=5)[0])


def test_functorch_transform_uses_function_apply():
    """Under a functorch transform the eager path goes through Function.apply (the C++
    apply is only taken outside transforms): the same error as Function.apply itself."""
    from mhc_proj.birkhoff import _BirkhoffProject

    x = torch.randn(3, 4, 4, generator=_gen(14))
    with pytest.raises(RuntimeError) as direct:
        torch.func.grad(lambda a: _BirkhoffProject.apply(a, torch.float32, 4e-6, 30, None).sum())(x)
    with pytest.raises(RuntimeError) as public:
        torch.func.grad(lambda a: birkhoff_project(a).sum())(x)
    assert str(public.value) == str(direct.value)


@pytest.mark.gpu
def test_cuda_side_stream_and_raw_stream_handle():
    """The launchers take the raw handle of the caller's current stream: results on a side
    stream (forward and backward) are bitwise those on the default stream."""
    from mhc_proj import _backend

    x = torch.randn(4099, 4, 4, generator=_gen(15)).cuda() * 3
    gr = torch.randn(4099, 4, 4, generator=_gen(16)).cuda()
    xd = x.clone().requires_grad_(True)
    t = birkhoff_project(xd)
    t.backward(gr)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        assert _backend.stream(x) == s.cuda_stream
        xs = x.clone().requires_grad_(True)
        ts = birkhoff_project(xs)
        ts.backward(gr)
    torch.cuda.current_stream().wait_stream(s)
    assert _backend.stream(x) == torch.cuda.current_stream().cuda_stream
    assert torch.equal(t.detach(), ts.detach()) and torch.equal(xd.grad, xs.grad)
