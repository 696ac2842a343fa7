"""GPU run of the second-order applications: HVP benchmark, OTDD at n = 60k, shuffled regression.

    python packages/flashsinkhorn/examples/gpu_second_order.py --out OUTDIR [--quick]

Writes into OUTDIR: ``bench-second-order.json`` (kernel-bench/1 rows: HVP ours vs
flash-sinkhorn 0.4.1, OTDD timings and peak memory), ``second-order.json`` (everything
measured, including the histories), ``flashsinkhorn-otdd-flow.png`` and
``flashsinkhorn-shuffled-regression-gpu.png`` when matplotlib is present, and prints a
markdown summary last. Every part is guarded: a failure is recorded, not fatal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from flashsinkhorn.second_order import bench_hvp, hvp, otdd  # noqa: E402
from flashsinkhorn.second_order.otdd import label_distances, otdd_gradient_flow  # noqa: E402

DEV = "cuda"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def mem_reset():
    if DEV != "cuda":
        return 0
    sync()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def mem_peak(base):
    if DEV != "cuda":
        return None
    sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def mnist_like(n, seed, device, shift=0.0, side=28):
    """Synthetic data of MNIST's shape: 10 classes of 28x28 images in [0, 1] (784 features).

    Each class is a random smooth template (sum of Gaussian strokes); samples are the
    template with random elastic-ish intensity noise, clipped to [0, 1]. ``shift`` moves
    the second dataset's templates (a domain shift).
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


def env_info():
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.UTC).isoformat()}  # fmt: skip
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


def part_hvp(res, rows, quick):
    sizes = [(20000, 64)] if not quick else [(400, 64)]
    for n, d in sizes:
        r = bench_hvp(n, d=d, eps=0.01, n_sinkhorn=100, reps=3, device=DEV)
        rows.extend(r)
    # accuracy at the benchmark size: ours (fp32, tf32x3) and flash-sinkhorn vs a float64
    # run of the same algorithm (torch backend, 100 alternating iterations, tight CG)
    from flashsinkhorn.second_order.bench import _problem

    n, d = sizes[0]
    x, y, v = _problem(n, n, d, DEV)
    t0 = time.time()
    ref = hvp(x.double(), y.double(), v.double(), eps=0.01, max_iter=100, backend="torch",
              cg_tol=1e-10)  # fmt: skip
    sync()
    acc = {"float64_ref_s": time.time() - t0}
    for prec in ("tf32x3", "tf32"):
        h, info = hvp(x, y, v, eps=0.01, max_iter=100, precision=prec, return_info=True)
        acc[f"rel_err_{prec}"] = float((h.double() - ref).norm() / ref.norm())
        acc[f"cg_iters_{prec}"] = info.cg[0].iterations
    try:
        import flash_sinkhorn as fs

        a = torch.full((n,), 1.0 / n, device=DEV)
        hfs, finfo = fs.hvp_x_sqeuclid(x, y, a, a, v, eps_list=[0.01] * 100)
        acc["rel_err_flash_sinkhorn"] = float((hfs.double() - ref).norm() / ref.norm())
        acc["flash_sinkhorn_cg_iters"] = finfo.cg_iters
    except Exception as e:  # noqa: BLE001
        acc["flash_sinkhorn_error"] = repr(e)
    res["hvp_accuracy"] = acc


