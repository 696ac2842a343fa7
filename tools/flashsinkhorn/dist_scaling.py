"""Multi-GPU scaling of flashsinkhorn's sharded Sinkhorn: one command for the K-GPU run.

    # on a host with K GPUs (NCCL; NVLink multicast off, as the device documentation says):
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    PYTHONPATH=packages/flashsinkhorn/src torchrun --nproc_per_node 2 \\
        tools/flashsinkhorn/dist_scaling.py --out OUT
    # per-rank peak memory of 2 ranks on a host with one GPU (gloo; times not meaningful):
    PYTHONPATH=packages/flashsinkhorn/src torchrun --nproc_per_node 2 \\
        tools/flashsinkhorn/dist_scaling.py --gloo-cuda --sizes 1048576 --out OUT
    # the one-GPU dry run (every case at small sizes, < 2 minutes on one H200):
    PYTHONPATH=packages/flashsinkhorn/src torchrun --nproc_per_node 1 \\
        tools/flashsinkhorn/dist_scaling.py --dry-run --out OUT
    # the logic on a CPU (gloo, tiny sizes; a test runs it):
    PYTHONPATH=packages/flashsinkhorn/src torchrun --nproc_per_node 2 \\
        tools/flashsinkhorn/dist_scaling.py --cpu --dry-run --out OUT

Cases, each at n = m (default 1M and 4M), d = 64, x, y uniform in ``[0, 1/sqrt(d)]^d`` with
y shifted by ``0.5/sqrt(d)`` (the package benchmark's problem), eps = 0.05, tf32:

- ``dist_iteration``: one symmetric fixed-eps Sinkhorn iteration (both half-updates), as
  ``(t(k2 iterations) - t(k1)) / (k2 - k1)``: ``ours`` on one GPU (``process_group=None``,
  rank 0 alone), ``ours-sharded`` over the K ranks (the exchange ``auto`` picks), and
  ``ours-sharded-stream`` (the chunked exchange forced, also at one rank: what chunking
  costs). Per-rank peak memory (everything allocated, inputs included, and beyond the
  inputs), the scaling efficiency ``t_1 / (K t_K)``, and the value after k2 iterations
  relative to the one-GPU value.
- ``dist_samples_loss``: ``SamplesLoss(blur=sqrt(eps), scaling=0.5, debias=False)`` forward,
  one GPU against K ranks; time per iteration = time / (passes / 2); value agreement.
- ``dist_sample_plan``: plan sampling with the global coupling (the potentials after the
  k2 iterations), one GPU against K ranks: the fraction of identical draws, the time
  against one iteration.
- ``dist_flow_matching``: the data-parallel OT flow-matching example
  (packages/flashsinkhorn/examples/dp_flow_matching.py), global against per-rank couplings
  (at the fixed tile config: ``FLASHSINKHORN_NO_AUTOTUNE=1`` is set while it runs).

JSON (kernel-bench/1 rows, written after every row) to ``OUT/bench-dist.json``; a markdown
table is printed last. A case that would start after ``--budget`` seconds is recorded as
skipped, so a time limit keeps what finished.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

import flashsinkhorn as fs
from flashsinkhorn import _harness as H
from flashsinkhorn import distributed as D
from flashsinkhorn.bench import _problem
from flashsinkhorn.operands import centered_sqnorm, common_center
from flashsinkhorn.reference import eps_schedule, max_diameter
from flashsinkhorn.streaming import StreamingProblem

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "packages" / "flashsinkhorn" / "examples" / "dp_flow_matching.py"
D_FEAT, EPS = 64, 0.05


DEV = torch.device("cpu")  # set by main: the rank's GPU, or the CPU with --cpu


def _sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, group):
    """Wall time of ``fn()`` on every rank (CUDA-synchronized), the slowest rank's; the
    ranks start together."""
    if group is not None:
        dist.barrier(group)
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    dt = torch.tensor([time.perf_counter() - t0], device=DEV, dtype=torch.float64)
    if group is not None:
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
    return float(dt) * 1e3, out


def _shard(t, rank, world):
    n = t.shape[0]
    sizes = [n // world + (r < n % world) for r in range(world)]
    lo = sum(sizes[:rank])
    return t[lo : lo + sizes[rank]]


def _plain_problem(x, y):
    """The one-GPU Problem solve builds (uniform weights, |x - y|^2, tf32)."""
    x3, y3 = x[None], y[None]
    N, M = x3.shape[1], y3.shape[1]
    a = torch.full((1, N), 1.0 / N, device=x.device)
    b = torch.full((1, M), 1.0 / M, device=x.device)
    c = common_center(x3, y3)
    cx, cy = centered_sqnorm(x3, c), centered_sqnorm(y3, c)
    return StreamingProblem(X=x3, Y=y3, a=a, b=b, cx=cx, cy=cy, c2=2.0, center=c)


def _iterate(prob, k):
    """k symmetric fixed-eps iterations from zero potentials (the loop's passes)."""
    f = torch.zeros_like(prob.cx)
    g = torch.zeros_like(prob.cy)
    for it in range(k):
        gf, gg = (f, g) if it > 0 else (None, None)
        ft = prob.sm_x(g, EPS, guess=gf)[0]
        gt = prob.sm_y(f, EPS, guess=gg)[0]
        f, g = 0.5 * (f + ft), 0.5 * (g + gt)
    return f, g


def _mem_reset():
    if DEV.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peaks(base, group):
    """(peak total MiB, peak beyond ``base`` MiB) of every rank (NaN on a CPU)."""
    peak = torch.cuda.max_memory_allocated() if DEV.type == "cuda" else float("nan")
    t = torch.tensor([peak / 2**20, (peak - base) / 2**20], device=DEV, dtype=torch.float64)
    if group is None:
        return [t.tolist()]
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.tolist() for o in out]


