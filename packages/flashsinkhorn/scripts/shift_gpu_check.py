"""The "shift" softmin variant (FLASHSINKHORN_SOFTMIN_VARIANT=shift) against the default
kernel on a CUDA GPU, in one process (NOTES.md, "`shift`: no running max").

    PYTHONPATH=packages/flashsinkhorn/src python3 \
        packages/flashsinkhorn/scripts/shift_gpu_check.py OUT.json [BUDGET_S]

Rows, in priority order (the JSON is rewritten after every row; no row starts after
BUDGET_S seconds, default 110, compiles and autotuning included):

1. ONE softmin pass at n = m = 50k (eps = 0.01, squared Euclidean, uniform clouds as in the
   benchmark), d = 64 tf32, d = 64 bf16, d = 512 tf32: the default kernel autotuned, then
   `shift` autotuned with a realistic guess: the potentials after two alternating Sinkhorn
   iterations of the default kernel (f2, g2); the timed pass is f3 = softmin_x(g2) with
   guess f2. Per row: ms (median of REPS after WARMUP; CUDA events), registers / spills /
   SASS order of the kernel at the config the autotuner chose, the rows the kernel
   recomputed with the running max (kernels.SHIFT_FALLBACK_ROWS), max abs difference of
   the output against the default's.
2. One fixed-eps symmetric iteration at 50k, d = 64, tf32 and bf16 (bench._ours_iterations:
   (t(6 iterations) - t(2)) / 4; the first iteration has no guess), variant off and on.
3. SamplesLoss forward at 50k, d = 64 (blur 0.05, scaling 0.5, no debias: 18 passes),
   variant off and on: ms, value difference, fallback rows in one call.
4. `shift` at fixed configs (d = 64: 128,64,8,4 / 128,64,8,3 / 64,128,4,4).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep_softmin_variants as SW  # noqa: E402  (sibling: fixed-config launch, SASS facts)

import flashsinkhorn as fs  # noqa: E402
from flashsinkhorn import kernels as K  # noqa: E402
from flashsinkhorn.bench import _ours_iterations, _problem  # noqa: E402
from flashsinkhorn.solver import centered_sqnorm, common_center, kernel_operands  # noqa: E402

N, EPS = SW.N, SW.EPS
DEV = "cuda"
FIXED_D64 = [(128, 64, 8, 4), (128, 64, 8, 3), (64, 128, 4, 4)]


class _variant:
    """FLASHSINKHORN_SOFTMIN_VARIANT for the duration of a block (read at each launch)."""

    def __init__(self, name, config=None):
        self.name, self.config = name, config

    def __enter__(self):
        os.environ["FLASHSINKHORN_SOFTMIN_VARIANT"] = self.name
        K.VARIANT_CONFIG = self.config

    def __exit__(self, *exc):
        os.environ.pop("FLASHSINKHORN_SOFTMIN_VARIANT", None)
        K.VARIANT_CONFIG = None
        return False


def _operands(d, precision, dev):
    """Both sides' kernel operands and a realistic (g2, f2): two alternating iterations of
    the default kernel from g = 0."""
    x, y = _problem(N, N, d, dev)
    x, y = x[None], y[None]
    c = common_center(x, y)
    cx, cy = centered_sqnorm(x, c), centered_sqnorm(y, c)
    xk, yk = kernel_operands(x, y, c, precision, "auto")
    logw = torch.full((1, N), -math.log(N), device=dev)
    kw = dict(eps=EPS, c2=2.0, precision=precision, backend="triton")
    g = torch.zeros(1, N, device=dev)
    for _ in range(2):
        f = K.softmin(xk, yk, g, logw, cx, cy, **kw)[0]
        g = K.softmin(yk, xk, f, logw, cy, cx, **kw)[0]
    return dict(x=xk, y=yk, g=g, logb=logw, cx=cx, cy=cy, guess=f)


def _pass(o, precision):
    return K.softmin(o["x"], o["y"], o["g"], o["logb"], o["cx"], o["cy"], eps=EPS, c2=2.0,
                     precision=precision, backend="triton", guess=o["guess"])[0]  # fmt: skip


def _fallback_rows(fn):
    """Rows recomputed with the running max in one call of fn (shift launches only). The
    counter's int32 pointer is a new autotuning key (Triton keys on the argument dtypes):
    a first call autotunes (its benchmark launches count too), the second is counted."""
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    K.SHIFT_FALLBACK_ROWS = counter
    try:
        fn()
        torch.cuda.synchronize()
        counter.zero_()
        fn()
        torch.cuda.synchronize()
    finally:
        K.SHIFT_FALLBACK_ROWS = None
    return int(counter)


def _chosen(kern):
    """The autotuner's latest choice (BM, BN, warps, stages); the fixed config without
    autotuning (interpreter, FLASHSINKHORN_NO_AUTOTUNE=1)."""
    cfgs = SW._tuned_config(kern)
    return tuple(int(v) for v in cfgs[-1].split(",")) if cfgs else tuple(K._FIXED)


def pass_rows(d, precision, o, refs, fixed=False):
    """Rows of group 1 (autotuned default and shift) or group 4 (shift at fixed configs)."""
    key = (d, precision)
    if not fixed:
        ms, p20, p80 = SW._median_ms(lambda: _pass(o, precision))
        out = _pass(o, precision)
        torch.cuda.synchronize()
        refs[key] = (out.clone(), ms)
        cfgs = SW._tuned_config(K._softmin_tuned)
        row = dict(kernel="default (autotuned)", ms=ms, p20=p20, p80=p80,
                   autotuned_configs_so_far=cfgs)  # fmt: skip
        SW._LAST.clear()
        SW._fixed_default(o, precision, _chosen(K._softmin_tuned))  # its registers
        row.update(SW._kernel_facts(SW._LAST["kernel"]))
        yield row
    configs = FIXED_D64 if (fixed and d <= 128) else ([] if fixed else [None])
    for cfg in configs:
        with _variant("shift", cfg):
            ms, p20, p80 = SW._median_ms(lambda: _pass(o, precision))
            out = _pass(o, precision)
            torch.cuda.synchronize()
            n_fb = _fallback_rows(lambda: _pass(o, precision))
        ref_out, ref_ms = refs[key]
        row = dict(kernel="shift" + (" (autotuned)" if cfg is None else ""),
                   config=list(cfg) if cfg else None, ms=ms, p20=p20, p80=p80,
                   ratio_vs_default_autotuned=ms / ref_ms, fallback_rows=n_fb,
                   max_abs_diff_vs_default=float((out - ref_out).abs().max()),
                   finite=bool(torch.isfinite(out).all()))  # fmt: skip
        chosen = cfg
        if cfg is None:
            row["autotuned_configs_so_far"] = SW._tuned_config(K._softmin_variant_tuned)
            chosen = _chosen(K._softmin_variant_tuned)
        with _variant("shift", chosen):  # the kernel at that config: its registers
            SW._LAST.clear()
            _pass(o, precision)
        if SW._LAST.get("kernel") is not None:
            row.update(SW._kernel_facts(SW._LAST["kernel"]))
        yield row


def iteration_rows(precision):
    x, y = _problem(N, N, 64, torch.device(DEV))
    k1, k2 = 2, 6
    res = {}
    for name in ("default", "shift"):
        with _variant(name):
            t1 = SW._median_ms(lambda: _ours_iterations(x, y, EPS, k1, precision, "auto"))
            t2 = SW._median_ms(lambda: _ours_iterations(x, y, EPS, k2, precision, "auto"))
            f, g = _ours_iterations(x, y, EPS, k2, precision, "auto")
            n_fb = _fallback_rows(lambda: _ours_iterations(x, y, EPS, k2, precision, "auto"))
        res[name] = f
        per = (t2[0] - t1[0]) / (k2 - k1)
        row = dict(kernel=f"iteration, {name}", ms=per, ms_6_iters=t2[0], fallback_rows=n_fb)
        if name == "shift":
            row["max_abs_diff_vs_default"] = float((f - res["default"]).abs().max())
        yield row


def samples_loss_rows():
    x, y = _problem(N, N, 64, torch.device(DEV))
    L = fs.SamplesLoss(blur=0.05, scaling=0.5, debias=False, precision="tf32")
    vals = {}
    for name in ("default", "shift"):
        with _variant(name), torch.no_grad():
            ms, p20, p80 = SW._median_ms(lambda: L(x, y))
            vals[name] = float(L(x, y))
            n_fb = _fallback_rows(lambda: L(x, y))
        row = dict(kernel=f"SamplesLoss fwd, {name}", ms=ms, p20=p20, p80=p80,
                   value=vals[name], fallback_rows=n_fb)  # fmt: skip
        if name == "shift":
            row["abs_diff_value_vs_default"] = abs(vals["shift"] - vals["default"])
        yield row


def main(out_path, budget_s=110.0):
    t0 = time.time()
    dev = torch.device(DEV)
    meta = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                triton=__import__("triton").__version__, n=N, eps=EPS, warmup=SW.WARMUP,
                reps=SW.REPS, budget_s=budget_s)  # fmt: skip
    rows, refs, ops = [], {}, {}

    def dump():
        with open(out_path, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)

    def operands(d, precision):
        if (d, precision) not in ops:
            ops.clear()
            torch.cuda.empty_cache()
            ops[(d, precision)] = _operands(d, precision, dev)
        return ops[(d, precision)]

    groups = [(f"pass d={d} {p}", (lambda d=d, p=p: pass_rows(d, p, operands(d, p), refs)))
              for d, p in ((64, "tf32"), (64, "bf16"), (512, "tf32"))]  # fmt: skip
    groups += [(f"iteration d=64 {p}", (lambda p=p: iteration_rows(p))) for p in ("tf32", "bf16")]
    groups += [("SamplesLoss fwd d=64 tf32", samples_loss_rows)]
    groups += [(f"pass d=64 {p} fixed configs",
                (lambda p=p: pass_rows(64, p, operands(64, p), refs, fixed=True)))
               for p in ("tf32", "bf16")]  # fmt: skip
    print("| case | kernel | config | ms | x default | fallback rows | max abs diff | regs, "
          "spills | SASS order |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for name, gen in groups:
        if time.time() - t0 > budget_s:
            meta["stopped_by_budget_at"] = name
            break
        try:
            for row in gen():
                row = dict(case=name, **row, elapsed_s=round(time.time() - t0, 1))
                rows.append(row)
                dump()
                diff = row.get("max_abs_diff_vs_default", row.get("abs_diff_value_vs_default"))
                print(f"| {name} | {row['kernel']} | {row.get('config') or ''} | "
                      f"{row['ms']:.3f} | {row.get('ratio_vs_default_autotuned', '')} | "
                      f"{row.get('fallback_rows', '')} | {diff if diff is not None else ''} | "
                      f"{row.get('regs')}, {row.get('spills')} | {row.get('sass', '')} |",
                      flush=True)  # fmt: skip
                if time.time() - t0 > budget_s:
                    break
        except Exception as e:  # noqa: BLE001 - a failing group is a row
            rows.append(dict(case=name, error=repr(e)[:300]))
            dump()
            print(f"| {name} | error: {repr(e)[:200]} | | | | | | | |", flush=True)
    meta["total_s"] = round(time.time() - t0, 1)
    dump()
    print(f"total {meta['total_s']} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 110.0)
