"""Plan sampling: for every row (source point) one column (target index) drawn from its row
of the entropic plan, at the cost of one streaming pass. No n x m matrix is formed.

Row i of the plan ``P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)``, normalized, is the row
softmax of the scores ``S_ij = log b_j + (g_j - C_ij) / eps``. The draw takes two levels,
over a fixed grid of blocks of ``BLOCK = 128`` global columns (block K holds the columns
``[128 K, 128 K + 128)``):

1. the block, by Gumbel-max on the blocks' LogSumExps:
   ``K_i = argmax_K (log2 Z_iK - log2 E_iK)`` with ``Z_iK = sum_{j in K} exp2(s_ij)`` and
   ``E_iK ~ Exp(1)``: ``P(K_i = K) = Z_iK / sum_K' Z_iK'``;
2. the column inside the winning block, by Gumbel-max on its scores:
   ``j_i = argmax_{j in K_i} (s_ij - log2 E_ij)``: ``P(j_i = j | K_i) = exp2(s_ij) / Z_iK``;

so ``P(j_i = j) = exp2(s_ij) / sum_j' exp2(s_ij')``: exact draws (``s = log2e S``, base 2
as in the kernels). The first level is the streaming pass: one exp2 per score for the
blocks' sums (the tile of a pass IS a block), one noise per (row, block), a running
argmax; the second recomputes the 128 scores of one block per row (``N x 128`` scores:
1/400 of the pass at 50k). Against Gumbel-max on every score (the previous kernel: a hash
and two logs per score, 2.66x an iteration on the H100) the pass keeps one exp per score.

Why Gumbel-max inside the block and not an inverse-CDF pick with one uniform: a column
chunk (a rank's shard, :mod:`flashsinkhorn.distributed`) may cut a block in two. The
pieces' sums add up to the block's (step 1) and the largest perturbed score of the block is
the larger of the pieces' (step 2), so a sharded draw is the same draw as one process's (up
to the rounding of the scores), which an inverse CDF over the block would not be (its
target needs the whole block's sum before either piece can pick). :class:`DrawMerger`
assembles the pieces in column order.

The randomness is a counter-based hash of ``(seed, b, i)`` with the GLOBAL row index and
``j`` (step 2) or ``K`` (step 1) global column / block indices, so a draw depends only on
the problem and the seed: the same on every backend, tile configuration and number of ranks
(up to the rounding of the scores). Hash (integer arithmetic mod 2^32, the same in the
kernels, the torch path and the reference): per row ``rk_i = mix(mix(i ^ k0) + mix(b ^ k1))``,
per column ``ck_j = mix(mix(j ^ k1) ^ 0x68E31DA4)``, per block ``bk_K = mix(mix(K ^ k1) ^
0x2F6B3E55)`` (k0, k1 the seed's low and high 32 bits, ``mix`` Chris Wellons' lowbias32),
per pair ``r = ((rk ^ ck) * C1 ^ ... >> 15) * C2`` (lowbias32's multiplies and middle
xor-shift). ``W = fl32(r) 2^-32 + 2^-33`` (at most ``1 - 2^-24``) is uniform in (0, 1) with
32-bit resolution near 0, ``E = -ln(1 - W)``: the series ``W (1 + W/2 + W^2/3 + W^3/4 +
W^4/5)`` below ``W = 1/16`` (where ``1 - W`` cancels; truncation below 2e-7), the log above
(the reference: ``-log1p(-W)`` in float64).

- :func:`softmax_sample_ref`: the dense float64 reference;
- the Triton kernels: ``_sample_blocks_kernel`` (step 1, a running max per block: exact
  without a guess) and ``_sample_pick_kernel`` (step 2); on sm_90 step 1 runs the Gluon
  kernel of ``_sample_hopper`` (``backend="auto"``);
- :func:`softmax_sample`: the primitive (like :func:`flashsinkhorn.softmin`);
  :func:`sample_chunk` and :class:`DrawMerger`: the same over column chunks;
- :func:`sample_plan`: one target index per source point from a :func:`flashsinkhorn.solve`
  result, single-process or sharded over a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashsinkhorn import _config, _sample_hopper
from flashsinkhorn._sample_triton import blocks_triton, keys_triton, pick_triton, sample_operands
from flashsinkhorn.primitives import (
    block_rows,
    check_precision,
    resolve_backend,
    sm90_call,
    sm90_pass_reason,
)
from flashsinkhorn.reference import LN2, LOG2E

__all__ = [
    "softmax_sample",
    "softmax_sample_ref",
    "sample_chunk",
    "DrawMerger",
    "sample_plan",
    "sample_from_scores",
]

BLOCK = _config.SAMPLE_BLOCK  # columns per block of the first level (a pass's tile)
_M32 = 0xFFFFFFFF
_MIX1, _MIX2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_COL_SALT = 0x68E31DA4
_BLOCK_SALT = 0x2F6B3E55
_W_MAX = 1.0 - 2.0**-24  # the largest float32 below 1 (1 itself would give E = inf)


# ----------------------------------------------------------------------------------------
# the hash in torch (int64 tensors holding uint32 values) and the reference
# ----------------------------------------------------------------------------------------


def _mul32(x, c):
    """``x * c mod 2^32`` for int64 tensors of uint32 values, without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix_torch(x):
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX2)
    return x ^ (x >> 16)


