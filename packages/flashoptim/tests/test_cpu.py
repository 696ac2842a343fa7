"""The CPU path (``_cpu.cpu_step``, what ``backend="torch"`` runs) against the float64
reference: function level (stored state in, stored state out) and through every optimizer
and storage option."""

import pytest
import torch
from _checks import OPT_IDS, OPTION_IDS, OPTIONS, OPTS, assert_matches_reference, grad, snapshot

import flashoptim_fused as fo
from flashoptim_fused import _cpu
from flashoptim_fused import reference as R
from flashoptim_fused.reference import ADAM, LION, SGD


def _hp(kind, **kw):
    hp = dict(
        ecc=8,
        quant=True,
        sr=True,
        scale_dtype=torch.bfloat16,
        lr=1e-2,
        wd=0.01,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        decoupled=True,
        dampening=0.0,
        nesterov=False,
    )
    if kind == LION:
        hp.update(b2=0.99, lr=1e-3)
    hp.update(kw)
    return hp


def _state(kind, p, hp):
    n = p.numel()
    ng = (n + 31) // 32
    st = {}
    if hp["quant"]:
        st["m"], st["ms"] = (
            torch.zeros(n, dtype=torch.int8),
            torch.zeros(ng, dtype=hp["scale_dtype"]),
        )
        if kind == ADAM:
            st["v"] = torch.zeros(n, dtype=torch.uint8)
            st["vs"] = torch.zeros(ng, dtype=hp["scale_dtype"])
    else:
        st["m"] = torch.zeros(n)
        if kind == ADAM:
            st["v"] = torch.zeros(n)
    if hp["ecc"] and p.dtype != torch.float32:
        st["c"] = torch.zeros(n, dtype=torch.int8 if hp["ecc"] == 8 else torch.int16)
    return st


@pytest.mark.parametrize("kind", [ADAM, SGD, LION])
@pytest.mark.parametrize("n", [1, 33, 1000])
@pytest.mark.parametrize("ecc", [8, 16])
def test_cpu_path_matches_float64_reference(kind, n, ecc):
    """Per step: feed the same stored state to the fp32 CPU path and the float64 reference;
    codes agree within one (ties), weights within a correction code."""
    torch.manual_seed(n + kind)
    hp = _hp(kind, ecc=ecc, b1=0.9 if kind != SGD else 0.9)
    p = torch.randn(n).to(torch.bfloat16)
    st = _state(kind, p, hp)
    for step in range(1, 6):
        g = torch.randn(n)
        ref_p, ref_st = R.step_ref(kind, p, g, {k: v.clone() for k, v in st.items()}, hp, step, 5)
        _cpu.cpu_step(kind, p, g, st, hp, step, 5)
        for k in ref_st:
            d = (ref_st[k].double() - st[k].double()).abs()
            if k in ("ms", "vs"):
                assert torch.allclose(ref_st[k].double(), st[k].double(), rtol=2e-2), k
            elif k == "c":
                th_ref = R.join_ref(ref_p, ref_st["c"], ecc)
                th = R.join_ref(p, st["c"], ecc)
                q = torch.maximum(R.ulp_ref(p), R.ulp_ref(ref_p)) / 2.0**ecc
                tol = 2 * q + 2.0**-21 * (th.abs() + hp["lr"])  # fp32 rounding of th and update
                assert ((th_ref - th).abs() <= tol).all()
            else:
                assert d.max() <= 1, (k, d.max())


@pytest.mark.parametrize("Opt,kw", OPTS, ids=OPT_IDS)
def test_cpu_path_optimizers_match_float64_reference(Opt, kw):
    """Every step of every optimizer on the CPU path against ``step_ref``, odd sizes, randn
    and mixed-magnitude gradients."""
    gen = torch.Generator().manual_seed(3)
    ps = [(torch.randn(n, generator=gen) * 0.1).bfloat16().requires_grad_() for n in (1, 33, 1000)]
    opt = Opt(ps, lr=1e-2, backend="torch", **kw)
    for s in range(5):
        for p in ps:
            p.grad = grad("mixed" if s % 2 else "randn", p.numel(), p.dtype, gen)
        before = snapshot(opt, ps)
        opt.step()
        assert_matches_reference(opt, ps, before)


@pytest.mark.parametrize(
    "dtype,okw",
    [(torch.bfloat16, o) for o in OPTIONS] + [(torch.float16, {}), (torch.float32, {})],
    ids=OPTION_IDS + ["fp16", "fp32"],
)
def test_cpu_path_options_match_float64_reference(dtype, okw):
    gen = torch.Generator().manual_seed(4)
    ps = [(torch.randn(n, generator=gen) * 0.1).to(dtype).requires_grad_() for n in (7, 300)]
    opt = fo.FlashAdamW(ps, lr=1e-2, backend="torch", **okw)
    for s in range(4):
        for p in ps:
            p.grad = grad("mixed" if s % 2 else "randn", p.numel(), dtype, gen)
        before = snapshot(opt, ps)
        opt.step()
        assert_matches_reference(opt, ps, before)
