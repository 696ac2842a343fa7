"""The base class (``optimizer.py``): non-finite gradients, errors, param groups and
schedulers, stochastic rounding's lost-update effect, the torch and Triton paths."""

import math

import pytest
import torch
from _checks import INTERP, small_grads, small_params

import flashoptim as fo


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lost_update(backend, request):
    """Weight 1.0, 100 steps of -1e-5: nearest rounding drops them, stochastic keeps them."""
    if backend == "triton" and not (INTERP or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA")
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    out = {}
    for sr in (False, True):
        p = torch.ones(4096, dtype=torch.bfloat16, device=dev, requires_grad=True)
        opt = fo.FlashSGD([p], lr=1e-5, stochastic_rounding=sr, backend=backend)
        for _ in range(100):
            p.grad = torch.ones_like(p)  # step -lr * 1 = -1e-5
            opt.step()
        out[sr] = fo.master_weight(p, opt).double()
    assert (out[False] == 1.0).all()  # the published scheme loses every update
    moved = out[True].mean().item()
    assert abs(moved - (1.0 - 1e-3)) < 1e-4  # lands in expectation: 1 - 100 * 1e-5
    assert (out[True] < 1.0).float().mean() > 0.99


def _can_run_kernel():
    import os

    return os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


def test_nonfinite_skip_and_raise():
    ps = small_params(torch.bfloat16)
    opt = fo.FlashAdamW(ps, lr=1e-2)
    for p, g in zip(ps, small_grads(ps, 0)):
        p.grad = g.bfloat16()
    opt.step()
    snap = {k: v.clone() for k, v in opt.state[ps[0]].items() if torch.is_tensor(v)}
    w = [p.detach().clone() for p in ps]
    ps[1].grad[3] = float("nan")
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, p) for a, p in zip(w, ps))
    for k, v in snap.items():
        assert torch.equal(v, opt.state[ps[0]][k])
    assert opt.state[ps[0]]["step"] == 1
    opt2 = fo.FlashAdamW(ps, on_nonfinite="raise")
    ps[0].grad[0] = float("inf")
    with pytest.raises(fo.NonFiniteGradError):
        opt2.step()


def test_clear_errors():
    with pytest.raises(ValueError, match="complex"):
        fo.FlashAdamW([torch.zeros(3, dtype=torch.complex64, requires_grad=True)])
    with pytest.raises(ValueError, match="master_weight_bits"):
        fo.FlashAdamW([torch.zeros(3, requires_grad=True)], master_weight_bits=16)
    with pytest.raises(ValueError, match="scale_dtype"):
        fo.FlashAdamW([torch.zeros(3, requires_grad=True)], scale_dtype=torch.float16)
    with pytest.raises(ValueError, match="lr"):
        fo.FlashAdamW([torch.zeros(3, requires_grad=True)], lr=-1)
    with pytest.raises(ValueError, match="nesterov"):
        fo.FlashSGD([torch.zeros(3, requires_grad=True)], nesterov=True)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = fo.FlashAdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()


def test_param_groups_scheduler_zero_grad():
    a, b = small_params(torch.bfloat16)[:2]
    opt = fo.FlashAdamW([{"params": [a]}, {"params": [b], "lr": 0.0}], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    b0 = b.detach().clone()
    for _s in range(3):
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
        opt.step()
        sched.step()
    assert torch.equal(b.detach(), b0)  # lr 0 group untouched (weight decay * lr = 0)
    assert math.isclose(opt.param_groups[0]["lr"], 1e-2 / 8)
    c = torch.randn(10, requires_grad=True)
    opt.add_param_group({"params": [c]})
    c.grad = torch.ones(10)
    opt.step()
    assert opt.state[c]["step"] == 1
    opt.zero_grad()
    assert a.grad is None