def _seed_keys(seed) -> tuple[int, int]:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a nonnegative int; got {seed!r}")
    return seed & _M32, (seed >> 32) & _M32


def _row_keys(B, rows, k0, k1, device):
    """(B, len(rows)) int64: the per-row keys of global rows ``rows`` (int64 tensor)."""
    b = torch.arange(B, dtype=torch.int64, device=device)
    hb = _mix_torch(b ^ k1)[:, None]
    hi = _mix_torch((rows & _M32) ^ k0)[None, :]
    return _mix_torch((hi + hb) & _M32)


def _salted_keys(idx, k1, salt):
    """Column (salt _COL_SALT) or block (_BLOCK_SALT) keys of global indices ``idx``."""
    return _mix_torch(_mix_torch((idx & _M32) ^ k1) ^ salt)


def _log2_noise(row_keys, keys):
    """Gumbel noise in log2 units, ``-log2 E`` with ``E = -ln(1 - W) ~ Exp(1)`` (float64),
    of the pairs of ``row_keys`` and ``keys`` (int64 holding uint32, broadcast together; W
    as the kernels form it: the bits rounded to float32, times 2^-32, plus 2^-33)."""
    x = _mul32(row_keys ^ keys, _MIX1)
    x = x ^ (x >> 15)
    r = _mul32(x, _MIX2)
    w = r.to(torch.float32).to(torch.float64) * 2.0**-32 + 2.0**-33
    return -torch.log2(-torch.log1p(-w.clamp_max(_W_MAX)))


def _dense_scores(x, y, g, logb, cy, eps, c2, labels):
    """Natural-log scores ``logb_j + (g_j - cy_j + c2 <x_i, y_j> [- w W]) / eps`` (B, N, M)."""
    S = logb[..., None, :] + (g - cy)[..., None, :] / eps + (c2 / eps) * (x @ y.transpose(-1, -2))
    if labels is not None:
        lx, ly, W, w_scale = labels
        S = S - (w_scale / eps) * W.to(S.dtype)[lx.long()[..., :, None], ly.long()[..., None, :]]
    return S


