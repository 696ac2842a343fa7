"""Kernel v4 (v3's element math over 8,192-element chunks, L2 prefetch on the GPU, an
epoch-marked persistent non-finite flag).

Under the interpreter (``ASM=False``: no prefetch, no inline PTX) v4 must equal v3 bit for
bit: same tile arithmetic, other indexing (chunks, a dynamic tile count per chunk). Sizes
cross v4's chunk boundary (8,192) and v3's unit boundary (2,048). The finiteness checks
place inf/NaN at the first and last element, on both sides of a chunk boundary and on both
sides of a tensor boundary of the multi-tensor launch, and check that an old epoch left in
the flag does not skip a later finite step.
"""

import pytest
import torch

# the interpreter flag, markers, device and the bitwise pair helpers are test_v3's (its pair
# defaults to v2 vs v3; here v3 vs v4)
from test_v3 import DEV, STORAGE_OPTIONS, _assert_bitwise, needs_interp, needs_kernel
from test_v3 import _pair as _pair_v3

import flashoptim as fo
from flashoptim import _core

U = _core.V4_UNIT


def _pair(Opt, kw, sizes, dtype, kinds, steps=3, kernels=("v3", "v4"), **okw):
    return _pair_v3(Opt, kw, sizes, dtype, kinds, steps, kernels, **okw)


OPTS = [
    (fo.FlashAdamW, dict(weight_decay=0.1)),
    (fo.FlashAdam, dict(weight_decay=0.1, eps=0.0)),
    (fo.FlashSGD, dict(momentum=0.9, nesterov=True)),
    (fo.FlashLion, dict(weight_decay=0.1)),
]


@needs_interp
@pytest.mark.parametrize("Opt,kw", OPTS)
@pytest.mark.parametrize("kinds", [("randn",), ("subnormal", "huge", "mixed")])
def test_v4_equals_v3_bitwise(Opt, kw, kinds):
    """Odd sizes, one past a chunk (U + 1: a one-element second chunk), a tensor of exactly
    one chunk, a one-element tensor after it (tensor boundary inside the launch)."""
    out = _pair(Opt, kw, (1, 33, U + 1, 2049, U, 1), torch.bfloat16, kinds)
    _assert_bitwise(out)


@needs_interp
@pytest.mark.parametrize(
    "okw",
    STORAGE_OPTIONS,
)
def test_v4_equals_v3_bitwise_options(okw):
    out = _pair(fo.FlashAdamW, {}, (7, 300, 2 * U + 33), torch.bfloat16, ("mixed",), **okw)
    _assert_bitwise(out)


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_v4_equals_v3_bitwise_other_dtypes(dtype):
    out = _pair(fo.FlashAdamW, {}, (5, U + 100), dtype, ("randn", "mixed"), steps=2)
    _assert_bitwise(out)


