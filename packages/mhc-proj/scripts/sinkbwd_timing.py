"""Sinkhorn-20 backward kernels timed interleaved in one process (CUDA).

For each batch size and each repetition, every variant is timed once per mode, in turn, so
clock and host drift hit all variants alike. Modes: ``bwd`` (the launcher
:func:`mhc_proj.sinkhorn.sinkhorn_bwd`, kernel + output allocation from the cache) and
``fwd_bwd`` (default forward + the variant's backward through autograd, as
``mhc_proj.bench``'s fwd_bwd rows: ``torch.autograd.grad``). Median / p20 / p80 of CUDA
events, each call on an idle GPU; GB/s of the ideal kernel (bwd 192 B, fwd_bwd 320 B per
matrix, ``mhc_proj.bench.BYTES``) and its fraction of the copy ceiling measured in the same
process (``mhc_proj.bench.copy_ceiling_gbps``). Writes OUT/sinkbwd.json and
OUT/sinkbwd.md; prints the table.

    python packages/mhc-proj/scripts/sinkbwd_timing.py --out OUT \
        --batch 16777216 1048576 --variants thread-e-occ3 thread-rs thread-rp thread-r-occ3
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

from mhc_proj.bench import BYTES, _env, copy_ceiling_gbps
from mhc_proj.sinkhorn import BWD_DEFAULT, _project, sinkhorn_bwd


def _quant(ts: list[float], p: float) -> float:
    s = sorted(ts)
    return s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[16777216, 1048576])
    ap.add_argument(
        "--variants", nargs="+", default=[BWD_DEFAULT, "thread-rs", "thread-rp", "thread-r-occ3"]
    )
    ap.add_argument("--modes", nargs="+", default=["bwd", "fwd_bwd"])
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test (wall clock)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ceiling = copy_ceiling_gbps(dev)
    rows = []
    for b in args.batch:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(b, 4, 4, device=dev, generator=g) * args.sigma
        gr = torch.randn(b, 4, 4, device=dev, generator=g)
        xg = x.clone().requires_grad_(True)

        def call(v: str, mode: str, x=x, gr=gr, xg=xg):
            if mode == "bwd":
                return sinkhorn_bwd(x, gr, 20, 1e-6, variant=v)
            (d,) = torch.autograd.grad(_project(xg, 20, 1e-6, bwd_variant=v), xg, gr)
            return d

        times = {(v, m): [] for v in args.variants for m in args.modes}
        for v in args.variants:  # warm-up (and the one-time shared-memory attribute)
            for m in args.modes:
                call(v, m)
        if cuda:
            torch.cuda.synchronize(dev)
        for _ in range(args.reps):
            for v in args.variants:
                for m in args.modes:
                    if not cuda:
                        h0 = time.perf_counter()
                        call(v, m)
                        times[(v, m)].append((time.perf_counter() - h0) * 1e3)
                        continue
                    s = torch.cuda.Event(enable_timing=True)
                    e = torch.cuda.Event(enable_timing=True)
                    s.record()
                    call(v, m)
                    e.record()
                    e.synchronize()
                    times[(v, m)].append(s.elapsed_time(e))
        # agreement with the first variant (the default) on this batch, bwd
        base = sinkhorn_bwd(x, gr, 20, 1e-6, variant=args.variants[0])
        scale = float(base.abs().max())
        for (v, m), ts in times.items():
            ms = statistics.median(ts)
            gbps = BYTES[m] * b / (ms * 1e-3) / 1e9
            rows.append(
                {
                    "variant": v,
                    "mode": m,
                    "B": b,
                    "sigma": args.sigma,
                    "time_ms": ms,
                    "time_ms_p20": _quant(ts, 0.2),
                    "time_ms_p80": _quant(ts, 0.8),
                    "reps": len(ts),
                    "gbps": gbps,
                    "frac_ceiling": gbps / ceiling if ceiling else None,
                    "max_rel_diff_vs_first": float(
                        (sinkhorn_bwd(x, gr, 20, 1e-6, variant=v) - base).abs().max() / scale
                    )
                    if m == "bwd"
                    else None,
                }
            )
        del call, x, gr, xg, base
        if cuda:
            torch.cuda.empty_cache()
    first = {(r["mode"], r["B"]): r["time_ms"] for r in rows if r["variant"] == args.variants[0]}
    lines = [
        f"Sinkhorn-20 backward, interleaved, {args.reps} reps, sigma {args.sigma:g}; copy "
        f"ceiling {f'{ceiling:.0f} GB/s' if ceiling else 'n/a (CPU)'}",
        "",
        "| variant | mode | B | ms (p20-p80) | / first | GB/s | frac ceiling | max rel diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rd, fc = r["max_rel_diff_vs_first"], r["frac_ceiling"]
        lines.append(
            f"| {r['variant']} | {r['mode']} | {r['B']} | {r['time_ms']:.4f} "
            f"({r['time_ms_p20']:.4f}-{r['time_ms_p80']:.4f}) | "
            f"{r['time_ms'] / first[(r['mode'], r['B'])]:.3f} | {r['gbps']:.0f} | "
            f"{'—' if fc is None else f'{fc:.3f}'} | {'—' if rd is None else f'{rd:.1e}'} |"
        )
    lines.append(f"\n{time.perf_counter() - t0:.1f} s")
    text = "\n".join(lines)
    print(text)
    (out / "sinkbwd.md").write_text(text + "\n")
    doc = {"env": _env(dev), "copy_ceiling_gbps": ceiling, "results": rows}
    (out / "sinkbwd.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
