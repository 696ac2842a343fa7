"""The symmetric Gram kernel (``_gram_kernel.py``) against its float64 reference, every
element written (outputs prefilled with NaN) for square and 2:1 tiles and bands of several
heights, batched and strided operands, the ``beta Z`` term; Newton-Schulz through it against
the float64 iteration and the float64 polar factor (SVD) on random, ill-conditioned and
rank-deficient matrices. On the GPU: bf16 against torch's bf16 matmuls, error to float64 at
most ~2x theirs, and the orthogonality error of the whole iteration no worse than torch's."""

import pytest
import torch
from _checks import needs_interp

from flashoptim_fused import _gram_kernel
from flashoptim_fused._gram_kernel import gram, gram_ptr, gram_ref
from flashoptim_fused.muon import gram_torch, newton_schulz
from flashoptim_fused.reference import newton_schulz_ref

# (BM, BN, BK, warps, stages) under the interpreter, and band heights
TILINGS = [((16, 16, 16, 4, 1), 8), ((16, 32, 16, 4, 1), 2), ((32, 16, 16, 4, 1), 1)]


def _nan_out(shape):
    return torch.full(shape, float("nan"))


def _check(c, ref, k):
    """fp32 operands: error to float64 within fp32 rounding of a k-term dot product."""
    assert not c.isnan().any(), "an element of C was never written"
    assert torch.equal(c, c.mT), "C is not exactly symmetric"
    tol = 4 * k * 2.0**-24 * ref.abs().max().item() + 1e-30
    assert (c.double() - ref).abs().max().item() <= tol


