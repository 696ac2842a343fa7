"""How a step becomes kernel launches: buckets of tensors, their offset tables and work
tables, the launches of the finiteness pre-pass and of the step kernel.

A bucket is every parameter of a param group with the same step count, parameter and
gradient dtype, device and backend, and ``numel % 16 == 0`` or not (the kernel's masks
vectorize when every numel is a multiple of 16). Each array of tensor ``i`` sits at
``bases[j] + tab[i, j]`` (element offsets from one base tensor per array), so one launch
covers any number of tensors.
"""

from __future__ import annotations

import array
import math
import operator

import torch

from . import _config, grid
from . import _prepass_kernel as PK
from . import _step_kernel as K
from .reference import ADAM, GOLDEN, GROUP, M32

P_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# largest numel the kernel's int32 element offsets cover (offsets run up to numel + CHUNK);
# a bucket with a larger tensor runs the kernel with int64 offsets (INDEX64)
INT32_NUMEL_LIMIT = 2**31 - 2 * K.CHUNK
# C-level getters for the per-step passes over thousands of parameters (``map``: no Python
# frame per tensor)
_DTYPE = operator.attrgetter("dtype")
_GET_DEVICE = torch.Tensor.get_device
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_SMS: dict = {}


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameter or gradient), else the tensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor's elements in memory order (``t.view(-1)`` for a
    contiguous one; a channels_last or transposed one is stepped over its storage: every
    array of a parameter has the parameter's strides, so element i of each is the same)."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory (any order): what the step needs."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, d) for d, s in zip(t.shape, t.stride()) if d != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def layout_error(p: torch.Tensor, where: str) -> ValueError:
    return ValueError(
        f"{where} (shape {tuple(p.shape)}, strides {p.stride()}) is not dense: flashoptim"
        " steps a parameter over its storage, which must hold exactly its elements (any"
        " memory format: contiguous, channels_last, a transpose); pass a non-overlapping,"
        " dense tensor (e.g. .contiguous()), not an expanded or strided view"
    )


