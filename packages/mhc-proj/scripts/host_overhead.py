"""Host (Python + dispatch + autograd) time per eager ``birkhoff_project`` call.

At tiny batches on the CPU module the kernels are a few microseconds, so the wall time per
call is the host path: the part of the GPU's eager fwd+bwd time that CUDA graph replay
removes (issue #4: eager fwd+bwd at B = 128K, target <= 0.04 ms). One thread, best of
several interleaved rounds (the host is shared), microseconds per call.

    PYTHONPATH=/tmp/mhcdev python packages/mhc-proj/scripts/host_overhead.py
    ... --profile fwd_bwd     # cProfile of one case, sorted by own time
    ... --device cuda         # the same cases on a GPU (kernels are then not negligible)

Cases: ``launchers`` (``birkhoff_bwd(birkhoff_fwd(x))``, no autograd), ``fwd_nograd``
(x without grad), ``fwd`` (x.requires_grad: the autograd node is built), ``fwd_bwd``
(``y.backward(g)``), ``fwd_grad`` (``torch.autograd.grad``, as the bench times it),
``op_fwd_bwd`` (the ``torch.library`` custom op with its registered autograd: the path
``torch.compile`` sees, run eagerly), ``info_fwd_bwd`` (``return_info=True``),
``legacy_fwd_grad`` (a copy of the eager path before 2026-12-01 14:00 UTC, the same
compiled module: an A/B in one process) and two references: ``exp_grad`` (a builtin op +
``autograd.grad``) and ``identity_fn`` (an identity ``autograd.Function`` +
``autograd.grad``: the floor of any Python autograd.Function).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch

from mhc_proj import _backend
from mhc_proj import birkhoff as bk


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


# ---------------------------------------------------------------- the path before
def _legacy_code() -> int:
    value = os.environ.get(bk.LAYOUT_ENV) or bk.DEFAULT_LAYOUT
    return bk._LAYOUTS[value]


def _legacy_stream(x: torch.Tensor) -> int:
    return torch.cuda.current_stream(x.device).cuda_stream


def _legacy_guard(x: torch.Tensor):
    if x.device.index is None or x.device.index == torch.cuda.current_device():
        return _backend._NO_GUARD
    return torch.cuda.device(x.device)


def _legacy_mod(x: torch.Tensor):
    return _backend.cuda() if x.device.type == "cuda" else _backend.cpu()


def _legacy_fwd(x: torch.Tensor, tol: float, max_iter: int) -> torch.Tensor:
    code = _legacy_code()
    b, n = x.shape[0], x.shape[-1]
    x = x if x.data_ptr() % 16 == 0 else x.clone()
    out = torch.empty_like(x)
    info = torch.empty(0, dtype=torch.int32, device=x.device)  # noqa: F841 (it was made)
    mod = _legacy_mod(x)
    dt = 1 if x.dtype == torch.float64 else 0
    args = (bk.FALLBACK_TOL, bk.FALLBACK_MAX_ITER, bk.PIVOT_MIN)
    if x.is_cuda:
        with _legacy_guard(x):
            work = torch.empty(1 + b + b * n, dtype=torch.int32, device=x.device)
            mod.birkhoff_fwd(
                x.data_ptr(), out.data_ptr(), 0, work.data_ptr(), b, n, dt, tol, max_iter,
                *args, _legacy_stream(x), code,
            )  # fmt: skip
    else:
        variant = bk._CPU_VARIANT.get(code, 0) if n == 4 and dt == 0 else 0
        mod.birkhoff_fwd(
            x.data_ptr(), out.data_ptr(), 0, b, n, dt, tol, max_iter, *args, variant
        )  # fmt: skip
    return out


def _legacy_bwd(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    code = _legacy_code()
    b, n = t.shape[0], t.shape[-1]
    t = t if t.data_ptr() % 16 == 0 else t.clone()
    grad = grad if grad.data_ptr() % 16 == 0 else grad.clone()
    out = torch.empty_like(t)
    mod = _legacy_mod(t)
    dt = 1 if t.dtype == torch.float64 else 0
    if t.is_cuda:
        with _legacy_guard(t):
            mod.birkhoff_bwd(
                t.data_ptr(), grad.data_ptr(), out.data_ptr(), b, n, dt, _legacy_stream(t), code
            )
    else:
        mod.birkhoff_bwd(t.data_ptr(), grad.data_ptr(), out.data_ptr(), b, n, dt)
    return out


class _Legacy(torch.autograd.Function):
    """birkhoff._BirkhoffProject as of commit b5aed9a (reshapes and views, launchers that
    read the environment, build the info tensor and torch.cuda Stream objects)."""

    @staticmethod
    def forward(ctx, logits, compute_dtype, tol, max_iter, layout):
        n = logits.shape[-1]
        x = logits.to(compute_dtype).reshape(-1, n, n).contiguous()
        t = _legacy_fwd(x, tol, max_iter)
        ctx.save_for_backward(t)
        ctx.layout = layout
        ctx.in_dtype = logits.dtype
        return t.view(logits.shape)

    @staticmethod
    def backward(ctx, grad_t):
        (t,) = ctx.saved_tensors
        g = grad_t.reshape(t.shape).to(t.dtype).contiguous()
        da = _legacy_bwd(t, g).view(grad_t.shape).to(ctx.in_dtype)
        return da, None, None, None, None


def legacy_project(logits: torch.Tensor) -> torch.Tensor:
    """The old public call for float32/float64 logits (its checks, then _Legacy)."""
    bk._check(logits)
    _ = logits.device.type  # the old check read the device type
    f64 = logits.dtype == torch.float64
    dtype, tol, it = (torch.float64, bk.TOL_F64, 100) if f64 else (torch.float32, bk.TOL_F32, 30)
    torch.compiler.is_compiling()
    return _Legacy.apply(logits, dtype, tol, it, None)


# ---------------------------------------------------------------- cases
def cases(batch: int, device: str, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(batch, 4, 4, generator=gen, dtype=dtype).to(device)
    g = torch.randn(batch, 4, 4, generator=gen, dtype=dtype).to(device)
    xg = x0.clone().requires_grad_(True)
    tol, it = (bk.TOL_F64, bk.MAX_ITER_F64) if dtype == torch.float64 else (bk.TOL_F32, 30)

    def launchers():
        bk.birkhoff_bwd(bk.birkhoff_fwd(x0, tol, it, False)[0], g)

    def fwd_nograd():
        bk.birkhoff_project(x0)

    def fwd():
        bk.birkhoff_project(xg)

    def fwd_bwd():
        bk.birkhoff_project(xg).backward(g)

    def fwd_grad():
        torch.autograd.grad(bk.birkhoff_project(xg), xg, g)

    def op_fwd_bwd():
        t, _ = bk._fwd_op(xg, tol, it, False)
        t.backward(g)

    def info_fwd_bwd():
        bk.birkhoff_project(xg, return_info=True)[0].backward(g)

    def legacy_fwd_grad():
        torch.autograd.grad(legacy_project(xg), xg, g)

    def exp_grad():
        torch.autograd.grad(xg.exp(), xg, g)

    def identity_fn():
        torch.autograd.grad(_Identity.apply(xg), xg, g)

    return {
        f.__name__: f
        for f in (
            launchers,
            fwd_nograd,
            fwd,
            fwd_bwd,
            fwd_grad,
            op_fwd_bwd,
            info_fwd_bwd,
            legacy_fwd_grad,
            exp_grad,
            identity_fn,
        )
    }


def measure(fns: dict, calls: int, rounds: int, sync) -> dict[str, float]:
    """Best-of-rounds and median-of-rounds mean us per call, the cases interleaved."""
    per: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():  # warm-up
        for _ in range(20):
            f()
    sync()
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            sync()
            per[k].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: (min(v), statistics.median(v)) for k, v in per.items()}


def check(device: str, dtype: torch.dtype) -> None:
    """The new path, the legacy copy and the op path agree bitwise (T and dA)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 4, 4, generator=gen, dtype=dtype).to(device) * 3
    g = torch.randn(3, 5, 4, 4, generator=gen, dtype=dtype).to(device)
    grads = []
    for f in (bk.birkhoff_project, legacy_project):
        xg = x.clone().requires_grad_(True)
        t = f(xg)
        grads.append((t.detach(), torch.autograd.grad(t, xg, g)[0]))
    (t0, d0), (t1, d1) = grads
    if not (torch.equal(t0, t1) and torch.equal(d0, d1)):
        raise AssertionError("the new eager path and the legacy copy differ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", default=None, help="cProfile this case instead")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cuda = args.device.startswith("cuda")
    sync = (lambda: torch.cuda.synchronize()) if cuda else (lambda: None)
    check(args.device, dtype)
    if args.profile:
        f = cases(args.batch[0], args.device, dtype)[args.profile]
        for _ in range(50):
            f()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.calls):
            f()
        sync()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue())
        return
    print(f"# torch {torch.__version__}, {args.device}, {args.dtype}, threads {args.threads}")
    print("| case | " + " | ".join(f"B={b} us (best / median)" for b in args.batch) + " |")
    print("|---|" + "---|" * len(args.batch))
    res = {
        b: measure(cases(b, args.device, dtype), args.calls, args.rounds, sync) for b in args.batch
    }
    for k in res[args.batch[0]]:
        cells = " | ".join(f"{res[b][k][0]:.1f} / {res[b][k][1]:.1f}" for b in args.batch)
        print(f"| {k} | {cells} |")


if __name__ == "__main__":
    main()
