"""Buckets, offset tables and cached plans (``_plan.py``): one launch covers many tensors;
a cached plan (reused across steps, gradient pointers checked in one pass, the gradient
column rebased over whole lists, step counts advanced after the launches) steps exactly
like an optimizer that rebuilds every table each step (``_plans.clear()``: the uncached
path); 2,050 tensors on the GPU against the CPU path."""

import pytest
import torch
from _checks import DEV, INTERP, assert_bitwise, needs_kernel, shape_of

import flashoptim_fused as fo
from flashoptim_fused import _plan

# bf16 buckets interleaved with an fp32 one, single rows (_checks.shape_of): rows of 64 (the
# flat grid), rows of 33 and 1000 (one table entry per row, numel % 16 != 0), rows of 48
# (per row, % 16 == 0), fp32 rows of 100: a plan of four buckets whose parameters are not
# contiguous runs of the group
SPECS = [(64, torch.bfloat16), (33, torch.bfloat16), (100, torch.float32), (1000, torch.bfloat16)]
SPECS += [(48, torch.bfloat16)]


def _params(gen):
    return [(torch.randn(shape_of(n), generator=gen) * 0.1).to(dt).to(DEV) for n, dt in SPECS]


def _count_builds(monkeypatch, params) -> list:
    """A list that gets one entry per offset table built for a bucket of ``params``."""
    builds = []
    build = _plan.build_table

    def spy(ps, *rest, **kw):
        if any(ps[0] is p for p in params):
            builds.append(1)
        return build(ps, *rest, **kw)

    monkeypatch.setattr(_plan, "build_table", spy)
    return builds


def _pair(ps, **kw):
    out = []
    for _ in range(2):
        qs = [p.clone().requires_grad_() for p in ps]
        out.append((fo.FlashAdamW(qs, lr=1e-2, weight_decay=0.1, backend="triton", **kw), qs))
    return out


def _grads(gen, nan=False):
    gs = [torch.randn(shape_of(n), generator=gen).to(dt).to(DEV) for n, dt in SPECS]
    if nan:
        gs[3].view(-1)[-1] = float("nan")
    return gs


def _assert_equal(a, pa, b, pb, steps=True):
    """Bitwise parameters and states; ``steps``: also the host step counts (a pending lazy
    flag leaves them one too high until it is read)."""
    for p, q in zip(pa, pb, strict=True):
        assert torch.equal(p, q)
        assert a.state[p].keys() == b.state[q].keys()
        for k, v in a.state[p].items():
            w = b.state[q][k]
            if torch.is_tensor(v):
                assert torch.equal(v, w), k
            elif steps or k != "step":
                assert v == w, k


@needs_kernel
@pytest.mark.parametrize("mode", ["inplace", "fresh", "set_to_none", "one_without_grad"])
def test_cached_plan_equals_rebuilt_tables(monkeypatch, mode):
    """Same gradient tensors updated in place, fresh tensors every step (kept alive so the
    addresses change), ``zero_grad(set_to_none=True)`` then new tensors, and a parameter
    without a gradient in one step: bitwise the uncached path, with the tables built once
    where the parameters with gradients do not change (a parameter that missed a step has
    another step count than the rest: no cached plan, every table built each step)."""
    gen = torch.Generator().manual_seed(0)
    (a, pa), (b, pb) = _pair(_params(gen))
    builds = _count_builds(monkeypatch, pa)
    keep = []
    for s in range(5):
        gs = _grads(gen)
        for opt, qs in ((a, pa), (b, pb)):
            if mode == "set_to_none":
                opt.zero_grad(set_to_none=True)
            for i, (q, g) in enumerate(zip(qs, gs)):
                if mode == "one_without_grad" and s == 2 and i == 1:
                    q.grad = None
                elif mode == "inplace" and q.grad is not None:
                    q.grad.copy_(g)
                else:
                    q.grad = g.clone()
                    keep.append(q.grad)
        b._plans.clear()
        a.step()
        b.step()
        _assert_equal(a, pa, b, pb)
    if mode != "one_without_grad":  # (then the step counts differ: no plan, by design)
        assert len(builds) == len(a._plans[id(a.param_groups[0])]["buckets"]) == 4


