"""The base class (``optimizer.py``): non-finite gradients, errors, param groups and
schedulers, stochastic rounding's lost-update effect, the torch and Triton paths."""

import math

import pytest
import torch
from _checks import DEV, INTERP, needs_kernel, small_grads, small_params

import flashoptim_fused as fo


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


def _strided_params():
    """A channels_last conv weight, a transposed matrix and a view at a storage offset."""
    gen = torch.Generator().manual_seed(3)
    conv = torch.randn(8, 3, 3, 5, generator=gen).to(memory_format=torch.channels_last)
    tr = torch.randn(24, 37, generator=gen).t()
    off = torch.randn(5 + 40, generator=gen)[5:].view(8, 5)
    return [conv, tr, off]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
@pytest.mark.parametrize(
    "okw", [dict(quantize=False, master_weight_bits=32), {}], ids=["fp32", "default"]
)
def test_strided_parameters_match_torch(backend, okw):
    """Non-contiguous dense parameters (channels_last, transposed) are stepped over their
    storage, states in the parameter's strides: the CPU path wrote the update into a copy
    (0.03 off torch AdamW after 3 steps) and the kernel refused them. fp32 states and 32-bit
    masters: torch's trajectory to fp32 round-off; the default: within 8-bit noise."""
    dev = DEV if backend == "triton" else "cpu"
    ps = [p.to(dev).requires_grad_() for p in _strided_params()]
    assert not ps[0].is_contiguous() and not ps[1].is_contiguous()
    ref = [p.detach().cpu().clone().requires_grad_() for p in ps]
    a = fo.FlashAdamW(ps, lr=1e-2, backend=backend, **okw)
    b = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(4)
    for s in range(3):
        for p, r in zip(ps, ref):
            g = torch.randn(p.shape, generator=gen)
            r.grad = g
            # the first step: a contiguous gradient (copied into the parameter's layout)
            p.grad = g.to(dev) if s == 0 else torch.empty_like(p).copy_(g)
        a.step()
        b.step()
    tol = 1e-5 if okw else 3e-3
    for p, r in zip(ps, ref):
        assert p.stride() == r.stride()
        d = (fo.master_weight(p, a).cpu() - r.detach()).abs().max()
        assert d < tol, float(d)


def test_non_dense_parameter_is_refused():
    base = torch.zeros(8, 10)
    with pytest.raises(ValueError, match="parameter 1 of param group 0.*not dense"):
        fo.FlashAdamW([torch.zeros(3, requires_grad=True), base[:, ::2].requires_grad_()])
    e = torch.zeros(1, 4).expand(3, 4).requires_grad_()
    with pytest.raises(ValueError, match="not dense"):
        fo.FlashSGD([e])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_step(how):
    """copy.deepcopy / pickle gave an optimizer whose step() raised AttributeError _plans:
    the per-step caches are rebuilt lazily; the copy continues bit for bit."""
    import copy
    import pickle

    ps = small_params(torch.bfloat16)
    opt = fo.FlashAdamW(ps, lr=1e-2)
    for p, g in zip(ps, small_grads(ps, 0)):
        p.grad = g.bfloat16()
    opt.step()
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    qs = [q for g in twin.param_groups for q in g["params"]]
    for p, q, g in zip(ps, qs, small_grads(ps, 1)):
        p.grad, q.grad = g.bfloat16(), g.bfloat16()
    opt.step()
    twin.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
        assert all(
            torch.equal(v, twin.state[q][k]) for k, v in opt.state[p].items() if torch.is_tensor(v)
        )


