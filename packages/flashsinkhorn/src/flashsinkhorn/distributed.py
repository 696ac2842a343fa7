"""flashsinkhorn over torch.distributed: row-sharded Sinkhorn, SamplesLoss and plan
sampling, one global coupling from data spread over the ranks of a process group.

Each rank holds a shard of the points of x (rows) and of y (columns), with their weights;
the global clouds are the shards concatenated in rank order (shards may be uneven). Each
rank computes the potential of its own points; a pass over the columns streams the other
ranks' column operands past its rows:

- ``stream`` (the default for large problems): every rank broadcasts its column shard in
  chunks of at most ``_config.SHARD_CHUNK_BYTES`` (operand rows, the fused column vector
  ``g - cy + eps log b`` and, for plan applications, V), the next chunk in flight while the
  current one is consumed; each chunk's partial LogSumExp (or softmax average, or Gumbel
  argmax) is merged into the running one. Per rank memory: its shards and their kernel
  operands, plus two chunks.
- ``gather`` (when all operands of both clouds fit in one chunk, or for one rank): the
  column operands are all-gathered once per problem, then each pass exchanges only the
  potentials (one all-gather) and runs one kernel over all columns: fewer collectives for
  the small problems of data-parallel training, at no more memory than two chunks.

Communication per Sinkhorn iteration and rank (stream): every other rank's operands of
both clouds, ``(n + m) (R - 1) / R`` rows of ``d`` kernel-dtype values plus one fp32 value
each; gather: ``(n + m) (R - 1) / R`` fp32 values. The convergence test (an all-reduced
marginal error, every ``check_every`` iterations), the value, the certificates and every
error are global: all ranks take the same branch, so no rank waits on a collective that
another one skipped.

The result on each rank is the same coupling as one process computes on the whole clouds,
to float rounding: ``f`` and ``g`` for this rank's points, the global value and marginal
error, gradients to this rank's points. Collective calls: every rank must make them, in
the same order (solve, SamplesLoss, the result's plan operations, backward through
``solve(...).value``, :func:`flashsinkhorn.sample_plan`, :func:`gather_rows`).
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field

import torch

from flashsinkhorn import _config
from flashsinkhorn._inputs import prepare_inputs
from flashsinkhorn.operands import centered_sqnorm, cost_features
from flashsinkhorn.primitives import check_precision, problem_backend, resolve_backend, softmin
from flashsinkhorn.problem import Problem
from flashsinkhorn.reference import LN2
from flashsinkhorn.sampling import BLOCK, DrawMerger, row_keys, sample_chunk
from flashsinkhorn.streaming import StreamingProblem

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover - torch built without distributed
    dist = None

__all__ = [
    "Sharding",
    "Communicator",
    "ShardedProblem",
    "sharding",
    "check_group",
    "collective_errors",
    "features",
    "global_weights",
    "sharded_problem",
    "problem",
    "gather_rows",
]

EXCHANGES = ("auto", "stream", "gather")


# ----------------------------------------------------------------------------------------
# process group, collective errors
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sharding:
    """A process group with the exchange forced: ``process_group=Sharding(group,
    exchange="stream", chunk_bytes=...)`` in :func:`flashsinkhorn.solve` or
    :class:`flashsinkhorn.SamplesLoss` (tests and benchmarks; a plain group is
    ``Sharding(group)``: the exchange chosen by size, a group of one rank runs the
    single-process code)."""

    group: object
    exchange: str = "auto"
    chunk_bytes: int | None = None


def sharding(process_group) -> Sharding:
    """``process_group`` (a ``torch.distributed.ProcessGroup`` or a :class:`Sharding`),
    checked."""
    share = process_group if isinstance(process_group, Sharding) else Sharding(process_group)
    check_group(share.group)
    if share.exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}; got {share.exchange!r}")
    return share


def check_group(group):
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "process_group needs an initialized torch.distributed "
            "(torch.distributed.init_process_group)"
        )
    if group is None or not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed.ProcessGroup (e.g. "
            f"torch.distributed.group.WORLD); got {type(group).__name__}"
        )
    return group


def alone(share: Sharding) -> bool:
    """A group of one rank runs the single-process code (the same result; on the H200 at
    n = m = 1M the sharded path's SamplesLoss took 1.36x as long there): unless a test or
    benchmark forces an exchange."""
    one = dist.get_world_size(share.group) == 1
    return one and share.exchange == "auto" and share.chunk_bytes is None


def comm_device(group):
    """Where this group's collectives take their tensors: the current CUDA device for NCCL."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def collective_errors(group):
    """Run a block of local checks on every rank; if any rank's block raised a ValueError or
    TypeError, raise on every rank (its own error where it failed), so that no rank goes on
    into a collective that the others never reach."""
    err = None
    try:
        yield
    except (ValueError, TypeError) as e:
        err = e
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=comm_device(group))
    flags[dist.get_rank(group)] = err is not None
    dist.all_reduce(flags, group=group)
    if err is not None:
        raise err
    if bool(flags.any()):
        bad = flags.nonzero().flatten().tolist()
        raise ValueError(
            f"flashsinkhorn: the inputs on rank(s) {bad} of the process group are "
            "invalid (see the error raised there)"
        )


