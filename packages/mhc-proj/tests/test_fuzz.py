"""Property-based fuzzing of the public functions (#19): random batch shapes (empty, 1, odd,
several leading dims), layouts (transposed, expanded, strided views, storage offsets), n = 2..8,
float32 / float64 / bfloat16 / float16, values from the whole float range (zeros,
subnormals, huge, +-inf, NaN, masks), and random options. Properties, checked against the
truth recomputed in float64 from the returned output:

- every call returns within a time bound (a hang aborts the run with a traceback) or raises
  a ValueError / TypeError that names the bad argument;
- T has the input's shape and the requested dtype; a matrix is NaN exactly where the
  contract says (README, "Bad input"): a NaN or +inf entry, or (Birkhoff) a support of
  finite entries that contains no permutation, or (Sinkhorn) a row of -inf; every other
  matrix is finite, nonnegative, exactly 0 at -inf entries (Birkhoff), and converged;
- ``info.converged`` is never better than the truth: converged implies the marginal error
  of the T computed in the compute dtype and of the returned T (out_dtype), summed in
  float64, is <= tol; ``infeasible`` is set exactly for the infeasible supports;
- gradients are finite where T is finite and NaN where T is NaN.

The CPU tests run a bounded number of examples (seconds); the ``gpu`` tests run the same
properties against the CUDA kernels.
"""

import faulthandler
from contextlib import contextmanager

import pytest
import torch
from _mhc_test_env import fuzz_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mhc_proj import birkhoff_project, hyper_connection, marginal_error, sinkhorn_project
from mhc_proj._config import RANGE_TOL_F64

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SPECIALS = ["zero", "subnormal", "huge", "-huge", "inf", "-inf", "nan", "mask"]
TIME_BOUND_S = 120  # per call; generous for a loaded 2-core CI machine (calls take ms)
FUZZ = settings(
    max_examples=fuzz_examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=fuzz_examples(0) == 0,  # CI: the same examples every run
    database=None,
)
FUZZ_GPU = settings(FUZZ, max_examples=fuzz_examples(40))


