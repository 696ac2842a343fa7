"""One GPU call for flashsinkhorn on sm_90 (issue #18): correctness, then speed, table last.

    PYTHONPATH=packages/flashsinkhorn/src python3 tools/flashsinkhorn/hopper_check.py \
        --out $OUT/hopper.json            # about 4 minutes on the H200

Clouds as the benchmarks draw them (x, y uniform in [0, 1/sqrt(d)]^d, y shifted), n = m =
50k, cost |x - y|^2, eps = 0.01, uniform weights, potentials from two alternating torch
iterations (every pass below has a realistic guess). Per case (d, operands):

1. one pass f <- softmin(g): the Triton kernel (backend "triton") and the default
   (backend "auto": the Gluon sm_90 pass), errors against float64 on 514 sampled rows;
2. one symmetric update (f, g) <- (softmin(g), softmin(f)) in ONE pass (symmetric_update,
   Gluon under "auto", Triton under "triton"): errors of f and g against float64 on 514
   sampled rows and columns, difference to the two-pass results, rows / columns the one
   pass had to recompute (0 expected);
3. times (triton.testing.do_bench medians, p20, p80): the pass, and one full symmetric
   iteration (update + averaging) four ways: two Triton passes, two Gluon passes, the
   Gluon one pass, the Triton one pass; at d = 64 tf32 also the one pass with one launch
   (a 64 MiB partial buffer instead of 16 MiB chunks);
4. the alternative tile widths / no ping-pong turns of the Gluon pass where d >= 512 (time
   permitting).

Then SamplesLoss at 50k, d = 64 (blur 0.05, scaling 0.5): forward and forward + backward,
debias False and True, "auto" and "triton", peak extra memory; and flash-sinkhorn 0.4.1
(its iteration at d = 64 and its SamplesLoss) if it imports. Every case runs in a child
process with a time limit (a hung kernel costs its case), every step in try/except, the
child saves its JSON after each step.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import time
import traceback

EPS = 0.01
EXP_RATE = 4.2e12  # exp2/s, H200 special-function units (../../shared/GPU.md)
DOT_RATE = {"tf32": 433e12, "bf16": 792e12}  # measured matmul ceilings, FLOP/s
# stage -> seconds of the budget it may use (children stop starting steps after it)
CASES = {
    "64:tf32": 38,
    "64:bf16": 24,
    "512:tf32": 32,
    "512:bf16": 24,
    "1024:tf32": 34,
    "loss:64": 40,
    "peer": 28,
}


def _problem(n, d, precision, device):
    """Centered clouds in kernel form (tf32-rounded fp32 or bf16), cx, cy, log weights."""
    import torch

    from flashsinkhorn.operands import round_to_tf32

    gen = torch.Generator().manual_seed(0)
    s = 1.0 / math.sqrt(d)
    x = torch.rand(1, n, d, generator=gen).to(device) * s
    y = torch.rand(1, n, d, generator=gen).to(device) * s + 0.5 * s
    c = (x.sum(1) + y.sum(1)) / (2 * n)
    x, y = x - c[:, None], y - c[:, None]
    cx, cy = (x * x).sum(-1), (y * y).sum(-1)
    if precision == "tf32":
        xk, yk = round_to_tf32(x), round_to_tf32(y)
    else:
        xk, yk = x.bfloat16(), y.bfloat16()
    logw = torch.full((1, n), -math.log(n), device=device)
    return xk, yk, cx, cy, logw


def _pass_floor_ms(n, d, precision):
    scores = n * n
    return 1e3 * max(scores / EXP_RATE, 2 * d * scores / DOT_RATE[precision])


class Case:
    """A child's report: steps recorded in ``res``, saved after each, deadline respected."""

    def __init__(self, res, out_path, deadline):
        self.res, self.out_path, self.deadline = res, out_path, deadline

    def save(self):
        if self.out_path:
            with open(self.out_path, "w") as fh:
                json.dump(self.res, fh, indent=1, default=str)

    def step(self, name, fn, optional=False):
        """Run ``fn() -> dict`` into ``res[name]`` (its error instead, if it raises)."""
        if time.time() > self.deadline - (8 if optional else 0):
            self.res[name] = {"error": "skipped: case time budget spent"}
        else:
            t0 = time.time()
            try:
                self.res[name] = fn()
            except Exception as e:  # noqa: BLE001 - recorded, the next step runs
                self.res[name] = {
                    "error": f"{type(e).__name__}: {e}"[-2000:],
                    "traceback": traceback.format_exc()[-3000:],
                }
            self.res[name]["wall_s"] = round(time.time() - t0, 2)
        brief = {k: v for k, v in self.res[name].items() if k != "traceback"}
        print(f"[{self.res.get('case')}] {name}: {json.dumps(brief, default=str)}", flush=True)
        self.save()
        return self.res[name]


