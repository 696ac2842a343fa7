"""The opt-in softmin kernel variants (FLASHSINKHORN_SOFTMIN_VARIANT, kernels.py) against
the float64 oracle (CPU interpreter) and against the default kernel (GPU)."""

import math

import pytest
import torch
from _helpers import needs_interpreter

from flashsinkhorn import kernels as K
from flashsinkhorn.kernels import softmin, softmin_ref

VARIANTS = [v for v in K.SOFTMIN_VARIANTS if v != "default"] if K.HAS_TRITON else []


def _problem(B, N, M, D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, D, generator=gen) / D**0.5
    y = torch.randn(B, M, D, generator=gen) / D**0.5
    g = 0.1 * torch.randn(B, M, generator=gen)
    logb = torch.log(torch.rand(B, M, generator=gen) + 0.05)
    logb[0, M // 2] = float("-inf")  # a zero column weight
    cx, cy = (x * x).sum(-1), (y * y).sum(-1)
    lx = torch.randint(0, 3, (B, N), generator=gen)
    ly = torch.randint(0, 4, (B, M), generator=gen)
    W = torch.rand(3, 4, generator=gen)
    return x, y, g, logb, cx, cy, (lx, ly, W, 0.7)


def _count_variant_launches(monkeypatch):
    calls = []
    orig = K._launch_variant

    def wrapped(variant, *args):
        calls.append(variant)
        return orig(variant, *args)

    monkeypatch.setattr(K, "_launch_variant", wrapped)
    return calls


@needs_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "shape,labels",
    [
        ((2, 37, 29, 5), True),  # batch, odd sizes, one partial column tile
        ((1, 37, 29, 70), True),  # D not a power of two (D mask)
        ((3, 65, 129, 64), False),  # EVEN_D, 3 column tiles (last partial), 2 row blocks
        ((1, 19, 23, 200), True),  # D > 128: the feature-chunk loop (NUM_D = 4)
        ((1, 5, 1, 3), False),  # one column: only the peeled tile
    ],
)
def test_softmin_variant_matches_float64(monkeypatch, variant, shape, labels):
    x, y, g, logb, cx, cy, lab = _problem(*shape, seed=sum(shape))
    lab = lab if labels else None
    monkeypatch.setenv("FLASHSINKHORN_SOFTMIN_VARIANT", variant)
    calls = _count_variant_launches(monkeypatch)
    ref, ref_lse2, _ = softmin_ref(x, y, g, logb, cx, cy, eps=0.2, c2=2.0, damping=0.8,
                                   labels=lab)  # fmt: skip
    out, lse2, vbar = softmin(
        x, y, g, logb, cx, cy, eps=0.2, c2=2.0, damping=0.8, labels=lab, backend="triton",
        precision="ieee", want_lse=True,
    )  # fmt: skip
    assert calls == [variant] and vbar is None
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse2.double(), ref_lse2, atol=2e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("variant", ["pipe"])
@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_softmin_variant_precisions_interpreter(monkeypatch, variant, precision):
    """tf32 / tf32x3 paths of the variant run under the interpreter (which computes the
    dots in fp32: equal to the default kernel's result)."""
    x, y, g, logb, cx, cy, lab = _problem(2, 37, 29, 5, seed=7)
    kw = dict(eps=0.2, c2=2.0, damping=0.8, labels=lab, backend="triton", precision=precision)
    base = softmin(x, y, g, logb, cx, cy, **kw)[0]
    monkeypatch.setenv("FLASHSINKHORN_SOFTMIN_VARIANT", variant)
    out = softmin(x, y, g, logb, cx, cy, **kw)[0]
    torch.testing.assert_close(out, base, atol=1e-6, rtol=1e-6)


