"""Rigid, then non-rigid registration of two 3-D point clouds by gradient flow of the
Sinkhorn divergence, on the multiscale backend (issue #35).

The target is a closed surface (a sphere with three bumps, "a pebble"), sampled at n points.
The source is the same surface sampled at other points, bent (a smooth non-rigid warp) and
then moved by a rotation of 40 degrees and a translation. Registration:

1. rigid: a rotation (axis-angle) and a translation, fitted by Adam on
   ``SamplesLoss(blur=0.05)(R x + t, y)``;
2. non-rigid: a smooth displacement field (Gaussian radial basis on a coarse grid of
   control points), fitted by Adam on ``SamplesLoss(blur=0.01)``.

Each source point was generated from a point of the surface, so its true position after
registration is known: the script prints the mean distance to it after each stage, and
draws the three stages into a PNG. On a GPU: ``python registration.py`` (n = 2^18 points per
cloud by default; ``--n 1000000`` for a million). On a CPU: ``--smoke`` (n = 1000, a few
steps: a test runs it); docs/results/flashsinkhorn/registration-cpu-n4000.png came from
``--n 4000 --rigid-steps 40 --warp-steps 40 --png ...`` (8 minutes on one CPU thread).
"""

from __future__ import annotations

import argparse
import math
import struct
import time
import zlib

import torch

import flashsinkhorn as fs


def surface(u, v):
    """The pebble: a sphere of radius 1 + 0.2 bumps, at angles (u, v)."""
    r = 1 + 0.2 * torch.sin(3 * u) * torch.sin(2 * v) ** 2
    return torch.stack(
        [r * torch.sin(v) * torch.cos(u), r * torch.sin(v) * torch.sin(u), r * torch.cos(v)], -1
    )


def sample_angles(n, gen):
    """Angles of points spread uniformly on the sphere (the pebble is close to it)."""
    u = 2 * math.pi * torch.rand(n, generator=gen)
    v = torch.acos(1 - 2 * torch.rand(n, generator=gen))
    return u, v


def bend(p):
    """The smooth non-rigid warp applied to the source: a bend around the z axis."""
    x, y, z = p.unbind(-1)
    return torch.stack([x + 0.15 * z**2, y + 0.1 * torch.sin(2 * x), z * (1 + 0.1 * x)], -1)


def rotation(w):
    """Rotation matrix of the axis-angle vector w (Rodrigues), differentiable."""
    theta = w.norm().clamp_min(1e-12)
    k = w / theta
    K = torch.zeros(3, 3, dtype=w.dtype, device=w.device)
    K[0, 1], K[0, 2], K[1, 2] = -k[2], k[1], -k[0]
    K = K - K.T
    eye = torch.eye(3, dtype=w.dtype, device=w.device)
    return eye + torch.sin(theta) * K + (1 - torch.cos(theta)) * (K @ K)


