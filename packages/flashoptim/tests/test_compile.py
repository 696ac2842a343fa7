"""torch.compile (``_compile.py``): ``torch.compile(opt.step, fullgraph=True)`` traces the
step as one custom op (it failed on ``operator.attrgetter``), bit for bit the eager step; a
compiled function that changes the gradients before stepping passes them to the op; a
compiled step inside a user's CUDA graph capture is refused with an error that points to the
package's own capture (``capturable=True``); ``mode="reduce-overhead"`` leaves the step out of
its CUDA graphs (the op's ``cudagraph_unsafe`` tag) and steps as eager does."""

import pytest
import torch
from _checks import small_grads, small_params

import flashoptim_fused as fo
from flashoptim_fused import _plan


def _twins(Opt, dev="cpu", **kw):
    out = []
    for _ in range(2):
        ps = [p.detach().to(dev).requires_grad_() for p in small_params(torch.bfloat16)]
        out.append((Opt(ps, lr=1e-2, **kw), ps))
    return out


def _same(a, pa, b, pb):
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
        for k, v in a.state[p].items():
            w = b.state[q][k]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, k


@pytest.mark.parametrize("Opt,kw", [(fo.FlashAdamW, {}), (fo.FlashSGD, dict(momentum=0.9))])
def test_compiled_step_fullgraph(Opt, kw):
    torch._dynamo.reset()
    (a, pa), (b, pb) = _twins(Opt, **kw)
    step = torch.compile(b.step, fullgraph=True)
    for s in range(3):
        for p, q, g in zip(pa, pb, small_grads(pa, s)):
            p.grad, q.grad = g.bfloat16(), g.bfloat16()
        a.step()
        step()
    _same(a, pa, b, pb)


def test_compiled_function_passes_its_gradients():
    """Gradients changed inside the compiled function (functionalized) reach the step."""
    torch._dynamo.reset()
    (a, pa), (b, pb) = _twins(fo.FlashAdamW)

    def clip_and_step(opt, ps):
        for p in ps:
            p.grad.mul_(0.5)
        opt.step()

    compiled = torch.compile(clip_and_step, fullgraph=True, backend="aot_eager")
    for s in range(2):
        for p, q, g in zip(pa, pb, small_grads(pa, s)):
            p.grad, q.grad = g.bfloat16(), g.bfloat16()
        clip_and_step(a, pa)
        compiled(b, pb)
    _same(a, pa, b, pb)


def test_compiled_step_in_a_capture_is_refused(monkeypatch):
    """The compiled step's op, run while a CUDA graph is being captured (a
    torch.cuda.graph of the user's around a compiled step), raises the error naming the
    package's own capture, and the optimizer's step count is untouched."""
    torch._dynamo.reset()
    (a, pa), _ = _twins(fo.FlashAdamW)
    step = torch.compile(a.step, fullgraph=True, backend="aot_eager")
    for p, g in zip(pa, small_grads(pa, 0)):
        p.grad = g.bfloat16()
    step()
    monkeypatch.setattr(_plan, "capturing", lambda: True)
    with pytest.raises(RuntimeError, match="capturable=True.*torch.cuda.graph"):
        step()
    assert all(a.state[p]["step"] == 1 for p in pa)


def test_step_op_is_left_out_of_cuda_graphs():
    """The op is tagged cudagraph_unsafe: Inductor's reduce-overhead mode does not record it."""
    assert torch.Tag.cudagraph_unsafe in torch.ops.flashoptim_fused.step.default.tags


@pytest.mark.gpu
def test_gpu_reduce_overhead_steps_like_eager():
    """mode='reduce-overhead' on CUDA (capturable=True, nn.Parameters as in training): the
    graph holding the step is left out of the CUDA graph trees (the op's cudagraph_unsafe
    tag), so every step is bit for bit the eager twin's (it raised torch's "tensors in the
    cudagraph pool not tracked" error on the H200 before the tag)."""
    torch._dynamo.reset()
    twins = []
    for _ in range(2):
        ps = [torch.nn.Parameter(p.detach().cuda()) for p in small_params(torch.bfloat16)]
        twins.append((fo.FlashAdamW(ps, lr=1e-2, capturable=True), ps))
    (a, pa), (b, pb) = twins
    step = torch.compile(b.step, mode="reduce-overhead", fullgraph=True)
    for s in range(4):
        for p, q, g in zip(pa, pb, small_grads(pa, s)):
            p.grad, q.grad = g.cuda().bfloat16(), g.cuda().bfloat16()
        a.step()
        step()
    torch.cuda.synchronize()
    _same(a, pa, b, pb)
    torch._dynamo.reset()
