"""The device-only loop (issue #36): a solve recorded into a CUDA graph reads nothing from
the device. On the CPU: ``_loop.run(Schedule(host_reads=False))`` and ``solve`` with the
capture detection forced on make no host read (every ``__bool__`` / ``item`` /
``__float__`` / ``__int__`` / ``tolist`` on a tensor is counted), return what the host
loop returns when its first certificate passes, and never claim convergence that the
float64 certificate of the returned potentials does not give. On CUDA: a dense solve
captured by ``torch.cuda.graph`` and replayed equals the eager solve."""

import sys

import pytest
import torch
from _helpers import PlainProblem

import flashsinkhorn as fs
from flashsinkhorn import _loop, backends
from flashsinkhorn.result import certificate

READS = ("__bool__", "item", "__float__", "__int__", "__index__", "tolist")


def _clouds(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(2, 31, 3, generator=g, dtype=torch.float64)
    y = torch.rand(2, 26, 3, generator=g, dtype=torch.float64) + 0.2
    return x.to(dtype), y.to(dtype)


def _problems(seed, eps):
    """The loop's float32 problem and ``certify`` on its float64 dense twin (built here:
    the dense backend's constructor reads the weights' sign once on the CPU)."""
    x, y = _clouds(seed)
    a, b = torch.full((2, 31), 1 / 31), torch.full((2, 26), 1 / 26)
    fields = dict(a=a, b=b, c2=2.0)
    prob = PlainProblem(X=x, Y=y, cx=(x * x).sum(-1), cy=(y * y).sum(-1), **fields)
    x64, y64 = x.double(), y.double()
    fields64 = dict(a=a.double(), b=b.double(), c2=2.0)
    p64 = backends.build(
        "dense", X=x64, Y=y64, cx=(x64 * x64).sum(-1), cy=(y64 * y64).sum(-1), **fields64
    )[0]
    return prob, lambda f, g: certificate(p64, f, g, eps, None, None)


def _spy_reads(monkeypatch):
    """Every host read of a tensor from now on, as ``(method, calling file)``."""
    reads = []
    for name in READS:
        real = getattr(torch.Tensor, name)

        def spy(self, *a, real=real, name=name):
            reads.append((name, sys._getframe(1).f_code.co_filename))
            return real(self, *a)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads


@pytest.mark.parametrize("update", ["alternating", "symmetric"])
def test_device_only_loop_reads_nothing_and_stops_where_the_host_loop_does(monkeypatch, update):
    eps, tol = 0.05, 1e-4
    prob, certify = _problems(1, eps)
    kw = dict(eps=eps, stages=(1.0, 0.3), max_iter=400, update=update, tol=tol, check_every=10)
    host = _loop.run(prob, _loop.Schedule(**kw), certify)
    assert host.converged and host.n_iter < 400  # the certificate passed and stopped it
    reads = _spy_reads(monkeypatch)
    dev = _loop.run(prob, _loop.Schedule(**kw, host_reads=False), certify)
    assert reads == []
    monkeypatch.undo()
    # the potentials froze at the check that stopped the host loop: bitwise the same
    assert torch.equal(dev.f, host.f) and torch.equal(dev.g, host.g)
    assert isinstance(dev.n_iter, torch.Tensor) and int(dev.n_iter) == host.n_iter
    assert isinstance(dev.converged, torch.Tensor) and bool(dev.converged)
    assert torch.equal(dev.err, host.err)


def test_device_only_loop_without_a_tolerance_runs_every_iteration(monkeypatch):
    prob, certify = _problems(2, 0.05)
    kw = dict(eps=0.05, max_iter=23, update="alternating")
    host = _loop.run(prob, _loop.Schedule(**kw), certify)
    reads = _spy_reads(monkeypatch)
    dev = _loop.run(prob, _loop.Schedule(**kw, host_reads=False), certify)
    assert reads == []
    monkeypatch.undo()
    assert torch.equal(dev.f, host.f) and torch.equal(dev.err, host.err)
    assert int(dev.n_iter) == 23 and not bool(dev.converged) and not host.converged


def test_device_only_loop_never_claims_more_than_the_certificate():
    """Converged only where the float64 certificate of the returned potentials says so:
    not when the estimate passed but the certificate disagrees, not at max_iter short of
    tol, not for non-finite potentials (their certificate is inf)."""
    eps = 0.05
    prob, certify = _problems(3, eps)

    def pessimist(f, g):  # a certificate that never passes, whatever the estimate says
        err, rows, cols = certify(f, g)
        return torch.ones_like(err), rows, cols

    sched = _loop.Schedule(eps=eps, max_iter=300, tol=1e-3, check_every=5, host_reads=False)
    out = _loop.run(prob, sched, pessimist)
    assert int(out.n_iter) < 300  # the estimate passed and froze the potentials ...
    assert not bool(out.converged)  # ... but only the certificate declares convergence

    short = _loop.Schedule(eps=eps, max_iter=3, tol=1e-9, check_every=1, host_reads=False)
    out = _loop.run(prob, short, certify)
    assert int(out.n_iter) == 3 and not bool(out.converged) and float(out.err.max()) > 1e-9

    x, y = _clouds(4)
    x[1, 5, 0] = float("nan")
    bad = PlainProblem(X=x, Y=y, a=prob.a, b=prob.b, cx=(x * x).sum(-1), cy=(y * y).sum(-1), c2=2.0)
    x64 = x.double()
    p64 = backends.build(
        "dense",
        X=x64,
        Y=y.double(),
        a=prob.a.double(),
        b=prob.b.double(),
        cx=(x64 * x64).sum(-1),
        cy=(y.double() ** 2).sum(-1),
        c2=2.0,
    )[0]
    out = _loop.run(bad, sched, lambda f, g: certificate(p64, f, g, eps, None, None))
    assert not bool(out.converged) and torch.isinf(out.err[1])


def test_device_only_loop_refuses_verbose():
    prob, certify = _problems(5, 0.05)
    sched = _loop.Schedule(eps=0.05, max_iter=5, host_reads=False)
    with pytest.raises(ValueError, match="verbose"):
        _loop.run(prob, sched, certify, verbose=True)


@pytest.mark.parametrize("schedule", ["alternating", "symmetric"])
def test_solve_under_capture_reads_nothing_outside_the_cpu_range_tests(monkeypatch, schedule):
    """``solve`` with the capture detection forced on (the CPU cannot capture): no host
    read except the dense backend's CPU-only range tests (on CUDA every dense pass is the
    max-subtracted one: none), and the eager solve's result."""
    x, y = _clouds(6)
    kw = dict(eps=0.05, tol=1e-4, schedule=schedule, backend="dense", eps_scaling=0.5)
    kw.update(diameter=2.0, warn=False)
    eager = fs.solve(x, y, **kw)
    assert bool(eager.converged)
    monkeypatch.setattr(_loop, "capturing", lambda device: True)
    reads = _spy_reads(monkeypatch)
    res = fs.solve(x, y, **kw)
    outside = [r for r in reads if not r[1].endswith("dense.py")]
    monkeypatch.undo()
    assert outside == []
    assert torch.equal(res.f, eager.f) and torch.equal(res.g, eager.g)
    assert torch.equal(res.value, eager.value)
    assert torch.equal(res.marginal_error, eager.marginal_error)
    assert isinstance(res.converged, torch.Tensor) and bool(res.converged)
    assert int(res.n_iter) == eager.n_iter


def test_solve_under_capture_refuses_what_reads_the_device(monkeypatch):
    monkeypatch.setattr(_loop, "capturing", lambda device: True)
    x, y = _clouds(7)
    with pytest.raises(ValueError, match="diameter"):
        fs.solve(x[0], y[0], eps=0.1, eps_scaling=0.5, backend="dense")
    with pytest.raises(ValueError, match="verbose"):
        fs.solve(x[0], y[0], eps=0.1, verbose=True, backend="dense")
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        fs.solve([x[0]], [y[0]], eps=0.1, backend="dense")


def _capture(fn):
    """``fn()`` recorded into a CUDA graph after one warm-up call on a side stream (what
    torch.cuda.graph needs: allocations and first-call work done eagerly). Returns
    ``(graph, outputs of the captured call)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.gpu
@pytest.mark.parametrize("tol", [None, 1e-4])
@pytest.mark.parametrize("schedule", ["alternating", "symmetric"])
def test_cuda_graph_capture_of_a_dense_solve(monkeypatch, tol, schedule):
    """A dense solve (eps-scaling with a given diameter, then the final-eps loop, the
    float64 certificate and the value) captured and replayed on new inputs copied into the
    captured ones: the device-only loop run eagerly on those inputs (the same kernels), and
    the ordinary eager solve's certificate (which stops up to _LAG checks later: its
    estimates are read behind events)."""
    x, y = (t.cuda() for t in _clouds(8))
    kw = dict(eps=0.05, tol=tol, max_iter=300, schedule=schedule, backend="dense")
    kw.update(eps_scaling=0.5, diameter=2.0, warn=False)
    xs, ys = x.clone(), y.clone()
    graph, res = _capture(lambda: fs.solve(xs, ys, **kw))
    for seed in (9, 10):
        xn, yn = (t.cuda() for t in _clouds(seed))
        xs.copy_(xn)
        ys.copy_(yn)
        graph.replay()
        torch.cuda.synchronize()
        plain = fs.solve(xn, yn, **kw)
        with monkeypatch.context() as m:
            m.setattr(_loop, "capturing", lambda device: True)
            ref = fs.solve(xn, yn, **kw)
        for name in ("f", "g", "value", "marginal_error"):
            torch.testing.assert_close(getattr(res, name), getattr(ref, name), rtol=1e-6, atol=0)
        assert int(res.n_iter) == int(ref.n_iter) and bool(res.converged) == bool(ref.converged)
        assert bool(res.converged) == bool(plain.converged) == (tol is not None)
        if tol is None:
            assert int(res.n_iter) == plain.n_iter == 300
            torch.testing.assert_close(res.f, plain.f, rtol=1e-6, atol=1e-7)
        else:
            assert float(res.marginal_error.max()) < tol
            assert int(res.n_iter) <= plain.n_iter
        torch.testing.assert_close(res.value, plain.value, rtol=1e-4, atol=1e-6)
