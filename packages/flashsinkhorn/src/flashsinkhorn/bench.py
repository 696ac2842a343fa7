"""flashsinkhorn-bench: timings against flash-sinkhorn and GeomLoss (kernel-bench/1 JSON).

    python -m flashsinkhorn.bench                 # CUDA: the standard GPU suite (~2 min)
    python -m flashsinkhorn.bench --smoke         # tiny CPU run (CI)
    python -m flashsinkhorn.bench --n 20000 --d 64 128 --mode fwd fwd_bwd iter
    python -m flashsinkhorn.bench --json out.json --providers ours geomloss
    python -m flashsinkhorn.bench --only iter:1024,large --budget 80 --json rest.json

Providers: ``ours`` (``ours-bf16``: bf16 operands), ``flash-sinkhorn`` 0.4.x, ``geomloss``
(tensorized backend); peers that are not importable are recorded as skipped. Benches
(``bench`` field):

- ``sinkhorn_iteration`` (``--mode iter``): one symmetric fixed-eps iteration (both
  potentials), C = |x - y|^2, eps = 0.01, measured as ``(t(6 iterations) - t(2
  iterations)) / 4`` for every provider (flash-sinkhorn's fixed-iteration setting);
- ``samples_loss`` (``--mode fwd fwd_bwd``): GeomLoss's SamplesLoss(p=2, blur, scaling)
  schedule; ``params.debias`` and ``params.batch`` tell the variants apart; on 10k points
  also the relative error of the value against the float64 reference;
- ``hvp`` (``--mode hvp``): ``flashsinkhorn.second_order.hvp`` with its defaults (100 Sinkhorn
  iterations at eps = 0.01, then CG), flash-sinkhorn's ``hvp_x_sqeuclid`` when asked for
  (its first call autotunes for minutes: not in the default suite);
- ``softmin_pass`` (``--only passes``): one pass of each kernel (shift, running max, bf16
  operands, with V, the symmetric self kernel);
- ``plan_sample`` (``--mode sample``): ``sample_plan`` (the Gumbel-max pass, one target per
  source point) from the potentials of a converged solve at eps = 0.01, and one fixed-eps
  Sinkhorn iteration of the same problem as ``ours-sinkhorn-iteration`` (the reference:
  ``ratio_to_one_iteration``).

Points: x, y uniform in ``[0, 1/sqrt(d)]^d``, y shifted by ``0.5/sqrt(d)`` per coordinate.
Columns: median time, fraction of the floor (exp count at 4.2e12 exp/s against the dot's
FLOPs at 433 (tf32) / 792 (bf16) TFLOP/s, whichever is larger), peak extra memory, the
accuracy where a float64 reference is computed. Rows whose ``ours`` carries a ``headline``
label make the package's headline table (tools/report.py).
"""

from __future__ import annotations

import math
import time

import torch

import flashsinkhorn as fs
from flashsinkhorn import _harness as H
from flashsinkhorn import _loop
from flashsinkhorn.operands import centered_sqnorm, common_center, kernel_operands
from flashsinkhorn.reference import eps_schedule, max_diameter
from flashsinkhorn.streaming import StreamingProblem

PROVIDERS = ["ours", "flash-sinkhorn", "geomloss"]
MODES = ["fwd", "fwd_bwd", "iter", "hvp", "sample"]
EXP_RATE = 4.2e12  # exp/s, H200 special-function units
DOT_RATE = {"tf32": 433e12, "bf16": 792e12, "ieee": 60e12, "tf32x3": 144e12}
TENSORIZED_LIMIT = 40 * 2**30  # skip geomloss tensorized above this memory estimate
ACCURACY_KEY = "rel_err_vs_f64"

# The standard GPU suite, most important first: (kind, n, d, headline label or None). A
# case that would start after --budget seconds is recorded as skipped.
SUITE = [
    ("iter", 50000, 64, "Sinkhorn iteration 50k, d=64"),
    ("loss", 50000, 64, "SamplesLoss 50k, d=64"),
    ("loss_debias", 50000, 64, "SamplesLoss debias 50k, d=64"),
    ("iter", 50000, 512, "Sinkhorn iteration 50k, d=512"),
    ("loss", 50000, 512, "SamplesLoss 50k, d=512"),
    ("loss_batched", 2048, 64, "64 problems of 2048, d=64"),
    ("iter", 50000, 1024, "Sinkhorn iteration 50k, d=1024"),
    ("loss_ref", 10000, 64, "SamplesLoss 10k, d=64 vs float64"),
    ("hvp", 20000, 64, "HVP 20k, d=64"),
    ("sample", 50000, 64, "plan sampling 50k, d=64"),
]
# cases only on request (--only): more sizes and the kernel-level passes
EXTRA = [
    ("large", 200000, 64, None),
    ("loss", 50000, 1024, None),
    ("loss_ref", 10000, 512, None),
    ("passes", 50000, 64, None),
    ("passes", 50000, 512, None),
]
KINDS = (
    "iter",
    "loss",
    "loss_debias",
    "loss_batched",
    "loss_ref",
    "large",
    "hvp",
    "passes",
    "sample",
)


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------


