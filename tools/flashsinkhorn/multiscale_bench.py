"""The multiscale backend on a GPU (issue #35): one command, JSON and a table under --out.

    python tools/flashsinkhorn/multiscale_bench.py --out $OUT           # H100 / H200, < 8 min
    python tools/flashsinkhorn/multiscale_bench.py --out /tmp/ms --smoke  # CPU, seconds

Cases (d = 3, blur 0.01, GeomLoss's schedule at scaling 0.5, debias False, cost
|x - y|^2 / 2; cube: x, y uniform in [0, 1]^3 and 0.8 [0, 1]^3 + 0.1; sphere: x on the unit
sphere, y on the sphere stretched by (1.2, 0.9, 1.0) and shifted by 0.05):

- n = m = 2^20, cube and sphere: our ``SamplesLoss(backend="multiscale")`` forward and
  forward + backward (value, the certified marginal error ``last_marginal_error``, time,
  peak memory), the same with ``tol=1e-3`` (iterations at the final blur until the
  certificate is below 1e-3), our exact streaming forward (``backend="streaming"``) and
  flash-sinkhorn 0.4.1's ``backend="multiscale"`` forward (if importable), whose potentials
  are then certified by our certificate (the same float64 bound);
- n = m = 2^24, cube: our forward + backward, peak memory in bytes per point.

Every case runs under the time left (``--budget`` seconds in all): a case that would start
after the budget is skipped and says so. Writes ``OUT/multiscale.json`` and
``OUT/multiscale.md`` (printed last).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

import flashsinkhorn as fs
from flashsinkhorn.multiscale import MultiscaleProblem

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
        "value": float(v),
        "certified_error": None if err is None else float(err),
        "grad_norm": float(xg.grad.norm()) if grad else None,
    }


def streaming(x, y):
    loss = fs.SamplesLoss(blur=BLUR, scaling=0.5, debias=False, backend="streaming")
    with torch.no_grad():
        return {"value": float(loss(x, y))}


def peer(x, y):
    """flash-sinkhorn 0.4.1's multiscale forward, and its potentials certified by ours."""
    import flash_sinkhorn  # noqa: PLC0415 (an optional peer, imported only where it runs)

    kw = dict(blur=BLUR, half_cost=True, debias=False, backend="multiscale")
    loss = flash_sinkhorn.SamplesLoss("sinkhorn", **kw)
    with torch.no_grad():
        v = float(loss(x, y))
    return {"value": v}


def peer_certified(x, y):
    import flash_sinkhorn  # noqa: PLC0415

    kw = dict(blur=BLUR, half_cost=True, debias=False, backend="multiscale", potentials=True)
    with torch.no_grad():
        f, g = flash_sinkhorn.SamplesLoss("sinkhorn", **kw)(x, y)
    return certify(x, y, f.reshape(1, -1).float(), g.reshape(1, -1).float())


def certify(x, y, f, g):
    """Our float64 upper bound of the L1 marginal error of potentials (f, g) of the cost
    |x - y|^2 / 2 at eps = blur^2 (uniform weights)."""
    n, m = x.shape[0], y.shape[0]
    a = torch.full((1, n), 1.0 / n, device=x.device)
    b = torch.full((1, m), 1.0 / m, device=x.device)
    backend = "triton" if x.is_cuda else "torch"
    prob = MultiscaleProblem(
        X=x[None],
        Y=y[None],
        a=a,
        b=b,
        cx=a * 0,
        cy=b * 0,
        c2=1.0,
        cost_scale=0.5,
        backend=backend,
    )  # noqa: E501
    a64 = torch.full((1, n), 1.0 / n, dtype=torch.float64, device=x.device)
    b64 = torch.full((1, m), 1.0 / m, dtype=torch.float64, device=x.device)
    err = prob.certificate(f, g, BLUR**2, None, None, a64=a64, b64=b64)[0]
    return {"certified_error": float(err)}


def _fmt(row, key, spec):
    v = row.get(key)
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="small sizes on the CPU")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds in all")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    n_mid, n_big = (1 << 11, 1 << 12) if args.smoke else (1 << 20, 1 << 24)
    t_start = time.perf_counter()
    env = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
    }
    try:
        import triton  # noqa: PLC0415

        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import flash_sinkhorn  # noqa: PLC0415

        env["flash_sinkhorn"] = getattr(flash_sinkhorn, "__version__", "?")
        has_peer = device.type == "cuda"
    except ImportError:
        has_peer = False
    rows = []
    results = {"env": env, "cases": rows}

    def save():
        (out / "multiscale.json").write_text(json.dumps(results, indent=1))

    def case(name, kind, n, fn, est, **kw):
        """Run ``fn(**kw)`` unless the budget would be exceeded (``est`` seconds expected)."""
        left = args.budget - (time.perf_counter() - t_start)
        row = {"case": name, "cloud": kind, "n": n}
        if left < est:
            row["skipped"] = f"{left:.0f} s left, about {est:.0f} s needed"
            print(f"{name} {kind} n={n}: skipped ({row['skipped']})", flush=True)
        else:
            try:
                res, dt, peak = timed(functools.partial(fn, **kw), device)
                row.update(res, seconds=dt, peak_mib=peak)
            except Exception as err:  # a failed case is reported, the others still run
                row["error"] = f"{type(err).__name__}: {err}"[:500]
            print(json.dumps(row), flush=True)
        rows.append(row)
        save()
        return row

    # warm-up: compile the kernels (float32 with and without V, float64) at a small size
    xw, yw = clouds("cube", 1 << 10 if args.smoke else 1 << 12, device, seed=1)
    timed(functools.partial(ours, xw, yw, grad=True, tol=1e-3), device)
    timed(functools.partial(streaming, xw, yw), device)
    for kind in ("cube", "sphere"):
        x, y = clouds(kind, n_mid, device)
        xy = {"x": x, "y": y}
        case("ours multiscale fwd", kind, n_mid, ours, 20, grad=False, **xy)
        case("ours multiscale fwd+bwd", kind, n_mid, ours, 20, grad=True, **xy)
        case("ours multiscale fwd+bwd tol 1e-3", kind, n_mid, ours, 30, grad=True, tol=1e-3, **xy)
        case("ours streaming fwd (exact)", kind, n_mid, streaming, 15, **xy)
        if has_peer:
            case("flash-sinkhorn 0.4.1 multiscale fwd", kind, n_mid, peer, 40, **xy)
            name = "flash-sinkhorn potentials, our certificate"
            case(name, kind, n_mid, peer_certified, 40, **xy)
        del x, y, xy
    x, y = clouds("cube", n_big, device)
    row = case("ours multiscale fwd+bwd", "cube", n_big, ours, 120, x=x, y=y, grad=True)
    if row.get("peak_mib") is not None:
        row["bytes_per_point"] = row["peak_mib"] * 2**20 / (2 * n_big)
        save()
    table = [
        f"multiscale benchmark: {env['device']}, torch {env['torch']}, "
        f"triton {env.get('triton', '-')}, flash-sinkhorn {env.get('flash_sinkhorn', '-')}",
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
