"""Kernel v3 (v2's indexing, cheaper element math, device-flag finiteness check).

Under the interpreter v3 computes with ``ASM=False`` (tl.floor, exact division, integer bf16
rounding) and must equal v2 bit for bit, also on edge-case gradients (zero, subnormal, huge,
mixed magnitudes within a group) and on every storage option. On the GPU (``ASM=True``:
rcp.approx, add.rm, cvt.rn.bf16) the contract is v2's against the CPU path: codes within
one at ties (test_kernels.py ``[v3]`` cases and the gpu test below). Non-finite values that
reach the tile (only with check_finite=False) give other garbage codes than v2's (v2's clamp
maps a NaN momentum to -127, v3's add.rm bits to 0): not compared.
"""

import os

import pytest
import torch

import flashoptim as fo

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_interp = pytest.mark.skipif(not INTERP, reason="interpreter bitwise check")
needs_kernel = pytest.mark.skipif(
    not INTERP and not torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 or CUDA"
)
DEV = "cpu" if INTERP else "cuda"


def _grad(kind, n, dtype, gen):
    g = torch.randn(n, generator=gen)
    if kind == "zero":
        g = torch.zeros(n)
    elif kind == "subnormal":
        g = g * 1e-39  # bf16/fp32 subnormals (fp16: zero)
    elif kind == "huge":  # finite in the gradient's dtype (non-finite: see the pre-pass)
        g = g * (1e30 if dtype != torch.float16 else 1e4)
    elif kind == "mixed":  # magnitudes from 1e-30 to 1e10 (fp16: 1e4) in every group of 32
        top = 10 if dtype != torch.float16 else 4
        g = g * torch.logspace(-30, top, n)[torch.randperm(n, generator=gen)]
        g[::7] = 0.0
    return g.to(dtype)


def _pair(Opt, kw, sizes, dtype, kinds, steps=3, kernels=("v2", "v3"), **okw):
    gen = torch.Generator().manual_seed(0)
    ps = [(torch.randn(n, generator=gen) * 0.1).to(dtype).to(DEV) for n in sizes]
    out = []
    for kernel in kernels:
        qs = [p.clone().requires_grad_() for p in ps]
        opt = Opt(qs, lr=1e-2, backend="triton", kernel=kernel, check_finite=False, **kw, **okw)
        out.append((opt, qs))
    for s in range(steps):
        grads = [
            _grad(kinds[(s + i) % len(kinds)], n, dtype, gen).to(DEV) for i, n in enumerate(sizes)
        ]
        for opt, qs in out:
            for q, g in zip(qs, grads):
                q.grad = g.clone()
            opt.step()
    return out


def _assert_bitwise(out):
    (a, pa), (b, pb) = out
    for p, q in zip(pa, pb):
        assert torch.equal(
            p.view(torch.int8 if p.dtype != torch.float32 else torch.int32),
            q.view(torch.int8 if q.dtype != torch.float32 else torch.int32),
        )
        for k, v in a.state[p].items():
            if torch.is_tensor(v):
                w = b.state[q][k]
                if v.is_floating_point():  # NaN-safe bit comparison
                    v, w = v.view(torch.int8), w.view(torch.int8)
                assert torch.equal(v, w), k


OPTS = [
    (fo.FlashAdamW, dict(weight_decay=0.1)),
    (fo.FlashAdam, dict(weight_decay=0.1, eps=0.0)),
    (fo.FlashSGD, dict(momentum=0.9, nesterov=True)),
    (fo.FlashLion, dict(weight_decay=0.1)),
]


# the storage options every kernel version is compared under (besides the defaults)
STORAGE_OPTIONS = [
    dict(stochastic_rounding=False),
    dict(master_weight_bits=32),
    dict(master_weight_bits=None),
    dict(quantize=False),
    dict(scale_dtype=torch.float32),
]