class Run:
    def __init__(self, args, rank, world, group):
        self.args, self.rank, self.world, self.group = args, rank, world, group
        self.t0 = time.time()
        self.R = H.Results("flashsinkhorn", fs.__version__, DEV)
        argv = " ".join(sys.argv[1:])
        self.R.command = f"torchrun --nproc_per_node {world} {Path(__file__).name} {argv}"
        if rank == 0:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            self.R.save(os.path.join(args.out, "bench-dist.json"))
        self.one_peak = {}  # n -> the one-GPU peak (MiB)
        self.per_iteration = {}  # n -> (one GPU, K ranks) ms per iteration

    def over_budget(self, name, params, estimate_s=None):
        """Skip a case that would start after ``--budget`` seconds, or (with an estimate of
        its duration) end after it; rank 0 decides for every rank."""
        end = time.time() - self.t0 + (estimate_s or 0.0)
        late = torch.tensor([end > self.args.budget], device=DEV)
        dist.broadcast(late, 0, group=self.group)
        if bool(late):
            est = "" if estimate_s is None else f" (estimated {estimate_s:.0f} s)"
            self.add(
                name,
                "ours",
                params,
                status="skipped",
                error=f"time budget {self.args.budget:.0f} s{est}",
            )
        return bool(late)

    def add(self, bench, provider, params, **kw):
        if self.rank == 0:
            self.R.add(bench, provider, "fwd", dict(params, ranks=kw.pop("ranks", 1)), **kw)
            print(
                f"[dist {time.time() - self.t0:6.1f} s] {bench} {provider} {params} "
                f"{kw.get('timing', {}).get('time_ms', '')} {kw.get('status', '')}",
                flush=True,
            )

    def clouds(self, n):
        x, y = _problem(n, n, D_FEAT, "cpu", seed=0)  # the same global problem on every rank
        return x, y

    # ----------------------------------------------------------------------------------
    def iteration(self, n):
        """Iterations (and plan sampling from the potentials they reach) on one GPU, then
        over the K ranks."""
        params = {"n": n, "m": n, "d": D_FEAT, "eps": EPS, "dtype": "float32"}
        k1, k2, seed = self.args.k1, self.args.k2, 12345
        x, y = self.clouds(n)
        # one GPU: rank 0 alone, the plain path (process_group=None)
        res1 = torch.zeros(3, device=DEV, dtype=torch.float64)  # per iteration, value, sample
        j1 = None
        if self.rank == 0:
            xg, yg = x.to(DEV), y.to(DEV)
            base = _mem_reset()
            prob = _plain_problem(xg, yg)
            ta, _ = _timed(partial(_iterate, prob, k1), None)
            tb, (f, g) = _timed(partial(_iterate, prob, k2), None)
            value = float((prob.a * f).sum() + (prob.b * g).sum())
            per = (tb - ta) / (k2 - k1)
            peak = _peaks(base, None)
            draw = partial(
                fs.softmax_sample,
                prob.Xk,
                prob.Yk,
                g,
                prob.logb,
                prob.cy,
                eps=EPS,
                c2=prob.c2,
                seed=seed,
            )
            ts, j1 = _timed(draw, None)
            res1 = torch.tensor([per, value, ts], device=DEV, dtype=torch.float64)
            self.one_peak[n] = peak[0][0]
            self.add(
                "dist_iteration",
                "ours",
                params,
                timing={"time_ms": per},
                metrics={
                    "peak_mib_per_rank": [p[0] for p in peak],
                    "peak_extra_mib_per_rank": [p[1] for p in peak],
                    "value": value,
                    f"time_ms_{k2}_iters": tb,
                },
            )
            self.add(
                "dist_sample_plan",
                "ours",
                params,
                timing={"time_ms": ts},
                metrics={"ratio_to_one_iteration": ts / per, "iterations": k2},
            )
            j1 = j1[0].cpu()
            del prob, xg, yg, f, g, draw
        dist.broadcast(res1, 0, group=self.group)
        per1, value1, ts1 = res1.tolist()
        xs, ys = _shard(x, self.rank, self.world).to(DEV), _shard(y, self.rank, self.world).to(DEV)
        exchanges = ["auto"] + (["stream"] if self.args.stream_rows else [])
        auto_exchange = None
        for exchange in exchanges:
            if exchange == "stream" and auto_exchange == "stream":
                break  # "auto" streamed already
            base = _mem_reset()
            prob = D.problem(xs, ys, process_group=self.group, exchange=exchange)
            auto_exchange = auto_exchange or prob.comm.exchange
            name = "ours-sharded" if exchange == "auto" else "ours-sharded-stream"
            _iterate(prob, 1)  # first-pass costs out of t(k1) (it gave t(2) < t(1) at 1M)
            ta, _ = _timed(partial(_iterate, prob, k1), self.group)
            tb, (f, g) = _timed(partial(_iterate, prob, k2), self.group)
            value = float(prob.total(prob.a * f) + prob.total(prob.b * g, "y"))
            per = (tb - ta) / (k2 - k1)
            peak = _peaks(base, self.group)
            one_peak = self.one_peak.get(n)
            self.per_iteration[n] = (per1, per)
            self.add(
                "dist_iteration",
                name,
                params,
                ranks=self.world,
                timing={"time_ms": per},
                metrics={
                    "efficiency": per1 / (self.world * per),
                    "value": value,
                    "value_rel_diff": abs(value - value1) / abs(value1),
                    "exchange": prob.comm.exchange,
                    "peak_mib_per_rank": [p[0] for p in peak],
                    "peak_extra_mib_per_rank": [p[1] for p in peak],
                    "peak_ratio_to_one_gpu": (
                        max(p[0] for p in peak) / one_peak if one_peak else None
                    ),
                    f"time_ms_{k2}_iters": tb,
                },
            )
            if exchange == "auto":
                ts, j = _timed(partial(prob.sample_rows, g, EPS, seed), self.group)
                allj = prob.comm.gather("x", j)[0].cpu()  # every rank's draws
                same = float((allj == j1).float().mean()) if self.rank == 0 else None
                self.add(
                    "dist_sample_plan",
                    "ours-sharded",
                    params,
                    ranks=self.world,
                    timing={"time_ms": ts},
                    metrics={
                        "same_draws_as_one_gpu": same,
                        "iterations": k2,
                        "efficiency": ts1 / (self.world * ts),
                        "ratio_to_one_iteration": ts / per,
                    },
                )
            del prob, f, g
        del xs, ys

    def estimate_s(self, case, n):
        """Seconds a case will take, from the iteration times measured at the largest
        smaller size (scaled by the n^2 work), or None."""
        known = [m for m in self.per_iteration if m <= n]
        if not known:
            return None
        m = max(known)
        per1, perK = (t * (n / m) ** 2 / 1e3 for t in self.per_iteration[m])
        if case == "iteration":  # k1 + k2 iterations each side, plus one sampling pass
            return (self.args.k1 + self.args.k2 + 1) * (per1 + perK)
        return self.loss_iterations(n) * (per1 + perK)

    def loss_iterations(self, n):
        x, y = self.clouds(min(n, 4096))  # the same bounding box at any n (uniform clouds)
        return len(eps_schedule(max_diameter(x, y) ** 2, EPS, 0.5)) + 2

    # ----------------------------------------------------------------------------------
    def samples_loss(self, n):
        blur = math.sqrt(EPS)
        params = {"n": n, "m": n, "d": D_FEAT, "blur": blur, "scaling": 0.5, "debias": False}
        x, y = self.clouds(n)
        iters = len(eps_schedule(max_diameter(x, y) ** 2, blur**2, 0.5)) + 2
        res1 = torch.zeros(2, device=DEV, dtype=torch.float64)
        loss = fs.SamplesLoss(blur=blur, scaling=0.5, debias=False)
        if self.rank == 0:
            xg, yg = x.to(DEV), y.to(DEV)
            base = _mem_reset()
            with torch.no_grad():
                t, v = _timed(partial(loss, xg, yg), None)
            peak = _peaks(base, None)
            res1 = torch.tensor([t, float(v)], device=DEV, dtype=torch.float64)
            self.add(
                "dist_samples_loss",
                "ours",
                params,
                timing={"time_ms": t},
                metrics={
                    "time_ms_per_iteration": t / iters,
                    "value": float(v),
                    "peak_mib_per_rank": [p[0] for p in peak],
                },
            )
            del xg, yg
        dist.broadcast(res1, 0, group=self.group)
        t1, v1 = res1.tolist()
        xs, ys = _shard(x, self.rank, self.world).to(DEV), _shard(y, self.rank, self.world).to(DEV)
        sl = fs.SamplesLoss(blur=blur, scaling=0.5, debias=False, process_group=self.group)
        base = _mem_reset()
        with torch.no_grad():
            t, v = _timed(partial(sl, xs, ys), self.group)
        peak = _peaks(base, self.group)
        self.add(
            "dist_samples_loss",
            "ours-sharded",
            params,
            ranks=self.world,
            timing={"time_ms": t},
            metrics={
                "time_ms_per_iteration": t / iters,
                "efficiency": t1 / (self.world * t),
                "value": float(v),
                "value_rel_diff": abs(float(v) - v1) / abs(v1),
                "peak_mib_per_rank": [p[0] for p in peak],
            },
        )

    # ----------------------------------------------------------------------------------
    def flow_matching(self):
        spec = importlib.util.spec_from_file_location("dp_flow_matching", EXAMPLE)
        ex = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ex)
        # the example's small d = 2 kernels at the one fixed config: no autotuning compiles
        # (its timing is not a kernel benchmark); the switch is read at each launch
        before = os.environ.get("FLASHSINKHORN_NO_AUTOTUNE")
        os.environ["FLASHSINKHORN_NO_AUTOTUNE"] = "1"
        try:
            for coupling in ("global", "local"):
                params = {
                    "coupling": coupling,
                    "steps": self.args.fm_steps,
                    "batch_per_rank": self.args.fm_batch,
                }
                if self.over_budget("dist_flow_matching", params):
                    continue
                row = ex.train(
                    self.group,
                    DEV,
                    coupling,
                    steps=self.args.fm_steps,
                    batch=self.args.fm_batch,
                    n_eval=self.args.fm_eval,
                )
                self.add(
                    "dist_flow_matching",
                    "ours",
                    params,
                    ranks=self.world,
                    timing={"time_ms": row["step_ms"]},
                    metrics={
                        k: row[k]
                        for k in ("pair_sq_dist", "divergence_1_euler", "divergence_4_euler")
                    },
                )
        finally:
            if before is None:
                os.environ.pop("FLASHSINKHORN_NO_AUTOTUNE", None)
            else:
                os.environ["FLASHSINKHORN_NO_AUTOTUNE"] = before