def _bench(fn, dev, rep=150):
    import torch
    import triton.testing

    if dev.type != "cuda":  # the CPU smoke run of this script
        t0 = time.perf_counter()
        fn()
        return [round(1e3 * (time.perf_counter() - t0), 4)] * 3
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=25, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return [round(v, 4) for v in ms]


def run_case(case, deadline, n, device="cuda", out_path=None):
    """One (d, operands) case in this process (``device="cpu"`` with TRITON_INTERPRET=1
    and a small n: a smoke run of this script's own code)."""
    import torch

    import flashsinkhorn as fs
    from flashsinkhorn import _config, primitives

    d_str, precision = case.split(":")
    D = int(d_str)
    dev = torch.device(device)
    res = {"case": case, "n": n, "d": D, "precision": precision}
    C = Case(res, out_path, deadline)
    xk, yk, cx, cy, logw = _problem(n, D, precision, dev)
    kw = dict(eps=EPS, c2=2.0)
    t0 = time.time()
    xf, yf = xk.float(), yk.float()
    f = torch.zeros(1, n, device=dev)
    for _ in range(2):
        g = fs.softmin(yf, xf, f, logw, cy, cx, backend="torch", **kw)[0]
        f = fs.softmin(xf, yf, g, logw, cx, cy, backend="torch", **kw)[0]
    g = fs.softmin(yf, xf, f, logw, cy, cx, backend="torch", **kw)[0]
    del xf, yf
    res["init_s"] = round(time.time() - t0, 2)
    gen = torch.Generator().manual_seed(1)
    rows = torch.cat([torch.tensor([0, n - 1]), torch.randperm(n, generator=gen)[:512]]).to(dev)
    cols = torch.cat([torch.tensor([0, n - 1]), torch.randperm(n, generator=gen)[:512]]).to(dev)
    f_ref = fs.softmin_ref(xk[:, rows].double(), yk.double(), g, logw, cx[:, rows], cy, **kw)[0]
    g_ref = fs.softmin_ref(yk[:, cols].double(), xk.double(), f, logw, cy[:, cols], cx, **kw)[0]
    res["floor_ms"] = _pass_floor_ms(n, D, precision)

    def err(out, idx, ref):
        return float((out[0, idx].double() - ref[0]).abs().max())

    def pass_x(backend):
        return fs.softmin(
            xk, yk, g, logw, cx, cy, precision=precision, backend=backend, guess=f, **kw
        )[0]

    def pass_y(backend):
        return fs.softmin(
            yk, xk, f, logw, cy, cx, precision=precision, backend=backend, guess=g, **kw
        )[0]

    outs = {}

    def one_pass_step(backend):
        def run():
            t1 = time.time()
            stats = {}
            ft, gt = fs.symmetric_update(
                xk,
                yk,
                f,
                g,
                logw,
                logw,
                cx,
                cy,
                precision=precision,
                backend=backend,
                stats=stats,
                **kw,
            )
            r = {
                "first_call_s": round(time.time() - t1, 2),
                "kernel": stats["kernel"],
                "rows_recomputed": int(stats.get("rows_recomputed", -1)),
                "cols_recomputed": int(stats.get("cols_recomputed", -1)),
                "err_f64_f": err(ft, rows, f_ref),
                "err_f64_g": err(gt, cols, g_ref),
            }
            if "triton" in outs:
                dx = float((ft - outs["triton"]).abs().max())
                r["max_diff_two_pass"] = max(dx, float((gt - outs["triton_y"]).abs().max()))
            e_t = res.get("pass_triton", {}).get("err_f64")
            r["correct"] = bool(
                math.isfinite(r["err_f64_f"])
                and math.isfinite(r["err_f64_g"])
                and r["rows_recomputed"] == 0
                and r["cols_recomputed"] == 0
                and max(r["err_f64_f"], r["err_f64_g"]) < 1e-4
                and (e_t is None or r["err_f64_f"] <= 2 * e_t + 1e-6)
            )
            r["ms"] = _bench(
                lambda: fs.symmetric_update(
                    xk, yk, f, g, logw, logw, cx, cy, precision=precision, backend=backend, **kw
                ),
                dev,
            )
            return r

        return run

    def pass_step(backend):
        def run():
            t1 = time.time()
            out = pass_x(backend)
            torch.cuda.synchronize() if dev.type == "cuda" else None
            r = {
                "first_call_s": round(time.time() - t1, 2),
                "err_f64": err(out, rows, f_ref),
                "finite": bool(torch.isfinite(out).all()),
            }
            if backend == "auto":
                r["sm90_reason"] = primitives.sm90_pass_reason(xk, yk, precision)
                r["max_diff_triton"] = float((out - outs["triton"]).abs().max())
                e_t = res["pass_triton"].get("err_f64")
                ok = e_t is None or r["err_f64"] <= 2 * e_t + 1e-6
                r["correct"] = bool(r["finite"] and r["err_f64"] < 1e-4 and ok)
            else:
                outs["triton"], outs["triton_y"] = out, pass_y(backend)
            r["ms"] = _bench(lambda: pass_x(backend), dev)
            r["frac_floor"] = round(res["floor_ms"] / r["ms"][0], 3)
            return r

        return run

    C.step("pass_triton", pass_step("triton"))
    C.step("pass_auto", pass_step("auto"))
    C.step("one_pass_auto", one_pass_step("auto"))
    C.step("one_pass_triton", one_pass_step("triton"))

    def iteration(kind):
        def it():
            if kind.startswith("one_pass"):
                be = kind.split(":")[1]
                ft, gt = fs.symmetric_update(
                    xk, yk, f, g, logw, logw, cx, cy, precision=precision, backend=be, **kw
                )
            else:
                be = kind.split(":")[1]
                ft, gt = pass_x(be), pass_y(be)
            return 0.5 * (f + ft), 0.5 * (g + gt)

        return it

    def iterations():
        r = {}
        for kind in ("two_pass:triton", "two_pass:auto", "one_pass:auto", "one_pass:triton"):
            try:
                r[kind] = _bench(iteration(kind), dev)
            except Exception as e:  # noqa: BLE001
                r[kind] = f"{type(e).__name__}: {e}"[:500]
        if case == "64:tf32":  # the one pass in one launch: the chunks' cost
            cap = _config.SYM_PARTIAL_BYTES
            try:
                _config.SYM_PARTIAL_BYTES = 64 << 20
                r["one_pass:auto:one_launch"] = _bench(iteration("one_pass:auto"), dev)
            except Exception as e:  # noqa: BLE001
                r["one_pass:auto:one_launch"] = f"{type(e).__name__}: {e}"[:500]
            finally:
                _config.SYM_PARTIAL_BYTES = cap
        return r

    C.step("iteration_ms", iterations)
    if D >= 512:
        C.step(
            "alt_configs",
            lambda: _alt_configs(xk, yk, g, logw, cx, cy, f, precision, rows, f_ref, dev),
            optional=True,
        )
    return res


