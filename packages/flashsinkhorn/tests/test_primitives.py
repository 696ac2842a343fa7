"""softmin / plan_apply / self_softmin (primitives.py) against the float64 references, on both
backends (the Triton kernels under the interpreter on CPU), fresh random inputs, odd sizes.

The kernel-specific behaviour (the shift kernel's fallback rows, every tile config, the
tensor-core precisions on the GPU) is in test_softmin_triton.py.
"""

import math

import pytest
import torch
from _helpers import BACKENDS, INTERPRET, needs_interpreter

import flashsinkhorn as fs
from flashsinkhorn.primitives import problem_backend, resolve_backend, sm90_pass_reason
from flashsinkhorn.reference import plan_apply_ref, softmin_ref

SHAPES = [  # (B, N, M, D)
    (1, 1, 1, 1),
    (2, 37, 53, 3),
    (1, 70, 45, 100),
    (1, 19, 23, 784),  # D > 128: the feature-chunk loop, a partial last chunk
    (3, 65, 129, 16),
]


def _inputs(B, N, M, D, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, D, generator=gen, dtype=dtype) / D**0.5
    y = torch.randn(B, M, D, generator=gen, dtype=dtype) / D**0.5
    g = 0.1 * torch.randn(B, M, generator=gen, dtype=dtype)
    logb = torch.log(torch.rand(B, M, generator=gen, dtype=dtype) + 0.05)
    cx, cy = (x * x).sum(-1), (y * y).sum(-1)
    return x, y, g, logb, cx, cy