@needs_kernel
def test_cached_plan_with_a_new_param_group():
    gen = torch.Generator().manual_seed(1)
    (a, pa), (b, pb) = _pair(_params(gen))
    extra = [(torch.randn(n, generator=gen) * 0.1).bfloat16().to(DEV) for n in (16, 7)]
    for s in range(4):
        if s == 2:
            for opt, qs in ((a, pa), (b, pb)):
                new = [e.clone().requires_grad_() for e in extra]
                opt.add_param_group(dict(params=new, lr=3e-3))
                qs += new
        gs = _grads(gen) + [torch.randn(e.shape, generator=gen).bfloat16() for e in extra]
        for qs in (pa, pb):
            for q, g in zip(qs, gs):
                q.grad = g.to(DEV).clone()
        b._plans.clear()
        a.step()
        b.step()
        _assert_equal(a, pa, b, pb)
    assert len(a._plans) == 2


@needs_kernel
def test_cached_plan_across_load_state_dict():
    """A state dict round trip mid-run (plans dropped, rebuilt from the loaded counts) and
    a fresh optimizer loading it: both continue exactly like the uncached path."""
    gen = torch.Generator().manual_seed(2)
    (a, pa), (b, pb) = _pair(_params(gen))
    c = pc = None
    for s in range(5):
        if s == 2:
            a.load_state_dict(a.state_dict())
            pc = [q.detach().clone().requires_grad_() for q in pa]
            c = fo.FlashAdamW(pc, lr=1e-2, weight_decay=0.1, backend="triton")
            c.load_state_dict(a.state_dict())
        gs = _grads(gen)
        for qs in [pa, pb] + ([pc] if pc else []):
            for q, g in zip(qs, gs):
                q.grad = g.clone()
        b._plans.clear()
        for opt in (a, b, c):
            if opt is not None:
                opt.step()
        _assert_equal(a, pa, b, pb)
        if c is not None:
            _assert_equal(a, pa, c, pc)
    assert a.state[pa[0]]["step"] == c.state[pc[0]]["step"] == 5


@needs_kernel
def test_rebase_declines_a_non_contiguous_gradient():
    """A cached plan never rebases a gradient it cannot address (here: transposed); the
    rebuild copies it into the parameter's layout, and the step equals one with the same
    values contiguous."""
    ps = [torch.randn(8, 16, device=DEV).bfloat16().requires_grad_() for _ in range(2)]
    ps[1].data.copy_(ps[0])
    a, b = (fo.FlashAdamW([p], backend="triton") for p in ps)
    g0 = torch.randn(8, 16, device=DEV).bfloat16()
    g1 = torch.randn(16, 8, device=DEV).bfloat16().t()
    for opt, p in ((a, ps[0]), (b, ps[1])):
        p.grad = g0.clone()
        opt.step()
    ps[0].grad = g1
    ps[1].grad = g1.contiguous()
    a.step()
    b.step()
    assert ps[0].grad.is_contiguous()
    _assert_equal(a, ps[:1], b, ps[1:])


@needs_kernel
def test_many_tensors_one_launch():
    """200 tensors of odd sizes: one table per bucket (1-D fp32-state tensors of numel % 16
    == 0 or not, 8-bit matrices with rows of a multiple of 32: three launches per step)
    covers all of them; bitwise the CPU path."""
    shapes = [(1 + (i * 37) % 97,) if i % 2 else (1 + i % 3, 32 * (1 + i % 5)) for i in range(200)]
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
    qa = [p.clone().requires_grad_() for p in ps]
    qb = [p.clone().to(DEV).requires_grad_() for p in ps]
    a = fo.FlashAdamW(qa, lr=1e-2, backend="torch")
    b = fo.FlashAdamW(qb, lr=1e-2, backend="triton")
    for _ in range(2):
        for p, q in zip(qa, qb):
            g = torch.randn(p.shape, generator=gen).bfloat16()
            p.grad, q.grad = g, g.to(DEV)
        a.step()
        b.step()
    if INTERP:
        assert_bitwise(a, qa, b, qb)
    (plan,) = b._plans.values()
    assert sum(bk["ent"]["tab"].shape[0] for bk in plan["buckets"]) == 200 and plan["step"] == 2
    assert len(plan["buckets"]) == 3