def _alt_configs(xk, yk, g, logw, cx, cy, f, precision, rows, f_ref, dev):
    """The Gluon pass at the other tile width and without ping-pong turns (d >= 512)."""
    from dataclasses import replace

    from flashsinkhorn import _softmin_hopper as H

    D = xk.shape[2]
    base = H.default_config(D, xk.dtype)
    other = H.fit_stages(replace(base, block_n=384 - base.block_n, stages=8), D, xk.dtype)
    out = {"default": base.__dict__}
    alts = ((f"bn{other.block_n}", other), ("no-pingpong", replace(base, pingpong=False)))
    for label, cfg in alts:
        try:

            def run(cfg=cfg):
                return H.softmin_hopper(
                    xk,
                    yk,
                    g,
                    logw,
                    cx,
                    cy,
                    eps=EPS,
                    c2=2.0,
                    precision=precision,
                    guess=f,
                    config=cfg,
                )[0]

            o = run()
            e = float((o[0, rows].double() - f_ref[0]).abs().max())
            out[label] = {"config": cfg.__dict__, "err_f64": e, "ms": _bench(run, dev)}
        except Exception as e:  # noqa: BLE001
            out[label] = {"config": cfg.__dict__, "error": f"{type(e).__name__}: {e}"[:800]}
    return out


