"""sinkhorn_project: the default kernels against the float64 reference iteration and, on a
GPU, the CUDA kernels against the CPU path (the same header code).

Kernels under test: the forward in the scaling form (P = P0 (.) r c^T, one vector rescaled
per step) and the backward that replays it in reciprocal form and runs the rescaled
adjoint's reverse sweep (``csrc/sinkhorn.h``), on the CPU for every n and dtype and on
CUDA for n = 4 float32; other CUDA cases run the same iteration in torch ops.

Bounds, against ``sinkhorn_project_ref`` in float64 (forward) and autograd through it
(backward): forward max |P - ref| < 2e-6 (median matrix < 3e-7 on the CPU, < 5e-7 on the
GPU); float64 <= 1e-13; backward: max |dA - ref| / max |ref| below ``bwd_bound`` (64 eps
max(1, max|x|): the kernels shift each row by its maximum, so the shifted logit carries an
absolute rounding error ~2 eps max|x| that exp turns into a relative error of every P
entry; x2 for the GPU's 1-ulp reciprocals; x16 for cancellation in the 16-term
reductions), on the CPU with a 3x margin; float64 <= 1e-13 relative. The CUDA test
measures against max |ref| floored at eps max(1, max|x|) max |P (.) G| (``grad_scale``: a
saturated matrix's gradient is below the float32 resolution of its terms).
"""

import pytest
import torch

from mhc_proj import sinkhorn_project, sinkhorn_project_ref
from mhc_proj.sinkhorn import _sinkhorn_bwd_torch, sinkhorn_bwd, sinkhorn_fwd

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
F32_EPS = torch.finfo(torch.float32).eps


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def ref_grad(x, gr, iters, eps):
    """Gradient of the float64 reference iteration (autograd through sinkhorn_project_ref)."""
    xr = x.detach().cpu().double().requires_grad_(True)
    sinkhorn_project_ref(xr, iters=iters, eps=eps).backward(gr.cpu().double())
    return xr.grad


def bwd_bound(x: torch.Tensor) -> float:
    """Bound on max|dA - ref| / max|ref| of a float32 backward on logits x (module docstring).
    Measured (CPU, the test grid below): <= 14.8 of these units for the previous kernels
    (batch 1, iters 1, sigma 10); at sigma 10 the bound is <= 3.8e-4, so an error of 1e-3
    (a wrong term, a wrong step) fails."""
    return 64 * F32_EPS * max(1.0, float(x.abs().max()))


def grad_scale(ref_grad_, p_ref, gr, x) -> float:
    """The magnitude a backward error is measured against: max |ref gradient|, floored at
    the float32 resolution of the terms the gradient is the difference of. dA = P (.) (G -
    alpha 1^T - 1 beta^T) sums terms up to max |P (.) G| (float64 reference P, upstream
    gradient G) and each float32 P entry carries a relative rounding of eps max(1, max|x|)
    (bwd_bound's unit), so dA is resolved only to eps max(1, max|x|) max |P (.) G|. Where P
    saturates to a permutation (logit std 100, one matrix) the exact gradient (1e-9..1e-41)
    is below that and the relative bound measured rounding noise; elsewhere the floor is far
    below max |ref| and changes nothing (test_bwd_scale_floor_rejects_wrong_gradients)."""
    terms = (p_ref.detach().double() * gr.detach().cpu().double()).abs().max()
    floor = F32_EPS * max(1.0, float(x.abs().max())) * float(terms)
    return max(float(ref_grad_.abs().max()), floor)


def _per_matrix(d, ref):
    den = ref.abs().flatten(1).amax(1).clamp_min(1e-30)
    return (d.double() - ref).abs().flatten(1).amax(1) / den


