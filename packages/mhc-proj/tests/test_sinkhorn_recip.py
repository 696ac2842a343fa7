"""The reciprocal-replay Sinkhorn-k backward (``thread-rs`` / ``thread-r-occ3`` /
``thread-rp``, opt-in; ``mhc::sinkhorn_vjp_recip``, ``sinkhorn_vjp_recip_pipe``; NOTES.md,
"Sinkhorn-20 backward: reciprocal replay").

The replay keeps each step's denominator (1/c' = P0^T r + eps / c) and takes one reciprocal
of it, then runs the rescaled reverse sweep of ``thread-e``. The CPU module runs the same
header function for both names (any n, float32 and float64), so the CPU tests check its
math: float64 against autograd through the reference iteration (exact to rounding),
float32 inside the rounding bound the GPU tests apply to every backward kernel
(``_bwd_bound``, as tests/test_sinkhorn.py), on odd batch sizes, leading dimensions and
sigma 1 / 10 / 100, and per-matrix errors no worse than the default ``thread-e-occ3``'s.
The GPU tests compare both kernels with float64, with the CPU path and with the default
kernel.
"""

import pytest
import torch
from _sinkhorn_bwd_helpers import assert_graph_replay_matches, bwd_bound, ref_grad

from mhc_proj import sinkhorn_project
from mhc_proj.sinkhorn import BWD_DEFAULT, BWD_ENV, _project, bwd_variant_code, sinkhorn_bwd

# the rescaled-adjoint kernel (the default before thread-rs): an independent implementation
PREVIOUS_DEFAULT = "thread-e-occ3"

R_VARIANTS = ["thread-rs", "thread-r-occ3", "thread-rp"]


def _per_matrix(d, ref):
    """Per-matrix max error relative to the matrix's largest reference entry."""
    den = ref.abs().flatten(1).amax(1).clamp_min(1e-30)
    return (d - ref).abs().flatten(1).amax(1) / den


# ---------------------------------------------------------------- CPU
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("iters", [1, 2, 3, 20, 33])
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_cpu_recip_float64_exact(n, iters, eps):
    g = torch.Generator().manual_seed(n * 100 + iters)
    x = torch.randn(301, n, n, generator=g, dtype=torch.float64) * 4
    gr = torch.randn(301, n, n, generator=g, dtype=torch.float64)
    ref = ref_grad(x, gr, iters, eps)
    for v in R_VARIANTS:
        d = sinkhorn_bwd(x, gr, iters, eps, variant=v)
        assert float((d - ref).abs().max() / ref.abs().max()) <= 1e-13, v


@pytest.mark.parametrize("batch", [1, 3, 127, 10001])
@pytest.mark.parametrize("iters", [1, 3, 20, 33])
@pytest.mark.parametrize("sigma", [1.0, 10.0, 100.0])
def test_cpu_recip_within_rounding_bound(batch, iters, sigma):
    g = torch.Generator().manual_seed(batch + iters)
    x = torch.randn(batch, 4, 4, generator=g) * sigma
    gr = torch.randn(batch, 4, 4, generator=g)
    ref = ref_grad(x, gr, iters, 1e-6)
    scale = ref.abs().max()
    d = sinkhorn_bwd(x, gr, iters, 1e-6, variant="thread-rs").double()
    assert torch.isfinite(d).all()
    err = float((d - ref).abs().max() / scale)
    assert err < bwd_bound(x) / 3, err
    if batch >= 127:
        default = sinkhorn_bwd(x, gr, iters, 1e-6, variant=PREVIOUS_DEFAULT).double()
        per, per_old = _per_matrix(d, ref), _per_matrix(default, ref)
        assert float(per.quantile(0.99)) <= 1.5 * float(per_old.quantile(0.99)) + 1e-7


