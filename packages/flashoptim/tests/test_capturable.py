"""Capturable mode (``_capturable.py``: step counts, step scalars and the finiteness decision
on device, for CUDA graphs): bitwise the same parameters, corrections, codes and scales as
the CPU path and the eager kernel.

CPU tests run the Triton kernels under the interpreter (backend="triton" on CPU tensors).
The device scalars are computed with torch float64 ops from the same formulas as the host's
``_plan.scalar_args``; the only op that is not correctly rounded is ``pow`` (b1**step, b2**step:
Python's ``**`` is the C library's pow, torch's CPU pow of a small tensor is the same libm
call, CUDA's double pow is within 2 ulp). A last-bit float64 difference changes the fp32
scalar the kernel reads only when it straddles an fp32 rounding boundary (about 2**-29 per
scalar); ``test_device_scalars_match_host`` checks the float64 powers within 1 ulp and the
fp32 scalars bitwise, so the bitwise parameter checks below hold on this machine. On a GPU
the graph test compares codes up to ties and parameters to a tolerance.
"""

import pytest
import torch

import flashoptim_fused as fo
from flashoptim_fused import _capturable, _plan
from flashoptim_fused import _step_kernel as K

SHAPES = [(64,), (40, 3), (33,), (7,), (2048 + 96,)]

CASES = [
    ("adamw", fo.FlashAdamW, dict(betas=(0.9, 0.95), weight_decay=0.1)),
    ("adam", fo.FlashAdam, dict(weight_decay=0.01)),
    ("sgd", fo.FlashSGD, dict(momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("sgd_nesterov", fo.FlashSGD, dict(momentum=0.9, nesterov=True)),
    ("lion", fo.FlashLion, dict(weight_decay=0.1)),
]


def _params(dtypes=(torch.bfloat16,)):
    g = torch.Generator().manual_seed(0)
    out = []
    for i, s in enumerate(SHAPES):
        dt = dtypes[i % len(dtypes)]
        out.append(torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dt)))
    return out


def _groups(ps, split):
    if not split:
        return ps
    return [dict(params=ps[:2]), dict(params=ps[2:], weight_decay=0.0)]


def _set_grads(pss, k, bad):
    g = torch.Generator().manual_seed(100 + k)
    for i, p0 in enumerate(pss[0]):
        gr = torch.randn(p0.shape, generator=g).to(p0.dtype)
        if bad and i == 1:
            gr.view(-1)[5] = float("inf") if k % 2 else float("nan")
        for ps in pss:
            if ps[i].grad is None:
                ps[i].grad = gr.clone()
            else:  # static gradient tensors, as under CUDA graphs: cached tables reused
                ps[i].grad.copy_(gr)


def _state_tensors(opt, ps):
    out = []
    for p in ps:
        out.append(p.detach().clone())
        st = opt.state.get(p, {})
        out += [st[k].clone() for k in sorted(st) if torch.is_tensor(st[k])]
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        if x.is_floating_point():  # bitwise: compare the bit patterns
            it = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
            x, y = x.view(it), y.view(it)
        assert torch.equal(x, y)


def _steps(opt):
    return [opt.state[p]["step"] for g in opt.param_groups for p in g["params"] if p in opt.state]


@pytest.mark.parametrize("name,Opt,kw", CASES, ids=[c[0] for c in CASES])
def test_capturable_bitwise(name, Opt, kw):
    """Several steps with an LR schedule (float lr on the CPU path, float64 tensor lr
    capturable), stochastic rounding, two param groups and bf16 + fp16 + fp32 parameters;
    step 0 (SGD's 'first' step) or step 2 has a non-finite gradient: skipped identically
    on device. Against the CPU path, bitwise."""
    dts = (torch.bfloat16, torch.float16, torch.float32)
    pa, pb = _params(dts), _params(dts)
    bad_step = 0 if name.startswith("sgd") else 2
    a = Opt(_groups(pa, True), lr=1e-2, backend="torch", **kw)
    lr_t = torch.tensor(1e-2, dtype=torch.float64)
    b = Opt(_groups(pb, True), lr=lr_t, backend="triton", capturable=True, **kw)
    assert torch.is_tensor(b.param_groups[0]["lr"])
    sa = torch.optim.lr_scheduler.LambdaLR(a, lambda k: 1.0 / (1 + 0.37 * k))
    sb = torch.optim.lr_scheduler.LambdaLR(b, lambda k: 1.0 / (1 + 0.37 * k))
    for k in range(5):
        _set_grads([pa, pb], k, bad=k == bad_step)
        before = _state_tensors(b, pb)
        a.step()
        b.step()
        if k == bad_step and k:
            _assert_same(before, _state_tensors(b, pb))  # nothing written
        elif k == bad_step:  # skipped first step: parameters kept, states allocated as zeros
            _assert_same(before, [p.detach() for p in pb])
            assert all(not t.any() for p in pb for t in b.state[p].values() if torch.is_tensor(t))
        _assert_same(_state_tensors(a, pa), _state_tensors(b, pb))
        sa.step()
        sb.step()
        assert float(b.param_groups[0]["lr"]) == a.param_groups[0]["lr"]
    assert a.skipped_steps == 1 and b.skipped_steps == 0
    assert int(b.skipped_steps_device) == 1
    sd = b.state_dict()  # reads the device step counts
    assert _steps(a) == _steps(b) == [4] * len(SHAPES)
    assert sd["flashoptim"]["skipped_steps"] == 1
    assert [st["step"] for st in sd["state"].values()] == [4] * len(SHAPES)