def _code(v):
    """A float64 code of an argument that must agree across ranks (None: -1)."""
    if v is None:
        return -1.0
    if isinstance(v, str):
        return float(zlib.crc32(v.encode()))
    if isinstance(v, (tuple, list)):
        return float(zlib.crc32(repr(tuple(v)).encode()))
    return float(v)


# ----------------------------------------------------------------------------------------
# the communicator of one call
# ----------------------------------------------------------------------------------------


class Communicator:
    """One sharded call: the group, every rank's shard sizes of the clouds ``"x"`` and
    ``"y"``, the exchange (stream or gather) and the gathered operands (gather)."""

    def __init__(self, group, sizes, device, exchange, chunk_bytes):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.sizes = sizes
        self.offsets = {k: [sum(v[:r]) for r in range(len(v) + 1)] for k, v in sizes.items()}
        self.device = device
        self.exchange = exchange
        self.chunk_bytes = chunk_bytes
        self._gathered = {}

    @classmethod
    def create(cls, group, x3, y3, agree, exchange="auto", chunk_bytes=None):
        """Exchange the shard sizes and check that the shapes, dtypes, devices and the
        arguments ``agree`` (name -> value) are the same on every rank."""
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}; got {exchange!r}")
        device = x3.device
        meta = {
            "batch": x3.shape[0],
            "dimension D": x3.shape[2],
            "dtype": str(x3.dtype),
            "device type": device.type,
            **agree,
        }
        local = [x3.shape[1], y3.shape[1]] + [_code(v) for v in meta.values()]
        t = torch.tensor(local, dtype=torch.float64, device=comm_device(group))
        world = dist.get_world_size(group)
        allv = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(allv, t, group=group)
        allv = torch.stack(allv).cpu()
        for k, name in enumerate(meta):
            col = allv[:, 2 + k]
            if not bool((col == col[0]).all()):
                raise ValueError(
                    f"process_group: {name} differs across ranks (this rank: "
                    f"{meta[name]!r}); every rank must pass the same"
                )
        sizes = {"x": [int(v) for v in allv[:, 0]], "y": [int(v) for v in allv[:, 1]]}
        chunk = int(chunk_bytes or _config.SHARD_CHUNK_BYTES)
        if exchange == "auto":
            D = x3.shape[2]
            total = x3.shape[0] * (sum(sizes["x"]) + sum(sizes["y"])) * D * 4
            exchange = "gather" if world == 1 or total <= chunk else "stream"
        return cls(group, sizes, device, exchange, chunk)

    # collectives ----------------------------------------------------------------------

    def total(self, t):
        """``t.sum(-1)`` summed over the ranks."""
        s = t.sum(-1).contiguous()
        if self.world > 1:
            dist.all_reduce(s, group=self.group)
        return s

    def peak(self, t):
        """``t.amax(-1)`` over the ranks."""
        s = t.amax(-1).contiguous()
        if self.world > 1:
            dist.all_reduce(s, op=dist.ReduceOp.MAX, group=self.group)
        return s

    def any(self, flags):
        """Each flag OR-ed over the ranks."""
        t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=self.device)
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(bool(v) for v in t.tolist())

    def center(self, X, Y):
        """The common mean (B, D) of both global clouds."""
        s = (X.sum(-2) + Y.sum(-2)).contiguous()
        if self.world > 1:
            dist.all_reduce(s, group=self.group)
        return s / (sum(self.sizes["x"]) + sum(self.sizes["y"]))

    def diameter(self, X, Y):
        """Diagonal of the bounding box of both global clouds (as GeomLoss's default)."""
        D = X.shape[-1]
        Xf, Yf = X.detach().reshape(-1, D), Y.detach().reshape(-1, D)
        lo = torch.minimum(Xf.amin(0), Yf.amin(0)).contiguous()
        hi = torch.maximum(Xf.amax(0), Yf.amax(0)).contiguous()
        if self.world > 1:
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.group)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
        return float((hi - lo).norm())

    def gather(self, key, t):
        """The global tensor (B, n, ...) of a cloud-indexed local shard (B, n_r, ...)."""
        if self.world == 1:
            return t
        sizes = self.sizes[key]
        pad = list(t.shape)
        pad[1] = max(sizes)
        buf = t.new_zeros(pad)
        buf[:, : t.shape[1]] = t
        parts = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(parts, buf, group=self.group)
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

    def check_v(self, v):
        """A pass with V: its width and dtype must agree (they size the exchanged chunks)."""
        code = torch.tensor(
            [v.shape[-1], _code(str(v.dtype))], dtype=torch.float64, device=comm_device(self.group)
        )
        lo, hi = code.clone(), code.clone()
        if self.world > 1:
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.group)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
        if not torch.equal(lo, hi):
            raise ValueError(
                f"a plan operation's V differs in width or dtype across ranks "
                f"(this rank: {tuple(v.shape)} {v.dtype})"
            )

    # the column stream ----------------------------------------------------------------

    def for_each_chunk(self, key, ops, h, v, fn):
        """Call ``fn(col_offset, ops_c, h_c, v_c)`` for the chunks of the global column cloud
        ``key``, in global order: ``ops`` (B, n_r, D) this rank's kernel operands, ``h``
        (B, n_r) its fused column vector, ``v`` (B, n_r, DV) or None."""
        if self.exchange == "gather":
            # one gathered copy per operand tensor (the float64 certificate's problem and a
            # tf32x3 polish have their own operands next to the loop's)
            ck = (key, ops.dtype, ops.data_ptr())
            if ck not in self._gathered:
                self._gathered[ck] = self.gather(key, ops)
            V = None if v is None else self.gather(key, v)
            fn(0, self._gathered[ck], self.gather(key, h), V)
            return
        B = ops.shape[0]
        row_bytes = B * (ops.shape[2] * ops.element_size() + h.element_size())
        if v is not None:
            row_bytes += B * v.shape[2] * v.element_size()
        rows = max(1, self.chunk_bytes // row_bytes)
        sizes, offs = self.sizes[key], self.offsets[key]
        steps = [
            (s, i0, min(i0 + rows, sizes[s]))
            for s in range(self.world)
            for i0 in range(0, sizes[s], rows)
        ]
        pending = self._post(steps[0], ops, h, v)
        for k, (s, i0, _) in enumerate(steps):
            bufs, works = pending
            for w in works:
                w.wait()
            # the next chunk is in flight while this one is consumed (two chunks alive)
            pending = self._post(steps[k + 1], ops, h, v) if k + 1 < len(steps) else None
            fn(offs[s] + i0, *bufs)
            del bufs

    def _post(self, step, ops, h, v):
        """Start the broadcast of one chunk from its owner: ``(buffers, works)``."""
        s, i0, i1 = step
        if s == self.rank:
            bufs = [t[:, i0:i1].contiguous() if t is not None else None for t in (ops, h, v)]
        else:
            n = i1 - i0
            bufs = [
                ops.new_empty((ops.shape[0], n, ops.shape[2])),
                h.new_empty((h.shape[0], n)),
                None if v is None else v.new_empty((v.shape[0], n, v.shape[2])),
            ]
        works = []
        if self.world > 1:
            src = dist.get_global_rank(self.group, s)
            works = [
                dist.broadcast(t, src=src, group=self.group, async_op=True)
                for t in bufs
                if t is not None
            ]
        return bufs, works

    def problem(self, keys=("x", "y"), **kwargs):
        """A :class:`ShardedProblem` of this call (keyword arguments of the problem)."""
        return ShardedProblem(comm=self, keys=keys, **kwargs)


def _merge(lse, vbar, lse_c, vbar_c):
    """Running merge of a chunk's row LogSumExp (log2) and softmax average into the total."""
    if lse is None:
        return lse_c, vbar_c
    m = torch.maximum(lse, lse_c)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w0, w1 = torch.exp2(lse - m), torch.exp2(lse_c - m)
    tot = w0 + w1
    if vbar is not None:
        # a chunk without mass for a row (weight 0) has a 0/0 average: it does not count
        a0 = torch.where(w0 > 0, w0 / tot, torch.zeros_like(w0))[..., None]
        a1 = torch.where(w1 > 0, w1 / tot, torch.zeros_like(w1))[..., None]
        vbar = torch.nan_to_num(vbar, nan=0.0) * a0 + torch.nan_to_num(vbar_c, nan=0.0) * a1
        vbar = torch.where((tot > 0)[..., None], vbar, torch.full_like(vbar, float("nan")))
    return m + torch.log2(tot), vbar


# ----------------------------------------------------------------------------------------
# the sharded problem: the same Problem, its passes over the global columns
# ----------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ShardedProblem(StreamingProblem):
    """A :class:`flashsinkhorn.solver.Problem` of this rank's shards (X, a, cx: its rows of
    x; Y, b, cy: its rows of y) whose passes run over the global clouds and whose sums are
    global. ``keys`` name the row and column clouds in ``comm`` (``("x", "x")`` for the
    debiasing term OT(a, a))."""

    kind = "sharded"

    comm: Communicator = field(default=None, repr=False)
    keys: tuple = ("x", "y")

    # two sharded passes (the one-pass kernels see one rank's columns only)
    sym_update = Problem.sym_update

    def total(self, t, side="x"):
        return self.comm.total(t)

    def peak(self, t, side="x"):
        return self.comm.peak(t)

    def any_rank(self, flags):
        return self.comm.any(flags)

    def _pass(self, rows, rcx, col_key, cols, g, logw, ccy, eps, damping, v, want_lse, guess):
        if self.labels is not None:  # pragma: no cover - rejected when the problem is built
            raise NotImplementedError("label costs are not sharded")
        if v is not None:
            self.comm.check_v(v)
        h = (g - ccy) + eps * logw  # the column vector: log b_j + (g_j - cy_j) / eps, times eps
        acc = {"lse": None, "vbar": None}

        def consume(_, cols_c, h_c, v_c):
            z = torch.zeros_like(h_c)
            _, lse_c, vbar_c = softmin(
                rows,
                cols_c,
                h_c,
                z,
                rcx,
                z,
                eps=eps,
                c2=self.c2,
                damping=damping,
                v=v_c,
                precision=self.precision,
                backend=self.backend,
                want_lse=True,
                guess=guess,
            )
            acc["lse"], acc["vbar"] = _merge(acc["lse"], acc["vbar"], lse_c, vbar_c)

        self.comm.for_each_chunk(col_key, cols, h, v, consume)
        lse = acc["lse"]
        out = damping * (rcx.to(lse.dtype) - (eps * LN2) * lse)
        return out, (lse if want_lse else None), acc["vbar"]

    def sm_x(self, g, eps, damping=1.0, v=None, want_lse=False, guess=None):
        return self._pass(
            self.Xk,
            self.cx,
            self.keys[1],
            self.Yk,
            g,
            self.logb,
            self.cy,
            eps,
            damping,
            v,
            want_lse,
            guess,
        )

    def sm_y(self, f, eps, damping=1.0, v=None, want_lse=False, guess=None):
        return self._pass(
            self.Yk,
            self.cy,
            self.keys[0],
            self.Xk,
            f,
            self.loga,
            self.cx,
            eps,
            damping,
            v,
            want_lse,
            guess,
        )

    # the debiasing update (rows and columns the same cloud): a plain sharded pass
    self_update = Problem.self_update

    def self_problem(self, side):
        """The debiasing problem of one cloud: rows and columns are that cloud's shards."""
        p = StreamingProblem.self_problem(self, side)
        key = self.keys[0] if side == "x" else self.keys[1]
        p.keys = (key, key)
        return p

    def dense_plan(self, f, g, eps):
        """This rank's rows of the dense plan (B, N_r, M): tests and small problems only."""
        cols = dict(
            Y=self.comm.gather(self.keys[1], self.Y),
            g=self.comm.gather(self.keys[1], g),
            b=self.comm.gather(self.keys[1], self.b),
            cy=self.comm.gather(self.keys[1], self.cy),
        )
        return StreamingProblem.dense_plan(self, f, g, eps, columns=cols)

    def sample_rows(self, g, eps, seed, guess=None):
        """:func:`flashsinkhorn.sample_plan` for this rank's rows: global column indices.
        The column chunks' draws are merged in column order (blocks cut by a chunk boundary
        assembled first): the same draws as one process. ``guess`` (the whole row's) is not
        a chunk's: unused."""
        h = (g - self.cy) + eps * self.logb
        row0 = self.comm.offsets[self.keys[0]][self.comm.rank]
        M = sum(self.comm.sizes[self.keys[1]])
        B, n = self.Xk.shape[0], self.Xk.shape[1]
        merger = DrawMerger(row_keys(B, n, seed, row0, self.Xk.device), seed)

        def consume(col0, cols_c, h_c, _):
            z = torch.zeros_like(h_c)
            c1 = col0 + h_c.shape[1]
            draw = sample_chunk(
                self.Xk,
                cols_c,
                h_c,
                z,
                z,
                eps=eps,
                c2=self.c2,
                seed=seed,
                precision=self.precision,
                backend=self.backend,
                row_offset=row0,
                col_offset=col0,
                first_complete=col0 % BLOCK == 0,
                last_complete=c1 % BLOCK == 0 or c1 == M,
            )
            merger.add(draw)

        self.comm.for_each_chunk(self.keys[1], self.Yk, h, None, consume)
        return merger.result()[0]


# ----------------------------------------------------------------------------------------
# entry points (called by solve / SamplesLoss with process_group=...)
# ----------------------------------------------------------------------------------------


def features(comm, x3, y3, cost, cost_scale):
    """:func:`flashsinkhorn.operands.cost_features` with the global common center."""
    X, Y, cx, cy, c2, _ = cost_features(x3, y3, cost, cost_scale, center=False)
    if cost == "dot":
        return X, Y, cx, cy, c2, None
    Xd, Yd = X.detach(), Y.detach()
    c = comm.center(Xd, Yd)
    k = 0.5 * c2  # cx = (c2 / 2) |X - c|^2 for the squared-Euclidean and cosine costs
    return X, Y, k * centered_sqnorm(Xd, c), k * centered_sqnorm(Yd, c), c2, c


def sharded_problem(comm, X, Y, a, b, cx, cy, c2, cost, cost_scale, precision, backend, center):
    """The sharded problem of this rank's features (detached)."""
    return comm.problem(
        X=X.detach(),
        Y=Y.detach(),
        a=a.detach(),
        b=b.detach(),
        cx=cx.detach(),
        cy=cy.detach(),
        c2=c2,
        cost=cost,
        cost_scale=cost_scale,
        precision=precision,
        backend=backend,
        center=center,
    )


def global_weights(comm, a2, b2, a, b):
    """Default weights are uniform over the GLOBAL clouds (prepare_inputs made 1/n_r)."""
    if a is None:
        a2 = torch.full_like(a2, 1.0 / sum(comm.sizes["x"]))
    if b is None:
        b2 = torch.full_like(b2, 1.0 / sum(comm.sizes["y"]))
    return a2, b2


def problem(
    x,
    y,
    a=None,
    b=None,
    *,
    process_group,
    cost="sqeuclidean",
    cost_scale=1.0,
    precision="tf32",
    backend="auto",
    exchange="auto",
    chunk_bytes=None,
):
    """The sharded problem of this rank's shards: the building block of the sharded solve
    (its ``sm_x(g, eps, ...)`` / ``sm_y(f, eps, ...)`` are the Sinkhorn half-updates over
    all ranks, ``total`` the global sum). For benchmarks and custom loops; x, y (N_r, D)
    or (B, N_r, D), weights default to uniform over the global clouds."""
    group = check_group(process_group)
    with collective_errors(group):
        x3, y3, a2, b2, _ = prepare_inputs(x, y, a, b)
        check_device(group, x3)
        be = problem_backend(backend, x3.device, x3.dtype)  # as solve
        check_precision(precision, resolve_backend(backend, x3.device))
    agree = dict(
        cost=cost,
        cost_scale=cost_scale,
        precision=precision,
        backend=backend,
        weights=(a is None, b is None),
        exchange=exchange,
        chunk_bytes=chunk_bytes,
    )
    comm = Communicator.create(group, x3, y3, agree, exchange, chunk_bytes)
    a2, b2 = global_weights(comm, a2, b2, a, b)
    X, Y, cx, cy, c2, center = features(comm, x3, y3, cost, cost_scale)
    return sharded_problem(comm, X, Y, a2, b2, cx, cy, c2, cost, cost_scale, precision, be, center)


def check_device(group, x3):
    backend = str(dist.get_backend(group))
    if x3.device.type == "cuda" and backend == "gloo":
        raise ValueError("a gloo process group takes CPU tensors; use NCCL for CUDA tensors")
    if x3.device.type != "cuda" and backend == "nccl":
        raise ValueError(
            f"an NCCL process group takes CUDA tensors; got {x3.device} (use gloo on CPU)"
        )


# ----------------------------------------------------------------------------------------
# rows of a sharded tensor by global index
# ----------------------------------------------------------------------------------------


def gather_rows(local: torch.Tensor, index: torch.Tensor, process_group) -> torch.Tensor:
    """Rows of a tensor sharded over the ranks in rank order, by global row index.

    ``local`` (n_r, ...): this rank's rows; ``index``: int64 global indices (any shape, into
    the concatenation of all ranks' rows). Returns ``index.shape + local.shape[1:]``. Two
    all-to-all exchanges (the requests, then the rows): each rank receives only the rows it
    asked for. The OT flow-matching pairs of a sharded coupling:
    ``y_pair = gather_rows(y_local, sample_plan(result, seed=s), group)``.
    """
    group = check_group(process_group)
    with collective_errors(group):
        if not isinstance(local, torch.Tensor) or local.dim() < 1:
            raise ValueError("gather_rows: local must be a tensor of rows (n_r, ...)")
        if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int32, torch.int64):
            raise ValueError("gather_rows: index must be an integer tensor of global row indices")
    world = dist.get_world_size(group)
    dev = local.device
    n = torch.tensor([local.shape[0]], dtype=torch.int64, device=comm_device(group))
    sizes = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    sizes = [int(s) for s in sizes]
    ends = torch.tensor(sizes, device=dev).cumsum(0)
    flat = index.reshape(-1).to(device=dev, dtype=torch.int64)
    total = int(ends[-1])
    with collective_errors(group):
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= total):
            raise ValueError(f"gather_rows: index must lie in [0, {total}) (the global rows)")
    owner = torch.searchsorted(ends, flat, right=True)
    order = torch.argsort(owner, stable=True)
    starts = ends - torch.tensor(sizes, device=dev)
    want = flat[order] - starts[owner[order]]  # local row indices on their owners
    send_counts = torch.bincount(owner, minlength=world).to(comm_device(group))
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_counts, recv_counts = send_counts.tolist(), recv_counts.tolist()
    asked = want.new_empty(sum(recv_counts))
    dist.all_to_all_single(asked, want, recv_counts, send_counts, group=group)
    rows = local[asked].contiguous()
    got = local.new_empty((flat.numel(), *local.shape[1:]))
    dist.all_to_all_single(got, rows, send_counts, recv_counts, group=group)
    out = torch.empty_like(got)
    out[order] = got
    return out.reshape(*index.shape, *local.shape[1:])