# ---------------------------------------------------------------- forward and backward
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [2, 4, 7])
@pytest.mark.parametrize("iters", [1, 3, 20, 33])
def test_forward_backward_vs_reference(device, n, iters):
    g = _gen(n * 100 + iters)
    x = torch.randn(300, n, n, generator=g) * 3
    gr = torch.randn(300, n, n, generator=g)
    xd = x.clone().to(device).requires_grad_(True)
    p = sinkhorn_project(xd, iters=iters)
    p.backward(gr.to(device))
    xr = x.detach().double().requires_grad_(True)
    pr = sinkhorn_project_ref(xr, iters=iters)
    pr.backward(gr.double())
    assert p.dtype == torch.float32
    assert (p.detach().cpu().double() - pr.detach()).abs().max() < 1e-5
    rel = (xd.grad.cpu().double() - xr.grad).abs().max() / xr.grad.abs().max()
    assert rel < 1e-4


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("sigma", [1.0, 10.0])
def test_cpu_forward_vs_reference(n, iters, sigma):
    g = _gen(13 * n + iters + int(sigma))
    x = torch.randn(4001, n, n, generator=g) * sigma
    ref = sinkhorn_project_ref(x.double(), iters=iters, eps=1e-6)
    p = sinkhorn_fwd(x, iters, 1e-6)
    assert p.dtype == torch.float32 and torch.isfinite(p).all()
    err = (p.double() - ref).abs().amax((1, 2))
    # measured (4000 matrices): max <= 4.2e-7, median <= 1.3e-7
    assert float(err.max()) < 2e-6
    assert float(err.median()) < 3e-7
    p64 = sinkhorn_fwd(x.double(), iters, 1e-6)
    assert float((p64 - ref).abs().max()) < 1e-13


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("iters", [1, 20, 33])
@pytest.mark.parametrize("sigma", [1.0, 10.0, 100.0, 1e4])
@pytest.mark.parametrize("eps", [1e-6, 1e-2, 1e-20])
def test_cpu_forward_huge_logits_and_tiny_eps(n, iters, sigma, eps):
    """Measured (4000 matrices per case): max <= 6e-7 (eps = 1e-20 at sigma 100), <= 3e-7
    for eps >= 1e-6; finite everywhere. Not included: eps = 0 with logits so large that a
    whole float32 softmax line underflows to 0 (the test below)."""
    g = _gen(n + 7 * iters + int(sigma) % 101)
    x = torch.randn(4000, n, n, generator=g) * sigma
    ref = sinkhorn_project_ref(x.double(), iters=iters, eps=eps)
    assert torch.isfinite(ref).all()
    p = sinkhorn_fwd(x, iters, eps).double()
    assert torch.isfinite(p).all()
    assert float((p - ref).abs().max()) < 1.5e-6


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("iters", [1, 2, 3, 20, 33])
@pytest.mark.parametrize("eps", [0.0, 1e-6, 1e-2])
def test_cpu_backward_float64_exact(n, iters, eps):
    g = _gen(n * 100 + iters)
    x = torch.randn(301, n, n, generator=g, dtype=torch.float64) * 4
    gr = torch.randn(301, n, n, generator=g, dtype=torch.float64)
    ref = ref_grad(x, gr, iters, eps)
    d = sinkhorn_bwd(x, gr, iters, eps)
    assert float((d - ref).abs().max() / ref.abs().max()) <= 1e-13


@pytest.mark.parametrize("batch", [1, 3, 127, 10001])
@pytest.mark.parametrize("iters", [1, 3, 20, 33])
@pytest.mark.parametrize("sigma", [1.0, 3.0, 10.0, 100.0])
def test_cpu_backward_within_rounding_bound(batch, iters, sigma):
    """The CPU backward sits well inside bwd_bound (3x margin), its median matrix within
    1e-6; for logit std <= 10 a gradient off by 1e-3 of its scale does not pass the bound."""
    g = _gen(batch + iters)
    x = torch.randn(batch, 4, 4, generator=g) * sigma
    gr = torch.randn(batch, 4, 4, generator=g)
    ref = ref_grad(x, gr, iters, 1e-6)
    d = sinkhorn_bwd(x, gr, iters, 1e-6).double()
    assert torch.isfinite(d).all()
    scale = ref.abs().max()
    bound = bwd_bound(x)
    assert float((d - ref).abs().max() / scale) < bound / 3
    if sigma > 10:
        return  # the bound (64 eps max|x|) exceeds 1e-3 for logits of std 100
    if batch >= 127:
        assert float(_per_matrix(d, ref).median()) < 1e-6
    bad = d.clone()
    bad.view(-1)[bad.abs().argmax()] += 1e-3 * scale
    assert float((bad - ref).abs().max() / scale) > bound
    assert float((d * (1 + 1e-3) - ref).abs().max() / scale) > bound


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_cpu_backward_edge_cases(n):
    """Large logits (underflowing softmax entries), eps 1e-2 and 1e-9: finite and within the
    bound; an empty batch; a zero gradient gives exactly 0."""
    g = _gen(n)
    for sigma, eps in [(30.0, 1e-6), (100.0, 1e-6), (1.0, 1e-2), (3.0, 1e-9)]:
        x = torch.randn(513, n, n, generator=g) * sigma
        gr = torch.randn(513, n, n, generator=g)
        ref = ref_grad(x, gr, 20, eps)
        d = sinkhorn_bwd(x, gr, 20, eps).double()
        assert torch.isfinite(d).all()
        assert float((d - ref).abs().max() / ref.abs().max()) < bwd_bound(x), (sigma, eps)
    e = sinkhorn_bwd(torch.empty(0, n, n), torch.empty(0, n, n), 20, 1e-6)
    assert e.shape == (0, n, n)
    z = sinkhorn_bwd(x, torch.zeros_like(x), 20, 1e-6)
    assert float(z.abs().max()) == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sigma", [1.0, 3.0, 10.0])
