"""GPU A/B of v4's tile math: default (v3's, ``LEAN`` 0) against the lean one (``LEAN`` 2),
interleaved in one process on the large layout (8 x 8192^2 bf16, 537M params).

    PYTHONPATH=packages/flashoptim/src python3 packages/flashoptim/scripts/lean_bench.py OUTDIR \
        [--reps 30] [--rows adamw_nocheck,adamw,sgd,lion]

Per row two optimizers on two copies of the same parameters and gradients (kernel v4, one
with ``opt._lean = True``); after one step each (tables, states, compile or autotuning) and
3 warm-up steps, ``reps`` rounds time one step of each with CUDA events (order alternating
per round). Reports medians (p20/p80), GB/s of the bytes the step must move
(``flashoptim.bench.MOVED``) and their fraction of the 4.21 TB/s copy ceiling, new / old,
the v4 config each used, and whether both ended bit for bit equal (same steps, same
gradients: they must). Writes OUTDIR/lean_bench[TAG].json (after every row) and .txt.
``--config`` sets the single config both sides run under FLASHOPTIM_NO_AUTOTUNE=1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import flashoptim as fo
from flashoptim import _core, bench
from flashoptim import optimizers as fopt

ROWS = {  # name: (optimizer class, kwargs, bytes moved per param)
    "adamw_nocheck": (fo.FlashAdamW, dict(check_finite=False), bench.MOVED["ours_nocheck"]),
    "adamw": (fo.FlashAdamW, {}, bench.MOVED["ours"]),
    "sgd": (fo.FlashSGD, dict(momentum=0.9, check_finite=False), bench.MOVED["ours_sgd"]),
    "lion": (fo.FlashLion, dict(check_finite=False), bench.MOVED["ours_lion"]),
}


def _bits(t):
    return t.view(torch.int8) if t.is_floating_point() else t


def _equal(a, pa, b, pb) -> bool:
    for p, q in zip(pa, pb):
        if not torch.equal(_bits(p.detach()), _bits(q.detach())):
            return False
        for k, v in a.state[p].items():
            if torch.is_tensor(v) and not torch.equal(_bits(v), _bits(b.state[q][k])):
                return False
    return True


def _step_ms(opt, dev) -> float:
    if dev.type != "cuda":
        t0 = time.perf_counter()
        opt.step()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    opt.step()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def run_row(name, reps, warmup=3, smoke=False):
    Opt, kw, moved = ROWS[name]
    dev = torch.device("cpu" if smoke else "cuda")
    shapes = [(64, 48), (33,)] if smoke else bench.layout_shapes("large")
    n = sum(torch.Size(s).numel() for s in shapes)
    gen = torch.Generator(device=dev).manual_seed(0)
    ps0 = [(torch.randn(s, device=dev, generator=gen) * 0.02).bfloat16() for s in shapes]
    gs = [(torch.randn(s, device=dev, generator=gen) * 1e-3).bfloat16() for s in shapes]
    sides = []
    for lean in (False, True):
        ps = [torch.nn.Parameter(p.clone()) for p in ps0]
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt = Opt(ps, lr=1e-4, kernel="v4", backend="triton", **kw)
        opt._lean = lean
        opt.step()
        cfg = bench._v2_config("v4") if fopt._v2_autotune(dev) else "FLASHOPTIM_NO_AUTOTUNE"
        sides.append(dict(opt=opt, ps=ps, times=[], config=cfg))
    del ps0
    for s in sides:
        for _ in range(warmup):
            s["opt"].step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    for r in range(reps):
        for s in sides if r % 2 == 0 else sides[::-1]:
            s["times"].append(_step_ms(s["opt"], dev))
    out = dict(row=name, n_params=n, bytes_moved_per_param=moved, reps=reps)
    for key, s in zip(("old", "new"), sides):
        ts = sorted(s["times"])
        med, p20, p80 = (ts[min(len(ts) - 1, int(f * len(ts)))] for f in (0.5, 0.2, 0.8))
        gbps = moved * n / (med * 1e-3) / 1e9
        out[key] = dict(
            ms=med,
            p20=p20,
            p80=p80,
            gbps=gbps,
            frac_ceiling=gbps / (bench.CEILING_TBPS * 1e3),
            config=s["config"],
            lean=bool(s["opt"]._lean),
        )
    out["new_over_old"] = out["new"]["ms"] / out["old"]["ms"]
    out["bitwise_equal"] = _equal(sides[0]["opt"], sides[0]["ps"], sides[1]["opt"], sides[1]["ps"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", default="adamw_nocheck,adamw,sgd,lion")
    ap.add_argument("--smoke", action="store_true", help="tiny tensors on the CPU (interpreter)")
    ap.add_argument(
        "--config",
        default=None,
        help="BLOCK,WAVES,PF,warps for both sides (with FLASHOPTIM_NO_AUTOTUNE=1), e.g. 2048,0,1,4",
    )
    ap.add_argument("--tag", default="", help="suffix of the output files")
    a = ap.parse_args(argv)
    os.makedirs(a.outdir, exist_ok=True)
    if a.config:
        blk, waves, pf, warps = (int(x) for x in a.config.split(","))
        _core.V4_DEFAULT = dict(BLOCK=blk, WAVES=waves, PF=pf)
        _core.V4_DEFAULT_WARPS = warps
    res = dict(env=bench.env_info(), ceiling_tbps=bench.CEILING_TBPS, rows=[])
    res["default_config"] = dict(_core.V4_DEFAULT, warps=_core.V4_DEFAULT_WARPS)
    lines = [
        "| row | old ms | new ms | new/old | old of ceiling | new of ceiling | bitwise |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in a.rows.split(","):
        try:
            r = run_row(name, a.reps, warmup=1 if a.smoke else 3, smoke=a.smoke)
        except Exception as e:  # report, keep going
            r = dict(row=name, error=f"{type(e).__name__}: {e}"[:500])
        res["rows"].append(r)
        with open(os.path.join(a.outdir, f"lean_bench{a.tag}.json"), "w") as f:
            json.dump(res, f, indent=1)
        if "error" in r:
            line = f"| {name} | error: {r['error']} |"
        else:
            o, w = r["old"], r["new"]
            line = (
                f"| {name} | {o['ms']:.3f} ({o['p20']:.3f}-{o['p80']:.3f}) | {w['ms']:.3f} "
                f"({w['p20']:.3f}-{w['p80']:.3f}) | {r['new_over_old']:.3f} | "
                f"{o['frac_ceiling']:.3f} | {w['frac_ceiling']:.3f} | {r['bitwise_equal']} |"
            )
            print(f"# {name} configs: old {o['config']}, new {w['config']}", flush=True)
        print(line, flush=True)
        lines.append(line)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    with open(os.path.join(a.outdir, f"lean_bench{a.tag}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
