"""HVP benchmark rows (kernel-bench/1 result dicts) for the package's bench CLI.

``bench_hvp(n, m, d)`` times, on one problem: potentials from ``n_sinkhorn`` Sinkhorn
iterations at eps, then the streaming HVP in x along a random direction (ours), and
flash-sinkhorn 0.4.1's ``hvp_x_sqeuclid`` (same iterations, its default CG tolerance and
Tikhonov term) when importable and on CUDA. Points: x, y uniform in [0, 1/sqrt(d)]^d, y
shifted by 0.1/sqrt(d) per coordinate (the shared setup of ../shared/GPU.md).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from flashsinkhorn.second_order._plan import solve_potentials
from flashsinkhorn.second_order.hvp import _hvp_plan


def _problem(n, m, d, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.rand(n, d, generator=g) / math.sqrt(d)
    y = torch.rand(m, d, generator=g) / math.sqrt(d) + 0.1 / math.sqrt(d)
    v = torch.randn(n, d, generator=g)
    return x.to(device), y.to(device), v.to(device)


def _timeit(fn, reps, device):
    """Median/p20/p80 in ms (CUDA events on GPU, wall clock on CPU), after one warm-up."""
    out = fn()
    ts = []
    for _ in range(reps):
        if device.type == "cuda":
            s = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            out = fn()
            ts.append(1e3 * (time.perf_counter() - t0))
    ts.sort()
    q = lambda p: ts[min(len(ts) - 1, int(p * (len(ts) - 1) + 0.5))]
    return out, statistics.median(ts), q(0.2), q(0.8)


def _peak(device, fn):
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_hvp(
    n: int = 20000,
    m: int | None = None,
    d: int = 64,
    *,
    eps: float = 0.01,
    n_sinkhorn: int = 100,
    cg_tol: float = 1e-6,
    reps: int = 3,
    providers=("ours", "flash-sinkhorn"),
    device=None,
    precision: str = "tf32x3",
    backend: str = "auto",
) -> list[dict]:
    """Rows of the shared schema for the HVP case (bench "hvp", mode "hvp")."""
    m = n if m is None else m
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    x, y, v = _problem(n, m, d, device)
    params = {"n": n, "m": m, "d": d, "eps": eps, "sinkhorn_iters": n_sinkhorn,
              "dtype": "float32"}  # fmt: skip
    rows = []
    ours = None
    if "ours" in providers:
        info = {}

        def run():
            plan = solve_potentials(x, y, eps=eps, max_iter=n_sinkhorn, backend=backend,
                                    precision=precision)  # fmt: skip
            hx, _, cg = _hvp_plan(plan, v, None, need_y=False, cg_tol=cg_tol)
            info["cg"] = cg
            info["plan"] = plan
            return hx

        try:
            ours, t, t20, t80 = _timeit(run, reps, device)
            plan = info["plan"]
            _, t_solve, _, _ = _timeit(
                lambda: solve_potentials(
                    x, y, eps=eps, max_iter=n_sinkhorn, backend=backend, precision=precision
                ),  # fmt: skip
                reps,
                device,
            )
            _, peak = _peak(device, run)
            rows.append(_row(params, "ours", t, t20, t80, {
                "peak_mem_mib": peak,
                "sinkhorn_ms": t_solve,
                "hvp_only_ms": t - t_solve,
                "cg_iters": info["cg"].iterations,
                "cg_rel_residual": info["cg"].residual / max(info["cg"].initial_residual, 1e-30),
            }, {"precision": precision}))  # fmt: skip
            del plan
        except Exception as e:  # pragma: no cover - reported, not hidden
            rows.append(_row(params, "ours", None, None, None, {}, {}, repr(e)))
    if "flash-sinkhorn" in providers:
        try:
            import flash_sinkhorn as fs
        except ImportError:
            rows.append(_row(params, "flash-sinkhorn", None, None, None, {}, {},
                             "not importable", "skipped"))  # fmt: skip
        else:
            if device.type != "cuda":
                rows.append(_row(params, "flash-sinkhorn", None, None, None, {}, {},
                                 "needs CUDA", "skipped"))  # fmt: skip
            else:
                a = torch.full((n,), 1.0 / n, device=device)
                b = torch.full((m,), 1.0 / m, device=device)
                try:

                    def run_fs():
                        return fs.hvp_x_sqeuclid(x, y, a, b, v, eps_list=[eps] * n_sinkhorn)

                    (hfs, finfo), t, t20, t80 = _timeit(run_fs, reps, device)
                    _, peak = _peak(device, run_fs)
                    acc = {}
                    if ours is not None:
                        rel = float((hfs - ours).norm() / ours.norm())
                        acc["rel_diff_vs_ours"] = rel
                    rows.append(_row(params, "flash-sinkhorn", t, t20, t80, {
                        "peak_mem_mib": peak, "cg_iters": finfo.cg_iters,
                    }, acc))  # fmt: skip
                except Exception as e:  # pragma: no cover
                    rows.append(_row(params, "flash-sinkhorn", None, None, None, {}, {}, repr(e)))
    return rows


def _row(params, provider, t, t20, t80, metrics, accuracy, error=None, status=None):
    return {
        "bench": "hvp",
        "provider": provider,
        "mode": "hvp",
        "params": dict(params),
        "status": status or ("ok" if error is None else "error"),
        "time_ms": t,
        "time_ms_p20": t20,
        "time_ms_p80": t80,
        "metrics": metrics,
        "accuracy": accuracy,
        "error": error,
    }


__all__ = ["bench_hvp"]
