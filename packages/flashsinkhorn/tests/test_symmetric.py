"""symmetric_update (primitives.py): both updates of a symmetric Sinkhorn iteration in one
pass (_symmetric_triton.py; the sm_90 Gluon version in test_symmetric_hopper.py), against
the float64 reference and the two-pass torch path in the same dtype.

CPU tests run the Triton kernel under the interpreter (one fixed config); GPU tests run
the tensor-core precisions and the solver's symmetric schedule above the one-pass size.
"""

import math

import pytest
import torch
from _helpers import needs_interpreter

import flashsinkhorn as fs
from flashsinkhorn import _config
from flashsinkhorn.primitives import one_pass_reason


def _problem(B, N, M, D, seed=0, device="cpu"):
    """Clouds, weights and potentials near a symmetric iterate (potentials: a few
    alternating torch iterations from zero, plus noise)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(B, N, D, generator=gen) / math.sqrt(D)
    y = torch.rand(B, M, D, generator=gen) / math.sqrt(D) + 0.3 / math.sqrt(D)
    a = torch.rand(B, N, generator=gen) + 0.1
    b = torch.rand(B, M, generator=gen) + 0.1
    a, b = a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True)
    x, y, a, b = (t.to(device) for t in (x, y, a, b))
    cx, cy = (x * x).sum(-1), (y * y).sum(-1)
    return dict(x=x, y=y, loga=a.log(), logb=b.log(), cx=cx, cy=cy)


def _potentials(p, eps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    kw = dict(eps=eps, c2=2.0, backend="torch")
    f = torch.zeros_like(p["cx"])
    for _ in range(2):
        g = fs.softmin(p["y"], p["x"], f, p["loga"], p["cy"], p["cx"], **kw)[0]
        f = fs.softmin(p["x"], p["y"], g, p["logb"], p["cx"], p["cy"], **kw)[0]
    noise = eps * torch.randn(f.shape, generator=gen).to(f.device)
    return f + noise, g


def _update(p, f, g, eps, dx=1.0, dy=1.0, **kw):
    return fs.symmetric_update(
        p["x"],
        p["y"],
        f,
        g,
        p["loga"],
        p["logb"],
        p["cx"],
        p["cy"],
        eps=eps,
        c2=2.0,
        damping_x=dx,
        damping_y=dy,
        **kw,
    )


def _ref(p, f, g, eps, dx=1.0, dy=1.0):
    d = {k: v.double() for k, v in p.items()}
    return fs.symmetric_update_ref(
        d["x"],
        d["y"],
        f.double(),
        g.double(),
        d["loga"],
        d["logb"],
        d["cx"],
        d["cy"],
        eps=eps,
        c2=2.0,
        damping_x=dx,
        damping_y=dy,
    )


def _err(a, b):
    a, b = a.double(), b.double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    same_inf = torch.isinf(a) & (a == b)
    d = (a - b).abs().masked_fill(both_nan | same_inf, 0.0)
    return float(d.max())


def _check(p, f, g, eps, dx=1.0, dy=1.0, stats=None, atol=1e-6):
    """One pass against float64, at most 2x the two-pass torch path's error in fp32."""
    stats = {} if stats is None else stats
    ft, gt = _update(p, f, g, eps, dx, dy, precision="ieee", backend="triton", stats=stats)
    assert stats["kernel"] == "one pass (Triton)", stats
    t_f, t_g = _update(p, f, g, eps, dx, dy, backend="torch")
    r_f, r_g = _ref(p, f, g, eps, dx, dy)
    for ours, torch_path, ref in ((ft, t_f, r_f), (gt, t_g, r_g)):
        assert ours.dtype == torch.float32
        assert _err(ours, ref) <= 2 * _err(torch_path, ref) + atol
    return stats


SHAPES = [  # (B, N, M, D)
    (1, 1, 1, 1),
    (2, 37, 53, 3),
    (1, 70, 45, 100),
    (1, 19, 23, 130),  # D > 128: the feature-chunk loop, a partial last chunk
]


