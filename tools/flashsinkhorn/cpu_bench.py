"""CPU rows of docs/benchmarks.md (flashsinkhorn): SamplesLoss fwd+bwd against GeomLoss's
tensorized backend and ``solve`` against POT's ``ot.solve_sample``, one thread, one process.

    PYTHONPATH=packages/flashsinkhorn/src python tools/flashsinkhorn/cpu_bench.py \
        --json OUT.json [--sizes 300 1000 5000] [--dims 3 64] [--rounds 5]

Points: x, y uniform in ``[0, 1/sqrt(d)]^d``, y shifted by ``0.5/sqrt(d)`` (the GPU bench's
clouds). SamplesLoss: p = 2, blur 0.05, scaling 0.5, debias False (the issue's table) and
True. solve: eps 0.01, float32, ours at tol 1e-5 (L1 error of both marginals, measured in
float64); POT at tol 1e-5 (its criterion: the L2 error of one marginal, checked every 10
iterations, a looser test) and at 1e-7 (about our final accuracy); the table gives each
one's final L1 marginal error, measured here in float64. POT is not run at n = 5000 (its
log-domain Sinkhorn takes minutes there).

The machine may be shared: each round times every provider of a case back to back
(interleaved, so that load hits them alike), a round's time is the median of ``--reps``
calls after one warm-up call, and the table gives the median over rounds with the spread
(min-max over rounds). The first call of the process (SamplesLoss, n = 1000, d = 3) is timed
before anything else ran.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import torch


def clouds(n, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    s = 1.0 / math.sqrt(d)
    x = torch.rand(n, d, generator=gen) * s
    y = torch.rand(n, d, generator=gen) * s + 0.5 * s
    return x, y


def l1_marginal_error64(x, y, f, g, eps):
    """``|P 1 - a|_1 + |P^T 1 - b|_1`` in float64 for uniform weights, cost |x - y|^2."""
    x, y, f, g = x.double(), y.double(), f.double(), g.double()
    n, m = x.shape[0], y.shape[0]
    C = torch.cdist(x, y) ** 2
    P = torch.exp((f[:, None] + g[None, :] - C) / eps) / (n * m)
    return float((P.sum(1) - 1 / n).abs().sum() + (P.sum(0) - 1 / m).abs().sum())


def timed(fn, reps):
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[300, 1000, 5000])
    ap.add_argument("--dims", type=int, nargs="+", default=[3, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", choices=("loss", "solve"), default=None, help="one kind of row")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    import flashsinkhorn as fs  # noqa: PLC0415 (timed below: the first call of the process)

    x, y = clouds(1000, 3)

    def first_loss():
        xg = x.clone().requires_grad_()
        fs.SamplesLoss(blur=0.05, debias=False)(xg, y).backward()

    t0 = time.perf_counter()
    first_loss()
    first = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    first_loss()
    second = (time.perf_counter() - t0) * 1e3

    import geomloss  # noqa: PLC0415 (peers imported after the first-call measurement)
    import ot  # noqa: PLC0415

    rows = []
    for n in args.sizes:
        for d in args.dims:
            x, y = clouds(n, d)
            for debias in (False, True) if args.only != "solve" else ():

                def ours(debias=debias, x=x, y=y):
                    xg = x.clone().requires_grad_()
                    fs.SamplesLoss(blur=0.05, debias=debias)(xg, y).backward()

                def peer(debias=debias, x=x, y=y):
                    xg = x.clone().requires_grad_()
                    loss = geomloss.SamplesLoss(
                        "sinkhorn", p=2, blur=0.05, debias=debias, backend="tensorized"
                    )
                    loss(xg, y).backward()

                rows.append(measure("SamplesLoss fwd+bwd", n, d, debias, ours, peer, args))
            for pot_tol in (1e-5, 1e-7) if n <= 1000 and args.only != "loss" else ():
                r = fs.solve(x, y, eps=0.01, tol=1e-5, warn=False)
                res = ot.solve_sample(x, y, reg=0.01, tol=pot_tol)
                # POT's potentials are its log-scalings, P = u_i K_ij v_j: f = eps log(n u)
                pot_f = 0.01 * (res.potentials[0] + math.log(n))
                pot_g = 0.01 * (res.potentials[1] + math.log(n))
                err = {
                    "ours": l1_marginal_error64(x, y, r.f, r.g, 0.01),
                    "peer": l1_marginal_error64(x, y, pot_f, pot_g, 0.01),
                    "ours_n_iter": int(r.n_iter),
                    "ours_backend": r.backend,
                }

                def ours_solve(x=x, y=y):
                    fs.solve(x, y, eps=0.01, tol=1e-5, warn=False)

                def pot_solve(x=x, y=y, pot_tol=pot_tol):
                    ot.solve_sample(x, y, reg=0.01, tol=pot_tol)

                case = f"solve eps 0.01 tol 1e-5 (POT tol {pot_tol:g})"
                row = measure(case, n, d, None, ours_solve, pot_solve, args)
                row.update(l1_error=err)
                rows.append(row)
            if rows:
                print(json.dumps(rows[-1]), flush=True)
    env = {
        "torch": torch.__version__,
        "geomloss": geomloss.__version__,
        "pot": ot.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = {"env": env, "first_call_ms": first, "second_call_ms": second, "rows": rows}
    print(table(out))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


def measure(case, n, d, debias, ours, peer, args):
    """Interleaved rounds: ``{"ours": ms, "peer": ms, "spread": ...}`` medians over rounds."""
    t = {"ours": [], "peer": []}
    for _ in range(args.rounds):
        t["ours"].append(timed(ours, args.reps))
        t["peer"].append(timed(peer, args.reps))
    med = {k: statistics.median(v) for k, v in t.items()}
    return {
        "case": case,
        "n": n,
        "d": d,
        "debias": debias,
        "ours_ms": med["ours"],
        "peer_ms": med["peer"],
        "ratio": med["peer"] / med["ours"],
        "ours_spread_ms": [min(t["ours"]), max(t["ours"])],
        "peer_spread_ms": [min(t["peer"]), max(t["peer"])],
    }


def table(out):
    lines = [
        "| case | n = m | d | ours ms (spread) | peer ms (spread) | peer / ours | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        peer = "GeomLoss tensorized" if r["case"].startswith("SamplesLoss") else "POT"
        case = r["case"] + ("" if r["debias"] is None else f", debias {r['debias']}")
        note = peer
        if "l1_error" in r:
            e = r["l1_error"]
            note += f"; L1 error ours {e['ours']:.1e} ({e['ours_n_iter']} it), POT {e['peer']:.1e}"
        os_, ps = r["ours_spread_ms"], r["peer_spread_ms"]
        lines.append(
            f"| {case} | {r['n']} | {r['d']} | {r['ours_ms']:.1f} ({os_[0]:.1f}-{os_[1]:.1f}) "
            f"| {r['peer_ms']:.1f} ({ps[0]:.1f}-{ps[1]:.1f}) | {r['ratio']:.2f}x | {note} |"
        )
    lines.append(
        f"\nFirst call of the process (SamplesLoss fwd+bwd, n = m = 1000, d = 3): "
        f"{out['first_call_ms']:.1f} ms; second call {out['second_call_ms']:.1f} ms."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