def _layout(M: int, col_offset: int):
    """``(off, n_tiles, K0)``: tile t of a chunk of M columns starting at global column
    ``col_offset`` holds the local columns ``[t BLOCK - off, (t + 1) BLOCK - off)`` (those
    of global block K0 + t that the chunk has)."""
    off = col_offset % BLOCK
    return off, -(-(off + M) // BLOCK), col_offset // BLOCK


def _keys(B, N, M, seed, row_offset, col_offset, device):
    """Row keys (B, N), column keys (M,) and block keys (n_tiles,) of a chunk (int64
    tensors holding uint32)."""
    k0, k1 = _seed_keys(seed)
    rows = torch.arange(N, dtype=torch.int64, device=device) + row_offset
    cols = torch.arange(M, dtype=torch.int64, device=device) + col_offset
    _, n_tiles, K0 = _layout(M, col_offset)
    blocks = torch.arange(n_tiles, dtype=torch.int64, device=device) + K0
    return (
        _row_keys(B, rows, k0, k1, device),
        _salted_keys(cols, k1, _COL_SALT),
        _salted_keys(blocks, k1, _BLOCK_SALT),
    )


def _tiled(s, off, n_tiles):
    """(B, R, M) scores -> (B, R, n_tiles, BLOCK), -inf where a tile has no column."""
    B, R, M = s.shape
    out = s.new_full((B, R, n_tiles * BLOCK), float("-inf"))
    out[..., off : off + M] = s
    return out.view(B, R, n_tiles, BLOCK)


def _draw_dense(s2, rk, ck, bk, off, first_complete, last_complete):
    """Both levels on dense log2-unit scores ``s2`` (B, R, M) of a chunk: ``(val, col,
    lz_first, lz_last, pick)`` with ``val`` (B, R) the best complete block's perturbed
    LogSumExp, ``col`` its in-block pick (local column), ``lz_*`` the log2 sums of the
    first and last tile, and ``pick(tile (B, R) int64) -> (value, local column)`` the
    in-tile Gumbel-max of any tile (partial tiles of a split block)."""
    B, R, M = s2.shape
    n_tiles = bk.shape[0]
    t2 = _tiled(s2, off, n_tiles)
    lz = torch.logsumexp(t2 * LN2, dim=-1) / LN2  # (B, R, n_tiles); -inf for empty tiles
    val = lz + _log2_noise(rk[..., None], bk).to(lz.dtype)
    take = torch.ones(n_tiles, dtype=torch.bool, device=s2.device)
    take[0] &= first_complete
    take[-1] &= last_complete
    val = torch.where(take, val, torch.full_like(val, float("-inf")))
    best, tile = val.max(-1)  # ties: the first (smallest) tile

    def pick(t):
        cols = t[..., None] * BLOCK - off + torch.arange(BLOCK, device=s2.device)
        ok = (cols >= 0) & (cols < M)
        cc = cols.clamp(0, M - 1)
        v = torch.gather(s2, 2, cc) + _log2_noise(rk[..., None], ck[cc]).to(s2.dtype)
        v = torch.where(ok, v, torch.full_like(v, float("-inf")))
        pv, pj = v.max(-1)
        return pv, torch.gather(cols, 2, pj[..., None])[..., 0]

    return best, pick(tile)[1], lz[..., 0], lz[..., -1], pick


def softmax_sample_ref(
    x, y, g, logb, cy, *, eps, c2, seed, labels=None, row_offset=0, col_offset=0
):
    """Dense float64 reference of :func:`softmax_sample` (batched (B, ...) inputs, the
    columns one chunk whose first and last blocks are whole): int64 (B, N) global column
    indices (``col_offset + j``)."""
    d = torch.float64
    x, y, g, logb, cy = (t.to(d) for t in (x, y, g, logb, cy))
    lab = None if labels is None else (labels[0], labels[1], labels[2].to(d), labels[3])
    s2 = LOG2E * _dense_scores(x, y, g, logb, cy, eps, c2, lab)
    B, N, M = s2.shape
    rk, ck, bk = _keys(B, N, M, seed, row_offset, col_offset, x.device)
    off = col_offset % BLOCK
    return _draw_dense(s2, rk, ck, bk, off, True, True)[1] + col_offset


def sample_from_scores(scores2, seed):
    """The draw of :func:`softmax_sample` from dense scores ``scores2`` (B, N, M) in log2
    units (any per-row constant added: the draw ignores it), with the same blocks and hash:
    a dense backend's plan sampling. Row blocks bound the int64 hash temporaries."""
    B, N, M = scores2.shape
    rk, ck, bk = _keys(B, N, M, seed, 0, 0, scores2.device)
    out = torch.empty((B, N), dtype=torch.int64, device=scores2.device)
    rows = max(1, block_rows(N, M) // 4)
    for i0 in range(0, N, rows):
        i1 = min(N, i0 + rows)
        out[:, i0:i1] = _draw_dense(scores2[:, i0:i1], rk[:, i0:i1], ck, bk, 0, True, True)[1]
    return out


@dataclass
class ChunkDraw:
    """What one column chunk contributes to the rows' draws (see :class:`DrawMerger`):
    ``val``, ``col``: the best whole block's perturbed log2 sum and its in-block draw
    (global column; val -inf where the chunk has no whole block); ``head`` / ``tail``:
    ``(K, lz, value, col)`` of a piece of a block cut by the chunk's start / end (None
    where the chunk starts / ends on a block boundary); ``head_open``: the chunk lies
    inside one block and ends before it does (its head piece continues)."""

    val: torch.Tensor
    col: torch.Tensor
    head: tuple | None
    tail: tuple | None
    head_open: bool


class DrawMerger:
    """The rows' draws over column chunks given in global column order (a sharded pass):
    the pieces of a block cut by chunk boundaries are assembled (their log2 sums added,
    the larger in-block perturbed score kept) before the block competes, so the result is
    the draw of the whole row. ``rk``: the rows' keys (:func:`row_keys`), ``seed``."""

    def __init__(self, rk: torch.Tensor, seed: int):
        self.rk, self.k1 = rk.long() & _M32, _seed_keys(seed)[1]
        self.val = self.col = None
        self.pending = None

    def _offer(self, val, col):
        if self.val is None:
            self.val, self.col = val, col
        else:  # ties keep the earlier (smaller) column
            better = val > self.val
            self.val = torch.where(better, val, self.val)
            self.col = torch.where(better, col, self.col)

    def _close(self):
        K, lz, _, col = self.pending
        bk = _salted_keys(
            torch.tensor([K], dtype=torch.int64, device=lz.device), self.k1, _BLOCK_SALT
        )
        self._offer(lz + _log2_noise(self.rk, bk).to(lz.dtype), col)
        self.pending = None

    def add(self, d: ChunkDraw) -> None:
        if d.head is not None:
            K, lz, v, col = d.head
            if self.pending is None:
                self.pending = d.head
            else:
                K0, lz0, v0, col0 = self.pending
                if K0 != K:
                    raise ValueError(f"DrawMerger: chunks out of order (block {K0}, then {K})")
                better = v > v0
                self.pending = (
                    K,
                    torch.logaddexp2(lz0, lz),
                    torch.where(better, v, v0),
                    torch.where(better, col, col0),
                )
            if not d.head_open:
                self._close()
        elif self.pending is not None:
            self._close()
        self._offer(d.val, d.col)
        if d.tail is not None:
            self.pending = d.tail

    def result(self):
        """``(col (B, N) int64 global, val (B, N))`` of every row."""
        if self.pending is not None:
            self._close()
        return self.col, self.val


def sample_chunk(
    x,
    y,
    g,
    logb,
    cy,
    *,
    eps,
    c2,
    seed,
    labels=None,
    precision="tf32",
    backend="auto",
    row_offset=0,
    col_offset=0,
    first_complete=True,
    last_complete=True,
    guess=None,
    config=None,
) -> ChunkDraw:
    """Both levels of the draw over one chunk of columns (arguments as
    :func:`softmax_sample`). ``first_complete`` / ``last_complete``: whether the chunk's
    first / last block is whole here (False where another chunk holds the rest of it: its
    piece is returned for :class:`DrawMerger`). ``guess``: optional (B, N) estimate of
    ``-eps ln sum_j exp(S_ij)`` (the sm_90 pass's fixed shift; exact whatever it is)."""
    if x.dim() != 3 or y.dim() != 3 or y.shape[0] != x.shape[0] or y.shape[2] != x.shape[2]:
        raise ValueError(
            f"x must be (B, N, D) and y (B, M, D); got {tuple(x.shape)}, {tuple(y.shape)}"
        )
    B, N, M = x.shape[0], x.shape[1], y.shape[1]
    for name, t in (("g", g), ("logb", logb), ("cy", cy)):
        if tuple(t.shape) != (B, M):
            raise ValueError(f"{name} must be ({B}, {M}); got {tuple(t.shape)}")
    if guess is not None and tuple(guess.shape) != (B, N):
        raise ValueError(f"guess must be ({B}, {N}); got {tuple(guess.shape)}")
    if not (eps > 0):
        raise ValueError(f"eps must be positive; got {eps}")
    if M == 0:
        raise ValueError("sample_chunk needs at least one column")
    be = resolve_backend(backend, x.device)
    check_precision(precision, be)  # bf16 under the interpreter is refused
    off, n_tiles, K0 = _layout(M, col_offset)
    one_open = n_tiles == 1 and not first_complete and not last_complete
    extra = ([0] if not first_complete else []) + (
        [n_tiles - 1] if not last_complete and not one_open else []
    )
    if be == "triton":
        rk, ck, bk = keys_triton(
            B, N, M, *_seed_keys(seed), row_offset, col_offset, K0, n_tiles, x.device
        )
        ops = sample_operands(x, y, g, logb, cy, eps, labels, precision)
        res = None
        if (
            backend == "auto"
            and labels is None
            and sm90_pass_reason(ops[0], ops[1], precision) is None
        ):
            res = sm90_call(
                f"sample d={x.shape[2]} {precision}",
                _sample_hopper.sample_blocks_hopper,
                ops[0],
                ops[1],
                ops[2],
                rk,
                bk,
                eps=eps,
                c2=c2,
                precision=precision,
                off=off,
                first_in=first_complete,
                last_in=last_complete,
                guess=guess,
            )
        if res is None:
            res = blocks_triton(
                ops, eps, c2, precision, rk, bk, off, first_complete, last_complete, config
            )
        val, tile, lz0, lzl = res
        tiles = torch.stack([tile.int()] + [torch.full_like(tile, t) for t in extra], -1)
        tiles[..., 0] = torch.where(val == float("-inf"), -1, tiles[..., 0])
        pv, pj = pick_triton(ops, eps, c2, rk, ck, tiles.int(), off)
        best_col = pj[..., 0]
        pieces = [(pv[..., k + 1], pj[..., k + 1]) for k in range(len(extra))]
    else:
        rk, ck, bk = _keys(B, N, M, seed, row_offset, col_offset, x.device)
        val, best_col, lz0, lzl, pieces = _sample_torch(
            x,
            y,
            g,
            logb,
            cy,
            eps,
            c2,
            labels,
            rk,
            ck,
            bk,
            off,
            first_complete,
            last_complete,
            extra,
        )
    head = tail = None
    k = 0
    if not first_complete:
        head = (K0, lz0, pieces[0][0], pieces[0][1] + col_offset)
        k = 1
    if not last_complete and not one_open:
        tail = (K0 + n_tiles - 1, lzl, pieces[k][0], pieces[k][1] + col_offset)
    return ChunkDraw(val, best_col + col_offset, head, tail, one_open)


def _sample_torch(x, y, g, logb, cy, eps, c2, labels, rk, ck, bk, off, first_in, last_in, extra):
    """Blockwise torch path (row blocks against all columns) of :func:`sample_chunk`."""
    B, N, _ = x.shape
    M = y.shape[1]
    dt = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    x, y, g, logb, cy = (t.to(dt) for t in (x, y, g, logb, cy))
    out = [torch.empty((B, N), dtype=dt, device=x.device) for _ in range(3)]
    col = torch.empty((B, N), dtype=torch.int64, device=x.device)
    pieces = [
        (torch.empty((B, N), dtype=dt, device=x.device), torch.empty_like(col)) for _ in extra
    ]
    rows = max(1, block_rows(N, M) // 4)  # the int64 hash temporaries
    for i0 in range(0, N, rows):
        i1 = min(N, i0 + rows)
        lab = None if labels is None else (labels[0][:, i0:i1], labels[1], labels[2], labels[3])
        s2 = LOG2E * _dense_scores(x[:, i0:i1], y, g, logb, cy, eps, c2, lab)
        best, c, lz0, lzl, pick = _draw_dense(s2, rk[:, i0:i1], ck, bk, off, first_in, last_in)
        out[0][:, i0:i1], out[1][:, i0:i1], out[2][:, i0:i1], col[:, i0:i1] = best, lz0, lzl, c
        for (pv, pj), t in zip(pieces, extra):
            pv[:, i0:i1], pj[:, i0:i1] = pick(torch.full_like(c, t))
    return out[0], col, out[1], out[2], pieces


def softmax_sample(
    x: torch.Tensor,
    y: torch.Tensor,
    g: torch.Tensor,
    logb: torch.Tensor,
    cy: torch.Tensor,
    *,
    eps: float,
    c2: float,
    seed: int,
    labels: tuple | None = None,
    precision: str = "tf32",
    backend: str = "auto",
    row_offset: int = 0,
    col_offset: int = 0,
    return_score: bool = False,
    guess: torch.Tensor | None = None,
    config: tuple | None = None,
):
    """One column per row drawn from the row softmax of the scores, streaming.

    For every row i, ``j_i ~ softmax_j(logb_j + (g_j - cy_j + c2 <x_i, y_j> [- w W]) / eps)``
    (the rows of the plan for a squared-Euclidean or dot cost, see :func:`sample_plan`):
    Gumbel-max over blocks of 128 columns, then over the winning block's columns, with a
    counter-based hash of ``(seed, b, row_offset + i, col_offset + j)`` (module docstring).

    Args:
        x: (B, N, D) rows, y: (B, M, D) columns (already centered, as
            :func:`flashsinkhorn.softmin`'s operands). g, logb, cy: (B, M).
        eps, c2, labels, precision, backend: as in :func:`flashsinkhorn.softmin`.
        seed: a nonnegative int (its low 64 bits are used).
        row_offset, col_offset: global index of the first row / column (the columns given
            are all there is: to combine column chunks use :func:`sample_chunk`).
        return_score: also return the winning block's perturbed log2 sum (B, N).
        guess: optional (B, N) estimate of ``-eps ln sum_j exp(S_ij)`` (on sm_90 the pass's
            fixed shift; exact whatever it is).
        config: force one Triton tile config of the first level (tests).

    Returns:
        int64 (B, N) global column indices, or ``(indices, score)``.
    """
    d = sample_chunk(
        x,
        y,
        g,
        logb,
        cy,
        eps=eps,
        c2=c2,
        seed=seed,
        labels=labels,
        precision=precision,
        backend=backend,
        row_offset=row_offset,
        col_offset=col_offset,
        guess=guess,
        config=config,
    )
    return (d.col, d.val) if return_score else d.col


def row_keys(B: int, N: int, seed: int, row_offset: int, device) -> torch.Tensor:
    """The rows' keys (B, N) (int64 holding uint32) for :class:`DrawMerger`."""
    k0, k1 = _seed_keys(seed)
    rows = torch.arange(N, dtype=torch.int64, device=device) + row_offset
    return _row_keys(B, rows, k0, k1, device)


def sample_plan(result, *, seed: int = 0) -> torch.Tensor:
    """For every source point x_i, one target index ``j ~ P_ij / sum_j P_ij`` from the
    entropic plan of a :func:`flashsinkhorn.solve` result: int64 of shape (N,) (or (B, N)).

    Seeded and reproducible: the draw is a function of the plan and ``seed`` only (global
    indices), so a result sharded over a process group gives the same indices as one
    process (up to the rounding of the scores); there each rank gets its own rows' draws,
    indices into the global (rank-ordered) y. Pairs for OT flow matching:
    ``(x_i, y[sample_plan(r)[i]])`` (sharded: :func:`flashsinkhorn.distributed.gather_rows`).
    One streaming pass and a pass over one block of 128 columns per row.
    """
    # every backend supplies the draw (the sharded problem streams the other ranks'
    # columns); f - cx estimates the rows' -eps LogSumExp of the scores (exact at a balanced
    # fixed point): the sm_90 pass's fixed shift, exact whatever it is
    p = result._prob
    guess = (result._f - p.cx).float()
    idx = p.sample_rows(result._g, result.eps, seed, guess=guess)
    return result._unb(idx)
