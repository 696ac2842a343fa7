"""The step kernel (``_step_kernel.py``: Triton, under the interpreter on CPU, compiled on
CUDA) against the CPU path and the float64 reference.

Interpreter: bit for bit the CPU path (``backend="torch"``) for every optimizer, option and
parameter dtype, on odd sizes across tile (2,048) and chunk (8,192) boundaries, with zero,
huge, subnormal and mixed-magnitude gradients, skipped steps and rounding-stream bases; and
within the float64 reference's bounds (tests/_checks.py). GPU (``@pytest.mark.gpu``): the
same comparisons with the ties the GPU's approximate arithmetic moves, on 1M-element
tensors, a tensor of 2**31 + 4,097 elements (64-bit indexing), unaligned gradient views,
both tuning configs and the autotuner.
"""

import pytest
import torch
from _checks import (
    DEV,
    INTERP,
    OPT_IDS,
    OPTION_IDS,
    OPTIONS,
    OPTS,
    assert_bitwise,
    assert_matches_reference,
    assert_ties,
    copy_state,
    grad,
    needs_interp,
    needs_kernel,
    snapshot,
)

import flashoptim as fo
from flashoptim import _core as K
from flashoptim import optimizers as O
from flashoptim import reference

CHUNK = K.V4_UNIT
SIZES = (1, 31, 33, 2049, CHUNK + 1, CHUNK, 1)  # tensor boundaries inside chunks and tiles
# subnormal bf16 gradients are tested on the GPU only: the interpreter converts bf16
# subnormals to fp32 wrongly (1.01e-39 -> 4.41e-39), the kernel is not to blame there
EDGE = [("randn",), ("zero", "randn"), ("huge", "mixed")]
EDGE_IDS = ["randn", "zero", "huge_mixed"]


def _pair(Opt, kw, sizes, dtype, kinds, steps=3, dev=DEV, bad=None, **okw):
    """The CPU path and the kernel, same parameters and gradients, ``steps`` steps; ``bad``:
    {step: (tensor, index, value)} puts a non-finite gradient element there."""
    gen = torch.Generator().manual_seed(0)
    ps = [(torch.randn(n, generator=gen) * 0.1).to(dtype) for n in sizes]
    out = []
    for backend, d in (("torch", "cpu"), ("triton", dev)):
        qs = [p.clone().to(d).requires_grad_() for p in ps]
        out.append((Opt(qs, lr=1e-2, backend=backend, **kw, **okw), qs))
    for s in range(steps):
        gs = [grad(kinds[(s + i) % len(kinds)], n, dtype, gen) for i, n in enumerate(sizes)]
        if bad and s in bad:
            t, i, v = bad[s]
            gs[t][i] = v
        for opt, qs in out:
            for q, g in zip(qs, gs):
                q.grad = g.to(q.device).clone()
            opt.step()
    return out


@needs_interp
@pytest.mark.parametrize("Opt,kw", OPTS, ids=OPT_IDS)
@pytest.mark.parametrize("kinds", EDGE, ids=EDGE_IDS)
def test_kernel_equals_cpu_path(Opt, kw, kinds):
    (a, pa), (b, pb) = _pair(Opt, kw, SIZES, torch.bfloat16, kinds, check_finite=False)
    assert_bitwise(a, pa, b, pb)


@needs_interp
@pytest.mark.parametrize("okw", OPTIONS, ids=OPTION_IDS)
def test_kernel_equals_cpu_path_options(okw):
    (a, pa), (b, pb) = _pair(
        fo.FlashAdamW, {}, (7, 300, 2 * CHUNK + 33), torch.bfloat16, ("mixed", "randn"), **okw
    )
    assert_bitwise(a, pa, b, pb)


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("Opt,kw", [OPTS[0], OPTS[3], OPTS[6]], ids=["adamw", "nesterov", "lion"])
def test_kernel_equals_cpu_path_other_dtypes(dtype, Opt, kw):
    sizes = (5, CHUNK + 100)
    (a, pa), (b, pb) = _pair(Opt, kw, sizes, dtype, ("randn", "subnormal", "mixed"))
    assert_bitwise(a, pa, b, pb)


