"""The softmin kernel variants (FLASHSINKHORN_SOFTMIN_VARIANT, kernels.py; "shift" is the
default) against the float64 oracle (CPU interpreter) and against the running-max kernel
(GPU)."""

import math

import pytest
import torch
from _helpers import clouds, needs_interpreter

import flashsinkhorn as fs
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
    # a guess 1 eps off the result (read by "shift" only; the others ignore it)
    guess = ref + 0.2 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    out, lse2, vbar = softmin(
        x, y, g, logb, cx, cy, eps=0.2, c2=2.0, damping=0.8, labels=lab, backend="triton",
        precision="ieee", want_lse=True, guess=guess.float(),
    )  # fmt: skip
    assert calls == [variant] and vbar is None
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse2.double(), ref_lse2, atol=2e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("variant", ["pipe", "shift"])
@pytest.mark.parametrize("precision", ["tf32", "tf32x3", "bf16"])
def test_softmin_variant_precisions_interpreter(monkeypatch, variant, precision):
    """tf32 / tf32x3 / bf16 paths of the variant run under the interpreter (which computes
    the dots its own way for every kernel: equal to the default kernel's result)."""
    if variant == "pipe" and precision == "bf16":
        pytest.skip("covered by the GPU test")
    x, y, g, logb, cx, cy, lab = _problem(2, 37, 29, 5, seed=7)
    kw = dict(eps=0.2, c2=2.0, damping=0.8, labels=lab, backend="triton", precision=precision)
    base = softmin(x, y, g, logb, cx, cy, **kw)[0]
    monkeypatch.setenv("FLASHSINKHORN_SOFTMIN_VARIANT", variant)
    calls = _count_variant_launches(monkeypatch)
    out = softmin(x, y, g, logb, cx, cy, guess=base + 0.1, **kw)[0]
    assert calls == [variant]
    torch.testing.assert_close(out, base, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------
# "shift": fixed per-row shift from a guess, in-kernel fallback to the running max
# ---------------------------------------------------------------------------------------


def _fallback_rows(monkeypatch):
    """Count the rows the "shift" kernel recomputes (kernels.SHIFT_FALLBACK_ROWS)."""
    counter = torch.zeros(1, dtype=torch.int32)
    monkeypatch.setattr(K, "SHIFT_FALLBACK_ROWS", counter)
    return counter


@needs_interpreter
@pytest.mark.parametrize("shape", [(2, 37, 29, 5), (3, 65, 129, 64), (1, 19, 23, 200)])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_shift_guesses(monkeypatch, shape, precision):
    """Exact for any guess: good rows (guess = result, or up to ~35 log2 units off) take the
    shift path, rows with a guess far too high / far too low / NaN are recomputed with the
    running max in the same block, and only those."""
    B, N = shape[:2]
    x, y, g, logb, cx, cy, lab = _problem(*shape, seed=sum(shape) + 1)
    kw = dict(eps=0.2, c2=2.0, damping=0.8, labels=lab)
    ref, ref_lse2, _ = softmin_ref(x, y, g, logb, cx, cy, **kw)
    monkeypatch.setenv("FLASHSINKHORN_SOFTMIN_VARIANT", "shift")
    calls = _count_variant_launches(monkeypatch)
    counter = _fallback_rows(monkeypatch)
    # 20 eps off (in potential units): 36 log2 units with damping 0.8, inside the window
    guess = ref.float() + 4.0 * torch.tensor([1.0, -1.0]).repeat(N)[:N]
    kw.update(backend="triton", precision=precision, want_lse=True)
    out, lse2, _ = softmin(x, y, g, logb, cx, cy, guess=guess, **kw)
    assert calls == ["shift"] and int(counter) == 0
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse2.double(), ref_lse2, atol=2e-5, rtol=1e-5)
    bad = guess.clone()
    bad[:, 0::3] += 1e3  # far too high: every term flushed to zero
    bad[:, 1::3] -= 1e3  # far too low: overflow
    bad[-1, 2] = float("nan")
    n_bad = B * (len(range(0, N, 3)) + len(range(1, N, 3))) + 1
    counter.zero_()
    out, lse2, _ = softmin(x, y, g, logb, cx, cy, guess=bad, **kw)
    assert int(counter) == n_bad
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse2.double(), ref_lse2, atol=2e-5, rtol=1e-5)


