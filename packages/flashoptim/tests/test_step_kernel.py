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
    _few,
    assert_bitwise,
    assert_matches_reference,
    assert_step_matches_reference,
    assert_ties,
    copy_state,
    grad,
    needs_interp,
    needs_kernel,
    shape_of,
    snapshot,
)

import flashoptim_fused as fo
from flashoptim_fused import _config, _plan, reference
from flashoptim_fused import _prepass_kernel as PK
from flashoptim_fused import _step_kernel as K

CHUNK = K.CHUNK
SIZES = (1, 31, 33, 2049, CHUNK + 1, CHUNK, 1)  # tensor boundaries inside chunks and tiles
# subnormal bf16 gradients are tested on the GPU only: the interpreter converts bf16
# subnormals to fp32 wrongly (1.01e-39 -> 4.41e-39), the kernel is not to blame there
EDGE = [("randn",), ("zero", "randn"), ("huge", "mixed")]
EDGE_IDS = ["randn", "zero", "huge_mixed"]


def _pair(Opt, kw, sizes, dtype, kinds, steps=3, dev=DEV, bad=None, **okw):
    """The CPU path and the kernel, same parameters and gradients, ``steps`` steps; ``bad``:
    {step: (tensor, index, value)} puts a non-finite gradient element there."""
    gen = torch.Generator().manual_seed(0)
    ps = [(torch.randn(shape_of(n), generator=gen) * 0.1).to(dtype) for n in sizes]
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
                q.grad = g.to(q.device).clone().view(q.shape)
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
        (torch.randn(shape_of(n), generator=gen) * 0.1).bfloat16().to(DEV).requires_grad_()
        for n in (33, 2049, CHUNK + 5)
    ]
    opt = Opt(ps, lr=1e-2, backend="triton", **kw)
    for s in range(4):
        for p in ps:
            g = grad("randn" if s % 2 else "mixed", p.numel(), p.dtype, gen)
            p.grad = g.to(DEV).view(p.shape)
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
        (torch.randn(shape_of(n), generator=gen) * 0.1).to(dtype).to(DEV).requires_grad_()
        for n in (7, 300, CHUNK + 33)
    ]
    opt = fo.FlashAdamW(ps, lr=1e-2, backend="triton", check_finite=False, **okw)
    for s in range(3):
        for p in ps:
            g = grad("mixed" if s == 1 else "randn", p.numel(), dtype, gen)
            p.grad = g.to(DEV).view(p.shape)
        before = snapshot(opt, ps)
        opt.step()
        assert_matches_reference(opt, ps, before, ties=not INTERP)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prepass_finds_every_nonfinite(dtype):
    _prepass_finds_every_nonfinite(dtype, DEV)


def _prepass_finds_every_nonfinite(dtype, dev):
    """One inf, -inf or NaN anywhere skips the step (first / last element, both sides of a
    chunk boundary, both sides of a tensor boundary of the multi-tensor launch) and writes
    nothing; the largest finite values do not; a finite step after a skipped one runs (the
    device flag still holds the old step's epoch)."""
    sizes = (1, 33, CHUNK + 5)
    ps = [torch.randn(shape_of(n), device=dev).to(dtype).requires_grad_() for n in sizes]
    opt = fo.FlashAdamW(ps, backend="triton")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    big = torch.finfo(dtype).max
    for p in ps:
        p.grad.view(-1)[0] = big
        p.grad.view(-1)[-1] = -big
    opt.step()
    assert opt.skipped_steps == 0 and opt.state[ps[0]]["step"] == 2
    places = [(0, 0), (1, 0), (1, 32), (2, 0), (2, CHUNK - 1), (2, CHUNK), (2, CHUNK + 4)]
    for value in (float("inf"), float("-inf"), float("nan")):
        for t, i in places:
            snap = [p.detach().clone() for p in ps]
            st = [_tensors(opt.state[p]) for p in ps]
            old = ps[t].grad.view(-1)[i].item()
            ps[t].grad.view(-1)[i] = value
            opt.step()
            ps[t].grad.view(-1)[i] = old
            assert opt.skipped_steps == 1, (value, t, i)
            assert all(torch.equal(a, p) for a, p in zip(snap, ps))
            for a, p in zip(st, ps):  # codes, scales, fp32 states, corrections
                assert all(torch.equal(v, opt.state[p][k]) for k, v in a.items())
            assert opt.state[ps[0]]["step"] == 2
            opt.skipped_steps = 0
    snap = [p.detach().clone() for p in ps]
    opt.step()
    assert opt.skipped_steps == 0 and opt.state[ps[0]]["step"] == 3
    assert not all(torch.equal(a, p) for a, p in zip(snap, ps))


