"""sinkhorn_project: the fused Sinkhorn-k against the plain torch reference."""

import pytest
import torch

from mhc_proj import sinkhorn_project, sinkhorn_project_ref
from mhc_proj.sinkhorn import sinkhorn_fwd

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [2, 4, 7])
@pytest.mark.parametrize("iters", [1, 3, 20, 33])
def test_forward_backward_vs_reference(device, n, iters):
    g = torch.Generator().manual_seed(n * 100 + iters)
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


def test_gradcheck_float64():
    x = torch.randn(3, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: sinkhorn_project(a, iters=6, eps=1e-3), (x,))


def test_opcheck():
    x = torch.randn(5, 4, 4)
    torch.library.opcheck(torch.ops.mhc_proj.sinkhorn_fwd.default, (x, 20, 1e-6))
    torch.library.opcheck(
        torch.ops.mhc_proj.sinkhorn_bwd.default, (x, torch.randn_like(x), 20, 1e-6)
    )


def test_large_logits_not_doubly_stochastic():
    # documents why the exact projection exists: Sinkhorn-20 is far off at sigma = 10
    x = torch.randn(2000, 4, 4, generator=torch.Generator().manual_seed(0)) * 10
    p = sinkhorn_project(x)
    err = (p.sum(-1) - 1).abs().sum(-1) + (p.sum(-2) - 1).abs().sum(-1)
    assert float(err.median()) > 1e-3


@pytest.mark.gpu
def test_cuda_variants_agree():
    x = torch.randn(10001, 4, 4, device="cuda") * 2
    a = sinkhorn_fwd(x, 20, 1e-6, variant=0)
    b = sinkhorn_fwd(x, 20, 1e-6, variant=1)
    c = sinkhorn_fwd(x.cpu(), 20, 1e-6)
    assert (a - b).abs().max() < 1e-5
    assert (a.cpu() - c).abs().max() < 1e-5


def test_torch_fallback_backward_matches_kernel():
    from mhc_proj.sinkhorn import _sinkhorn_bwd_torch, sinkhorn_bwd

    for n, iters in [(2, 1), (4, 20), (7, 3)]:
        x = torch.randn(50, n, n, dtype=torch.float64)
        g = torch.randn_like(x)
        assert (
            _sinkhorn_bwd_torch(x, g, iters, 1e-6) - sinkhorn_bwd(x, g, iters, 1e-6)
        ).abs().max() < 1e-12


# ---------------------------------------------------------------- backward kernels
# The CPU backward runs the shared header's recompute formulation (sinkhorn_vjp_scaling),
# the code of the CUDA thread-per-matrix kernel; float64 pins its math to autograd.
@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("iters", [1, 2, 7, 20])
@pytest.mark.parametrize("eps", [0.0, 1e-6, 1e-2])
def test_cpu_backward_float64_matches_autograd(n, iters, eps):
    from mhc_proj.sinkhorn import sinkhorn_bwd

    g = torch.Generator().manual_seed(7 * n + iters)
    x = torch.randn(64, n, n, generator=g, dtype=torch.float64) * 2
    gr = torch.randn(64, n, n, generator=g, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    sinkhorn_project_ref(xr, iters=iters, eps=eps).backward(gr)
    d = sinkhorn_bwd(x, gr, iters, eps)
    assert (d - xr.grad).abs().max() <= 1e-12 * xr.grad.abs().max()


@pytest.mark.parametrize("sigma", [1.0, 10.0])
def test_cpu_backward_float32_accuracy(sigma):
    # fp32 recompute vs the float64 autograd reference, per matrix
    from mhc_proj.sinkhorn import sinkhorn_bwd

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4000, 4, 4, generator=g) * sigma
    gr = torch.randn(4000, 4, 4, generator=g)
    xr = x.double().requires_grad_(True)
    sinkhorn_project_ref(xr, iters=20, eps=1e-6).backward(gr.double())
    d = sinkhorn_bwd(x, gr, 20, 1e-6).double()
    assert (d - xr.grad).abs().max() < 2e-6 * xr.grad.abs().max()
    rel = (d - xr.grad).abs().amax((1, 2)) / xr.grad.abs().amax((1, 2))
    assert float(rel.median()) < 1e-6


