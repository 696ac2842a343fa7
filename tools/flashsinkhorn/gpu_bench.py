"""GPU rows of flashsinkhorn issue #36 (small problems, ragged batches, 50k no-regression),
peers in the same process; JSON and a markdown table. Run by tools/flashsinkhorn/gpu_check.sh.

    python tools/flashsinkhorn/gpu_bench.py --out OUT [--sections small ragged big]
        [--before SRC]   # SRC: an old packages/flashsinkhorn/src (the "big" rows again there)

Sections:

- ``small``: SamplesLoss fwd+bwd (p = 2, blur 0.05, scaling 0.5, debias False) at
  n = m = 512, 2048, 8192, d = 3 and 64: ours with ``backend="auto"``, ``"dense"`` and
  ``"streaming"`` (the dense / streaming crossover of ``_config.DENSE_MAX_SCORES_CUDA``),
  flash-sinkhorn 0.4.1 and GeomLoss tensorized; plus ours with ``diameter=`` given (no host
  read for the schedule) and, where the capture succeeds, the whole fwd+bwd replayed from a
  CUDA graph (``torch.cuda.graph``), to show what is left of the host overhead;
- ``ragged``: 64 problems of 500-4000 points (d = 3 and 64), one call (a list of clouds,
  the varlen problem) against a Python loop over single problems, and against one padded
  batch with zero weights;
- ``big``: the 50k rows that must not regress (iteration, SamplesLoss fwd / fwd+bwd at
  d = 64 and 512, debias, 64 x 2048 batched, HVP 20k), written with the public API only so
  that ``--before`` runs the same code on an old source tree in a subprocess of this call.

Timing: CUDA events around each call, median of ``--reps`` after warm-up calls (autotuning
and compiles happen there); the first call of each case is reported separately.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

PEERS = ("flash-sinkhorn", "geomloss")


DEVICE = "cuda"
# --smoke (CPU, seconds): every code path of the script at tiny sizes, to check it before a
# device call; the sizes of each section are divided by SMOKE
SMOKE = 1


def clouds(n, d, batch=None, seed=0, device=None):
    n = max(8, n // SMOKE)
    device = device or DEVICE
    gen = torch.Generator().manual_seed(seed)
    sh = () if batch is None else (batch,)
    s = 1.0 / math.sqrt(d)
    x = torch.rand(*sh, n, d, generator=gen) * s
    y = torch.rand(*sh, n, d, generator=gen) * s + 0.5 * s
    return x.to(device), y.to(device)


def cuda_ms(fn, warmup=2, reps=10):
    """``(median ms, first-call ms)`` of ``fn`` with CUDA events."""
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), first


def record(rows, **row):
    rows.append(row)
    print(json.dumps(row), flush=True)


def run_case(rows, fn, reps=10, **meta):
    try:
        ms, first = cuda_ms(fn, reps=reps)
        record(rows, ms=ms, first_ms=first, **meta)
    except Exception as e:  # a peer that fails or an API absent from an old build
        record(rows, ms=None, error=f"{type(e).__name__}: {e}"[:300], **meta)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _fs():
    import flashsinkhorn as fs  # noqa: PLC0415 (the package under test: its path is set by the caller)

    return fs


def _samples_loss(backend, debias=False, **kw):
    fs = _fs()
    try:
        return fs.SamplesLoss(blur=0.05, scaling=0.5, debias=debias, backend=backend, **kw)
    except ValueError:
        if backend in ("dense", "streaming"):  # an old build: only auto / triton / torch
            raise
        return fs.SamplesLoss(blur=0.05, scaling=0.5, debias=debias, **kw)


def fwd_bwd(loss, x, y):
    def fn():
        xg = x.detach().requires_grad_()
        loss(xg, y).sum().backward()

    return fn


def fwd(loss, x, y):
    def fn():
        with torch.no_grad():
            loss(x, y)

    return fn


def peer_loss(name, debias=False):
    if name == "geomloss":
        import geomloss  # noqa: PLC0415

        return geomloss.SamplesLoss(
            "sinkhorn", p=2, blur=0.05, scaling=0.5, debias=debias, backend="tensorized"
        )
    import flash_sinkhorn  # noqa: PLC0415

    # GeomLoss's conventions (cost |x - y|^2 / 2), tf32 as ours
    return flash_sinkhorn.SamplesLoss(
        "sinkhorn", p=2, blur=0.05, scaling=0.5, debias=debias, half_cost=True, allow_tf32=True
    )


def graphed(loss, x, y):
    """The fwd+bwd of ``loss`` captured once in a CUDA graph and replayed (static x, y)."""
    xs = x.detach().clone().requires_grad_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            xs.grad = None
            loss(xs, y).sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    xs.grad = None
    with torch.cuda.graph(graph):
        loss(xs, y).sum().backward()
    return graph.replay


def section_small(rows, reps):
    for d in (3, 64):
        for n in (512, 2048, 8192):
            _small_case(rows, reps, n, d)


def _small_case(rows, reps, n, d):
    x, y = clouds(n, d)
    meta = dict(section="small", case="SamplesLoss fwd+bwd", n=n, d=d)
    for be in ("auto", "dense", "streaming"):
        try:
            loss = _samples_loss(be)
        except ValueError as e:
            record(rows, ms=None, error=str(e)[:200], provider=f"ours-{be}", **meta)
            continue
        run_case(rows, fwd_bwd(loss, x, y), reps, provider=f"ours-{be}", **meta)
    diam = 1.5  # the clouds lie in [0, 1.5 / sqrt(d)]^d: its diagonal
    loss = _samples_loss("auto", diameter=diam)
    run_case(rows, fwd_bwd(loss, x, y), reps, provider="ours-auto-diameter", **meta)
    try:
        if DEVICE != "cuda":
            raise RuntimeError("CUDA graphs need CUDA")
        replay = graphed(loss, x, y)
        run_case(rows, replay, reps, provider="ours-auto-cudagraph", **meta)
    except Exception as e:
        error = f"capture: {type(e).__name__}: {e}"[:300]
        record(rows, ms=None, error=error, provider="ours-auto-cudagraph", **meta)
    for peer in PEERS:
        try:
            loss = peer_loss(peer)
        except Exception as e:
            record(rows, ms=None, error=f"{type(e).__name__}: {e}"[:200], provider=peer, **meta)
            continue
        run_case(rows, fwd_bwd(loss, x, y), reps, provider=peer, **meta)


def section_ragged(rows, reps):
    gen = torch.Generator().manual_seed(1)
    sizes = [max(8, int(v) // SMOKE) for v in torch.randint(500, 4001, (128,), generator=gen)]
    for d in (3, 64):
        _ragged_case(rows, reps, d, sizes[0::2], sizes[1::2])


def _ragged_case(rows, reps, d, ns, ms):
    xs = [clouds(n, d, seed=k)[0] for k, n in enumerate(ns)]
    ys = [clouds(m, d, seed=100 + k)[1] for k, m in enumerate(ms)]
    meta = dict(section="ragged", case="64 ragged problems fwd+bwd (500-4000 points)", d=d)
    loss = _samples_loss("auto")

    def one_call():
        xg = [x.detach().requires_grad_() for x in xs]
        loss(xg, ys).sum().backward()

    def loop():
        for x, y in zip(xs, ys):
            xg = x.detach().requires_grad_()
            loss(xg, y).backward()

    B, N, M = len(xs), max(ns), max(ms)
    xp = torch.zeros(B, N, d, device=DEVICE)
    yp = torch.zeros(B, M, d, device=DEVICE)
    a = torch.zeros(B, N, device=DEVICE)
    b = torch.zeros(B, M, device=DEVICE)
    for k, (x, y) in enumerate(zip(xs, ys)):
        xp[k, : x.shape[0]], yp[k, : y.shape[0]] = x, y
        a[k, : x.shape[0]], b[k, : y.shape[0]] = 1.0 / x.shape[0], 1.0 / y.shape[0]

    def padded():
        xg = xp.detach().requires_grad_()
        loss(a, xg, b, yp).sum().backward()

    run_case(rows, one_call, reps, provider="ours-varlen-one-call", **meta)
    run_case(rows, loop, max(2, reps // 3), provider="ours-python-loop", **meta)
    run_case(rows, padded, reps, provider="ours-padded-zero-weights", **meta)


def section_big(rows, reps, tag):
    fs = _fs()
    meta = dict(section="big", build=tag)
    x, y = clouds(50000, 64)

    def iterations(k, x=x, y=y):
        fs.solve(x, y, eps=0.01, schedule="symmetric", max_iter=k, tol=None, warn=False)

    t2, _ = cuda_ms(lambda: iterations(2), reps=reps)
    t6, _ = cuda_ms(lambda: iterations(6), reps=reps)
    record(rows, case="iteration 50k d=64 (t6-t2)/4", ms=(t6 - t2) / 4, provider="ours", **meta)
    for d in (64, 512):
        x, y = clouds(50000, d)
        loss = _samples_loss("auto")
        run_case(
            rows, fwd(loss, x, y), reps, case=f"SamplesLoss 50k d={d} fwd", provider="ours", **meta
        )
        run_case(
            rows,
            fwd_bwd(loss, x, y),
            reps,
            case=f"SamplesLoss 50k d={d} fwd+bwd",
            provider="ours",
            **meta,
        )
    x, y = clouds(50000, 64)
    loss = _samples_loss("auto", debias=True)
    run_case(rows, fwd(loss, x, y), reps, case="debias 50k d=64 fwd", provider="ours", **meta)
    run_case(
        rows, fwd_bwd(loss, x, y), reps, case="debias 50k d=64 fwd+bwd", provider="ours", **meta
    )
    x, y = clouds(2048, 64, batch=64)
    loss = _samples_loss("auto")
    run_case(rows, fwd(loss, x, y), reps, case="batched 64x2048 d=64 fwd", provider="ours", **meta)
    run_case(
        rows,
        fwd_bwd(loss, x, y),
        reps,
        case="batched 64x2048 d=64 fwd+bwd",
        provider="ours",
        **meta,
    )
    gen = torch.Generator().manual_seed(0)
    n = 20000 // SMOKE
    x = (torch.rand(n, 64, generator=gen) / 8).to(DEVICE)
    y = (torch.rand(n, 64, generator=gen) / 8 + 0.1 / 8).to(DEVICE)
    v = torch.randn(n, 64, generator=gen).to(DEVICE)
    hvp = getattr(getattr(fs, "second_order", fs), "hvp", None) or fs.second_order.hvp
    run_case(
        rows,
        lambda: hvp(x, y, v, eps=0.01),
        max(3, reps // 2),
        case="HVP 20k d=64",
        provider="ours",
        **meta,
    )


def table(rows):
    lines = [
        "| section | case | n | d | provider | ms | first call ms | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = "—" if r.get("ms") is None else f"{r['ms']:.3f}"
        first = "" if r.get("first_ms") is None else f"{r['first_ms']:.1f}"
        note = r.get("error", "") or r.get("build", "")
        lines.append(
            f"| {r['section']} | {r['case']} | {r.get('n', '')} | {r.get('d', '')} "
            f"| {r['provider']} | {ms} | {first} | {note[:80]} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sections", nargs="+", default=["small", "ragged", "big"])
    ap.add_argument("--before", default=None, help="an old packages/flashsinkhorn/src")
    ap.add_argument("--tag", default="after")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (checks the script)")
    args = ap.parse_args(argv)
    global DEVICE, SMOKE
    if args.smoke:
        DEVICE, SMOKE = "cpu", 64
    os.makedirs(args.out, exist_ok=True)
    fs = _fs()
    env = {
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "flashsinkhorn": fs.__file__,
        "tag": args.tag,
    }
    print(json.dumps(env), flush=True)
    rows = []
    for name in args.sections:
        t0 = time.time()
        {"small": section_small, "ragged": section_ragged}.get(
            name, lambda r, k: section_big(r, k, args.tag)
        )(rows, args.reps)
        print(f"section {name}: {time.time() - t0:.0f} s", flush=True)
    if args.before:
        path = os.path.join(args.out, "before.json")
        cmd = [
            sys.executable,
            __file__,
            "--out",
            args.out,
            "--sections",
            "big",
            "--tag",
            "before",
            "--reps",
            str(args.reps),
        ] + (["--smoke"] if args.smoke else [])
        pp = os.environ.get("PYTHONPATH", "")
        env_b = dict(os.environ, PYTHONPATH=os.pathsep.join([args.before, pp]))
        subprocess.run(cmd, env=env_b, check=False, timeout=float(os.environ.get("BEFORE_S", 150)))
        if os.path.exists(path):
            with open(path) as fh:
                rows += json.load(fh)["rows"]
    name = "before.json" if args.tag == "before" else "gpu-bench-36.json"
    with open(os.path.join(args.out, name), "w") as fh:
        json.dump({"env": env, "rows": rows}, fh, indent=1)
    if args.tag != "before":
        text = table(rows)
        with open(os.path.join(args.out, "gpu-bench-36.md"), "w") as fh:
            fh.write(f"{env}\n\n{text}\n")
        print(text)


if __name__ == "__main__":
    main()
