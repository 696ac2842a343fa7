"""The Triton kernels of _softmin_triton.py against the float64 reference: which kernel a
pass runs, the shift kernel's in-kernel fallback (exact for any guess), every tile config of
the autotune space, and the tensor-core precisions (GPU).

CPU tests run the kernels under the interpreter (TRITON_INTERPRET=1, one fixed config); the
GPU tests compile each kernel at few sizes, so the suite stays compile-light.
"""

import math

import pytest
import torch
from _helpers import needs_interpreter

import flashsinkhorn as fs
from flashsinkhorn import _config
from flashsinkhorn import _softmin_triton as K
from flashsinkhorn.reference import LN2, softmin_ref


def _problem(B, N, M, D, seed=0, scale=None, device="cpu"):
    """Clouds, a random column potential, log weights with one zero weight, labels."""
    gen = torch.Generator().manual_seed(seed)
    s = 1 / math.sqrt(D) if scale is None else scale
    x = torch.randn(B, N, D, generator=gen) * s
    y = torch.randn(B, M, D, generator=gen) * s
    g = 0.1 * torch.randn(B, M, generator=gen)
    logb = torch.log(torch.rand(B, M, generator=gen) + 0.05)
    logb[0, M // 2] = float("-inf")  # a zero column weight
    lx = torch.randint(0, 3, (B, N), generator=gen)
    ly = torch.randint(0, 4, (B, M), generator=gen)
    W = torch.rand(3, 4, generator=gen)
    x, y, g, logb, lx, ly, W = (t.to(device) for t in (x, y, g, logb, lx, ly, W))
    cx, cy = (x * x).sum(-1), (y * y).sum(-1)
    return x, y, g, logb, cx, cy, (lx, ly, W, 0.7)


def _pass(
    x,
    y,
    g,
    logb,
    cx,
    cy,
    lab,
    *,
    eps,
    damping,
    precision="ieee",
    guess=None,
    v=None,
    counter=None,
    config=None,
    want_lse=True,
):
    """One pass through the kernel module's launcher (no center)."""
    return K.softmin_triton(
        x,
        y,
        g,
        logb,
        cx,
        cy,
        eps,
        2.0,
        damping,
        v,
        lab,
        precision,
        want_lse,
        None,
        guess=guess,
        fallback_rows=counter,
        config=config,
    )


# ---------------------------------------------------------------------------------------
# CPU (interpreter)
# ---------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("shape", [(2, 37, 29, 5), (3, 65, 129, 64), (1, 19, 23, 200)])
def test_shift_exact_for_any_guess(shape):
    """Good guesses (up to ~36 log2 units off) take the shift path: no row recomputed;
    rows with a guess far too high (every term flushed), far too low (overflow) or NaN are
    recomputed with the running max in the same block, exactly those rows, and every row
    equals float64."""
    B, N = shape[:2]
    x, y, g, logb, cx, cy, lab = _problem(*shape, seed=sum(shape) + 1)
    kw = dict(eps=0.2, damping=0.8)
    ref, ref_lse2, _ = softmin_ref(x, y, g, logb, cx, cy, c2=2.0, labels=lab, **kw)
    counter = torch.zeros(1, dtype=torch.int32)
    # 20 eps off (in potential units): 36 log2 units with damping 0.8, inside the window
    guess = ref.float() + 4.0 * torch.tensor([1.0, -1.0]).repeat(N)[:N]
    out, lse2, _ = _pass(x, y, g, logb, cx, cy, lab, guess=guess, counter=counter, **kw)
    assert int(counter) == 0
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse2.double(), ref_lse2, atol=2e-5, rtol=1e-5)
    bad = guess.clone()
    bad[:, 0::3] += 1e3  # far too high: every term flushed to zero
    bad[:, 1::3] -= 1e3  # far too low: overflow
    bad[-1, 2] = float("nan")
    n_bad = B * (len(range(0, N, 3)) + len(range(1, N, 3))) + 1
    out, lse2, _ = _pass(x, y, g, logb, cx, cy, lab, guess=bad, counter=counter, **kw)
    assert int(counter) == n_bad
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse2.double(), ref_lse2, atol=2e-5, rtol=1e-5)