def test_eps_zero(device, sigma):
    """eps = 0 (not the DeepSeek default, but allowed; the log-domain iteration in torch
    ops): forward and backward finite and within the float32 bounds of the float64
    iteration."""
    g = _gen(int(sigma) + 50)
    x = torch.randn(10001, 4, 4, generator=g) * sigma
    gr = torch.randn(10001, 4, 4, generator=g)
    xd = x.clone().to(device).requires_grad_(True)
    p = sinkhorn_project(xd, eps=0.0)
    p.backward(gr.to(device))
    pr = sinkhorn_project_ref(x.double(), eps=0.0)
    ref = ref_grad(x, gr, 20, 0.0)
    bound = bwd_bound(x)
    assert torch.isfinite(p).all() and torch.isfinite(xd.grad).all()
    assert float((p.detach().cpu().double() - pr).abs().max()) < 2e-6
    assert float((xd.grad.cpu().double() - ref).abs().max() / ref.abs().max()) < bound


@pytest.mark.parametrize("shape", [(3, 5, 4, 4), (2, 1, 7, 4, 4), (4, 4), (5, 3, 3)])
@pytest.mark.parametrize("sigma", [1.0, 10.0])
def test_leading_dims_through_autograd(shape, sigma):
    """sinkhorn_project (eager) and the custom op with its registered autograd give the
    launchers' results for leading dims, in the input's shape."""
    g = _gen(len(shape) * 10 + int(sigma))
    x = torch.randn(*shape, generator=g) * sigma
    gr = torch.randn(*shape, generator=g)
    n = shape[-1]
    xd = x.clone().requires_grad_(True)
    p = sinkhorn_project(xd)
    p.backward(gr)
    assert p.shape == x.shape and xd.grad.shape == x.shape
    x3, g3 = x.reshape(-1, n, n), gr.reshape(-1, n, n)
    assert torch.equal(p.detach().reshape(-1, n, n), sinkhorn_fwd(x3, 20, 1e-6))
    assert torch.equal(xd.grad.reshape(-1, n, n), sinkhorn_bwd(x3, g3, 20, 1e-6))
    xo = x3.clone().requires_grad_(True)
    po = torch.ops.mhc_proj.sinkhorn_fwd.default(xo, 20, 1e-6)
    po.backward(g3)
    assert torch.equal(po.detach(), p.detach().reshape(-1, n, n))
    assert torch.equal(xo.grad, xd.grad.reshape(-1, n, n))
    ref = ref_grad(x, gr, 20, 1e-6)
    assert float((xd.grad.double() - ref).abs().max() / ref.abs().max()) < bwd_bound(x) / 3


def test_float64_and_half_inputs():
    x = torch.randn(65, 4, 4, generator=_gen(3)) * 2
    p64 = sinkhorn_project(x.double())
    assert p64.dtype == torch.float64
    assert float((p64 - sinkhorn_project_ref(x.double())).abs().max()) < 1e-13
    for dt in (torch.bfloat16, torch.float16):
        # computed in float32; returned in the input dtype, or float32 on request (#20)
        ph = sinkhorn_project(x.to(dt), out_dtype=torch.float32)
        assert ph.dtype == torch.float32
        ref = sinkhorn_project_ref(x.to(dt).double())
        assert float((ph.double() - ref).abs().max()) < 2e-6
        pl = sinkhorn_project(x.to(dt))
        assert pl.dtype == dt and torch.equal(pl, ph.to(dt))


def test_gradcheck_float64():
    x = torch.randn(3, 4, 4, dtype=torch.float64, generator=_gen(4)).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a: sinkhorn_project(a, iters=6, eps=1e-3), (x,))


