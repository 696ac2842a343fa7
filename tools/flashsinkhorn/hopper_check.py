"""One GPU call for the Gluon sm_90 softmin pass (issue #18): correctness, then speed.

    PYTHONPATH=packages/flashsinkhorn/src python3 tools/flashsinkhorn/hopper_check.py \
        --out $OUT/hopper.json

For each case (d, operands) of GeomLoss-style clouds at n = m = 50k (x, y uniform in
[0, 1/sqrt(d)]^d, y shifted; cost |x - y|^2, eps = 0.01, uniform weights; potentials from
two alternating iterations of the torch backend, so every pass below has a realistic guess):

1. the Triton kernel (``flashsinkhorn.softmin``, backend "triton", autotuned) and every swept
   Hopper config run one x-side pass; errors against float64 on 514 sampled rows (the
   package's ``softmin_ref`` on the kernel's own operands) and against the Triton kernel on
   all rows; rows handed to the fallback launch (0 expected); registers, spills, shared
   memory of the compiled kernels;
2. for the default config: the pass without a guess (online max) and with a hostile guess
   (a third of the rows 1e4 eps too high, a third too low: exactly those rows fall back);
3. timing (triton.testing.do_bench medians) of one pass per config and of one symmetric
   Sinkhorn iteration (two passes and the averaging) for the Triton kernel, the default
   config and the fastest correct config;
4. flash-sinkhorn 0.4.1's fixed-eps iteration at d = 64 if it imports and time is left.

Every case runs in a child process with a time limit (a hung kernel costs its case only);
inside a case every config is in try/except, so one call reports compile errors, mismatch
magnitudes and timings for everything that works. The JSON (``--out``) is rewritten after
each case; a short table is printed last. About 3 minutes on the H200 with the defaults.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
import traceback

EPS = 0.01
EXP_RATE = 4.2e12  # exp2/s, H200 special-function units (../../shared/GPU.md)
DOT_RATE = {"tf32": 433e12, "bf16": 792e12}  # measured matmul ceilings, FLOP/s
# case -> seconds of the budget it may use (children stop starting configs after it)
CASES = {"64:tf32": 42, "64:bf16": 30, "512:tf32": 32, "1024:tf32": 32, "512:bf16": 22}


def _find(name):
    """``name`` from wherever flashsinkhorn keeps it (its modules may be regrouped)."""
    import flashsinkhorn

    if hasattr(flashsinkhorn, name):
        return getattr(flashsinkhorn, name)
    for info in pkgutil.walk_packages(flashsinkhorn.__path__, "flashsinkhorn."):
        if info.name.endswith(("_softmin_hopper", "bench", "demo")):
            continue
        mod = importlib.import_module(info.name)
        if hasattr(mod, name):
            return getattr(mod, name)
    raise ImportError(f"flashsinkhorn has no {name!r}")


def sweep(D, dtype):
    """(label, HopperConfig) pairs timed for one case: the default first."""
    from dataclasses import replace

    import torch

    from flashsinkhorn import _softmin_hopper as H

    base = H.default_config(D, dtype)
    if base.pipe:  # one chunk per tile (d = 64); the most telling comparisons first
        bk = base.block_k
        cands = [
            ("default", base),
            ("ws-pipe-pingpong", replace(base, pingpong=True)),
            ("pipe-1wg", H.HopperConfig(kernel="pipe", block_k=bk, stages=2)),
            ("ws-nooverlap", replace(base, pipe=False)),
            ("ws-pingpong", replace(base, pipe=False, pingpong=True)),
            ("pipe-1wg-nooverlap", H.HopperConfig(kernel="pipe", block_k=bk, stages=2,
                                                  pipe=False)),
            ("ws-1wg", replace(base, num_wg=1)),
            ("ws-bn64", replace(base, block_n=64)),
        ]  # fmt: skip
        # every 8th / 6th tile's exp2 on the FMA pipe: for bf16, where MUFU is the bound
        poly = [
            ("ws-poly8", replace(base, poly_every=8)),
            ("ws-poly6", replace(base, poly_every=6)),
        ]
        if dtype == torch.bfloat16:  # MUFU is the bound: early in the sweep
            cands[1:1] = poly
        else:  # the tensor cores are the bound: one control, last
            cands.append(poly[0])
    else:  # a main loop over feature chunks per tile (d = 512, 1024)
        cands = [
            ("default", base),
            ("ws-bn256", replace(base, block_n=256, stages=4, x_resident=False)),
            ("ws-bk2x", H.fit_stages(replace(base, block_k=2 * base.block_k, stages=6), D,
                                     dtype)),
            ("ws-no-pingpong", replace(base, pingpong=False)),
            ("pipe-1wg", H.HopperConfig(kernel="pipe", block_k=base.block_k, stages=4,
                                        pipe=False, x_resident=False)),
        ]  # fmt: skip
    out = []
    for label, cfg in cands:
        try:
            H._check_config(cfg, D, dtype)
        except ValueError as e:
            out.append((label, cfg, str(e)))
            continue
        out.append((label, cfg, None))
    return out


def _problem(n, d, precision, device):
    import torch

    gen = torch.Generator().manual_seed(0)
    s = 1.0 / math.sqrt(d)
    x = torch.rand(1, n, d, generator=gen).to(device) * s
    y = torch.rand(1, n, d, generator=gen).to(device) * s + 0.5 * s
    c = (x.sum(1) + y.sum(1)) / (2 * n)
    x, y = x - c[:, None], y - c[:, None]
    cx, cy = (x * x).sum(-1), (y * y).sum(-1)
    if precision == "tf32":
        xk, yk = _find("round_to_tf32")(x), _find("round_to_tf32")(y)
    else:
        xk, yk = x.bfloat16(), y.bfloat16()
    logw = torch.full((1, n), -math.log(n), device=device)
    return xk, yk, cx, cy, logw


def _pass_floor_ms(n, d, precision):
    scores = n * n
    return 1e3 * max(scores / EXP_RATE, 2 * d * scores / DOT_RATE[precision])


def _sass_order(cubin):
    """Order of HGMMA (H), MUFU.EX2 (E), wgmma waits (D), bar.sync (B) in the shortest SASS
    loop that has both HGMMA and EX2 (the consumer's tile loop), and its length."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        sass = subprocess.run([tool, "-sass", fh.name], capture_output=True, text=True).stdout
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    best = None
    for addr, txt in ins:
        m = re.search(r"^@!?U?P\d+\s+BRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)", txt)
        if not m or int(m.group(1), 16) >= addr:
            continue
        body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
        if any("HGMMA" in t for t in body) and any("MUFU.EX2" in t for t in body):
            if best is None or len(body) < len(best):
                best = body
    if best is None:
        return None
    codes = {"HGMMA": "H", "MUFU.EX2": "E", "WARPGROUP.DEPBAR": "D", "BAR.SYNC": "B"}
    seq = []
    for t in best:
        op = t.split()[1] if t.startswith("@") else t.split()[0]
        c = next((v for k, v in codes.items() if op.startswith(k)), None)
        if c is None:
            continue
        if seq and seq[-1][0] == c:
            seq[-1][1] += 1
        else:
            seq.append([c, 1])
    return {"instructions": len(best), "order": " ".join(c + (str(k) if k > 1 else "")
                                                      for c, k in seq)}  # fmt: skip


def _kernel_info(kern, known):
    """Resources of the kernels the JIT compiled since ``known`` (keys of its cache)."""
    out = []
    try:
        for dev_cache in kern.device_caches.values():
            for key, k in dev_cache[0].items():
                if key in known:
                    continue
                known.add(key)
                k = k.result() if hasattr(k, "result") else k
                info = {"shared": k.metadata.shared, "num_warps": k.metadata.num_warps}
                for a in ("n_regs", "n_spills"):
                    info[a] = getattr(k, a, None)
                try:
                    info["sass"] = _sass_order(k.asm["cubin"])
                except Exception as e:  # noqa: BLE001 - diagnostics only
                    info["sass"] = f"{type(e).__name__}: {e}"
                out.append(info)
    except Exception as e:  # noqa: BLE001 - diagnostics only
        out.append({"error": f"{type(e).__name__}: {e}"})
    return out


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_case(case, deadline, n, device="cuda", out_path=None):
    """One (d, operands) case in this process; returns its JSON dict, also written to
    ``out_path`` after every configuration (a hang then loses only what follows).
    (``device="cpu"`` with TRITON_INTERPRET=1 and a small n: a smoke run of this
    script's own code.)"""
    import torch
    import triton.testing

    from flashsinkhorn import _softmin_hopper as H

    d_str, precision = case.split(":")
    D = int(d_str)
    dev = torch.device(device)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    res = {"case": case, "n": n, "d": D, "precision": precision, "configs": {}}

    def save():
        if out_path:
            with open(out_path, "w") as fh:
                json.dump(res, fh, indent=1, default=str)

    softmin = _find("softmin")
    softmin_ref = _find("softmin_ref")
    xk, yk, cx, cy, logw = _problem(n, D, precision, dev)
    kw = dict(eps=EPS, c2=2.0)

    # realistic potentials: two alternating iterations of the torch backend from zero
    t0 = time.time()
    xf, yf = xk.float(), yk.float()
    f = torch.zeros(1, n, device=dev)
    for _ in range(2):
        g = softmin(yf, xf, f, logw, cy, cx, backend="torch", **kw)[0]
        f = softmin(xf, yf, g, logw, cx, cy, backend="torch", **kw)[0]
    g = softmin(yf, xf, f, logw, cy, cx, backend="torch", **kw)[0]
    del xf, yf
    res["init_s"] = round(time.time() - t0, 2)
    # float64 on sampled rows, on the kernel's own operands
    gen = torch.Generator().manual_seed(1)
    rows = torch.cat([torch.tensor([0, n - 1]), torch.randperm(n, generator=gen)[:512]])
    rows = rows.to(dev)
    ref = softmin_ref(xk[:, rows].double(), yk.double(), g, logw, cx[:, rows], cy, **kw)[0][0]
    floor = _pass_floor_ms(n, D, precision)
    res["floor_ms"] = floor

    def err_rows(out):
        return float((out[0, rows].double() - ref).abs().max())

    def bench(fn):
        if dev.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return [round(1e3 * (time.perf_counter() - t0), 4)] * 3
        ms = triton.testing.do_bench(fn, warmup=25, rep=150, quantiles=[0.5, 0.2, 0.8])
        return [round(v, 4) for v in ms]

    # the Triton kernel (the shipped "shift" variant: the guess is the current potential)
    def triton_pass():
        return softmin(xk, yk, g, logw, cx, cy, precision=precision, backend="triton",
                       guess=f, **kw)[0]  # fmt: skip

    tri = {}
    try:
        t0 = time.time()
        out_t = triton_pass()
        _sync(dev)
        tri["first_call_s"] = round(time.time() - t0, 2)
        tri["err_f64"] = err_rows(out_t)
        tri["ms"] = bench(triton_pass)
    except Exception as e:  # noqa: BLE001 - reported, the Hopper configs still run
        tri["error"] = f"{type(e).__name__}: {e}"[:2000]
        out_t = None
    res["triton"] = tri
    print(f"[{case}] triton {tri}", flush=True)
    save()

    known = set()
    for label, cfg, bad in sweep(D, dtype):
        r = {"config": cfg.__dict__}
        res["configs"][label] = r
        if bad:
            r["error"] = f"config rejected: {bad}"
            continue
        if time.time() > deadline:
            r["error"] = "skipped: case time budget spent"
            continue
        counter = torch.zeros(1, dtype=torch.int32, device=dev)

        def hop(guess=f, cfg=cfg, counter=None):
            return H.softmin_hopper(xk, yk, g, logw, cx, cy, precision=precision, guess=guess,
                                    config=cfg, fallback_rows=counter, **kw)[0]  # fmt: skip

        try:
            t0 = time.time()
            out = hop(counter=counter)
            _sync(dev)
            r["first_call_s"] = round(time.time() - t0, 2)
            r["kernels"] = _kernel_info(H._softmin_sm90_kernel, known)
            r["fallback_rows"] = int(counter)
            r["finite"] = bool(torch.isfinite(out).all())
            r["err_f64"] = err_rows(out)
            if out_t is not None:
                r["max_diff_triton"] = float((out - out_t).abs().max())
                r["bitwise_equal_triton"] = bool(torch.equal(out, out_t))
            e_t = tri.get("err_f64")
            r["correct"] = bool(
                r["finite"] and r["fallback_rows"] == 0 and r["err_f64"] < 1e-4
                and (e_t is None or r["err_f64"] <= 2 * e_t + 1e-6)
            )  # fmt: skip
            if label == "default":
                # no guess: the online max in the main launch
                out0 = hop(guess=None)
                r["online_err_f64"] = err_rows(out0)
                # hostile guess: exactly the rows a third too high / low fall back
                bad_g = f.clone()
                bad_g[:, 0::3] += 1e4 * EPS
                bad_g[:, 1::3] -= 1e4 * EPS
                counter.zero_()
                out_b = hop(guess=bad_g, counter=counter)
                r["hostile_fallback_rows"] = int(counter)
                r["hostile_expected"] = len(range(0, n, 3)) + len(range(1, n, 3))
                r["hostile_err_f64"] = err_rows(out_b)
                r["kernels"] += _kernel_info(H._softmin_sm90_kernel, known)
                r["correct"] = bool(
                    r["correct"] and r["online_err_f64"] < 1e-4
                    and r["hostile_err_f64"] < 1e-4
                    and r["hostile_fallback_rows"] == r["hostile_expected"]
                )  # fmt: skip
            r["ms"] = bench(hop)
            r["frac_floor"] = round(floor / r["ms"][0], 3)
            if tri.get("ms"):
                r["speedup_vs_triton"] = round(tri["ms"][0] / r["ms"][0], 3)
        except Exception as e:  # noqa: BLE001 - recorded, the next config runs
            r["error"] = f"{type(e).__name__}: {e}"[-3000:]
            r["traceback"] = traceback.format_exc()[-3000:]
        brief = {k: v for k, v in r.items() if k not in ("traceback", "kernels", "config")}
        print(f"[{case}] {label}: {json.dumps(brief)}", flush=True)
        save()

    # one symmetric fixed-eps iteration: x pass, y pass, averaging (as the solver's loop)
    good = [(lab, r) for lab, r in res["configs"].items() if r.get("correct") and r.get("ms")]
    its = {}
    if time.time() < deadline + 10:

        def iteration(pass_x, pass_y):
            ft = pass_x()
            gt = pass_y()
            return 0.5 * (f + ft), 0.5 * (g + gt)

        def tri_y():
            return softmin(yk, xk, f, logw, cy, cx, precision=precision, backend="triton",
                           guess=g, **kw)[0]  # fmt: skip

        runs = [("triton", triton_pass, tri_y)] if tri.get("ms") else []
        picks = {"default"} | ({min(good, key=lambda lr: lr[1]["ms"][0])[0]} if good else set())
        for lab in sorted(picks):
            if lab not in dict(good):
                continue
            cfg = H.HopperConfig(**res["configs"][lab]["config"])

            def hx(cfg=cfg):
                return H.softmin_hopper(xk, yk, g, logw, cx, cy, precision=precision, guess=f,
                                        config=cfg, **kw)[0]  # fmt: skip

            def hy(cfg=cfg):
                return H.softmin_hopper(yk, xk, f, logw, cy, cx, precision=precision, guess=g,
                                        config=cfg, **kw)[0]  # fmt: skip

            runs.append((f"hopper:{lab}", hx, hy))
        for name, px, py in runs:
            try:
                its[name] = bench(lambda px=px, py=py: iteration(px, py))
            except Exception as e:  # noqa: BLE001
                its[name] = f"{type(e).__name__}: {e}"[:1000]
        print(f"[{case}] iteration {its}", flush=True)
    res["iteration_ms"] = its
    return res


def run_peer(n):
    """flash-sinkhorn 0.4.1's fixed-eps iteration at d = 64 (bench.py's method: the time of
    6 iterations minus that of 2, over 4)."""
    import flash_sinkhorn
    import torch
    import triton.testing

    x, y, _, _, _ = _problem(n, 64, "tf32", torch.device("cuda"))
    x, y = x[0].float(), y[0].float()
    a = torch.full((n,), 1.0 / n, device="cuda")
    out = {"version": getattr(flash_sinkhorn, "__version__", "?")}
    ts = {}
    for k in (2, 6):
        L = flash_sinkhorn.SamplesLoss("sinkhorn", use_epsilon_scaling=False, eps=EPS,
                                       n_iters=k, debias=False, potentials=False,
                                       normalize=False, last_extrapolation=False,
                                       allow_tf32=True, half_cost=False)  # fmt: skip
        L(a, x, a, y)
        ts[k] = triton.testing.do_bench(lambda L=L: L(a, x, a, y), warmup=25, rep=150)
    out["iteration_ms_d64"] = round((ts[6] - ts[2]) / 4, 4)
    return out


def _env():
    import torch
    import triton

    e = {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        e.update(gpu=p.name, sms=p.multi_processor_count, capability=[p.major, p.minor])
    return e


def _table(report):
    lines = ["", "| case | config | pass ms | x triton | frac floor | err f64 | iteration ms |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for case, r in report.get("cases", {}).items():
        if not isinstance(r, dict) or "configs" not in r:
            lines.append(f"| {case} | {str(r)[:60]} | | | | | |")
            continue
        if r.get("error"):
            lines.append(f"| {case} | ERROR: {str(r['error'])[:90]} | | | | | |")
        its = r.get("iteration_ms", {})
        t = r.get("triton", {})
        tit = its.get("triton")
        tfrac = _fmt(r["floor_ms"] / t["ms"][0] if t.get("ms") else None)
        tit = tit[0] if isinstance(tit, list) else tit
        lines.append(f"| {case} | triton | {t.get('ms', [None])[0]} | 1 | {tfrac} | "
                     f"{_fmt(t.get('err_f64'))} | {tit} |")  # fmt: skip
        for lab, c in r["configs"].items():
            it = its.get(f"hopper:{lab}")
            if c.get("ms"):
                ok = "" if c.get("correct") else " (WRONG)"
                lines.append(f"| {case} | {lab}{ok} | {c['ms'][0]} | "
                             f"{c.get('speedup_vs_triton')} | {c.get('frac_floor')} | "
                             f"{_fmt(c.get('err_f64'))} | "
                             f"{it[0] if isinstance(it, list) else (it or '')} |")  # fmt: skip
            else:
                lines.append(f"| {case} | {lab} | {str(c.get('error'))[:70]} | | | | |")
    peer = report.get("peer")
    if isinstance(peer, dict):
        peer = {k: v for k, v in peer.items() if k not in ("log", "traceback")}
    if peer is not None:
        lines.append(f"flash-sinkhorn (same run): {peer}")
    return "\n".join(lines)


def _fmt(v):
    return None if v is None else f"{v:.3g}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--budget", type=float, default=165.0, help="seconds for all cases")
    ap.add_argument("--n", type=int, default=50000, help="points per cloud")
    ap.add_argument("--cases", default=",".join(CASES), help="e.g. 64:tf32,512:tf32")
    ap.add_argument("--no-peer", action="store_true", help="skip flash-sinkhorn")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # internal: one case in this process
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: smoke run
    args = ap.parse_args()

    if args.stage:  # child: one case (or the peer), JSON to --out
        try:
            if args.stage == "peer":
                res = run_peer(args.n)
            else:
                res = run_case(args.stage, args.deadline, args.n, args.device, args.out)
        except Exception as e:  # noqa: BLE001 - the parent records it
            res = {"error": f"{type(e).__name__}: {e}"[:3000],
                   "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
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
        share = CASES.get(stage, 100)  # the peer: its first call autotunes
        if left < 12:
            if stage == "peer":
                report["peer"] = "skipped: budget spent"
            else:
                report["cases"][stage] = "skipped: budget spent"
            continue
        if stage == "peer":
            try:
                importlib.import_module("flash_sinkhorn")
            except Exception as e:  # noqa: BLE001
                report["peer"] = f"not importable: {type(e).__name__}: {e}"[:300]
                continue
        part = f"{args.out}.{stage.replace(':', '-')}.json"
        if os.path.exists(part):
            os.remove(part)
        deadline = time.time() + min(share, left) - 8  # children stop starting configs
        cmd = [sys.executable, os.path.abspath(__file__), "--out", part, "--stage", stage,
               "--deadline", str(deadline), "--n", str(args.n),
               "--device", args.device]  # fmt: skip
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, timeout=min(share, left) + 20, capture_output=True,
                                  text=True)  # fmt: skip
            log = (proc.stdout + proc.stderr)[-6000:]
            print(proc.stdout[-4000:], flush=True)
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
            res["error"] = "timeout (hung kernel or slow compile): the configuration after "
            res["error"] += "the last one recorded; log tail in 'log'"
            print(log[-3000:], flush=True)
        except Exception as e:  # noqa: BLE001
            log = ""
            res = {"error": f"{type(e).__name__}: {e}"[:2000]}
        res["wall_s"] = round(time.time() - t0, 1)
        res["log"] = log
        if stage == "peer":
            report["peer"] = res
        else:
            report["cases"][stage] = res
        save()
    save()
    print(_table(report))


if __name__ == "__main__":
    main()