@needs_interp
@pytest.mark.parametrize(
    "Opt,kw", OPTS[:2] + OPTS[3:4] + OPTS[6:], ids=["adamw", "adam", "nesterov", "lion"]
)
def test_kernel_skips_like_cpu_path(Opt, kw):
    """Six checked steps, NaN in the third (last element of an odd size) and inf in the fifth
    (first element of a second chunk): the kernel's device flag (read after its step
    kernels, step counts taken back on the host) skips the same steps as the CPU path's
    host check, and both stay bit for bit equal, step counts and bias corrections included."""
    bad = {2: (2, 4099, float("nan")), 4: (1, CHUNK, float("inf"))}
    (a, pa), (b, pb) = _pair(Opt, kw, (31, CHUNK + 1, 4100), torch.bfloat16, ("randn",), 6, bad=bad)
    assert a.skipped_steps == b.skipped_steps == 2
    assert_bitwise(a, pa, b, pb)
    assert [b.state[q]["step"] for q in pb] == [4, 4, 4]


@needs_kernel
@pytest.mark.parametrize("Opt,kw", OPTS, ids=OPT_IDS)
def test_kernel_matches_float64_reference(Opt, kw):
    """Every step of the kernel against ``reference.step_ref`` from the same stored state."""
    gen = torch.Generator().manual_seed(7)
    ps = [
        (torch.randn(n, generator=gen) * 0.1).bfloat16().to(DEV).requires_grad_()
        for n in (33, 2049, CHUNK + 5)
    ]
    opt = Opt(ps, lr=1e-2, backend="triton", **kw)
    for s in range(4):
        for p in ps:
            p.grad = grad("randn" if s % 2 else "mixed", p.numel(), p.dtype, gen).to(DEV)
        before = snapshot(opt, ps)
        opt.step()
        assert_matches_reference(opt, ps, before, ties=not INTERP)


@needs_kernel
@pytest.mark.parametrize(
    "dtype,okw",
    [(torch.bfloat16, o) for o in OPTIONS] + [(torch.float16, {}), (torch.float32, {})],
    ids=OPTION_IDS + ["fp16", "fp32"],
)
def test_kernel_matches_float64_reference_options(dtype, okw):
    gen = torch.Generator().manual_seed(8)
    ps = [
        (torch.randn(n, generator=gen) * 0.1).to(dtype).to(DEV).requires_grad_()
        for n in (7, 300, CHUNK + 33)
    ]
    opt = fo.FlashAdamW(ps, lr=1e-2, backend="triton", check_finite=False, **okw)
    for s in range(3):
        for p in ps:
            p.grad = grad("mixed" if s == 1 else "randn", p.numel(), dtype, gen).to(DEV)
        before = snapshot(opt, ps)
        opt.step()
        assert_matches_reference(opt, ps, before, ties=not INTERP)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prepass_finds_every_nonfinite(dtype):
    """One inf, -inf or NaN anywhere skips the step (first / last element, both sides of a
    chunk boundary, both sides of a tensor boundary of the multi-tensor launch) and writes
    nothing; the largest finite values do not; a finite step after a skipped one runs (the
    device flag still holds the old step's epoch)."""
    sizes = (1, 33, CHUNK + 5)
    ps = [torch.randn(n, device=DEV).to(dtype).requires_grad_() for n in sizes]
    opt = fo.FlashAdamW(ps, backend="triton")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    big = torch.finfo(dtype).max
    for p in ps:
        p.grad[0] = big
        p.grad[-1] = -big
    opt.step()
    assert opt.skipped_steps == 0 and opt.state[ps[0]]["step"] == 2
    places = [(0, 0), (1, 0), (1, 32), (2, 0), (2, CHUNK - 1), (2, CHUNK), (2, CHUNK + 4)]
    for value in (float("inf"), float("-inf"), float("nan")):
        for t, i in places:
            snap = [p.detach().clone() for p in ps]
            st = [opt.state[p]["exp_avg"].clone() for p in ps]
            old = ps[t].grad[i].item()
            ps[t].grad[i] = value
            opt.step()
            ps[t].grad[i] = old
            assert opt.skipped_steps == 1, (value, t, i)
            assert all(torch.equal(a, p) for a, p in zip(snap, ps))
            assert all(torch.equal(a, opt.state[p]["exp_avg"]) for a, p in zip(st, ps))
            assert opt.state[ps[0]]["step"] == 2
            opt.skipped_steps = 0
    snap = [p.detach().clone() for p in ps]
    opt.step()
    assert opt.skipped_steps == 0 and opt.state[ps[0]]["step"] == 3
    assert not all(torch.equal(a, p) for a, p in zip(snap, ps))