def test_opcheck():
    x = torch.randn(5, 4, 4, generator=_gen(5))
    torch.library.opcheck(torch.ops.mhc_proj.sinkhorn_fwd.default, (x, 20, 1e-6))
    torch.library.opcheck(
        torch.ops.mhc_proj.sinkhorn_bwd.default, (x, torch.randn_like(x), 20, 1e-6)
    )


def test_torch_fallback_backward_matches_kernel():
    """The torch-op backward (CUDA cases without a kernel) is the same VJP."""
    for n, iters in [(2, 1), (4, 20), (7, 3)]:
        x = torch.randn(50, n, n, dtype=torch.float64, generator=_gen(n))
        g = torch.randn_like(x)
        d = _sinkhorn_bwd_torch(x, g, iters, 1e-6)
        assert float((d - sinkhorn_bwd(x, g, iters, 1e-6)).abs().max()) < 1e-12


def test_large_logits_not_doubly_stochastic():
    # documents why the exact projection exists: Sinkhorn-20 is far off at sigma = 10
    x = torch.randn(2000, 4, 4, generator=_gen(0)) * 10
    p = sinkhorn_project(x)
    err = (p.sum(-1) - 1).abs().sum(-1) + (p.sum(-2) - 1).abs().sum(-1)
    assert float(err.median()) > 1e-3


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"iters": 0}, r"iters must be an integer in 1..10000; got 0"),
        ({"iters": 2.5}, r"iters must be an integer in 1..10000; got 2.5"),
        ({"iters": 10**6}, r"iters must be an integer in 1..10000; got 1000000"),
        ({"eps": -1.0}, r"eps must be in 0 <= eps <= 1; got -1.0"),
        ({"eps": float("nan")}, r"eps must be in 0 <= eps <= 1; got nan"),
        ({"eps": float("inf")}, r"eps must be in 0 <= eps <= 1; got inf"),
        # found by test_fuzz.py: a finite eps of 3.4e38 overflowed the sums to NaN
        ({"eps": 3.4e38}, r"eps must be in 0 <= eps <= 1; got 3.4e\+38"),
        ({"out_dtype": torch.int64}, r"out_dtype must be None or one of"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sinkhorn_project(torch.zeros(2, 4, 4), **kwargs)


# ---------------------------------------------------------------- GPU: CUDA vs CPU, float64
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 129, 65537])
@pytest.mark.parametrize("iters", [1, 2, 3, 20, 33])
@pytest.mark.parametrize("sigma", [1.0, 10.0, 100.0])
def test_cuda_vs_reference_and_cpu(batch, iters, sigma):
    """The CUDA forward (iters = 20 unrolled, others a run-time loop) and backward (iters =
    20: 27 of the 39 step vectors in shared memory; other iters: the run-time-count kernel)
    against float64 and the CPU path (IEEE reciprocals where the GPU uses MUFU.RCP)."""
    g = _gen(batch + 7 * iters)
    x = torch.randn(batch, 4, 4, generator=g) * sigma
    gr = torch.randn(batch, 4, 4, generator=g)
    xc, gc = x.cuda(), gr.cuda()
    ref = sinkhorn_project_ref(x.double(), iters=iters, eps=1e-6)
    p = sinkhorn_fwd(xc, iters, 1e-6).cpu().double()
    assert torch.isfinite(p).all()
    err = (p - ref).abs().amax((1, 2))
    assert float(err.max()) < 2e-6
    if batch >= 100:
        assert float(err.median()) < 5e-7
    assert float((p - sinkhorn_fwd(x, iters, 1e-6).double()).abs().max()) < 2e-6
    dref = ref_grad(x, gr, iters, 1e-6)
    scale = grad_scale(dref, ref, gr, x)  # (sigma 100, batch 1: max |dref| is 1e-9..1e-41)
    bound = bwd_bound(x)
    d = sinkhorn_bwd(xc, gc, iters, 1e-6).cpu().double()
    assert torch.isfinite(d).all()
    assert float((d - dref).abs().max() / scale) < bound
    cpu = sinkhorn_bwd(x, gr, iters, 1e-6).double()
    assert float((d - cpu).abs().max() / scale) < bound
    if batch >= 100 and sigma <= 10:
        assert float(_per_matrix(d, dref).median()) < 2e-6


