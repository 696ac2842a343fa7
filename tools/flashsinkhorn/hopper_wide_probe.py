"""Tells a slow compile from a hang for the sm_90 Gluon pass on wide rows (GPU, ~1 min).

    python3 tools/flashsinkhorn/hopper_wide_probe.py --d 1024 --precision tf32 --limit 90

Runs the Gluon pass (the default config and, with --configs, the 128-wide x-streamed one)
in a child process per config: first the compile alone (triton's warmup of the launch is
the first call), then three timed calls, each printed as soon as it is known, so a run
killed by the limit still says how far it got. Compared with the Triton pass on the same
operands (error against each other) when both finish.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from hopper_check import _problem  # same folder: run as a script


def child(d: int, precision: str, n: int, config: str) -> None:
    import torch

    from flashsinkhorn import _softmin_hopper as H
    from flashsinkhorn._softmin_triton import softmin_triton

    xk, yk, cx, cy, logw = _problem(n, d, precision, "cuda")  # hopper_check's clouds
    g = torch.zeros(1, n, device="cuda")
    cfg = H.default_config(d, xk.dtype)
    if config == "bn128":
        from dataclasses import replace

        cfg = H.fit_stages(replace(cfg, block_n=128, stages=6), d, xk.dtype)
    print(json.dumps({"config": str(cfg)}), flush=True)
    kw = dict(eps=0.01, c2=1.0, precision=precision, config=cfg)
    t0 = time.perf_counter()
    out, _ = H.softmin_hopper(xk, yk, g, logw, cx, cy, **kw)
    torch.cuda.synchronize()
    print(json.dumps({"first_call_s": round(time.perf_counter() - t0, 2)}), flush=True)
    ms = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        H.softmin_hopper(xk, yk, g, logw, cx, cy, **kw)
        b.record()
        torch.cuda.synchronize()
        ms.append(round(a.elapsed_time(b), 4))
    print(json.dumps({"ms": ms}), flush=True)
    ref = softmin_triton(
        xk, yk, g, logw, cx, cy, 0.01, 1.0, 1.0, None, None, precision, False, None, None
    )[0]
    err = float(((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())
    print(json.dumps({"max_rel_diff_triton": err}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--precision", default="tf32", choices=["tf32", "bf16"])
    ap.add_argument("--n", type=int, default=50000)
    ap.add_argument("--limit", type=float, default=90.0, help="seconds per config")
    ap.add_argument("--configs", default="default", help="comma list of default, bn128")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.d, args.precision, args.n, args.child)
        return
    for config in args.configs.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--d",
            str(args.d),
            "--precision",
            args.precision,
            "--n",
            str(args.n),
            "--child",
            config,
        ]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, timeout=args.limit, capture_output=True, text=True)
            tail = (p.stdout + p.stderr)[-1500:]
            status = f"rc={p.returncode}"
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            tail, status = out[-1500:], f"killed after {args.limit} s"
        print(
            f"== d={args.d} {args.precision} {config}: {status} in "
            f"{time.perf_counter() - t0:.1f} s\n{tail}",
            flush=True,
        )


if __name__ == "__main__":
    main()
