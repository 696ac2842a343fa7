"""The GPU run of issue #31 (FlashMuon): tests, Newton-Schulz speed and orthogonality,
whole steps against torch.optim.Muon, and training parity. Stages run in the order given,
each under its own time limit (``LIMITS``); JSON and a short table under OUT. Calls of at
most ~4 minutes each on an H100 (a stage cut by its limit still reports what finished):

    # 1. kernels (~3.5 min): the GPU tests and the whole step vs torch.optim.Muon
    PYTHONPATH=packages/flashoptim/src python3 tools/flashoptim/muon_gpu.py --out $OUT \
        --stages tests,step
    # 2. Newton-Schulz speed and orthogonality (~3.5 min)
    PYTHONPATH=packages/flashoptim/src python3 tools/flashoptim/muon_gpu.py --out $OUT \
        --stages ns
    # 3. parity (~4 min): 25.6M GPT, 600 steps, 3 seeds side by side
    PYTHONPATH=packages/flashoptim/src python3 tools/flashoptim/muon_gpu.py --out $OUT \
        --stages parity
    # 4. optional (~4 min each): the 127M GPT (1,000 steps; cut at the limit), the storages
    PYTHONPATH=packages/flashoptim/src python3 tools/flashoptim/muon_gpu.py --out $OUT \
        --stages parity_large
    PYTHONPATH=packages/flashoptim/src python3 tools/flashoptim/muon_gpu.py --out $OUT \
        --stages search

Stages:

* ``tests``: the @gpu tests of test_gram_kernel.py and test_muon.py.
* ``ns``: Newton-Schulz at 8 x 8192^2 and 24 x 4096^2 bf16 with four Gram products:
  ``torch`` (torch.optim.Muon's matmuls), ``triton`` (the package's symmetric kernel
  through TMA descriptors, the default on CUDA), ``triton_ptr`` (the same tiles by
  pointers, cp.async), ``blocks`` (cuBLAS on the upper block rows, mirrored by a copy: the
  contender a kernel must beat); each one's whole iteration and its three products alone
  (the first autotunes the kernels: a minute of compiles); the orthogonality error of each
  against the float64 polar factor on a Gaussian 4096^2, a low-rank-plus-noise 4096^2 and
  an ill-conditioned 2048^2 matrix.
* ``step``: one optimizer step at the same two layouts: FlashMuon (default), FlashMuon with
  torch's Gram products, torch.optim.Muon on bf16 and on fp32 parameters.
* ``parity``: ``python -m flashoptim_fused.parity --optimizers torch_muon,flash_muon``,
  25.6M GPT, 600 steps, seeds 0, 1, 2 as three processes side by side; verdict: FlashMuon's
  mean validation loss inside torch.optim.Muon's seed range.
* ``parity_large``: the same at the ``gpt2s`` size (127M parameters: d 768, 18 layers,
  1,000 steps of 16 x 512 bytes).
* ``search``: the momentum storages of issue #31 at the 25.6M size on torch.optim.Muon's
  own buffer (the storage alone): none, the #24 codes, rank 4 (P from the step's
  direction, as shipped) + nearest codes; 3 seeds side by side.

``--dry-run``: every stage's code on the CPU at toy sizes (Triton's interpreter), a minute.
Writes OUT/muon-gpu.json (every number) and OUT/summary.md (the tables, printed last).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import flashoptim_fused as fo
from flashoptim_fused import _gram_kernel, muon
from flashoptim_fused import _harness as H
from flashoptim_fused._gram_kernel import gram, gram_ptr
from flashoptim_fused.muon import gram_torch, newton_schulz
from flashoptim_fused.parity import PAIRS, summarize
from flashoptim_fused.reference import NS_COEFFICIENTS

LAYOUTS = {"8x8192^2": (8, 8192, 8192), "24x4096^2": (24, 4096, 4096)}
# --dry-run: the same code on the CPU at toy sizes (Triton's interpreter), seconds
DRY = {"layouts": {"2x16^2": (2, 16, 16)}, "big": 24, "small": 16, "reps": (0, 1)}
SIZES = {"layouts": LAYOUTS, "big": 4096, "small": 2048, "reps": (2, 5)}
LIMITS = {"tests": 120, "ns": 200, "step": 90, "parity": 225, "parity_large": 225, "search": 225}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gram_blocks(y, alpha=1.0, z=None, beta=0.0, blocks=4):
    """The contender: ``alpha y y^T + beta z`` from cuBLAS products of the upper block rows
    (block row i against rows i.. : (blocks + 1) / (2 blocks) of the FLOPs), the strictly
    lower part copied from the upper one."""
    y3 = y if y.ndim == 3 else y.unsqueeze(0)
    k, m, _ = y3.shape
    out = torch.empty(k, m, m, dtype=y.dtype, device=y.device)
    z3 = None if z is None else (z if z.ndim == 3 else z.unsqueeze(0))
    step = -(-m // blocks)
    for r0 in range(0, m, step):
        r1 = min(m, r0 + step)
        dst = out[:, r0:r1, r0:]
        rows, cols = y3[:, r0:r1], y3[:, r0:].mT
        if z3 is None:
            torch.bmm(rows, cols, out=dst)
            if alpha != 1.0:
                dst.mul_(alpha)
        else:
            torch.baddbmm(z3[:, r0:r1, r0:], rows, cols, beta=beta, alpha=alpha, out=dst)
        if r1 < m:
            out[:, r1:, r0:r1].copy_(out[:, r0:r1, r1:].mT)
    return out if y.ndim == 3 else out[0]


GRAMS = {"torch": gram_torch, "triton": gram, "triton_ptr": gram_ptr, "blocks": gram_blocks}


def _polar(x):
    """float64 polar factor of ``x`` on its range, ``(x x^T)^(-1/2) x`` (wide; tall by the
    transpose) from ``eigh`` of the smaller Gram matrix (cuSOLVER's SVD of a 4096^2 float64
    matrix takes far longer); eigenvalues below 1e-20 of the largest are the null space."""
    x = x.double()
    tall = x.shape[0] > x.shape[1]
    x = x.mT if tall else x
    w, v = torch.linalg.eigh(x @ x.mT)
    inv = torch.where(w > w.max() * 1e-20, w.clamp(min=1e-300).rsqrt(), 0.0)
    p = (v * inv) @ v.mT @ x
    return p.mT if tall else p


def _test_matrices(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    big, small = SIZES["big"], SIZES["small"]
    gauss = torch.randn(big, big, device=dev, generator=g)
    u = torch.randn(big, 64, device=dev, generator=g)
    low = u @ torch.randn(64, big, device=dev, generator=g)
    low = low / low.norm() + 0.1 * gauss / gauss.norm()
    q1, _ = torch.linalg.qr(torch.randn(small, small, device=dev, generator=g).double())
    q2, _ = torch.linalg.qr(torch.randn(small, small, device=dev, generator=g).double())
    spectrum = torch.logspace(0, -5, small, device=dev, dtype=torch.float64)
    ill = ((q1 * spectrum) @ q2.T).float()
    return {f"gaussian_{big}": gauss, f"lowrank_noise_{big}": low, f"ill_conditioned_{small}": ill}


def _empty_cache(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _ns_layout(k, m, n, dev) -> dict:
    """Times (ms) of each Gram product's whole Newton-Schulz on k x (m, n) bf16 and of the
    iteration's three products alone."""
    a, b, c = NS_COEFFICIENTS
    x = torch.randn(k, m, n, device=dev, dtype=torch.bfloat16)
    X = x / torch.linalg.vector_norm(x.float(), dim=(-2, -1), keepdim=True).bfloat16()
    A = gram_torch(X)
    B = gram_torch(A, c, A, b)
    out = {}
    for name, fn in GRAMS.items():
        cases = dict(
            ns_ms=lambda fn=fn: newton_schulz(x, gram_fn=fn),
            xxt_ms=lambda fn=fn: fn(X),
            bA_cAA_ms=lambda fn=fn: fn(A, c, A, b),
            aX_BX_ms=lambda: torch.baddbmm(X, B, X, beta=a),
        )
        w, r = SIZES["reps"]
        out[name] = {
            key: H.time_fn(f, dev, warmup=w, reps=r)["time_ms"] for key, f in cases.items()
        }
    return out


