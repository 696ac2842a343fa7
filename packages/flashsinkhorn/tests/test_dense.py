"""The dense backend (dense.py) and backend="auto" (backends.py): every operation of the
Problem interface against the float64 references, the one-exp paths against their safe
fallbacks (hostile guesses, zero weights, out-of-range sums), and solve / SamplesLoss on
dense against the streaming backend on the same problems."""

import math

import pytest
import torch
from _helpers import clouds

import flashsinkhorn as fs
from flashsinkhorn import _config, backends
from flashsinkhorn.dense import DenseProblem
from flashsinkhorn.reference import softmin_ref, symmetric_update_ref
from flashsinkhorn.sampling import softmax_sample_ref
from flashsinkhorn.streaming import StreamingProblem


def _problem(B, N, M, D, *, dtype=torch.float64, seed=0, zero=False, labels=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(B, N, D, generator=gen, dtype=dtype) / math.sqrt(D)
    y = torch.rand(B, M, D, generator=gen, dtype=dtype) / math.sqrt(D) + 0.3
    a = torch.rand(B, N, generator=gen, dtype=dtype) + 0.1
    b = torch.rand(B, M, generator=gen, dtype=dtype) + 0.1
    if zero:
        a[:, 1] = 0.0
        b[:, -1] = 0.0
    a, b = a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True)
    lab = None
    if labels:
        W = torch.rand(3, 4, generator=gen, dtype=dtype)
        lab = (
            torch.randint(0, 3, (B, N), generator=gen),
            torch.randint(0, 4, (B, M), generator=gen),
            W,
            0.7,
        )
    fields = dict(X=x, Y=y, a=a, b=b, cx=(x * x).sum(-1), cy=(y * y).sum(-1), c2=2.0)
    return DenseProblem(labels=lab, **fields), fields, lab