def test_load_state_dict_hooks_errors_and_validation():
    """load_state_dict runs torch.optim's pre/post hooks (they never fired), names the
    parameter of a mismatched state (was a reshape error), validates loaded groups, and
    refuses amsgrad state; group dicts are validated like the constructor's arguments."""
    ps = small_params()
    opt = fo.FlashAdamW(ps, lr=1e-2)
    for p, g in zip(ps, small_grads(ps, 0)):
        p.grad = g
    opt.step()
    sd = opt.state_dict()
    seen = []
    opt.register_load_state_dict_pre_hook(lambda o, s: seen.append("pre"))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("post"))
    opt.load_state_dict(sd)
    assert seen == ["pre", "post"]
    other = fo.FlashAdamW(small_params(sizes=((7, 5), (32,), (300,), (3, 40))), lr=1e-2)
    with pytest.raises(ValueError, match="parameter 1 of param group 0: state 'exp_avg"):
        other.load_state_dict(sd)
    bad = dict(sd, param_groups=[dict(sd["param_groups"][0], weight_decay=-1.0)])
    with pytest.raises(ValueError, match="weight_decay"):
        opt.load_state_dict(bad)
    t = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in ps], amsgrad=True)
    for q in t.param_groups[0]["params"]:
        q.grad = torch.ones_like(q)
    t.step()
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(t.state_dict())
    for kw in (dict(weight_decay=-0.1), dict(betas=(0.9, 1.5)), dict(lr=-1.0), dict(eps=-1.0)):
        with pytest.raises(ValueError, match="param group 1"):
            fo.FlashAdamW([{"params": ps[:1]}, {"params": ps[1:], **kw}])
    with pytest.raises(ValueError, match="momentum"):
        fo.FlashSGD([{"params": ps, "momentum": -0.5}])


def test_skip_warns_once_with_the_step():
    ps = small_params()
    opt = fo.FlashAdamW(ps, lr=1e-2)
    for p, g in zip(ps, small_grads(ps, 0)):
        p.grad = g
    opt.step()
    ps[0].grad[0, 0] = float("inf")
    with pytest.warns(RuntimeWarning, match="step 2 was skipped"):
        opt.step()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # counted, not warned again
    assert opt.skipped_steps == 2


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
@pytest.mark.parametrize(
    "Flash,Torch,kw",
    [
        (fo.FlashAdamW, torch.optim.AdamW, dict(weight_decay=0.1)),
        (fo.FlashAdam, torch.optim.Adam, dict(weight_decay=0.1, decoupled_weight_decay=True)),
        (fo.FlashSGD, torch.optim.SGD, dict(momentum=0.9, weight_decay=0.01)),
    ],
    ids=["adamw", "adam_decoupled", "sgd"],
)
def test_torch_keywords(backend, Flash, Torch, kw):
    """torch.optim keywords: maximize ascends (in the kernel), foreach / fused are accepted
    no-ops, decoupled_weight_decay=True makes Adam AdamW; fp32 states and 32-bit masters
    follow torch's trajectory."""
    dev = DEV if backend == "triton" else "cpu"
    ps = [p.to(dev).requires_grad_() for p in small_params()]
    ref = [p.detach().cpu().clone().requires_grad_() for p in ps]
    a = Flash(
        ps,
        lr=1e-2,
        maximize=True,
        foreach=True,
        fused=False,
        backend=backend,
        quantize=False,
        master_weight_bits=32,
        **kw,
    )
    b = Torch(ref, lr=1e-2, maximize=True, foreach=False, **kw)
    for s in range(5):
        for p, r, g in zip(ps, ref, small_grads(ps, s)):
            p.grad, r.grad = g.to(dev), g
        a.step()
        b.step()
    for p, r in zip(ps, ref):
        torch.testing.assert_close(fo.master_weight(p, a).cpu(), r.detach(), rtol=1e-5, atol=1e-5)


def test_torch_keywords_rejected():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError, match="amsgrad"):
        fo.FlashAdamW(p, amsgrad=True)
    with pytest.raises(ValueError, match="differentiable"):
        fo.FlashSGD(p, differentiable=True)
    with pytest.raises(ValueError, match="FlashAdam"):
        fo.FlashAdamW(p, decoupled_weight_decay=False)
