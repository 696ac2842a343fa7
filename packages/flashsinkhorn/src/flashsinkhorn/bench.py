"""flashsinkhorn-bench: timings against flash-sinkhorn, GeomLoss and POT (kernel-bench/1 JSON).

    python -m flashsinkhorn.bench                 # CUDA: the standard H200 suite
    python -m flashsinkhorn.bench --smoke         # tiny CPU run (CI)
    python -m flashsinkhorn.bench --n 20000 --d 64 128 --mode fwd fwd_bwd iter
    python -m flashsinkhorn.bench --json out.json --providers ours geomloss
    python -m flashsinkhorn.bench --only iter:1024,large --budget 80 --json rest.json
    python -m flashsinkhorn.bench --skip-done first.json --json rest.json  # what was cut

Benches (``bench`` field):
- ``sinkhorn_iteration``: one symmetric fixed-eps iteration (both potentials), C = |x-y|^2,
  eps = 0.01 (flash-sinkhorn's fixed-iteration setting); time per iteration is measured as
  ``(t(K2 iterations) - t(K1 iterations)) / (K2 - K1)`` for every provider.
- ``samples_loss``: GeomLoss's SamplesLoss(p=2, blur, scaling) schedule, modes ``fwd`` and
  ``fwd_bwd``; ``params.debias`` and ``params.batch`` distinguish the variants.
- ``hvp``: delegated to ``flashsinkhorn.second_order.bench_hvp`` when present.

Points: x, y uniform in [0, 1/sqrt(d)]^d, y shifted by 0.5/sqrt(d) per coordinate (the
problem of ../shared/GPU.md). Columns: median time, time per iteration, fraction of the
floor (exp count at 4.2e12 exp/s vs dot FLOPs at 433 (tf32) / 792 (bf16) TFLOP/s, whichever
is larger), peak extra memory, and |value - float64 reference| on small sizes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time

import torch

import flashsinkhorn as fs
from flashsinkhorn.operands import centered_sqnorm, common_center, kernel_operands
from flashsinkhorn.reference import eps_schedule, max_diameter
from flashsinkhorn.solver import Problem

EXP_RATE = 4.2e12  # exp/s, H200 special-function units
DOT_RATE = {"tf32": 433e12, "bf16": 792e12, "ieee": 60e12, "tf32x3": 144e12}
TENSORIZED_LIMIT = 40 * 2**30  # skip geomloss tensorized above this estimate


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------


def _problem(n, m, d, device, batch=None, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    sh = () if batch is None else (batch,)
    s = 1.0 / math.sqrt(d)
    x = (torch.rand(*sh, n, d, generator=gen) * s).to(device)
    y = (torch.rand(*sh, m, d, generator=gen) * s + 0.5 * s).to(device)
    return x, y


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timeit(fn, device, warmup=1, reps=5):
    """Median / p20 / p80 in ms (CUDA events on GPU) and peak extra memory (MiB)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    for _ in range(reps):
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    q = statistics.quantiles(times, n=5) if len(times) > 1 else [times[0]] * 4
    return statistics.median(times), q[0], q[-1], peak


_LIVE = {"rows": [], "dump": None}  # every row as soon as it exists (GPU suite)