@needs_interpreter
@pytest.mark.parametrize("shape", SHAPES)
def test_one_pass_matches_float64(shape):
    p = _problem(*shape, seed=sum(shape))
    f, g = _potentials(p, 0.05)
    stats = _check(p, f, g, 0.05, 0.9, 0.7)  # unbalanced dampings, different per side
    assert int(stats["rows_recomputed"]) == 0 and int(stats["cols_recomputed"]) == 0


@needs_interpreter
def test_column_chunks_and_row_blocks(monkeypatch):
    # three row blocks, chunks of one column tile: every chunk boundary and partial tile
    monkeypatch.setattr(_config, "SYM_PARTIAL_BYTES", 1)
    monkeypatch.setattr(_config, "SYM_MIN_CHUNK_TILES", 1)
    p = _problem(2, 150, 141, 8, seed=4)
    f, g = _potentials(p, 0.05)
    _check(p, f, g, 0.05)


@needs_interpreter
def test_zero_weights_and_hostile_potentials_are_recomputed():
    B, N, M = 2, 70, 61
    p = _problem(B, N, M, 4, seed=9)
    eps = 0.05
    f, g = _potentials(p, eps)
    p["loga"][0, 5] = float("-inf")  # a zero row weight: its row sum is 0
    p["logb"][1, ::9] = float("-inf")  # zero column weights
    f[1, ::7] -= 1e4 * eps  # far too low: these rows' sums underflow
    f[0, 3] += 1e3 * eps  # far too high: row 3 overflows, and every column with it
    g[1, 2] = float("nan")  # a NaN potential: its column, and every row of problem 1
    stats = _check(p, f, g, eps)
    # problem 0: row 5 (zero weight), row 3 (overflow); every column of problem 0 sums the
    # overflowed row 3; problem 1: every row sums the NaN column
    assert int(stats["rows_recomputed"]) == 2 + N
    assert int(stats["cols_recomputed"]) == M + (len(range(0, M, 9)) + 1)


def test_one_pass_reasons():
    x = torch.zeros(1, 10, 4)
    assert "torch" in one_pass_reason(x, x, None, "torch")
    assert "label" in one_pass_reason(x, x, (None,), "triton")
    assert one_pass_reason(x, x, None, "triton") is None  # CPU: no size threshold
    with pytest.raises(ValueError, match="g must be"):
        z = torch.zeros(1, 10)
        fs.symmetric_update(x, x, z, z[:, :3], z, z, z, z, eps=0.1, c2=2.0)


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32", "bf16", "ieee"])
def test_one_pass_triton_tensor_cores(monkeypatch, precision):
    from flashsinkhorn.operands import round_to_tf32

    monkeypatch.setattr(_config, "ONE_PASS_MIN_SCORES", 1)  # 2M scores: one pass anyway
    p = _problem(2, 777, 1299, 64, seed=3, device="cuda")
    eps = 0.01
    f, g = _potentials(p, eps)
    kdt = torch.bfloat16 if precision == "bf16" else torch.float32
    xk, yk = p["x"].to(kdt), p["y"].to(kdt)
    if precision == "tf32":  # exactly representable operands, as the solvers prepare them
        xk, yk = round_to_tf32(xk), round_to_tf32(yk)
    q = dict(p, x=xk, y=yk)
    stats = {}
    ft, gt = _update(q, f, g, eps, 0.9, 1.0, precision=precision, backend="triton", stats=stats)
    assert stats["kernel"] == "one pass (Triton)"
    assert int(stats["rows_recomputed"]) == 0 and int(stats["cols_recomputed"]) == 0
    r_f, r_g = _ref(q, f, g, eps, 0.9, 1.0)
    # the peer: two Triton passes on the same operands
    kw = dict(eps=eps, c2=2.0, precision=precision, backend="triton")
    two_f = fs.softmin(q["x"], q["y"], g, q["logb"], q["cx"], q["cy"], damping=0.9, guess=f, **kw)[
        0
    ]
    two_g = fs.softmin(q["y"], q["x"], f, q["loga"], q["cy"], q["cx"], guess=g, **kw)[0]
    for ours, two, ref in ((ft, two_f, r_f), (gt, two_g, r_g)):
        assert _err(ours, ref) <= 2 * _err(two, ref) + 1e-6
        assert _err(ours, ref) < 1e-4


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")


