"""Tiles for the multiscale backend: Morton runs, k-means clusters, k-d tree leaves (CPU).

The question (issue #35): which clustering makes the tiles of the block-sparse passes? All
are scored by what a pass costs: the tile pairs that the bound of
``flashsinkhorn._multiscale_tiles.pair_bound`` cannot skip at temperature eps (each pair is
64 x 64 scores whatever the tile's fill), and by the time to build the tiles.

- Morton: sort by Z-order code, cut into runs of 64;
- k-d tree: leaves of a balanced k-d tree (median splits on the widest axis), 64 points
  each (``sort_clouds``: what the package ships);
- k-means: Lloyd's iterations with k = n / 64 centers started from the Morton tiles'
  centers (a refinement of them), clusters cut into tiles of at most 64 points (a tile's
  free slots are zero-weight copies of its first point: no mass, no bound).

The potentials are those of a translation ``y = x + t`` (the Brenier potentials
``f = -2 s <x, t>``, ``g = 2 s <y, t> - s |t|^2``, what the entropic ones approach at small
eps): the bound then sees realistic slopes. Run:

    PYTHONPATH=packages/flashsinkhorn/src python tools/flashsinkhorn/multiscale_clustering.py

Prints a markdown table (the design note's numbers came from it).
"""

from __future__ import annotations

import argparse
import time

import torch

from flashsinkhorn import _config
from flashsinkhorn._multiscale_tiles import (
    SortedCloud,
    fit_potential,
    keep_set,
    morton_codes,
    sort_clouds,
)


def clouds(kind, n, gen):
    if kind == "cube":
        x = torch.rand(n, 3, generator=gen)
    else:
        x = torch.randn(n, 3, generator=gen)
        x = x / x.norm(dim=1, keepdim=True)
    return x


def kmeans_tiles(pts, w, init, iters):
    """Lloyd's iterations from ``init`` centers, then the clusters cut into tiles of at
    most TILE points, padded with zero-weight copies: ``(pts, w, order)`` in tile order."""
    T = _config.MULTISCALE_TILE
    c = init.clone()
    for _ in range(iters):
        lab = torch.cat([torch.cdist(p, c).argmin(1) for p in pts.split(8192)])
        s = torch.zeros_like(c).index_add_(0, lab, pts)
        cnt = torch.bincount(lab, minlength=c.shape[0]).clamp_min(1)
        c = torch.where((cnt > 0)[:, None], s / cnt[:, None], c)
    lab = torch.cat([torch.cdist(p, c).argmin(1) for p in pts.split(8192)])
    order = torch.argsort(lab, stable=True)
    lab_s = lab[order]
    out_p, out_w, out_o = [], [], []
    bounds = torch.cat(
        [
            torch.tensor([0]),
            torch.nonzero(lab_s[1:] != lab_s[:-1])[:, 0] + 1,
            torch.tensor([len(lab_s)]),
        ]
    )
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        for t0 in range(lo, hi, T):
            t1 = min(t0 + T, hi)
            idx = order[t0:t1]
            pad = T - (t1 - t0)
            out_p.append(torch.cat([pts[idx], pts[idx[:1]].expand(pad, -1)]))
            out_w.append(torch.cat([w[idx], w.new_zeros(pad)]))
            out_o.append(torch.cat([idx, idx[:1].expand(pad)]))
    return torch.cat(out_p), torch.cat(out_w), torch.cat(out_o)


def morton_tiles(p, w, like):
    """Runs of 64 consecutive points in Z-order (n a multiple of 64 here)."""
    order = torch.sort(morton_codes(p, like.lo, like.side, like.bits), stable=True).indices
    return as_cloud(p[order], w[order], order, like)


def as_cloud(pts, w, order, like):
    return SortedCloud(
        pts=pts,
        w=w,
        order=order,
        codes=torch.zeros(pts.shape[0], dtype=torch.int64),
        shift=0,
        bits=like.bits,
        lo=like.lo,
        side=like.side,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 16)
    ap.add_argument("--blur", type=float, default=0.01)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    s, eps = 0.5, args.blur**2
    t = torch.tensor([0.05, 0.02, -0.03])
    rows = []
    for kind in ("cube", "sphere"):
        gen = torch.Generator().manual_seed(0)
        x = clouds(kind, args.n, gen)
        y = x + t
        w = torch.full((args.n,), 1.0 / args.n)
        t0 = time.perf_counter()
        xc, yc = sort_clouds(x, y, w, w)
        t_kd = time.perf_counter() - t0
        t0 = time.perf_counter()
        mx, my = (morton_tiles(p, w, xc) for p in (x, y))
        t_morton = time.perf_counter() - t0

        def brenier(p, side):
            """The translation's potentials at the points p (float64)."""
            p, tt = p.double(), t.double()
            return -2 * s * (p @ tt) if side == 0 else 2 * s * (p @ tt) - s * tt.dot(tt)

        def score(xc_, yc_, fx_vals, gy_vals):
            fx, gy = fit_potential(xc_, fx_vals), fit_potential(yc_, gy_vals)
            ks = keep_set(xc_, fx, yc_, gy, eps, s, -12.5)
            return ks.pairs, float(xc_.radius.mean())

        pm, rm = score(mx, my, brenier(mx.pts, 0), brenier(my.pts, 1))
        rows.append((kind, "Morton runs", t_morton, mx.K, rm, pm))
        pd, rd = score(xc, yc, xc.sorted_values(brenier(x, 0)), yc.sorted_values(brenier(y, 1)))
        rows.append((kind, "k-d tree leaves (shipped)", t_kd, xc.K, rd, pd))
        t0 = time.perf_counter()
        kx = kmeans_tiles(x, w, mx.center.float(), args.iters)
        ky = kmeans_tiles(y, w, my.center.float(), args.iters)
        t_km = time.perf_counter() - t0 + t_morton
        kxc, kyc = as_cloud(*kx, xc), as_cloud(*ky, yc)

        pk, rk = score(kxc, kyc, brenier(kxc.pts, 0), brenier(kyc.pts, 1))
        rows.append((kind, f"k-means ({args.iters} Lloyd)", t_km, kxc.K, rk, pk))
    print(
        f"n = m = {args.n}, d = 3, blur {args.blur}, truncate 5, tiles of {_config.MULTISCALE_TILE}"
    )
    print("| cloud | tiles by | build s | tiles | mean radius | kept pairs | kept scores |")
    print("|---|---|---|---|---|---|---|")
    T2 = _config.MULTISCALE_TILE**2
    for kind, how, tb, K, r, p in rows:
        print(f"| {kind} | {how} | {tb:.3f} | {K} | {r:.4f} | {p} | {p * T2:.3g} |")


if __name__ == "__main__":
    main()
