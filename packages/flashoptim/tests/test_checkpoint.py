"""Checkpoints and master weights (``checkpoint.py``): bit-exact resume, compact state dicts,
torch.optim checkpoints, fp32 export, starting from fp32 master weights."""

import io

import pytest
import torch
from _checks import INTERP, small_grads, small_params

import flashoptim_fused as fo
from flashoptim_fused import reference

dm, dv = reference.dequantize_momentum_ref, reference.dequantize_variance_ref
qm, qv = reference.quantize_momentum_ref, reference.quantize_variance_ref


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(s):
    g = torch.Generator().manual_seed(100 + s)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _train(model, opt, steps):
    for s in steps:
        x, y = _batch(s)
        loss = ((model(x.to(model[0].weight.dtype)).float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    "Opt,kw",
    [
        (fo.FlashAdamW, {}),
        (fo.FlashSGD, dict(momentum=0.9)),
        (fo.FlashLion, {}),
        (fo.FlashAdamW, dict(scale_dtype=torch.float32, master_weight_bits=32)),
    ],
)
def test_bit_exact_resume(Opt, kw):
    full = _model().bfloat16()
    o_full = Opt(full.parameters(), lr=1e-2, **kw)
    _train(full, o_full, range(10))

    part = _model().bfloat16()
    o_part = Opt(part.parameters(), lr=1e-2, **kw)
    _train(part, o_part, range(5))
    buf = io.BytesIO()
    torch.save({"model": part.state_dict(), "opt": o_part.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    fresh = _model(seed=123).bfloat16()
    fresh.load_state_dict(ck["model"])
    o_fresh = Opt(fresh.parameters(), lr=1e-2, **kw)
    o_fresh.load_state_dict(ck["opt"])
    _train(fresh, o_fresh, range(5, 10))
    for a, b in zip(full.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    for p, q in zip(full.parameters(), fresh.parameters()):
        for k, v in o_full.state[p].items():
            w = o_fresh.state[q][k]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, k


def test_state_dict_is_compact():
    ps = [torch.zeros(4096, 64, dtype=torch.bfloat16, requires_grad=True)]
    opt = fo.FlashAdamW(ps)
    ps[0].grad = torch.randn_like(ps[0])
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    n = ps[0].numel()
    in_mem = fo.memory_report(opt)
    held = in_mem["master_correction"] + in_mem["state_codes"] + in_mem["state_scales"]
    assert held == pytest.approx(3.125 * n)
    assert len(buf.getvalue()) < held * 1.02 + 4096


def test_load_torch_adamw_checkpoint():
    m_t = _model()
    o_t = torch.optim.AdamW(m_t.parameters(), lr=1e-2)
    _train(m_t, o_t, range(5))
    sd = o_t.state_dict()
    m_f = _model()
    m_f.load_state_dict(m_t.state_dict())
    o_f = fo.FlashAdamW(m_f.parameters(), lr=1e-2)
    o_f.load_state_dict(sd)
    # Linear(32, 4).weight: rows of 32 (quantized); the first layer's rows of 16 keep fp32
    # states (grid.py), loaded as they are
    p_t, p_f = m_t[2].weight, m_f[2].weight
    assert o_f.state[p_f]["exp_avg_codes"].dtype == torch.int8
    assert o_f.state[p_f]["step"] == 5
    assert torch.equal(o_f.state[m_f[0].weight]["exp_avg"], o_t.state[m_t[0].weight]["exp_avg"])
    m = reference.dequantize_momentum_ref(
        o_f.state[p_f]["exp_avg_codes"].view(-1), o_f.state[p_f]["exp_avg_scale"]
    ).view(p_t.shape)
    ref = o_t.state[p_t]["exp_avg"].double()
    assert (m - ref).abs().max() <= ref.abs().max() / 60  # within the companded resolution
    # continuing from the loaded state tracks torch
    _train(m_t, o_t, range(5, 10))
    _train(m_f, o_f, range(5, 10))
    for a, b in zip(m_t.parameters(), m_f.parameters()):
        torch.testing.assert_close(a, b, rtol=0.05, atol=2e-3)


def _v020(sd, opt, per_element: bool) -> dict:
    """``sd`` as flashoptim-fused 0.2.0 saved it: scales on a flat grid of 32 over each
    tensor (1-D), every tensor quantized, codes of 1-D tensors too; or (``per_element``)
    its sharded export, each group scale repeated per element."""
    out = {"state": {}, "param_groups": sd["param_groups"]}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, st in sd["state"].items():
        new = {k: v for k, v in st.items() if k in ("step", "seed", "correction")}
        for key, q in (("exp_avg", qm), ("exp_avg_sq", qv)):
            vals = torch.empty_like(params[i], dtype=torch.float64)
            if key in st:  # fp32 now (rows under 32): 0.2.0 kept codes
                vals.copy_(st[key])
            else:
                row = reference.state_row(params[i], True)
                dq = dm if key == "exp_avg" else dv
                vals.view(-1).copy_(dq(st[key + "_codes"].view(-1), st[key + "_scale"], row))
            if reference.state_row(params[i], True) is None and key not in st:
                codes, scales = st[key + "_codes"], st[key + "_scale"].view(-1)  # same groups
            else:
                codes, scales = q(vals.view(-1), torch.bfloat16)
            new[key + "_codes"] = codes.view(vals.shape)
            if per_element:
                n = vals.numel()
                new[key + "_scale_per_element"] = scales.repeat_interleave(32)[:n].view(vals.shape)
            else:
                new[key + "_scale"] = scales
        out["state"][i] = new
    return out


@pytest.mark.parametrize("per_element", [False, True], ids=["flat", "sharded_export"])
def test_loads_0_2_0_state_dicts(per_element):
    """0.2.0's layouts still load: rows of a multiple of 32 had the same groups then, so
    their codes and scales load bit for bit (``flat``); 1-D tensors and other rows are
    decoded (fp32 states now) or quantized again on the rows' grid; per-element scales
    (0.2.0's DTensor export) are decoded and quantized again."""
    shapes = ((4, 64), (3, 40), (50,))
    ps = small_params(dtype=torch.bfloat16, sizes=shapes)
    opt = fo.FlashAdamW(ps, lr=1e-2)
    for s in range(3):
        for p, g in zip(ps, small_grads(ps, s)):
            p.grad = g.bfloat16()
        opt.step()
    old = _v020(opt.state_dict(), opt, per_element)
    qs = [p.detach().clone().requires_grad_() for p in ps]
    opt2 = fo.FlashAdamW(qs, lr=1e-2)
    opt2.load_state_dict(old)
    for i, (p, q) in enumerate(zip(ps, qs)):
        a, b = opt.state[p], opt2.state[q]
        assert a.keys() == b.keys() and b["step"] == 3
        assert torch.equal(a["correction"], b["correction"])
        for key in ("exp_avg", "exp_avg_sq"):
            if key in a:  # 1-D: fp32 from 0.2.0's codes, within their resolution
                assert b[key].dtype == torch.float32
                assert (b[key] - a[key]).abs().max() <= a[key].abs().max() / 50
            elif i == 0 and not per_element:  # the same groups: bit for bit
                assert torch.equal(a[key + "_codes"], b[key + "_codes"])
                assert torch.equal(a[key + "_scale"], b[key + "_scale"])
            else:  # quantized again on this grid: the same values to the codes' resolution
                row = reference.state_row(p, True)
                dq = dm if key == "exp_avg" else dv
                va = dq(a[key + "_codes"].view(-1), a[key + "_scale"], row)
                vb = dq(b[key + "_codes"].view(-1), b[key + "_scale"], row)
                assert (va - vb).abs().max() <= va.abs().max() / 30, (i, key)
    for s in range(3, 5):  # and it steps
        for p, g in zip(qs, small_grads(qs, s)):
            p.grad = g.bfloat16()
        opt2.step()
    assert all(opt2.state[q]["step"] == 5 for q in qs)


def test_export_fp32_master_weights():
    model = _model().bfloat16()
    opt = fo.FlashAdamW(model.parameters(), lr=1e-3)
    _train(model, opt, range(3))
    mw = opt.master_weights()
    for p in model.parameters():
        w = mw[p]
        assert w.dtype == torch.float32 and w.shape == p.shape
        assert torch.equal(w.bfloat16(), p.detach()) or (w.bfloat16() - p).abs().max() <= (
            p.abs().max() * 2**-7
        )
        assert not torch.equal(w, p.detach().float())  # carries the extra bits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [24, 32, None])
def test_load_master_weights_keeps_the_fp32_value(dtype, bits):
    """The narrow parameter is the nearest narrow value of the master and the correction holds
    the rest: the optimizer's master weight is the fp32 value to half a correction step."""
    from flashoptim_fused import reference

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
            q = reference.ulp_ref(p.detach().reshape(-1)) / 2.0 ** reference.ECC_BITS[bits]
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
            marks=pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1"),
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


@pytest.mark.parametrize(
    "Flash,Torch,kw",
    [
        (fo.FlashAdamW, torch.optim.AdamW, dict(weight_decay=0.1)),
        (fo.FlashSGD, torch.optim.SGD, dict(momentum=0.9)),
    ],
    ids=["adamw", "sgd"],
)
def test_torch_round_trip(Flash, Torch, kw):
    """The way back to torch: ``torch_state_dict()`` (fp32 moments) + ``master_weights()``
    continue in torch.optim as our optimizer continues (fp32 states: to fp32 round-off;
    default 8-bit states: within their resolution), and torch's state dict loads back. Our
    native format keeps 8-bit codes under ``<state>_codes``: torch's loader cannot take them
    for moments (torch's step raises instead of reading codes as values)."""
    for okw, tol in ((dict(quantize=False, master_weight_bits=32), 1e-5), ({}, 5e-3)):
        ps = small_params()
        opt = Flash(ps, lr=1e-2, **okw, **kw)
        for s in range(3):
            for p, g in zip(ps, small_grads(ps, s)):
                p.grad = g
            opt.step()
        masters = opt.master_weights()
        fp32 = [masters[p].clone().requires_grad_() for p in ps]
        t = Torch(fp32, lr=1e-2, **kw)
        t.load_state_dict(opt.torch_state_dict())
        back = Flash([p.detach().clone().requires_grad_() for p in ps], lr=1e-2, **okw, **kw)
        back.load_state_dict(t.state_dict())
        qs = [q for q in back.param_groups[0]["params"]]
        for s in range(3, 6):
            for p, q, r, g in zip(ps, qs, fp32, small_grads(ps, s)):
                p.grad, q.grad, r.grad = g, g.clone(), g.clone()
            opt.step()
            t.step()
            back.step()
        for p, q, r in zip(ps, qs, fp32):
            w = fo.master_weight(p, opt)
            assert (w - r.detach()).abs().max() < tol
            assert (fo.master_weight(q, back) - w).abs().max() < tol
    native = opt.state_dict()
    # quantized parameters (rows of >= 32, grid.py) keep codes under <state>_codes only;
    # the others (rows under 32) keep fp32 states under torch's names
    quant = [i for i, st in native["state"].items() if opt._m_key + "_codes" in st]
    assert quant and all(opt._m_key not in native["state"][i] for i in quant)
    t = Torch([p.detach().clone().requires_grad_() for p in ps], lr=1e-2, **kw)
    t.load_state_dict(native)
    for i, p in enumerate(t.param_groups[0]["params"]):
        p.grad = torch.ones_like(p)
        if i in quant:
            assert opt._m_key not in t.state[p]  # no codes taken for moments
    if Torch is torch.optim.AdamW:  # (torch's SGD starts a fresh momentum_buffer)
        with pytest.raises(KeyError):
            t.step()