@needs_interp
@pytest.mark.parametrize("Opt,kw", OPTS)
@pytest.mark.parametrize("kinds", [("randn",), ("zero", "randn"), ("subnormal", "huge", "mixed")])
def test_v3_equals_v2_bitwise_edge_cases(Opt, kw, kinds):
    out = _pair(Opt, kw, (1, 31, 33, 2049, 4100), torch.bfloat16, kinds)
    _assert_bitwise(out)


@needs_interp
@pytest.mark.parametrize(
    "okw",
    STORAGE_OPTIONS,
)
def test_v3_equals_v2_bitwise_options(okw):
    out = _pair(fo.FlashAdamW, {}, (7, 300, 2048), torch.bfloat16, ("mixed", "randn"), **okw)
    _assert_bitwise(out)


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_v3_equals_v2_bitwise_other_dtypes(dtype):
    out = _pair(fo.FlashAdamW, {}, (5, 200, 2100), dtype, ("randn", "mixed"))
    _assert_bitwise(out)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_v3_prepass_finds_every_nonfinite(dtype, value):
    """The packed exponent-field pre-pass: one bad element anywhere (first, last of an odd
    size, inside the second unit) skips the step; the largest finite values do not."""
    sizes = (1, 33, 4100)
    ps = [torch.randn(n, device=DEV).to(dtype).requires_grad_() for n in sizes]
    opt = fo.FlashAdamW(ps, backend="triton", kernel="v3")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    big = torch.finfo(dtype).max
    for p in ps:
        p.grad[0] = big
        p.grad[-1] = -big
    opt.step()
    assert opt.skipped_steps == 0 and opt.state[ps[0]]["step"] == 2
    for t, i in [(0, 0), (1, 32), (2, 0), (2, 2047), (2, 2048), (2, 4099)]:
        snap = [p.detach().clone() for p in ps]
        st = [opt.state[p]["exp_avg"].clone() for p in ps]
        old = ps[t].grad[i].item()
        ps[t].grad[i] = value
        opt.step()
        ps[t].grad[i] = old
        assert opt.skipped_steps == 1, (t, i)
        assert all(torch.equal(a, p) for a, p in zip(snap, ps))
        assert all(torch.equal(a, opt.state[p]["exp_avg"]) for a, p in zip(st, ps))
        assert opt.state[ps[0]]["step"] == 2  # the deferred check took the count back
        opt.skipped_steps = 0


@needs_kernel
def test_v3_raise_mode_writes_nothing():
    ps = [torch.randn(n, device=DEV).bfloat16().requires_grad_() for n in (40, 2100)]
    opt = fo.FlashAdamW(ps, backend="triton", kernel="v3", on_nonfinite="raise")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    snap = [p.detach().clone() for p in ps]
    ps[1].grad[2099] = float("nan")
    with pytest.raises(fo.NonFiniteGradError):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(snap, ps))
    assert opt.state[ps[1]]["step"] == 2 and opt.skipped_steps == 0
    ps[1].grad[2099] = 0.0
    opt.step()
    assert opt.state[ps[1]]["step"] == 3