def test_bwd_variant_selection(monkeypatch):
    from mhc_proj.sinkhorn import BWD_ENV, bwd_variant_code, sinkhorn_bwd

    monkeypatch.delenv(BWD_ENV, raising=False)
    assert bwd_variant_code() == 1  # thread per matrix: measured faster on the H200
    assert bwd_variant_code("thread") == 1
    monkeypatch.setenv(BWD_ENV, "thread")
    assert bwd_variant_code() == 1
    assert bwd_variant_code("lane") == 0
    monkeypatch.setenv(BWD_ENV, "warp")
    x = torch.randn(3, 4, 4)
    with pytest.raises(ValueError, match="backward variant"):
        sinkhorn_bwd(x, x, 20, 1e-6)
    with pytest.raises(ValueError, match="backward variant"):
        sinkhorn_bwd(x, x, 20, 1e-6, variant="warp")
    # the CPU path has one implementation: both names give the same result
    monkeypatch.delenv(BWD_ENV)
    gr = torch.randn_like(x)
    assert torch.equal(
        sinkhorn_bwd(x, gr, 20, 1e-6, variant="lane"),
        sinkhorn_bwd(x, gr, 20, 1e-6, variant="thread"),
    )


def _ref_grad(x, gr, iters, eps):
    xr = x.detach().cpu().double().requires_grad_(True)
    sinkhorn_project_ref(xr, iters=iters, eps=eps).backward(gr.cpu().double())
    return xr.grad


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 127, 10001, 65537])
@pytest.mark.parametrize("iters", [1, 3, 20, 33])
@pytest.mark.parametrize("sigma", [1.0, 3.0, 10.0])
def test_cuda_bwd_kernels_vs_reference(batch, iters, sigma):
    """Both CUDA backward kernels (lane = 16 lanes per matrix, thread = thread per matrix,
    recompute) against the float64 autograd reference, and against each other."""
    from mhc_proj.sinkhorn import sinkhorn_bwd

    g = torch.Generator().manual_seed(batch + iters)
    x = torch.randn(batch, 4, 4, generator=g) * sigma
    gr = torch.randn(batch, 4, 4, generator=g)
    ref = _ref_grad(x, gr, iters, 1e-6)
    xc, gc = x.cuda(), gr.cuda()
    lane = sinkhorn_bwd(xc, gc, iters, 1e-6, variant="lane").cpu().double()
    thread = sinkhorn_bwd(xc, gc, iters, 1e-6, variant="thread").cpu().double()
    cpu = sinkhorn_bwd(x, gr, iters, 1e-6).double()  # the thread kernel's code on the CPU
    scale = ref.abs().max()
    for name, d in [("lane", lane), ("thread", thread)]:
        assert torch.isfinite(d).all(), name
        err = float((d - ref).abs().max() / scale)
        assert err < 2e-5, (name, err)
        if batch >= 100:  # a median over one matrix is its max, bounded just above
            rel = (d - ref).abs().amax((1, 2)) / ref.abs().amax((1, 2))
            assert float(rel.median()) < 2e-6, (name, float(rel.median()))
    assert float((thread - lane).abs().max() / scale) < 2e-5
    assert float((thread - cpu).abs().max() / scale) < 2e-5


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["lane", "thread"])
def test_cuda_bwd_variant_through_autograd(monkeypatch, variant):
    """MHC_PROJ_SINKHORN_BWD selects the kernel for sinkhorn_project's backward (eager and
    the custom op), and the benchmark's explicit selection gives the same gradient."""
    from mhc_proj.sinkhorn import BWD_ENV, _project

    monkeypatch.setenv(BWD_ENV, variant)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5000, 4, 4, generator=g) * 2
    gr = torch.randn(5000, 4, 4, generator=g)
    ref = _ref_grad(x, gr, 20, 1e-6)
    xd = x.cuda().requires_grad_(True)
    sinkhorn_project(xd).backward(gr.cuda())
    op = torch.ops.mhc_proj.sinkhorn_bwd.default(x.cuda(), gr.cuda(), 20, 1e-6)
    monkeypatch.delenv(BWD_ENV)
    xe = x.cuda().requires_grad_(True)
    _project(xe, 20, 1e-6, bwd_variant=variant).backward(gr.cuda())
    scale = ref.abs().max()
    for d in (xd.grad, op, xe.grad):
        assert float((d.cpu().double() - ref).abs().max() / scale) < 2e-5
    assert torch.equal(xd.grad, xe.grad)


@pytest.mark.gpu
def test_cuda_thread_bwd_large_batch_agrees_with_lane():
    # 4M matrices: grid and 64-bit indexing of the thread kernel, odd tail block
    from mhc_proj.sinkhorn import sinkhorn_bwd

    b = (1 << 22) + 77
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(b, 4, 4, device="cuda", generator=g)
    gr = torch.randn(b, 4, 4, device="cuda", generator=g)
    lane = sinkhorn_bwd(x, gr, 20, 1e-6, variant="lane")
    thread = sinkhorn_bwd(x, gr, 20, 1e-6, variant="thread")
    assert torch.isfinite(thread).all()
    assert float((thread - lane).abs().max() / lane.abs().max()) < 2e-5
