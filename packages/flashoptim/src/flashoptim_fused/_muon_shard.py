"""Newton-Schulz of row-sharded (FSDP2) matrices, each on one owner rank.

Every rank holds some rows of each matrix's direction ``u``. Instead of all-gathering every
matrix on every rank (each rank then runs every iteration), each matrix gets one owner
(``owners``: greedy by Newton-Schulz cost, the same on every rank); one ``all_to_all``
sends every shard to its matrix's owner, the owner orthogonalises its whole matrices (those
of one shape as one batch) and a second ``all_to_all`` returns each rank its rows of ``O``.
Per matrix of N elements: 2 (W - 1) / W x 2 N bytes cross the network in total (the
all-gather moved W (W - 1) / W x 2 N) and the iteration runs once instead of W times.

Shards follow ``torch.chunk`` along dim 0 (FSDP2's ``Shard(0)``; on a mesh of several
dimensions the others must be ``Replicate``, as HSDP's): ``rows_of``. Matrices of another
placement are returned to the caller (``muon.py`` gathers those whole on every rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist


def shard_group(p) -> tuple | None:
    """(process group, this rank's index in it, its size) of a DTensor ``p`` sharded by
    rows on one mesh dimension (the others ``Replicate``); None for any other placement."""
    from torch.distributed.tensor import Replicate, Shard

    dims = [i for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if len(dims) != 1 or type(p.placements[dims[0]]) is not Shard or p.placements[dims[0]].dim:
        return None
    mesh, d = p.device_mesh, dims[0]
    return mesh.get_group(d), mesh.get_local_rank(d), mesh.size(d)


def row_sum(p) -> Callable:
    """The sum over the ranks that hold the other rows of a row-sharded ``p`` (in place, an
    all-reduce on its shard group); the identity for a plain tensor."""
    g = shard_group(p) if hasattr(p, "_local_tensor") else None
    if g is None:
        return lambda t: t

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        dist.all_reduce(t, group=g[0])
        return t

    return reduce


def rows_of(n: int, world: int) -> list[int]:
    """Rows of each rank when ``n`` rows are split as ``torch.chunk`` splits them (chunks of
    ceil(n / world), the last ones shorter or empty)."""
    c = -(-n // world) if n else 0
    return [max(0, min(n, (r + 1) * c) - r * c) for r in range(world)]


def owners(shapes: list[tuple[int, int]], world: int) -> list[int]:
    """The owner rank of each (rows, cols) matrix: largest Newton-Schulz cost first (about
    min(A, B)^2 max(A, B)), each to the least loaded rank (the lowest on ties)."""
    load = [0.0] * world
    out = [0] * len(shapes)
    for j in sorted(range(len(shapes)), key=lambda j: (-_cost(shapes[j]), j)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[j] = r
        load[r] += _cost(shapes[j])
    return out


def _cost(shape: tuple[int, int]) -> float:
    a, b = sorted(shape)
    return float(a) * a * b


def orthogonalize(items: list, orthogonalize_full: Callable) -> list:
    """Replace each local ``x`` of ``items`` (pairs of a row-sharded DTensor parameter ``p``
    and this rank's rows of its direction, ``x`` of ``p``'s local shape, bf16) by its rows
    of ``orthogonalize_full(u)`` of the whole matrix (``u`` (k, A, B): a batch of one
    shape). Every rank must call this with the same parameters in the same order. Returns
    the items whose placement this path does not take (``shard_group`` None)."""
    rest, by_group = [], {}
    for p, x in items:
        g = shard_group(p)
        if g is None:
            rest.append((p, x))
        else:
            by_group.setdefault(g, []).append((p, x))
    for (group, rank, world), its in by_group.items():
        _exchange(its, group, rank, world, orthogonalize_full)
    return rest


def _exchange(items, group, rank: int, world: int, orthogonalize_full: Callable) -> None:
    ps = [p for p, _ in items]
    inner = [math.prod(p.shape[1:]) for p in ps]
    rows = [rows_of(int(p.shape[0]), world) for p in ps]
    for (p, x), rs, k in zip(items, rows, inner):
        if x.numel() != rs[rank] * k:
            raise ValueError(
                f"a sharded parameter of shape {tuple(p.shape)} holds {x.numel()} elements on"
                f" rank {rank}; torch.chunk's rows give {rs[rank] * k}"
            )
    own = owners([(int(p.shape[0]), k) for p, k in zip(ps, inner)], world)
    mine = [j for j in range(len(ps)) if own[j] == rank]
    # to the owners: for each destination, this rank's rows of the matrices it owns
    send = [x.reshape(-1) for r in range(world) for j, (_, x) in enumerate(items) if own[j] == r]
    in_splits = [
        sum(rows[j][rank] * inner[j] for j in range(len(ps)) if own[j] == r) for r in range(world)
    ]
    out_splits = [sum(rows[j][r] * inner[j] for j in mine) for r in range(world)]
    recv = _all_to_all(send, in_splits, out_splits, group, items[0][1])
    # the owner's whole matrices: rank r's rows of matrix j lie in block r, in mine's order
    parts = {j: [] for j in mine}
    off = 0
    for r in range(world):
        for j in mine:
            n = rows[j][r] * inner[j]
            parts[j].append(recv[off : off + n])
            off += n
    full = {j: torch.cat(parts[j]).view(int(ps[j].shape[0]), inner[j]) for j in mine}
    by_shape: dict = {}
    for j in mine:
        by_shape.setdefault(full[j].shape, []).append(j)
    done = {}
    for js in by_shape.values():
        o = orthogonalize_full(torch.stack([full[j] for j in js]))
        for i, j in enumerate(js):
            done[j] = o[i]
    # back: each rank its rows of every O this rank owns
    back = []
    for r in range(world):
        for j in mine:
            r0 = sum(rows[j][:r])
            back.append(done[j][r0 : r0 + rows[j][r]].reshape(-1))
    recv = _all_to_all(back, out_splits, in_splits, group, items[0][1])
    off = 0
    for r in range(world):
        for j, (_, x) in enumerate(items):
            if own[j] == r:
                n = x.numel()
                x.copy_(recv[off : off + n].view(x.shape))
                off += n


def _all_to_all(chunks, in_splits, out_splits, group, like) -> torch.Tensor:
    """One ``all_to_all_single`` of bf16 data, moved as bytes (gloo has no bf16 or int16
    all-to-all)."""
    send = torch.cat(chunks) if chunks else like.new_empty(0)
    out = send.new_empty(sum(out_splits))
    w = send.element_size()
    dist.all_to_all_single(
        out.view(torch.uint8),
        send.contiguous().view(torch.uint8),
        output_split_sizes=[w * n for n in out_splits],
        input_split_sizes=[w * n for n in in_splits],
        group=group,
    )
    return out