@pytest.mark.gpu
def test_gpu_v3_vs_v2_one_step(monkeypatch):
    """GPU, ASM path: one step of v3 and v2 from identical states on 1M + odd elements.
    Weights: within one correction code; state codes: within one at ties, rarely."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    torch.manual_seed(0)
    sizes = (1_000_003, 4097, 31)
    for Opt, kw in OPTS:
        ps = [torch.randn(n, device="cuda").bfloat16() for n in sizes]
        outs = []
        for kernel in ("v2", "v3"):
            qs = [p.clone().requires_grad_() for p in ps]
            opt = Opt(qs, lr=1e-3, kernel=kernel, **kw)
            outs.append((opt, qs))
        for s in range(3):
            gs = [torch.randn(n, device="cuda").bfloat16() for n in sizes]
            for opt, qs in outs:
                for q, g in zip(qs, gs):
                    q.grad = g.clone()
                opt.step()
            (a, pa), (b, pb) = outs
            for p, q in zip(pa, pb):
                ma, mb = fo.master_weight(p, a), fo.master_weight(q, b)
                n = ma.numel()
                far = (~torch.isclose(ma, mb, rtol=1e-4, atol=1e-5)).sum().item()
                assert far <= max(2, 0.01 * n), (Opt.__name__, s, far)  # Lion: sign(c ~ 0)
                for k, v in a.state[p].items():
                    if not torch.is_tensor(v) or v.is_floating_point():
                        continue
                    d = (v.int() - b.state[q][k].int()).abs()
                    lim = 2 if k != "correction" else 3
                    nd = (d > 0).sum().item()
                    assert d.max() <= lim and nd <= max(2, 0.02 * n), (Opt.__name__, k, nd)
                # the next step starts from identical states again
                with torch.no_grad():
                    q.copy_(p)
                    for k, v in a.state[p].items():
                        if torch.is_tensor(v):
                            b.state[q][k].copy_(v)


@needs_interp
def test_v3_every_tuning_config_equals_v2(monkeypatch):
    """Each of v3's autotuning configs (BLOCK 1024/2048, persistent or one unit per
    program), run through triton.autotune with the snapshot hooks under the interpreter:
    the step applied once, bit for bit v2's (each config tuned alone, so it also runs the
    real steps)."""
    import triton

    from flashoptim import _core
    from flashoptim import optimizers as fopt

    cfgs = _core._v3_configs()
    for cfg in cfgs:
        calls = []

        def bench(fn, quantiles, calls=calls):
            fn()
            calls.append(1)
            return [float(len(calls))] * 3

        tuned = triton.autotune(
            [cfg, cfg],  # two entries: a single config skips the (hooked) benchmark path
            key=_core._TUNE_KEY,
            pre_hook=_core._tune_pre_hook,
            post_hook=_core._tune_post_hook,
            do_bench=bench,
        )(_core._step_kernel_v3)
        monkeypatch.setattr(_core, "_step_kernel_v3_tuned", tuned)
        ref = triton.autotune(  # the v2 reference (also "autotuned" here): its default config
            [triton.Config(dict(_core.V2_DEFAULT), num_warps=_core.V2_DEFAULT_WARPS)] * 2,
            key=_core._TUNE_KEY,
            pre_hook=_core._tune_pre_hook,
            post_hook=_core._tune_post_hook,
            do_bench=bench,
        )(_core._step_kernel_v2)
        monkeypatch.setattr(_core, "_step_kernel_v2_tuned", ref)
        monkeypatch.setattr(fopt, "_v2_autotune", lambda dev: True)
        monkeypatch.setattr(fopt, "_num_sms", lambda dev: 1)  # persistent: 1 SM x WAVES
        out = _pair(fo.FlashAdamW, {}, (33, 2049, 4100), torch.bfloat16, ("mixed", "randn"))
        _assert_bitwise(out)


@needs_interp
@pytest.mark.parametrize("Opt,kw", OPTS)
def test_v3_deferred_skip_equals_v2(Opt, kw):
    """Five steps with check_finite=True, the third one with a NaN: v3 (device flag read by
    the step kernels, step counts taken back on the host) and v2 (host sync before the step)
    skip the same step and then stay bit for bit equal, bias corrections included."""
    gen = torch.Generator().manual_seed(3)
    sizes = (31, 2049, 4100)
    ps = [(torch.randn(n, generator=gen) * 0.1).bfloat16() for n in sizes]
    runs = []
    for kernel in ("v2", "v3"):
        qs = [p.clone().requires_grad_() for p in ps]
        runs.append((Opt(qs, lr=1e-2, backend="triton", kernel=kernel, **kw), qs))
    for s in range(5):
        gs = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
        if s == 2:
            gs[1][2048] = float("nan")
        for opt, qs in runs:
            for q, g in zip(qs, gs):
                q.grad = g.clone()
            opt.step()
        assert runs[0][0].skipped_steps == runs[1][0].skipped_steps == (1 if s >= 2 else 0)
        _assert_bitwise(runs)
        steps = [[o.state[q]["step"] for q in qs] for o, qs in runs]
        assert steps[0] == steps[1] == [s + (0 if s >= 2 else 1)] * len(sizes)
