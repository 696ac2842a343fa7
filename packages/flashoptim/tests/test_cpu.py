"""The CPU path (``_cpu.cpu_step``, what ``backend="torch"`` runs) against the float64
reference: function level (stored state in, stored state out) and through every optimizer
and storage option."""

import pytest
import torch
from _checks import (
    OPT_IDS,
    OPTION_IDS,
    OPTIONS,
    OPTS,
    assert_matches_reference,
    assert_step_matches_reference,
    grad,
    group_of,
    shape_of,
    snapshot,
    state_view,
)

import flashoptim_fused as fo
from flashoptim_fused import _cpu, _plan
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
    ps = [
        (torch.randn(shape_of(n), generator=gen) * 0.1).bfloat16().requires_grad_()
        for n in (1, 33, 1000)
    ]
    opt = Opt(ps, lr=1e-2, backend="torch", **kw)
    for s in range(5):
        for p in ps:
            p.grad = grad("mixed" if s % 2 else "randn", p.numel(), p.dtype, gen).view(p.shape)
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
    ps = [
        (torch.randn(shape_of(n), generator=gen) * 0.1).to(dtype).requires_grad_() for n in (7, 300)
    ]
    opt = fo.FlashAdamW(ps, lr=1e-2, backend="torch", **okw)
    for s in range(4):
        for p in ps:
            p.grad = grad("mixed" if s % 2 else "randn", p.numel(), dtype, gen).view(p.shape)
        before = snapshot(opt, ps)
        opt.step()
        assert_matches_reference(opt, ps, before)


@pytest.mark.parametrize("Opt,kw", [OPTS[2], OPTS[5]], ids=["sgd", "sgdw_damp"])
def test_cpu_path_matches_float64_reference_at_gpu_sizes(Opt, kw):
    """The GPU tests' sizes, parameters and gradients (test_step_kernel ``_gpu_steps``: a
    1M-element tensor, mixed gradients up to 1e10 in the second step) on the CPU path: SGD
    updates of lr |m| ~ |old weight| cancel to a small new weight, whose fp32 rounding is
    at the old weight's magnitude (1.33 / 1.53 times a bound of |new weight| + lr; the H200
    run of 2026-12-02 failed the same way, SGD Nesterov too)."""
    torch.manual_seed(0)
    shapes = ((1025, 1024), (257, 48), (48,))  # test_step_kernel.GPU_SHAPES' first three
    ps = [(torch.randn(s) * 0.1).bfloat16().requires_grad_() for s in shapes]
    opt = Opt(ps, lr=1e-2, backend="torch", **kw)
    gen = torch.Generator().manual_seed(1)
    for s in range(2):
        for p in ps:
            p.grad = grad("mixed" if s == 1 else "randn", p.numel(), torch.bfloat16, gen).view(
                p.shape
            )
        before = snapshot(opt, ps)
        opt.step()
        assert_matches_reference(opt, ps, before)


def _fused_adam_step1(theta: float, g: float, wd: float, lr: float) -> float:
    """The GPU kernel's first coupled-Adam step (b1 0.9, b2 0.999, eps 1e-8) on one element,
    fp32 with its fused multiply-adds (each formed exactly in float64, rounded once)."""
    f = lambda x: torch.as_tensor(x, dtype=torch.float64).float().double()  # noqa: E731
    gc = f(g + f(wd) * theta)  # fma(wd, theta, g)
    m = f(gc * f(0.1))
    v = f(f(f(0.001) * gc) * gc)
    denom = f(f(v.sqrt().float().double() * f(1 / 0.001**0.5)) + f(1e-8))
    return float(f(theta - f(lr / 0.1) * f(m * f(1 / denom))))


def test_reference_bound_takes_the_gpus_fused_coupled_decay():
    """Coupled Adam, first step, g = -wd theta exactly in bf16 (theta 0.302734375, g
    -0.0302734375, wd 0.1): float64's g + wd theta is 0 and so is the update; the CPU
    path's rounded product cancels to 0 as well, but the GPU's fma(fp32(0.1), theta, g)
    keeps 4.5e-10 and the eps-dominated update is lr * 0.043, 39 times the fp32-rounding
    bound alone (the H200 run of 2026-12-02). The check's Adam term (_checks
    ``_update_rounding``) takes it; a weight off by lr / 2 there still fails."""
    gen = torch.Generator().manual_seed(5)
    p = (torch.randn(33, generator=gen) * 0.1).bfloat16()
    g = torch.randn(33, generator=gen).bfloat16()
    p[0], g[0] = 0.302734375, -0.0302734375
    p.requires_grad_()
    opt = fo.FlashAdam([p], lr=1e-2, weight_decay=0.1, backend="torch")
    p.grad = g
    before = snapshot(opt, [p])
    opt.step()
    assert_matches_reference(opt, [p], before)  # the CPU path: update 0 at element 0
    hp = opt._hp(group_of(opt, p), p)
    seed, (p0, st0) = opt.state[p]["seed"], before[0]
    th_gpu = _fused_adam_step1(0.302734375, -0.0302734375, 0.1, 1e-2)
    assert 0.04 < (0.302734375 - th_gpu) / 1e-2 < 0.05
    for th1, ok in ((th_gpu, True), (0.302734375 - 5e-3, False)):
        u = R.uniform_ref(seed, 1, torch.tensor([0]))
        pn, c = R.split_ref(torch.tensor([th1], dtype=torch.float32), torch.bfloat16, 8, u)
        p1, st1 = p.detach().clone(), {k: v.clone() for k, v in state_view(opt, p).items()}
        p1[0], st1["c"][0] = pn[0], c[0]
        args = (opt._kind, hp, 1, seed, p0, g, st0, p1, st1)
        if ok:
            assert_step_matches_reference(*args, ties=True)
        else:
            with pytest.raises(AssertionError):
                assert_step_matches_reference(*args, ties=True)


def test_cpu_path_rounding_stream_base_matches_reference(monkeypatch):
    """A sharded tensor's rounding stream starts at its global index: the reference draws
    from there too (the check took index 0, and every stochastically rounded code moved:
    the H200 run of 2026-12-02, test_gpu_rounding_stream_base_not_a_multiple_of_8)."""
    monkeypatch.setattr(_plan, "global_index_base", lambda p: 12345 + p.numel())
    gen = torch.Generator().manual_seed(6)
    ps = [
        (torch.randn(shape_of(n), generator=gen) * 0.1).bfloat16().requires_grad_()
        for n in (33, 2049)
    ]
    opt = fo.FlashAdamW(ps, lr=1e-2, backend="torch")
    for s in range(2):
        for p in ps:
            p.grad = grad("mixed" if s else "randn", p.numel(), torch.bfloat16, gen).view(p.shape)
        before = snapshot(opt, ps)
        opt.step()
        assert_matches_reference(opt, ps, before)
