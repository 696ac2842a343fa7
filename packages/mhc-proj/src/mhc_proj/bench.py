"""mhc-proj-bench: the exact projection and the fused Sinkhorn-20 against torch (kernel-bench/1).

    python -m mhc_proj.bench                  # CUDA: the standard GPU suite (~1-2 min)
    python -m mhc_proj.bench --smoke          # tiny CPU run (CI)
    python -m mhc_proj.bench --batch 1048576 16777216 --sigma 1 10 --mode fwd fwd_bwd --graph
    python -m mhc_proj.bench --report docs/results/mhc-proj/run12-bench.json

Benches (``bench`` field), float32 B x 4 x 4 logits drawn from N(0, sigma^2):

- ``birkhoff4``: the exact projection, provider ``ours`` (:func:`mhc_proj.birkhoff_project`;
  its ``bwd`` rows time the backward launcher on a saved T, its ``graph`` rows CUDA graph
  replay of the launchers). No implementation of the exact projection runs here as a peer.
- ``sinkhorn20``: Sinkhorn-20 in the DeepSeek / TileKernels convention (eps = 1e-6), the
  iteration mHC layers run today: ``ours`` (:func:`mhc_proj.sinkhorn_project`, fused, with
  the exact backward of the iteration), ``torch-eager`` (the same iteration in torch ops,
  autograd through it) and ``torch-compile`` (that under ``torch.compile``, static shapes).

The hyper-connection layer benches ``hc_layer`` (ours against ``liger-kernel`` and
``torch-compile``) and ``hc_kernels`` (the fused kernels alone, as fractions of the HBM
floor) are described in ``mhc_proj/_bench_layer.py``; the fused layer boundary's
``hc_boundary`` (one boundary, default and deterministic mode) and ``hc_chain`` (chains of
2 and 4 layers: ``ours`` fused, ``ours-unfused``, ``liger-kernel``) in
``mhc_proj/_bench_boundary.py``.

Modes: ``fwd``, ``bwd`` (the backward alone, from a saved forward), ``fwd_bwd`` (forward
and ``torch.autograd.grad``). Columns: median time, the ratio of each peer to ours, the
fraction of the copy ceiling measured in the same process (ideal bytes: fwd 128 B, bwd
192 B, fwd+bwd 320 B per matrix), the max L1 marginal error of the output. The ``ours``
rows of the headline cases carry a ``headline`` label (tools/report.py); the run ends with
the short table of the package README (also printed for a saved run by ``--report``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch

import mhc_proj
from mhc_proj import _bench_boundary as BND
from mhc_proj import _bench_layer as L
from mhc_proj import _harness as H
from mhc_proj._config import MAX_ITER_F32, TOL_F32
from mhc_proj.birkhoff import birkhoff_bwd, birkhoff_fwd
from mhc_proj.reference import birkhoff_project_ref, marginal_error, sinkhorn_project_ref

PROJ_PROVIDERS = ["ours", "torch-eager", "torch-compile"]
PROVIDERS = PROJ_PROVIDERS + ["liger-kernel", "ours-unfused"]
MODES = ["fwd", "bwd", "fwd_bwd"]
BENCHES = ["birkhoff4", "sinkhorn20", "hc_layer", "hc_kernels", "hc_boundary", "hc_chain"]
# hc_chain only when asked (tools/mhc-proj/boundary_gpu.sh): its Liger-Kernel rows compile
# LigerMHC for a second width, minutes on a cold cache, beyond the standard suite's budget
DEFAULT_BENCHES = [b for b in BENCHES if b != "hc_chain"]
BYTES = {"fwd": 128, "bwd": 192, "fwd_bwd": 320}  # per matrix, the ideal kernel's
SAMPLE = 16384  # matrices compared with the float64 projection
ACCURACY_KEY = "marginal_err_max"
K, M = 131072, 1048576
BIG = 16777216
# (bench, mode, B, sigma) -> headline label of the ours row
HEADLINES = {
    ("birkhoff4", "fwd", BIG, 1.0): "exact projection, 16M, N(0,1), fwd",
    ("birkhoff4", "fwd_bwd", BIG, 1.0): "exact projection, 16M, N(0,1), fwd+bwd",
    ("birkhoff4", "bwd", BIG, 1.0): "exact projection, 16M, bwd",
    ("birkhoff4", "fwd", BIG, 10.0): "exact projection, 16M, N(0,10^2), fwd",
    ("sinkhorn20", "fwd", BIG, 1.0): "Sinkhorn-20, 16M, fwd",
    ("sinkhorn20", "fwd_bwd", BIG, 1.0): "Sinkhorn-20, 16M, fwd+bwd",
    ("sinkhorn20", "fwd_bwd", M, 1.0): "Sinkhorn-20, 1M, fwd+bwd",
}
GRAPH_HEADLINE = "exact projection, 128K, fwd+bwd, CUDA graph replay"


def torch_sinkhorn20(x: torch.Tensor) -> torch.Tensor:
    """The torch peer: DeepSeek/TileKernels Sinkhorn-20 (eps = 1e-6) in plain torch ops."""
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


def _fn(bench: str, provider: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if bench == "birkhoff4":
        if provider != "ours":
            raise H.Skip(f"no {provider} implementation of the exact projection")
        return mhc_proj.birkhoff_project
    if provider == "ours":
        return lambda x: mhc_proj.sinkhorn_project(x, iters=20)
    if provider == "torch-eager":
        return torch_sinkhorn20
    return compile_sinkhorn20()


def _inputs(batch: int, sigma: float, device: torch.device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, 4, 4, device=device, generator=g) * sigma
    gr = torch.randn(batch, 4, 4, device=device, generator=g)
    return x, gr


def _accuracy(out: torch.Tensor, x: torch.Tensor, sigma: float) -> dict:
    err = marginal_error(out.detach().float())
    acc = {"marginal_err_max": float(err.max()), "marginal_err_median": float(err.median())}
    if sigma <= 10:  # the float64 reference has no continuation: trusted up to std 10
        k = min(x.shape[0], SAMPLE)
        ref = birkhoff_project_ref(x[:k])
        acc["max_abs_err_vs_exact_ref"] = float((out[:k].double() - ref).abs().max())
    return acc


def run_case(R, bench, provider, mode, batch, sigma, device, ceiling, graph, warmup, reps):
    params = {"B": batch, "n": 4, "sigma": sigma, "dtype": "float32"}
    if graph:
        params["graph"] = True
    state: dict = {}

    def make():
        fn = _fn(bench, provider)
        x, gr = _inputs(batch, sigma, device)
        state["x"], state["fn"] = x, fn
        if graph:  # the launchers, as a training step would capture them
            if bench != "birkhoff4" or device.type != "cuda" or mode == "bwd":
                raise H.Skip("graph replay: the exact projection's fwd / fwd_bwd on CUDA")
            if mode == "fwd":
                return H.cuda_graph(lambda: fn(x), device)
            fwd = lambda: birkhoff_fwd(x, TOL_F32, MAX_ITER_F32, False)[0]
            return H.cuda_graph(lambda: birkhoff_bwd(fwd(), gr), device)
        if mode == "fwd":
            return lambda: fn(x)
        if mode == "fwd_bwd":
            xg = x.clone().requires_grad_(True)
            return lambda: torch.autograd.grad(fn(xg), xg, gr)
        if bench == "birkhoff4":  # bwd: the launcher on a saved T
            t = fn(x)
            return lambda: birkhoff_bwd(t, gr)
        if provider == "torch-compile":
            raise H.Skip("a compiled backward runs once per graph (donated buffers): fwd_bwd")
        xg = x.clone().requires_grad_(True)  # bwd through autograd, the forward's graph kept
        y = fn(xg)
        return lambda: torch.autograd.grad(y, xg, gr, retain_graph=True)

    def accuracy():
        if mode != "fwd":
            return {}
        with torch.no_grad():
            return _accuracy(state["fn"](state["x"]), state["x"], sigma)

    slow = provider != "ours" and batch >= M  # the torch peers take 5-300 ms per call
    headline = None
    if provider == "ours" and not graph:
        headline = HEADLINES.get((bench, mode, batch, sigma))
    elif provider == "ours" and mode == "fwd_bwd" and batch == K and sigma == 1.0:
        headline = GRAPH_HEADLINE
    return R.run(
        bench,
        provider,
        mode,
        params,
        make,
        warmup=warmup if warmup is not None else (2 if slow else 3),
        reps=reps if reps is not None else (5 if slow else 20),
        bytes_moved=BYTES[mode] * batch,
        ceiling_gbps=ceiling,
        accuracy=accuracy,
        headline=headline,
    )


# ---------------------------------------------------------------- suites
def gpu_suite(providers: list[str], benches: list[str], modes: list[str]) -> list[tuple]:
    """(bench, provider, mode, B, sigma, graph) of the standard H200 suite: the headline
    rows and their neighbours (128K, 1M, 16M; N(0,1) and N(0,10^2); graph replay)."""
    cases = []
    order = ["fwd", "fwd_bwd", "bwd"]
    for b in (K, M, BIG):
        for bench in benches:
            for p in providers:
                if bench not in ("birkhoff4", "sinkhorn20") or p not in PROJ_PROVIDERS:
                    continue
                if bench == "birkhoff4" and p != "ours":
                    continue
                if p == "torch-compile" and b < M:
                    continue  # one static compile per shape: keep the suite short
                ms = [m for m in order if m in modes and (m != "bwd" or p != "torch-compile")]
                cases += [(bench, p, m, b, 1.0, False) for m in ms]
    if "birkhoff4" in benches and "ours" in providers:
        for b in (K, M, BIG):  # large logits: more Newton iterations, ~24% in float64
            cases += [("birkhoff4", "ours", m, b, 10.0, False) for m in order if m in modes]
        cases += [("birkhoff4", "ours", m, K, 1.0, True) for m in ("fwd", "fwd_bwd") if m in modes]
    if "sinkhorn20" in benches and "ours" in providers and "fwd" in modes:
        cases.append(("sinkhorn20", "ours", "fwd", BIG, 10.0, False))  # far from stochastic
    return cases


# ---------------------------------------------------------------- the short table
# columns of the README table; a saved run of the earlier layout (one bench, providers
# ours-sinkhorn20 / torch-sinkhorn20 / compile-sinkhorn20) maps onto the same columns
_COLUMNS = {
    ("birkhoff4", "ours"): "exact",
    ("birkhoff4", "ours-sinkhorn20"): "sk",
    ("sinkhorn20", "ours"): "sk",
    ("birkhoff4", "torch-sinkhorn20"): "eager",
    ("sinkhorn20", "torch-eager"): "eager",
    ("birkhoff4", "compile-sinkhorn20"): "compile",
    ("sinkhorn20", "torch-compile"): "compile",
}


def headline(rows: list[dict]) -> str:
    """Per (mode, B, sigma): ours exact, ours Sinkhorn-20 and the torch Sinkhorn-20 peers,
    and the faster peer's time over ours Sinkhorn-20 (the same iteration)."""
    t: dict = {}
    for r in rows:
        col = _COLUMNS.get((r["bench"], r["provider"]))
        if r["status"] == "ok" and col:
            p = r["params"]
            key = (r["mode"], p["B"], p["sigma"], bool(p.get("graph")))
            t.setdefault(key, {})[col] = r["time_ms"]
    lines = [
        "| mode | B | sigma | ours exact | ours Sinkhorn-20 | torch eager | torch.compile "
        "| torch / ours Sinkhorn-20 |",
        "|" + "---|" * 8,
    ]
    for (mode, b, sigma, graph), d in t.items():
        peers = [d[k] for k in ("eager", "compile") if k in d]
        ratio = f"{min(peers) / d['sk']:.1f}x" if peers and d.get("sk") else "—"
        cells = [f"{mode} (graph)" if graph else mode, str(b), f"{sigma:g}"]
        cells += [H.fmt(d.get(k)) for k in ("exact", "sk", "eager", "compile")] + [ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = H.parser("mhc-proj-bench", __doc__.split("\n")[0], PROVIDERS, MODES)
    ap.add_argument("--bench", nargs="+", default=DEFAULT_BENCHES, choices=BENCHES)
    ap.add_argument("--batch", nargs="+", type=int, help="batch sizes B (custom run)")
    ap.add_argument("--sigma", nargs="+", type=float, help="logit std devs (custom run)")
    ap.add_argument("--graph", action="store_true", help="also CUDA graph replay (birkhoff4)")
    ap.add_argument("--report", metavar="JSON", help="print the short table of a saved run")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as fh:
            print(headline(json.load(fh)["results"]))
        return 0

    device = H.device_of(args)
    if args.smoke and not args.device:
        device = torch.device("cpu")
    R = H.Results("mhc-proj", mhc_proj.__version__, device, peers=("liger-kernel",))
    R.save(args.json)
    ceiling = H.copy_ceiling_gbps(device)
    if ceiling:
        R.env["copy_ceiling_gbps"] = ceiling
    providers, modes, benches = list(args.providers), list(args.mode), list(args.bench)
    custom = args.batch is not None or args.sigma is not None
    if args.smoke or (device.type != "cuda" and not custom):
        providers = [p for p in providers if p != "torch-compile"]  # minutes on a CPU
        custom, args.batch, args.sigma = True, args.batch or [64, 1023], args.sigma or [1.0]
    if custom:
        cases = [
            (bench, p, m, b, s, False)
            for b in args.batch or [M]
            for s in args.sigma or [1.0]
            for bench in benches
            if bench in ("birkhoff4", "sinkhorn20")
            for p in providers
            if (bench == "sinkhorn20" and p in PROJ_PROVIDERS) or p == "ours"
            for m in modes
        ]
        if args.graph and device.type == "cuda" and "birkhoff4" in benches:
            cases += [
                ("birkhoff4", "ours", m, b, s, True)
                for b in args.batch or [M]
                for s in args.sigma or [1.0]
                for m in modes
                if m != "bwd"
            ]
    else:
        cases = gpu_suite(providers, benches, modes)
    layer_cases = L.cases(providers, modes, args.smoke or device.type != "cuda")
    layer_cases = [c for c in layer_cases if c[0] in benches]
    t0 = time.time()
    for bench, p, m, b, s, graph in cases:
        row = run_case(R, bench, p, m, b, s, device, ceiling, graph, args.warmup, args.reps)
        print(
            f"[bench {time.time() - t0:6.1f} s] {bench} {p} {m} B={b} sigma={s:g}"
            f"{' graph' if graph else ''}: {row['status']} {H.fmt(row['time_ms'])}",
            flush=True,
        )
    state: dict = {}  # the kernels' saved inputs, one problem size at a time
    for case in layer_cases:
        row = L.run(R, case, device, ceiling, args.warmup, args.reps, state)
        print(
            f"[bench {time.time() - t0:6.1f} s] {' '.join(map(str, case))}: {row['status']} "
            f"{H.fmt(row['time_ms'])}",
            flush=True,
        )
    state.clear()
    smoke = args.smoke or device.type != "cuda"
    for case in [c for c in BND.cases(providers, modes, smoke) if c[0] in benches]:
        row = BND.run(R, case, device, ceiling, args.warmup, args.reps)
        print(
            f"[bench {time.time() - t0:6.1f} s] {' '.join(map(str, case))}: {row['status']} "
            f"{H.fmt(row['time_ms'])} {row['error'] or ''}",
            flush=True,
        )
    print(H.markdown(R.rows, accuracy_key=ACCURACY_KEY))
    print(f"\n({len(R.rows)} cases in {time.time() - t0:.1f} s on {device})\n")
    print(headline(R.rows))
    if any(r["bench"] in ("hc_boundary", "hc_chain") for r in R.rows):
        print("\n" + BND.summary(R.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
