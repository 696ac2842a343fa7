"""GPU run of the second-order applications, most important case first, results kept as they come.

    python packages/flashsinkhorn/examples/gpu_second_order.py --out OUTDIR [--budget 105]
    python packages/flashsinkhorn/examples/gpu_second_order.py --out OUTDIR --smoke   # CPU, s

Cases, in this order (each under its own time limit, all under ``--budget`` seconds):

1. ``hvp``: HVP in x at n = m = 20k, d = 64: 100 Sinkhorn iterations at eps = 0.01, then
   the Schur-complement CG (target 200 ms; hvp's default loop: tf32 but the last 5
   iterations; ``hvp_exact_loop``: every iteration at tf32x3; the first call, with the
   Triton compiles, is timed apart);
2. ``hvp_peer``: flash-sinkhorn 0.4.1's ``hvp_x_sqeuclid`` on the same problem;
3. ``otdd``: debiased OTDD between two synthetic MNIST-shaped datasets of 60k points
   (d = 784, Gaussian label distances), one direction;
4. ``newton_step``: one damped Newton direction at the HVP's size, (H + damping I) z = grad
   by CG on the streaming HVP (at most 20 HVPs);
5. ``hvp_accuracy``: ours (tf32x3, tf32) and flash-sinkhorn against a float64 run of the
   same algorithm at n = m = 10k;
6. ``newton``: shuffled regression (at most 100 Adam steps, then Newton-CG on the HVP) at
   n = 4000; tiny kernels, so launch bound (90 Adam steps with their Lanczos checks and 4
   Newton steps took 54 s on the CPU at n = 60): it may stop at its limit, and its
   progress lines in the log then say how far it got;
7. ``otdd_more``: the other direction and the self distance at 60k;
8. ``otdd_flow``: 6 steps of the OTDD gradient flow at n = 10k.

A case past its limit is stopped (SIGALRM between Python statements) and recorded as
``timeout``; cases that would start after the budget are recorded as ``skipped``. Every
finished measurement is written at once (flushed): ``results.jsonl`` (one JSON object a
line), ``summary.md`` (one markdown row a line), ``bench-second-order.json`` (kernel-bench/1
rows) and ``second-order.json`` (everything, rewritten after each case). Progress lines with
elapsed seconds go to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "packages", "flashsinkhorn", "src"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "packages", "flashsinkhorn", "examples"))

from flashsinkhorn._hessian import envelope_grads, hvp_plan  # noqa: E402
from flashsinkhorn.bench import hvp_problem as _problem  # noqa: E402
from flashsinkhorn.second_order import hvp, inverse_hvp, otdd  # noqa: E402
from flashsinkhorn.second_order._plan import solve_potentials  # noqa: E402
from flashsinkhorn.second_order.hvp import _resolve_loop_precision  # noqa: E402
from flashsinkhorn.second_order.otdd import otdd_gradient_flow  # noqa: E402

TARGET_HVP_MS = 200.0  # issue #6: HVP at n = m = 20k, d = 64, after 100 iterations

# problem sizes: full (H200) and smoke (CPU, seconds)
SIZES = {
    "full": dict(
        hvp_n=20000,
        hvp_d=64,
        otdd_n=60000,
        side=28,
        newton_n=4000,
        newton_adam=100,
        acc_n=10000,
        flow_n=10000,
        reps=3,
    ),
    "smoke": dict(
        hvp_n=300,
        hvp_d=8,
        otdd_n=200,
        side=6,
        newton_n=60,
        newton_adam=20,
        acc_n=200,
        flow_n=100,
        reps=1,
    ),
}


class CaseTimeout(BaseException):
    """Raised by the alarm; a BaseException so that no ``except Exception`` swallows it."""


class Run:
    """Where results go, written as soon as they exist."""

    def __init__(self, out, device, sizes, budget):
        self.out, self.dev, self.sz, self.budget = out, device, sizes, budget
        self.t0 = time.time()
        self.rows, self.res, self.state = [], {"env": env_info(), "sizes": sizes}, {}
        os.makedirs(out, exist_ok=True)
        self.jsonl = open(os.path.join(out, "results.jsonl"), "w")
        self.md = open(os.path.join(out, "summary.md"), "w")
        self._write(
            self.md,
            "| case | provider | params | time ms | first call s | metrics |\n"
            "|---|---|---|---|---|---|\n",
        )

    def elapsed(self):
        return time.time() - self.t0

    def log(self, msg):
        print(f"[second-order {self.elapsed():6.1f} s] {msg}", flush=True)

    @staticmethod
    def _write(fh, text):
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())  # a kill by the step time limit keeps every finished line

    def event(self, case, kind, **data):
        rec = {"case": case, "event": kind, "elapsed_s": round(self.elapsed(), 2), **data}
        self._write(self.jsonl, json.dumps(rec, default=str) + "\n")

    def row(
        self,
        case,
        bench,
        provider,
        params,
        time_ms=None,
        *,
        first_s=None,
        t20=None,
        t80=None,
        metrics=None,
        accuracy=None,
        status="ok",
        error=None,
    ):
        r = {
            "bench": bench,
            "provider": provider,
            "mode": bench,
            "params": params,
            "status": status,
            "time_ms": time_ms,
            "time_ms_p20": t20,
            "time_ms_p80": t80,
            "metrics": dict(metrics or {}, first_call_s=first_s),
            "accuracy": accuracy or {},
            "error": error,
        }
        self.rows.append(r)
        self.event(case, "row", row=r)
        t = f"{time_ms:.1f}" if time_ms is not None else status
        fs_ = f"{first_s:.1f}" if first_s is not None else "-"
        m = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in (metrics or {}).items()}
        if accuracy:
            m.update(accuracy)
        ps = " ".join(f"{k}={v}" for k, v in params.items())
        self._write(self.md, f"| {case} | {provider} | {ps} | {t} | {fs_} | {m} |\n")
        self.log(f"{case} {provider}: {t} ms (first call {fs_} s) {m}")
        self.dump()

    def note(self, case, status, why):
        """A summary line for a case that ended without (all of) its rows."""
        self._write(self.md, f"| {case} | - | - | {status} | - | {why} |\n")

    def dump(self):
        bench = {
            "schema": "kernel-bench/1",
            "package": "flashsinkhorn",
            "package_version": _version(),
            "command": " ".join(sys.argv),
            "env": self.res["env"],
            "results": self.rows,
            "wall_s": self.elapsed(),
        }
        for name, obj in (("bench-second-order.json", bench), ("second-order.json", self.res)):
            tmp = os.path.join(self.out, name + ".tmp")
            with open(tmp, "w") as fh:
                json.dump(obj, fh, indent=1, default=str)
            os.replace(tmp, os.path.join(self.out, name))


def _version():
    try:
        import flashsinkhorn

        return flashsinkhorn.__version__
    except Exception:  # noqa: BLE001
        return "?"


def env_info():
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    try:
        import flash_sinkhorn

        env["peers"] = {"flash-sinkhorn": flash_sinkhorn.__version__}
    except ImportError:
        env["peers"] = {}
    return env


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def first_call(dev, fn):
    """Wall seconds of the first call (Triton compiles and autotuning included) and its output."""
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t0, out


def timed(dev, fn, reps):
    """Median / p20 / p80 ms of ``reps`` calls (CUDA events on GPU), peak extra MiB, last output."""
    ts, out = [], None
    if dev.type == "cuda":
        sync(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(reps):
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            out = fn()
            ts.append(1e3 * (time.perf_counter() - t0))
    peak = None
    if dev.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
    ts.sort()
    q = lambda p: ts[min(len(ts) - 1, int(p * (len(ts) - 1) + 0.5))]  # noqa: E731
    return statistics.median(ts), q(0.2), q(0.8), peak, out


def mnist_like(n, seed, device, shift=0.0, side=28):
    """Synthetic data of MNIST's shape: 10 classes of side x side images in [0, 1].

    Each class is a random smooth template (sum of Gaussian strokes); samples are the
    template with random intensity noise, clipped to [0, 1]. ``shift`` moves the second
    dataset's templates (a domain shift).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(float(side)), torch.arange(float(side)), indexing="ij")
    tg = torch.Generator(device="cpu").manual_seed(1234)  # templates shared by both datasets
    templates = []
    for _ in range(10):
        img = torch.zeros(side, side)
        for _ in range(6):
            cx, cy = side * (0.2 + 0.6 * torch.rand(2, generator=tg))
            s = side / 28 * (1.5 + 2.0 * torch.rand(1, generator=tg))
            img += torch.exp(-((xx - cx - shift) ** 2 + (yy - cy) ** 2) / (2 * s**2))
        templates.append((img / img.max()).reshape(-1))
    T = torch.stack(templates)
    labels = torch.randint(0, 10, (n,), generator=g)
    noise = 0.25 * torch.randn(n, side * side, generator=g)
    x = (T[labels] * (0.8 + 0.4 * torch.rand(n, 1, generator=g)) + noise).clamp(0, 1)
    return x.to(device), labels.to(device)


