"""Benchmark CLI: ``mhc-proj-bench`` / ``python -m mhc_proj.bench``.

Providers (fp32 B x 4 x 4 logits, N(0, sigma^2)):

- ``ours``: :func:`mhc_proj.birkhoff_project` (the exact projection).
- ``ours-sinkhorn20``: :func:`mhc_proj.sinkhorn_project` (fused Sinkhorn-20, the
  compatibility op: the same iteration as the peers below, with its exact backward).
- ``torch-sinkhorn20``: the same iteration in eager torch (autograd through it).
- ``compile-sinkhorn20``: that function under ``torch.compile`` (static shapes).

Modes: ``fwd``, ``bwd`` (the backward alone, from a saved forward), ``fwd_bwd`` (forward
and ``torch.autograd.grad``); ``--graph``: ``ours`` also under CUDA graph replay.

Columns: median CUDA-event time (wall clock on CPU), achieved GB/s (bytes of the ideal
kernel: fwd 128 B, bwd 192 B, fwd+bwd 320 B per matrix) and its fraction of the copy
ceiling measured in the same process, and accuracy (median / max L1 marginal error,
max distance to the float64 exact projection on a sample). ``--json`` writes the
kernel-bench/1 schema. With no size flags on CUDA it runs the standard GPU suite (the
headline rows: 128K, 1M and 16M matrices, N(0,1) and N(0,10^2), the Sinkhorn-20 peers,
graph replay at 128K) and prints a short headline table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

import mhc_proj
from mhc_proj._config import TOL_F32
from mhc_proj.birkhoff import birkhoff_bwd, birkhoff_fwd
from mhc_proj.reference import birkhoff_project_ref, marginal_error, sinkhorn_project_ref

PROVIDERS = ["ours", "ours-sinkhorn20", "torch-sinkhorn20", "compile-sinkhorn20"]
MODES = ["fwd", "bwd", "fwd_bwd"]
BYTES = {"fwd": 128, "bwd": 192, "fwd_bwd": 320}
SAMPLE = 16384


def torch_sinkhorn20(x: torch.Tensor) -> torch.Tensor:
    """The eager peer: DeepSeek/TileKernels Sinkhorn-20 (eps = 1e-6) in plain torch."""
    return sinkhorn_project_ref(x, iters=20, eps=1e-6)


_compiled: Callable | None = None


def compile_sinkhorn20() -> Callable:
    global _compiled
    if _compiled is None:
        # static shapes (one compile per batch size, like a training job sees): dynamic
        # shapes gave a 13x slower kernel on the H200
        cfg = torch._dynamo.config
        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(64, getattr(cfg, name)))
        _compiled = torch.compile(torch_sinkhorn20, dynamic=False)
    return _compiled


def _fn_for(provider: str) -> Callable:
    if provider == "ours":
        return mhc_proj.birkhoff_project
    if provider == "ours-sinkhorn20":
        return lambda x: mhc_proj.sinkhorn_project(x, iters=20)
    if provider == "torch-sinkhorn20":
        return torch_sinkhorn20
    if provider == "compile-sinkhorn20":
        return compile_sinkhorn20()
    raise ValueError(f"unknown provider {provider!r}; choose from {PROVIDERS}")


# ---------------------------------------------------------------- timing
def _timeit(
    fn: Callable[[], object],
    device: torch.device,
    budget_s: float = 0.4,
    host_ms: list[float] | None = None,
):
    """Median / p20 / p80 in ms of ``fn``: CUDA events on GPU, wall clock on CPU.

    Each CUDA repetition starts on an idle GPU (the previous one was synchronized), so the
    event time of a call whose kernels are short includes the host time up to its last
    launch. ``host_ms`` (CUDA): gets the host time of each repetition, from before ``fn``
    to its return (without the final synchronize): equal to the event time when the call
    is host-bound or blocks on the GPU inside, smaller when the GPU is the bottleneck."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
    else:
        t0 = time.perf_counter()
        fn()
    est = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(50, max(3, budget_s / est)))
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            h0 = time.perf_counter()
            fn()
            h1 = time.perf_counter()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
            if host_ms is not None:
                host_ms.append((h1 - h0) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    q = lambda p: times[min(len(times) - 1, int(p * (len(times) - 1) + 0.5))]
    return statistics.median(times), q(0.2), q(0.8)


def copy_ceiling_gbps(device: torch.device) -> float | None:
    """Device-to-device copy throughput (bytes read + written) of a 1 GiB buffer."""
    if device.type != "cuda":
        return None
    a = torch.empty(1 << 28, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms, _, _ = _timeit(lambda: b.copy_(a), device, budget_s=0.2)
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------- one case
def run_case(provider, mode, batch, sigma, device, ceiling, graph=False, seed=0):
    params = {"B": batch, "n": 4, "sigma": sigma, "dtype": "float32"}
    if graph:
        params["graph"] = True
    row = {
        "bench": "birkhoff4",
        "provider": provider,
        "mode": mode,
        "params": params,
        "status": "ok",
        "time_ms": None,
        "time_ms_p20": None,
        "time_ms_p80": None,
        "metrics": {},
        "accuracy": {},
        "error": None,
    }
    try:
        fn = _fn_for(provider)
        g = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(batch, 4, 4, device=device, generator=g) * sigma
        gr = torch.randn(batch, 4, 4, device=device, generator=g)
        out = None
        if mode == "fwd":
            with torch.no_grad():
                out = fn(x)
            call = lambda: fn(x)
            if graph:
                call = _graphed(lambda: fn(x), device)
        elif mode == "fwd_bwd":
            if graph:
                if provider != "ours":
                    raise NotImplementedError("graph mode is measured for ours only")
                call = _graphed(
                    lambda: birkhoff_bwd(birkhoff_fwd(x, TOL_F32, 30, False)[0], gr), device
                )
            else:
                xg = x.clone().requires_grad_(True)

                def call():
                    (d,) = torch.autograd.grad(fn(xg), xg, gr)
                    return d

        else:  # bwd only
            xg = x.clone().requires_grad_(True)
            y = fn(xg)
            if provider == "ours":
                t = y.detach()
                call = lambda: birkhoff_bwd(t, gr)
            else:
                call = lambda: torch.autograd.grad(y, xg, gr, retain_graph=True)
        # Diagnostics of the eager rows (small batches are host-bound): the host time per
        # call and the device allocations (cudaMalloc / cudaFree) of the caching allocator.
        host: list[float] = []
        cuda = device.type == "cuda"
        stats0 = torch.cuda.memory_stats(device) if cuda else {}
        with torch.no_grad() if mode == "fwd" else torch.enable_grad():
            ms, p20, p80 = _timeit(call, device, host_ms=host)
        stats1 = torch.cuda.memory_stats(device) if cuda else {}
        calls = len(host) + 2  # the timed repetitions, the warm-up and the estimate
        row.update(time_ms=ms, time_ms_p20=p20, time_ms_p80=p80)
        gbps = BYTES[mode] * batch / (ms * 1e-3) / 1e9
        row["metrics"] = {
            "gbps": gbps,
            "frac_ceiling": gbps / ceiling if ceiling else None,
            "host_ms": statistics.median(host) if host else None,
        }
        for key in ("num_device_alloc", "num_device_free"):
            if key in stats0 and key in stats1:
                row["metrics"][key + "_per_call"] = (stats1[key] - stats0[key]) / calls
        if out is not None:
            err = marginal_error(out.detach().float())
            k = min(batch, SAMPLE)
            ref = birkhoff_project_ref(x[:k]) if sigma <= 10 else None
            row["accuracy"] = {
                "marginal_err_median": float(err.median()),
                "marginal_err_max": float(err.max()),
                # the float64 reference has no continuation: trusted for sigma <= 10 only
                "max_abs_err_vs_exact_ref": float((out[:k].double() - ref).abs().max())
                if sigma <= 10
                else None,
            }
    except Exception as e:  # one failing provider must not end the suite
        row.update(status="error", error=f"{type(e).__name__}: {e}")
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# ---------------------------------------------------------------- suites
def gpu_suite(providers: list[str]) -> list[tuple]:
    """(provider, mode, B, sigma, graph) of the standard H200 suite: the headline rows."""
    cases = []
    sizes = [131072, 1048576, 16777216]
    for b in sizes:
        for p in providers:
            if p == "compile-sinkhorn20" and b < 1048576:
                continue  # one static compile per shape: keep the suite short
            for mode in ["fwd", "fwd_bwd", "bwd"]:  # bwd after fwd_bwd: no second compile
                cases.append((p, mode, b, 1.0, False))
    for b in sizes:  # large logits: more Newton iterations, ~24% of them in float64
        for mode in ["fwd", "fwd_bwd", "bwd"]:
            if "ours" in providers:
                cases.append(("ours", mode, b, 10.0, False))
    if "ours-sinkhorn20" in providers:  # the same time, far from doubly stochastic
        cases.append(("ours-sinkhorn20", "fwd", 16777216, 10.0, False))
    if "ours" in providers:
        cases.append(("ours", "fwd", 131072, 1.0, True))
        cases.append(("ours", "fwd_bwd", 131072, 1.0, True))
    return cases


def headline(rows: list[dict]) -> str:
    """The short table printed last: per (mode, B, sigma) ours, ours Sinkhorn-20 and the
    torch peers, and the ratio of the best Sinkhorn-20 peer's time to ours-sinkhorn20's."""
    t = {}
    for r in rows:
        if r["status"] == "ok":
            p = r["params"]
            key = (r["mode"], p["B"], p["sigma"], bool(p.get("graph")))
            t.setdefault(key, {})[r["provider"]] = r["time_ms"]
    lines = [
        "| mode | B | sigma | ours exact | ours Sinkhorn-20 | torch eager | torch.compile "
        "| best peer / ours Sinkhorn-20 |",
        "|" + "---|" * 8,
    ]
    f = lambda v: "—" if v is None else f"{v:.4g}"
    for (mode, b, sigma, graph), d in t.items():
        peers = [d[k] for k in ("torch-sinkhorn20", "compile-sinkhorn20") if k in d]
        ours_sk = d.get("ours-sinkhorn20")
        ratio = f"{min(peers) / ours_sk:.1f}x" if peers and ours_sk else "—"
        label = f"{mode} (graph)" if graph else mode
        lines.append(
            f"| {label} | {b} | {sigma:g} | {f(d.get('ours'))} | {f(ours_sk)} | "
            f"{f(d.get('torch-sinkhorn20'))} | {f(d.get('compile-sinkhorn20'))} | {ratio} |"
        )
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    head = (
        "| provider | mode | B | sigma | graph | ms | GB/s | frac ceiling | marg err med "
        "| marg err max | max err vs exact | vs ours |"
    )
    lines = [head, "|" + "---|" * 12]
    ours = {
        (r["mode"], tuple(sorted(r["params"].items()))): r["time_ms"]
        for r in rows
        if r["provider"] == "ours" and r["status"] == "ok"
    }
    f = lambda v, fmt: "—" if v is None else format(v, fmt)
    for r in rows:
        p, m, a = r["params"], r["metrics"] or {}, r["accuracy"] or {}
        o = ours.get((r["mode"], tuple(sorted(p.items()))))
        ratio = r["time_ms"] / o if (o and r["time_ms"]) else None
        t = f(r["time_ms"], ".4g") if r["status"] == "ok" else r["status"]
        lines.append(
            f"| {r['provider']} | {r['mode']} | {p['B']} | {p['sigma']:g} | "
            f"{'yes' if p.get('graph') else ''} | {t} | {f(m.get('gbps'), '.0f')} | "
            f"{f(m.get('frac_ceiling'), '.2f')} | {f(a.get('marginal_err_median'), '.1e')} | "
            f"{f(a.get('marginal_err_max'), '.1e')} | "
            f"{f(a.get('max_abs_err_vs_exact_ref'), '.1e')} | {f(ratio, '.2f')} |"
        )
    return "\n".join(lines)


def _env(device: torch.device) -> dict:
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "peers": {},
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    env["gpu"] = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu"
    )
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mhc-proj-bench", description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (CI)")
    ap.add_argument("--json", help="write kernel-bench/1 JSON here")
    ap.add_argument("--providers", nargs="+", default=None, choices=PROVIDERS)
    ap.add_argument("--mode", nargs="+", default=None, choices=MODES)
    ap.add_argument("--batch", nargs="+", type=int, default=None, help="batch sizes B")
    ap.add_argument("--sigma", nargs="+", type=float, default=None, help="logit std devs")
    ap.add_argument("--graph", action="store_true", help="also time CUDA graph replay (ours)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--report", metavar="JSON", help="print the headline table of a saved run")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as fh:
            print(headline(json.load(fh)["results"]))
        return 0

    if args.smoke:
        device = torch.device(args.device or "cpu")
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    default_providers = [p for p in PROVIDERS if p != "compile-sinkhorn20" or not args.smoke]
    providers = args.providers or default_providers
    ceiling = copy_ceiling_gbps(device)

    sized = args.batch or args.sigma or args.mode or args.smoke or device.type != "cuda"
    if sized:
        batches = args.batch or ([64, 1024] if args.smoke or device.type != "cuda" else [1 << 20])
        sigmas = args.sigma or [1.0]
        modes = args.mode or ["fwd", "fwd_bwd"]
        cases = [
            (p, m, b, s, False) for b in batches for s in sigmas for m in modes for p in providers
        ]
        if args.graph and device.type == "cuda" and "ours" in providers:
            graph_modes = [m for m in modes if m != "bwd"]
            cases += [("ours", m, b, s, True) for b in batches for s in sigmas for m in graph_modes]
    else:
        cases = gpu_suite(providers)

    doc = {
        "schema": "kernel-bench/1",
        "package": "mhc-proj",
        "package_version": mhc_proj.__version__,
        "command": "python -m mhc_proj.bench "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "env": _env(device),
        "results": [],
    }
    if ceiling:
        doc["env"]["copy_ceiling_gbps"] = ceiling

    def dump():
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(doc, fh, indent=1)

    t_start = time.perf_counter()
    rows = doc["results"]
    for p, m, b, s, graph in cases:
        rows.append(run_case(p, m, b, s, device, ceiling, graph=graph))
        dump()  # partial results survive an interrupted run
        r = rows[-1]
        print(f"# {p:24s} {m:8s} B={b:<9d} sigma={s:<5g} graph={graph!s:5s} "
              f"{r['status']:7s} {r['time_ms'] if r['time_ms'] is not None else '':>10} "
              f"{r['error'] or ''}", file=sys.stderr, flush=True)  # fmt: skip
    elapsed = time.perf_counter() - t_start
    print(markdown(rows))
    print(
        f"\n{len(rows)} cases in {elapsed:.1f} s on {doc['env']['gpu']}; copy ceiling "
        f"{f'{ceiling:.0f} GB/s' if ceiling else 'n/a (CPU)'}\n"
    )
    print(headline(rows))
    dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