@pytest.mark.parametrize("iters", [1, 2, 3, 20, 33])
@pytest.mark.parametrize("sigma", [1.0, 10.0, 100.0])
def test_bwd_scale_floor_rejects_wrong_gradients(sigma, iters):
    """grad_scale on the CUDA test's single matrices (its seeds), with the CPU backward in
    the CUDA backward's place. At logit std 100 max |ref| is 6e-12..3e-41 and the CPU path
    fails the plain relative bound (iters 3, 33); with the floor it passes. The floor only
    applies there (std 1, 10: the scale is max |ref|), and a wrong gradient still fails: one
    entry off by 5 bounds of the scale (at std 100, saturated: 5e-7 absolute), the VJP without its
    potential terms (P (.) G), a 1e-3 relative error and a zero gradient (std <= 10)."""
    g = _gen(1 + 7 * iters)
    x = torch.randn(1, 4, 4, generator=g) * sigma
    gr = torch.randn(1, 4, 4, generator=g)
    p_ref = sinkhorn_project_ref(x.double(), iters=iters, eps=1e-6)
    dref = ref_grad(x, gr, iters, 1e-6)
    scale, bound = grad_scale(dref, p_ref, gr, x), bwd_bound(x)
    d = sinkhorn_bwd(x, gr, iters, 1e-6).double()
    assert float((d - dref).abs().max()) < bound * scale / 3
    bad = d.clone()
    bad.view(-1)[0] += 5 * bound * scale
    assert float((bad - dref).abs().max()) > bound * scale
    assert float((p_ref * gr.double() - dref).abs().max()) > bound * scale
    if sigma <= 10:
        assert scale == float(dref.abs().max())
        assert float(dref.abs().max()) > bound * scale
        assert float((d * (1 + 1e-3) - dref).abs().max()) > bound * scale
    else:  # the floor stays at float32 resolution (5e-5 here): 5 bounds of it are 5e-7
        assert scale == float(dref.abs().max()) or scale < 1e-4


