"""The multiscale backend on a GPU (issue #35): one command, JSON and a table under --out.

    FLASHSINKHORN_NO_AUTOTUNE=1 PYTHONPATH=.site:packages/flashsinkhorn/src \\
        python tools/flashsinkhorn/multiscale_bench.py --out $OUT      # H100 / H200, < 4 min
    PYTHONPATH=packages/flashsinkhorn/src \\
        python tools/flashsinkhorn/multiscale_bench.py --out /tmp/ms --smoke  # CPU, a minute

Cases (d = 3, blur 0.01, GeomLoss's schedule at scaling 0.5, debias False, cost
|x - y|^2 / 2; cube: x, y uniform in [0, 1]^3 and 0.8 [0, 1]^3 + 0.1; sphere: x on the unit
sphere, y on the sphere stretched by (1.2, 0.9, 1.0) and shifted by 0.05), in this order:

1. n = m = 2^20, cube then sphere: our ``SamplesLoss(backend="multiscale")`` forward +
   backward (the issue's target: <= 0.7 s at a certified error <= 1e-3; value, the
   certified marginal error ``last_marginal_error``, time, peak memory), our exact streaming
   forward (``backend="streaming"``), flash-sinkhorn 0.4.1's ``backend="multiscale"``
   forward (potentials, if importable; its value is <a, f> + <b, g>), those potentials then
   measured by our float64 certificate (not timed);
2. n = m = 2^24, cube: our forward + backward, peak memory in bytes per point;
3. our forward alone (n = 2^20), cube and sphere;
4. our forward + backward with ``tol=1e-3`` (iterations at the final blur until the
   certificate is below 1e-3, at most 2000), cube and sphere.

``--budget`` seconds in all (default 210; 60 with ``--smoke``). Each case stops at
``min(its cap, the time left)`` (an alarm between two passes: the loop is driven from
Python) and says so. Writes ``OUT/multiscale.json`` after every case and
``OUT/multiscale.md`` (printed last). The first call compiles the kernels (a warm-up at 4096
points, outside the budget's cases but inside the wall time).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import signal
import sys
import time
from pathlib import Path

import torch

import flashsinkhorn as fs
from flashsinkhorn.multiscale import MultiscaleProblem

try:  # the optional peer (installed from .whl/ into .site/ on the GPU host)
    import flash_sinkhorn
except ImportError:
    flash_sinkhorn = None

BLUR = 0.01


def clouds(kind, n, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "cube":
        x = torch.rand(n, 3, generator=gen)
        y = torch.rand(n, 3, generator=gen) * 0.8 + 0.1
    else:
        x = torch.randn(n, 3, generator=gen)
        x = x / x.norm(dim=1, keepdim=True)
        y = torch.randn(n, 3, generator=gen)
        y = y / y.norm(dim=1, keepdim=True) * torch.tensor([1.2, 0.9, 1.0]) + 0.05
    return x.to(device), y.to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    """``(result, seconds, peak MiB above the memory at the start)`` of one call."""
    sync(device)
    base = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    dt = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else None
    return out, dt, peak


def ours(x, y, *, grad, tol=None):
    """Our multiscale SamplesLoss: value, certified error, and the gradient's norm."""
    xg = x.detach().clone().requires_grad_(grad)
    loss = fs.SamplesLoss(blur=BLUR, scaling=0.5, debias=False, backend="multiscale", tol=tol)
    v = loss(xg, y)
    if grad:
        v.backward()
    err = loss.last_marginal_error
    return {
        "value": float(v.detach()),
        "certified_error": None if err is None else float(err),
        "grad_norm": float(xg.grad.norm()) if grad else None,
    }


def streaming(x, y):
    loss = fs.SamplesLoss(blur=BLUR, scaling=0.5, debias=False, backend="streaming")
    with torch.no_grad():
        return {"value": float(loss(x, y))}


def peer(x, y):
    """flash-sinkhorn 0.4.1's multiscale forward: its potentials and value <a, f> + <b, g>
    (uniform weights; forward only, its own sampled stopping check at its default tol)."""
    kw = dict(blur=BLUR, half_cost=True, debias=False, backend="multiscale", potentials=True)
    with torch.no_grad():
        f, g = flash_sinkhorn.SamplesLoss("sinkhorn", **kw)(x, y)
    f, g = f.reshape(1, -1).float(), g.reshape(1, -1).float()
    return {"value": float(f.mean() + g.mean()), "_potentials": (f, g)}


def certify(x, y, f, g):
    """Our float64 upper bound of the L1 marginal error of potentials (f, g) of the cost
    |x - y|^2 / 2 at eps = blur^2 (uniform weights)."""
    n, m = x.shape[0], y.shape[0]
    a = torch.full((1, n), 1.0 / n, device=x.device)
    b = torch.full((1, m), 1.0 / m, device=x.device)
    backend = "triton" if x.is_cuda else "torch"
    fields = dict(X=x[None], Y=y[None], a=a, b=b, cx=a * 0, cy=b * 0, c2=1.0, cost_scale=0.5)
    prob = MultiscaleProblem(backend=backend, **fields)
    a64 = torch.full((1, n), 1.0 / n, dtype=torch.float64, device=x.device)
    b64 = torch.full((1, m), 1.0 / m, dtype=torch.float64, device=x.device)
    return float(prob.certificate(f, g, BLUR**2, None, None, a64=a64, b64=b64)[0])