def _tensors(st: dict) -> dict:
    return {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}


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
    ps = [torch.randn(shape_of(n), device=DEV).bfloat16() for n in (40, CHUNK + 3)]
    ps = [p.requires_grad_() for p in ps]
    opt = fo.FlashAdamW(ps, backend="triton", on_nonfinite="raise")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    snap = [p.detach().clone() for p in ps]
    st = [_tensors(opt.state[p]) for p in ps]
    ps[1].grad.view(-1)[CHUNK + 2] = float("nan")
    with pytest.raises(fo.NonFiniteGradError):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(snap, ps))
    for a, p in zip(st, ps):
        assert all(torch.equal(v, opt.state[p][k]) for k, v in a.items())
    assert opt.state[ps[1]]["step"] == 2 and opt.skipped_steps == 0
    ps[1].grad.view(-1)[CHUNK + 2] = 0.0
    opt.step()
    assert opt.state[ps[1]]["step"] == 3


@needs_interp
@pytest.mark.parametrize("base", [5, 8 * 12345, 2**32 - 8, 2**32 - 3])
def test_rounding_stream_index_bases(monkeypatch, base):
    """Sharded tensors' rounding streams start at their global index (``global_index_base``,
    also used by the CPU path): a base that is a multiple of 8 takes the hoisted draw, one
    that is not the plain one; both equal the CPU path bit for bit, wrapping mod 2**32."""
    monkeypatch.setattr(_plan, "global_index_base", lambda p: base + p.numel())
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
        u = K._draw(K._hash(off, ib.to(tl.uint32), key.to(tl.uint32), HOIST))
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
    )(K._step_kernel)


@needs_interp
def test_autotune_applies_the_step_once(monkeypatch):
    """Autotuning runs the in-place kernel many times on the live bucket; the hooks must
    restore every tensor of the bucket (three tensors, two of them not the base tensors the
    kernel takes as arguments), so the tuned step is applied once: bitwise the CPU path."""
    calls = []
    monkeypatch.setattr(K, "_step_kernel_tuned", _counting_tuner(_config.triton_configs(), calls))
    monkeypatch.setattr(_config, "autotune", lambda dev: True)
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
    monkeypatch.setattr(_config, "autotune", lambda dev: True)
    for cfg in _config.triton_configs():
        calls = []
        monkeypatch.setattr(K, "_step_kernel_tuned", _counting_tuner([cfg, cfg], calls))
        (a, pa), (b, pb) = _pair(
            fo.FlashAdamW, {}, (33, CHUNK + 7), torch.bfloat16, ("mixed", "randn"), 2
        )
        assert_bitwise(a, pa, b, pb)
        assert calls