@needs_interpreter
def test_kernel_choice_and_empty_problem():
    """A guess selects the shift kernel (it counts its fallback rows); no guess, or a pass
    with V, runs the running-max kernel (the counter stays 0 even for a hopeless guess).
    A problem whose column weights are all zero gives out = +inf in every kernel, as in
    float64."""
    x, y, g, logb, cx, cy, _ = _problem(2, 37, 29, 5, seed=11)
    logb[1] = float("-inf")
    kw = dict(eps=0.2, damping=1.0)
    ref, _, _ = softmin_ref(x, y, g, logb, cx, cy, c2=2.0, **kw)
    assert torch.isinf(ref[1]).all() and torch.isfinite(ref[0]).all()
    counter = torch.zeros(1, dtype=torch.int32)
    guess = torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref)).float()
    out = _pass(x, y, g, logb, cx, cy, None, guess=guess, counter=counter, **kw)[0]
    assert int(counter) == 37  # the rows of the empty problem
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    counter.zero_()
    out = _pass(x, y, g, logb, cx, cy, None, counter=counter, **kw)[0]
    assert int(counter) == 0
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    v = torch.randn(2, 29, 3, generator=torch.Generator().manual_seed(4))
    ref_v = softmin_ref(x, y, g, logb, cx, cy, c2=2.0, v=v, **kw)[2]
    vbar = _pass(x, y, g, logb, cx, cy, None, guess=guess + 1e4, v=v, counter=counter, **kw)[2]
    assert int(counter) == 0
    torch.testing.assert_close(vbar[0].double(), ref_v[0], atol=3e-5, rtol=1e-5)


@needs_interpreter
def test_autotune_switch_is_read_at_call_time(monkeypatch):
    """FLASHSINKHORN_NO_AUTOTUNE and the interpreter pick the fixed config per launch; a
    given config is used as is (the GPU tests sweep the autotune space with it)."""
    seen = []
    real = K._pick

    def spy(tuned, kernel, config):
        kern, cfg = real(tuned, kernel, config)
        seen.append((kern is kernel, cfg.get("BLOCK_M"), cfg.get("num_warps")))
        return kern, cfg

    monkeypatch.setattr(K, "_pick", spy)
    x, y, g, logb, cx, cy, _ = _problem(1, 20, 30, 4)
    kw = dict(eps=0.3, damping=1.0)
    ref = softmin_ref(x, y, g, logb, cx, cy, c2=2.0, **kw)[0]
    monkeypatch.setenv("FLASHSINKHORN_NO_AUTOTUNE", "0")  # the interpreter still forces it
    out = _pass(x, y, g, logb, cx, cy, None, guess=ref.float(), **kw)[0]
    out2 = _pass(x, y, g, logb, cx, cy, None, guess=ref.float(), config=(16, 32, 4, 1), **kw)[0]
    assert seen == [(True, _config.FIXED[0], _config.FIXED[2]), (True, 16, 4)]
    for o in (out, out2):
        torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not _config.interpret() and not _config.no_autotune()
    assert _config.plan_apply_config(300) == _config.PLAN_APPLY_WIDE
    monkeypatch.setenv("FLASHSINKHORN_NO_AUTOTUNE", "1")
    assert _config.no_autotune() and _config.plan_apply_config(300) == _config.FIXED


# ---------------------------------------------------------------------------------------
# GPU: the tensor-core precisions, and every config of the autotune space
# ---------------------------------------------------------------------------------------

# (precision, atol on the potential, atol on the softmax average) at eps = 0.01 on clouds
# of radius ~1 (potentials in cost units): tf32 / bf16 errors scale with |x||y| u
TOL = {"ieee": (2e-5, 1e-4), "tf32x3": (2e-5, 1e-4), "tf32": (2e-3, 3e-2), "bf16": (2e-2, 1e-1)}
# every precision once with one feature chunk and once with several; d = 64: one chunk,
# EVEN_D; d = 3: one masked chunk; d = 512: 8 even chunks; d = 784: 13 chunks, masked tail.
# (tf32 at d = 64, 512 and 1024 is also covered config by config below.)
GPU_CASES = [
    (64, "bf16"),
    (64, "tf32x3"),
    (3, "tf32"),
    (3, "ieee"),
    (784, "ieee"),
    (784, "tf32"),
    (784, "tf32x3"),
    (512, "bf16"),
]


