"""The 16-lanes-per-matrix layout of the n = 4 Birkhoff kernels (``csrc/mhc_lane16.h``).

CPU: the CPU module runs the lane algorithm in a host emulation (the 16 lanes in lockstep,
the same lane permutations as the GPU's shuffles) and counts "uniformity violations": a
value that a branch depends on differing between the lanes of a matrix, which on the GPU
would split a matrix's lanes across branches. Those tests pin the algorithm to the thread
path (the code every other test checks) without a GPU. GPU: the CUDA lane kernels against
the thread kernels, the emulation and the float64 reference.

Tolerances (lane vs thread, both fp32, same algorithm, sums in another order). Measured on
the CPU, emulation vs thread path, 100003 matrices x 2 seeds per distribution:
max |T_lane - T_thread| <= 1.43e-6, median of the per-matrix max <= 1.19e-7 (2 ulps of
values in [0.5, 1)), converged and fallback flags identical, iteration counts different for
<= 2.8% of the matrices (a rounding-level difference in the error moves the stopping test by
one iteration); backward: per-matrix relative difference p99 <= 1.8e-6, max 2.0e-4 (on the
ill-conditioned matrices, where both are 5e-3 from the float64 VJP). The tests allow
max |dT| 1e-5 (the accuracy suite's bound on the distance to the float64 projection: two
solutions within it of the same exact one), median 5e-7, flags differing on at most 1 in
1000 matrices, the float64 marginal error of T <= 5.5e-6: the kernels stop at an fp32 error
<= 4e-6 (the default tolerance), and each of their 8 fp32 row / column sums is off by at most
1.8e-7 (3 roundings near 1), so the recomputed error is <= 4e-6 + 1.4e-6 (the thread kernel
measured 4.35e-6 on the H200, the emulation 4.35e-6).
"""

import pytest
import torch

from mhc_proj import _backend, marginal_error
from mhc_proj.birkhoff import (
    FALLBACK_MAX_ITER,
    FALLBACK_TOL,
    LAYOUT_ENV,
    PIVOT_MIN,
    TOL_F32,
    _project,
    birkhoff_bwd,
    birkhoff_fwd,
    birkhoff_project,
    layout_code,
)
from mhc_proj.reference import birkhoff_project_ref, birkhoff_vjp_ref

DISTS = {
    "N(0,1)": lambda b, g: torch.randn(b, 4, 4, generator=g),
    "N(0,10^2)": lambda b, g: torch.randn(b, 4, 4, generator=g) * 10,
    "U(-10,10)": lambda b, g: torch.rand(b, 4, 4, generator=g) * 20 - 10,
    "1e4*N(0,1)": lambda b, g: torch.randn(b, 4, 4, generator=g) * 1e4,
}
SMALL = {"N(0,1)", "N(0,10^2)", "U(-10,10)"}  # the float64 reference has no continuation
BATCHES = [1, 2, 3, 31, 1000, 100003]
MAX_DT, MED_DT, MAX_MARGINAL = 1e-5, 5e-7, 5.5e-6


def _flags(info):
    return (info >> 17) & 1, (info >> 16) & 1, info & 0xFFFF


def emulated_fwd(x, tol=TOL_F32, max_iter=30):
    """The lane algorithm on the CPU (fp32 stage 1 + the float64 stage): T, info, and the
    number of uniformity violations."""
    x = x.contiguous().float()
    out = torch.empty_like(x)
    info = torch.empty(x.shape[0], dtype=torch.int32)
    v = _backend.cpu().lane16_fwd_emulated(
        x.data_ptr(), out.data_ptr(), info.data_ptr(), x.shape[0], tol, max_iter,
        FALLBACK_TOL, FALLBACK_MAX_ITER, PIVOT_MIN,
    )  # fmt: skip
    return out, info, v


def emulated_bwd(t, g):
    t, g = t.contiguous().float(), g.contiguous().float()
    out = torch.empty_like(t)
    v = _backend.cpu().lane16_bwd_emulated(t.data_ptr(), g.data_ptr(), out.data_ptr(), t.shape[0])
    return out, v