# ----------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------
EPS, ITERS = 0.01, 100


def case_hvp(run, precision="tf32x3", case="hvp", loop_precision="auto"):
    """Ours at the issue's size: one Sinkhorn solve of 100 iterations + one HVP (CG), with
    ``hvp``'s loop precision ("auto": at tf32x3 the loop runs in tf32 but its last 5)."""
    loop = _resolve_loop_precision(loop_precision, precision, None, False)
    dev, n, d = run.dev, run.sz["hvp_n"], run.sz["hvp_d"]
    x, y, v = run.state.get("hvp_problem") or _problem(n, n, d, dev)
    run.state["hvp_problem"] = (x, y, v)
    info = {}

    def solve():
        return solve_potentials(
            x, y, eps=EPS, max_iter=ITERS, precision=precision, loop_precision=loop
        )

    def full():
        plan = solve()
        hx, _, cg = hvp_plan(plan, v, None, need_y=False, cg_tol=1e-6)
        info["cg"] = cg
        return hx

    first, _ = first_call(dev, full)
    # kept at once: if the timed calls below run past the case's limit, this stays
    run.event(case, "first_call", wall_s=round(first, 3), cg_iters=info["cg"].iterations)
    run.note(
        case,
        "first call",
        f"{first:.1f} s with the compiles, {info['cg'].iterations} CG iterations",
    )
    reps = run.sz["reps"] if first < 10 else 1  # a slow first call: time one more only
    run.log(f"{case}: first call (compiles + run) {first:.1f} s; timing {reps} call(s)")
    t, t20, t80, peak, hx = timed(dev, full, reps)
    if precision == "tf32x3" and loop_precision == "auto":
        run.state["hvp_ours"] = hx
    ts, _, _, _, _ = timed(dev, solve, max(1, reps - 1))
    cg = info["cg"]
    params = {
        "n": n,
        "m": n,
        "d": d,
        "eps": EPS,
        "sinkhorn_iters": ITERS,
        "cg_tol": 1e-6,
        "precision": precision,
        "loop_precision": loop_precision,
        "dtype": "float32",
    }
    provider = "ours" if precision == "tf32x3" else f"ours-{precision}"
    if loop_precision != "auto":
        provider += f"-{loop_precision or 'exact'}-loop"
    run.row(
        case,
        "hvp",
        provider,
        params,
        t,
        first_s=first,
        t20=t20,
        t80=t80,
        metrics={
            "sinkhorn_ms": ts,
            "hvp_only_ms": t - ts,
            "cg_iters": cg.iterations,
            "cg_rel_residual": cg.residual / max(cg.initial_residual, 1e-30),
            "peak_mem_mib": peak,
            "target_ms": TARGET_HVP_MS,
        },
    )


