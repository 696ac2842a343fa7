"""Host (Python + dispatch + autograd) time per eager ``birkhoff_project`` call.

At tiny batches on the CPU module the kernels are a few microseconds, so the wall time per
call is the host path: the part of the GPU's eager fwd+bwd time that CUDA graph replay
removes (issue #4: eager fwd+bwd at B = 128K, target <= 0.04 ms). One thread, best of
several interleaved rounds (the host is shared), microseconds per call.

    python tools/mhc-proj/host_overhead.py          # mhc-proj installed or on PYTHONPATH
    ... --profile fwd_bwd     # cProfile of one case, sorted by own time
    ... --device cuda         # the same cases on a GPU (kernels are then not negligible)

Cases: ``launchers`` (``birkhoff_bwd(birkhoff_fwd(x))``, no autograd), ``fwd_nograd``
(x without grad), ``fwd`` (x.requires_grad: the autograd node is built), ``fwd_bwd``
(``y.backward(g)``), ``fwd_grad`` (``torch.autograd.grad``, as the bench times it),
``op_fwd_bwd`` (the ``torch.library`` custom op with its registered autograd: the path
``torch.compile`` sees, run eagerly), ``info_fwd_bwd`` (``return_info=True``) and two
references: ``exp_grad`` (a builtin op + ``autograd.grad``) and ``identity_fn`` (an
identity ``autograd.Function`` + ``autograd.grad``: the floor of any Python
autograd.Function). Measurements: docs/design/mhc-proj.md, "The eager host path".
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from mhc_proj import birkhoff as bk
from mhc_proj._config import MAX_ITER_F32, MAX_ITER_F64, TOL_F32, TOL_F64


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


# ---------------------------------------------------------------- cases
def cases(batch: int, device: str, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(batch, 4, 4, generator=gen, dtype=dtype).to(device)
    g = torch.randn(batch, 4, 4, generator=gen, dtype=dtype).to(device)
    xg = x0.clone().requires_grad_(True)
    tol, it = (TOL_F64, MAX_ITER_F64) if dtype == torch.float64 else (TOL_F32, MAX_ITER_F32)

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