def _compare_fwd(t_lane, i_lane, t_thread, i_thread):
    """The agreement criteria of the module docstring."""
    b = t_lane.shape[0]
    assert torch.isfinite(t_lane).all()
    d = (t_lane.double() - t_thread.double()).abs().flatten(1).amax(1)
    assert float(d.max()) <= MAX_DT, float(d.max())
    if b >= 1000:
        assert float(d.median()) <= MED_DT, float(d.median())
    cl, fl, il = _flags(i_lane)
    ct, ft, it = _flags(i_thread)
    assert int((cl != ct).sum()) <= b // 1000
    assert int((fl != ft).sum()) <= b // 1000
    assert bool(cl.bool().all())
    if b >= 1000:
        assert float((il != it).float().mean()) <= 0.06
    assert float(marginal_error(t_lane).max()) <= MAX_MARGINAL


def _bwd_rel(d, ref):
    scale = ref.abs().flatten(1).amax(1).clamp_min(1e-30)
    return (d.double() - ref.double()).abs().flatten(1).amax(1) / scale


# ---------------------------------------------------------------- CPU: host emulation
@pytest.mark.parametrize("dist", list(DISTS))
@pytest.mark.parametrize("batch", [1, 3, 31, 4000])
def test_emulated_lane_forward_matches_thread_path(dist, batch):
    g = torch.Generator().manual_seed(batch + len(dist))
    x = DISTS[dist](batch, g)
    t_lane, i_lane, violations = emulated_fwd(x)
    assert violations == 0
    t_thread, i_thread = birkhoff_fwd(x, TOL_F32, 30, True, layout="thread")
    _compare_fwd(t_lane, i_lane, t_thread, i_thread)
    if dist in SMALL:
        ref = birkhoff_project_ref(x.double())
        assert float((t_lane.double() - ref).abs().max()) <= 1e-5


def test_emulated_lane_forward_edge_cases():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 4, 4, generator=g) * 30
    x[3, 1, 2] = float("nan")
    x[8, 0, 0] = float("inf")
    x[9] = 0.0  # uniform logits: T = 1/4 everywhere, converged at once
    x[10] = torch.eye(4) * 1e30  # huge finite logits
    t_lane, i_lane, v = emulated_fwd(x)
    t_thread, i_thread = birkhoff_fwd(x, TOL_F32, 30, True, layout="thread")
    assert v == 0
    bad = torch.zeros(64, dtype=torch.bool)
    bad[[3, 8]] = True
    assert torch.isnan(t_lane[bad]).all() and torch.equal(i_lane[bad], i_thread[bad])
    assert torch.equal(t_lane[9], torch.full((4, 4), 0.25))
    _compare_fwd(t_lane[~bad], i_lane[~bad], t_thread[~bad], i_thread[~bad])
    # a tolerance fp32 cannot reach sends every matrix to the float64 stage; max_iter = 0
    # stops before the first Newton step (fp32), then float64 finishes
    for tol, max_iter in [(1e-9, 30), (TOL_F32, 0)]:
        t_lane, i_lane, v = emulated_fwd(x[~bad], tol, max_iter)
        t_thread, i_thread = birkhoff_fwd(x[~bad], tol, max_iter, True, layout="thread")
        assert v == 0
        assert torch.equal(_flags(i_lane)[1], _flags(i_thread)[1])
        assert float((t_lane - t_thread).abs().max()) <= MAX_DT


@pytest.mark.parametrize("sigma", [1.0, 10.0])
def test_emulated_lane_backward(sigma):
    g = torch.Generator().manual_seed(int(sigma) + 40)
    x = torch.randn(4000, 4, 4, generator=g) * sigma
    gr = torch.randn(4000, 4, 4, generator=g)
    t = birkhoff_fwd(x, TOL_F32, 30, False, layout="thread")[0]
    d_lane, v = emulated_bwd(t, gr)
    assert v == 0
    d_thread = birkhoff_bwd(t, gr)
    ref = birkhoff_vjp_ref(birkhoff_project_ref(x.double()), gr.double())
    rel_lt = _bwd_rel(d_lane, d_thread.double())
    assert float(rel_lt.max()) <= 1e-3 and float(rel_lt.quantile(0.99)) <= 1e-5
    rel = _bwd_rel(d_lane, ref)
    assert float(rel.quantile(0.99)) <= 1e-4 and float(rel.median()) <= 1e-6
    # permutation-like T (huge logits): finite, and the thread path's result
    t_big = birkhoff_fwd(x * 1e4, TOL_F32, 30, False, layout="thread")[0]
    d_big, v = emulated_bwd(t_big, gr)
    assert v == 0 and torch.isfinite(d_big).all()
    assert float((d_big - birkhoff_bwd(t_big, gr)).abs().max()) <= 1e-5


