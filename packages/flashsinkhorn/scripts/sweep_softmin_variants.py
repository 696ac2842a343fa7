"""Sweep the opt-in softmin kernel variants (FLASHSINKHORN_SOFTMIN_VARIANT) on a CUDA GPU.

    PYTHONPATH=packages/flashsinkhorn/src python3 \
        packages/flashsinkhorn/scripts/sweep_softmin_variants.py OUT.json [BUDGET_S]

Times ONE softmin pass (the Sinkhorn half-iteration, no V) at n = m = 50k for d = 64 and
d = 512, tf32 and bf16 operands, in one process: the default kernel autotuned (what the
solvers run), the default kernel at fixed configs, and each variant (kernels.py: "pipe",
"pipe_nofence", "stages") at a few (BLOCK_M, BLOCK_N, warps, stages) configs (and, at
d = 512, the default kernel at larger tiles). CUDA events, median of REPS calls after
WARMUP. For every row, the max abs difference of its output potential against the
autotuned default's (same operands, same precision; the potentials are O(0.1) in cost units
at eps = 0.01). Rows are in priority order (d = 64 tf32 first); the JSON
is rewritten after every row, and no row starts after BUDGET_S seconds (default 150,
compiles included). A config that fails to compile or launch is a row with its error.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch

from flashsinkhorn import kernels as K
from flashsinkhorn.bench import _problem
from flashsinkhorn.solver import centered_sqnorm, common_center, kernel_operands

WARMUP, REPS = 2, 20
N, EPS = 50000, 0.01
# (BLOCK_M, BLOCK_N, warps, stages)
PIPE_D64 = [(128, 64, 8, 4), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
            (64, 128, 4, 4), (256, 64, 8, 3)]  # fmt: skip
PIPE_D512 = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3)]
REF_D64, REF_D512 = (128, 64, 8, 4), (128, 128, 8, 3)  # fixed-config default rows
# d = 512 re-reads the X and Y feature chunks from L2 for every tile: (BM + BN) * D * 4 bytes
# per BM * BN scores, 32 B per score at 128 x 128 (~80 TB per pass at 50k); larger tiles
# re-read less (24 B per score at 256 x 128). Default-kernel rows that test this.
BIG_D512 = [(256, 128, 8, 2), (128, 256, 8, 2)]


def _plan(d):
    """(label, variant, config) rows for one (d, precision), in priority order."""
    small = d <= 128
    ref = REF_D64 if small else REF_D512
    rows = [("default (autotuned)", "default", None), ("default", "default", ref)]
    rows += [("pipe", "pipe", c) for c in (PIPE_D64 if small else PIPE_D512)]
    rows += [("pipe_nofence", "pipe_nofence", ref), ("stages", "stages", ref)]
    if small:
        rows += [("stages", "stages", (128, 128, 8, 3))]
    else:
        rows += [("default", "default", c) for c in BIG_D512]
    return rows


def _operands(d, precision, dev):
    x, y = _problem(N, N, d, dev)
    x, y = x[None], y[None]
    c = common_center(x, y)
    cx, cy = centered_sqnorm(x, c), centered_sqnorm(y, c)
    xk, yk = kernel_operands(x, y, c, precision, "auto")
    g = 0.01 * torch.randn(1, N, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    logb = torch.full((1, N), -math.log(N), device=dev)
    return dict(x=xk, y=yk, g=g, logb=logb, cx=cx, cy=cy)


def _fixed_default(o, precision, cfg):
    """The default `_softmin_kernel` (no V) at one fixed config: the launcher's arguments
    of `_softmin_triton` with DV = 0, without the autotuner."""
    x, y, g, logb, cx, cy = (o[k] for k in ("x", "y", "g", "logb", "cx", "cy"))
    kdt = torch.bfloat16 if precision == "bf16" else torch.float32
    x, y = x.to(kdt).contiguous(), y.to(kdt).contiguous()  # no copy on the GPU
    B, n, D = x.shape
    m = y.shape[1]
    bias = torch.sub(g, cy).mul_(K.LOG2E / EPS).add_(logb, alpha=K.LOG2E).contiguous()
    out = torch.empty((B, n), device=x.device, dtype=torch.float32)
    block_d = max(16, min(K._next_pow2(D), 128 if D <= 128 else 64))
    num_d = -(-D // block_d)
    bm, bn, w, st = cfg
    grid = (-(-n // bm), B, 1)
    _LAST["kernel"] = K._softmin_kernel[grid](
        x, y, bias, cx, out, out, out, out, out, out, out, n, m, D, 0, 1,
        K._bucket(n), K._bucket(m), 2.0 * K.LOG2E / EPS, K.LOG2E / EPS, EPS * K.LN2, 1.0, 0.0,
        BLOCK_D=block_d, NUM_D=num_d, EVEN_D=block_d * num_d == D, BLOCK_DV=16, HAS_V=False,
        HAS_LABELS=False, HAS_LSE=False, PREC="tf32", BLOCK_M=bm, BLOCK_N=bn, num_warps=w,
        num_stages=st,
    )  # fmt: skip
    return out


_LAST = {}  # the compiled kernel of the last launch (its PTX, registers, spills)
_launch_variant = K._launch_variant


def _recording_launch_variant(*args):
    _LAST["kernel"] = _launch_variant(*args)
    return _LAST["kernel"]


K._launch_variant = _recording_launch_variant  # softmin() looks it up at every call


def _kernel_facts(kernel):
    """Registers, spills and the SASS order of HGMMA / wait / EX2 of a launched kernel."""
    facts = {}
    try:
        facts["regs"] = getattr(kernel, "n_regs", None)
        facts["spills"] = getattr(kernel, "n_spills", None)
        from softmin_variants_sm90 import sass_order  # same folder

        facts["sass"] = sass_order(kernel.asm["cubin"])
    except Exception as e:  # noqa: BLE001 - diagnostics only
        facts["facts_error"] = repr(e)[:120]
    return facts


def _pass_fn(o, precision, variant, cfg):
    if variant == "default" and cfg is not None:
        return lambda: _fixed_default(o, precision, cfg)

    def fn():
        os.environ["FLASHSINKHORN_SOFTMIN_VARIANT"] = variant
        K.VARIANT_CONFIG = cfg
        try:
            return K.softmin(o["x"], o["y"], o["g"], o["logb"], o["cx"], o["cy"], eps=EPS,
                             c2=2.0, precision=precision, backend="triton")[0]  # fmt: skip
        finally:
            os.environ.pop("FLASHSINKHORN_SOFTMIN_VARIANT", None)
            K.VARIANT_CONFIG = None

    return fn


def _median_ms(fn):
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], times[len(times) // 5], times[(4 * len(times)) // 5]


def _tuned_config(kern):
    """The autotuner's choice(s) so far, as 'BM,BN,warps,stages' strings."""
    out = []
    for cfg in getattr(kern, "cache", {}).values():
        kw = cfg.kwargs
        out.append(f"{kw['BLOCK_M']},{kw['BLOCK_N']},{cfg.num_warps},{cfg.num_stages}")
    return out