def stage_ns(out: dict, dev) -> list[str]:
    rows = []
    res = out.setdefault("ns", {})
    for lay, (k, m, n) in SIZES["layouts"].items():
        flops = 5 * (4 * m * m * n + 2 * m**3) * k
        times = _ns_layout(k, m, n, dev)
        _empty_cache(dev)
        for name, r in times.items():
            r["torch_equiv_tflops"] = flops / (r["ns_ms"] * 1e-3) / 1e12
            r["ratio_to_torch"] = r["ns_ms"] / times["torch"]["ns_ms"]
            res[f"{lay}/{name}"] = r
            rows.append(
                f"| {lay} | {name} | {r['ns_ms']:.1f} | {r['ratio_to_torch']:.3f} |"
                f" {r['xxt_ms']:.2f} | {r['bA_cAA_ms']:.2f} | {r['aX_BX_ms']:.2f} |"
            )
            print(rows[-1], flush=True)
    res["triton_best_config"] = str(
        getattr(_gram_kernel._gram_tma_kernel_tuned, "best_config", None)
    )
    res["triton_ptr_best_config"] = str(
        getattr(_gram_kernel._gram_kernel_tuned, "best_config", None)
    )
    err_rows = []
    # the dry run in fp32: Triton's interpreter (3.9) multiplies bf16 operands of tl.dot as
    # their raw 16-bit patterns (C = 2e10 for a unit 16 x 16 Gram), so bf16 rows read NaN
    dt = torch.float32 if dev.type == "cpu" else torch.bfloat16
    for mname, mat in _test_matrices(dev).items():
        polar = _polar(mat)
        for name, fn in GRAMS.items():
            o = newton_schulz(mat, gram_fn=fn, dtype=dt).double()
            e = ((o - polar).norm() / polar.norm()).item()
            oo = o @ o.mT
            orth = (
                (oo - torch.eye(oo.shape[0], device=dev, dtype=oo.dtype)).norm()
                / oo.shape[0] ** 0.5
            ).item()
            res[f"err/{mname}/{name}"] = dict(polar_rel=e, ootmi_rms=orth)
            err_rows.append(f"| {mname} | {name} | {e:.4f} | {orth:.4f} |")
            print(err_rows[-1], flush=True)
    head = "| layout | Gram | NS ms | / torch | X X^T ms | b A + c A A ms | a X + B X ms |"
    return [
        head,
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "| matrix | Gram | to polar (rel. Frobenius) | rms of O O^T - I |",
        "|---|---|---|---|",
        *err_rows,
    ]


