"""Shared by the Sinkhorn-k backward tests (test_sinkhorn_rescaled.py, test_sinkhorn_recip.py):
the float64 oracle, the float32 rounding bound and the CUDA-graph replay check."""

import torch

from mhc_proj import sinkhorn_project_ref
from mhc_proj.sinkhorn import sinkhorn_bwd

F32_EPS = torch.finfo(torch.float32).eps


def ref_grad(x, gr, iters, eps):
    """Gradient of the float64 reference iteration (autograd through sinkhorn_project_ref)."""
    xr = x.detach().cpu().double().requires_grad_(True)
    sinkhorn_project_ref(xr, iters=iters, eps=eps).backward(gr.cpu().double())
    return xr.grad


def bwd_bound(x: torch.Tensor) -> float:
    """tests/test_sinkhorn.py's bound: 64 eps_f32 max(1, max|x|) of max|ref|."""
    return 64 * F32_EPS * max(1.0, float(x.abs().max()))


def assert_graph_replay_matches(xs, gs, variant):
    """The backward ``variant`` captured in a CUDA graph (after a warm-up on a side stream)
    and replayed on new logits equals an eager call on them, bit for bit."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sinkhorn_bwd(xs, gs, 20, 1e-6, variant=variant)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dg = sinkhorn_bwd(xs, gs, 20, 1e-6, variant=variant)
    xs.copy_(torch.randn_like(xs))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dg, sinkhorn_bwd(xs, gs, 20, 1e-6, variant=variant))
