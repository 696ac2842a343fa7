"""Persistent scheduling of the n = 4 float32 forward (``birkhoff_fwd_f32_persistent``).

A thread loops over matrices, one Newton iteration per trip (``mhc::persistent_iterate`` /
``persistent_refill`` in ``csrc/mhc_math.h``, the same per-matrix code as
``mhc::project_matrix``). The schedule must not change any result: T and the info words are
bitwise those of the thread-per-matrix path. CPU: the CPU module's emulation (warps of 32
lanes in lockstep, the kernel's static stride and refill vote) against the CPU path. GPU:
the persistent kernel against the thread kernel, bitwise.
"""

import numpy as np
import pytest
import torch

from mhc_proj import _backend
from mhc_proj.birkhoff import (
    FALLBACK_MAX_ITER,
    FALLBACK_TOL,
    PIVOT_MIN,
    REFILL_ENV,
    SCHED_ENV,
    TOL_F32,
    _project,
    birkhoff_fwd,
    birkhoff_project,
    refill_min,
    sched_code,
)

DISTS = {
    "N(0,1)": lambda b, g: torch.randn(b, 4, 4, generator=g),
    "N(0,3^2)": lambda b, g: torch.randn(b, 4, 4, generator=g) * 3,
    "N(0,10^2)": lambda b, g: torch.randn(b, 4, 4, generator=g) * 10,
    "1e4*N(0,1)": lambda b, g: torch.randn(b, 4, 4, generator=g) * 1e4,
}


def emulated_fwd(x, lanes, refill, tol=TOL_F32, max_iter=30):
    """The persistent schedule on the CPU: T, info, trips per matrix, and the statistics
    (warp trips, trips with a Newton step, with a refill, with a log-domain column step)."""
    x = x.contiguous().float()
    b = x.shape[0]
    out = torch.empty_like(x)
    info = torch.empty(b, dtype=torch.int32)
    trips = torch.zeros(b, dtype=torch.int32)
    stats = torch.zeros(4, dtype=torch.int64)
    _backend.cpu().persistent_fwd_emulated(
        x.data_ptr(), out.data_ptr(), info.data_ptr(), trips.data_ptr(), stats.data_ptr(), b,
        tol, max_iter, FALLBACK_TOL, FALLBACK_MAX_ITER, PIVOT_MIN, lanes, refill,
    )  # fmt: skip
    return out, info, trips, stats


def _bitwise(a, b):
    return a.numpy().tobytes() == b.numpy().tobytes()


def _with_bad_rows(x):
    x = x.clone()
    if x.shape[0] > 8:
        x[3, 1, 2] = float("nan")
        x[5, 0, 0] = float("inf")
        x[8, 2, 3] = -float("inf")
    return x


# ---------------------------------------------------------------- CPU: emulation
@pytest.mark.parametrize("dist", list(DISTS))
@pytest.mark.parametrize("batch", [1, 31, 4099])
@pytest.mark.parametrize("refill", [1, 16, 32])
def test_emulated_persistent_bitwise_equals_cpu_path(dist, batch, refill):
    g = torch.Generator().manual_seed(batch + refill + len(dist))
    x = _with_bad_rows(DISTS[dist](batch, g))
    t0, i0 = birkhoff_fwd(x, TOL_F32, 30, True)
    for lanes in (32, 96, 32 * 40):
        t1, i1, trips, stats = emulated_fwd(x, lanes, refill)
        assert _bitwise(t0, t1) and _bitwise(i0, i1), (lanes, refill)
        fin = torch.isfinite(x).flatten(1).all(1)
        fp32 = fin & ((i0 & (1 << 16)) == 0)  # info's count is the fp32 stage's alone
        # a matrix is planned once per iteration and once more per continuation stage
        assert bool((trips[fp32] >= (i0[fp32] & 0xFFFF) + 1).all())
        assert bool((trips[fin] >= 1).all()) and bool((trips[~fin] == 0).all())
        assert int(stats[0]) >= int(trips.max())


def test_emulated_persistent_iteration_limits():
    """Non-converged matrices (max_iter 0..3) go to the float64 stage exactly as on the
    thread path."""
    g = torch.Generator().manual_seed(5)
    x = _with_bad_rows(torch.randn(3000, 4, 4, generator=g) * 10)
    for max_iter in (0, 1, 3):
        t0, i0 = birkhoff_fwd(x, TOL_F32, max_iter, True)
        t1, i1, _, _ = emulated_fwd(x, 64, 8, max_iter=max_iter)
        assert _bitwise(t0, t1) and _bitwise(i0, i1), max_iter