def stage_step(out: dict, dev) -> list[str]:
    rows = []
    res = out.setdefault("step", {})
    default_gram = muon.default_gram
    for lay, (k, m, n) in SIZES["layouts"].items():
        base = None
        for name in ("torch_muon_bf16", "torch_muon_fp32", "flash_muon", "flash_muon_torch_gram"):
            _empty_cache(dev)
            dt = torch.float32 if name.endswith("fp32") else torch.bfloat16
            gen = torch.Generator(device=dev).manual_seed(0)
            ps = [
                torch.nn.Parameter((torch.randn(m, n, device=dev, generator=gen) * 0.02).to(dt))
                for _ in range(k)
            ]
            for p in ps:
                p.grad = (torch.randn(m, n, device=dev, generator=gen) * 1e-3).to(dt)
            if name.startswith("torch"):
                opt = torch.optim.Muon(ps, lr=0.02)
            else:
                opt = fo.FlashMuon(ps, lr=0.02)
                if name == "flash_muon_torch_gram":
                    muon.default_gram = lambda x: gram_torch
            try:
                t = H.time_fn(opt.step, dev, warmup=1, reps=SIZES["reps"][1])["time_ms"]
            finally:
                muon.default_gram = default_gram
            if name == "torch_muon_bf16":
                base = t
            res[f"{lay}/{name}"] = dict(time_ms=t, ratio_to_torch_bf16=t / base)
            rows.append(f"| {lay} | {name} | {t:.1f} | {t / base:.3f} |")
            print(rows[-1], flush=True)
            del opt, ps
    return [
        "| layout | optimizer | step ms | / torch.optim.Muon bf16 |",
        "|---|---|---|---|",
        *rows,
    ]