@needs_interpreter
def test_shift_zero_weights_and_fallbacks(monkeypatch):
    """Zero column weights (a -inf log weight; a problem with all of them zero: out = inf
    like the default kernel); no guess -> the default kernel; with V -> the default
    kernel."""
    x, y, g, logb, cx, cy, _ = _problem(2, 37, 29, 5, seed=11)
    logb[1] = float("-inf")
    kw = dict(eps=0.2, c2=2.0, backend="triton", precision="ieee")
    base = softmin(x, y, g, logb, cx, cy, **kw)[0]
    assert torch.isinf(base[1]).all() and torch.isfinite(base[0]).all()
    monkeypatch.setenv("FLASHSINKHORN_SOFTMIN_VARIANT", "shift")
    calls = _count_variant_launches(monkeypatch)
    counter = _fallback_rows(monkeypatch)
    guess = torch.where(torch.isfinite(base), base, torch.zeros_like(base))
    out = softmin(x, y, g, logb, cx, cy, guess=guess, **kw)[0]
    assert calls == ["shift"] and int(counter) == 37  # the rows of the empty problem
    torch.testing.assert_close(out, base, atol=1e-6, rtol=1e-6)
    assert softmin(x, y, g, logb, cx, cy, **kw)[0].equal(base) and calls == ["shift"]
    v = torch.randn(2, 29, 3, generator=torch.Generator().manual_seed(4))
    vbar = softmin(x, y, g, logb, cx, cy, v=v, guess=guess, **kw)[2]
    ref_v = softmin_ref(x, y, g, logb, cx, cy, eps=0.2, c2=2.0, v=v)[2]
    assert calls == ["shift"]
    torch.testing.assert_close(vbar[0].double(), ref_v[0], atol=3e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize(
    "schedule,eps_scaling", [("alternating", 0.5), ("symmetric", 0.5), ("symmetric", None)]
)
def test_shift_solve_end_to_end(monkeypatch, schedule, eps_scaling):
    """solve() with the "shift" variant: the loop passes the current potentials as guesses
    (eps-scaling warm start and fixed-eps iterations; not the zeros of a cold start, whose
    passes run the default kernel) and matches the default kernel."""
    x, y, a, b = clouds(45, 38, 3, dtype=torch.float32, seed=3)
    kw = dict(eps=0.05, eps_scaling=eps_scaling, max_iter=30, tol=None, schedule=schedule,
              backend="triton", precision="ieee", reach=2.0)  # fmt: skip
    monkeypatch.setenv("FLASHSINKHORN_SOFTMIN_VARIANT", "default")  # the running-max kernel
    base = fs.solve(x, y, a, b, **kw)
    monkeypatch.setenv("FLASHSINKHORN_SOFTMIN_VARIANT", "shift")
    calls = _count_variant_launches(monkeypatch)
    counter = _fallback_rows(monkeypatch)
    r = fs.solve(x, y, a, b, **kw)
    assert set(calls) == {"shift"}
    assert len(calls) > 60 if eps_scaling else len(calls) == 2 * 29
    assert int(counter) == 0  # the previous potentials are good shifts
    torch.testing.assert_close(r.f, base.f, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(r.g, base.g, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(r.value, base.value, atol=2e-6, rtol=1e-5)


@needs_interpreter
def test_shift_samples_loss_end_to_end(monkeypatch):
    """SamplesLoss (debiased, value and gradient) with the "shift" variant."""
    x, y, a, b = clouds(40, 33, 2, dtype=torch.float32, seed=5)

    def run():
        xx = x.clone().requires_grad_(True)
        v = fs.SamplesLoss(blur=0.1, backend="triton", precision="ieee")(a, xx, b, y)
        v.backward()
        return v.detach(), xx.grad

    monkeypatch.setenv("FLASHSINKHORN_SOFTMIN_VARIANT", "default")  # the running-max kernel
    v0, g0 = run()
    monkeypatch.delenv("FLASHSINKHORN_SOFTMIN_VARIANT")  # unset: "shift", the default
    assert K.softmin_variant() == "shift"
    calls = _count_variant_launches(monkeypatch)
    v1, g1 = run()
    assert len(calls) > 5 and set(calls) == {"shift"}
    torch.testing.assert_close(v1, v0, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g1, g0, atol=1e-6, rtol=1e-5)


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
    assert K.softmin_variant() == K.DEFAULT_SOFTMIN_VARIANT == "shift"
    monkeypatch.setenv("FLASHSINKHORN_SOFTMIN_VARIANT", "default")
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
    configs = GPU_CONFIGS if variant in ("pipe", "shift") else GPU_CONFIGS[:1]
    # "shift": a guess 3 eps off the result (no fallback), then one with a third of the
    # rows far too high, a third far too low (recomputed in the kernel); ignored otherwise
    sign = torch.tensor([1.0, -1.0], device="cuda").repeat(n)[:n]
    good = base[0] + 3 * eps * sign
    bad = good.clone()
    bad[:, 0::3] += 1e4 * eps
    bad[:, 1::3] -= 1e4 * eps
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    monkeypatch.setattr(K, "SHIFT_FALLBACK_ROWS", counter)
    for cfg in [None] + configs:  # None: the tests' fixed config (no autotune)
        monkeypatch.setattr(K, "VARIANT_CONFIG", cfg)
        for guess, n_bad in ((good, 0), (bad, len(range(0, n, 3)) + len(range(1, n, 3)))):
            counter.zero_()
            out = softmin(x, y, g, logb, cx, cy, guess=guess, **kw)
            if variant == "shift":
                assert int(counter) == n_bad, (cfg, int(counter), n_bad)
            err = float((out[0].double() - ref).abs().max())
            assert torch.isfinite(out[0]).all(), cfg
            assert err <= 2 * err_base + 1e-6 and err < atol, (cfg, err, err_base)
            assert (out[0] - base[0]).abs().max() < atol, cfg
            assert (out[1] - base[1]).abs().max() < atol / (eps * K.LN2), cfg
            if variant != "shift":
                break