def _kernel_operands(p, precision):
    from flashsinkhorn.operands import round_to_tf32

    if precision == "bf16":
        return dict(p, x=p["x"].bfloat16(), y=p["y"].bfloat16())
    return dict(p, x=round_to_tf32(p["x"]), y=round_to_tf32(p["y"]))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("d,precision", [(64, "tf32"), (64, "bf16"), (512, "tf32"), (512, "bf16")])
def test_one_pass_sm90_matches_float64_and_triton(monkeypatch, d, precision):
    # the Gluon kernel's sums through symmetric_update, chunks of 256 columns (several
    # launches, partial tiles and row blocks), against float64 and the Triton one pass
    from flashsinkhorn import _symmetric_hopper as SH
    from flashsinkhorn import primitives

    q = _kernel_operands(_problem(2, 777, 1299, d, seed=d, device="cuda"), precision)
    eps = 0.01
    f, g = _potentials(q, eps)
    real = SH.symmetric_sums_hopper
    calls = []

    def chunked(*a, **k):
        calls.append(1)
        return real(*a, chunk=256, **k)

    monkeypatch.setattr(_config, "ONE_PASS_MIN_SCORES", 1)  # 2M scores: one pass anyway
    monkeypatch.setattr(primitives._symmetric_hopper, "symmetric_sums_hopper", chunked)
    stats = {}
    ft, gt = _update(q, f, g, eps, 0.9, 1.0, precision=precision, backend="auto", stats=stats)
    assert calls and stats["kernel"] == "one pass (sm_90 Gluon)", stats
    monkeypatch.setattr(primitives._symmetric_hopper, "symmetric_sums_hopper", real)
    assert int(stats["rows_recomputed"]) == 0 and int(stats["cols_recomputed"]) == 0
    tri = {}
    t_f, t_g = _update(q, f, g, eps, 0.9, 1.0, precision=precision, backend="triton", stats=tri)
    assert tri["kernel"] == "one pass (Triton)"
    r_f, r_g = _ref(q, f, g, eps, 0.9, 1.0)
    for ours, peer, ref in ((ft, t_f, r_f), (gt, t_g, r_g)):
        assert _err(ours, ref) <= 2 * _err(peer, ref) + 1e-6
        assert _err(ours, ref) < 1e-4