def case_hvp_tf32(run):
    """The same problem with the Sinkhorn loop and the HVP passes in plain tf32 (one
    tensor-core pass per product: the precision flash-sinkhorn runs at; float64 error in
    ``hvp_accuracy``)."""
    case_hvp(run, precision="tf32", case="hvp_tf32")


def case_hvp_exact_loop(run):
    """tf32x3 HVP passes with every Sinkhorn iteration at tf32x3 (``loop_precision=None``;
    the default before 2026-12-01 run 10)."""
    case_hvp(run, precision="tf32x3", case="hvp_exact_loop", loop_precision=None)


def case_hvp_peer(run):
    """flash-sinkhorn 0.4.1's end-to-end HVP (its defaults: CG rtol 1e-6, tau2 1e-5)."""
    dev = run.dev
    x, y, v = run.state.get("hvp_problem") or _problem(
        run.sz["hvp_n"], run.sz["hvp_n"], run.sz["hvp_d"], dev
    )
    n, d = x.shape
    params = {"n": n, "m": n, "d": d, "eps": EPS, "sinkhorn_iters": ITERS, "dtype": "float32"}
    try:
        import flash_sinkhorn as fsk
    except ImportError:
        run.row(
            "hvp_peer",
            "hvp",
            "flash-sinkhorn",
            params,
            status="skipped",
            error="flash_sinkhorn not importable",
        )
        return
    if dev.type != "cuda":
        run.row("hvp_peer", "hvp", "flash-sinkhorn", params, status="skipped", error="needs CUDA")
        return
    a = torch.full((n,), 1.0 / n, device=dev)

    def call():
        return fsk.hvp_x_sqeuclid(x, y, a, a, v, eps_list=[EPS] * ITERS)

    first, _ = first_call(dev, call)
    run.event("hvp_peer", "first_call", wall_s=round(first, 3))
    run.note("hvp_peer", "first call", f"{first:.1f} s with its compiles and autotuning")
    run.log(f"hvp_peer: first call {first:.1f} s")
    t, t20, t80, peak, (h, finfo) = timed(dev, call, max(1, run.sz["reps"] - 1))
    acc = {}
    if run.state.get("hvp_ours") is not None:
        ours = run.state["hvp_ours"]
        acc["rel_diff_vs_ours"] = float((h - ours).norm() / ours.norm())
    run.row(
        "hvp_peer",
        "hvp",
        "flash-sinkhorn",
        params,
        t,
        first_s=first,
        t20=t20,
        t80=t80,
        metrics={"peak_mem_mib": peak, "cg_iters": getattr(finfo, "cg_iters", None)},
        accuracy=acc,
    )


