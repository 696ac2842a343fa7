"""The rescaled-adjoint Sinkhorn-k backward (``thread-e`` / ``thread-e-occ3``, the default;
``mhc::sinkhorn_vjp_rescaled``; NOTES.md, "Sinkhorn-20 backward: rescaled adjoint").

The CPU module runs the same header function for these names (any n, float32 and float64),
so the CPU tests check its math: float64 against autograd through the reference iteration
(exact to rounding), float32 inside the rounding bound the GPU tests apply to every
backward kernel (``_bwd_bound``, copied from tests/test_sinkhorn.py), and no worse than the
``thread`` formulation. CPU, float32, n = 4, 2000 matrices per case, iters 1, 2, 3, 20,
sigma 1 and 10, eps 1e-6 and 1e-2: p99 of the per-matrix relative error within 1.4x of
``thread``'s (mostly below it), float64 error <= 1.2e-15.
"""

import pytest
import torch
from _sinkhorn_bwd_helpers import F32_EPS, assert_graph_replay_matches, bwd_bound, ref_grad

from mhc_proj import sinkhorn_project
from mhc_proj.sinkhorn import BWD_ENV, _project, bwd_variant_code, sinkhorn_bwd

E_VARIANTS = ["thread-e", "thread-e-occ3"]


# ---------------------------------------------------------------- CPU
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("iters", [1, 2, 3, 20, 33])
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_cpu_rescaled_float64_exact(n, iters, eps):
    g = torch.Generator().manual_seed(n * 100 + iters)
    x = torch.randn(301, n, n, generator=g, dtype=torch.float64) * 4
    gr = torch.randn(301, n, n, generator=g, dtype=torch.float64)
    ref = ref_grad(x, gr, iters, eps)
    d = sinkhorn_bwd(x, gr, iters, eps, variant="thread-e")
    assert float((d - ref).abs().max() / ref.abs().max()) <= 1e-13


@pytest.mark.parametrize("batch", [1, 127, 10001])
@pytest.mark.parametrize("iters", [1, 3, 20, 33])
@pytest.mark.parametrize("sigma", [1.0, 3.0, 10.0])
def test_cpu_rescaled_within_rounding_bound(batch, iters, sigma):
    g = torch.Generator().manual_seed(batch + iters)
    x = torch.randn(batch, 4, 4, generator=g) * sigma
    gr = torch.randn(batch, 4, 4, generator=g)
    ref = ref_grad(x, gr, iters, 1e-6)
    scale = ref.abs().max()
    d = sinkhorn_bwd(x, gr, iters, 1e-6, variant="thread-e").double()
    old = sinkhorn_bwd(x, gr, iters, 1e-6, variant="thread").double()
    err = float((d - ref).abs().max() / scale)
    assert err < bwd_bound(x) / 3, err
    if batch >= 127:
        per = (d - ref).abs().flatten(1).amax(1) / ref.abs().flatten(1).amax(1).clamp_min(1e-30)
        per_old = (old - ref).abs().flatten(1).amax(1) / ref.abs().flatten(1).amax(1).clamp_min(
            1e-30
        )
        assert float(per.quantile(0.99)) <= 1.5 * float(per_old.quantile(0.99)) + 1e-7


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_cpu_rescaled_edge_cases(n):
    """Large logits (underflowing softmax entries), eps 1e-2 and 1e-9, an empty batch,
    a zero gradient."""
    g = torch.Generator().manual_seed(n)
    for sigma, eps in [(30.0, 1e-6), (1.0, 1e-2), (3.0, 1e-9)]:
        x = torch.randn(513, n, n, generator=g) * sigma
        gr = torch.randn(513, n, n, generator=g)
        ref = ref_grad(x, gr, 20, eps)
        d = sinkhorn_bwd(x, gr, 20, eps, variant="thread-e").double()
        assert torch.isfinite(d).all()
        old = sinkhorn_bwd(x, gr, 20, eps, variant="thread").double()
        scale = ref.abs().max()
        assert float((d - ref).abs().max() / scale) <= 2 * float(
            (old - ref).abs().max() / scale
        ) + 64 * F32_EPS * max(1.0, float(x.abs().max())), (sigma, eps)
    e = sinkhorn_bwd(torch.empty(0, n, n), torch.empty(0, n, n), 20, 1e-6, variant="thread-e")
    assert e.shape == (0, n, n)
    z = sinkhorn_bwd(x, torch.zeros_like(x), 20, 1e-6, variant="thread-e")
    assert float(z.abs().max()) == 0.0