def test_layout_selection(monkeypatch):
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    assert layout_code() == 7  # thread per matrix, thread-flat: the default
    assert [layout_code(v) for v in ("lane", "thread", 0, 1)] == [0, 1, 0, 1]
    monkeypatch.setenv(LAYOUT_ENV, "lane")
    assert layout_code() == 0 and layout_code("thread") == 1
    x = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(1))
    # the CPU has one layout: lane and thread give the same result, forward and backward
    t_env = birkhoff_project(x)
    monkeypatch.setenv(LAYOUT_ENV, "thread")
    assert torch.equal(t_env, birkhoff_project(x))
    gr = torch.randn_like(x)
    assert torch.equal(birkhoff_bwd(t_env, gr, "lane"), birkhoff_bwd(t_env, gr, "thread"))
    xe = x.clone().requires_grad_(True)
    _project(xe, layout="lane").backward(gr)
    xt = x.clone().requires_grad_(True)
    birkhoff_project(xt).backward(gr)
    assert torch.equal(xe.grad, xt.grad)
    for bad in ("warp", 99, -1, True):
        with pytest.raises(ValueError, match="Birkhoff layout"):
            birkhoff_fwd(x, TOL_F32, 30, False, layout=bad)
    with pytest.raises(ValueError, match="Birkhoff layout"):
        _project(x, layout="warp")
    monkeypatch.setenv(LAYOUT_ENV, "warp")  # validated on the CPU too
    with pytest.raises(ValueError, match="Birkhoff layout"):
        birkhoff_project(x)


# ---------------------------------------------------------------- GPU: the CUDA kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dist", list(DISTS))
@pytest.mark.parametrize("batch", BATCHES)
def test_cuda_lane_forward_vs_thread(dist, batch):
    """Odd batches leave the last warp's second half-warp (and block tail) empty."""
    g = torch.Generator().manual_seed(batch + 3 * len(dist))
    x = DISTS[dist](batch, g)
    xc = x.cuda()
    t_lane, i_lane = birkhoff_fwd(xc, TOL_F32, 30, True, layout="lane")
    t_thread, i_thread = birkhoff_fwd(xc, TOL_F32, 30, True, layout="thread")
    t_lane, i_lane, t_thread, i_thread = (v.cpu() for v in (t_lane, i_lane, t_thread, i_thread))
    _compare_fwd(t_lane, i_lane, t_thread, i_thread)
    # the same algorithm on the CPU (same sums in the same order; host expf / IEEE)
    t_emu, i_emu, v = emulated_fwd(x)
    assert v == 0
    _compare_fwd(t_lane, i_lane, t_emu, i_emu)
    if dist in SMALL:
        ref = birkhoff_project_ref(x.double())
        assert float((t_lane.double() - ref).abs().max()) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("sigma", [1.0, 10.0, 1e4])