def main(out_path, budget_s=150.0):
    t0 = time.time()
    dev = torch.device("cuda")
    meta = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                triton=__import__("triton").__version__, n=N, eps=EPS, warmup=WARMUP,
                reps=REPS, budget_s=budget_s)  # fmt: skip
    rows = []

    def dump():
        with open(out_path, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)

    print("| d | operands | kernel | config (BM, BN, warps, stages) | ms (p20-p80) | x default "
          "autotuned | max abs diff vs default | regs, spills | SASS order |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    groups = ((64, "tf32"), (64, "bf16"), (512, "tf32"), (512, "bf16"))
    # "ws" rows last: a Triton pass that aborts the process would cost nothing else
    todo = [(d, p, *r) for d, p in groups for r in _plan(d)]
    refs, key, o = {}, None, None
    for d, precision, label, variant, cfg in todo:
        if time.time() - t0 > budget_s:
            meta["stopped_by_budget_at"] = f"d={d} {precision} {label} {cfg}"
            break
        if key != (d, precision):
            o = None
            torch.cuda.empty_cache()
            key, o = (d, precision), _operands(d, precision, dev)
        row = dict(d=d, precision=precision, kernel=label, variant=variant,
                   config=list(cfg) if cfg else None)  # fmt: skip
        try:
            fn = _pass_fn(o, precision, variant, cfg)
            ms, p20, p80 = _median_ms(fn)
            _LAST.clear()
            out = fn()
            torch.cuda.synchronize()
            if _LAST.get("kernel") is not None:
                row.update(_kernel_facts(_LAST["kernel"]))
            row.update(ms=ms, p20=p20, p80=p80, finite=bool(torch.isfinite(out).all()))
            if key not in refs:  # the first row of a group: the autotuned default
                refs[key] = (out.clone(), ms)
            ref_out, ref_ms = refs[key]
            row["max_abs_diff_vs_default"] = float((out - ref_out).abs().max())
            row["ratio_vs_default_autotuned"] = ms / ref_ms
            if cfg is None:
                kern = K._softmin_tuned if variant == "default" else K._softmin_variant_tuned
                row["autotuned_configs_so_far"] = _tuned_config(kern)
        except Exception as e:  # noqa: BLE001 - a config that fails is a row
            row["error"] = repr(e)[:300]
        row["elapsed_s"] = round(time.time() - t0, 1)
        rows.append(row)
        dump()
        c = ", ".join(map(str, cfg)) if cfg else "autotuned"
        if "error" in row:
            print(f"| {d} | {precision} | {label} | {c} | error: {row['error'][:80]} | | | | |",
                  flush=True)  # fmt: skip
        else:
            print(f"| {d} | {precision} | {label} | {c} | {ms:.3f} ({p20:.3f}-{p80:.3f}) | "
                  f"{row['ratio_vs_default_autotuned']:.3f} | "
                  f"{row['max_abs_diff_vs_default']:.2e} | {row.get('regs')}, "
                  f"{row.get('spills')} | {row.get('sass', '')} |", flush=True)  # fmt: skip
    meta["total_s"] = round(time.time() - t0, 1)
    dump()
    print(f"total {meta['total_s']} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 150.0)