@pytest.mark.gpu
@needs_sm90
def test_one_pass_sm90_recomputes_hostile_rows_and_columns(monkeypatch):
    B, N, M = 2, 300, 700
    q = _kernel_operands(_problem(B, N, M, 64, seed=9, device="cuda"), "tf32")
    eps = 0.01
    f, g = _potentials(q, eps)
    q["loga"][0, 5] = float("-inf")  # as in the CPU test above
    q["logb"][1, ::9] = float("-inf")
    f[1, ::7] -= 1e4 * eps
    f[0, 3] += 1e3 * eps
    g[1, 2] = float("nan")
    stats = {}
    _update(q, f, g, eps, precision="tf32", backend="auto", stats=stats)
    assert stats["kernel"].startswith("two passes")  # 210k scores: below the threshold
    monkeypatch.setattr(_config, "ONE_PASS_MIN_SCORES", 1)
    ft, gt = _update(q, f, g, eps, precision="tf32", backend="auto", stats=stats)
    assert stats["kernel"] == "one pass (sm_90 Gluon)"
    assert int(stats["rows_recomputed"]) == 2 + N
    assert int(stats["cols_recomputed"]) == M + (len(range(0, M, 9)) + 1)
    r_f, r_g = _ref(q, f, g, eps)
    assert _err(ft, r_f) < 1e-4 and _err(gt, r_g) < 1e-4


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("debias", [False, True])
def test_loops_above_the_one_pass_size(monkeypatch, debias):
    # 2100 x 2100 = 4.4M scores: the loops' symmetric updates take the one pass, the
    # Gluon kernel under "auto", the Triton one under "triton"; both against float64
    # (GeomLoss's float64 re-implementation, solve's float64 torch loop), at most 2x the
    # Triton path's error
    from flashsinkhorn import _symmetric_hopper as SH

    calls = []
    real = SH.symmetric_sums_hopper
    spy = lambda *a, **k: calls.append(1) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(SH, "symmetric_sums_hopper", spy)
    gen = torch.Generator().manual_seed(2)
    n, d = 2100, 64  # d = 64: the kernels the other tests compiled
    x = (torch.rand(n, d, generator=gen) / d**0.5).cuda()
    y = (torch.rand(n, d, generator=gen) / d**0.5 + 0.2 / d**0.5).cuda()
    a = torch.full((n,), 1.0 / n, device="cuda")
    assert n * n >= _config.ONE_PASS_MIN_SCORES
    ref = float(fs.samples_loss_ref(a, x, a, y, blur=0.05, scaling=0.5, debias=debias))
    val = {
        be: float(fs.SamplesLoss(blur=0.05, scaling=0.5, debias=debias, backend=be)(x, y))
        for be in ("auto", "triton")
    }
    assert calls, "the loop did not reach the sm_90 one pass"
    assert abs(val["auto"] - ref) <= 2 * abs(val["triton"] - ref) + 1e-7
    # the bound, 1e-6 relative to the terms the value is made of: the debiased
    # value OT(x, y) - (OT(x, x) + OT(y, y)) / 2 cancels most of them (float32 rounding of
    # each term, not of their difference)
    scale = abs(ref)
    if debias:
        terms = [(x, y, 1.0), (x, x, 0.5), (y, y, 0.5)]
        scale = sum(
            w * abs(float(fs.samples_loss_ref(a, p, a, q, blur=0.05, scaling=0.5, debias=False)))
            for p, q, w in terms
        )
    assert abs(val["auto"] - ref) <= 1e-6 * scale + 1e-7
    if not debias:
        kw = dict(eps=0.01, schedule="symmetric", eps_scaling=0.7, max_iter=40, tol=None)
        r64 = fs.solve(x.double(), y.double(), backend="torch", **kw).value
        v = {be: fs.solve(x, y, backend=be, **kw).value.double() for be in ("auto", "triton")}
        assert abs(v["auto"] - r64) <= 2 * abs(v["triton"] - r64) + 1e-7


def test_a_backend_without_a_one_pass_kernel_gets_two_passes():
    # a backend that supplies only sm_x / sm_y (the sharded problem of
    # flashsinkhorn.distributed, a new backend) gets the base class's two passes
    from flashsinkhorn.problem import Problem

    calls = []

    class Own(Problem):
        def sm_x(self, g, eps, damping=1.0, v=None, want_lse=False, guess=None):
            calls.append("x")
            kw = dict(eps=eps, c2=self.c2, damping=damping, backend="torch", guess=guess)
            return fs.softmin(self.X, self.Y, g, self.logb, self.cx, self.cy, **kw)

        def sm_y(self, f, eps, damping=1.0, v=None, want_lse=False, guess=None):
            calls.append("y")
            kw = dict(eps=eps, c2=self.c2, damping=damping, backend="torch", guess=guess)
            return fs.softmin(self.Y, self.X, f, self.loga, self.cy, self.cx, **kw)

    p = _problem(1, 9, 7, 3)
    a, b = p["loga"].exp(), p["logb"].exp()
    prob = Own(X=p["x"], Y=p["y"], a=a, b=b, cx=p["cx"], cy=p["cy"], c2=2.0)
    f, g = torch.zeros_like(a), torch.zeros_like(b)
    ft, gt = prob.sym_update(f, g, 0.1)
    assert calls == ["x", "y"]
    r_f, r_g = _ref(p, f, g, 0.1)
    assert _err(ft, r_f) < 1e-5 and _err(gt, r_g) < 1e-5