def _uniform(n, m, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    s = 1 / math.sqrt(d)
    x = torch.rand(1, n, d, generator=gen) * s
    y = torch.rand(1, m, d, generator=gen) * s + 0.5 * s
    return x.cuda(), y.cuda()


def _gpu_problem(n, m, d, seed):
    x, y = _uniform(n, m, d, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    g = (0.01 * torch.randn(1, m, generator=gen)).cuda()
    logb = torch.full((1, m), -math.log(m), device="cuda")
    return x, y, g, logb, (x * x).sum(-1), (y * y).sum(-1)


@pytest.mark.gpu
@pytest.mark.parametrize("d,precision", GPU_CASES)
def test_kernels_vs_float64_gpu(d, precision):
    """Each kernel (cold start, plan application with V = Y, shift with a good guess and
    with a third of the rows far off either way) within the precision's float64 bound."""
    atol, vtol = TOL[precision]
    n, m, eps = 1000, 1500, 0.01
    x, y, g, logb, cx, cy = _gpu_problem(n, m, d, seed=d)
    ref, ref_lse2, refv = softmin_ref(x, y, g, logb, cx, cy, eps=eps, c2=2.0, damping=0.9, v=y)
    kw = dict(eps=eps, damping=0.9, precision=precision)
    out, lse2, _ = _pass(x, y, g, logb, cx, cy, None, **kw)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() < atol
    _, _, vbar = _pass(x, y, g, logb, cx, cy, None, v=y, **kw)
    assert (vbar.double() - refv).abs().max() < vtol
    sign = torch.tensor([1.0, -1.0], device="cuda").repeat(n)[:n]
    good = ref.float() + 3 * eps * sign
    bad = good.clone()
    bad[:, 0::3] += 1e4 * eps
    bad[:, 1::3] -= 1e4 * eps
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    for guess, n_bad in ((good, 0), (bad, len(range(0, n, 3)) + len(range(1, n, 3)))):
        counter.zero_()
        out, lse2, _ = _pass(x, y, g, logb, cx, cy, None, guess=guess, counter=counter, **kw)
        assert int(counter) == n_bad
        assert torch.isfinite(out).all()
        assert (out.double() - ref).abs().max() < atol
        assert (lse2.double() - ref_lse2).abs().max() < atol / (eps * LN2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "d,precision,kernels",
    [
        (64, "tf32", ("shift", "running-max")),
        (64, "bf16", ("shift", "running-max")),
        (64, "tf32x3", ("running-max",)),
        (512, "tf32", ("shift", "running-max")),
        (1024, "tf32", ("shift", "running-max")),
    ],
)
def test_every_autotune_config_gpu(d, precision, kernels):
    """Every config the autotuner may pick, for the shift and running-max kernels, within
    the precision's float64 bound. The launches use the production flags (no labels, no
    lse, no counter), operands prepared as Problem prepares them, and sizes that are
    multiples of 16 like the benchmark's: these compiles are the ones the benchmark's
    autotuner (and hvp's tf32x3 tail, running max) then finds in Triton's cache."""
    n, m, eps = 1504, 1296, 0.01
    x, y, g, logb, cx, cy = _gpu_problem(n, m, d, seed=d + 1)
    ref = softmin_ref(x, y, g, logb, cx, cy, eps=eps, c2=2.0, damping=0.9)[0]
    space = _config.TUNE_SMALL_D if d <= 128 else _config.TUNE_LARGE_D
    kdt = torch.bfloat16 if precision == "bf16" else torch.float32
    for kernel in kernels:
        guess = ref.float() + 3 * eps if kernel == "shift" else None
        for cfg in space:
            out = _pass(
                x.to(kdt),
                y.to(kdt),
                g,
                logb,
                cx,
                cy,
                None,
                eps=eps,
                damping=0.9,
                precision=precision,
                guess=guess,
                config=cfg,
                want_lse=False,
            )[0]
            err = float((out.double() - ref).abs().max())
            assert torch.isfinite(out).all() and err < TOL[precision][0], (kernel, cfg, err)


@pytest.mark.gpu
def test_self_softmin_gpu():
    """The symmetric self kernel (tf32, the fixed config) against float64 at d = 64."""
    n, d, eps = 1500, 64, 0.01
    x, _ = _uniform(n, n, d, seed=9)
    c = x.mean(1)
    cx = 0.5 * ((x - c[:, None]) ** 2).sum(-1)
    loga = torch.full((1, n), -math.log(n), device="cuda")
    f = 0.002 * torch.randn(1, n, generator=torch.Generator().manual_seed(1)).cuda()
    xc = x - c[:, None]
    ref = softmin_ref(xc, xc, f, loga, cx, cx, eps=eps, c2=1.0, damping=0.9)[0]
    out = fs.self_softmin(x, loga, f, cx, eps=eps, c2=1.0, damping=0.9, center=c)
    assert (out.double() - ref).abs().max() < TOL["tf32"][0]