@pytest.mark.parametrize("shape", [(3, 5, 4, 4), (2, 1, 7, 4, 4), (4, 4), (5, 3, 3)])
@pytest.mark.parametrize("sigma", [1.0, 10.0])
def test_cpu_recip_leading_dims_through_autograd(shape, sigma, monkeypatch):
    g = torch.Generator().manual_seed(len(shape) * 10 + int(sigma))
    x = torch.randn(*shape, generator=g) * sigma
    gr = torch.randn(*shape, generator=g)
    ref = ref_grad(x, gr, 20, 1e-6)
    grads = {}
    for v in R_VARIANTS + [PREVIOUS_DEFAULT]:
        monkeypatch.setenv(BWD_ENV, v)
        xd = x.clone().requires_grad_(True)
        sinkhorn_project(xd).backward(gr)
        grads[v] = xd.grad
        assert xd.grad.shape == x.shape
    monkeypatch.delenv(BWD_ENV)
    assert torch.equal(grads["thread-rs"], grads["thread-r-occ3"])  # the same CPU math
    assert torch.equal(grads["thread-rs"], grads["thread-rp"])
    scale = ref.abs().max()
    assert float((grads["thread-rs"].double() - ref).abs().max() / scale) < bwd_bound(x) / 3
    xe = x.clone().requires_grad_(True)
    _project(xe, 20, 1e-6, bwd_variant="thread-rs").backward(gr)
    assert torch.equal(xe.grad, grads["thread-rs"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [2, 4, 5])
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_cpu_pipeline_bitwise_per_matrix(dtype, n, iters):
    """thread-rp (two matrices in flight, mirrored slots, a dummy replay after the last
    matrix) gives bitwise the per-matrix results for odd and even batch sizes."""
    g = torch.Generator().manual_seed(n * 10 + iters)
    for batch in (1, 2, 3, 4, 7, 64, 101):
        x = torch.randn(batch, n, n, generator=g, dtype=dtype) * 3
        gr = torch.randn(batch, n, n, generator=g, dtype=dtype)
        want = sinkhorn_bwd(x, gr, iters, 1e-6, variant="thread-rs")
        assert torch.equal(sinkhorn_bwd(x, gr, iters, 1e-6, variant="thread-rp"), want), batch


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_cpu_recip_edge_cases(n):
    """Large logits (underflowing softmax entries), eps 1e-2 and 1e-9, an empty batch,
    a zero gradient."""
    g = torch.Generator().manual_seed(n)
    for sigma, eps in [(30.0, 1e-6), (100.0, 1e-6), (1.0, 1e-2), (3.0, 1e-9)]:
        x = torch.randn(513, n, n, generator=g) * sigma
        gr = torch.randn(513, n, n, generator=g)
        ref = ref_grad(x, gr, 20, eps)
        d = sinkhorn_bwd(x, gr, 20, eps, variant="thread-rs").double()
        assert torch.isfinite(d).all()
        old = sinkhorn_bwd(x, gr, 20, eps, variant="thread-e").double()
        scale = ref.abs().max()
        assert float((d - ref).abs().max() / scale) <= 2 * float(
            (old - ref).abs().max() / scale
        ) + bwd_bound(x), (sigma, eps)
    e = sinkhorn_bwd(torch.empty(0, n, n), torch.empty(0, n, n), 20, 1e-6, variant="thread-rs")
    assert e.shape == (0, n, n)
    z = sinkhorn_bwd(x, torch.zeros_like(x), 20, 1e-6, variant="thread-rs")
    assert float(z.abs().max()) == 0.0


def test_recip_variant_selection(monkeypatch):
    monkeypatch.delenv(BWD_ENV, raising=False)
    assert BWD_DEFAULT == "thread-rs" and bwd_variant_code() == 6  # since 2026-12-01 evening
    assert [bwd_variant_code(v) for v in R_VARIANTS] == [6, 5, 7]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(65, 4, 4, generator=g) * 2
    gr = torch.randn(65, 4, 4, generator=g)
    direct = sinkhorn_bwd(x, gr, 20, 1e-6, variant="thread-rs")
    assert torch.equal(direct, sinkhorn_bwd(x, gr, 20, 1e-6, variant="thread-r-occ3"))
    assert torch.equal(direct, sinkhorn_bwd(x, gr, 20, 1e-6, variant="thread-rp"))
    assert not torch.equal(direct, sinkhorn_bwd(x, gr, 20, 1e-6, variant="thread-e"))
    with pytest.raises(ValueError, match="Sinkhorn backward variant"):
        bwd_variant_code("thread-r")


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 127, 129, 10001, 65537])
@pytest.mark.parametrize("iters", [1, 3, 20, 33])
@pytest.mark.parametrize("sigma", [1.0, 10.0, 100.0])
def test_cuda_recip_vs_reference_and_default(batch, iters, sigma):
    g = torch.Generator().manual_seed(batch + iters)
    x = torch.randn(batch, 4, 4, generator=g) * sigma
    gr = torch.randn(batch, 4, 4, generator=g)
    ref = ref_grad(x, gr, iters, 1e-6)
    scale = ref.abs().max()
    bound = bwd_bound(x)
    cpu = sinkhorn_bwd(x, gr, iters, 1e-6, variant="thread-rs").double()
    xc, gc = x.cuda(), gr.cuda()
    default = sinkhorn_bwd(xc, gc, iters, 1e-6, variant=PREVIOUS_DEFAULT).cpu().double()
    assert float((default - ref).abs().max() / scale) < bound
    for variant in R_VARIANTS:
        d = sinkhorn_bwd(xc, gc, iters, 1e-6, variant=variant).cpu().double()
        assert torch.isfinite(d).all(), variant
        assert float((d - ref).abs().max() / scale) < bound, variant
        assert float((d - cpu).abs().max() / scale) < bound, variant
        assert float((d - default).abs().max() / scale) < bound, variant
        if batch >= 10001:
            # no worse than the default kernel per matrix (p99, the CPU test's rule)
            p99 = float(_per_matrix(d, ref).quantile(0.99))
            assert p99 <= 1.5 * float(_per_matrix(default, ref).quantile(0.99)) + 1e-7


@pytest.mark.gpu
def test_cuda_recip_through_autograd_leading_dims_and_graph(monkeypatch):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 1667, 4, 4, generator=g) * 2
    gr = torch.randn(3, 1667, 4, 4, generator=g)
    ref = ref_grad(x, gr, 20, 1e-6)
    scale = ref.abs().max()
    for variant in R_VARIANTS:
        monkeypatch.setenv(BWD_ENV, variant)
        xd = x.cuda().requires_grad_(True)
        sinkhorn_project(xd).backward(gr.cuda())
        monkeypatch.delenv(BWD_ENV)
        xe = x.cuda().requires_grad_(True)
        _project(xe, 20, 1e-6, bwd_variant=variant).backward(gr.cuda())
        assert xd.grad.shape == x.shape
        assert float((xd.grad.cpu().double() - ref).abs().max() / scale) < 2e-5, variant
        assert torch.equal(xd.grad, xe.grad), variant
    xs, gs = x.reshape(-1, 4, 4).cuda(), gr.reshape(-1, 4, 4).cuda()
    assert_graph_replay_matches(xs, gs, "thread-rs")