def test_emulated_persistent_trip_counts():
    """The schedule's point: at refill 1 a warp runs about the mean number of plans per
    matrix (per 32 matrices), fewer than the slowest of 32 consecutive matrices."""
    g = torch.Generator().manual_seed(9)
    b = 32 * 2048
    x = torch.randn(b, 4, 4, generator=g)
    _, _, trips, stats = emulated_fwd(x, 32 * 16, 1)
    k = trips.double()
    warp_max = float(k.view(-1, 32).amax(1).mean())
    per32 = float(stats[0]) * 32 / b
    assert float(k.mean()) <= per32 < warp_max
    assert per32 < 0.9 * warp_max


def test_sched_selection(monkeypatch):
    monkeypatch.delenv(SCHED_ENV, raising=False)
    monkeypatch.delenv(REFILL_ENV, raising=False)
    assert sched_code() == 0  # thread per matrix: the default
    assert [sched_code(v) for v in ("thread", "persistent", 0, 1)] == [0, 1, 0, 1]
    monkeypatch.setenv(SCHED_ENV, "persistent")
    assert sched_code() == 1 and sched_code("thread") == 0
    x = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(1))
    t_env = birkhoff_project(x)  # the CPU has one schedule
    monkeypatch.setenv(SCHED_ENV, "thread")
    assert torch.equal(t_env, birkhoff_project(x))
    assert torch.equal(t_env, _project(x, sched="persistent"))
    for bad in ("warp", 2, -1, True):
        with pytest.raises(ValueError, match="Birkhoff schedule"):
            birkhoff_fwd(x, TOL_F32, 30, False, sched=bad)
    with pytest.raises(ValueError, match="Birkhoff schedule"):
        _project(x, sched="warp")
    monkeypatch.setenv(SCHED_ENV, "warp")  # validated on the CPU too
    with pytest.raises(ValueError, match="Birkhoff schedule"):
        birkhoff_project(x)
    assert refill_min() == 24
    monkeypatch.setenv(REFILL_ENV, "32")
    assert refill_min() == 32
    for bad in ("0", "33", "x"):
        monkeypatch.setenv(REFILL_ENV, bad)
        with pytest.raises(ValueError, match=REFILL_ENV):
            refill_min()


def test_emulation_rejects_bad_lanes():
    x = torch.randn(4, 4, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        emulated_fwd(x, 48, 1)


# ---------------------------------------------------------------- GPU: the CUDA kernel
@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["N(0,1)", "N(0,10^2)", "1e4*N(0,1)"])
@pytest.mark.parametrize("batch", [1, 31, 100003])
@pytest.mark.parametrize("refill", ["1", "16", "32"])
def test_cuda_persistent_bitwise_equals_thread(monkeypatch, dist, batch, refill):
    monkeypatch.setenv(REFILL_ENV, refill)
    g = torch.Generator().manual_seed(batch + 7 * len(dist))
    xc = _with_bad_rows(DISTS[dist](batch, g)).cuda()
    t_p, i_p = birkhoff_fwd(xc, TOL_F32, 30, True, sched="persistent")
    t_t, i_t = birkhoff_fwd(xc, TOL_F32, 30, True, sched="thread")
    t_p, i_p, t_t, i_t = (v.cpu() for v in (t_p, i_p, t_t, i_t))
    assert _bitwise(t_p, t_t)
    assert _bitwise(i_p, i_t)
    if batch > 8:
        assert bool(torch.isnan(t_p[3]).all()) and bool(torch.isfinite(t_p[9:]).all())


@pytest.mark.gpu
def test_cuda_persistent_env_autograd_and_graph(monkeypatch):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(40000, 4, 4, generator=g) * 10).cuda()
    gr = torch.randn_like(x)
    monkeypatch.setenv(SCHED_ENV, "thread")
    xt = x.clone().requires_grad_(True)
    t_t, info_t = birkhoff_project(xt, return_info=True)
    t_t.backward(gr)
    monkeypatch.setenv(SCHED_ENV, "persistent")
    xp = x.clone().requires_grad_(True)
    t_p, info_p = birkhoff_project(xp, return_info=True)
    t_p.backward(gr)
    assert torch.equal(t_p, t_t) and torch.equal(xp.grad, xt.grad)
    for a, b in zip(info_p, info_t, strict=True):
        assert torch.equal(a, b)
    # capturable: no host synchronization
    out = {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out["t"] = birkhoff_fwd(x, TOL_F32, 30, False, sched="persistent")[0]
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out["t"] = birkhoff_fwd(x, TOL_F32, 30, False, sched="persistent")[0]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out["t"], t_t.detach())


def test_trip_statistics_are_reproducible():
    """Two emulations of the same batch give the same statistics (the schedule is
    deterministic: static stride, no atomics)."""
    x = torch.randn(2000, 4, 4, generator=torch.Generator().manual_seed(4)) * 3
    a = emulated_fwd(x, 64, 16)
    b = emulated_fwd(x, 64, 16)
    assert all(np.array_equal(u.numpy(), v.numpy()) for u, v in zip(a, b, strict=True))
