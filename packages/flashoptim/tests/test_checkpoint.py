"""Checkpoints: bit-exact resume, compact state dicts, torch.optim checkpoints, fp32 export."""

import io

import pytest
import torch

import flashoptim as fo


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
    p_t, p_f = next(iter(m_t.parameters())), next(iter(m_f.parameters()))
    assert o_f.state[p_f]["exp_avg"].dtype == torch.int8
    assert o_f.state[p_f]["step"] == 5
    from flashoptim import _core

    m = _core.dequantize_momentum_ref(
        o_f.state[p_f]["exp_avg"].view(-1), o_f.state[p_f]["exp_avg_scale"]
    ).view(p_t.shape)
    ref = o_t.state[p_t]["exp_avg"].double()
    assert (m - ref).abs().max() <= ref.abs().max() / 60  # within the companded resolution
    # continuing from the loaded state tracks torch
    _train(m_t, o_t, range(5, 10))
    _train(m_f, o_f, range(5, 10))
    for a, b in zip(m_t.parameters(), m_f.parameters()):
        torch.testing.assert_close(a, b, rtol=0.05, atol=2e-3)


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