def _problem(n, m, d, device, batch=None, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    sh = () if batch is None else (batch,)
    s = 1.0 / math.sqrt(d)
    x = (torch.rand(*sh, n, d, generator=gen) * s).to(device)
    y = (torch.rand(*sh, m, d, generator=gen) * s + 0.5 * s).to(device)
    return x, y


def hvp_problem(n, m, d, device, seed=0):
    """The HVP case's clouds (y shifted by 0.1/sqrt(d)) and direction v (n, d)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.rand(n, d, generator=g) / math.sqrt(d)
    y = torch.rand(m, d, generator=g) / math.sqrt(d) + 0.1 / math.sqrt(d)
    v = torch.randn(n, d, generator=g)
    return x.to(device), y.to(device), v.to(device)


def _pass_floor_ms(n, m, d, precision, batch=1):
    """One softmin pass (n x m scores): max(exp time, dot time), in ms."""
    scores = batch * n * m
    return 1e3 * max(scores / EXP_RATE, scores * 2 * d / DOT_RATE.get(precision, DOT_RATE["tf32"]))


def _peers(providers):
    out = {}
    if "geomloss" in providers:
        try:
            import geomloss

            out["geomloss"] = geomloss
        except ImportError:
            pass
    if "flash-sinkhorn" in providers:
        try:
            import flash_sinkhorn

            out["flash-sinkhorn"] = flash_sinkhorn
        except ImportError:
            pass
    return out


def _skip_missing(R, bench, mode, params, provider, peers, device):
    """Record a peer that cannot run here as skipped; True when it was."""
    if provider == "ours":
        return False
    if provider not in peers:
        R.add(bench, provider, mode, params, status="skipped", error="not importable")
        return True
    if provider == "flash-sinkhorn" and device.type != "cuda":
        R.add(bench, provider, mode, params, status="skipped", error="needs CUDA")
        return True
    return False


# ----------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------


def _ours_iterations(x, y, eps, k, precision):
    """k symmetric fixed-eps iterations (C = |x - y|^2) as solve's loop runs them."""
    if x.dim() == 2:
        x, y = x[None], y[None]
    B, N, _ = x.shape
    M = y.shape[1]
    a = torch.full((B, N), 1.0 / N, device=x.device)
    b = torch.full((B, M), 1.0 / M, device=x.device)
    c = common_center(x, y)
    prob = StreamingProblem(
        X=x,
        Y=y,
        a=a,
        b=b,
        cx=centered_sqnorm(x, c),
        cy=centered_sqnorm(y, c),
        c2=2.0,
        precision=precision,
        center=c,
    )
    sched = _loop.Schedule(eps=eps, max_iter=k, update="symmetric")
    out = _loop.run(prob, sched)
    return out.f, out.g


def case_iteration(
    R,
    n,
    d,
    device,
    providers,
    peers,
    warmup,
    reps,
    headline=None,
    precisions=("tf32", "bf16"),
    k1=2,
    k2=6,
):
    eps = 0.01
    x, y = _problem(n, n, d, device)
    params = {"n": n, "m": n, "d": d, "eps": eps, "dtype": "float32"}
    cases = [("ours", p) for p in precisions if "ours" in providers]
    cases += [("flash-sinkhorn", "tf32")] if "flash-sinkhorn" in providers else []
    for prov, prec in cases:
        label = prov if (prov != "ours" or prec == "tf32") else f"ours-{prec}"
        if _skip_missing(R, "sinkhorn_iteration", "fwd", params, prov, peers, device):
            continue
        if prov == "ours":

            def make(k, prec=prec):
                return lambda: _ours_iterations(x, y, eps, k, prec)

        else:
            FS = peers["flash-sinkhorn"].SamplesLoss
            a = torch.full((n,), 1.0 / n, device=device)

            def make(k, FS=FS, a=a):
                L = FS(
                    "sinkhorn",
                    use_epsilon_scaling=False,
                    eps=eps,
                    n_iters=k,
                    debias=False,
                    potentials=False,
                    normalize=False,
                    last_extrapolation=False,
                    allow_tf32=True,
                    half_cost=False,
                )
                return lambda: L(a, x, a, y)

        try:
            t1 = H.time_fn(make(k1), device, warmup=warmup, reps=reps)
            t2 = H.time_fn(make(k2), device, warmup=warmup, reps=reps)
        except Exception as e:  # a failing peer must not end the suite
            R.add(
                "sinkhorn_iteration",
                label,
                "fwd",
                params,
                status="error",
                error=f"{type(e).__name__}: {e}"[:500],
            )
            continue
        timing = {k: (t2[k] - t1[k]) / (k2 - k1) for k in ("time_ms", "time_ms_p20", "time_ms_p80")}
        timing["peak_mem_mib"] = t2["peak_mem_mib"]
        floor = _pass_floor_ms(n, n, d, prec)  # one pass serves both potentials
        per = timing["time_ms"]
        R.add(
            "sinkhorn_iteration",
            label,
            "fwd",
            params,
            timing=timing,
            metrics={
                "floor_ms": floor,
                "frac_floor": floor / per if per > 0 else None,
                f"time_ms_{k2}_iters": t2["time_ms"],
            },
            headline=headline if label == "ours" else None,
        )


def _samples_loss_passes(x, y, blur, scaling, debias):
    n_eps = len(eps_schedule(max_diameter(x, y) ** 2, blur**2, scaling))
    # the start and the loop: one pass each for both potentials; the final extrapolation:
    # one pass per side
    passes = n_eps + 1 + 2
    return passes * (2 if debias else 1)


def case_samples_loss(
    R,
    n,
    d,
    device,
    providers,
    peers,
    modes,
    warmup,
    reps,
    *,
    batch=None,
    debias=False,
    blur=0.05,
    scaling=0.5,
    precisions=("tf32",),
    reference=False,
    headline=None,
):
    x, y = _problem(n, n, d, device, batch=batch)
    params = {
        "n": n,
        "m": n,
        "d": d,
        "blur": blur,
        "scaling": scaling,
        "debias": debias,
        "batch": batch or 1,
        "dtype": "float32",
    }
    passes = _samples_loss_passes(x, y, blur, scaling, debias)
    ref = None
    if reference and batch is None:
        with torch.no_grad():
            w = torch.full((n,), 1.0 / n, device=device, dtype=torch.float64)
            ref = float(
                fs.samples_loss_ref(
                    w, x.double(), w, y.double(), blur=blur, scaling=scaling, debias=debias
                )
            )
    cases = [("ours", p) for p in precisions if "ours" in providers]
    cases += [(p, "tf32") for p in PROVIDERS[1:] if p in providers]
    for mode in modes:
        for prov, prec in cases:
            label = prov if (prov != "ours" or prec == "tf32") else f"ours-{prec}"
            if _skip_missing(R, "samples_loss", mode, params, prov, peers, device):
                continue
            if prov == "geomloss":
                est = (8 if debias else 4) * n * n * 4 * (batch or 1)
                if device.type == "cuda" and est > TENSORIZED_LIMIT:
                    R.add(
                        "samples_loss",
                        prov,
                        mode,
                        params,
                        status="skipped",
                        error=f"tensorized needs ~{est / 2**30:.0f} GiB",
                    )
                    continue
                L = peers["geomloss"].SamplesLoss(
                    "sinkhorn", p=2, blur=blur, scaling=scaling, debias=debias, backend="tensorized"
                )
            elif prov == "flash-sinkhorn":
                L = peers["flash-sinkhorn"].SamplesLoss(
                    "sinkhorn",
                    p=2,
                    blur=blur,
                    scaling=scaling,
                    debias=debias,
                    half_cost=True,
                    allow_tf32=True,
                )
                if batch is not None:  # flash-sinkhorn has no batch dimension: a loop
                    L0 = L

                    def L(xx, yy, L0=L0):
                        return torch.stack([L0(xx[i], yy[i]) for i in range(xx.shape[0])])

            else:
                L = fs.SamplesLoss(blur=blur, scaling=scaling, debias=debias, precision=prec)

            def make(L=L, mode=mode):
                if mode == "fwd":

                    def fn():
                        with torch.no_grad():
                            return L(x, y)

                    return fn

                def fn_bwd():
                    xx, yy = x.detach().requires_grad_(), y.detach().requires_grad_()
                    v = L(xx, yy)
                    v.sum().backward()
                    return v

                return fn_bwd

            def accuracy(L=L):
                if ref is None:
                    return {}
                with torch.no_grad():
                    val = float(L(x, y))
                return {
                    ACCURACY_KEY: abs(val - ref) / max(abs(ref), 1e-30),
                    "abs_err_vs_f64": abs(val - ref),
                    "value": val,
                }

            floor = passes * _pass_floor_ms(n, n, d, prec if prov == "ours" else "tf32", batch or 1)
            R.run(
                "samples_loss",
                label,
                mode,
                params,
                make,
                warmup=warmup,
                reps=reps,
                floor_ms=floor,
                accuracy=accuracy,
                headline=headline if label == "ours" else None,
            )


def case_hvp(R, n, d, device, providers, peers, warmup, reps, headline=None):
    """``flashsinkhorn.second_order.hvp`` with its defaults (100 iterations, loop_precision
    "auto")."""
    eps, n_sinkhorn = 0.01, 100
    x, y, v = hvp_problem(n, n, d, device)
    params = {"n": n, "m": n, "d": d, "eps": eps, "sinkhorn_iters": n_sinkhorn, "dtype": "float32"}
    info = {}

    def make_ours():
        def fn():
            h, i = fs.second_order.hvp(x, y, v, eps=eps, max_iter=n_sinkhorn, return_info=True)
            info["cg_iters"] = sum(c.iterations for c in i.cg)
            return h

        return fn

    if "ours" in providers:
        R.run(
            "hvp",
            "ours",
            "hvp",
            params,
            make_ours,
            warmup=warmup,
            reps=reps,
            metrics=lambda: {"cg_iters": info.get("cg_iters")},
            headline=headline,
        )
    if "flash-sinkhorn" in providers:
        if _skip_missing(R, "hvp", "hvp", params, "flash-sinkhorn", peers, device):
            return
        a = torch.full((n,), 1.0 / n, device=device)

        def make_peer():
            fsk = peers["flash-sinkhorn"]
            return lambda: fsk.hvp_x_sqeuclid(x, y, a, a, v, eps_list=[eps] * n_sinkhorn)

        R.run("hvp", "flash-sinkhorn", "hvp", params, make_peer, warmup=warmup, reps=reps)


def case_sample(R, n, d, device, warmup, reps, headline=None, k1=2, k2=6):
    """``sample_plan`` from converged potentials (eps = 0.01) against one fixed-eps
    iteration of the same problem (measured as in ``case_iteration``)."""
    eps = 0.01
    x, y = _problem(n, n, d, device)
    params = {"n": n, "m": n, "d": d, "eps": eps, "dtype": "float32"}
    try:
        r = fs.solve(x, y, eps=eps, tol=1e-3, max_iter=2000, warn=False)
        t1 = H.time_fn(
            lambda: _ours_iterations(x, y, eps, k1, "tf32"), device, warmup=warmup, reps=reps
        )
        t2 = H.time_fn(
            lambda: _ours_iterations(x, y, eps, k2, "tf32"), device, warmup=warmup, reps=reps
        )
        it = {k: (t2[k] - t1[k]) / (k2 - k1) for k in ("time_ms", "time_ms_p20", "time_ms_p80")}
        seed = iter(range(1 << 30))  # a new seed per call: nothing cached between draws
        ts = H.time_fn(lambda: fs.sample_plan(r, seed=next(seed)), device, warmup=warmup, reps=reps)
    except Exception as e:  # a failing case must not end the suite
        R.add(
            "plan_sample",
            "ours",
            "sample",
            params,
            status="error",
            error=f"{type(e).__name__}: {e}"[:500],
        )
        return
    R.add("plan_sample", "ours-sinkhorn-iteration", "sample", params, timing=it)
    per = it["time_ms"]
    R.add(
        "plan_sample",
        "ours",
        "sample",
        params,
        timing=ts,
        headline=headline,
        metrics={
            "ratio_to_one_iteration": ts["time_ms"] / per if per > 0 else None,
            "solve_iterations": r.n_iter,
            "floor_ms": _pass_floor_ms(n, n, d, "tf32"),
        },
    )


def case_passes(R, n, d, device, warmup, reps):
    """Kernel-level rows: one pass (n x n scores) of each kernel, operands prepared as the
    solvers prepare them."""
    x, y = _problem(n, n, d, device)
    x, y = x[None], y[None]
    eps = 0.01
    c = common_center(x, y)
    cx, cy = centered_sqnorm(x, c), centered_sqnorm(y, c)
    g = torch.zeros(1, n, device=device)
    logb = torch.full((1, n), -math.log(n), device=device)
    params = {"n": n, "m": n, "d": d, "eps": eps, "dtype": "float32"}
    xk, yk = kernel_operands(x, y, c, "tf32", "auto")
    xb, yb = kernel_operands(x, y, c, "bf16", "auto")
    guess = fs.softmin(xk, yk, g, logb, cx, cy, eps=eps, c2=2.0)[0]
    sm = dict(eps=eps, c2=2.0)
    passes = {
        "ours": lambda: fs.softmin(xk, yk, g, logb, cx, cy, guess=guess, **sm),
        "ours-running-max": lambda: fs.softmin(xk, yk, g, logb, cx, cy, **sm),
        "ours-bf16": lambda: fs.softmin(
            xb, yb, g, logb, cx, cy, guess=guess, precision="bf16", **sm
        ),
        "ours-with-V": lambda: fs.softmin(xk, yk, g, logb, cx, cy, v=y, **sm),
        "ours-self-plain": lambda: fs.softmin(xk, xk, g, logb, cx, cx, guess=guess, **sm),
        "ours-self-symmetric": lambda: fs.self_softmin(
            xk, logb, g, cx, eps=eps, c2=2.0, check=False
        ),
    }
    for name, fn in passes.items():
        floor = _pass_floor_ms(n, n, d, "bf16" if "bf16" in name else "tf32")
        R.run(
            "softmin_pass",
            name,
            "fwd",
            params,
            lambda fn=fn: fn,
            warmup=warmup,
            reps=reps,
            floor_ms=floor,
        )


def run_case(R, case, device, providers, peers, modes, warmup, reps):
    kind, n, d, headline = case
    P, w = providers, warmup
    loss_modes = [m for m in modes if m in ("fwd", "fwd_bwd")]
    if kind == "iter" and "iter" in modes:
        precisions = ("tf32", "bf16") if d <= 128 else ("tf32",)
        case_iteration(R, n, d, device, P, peers, w or 1, reps or 2, headline, precisions)
    elif kind == "loss":
        case_samples_loss(
            R, n, d, device, P, peers, loss_modes, w or 1, reps or 2, headline=headline
        )
    elif kind == "loss_debias":
        case_samples_loss(
            R, n, d, device, P, peers, loss_modes, w or 1, reps or 2, debias=True, headline=headline
        )
    elif kind == "loss_batched":
        case_samples_loss(
            R, n, d, device, P, peers, loss_modes, w or 1, reps or 3, batch=64, headline=headline
        )
    elif kind == "loss_ref":
        case_samples_loss(
            R,
            n,
            d,
            device,
            P,
            peers,
            loss_modes[:1],
            w or 1,
            reps or 3,
            reference=True,
            headline=headline,
        )
    elif kind == "large":  # one warm-up call: the timed call must not include autotuning
        case_samples_loss(R, n, d, device, P & {"ours"}, peers, ["fwd_bwd"], w or 1, reps or 1)
    elif kind == "hvp" and "hvp" in modes:
        case_hvp(
            R,
            n,
            d,
            device,
            P - {"flash-sinkhorn"} if headline else P,
            peers,
            w or 1,
            reps or 3,
            headline,
        )
    elif kind == "passes":
        case_passes(R, n, d, device, w or 2, reps or 5)
    elif kind == "sample" and "sample" in modes:
        case_sample(R, n, d, device, w or 1, reps or 5, headline)


def select_cases(only: str | None):
    """The suite cases to run: the standard suite, or those named by ``--only`` (comma-
    separated ``KIND``, ``KIND:D`` or ``KIND:N:D``), in the order given."""
    if not only:
        return list(SUITE)
    picked = []
    for spec in only.split(","):
        parts = spec.strip().split(":")
        if parts[0] not in KINDS or len(parts) > 3:
            raise ValueError(
                f"--only: unknown case {spec!r}; KIND[:D] or KIND:N:D with KIND "
                f"one of {', '.join(KINDS)}"
            )
        try:
            nums = [int(v) for v in parts[1:]]
        except ValueError:
            raise ValueError(f"--only: N and D must be integers; got {spec!r}") from None
        n, d = ([None, None] + nums)[-2:]  # KIND:D gives D, KIND:N:D both
        matches = [
            c for c in SUITE + EXTRA if c[0] == parts[0] and n in (None, c[1]) and d in (None, c[2])
        ]
        if not matches and d is not None:  # a size outside the list: run it as asked
            matches = [(parts[0], n or (10000 if parts[0] == "loss_ref" else 50000), d, None)]
        picked += [c for c in matches if c not in picked]
    return picked


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------


def main(argv=None):
    ap = H.parser("flashsinkhorn-bench", __doc__.split("\n")[0], PROVIDERS, MODES)
    ap.add_argument("--n", nargs="+", type=int, help="cloud sizes n = m (custom run)")
    ap.add_argument("--d", nargs="+", type=int, help="dimensions (custom run)")
    ap.add_argument("--batch", type=int, default=None, help="batch of problems (samples_loss)")
    ap.add_argument("--blur", type=float, default=0.05)
    ap.add_argument("--scaling", type=float, default=0.5)
    ap.add_argument("--debias", action="store_true")
    ap.add_argument("--precision", nargs="+", default=["tf32"], help="tf32 ieee tf32x3 bf16")
    ap.add_argument(
        "--only",
        metavar="CASE[,CASE]",
        help="GPU suite: run only these cases, KIND, KIND:D or KIND:N:D (KIND: "
        + " ".join(KINDS)
        + "), e.g. iter:1024,large",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=100.0,
        help="GPU suite: start no case after this many seconds (default 100)",
    )
    args = ap.parse_args(argv)

    device = H.device_of(args)
    providers = set(args.providers)
    peers = _peers(providers)
    R = H.Results("flashsinkhorn", fs.__version__, device, peers=["flash-sinkhorn", "geomloss"])
    R.save(args.json)
    modes = list(args.mode)
    custom = args.n is not None or args.d is not None
    t0 = time.time()
    if args.smoke or (device.type != "cuda" and not custom):  # tiny CPU run
        reps = args.reps or 3
        for d in args.d or [3]:
            case_samples_loss(
                R,
                (args.n or [200])[0],
                d,
                device,
                providers,
                peers,
                [m for m in modes if m in ("fwd", "fwd_bwd")],
                1,
                reps,
                reference=True,
                blur=0.1,
            )
        if "iter" in modes:
            case_iteration(
                R, 256, 8, device, providers & {"ours"}, peers, 1, reps, precisions=("tf32",)
            )
        if "sample" in modes and "ours" in providers:
            case_sample(R, 256, 8, device, 1, reps)
    elif custom:
        reps, w = args.reps or 5, args.warmup or 1
        for n in args.n or [10000]:
            for d in args.d or [64]:
                if "iter" in modes:
                    case_iteration(
                        R, n, d, device, providers, peers, w, reps, precisions=tuple(args.precision)
                    )
                lm = [m for m in modes if m in ("fwd", "fwd_bwd")]
                if lm:
                    case_samples_loss(
                        R,
                        n,
                        d,
                        device,
                        providers,
                        peers,
                        lm,
                        w,
                        reps,
                        batch=args.batch,
                        debias=args.debias,
                        blur=args.blur,
                        scaling=args.scaling,
                        precisions=tuple(args.precision),
                        reference=n <= 10000 and args.batch is None,
                    )
                if "hvp" in modes:
                    case_hvp(R, n, d, device, providers, peers, w, args.reps or 3)
    else:
        try:
            suite = select_cases(args.only)
        except ValueError as e:
            ap.error(str(e))
        for case in suite:
            kind, n, d, _ = case
            if time.time() - t0 > args.budget:
                R.add(
                    f"suite:{kind}",
                    "ours",
                    "-",
                    {"n": n, "m": n, "d": d},
                    status="skipped",
                    error=f"suite time budget {args.budget:.0f} s",
                )
                continue
            print(f"[bench {time.time() - t0:6.1f} s] {kind} n={n} d={d}", flush=True)
            run_case(R, case, device, providers, peers, modes, args.warmup, args.reps)
    print(H.markdown(R.rows, accuracy_key=ACCURACY_KEY))
    print(f"\n(total {time.time() - t0:.1f} s on {device})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