@needs_kernel
def test_fresh_gradient_storage_reuses_the_plan(monkeypatch):
    """FSDP2 and zero_grad(set_to_none=True) hand out new .grad storage every step. The
    cached plan rewrites only its gradient column (no rebuild) and steps exactly like an
    optimizer that rebuilds every table, also when a gradient lands on an unaligned address
    (which turns the vectorized path off for that bucket) and back."""
    dev = DEV
    sizes = [64, 4096, 48, 1024]  # as single rows: flat grid, and rows of 48 (per-row entries)
    torch.manual_seed(1)
    ps = [torch.randn(shape_of(n), device=dev).bfloat16().requires_grad_() for n in sizes]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    a = fo.FlashAdamW(ps, lr=1e-2, weight_decay=0.1, backend="triton")
    b = fo.FlashAdamW(qs, lr=1e-2, weight_decay=0.1, backend="triton")
    builds = _count_builds(monkeypatch, ps)
    for step, shift in enumerate([0, 16, 1, 0, 40]):  # element shifts; 1 = unaligned
        buf = torch.randn(sum(sizes) + 16 * len(sizes) + 64, device=dev).bfloat16()
        off = shift
        order = list(range(len(ps)))[:: 1 if step % 2 == 0 else -1]  # offsets move around
        for i in order:
            p, q = ps[i], qs[i]
            p.grad = buf[off : off + p.numel()].view(p.shape)  # one flat buffer, like FSDP2's
            q.grad = p.grad.clone()
            off += p.numel() + 16 * (step % 3)
        a.step()
        b._plans.clear()  # the reference rebuilds every table
        b.step()
        aligned = [bk["ent"]["aligned"] for bk in next(iter(a._plans.values()))["buckets"]]
        assert all(aligned) == (shift % 8 == 0), (step, aligned)
    assert len(builds) == len(a._plans[id(a.param_groups[0])]["buckets"])  # built once
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
        for k, v in a.state[p].items():
            if torch.is_tensor(v):
                assert torch.equal(v, b.state[q][k]), k


@needs_kernel
@pytest.mark.parametrize("first", [torch.float32, torch.bfloat16])
def test_mixed_dtype_group_cached_plan(first):
    """One group with fp32 and bf16 parameters and static gradients (the cached-plan fast
    path from step 2): each bucket's mode (correction bits) follows its own dtype, as with
    one group per parameter. Regression: the fast path took the first parameter's."""
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


@pytest.mark.gpu
def test_gpu_many_small_tensors_repeated_steps_match_cpu_path(monkeypatch):
    """2,050 tensors, 5 steps through the cached launch plan, kernel vs CPU path: after each
    step the codes agree within ties (the default config: autotuning is tested in
    test_step_kernel.py). Ties are compared per step: the CPU copy is then reset to the
    kernel's state, since a tie taken differently changes the next step's inputs."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    sizes = [(128, 384)] * 20 + [(4096,)] * 20 + [(3, 5)] * 2010
    torch.manual_seed(0)
    ps = [torch.randn(s).bfloat16().cuda().requires_grad_() for s in sizes]
    qs = [p.detach().cpu().clone().requires_grad_() for p in ps]
    a = fo.FlashAdamW(ps, lr=1e-3)
    b = fo.FlashAdamW(qs, lr=1e-3)
    bad = total = far = 0
    for _s in range(5):
        for p, q in zip(ps, qs):
            g = torch.randn(p.shape).bfloat16()
            p.grad, q.grad = g.cuda(), g
        a.step()
        b.step()
        for p, q in zip(ps, qs):
            for k in ("exp_avg", "exp_avg_sq"):
                if k not in a.state[p]:  # 8-bit codes (rows of 384; the rest keep fp32)
                    k += "_codes"
                    d = (a.state[p][k].cpu().int() - b.state[q][k].int()).abs()
                    # an element's own tie (one code) plus a tie of its group's bf16 scale
                    assert d.max() <= 2
                    bad += int((d > 0).sum())
                    total += d.numel()
                else:
                    torch.testing.assert_close(
                        a.state[p][k].cpu(), b.state[q][k], rtol=1e-5, atol=0
                    )
            mw, mc = fo.master_weight(p, a).cpu(), fo.master_weight(q, b)
            far += int((~torch.isclose(mw, mc, rtol=2e-4, atol=1e-5)).sum())
            with torch.no_grad():  # the next step starts from the kernel's state
                q.copy_(p.cpu())
                for k, v in a.state[p].items():
                    if torch.is_tensor(v) and v.numel() > 0 and k != "step":
                        b.state[q][k].copy_(v.cpu())
    assert a.state[ps[0]]["step"] == b.state[qs[0]]["step"] == 5
    assert bad / total < 0.01
    assert far / total < 0.001