@needs_interpreter
def test_softmin_variant_falls_back_with_v(monkeypatch):
    """The plan-application pass (with V) always runs the default kernel."""
    x, y, g, logb, cx, cy, _ = _problem(1, 37, 29, 5, seed=3)
    v = torch.randn(1, 29, 3, generator=torch.Generator().manual_seed(4))
    monkeypatch.setenv("FLASHSINKHORN_SOFTMIN_VARIANT", "pipe")
    calls = _count_variant_launches(monkeypatch)
    _, _, refv = softmin_ref(x, y, g, logb, cx, cy, eps=0.2, c2=2.0, v=v)
    _, _, vbar = softmin(x, y, g, logb, cx, cy, eps=0.2, c2=2.0, v=v, backend="triton",
                         precision="ieee")  # fmt: skip
    assert calls == []
    torch.testing.assert_close(vbar.double(), refv, atol=3e-5, rtol=1e-5)


@pytest.mark.skipif(not K.HAS_TRITON, reason="needs triton")
def test_softmin_variant_name_is_checked(monkeypatch):
    monkeypatch.setenv("FLASHSINKHORN_SOFTMIN_VARIANT", "pipelined")
    with pytest.raises(ValueError, match="FLASHSINKHORN_SOFTMIN_VARIANT"):
        K.softmin_variant()
    monkeypatch.setenv("FLASHSINKHORN_SOFTMIN_VARIANT", "")
    assert K.softmin_variant() == "default"


# ---------------------------------------------------------------------------------------
# GPU: each variant against the default kernel (and both against float64)
# ---------------------------------------------------------------------------------------

GPU_CONFIGS = [(128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 4, 3)]  # all for 'pipe'


def _uniform(n, m, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    s = 1 / math.sqrt(d)
    x = torch.rand(1, n, d, generator=gen) * s
    y = torch.rand(1, m, d, generator=gen) * s + 0.5 * s
    return x.cuda(), y.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("d", [64, 512])
@pytest.mark.parametrize(
    "precision,atol", [("ieee", 2e-5), ("tf32x3", 2e-5), ("tf32", 2e-3), ("bf16", 2e-2)]
)
def test_softmin_variant_matches_default_gpu(monkeypatch, variant, d, precision, atol):
    n, m, eps = 1500, 1300, 0.01
    x, y = _uniform(n, m, d, seed=d)
    gen = torch.Generator().manual_seed(5)
    g = (0.01 * torch.randn(1, m, generator=gen)).cuda()
    logb = torch.full((1, m), -math.log(m), device="cuda")
    cx, cy = (x * x).sum(-1), (y * y).sum(-1)
    lx = torch.randint(0, 3, (1, n), generator=gen).cuda()
    ly = torch.randint(0, 4, (1, m), generator=gen).cuda()
    lab = (lx, ly, torch.rand(3, 4, generator=gen).cuda(), 0.05)
    kw = dict(eps=eps, c2=2.0, damping=0.9, labels=lab, precision=precision, want_lse=True)
    ref = softmin_ref(x, y, g, logb, cx, cy, eps=eps, c2=2.0, damping=0.9, labels=lab)[0]
    base = softmin(x, y, g, logb, cx, cy, **kw)
    err_base = float((base[0].double() - ref).abs().max())
    monkeypatch.setenv("FLASHSINKHORN_SOFTMIN_VARIANT", variant)
    configs = GPU_CONFIGS if variant == "pipe" else GPU_CONFIGS[:1]
    for cfg in [None] + configs:  # None: the tests' fixed config (no autotune)
        monkeypatch.setattr(K, "VARIANT_CONFIG", cfg)
        out = softmin(x, y, g, logb, cx, cy, **kw)
        err = float((out[0].double() - ref).abs().max())
        assert torch.isfinite(out[0]).all(), cfg
        assert err <= 2 * err_base + 1e-6 and err < atol, (cfg, err, err_base)
        assert (out[0] - base[0]).abs().max() < atol, cfg
        assert (out[1] - base[1]).abs().max() < atol / (eps * K.LN2), cfg
