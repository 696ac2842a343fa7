"""The block-sparse passes of the multiscale backend and its certificate.

One pass: for every row point i of a sorted cloud and the column tiles J kept for its
tile (a :class:`~flashsinkhorn._multiscale_tiles.KeepSet`, row- or column-major),

    lse_i = log sum_{J kept} sum_{j in J} exp(bias_j - scale |x_i - y_j|^2)

with ``bias_j = log w_j + g_j / eps`` and ``scale = s / eps`` (natural logarithms), and
with ``v`` the softmax average ``vbar_i = sum_j pi_ij v_j``. The squared distance is
formed from the coordinate differences (not ``|x|^2 + |y|^2 - 2 <x, y>``): neighbouring
points, the only ones a pass computes at small eps, keep full relative precision.

Backends: the Triton kernel of ``_multiscale_triton`` (CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``) and a chunked torch path (any device and dtype; float64 for the
certificate on CPU).

:func:`certificate` bounds the L1 marginal error of potentials from above: the kept pairs
are summed in float64, the skipped ones enter through their mass bounds, and float64's own
rounding through the same margin as the dense certificate.
"""

from __future__ import annotations

import torch

from flashsinkhorn import _config, _multiscale_triton
from flashsinkhorn._multiscale_tiles import SortedCloud

__all__ = ["softmin_pass", "interval_error"]

# torch path: at most this many scores (pairs x T x T) at once
_CHUNK_ELEMS = 1 << 22


def softmin_pass(
    rowc: SortedCloud,
    colc: SortedCloud,
    ptr,
    nbr,
    bias_pad,
    scale,
    v_pad=None,
    backend="torch",
    pts=None,
):
    """``(lse (npad_rows,), vbar (npad_rows, DV) or None)`` of one block-sparse pass.

    ``ptr`` (K+1,), ``nbr`` (P,): the CSR of the kept column tiles of each row tile;
    ``bias_pad`` (npad_cols,): the column vector (``-inf`` for zero weights); ``v_pad``
    (npad_cols, DV) optional; ``pts``: ``(row points, column points)`` padded, when not the
    clouds' own (the float64 copies of the certificate). Rows without any term get
    ``lse = -inf``.
    """
    xr, yc = (rowc.pts_pad, colc.pts_pad) if pts is None else pts
    if backend == "triton":
        return _multiscale_triton.softmin_pass_triton(xr, yc, ptr, nbr, bias_pad, scale, v_pad)
    return _softmin_pass_torch(xr, yc, ptr, nbr, bias_pad, scale, v_pad)


def _softmin_pass_torch(xr, yc, ptr, nbr, bias_pad, scale, v_pad):
    """Chunks of row tiles; each chunk gathers its kept column tiles into a row of width
    ``W`` tiles (W the most any of its row tiles keeps; shorter rows padded with an empty
    tile of bias -inf), so the LogSumExp and the softmax average are dense ops on
    (rows, T, W T) blocks, with no scatter."""
    T = _config.MULTISCALE_TILE
    K, L, d = xr.shape[0] // T, yc.shape[0] // T, xr.shape[1]
    dt, dev = bias_pad.dtype, bias_pad.device
    X = xr.to(dt).view(K, T, d)
    # one more column tile, empty (bias -inf), for the padding of the gathered rows
    Y = torch.cat([yc.to(dt), yc.new_zeros(T, d, dtype=dt)]).view(L + 1, T, d)
    bias = torch.cat([bias_pad, bias_pad.new_full((T,), float("-inf"))]).view(L + 1, T)
    V = None
    if v_pad is not None:
        V = torch.cat([v_pad.to(dt), v_pad.new_zeros(T, v_pad.shape[1], dtype=dt)])
        V = V.view(L + 1, T, -1)
    lse = torch.empty(K, T, dtype=dt, device=dev)
    vbar = None if V is None else torch.empty(K, T, V.shape[-1], dtype=dt, device=dev)
    counts = ptr[1:] - ptr[:-1]
    counts_h = counts.tolist()
    k0 = 0
    while k0 < K:  # chunks of whole row tiles, at most _CHUNK_ELEMS scores (or one tile)
        k1, w = k0, 0
        while k1 < K and (k1 == k0 or (k1 + 1 - k0) * max(w, counts_h[k1]) * T * T <= _CHUNK_ELEMS):
            w = max(w, counts_h[k1])
            k1 += 1
        kc = k1 - k0
        slot = torch.arange(max(w, 1), device=dev)
        J = torch.full((kc, slot.numel()), L, dtype=torch.int64, device=dev)
        if w:
            ok = slot[None, :] < counts[k0:k1, None]
            J[ok] = nbr[(ptr[k0:k1, None] + slot[None, :])[ok]]
        Yg = Y[J].view(kc, -1, d)  # (kc, W T, d)
        # |x - y|^2 from coordinate differences, one coordinate at a time (the expansion
        # |x|^2 + |y|^2 - 2 <x, y> would lose float32 digits to cancellation)
        d2 = torch.zeros(kc, T, Yg.shape[1], dtype=dt, device=dev)
        for k in range(d):
            diff = X[k0:k1, :, None, k] - Yg[:, None, :, k]
            d2.addcmul_(diff, diff)
        S = bias[J].view(kc, 1, -1) - scale * d2
        del d2, diff
        lse[k0:k1] = torch.logsumexp(S, -1)
        if V is not None:
            pi = torch.softmax(S, -1).nan_to_num_(0.0)
            vbar[k0:k1] = pi @ V[J].view(kc, -1, V.shape[-1])
        k0 = k1
    return lse.view(-1), None if vbar is None else vbar.view(K * T, -1)


def interval_error(w, kept, extra, z_of):
    """Per point, the largest error over the interval of its true marginal.

    ``kept`` (n,): the float64 marginal over the computed pairs (a lower bound of the true
    one); ``extra`` (n,): the bound of the skipped pairs' mass, so the truth lies in
    ``[kept, kept + extra]``; ``z_of(r)``: the residual exponent of a marginal ``r`` (it
    increases with r), the error of the point being ``w |expm1(z)|``, largest at an end of
    the interval. Zero weights count 0."""
    e = torch.maximum(torch.expm1(z_of(kept)).abs(), torch.expm1(z_of(kept + extra)).abs())
    return torch.where(w > 0, w * e, torch.zeros_like(e))