def global_index_base(p: torch.Tensor) -> int:
    """Flat index of the first local element in the full tensor: the start of the tensor's
    stochastic-rounding stream, so a sharded run rounds as one process does. A DTensor's
    placements are Shard(0) or Replicate (``check_placements``): each Shard(0) mesh
    dimension cuts the rows left to it into ``ceil(rows / size)``-row chunks (torch.chunk's
    rule, FSDP2's), applied in mesh-dimension order."""
    if not hasattr(p, "_local_tensor") or p.dim() == 0:
        return 0
    mesh = p.device_mesh
    coord = mesh.get_coordinate()
    start, rows = 0, p.shape[0]
    for d, pl in enumerate(p.placements):
        if pl.is_shard():
            chunk = -(-rows // mesh.size(d))
            lo = min(coord[d] * chunk, rows)
            start, rows = start + lo, min(chunk, rows - lo)
    if rows != local(p).shape[0]:
        raise ValueError(
            f"a DTensor parameter of shape {tuple(p.shape)} and placements"
            f" {tuple(p.placements)} holds {local(p).shape[0]} rows on this rank where"
            f" torch.chunk's rule gives {rows}: flashoptim cannot place its shard in the"
            " unsharded tensor (its rounding stream and quantization grid need that)"
        )
    return start * (p.numel() // p.shape[0] if p.shape[0] else 0)


def check_placements(p, where: str) -> None:
    """A DTensor parameter must be Replicate or Shard(0) on every mesh dimension (FSDP2,
    HSDP, DDP-like replication): its shard is then a run of whole rows, which the
    quantization grid never cuts (``grid.py``). Other placements (tensor parallelism's
    Shard(1), strided shards) would cut rows and make the states depend on the mesh."""
    from torch.distributed.tensor import Replicate, Shard

    for pl in p.placements:
        if isinstance(pl, Replicate) or (type(pl) is Shard and pl.dim == 0):
            continue
        raise ValueError(
            f"{where} is a DTensor with placements {tuple(p.placements)}: flashoptim steps"
            " Shard(0) (FSDP2's fully_shard) and Replicate placements, whose shards hold"
            " whole rows of the unsharded tensor and so the same quantization groups under"
            " every mesh (docs/flashoptim.md, 'Sharding'); redistribute it, or shard it with"
            " fully_shard's default placement"
        )


def meshes_of(ps) -> list:
    """The distinct device meshes of the DTensor parameters among ``ps``."""
    out: dict = {}
    for p in ps:
        if hasattr(p, "_local_tensor"):
            out.setdefault(id(p.device_mesh), p.device_mesh)
    return list(out.values())


def mesh_device(mesh) -> torch.device:
    """The device a collective over ``mesh`` takes its tensors on."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def all_ranks_max_(t: torch.Tensor, meshes) -> None:
    """``t`` becomes its elementwise maximum over every rank of every mesh, in place."""
    import torch.distributed as dist

    for mesh in meshes:
        for d in range(mesh.ndim):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group(d))


def capturing() -> bool:
    """Whether a CUDA graph capture is in progress on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def num_sms(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 1
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def use_asm(dev: torch.device) -> bool:
    """The kernel's inline PTX: on CUDA, never under the interpreter."""
    return dev.type == "cuda" and not _config.interpret()


def needs_index64(numels) -> bool:
    """Whether a bucket with these tensor sizes needs the kernel's int64 element offsets."""
    return max(numels) > INT32_NUMEL_LIMIT


def index_buckets(ps: list, buckets: list) -> None:
    """A plan's buckets get ``idx``: their parameters' positions in ``ps`` (for the gradient
    rebase); a single bucket holding every parameter in their order needs none."""
    if (
        len(buckets) == 1
        and len(buckets[0]["ps"]) == len(ps)
        and all(map(operator.is_, buckets[0]["ps"], ps))
    ):
        buckets[0]["idx"] = None
        return
    pos = {id(p): i for i, p in enumerate(ps)}
    for b in buckets:
        b["idx"] = [pos[id(p)] for p in b["ps"]]


def build_table(ps: list, states: list, seeds: list, rows: bool = False) -> dict:
    """The offset table and work table of one bucket. ``states``: per parameter the dict of
    its ``c``, ``m``, ``ms``, ``v``, ``vs`` tensors (None where the mode has none).
    ``rows``: every parameter's rows end inside a group (``grid.split``): each row is a
    table entry of its own, so its groups start at the row (the kernel's groups of 32 start
    at each entry's element 0). ``owner`` / ``row0``: per entry, its parameter's index in
    ``ps`` and its first element within the parameter."""
    p0 = local(ps[0])
    cols = [
        [local(p) for p in ps],
        [local(p.grad) for p in ps],
        [s.get("c") for s in states],
        [s.get("m") for s in states],
        [s.get("ms") for s in states],
        [s.get("v") for s in states],
        [s.get("vs") for s in states],
    ]
    bases = [col[0] if col[0] is not None else p0 for col in cols]
    table, aligned, aligned_other = [], True, True
    present = []  # per tensor: which of its 7 arrays exist (an absent one stays at its base)
    for i, p in enumerate(ps):
        row = []
        present.append([c[i] is not None for c in cols])
        for j, col in enumerate(cols):
            t = col[i]
            if t is None:
                row.append(0)
                continue
            if j in (4, 6):  # group scales: 1-D
                ok_layout = t.is_contiguous()
            else:  # per-element arrays: the parameter's dense layout
                ok_layout = dense(t) and t.stride() == cols[0][i].stride()
            if not ok_layout:
                raise ValueError(
                    f"flashoptim: array {j} of tensor {i} of the bucket has shape"
                    f" {tuple(t.shape)} and strides {t.stride()}; the parameter has"
                    f" {cols[0][i].stride()}: every array must be dense with the parameter's"
                    " strides"
                )
            if t.device != p0.device:
                raise ValueError("all tensors of a step must be on one device")
            es = t.element_size()
            d = t.data_ptr() - bases[j].data_ptr()
            if d % es:
                raise ValueError("tensor storage is not aligned to its element size")
            o = d // es
            ok = o % 16 == 0 and t.data_ptr() % 16 == 0
            aligned = aligned and ok
            if j != 1:  # every column but the gradients' (see rebase_grads)
                aligned_other = aligned_other and ok
            row.append(o)
        row += [cols[0][i].numel(), seeds[i], global_index_base(p)]
        table.append(row)
    tab = torch.tensor(table, dtype=torch.int64)
    owner = torch.arange(len(ps))
    row0 = torch.zeros(len(ps), dtype=torch.int64)
    if rows:
        tab, owner, row0 = _row_entries(ps, tab, present)
        aligned = aligned and bool((tab[:, :7] % 16 == 0).all())
        aligned_other = aligned_other and bool((tab[:, [0, 2, 3, 4, 5, 6]] % 16 == 0).all())
    nw = ((tab[:, 7] + K.CHUNK - 1) // K.CHUNK).tolist()
    tab = tab.to(p0.device)
    tid = torch.repeat_interleave(torch.arange(len(nw)), torch.tensor(nw, dtype=torch.int64))
    starts = torch.tensor([0] + nw[:-1], dtype=torch.int64).cumsum(0)
    first = torch.repeat_interleave(starts, torch.tensor(nw, dtype=torch.int64))
    work = torch.stack([tid, torch.arange(len(tid)) - first], 1)  # tensor, chunk index
    written = [t for j in (0, 2, 3, 4, 5, 6) for t in cols[j] if t is not None]
    return dict(
        work=work.to(torch.int32).contiguous().to(p0.device),
        written=written,  # what autotuning must restore
        tab=tab,
        bases=bases,
        aligned=aligned,
        aligned_other=aligned_other,
        skip=torch.zeros(1, dtype=torch.int32, device=p0.device),
        dtype=p0.dtype,
        n16=bool((tab[:, 7] % 16 == 0).all()),
        ib8=bool((tab[:, 9] % 8 == 0).all()),  # rounding-stream bases (the hoisted draw)
        index64=needs_index64(tab[:, 7].tolist() or [0]),
        rows=rows,
        owner=owner,
        row0=row0,
    )


def _row_entries(ps: list, tab: torch.Tensor, present: list) -> tuple:
    """One table entry per row of each parameter (``build_table``'s ``rows``): every array's
    offset advances by a row (``R`` elements; the group scales by ``ceil(R / 32)``), the
    numel is ``R``, the rounding-stream base advances by ``R``."""
    out, owner, row0 = [], [], []
    for i, p in enumerate(ps):
        r = grid.row_len(p)
        nrows, gpr = grid.scale_shape(local(p))
        step = torch.tensor([r, r, r, r, gpr, r, gpr, 0, 0, r], dtype=torch.int64)
        step[:7] *= torch.tensor(present[i], dtype=torch.int64)
        k = torch.arange(nrows, dtype=torch.int64)[:, None]
        e = tab[i][None, :] + k * step[None, :]
        e[:, 7] = r
        out.append(e)
        owner.append(torch.full((nrows,), i, dtype=torch.int64))
        row0.append(k[:, 0] * r)
    return torch.cat(out), torch.cat(owner), torch.cat(row0)


def rebase_grads(plan: dict, gs: list, gptrs: tuple) -> bool:
    """New gradient tensors, same parameters (FSDP2 and ``zero_grad(set_to_none=True)`` hand
    out fresh ``.grad`` storage every step): rewrite only the gradient column of each
    bucket's offset table instead of rebuilding the plan. ``gs``: the (local) gradients of
    ``plan["ps"]``, ``gptrs`` their addresses. False: rebuild (a gradient changed dtype,
    device or layout). Checks and offsets run over whole lists (C-level ``map``, one torch
    op per bucket), not per parameter in Python."""
    updates = []
    for b in plan["buckets"]:
        ent = b["ent"]
        idx = b["idx"]
        if idx is None:  # the plan's only bucket: every parameter, in order
            bgs, bptrs = gs, gptrs
        else:
            pick = operator.itemgetter(*idx)
            bgs, bptrs = (
                (list(pick(gs)), pick(gptrs)) if len(idx) > 1 else ([gs[idx[0]]], (gptrs[idx[0]],))
            )
        old = ent["bases"][1]
        if (
            set(map(_DTYPE, bgs)) != {old.dtype}
            or set(map(_GET_DEVICE, bgs)) != {old.get_device()}
            or not all(map(_IS_CONTIGUOUS, bgs))  # (a plan with strided parameters: rebuild)
        ):
            return False
        base = bgs[0]
        es = base.element_size()
        ptr = torch.frombuffer(array.array("q", bptrs), dtype=torch.int64)
        d = ptr - bptrs[0]
        if bool((d % es).any()):
            return False
        offs = d // es
        if ent["rows"]:  # one entry per row (grid.split): its parameter's offset + its row
            own, row0 = ent["owner"], ent["row0"]
            ptr, offs = ptr[own] + row0 * es, offs[own] + row0
        aligned = bool(((offs % 16 == 0) & (ptr % 16 == 0)).all())
        updates.append((ent, base, offs, aligned))
    for ent, base, col, aligned in updates:
        if ent["tab"].is_cuda:
            # pinned + non_blocking: no host sync; the caching host allocator keeps the
            # buffer alive until the copy has run on the stream
            col = col.pin_memory()
        ent["tab"][:, 1].copy_(col, non_blocking=True)
        ent["bases"][1] = base
        ent["aligned"] = ent["aligned_other"] and aligned
    return True


def scalar_args(kind: int, hp: dict, step: int) -> tuple:
    """The step's run-time scalars, in the order the step kernel takes them."""
    lr, wd = hp["lr"], hp["wd"]
    b1, b2 = hp.get("b1", 0.0), hp.get("b2", 0.0)
    bc1 = 1 - b1**step if kind == ADAM else 1.0
    bc2 = 1 - b2**step if kind == ADAM else 1.0
    return (
        lr,
        b1,
        1 - b1,
        b2,
        1 - b2,
        hp.get("eps", 0.0),
        wd,
        1 - lr * wd,
        lr / bc1,
        1 / math.sqrt(bc2),
        1 - hp.get("dampening", 0.0),
        1 if step == 1 else 0,
        (step * GOLDEN) & M32,
    )


def mode_flags(kind: int, ent: dict, hp: dict, has_mom: bool) -> dict:
    """The constexpr mode flags of the step kernel."""
    return dict(
        KIND=kind,
        ECC=hp["ecc"],
        QUANT=hp["quant"],
        SR=hp["sr"],
        P_DTYPE=P_CODE[ent["dtype"]],
        DECOUPLED=hp["decoupled"],
        NESTEROV=hp.get("nesterov", False),
        HAS_MOM=has_mom,
        SCALE_F32=hp["scale_dtype"] == torch.float32,
        MAXIMIZE=hp.get("maximize", False),
    )


def launch_prepass(ent: dict, flag: torch.Tensor, mark: int) -> None:
    """The finiteness pre-pass over one bucket's gradients: ``atomic_max(flag, mark)`` if
    any element is inf or NaN."""
    nb = ent["work"].shape[0]
    if nb == 0:
        return
    dev = ent["tab"].device
    nsub = nb * (K.CHUNK // PK.PREPASS_SUB)
    nprog = min(nsub, num_sms(dev) * PK.PREPASS_PER_SM) if dev.type == "cuda" else min(nsub, 3)
    PK._nonfinite_kernel[(nprog,)](
        ent["work"],
        nb,
        ent["tab"],
        ent["bases"][1],
        flag,
        mark,
        ALIGNED=ent["aligned"],
        N16=ent["n16"],
        G_DTYPE=P_CODE[ent["bases"][1].dtype],
        UNIT=K.CHUNK,
        SUB=PK.PREPASS_SUB,
        BLOCK=PK.PREPASS_BLOCK,
        INDEX64=ent["index64"],
        num_warps=4,
    )


def launch_step(ent: dict, scalars: tuple, flags: dict, skip=None, epoch: int = 0) -> None:
    """The step kernel over one bucket: one program per chunk on CUDA (on CPU, under the
    interpreter, 3 programs: the kernel's loop over chunks covers any grid); autotuned on
    CUDA (every written tensor of the bucket restored after the tuning runs), else the
    default config. ``skip``: the device flag the kernel checks against ``epoch`` before any
    write."""
    nunits = ent["work"].shape[0]
    if nunits == 0:
        return
    dev = ent["tab"].device
    grid = (nunits,) if dev.type == "cuda" else (min(nunits, 3),)
    args = (ent["work"], nunits, ent["tab"], *ent["bases"], *scalars)
    args += (ent["skip"] if skip is None else skip, epoch if skip is not None else 0)
    meta = dict(
        **flags,
        ALIGNED=ent["aligned"],
        N16=ent["n16"],
        CHECK_SKIP=skip is not None,
        ASM=use_asm(dev),
        UNIT=K.CHUNK,
        GROUP_SIZE=GROUP,
        DRAW_HOIST=ent["ib8"],
        INDEX64=ent["index64"],
    )
    if _config.autotune(dev):
        K._TUNE["tensors"] = ent["written"]
        try:
            K._step_kernel_tuned[grid](*args, **meta)
        finally:
            if K._TUNE["snap"] is not None:  # tuning raised: undo its runs
                K._tune_pre_hook({}, reset_only=True)
            K._TUNE["tensors"] = ()
        return
    block, pf, warps = _config.DEFAULT_CONFIG
    K._step_kernel[grid](*args, **meta, BLOCK=block, PF=pf, num_warps=warps)
