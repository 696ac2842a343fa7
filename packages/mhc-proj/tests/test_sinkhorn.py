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
