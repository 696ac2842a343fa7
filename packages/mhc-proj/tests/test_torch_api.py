"""mhc_proj.torch and MHCProjectionN4 / N8: the API of the mHC paper's own mhc_proj 0.1.0
(same import name, #29) as thin aliases of birkhoff_project: the paper's README calls run
unchanged (on the CPU too) and give this package's projection and implicit VJP."""

import pytest
import torch

import mhc_proj
from mhc_proj import MHCProjectionN4, MHCProjectionN8, birkhoff_project, marginal_error
from mhc_proj.reference import birkhoff_project_ref, birkhoff_vjp_ref

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "n,module,fwd,bwd",
    [
        (4, MHCProjectionN4, "birkhoff_proj_n4", "birkhoff_proj_n4_backward"),
        (8, MHCProjectionN8, "birkhoff_proj_n8", "birkhoff_proj_n8_backward"),
    ],
)
def test_paper_api(device, n, module, fwd, bwd):
    g = torch.Generator().manual_seed(123)
    x = torch.randn(2, n, n, generator=g).to(device)
    gr = torch.randn(2, n, n, generator=g).to(device)
    # the paper README's module call
    xr = x.clone().requires_grad_(True)
    p2 = module(tol=1e-6)(xr)
    torch.sum(gr * p2).backward()
    ours = x.clone().requires_grad_(True)
    t = birkhoff_project(ours, tol=1e-6)
    torch.sum(gr * t).backward()
    assert torch.equal(p2, t) and torch.equal(xr.grad, ours.grad)
    assert float(marginal_error(p2.detach()).max()) <= 1e-6
    assert float((p2.detach().cpu().double() - birkhoff_project_ref(x.cpu())).abs().max()) <= 1e-6
    # and its low-level functions
    p3 = getattr(mhc_proj.torch, fwd)(x, tol=1e-6)["T"]
    d3 = getattr(mhc_proj.torch, bwd)(gr, p3)["D"]
    assert torch.equal(p3, t.detach()) and not p3.requires_grad
    assert torch.equal(d3, ours.grad)
    ref = birkhoff_vjp_ref(birkhoff_project_ref(x.cpu()), gr.cpu())
    assert float((d3.cpu().double() - ref).abs().max() / ref.abs().max()) <= 1e-4
    # leading dims (the paper's module keeps the input's shape)
    y = torch.randn(3, 2, n, n, generator=g).to(device)
    assert module()(y).shape == y.shape


def test_paper_api_bad_input():
    with pytest.raises(ValueError, match="must end with dimensions 4 x 4"):
        MHCProjectionN4()(torch.randn(2, 3, 3))
    with pytest.raises(ValueError, match="must end with dimensions 8 x 8"):
        mhc_proj.torch.birkhoff_proj_n8(torch.randn(2, 4, 4))
    with pytest.raises(TypeError, match="floating-point"):
        mhc_proj.torch.birkhoff_proj_n4(torch.zeros(2, 4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="tol"):
        MHCProjectionN4(tol=0.0)
    with pytest.raises(ValueError, match="same shape"):
        mhc_proj.torch.birkhoff_proj_n4_backward(torch.randn(3, 4, 4), torch.rand(2, 4, 4))