def part_otdd(res, rows, quick, out):
    n = 60000 if not quick else 400
    eps = 5.0
    sched = [400.0, 160.0, 64.0, 25.6, 10.24]
    kw = dict(eps=eps, eps_schedule=sched, max_iter=15, tol=None, label_distance="gaussian")
    side = 28 if not quick else 8
    x1, l1 = mnist_like(n, 1, DEV, side=side)
    x2, l2 = mnist_like(n, 2, DEV, shift=1.5, side=side)
    base = mem_reset()
    t0 = time.time()
    r12 = otdd(x1, l1, x2, l2, **kw)
    sync()
    t12 = time.time() - t0
    peak = mem_peak(base)
    W = r12.label_distances
    t0 = time.time()
    r21 = otdd(x2, l2, x1, l1, **kw)
    sync()
    t21 = time.time() - t0
    t0 = time.time()
    r11 = otdd(x1, l1, x1, l1, **kw)
    sync()
    t11 = time.time() - t0
    t0 = time.time()
    label_distances(x1, l1, x2, l2, eps=eps, method="gaussian")
    sync()
    tw = time.time() - t0
    res["otdd"] = {
        "n": n, "d": side * side, "eps": eps, "eps_schedule": sched, "iters_at_eps": 15,
        "label_distance": "gaussian", "otdd_12": r12.value, "otdd_21": r21.value,
        "otdd_11": r11.value, "terms_12": r12.terms, "time_s_12": t12, "time_s_21": t21,
        "time_s_11": t11, "time_s_label_table": tw,
        "peak_extra_mib_12": peak, "inputs_mib": 2 * n * 784 * 4 / 2**20,
        "label_table_diag_mean": float(W.diag().mean()),
        "label_table_offdiag_mean": float((W.sum() - W.diag().sum()) / (W.numel() - len(W))),
    }  # fmt: skip
    rows.append({
        "bench": "otdd", "provider": "ours", "mode": "fwd",
        "params": {"n": n, "m": n, "d": side * side, "eps": eps, "dtype": "float32"},
        "status": "ok", "time_ms": 1e3 * t12, "time_ms_p20": None, "time_ms_p80": None,
        "metrics": {"peak_mem_mib": peak}, "accuracy": {"asym_abs": abs(r12.value - r21.value)},
        "error": None,
    })  # fmt: skip
    del x1, x2
    if DEV == "cuda":
        torch.cuda.empty_cache()
    # gradient flow of D1 toward D2 (smaller n: every step solves three problems)
    nf = 10000 if not quick else 300
    y1, k1 = mnist_like(nf, 3, DEV, side=side)
    y2, k2 = mnist_like(nf, 4, DEV, shift=1.5, side=side)
    t0 = time.time()
    _, hist = otdd_gradient_flow(y1, k1, y2, k2, eps=eps, steps=6, lr=0.5,
                                 eps_schedule=sched, max_iter=15, tol=None)  # fmt: skip
    sync()
    res["otdd_flow"] = {"n": nf, "steps": 6, "lr": 0.5, "history": hist,
                        "time_s": time.time() - t0}  # fmt: skip
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot([h[0] for h in hist], [h[1] for h in hist], "o-")
        ax.set_xlabel("gradient-flow step")
        ax.set_ylabel("debiased OTDD(D1(t), D2)")
        ax.set_title(f"OTDD gradient flow, n={nf}/side, d={side * side} ({DEV})")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "flashsinkhorn-otdd-flow.png"), dpi=120)
    except Exception as e:  # noqa: BLE001
        res["otdd_flow"]["plot_error"] = repr(e)


def part_shuffled(res, quick, out):
    from flashsinkhorn.second_order.shuffled_regression import shuffled_regression

    n = 4000 if not quick else 100
    t0 = time.time()
    r = shuffled_regression(n=n, p=3, q=2, eps=0.2, seed=1, device=DEV, dtype=torch.float32,
                            sinkhorn_iter=300, sinkhorn_tol=1e-5, cg_tol=1e-5, gtol=1e-5,
                            max_adam=150, newton_iters=10)  # fmt: skip
    sync()
    res["shuffled_regression"] = {
        "n": n, "time_s": time.time() - t0, "rel_pred_error": r["rel_pred_error"],
        "switch_iter": r["switch_iter"], "loss_at_truth": r["loss_at_truth"],
        "final_loss": r["newton"].fun, "final_grad_norm": r["newton"].grad_norm,
        "history": r["history"],
    }  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="hvp,otdd,shuffled")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    os.makedirs(args.out, exist_ok=True)
    res = {"env": env_info()}
    rows = []
    T0 = time.time()
    for name in args.parts.split(","):
        t0 = time.time()
        try:
            if name == "hvp":
                part_hvp(res, rows, args.quick)
            elif name == "otdd":
                part_otdd(res, rows, args.quick, args.out)
            elif name == "shuffled":
                part_shuffled(res, args.quick, args.out)
        except Exception:  # noqa: BLE001
            res[f"{name}_error"] = traceback.format_exc()
            print(res[f"{name}_error"], flush=True)
        res[f"{name}_wall_s"] = time.time() - t0
        print(f"part {name}: {time.time() - t0:.1f} s", flush=True)
    res["total_wall_s"] = time.time() - T0
    bench = {
        "schema": "kernel-bench/1", "package": "flashsinkhorn", "package_version": "0.1.0",
        "command": "python packages/flashsinkhorn/examples/gpu_second_order.py --out OUT",
        "env": res["env"], "results": rows,
    }  # fmt: skip
    with open(os.path.join(args.out, "bench-second-order.json"), "w") as fh:
        json.dump(bench, fh, indent=1, default=str)
    with open(os.path.join(args.out, "second-order.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print("\n| bench | provider | params | time ms | metrics |\n|---|---|---|---|---|")
    for r in rows:
        t = r["time_ms"]
        ts = f"{t:.1f}" if isinstance(t, (int, float)) else str(r["status"])
        p = {k: r["params"][k] for k in ("n", "d") if k in r["params"]}
        m = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r["metrics"].items()}
        print(f"| {r['bench']} | {r['provider']} | {p} | {ts} | {m} {r['accuracy']} |")
    short = {k: v for k, v in res.items() if k not in ("otdd_flow", "shuffled_regression")}
    print(json.dumps(short, indent=1, default=str)[:4000])
    for k in ("otdd_flow", "shuffled_regression"):
        if k in res:
            d = {kk: vv for kk, vv in res[k].items() if kk != "history"}
            print(k, json.dumps(d, default=str))


if __name__ == "__main__":
    main()