OTDD_KW = dict(
    eps=5.0,
    eps_schedule=[400.0, 160.0, 64.0, 25.6, 10.24],
    max_iter=15,
    tol=None,
    label_distance="gaussian",
)


def _otdd_data(run):
    if "otdd_data" not in run.state:
        n, side = run.sz["otdd_n"], run.sz["side"]
        x1, l1 = mnist_like(n, 1, run.dev, side=side)
        x2, l2 = mnist_like(n, 2, run.dev, shift=1.5, side=side)
        run.state["otdd_data"] = (x1, l1, x2, l2)
    return run.state["otdd_data"]


def _otdd_row(run, case, name, a, b, first=None):
    x1, l1, x2, l2 = a + b
    t, _, _, peak, r = timed(run.dev, lambda: otdd(x1, l1, x2, l2, **OTDD_KW), 1)
    n, side = run.sz["otdd_n"], run.sz["side"]
    params = {
        "n": n,
        "m": n,
        "d": side * side,
        "eps": OTDD_KW["eps"],
        "pair": name,
        "iters": len(OTDD_KW["eps_schedule"]) + OTDD_KW["max_iter"],
        "debias": True,
    }
    run.res.setdefault("otdd", {})[name] = {"value": r.value, "terms": r.terms, "time_ms": t}
    run.row(
        case,
        "otdd",
        "ours",
        params,
        t,
        first_s=first,
        metrics={"peak_mem_mib": peak, "inputs_mib": 2 * n * side * side * 4 / 2**20},
        accuracy={"value": r.value, **r.terms},
    )
    return r


