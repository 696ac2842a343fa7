"""The quantization grid: which elements share a group scale, fixed by the *unsharded*
tensor so that no sharding can cut a group (issue #32's contract, docs/flashoptim.md).

FSDP2 (``fully_shard``) cuts a parameter along dim 0 into ``ceil(rows / world)``-row pieces
(uneven at the end, possibly empty); DDP and one process do not cut it; a resharded
checkpoint moves the cuts. Every such cut falls on a row boundary, where a row is one
``p[i]`` of ``R = numel / shape[0]`` elements. So:

* ``R >= 32``: the groups are 32 consecutive elements **within a row** (``ceil(R / 32)`` per
  row, the last one partial when ``R % 32 != 0``). For ``R % 32 == 0`` (nearly every matrix)
  this is the plain grid of 32 over the flattened tensor. A shard holds whole rows, so its
  groups are exactly the unsharded tensor's and its scales a row-slice of the unsharded
  scale array, shape ``(rows, ceil(R / 32))``: states, codes, scales and updates are
  bit-identical for any mesh, and a checkpoint reshards row by row.
* ``R < 32`` (every 1-D tensor: biases, norm scales; thin matrices): a shard boundary can
  fall between any two elements, so no group of 32 survives every mesh: these tensors keep
  fp32 states (``quantize`` is True for the rest). Decided by the shape, never by the shard
  size (a rule on the shard's size would flip precision with the mesh).

Rows follow the parameter's memory order (the step runs over storage): dim 0 for contiguous
and channels_last parameters (every FSDP2 shard); for another dense layout (a transpose)
the outermost memory dimension.
"""

from __future__ import annotations

import math

import torch

GROUP = 32  # elements per group scale


def row_len(t: torch.Tensor) -> int:
    """Elements per row of ``t`` (a plain tensor, a DTensor or its local shard: the row length
    is the same): the product of all dims but the outermost one in memory; 1 for 0-D and 1-D
    tensors."""
    if t.dim() < 2:
        return 1
    outer = _outer_dim(t)
    return math.prod(s for d, s in enumerate(t.shape) if d != outer)


def _outer_dim(t: torch.Tensor) -> int:
    if t.is_contiguous() or not hasattr(t, "stride") or hasattr(t, "_local_tensor"):
        return 0
    sizes = [d for d in range(t.dim()) if t.shape[d] > 1]
    return max(sizes, key=lambda d: t.stride(d)) if sizes else 0


def quantizable(t: torch.Tensor) -> bool:
    """Whether ``t``'s states may be quantized: rows of at least one whole group."""
    return row_len(t) >= GROUP


def split(t: torch.Tensor) -> bool:
    """Whether ``t``'s rows end inside a group (``R % 32 != 0``): the kernel then steps each
    row as its own table entry (``_plan.build_table``)."""
    r = row_len(t)
    return r >= GROUP and r % GROUP != 0


def scale_shape(lt: torch.Tensor) -> tuple[int, int]:
    """(rows, groups per row) of the group scales of the local tensor ``lt``."""
    r = row_len(lt)
    rows = lt.numel() // r if r else 0
    return rows, -(-r // GROUP)


def pad_rows(x: torch.Tensor, r: int) -> torch.Tensor:
    """A flat tensor of whole rows of ``r`` elements, each zero-padded to whole groups:
    ``(rows * ceil(r / 32) * 32,)``; the padded elements take part in no maximum (|0|)."""
    rows = x.numel() // r
    rp = -(-r // GROUP) * GROUP
    if rp == r:
        return x.reshape(-1)
    out = x.new_zeros(rows, rp)
    out[:, :r] = x.reshape(rows, r)
    return out.view(-1)


def unpad_rows(x: torch.Tensor, r: int) -> torch.Tensor:
    """The inverse of ``pad_rows``: the real elements, flat."""
    rp = -(-r // GROUP) * GROUP
    if rp == r:
        return x.reshape(-1)
    return x.view(-1, rp)[:, :r].reshape(-1)


def row_index(rows: int, r: int, base: int, device) -> torch.Tensor:
    """Global element index (for the rounding stream) of every padded element of
    ``pad_rows``: ``base + i * r + j`` (padded columns get indices past their row)."""
    rp = -(-r // GROUP) * GROUP
    i = torch.arange(rows, dtype=torch.int64, device=device)[:, None] * r
    return (i + torch.arange(rp, dtype=torch.int64, device=device)[None, :] + base).view(-1)


def grouped(x: torch.Tensor, r: int | None) -> torch.Tensor:
    """``x`` (flat, whole rows of ``r``) as [groups, 32], zero-padded per row; ``r`` None:
    the flat tensor padded at its end (one row)."""
    if r is None:
        r = x.numel()
    if r == 0:
        return x.new_zeros(0, GROUP)
    return pad_rows(x, r).view(-1, GROUP)