def _labels(B, N, M, seed):
    gen = torch.Generator().manual_seed(seed)
    lx = torch.randint(0, 3, (B, N), generator=gen)
    ly = torch.randint(0, 4, (B, M), generator=gen)
    return (lx, ly, torch.rand(3, 4, generator=gen), 0.7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_guess", [False, True])
def test_softmin_matches_float64(backend, shape, with_guess):
    """Cold start (no guess: the running-max kernel) and a Sinkhorn-loop pass (a guess 1
    eps off the result: the shift kernel), labels and a zero column weight included."""
    B, N, M, D = shape
    x, y, g, logb, cx, cy = _inputs(*shape, seed=sum(shape))
    logb[0, M // 2] = float("-inf")
    lab = _labels(B, N, M, seed=D) if N > 1 else None
    kw = dict(eps=0.3, c2=2.0, damping=0.8, labels=lab)
    ref, ref_lse2, _ = softmin_ref(x, y, g, logb, cx, cy, **kw)
    guess = None
    if with_guess:
        noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
        guess = (ref + 0.3 * noise).float()
    out, lse2, vbar = fs.softmin(
        x, y, g, logb, cx, cy, backend=backend, precision="ieee", want_lse=True, guess=guess, **kw
    )
    assert vbar is None
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse2.double(), ref_lse2, atol=2e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("with_guess", [False, True])
def test_softmin_precision_paths_interpreter(precision, with_guess):
    """The tf32 / tf32x3 launch paths (the interpreter computes their dots in fp32, so the
    bound is fp32's; the tensor-core rounding is tested on the GPU)."""
    x, y, g, logb, cx, cy = _inputs(2, 37, 29, 5, seed=7)
    kw = dict(eps=0.2, c2=2.0, damping=0.8, labels=_labels(2, 37, 29, seed=8))
    ref = softmin_ref(x, y, g, logb, cx, cy, **kw)[0]
    guess = (ref + 0.1).float() if with_guess else None
    out = fs.softmin(
        x, y, g, logb, cx, cy, backend="triton", precision=precision, guess=guess, **kw
    )[0]
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dv", [1, 5, 70, 300])
def test_softmin_average(backend, dv):
    """The plan-application pass: DV > 64 runs in 256-wide output chunks (300 = 256 + 44)."""
    x, y, g, logb, cx, cy = _inputs(2, 41, 67, 7, seed=1)
    v = torch.randn(2, 67, dv, generator=torch.Generator().manual_seed(dv))
    _, _, ref = softmin_ref(x, y, g, logb, cx, cy, eps=0.2, c2=2.0, v=v)
    _, _, vbar = fs.softmin(
        x,
        y,
        g,
        logb,
        cx,
        cy,
        eps=0.2,
        c2=2.0,
        v=v,
        backend=backend,
        precision="ieee",
        guess=torch.zeros(2, 41),
    )
    torch.testing.assert_close(vbar.double(), ref, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_label_cost_in_kernel(backend):
    B, N, M, D = 2, 33, 40, 5
    x, y, g, logb, cx, cy = _inputs(B, N, M, D, seed=2)
    labels = _labels(B, N, M, seed=3)
    ref, _, refv = softmin_ref(x, y, g, logb, cx, cy, eps=0.25, c2=2.0, labels=labels, v=y)
    out, _, vbar = fs.softmin(
        x,
        y,
        g,
        logb,
        cx,
        cy,
        eps=0.25,
        c2=2.0,
        labels=labels,
        v=y,
        backend=backend,
        precision="ieee",
    )
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(vbar.double(), refv, atol=2e-5, rtol=1e-5)
    # the label term matters: without it the result differs
    plain, _, _ = fs.softmin(x, y, g, logb, cx, cy, eps=0.25, c2=2.0, backend=backend)
    assert (plain - out).abs().max() > 1e-3


@needs_interpreter
def test_triton_equals_torch_path():
    x, y, g, logb, cx, cy = _inputs(2, 90, 77, 24, seed=4)
    kw = dict(eps=0.05, c2=2.0, precision="ieee", want_lse=True, v=y)
    t = fs.softmin(x, y, g, logb, cx, cy, backend="triton", **kw)
    p = fs.softmin(x, y, g, logb, cx, cy, backend="torch", **kw)
    for u, w in zip(t, p):
        torch.testing.assert_close(u, w, atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_weight_columns_are_ignored(backend):
    x, y, g, logb, cx, cy = _inputs(1, 10, 12, 3, seed=5)
    logb[:, :4] = float("-inf")
    kw = dict(eps=0.3, c2=2.0, backend=backend, precision="ieee")
    out, _, _ = fs.softmin(x, y, g, logb, cx, cy, **kw)
    ref, _, _ = softmin_ref(x, y[:, 4:], g[:, 4:], logb[:, 4:], cx, cy[:, 4:], eps=0.3, c2=2.0)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_apply_matches_dense(backend):
    gen = torch.Generator().manual_seed(6)
    x, y = torch.rand(1, 30, 4, generator=gen), torch.rand(1, 26, 4, generator=gen)
    a, b = torch.full((1, 30), 1 / 30), torch.full((1, 26), 1 / 26)
    f, g = 0.1 * torch.randn(1, 30, generator=gen), 0.1 * torch.randn(1, 26, generator=gen)
    v = torch.randn(1, 26, 3, generator=gen)
    cx, cy = (x * x).sum(-1), (y * y).sum(-1)
    out, rows = fs.plan_apply(
        x, y, a, b, f, g, v, cx, cy, eps=0.1, c2=2.0, backend=backend, precision="ieee"
    )
    ref = plan_apply_ref(x, y, a, b, f, g, v, eps=0.1)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    ones = plan_apply_ref(x, y, a, b, f, g, torch.ones(1, 26, 1), eps=0.1)[..., 0]
    torch.testing.assert_close(rows.double(), ones, atol=1e-6, rtol=1e-4)
    bary, _ = fs.plan_apply(
        x,
        y,
        a,
        b,
        f,
        g,
        y,
        cx,
        cy,
        eps=0.1,
        c2=2.0,
        normalize=True,
        backend=backend,
        precision="ieee",
    )
    ref_bary = plan_apply_ref(x, y, a, b, f, g, y, eps=0.1) / ones[..., None]
    torch.testing.assert_close(bary.double(), ref_bary, atol=1e-5, rtol=1e-4)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda", torch.device("cpu"))
    x, y, g, logb, cx, cy = _inputs(1, 4, 5, 2)
    with pytest.raises(ValueError, match="precision"):
        fs.softmin(x, y, g, logb, cx, cy, eps=0.1, c2=2.0, precision="fp8")
    with pytest.raises(ValueError, match=r"x must be \(B, N, D\)"):
        fs.softmin(x[0], y, g, logb, cx, cy, eps=0.1, c2=2.0)
    with pytest.raises(ValueError, match=r"y must be \(1, M, 2\)"):
        fs.softmin(x, y[..., :1], g, logb, cx, cy, eps=0.1, c2=2.0)
    with pytest.raises(ValueError, match=r"g must be \(1, 5\)"):
        fs.softmin(x, y, g[:, :3], logb, cx, cy, eps=0.1, c2=2.0)
    with pytest.raises(ValueError, match=r"cx must be \(1, 4\)"):
        fs.softmin(x, y, g, logb, cy, cy, eps=0.1, c2=2.0)
    with pytest.raises(ValueError, match=r"guess must be \(1, 4\)"):
        fs.softmin(x, y, g, logb, cx, cy, eps=0.1, c2=2.0, guess=g)
    with pytest.raises(ValueError, match=r"v must be \(1, 5, DV\)"):
        fs.softmin(x, y, g, logb, cx, cy, eps=0.1, c2=2.0, v=x)
    for eps in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps"):
            fs.softmin(x, y, g, logb, cx, cy, eps=eps, c2=2.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [3, 150])
def test_center_subtracted_in_kernel(backend, d):
    """center=c computes <x - c, y - c>: shifted clouds with the shift as center agree."""
    x, y, g, logb, cx, cy = _inputs(2, 29, 38, d, seed=7)
    shift = 5.0 + torch.randn(2, d, generator=torch.Generator().manual_seed(d))
    ref, _, refv = softmin_ref(x, y, g, logb, cx, cy, eps=0.2, c2=2.0, v=y)
    out, _, vbar = fs.softmin(
        x + shift[:, None],
        y + shift[:, None],
        g,
        logb,
        cx,
        cy,
        eps=0.2,
        c2=2.0,
        v=y,
        backend=backend,
        precision="ieee",
        center=shift,
    )
    torch.testing.assert_close(out.double(), ref, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(vbar.double(), refv, atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,N,D", [(1, 1, 3), (2, 70, 3), (1, 200, 20), (1, 130, 150)])
def test_self_softmin_matches_float64(backend, B, N, D):
    """The half-tile symmetric self-transport update against the float64 softmin."""
    gen = torch.Generator().manual_seed(N)
    x = torch.rand(B, N, D, generator=gen)
    c = x.mean(1)
    cx = 0.5 * ((x - c[:, None]) ** 2).sum(-1)
    loga = torch.log(torch.rand(B, N, generator=gen) + 0.2)
    loga = loga - torch.logsumexp(loga, -1, keepdim=True)
    f = 0.02 * torch.randn(B, N, generator=gen)
    ref, _, _ = softmin_ref(
        x - c[:, None], x - c[:, None], f, loga, cx, cx, eps=0.05, c2=1.0, damping=0.9
    )
    out = fs.self_softmin(
        x, loga, f, cx, eps=0.05, c2=1.0, damping=0.9, center=c, precision="ieee", backend=backend
    )
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


@needs_interpreter
def test_self_softmin_falls_back_on_zero_weights():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(1, 50, 2, generator=gen)
    cx = 0.5 * (x**2).sum(-1)
    loga = torch.full((1, 50), -math.log(50))
    loga[0, 3] = float("-inf")  # a zero weight: the fixed-offset kernel must not be used
    f = torch.zeros(1, 50)
    ref, _, _ = softmin_ref(x, x, f, loga, cx, cx, eps=0.01, c2=1.0)
    out = fs.self_softmin(x, loga, f, cx, eps=0.01, c2=1.0, backend="triton", precision="ieee")
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("D", [64, 256])
def test_softmin_even_d_fused_bias_and_tail(backend, D):
    """D a multiple of the D block (the kernel drops the D mask), a zero column weight
    (log b = -inf inside the fused column bias), a partial last column tile, and the
    plan-application pass, against the float64 oracle."""
    x, y, g, logb, cx, cy = _inputs(2, 70, 130, D, seed=3)
    logb[0, 5] = float("-inf")
    logb[1, 129] = float("-inf")
    v = torch.randn(2, 130, 3, generator=torch.Generator().manual_seed(4))
    ref, ref_lse2, refv = softmin_ref(x, y, g, logb, cx, cy, eps=0.2, c2=2.0, damping=0.7, v=v)
    out, lse2, vbar = fs.softmin(
        x,
        y,
        g,
        logb,
        cx,
        cy,
        eps=0.2,
        c2=2.0,
        damping=0.7,
        v=v,
        want_lse=True,
        backend=backend,
        precision="ieee",
    )
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse2.double(), ref_lse2, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(vbar.double(), refv, atol=2e-5, rtol=1e-5)


def test_backend_choice_keeps_the_users_word():
    cpu = torch.device("cpu")
    # solvers keep "auto" (each pass may then take the sm_90 kernel) and "triton" (the
    # portable kernels only); float64 under "auto" and CPU without the interpreter: torch
    assert problem_backend("auto", cpu, torch.float64) == "torch"
    assert problem_backend("torch", cpu, torch.float32) == "torch"
    assert problem_backend("auto", cpu, torch.float32) == "torch"  # auto on CPU: torch
    if resolve_backend("auto", cpu) == "torch" and INTERPRET:
        assert problem_backend("triton", cpu, torch.float32) == "triton"
    x = torch.zeros(1, 8, 16)
    assert sm90_pass_reason(x, x, "tf32") == "not a CUDA tensor"