@pytest.mark.parametrize("resume_capturable", [True, False])
def test_capturable_checkpoint_resume(resume_capturable):
    """state_dict of a capturable optimizer resumes in either mode, and an eager checkpoint
    resumes in capturable mode, bitwise as an uninterrupted eager run."""
    pr, pc = _params(), _params()
    ref = fo.FlashAdamW(pr, lr=1e-2, backend="triton")
    cap = fo.FlashAdamW(pc, lr=1e-2, backend="triton", capturable=True)
    for k in range(2):
        _set_grads([pr, pc], k, bad=k == 1)
        ref.step()
        cap.step()
    sd = cap.state_dict()
    assert sd["flashoptim"]["skipped_steps"] == 1
    p2 = [torch.nn.Parameter(p.detach().clone()) for p in pc]
    new = fo.FlashAdamW(p2, lr=1e-2, backend="triton", capturable=resume_capturable)
    new.load_state_dict(sd)
    assert _steps(new) == [1] * len(SHAPES)
    # and back: an eager checkpoint into a capturable optimizer
    p3 = [torch.nn.Parameter(p.detach().clone()) for p in pr]
    back = fo.FlashAdamW(p3, lr=1e-2, backend="triton", capturable=True)
    back.load_state_dict(ref.state_dict())
    for k in range(2, 4):
        _set_grads([pr, p2, p3], k, bad=False)
        ref.step()
        new.step()
        back.step()
        _assert_same(_state_tensors(ref, pr), _state_tensors(new, p2))
        _assert_same(_state_tensors(ref, pr), _state_tensors(back, p3))
    back.sync_steps()  # capturable: the host state["step"] is refreshed on demand
    if resume_capturable:
        new.sync_steps()
    assert _steps(new) == _steps(back) == [3] * len(SHAPES)
    assert new.state_dict()["flashoptim"]["skipped_steps"] == 1


def test_device_scalars_match_host():
    """The fp32 scalars the kernels read in capturable mode equal the host's, for steps
    1..3000 and several betas; the float64 powers agree within 1 ulp (pow is the one op
    that is not correctly rounded; here torch's CPU pow and Python's ** agree exactly)."""
    steps = torch.arange(0, 3001, dtype=torch.int64)
    for b1, b2, lr, wd in [
        (0.9, 0.999, 1e-3, 0.1),
        (0.8, 0.95, 3e-4, 0.0),
        (0.99, 0.9999, 0.7, 1e-2),
    ]:
        p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
        p.grad = torch.zeros_like(p)
        opt = fo.FlashAdamW(
            [p], lr=lr, betas=(b1, b2), weight_decay=wd, capturable=True, backend="triton"
        )
        prep = opt._prepare(opt.param_groups[0], [p])
        plan = prep["plan"]
        plan["dstep"] = steps.clone()
        plan["scal"] = torch.zeros(len(steps), 14, dtype=torch.int32)
        hp = opt._hp(opt.param_groups[0], p)
        _capturable.device_scalars(opt, plan, hp, torch.zeros(1, dtype=torch.int32))
        got = plan["scal"]
        pw = torch.pow(torch.tensor(b1, dtype=torch.float64), steps[1:].double())
        host = torch.tensor([b1**s for s in range(1, 3001)], dtype=torch.float64)
        ulps = (pw.view(torch.int64) - host.view(torch.int64)).abs()
        assert int(ulps.max()) <= 1
        for s in range(1, 3001, 7):
            want = _plan.scalar_args(opt._kind, hp, s)
            f = torch.tensor(want[:11], dtype=torch.float32).view(torch.int32)
            assert torch.equal(got[s, :11], f), s
            assert int(got[s, 11]) == want[11]
            assert int(got[s, 12]) & 0xFFFFFFFF == want[12]
            assert int(got[s, 13]) == 0