@contextmanager
def time_bound(seconds=TIME_BOUND_S):
    """Aborts the process with every thread's traceback if the block does not return: the
    kernels release the GIL, so nothing in Python could interrupt a hang."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _special_value(kind: str, dtype: torch.dtype) -> float:
    fi = torch.finfo(dtype)
    return {
        "zero": 0.0,
        "subnormal": fi.tiny / 4 if dtype != torch.bfloat16 else fi.tiny,
        "huge": fi.max / 2,
        "-huge": -fi.max / 2,
        "inf": float("inf"),
        "-inf": float("-inf"),
        "nan": float("nan"),
        "mask": max(-1e30, -fi.max / 2),
    }[kind]


@st.composite
def logits_cases(draw, dtypes=DTYPES, device="cpu"):
    n = draw(st.integers(2, 8))
    dtype = draw(st.sampled_from(dtypes))
    batch = draw(st.sampled_from([(), (0,), (1,), (3,), (2, 5), (7, 1), (0, 3), (33,)]))
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 10.0, 1e3, 1e30, 1e300]))
    rate = draw(st.sampled_from([0.0, 0.0, 0.05, 0.3, 0.7]))
    kinds = draw(st.lists(st.sampled_from(SPECIALS), min_size=1, max_size=3, unique=True))
    layout = draw(st.sampled_from(["contiguous", "transposed", "expanded", "offset", "strided"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    fmax = torch.finfo(dtype).max
    shape = (*batch, n, n)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    x = x.clamp(-fmax / 2, fmax / 2)
    pick = torch.rand(shape, generator=g) < rate
    which = torch.randint(len(kinds), shape, generator=g)
    for k, kind in enumerate(kinds):
        x = torch.where(pick & (which == k), _special_value(kind, dtype), x)
    x = x.to(dtype)
    if layout == "transposed":
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif layout == "expanded" and len(batch) >= 1 and batch[0] > 0:
        x = x[:1].expand(*batch, n, n)
    elif layout == "offset":
        flat = torch.empty(x.numel() + 3, dtype=dtype)
        flat[3:] = x.reshape(-1)
        x = flat[3:].view(shape)
    elif layout == "strided":
        wide = torch.zeros(*batch, n, 2 * n, dtype=dtype)
        wide[..., ::2] = x
        x = wide[..., ::2]
    return x.to(device)


def _matchable(allowed: torch.Tensor) -> bool:
    """True when the (n, n) bool pattern contains a permutation (bit-mask DP over rows)."""
    n = allowed.shape[0]
    reach = {0}
    for i in range(n):
        cols = [j for j in range(n) if bool(allowed[i, j])]
        reach = {m | (1 << j) for m in reach for j in cols if not m >> j & 1}
        if not reach:
            return False
    return True


def _logit_range(x: torch.Tensor) -> torch.Tensor:
    """Per matrix: the largest span of a row's finite entries (an upper bound of the range
    the solver sees after its reduction)."""
    n = x.shape[-1]
    xc = x.detach().cpu().to(torch.float64).reshape(-1, n, n)
    fin = torch.isfinite(xc)
    hi = torch.where(fin, xc, -torch.inf).amax(-1, keepdim=True)
    span = torch.where(fin, hi - xc, torch.zeros_like(xc)).nan_to_num(0.0, posinf=0.0)
    return span.flatten(1).amax(1) if xc.shape[0] else torch.zeros(0, dtype=torch.float64)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN equal to NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _contract(x: torch.Tensor):
    """Per matrix (flattened batch): non-finite (NaN / +inf entry), infeasible support,
    the -inf mask; in the compute dtype."""
    n = x.shape[-1]
    xc = x.detach().cpu().to(torch.float64).reshape(-1, n, n)
    bad = (torch.isnan(xc) | (xc == float("inf"))).flatten(1).any(1)
    neg = xc == float("-inf")
    infeasible = torch.tensor(
        [not bad[b] and not _matchable(~neg[b]) for b in range(xc.shape[0])], dtype=torch.bool
    )
    return bad, infeasible, neg


def _check_birkhoff(x, tol=None, out_dtype=None, grad=False):
    n = x.shape[-1]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    want = x.dtype if out_dtype is None else out_dtype
    xr = x.detach().clone().requires_grad_(True) if grad else x
    with time_bound():
        t, info = birkhoff_project(xr, tol=tol, return_info=True, out_dtype=out_dtype)
        tc = birkhoff_project(x, tol=tol, out_dtype=compute)
    assert t.shape == x.shape and t.dtype == want
    assert _same(t.detach(), tc.to(want))  # the returned T is the computed one, cast
    bad, infeasible, neg = _contract(x)
    tcf = tc.detach().cpu().reshape(-1, n, n)
    conv = info.converged.cpu().reshape(-1)
    nan = torch.isnan(tcf).flatten(1)
    good = ~bad & ~infeasible
    assert bool(nan[~good].all()) and not bool(nan[good].any())
    assert bool((tcf[good] >= 0).all()) and bool((tcf[good][neg[good]] == 0).all())
    assert torch.equal(info.infeasible.cpu().reshape(-1), infeasible)
    # the certificate: never better than the truth (float64 recomputation: +64 eps slack)
    err = marginal_error(tcf)
    if tol is not None:
        limit = torch.full_like(err, tol)
    elif compute == torch.float32:
        limit = torch.full_like(err, 4e-6)
    else:  # 1e-13 or the matrix's double rounding floor (README): bounded by its full range
        limit = (RANGE_TOL_F64 * n * _logit_range(x).clamp_min(1.0)).clamp_min(1e-13)
    limit = limit + 64 * torch.finfo(torch.float64).eps  # the float64 recomputation
    assert not bool((conv & ~(err <= limit)).any())
    # ... and of the returned T, where out_dtype rounds it further (#29: a bf16 T was
    # certified while its own marginal error was 1e-2)
    err_out = marginal_error(t.detach().cpu().reshape(-1, n, n))
    assert not bool((conv & ~(err_out <= limit)).any())
    rounded = torch.finfo(want).eps > torch.finfo(compute).eps
    if tol is None and not rounded:  # with the defaults every feasible finite matrix converges
        assert bool(conv[good].all())
    if grad and compute == x.dtype and x.numel():
        w = torch.randn(t.shape, dtype=t.dtype, generator=torch.Generator().manual_seed(1))
        with time_bound():
            (da,) = torch.autograd.grad(t, xr, w.to(t.device))
        da = da.detach().cpu().reshape(-1, n, n)
        finite = torch.isfinite(da).flatten(1).all(1)
        if x.is_contiguous() or x.stride(0) != 0:  # (an expanded view sums matrices)
            assert torch.equal(finite, good)


# ---------------------------------------------------------------- birkhoff_project
def _fuzz_birkhoff(device):
    @FUZZ if device == "cpu" else FUZZ_GPU
    @given(
        x=logits_cases(device=device),
        tol=st.sampled_from([None, None, 1e-12, 1e-7, 1e-3]),
        out=st.sampled_from([None, None, torch.float32, torch.bfloat16]),
        grad=st.booleans(),
    )
    def run(x, tol, out, grad):
        _check_birkhoff(x, tol=tol, out_dtype=out, grad=grad)

    run()


@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_birkhoff(device):
    _fuzz_birkhoff(device)


# ---------------------------------------------------------------- sinkhorn_project
def _fuzz_sinkhorn(device):
    @FUZZ if device == "cpu" else FUZZ_GPU
    @given(
        x=logits_cases(device=device),
        iters=st.sampled_from([1, 2, 20, 33, 70]),
        eps=st.sampled_from([1e-6, 1e-2, 1e-30]),
        grad=st.booleans(),
    )
    def run(x, iters, eps, grad):
        n = x.shape[-1]
        xr = x.detach().clone().requires_grad_(True) if grad else x
        with time_bound():
            p = sinkhorn_project(xr, iters=iters, eps=eps)
        assert p.shape == x.shape and p.dtype == x.dtype
        xc = x.detach().cpu().to(torch.float64).reshape(-1, n, n)
        bad = (torch.isnan(xc) | (xc == float("inf"))).flatten(1).any(1)
        bad |= (xc == float("-inf")).all(-1).any(-1)  # a row of -inf: 0 / 0 in the softmax
        pf = p.detach().cpu().to(torch.float64).reshape(-1, n, n)
        nan = torch.isnan(pf).flatten(1)
        assert bool(nan[bad].all()) and bool(torch.isfinite(pf[~bad]).all())
        assert bool((pf[~bad] >= 0).all())
        if grad and x.numel() and x.dtype in (torch.float32, torch.float64):
            w = torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(2))
            with time_bound():
                (da,) = torch.autograd.grad(p, xr, w.to(p.device))
            if x.is_contiguous() or x.stride(0) != 0:
                finite = torch.isfinite(da.detach().cpu().reshape(-1, n, n)).flatten(1).all(1)
                assert bool(finite[~bad].all())

    run()


@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_sinkhorn(device):
    _fuzz_sinkhorn(device)


# ---------------------------------------------------------------- bad arguments
ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**13), 10**13),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["3", b"x", [1], torch.float32, torch.int32, torch.tensor(3.0)]),
)


@settings(FUZZ, max_examples=fuzz_examples(150))
@given(
    tol=ANY,
    max_iter=ANY,
    out_dtype=ANY,
    return_info=ANY,
    iters=ANY,
    eps=ANY,
    which=st.integers(0, 5),
)
def test_fuzz_arguments(tol, max_iter, out_dtype, return_info, iters, eps, which):
    """Each argument alone set to anything: it works, or raises ValueError / TypeError whose
    message names it."""
    x = torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(0))
    name, call = [
        ("tol", lambda: birkhoff_project(x, tol=tol)),
        ("max_iter", lambda: birkhoff_project(x, max_iter=max_iter)),
        ("out_dtype", lambda: birkhoff_project(x, out_dtype=out_dtype)),
        ("return_info", lambda: birkhoff_project(x, return_info=return_info)),
        ("iters", lambda: sinkhorn_project(x, iters=iters)),
        ("eps", lambda: sinkhorn_project(x, eps=eps)),
    ][which]
    try:
        with time_bound():
            out = call()
    except (ValueError, TypeError) as e:
        assert name in str(e), str(e)
        return
    t = out[0] if isinstance(out, tuple) else out
    assert t.shape == x.shape and bool(torch.isfinite(t).all())


@pytest.mark.parametrize(
    "bad,match",
    [
        (torch.zeros(2, 3), "logits must have shape"),
        (torch.zeros(2, 3, 3, dtype=torch.int32), "logits must have a floating dtype"),
        (torch.zeros(2, 17, 17), "logits: n must be in 2..16"),
        (torch.zeros(2, 4, 4, device="meta"), "logits must be on a CPU or CUDA device"),
        (3.0, "logits must be a torch.Tensor"),
    ],
)
def test_bad_logits_name_the_argument(bad, match):
    for op in (birkhoff_project, sinkhorn_project):
        with pytest.raises((ValueError, TypeError), match=match):
            op(bad)


# ---------------------------------------------------------------- the layer under autocast
FUZZ_LAYER = settings(FUZZ, max_examples=fuzz_examples(12))


@st.composite
def layer_cases(draw):
    return dict(
        n=draw(st.integers(2, 8)),
        c=draw(st.sampled_from([1, 3, 8, 17, 40])),
        lead=draw(st.sampled_from([(1,), (3,), (2, 3), (5,)])),
        stream=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        projection=draw(st.sampled_from(["birkhoff", "sinkhorn"])),
        formulation=draw(st.sampled_from(["mhc", "deepseek"])),
        x_scale=draw(st.sampled_from([1e-3, 1.0, 30.0])),
        logit_scale=draw(st.sampled_from([0.1, 1.0, 10.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _layer_run(case, device, autocast):
    """HyperConnection's function around a float32 Linear: under autocast, or (autocast
    off) around the same Linear written in bf16 by hand. Output and gradients."""
    n, c = case["n"], case["c"]
    g = torch.Generator().manual_seed(case["seed"])
    x = (torch.randn(*case["lead"], n, c, generator=g) * case["x_scale"]).to(case["stream"])
    lin = torch.nn.Linear(c, c)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(c, c, generator=g) / c**0.5)
        lin.bias.copy_(torch.randn(c, generator=g) * 0.1)
    m = n * n + 2 * n
    phi = torch.randn(n * c, m, generator=g) * case["logit_scale"] / (n * c) ** 0.5
    b = torch.randn(m, generator=g)
    al = torch.rand(3, generator=g) * 1.5 + 0.5
    lin = lin.to(device)
    leaves = [t.to(device).requires_grad_(True) for t in (x, phi, b, *al.unbind())]

    def explicit(y):
        return torch.nn.functional.linear(y.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())

    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        out, maps = hyper_connection(
            leaves[0],
            lin if autocast else explicit,
            *leaves[1:],
            projection=case["projection"],
            formulation=case["formulation"],
            return_maps=True,
        )
    gout = torch.randn(out.shape, generator=g).to(device, out.dtype)
    with time_bound():
        out.backward(gout)
    grads = [t.grad for t in leaves] + [lin.weight.grad, lin.bias.grad]
    return out.detach(), maps, grads


def _fuzz_layer(device):
    @FUZZ_LAYER if device == "cpu" else FUZZ_GPU
    @given(case=layer_cases())
    def run(case):
        with time_bound():
            out, maps, grads = _layer_run(case, device, autocast=True)
            ref, _maps, ref_grads = _layer_run(case, device, autocast=False)
        assert out.dtype == case["stream"] and bool(torch.isfinite(out).all())
        assert torch.equal(out, ref)  # bit for bit the explicit-bf16 run
        for a, r in zip(grads, ref_grads):
            assert torch.equal(a, r) and bool(torch.isfinite(a).all())
        if case["projection"] == "birkhoff":
            assert float(marginal_error(maps.h_res.detach()).max()) <= 5.5e-6
        assert bool((maps.h_pre > 0).all() and (maps.h_pre <= 1 + 1e-6).all())
        assert bool((maps.h_post >= 0).all() and (maps.h_post <= 2).all())

    run()


@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_layer_under_autocast(device):
    """#29: the hyper-connection layer under torch.autocast (bf16) on random shapes, dtypes,
    projections, formulations and scales equals, bit for bit, the layer whose sublayer is
    written in bf16 by hand (autocast touches only the sublayer); finite; the maps in
    range."""
    _fuzz_layer(device)