def _aligned(m, k, g, batch=()):
    """A random (..., m, k) fp32 view whose row stride is a multiple of 4 elements (16
    bytes): the operands the TMA kernel takes."""
    ld = -(-k // 4) * 4
    base = torch.randn(*batch, m, ld, generator=g)
    return base[..., :k]


@needs_interp
@pytest.mark.parametrize("tiling,group", TILINGS)
@pytest.mark.parametrize("m,k", [(1, 3), (5, 1), (16, 40), (33, 7), (70, 19)])
def test_gram_ptr_matches_float64(monkeypatch, tiling, group, m, k):
    monkeypatch.setattr(_gram_kernel, "INTERP_CONFIG", tiling)
    monkeypatch.setattr(_gram_kernel, "GROUP", group)
    g = torch.Generator().manual_seed(m * 100 + k)
    y = torch.randn(m, k, generator=g)
    c = gram_ptr(y, out=_nan_out((m, m)))
    _check(c, gram_ref(y), k)


@needs_interp
@pytest.mark.parametrize("bm,group", [(16, 8), (32, 1)])
@pytest.mark.parametrize("m,k", [(4, 3), (16, 40), (36, 7), (68, 19)])
def test_gram_tma_matches_float64(monkeypatch, bm, group, m, k):
    """The TMA kernel (what ``gram`` takes for aligned operands): every element written,
    off-diagonal tiles mirrored, the tiles past the matrix clipped."""
    monkeypatch.setattr(_gram_kernel, "TMA_INTERP_CONFIG", (bm, 16, 4, 1))
    monkeypatch.setattr(_gram_kernel, "GROUP", group)
    g = torch.Generator().manual_seed(m * 100 + k)
    y = _aligned(m, k, g, batch=(2,))
    out = _nan_out((2, m, m))
    assert _gram_kernel._tma_ready(y, out)
    c = gram(y, out=out)
    _check(c, gram_ref(y), k)
    zc = gram(c, 0.25, c, -1.5, out=_nan_out((2, m, m)))
    _check(zc, gram_ref(c, 0.25, c, -1.5), m)


@needs_interp
def test_gram_batched_strided_and_beta_z():
    """A batch of transposed views (the tall orientation Newton-Schulz takes), then the
    second product of an iteration: ``c A A + b A`` with ``A`` symmetric."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(3, 45, 20, generator=g)
    y = base.mT  # (3, 20, 45), strides (900, 1, 20): not for TMA
    assert not _gram_kernel._tma_ready(y)
    a = gram(y, out=_nan_out((3, 20, 20)))
    _check(a, gram_ref(y), 45)
    b = gram(a, -4.775, a, 3.4445, out=_nan_out((3, 20, 20)))
    _check(b, gram_ref(a, -4.775, a, 3.4445), 20)
    # a wide batch where Y has a row stride that is not its width (a slice of a workspace)
    ws = torch.randn(2 * 12 * 40 + 16, generator=g)
    x = ws.as_strided((2, 12, 33), (12 * 40, 40, 1), 16)
    _check(gram(x, 0.5, out=_nan_out((2, 12, 12))), gram_ref(x, 0.5), 33)


def test_gram_clear_errors():
    with pytest.raises(ValueError, match=r"y must be \(M, K\) or \(k, M, K\)"):
        gram(torch.zeros(3))
    with pytest.raises(ValueError, match="y must be bf16, fp16 or fp32"):
        gram(torch.zeros(3, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"z must have shape \(4, 4\)"):
        gram(torch.zeros(4, 5), z=torch.zeros(5, 5))
    with pytest.raises(ValueError, match=r"out must be \(4, 4\)"):
        gram(torch.zeros(4, 5), out=torch.zeros(4, 5))


def _polar(x: torch.Tensor) -> torch.Tensor:
    """float64 polar factor U V^T of ``x`` on its numerical range (rank-deficient: the
    partial isometry; Newton-Schulz keeps zero singular values at zero)."""
    u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    r = int((s > s[0] * 1e-10).sum())
    return u[:, :r] @ vh[:r]


def _matrices():
    g = torch.Generator().manual_seed(7)
    rnd = torch.randn(24, 56, generator=g)
    q1, _ = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(24, 24, generator=g, dtype=torch.float64))
    ill = (q1[:, :24] * torch.logspace(0, -6, 24, dtype=torch.float64)) @ q2.T  # cond 1e6
    low = torch.randn(30, 5, generator=g) @ torch.randn(5, 44, generator=g)  # rank 5
    return {"random": rnd, "ill_conditioned": ill.float(), "rank_deficient": low}


@needs_interp
@pytest.mark.parametrize("kind", ["random", "ill_conditioned", "rank_deficient"])
def test_newton_schulz_through_the_kernel(kind):
    """The iteration with the kernel's Gram products (fp32, IEEE) against the float64
    iteration (the same polynomial: fp32 rounding apart), and its distance to the float64
    polar factor no worse than the float64 iteration's own (the quintic's 5 steps do not
    converge: singular values end in about [0.7, 1.2], and tiny ones stay small)."""
    x = _matrices()[kind]
    got = newton_schulz(x, gram_fn=gram, dtype=torch.float32).double()
    by_ptr = newton_schulz(x, gram_fn=gram_ptr, dtype=torch.float32).double()
    assert (got - by_ptr).abs().max().item() <= 1e-5
    ref = newton_schulz_ref(x)
    assert (got - ref).abs().max().item() <= 1e-4
    torch_way = newton_schulz(x, gram_fn=gram_torch, dtype=torch.float32).double()
    polar = _polar(x)
    err = ((got - polar).norm() / polar.norm()).item()
    err_ref = ((ref - polar).norm() / polar.norm()).item()
    err_torch = ((torch_way - polar).norm() / polar.norm()).item()
    assert err <= err_ref * (1 + 1e-3) + 1e-6 and abs(err - err_torch) <= 1e-4
    if kind == "rank_deficient":  # the null space stays null
        _, s, vh = torch.linalg.svd(x.double())
        null = vh[5:].T
        assert (got @ null).abs().max().item() <= 1e-4
    sv = torch.linalg.svdvals(got)
    assert sv.max().item() <= 1.25


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(512, 1536), (1, 640, 640), (3, 1000, 777), (129, 4097)])
def test_gpu_gram_bf16_against_torch(shape):
    """bf16 operands, fp32 accumulation: the error to float64 at most ~2x that of torch's
    bf16 matmul (both round the result once to bf16), both products of an iteration, both
    kernels; autotuned (every config the tuner times runs on these shapes)."""
    g = torch.Generator().manual_seed(1)
    y = torch.randn(shape, generator=g).cuda().bfloat16()
    for z_term in (False, True):
        if z_term:
            y = (gram(y) / shape[-1]).contiguous()
            args = (-4.775, y, 2.0315)
        else:
            args = ()
        t = gram_torch(y, *args)
        ref = gram_ref(y, *args)
        e_torch = (t.double() - ref).abs().max().item()
        for fn in (gram, gram_ptr):
            c = fn(y, *args)
            assert torch.equal(c, c.mT) or fn is gram
            e_ours = (c.double() - ref).abs().max().item()
            assert e_ours <= 2 * e_torch + 1e-6, (fn.__name__, e_ours, e_torch)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "ill_conditioned", "rank_deficient"])
def test_gpu_newton_schulz_orthogonality_no_worse_than_torch(kind):
    """bf16 Newton-Schulz with the kernel against the same iteration on torch's matmuls
    (torch.optim.Muon's): distance to the float64 polar factor within 2% of torch's (bf16
    rounding of the iterates differs; neither is systematically closer)."""
    x = _matrices()[kind].cuda()
    big = torch.randn(2, 1024, 3072, device="cuda")
    for inp, fn in ((x, gram), (big, gram), (x, gram_ptr), (big, gram_ptr)):
        ours = newton_schulz(inp, gram_fn=fn).double()
        theirs = newton_schulz(inp, gram_fn=gram_torch).double()
        polar = torch.stack([_polar(m) for m in inp.reshape(-1, *inp.shape[-2:])]).view_as(ours)
        e_ours = ((ours - polar).norm() / polar.norm()).item()
        e_torch = ((theirs - polar).norm() / polar.norm()).item()
        assert e_ours <= 1.02 * e_torch + 1e-3, (e_ours, e_torch)