def _int32_offsets_of_last_chunk(n: int, block: int) -> list:
    """Every index value the kernel's int32 path forms for the last chunk of a tensor of
    ``n`` elements (chunk base, its end, tile starts, the prefetch start, the last offset of
    the last tile and the group count), in exact Python integers."""
    ch = K.CHUNK
    lu = (n - 1) // ch
    base = lu * ch
    nt = (min(n - base, ch) + block - 1) // block
    vals = [base, base + ch, min(n, base + ch), n + 31]
    for s in range(nt):
        start = base + s * block
        vals += [start, start + block, start + block - 1]
    sub = PK.PREPASS_SUB
    vals += [base + (ch // sub - 1) * sub + sub - 1]  # the pre-pass's last offset
    return vals


def test_int32_offsets_cover_the_limit():
    """The largest numel the int32 path serves forms no index of 2**31 or more (so no
    wrap); one element more takes the int64 path (``INDEX64``); a GPU test runs a tensor of
    2**31 + 4,097 elements through it."""
    lim = _plan.INT32_NUMEL_LIMIT
    for block, _pf, _w in _config.CONFIGS:
        assert max(_int32_offsets_of_last_chunk(lim, block)) < 2**31
        assert max(_int32_offsets_of_last_chunk(2**31 + 4097, block)) >= 2**31
    assert not _plan.needs_index64([1, lim]) and _plan.needs_index64([1, lim + 1])


@needs_interp
@pytest.mark.parametrize("Opt,kw", [OPTS[0], OPTS[3], OPTS[6]], ids=["adamw", "nesterov", "lion"])
def test_index64_equals_cpu_path(monkeypatch, Opt, kw):
    """The int64 indexing (forced here for small tensors) computes the same steps: bitwise
    the CPU path, the pre-pass included (a NaN in the second step)."""
    monkeypatch.setattr(_plan, "INT32_NUMEL_LIMIT", 0)
    bad = {1: (1, CHUNK + 2, float("nan"))}
    (a, pa), (b, pb) = _pair(Opt, kw, (33, CHUNK + 5), torch.bfloat16, ("randn",), 3, bad=bad)
    ents = [bk["ent"] for bk in next(iter(b._plans.values()))["buckets"]]
    assert all(e["index64"] for e in ents)
    assert a.skipped_steps == b.skipped_steps == 1
    assert_bitwise(a, pa, b, pb)


# ----------------------------------------------------------------------------- GPU
#
# The GPU suite is compile-bound: every distinct mode (optimizer, options, numel % 16 == 0
# or not, finiteness check on or off, ...) is one more compile. The tests share modes where
# they can: GPU_SHAPES' rows are all multiples of 16 (the usual case: vectorized buckets),
# the odd sizes run in the edge-gradient, pre-pass, unaligned and 2**31 tests. Their three
# buckets: rows of a multiple of 32 (the flat grid of 32), rows of 48 (one table entry per
# row, groups of 32 and 16: grid.py), a 1-D tensor (fp32 states).

GPU_SHAPES = ((1025, 1024), (257, 48), (48,), (3, CHUNK))


def _gpu_steps(Opt, kw, shapes, steps=3, dev="cuda", **okw):
    """Kernel on CUDA vs the CPU path, one step at a time from identical inputs (ties) and
    against the float64 reference; the CPU side then takes the kernel's state."""
    torch.manual_seed(0)
    dtype = okw.pop("dtype", torch.bfloat16)
    ps = [(torch.randn(s) * 0.1).to(dtype) for s in shapes]
    qa = [p.clone().requires_grad_() for p in ps]
    qb = [p.clone().to(dev).requires_grad_() for p in ps]
    a = Opt(qa, lr=1e-2, backend="torch", **kw, **okw)
    b = Opt(qb, lr=1e-2, backend="triton", **kw, **okw)
    gen = torch.Generator().manual_seed(1)
    for s in range(steps):
        for p, q in zip(qa, qb):
            g = grad("mixed" if s == 1 else "randn", p.numel(), dtype, gen).view(p.shape)
            p.grad, q.grad = g.clone(), g.to(dev)
        before = snapshot(b, qb)
        a.step()
        b.step()
        assert_ties(b, qb, a, qa)
        assert_matches_reference(b, qb, before, ties=True)
        copy_state(b, qb, a, qa)


@needs_interp
@pytest.mark.parametrize("Opt,kw", [OPTS[0], OPTS[3], OPTS[6]], ids=["adamw", "nesterov", "lion"])
def test_gpu_steps_helper_on_the_interpreter(Opt, kw):
    """The GPU tests' helper on the CPU (small sizes, a mixed-gradient step): kernel vs CPU
    path (``assert_ties``), the float64 reference with ``ties=True``, ``copy_state``. The
    reference check copies its inputs to the CPU, so this is the code the GPU tests run
    (with CUDA inputs it mixed CUDA and CPU scales: by count the 16 failures of the H200
    run of 2026-12-02 01:45, whose tracebacks were not captured)."""
    _gpu_steps(Opt, kw, ((257, 16), (3, 48), (48,), (2, CHUNK // 2 + 16)), dev="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("Opt,kw", OPTS, ids=OPT_IDS)
def test_gpu_kernel_vs_cpu_path_and_reference(monkeypatch, Opt, kw):
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    _gpu_steps(Opt, kw, GPU_SHAPES)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "okw",
    OPTIONS + [dict(dtype=torch.float16), dict(dtype=torch.float32)],
    ids=OPTION_IDS + ["fp16", "fp32"],
)
def test_gpu_kernel_options(monkeypatch, okw):
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    _gpu_steps(fo.FlashAdamW, {}, GPU_SHAPES, check_finite=False, **dict(okw))


@pytest.mark.gpu
@pytest.mark.parametrize("Opt,kw", [OPTS[0], OPTS[3], OPTS[6]], ids=["adamw", "nesterov", "lion"])
def test_gpu_edge_gradients(monkeypatch, Opt, kw):
    """Zero, huge and mixed-magnitude gradients (1e-30 .. 1e10 in every group of 32) on the
    GPU against the CPU path, one step at a time."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    sizes = (100_003, CHUNK + 1, 33)
    torch.manual_seed(0)
    ps = [(torch.randn(shape_of(n)) * 0.1).bfloat16() for n in sizes]
    qa = [p.clone().requires_grad_() for p in ps]
    qb = [p.clone().cuda().requires_grad_() for p in ps]
    a = Opt(qa, lr=1e-2, backend="torch", check_finite=False, **kw)
    b = Opt(qb, lr=1e-2, backend="triton", check_finite=False, **kw)
    gen = torch.Generator().manual_seed(2)
    for kind in ("zero", "huge", "mixed", "huge"):
        for p, q in zip(qa, qb):
            g = grad(kind, p.numel(), torch.bfloat16, gen).view(p.shape)
            p.grad, q.grad = g.clone(), g.cuda()
        a.step()
        b.step()
        assert_ties(b, qb, a, qa)
        copy_state(b, qb, a, qa)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_prepass_finds_every_nonfinite(dtype):
    _prepass_finds_every_nonfinite(dtype, "cuda")


@pytest.mark.gpu
def test_gpu_autotune_applies_the_step_once(monkeypatch):
    """The real autotuner (both configs timed on the live bucket, every written tensor
    restored after): the first step is applied once, as the CPU path's."""
    monkeypatch.delenv("FLASHOPTIM_NO_AUTOTUNE", raising=False)
    n0 = len(K._step_kernel_tuned.cache)
    _gpu_steps(fo.FlashAdamW, {}, GPU_SHAPES, steps=2)
    assert len(K._step_kernel_tuned.cache) > n0  # it did tune
    print("autotuned config:", K._step_kernel_tuned.best_config)


@pytest.mark.gpu
def test_gpu_other_tuning_config(monkeypatch):
    """The other tuning config (8 warps) as the default config, against the CPU path."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    monkeypatch.setattr(_config, "DEFAULT_CONFIG", _config.CONFIGS[1])
    _gpu_steps(fo.FlashAdamW, {}, GPU_SHAPES, steps=2)
    _gpu_steps(fo.FlashSGD, dict(momentum=0.9, weight_decay=0.01), GPU_SHAPES, steps=2)


@pytest.mark.gpu
@pytest.mark.parametrize("Opt", [fo.FlashAdamW, fo.FlashLion], ids=["adamw", "lion"])
def test_gpu_unaligned_gradient_views(monkeypatch, Opt):
    """Gradients as views into one flat buffer at odd element offsets (the bucket's vector
    accesses and L2 prefetch off), against the CPU path."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    sizes = (64, 4096, 48, 1000)
    torch.manual_seed(1)
    ps = [torch.randn(shape_of(n)).bfloat16() for n in sizes]
    qa = [p.clone().requires_grad_() for p in ps]
    qb = [p.clone().cuda().requires_grad_() for p in ps]
    a = Opt(qa, lr=1e-2, weight_decay=0.1, backend="torch")
    b = Opt(qb, lr=1e-2, weight_decay=0.1, backend="triton")
    for _ in range(3):
        buf = torch.randn(sum(sizes) + 64).bfloat16()
        gbuf = buf.cuda()
        off = 1
        for p, q in zip(qa, qb):
            p.grad = buf[off : off + p.numel()].view(p.shape)
            q.grad = gbuf[off : off + q.numel()].view(q.shape)
            off += p.numel() + 3
        a.step()
        b.step()
        assert_ties(b, qb, a, qa)
        copy_state(b, qb, a, qa)
    assert not next(iter(b._plans.values()))["buckets"][0]["ent"]["aligned"]


@pytest.mark.gpu
def test_gpu_rounding_stream_base_not_a_multiple_of_8(monkeypatch):
    """A sharded tensor whose rounding stream starts at an odd index (the plain draw) on the
    GPU against the CPU path."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    monkeypatch.setattr(_plan, "global_index_base", lambda p: 12345 + p.numel())
    _gpu_steps(fo.FlashAdamW, {}, ((1, 100_003), (1, 33)), steps=2)


def _window(opt, p, a, b) -> tuple:
    """(parameter, gradient, stored state) of elements [a, b) of ``p`` (``a`` a multiple of
    32), copied to the CPU."""
    st = opt.state[p]
    g0, g1 = a // 32, (b + 31) // 32
    sv = dict(
        m=st["exp_avg_codes"].view(-1)[a:b],
        ms=st["exp_avg_scale"].view(-1)[g0:g1],
        v=st["exp_avg_sq_codes"].view(-1)[a:b],
        vs=st["exp_avg_sq_scale"].view(-1)[g0:g1],
        c=st["correction"].view(-1)[a:b],
    )
    grd = p.grad.view(-1)[a:b].cpu().clone() if p.grad is not None else None
    pw = p.detach().view(-1)[a:b].cpu().clone()
    return pw, grd, {k: v.cpu().clone() for k, v in sv.items()}


@pytest.mark.gpu
def test_gpu_tensor_of_2_31_elements(monkeypatch):
    """One tensor of 2**31 + 4,097 bf16 elements (~15 GB with its states): the int64
    indexing. Two steps and a skipped one (NaN past element 2**31); windows at the start,
    across element 2**31 and at the end against the CPU path (ties) and the float64
    reference, with the rounding stream's index base of each window."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    free, _ = torch.cuda.mem_get_info()
    if free < 20 * 2**30:
        pytest.skip(f"needs ~20 GiB free on the GPU, {free / 2**30:.1f} GiB free")
    _big_tensor_steps(2**31 + 4097, 2**31, "cuda")


def _big_tensor_steps(n: int, boundary: int, dev: str) -> None:
    """``test_gpu_tensor_of_2_31_elements`` for a tensor of ``n`` elements and a window
    across element ``boundary`` (a multiple of 8,192)."""
    from flashoptim_fused import _cpu

    torch.manual_seed(0)
    # one row of n (8-bit states: its grid of 32 is the flat one; a 1-D tensor keeps fp32)
    p = torch.nn.Parameter(torch.randn(1, n, device=dev, dtype=torch.bfloat16) * 0.1)
    opt = fo.FlashAdamW([p], lr=1e-2, weight_decay=0.1, backend="triton")
    windows = [(0, 4096), (boundary - 8192, boundary + 8192), (n - 4097 - 32 * 7, n)]
    for step in (1, 2):
        p.grad = torch.randn(1, n, device=dev, dtype=torch.bfloat16)
        if step == 1:  # the first step's zero states, as the step creates them
            opt._init_state(p, opt.param_groups[0])
        before = [_window(opt, p, a, b) for a, b in windows]
        opt.step()
        assert next(iter(opt._plans.values()))["buckets"][0]["ent"]["index64"]
        hp = opt._hp(opt.param_groups[0], p)
        seed = opt.state[p]["seed"]
        for (a, b), (p0, g, st0) in zip(windows, before):
            p1, _, st1 = _window(opt, p, a, b)
            assert_step_matches_reference(
                reference.ADAM, hp, step, seed, p0, g, st0, p1, st1, a, ties=True
            )
            cp, cst = p0.clone(), {k: v.clone() for k, v in st0.items()}
            _cpu.cpu_step(reference.ADAM, cp, g, cst, hp, step, seed, a)
            for k in ("m", "v"):
                d = (cst[k].int() - st1[k].int()).abs()
                assert d.max() <= 2 and _few(d > 0, 0.02), (a, k)
            for k in ("ms", "vs"):
                assert torch.allclose(cst[k].double(), st1[k].double(), rtol=2e-2), (a, k)
            ma, mb = reference.join_ref(cp, cst["c"], 8), reference.join_ref(p1, st1["c"], 8)
            assert _few(~torch.isclose(ma, mb, rtol=1e-4, atol=1e-5), 0.01), a
    p.grad.view(-1)[boundary + 5] = float("nan")
    snap = _window(opt, p, *windows[1])
    opt.step()
    assert opt.skipped_steps == 1 and opt.state[p]["step"] == 2
    after = _window(opt, p, *windows[1])
    assert torch.equal(snap[0], after[0])
    assert all(torch.equal(snap[2][k], after[2][k]) for k in snap[2])


BACKENDS = ["torch", pytest.param("triton", marks=needs_kernel)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_finite_gradient_keeps_weights_finite(backend):
    """A finite gradient element of 2e19 made ``g * g`` overflow, the variance scale inf and
    the weight NaN on the next step (torch AdamW stays finite); now ``((1 - b2) g) g`` is
    finite up to ~1.8e20 and sqrt(v) is capped at the largest bf16, so beyond that v decodes
    as inf and the update is 0. Weights match torch AdamW (fp32) while its v is finite."""
    dev = DEV if backend == "triton" else "cpu"
    for big in (2e19, 1e20, 1e30, 3.4e38):
        # one row of 40: 8-bit states, groups of 32 and 8 (a 1-D tensor keeps fp32 states)
        p0 = torch.randn(1, 40, generator=torch.Generator().manual_seed(0))
        p = p0.clone().to(dev).requires_grad_()
        r = p0.clone().requires_grad_()
        opt = fo.FlashAdamW([p], lr=1e-2, backend=backend)
        ref = torch.optim.AdamW([r], lr=1e-2, foreach=False)
        for s in range(4):
            g = torch.randn(1, 40, generator=torch.Generator().manual_seed(s + 1))
            g[0, 3] = big
            p.grad, r.grad = g.to(dev), g.clone()
            opt.step()
            ref.step()
            w = fo.master_weight(p, opt).cpu()
            assert torch.isfinite(w).all(), (big, s)
            assert opt.skipped_steps == 0
        if big <= 1e20:  # torch's v finite: the huge element and the other group of 32 follow
            # torch within a few 8-bit codes (the rest of its own group sits at codes ~0 of the
            # outlier's scale, as group quantization does)
            d = (w - r.detach()).abs().view(-1)
            assert d[3] < 2e-3 and d[32:].max() < 2e-3, big


@pytest.mark.parametrize("backend", BACKENDS)
def test_subnormal_momenta_quantize(backend):
    """Gradients ~1e-39 give subnormal momenta: the group scale's reciprocal overflowed and
    the codes were garbage on both paths; now the scale is at least 2**-126 and the decoded
    momentum is within 2% of the group's largest value, plus one code of the smallest scale
    (2**-126 / 254, below which momenta lose precision), of the float64 one (fp32 gradients:
    the interpreter converts bf16 subnormals wrongly, that variant is a GPU test)."""
    _check_subnormal_momenta(backend, DEV if backend == "triton" else "cpu", torch.float32)


@pytest.mark.gpu
def test_gpu_subnormal_bf16_momenta_quantize():
    """The same with bf16 parameters and subnormal bf16 gradients on the CUDA kernel."""
    _check_subnormal_momenta("triton", "cuda", torch.bfloat16)


def _check_subnormal_momenta(backend, dev, dtype):
    for Opt, kw in [(fo.FlashAdamW, {}), (fo.FlashSGD, dict(momentum=0.9)), (fo.FlashLion, {})]:
        # one row of 100 (grid.py: rows of >= 32 are quantized; in one row its grid is the
        # flat one, groups 32, 32, 32, 4)
        p = torch.randn(1, 100, generator=torch.Generator().manual_seed(0)).to(dev, dtype)
        p.requires_grad_()
        g = torch.randn(100, generator=torch.Generator().manual_seed(1)) * 1e-39
        g[:32] *= 1e-4  # a group of the smallest subnormals
        g = g.to(dtype).float()  # the values the optimizer sees
        opt = Opt([p], lr=1e-2, backend=backend, **kw)
        p.grad = g.to(dev, dtype).view(1, 100)
        opt.step()
        st = opt.state[p]
        key = opt._m_key + "_codes"
        scale = st[opt._m_key + "_scale"].cpu().reshape(-1)
        got = reference.dequantize_momentum_ref(st[key].cpu().reshape(-1), scale)
        want = g.double() * (0.1 if Opt is fo.FlashAdamW else (1.0 if Opt is fo.FlashSGD else 0.01))
        for lo in range(0, 100, 32):
            a, b = got[lo : lo + 32], want[lo : lo + 32]
            assert (a - b).abs().max() <= 0.02 * b.abs().max() + 2.0**-126 / 254, (Opt.__name__, lo)


@pytest.mark.parametrize("backend", BACKENDS)
def test_momentum_beyond_bf16_range_stays_finite(backend):
    """A momentum group beyond the largest bf16 (3.39e38) had an inf scale (NaN decodes):
    it now codes 0 with the largest bf16 as its scale; the weights stay finite."""
    dev = DEV if backend == "triton" else "cpu"
    p = torch.zeros(2, 32, device=dev, requires_grad=True)  # rows of 32: quantized
    opt = fo.FlashSGD([p], lr=1e-3, momentum=0.9, backend=backend)
    for _ in range(2):
        p.grad = torch.full((2, 32), 3.4e38, device=dev)
        opt.step()
        assert torch.isfinite(p.detach()).all()
        st = opt.state[p]
        assert torch.isfinite(st["momentum_buffer_scale"].float()).all()
