"""Host (Python) time of ``step()`` for many tensors, without a GPU.

    TRITON_INTERPRET=1 PYTHONPATH=packages/flashoptim/src \
        python tools/flashoptim/host_overhead.py [--layout small] [--steps 50]
        [--profile default] [--json OUT]

Builds the bench's layout (``small``: 2,050 bf16 tensors, 54.6M params) on the CPU with
``backend="triton"``, and replaces every Triton kernel launch by a no-op
(``kernel[grid](...)`` returns at once), so what is timed is the host path alone:
plan lookup, gradient pointer check, flag handling, step bookkeeping, launch arguments.
Triton's own launch cost (argument binding, ~tens of us per launch on the GPU host) and the
device work are not in it. Scenarios: ``default`` (check_finite, skip: the bench's
``ours``), ``nocheck``, ``newgrads`` (default, with fresh ``.grad`` tensors every step, as
``zero_grad(set_to_none=True)`` or FSDP2 give). The 2,050-tensor step is host-bound eagerly
(docs/design/flashoptim.md): this is the tool to cut that time without a GPU.
Prints the median ms per step of each; ``--profile NAME`` prints cProfile's top entries.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import flashoptim_fused as fo  # noqa: E402
from flashoptim_fused import _prepass_kernel, _step_kernel  # noqa: E402
from flashoptim_fused.bench import layout_shapes  # noqa: E402

_KERNELS = [(_step_kernel, "_step_kernel"), (_step_kernel, "_step_kernel_tuned")]
_KERNELS += [(_prepass_kernel, "_nonfinite_kernel")]


_LAUNCHES: list = []  # perf_counter() of every no-op launch


def _noop(*args, **kwargs):
    _LAUNCHES.append(time.perf_counter())


class _NoLaunch:
    def __getitem__(self, grid):
        return _noop


def patch_launches() -> None:
    """Every step / pre-pass kernel becomes a no-op launch."""
    for module, name in _KERNELS:
        setattr(module, name, _NoLaunch())


def build(layout: str, scenario: str):
    shapes = layout_shapes(layout)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.empty(s, dtype=torch.bfloat16)) for s in shapes]
    for p in params:
        p.data.normal_(0, 0.02, generator=gen)
    sets = [[torch.full(p.shape, 1e-3, dtype=torch.bfloat16) for p in params]]
    if scenario == "newgrads":  # two sets of gradient tensors, alternated step to step
        sets.append([g.clone() for g in sets[0]])
    for p, g in zip(params, sets[0], strict=True):
        p.grad = g
    kw = dict(backend="triton")
    if scenario == "nocheck":
        kw["check_finite"] = False
    opt = fo.FlashAdamW(params, lr=1e-4, **kw)
    opt.step()  # states, tables, plan

    def before(i):  # not timed: the gradient assignment is the training loop's work
        if len(sets) > 1:
            for p, g in zip(params, sets[i % 2], strict=True):
                p.grad = g

    return opt, before


def time_steps(opt, before, n: int) -> dict:
    """Median ms per step (p20, p80) and the median ms from the call to the first and to
    the last launch (what the device waits for before its work starts / ends)."""
    ts, first, last = [], [], []
    for i in range(n):
        before(i)
        _LAUNCHES.clear()
        t0 = time.perf_counter()
        opt.step()
        ts.append((time.perf_counter() - t0) * 1e3)
        if _LAUNCHES:
            first.append((_LAUNCHES[0] - t0) * 1e3)
            last.append((_LAUNCHES[-1] - t0) * 1e3)
    ts.sort()
    med = lambda x: sorted(x)[len(x) // 2] if x else None  # noqa: E731
    return dict(
        ms=ts[len(ts) // 2],
        p20=ts[len(ts) // 5],
        p80=ts[4 * len(ts) // 5],
        to_first_launch=med(first),
        to_last_launch=med(last),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", default="small")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--scenarios", default="default,nocheck,newgrads")
    ap.add_argument("--profile", default=None, help="scenario to profile with cProfile")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    patch_launches()
    out = {}
    for sc in a.scenarios.split(","):
        opt, before = build(a.layout, sc)
        time_steps(opt, before, 3)
        r = out[sc] = time_steps(opt, before, a.steps)
        print(
            f"{a.layout} {sc}: {r['ms']:.3f} ms/step host ({r['p20']:.3f}-{r['p80']:.3f}),"
            f" first launch at {r['to_first_launch']:.3f}, last at {r['to_last_launch']:.3f}"
            " ms"
        )
        if sc == a.profile:
            pr = cProfile.Profile()
            pr.enable()
            for i in range(a.steps):
                before(i)
                opt.step()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(18)
        del opt, before
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