@needs_interp
def test_v4_matches_float64_reference():
    """One AdamW step of v4 against ``step_ref`` (float64 of the same quantized algorithm):
    weights within one correction code of the reference's rounding (fp32 vs float64
    arithmetic), state codes within one."""
    torch.manual_seed(1)
    n = U + 37
    p = (torch.randn(n) * 0.1).bfloat16().requires_grad_()
    opt = fo.FlashAdamW([p], lr=1e-2, backend="triton", kernel="v4", weight_decay=0.1)
    p.grad = torch.randn(n).bfloat16()
    st0 = {"c": torch.zeros(n, dtype=torch.int8)}
    st0["m"] = torch.zeros(n, dtype=torch.int8)
    st0["ms"] = torch.zeros((n + 31) // 32, dtype=torch.bfloat16)
    st0["v"] = torch.zeros(n, dtype=torch.uint8)
    st0["vs"] = torch.zeros((n + 31) // 32, dtype=torch.bfloat16)
    p0 = p.detach().clone()
    opt.step()
    hp = dict(opt._hp(opt.param_groups[0], p))
    pn, new = _core.step_ref(_core.ADAM, p0, p.grad, st0, hp, 1, opt.state[p]["seed"], idx_base=0)
    mk = _core.join_ref(p.detach(), opt.state[p]["correction"], 8)
    mr = _core.join_ref(pn, new["c"], 8)
    # one code of the coarser of the two weights' binades, plus the kernel's fp32 rounding
    # of the update at the old weight's magnitude (AdamW's first step moves a weight by
    # ~lr: where it nearly cancels, an fp32 ulp of the old weight is many codes)
    q = torch.maximum(_core._ulp_ref(pn), _core._ulp_ref(p.detach())) / 2.0**8
    tol = 1.01 * q + 4 * 2.0**-24 * p0.double().abs()
    assert ((mk - mr).abs() <= q * 1.01).float().mean() > 0.999
    assert ((mk - mr).abs() <= tol).all()
    for k, key in (("m", "exp_avg"), ("v", "exp_avg_sq")):
        d = (opt.state[p][key].int() - new[k].int()).abs()
        assert d.max() <= 1 and (d > 0).float().mean() < 0.01, k


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_v4_prepass_finds_every_nonfinite(dtype, value):
    """One bad element anywhere skips the step (first / last element, both sides of a chunk
    boundary, both sides of a tensor boundary); the largest finite values do not; a finite
    step after a skipped one runs (the flag still holds the old epoch)."""
    sizes = (1, 33, U + 5)
    ps = [torch.randn(n, device=DEV).to(dtype).requires_grad_() for n in sizes]
    opt = fo.FlashAdamW(ps, backend="triton", kernel="v4")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    big = torch.finfo(dtype).max
    for p in ps:
        p.grad[0] = big
        p.grad[-1] = -big
    opt.step()
    assert opt.skipped_steps == 0 and opt.state[ps[0]]["step"] == 2
    places = [(0, 0), (1, 0), (1, 32), (2, 0), (2, U - 1), (2, U), (2, U + 4)]
    for t, i in places:
        snap = [p.detach().clone() for p in ps]
        st = [opt.state[p]["exp_avg"].clone() for p in ps]
        old = ps[t].grad[i].item()
        ps[t].grad[i] = value
        opt.step()
        ps[t].grad[i] = old
        assert opt.skipped_steps == 1, (t, i)
        assert all(torch.equal(a, p) for a, p in zip(snap, ps))
        assert all(torch.equal(a, opt.state[p]["exp_avg"]) for a, p in zip(st, ps))
        assert opt.state[ps[0]]["step"] == 2
        opt.skipped_steps = 0
    snap = [p.detach().clone() for p in ps]
    opt.step()  # finite again: the stale epoch in the flag must not skip it
    assert opt.skipped_steps == 0 and opt.state[ps[0]]["step"] == 3
    assert not all(torch.equal(a, p) for a, p in zip(snap, ps))


@needs_kernel
def test_v4_epoch_wraps(monkeypatch):
    """At the epoch limit the flags are cleared and the epoch restarts at 1: a bad step
    right after the wrap is still skipped and the next finite one runs."""
    ps = [torch.randn(n, device=DEV).bfloat16().requires_grad_() for n in (40, 2100)]
    opt = fo.FlashAdamW(ps, backend="triton", kernel="v4")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    opt._epoch = 2**31 - 2
    ps[1].grad[7] = float("nan")
    opt.step()
    assert opt.skipped_steps == 1 and opt._epoch == 1
    ps[1].grad[7] = 0.0
    opt.step()
    assert opt.skipped_steps == 1 and opt.state[ps[0]]["step"] == 3


@needs_kernel
def test_v4_raise_mode_writes_nothing():
    ps = [torch.randn(n, device=DEV).bfloat16().requires_grad_() for n in (40, U + 3)]
    opt = fo.FlashAdamW(ps, backend="triton", kernel="v4", on_nonfinite="raise")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    snap = [p.detach().clone() for p in ps]
    ps[1].grad[U + 2] = float("nan")
    with pytest.raises(fo.NonFiniteGradError):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(snap, ps))
    assert opt.state[ps[1]]["step"] == 2 and opt.skipped_steps == 0
    ps[1].grad[U + 2] = 0.0
    opt.step()
    assert opt.state[ps[1]]["step"] == 3


@needs_interp
@pytest.mark.parametrize("Opt,kw", OPTS)
def test_v4_deferred_skip_equals_v3(Opt, kw):
    """Six steps with check_finite=True, NaN in the third and inf in the fifth (at a chunk
    boundary): v4 (epoch flag) and v3 (zeroed flag) skip the same steps and stay bit for bit
    equal, step counts and bias corrections included."""
    gen = torch.Generator().manual_seed(3)
    sizes = (31, U + 1, 4100)
    ps = [(torch.randn(n, generator=gen) * 0.1).bfloat16() for n in sizes]
    runs = []
    for kernel in ("v3", "v4"):
        qs = [p.clone().requires_grad_() for p in ps]
        runs.append((Opt(qs, lr=1e-2, backend="triton", kernel=kernel, **kw), qs))
    skipped = 0
    for s in range(6):
        gs = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
        if s == 2:
            gs[2][4099] = float("nan")
        if s == 4:
            gs[1][U] = float("inf")
        skipped += s in (2, 4)
        for opt, qs in runs:
            for q, g in zip(qs, gs):
                q.grad = g.clone()
            opt.step()
        assert runs[0][0].skipped_steps == runs[1][0].skipped_steps == skipped
        _assert_bitwise(runs)
        steps = [[o.state[q]["step"] for q in qs] for o, qs in runs]
        assert steps[0] == steps[1] == [s + 1 - skipped] * len(sizes)


@needs_interp
def test_v4_every_tuning_config_equals_v3(monkeypatch):
    """Each of v4's autotuning configs run through triton.autotune with the snapshot hooks
    under the interpreter (PF has no effect there: no inline PTX): the step applied once,
    bit for bit v3's."""
    import triton

    from flashoptim import optimizers as fopt

    for cfg in _core._v4_configs():
        calls = []

        def bench(fn, quantiles, calls=calls):
            fn()
            calls.append(1)
            return [float(len(calls))] * 3

        tuned = triton.autotune(
            [cfg, cfg],
            key=_core._TUNE_KEY,
            pre_hook=_core._tune_pre_hook,
            post_hook=_core._tune_post_hook,
            do_bench=bench,
        )(_core._step_kernel_v4)
        monkeypatch.setattr(_core, "_step_kernel_v4_tuned", tuned)
        monkeypatch.setattr(fopt, "_v2_autotune", lambda dev: True)
        monkeypatch.setattr(fopt, "_num_sms", lambda dev: 1)
        # v3 runs its default config (the autotune switch is on for both: give v3 the same
        # hook-driven tuner over its default)
        ref = triton.autotune(
            [triton.Config(dict(_core.V2_DEFAULT), num_warps=_core.V2_DEFAULT_WARPS)] * 2,
            key=_core._TUNE_KEY,
            pre_hook=_core._tune_pre_hook,
            post_hook=_core._tune_post_hook,
            do_bench=bench,
        )(_core._step_kernel_v3)
        monkeypatch.setattr(_core, "_step_kernel_v3_tuned", ref)
        out = _pair(fo.FlashAdamW, {}, (33, U + 7), torch.bfloat16, ("mixed", "randn"), steps=2)
        _assert_bitwise(out)


@pytest.mark.gpu
def test_gpu_v4_vs_v3_one_step(monkeypatch):
    """GPU (inline PTX, L2 prefetch at the default PF 2): three steps of v4 with the
    previous tile math (``_lean = False``, no explicit-fma pinning) and v3 on 1M + odd
    elements and whole chunks, checked each step. Same tile code, so the results are
    bitwise equal (every tuning config, PF 0/1/4 included, runs in
    test_gpu_v2_autotune_applies_the_step_once[v4] against the CPU path). The lean math,
    v4's default, is compared bit for bit with this one in test_lean.py (H200, 2026-12-01
    evening: the lean default against v3 differed in FlashAdam's and Nesterov SGD's
    corrections, where the pinned fma order of the lean math is not the one LLVM chose)."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    torch.manual_seed(0)
    sizes = (1_000_003, 4097, 31, 3 * U)
    for Opt, kw in OPTS:
        ps = [torch.randn(n, device="cuda").bfloat16() for n in sizes]
        outs = []
        for kernel in ("v3", "v4"):
            qs = [p.clone().requires_grad_() for p in ps]
            opt = Opt(qs, lr=1e-3, kernel=kernel, **kw)
            opt._lean, opt._lean_parts = False, 0  # v4's previous math (v3 ignores both)
            outs.append((opt, qs))
        for _s in range(3):
            gs = [torch.randn(n, device="cuda").bfloat16() for n in sizes]
            for opt, qs in outs:
                for q, g in zip(qs, gs):
                    q.grad = g.clone()
                opt.step()
            _assert_bitwise(outs)


@needs_interp
@pytest.mark.parametrize("Opt,kw", OPTS[:1] + OPTS[2:3])
def test_v4_lazy_skip_equals_v3(Opt, kw):
    """Lazy skip (``_lazy_skip``: no host sync per step, the flag read at the next step):
    same skipped steps, same bits and, once resolved, the same step counts as v3; a NaN in
    two consecutive steps and in the last step (resolved by ``skipped_steps`` and by
    ``state_dict``)."""
    gen = torch.Generator().manual_seed(5)
    sizes = (31, U + 1)
    ps = [(torch.randn(n, generator=gen) * 0.1).bfloat16() for n in sizes]
    runs = []
    for kernel in ("v3", "v4"):
        qs = [p.clone().requires_grad_() for p in ps]
        opt = Opt(qs, lr=1e-2, backend="triton", kernel=kernel, **kw)
        opt._lazy_skip = kernel == "v4"
        runs.append((opt, qs))
    bad = (2, 3, 5)
    for s in range(6):
        gs = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
        if s in bad:
            gs[s % 2][0 if s != 5 else -1] = float("nan")
        for opt, qs in runs:
            for q, g in zip(qs, gs):
                q.grad = g.clone()
            opt.step()
        _assert_bitwise(runs)
    v4, qs4 = runs[1]
    assert v4._pending is not None  # the last step's flag is not read yet
    sd = v4.state_dict()  # resolves it
    assert v4._pending is None and sd["flashoptim"]["skipped_steps"] == 3
    assert runs[0][0].skipped_steps == v4.skipped_steps == 3
    for (o, q3), q4 in zip([(runs[0][0], q) for q in runs[0][1]], qs4):
        assert o.state[q3]["step"] == v4.state[q4]["step"] == 3
    # and the step after a resolved skip is the 4th
    for q3, g in zip(runs[0][1], [torch.randn(n, generator=gen).bfloat16() for n in sizes]):
        q3.grad = g
    for q3, q4 in zip(runs[0][1], qs4):
        q4.grad = q3.grad.clone()
    for opt, _ in runs:
        opt.step()
    _assert_bitwise(runs)
    assert v4.skipped_steps == 3 and v4.state[qs4[0]]["step"] == 4


@pytest.mark.gpu
def test_gpu_v4_lazy_skip(monkeypatch):
    """GPU path of the lazy skip (pinned copy + event): NaN in steps 2 and 3, v4 lazy and
    v3 stay bitwise equal, with the same skipped steps and step counts once read."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    torch.manual_seed(0)
    sizes = (100_003, U)
    ps = [torch.randn(n, device="cuda").bfloat16() for n in sizes]
    runs = []
    for kernel in ("v3", "v4"):
        qs = [p.clone().requires_grad_() for p in ps]
        opt = fo.FlashAdamW(qs, lr=1e-3, kernel=kernel)
        opt._lazy_skip = kernel == "v4"
        runs.append((opt, qs))
    for s in range(6):
        gs = [torch.randn(n, device="cuda").bfloat16() for n in sizes]
        if s in (2, 3):
            gs[s % 2][-1] = float("nan")
        for opt, qs in runs:
            for q, g in zip(qs, gs):
                q.grad = g.clone()
            opt.step()
        _assert_bitwise(runs)
    (a, qa), (b, qb) = runs
    assert a.skipped_steps == b.skipped_steps == 2
    assert a.state[qa[0]]["step"] == b.state[qb[0]]["step"] == 4
