"""torch.compile (``_compile.py``): ``torch.compile(opt.step, fullgraph=True)`` traces the
step as one custom op (it failed on ``operator.attrgetter``), bit for bit the eager step; a
compiled function that changes the gradients before stepping passes them to the op; on CUDA
``mode="reduce-overhead"`` captures the step in a CUDA graph (``capturable=True``)."""

import pytest
import torch
from _checks import small_grads, small_params

import flashoptim_fused as fo


def _twins(Opt, dev="cpu", **kw):
    out = []
    for _ in range(2):
        ps = [p.to(dev).requires_grad_() for p in small_params(torch.bfloat16)]
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


@pytest.mark.gpu
def test_gpu_reduce_overhead_is_the_eager_step():
    """mode='reduce-overhead': the step replays in a CUDA graph, bit for bit the eager
    capturable step; without capturable=True a clear error."""
    torch._dynamo.reset()
    (a, pa), (b, pb) = _twins(fo.FlashAdamW, "cuda", capturable=True)
    step = torch.compile(b.step, mode="reduce-overhead", fullgraph=True)
    for s in range(6):
        for p, q, g in zip(pa, pb, small_grads(pa, s)):
            p.grad = g.bfloat16().cuda()
            if q.grad is None:
                q.grad = torch.empty_like(p.grad)
            q.grad.copy_(p.grad)  # static gradient tensors, as CUDA graphs need
        a.step()
        step()
    torch.cuda.synchronize()
    a.sync_steps()
    b.sync_steps()
    _same(a, pa, b, pb)
    torch._dynamo.reset()
    (c, pc), _ = _twins(fo.FlashAdamW, "cuda")
    step = torch.compile(c.step, mode="reduce-overhead", fullgraph=True)
    for p in pc:
        p.grad = torch.ones_like(p)
    with pytest.raises(Exception, match="capturable=True"):
        for _ in range(3):
            step()
