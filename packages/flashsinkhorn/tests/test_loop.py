"""The one loop (_loop.py): host reads. A loop without a tolerance reads nothing from the
device; with one, one read per check (on CUDA behind an event, lagged); the problem's
passes here are pure tensor operations, so any read counted is the loop's own."""

import pytest
import torch
from _helpers import PlainProblem

from flashsinkhorn import _loop


def _problem():
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(2, 30, 3, generator=g), torch.rand(2, 25, 3, generator=g) + 0.2
    a, b = torch.full((2, 30), 1 / 30), torch.full((2, 25), 1 / 25)
    return PlainProblem(X=x, Y=y, a=a, b=b, cx=(x * x).sum(-1), cy=(y * y).sum(-1), c2=2.0)


def _count_reads(monkeypatch):
    reads = []
    for name in ("__bool__", "item", "__float__", "tolist"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, real=real, name=name):
            reads.append(name)
            return real(self, *a)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads


@pytest.mark.parametrize("update", ["alternating", "symmetric"])
def test_no_host_read_without_a_tolerance(monkeypatch, update):
    prob = _problem()
    reads = _count_reads(monkeypatch)
    sched = _loop.Schedule(eps=0.05, stages=(1.0, 0.3, 0.1), max_iter=40, update=update)
    out = _loop.run(prob, sched)
    assert reads == [] and out.n_iter == 40


def test_one_read_per_check_with_a_tolerance(monkeypatch):
    """Each check reads one 2-vector (the estimate and the potentials' largest entry) on
    the CPU; on CUDA the same read waits on an event recorded after the estimate."""
    prob = _problem()
    reads = _count_reads(monkeypatch)
    sched = _loop.Schedule(eps=0.05, max_iter=40, tol=1e-30, check_every=10)
    out = _loop.run(prob, sched)  # no certificate: the estimate alone could stop it
    assert out.n_iter == 40 and out.estimate is not None
    assert reads.count("__float__") == 2 * 4  # (estimate, max |f|) at the 4 checks
    assert len(reads) == 8


@pytest.mark.gpu
def test_lagged_stopping_on_cuda():
    """On CUDA the estimate is read behind an event: the loop stops at most _LAG checks
    after the CPU loop on the same problem, with the same certificate."""
    import flashsinkhorn as fs

    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(2000, 8, generator=g), torch.rand(1800, 8, generator=g) + 0.2
    kw = dict(eps=0.05, tol=1e-5, check_every=10, backend="dense")
    cpu = fs.solve(x, y, **kw)
    gpu = fs.solve(x.cuda(), y.cuda(), **kw)
    assert bool(cpu.converged) and bool(gpu.converged)
    assert cpu.n_iter - 10 <= gpu.n_iter <= cpu.n_iter + (_loop._LAG + 1) * 10