def _row(bench, provider, mode, params, **kw):
    r = {
        "bench": bench,
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
    r.update(kw)
    _LIVE["rows"].append(r)
    if _LIVE["dump"] is not None:
        _LIVE["dump"](_LIVE["rows"])
    return r


def _run_case(
    bench, provider, mode, params, fn, device, warmup, reps, floor_ms=None, extra=None,
    accuracy=None,
):  # fmt: skip
    try:
        med, p20, p80, peak = _timeit(fn, device, warmup, reps)
    except Exception as e:  # a failing peer must not kill the suite
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return _row(
            bench, provider, mode, params, status="error", error=f"{type(e).__name__}: {e}"[:300]
        )
    metrics = {"peak_mem_mib": peak}
    if floor_ms is not None:
        metrics["floor_ms"] = floor_ms
        metrics["frac_floor"] = floor_ms / med if med else None
    if extra:
        metrics.update(extra)
    return _row(
        bench,
        provider,
        mode,
        params,
        time_ms=med,
        time_ms_p20=p20,
        time_ms_p80=p80,
        metrics=metrics,
        accuracy=accuracy or {},  # in the row itself: the JSON is written when a row is made
    )


def _pass_floor_ms(n, m, d, precision, batch=1):
    """One softmin pass (N x M scores): max(exp time, dot time), in ms."""
    scores = batch * n * m
    t_exp = scores / EXP_RATE
    t_dot = scores * 2 * d / DOT_RATE.get(precision, DOT_RATE["tf32"])
    return 1e3 * max(t_exp, t_dot)


def _peers():
    out = {}
    try:
        import geomloss

        out["geomloss"] = geomloss
    except Exception:
        pass
    try:
        import flash_sinkhorn

        out["flash-sinkhorn"] = flash_sinkhorn
    except Exception:
        pass
    try:
        import ot

        out["pot"] = ot
    except Exception:
        pass
    return out


def _version(mod):
    return getattr(mod, "__version__", "?")


# ----------------------------------------------------------------------------------------
# benches
# ----------------------------------------------------------------------------------------


def _ours_iterations(x, y, eps, k, precision, backend):
    """k symmetric fixed-eps iterations (C = |x - y|^2), batched x (B, N, D)."""
    if x.dim() == 2:
        x, y = x[None], y[None]
    B, N, _ = x.shape
    M = y.shape[1]
    a = torch.full((B, N), 1.0 / N, device=x.device)
    b = torch.full((B, M), 1.0 / M, device=x.device)
    c = common_center(x, y)
    prob = Problem(
        x, y, a, b, centered_sqnorm(x, c), centered_sqnorm(y, c), 2.0, "sqeuclidean", 1.0,
        None, precision, backend, c,
    )  # fmt: skip
    f = torch.zeros_like(a)
    g = torch.zeros_like(b)
    for it in range(k):
        # the current potentials as guesses (the shift kernel), as in solve's loop: not the
        # zeros of the first iteration
        gf, gg = (f, g) if it > 0 else (None, None)
        ft = prob.sm_x(g, eps, guess=gf)[0]
        gt = prob.sm_y(f, eps, guess=gg)[0]
        f, g = 0.5 * (f + ft), 0.5 * (g + gt)
    return f, g


def bench_iteration(n, d, device, providers, peers, precisions, warmup, reps, k1=2, k2=10):
    rows = []
    eps = 0.01
    x, y = _problem(n, n, d, device)
    be = "auto"
    for prov, prec in [("ours", p) for p in precisions] + [("flash-sinkhorn", "tf32")]:
        if prov not in providers:
            continue
        params = {"n": n, "m": n, "d": d, "eps": eps, "dtype": "float32"}
        label = prov if (prov != "ours" or prec == "tf32") else f"ours-{prec}"
        floor = 2 * _pass_floor_ms(n, n, d, prec)
        if prov == "ours":

            def make(k, prec=prec):
                return lambda: _ours_iterations(x, y, eps, k, prec, be)

        else:
            if "flash-sinkhorn" not in peers or device.type != "cuda":
                rows.append(_row("sinkhorn_iteration", label, "fwd", params, status="skipped",
                                 error="flash_sinkhorn not importable"))  # fmt: skip
                continue
            FS = peers["flash-sinkhorn"].SamplesLoss
            a = torch.full((n,), 1.0 / n, device=device)

            def make(k, FS=FS, a=a):
                L = FS("sinkhorn", use_epsilon_scaling=False, eps=eps, n_iters=k, debias=False,
                       potentials=False, normalize=False, last_extrapolation=False,
                       allow_tf32=True, half_cost=False)  # fmt: skip
                return lambda: L(a, x, a, y)

        try:
            t1 = _timeit(make(k1), device, warmup, reps)
            t2 = _timeit(make(k2), device, warmup, reps)
        except Exception as e:
            rows.append(_row("sinkhorn_iteration", label, "fwd", params, status="error",
                             error=f"{type(e).__name__}: {e}"[:300]))  # fmt: skip
            continue
        per = (t2[0] - t1[0]) / (k2 - k1)
        p20 = (t2[1] - t1[1]) / (k2 - k1)
        p80 = (t2[2] - t1[2]) / (k2 - k1)
        # the label, not the provider: the H200 runs of 2026-11-29 logged the bf16 rows as
        # "ours" too, and the faster bf16 time was read as the tf32 one
        rows.append(
            _row(
                "sinkhorn_iteration",
                label,
                "fwd",
                params,
                time_ms=per,
                time_ms_p20=p20,
                time_ms_p80=p80,
                metrics={
                    "floor_ms": floor,
                    "frac_floor": floor / per if per > 0 else None,
                    "peak_mem_mib": t2[3],
                    f"time_ms_{k2}_iters": t2[0],
                },
            )  # fmt: skip
        )
    return rows


def _samples_loss_passes(x, y, blur, scaling, debias):
    d2 = max_diameter(x, y) ** 2
    n_eps = len(eps_schedule(d2, blur**2, scaling))
    passes = 2 * (n_eps + 2)  # init, the loop, the final extrapolation; two sides each
    return passes * (2 if debias else 1)


def bench_samples_loss(
    n, d, device, providers, peers, modes, warmup, reps, *, batch=None, debias=False,
    blur=0.05, scaling=0.5, precisions=("tf32",), reference=False,
):  # fmt: skip
    rows = []
    x, y = _problem(n, n, d, device, batch=batch)
    params0 = {"n": n, "m": n, "d": d, "blur": blur, "scaling": scaling, "debias": debias,
               "batch": batch or 1, "dtype": "float32"}  # fmt: skip
    passes = _samples_loss_passes(x, y, blur, scaling, debias)
    ref = None
    if reference:
        with torch.no_grad():
            if batch is None:
                a = torch.full((n,), 1.0 / n, device=device, dtype=torch.float64)
                ref = float(
                    fs.samples_loss_ref(
                        a, x.double(), a, y.double(), blur=blur, scaling=scaling, debias=debias
                    )  # fmt: skip
                )
    for mode in modes:
        cases = [("ours", p) for p in precisions]
        cases += [("flash-sinkhorn", "tf32"), ("geomloss", "fp32")]
        for prov, prec in cases:
            if prov not in providers:
                continue
            params = dict(params0)
            label = prov if (prov != "ours" or prec == "tf32") else f"ours-{prec}"
            if prov == "geomloss" and "geomloss" not in peers:
                continue
            if prov == "flash-sinkhorn" and (
                "flash-sinkhorn" not in peers or device.type != "cuda"
            ):
                continue
            if prov == "geomloss":
                est = (8 if debias else 4) * n * n * 4 * (batch or 1)
                if device.type == "cuda" and est > TENSORIZED_LIMIT:
                    rows.append(_row("samples_loss", "geomloss", mode, params, status="skipped",
                                     error=f"tensorized needs ~{est / 2**30:.0f} GiB"))  # fmt: skip
                    continue
                L = peers["geomloss"].SamplesLoss("sinkhorn", p=2, blur=blur, scaling=scaling,
                                                  debias=debias, backend="tensorized")  # fmt: skip
            elif prov == "flash-sinkhorn":
                FL = peers["flash-sinkhorn"].SamplesLoss
                L = FL("sinkhorn", p=2, blur=blur, scaling=scaling, debias=debias,
                       half_cost=True, allow_tf32=True)  # fmt: skip
                if batch is not None:  # flash-sinkhorn has no batch dimension: loop
                    L0 = L

                    def L(xx, yy, L0=L0):
                        return torch.stack([L0(xx[i], yy[i]) for i in range(xx.shape[0])])

            else:
                L = fs.SamplesLoss(blur=blur, scaling=scaling, debias=debias, precision=prec)

            if mode == "fwd":

                def fn(L=L):
                    with torch.no_grad():
                        return L(x, y)

            else:

                def fn(L=L):
                    xx = x.detach().requires_grad_()
                    yy = y.detach().requires_grad_()
                    v = L(xx, yy)
                    v.sum().backward()
                    return v

            acc = {}
            if ref is not None:
                try:
                    with torch.no_grad():
                        val = float(L(x, y))
                    acc = {"value": val, "abs_err_vs_f64_ref": abs(val - ref),
                           "rel_err_vs_f64_ref": abs(val - ref) / max(abs(ref), 1e-30)}  # fmt: skip
                except Exception:
                    acc = {}
            floor = passes * _pass_floor_ms(n, n, d, prec if prov == "ours" else "tf32", batch or 1)
            rows.append(_run_case("samples_loss", label, mode, params, fn, device, warmup, reps,
                                  floor, accuracy=acc))  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def bench_pass_variants(n, d, device, warmup=2, reps=5):
    """Kernel-level variants of ONE softmin pass (n x n scores): what each feature costs."""
    from flashsinkhorn.primitives import self_softmin, softmin

    rows = []
    x, y = _problem(n, n, d, device)
    x, y = x[None], y[None]
    eps = 0.01
    c = common_center(x, y)
    cx, cy = centered_sqnorm(x, c), centered_sqnorm(y, c)
    cx0, cy0 = (x * x).sum(-1), (y * y).sum(-1)
    g = torch.zeros(1, n, device=device)
    logb = torch.full((1, n), -math.log(n), device=device)
    params = {"n": n, "m": n, "d": d, "eps": eps, "dtype": "float32"}
    # operands centered (and cast) once, as Problem does in the solvers: the pass itself
    xk, yk = kernel_operands(x, y, c, "tf32", "auto")
    xb, yb = kernel_operands(x, y, c, "bf16", "auto")
    variants = {
        "ours": lambda: softmin(xk, yk, g, logb, cx, cy, eps=eps, c2=2.0),
        "ours-center-per-call": lambda: softmin(x, y, g, logb, cx, cy, eps=eps, c2=2.0,
                                                center=c),
        "ours-nocenter": lambda: softmin(x, y, g, logb, cx0, cy0, eps=eps, c2=2.0),
        "ours-bf16": lambda: softmin(xb, yb, g, logb, cx, cy, eps=eps, c2=2.0,
                                     precision="bf16"),
        "ours-with-V": lambda: softmin(xk, yk, g, logb, cx, cy, eps=eps, c2=2.0, v=y),
        "ours-self-plain": lambda: softmin(xk, xk, g, logb, cx, cx, eps=eps, c2=2.0),
        "ours-self-symmetric": lambda: self_softmin(xk, logb, g, cx, eps=eps, c2=2.0,
                                                    check=False),
    }  # fmt: skip
    for name, fn in variants.items():
        prec = "bf16" if "bf16" in name else "tf32"
        floor = _pass_floor_ms(n, n, d, prec)
        rows.append(_run_case("softmin_pass", name, "fwd", params, fn, device, warmup, reps,
                              floor))  # fmt: skip
    return rows


def bench_hvp(n, d, device, providers, warmup, reps):
    try:
        from flashsinkhorn.second_order.bench import bench_hvp as _bh
    except Exception as e:
        return [_row("hvp", "ours", "hvp", {"n": n, "d": d}, status="skipped",
                     error=f"second_order.bench_hvp unavailable: {e!r}"[:300])]  # fmt: skip
    prov = tuple(p for p in providers if p in ("ours", "flash-sinkhorn"))
    try:
        return list(_bh(n=n, d=d, reps=reps, providers=prov, device=device))
    except Exception as e:
        return [_row("hvp", "ours", "hvp", {"n": n, "d": d}, status="error",
                     error=f"{type(e).__name__}: {e}"[:300])]  # fmt: skip


# ----------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------


def _fmt(v, nd=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def markdown(rows):
    head = "| bench | params | mode | provider | time ms | x ours | frac floor | peak MiB | err |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    ours_t = {}

    def keyof(r):
        p = dict(r["params"])
        return (r["bench"], r["mode"], json.dumps(p, sort_keys=True))

    for r in rows:
        if r["provider"] == "ours" and r["status"] == "ok":
            key = keyof(r)
            ours_t[key] = r["time_ms"]
    for r in rows:
        p = r["params"]
        skip = ("dtype", "m", "blur", "scaling", "eps")
        ps = " ".join(f"{k}={v}" for k, v in p.items() if k not in skip and v not in (1, False))
        key = keyof(r)
        ratio = None
        if r["status"] == "ok" and key in ours_t and ours_t[key]:
            ratio = r["time_ms"] / ours_t[key]
        t = _fmt(r["time_ms"]) if r["status"] == "ok" else r["status"]
        m = r.get("metrics", {})
        acc = r.get("accuracy", {}) or {}
        lines.append(
            f"| {r['bench']} | {ps} | {r['mode']} | {r['provider']} | {t} | {_fmt(ratio)} | "
            f"{_fmt(m.get('frac_floor'))} | {_fmt(m.get('peak_mem_mib'))} | "
            f"{_fmt(acc.get('abs_err_vs_f64_ref'))} |"
        )
    return "\n".join(lines)


def _env(peers, device):
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "peers": {k: _version(v) for k, v in peers.items()},
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    env["gpu"] = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return env


def _tuned_configs():
    try:
        from flashsinkhorn import _softmin_triton as K

        out = {}
        for name in ("_softmin_tuned", "_softmin_shift_tuned", "_self_softmin_tuned"):
            cache = getattr(getattr(K, name, None), "cache", {}) or {}
            out.update({f"{name}{k}": str(v) for k, v in cache.items()})
        return out
    except Exception:
        return {}


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(prog="flashsinkhorn-bench", description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, CPU-friendly (CI)")
    ap.add_argument("--json", metavar="PATH", help="write kernel-bench/1 JSON here")
    ap.add_argument("--providers", nargs="+", default=["ours", "flash-sinkhorn", "geomloss"],
                    help="ours flash-sinkhorn geomloss (those importable are run)")  # fmt: skip
    ap.add_argument("--mode", nargs="+", default=None,
                    help="fwd fwd_bwd iter hvp (default: fwd fwd_bwd iter)")  # fmt: skip
    ap.add_argument("--n", nargs="+", type=int, help="cloud sizes n = m")
    ap.add_argument("--d", nargs="+", type=int, help="dimensions")
    ap.add_argument("--batch", type=int, default=None, help="batch of problems (samples_loss)")
    ap.add_argument("--blur", type=float, default=0.05)
    ap.add_argument("--scaling", type=float, default=0.5)
    ap.add_argument("--debias", action="store_true")
    ap.add_argument("--precision", nargs="+", default=["tf32"], help="tf32 ieee tf32x3 bf16")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--quick", action="store_true", help="GPU suite: the headline cases only")
    ap.add_argument("--only", metavar="CASE[,CASE]",
                    help="GPU suite: run only these cases, KIND, KIND:D or KIND:N:D "
                         "(KIND: " + " ".join(SUITE_KINDS) + "), e.g. iter:1024,large")  # fmt: skip
    ap.add_argument("--skip-done", metavar="JSON",
                    help="GPU suite: skip the cases that this earlier --json finished")  # fmt: skip
    ap.add_argument("--budget", type=float, default=190.0,
                    help="GPU suite: start no case after this many seconds")  # fmt: skip
    ap.add_argument("--scale", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--force-suite", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    peers = _peers()
    providers = set(args.providers)
    rows = []
    t0 = time.time()
    custom = args.n is not None or args.d is not None
    run_suite = args.force_suite or not (args.smoke or custom or device.type != "cuda")
    suite = QUICK_SUITE if args.quick else FULL_SUITE
    if args.only or args.skip_done:
        if not run_suite:
            ap.error("--only / --skip-done select cases of the GPU suite (CUDA, no --smoke)")
        try:
            suite = select_cases(suite, args.only, args.skip_done)
        except ValueError as e:
            ap.error(str(e))
        print("suite cases: " + (", ".join(_case_name(c) for c in suite) or "none"), flush=True)
    if run_suite:
        pass
    elif args.smoke or (device.type != "cuda" and not custom):  # tiny CPU run
        reps = args.reps or 3
        for d in args.d or [3]:
            n = (args.n or [200])[0]
            rows += bench_samples_loss(n, d, device, providers, peers, ["fwd", "fwd_bwd"], 1,
                                       reps, reference=True, blur=0.1)  # fmt: skip
        rows += bench_iteration(256, 8, device, providers & {"ours"}, peers, ["tf32"], 1, reps)
    elif custom or device.type != "cuda":
        reps = args.reps or 5
        modes = args.mode or ["fwd", "fwd_bwd", "iter"]
        for n in args.n or [10000]:
            for d in args.d or [64]:
                if "iter" in modes:
                    rows += bench_iteration(n, d, device, providers, peers, args.precision,
                                            args.warmup, reps)  # fmt: skip
                lm = [m for m in modes if m in ("fwd", "fwd_bwd")]
                if lm:
                    rows += bench_samples_loss(
                        n, d, device, providers, peers, lm, args.warmup, reps,
                        batch=args.batch, debias=args.debias, blur=args.blur,
                        scaling=args.scaling, precisions=args.precision,
                        reference=n <= 10000 and args.batch is None,
                    )  # fmt: skip
                if "hvp" in modes:
                    rows += bench_hvp(n, d, device, providers, args.warmup, reps)
    command = "python -m flashsinkhorn.bench " + " ".join(sys.argv[1:] if argv is None else argv)

    def dump(rows):
        if not args.json:
            return
        out = {
            "schema": "kernel-bench/1",
            "package": "flashsinkhorn",
            "package_version": fs.__version__,
            "command": command.strip(),
            "env": _env(peers, device),
            "results": rows,
            "tuned_configs": _tuned_configs(),
            "wall_s": time.time() - t0,
        }
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)

    if run_suite:
        _LIVE["dump"] = dump  # the JSON is rewritten after every measured row
        rows += gpu_suite(device, providers, peers, dump, suite=suite, scale=args.scale,
                          budget_s=args.budget)  # fmt: skip
    dump(rows)
    print(markdown(rows))
    print(f"\n(total {time.time() - t0:.1f} s on {device})")
    return 0


FULL_SUITE = [  # priority order: what a time limit cuts comes last
    ("loss", 50000, 64, {}),
    ("passes", 50000, 64, {}),
    ("iter", 50000, 64, {}),
    ("loss_debias", 50000, 64, {}),
    ("loss_batched", 2048, 64, {}),
    ("iter", 50000, 512, {}),
    ("loss", 50000, 512, {}),
    ("loss_ref", 10000, 64, {}),
    ("iter", 50000, 1024, {}),
    ("large", 200000, 64, {}),
    ("hvp", 20000, 64, {}),
    ("loss", 50000, 1024, {}),
    ("loss_ref", 10000, 512, {}),
    ("passes", 50000, 512, {}),
]
QUICK_SUITE = FULL_SUITE[:5]
SUITE_KINDS = ("loss", "passes", "iter", "loss_debias", "loss_batched", "loss_ref", "large",
               "hvp")  # fmt: skip


def _case_name(case):
    kind, n, d, _ = case
    return f"{kind}:{n}:{d}"


def _case_of_row(row, suite):
    """Index in ``suite`` of the case that wrote ``row`` (None: not one of its rows)."""
    bench, p = row.get("bench", ""), row.get("params", {})
    n, d = p.get("n"), p.get("d")
    if bench == "samples_loss":
        if p.get("batch", 1) != 1:
            kinds = ("loss_batched",)
        elif p.get("debias"):
            kinds = ("loss_debias",)
        else:  # these three differ by n in the suite
            kinds = ("loss", "loss_ref", "large")
    else:
        kinds = {"sinkhorn_iteration": ("iter",), "softmin_pass": ("passes",),
                 "hvp": ("hvp",)}.get(bench, ())  # fmt: skip
    for i, (kind, cn, cd, _) in enumerate(suite):
        if kind in kinds and cn == n and cd == d:
            return i
    return None


def select_cases(suite, only=None, skip_done=None):
    """The suite cases to run: in suite order, or in the order of ``only``.

    ``only``: comma-separated ``KIND``, ``KIND:D`` or ``KIND:N:D``. ``skip_done``: the JSON of
    an earlier suite run; the suite runs its cases in order and writes the JSON after every
    row, so every case before the last one that wrote a row has finished (the last one may
    have been cut by a time limit and is run again).
    """
    keep = list(suite)
    if only:
        specs = []
        for spec in only.split(","):
            parts = spec.strip().split(":")
            if parts[0] not in SUITE_KINDS or len(parts) > 3:
                raise ValueError(f"--only: unknown case {spec!r}; KIND[:D] or KIND:N:D with "
                                 f"KIND one of {', '.join(SUITE_KINDS)}")  # fmt: skip
            try:
                nums = [int(v) for v in parts[1:]]
            except ValueError:
                raise ValueError(f"--only: N and D must be integers; got {spec!r}") from None
            n, d = ([None, None] + nums)[-2:]  # KIND:D gives D, KIND:N:D both
            specs.append((parts[0], n, d))
        # in the order given: a second call runs what matters most first
        picked = [i for k, n, d in specs for i, c in enumerate(suite)
                  if k == c[0] and n in (None, c[1]) and d in (None, c[2])]  # fmt: skip
        keep = [suite[i] for i in dict.fromkeys(picked)]  # each case once
    if skip_done:
        with open(skip_done) as fh:
            rows = json.load(fh).get("results", [])
        seen = {_case_of_row(r, suite) for r in rows} - {None}
        if seen:
            finished = {_case_name(c) for c in suite[: max(seen)]}
            keep = [c for c in keep if _case_name(c) not in finished]
    return keep


def gpu_suite(
    device, providers, peers, dump=lambda rows: None, suite=None, scale=1.0, budget_s=190.0
):
    """The standard H200 suite (GPU.md's problem sizes), headline cases first; the JSON is
    rewritten after every row so that a time limit keeps what was measured. Cases that
    would start after ``budget_s`` seconds are recorded as skipped (the whole suite stays
    within about 3.5 minutes)."""
    rows = []
    P = providers
    suite = FULL_SUITE if suite is None else suite
    t_start = time.time()

    def log(msg):
        dump(rows)
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    for kind, n, d, _ in suite:
        n = max(64, int(n * scale))
        if time.time() - t_start > budget_s:
            why = f"suite time budget {budget_s:.0f} s"
            rows.append(_row(f"suite:{kind}", "ours", "-", {"n": n, "m": n, "d": d},
                             status="skipped", error=why))  # fmt: skip
            continue
        log(f"{kind} n={n} d={d}")
        if kind == "iter":  # (t(6 iterations) - t(2 iterations)) / 4
            precs = ["tf32", "bf16"] if d <= 512 else ["tf32"]
            rows += bench_iteration(n, d, device, P, peers, precs, 1, 2, k1=2, k2=6)
        elif kind == "loss":
            rows += bench_samples_loss(n, d, device, P, peers, ["fwd", "fwd_bwd"], 1, 2)
        elif kind == "loss_ref":
            rows += bench_samples_loss(n, d, device, P, peers, ["fwd", "fwd_bwd"], 1, 3,
                                       reference=True)  # fmt: skip
        elif kind == "loss_debias":
            rows += bench_samples_loss(n, d, device, P, peers, ["fwd", "fwd_bwd"], 1, 2,
                                       debias=True)  # fmt: skip
        elif kind == "loss_batched":
            rows += bench_samples_loss(n, d, device, P, peers, ["fwd", "fwd_bwd"], 1, 3, batch=64)
        elif kind == "large":  # one warm-up call: the timed call must not include autotuning
            rows += bench_samples_loss(n, d, device, P & {"ours"}, peers, ["fwd_bwd"], 1, 1)
        elif kind == "passes":
            rows += bench_pass_variants(n, d, device)
        elif kind == "hvp":
            rows += bench_hvp(n, d, device, P, 1, 3)
    log("done")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