def _potentials(p, eps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    f = eps * torch.randn(p.cx.shape, generator=gen, dtype=p.cx.dtype) + p.cx
    g = eps * torch.randn(p.cy.shape, generator=gen, dtype=p.cy.dtype)
    return f, g


def _ref_rows(fields, lab, g, eps, damping=1.0, v=None, cols=False):
    d = {k: (t.double() if isinstance(t, torch.Tensor) else t) for k, t in fields.items()}
    if cols:
        lab_t = None if lab is None else (lab[1], lab[0], lab[2].T, lab[3])
        args = (d["Y"], d["X"], g.double(), d["a"].log(), d["cy"], d["cx"])
        return softmin_ref(*args, eps=eps, c2=2.0, damping=damping, v=v, labels=lab_t)
    args = (d["X"], d["Y"], g.double(), d["b"].log(), d["cx"], d["cy"])
    return softmin_ref(*args, eps=eps, c2=2.0, damping=damping, v=v, labels=lab)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
@pytest.mark.parametrize("labels", [False, True])
@pytest.mark.parametrize("guess", ["none", "close", "hostile"])
def test_passes_match_the_float64_reference(dtype, tol, labels, guess):
    """sm_x / sm_y with and without a guess (one exp2 per score around it; rows whose sum
    leaves the safe range run the max-subtracted pass), with V and the log2 sums."""
    p, fields, lab = _problem(2, 37, 29, 5, dtype=dtype, seed=3, labels=labels)
    eps = 0.05
    f, g = _potentials(p, eps)
    for cols, pot in ((False, g), (True, f)):
        v = torch.randn(2, pot.shape[1], 3, dtype=dtype, generator=torch.Generator().manual_seed(5))
        ref, ref_lse2, ref_v = _ref_rows(fields, lab, pot, eps, 0.9, v, cols)
        est = {"none": None, "close": ref.to(dtype), "hostile": ref.to(dtype) + 500 * eps}[guess]
        if guess == "hostile":  # one row far off in the other direction too
            est[:, 0] -= 1000 * eps
        sm = p.sm_y if cols else p.sm_x
        out, lse2, vbar = sm(pot, eps, 0.9, v=v, want_lse=True, guess=est)
        scale = ref.abs().max()
        assert float((out.double() - ref).abs().max() / scale) < tol
        assert float((lse2.double() - ref_lse2).abs().max() / ref_lse2.abs().max()) < tol
        assert float((vbar.double() - ref_v).abs().max()) < 10 * tol


@pytest.mark.parametrize("zero", [False, True])
def test_symmetric_update_one_exp_matches_the_reference(zero):
    """Both updates from one exp2 per score (CPU, positive weights), or the two passes when
    a weight is zero (its row has no plan mass to measure); hostile potentials recomputed."""
    p, fields, _ = _problem(2, 33, 41, 3, dtype=torch.float64, seed=7, zero=zero)
    assert p._one_exp is not zero
    eps = 0.02
    for shift in (0.0, 200 * eps):  # plan sums far out of range for the hostile case
        f, g = _potentials(p, eps)
        f = f + shift
        ft, gt = p.sym_update(f, g, eps, 0.8, 0.7)
        d = fields
        rf, rg = symmetric_update_ref(
            d["X"],
            d["Y"],
            f,
            g,
            d["a"].log(),
            d["b"].log(),
            d["cx"],
            d["cy"],
            eps=eps,
            c2=2.0,
            damping_x=0.8,
            damping_y=0.7,
        )
        assert torch.allclose(ft, rf, atol=1e-10, rtol=1e-10)
        assert torch.allclose(gt, rg, atol=1e-10, rtol=1e-10)


def test_self_problem_and_sampling():
    p, fields, _ = _problem(1, 25, 19, 4, seed=2)
    q = p.self_problem("y")
    assert q.X is fields["Y"] and q.Y is fields["Y"] and q.negC2.shape == (1, 19, 19)
    torch.testing.assert_close(q.negC2, q.negC2.transpose(-1, -2))
    g = torch.randn(1, 19, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    sm = fs.softmin(
        fields["Y"],
        fields["Y"],
        g,
        q.logb,
        fields["cy"],
        fields["cy"],
        eps=0.1,
        c2=2.0,
        backend="torch",
    )[0]
    torch.testing.assert_close(q.self_update(g, 0.1, 1.0), sm, atol=1e-12, rtol=1e-12)
    # plan sampling: the streaming draw's hash, so the reference's indices
    g = 0.1 * torch.randn(1, 19, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    j = p.sample_rows(g, 0.05, seed=123)
    ref = softmax_sample_ref(
        fields["X"], fields["Y"], g, p.logb, fields["cy"], eps=0.05, c2=2.0, seed=123
    )
    assert torch.equal(j, ref)


@pytest.mark.parametrize("schedule,eps_scaling", [("alternating", None), ("symmetric", 0.5)])
def test_solve_dense_equals_streaming(schedule, eps_scaling):
    x, y, a, b = clouds(40, 31, 3, batch=2, seed=9)
    kw = dict(eps=0.05, schedule=schedule, eps_scaling=eps_scaling, tol=1e-9, max_iter=3000)
    rd = fs.solve(x, y, a, b, backend="dense", **kw)
    rs = fs.solve(x, y, a, b, backend="torch", **kw)
    assert rd.backend == "dense" and rs.backend == "streaming"
    assert bool(rd.converged.all() if torch.is_tensor(rd.converged) else rd.converged)
    torch.testing.assert_close(rd.value, rs.value, atol=1e-9, rtol=1e-9)
    xg = x.clone().requires_grad_()
    fs.solve(xg, y, a, b, backend="dense", **kw).value.sum().backward()
    xs = x.clone().requires_grad_()
    fs.solve(xs, y, a, b, backend="torch", **kw).value.sum().backward()
    torch.testing.assert_close(xg.grad, xs.grad, atol=1e-8, rtol=1e-7)
    # the plan operations of the result run on the dense problem
    V = torch.randn(2, 31, 2, dtype=torch.float64)
    torch.testing.assert_close(rd.apply(V), rs.apply(V), atol=1e-9, rtol=1e-8)


@pytest.mark.parametrize("debias,reach", [(False, None), (True, None), (True, 0.5)])
def test_samples_loss_dense_equals_streaming(debias, reach):
    x, y, a, b = clouds(45, 38, 3, seed=13, dtype=torch.float32)
    out = {}
    for be in ("dense", "torch"):
        xg = x.clone().requires_grad_()
        loss = fs.SamplesLoss(blur=0.1, debias=debias, reach=reach, backend=be)
        v = loss(a, xg, b, y)
        v.backward()
        out[be] = (v.detach(), xg.grad)
    torch.testing.assert_close(out["dense"][0], out["torch"][0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out["dense"][1], out["torch"][1], atol=2e-6, rtol=1e-4)


def test_auto_rule_is_recorded_and_printed(monkeypatch, capsys):
    x, y, a, b = clouds(30, 20, 2, seed=1)
    r = fs.solve(x, y, a, b, eps=0.1, verbose=True)
    assert r.backend == "dense"
    assert "backend dense (auto:" in capsys.readouterr().out
    assert backends.auto_backend(1, 30, 20, torch.device("cpu"), torch.float64)[0] == "dense"
    # above the budget auto streams (the blockwise torch path on the CPU)
    monkeypatch.setattr(_config, "DENSE_MAX_BYTES", 1000)
    r = fs.solve(x, y, a, b, eps=0.1)
    assert r.backend == "streaming" and isinstance(r._prob, StreamingProblem)
    assert backends.auto_backend(1, 300, 300, torch.device("cuda"), torch.float32)[0] == "dense"
    big = _config.DENSE_MAX_SCORES_CUDA + 1
    assert backends.auto_backend(1, big, 1, torch.device("cuda"), torch.float32)[0] == "streaming"


def test_bad_backends_name_the_argument():
    x, y, a, b = clouds(5, 4, 2)
    with pytest.raises(ValueError, match="backend must be one of"):
        fs.solve(x, y, a, b, eps=0.1, backend="keops")
    with pytest.raises(ValueError, match="backend must be one of"):
        fs.solve(x, y, a, b, eps=0.1, backend="Dense")


@pytest.mark.gpu
@pytest.mark.parametrize("debias", [False, True])
def test_dense_on_cuda_matches_float64(debias):
    """The CUDA dense path (max-subtracted passes, two passes per symmetric update, no host
    read) against the float64 reference on the CPU, values and gradients."""
    x, y, a, b = clouds(300, 250, 5, seed=21)
    ref_x = x.clone().requires_grad_()
    ref = fs.samples_loss_ref(a, ref_x, b, y, blur=0.1, debias=debias)
    xs = x.float().cuda().requires_grad_()
    args = (a.float().cuda(), xs, b.float().cuda(), y.float().cuda())
    v = fs.SamplesLoss(blur=0.1, debias=debias, backend="dense")(*args)
    v.backward()
    assert abs(float(v) - float(ref)) < 1e-5 * max(1.0, abs(float(ref)))
    r = fs.solve(
        x.float().cuda(),
        y.float().cuda(),
        a.float().cuda(),
        b.float().cuda(),
        eps=0.05,
        backend="dense",
        tol=1e-5,
    )
    assert r.backend == "dense" and bool(r.converged)
    r64 = fs.solve(x, y, a, b, eps=0.05, tol=1e-10, max_iter=5000)
    assert abs(float(r.value) - float(r64.value)) < 1e-5