def test_capturable_errors(monkeypatch):
    p = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="on_nonfinite"):
        fo.FlashAdamW([p], capturable=True, on_nonfinite="raise")
    with pytest.raises(ValueError, match="Triton"):
        fo.FlashAdamW([p], capturable=True, backend="torch")
    opt = fo.FlashAdamW([p], capturable=True, backend="triton")
    p.grad = torch.ones_like(p)
    opt.step()
    monkeypatch.setattr(_plan, "capturing", lambda: True)
    opt.step()  # same tensors: no rebuild, fine while "capturing"
    p.grad = torch.ones_like(p)  # a new gradient tensor: the tables would need rebuilding
    with pytest.raises(RuntimeError, match="capture"):
        opt.step()
    with pytest.raises(RuntimeError, match="capture"):
        opt.sync_steps()
    monkeypatch.setattr(_plan, "capturing", lambda: False)
    opt.step()  # rebuilt eagerly, step counts carried over
    assert opt.state_dict()["state"][0]["step"] == 3
    with pytest.raises(ValueError, match="capturable"):
        opt.step_param(p)


def test_default_path_unchanged_scalar_flag(monkeypatch):
    """The default path launches with SCALARS_ON_DEVICE=False (its compiled code does not
    change); capturable launches with True."""
    seen = []
    orig = _plan.launch_step

    def spy(ent, scalars, flags, *rest, **kw):
        seen.append(flags["SCALARS_ON_DEVICE"])
        return orig(ent, scalars, flags, *rest, **kw)

    monkeypatch.setattr(_plan, "launch_step", spy)
    for cap in (False, True):
        p = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
        p.grad = torch.ones_like(p)
        fo.FlashAdamW([p], capturable=cap, backend="triton").step()
    assert seen == [False, True]
    assert "SCALARS_ON_DEVICE" in K._step_kernel.arg_names


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """Capture opt.step() in a CUDA graph after an eager warm-up, replay it with fresh
    gradients copied into the static .grad tensors and a scheduler filling the tensor lr;
    compare with an eager optimizer; an injected inf gradient skips the step on device."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = "cuda"
    shapes = [(4096,), (1024, 33), (77,), (256, 256)] * 8

    def mk():
        g = torch.Generator(device=dev).manual_seed(0)
        return [
            torch.nn.Parameter((torch.randn(s, device=dev, generator=g) * 0.1).bfloat16())
            for s in shapes
        ]

    pa, pb = mk(), mk()
    a = fo.FlashAdamW(pa, lr=1e-3, weight_decay=0.1)
    lr = torch.tensor(1e-3, dtype=torch.float64, device=dev)
    b = fo.FlashAdamW(pb, lr=lr, weight_decay=0.1, capturable=True)
    sa = torch.optim.lr_scheduler.LambdaLR(a, lambda k: 1.0 / (1 + 0.1 * k))
    sb = torch.optim.lr_scheduler.LambdaLR(b, lambda k: 1.0 / (1 + 0.1 * k))

    def grads(k, bad=False):
        g = torch.Generator(device=dev).manual_seed(k)
        out = [torch.randn(s, device=dev, generator=g).bfloat16() for s in shapes]
        if bad:
            out[3].view(-1)[17] = float("inf")
        return out

    for p, q, gr in zip(pa, pb, grads(0), strict=True):
        p.grad, q.grad = gr.clone(), gr.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: builds the tables, autotunes
        a.step()
        b.step()
    torch.cuda.current_stream().wait_stream(s)
    sa.step()
    sb.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b.step()
    for k in range(1, 6):
        bad = k == 3
        for p, q, gr in zip(pa, pb, grads(k, bad), strict=True):
            p.grad.copy_(gr)
            q.grad.copy_(gr)
        a.step()
        graph.replay()
        sa.step()
        sb.step()
    torch.cuda.synchronize()
    assert a.skipped_steps == 1 and int(b.skipped_steps_device) == 1
    b.sync_steps()
    assert [b.state[q]["step"] for q in pb] == [a.state[p]["step"] for p in pa] == [5] * len(shapes)
    for p, q in zip(pa, pb, strict=True):
        torch.testing.assert_close(
            p.float(), q.float(), rtol=0, atol=2e-2 * p.float().abs().max().item()
        )
        for key in ("exp_avg", "exp_avg_sq"):
            d = (a.state[p][key].int() - b.state[q][key].int()).abs()
            assert int(d.max()) <= 1  # codes equal up to ties
            assert float((d > 0).float().mean()) < 1e-3