@pytest.mark.gpu
def test_cuda_large_batch():
    """4M + 77 matrices: the grid, 64-bit offsets and the tail block, checked on slices
    against the CPU path (each matrix is computed independently)."""
    b = (1 << 22) + 77
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(b, 4, 4, device="cuda", generator=g)
    gr = torch.randn(b, 4, 4, device="cuda", generator=g)
    p = sinkhorn_fwd(x, 20, 1e-6)
    d = sinkhorn_bwd(x, gr, 20, 1e-6)
    assert torch.isfinite(p).all() and torch.isfinite(d).all()
    for sl in (slice(0, 1000), slice(b // 2, b // 2 + 1000), slice(b - 1000, b)):
        xs, gs = x[sl].cpu(), gr[sl].cpu()
        assert float((p[sl].cpu() - sinkhorn_fwd(xs, 20, 1e-6)).abs().max()) < 2e-6
        dc = sinkhorn_bwd(xs, gs, 20, 1e-6)
        assert float((d[sl].cpu() - dc).abs().max() / dc.abs().max()) < 2 * bwd_bound(xs)


@pytest.mark.gpu
def test_cuda_through_autograd_leading_dims_and_op():
    g = _gen(11)
    x = torch.randn(3, 1667, 4, 4, generator=g) * 2
    gr = torch.randn(3, 1667, 4, 4, generator=g)
    ref = ref_grad(x, gr, 20, 1e-6)
    xd = x.cuda().requires_grad_(True)
    p = sinkhorn_project(xd)
    p.backward(gr.cuda())
    assert xd.grad.shape == x.shape
    assert float((xd.grad.cpu().double() - ref).abs().max() / ref.abs().max()) < 2e-5
    x3, g3 = x.reshape(-1, 4, 4).cuda(), gr.reshape(-1, 4, 4).cuda()
    op = torch.ops.mhc_proj.sinkhorn_bwd.default(x3, g3, 20, 1e-6)
    assert torch.equal(op, xd.grad.reshape(-1, 4, 4))
    assert torch.equal(
        torch.ops.mhc_proj.sinkhorn_fwd.default(x3, 20, 1e-6), p.detach().reshape(-1, 4, 4)
    )


@pytest.mark.gpu
def test_cuda_graph_replay():
    """Forward and backward captured in a CUDA graph (after a warm-up on a side stream) and
    replayed on new logits equal eager calls on them, bit for bit."""
    xs = torch.randn(5000, 4, 4, device="cuda") * 2
    gs = torch.randn_like(xs)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sinkhorn_bwd(xs, gs, 20, 1e-6)
        sinkhorn_fwd(xs, 20, 1e-6)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pg = sinkhorn_fwd(xs, 20, 1e-6)
        dg = sinkhorn_bwd(xs, gs, 20, 1e-6)
    xs.copy_(torch.randn_like(xs))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pg, sinkhorn_fwd(xs, 20, 1e-6))
    assert torch.equal(dg, sinkhorn_bwd(xs, gs, 20, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,dtype,iters",
    [
        (2, torch.float32, 20),
        (5, torch.float32, 3),
        (8, torch.float32, 20),
        (4, torch.float64, 20),
        (4, torch.float32, 65),
    ],
)
def test_cuda_cases_without_a_kernel(n, dtype, iters):
    """n != 4, float64 or iters > 64 on CUDA: the iteration in torch ops inside the op,
    against the CPU kernels and float64."""
    g = _gen(n + iters)
    x = (torch.randn(1001, n, n, generator=g) * 3).to(dtype)
    gr = torch.randn(1001, n, n, generator=g).to(dtype)
    xd = x.cuda().requires_grad_(True)
    p = sinkhorn_project(xd, iters=iters)
    p.backward(gr.cuda())
    pr = sinkhorn_project_ref(x.double(), iters=iters)
    ref = ref_grad(x, gr, iters, 1e-6)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert float((p.detach().cpu().double() - pr).abs().max()) < tol
    bound = 1e-12 if dtype == torch.float64 else bwd_bound(x)
    assert float((xd.grad.cpu().double() - ref).abs().max() / ref.abs().max()) < bound


@pytest.mark.parametrize("device", DEVICES)
def test_eps_zero_huge_logits_finite(device):
    """#29 defect 4: sinkhorn_project(x, 20, eps=0.0) returned NaN for 947 of 4096 finite
    float32 matrices at N(0, 100^2) (a column of exp(a) underflows: 0 / 0), where float64
    and TileKernels' float32 code are finite on most. The log-domain iteration is finite on
    all, equal to the float64 iteration where that is finite, and so is its backward."""
    g = _gen(4096)
    x = torch.randn(4096, 4, 4, generator=g) * 100
    gr = torch.randn(4096, 4, 4, generator=g)
    xd = x.clone().to(device).requires_grad_(True)
    p = sinkhorn_project(xd, 20, eps=0.0)
    p.backward(gr.to(device))
    assert bool(torch.isfinite(p).all()) and bool(torch.isfinite(xd.grad).all())
    ref = sinkhorn_project_ref(x.double(), 20, 0.0)
    fin = torch.isfinite(ref).flatten(1).all(1)
    assert float(fin.double().mean()) > 0.95
    assert float((p.detach().cpu().double() - ref)[fin].abs().max()) < 1e-4
    sub = x[fin][:64].double().requires_grad_(True)
    (r_grad,) = torch.autograd.grad((sinkhorn_project_ref(sub, 20, 0.0) * gr[fin][:64]).sum(), sub)
    ours = xd.grad.cpu()[fin][:64].double()
    assert float((ours - r_grad).abs().max() / r_grad.abs().max()) < 1e-3
    assert torch.autograd.gradgradcheck(lambda a: sinkhorn_project(a, 3, 0.0), (sub[:2],))


@pytest.mark.parametrize("fn", ["sinkhorn", "birkhoff"])
def test_compile_dynamic_fullgraph(fn):
    """#29 defect 5: torch.compile(sinkhorn_project, fullgraph=True, dynamic=True) failed
    ("torch.* op returned non-Tensor": math.isfinite of a SymFloat eps in the argument
    check). Compiled with dynamic shapes and float arguments, it equals eager on two shapes
    and two option values, without a graph break."""
    from mhc_proj import birkhoff_project

    torch._dynamo.reset()
    if fn == "sinkhorn":
        calls = [
            ((torch.randn(8, 4, 4),), dict(iters=20, eps=1e-6)),
            ((torch.randn(5, 3, 3),), dict(iters=7, eps=2e-3)),
        ]
        f = sinkhorn_project
    else:
        calls = [
            ((torch.randn(8, 4, 4),), dict(tol=4e-6)),
            ((torch.randn(5, 3, 3),), dict(tol=1e-5)),
        ]
        f = birkhoff_project
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for args, kw in calls:
        assert torch.equal(compiled(*args, **kw), f(*args, **kw))
