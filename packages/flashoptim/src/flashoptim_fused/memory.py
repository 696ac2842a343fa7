"""Bytes per parameter by component: ``memory_report(optimizer)``."""

from __future__ import annotations

import torch

from ._plan import local as _local
from .optimizer import FlashOptimizer


def memory_report(optimizer: torch.optim.Optimizer, grad_dtype: torch.dtype | None = None) -> dict:
    """Count the bytes each component holds (states are created by the first step).

    Gradients are counted in their current dtype if present, else in ``grad_dtype`` (default:
    the parameter dtype), and as 0 when gradient release is enabled. Returns a dict with
    bytes per component, ``params`` (count), ``total_bytes`` and ``bytes_per_param``. The
    states: ``state_codes`` (8-bit), ``state_scales`` (their group scales) and
    ``state_fp32`` (the fp32 states of tensors whose rows hold under 32 elements, 1-D ones
    among them: docs/flashoptim.md, "Sharding"; and every state with ``quantize=False``).
    """
    comp = dict(
        param=0,
        grad=0,
        master_correction=0,
        state_codes=0,
        state_scales=0,
        state_fp32=0,
        state_lowrank=0,  # FlashMuon's low-rank momentum factors (bf16)
    )
    other = 0
    n = 0
    release = getattr(optimizer, "_release_enabled", False)
    for group in optimizer.param_groups:
        for p in group["params"]:
            lp = _local(p)
            n += lp.numel()
            comp["param"] += lp.numel() * lp.element_size()
            if not release:
                if p.grad is not None:
                    g = _local(p.grad)
                    comp["grad"] += g.numel() * g.element_size()
                else:
                    es = torch.empty((), dtype=grad_dtype or lp.dtype).element_size()
                    comp["grad"] += lp.numel() * es
            for k, v in optimizer.state.get(p, {}).items():
                if not torch.is_tensor(v):
                    continue
                b = _local(v).numel() * _local(v).element_size()
                if k == "correction":
                    comp["master_correction"] += b
                elif k.endswith("_scale"):
                    comp["state_scales"] += b
                elif k.endswith("_codes"):
                    comp["state_codes"] += b
                elif "_lowrank_" in k:
                    comp["state_lowrank"] += b
                elif k == "step":
                    other += b
                else:
                    comp["state_fp32"] += b
    total = sum(comp.values())
    return dict(
        comp,
        params=n,
        total_bytes=total,
        bytes_per_param=total / max(n, 1),
        gradient_release=release,
        optimizer=type(optimizer).__name__,
        is_flash=isinstance(optimizer, FlashOptimizer),
    )