def _fmt(row, key, spec):
    v = row.get(key)
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


class OverBudget(Exception):
    """Raised by the alarm inside a case that runs past its time (between two launches: the
    loop is driven from Python, so the case stops at its next pass)."""


def _alarm(signum, frame):
    raise OverBudget


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="small sizes on the CPU")
    ap.add_argument("--budget", type=float, default=None, help="seconds in all (210; smoke 60)")
    args = ap.parse_args()
    budget = args.budget or (60.0 if args.smoke else 210.0)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_mid, n_big = (1 << 11, 1 << 13) if args.smoke else (1 << 20, 1 << 24)
    t_start = time.perf_counter()
    env = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "budget_s": budget,
        # the streaming kernels autotune unless this is 1 (then one fixed config)
        "FLASHSINKHORN_NO_AUTOTUNE": os.environ.get("FLASHSINKHORN_NO_AUTOTUNE"),
    }
    try:
        import triton  # noqa: PLC0415 (a version for the record; absent on some CPU hosts)

        env["triton"] = triton.__version__
    except ImportError:
        pass
    has_peer = flash_sinkhorn is not None and device.type == "cuda"
    if flash_sinkhorn is not None:
        env["flash_sinkhorn"] = getattr(flash_sinkhorn, "__version__", "?")
    rows = []
    results = {"env": env, "cases": rows}
    signal.signal(signal.SIGALRM, _alarm)

    def save():
        (out / "multiscale.json").write_text(json.dumps(results, indent=1))

    def left():
        return budget - (time.perf_counter() - t_start)

    def case(name, kind, n, fn, cap, **kw):
        """Run ``fn(**kw)`` for at most ``cap`` seconds and the budget's time left."""
        row = {"case": name, "cloud": kind, "n": n}
        limit = min(cap, left())
        if limit < 1:
            row["skipped"] = "the budget is spent"
        else:
            signal.setitimer(signal.ITIMER_REAL, limit)
            try:
                res, dt, peak = timed(functools.partial(fn, **kw), device)
                row.update(res, seconds=dt, peak_mib=peak)
            except OverBudget:
                row["error"] = f"stopped after {limit:.0f} s (its time limit)"
            except Exception as err:  # a failed case is reported, the others still run
                row["error"] = f"{type(err).__name__}: {err}"[:500]
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        pots = row.pop("_potentials", None)
        print(json.dumps(row), flush=True)
        rows.append(row)
        save()
        return row, pots

    # warm-up: compile the kernels (float32 with and without V, float64) at a small size
    xw, yw = clouds("cube", 1 << 12, device, seed=1)
    timed(functools.partial(ours, xw, yw, grad=True), device)
    timed(functools.partial(streaming, xw, yw), device)
    data = {kind: clouds(kind, n_mid, device) for kind in ("cube", "sphere")}
    for kind, (x, y) in data.items():
        case("ours multiscale fwd+bwd", kind, n_mid, ours, 60, x=x, y=y, grad=True)
        case("ours streaming fwd (exact)", kind, n_mid, streaming, 30, x=x, y=y)
        if has_peer:
            name = "flash-sinkhorn 0.4.1 multiscale fwd"
            row, pots = case(name, kind, n_mid, peer, 60, x=x, y=y)
            if pots is not None:  # its potentials measured by our certificate (not timed)
                try:
                    row["certified_error"] = certify(x, y, *pots)
                except Exception as err:
                    row["certify_error"] = f"{type(err).__name__}: {err}"[:300]
                del pots
                save()
    xb, yb = clouds("cube", n_big, device)
    row, _ = case("ours multiscale fwd+bwd", "cube", n_big, ours, 75, x=xb, y=yb, grad=True)
    if row.get("peak_mib") is not None:
        row["bytes_per_point"] = row["peak_mib"] * 2**20 / (2 * n_big)
        save()
    del xb, yb
    for kind, (x, y) in data.items():
        case("ours multiscale fwd", kind, n_mid, ours, 30, x=x, y=y, grad=False)
    for kind, (x, y) in data.items():
        name = "ours multiscale fwd+bwd tol 1e-3"
        case(name, kind, n_mid, ours, 40, x=x, y=y, grad=True, tol=1e-3)
    table = [
        f"multiscale benchmark: {env['device']}, torch {env['torch']}, "
        f"triton {env.get('triton', '-')}, flash-sinkhorn {env.get('flash_sinkhorn', '-')}, "
        f"{time.perf_counter() - t_start:.0f} s",
        "",
        "| case | cloud | n | s | value | certified L1 error | peak MiB | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = r.get("skipped") or r.get("error") or ""
        if "bytes_per_point" in r:
            note = f"{r['bytes_per_point']:.0f} B/point"
        table.append(
            f"| {r['case']} | {r['cloud']} | {r['n']} | {_fmt(r, 'seconds', '.3f')} | "
            f"{_fmt(r, 'value', '.6g')} | {_fmt(r, 'certified_error', '.3g')} | "
            f"{_fmt(r, 'peak_mib', '.0f')} | {note[:80]} |"
        )
    text = "\n".join(table)
    (out / "multiscale.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