@pytest.mark.parametrize("batch", BATCHES)
def test_cuda_lane_backward(sigma, batch):
    g = torch.Generator().manual_seed(batch + int(sigma))
    x = torch.randn(batch, 4, 4, generator=g) * sigma
    gr = torch.randn(batch, 4, 4, generator=g)
    t = birkhoff_fwd(x.cuda(), TOL_F32, 30, False)[0]
    d_lane = birkhoff_bwd(t, gr.cuda(), layout="lane").cpu()
    d_thread = birkhoff_bwd(t, gr.cuda(), layout="thread").cpu()
    d_emu, v = emulated_bwd(t.cpu(), gr)
    assert v == 0 and torch.isfinite(d_lane).all()
    for other in (d_thread, d_emu):
        if sigma > 10:  # T a permutation up to underflow: dA ~ 0, compare absolutely
            assert float((d_lane - other).abs().max()) <= 1e-5
            continue
        rel = _bwd_rel(d_lane, other.double())
        assert float(rel.max()) <= 1e-3
        if batch >= 1000:
            assert float(rel.quantile(0.99)) <= 1e-5
    if sigma <= 10:
        ref = birkhoff_vjp_ref(birkhoff_project_ref(x.double()), gr.double())
        rel = _bwd_rel(d_lane, ref)
        if batch >= 1000:
            assert float(rel.quantile(0.99)) <= 1e-4 and float(rel.median()) <= 1e-6
        rel_thread = _bwd_rel(d_thread, ref)
        assert float(rel.max()) <= 10 * float(rel_thread.max()) + 1e-5


@pytest.mark.gpu
def test_cuda_lane_through_autograd_and_op(monkeypatch):
    """MHC_PROJ_BIRKHOFF_LAYOUT=lane reaches the eager path and the custom ops (read per
    call); the explicit layout of the benchmark's entry point gives the same results."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(4097, 4, 4, generator=g) * 3
    gr = torch.randn(4097, 4, 4, generator=g)
    xc, gc = x.cuda(), gr.cuda()
    monkeypatch.setenv(LAYOUT_ENV, "lane")
    xd = xc.clone().requires_grad_(True)
    t_env, info = birkhoff_project(xd, return_info=True)
    t_env.backward(gc)
    t_op, _ = torch.ops.mhc_proj.birkhoff_fwd.default(xc, TOL_F32, 30, False)
    d_op = torch.ops.mhc_proj.birkhoff_bwd.default(t_env.detach(), gc)
    monkeypatch.delenv(LAYOUT_ENV)
    xe = xc.clone().requires_grad_(True)
    t_exp = _project(xe, layout="lane")
    t_exp.backward(gc)
    lane_t, _ = birkhoff_fwd(xc, TOL_F32, 30, False, layout="lane")
    lane_d = birkhoff_bwd(t_env.detach(), gc, layout="lane")
    assert torch.equal(t_env.detach(), lane_t) and torch.equal(t_op, lane_t)
    assert torch.equal(t_exp.detach(), lane_t)
    assert torch.equal(xd.grad, xe.grad) and torch.equal(d_op, lane_d)
    assert bool(info.converged.all())
    # and the default (thread) differs from it only by rounding
    t_thr = birkhoff_project(xc)
    assert float((t_thr - lane_t).abs().max()) <= MAX_DT


@pytest.mark.gpu
def test_cuda_lane_nan_isolation_and_graph():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(513, 4, 4, generator=g) * 1e4
    x[7, 1, 2] = float("nan")
    x[9, 0, 0] = float("inf")
    xc = x.cuda()
    t, info = birkhoff_fwd(xc, TOL_F32, 30, True, layout="lane")
    t, info = t.cpu(), info.cpu()
    bad = torch.zeros(513, dtype=torch.bool)
    bad[[7, 9]] = True
    assert torch.isnan(t[bad]).all() and torch.isfinite(t[~bad]).all()
    assert not _flags(info)[0][bad].any() and bool(_flags(info)[0][~bad].all())
    t2 = birkhoff_fwd(x[~bad].cuda(), TOL_F32, 30, False, layout="lane")[0].cpu()
    assert torch.equal(t2, t[~bad])
    # capturable: no host synchronization in the lane forward (stage 1 + float64 stage)
    xs = torch.randn(4096, 4, 4, device="cuda")
    gs = torch.randn_like(xs)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        birkhoff_bwd(birkhoff_fwd(xs, TOL_F32, 30, False, layout="lane")[0], gs, layout="lane")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tg, _ = birkhoff_fwd(xs, TOL_F32, 30, False, layout="lane")
        dg = birkhoff_bwd(tg, gs, layout="lane")
    xs.copy_(torch.randn_like(xs) * 10)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(tg, birkhoff_fwd(xs, TOL_F32, 30, False, layout="lane")[0])
    assert torch.equal(dg, birkhoff_bwd(tg.clone(), gs, layout="lane"))