def _seeds_side_by_side(cmd_of, name: str, outdir: str, limit: float, result: str) -> list:
    """Seeds 0, 1, 2 as three processes side by side (``cmd_of(seed, dir)``), each under
    ``limit`` seconds in all; the runs of their ``result`` JSON files."""
    procs, runs = [], []
    for seed in range(3):
        d = os.path.join(outdir, f"{name}-seed{seed}")
        log = open(os.path.join(outdir, f"{name}-seed{seed}.log"), "w")
        proc = subprocess.Popen(cmd_of(seed, d), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        procs.append((proc, d))
    t0 = time.time()
    for p, _ in procs:
        try:
            p.wait(timeout=max(1.0, limit - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
    for _, d in procs:
        path = os.path.join(d, result)
        if os.path.exists(path):
            runs += json.load(open(path))["runs"]
    return runs


def stage_search(out: dict, outdir: str, limit: float, extra=()) -> list[str]:
    """The momentum storages on torch.optim.Muon's own buffer at the 25.6M size
    (``momentum_quantizers.py parity --config gpu``): torch.optim.Muon, its momentum through
    the #24 codes (stochastic) and through the shipped rank-4 (P from u) + nearest codes."""
    schemes = "torch_muon,q_ours,q_lu4_ours_nearest"

    def cmd_of(seed, d):
        tool = os.path.join(ROOT, "tools", "flashoptim", "momentum_quantizers.py")
        return [
            sys.executable,
            tool,
            "parity",
            "--config",
            "gpu",
            "--schemes",
            schemes,
            "--seeds",
            "1",
            "--first-seed",
            str(seed),
            "--out",
            d,
            *extra,
        ]

    runs = _seeds_side_by_side(cmd_of, "search", outdir, limit, "schemes.json")
    out["search"] = runs
    vals: dict = {}
    for r in runs:
        vals.setdefault(r["optimizer"], {})[r["seed"]] = r["val_loss"]
    rows = []
    base = vals.get("torch_muon", {})
    for name, v in vals.items():
        common = [k for k in v if k in base]
        diff = sum(v[k] - base[k] for k in common) / max(1, len(common))
        seeds = " / ".join(f"{v[k]:.4f}" for k in sorted(v))
        rows.append(f"| {name} | {seeds} | {diff:+.4f} |")
    return [
        "| momentum storage (on torch.optim.Muon) | val loss seeds 0/1/2 | minus torch |",
        "|---|---|---|",
        *rows,
    ]


def stage_parity(out: dict, outdir: str, config: str, limit: float, extra=()) -> list[str]:
    """Three seeds as three processes side by side; the summary of parity.py over all."""

    def cmd_of(seed, d):
        cmd = [
            sys.executable,
            "-m",
            "flashoptim_fused.parity",
            "--optimizers",
            "torch_muon,flash_muon",
            "--seeds",
            "1",
            "--first-seed",
            str(seed),
            "--out",
            d,
        ]
        if config != "gpu":
            cmd += ["--config", config]
        return cmd + list(extra)

    runs = _seeds_side_by_side(cmd_of, f"parity-{config}", outdir, limit, "parity.json")
    for r in runs:
        r["losses"] = r["losses"][:: max(1, len(r["losses"]) // 200)]  # a thinned curve
    summary = summarize(runs, "peak_mem_mib") if runs else {}
    out[f"parity_{config}"] = dict(summary=summary, runs=runs)
    rows = []
    for name in ("torch_muon", "flash_muon"):
        if name in summary:
            v = summary[name]["val_loss"]
            tok = summary[name]["tokens_per_s"]
            mean = sum(v) / len(v)
            rows.append(
                f"| {config} | {name} | {' / '.join(f'{x:.4f}' for x in v)} |"
                f" {mean:.4f} | {sum(tok) / len(tok):,.0f} |"
            )
    verdict = summary.get([k for k in PAIRS if PAIRS[k][0] == "torch_muon"][0])
    if verdict:
        rows.append(
            f"| {config} | verdict | torch range {verdict['torch_val_range']} |"
            f" flash - torch {verdict['flash_minus_torch_val_mean']:+.4f} |"
            f" inside: {verdict['flash_mean_within_torch_range']} |"
        )
    return [
        "| size | run | val loss seeds 0/1/2 | mean | tokens/s (3 side by side) |",
        "|---|---|---|---|---|",
        *rows,
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="parity,parity_large")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (interpreter)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cpu" if a.dry_run else "cuda")
    if a.dry_run:
        SIZES.update(DRY)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)"
    out = {"env": H.environment(dev), "stages": {}}
    print(f"device: {name}", flush=True)
    tables = []
    path = os.path.join(a.out, "muon-gpu.json")
    for stage in a.stages.split(","):
        t0 = time.time()
        print(f"=== {stage}", flush=True)
        try:
            if stage == "tests":
                cmd = [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-c",
                    "pyproject.toml",
                    "--rootdir",
                    ".",
                    "-p",
                    "no:cacheprovider",
                    "-q",
                    "-rfE",
                    "-m",
                    "gpu",
                    "packages/flashoptim/tests/test_gram_kernel.py",
                    "packages/flashoptim/tests/test_muon.py",
                ]
                r = subprocess.run(
                    cmd, cwd=ROOT, capture_output=True, text=True, timeout=LIMITS["tests"]
                )
                open(os.path.join(a.out, "tests.txt"), "w").write(r.stdout + r.stderr)
                last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
                out["tests"] = dict(rc=r.returncode, last=last)
                tables.append(f"tests: rc={r.returncode} {last}")
            elif stage == "ns":
                tables += stage_ns(out, dev)
            elif stage == "step":
                tables += stage_step(out, dev)
            elif stage == "search":
                extra = ("--steps", "3", "--config", "smoke") if a.dry_run else ()
                tables += stage_search(out, a.out, LIMITS[stage], extra)
            elif stage in ("parity", "parity_large"):
                config = "gpu" if stage == "parity" else "gpt2s"
                extra = ("--steps", "3") if a.dry_run else ()
                config = "smoke" if a.dry_run else config
                tables += stage_parity(out, a.out, config, LIMITS[stage], extra)
            else:
                raise ValueError(f"unknown stage {stage!r}")
            status = "ok"
        except Exception as e:  # the run goes on: the next stages still report
            status = f"error: {type(e).__name__}: {e}"
            print(status, flush=True)
        out["stages"][stage] = dict(status=status, seconds=time.time() - t0)
        tables.append("")
        json.dump(out, open(path, "w"), indent=1, default=str)
    summary = "\n".join(
        [
            f"device: {name}",
            *(
                f"stage {k}: {v['status']} in {v['seconds']:.0f} s"
                for k, v in out["stages"].items()
            ),
            "",
            *tables,
        ]
    )
    open(os.path.join(a.out, "summary.md"), "w").write(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
