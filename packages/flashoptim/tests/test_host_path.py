"""The cached host path of ``step()`` (plans reused across steps, gradient pointers checked
in one pass, the gradient column rebased over whole lists, step counts advanced after the
launches, a lazy flag read after the pre-pass launch) steps exactly like an optimizer that
rebuilds every table each step (``_plans.clear()``: the uncached path)."""

import os

import pytest
import torch

import flashoptim as fo

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernel = pytest.mark.skipif(
    not INTERP and not torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 or CUDA"
)
DEV = "cpu" if INTERP else "cuda"

# bf16 buckets (numel % 16 == 0 or not) interleaved with an fp32 one: a plan of three
# buckets whose parameters are not contiguous runs of the group
SPECS = [(64, torch.bfloat16), (33, torch.bfloat16), (100, torch.float32), (1000, torch.bfloat16)]
SPECS += [(48, torch.bfloat16)]


def _params(gen):
    return [(torch.randn(n, generator=gen) * 0.1).to(dt).to(DEV) for n, dt in SPECS]


def _pair(ps, **kw):
    out = []
    for _ in range(2):
        qs = [p.clone().requires_grad_() for p in ps]
        out.append((fo.FlashAdamW(qs, lr=1e-2, weight_decay=0.1, backend="triton", **kw), qs))
    return out


def _grads(gen, nan=False):
    gs = [torch.randn(n, generator=gen).to(dt).to(DEV) for n, dt in SPECS]
    if nan:
        gs[3][-1] = float("nan")
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
def test_cached_plan_equals_rebuilt_tables(mode):
    """Same gradient tensors updated in place, fresh tensors every step (kept alive so the
    addresses change), ``zero_grad(set_to_none=True)`` then new tensors, and a parameter
    without a gradient in one step: bitwise the uncached path, with the tables built once
    where the parameters with gradients do not change (a parameter that missed a step has
    another step count than the rest: no cached plan, every table built each step)."""
    gen = torch.Generator().manual_seed(0)
    (a, pa), (b, pb) = _pair(_params(gen))
    builds = []
    build = a._build_table
    a._build_table = lambda *x: builds.append(1) or build(*x)
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
        assert len(builds) == len(a._plans[id(a.param_groups[0])]["buckets"]) == 3


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
def test_lazy_skip_read_after_the_prepass_equals_sync():
    """v4 lazy skip (the previous step's flag read after this step's pre-pass launch, or
    before a plan rebuild) against the synchronous skip on rebuilt tables, fresh gradient
    tensors in every step: NaN in steps 1, 3 and 5; step 2 reads step 1's flag after its
    pre-pass; step 4 (parameter 0 without a gradient) rebuilds its plan and reads step 3's
    flag first; step 5 (same parameters) is lazy again, read by ``skipped_steps``."""
    gen = torch.Generator().manual_seed(3)
    (a, pa), (b, pb) = _pair(_params(gen), kernel="v4")
    a._lazy_skip = True
    for s in range(6):
        gs = _grads(gen, nan=s in (1, 3, 5))
        for qs in (pa, pb):
            for i, (q, g) in enumerate(zip(qs, gs)):
                q.grad = None if (s >= 4 and i == 0) else g.clone()
        b._plans.clear()
        a.step()
        b.step()
        assert (a._pending is not None) == (s in (1, 2, 3, 5)), s
        _assert_equal(a, pa, b, pb, steps=a._pending is None)
    assert a.skipped_steps == b.skipped_steps == 3 and a._pending is None
    _assert_equal(a, pa, b, pb)
    assert a.state[pa[0]]["step"] == 2 and a.state[pa[1]]["step"] == 3


@needs_kernel
def test_rebase_declines_a_non_contiguous_gradient():
    """A cached plan never rebases a gradient it cannot address (here: non-contiguous);
    the rebuild raises the table's error, as without the cache."""
    p = torch.randn(8, 16, device=DEV).bfloat16().requires_grad_()
    opt = fo.FlashAdamW([p], backend="triton")
    p.grad = torch.randn(8, 16, device=DEV).bfloat16()
    opt.step()
    p.grad = torch.randn(16, 8, device=DEV).bfloat16().t()
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()