def case_otdd(run):
    """One OTDD (three streamed problems with a label term) at 60k; the compiles first."""
    side = run.sz["side"]
    w1, k1 = mnist_like(512, 11, run.dev, side=side)  # same kernels, seconds of compile
    w2, k2 = mnist_like(512, 12, run.dev, shift=1.5, side=side)
    first, _ = first_call(run.dev, lambda: otdd(w1, k1, w2, k2, **OTDD_KW))
    run.log(f"otdd: compile warm-up at n=512 {first:.1f} s")
    x1, l1, x2, l2 = _otdd_data(run)
    _otdd_row(run, "otdd", "D1-D2", (x1, l1), (x2, l2), first)


def case_newton_step(run):
    """One damped Newton direction at the HVP's size: solve (H + damping I) z = grad by CG
    on the streaming HVP (each product runs the inner Schur CG), capped at 20 products."""
    dev, n, d = run.dev, run.sz["hvp_n"], run.sz["hvp_d"]
    x, y, _ = run.state.get("hvp_problem") or _problem(n, n, d, dev)
    gx, _ = envelope_grads(solve_potentials(x, y, eps=EPS, max_iter=ITERS), need_y=False)
    # H is indefinite away from a minimizer (CG stops at the first negative curvature);
    # on this problem on the CPU (n = 300 and 1000) damping 2/n met negative curvature and
    # 20/n did not, so 20/n: H + damping I positive definite, CG to a tight tolerance
    damping, outer, tol = 20.0 / n, 20, 1e-6

    def step():
        return inverse_hvp(
            x,
            y,
            gx,
            eps=EPS,
            damping=damping,
            tol=tol,
            max_cg_iter=outer,
            inner_cg_tol=1e-6,
            max_iter=ITERS,
            return_info=True,
        )

    t, _, _, peak, (z, info) = timed(dev, step, 1)
    params = {
        "n": n,
        "m": n,
        "d": d,
        "eps": EPS,
        "sinkhorn_iters": ITERS,
        "damping": damping,
        "outer_cg_cap": outer,
        "outer_tol": tol,
        "inner_cg_tol": 1e-6,
    }
    run.row(
        "newton_step",
        "newton_step",
        "ours",
        params,
        t,
        metrics={
            "outer_cg_iters": info.iterations,
            "converged": info.converged,
            "rel_residual": info.residual / max(info.initial_residual, 1e-30),
            "negative_curvature": info.negative_curvature,
            "peak_mem_mib": peak,
            "ms_per_hvp": t / max(info.iterations, 1),
        },
    )


def case_newton(run):
    """Shuffled regression: Adam until the saddle is left, then Newton-CG (double backward)."""
    from shuffled_regression import shuffled_regression

    n = run.sz["newton_n"]
    t0 = time.perf_counter()
    r = shuffled_regression(
        n=n,
        p=3,
        q=2,
        eps=0.2,
        seed=1,
        device=run.dev,
        dtype=torch.float32,
        sinkhorn_iter=300,
        sinkhorn_tol=1e-5,
        cg_tol=1e-5,
        gtol=1e-5,
        max_adam=run.sz["newton_adam"],
        newton_iters=10,
        verbose=True,
    )
    sync(run.dev)
    wall = time.perf_counter() - t0
    run.res["shuffled_regression"] = {
        "n": n,
        "time_s": wall,
        "rel_pred_error": r["rel_pred_error"],
        "switch_iter": r["switch_iter"],
        "loss_at_truth": r["loss_at_truth"],
        "final_loss": r["newton"].fun,
        "final_grad_norm": r["newton"].grad_norm,
        "history": r["history"],
    }
    params = {"n": n, "p": 3, "q": 2, "eps": 0.2, "dtype": "float32"}
    run.row(
        "newton",
        "shuffled_regression",
        "ours",
        params,
        1e3 * wall,
        metrics={
            "newton_iters": r["newton"].iterations,
            "switch_iter": r["switch_iter"],
            "final_grad_norm": r["newton"].grad_norm,
        },
        accuracy={"rel_pred_error": r["rel_pred_error"]},
    )