def _loss_problem(n, d, device):
    import torch

    gen = torch.Generator().manual_seed(0)
    s = 1.0 / math.sqrt(d)
    x = (torch.rand(n, d, generator=gen) * s).to(device)
    y = (torch.rand(n, d, generator=gen) * s + 0.5 * s).to(device)
    return x, y


def _time_loss(L, x, y, dev, mode):
    import torch

    def fwd():
        with torch.no_grad():
            return L(x, y)

    def fwd_bwd():
        xx = x.detach().requires_grad_()
        v = L(xx, y)
        v.backward()
        return v

    fn = fwd if mode == "fwd" else fwd_bwd
    fn()  # compile / autotune outside the timing and the memory measurement
    out = {}
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        out["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    out["ms"] = _bench(fn, dev, rep=300)
    return out


def run_loss(case, deadline, n, device="cuda", out_path=None):
    """SamplesLoss at d = 64: ours ("auto", "triton") forward / forward + backward, debias
    False / True (the issue's targets: fwd <= 18 ms, fwd+bwd <= 21 ms, debias <= 1.6x)."""
    import torch

    import flashsinkhorn as fs

    dev = torch.device(device)
    d = int(case.split(":")[1])
    res = {"case": case, "n": n, "d": d}
    C = Case(res, out_path, deadline)
    x, y = _loss_problem(n, d, dev)
    vals = {}
    for debias in (False, True):
        for backend in ("auto", "triton"):
            for mode in ("fwd", "fwd_bwd"):
                if debias and mode == "fwd_bwd" and backend == "triton":
                    continue
                L = fs.SamplesLoss(blur=0.05, scaling=0.5, debias=debias, backend=backend)

                def run(L=L, mode=mode, key=(debias, backend)):
                    with torch.no_grad():
                        vals[key] = float(L(x, y))
                    r = _time_loss(L, x, y, dev, mode)
                    r["value"] = vals[key]
                    return r

                C.step(f"debias={debias}:{backend}:{mode}", run, optional=backend == "triton")
    for debias in (False, True):
        a, t = vals.get((debias, "auto")), vals.get((debias, "triton"))
        if a is not None and t is not None:
            res[f"rel_diff_auto_triton:debias={debias}"] = abs(a - t) / abs(t)
    C.save()
    return res


def run_peer(n):
    """flash-sinkhorn 0.4.1: its fixed-eps iteration at d = 64 (bench.py's method: the time
    of 6 iterations minus that of 2, over 4) and its SamplesLoss at d = 64."""
    import flash_sinkhorn
    import torch
    import triton.testing

    dev = torch.device("cuda")
    x, y = _loss_problem(n, 64, dev)
    a = torch.full((n,), 1.0 / n, device=dev)
    out = {"version": getattr(flash_sinkhorn, "__version__", "?")}
    ts = {}
    for k in (2, 6):
        L = flash_sinkhorn.SamplesLoss(
            "sinkhorn",
            use_epsilon_scaling=False,
            eps=EPS,
            n_iters=k,
            debias=False,
            potentials=False,
            normalize=False,
            last_extrapolation=False,
            allow_tf32=True,
            half_cost=False,
        )
        L(a, x, a, y)
        ts[k] = triton.testing.do_bench(lambda L=L: L(a, x, a, y), warmup=25, rep=150)
    out["iteration_ms_d64"] = round((ts[6] - ts[2]) / 4, 4)
    for debias in (False, True):
        L = flash_sinkhorn.SamplesLoss(
            "sinkhorn", p=2, blur=0.05, scaling=0.5, debias=debias, half_cost=True, allow_tf32=True
        )
        for mode in ("fwd", "fwd_bwd"):
            if debias and mode == "fwd_bwd":
                continue
            try:
                out[f"loss:debias={debias}:{mode}"] = _time_loss(L, x, y, dev, mode)
            except Exception as e:  # noqa: BLE001
                out[f"loss:debias={debias}:{mode}"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return out


def _env():
    import torch
    import triton

    e = {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        e.update(gpu=p.name, sms=p.multi_processor_count, capability=[p.major, p.minor])
    return e


def _ms(r):
    """The median of a step's timing (or its error, shortened)."""
    if isinstance(r, dict):
        if "ms" in r:
            return r["ms"][0]
        return ("ERR " + str(r.get("error", "?")))[:60]
    if isinstance(r, list):
        return r[0]
    return ("ERR " + str(r))[:60]


def _table(report):
    L = ["", "| case | item | result |", "|---|---|---|"]
    for case, r in report.get("cases", {}).items():
        if not isinstance(r, dict):
            L.append(f"| {case} | | {str(r)[:90]} |")
            continue
        if r.get("error"):
            L.append(f"| {case} | ERROR | {str(r['error'])[:90]} |")
        if case.startswith("loss"):
            for k, v in r.items():
                if isinstance(v, dict) and ("ms" in v or "error" in v):
                    mem = v.get("peak_extra_mib")
                    L.append(
                        f"| {case} | {k} | {_ms(v)} ms" + (f", +{mem} MiB" if mem else "") + " |"
                    )
                elif k.startswith("rel_diff"):
                    L.append(f"| {case} | {k} | {v:.2e} |")
            continue
        pt, pa = r.get("pass_triton", {}), r.get("pass_auto", {})
        if pt or pa:
            sp = (pt["ms"][0] / pa["ms"][0]) if pt.get("ms") and pa.get("ms") else None
            L.append(
                f"| {case} | pass: triton / auto (sm_90) | {_ms(pt)} / {_ms(pa)} ms"
                + (f" ({sp:.2f}x, {pa.get('frac_floor')} of floor)" if sp else "")
                + f"; err f64 {pt.get('err_f64', 0):.2g} / {pa.get('err_f64', 0):.2g}"
                + ("" if pa.get("correct", True) else " WRONG")
                + " |"
            )
        for be in ("auto", "triton"):
            o = r.get(f"one_pass_{be}", {})
            if o:
                L.append(
                    f"| {case} | one pass ({o.get('kernel', be)}) | {_ms(o)} ms; err f64 f "
                    f"{o.get('err_f64_f', float('nan')):.2g} g "
                    f"{o.get('err_f64_g', float('nan')):.2g}; recomputed "
                    f"{o.get('rows_recomputed')} / {o.get('cols_recomputed')}"
                    + ("" if o.get("correct", False) else " WRONG")
                    + " |"
                )
        its = r.get("iteration_ms", {})
        if its:
            L.append(
                f"| {case} | iteration: "
                + " / ".join(k for k in its if k != "wall_s")
                + " | "
                + " / ".join(str(_ms(v)) for k, v in its.items() if k != "wall_s")
                + " ms |"
            )
        alt = r.get("alt_configs", {})
        for k, v in alt.items():
            if isinstance(v, dict) and k != "default":
                L.append(f"| {case} | pass, config {k} | {_ms(v)} ms |")
    peer = report.get("peer")
    if isinstance(peer, dict):
        for k, v in peer.items():
            if k not in ("log", "traceback", "wall_s"):
                L.append(f"| flash-sinkhorn | {k} | {_ms(v) if isinstance(v, dict) else v} |")
    elif peer is not None:
        L.append(f"| flash-sinkhorn | | {str(peer)[:90]} |")
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--budget", type=float, default=225.0, help="seconds for all stages")
    ap.add_argument("--n", type=int, default=50000, help="points per cloud")
    ap.add_argument(
        "--cases",
        default=",".join(c for c in CASES if c != "peer"),
        help="e.g. 64:tf32,512:tf32,loss:64",
    )
    ap.add_argument("--no-peer", action="store_true", help="skip flash-sinkhorn")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # internal: one case in this process
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: smoke run
    args = ap.parse_args()

    if args.stage:  # child: one stage, JSON to --out
        try:
            if args.stage == "peer":
                res = run_peer(args.n)
            elif args.stage.startswith("loss"):
                res = run_loss(args.stage, args.deadline, args.n, args.device, args.out)
            else:
                res = run_case(args.stage, args.deadline, args.n, args.device, args.out)
        except Exception as e:  # noqa: BLE001 - the parent records it
            res = {
                "error": f"{type(e).__name__}: {e}"[:3000],
                "traceback": traceback.format_exc()[-4000:],
            }
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
        return

    t_start = time.time()
    end = t_start + args.budget
    report = {"env": _env(), "args": vars(args), "cases": {}}

    def save():
        report["elapsed_s"] = round(time.time() - t_start, 1)
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1, default=str)

    stages = [c for c in args.cases.split(",") if c]
    if not args.no_peer:
        stages.append("peer")
    for stage in stages:
        left = end - time.time()
        share = CASES.get(stage, 30)
        where = report if stage == "peer" else report["cases"]
        key = "peer" if stage == "peer" else stage
        if left < 12:
            where[key] = "skipped: budget spent"
            continue
        if stage == "peer":
            try:
                importlib.import_module("flash_sinkhorn")
            except Exception as e:  # noqa: BLE001
                where[key] = f"not importable: {type(e).__name__}: {e}"[:300]
                continue
        part = f"{args.out}.{stage.replace(':', '-')}.json"
        if os.path.exists(part):
            os.remove(part)
        deadline = time.time() + min(share, left) - 6  # children stop starting steps
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--out",
            part,
            "--stage",
            stage,
            "--deadline",
            str(deadline),
            "--n",
            str(args.n),
            "--device",
            args.device,
        ]
        t0 = time.time()
        try:
            proc = subprocess.run(
                cmd, timeout=min(share, left) + 15, capture_output=True, text=True
            )
            log = (proc.stdout + proc.stderr)[-6000:]
            print(proc.stdout[-3000:], flush=True)
            with open(part) as fh:
                res = json.load(fh)
            if proc.returncode:
                res["returncode"] = proc.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"") + (e.stderr or b"")
            log = out.decode(errors="replace")[-6000:] if isinstance(out, bytes) else str(out)
            try:  # what the child saved before the limit
                with open(part) as fh:
                    res = json.load(fh)
            except Exception:  # noqa: BLE001
                res = {}
            res["error"] = "timeout (hung kernel or slow compile) after the last step recorded"
            print(log[-3000:], flush=True)
        except Exception as e:  # noqa: BLE001
            log = ""
            res = {"error": f"{type(e).__name__}: {e}"[:2000]}
        res["wall_s"] = round(time.time() - t0, 1)
        res["log"] = log
        where[key] = res
        save()
    save()
    print(_table(report))


if __name__ == "__main__":
    main()