@needs_kernel
def test_epoch_wraps():
    """At the epoch limit the flags are cleared and the epoch restarts at 1: a bad step
    right after the wrap is still skipped and the next finite one runs."""
    ps = [torch.randn(n, device=DEV).bfloat16().requires_grad_() for n in (40, 2100)]
    opt = fo.FlashAdamW(ps, backend="triton")
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
def test_raise_mode_writes_nothing():
    ps = [torch.randn(n, device=DEV).bfloat16().requires_grad_() for n in (40, CHUNK + 3)]
    opt = fo.FlashAdamW(ps, backend="triton", on_nonfinite="raise")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    snap = [p.detach().clone() for p in ps]
    ps[1].grad[CHUNK + 2] = float("nan")
    with pytest.raises(fo.NonFiniteGradError):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(snap, ps))
    assert opt.state[ps[1]]["step"] == 2 and opt.skipped_steps == 0
    ps[1].grad[CHUNK + 2] = 0.0
    opt.step()
    assert opt.state[ps[1]]["step"] == 3


@needs_interp
@pytest.mark.parametrize("base", [5, 8 * 12345, 2**32 - 8, 2**32 - 3])
def test_rounding_stream_index_bases(monkeypatch, base):
    """Sharded tensors' rounding streams start at their global index (``global_index_base``,
    also used by the CPU path): a base that is a multiple of 8 takes the hoisted draw, one
    that is not the plain one; both equal the CPU path bit for bit, wrapping mod 2**32."""
    monkeypatch.setattr(O, "_global_index_base", lambda p: base + p.numel())
    (a, pa), (b, pb) = _pair(fo.FlashAdamW, {}, (16, 48, 2064), torch.bfloat16, ("mixed",), 2)
    assert_bitwise(a, pa, b, pb)
    ents = [bk["ent"] for bk in next(iter(b._plans.values()))["buckets"]]
    assert all(e["ib8"] == (base % 8 == 0) for e in ents)