def case_hvp_accuracy(run):
    """Relative error against float64 (torch backend, same algorithm, CG to 1e-10)."""
    dev, n, d = run.dev, run.sz["acc_n"], run.sz["hvp_d"]
    x, y, v = _problem(n, n, d, dev)
    t0 = time.perf_counter()
    ref = hvp(
        x.double(), y.double(), v.double(), eps=EPS, max_iter=ITERS, backend="torch", cg_tol=1e-10
    )
    sync(dev)
    acc = {"float64_ref_s": time.perf_counter() - t0}
    run.log(f"hvp_accuracy: float64 reference {acc['float64_ref_s']:.1f} s")
    params = {"n": n, "m": n, "d": d, "eps": EPS, "sinkhorn_iters": ITERS}
    for prec, loop in (("tf32x3", "auto"), ("tf32", "auto"), ("tf32x3", None)):
        h, info = hvp(
            x, y, v, eps=EPS, max_iter=ITERS, precision=prec, loop_precision=loop, return_info=True
        )
        key = prec if loop == "auto" else f"{prec}_exact_loop"
        acc[f"rel_err_{key}"] = float((h.double() - ref).norm() / ref.norm())
        acc[f"cg_iters_{key}"] = info.cg[0].iterations
        run.log(f"hvp_accuracy: {key} relative error {acc[f'rel_err_{key}']:.3g}")
    # our row is kept before the peer runs: its first call (compiles, autotuning) can
    # outlast the case's limit
    run.res["hvp_accuracy"] = acc
    run.row("hvp_accuracy", "hvp_accuracy", "ours", params, accuracy=dict(acc))
    if dev.type == "cuda":
        peer = {}
        try:
            import flash_sinkhorn as fsk

            a = torch.full((n,), 1.0 / n, device=dev)
            hfs, finfo = fsk.hvp_x_sqeuclid(x, y, a, a, v, eps_list=[EPS] * ITERS)
            peer["rel_err"] = float((hfs.double() - ref).norm() / ref.norm())
        except Exception as e:  # noqa: BLE001
            peer["error"] = repr(e)[:200]
        run.res["hvp_accuracy_flash_sinkhorn"] = peer
        run.row("hvp_accuracy", "hvp_accuracy", "flash-sinkhorn", params, accuracy=peer)


def case_otdd_more(run):
    """The reverse direction (the debiased OTDD is symmetric) and the self distance (~0)."""
    x1, l1, x2, l2 = _otdd_data(run)
    _otdd_row(run, "otdd_more", "D2-D1", (x2, l2), (x1, l1))
    _otdd_row(run, "otdd_more", "D1-D1", (x1, l1), (x1, l1))


