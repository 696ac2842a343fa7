"""GPU micro-benchmark of the finiteness pre-pass alone (v2 vs v3, or the kernels named in
the second argument, e.g. ``v3,v4``) on the large layout.

    PYTHONPATH=packages/flashoptim/src python3 packages/flashoptim/scripts/prepass_bench.py \
        [OUT.json] [v3,v4]

Times the device work of ``FlashOptimizer._nonfinite`` with device flags (flag fill +
pre-pass launches, no host sync) over 20 back-to-back calls with CUDA events, and prints
ms per call and the gradient read rate (2 bytes per bf16 element). Also times one full
host round trip (launch + sync) for each. Needs CUDA.
"""

from __future__ import annotations

import json
import sys

import torch

import flashoptim as fo


def main() -> int:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = [(8192, 8192)] * 8
    ps = [torch.nn.Parameter(torch.randn(s, device=dev, generator=gen).bfloat16()) for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, device=dev, generator=gen) * 1e-3).bfloat16()
    n = sum(p.numel() for p in ps)
    out = {}
    kernels = sys.argv[2].split(",") if len(sys.argv) > 2 else ["v2", "v3"]
    for kernel in kernels:
        opt = fo.FlashAdamW(ps, lr=1e-4, kernel=kernel)
        opt.step()  # tables, states, compiles
        preps = [opt._prepare(g, opt._grads(g)) for g in opt.param_groups]
        for _ in range(3):
            opt._nonfinite(preps, {})
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20
        a.record()
        for _ in range(reps):
            opt._nonfinite(preps, {})
        b.record()
        b.synchronize()
        dev_ms = a.elapsed_time(b) / reps
        a.record()
        for _ in range(reps):
            opt._nonfinite(preps)  # launch + host sync, as v2's step does
        b.record()
        b.synchronize()
        sync_ms = a.elapsed_time(b) / reps
        out[kernel] = dict(device_ms=dev_ms, with_sync_ms=sync_ms, read_tbps=2 * n / dev_ms / 1e9)
        print(
            f"pre-pass {kernel}: {dev_ms:.3f} ms device ({2 * n / dev_ms / 1e9:.2f} TB/s of "
            f"gradient reads), {sync_ms:.3f} ms with the host sync",
            flush=True,
        )
        del opt
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
