"""One GPU call for flashsinkhorn issue #30 (the sm_90 plan application, debias kernel and
plan sampling): errors against float64, times, fractions of the floor, the issue's targets
against flash-sinkhorn 0.4.1 in the same run; JSON and a short table.

    PYTHONPATH=.site:packages/flashsinkhorn/src python3 tools/flashsinkhorn/hopper30.py \
        --out $OUT/hopper30.json           # about 4 minutes on an H100 (after the tests)

Stages (each a child process with its time limit: a hang costs its stage; every step in
try/except, the JSON saved after each step):

- ``ceilings``: the device's tf32 / bf16 matmul rate (8192^3) and its exp2 rate (a Triton
  kernel of dependent exp2 chains), the floors' denominators;
- ``kernels:D:PREC`` (n = m = 50k, eps = 0.01, potentials from two torch iterations): the
  iteration pass and one symmetric update (the references), the plan application with
  V = y (Gluon "auto" and the Triton kernel), the debias self update (the Gluon symmetric
  kernel, the plain Gluon pass it replaced, the Triton kernel), plan sampling (with the
  potential as guess, without, and the Triton first level); errors against float64 on
  514 sampled rows, draws against the float64 reference on 512 rows;
- ``loss:D``: SamplesLoss (p = 2, blur 0.05, scaling 0.5) forward and forward + backward,
  debias False / True, "auto" and "before" (this code with the #30 kernels switched off:
  the dispatch of main before #30) and "triton"; peak extra memory;
- ``peer``: flash-sinkhorn 0.4.1's iteration and SamplesLoss (d = 64, 512), if importable.

Read per kernel: ``err_*`` (float64), ``ms`` (median / p20 / p80), ``frac_floor``; the
table's target rows; ``sm90_failed`` (Gluon kernels that raised and fell back).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hopper_check import (  # noqa: E402
    EPS,
    Case,
    _bench,
    _env,
    _loss_problem,
    _problem,
    _time_loss,
)

STAGES = {
    "ceilings": 15,
    "kernels:64:tf32": 50,
    "kernels:512:tf32": 45,
    "loss:64": 60,
    "loss:512": 35,
    "peer": 40,
    "kernels:64:bf16": 30,
}
EXP_RATE = 4.2e12  # default rates (GPU.md, H200) where the ceilings stage failed
DOT_RATE = {"tf32": 433e12, "bf16": 792e12}


@contextlib.contextmanager
def before_30():
    """The #30 kernels switched off (they decline, the dispatch takes the paths of main
    before #30: the Triton plan application, the plain Gluon self pass, Triton row passes,
    the Triton sampling first level)."""
    from flashsinkhorn import _plan_hopper, _sample_hopper, _softmin_hopper, _symmetric_hopper

    def off(*a, **k):
        raise NotImplementedError("switched off (before #30)")

    saved = [
        (_plan_hopper, "plan_hopper"),
        (_symmetric_hopper, "self_sums_hopper"),
        (_softmin_hopper, "softmin_rows_hopper"),
        (_sample_hopper, "sample_blocks_hopper"),
    ]
    old = [getattr(m, n) for m, n in saved]
    for m, n in saved:
        setattr(m, n, off)
    try:
        yield
    finally:
        for (m, n), f in zip(saved, old):
            setattr(m, n, f)


def run_ceilings(deadline, out_path):
    import torch
    import triton
    import triton.language as tl

    res = {"case": "ceilings"}
    C = Case(res, out_path, deadline)
    dev = torch.device("cuda")

    def mm(dtype, tf32):
        def run():
            torch.backends.cuda.matmul.allow_tf32 = tf32
            a = torch.randn(8192, 8192, device=dev).to(dtype)
            ms = _bench(lambda: a @ a, dev, rep=200)
            return {"ms": ms, "tflops": round(2 * 8192**3 / (ms[0] * 1e-3) / 1e12, 1)}

        return run

    C.step("matmul_tf32", mm(torch.float32, True))
    C.step("matmul_bf16", mm(torch.bfloat16, False))

    @triton.jit
    def _exp_chain(X, K: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(X + offs)
        w = v * 0.5
        for _ in range(K):  # two independent chains per thread: MUFU-bound, not latency
            v = tl.exp2(v * -0.75)
            w = tl.exp2(w * -0.5)
        tl.store(X + offs, v + w)

    def exps():
        n, k = 132 * 2048 * 16, 256
        x = torch.rand(n, device=dev)
        ms = _bench(lambda: _exp_chain[(n // 1024,)](x, K=k, BLOCK=1024), dev, rep=200)
        return {"ms": ms, "exp_per_s": 2 * n * k / (ms[0] * 1e-3)}

    C.step("exp2", exps)
    return res


def _ref_rows(fs, xk, yk, g, logw, cx, cy, rows, v=None):
    return fs.softmin_ref(
        xk[:, rows].double(),
        yk.double(),
        g,
        logw,
        cx[:, rows],
        cy,
        eps=EPS,
        c2=2.0,
        v=None if v is None else v.double(),
    )


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def run_kernels(case, deadline, n, out_path, device="cuda"):
    import torch

    import flashsinkhorn as fs
    from flashsinkhorn import _plan_hopper, _symmetric_hopper, primitives
    from flashsinkhorn import sampling as S

    _, d_str, precision = case.split(":")
    D = int(d_str)
    dev = torch.device(device)
    res = {"case": case, "n": n, "d": D, "precision": precision}
    C = Case(res, out_path, deadline)
    xk, yk, cx, cy, logw = _problem(n, D, precision, dev)
    kw = dict(eps=EPS, c2=2.0, precision=precision)
    xf, yf = xk.float(), yk.float()
    f = torch.zeros(1, n, device=dev)
    for _ in range(2):
        g = fs.softmin(yf, xf, f, logw, cy, cx, backend="torch", eps=EPS, c2=2.0)[0]
        f = fs.softmin(xf, yf, g, logw, cx, cy, backend="torch", eps=EPS, c2=2.0)[0]
    g = fs.softmin(yf, xf, f, logw, cy, cx, backend="torch", eps=EPS, c2=2.0)[0]
    gen = torch.Generator().manual_seed(1)
    rows = torch.cat([torch.tensor([0, n - 1]), torch.randperm(n, generator=gen)[:512]]).to(dev)
    ref = _ref_rows(fs, xk, yk, g, logw, cx, cy, rows, v=yf)
    vmax = float(yf.abs().max())

    def err(t, r):
        return float((t[0, rows].double() - r[0]).abs().max())

    def timed(fn, extra=None):
        t1 = time.time()
        out = fn()
        _sync(dev)
        r = {"first_call_s": round(time.time() - t1, 2)}
        r.update(extra(out) if extra else {})
        r["ms"] = _bench(fn, dev)
        return r

    C.step(
        "pass_auto",
        lambda: timed(
            lambda: fs.softmin(xk, yk, g, logw, cx, cy, guess=f, **kw)[0],
            lambda o: {"err_f64": err(o, ref[0])},
        ),
    )
    C.step(
        "iteration_auto",
        lambda: timed(lambda: fs.symmetric_update(xk, yk, f, g, logw, logw, cx, cy, **kw)),
    )

    calls = []

    def plan(backend):
        def run():
            out = fs.softmin(xk, yk, g, logw, cx, cy, v=yf, guess=f, backend=backend, **kw)
            return out

        def check(o):
            e_v = float((o[2][0, rows].double() - ref[2][0]).abs().max()) / vmax
            return {"err_f64": err(o[0], ref[0]), "err_vbar_rel": e_v}

        return lambda: timed(run, check)

    real = _plan_hopper.plan_hopper
    _plan_hopper.plan_hopper = lambda *a, **k: calls.append(1) or real(*a, **k)
    r = C.step("plan_auto", plan("auto"))
    _plan_hopper.plan_hopper = real
    r["gluon_calls"] = len(calls)
    cnt = torch.zeros(1, dtype=torch.int32, device=dev)
    C.step(
        "plan_fallback_rows",
        lambda: {
            "rows": int(
                (
                    real(
                        xk,
                        yk,
                        yf,
                        g,
                        logw,
                        cx,
                        cy,
                        eps=EPS,
                        c2=2.0,
                        precision=precision,
                        guess=f,
                        fallback_rows=cnt,
                    ),
                    _sync(dev),
                    cnt,
                )[2]
            )
        },
    )
    # the debias self update of x: the Gluon symmetric kernel / the plain Gluon pass / Triton
    ref_self = fs.softmin_ref(
        xk[:, rows].double(), xk.double(), f, logw, cx[:, rows], cx, eps=EPS, c2=2.0
    )[0]

    def self_step(mode):
        def run():
            extra = dict(backend="triton", check=False) if mode == "triton" else {}

            def fn():
                return fs.self_softmin(xk, logw, f, cx, **extra, **kw)

            if mode == "plain_gluon":
                with before_30():
                    return timed(fn, lambda o: {"err_f64": err(o, ref_self)})
            calls.clear()
            real_s = _symmetric_hopper.self_sums_hopper
            _symmetric_hopper.self_sums_hopper = lambda *a, **k: calls.append(1) or real_s(*a, **k)
            try:
                r = timed(fn, lambda o: {"err_f64": err(o, ref_self)})
            finally:
                _symmetric_hopper.self_sums_hopper = real_s
            r["gluon_calls"] = len(calls)
            return r

        return run

    C.step("self_auto", self_step("auto"))

    # plan sampling: the draws of 512 consecutive rows against the float64 reference
    r0 = 1000
    s_ref = fs.softmax_sample_ref(
        xk[:, r0 : r0 + 512].float(),
        yk.float(),
        g,
        logw,
        cy,
        eps=EPS,
        c2=2.0,
        seed=5,
        row_offset=r0,
    )
    guess = (f - cx).float()

    def sample_step(mode):
        def run():
            kws = dict(seed=5, **kw)
            if mode != "noguess":
                kws["guess"] = guess
            if mode == "triton":
                kws["backend"] = "triton"

            def fn():
                return fs.softmax_sample(xk, yk, g, logw, cy, **kws)

            def check(o):
                return {"draws_differ": int((o[:, r0 : r0 + 512] != s_ref).sum())}

            return timed(fn, check)

        return run

    C.step("sample_auto", sample_step("guess"))
    # the comparisons last (the stage's time limit skips what it cannot fit)
    C.step("plan_triton", plan("triton"), optional=True)
    if D >= 512:  # a narrow V (a barycentric map of a few columns) at large d
        v64 = yf[..., :64].contiguous()
        C.step(
            "plan_auto_dv64",
            lambda: timed(lambda: fs.softmin(xk, yk, g, logw, cx, cy, v=v64, guess=f, **kw)),
            optional=True,
        )

    C.step("self_plain_gluon", self_step("plain_gluon"), optional=True)
    C.step("self_triton", self_step("triton"), optional=True)
    C.step("sample_auto_noguess", sample_step("noguess"), optional=True)
    C.step("sample_triton", sample_step("triton"), optional=True)
    res["sm90_failed"] = dict(primitives.SM90_FAILED)
    del S
    C.save()
    return res


def run_loss(case, deadline, n, out_path, device="cuda"):
    import torch

    import flashsinkhorn as fs
    from flashsinkhorn import primitives

    D = int(case.split(":")[1])
    dev = torch.device(device)
    res = {"case": case, "n": n, "d": D}
    C = Case(res, out_path, deadline)
    x, y = _loss_problem(n, D, dev)
    vals = {}
    for debias in (False, True) if D == 64 else (False,):
        for kind in ("auto", "before", "triton"):
            for mode in ("fwd", "fwd_bwd"):
                if kind == "triton" and (debias or D > 64):
                    continue
                be = "triton" if kind == "triton" else "auto"
                L = fs.SamplesLoss(blur=0.05, scaling=0.5, debias=debias, backend=be)

                def run(L=L, mode=mode, key=(debias, kind), kind=kind):
                    ctx = before_30() if kind == "before" else contextlib.nullcontext()
                    with ctx:
                        with torch.no_grad():
                            vals[key] = float(L(x, y))
                        r = _time_loss(L, x, y, dev, mode)
                    r["value"] = vals[key]
                    return r

                C.step(f"debias={debias}:{kind}:{mode}", run, optional=kind != "auto")
    for key, v in vals.items():
        base = vals.get((key[0], "before"))
        if base is not None:
            res[f"rel_diff_{key[1]}_before:debias={key[0]}"] = abs(v - base) / abs(base)
    res["sm90_failed"] = dict(primitives.SM90_FAILED)
    C.save()
    return res


def run_peer(deadline, n, out_path):
    import flash_sinkhorn
    import torch
    import triton.testing

    dev = torch.device("cuda")
    res = {"case": "peer", "version": getattr(flash_sinkhorn, "__version__", "?")}
    C = Case(res, out_path, deadline)

    def iteration():
        x, y = _loss_problem(n, 64, dev)
        a = torch.full((n,), 1.0 / n, device=dev)
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
        return {"ms": [round((ts[6] - ts[2]) / 4, 4)] * 3}

    C.step("iteration_d64", iteration)
    for D, debias, mode in (
        (64, False, "fwd"),
        (64, False, "fwd_bwd"),
        (64, True, "fwd"),
        (64, True, "fwd_bwd"),
        (512, False, "fwd"),
        (512, False, "fwd_bwd"),
    ):
        x, y = _loss_problem(n, D, dev)
        L = flash_sinkhorn.SamplesLoss(
            "sinkhorn", p=2, blur=0.05, scaling=0.5, debias=debias, half_cost=True, allow_tf32=True
        )
        C.step(
            f"loss:{D}:debias={debias}:{mode}",
            lambda L=L, x=x, y=y, mode=mode: _time_loss(L, x, y, dev, mode),
        )
    return res


# ---------------------------------------------------------------------------------------
# floors and the table
# ---------------------------------------------------------------------------------------


def _med(r):
    return r["ms"][0] if isinstance(r, dict) and isinstance(r.get("ms"), list) else None


def floors(report):
    """Floors (ms) per kernel at 50k from the measured rates: exps at the exp2 rate, dot
    FLOPs at the matmul rate, the larger of the two (they overlap in the kernels)."""
    c = report.get("cases", {}).get("ceilings", {})
    exp_rate = (c.get("exp2") or {}).get("exp_per_s") or EXP_RATE
    dot = {
        p: ((c.get(f"matmul_{p}") or {}).get("tflops") or DOT_RATE[p] / 1e12) * 1e12
        for p in ("tf32", "bf16")
    }
    out = {"exp_per_s": exp_rate, "dot_flops": dot}
    n = report.get("n", 50000)
    nm = float(n) * n
    from flashsinkhorn._plan_hopper import default_plan_config

    for D, p in ((64, "tf32"), (64, "bf16"), (512, "tf32")):
        import torch

        cfg = default_plan_config(D, D, torch.bfloat16 if p == "bf16" else torch.float32)
        n_dv = -(-D // cfg.block_dv)
        k = f"{D}:{p}"
        out[f"pass:{k}"] = 1e3 * max(nm / exp_rate, 2 * D * nm / dot[p])
        # the plan application: one exp per score per output chunk, the scores' dot per
        # chunk, the P @ V product once (its padded width)
        pv = 2 * n_dv * cfg.block_dv * nm
        out[f"plan:{k}"] = 1e3 * max(n_dv * nm / exp_rate, (n_dv * 2 * D * nm + pv) / dot[p])
        out[f"plan_ideal:{k}"] = 1e3 * max(nm / exp_rate, (2 * D + 2 * D) * nm / dot[p])
        out[f"self:{k}"] = 0.5 * out[f"pass:{k}"]
        out[f"sample:{k}"] = out[f"pass:{k}"]
        out[f"iteration:{k}"] = out[f"pass:{k}"]  # the one pass: one exp, one dot per score
    return out


def table(report):
    fl = report.get("floors", {})
    L = [
        "",
        f"device: {report.get('env', {}).get('gpu')}  (ms: medians; floors from the "
        f"measured rates: exp2 {fl.get('exp_per_s', 0):.3g}/s, tf32 "
        f"{fl.get('dot_flops', {}).get('tf32', 0) / 1e12:.0f} / bf16 "
        f"{fl.get('dot_flops', {}).get('bf16', 0) / 1e12:.0f} TFLOP/s)",
        "",
        "| kernel / case | ours | before #30 (same run) | floor | frac of floor | notes |",
        "|---|---|---|---|---|---|",
    ]
    cases = report.get("cases", {})
    for k in ("kernels:64:tf32", "kernels:64:bf16", "kernels:512:tf32"):
        r = cases.get(k)
        if not isinstance(r, dict):
            continue
        key = k.split(":", 1)[1]

        def row(name, ours, before, floor, note="", key=key):
            o, b = _med(ours), _med(before)
            frac = f"{floor / o:.2f}" if (o and floor) else "-"
            err = (ours or {}).get("error") if isinstance(ours, dict) else None
            note = (note + (" ERROR " + str(err)[:60] if err else "")).strip()
            L.append(
                f"| {name} {key} | {o} | {b} | {floor and round(floor, 3)} | {frac} | {note} |"
            )

        pa = r.get("plan_auto", {})
        row(
            "pass (reference)",
            r.get("pass_auto"),
            None,
            fl.get(f"pass:{key}"),
            f"err {r.get('pass_auto', {}).get('err_f64', float('nan')):.2g}",
        )
        row("iteration, one pass", r.get("iteration_auto"), None, fl.get(f"iteration:{key}"))
        row(
            "plan application V=y",
            pa,
            r.get("plan_triton"),
            fl.get(f"plan:{key}"),
            f"err out {pa.get('err_f64', float('nan')):.2g} vbar "
            f"{pa.get('err_vbar_rel', float('nan')):.2g}"
            f" (Triton {r.get('plan_triton', {}).get('err_vbar_rel', float('nan')):.2g}); "
            f"gluon calls {pa.get('gluon_calls')}; fallback rows "
            f"{r.get('plan_fallback_rows', {}).get('rows')}",
        )
        sa = r.get("self_auto", {})
        row(
            "debias self update",
            sa,
            r.get("self_plain_gluon"),
            fl.get(f"self:{key}"),
            f"err {sa.get('err_f64', float('nan')):.2g}; gluon calls {sa.get('gluon_calls')}; "
            f"Triton {_med(r.get('self_triton'))}",
        )
        sm = r.get("sample_auto", {})
        it = _med(r.get("iteration_auto"))
        ratio = f"{_med(sm) / it:.2f}x an iteration" if (_med(sm) and it) else ""
        row(
            "plan sampling",
            sm,
            r.get("sample_triton"),
            fl.get(f"sample:{key}"),
            f"{ratio} (target <= 1.2); draws differing from f64 "
            f"{sm.get('draws_differ')}/512; no guess {_med(r.get('sample_auto_noguess'))}",
        )
        if r.get("sm90_failed"):
            L.append(f"| SM90 FAILED | {json.dumps(r['sm90_failed'])[:200]} | | | | |")
    peer = cases.get("peer", {}) if isinstance(cases.get("peer"), dict) else {}
    L += [
        "",
        "| SamplesLoss 50k | ours (auto) | before #30 | triton | flash-sinkhorn 0.4.1 | "
        "ours vs peer | target |",
        "|---|---|---|---|---|---|---|",
    ]
    targets = {
        ("64", False, "fwd"): "<= 13 ms",
        ("64", False, "fwd_bwd"): "<= fwd + 3 ms",
        ("512", False, "fwd_bwd"): "<= 1.4x its fwd",
        ("64", True, "fwd"): "<= 1.6x debias=False",
    }
    for D in ("64", "512"):
        r = cases.get(f"loss:{D}")
        if not isinstance(r, dict):
            continue
        for debias in (False, True):
            for mode in ("fwd", "fwd_bwd"):
                a = r.get(f"debias={debias}:auto:{mode}")
                if a is None:
                    continue
                b = r.get(f"debias={debias}:before:{mode}")
                t = r.get(f"debias={debias}:triton:{mode}")
                p = peer.get(f"loss:{D}:debias={debias}:{mode}")
                ratio = f"{_med(p) / _med(a):.2f}x" if (_med(p) and _med(a)) else "-"
                mem = a.get("peak_extra_mib") if isinstance(a, dict) else None
                L.append(
                    f"| d={D} debias={debias} {mode} | {_med(a)}"
                    + (f" (+{mem} MiB)" if mem else "")
                    + f" | {_med(b)} | {_med(t)} | "
                    f"{_med(p)} | {ratio} | {targets.get((D, debias, mode), '')} |"
                )
    if peer.get("iteration_d64"):
        L.append(f"| flash-sinkhorn iteration d=64 | | | | {_med(peer['iteration_d64'])} | | |")
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for all stages")
    ap.add_argument("--n", type=int, default=50000)
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    # cpu: a smoke run of this script's own code (TRITON_INTERPRET=1, small --n)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.stage:  # a child: one stage, its JSON to --out
        s = args.stage
        if s == "ceilings":
            run_ceilings(args.deadline, args.out)
        elif s.startswith("kernels"):
            run_kernels(s, args.deadline, args.n, args.out, args.device)
        elif s.startswith("loss"):
            run_loss(s, args.deadline, args.n, args.out, args.device)
        else:
            run_peer(args.deadline, args.n, args.out)
        return
    t_end = time.time() + args.budget
    report = {"env": _env(), "n": args.n, "cases": {}}

    def save():
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1, default=str)

    for s in args.stages.split(","):
        left = t_end - time.time()
        if left < 20:
            report["cases"][s] = "skipped: budget spent"
            continue
        limit = min(STAGES.get(s, 40), left - 12)
        part = f"{args.out}.{s.replace(':', '_')}.json"
        cmd = [
            sys.executable,
            __file__,
            "--device",
            args.device,
            "--out",
            part,
            "--stage",
            s,
            "--n",
            str(args.n),
            "--deadline",
            str(time.time() + limit - 5),
        ]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, timeout=limit + 10, capture_output=True, text=True)
            log = (p.stdout + p.stderr)[-4000:]
            print(p.stdout[-6000:], p.stderr[-3000:] if p.returncode else "", flush=True)
        except subprocess.TimeoutExpired as e:
            log = f"TIMEOUT after {limit + 10:.0f} s: {str(e.stdout)[-2000:]}"
            print(log, flush=True)
        try:
            with open(part) as fh:
                report["cases"][s] = json.load(fh)
        except (OSError, ValueError):
            report["cases"][s] = {"error": "no result", "log": log}
        report["cases"][s]["stage_s"] = (
            round(time.time() - t0, 1) if isinstance(report["cases"][s], dict) else None
        )
        save()
    try:
        report["floors"] = floors(report)
    except Exception as e:  # noqa: BLE001
        report["floors"] = {"error": f"{type(e).__name__}: {e}"}
    save()
    text = table(report)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as fh:
        fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