@needs_interp
@pytest.mark.parametrize("ib", [0, 8 * 977, 2**32 - 8, 3, 2**32 - 5])
def test_rounding_draw_equals_uniform_ref(ib):
    """The kernel's rounding draw (hoisted when ``ib`` is a multiple of 8) equals
    ``reference.uniform_ref`` bit for bit on 64K indices, across 2**16 boundaries of the
    index (where the first hash round's shift matters)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _k(out, ib, key, HOIST: tl.constexpr, BLOCK: tl.constexpr):
        off = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        u = K._draw_lean(off, ib.to(tl.uint32), key.to(tl.uint32), 2 if HOIST else 1)
        tl.store(out + off, u)

    n, seed, step = 1 << 16, 12345, 7
    out = torch.empty(n, dtype=torch.float32)
    key = reference.mix32_ref(torch.tensor([(seed + step * reference.GOLDEN) & reference.M32]))
    _k[(n // 4096,)](out, ib, key.item(), HOIST=ib % 8 == 0, BLOCK=4096)
    ref = reference.uniform_ref(seed, step, torch.arange(n, dtype=torch.int64) + ib)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


def _counting_tuner(configs, calls):
    """triton.autotune over ``configs`` with the package's snapshot hooks and a 'benchmark'
    that runs each config twice on the live bucket (so a missing restore shows)."""
    import triton

    def bench(fn, quantiles):
        fn()
        fn()
        calls.append(1)
        return [float(len(calls))] * 3

    return triton.autotune(
        configs,
        key=K._TUNE_KEY,
        pre_hook=K._tune_pre_hook,
        post_hook=K._tune_post_hook,
        do_bench=bench,
    )(K._step_kernel_v4)


@needs_interp
def test_autotune_applies_the_step_once(monkeypatch):
    """Autotuning runs the in-place kernel many times on the live bucket; the hooks must
    restore every tensor of the bucket (three tensors, two of them not the base tensors the
    kernel takes as arguments), so the tuned step is applied once: bitwise the CPU path."""
    calls = []
    monkeypatch.setattr(K, "_step_kernel_v4_tuned", _counting_tuner(K._v4_configs()[:2], calls))
    monkeypatch.setattr(O, "_v2_autotune", lambda dev: True)
    monkeypatch.setattr(O, "_num_sms", lambda dev: 1)
    (a, pa), (b, pb) = _pair(
        fo.FlashAdamW, {}, (33, 2500, CHUNK + 7), torch.bfloat16, ("randn",), 2, check_finite=False
    )
    assert_bitwise(a, pa, b, pb)
    assert len(calls) == 2  # tuned once (first step), both configs, cached for the second
    assert K._TUNE["snap"] is None and not K._TUNE["tensors"]


@needs_interp
def test_every_tuning_config_equals_cpu_path(monkeypatch):
    """Each autotuning config, tuned alone (so it also runs the real steps): bitwise the CPU
    path."""
    monkeypatch.setattr(O, "_v2_autotune", lambda dev: True)
    monkeypatch.setattr(O, "_num_sms", lambda dev: 1)
    for cfg in K._v4_configs()[:2]:
        calls = []
        monkeypatch.setattr(K, "_step_kernel_v4_tuned", _counting_tuner([cfg, cfg], calls))
        (a, pa), (b, pb) = _pair(
            fo.FlashAdamW, {}, (33, CHUNK + 7), torch.bfloat16, ("mixed", "randn"), 2
        )
        assert_bitwise(a, pa, b, pb)
        assert calls


# ----------------------------------------------------------------------------- GPU


def _gpu_steps(Opt, kw, sizes, steps=3, reference_check=True, **okw):
    """Kernel on CUDA vs the CPU path, one step at a time from identical inputs (ties) and
    against the float64 reference; the CPU side then takes the kernel's state."""
    torch.manual_seed(0)
    ps = [(torch.randn(n) * 0.1).bfloat16() for n in sizes] if "dtype" not in okw else None
    dtype = okw.pop("dtype", torch.bfloat16)
    if ps is None:
        ps = [(torch.randn(n) * 0.1).to(dtype) for n in sizes]
    qa = [p.clone().requires_grad_() for p in ps]
    qb = [p.clone().cuda().requires_grad_() for p in ps]
    a = Opt(qa, lr=1e-2, backend="torch", **kw, **okw)
    b = Opt(qb, lr=1e-2, **kw, **okw)
    gen = torch.Generator().manual_seed(1)
    for s in range(steps):
        for p, q in zip(qa, qb):
            g = grad("mixed" if s == 1 else "randn", p.numel(), dtype, gen)
            p.grad, q.grad = g.clone(), g.cuda()
        before = snapshot(b, qb)
        a.step()
        b.step()
        assert_ties(b, qb, a, qa)
        if reference_check:
            assert_matches_reference(b, qb, before, ties=True)
        copy_state(b, qb, a, qa)


@pytest.mark.gpu
@pytest.mark.parametrize("Opt,kw", OPTS, ids=OPT_IDS)
def test_gpu_kernel_vs_cpu_path_and_reference(monkeypatch, Opt, kw):
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    _gpu_steps(Opt, kw, (1_000_003, 4097, 31, 3 * CHUNK))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "okw",
    OPTIONS + [dict(dtype=torch.float16), dict(dtype=torch.float32)],
    ids=OPTION_IDS + ["fp16", "fp32"],
)
def test_gpu_kernel_options(monkeypatch, okw):
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    _gpu_steps(fo.FlashAdamW, {}, (100_003, 2 * CHUNK + 33, 7), check_finite=False, **dict(okw))
