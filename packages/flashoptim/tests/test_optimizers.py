"""Optimizer semantics: parity with torch.optim, lost updates, non-finite gradients, errors,
param groups and schedulers, memory report, gradient release, digits MLP parity."""

import math
import os

import pytest
import torch

import flashoptim as fo


def _params(dtype=torch.float32, seed=0, sizes=((7, 5), (33,), (300,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in sizes]


def _grads(ps, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in ps]


PAIRS = [
    (fo.FlashAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (fo.FlashAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (fo.FlashSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.01)),
    (fo.FlashSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    (fo.FlashSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.5, dampening=0.3)),
    (fo.FlashSGD, torch.optim.SGD, dict(lr=1e-2)),
]


@pytest.mark.parametrize("Flash,Torch,kw", PAIRS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_without_quantization(Flash, Torch, kw, dtype):
    """quantize=False + 32-bit master weights: the same trajectory as torch.optim on fp32."""
    ps = _params(dtype)
    ref = [p.detach().float().clone().requires_grad_() for p in ps]
    a = Flash(ps, quantize=False, master_weight_bits=32, **kw)
    b = Torch(ref, foreach=False, **kw)
    for s in range(20):
        for p, r, g in zip(ps, ref, _grads(ps, s)):
            p.grad, r.grad = g.to(dtype), g.to(dtype).float()
        a.step()
        b.step()
    for p, r in zip(ps, ref):
        m = fo.master_weight(p, a)
        # fp32 round-off over 20 steps; the int16 correction keeps the full fp32 value
        torch.testing.assert_close(m, r.detach(), rtol=1e-5, atol=1e-5)


def _lion_ref(p, g, m, lr, b1, b2, wd):
    p = p * (1 - lr * wd)
    p = p - lr * torch.sign(b1 * m + (1 - b1) * g)
    return p, b2 * m + (1 - b2) * g


def test_lion_matches_reference():
    ps = _params()
    ref = [p.detach().double().clone() for p in ps]
    ms = [torch.zeros_like(r) for r in ref]
    opt = fo.FlashLion(ps, lr=1e-3, weight_decay=0.1, quantize=False)
    for s in range(10):
        gs = _grads(ps, s)
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()
        for i, g in enumerate(gs):
            ref[i], ms[i] = _lion_ref(ref[i], g.double(), ms[i], 1e-3, 0.9, 0.99, 0.1)
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)


def test_sgdw_decoupled_decay():
    p = torch.ones(40, requires_grad=True)
    opt = fo.FlashSGDW([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(40)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((40,), 0.95))


@pytest.mark.parametrize("Opt", [fo.FlashAdamW, fo.FlashSGD, fo.FlashLion])
def test_quantized_tracks_unquantized(Opt):
    """Default (quantized, 24-bit) vs unquantized fp32: same direction, small deviation."""
    kw = dict(momentum=0.9) if Opt is fo.FlashSGD else {}
    ps = _params(torch.bfloat16)
    ref = [p.detach().float().clone().requires_grad_() for p in ps]
    a, b = Opt(ps, lr=1e-3, **kw), Opt(ref, lr=1e-3, quantize=False, **kw)
    init = [r.detach().clone() for r in ref]
    for s in range(20):
        for p, r, g in zip(ps, ref, _grads(ps, s)):
            p.grad, r.grad = g.bfloat16(), g
        a.step()
        b.step()
    for p, r, i in zip(ps, ref, init):
        da, db = fo.master_weight(p, a) - i, r.detach() - i
        cos = torch.nn.functional.cosine_similarity(da.flatten(), db.flatten(), dim=0)
        assert cos > 0.97
        assert (da - db).norm() < 0.2 * db.norm()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lost_update(backend, request):
    """Weight 1.0, 100 steps of -1e-5: nearest rounding drops them, stochastic keeps them."""
    if backend == "triton" and not _can_run_kernel():
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
    ps = _params(torch.bfloat16)
    opt = fo.FlashAdamW(ps, lr=1e-2)
    for p, g in zip(ps, _grads(ps, 0)):
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
    a, b = _params(torch.bfloat16)[:2]
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


@pytest.mark.parametrize(
    "Opt,kw,target",
    [
        (fo.FlashAdamW, {}, 7.125),
        (fo.FlashSGD, dict(momentum=0.9), 6.07),
        (fo.FlashLion, {}, 6.07),
    ],
)
def test_memory_report_targets(Opt, kw, target):
    ps = [torch.zeros(1024, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    opt = Opt(ps, **kw)
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt.step()
    rep = fo.memory_report(opt)
    assert rep["bytes_per_param"] <= target
    assert rep["grad"] == 2 * rep["params"]
    if Opt is fo.FlashAdamW:
        assert rep["bytes_per_param"] == pytest.approx(7.125)
        fo.enable_gradient_release(ps, opt)
        assert fo.memory_report(opt)["bytes_per_param"] == pytest.approx(5.125)


def _mlp(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    ).to(dtype)


@pytest.mark.parametrize("k", [1, 3])
def test_gradient_release_equals_step(k):
    x, y = torch.randn(3 * 16, 64), torch.randint(0, 10, (3 * 16,))
    m1, m2 = _mlp(0, torch.bfloat16), _mlp(0, torch.bfloat16)
    o1, o2 = fo.FlashAdamW(m1.parameters(), lr=1e-2), fo.FlashAdamW(m2.parameters(), lr=1e-2)
    h = fo.enable_gradient_release(m2, o2, accumulation_steps=k)
    for _it in range(4):
        for j in range(k):
            xb, yb = x[j * 16 : (j + 1) * 16].bfloat16(), y[j * 16 : (j + 1) * 16]
            torch.nn.functional.cross_entropy(m1(xb).float(), yb).backward()
            torch.nn.functional.cross_entropy(m2(xb).float(), yb).backward()
        o1.step()
        o1.zero_grad()
        o2.step()  # no-op: no gradients left
        assert all(p.grad is None for p in m2.parameters())
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    h.remove()
    assert not h.active


def test_gradient_release_per_param_clipping():
    p = torch.zeros(100, requires_grad=True)
    opt = fo.FlashSGD([p], lr=1.0, quantize=False)
    fo.enable_gradient_release([p], opt, max_norm_per_param=1.0)
    (p * 100.0).sum().backward()
    assert abs(p.detach().norm().item() - 1.0) < 1e-3


def _digits_run(make_opt, seed, dtype):
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(X), generator=g)
    Xtr, ytr = X[perm[:1500]], y[perm[:1500]]
    model = _mlp(seed).to(dtype)
    opt = make_opt(model.parameters())
    for _ep in range(8):
        idx = torch.randperm(1500, generator=g)
        for i in range(0, 1500, 64):
            b = idx[i : i + 64]
            loss = torch.nn.functional.cross_entropy(model(Xtr[b].to(dtype)).float(), ytr[b])
            loss.backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(Xtr.to(dtype)).float(), ytr).item()


def test_digits_mlp_parity():
    """FlashAdamW (bf16 weights, defaults) final loss within torch AdamW's seed spread."""
    tl = [_digits_run(lambda p: torch.optim.AdamW(p, lr=3e-3), s, torch.float32) for s in range(3)]
    fl = [_digits_run(lambda p: fo.FlashAdamW(p, lr=3e-3), s, torch.bfloat16) for s in range(3)]
    spread = max(tl) - min(tl)
    mean_f, mean_t = sum(fl) / 3, sum(tl) / 3
    assert max(tl) < 0.2  # it trained
    assert abs(mean_f - mean_t) <= max(spread, 0.1 * mean_t), (tl, fl)


@pytest.mark.parametrize("first", [torch.float32, torch.bfloat16])
def test_mixed_dtype_group_cached_plan(first):
    """One group with fp32 and bf16 parameters and static gradients (the cached-plan fast
    path from step 2): each bucket's mode (correction bits) follows its own dtype, as with
    one group per parameter. Regression: the fast path took the first parameter's."""
    if not _can_run_kernel():
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA")
    dts = [first, torch.bfloat16 if first == torch.float32 else torch.float32]

    def mk():
        g = torch.Generator().manual_seed(0)
        return [(torch.randn(64, generator=g) * 0.1).to(dt).requires_grad_() for dt in dts]

    pa, pb = mk(), mk()
    a = fo.FlashAdamW(pa, lr=1e-2, backend="triton")
    b = fo.FlashAdamW([dict(params=[p]) for p in pb], lr=1e-2, backend="triton")
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for x, y in zip(pa, pb):
            gr = torch.randn(x.shape, generator=g).to(x.dtype)
            if x.grad is None:
                x.grad, y.grad = gr.clone(), gr.clone()
            else:
                x.grad.copy_(gr)
                y.grad.copy_(gr)
        a.step()
        b.step()
        for x, y in zip(pa, pb):
            assert torch.equal(x, y)
            for k, v in a.state[x].items():
                if torch.is_tensor(v):
                    assert torch.equal(v, b.state[y][k]), k


# ----------------------------------------------------------------- load_master_weights
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [24, 32, None])
def test_load_master_weights_keeps_the_fp32_value(dtype, bits):
    """The narrow parameter is the nearest narrow value of the master and the correction holds
    the rest: the optimizer's master weight is the fp32 value to half a correction step."""
    from flashoptim import _core

    g = torch.Generator().manual_seed(11)
    masters = [
        torch.randn(1000, generator=g) * 0.02,
        torch.randn(7, 33, generator=g) * 3.0,
        torch.tensor([1.0, -1.0, 0.0, 1e-3, 5e-6, 1.0 + 2**-9, 2.0 - 2**-12]),
    ]
    ps = [m.to(dtype).requires_grad_() for m in masters]
    ps.append(torch.randn(5, generator=g).requires_grad_())  # an fp32 parameter
    masters.append(ps[-1].detach() + 0.25)
    opt = fo.FlashAdamW(ps, lr=1e-3, master_weight_bits=bits)
    opt.load_master_weights(masters)
    for p, m in zip(ps, masters):
        assert torch.equal(p.detach(), m.to(p.dtype)), "narrow value = nearest rounding"
        got = fo.master_weight(p, opt)
        if p.dtype == torch.float32:
            assert torch.equal(got, m)
        elif bits is None:
            assert "correction" not in opt.state[p]
            assert torch.equal(got, m.to(dtype).float())
        else:
            q = _core._ulp_ref(p.detach().reshape(-1)) / 2.0 ** _core._ECC_BITS[bits]
            err = (got.reshape(-1).double() - m.reshape(-1).double()).abs()
            # half a step, except where the rest is near +half an ulp: codes stop at 2**(b-1) - 1
            assert (err <= q).all(), float((err / q).max())
            assert float((err <= q / 2).float().mean()) > 0.99
            if bits == 24 and p.numel() > 100:
                assert (err > 0).any()  # a real rounding, not a copy through fp32


def test_load_master_weights_errors():
    ps = [torch.zeros(4, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    opt = fo.FlashAdamW(ps)
    with pytest.raises(ValueError, match="got 1 tensors for 2 parameters"):
        opt.load_master_weights([torch.zeros(4)])
    with pytest.raises(ValueError, match=r"masters\[1\] has shape \(5,\)"):
        opt.load_master_weights([torch.zeros(4), torch.zeros(5)])
    with pytest.raises(TypeError, match=r"masters\[0\] must be a float tensor"):
        opt.load_master_weights([torch.zeros(4, dtype=torch.int32), torch.zeros(4)])


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
            ),
        ),
    ],
)
def test_fp32_masters_remove_the_dead_zone(backend):
    """Why load_master_weights exists. A model cast to bf16 has every master weight on a
    bf16 value, so a first update of under half an ulp moves no visible weight at all; with
    the fp32 init as master, the visible weights follow the update on average (the fraction
    that moves is about |update| / ulp, as for torch's fp32 master cast to bf16)."""
    g = torch.Generator().manual_seed(3)
    init = 0.0201 + torch.rand(20000, generator=g) * 0.0108  # one binade: ulp = 2**-13
    grad = torch.randn(20000, generator=g).bfloat16()
    lr = 3e-5  # the first Adam update is lr * sign(g): about 0.25 ulp, under half an ulp
    moved = {}
    for name in ("bf16_init", "fp32_masters"):
        p = init.bfloat16().requires_grad_()
        opt = fo.FlashAdamW([p], lr=lr, weight_decay=0.0, backend=backend)
        if name == "fp32_masters":
            opt.load_master_weights([init])
        before = p.detach().clone()
        p.grad = grad.clone()
        opt.step()
        delta = (p.detach().float() - before.float())[grad != 0]
        moved[name] = float((delta != 0).float().mean())
        # every visible move goes against the gradient
        assert ((delta * grad[grad != 0].float()) <= 0).all()
    assert moved["bf16_init"] == 0.0
    expected = lr / 2**-13  # 0.246
    assert abs(moved["fp32_masters"] - expected) < 0.03, moved