def make_problem(n, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = surface(*sample_angles(n, gen))
    us, vs = sample_angles(n, gen)
    truth = surface(us, vs)  # where each source point belongs on the target
    R = rotation(torch.tensor([0.3, -0.5, 0.4]) * (math.radians(40) / 0.707))
    t = torch.tensor([0.4, -0.2, 0.3])
    x = bend(truth) @ R.T + t
    return x.to(device), y.to(device), truth.to(device)


def rbf_field(p, ctrl, disp, width):
    """Displacement at points p: sum_k exp(-|p - c_k|^2 / 2 width^2) d_k, normalized."""
    w = torch.exp(-(torch.cdist(p, ctrl) ** 2) / (2 * width**2))
    return (w @ disp) / w.sum(1, keepdim=True).clamp_min(1e-12)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 18)
    ap.add_argument("--rigid-steps", type=int, default=60)
    ap.add_argument("--warp-steps", type=int, default=60)
    ap.add_argument("--smoke", action="store_true", help="n = 1000, a few steps (CPU test)")
    ap.add_argument("--png", default=None, help="write the picture here")
    args = ap.parse_args()
    if args.smoke:
        args.n, args.rigid_steps, args.warp_steps = 1000, 3, 3
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x0, y, truth = make_problem(args.n, device)
    err = lambda p: float((p - truth).norm(dim=1).mean())  # noqa: E731
    print(f"n = {args.n} points per cloud on {device}; mean error before: {err(x0):.4f}")
    coarse = fs.SamplesLoss(blur=0.05, scaling=0.5, debias=True, backend="multiscale")
    fine = fs.SamplesLoss(blur=0.01, scaling=0.5, debias=True, backend="multiscale")

    # 1. rigid: rotation about the source's centroid, then translation
    w = torch.zeros(3, device=device, requires_grad=True)
    t = torch.zeros(3, device=device, requires_grad=True)
    c0 = x0.mean(0)
    opt = torch.optim.Adam([w, t], lr=0.05)
    t0 = time.perf_counter()

    def rigid():
        return (x0 - c0) @ rotation(w).T + c0 + t

    for _ in range(args.rigid_steps):
        opt.zero_grad()
        loss = coarse(rigid(), y)
        loss.backward()
        opt.step()
    x1 = rigid().detach()
    print(
        f"rigid: {args.rigid_steps} steps in {time.perf_counter() - t0:.1f} s; loss "
        f"{float(loss.detach()):.3g}, mean error {err(x1):.4f}"
    )

    # 2. non-rigid: a smooth field on 6^3 control points over the source's bounding box
    lo, hi = x1.amin(0), x1.amax(0)
    g = torch.linspace(0, 1, 6, device=device)
    grid = torch.stack(torch.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)
    ctrl = lo + grid * (hi - lo)
    disp = torch.zeros_like(ctrl, requires_grad=True)
    width = float((hi - lo).max()) / 5
    opt = torch.optim.Adam([disp], lr=0.01)
    t0 = time.perf_counter()
    for _ in range(args.warp_steps):
        opt.zero_grad()
        loss = fine(x1 + rbf_field(x1, ctrl, disp, width), y)
        loss.backward()
        opt.step()
    x2 = (x1 + rbf_field(x1, ctrl, disp, width)).detach()
    print(
        f"non-rigid: {args.warp_steps} steps in {time.perf_counter() - t0:.1f} s; loss "
        f"{float(loss.detach()):.3g}, mean error {err(x2):.4f}; certified L1 marginal error of the "
        f"last plan {float(fine.last_marginal_error):.3g}"
    )
    if args.png:
        draw(args.png, x0, x1, x2, y)


def draw(path, x0, x1, x2, y, size=320):
    """A PNG of the three stages side by side (no plotting library: the points are
    splatted into an RGB grid, viewed along a fixed oblique axis; target blue, source
    orange), written with zlib."""
    c, v = math.cos(0.6), math.sin(0.6)
    view = torch.tensor([[c, 0.0, v], [-v * v, c, v * c]]).T  # two screen axes
    pts = [p.detach().float().cpu() @ view for p in (x0, x1, x2, y)]
    lo = torch.stack([p.amin(0) for p in pts]).amin(0)
    hi = torch.stack([p.amax(0) for p in pts]).amax(0)
    img = torch.full((size, 3 * size, 3), 255, dtype=torch.uint8)
    for k, src in enumerate(pts[:3]):
        for q, color in ((pts[3], (40, 90, 200)), (src, (240, 130, 20))):
            uv = ((q - lo) / (hi - lo) * (size - 9) + 4).long()
            img[size - 1 - uv[:, 1], k * size + uv[:, 0]] = torch.tensor(color, dtype=torch.uint8)
    img[:, size - 1 :: size][:, :2] = 0  # panel borders
    rows = b"".join(b"\x00" + bytes(r.flatten().tolist()) for r in img)

    def chunk(tag, data):
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    head = struct.pack(">IIBBBBB", 3 * size, size, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(rows, 9))
    with open(path, "wb") as fh:
        fh.write(png + chunk(b"IEND", b""))
    print(f"wrote {path} (before | after rigid | after non-rigid; target blue, source orange)")


if __name__ == "__main__":
    main()