def case_otdd_flow(run):
    """Gradient flow of D1 toward D2 (three problems and the label table per step)."""
    run.state.pop("otdd_data", None)  # free the 60k datasets
    if run.dev.type == "cuda":
        torch.cuda.empty_cache()
    n, side, steps = run.sz["flow_n"], run.sz["side"], 6
    y1, k1 = mnist_like(n, 3, run.dev, side=side)
    y2, k2 = mnist_like(n, 4, run.dev, shift=1.5, side=side)
    kw = {k: v for k, v in OTDD_KW.items() if k != "label_distance"}
    hist = []

    def cb(step, _x, val):
        hist.append((step, val))
        run.log(f"otdd_flow step {step}: {val:.5g}")

    t0 = time.perf_counter()
    otdd_gradient_flow(y1, k1, y2, k2, steps=steps, lr=0.5, callback=cb, **kw)
    sync(run.dev)
    wall = time.perf_counter() - t0
    run.res["otdd_flow"] = {"n": n, "steps": steps, "lr": 0.5, "history": hist, "time_s": wall}
    params = {"n": n, "m": n, "d": side * side, "steps": steps}
    run.row(
        "otdd_flow",
        "otdd_flow",
        "ours",
        params,
        1e3 * wall,
        accuracy={"first": hist[0][1], "last": hist[-1][1]},
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot([h[0] for h in hist], [h[1] for h in hist], "o-")
        ax.set_xlabel("gradient-flow step")
        ax.set_ylabel("debiased OTDD(D1(t), D2)")
        ax.set_title(f"OTDD gradient flow, n={n}/side, d={side * side} ({run.dev.type})")
        fig.tight_layout()
        fig.savefig(os.path.join(run.out, "flashsinkhorn-otdd-flow.png"), dpi=120)
        plt.close(fig)
    except Exception as e:  # noqa: BLE001
        run.res["otdd_flow"]["plot_error"] = repr(e)


# (name, function, time limit in seconds on the H200), most important first. The limits
# are estimates with headroom: compiles of the streaming kernels take a few seconds each.
CASES = [
    ("hvp", case_hvp, 45),
    ("hvp_tf32", case_hvp_tf32, 30),
    ("hvp_exact_loop", case_hvp_exact_loop, 30),
    ("hvp_peer", case_hvp_peer, 30),
    ("otdd", case_otdd, 45),
    ("newton_step", case_newton_step, 25),
    ("hvp_accuracy", case_hvp_accuracy, 25),
    ("newton", case_newton, 45),
    ("otdd_more", case_otdd_more, 35),
    ("otdd_flow", case_otdd_flow, 30),
]


def _alarm(signum, frame):
    raise CaseTimeout()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder (created)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU by default)")
    ap.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # old name
    ap.add_argument(
        "--cases",
        default=",".join(c[0] for c in CASES),
        help="comma-separated subset, run in the order given",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=105.0,
        help="start no case after this many seconds; each case also stops at "
        "its own limit or at budget + 10 s",
    )
    ap.add_argument(
        "--limit-scale",
        type=float,
        default=1.0,
        help="multiply every case's own time limit (cases that compile "
        "peers' kernels may need more than the defaults)",
    )
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    smoke = args.smoke or args.quick
    dev = torch.device(args.device or ("cpu" if smoke or not torch.cuda.is_available() else "cuda"))
    table = dict((c[0], c) for c in CASES)
    names = [s.strip() for s in args.cases.split(",") if s.strip()]
    bad = [s for s in names if s not in table]
    if bad:
        ap.error(f"unknown case(s) {bad}; choose from {list(table)}")
    run = Run(args.out, dev, SIZES["smoke" if smoke else "full"], args.budget)
    run.log(f"device {dev}, cases {names}, budget {args.budget:.0f} s")
    use_alarm = hasattr(signal, "setitimer")
    if use_alarm:
        signal.signal(signal.SIGALRM, _alarm)
    for name in names:
        _, fn, limit = table[name]
        left = args.budget - run.elapsed()
        if left <= 0:
            run.event(name, "skipped", reason=f"budget {args.budget:.0f} s spent")
            run.note(name, "skipped", f"budget {args.budget:.0f} s spent")
            run.log(f"{name}: skipped (budget spent)")
            continue
        # a case started near the end of the budget may run 10 s past it
        lim = min(limit * args.limit_scale, left + 10.0)
        run.log(f"{name}: start (limit {lim:.0f} s)")
        t0 = time.time()
        status = "ok"
        try:
            if use_alarm and not smoke:
                signal.setitimer(signal.ITIMER_REAL, lim)
            fn(run)
        except CaseTimeout:
            status = "timeout"
            run.res[f"{name}_error"] = f"stopped at its {lim:.0f} s limit"
        except Exception:  # noqa: BLE001 - recorded, and the next case runs
            status = "error"
            run.res[f"{name}_error"] = traceback.format_exc()
            print(run.res[f"{name}_error"], flush=True)
        finally:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
        wall = time.time() - t0
        run.res[f"{name}_wall_s"] = wall
        run.event(name, "case_end", status=status, wall_s=round(wall, 2))
        if status != "ok":
            run.note(name, status, f"after {wall:.1f} s")
        run.log(f"{name}: {status} in {wall:.1f} s")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    run.res["total_wall_s"] = run.elapsed()
    run.dump()
    run.log(f"done; results in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