def test_rescaled_variant_selection(monkeypatch):
    monkeypatch.delenv(BWD_ENV, raising=False)
    assert bwd_variant_code() == 6  # thread-rs, the default since 2026-12-01 evening
    assert [bwd_variant_code(v) for v in E_VARIANTS] == [3, 4]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(65, 4, 4, generator=g) * 2
    gr = torch.randn(65, 4, 4, generator=g)
    direct = sinkhorn_bwd(x, gr, 20, 1e-6, variant="thread-e")
    assert torch.equal(direct, sinkhorn_bwd(x, gr, 20, 1e-6, variant="thread-e-occ3"))
    assert not torch.equal(direct, sinkhorn_bwd(x, gr, 20, 1e-6, variant="thread"))
    monkeypatch.setenv(BWD_ENV, "thread-e")
    xd = x.clone().requires_grad_(True)
    sinkhorn_project(xd).backward(gr)
    assert torch.equal(xd.grad, direct)
    monkeypatch.delenv(BWD_ENV)
    xe = x.clone().requires_grad_(True)
    _project(xe, 20, 1e-6, bwd_variant="thread-e").backward(gr)
    assert torch.equal(xe.grad, direct)
    xf = x.clone().requires_grad_(True)
    sinkhorn_project(xf).backward(gr)  # the default (thread-rs): other math, same gradient
    assert not torch.equal(xf.grad, direct)
    torch.testing.assert_close(xf.grad, direct, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="Sinkhorn backward variant"):
        bwd_variant_code(8)


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 127, 10001, 65537])
@pytest.mark.parametrize("iters", [1, 3, 20, 33])
@pytest.mark.parametrize("sigma", [1.0, 3.0, 10.0])
def test_cuda_rescaled_vs_reference(batch, iters, sigma):
    g = torch.Generator().manual_seed(batch + iters)
    x = torch.randn(batch, 4, 4, generator=g) * sigma
    gr = torch.randn(batch, 4, 4, generator=g)
    ref = ref_grad(x, gr, iters, 1e-6)
    scale = ref.abs().max()
    bound = bwd_bound(x)
    cpu = sinkhorn_bwd(x, gr, iters, 1e-6, variant="thread-e").double()
    for variant in E_VARIANTS:
        d = sinkhorn_bwd(x.cuda(), gr.cuda(), iters, 1e-6, variant=variant).cpu().double()
        assert torch.isfinite(d).all(), variant
        assert float((d - ref).abs().max() / scale) < bound, variant
        assert float((d - cpu).abs().max() / scale) < bound, variant


@pytest.mark.gpu
def test_cuda_rescaled_through_autograd_and_graph(monkeypatch):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5000, 4, 4, generator=g) * 2
    gr = torch.randn(5000, 4, 4, generator=g)
    ref = ref_grad(x, gr, 20, 1e-6)
    monkeypatch.setenv(BWD_ENV, "thread-e")
    xd = x.cuda().requires_grad_(True)
    sinkhorn_project(xd).backward(gr.cuda())
    op = torch.ops.mhc_proj.sinkhorn_bwd.default(x.cuda(), gr.cuda(), 20, 1e-6)
    monkeypatch.delenv(BWD_ENV)
    xe = x.cuda().requires_grad_(True)
    _project(xe, 20, 1e-6, bwd_variant="thread-e").backward(gr.cuda())
    scale = ref.abs().max()
    for d in (xd.grad, op, xe.grad):
        assert float((d.cpu().double() - ref).abs().max() / scale) < 2e-5
    assert torch.equal(xd.grad, xe.grad)
    xs, gs = x.cuda(), gr.cuda()
    assert_graph_replay_matches(xs, gs, "thread-e")