KEYS = (
    "efficiency",
    "value_rel_diff",
    "peak_ratio_to_one_gpu",
    "same_draws_as_one_gpu",
    "ratio_to_one_iteration",
    "time_ms_per_iteration",
    "pair_sq_dist",
    "divergence_4_euler",
)


def summary(rows):
    """The short table printed last: per row the time and the scaling / agreement metrics."""
    head = "| case | provider | n | ranks | ms | " + " | ".join(KEYS) + " |"
    out = [head, "|" + "---|" * (5 + len(KEYS))]
    for r in rows:
        if r["bench"] == "dist_warmup":
            continue
        p, m = r["params"], r["metrics"]
        ms = H.fmt(r["time_ms"]) if r["status"] == "ok" else r["status"]
        cells = [H.fmt(m.get(k)) for k in KEYS]
        n = p.get("n", p.get("coupling", "-"))
        out.append(
            f"| {r['bench'][5:]} | {r['provider']} | {n} | {p.get('ranks')} | {ms} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder (bench-dist.json)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 22])
    ap.add_argument(
        "--loss-sizes",
        type=int,
        nargs="+",
        default=None,
        help="SamplesLoss sizes (default: --sizes)",
    )
    ap.add_argument("--k1", type=int, default=1)
    ap.add_argument("--k2", type=int, default=2)
    ap.add_argument("--fm-steps", type=int, default=300)
    ap.add_argument("--fm-batch", type=int, default=4096)
    ap.add_argument(
        "--budget",
        type=float,
        default=500.0,
        help="start no case that would end (estimated from the measured iteration "
        "times) after this many seconds (default 500)",
    )
    ap.add_argument(
        "--no-stream-rows",
        dest="stream_rows",
        action="store_false",
        help="skip the forced-stream variant of the iteration case",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="every case at small sizes: n = 2^18, 50 flow-matching steps",
    )
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU tensors (tiny sizes)")
    ap.add_argument(
        "--gloo-cuda",
        action="store_true",
        help="gloo on CUDA tensors, ranks sharing the GPUs there are: per-rank "
        "peak memory on a host with fewer GPUs than ranks (each process "
        "has its own allocator); its times are not scaling numbers",
    )
    args = ap.parse_args(argv)
    if args.dry_run:
        args.sizes, args.fm_steps, args.fm_batch = [1 << 18], 50, 1024
    args.fm_eval = 2000
    if args.cpu:
        args.sizes, args.fm_steps, args.fm_batch, args.fm_eval = [700], 3, 64, 300
    loss_sizes = args.loss_sizes or args.sizes

    global DEV
    if args.cpu:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=9))
    else:
        local = int(os.environ.get("LOCAL_RANK", 0))
        DEV = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(DEV)
        backend = "gloo" if args.gloo_cuda else "nccl"
        if args.gloo_cuda:  # the package refuses gloo with CUDA tensors (slow: host staging)
            D.check_device = lambda group, x3: None
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=9))
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    run = Run(args, rank, world, group)
    # autotune once, at a size with the large problems' autotune keys (buckets cap at 2^16)
    n_warm = 256 if args.cpu else 1 << 17
    wx, wy = (t.to(DEV) for t in _problem(n_warm, n_warm, D_FEAT, "cpu", seed=1))
    wp = _plain_problem(wx, wy)
    _, g = _iterate(wp, 2)
    fs.softmax_sample(wp.Xk, wp.Yk, g, wp.logb, wp.cy, eps=EPS, c2=2.0, seed=0)
    del wp, wx, wy, g
    run.add("dist_warmup", "ours", {"n": n_warm}, timing={"time_ms": 1e3 * (time.time() - run.t0)})
    # most important first: the iterations (efficiency, memory, sampling) at every size,
    # SamplesLoss at the smallest, the flow-matching example, then the larger SamplesLoss
    sizes = sorted(args.sizes)
    loss_sizes = sorted(loss_sizes)
    plan = [("iteration", n) for n in sizes] + [("samples_loss", loss_sizes[0])]
    plan += [("flow_matching", None)] + [("samples_loss", n) for n in loss_sizes[1:]]
    for case, n in plan:
        if case != "flow_matching":
            est = run.estimate_s(case, n)
            if run.over_budget(f"dist_{case}", {"n": n}, est):
                continue
        try:  # a failing case is recorded (our code fails the same way on every rank)
            run.flow_matching() if case == "flow_matching" else getattr(run, case)(n)
        except Exception as e:  # noqa: BLE001
            run.add(
                f"dist_{case}",
                "ours",
                {"n": n},
                status="error",
                error=f"{type(e).__name__}: {e}"[:500],
            )
            if rank == 0:
                traceback.print_exc()
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        print(H.markdown(run.R.rows))
        print("\n" + summary(run.R.rows))
        name = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU (gloo)"
        print(f"\n(total {time.time() - run.t0:.1f} s on {world} x {name})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
