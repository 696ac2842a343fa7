"""Short CPU demo: ``python -m mhc_proj.demo``."""

from __future__ import annotations

import time

import torch

from mhc_proj import (
    HyperConnection,
    birkhoff_project,
    build_info,
    marginal_error,
    sinkhorn_project,
)
from mhc_proj.reference import birkhoff_project_ref


def main() -> None:
    torch.manual_seed(0)
    print("mhc-proj demo: project 4x4 residual-mixing logits onto the Birkhoff polytope (CPU)")
    print(f"  build: {build_info()}")
    for sigma in (1.0, 10.0, 100.0):
        x = torch.randn(20_000, 4, 4) * sigma
        t0 = time.perf_counter()
        t, info = birkhoff_project(x, return_info=True)
        ms = (time.perf_counter() - t0) * 1e3
        sk = sinkhorn_project(x, iters=20)
        print(
            f"  N(0,{sigma:g}^2), 20k matrices: exact projection in {ms:.0f} ms, "
            f"max marginal error {marginal_error(t).max():.1e} "
            f"(Sinkhorn-20: {marginal_error(sk).max():.1e}), "
            f"mean Newton iterations {info.iterations.float().mean():.1f}, "
            f"float64 re-solves {int(info.fallback.sum())}"
        )
    x = torch.randn(8, 4, 4) * 3
    ref = birkhoff_project_ref(x)
    dist = (birkhoff_project(x).double() - ref).abs().max()
    print(f"  distance to the float64 reference: {dist:.1e}")
    xg = x.clone().requires_grad_(True)
    w = torch.randn(8, 4, 4)
    (birkhoff_project(xg) * w).sum().backward()
    print(f"  implicit backward: grad norm {xg.grad.norm():.4f} (only T was saved)")
    layer = HyperConnection(torch.nn.Linear(64, 64), hc=4, c=64)
    xs = torch.randn(4, 32, 4, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # how most training runs
        out, maps = layer(xs, return_maps=True)
    out.square().mean().backward()
    print(
        f"  mHC layer (n = 4, C = 64) under bf16 autocast: H_res max marginal error "
        f"{marginal_error(maps.h_res.detach()).max():.1e}, grad norm of phi "
        f"{layer.phi.grad.norm():.3e}"
    )
    print("done")


if __name__ == "__main__":
    main()
