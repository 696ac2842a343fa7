"""The cases test_distributed.py runs inside spawned gloo worlds (one spawn per world size:
starting processes costs seconds). Each rank builds the same global problem from a seed,
takes its shard, runs the sharded call and compares with the single-process call on the
whole problem (float64, torch backend unless noted). Results go to one JSON file per rank:
``{case: "ok" | traceback}``.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback

import torch
import torch.distributed as dist
from _helpers import clouds

ATOL = RTOL = 1e-10  # float64: the sharded sums and LSE merges differ only in rounding


def _problem(N, M, D, seed, batch=None, dtype=torch.float64):
    """Fresh clouds and weights (the same on every rank: the seed decides)."""
    return clouds(N, M, D, batch=batch, dtype=dtype, seed=seed)


def _close(name, got, want, atol=ATOL, rtol=RTOL):
    if not torch.allclose(got, want, atol=atol, rtol=rtol):
        err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        raise AssertionError(
            f"{name}: max |diff| {err} (shapes {tuple(got.shape)}, {tuple(want.shape)})"
        )


class Ctx:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world
        self.group = dist.group.WORLD
        # uneven shards: the first rank small, the last one large
        self.nx = [5 + 7 * r + (r == world - 1) * 11 for r in range(world)]
        self.ny = [13 - 3 * r + 2 * (r % 2) for r in range(world)]

    def split(self, t, sizes, dim=0):
        return t.narrow(dim, sum(sizes[: self.rank]), sizes[self.rank])


# ----------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------


def case_solve_balanced_weights(c):
    import flashsinkhorn as fs

    N, M = sum(c.nx), sum(c.ny)
    x, y, a, b = _problem(N, M, 3, seed=1)
    from flashsinkhorn import distributed

    # to convergence (the global stopping test) and a fixed number of iterations
    for exchange, chunk, kw in (
        ("gather", None, dict(eps=0.1, tol=1e-9, max_iter=2000)),
        ("stream", 4 * 5 * 8, dict(eps=0.1, tol=None, max_iter=40)),
    ):
        ref = fs.solve(x, y, a, b, **kw)  # 5-row chunks above
        r = fs.solve(
            c.split(x, c.nx),
            c.split(y, c.ny),
            c.split(a, c.nx),
            c.split(b, c.ny),
            process_group=distributed.Sharding(c.group, exchange=exchange, chunk_bytes=chunk),
            **kw,
        )
        assert r.n_iter == ref.n_iter and r.converged == ref.converged, (r.n_iter, ref.n_iter)
        _close(f"{exchange} f", r.f, c.split(ref.f, c.nx))
        _close(f"{exchange} g", r.g, c.split(ref.g, c.ny))
        _close(f"{exchange} value", r.value, ref.value)
        _close(f"{exchange} marginal_error", r.marginal_error, ref.marginal_error, atol=1e-12)
    # the public hook: solve(process_group=...) with uniform (global) default weights
    r = fs.solve(c.split(x, c.nx), c.split(y, c.ny), eps=0.1, tol=1e-9, process_group=c.group)
    ref = fs.solve(x, y, eps=0.1, tol=1e-9)
    _close("uniform f", r.f, c.split(ref.f, c.nx))
    _close("uniform value", r.value, ref.value)


def case_solve_unbalanced_symmetric_eps_scaling(c):
    import flashsinkhorn as fs

    N, M = sum(c.nx), sum(c.ny)
    x, y, a, b = _problem(N, M, 2, seed=2)
    b = 1.7 * b  # unequal masses
    for reach, cost, schedule, scaling in (
        ((0.5, None), "sqeuclidean", "symmetric", 0.6),
        (1.0, "cosine", "alternating", None),
        (0.8, "dot", "alternating", 0.5),
    ):
        kw = dict(
            eps=0.1,
            rho=reach,
            cost=cost,
            schedule=schedule,
            eps_scaling=scaling,
            tol=1e-6,
            max_iter=3000,
        )
        ref = fs.solve(x, y, a, b, **kw)
        r = fs.solve(
            c.split(x, c.nx),
            c.split(y, c.ny),
            c.split(a, c.nx),
            c.split(b, c.ny),
            process_group=c.group,
            **kw,
        )
        assert r.n_iter == ref.n_iter, (cost, r.n_iter, ref.n_iter)
        _close(f"{cost} f", r.f, c.split(ref.f, c.nx))
        _close(f"{cost} g", r.g, c.split(ref.g, c.ny))
        _close(f"{cost} value", r.value, ref.value)


def case_solve_gradients(c):
    import flashsinkhorn as fs

    N, M = sum(c.nx), sum(c.ny)
    for reach in (None, 0.7):
        x, y, a, b = _problem(N, M, 3, seed=3)
        b = b if reach is None else 1.3 * b
        leaves = [t.clone().requires_grad_() for t in (x, y, a, b)]
        fs.solve(*leaves, eps=0.1, rho=reach, tol=1e-10, max_iter=3000).value.backward()
        shards = [
            c.split(t, s).clone().requires_grad_()
            for t, s in zip((x, y, a, b), (c.nx, c.ny, c.nx, c.ny))
        ]
        r = fs.solve(*shards, eps=0.1, rho=reach, tol=1e-10, max_iter=3000, process_group=c.group)
        (2.0 * r.value).backward()
        for name, sh, full, s in zip("xyab", shards, leaves, (c.nx, c.ny, c.nx, c.ny)):
            _close(f"reach={reach} grad {name}", sh.grad, 2.0 * c.split(full.grad, s), atol=1e-9)
    # requires_grad must agree across ranks (backward through the value is collective)
    x, y, a, b = _problem(N, M, 3, seed=4)
    xs = c.split(x, c.nx).clone().requires_grad_(c.rank == 0)
    try:
        fs.solve(
            xs, c.split(y, c.ny), c.split(a, c.nx), c.split(b, c.ny), eps=0.1, process_group=c.group
        )
    except ValueError as e:
        assert "requires_grad" in str(e), str(e)
    else:
        raise AssertionError("no error")


def case_plan_operations(c):
    import flashsinkhorn as fs

    N, M = sum(c.nx), sum(c.ny)
    x, y, a, b = _problem(N, M, 3, seed=5)
    kw = dict(eps=0.2, tol=1e-9)
    ref = fs.solve(x, y, a, b, **kw)
    from flashsinkhorn import distributed

    for exchange, chunk in (("gather", None), ("stream", 3 * 8 * 9)):
        r = fs.solve(
            c.split(x, c.nx),
            c.split(y, c.ny),
            c.split(a, c.nx),
            c.split(b, c.ny),
            process_group=distributed.Sharding(c.group, exchange=exchange, chunk_bytes=chunk),
            **kw,
        )
        gen = torch.Generator().manual_seed(6)
        V = torch.randn(M, 4, generator=gen, dtype=torch.float64)
        U = torch.randn(N, generator=gen, dtype=torch.float64)
        _close("apply", r.apply(c.split(V, c.ny)), c.split(ref.apply(V), c.nx))
        _close(
            "apply_transpose",
            r.apply_transpose(c.split(U, c.nx)),
            c.split(ref.apply_transpose(U), c.ny),
        )
        _close("barycentric_map", r.barycentric_map(), c.split(ref.barycentric_map(), c.nx))
        (rows, cols), (rr, rc) = r.marginals, ref.marginals
        _close("row marginal", rows, c.split(rr, c.nx))
        _close("column marginal", cols, c.split(rc, c.ny))
        _close("plan rows", r.plan, c.split(ref.plan, c.nx))


def case_samples_loss(c):
    import flashsinkhorn as fs

    N, M = sum(c.nx), sum(c.ny)
    for debias, reach, batch in ((True, None, None), (False, 0.5, None), (True, 1.0, 2)):
        x, y, a, b = _problem(N, M, 3, seed=7, batch=batch)
        full = [t.clone().requires_grad_() for t in (a, x, b, y)]
        loss = fs.SamplesLoss(blur=0.1, scaling=0.6, debias=debias, reach=reach)
        loss(*full).sum().backward()
        d = 0 if batch is None else 1
        sizes = (c.nx, c.nx, c.ny, c.ny)
        shards = [c.split(t, s, d).clone().requires_grad_() for t, s in zip((a, x, b, y), sizes)]
        sl = fs.SamplesLoss(
            blur=0.1, scaling=0.6, debias=debias, reach=reach, process_group=c.group
        )
        ref = loss(*full)
        val = sl(*shards)
        _close(f"loss debias={debias} reach={reach}", val, ref.detach())
        _close("last_marginal_error", sl.last_marginal_error, loss.last_marginal_error, atol=1e-12)
        val.sum().backward()
        for name, sh, fl, s in zip("axby", shards, full, sizes):
            _close(f"loss grad {name}", sh.grad, c.split(fl.grad, s, d), atol=1e-12)
    # potentials=True: this rank's potentials
    x, y, a, b = _problem(N, M, 2, seed=8)
    F, G = fs.SamplesLoss(blur=0.1, potentials=True)(a, x, b, y)
    Fs, Gs = fs.SamplesLoss(blur=0.1, potentials=True, process_group=c.group)(
        c.split(a, c.nx), c.split(x, c.nx), c.split(b, c.ny), c.split(y, c.ny)
    )
    _close("potential F", Fs[0], c.split(F[0], c.nx))
    _close("potential G", Gs[0], c.split(G[0], c.ny))


def case_sampling_and_pairs(c):
    import flashsinkhorn as fs
    from flashsinkhorn import distributed

    N, M = sum(c.nx), sum(c.ny)
    x, y, a, b = _problem(N, M, 2, seed=9)
    ref = fs.solve(x, y, a, b, eps=0.05, tol=None, max_iter=30)
    j_ref = fs.sample_plan(ref, seed=123)
    for exchange, chunk in (("gather", None), ("stream", 5 * 8 * 3)):
        r = fs.solve(
            c.split(x, c.nx),
            c.split(y, c.ny),
            c.split(a, c.nx),
            c.split(b, c.ny),
            eps=0.05,
            tol=None,
            max_iter=30,
            process_group=distributed.Sharding(c.group, exchange=exchange, chunk_bytes=chunk),
        )
        j = fs.sample_plan(r, seed=123)
        assert torch.equal(j, c.split(j_ref, c.nx)), (exchange, j, c.split(j_ref, c.nx))
    pairs = distributed.gather_rows(c.split(y, c.ny), j, c.group)
    _close("gather_rows", pairs, y[j])
    idx2 = torch.tensor([[0, M - 1], [c.rank, M // 2]])
    _close(
        "gather_rows 2-D index", distributed.gather_rows(c.split(y, c.ny), idx2, c.group), y[idx2]
    )


def case_subgroup(c):
    """A group of a subset of the ranks (global ranks are not group ranks) and a group of
    one rank (the single-process code: the same bits; a forced exchange still shards)."""
    import flashsinkhorn as fs

    members = list(range(1, c.world)) if c.world > 2 else [1]
    groups = {r: dist.new_group([r]) for r in range(c.world)}  # every rank creates every group
    sub = dist.new_group(members)
    x, y, a, b = _problem(30, 22, 3, seed=10)
    ref = fs.solve(x, y, a, b, eps=0.1, tol=1e-9)
    r = fs.solve(x, y, a, b, eps=0.1, tol=1e-9, process_group=groups[c.rank])
    assert torch.equal(r.f, ref.f) and torch.equal(r.value, ref.value), "world-1: not the same"
    loss = dict(blur=0.3, scaling=0.7)
    one = fs.SamplesLoss(process_group=groups[c.rank], **loss)(a, x, b, y)
    assert torch.equal(one, fs.SamplesLoss(**loss)(a, x, b, y)), "world-1 SamplesLoss"
    from flashsinkhorn import distributed

    r = fs.solve(
        x,
        y,
        a,
        b,
        eps=0.1,
        tol=1e-9,
        process_group=distributed.Sharding(groups[c.rank], exchange="gather"),
    )
    assert isinstance(r._prob, distributed.ShardedProblem)
    _close("world-1 gather f", r.f, ref.f)
    _close("world-1 gather value", r.value, ref.value)
    if c.rank in members:
        k, R = members.index(c.rank), len(members)
        nx = [30 // R + (i < 30 % R) for i in range(R)]
        ny = [22 // R + (i < 22 % R) for i in range(R)]
        sl = (slice(sum(nx[:k]), sum(nx[: k + 1])), slice(sum(ny[:k]), sum(ny[: k + 1])))
        r = fs.solve(
            x[sl[0]],
            y[sl[1]],
            a[sl[0]],
            b[sl[1]],
            eps=0.1,
            tol=1e-9,
            process_group=distributed.Sharding(sub, exchange="stream", chunk_bytes=200),
        )
        _close("subgroup f", r.f, ref.f[sl[0]])
        _close("subgroup value", r.value, ref.value)


def case_errors_are_collective(c):
    """A bad input on one rank raises on every rank (no rank left waiting in a collective),
    and so do arguments or shapes that differ across ranks."""
    import flashsinkhorn as fs

    x, y, a, b = _problem(sum(c.nx), sum(c.ny), 3, seed=11)
    xs, ys = c.split(x, c.nx).clone(), c.split(y, c.ny)
    if c.rank == c.world - 1:
        xs[0, 0] = float("nan")
    for call in (
        lambda: fs.solve(xs, ys, eps=0.1, process_group=c.group),
        lambda: fs.SamplesLoss(process_group=c.group)(xs, ys),
    ):
        try:
            call()
        except ValueError as e:
            want = "non-finite" if c.rank == c.world - 1 else "rank(s)"
            assert want in str(e), str(e)
        else:
            raise AssertionError("no error")
    xs = c.split(x, c.nx)
    checks = [
        (lambda: fs.solve(xs, ys, eps=0.1 + 0.01 * c.rank, process_group=c.group), "eps"),
        (
            lambda: fs.solve(
                xs[:, : 2 + (c.rank == 0)],
                ys[:, : 2 + (c.rank == 0)],
                eps=0.1,
                process_group=c.group,
            ),
            "dimension",
        ),
        (
            lambda: fs.solve(
                xs, ys, c.split(a, c.nx), c.split(b, c.ny) * 2, eps=0.1, process_group=c.group
            ),
            "balanced",
        ),
        (lambda: fs.solve(xs, ys, eps=0.1, process_group="world"), "ProcessGroup"),
    ]
    for call, want in checks:
        try:
            call()
        except (ValueError, TypeError) as e:
            assert want in str(e), (want, str(e))
        else:
            raise AssertionError(f"no error ({want})")


def case_triton_interpreter(c):
    """The Triton kernels (interpreter) under sharding: float32, equal to one process to
    float32 rounding, stream exchange with several chunks, and the sampled draws."""
    from _helpers import INTERPRET

    if not INTERPRET or c.world > 2:  # the interpreter is slow: one world is enough
        return
    import flashsinkhorn as fs
    from flashsinkhorn import distributed

    x, y, a, b = _problem(sum(c.nx), sum(c.ny), 5, seed=12, dtype=torch.float32)
    kw = dict(eps=0.1, tol=None, max_iter=15, backend="triton", precision="ieee")
    ref = fs.solve(x, y, a, b, **kw)
    r = fs.solve(
        c.split(x, c.nx),
        c.split(y, c.ny),
        c.split(a, c.nx),
        c.split(b, c.ny),
        process_group=distributed.Sharding(c.group, exchange="stream", chunk_bytes=6 * 4 * 7),
        **kw,
    )
    _close("triton f", r.f, c.split(ref.f, c.nx), atol=2e-6, rtol=1e-5)
    _close("triton value", r.value, ref.value, atol=1e-6, rtol=1e-5)
    j = fs.sample_plan(r, seed=5)
    j_ref = c.split(fs.sample_plan(ref, seed=5), c.nx)
    assert (j == j_ref).float().mean() > 0.9, (j, j_ref)  # fp32 near-ties may differ


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main(rank, world, port, out_dir, names):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    c = Ctx(rank, world)
    results = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            CASES[name](c)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = traceback.format_exc()
        dist.barrier()
        results[f"{name} seconds"] = round(time.perf_counter() - t0, 2)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()
