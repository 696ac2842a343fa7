"""torch.compile support: under dynamo, ``step()`` is one custom op (``flashoptim_fused::step``,
declared to mutate the parameters, with a no-op fake impl), so ``torch.compile(opt.step,
fullgraph=True)`` and compiled training steps trace it without a graph break or tracing our
host code. At run time the op runs the eager step of the optimizer it names, on the
gradients the graph passes. The op carries torch's ``cudagraph_unsafe`` tag: under
``mode="reduce-overhead"`` Inductor leaves a graph holding it out of its CUDA graph trees
(whose recording hands a step static copies of its inputs, on which the step's offset
tables, built on the real ``.grad`` pointers, would be stale), so the step runs eagerly and
correctly; the CUDA-graph speed of the step comes from the package's own capture
(``capturable=True`` and ``torch.cuda.graph`` around the eager ``step()``).
"""

from __future__ import annotations

import itertools
import weakref

import torch

_OPTIMIZERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def register(opt) -> int:
    """A handle (an int the compiled graph can hold) for ``opt``."""
    h = next(_HANDLES)
    _OPTIMIZERS[h] = opt
    return h


@torch.library.custom_op(
    "flashoptim_fused::step", mutates_args=("params",), tags=(torch.Tag.cudagraph_unsafe,)
)
def step_op(
    handle: int, index: list[int], params: list[torch.Tensor], grads: list[torch.Tensor]
) -> None:
    """One optimizer step: ``params`` are the parameters at positions ``index`` of the
    optimizer's param groups (those with a gradient when traced), ``grads`` their gradients."""
    opt = _OPTIMIZERS.get(handle)
    if opt is None:
        raise RuntimeError("flashoptim: the optimizer of this compiled step no longer exists")
    opt._step_from_graph(index, params, grads)


@step_op.register_fake
def _(handle, index, params, grads) -> None:
    return None


def traced_step(opt) -> None:
    """What ``step()`` is under dynamo: the custom op over the parameters with gradients."""
    allp = [p for g in opt.param_groups for p in g["params"]]
    index = [i for i, p in enumerate(allp) if p.grad is not None]
    ps = [allp[i] for i in index]
    torch.ops.flashoptim_fused.step(opt._handle, index, ps, [p.grad for p in ps])
