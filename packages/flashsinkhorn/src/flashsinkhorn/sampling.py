"""Plan sampling: for every row (source point) one column (target index) drawn from its row
of the entropic plan, by Gumbel-max inside the streaming pass. No n x m matrix is formed.

Row i of the plan ``P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)``, normalized, is the row
softmax of the scores ``S_ij = log b_j + (g_j - C_ij) / eps`` (f_i and a_i are constant
along the row, so only g, b and the cost matter). Gumbel-max draws from it exactly:

    j_i = argmax_j ( S_ij + G_ij ),   G_ij = -ln E_ij,   E_ij ~ Exp(1) i.i.d.

computed in the kernels' base-2 units as ``argmax_j (log2e S_ij - log2 E_ij)`` (the same
argmax, times log2e). The randomness is a counter-based hash of ``(seed, b, i, j)`` with the
GLOBAL row and column indices, so a draw depends only on the problem and the seed: the same
on any backend, with any tile config, and for any number of ranks
(:mod:`flashsinkhorn.distributed` passes each shard's offsets), up to the rounding of the
scores.

The hash (integer arithmetic mod 2^32, the same in the kernel, the torch path and the
reference): per row ``rk_i = mix(mix(i ^ k0) + mix(b ^ k1))``, per column
``ck_j = mix(mix(j ^ k1) ^ 0x68E31DA4)`` (computed once per call in torch, O(N + M)), with
``k0, k1`` the seed's low and high 32 bits and ``mix`` Chris Wellons' ``lowbias32``; per score
``r_ij = ((rk_i ^ ck_j) * C1 ^ ... >> 15) * C2`` (lowbias32's two multiplies and middle
xor-shift: the inputs are already hashed). ``W_ij = fl32(r_ij) 2^-32 + 2^-33`` (at most
``1 - 2^-24``) is uniform in (0, 1), with 32-bit resolution near 0, and
``E_ij = -ln(1 - W_ij)``. The winners of the argmax have large noise, i.e. small E, where
``1 - W`` cancels: the kernel takes the series ``W (1 + W/2 + W^2/3 + W^3/4 + W^4/5)`` for
``W < 1/16`` (truncation below 2e-7) and the special-function log above (its 2^-22 absolute
error is at most 2.6e-6 of E); the reference takes ``-log1p(-W)`` in float64. Resolution: a
row whose mass spreads over about K columns is drawn with probabilities exact to about
``K 2^-32`` (relative), besides the rounding of its scores.

- :func:`softmax_sample_ref`: the dense float64 reference;
- ``_softmax_sample_kernel`` and its launcher: the streaming Triton pass;
- :func:`softmax_sample`: the primitive (like :func:`flashsinkhorn.softmin`), both backends;
- :func:`sample_plan`: one target index per source point from a :func:`flashsinkhorn.solve`
  result, single-process or sharded over a process group.
"""

from __future__ import annotations

import torch

from flashsinkhorn import _config
from flashsinkhorn._softmin_triton import (
    HAS_TRITON,
    _block_d,
    _bucket,
    _device,
    _label_operands,
    _pick,
    _triton_configs,
)
from flashsinkhorn.primitives import _block_rows, check_precision, resolve_backend
from flashsinkhorn.reference import LOG2E

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from flashsinkhorn._softmin_triton import _load_rows, _row_stationary_dot, _tile_scores

__all__ = ["softmax_sample", "softmax_sample_ref", "sample_plan", "sample_from_scores"]

_M32 = 0xFFFFFFFF
_MIX1, _MIX2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_COL_SALT = 0x68E31DA4
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


def _col_keys(cols, k1):
    return _mix_torch(_mix_torch((cols & _M32) ^ k1) ^ _COL_SALT)


def _score_bits(row_keys, col_keys):
    """``r_ij`` (B, R, C) int64 holding uint32, from row keys (B, R) and column keys (C,)."""
    x = row_keys[:, :, None] ^ col_keys[None, None, :]
    x = _mul32(x, _MIX1)
    x = x ^ (x >> 15)
    return _mul32(x, _MIX2)


def _log2_noise(row_keys, col_keys):
    """Gumbel noise in log2 units, ``-log2 E`` with ``E = -ln(1 - W) ~ Exp(1)``, (B, R, C)
    float64 (W as the kernel forms it: r rounded to float32, times 2^-32, plus 2^-33)."""
    r = _score_bits(row_keys, col_keys)
    w = r.to(torch.float32).to(torch.float64) * 2.0**-32 + 2.0**-33
    w = w.clamp_max(_W_MAX)
    return -torch.log2(-torch.log1p(-w))


def _dense_scores(x, y, g, logb, cy, eps, c2, labels):
    """Natural-log scores ``logb_j + (g_j - cy_j + c2 <x_i, y_j> [- w W]) / eps`` (B, N, M)."""
    S = logb[..., None, :] + (g - cy)[..., None, :] / eps + (c2 / eps) * (x @ y.transpose(-1, -2))
    if labels is not None:
        lx, ly, W, w_scale = labels
        S = S - (w_scale / eps) * W.to(S.dtype)[lx.long()[..., :, None], ly.long()[..., None, :]]
    return S


def softmax_sample_ref(x, y, g, logb, cy, *, eps, c2, seed, labels=None, row_offset=0,
                       col_offset=0):  # fmt: skip
    """Dense float64 reference of :func:`softmax_sample` (batched (B, ...) inputs): the
    argmax over j of ``log2e S_ij - log2 E_ij``. Returns int64 (B, N) global column
    indices (``col_offset + j``)."""
    d = torch.float64
    x, y, g, logb, cy = (t.to(d) for t in (x, y, g, logb, cy))
    lab = None if labels is None else (labels[0], labels[1], labels[2].to(d), labels[3])
    S = _dense_scores(x, y, g, logb, cy, eps, c2, lab)
    B, N, M = S.shape
    rk, ck = _keys(B, N, M, seed, row_offset, col_offset, x.device)
    val = LOG2E * S + _log2_noise(rk, ck)
    return val.argmax(-1) + col_offset


def _keys(B, N, M, seed, row_offset, col_offset, device):
    """Row keys (B, N) and column keys (M,) (int64 holding uint32) of a call."""
    k0, k1 = _seed_keys(seed)
    rows = torch.arange(N, dtype=torch.int64, device=device) + row_offset
    cols = torch.arange(M, dtype=torch.int64, device=device) + col_offset
    return _row_keys(B, rows, k0, k1, device), _col_keys(cols, k1)


def _sample_torch(x, y, g, logb, cy, eps, c2, labels, rk, ck):
    """Blockwise torch path (row blocks against all columns): ``(best (B, N), j (B, N))``,
    best in log2 units, j local column indices (int64)."""
    B, N, _ = x.shape
    M = y.shape[1]
    dt = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    x, y, g, logb, cy = (t.to(dt) for t in (x, y, g, logb, cy))
    dev = x.device
    best = torch.empty((B, N), dtype=dt, device=dev)
    arg = torch.empty((B, N), dtype=torch.int64, device=dev)
    rows = max(1, _block_rows(N, M) // 4)  # the int64 hash temporaries are 4 x the scores
    for i0 in range(0, N, rows):
        i1 = min(N, i0 + rows)
        lab = None
        if labels is not None:
            lx, ly, W, w_scale = labels
            lab = (lx[:, i0:i1], ly, W, w_scale)
        S = _dense_scores(x[:, i0:i1], y, g, logb, cy, eps, c2, lab)
        val = LOG2E * S + _log2_noise(rk[:, i0:i1], ck).to(dt)
        best[:, i0:i1], arg[:, i0:i1] = val.max(-1)
    return best, arg


def sample_from_scores(scores2, seed):
    """The draw of :func:`softmax_sample` from dense scores ``scores2`` (B, N, M) in log2
    units (any per-row constant added: the argmax ignores it), with the same hash: the
    dense backend's plan sampling. Row blocks bound the int64 hash temporaries."""
    B, N, M = scores2.shape
    rk, ck = _keys(B, N, M, seed, 0, 0, scores2.device)
    out = torch.empty((B, N), dtype=torch.int64, device=scores2.device)
    rows = max(1, _block_rows(N, M) // 4)
    for i0 in range(0, N, rows):
        i1 = min(N, i0 + rows)
        noise = _log2_noise(rk[:, i0:i1], ck).to(scores2.dtype)
        out[:, i0:i1] = (scores2[:, i0:i1] + noise).argmax(-1)
    return out


# ----------------------------------------------------------------------------------------
# the Triton kernel
# ----------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _log2(x, FAST: tl.constexpr):
        """log2 on the special-function unit (lg2.approx) on the GPU; the interpreter has no
        libdevice (tl.log2)."""
        if FAST:
            return libdevice.fast_log2f(x)
        return tl.log2(x)

    @triton.jit
    def _exp_log2(rk, ck, FAST: tl.constexpr):
        """``log2 E`` (minus the Gumbel noise in log2 units) for row keys rk (BLOCK_M,) and column
        keys ck (BLOCK_N,) (uint32): the per-score hash, W, ``E = -ln(1 - W)``."""
        x = rk[:, None] ^ ck[None, :]
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        r = x * 0x846CA68B
        w = tl.minimum(r.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10,
                       0.99999994039535522)  # fmt: skip
        series = w * (1.0 + w * (0.5 + w * (0.33333333 + w * (0.25 + w * 0.2))))
        logged = -0.69314718055994531 * _log2(1.0 - w, FAST)
        e = tl.where(w < 0.0625, series, logged)
        return _log2(e, FAST)

    @triton.jit
    def _softmax_sample_kernel(
        X, Y, BIAS, LX, LY, W, RK, CK, BEST, ARG,
        N, M, D, K2, N_KEY, M_KEY,
        dot_scale, inv_eps2, w_scale,
        BLOCK_D: tl.constexpr, NUM_D: tl.constexpr, EVEN_D: tl.constexpr,
        HAS_LABELS: tl.constexpr, PREC: tl.constexpr, FAST_LOG2: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # RK (B, N), CK (M,): the row and column keys (int32 bits of the uint32 keys)
        pid_m = tl.program_id(0)
        pid_b64 = tl.program_id(1).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < N
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        Xb = X + pid_b64 * N * D
        Yb = Y + pid_b64 * M * D
        BIASb = BIAS + pid_b64 * M
        LYb = LY + pid_b64 * M

        x0 = rows  # placeholder, read only with one feature chunk
        if NUM_D == 1:
            x0 = _load_rows(Xb, rows, row_mask, offs_d, D, D, EVEN_D)
        lx = rows  # placeholder, read only with labels
        if HAS_LABELS:
            lx = tl.load(LX + pid_b64 * N + rows, mask=row_mask, other=0)
        rk = tl.load(RK + pid_b64 * N + rows, mask=row_mask, other=0).to(tl.uint32)

        # the running best per (row, tile slot) and its column; reduced over slots at the end
        best = tl.full((BLOCK_M, BLOCK_N), float("-inf"), dtype=tl.float32)
        arg = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for start in range(0, M, BLOCK_N):
            cols = start + offs_n
            col_mask = cols < M
            s = _row_stationary_dot(
                x0, Xb, Yb, rows, cols, row_mask, col_mask, D,
                NUM_D, EVEN_D, BLOCK_D, PREC, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            s = _tile_scores(
                s, BIASb, LYb, W, lx, cols, row_mask, col_mask, K2,
                dot_scale, inv_eps2, w_scale, HAS_LABELS,
            )  # fmt: skip
            ck = tl.load(CK + cols, mask=col_mask, other=0).to(tl.uint32)
            val = s - _exp_log2(rk, ck, FAST_LOG2)  # masked columns stay -inf
            better = val > best  # ties keep the earlier tile (the smaller j)
            best = tl.where(better, val, best)
            arg = tl.where(better, cols[None, :], arg)
        row_best = tl.max(best, 1)
        # the smallest column among the slots that hold the row's best (0 for a row of -inf)
        big = tl.full((BLOCK_M, BLOCK_N), 2147483647, dtype=tl.int32)
        row_arg = tl.min(tl.where(best == row_best[:, None], arg, big), 1)
        row_arg = tl.where(row_best == float("-inf"), 0, row_arg)
        tl.store(BEST + pid_b64 * N + rows, row_best, mask=row_mask)
        tl.store(ARG + pid_b64 * N + rows, row_arg, mask=row_mask)

    @triton.jit
    def _mix(x):
        """lowbias32 on uint32 tensors (wraps mod 2^32), as ``_mix_torch``."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _keys_kernel(RK, CK, ARGS, N, M, BLOCK: tl.constexpr):
        """Row keys (B, N) (program axis 1: the batch) and column keys (M,) of a call, one
        launch (the torch version is ~100 small kernels). ARGS (int64): row offset, column
        offset, seed low, seed high (a tensor: no specialization per value)."""
        pid = tl.program_id(0)
        b = tl.program_id(1)
        row0, col0 = tl.load(ARGS), tl.load(ARGS + 1)
        k0, k1 = tl.load(ARGS + 2).to(tl.uint32), tl.load(ARGS + 3).to(tl.uint32)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        hb = _mix(b.to(tl.uint32) ^ k1)
        rk = _mix(_mix((row0 + offs).to(tl.uint32) ^ k0) + hb)
        tl.store(RK + b.to(tl.int64) * N + offs, rk.to(tl.int32, bitcast=True), mask=offs < N)
        if b == 0:
            ck = _mix(_mix((col0 + offs).to(tl.uint32) ^ k1) ^ 0x68E31DA4)
            tl.store(CK + offs, ck.to(tl.int32, bitcast=True), mask=offs < M)

    _softmax_sample_tuned = triton.autotune(
        configs=_triton_configs(_config.SAMPLE_TUNE),
        key=["N_KEY", "M_KEY", "D", "HAS_LABELS", "PREC"],
    )(_softmax_sample_kernel)


def _keys_triton(B, N, M, seed, row_offset, col_offset, device):
    """:func:`_keys` in one Triton launch: int32 tensors holding the uint32 bits."""
    k0, k1 = _seed_keys(seed)
    args = torch.tensor([row_offset, col_offset, k0, k1], dtype=torch.int64, device=device)
    rk = torch.empty((B, N), dtype=torch.int32, device=device)
    ck = torch.empty((M,), dtype=torch.int32, device=device)
    block = 1024
    with _device(rk):
        _keys_kernel[(triton.cdiv(max(N, M), block), B)](rk, ck, args, N, M, BLOCK=block)
    return rk, ck


def _sample_triton(x, y, g, logb, cy, eps, c2, labels, precision, rk, ck, config=None):
    """The Triton pass: ``(best (B, N) fp32, j (B, N) int64 local)``. ``rk`` (B, N), ``ck``
    (M,): the keys (int32 tensors holding the uint32 bits, :func:`_keys_triton`);
    ``config`` forces one ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``."""
    B, N, D = x.shape
    M = y.shape[1]
    f32 = torch.float32
    kdt = torch.bfloat16 if precision == "bf16" else f32
    prec = "tf32" if precision == "bf16" else precision
    x = x.to(kdt).contiguous()
    y = y.to(kdt).contiguous()
    bias = torch.sub(g.to(f32), cy.to(f32)).mul_(LOG2E / eps).add_(logb.to(f32), alpha=LOG2E)
    bias = bias.contiguous()
    best = torch.empty((B, N), device=x.device, dtype=f32)
    arg = torch.empty((B, N), device=x.device, dtype=torch.int32)
    BLOCK_D, NUM_D = _block_d(D)
    if labels is not None:
        lx, ly, W, w_scale = labels
        lx, ly, W, K2 = _label_operands(lx, ly, W)
    else:
        lx = ly = W = best  # placeholders, never read
        K2, w_scale = 1, 0.0
    kern, cfg = _pick(_softmax_sample_tuned, _softmax_sample_kernel, config)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B)  # noqa: E731
    with _device(x):
        kern[grid](
            x, y, bias, lx, ly, W, rk, ck, best, arg, N, M, D, K2,
            _bucket(N), _bucket(M),
            float(c2 * LOG2E / eps), float(LOG2E / eps), float(w_scale),
            BLOCK_D=BLOCK_D, NUM_D=NUM_D, EVEN_D=BLOCK_D * NUM_D == D,
            HAS_LABELS=labels is not None, PREC=prec, FAST_LOG2=not _config.interpret(), **cfg,
        )  # fmt: skip
    return best, arg.long()


# ----------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------


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
    config: tuple | None = None,
):
    """One column per row drawn from the row softmax of the scores, streaming.

    For every row i, ``j_i ~ softmax_j(logb_j + (g_j - cy_j + c2 <x_i, y_j> [- w W]) / eps)``
    (the rows of the plan for a squared-Euclidean or dot cost, see :func:`sample_plan`), by
    Gumbel-max with a counter-based hash of ``(seed, b, row_offset + i, col_offset + j)``.

    Args:
        x: (B, N, D) rows, y: (B, M, D) columns (already centered, as
            :func:`flashsinkhorn.softmin`'s operands). g, logb, cy: (B, M).
        eps, c2, labels, precision, backend: as in :func:`flashsinkhorn.softmin`.
        seed: a nonnegative int (its low 64 bits are used).
        row_offset, col_offset: global index of the first row / column (sharded problems).
        return_score: also return the winning perturbed score (B, N) in log2 units (to
            merge draws over column chunks: the larger score wins).
        config: force one Triton tile config (tests).

    Returns:
        int64 (B, N) global column indices, or ``(indices, score)``.
    """
    if x.dim() != 3 or y.dim() != 3 or y.shape[0] != x.shape[0] or y.shape[2] != x.shape[2]:
        raise ValueError(f"x must be (B, N, D) and y (B, M, D); got {tuple(x.shape)}, "
                         f"{tuple(y.shape)}")  # fmt: skip
    B, M = y.shape[0], y.shape[1]
    for name, t in (("g", g), ("logb", logb), ("cy", cy)):
        if tuple(t.shape) != (B, M):
            raise ValueError(f"{name} must be ({B}, {M}); got {tuple(t.shape)}")
    if not (eps > 0):
        raise ValueError(f"eps must be positive; got {eps}")
    be = resolve_backend(backend, x.device)
    check_precision(precision, be)  # bf16 under the interpreter is refused
    if be == "triton":
        rk, ck = _keys_triton(B, x.shape[1], M, seed, row_offset, col_offset, x.device)
        best, arg = _sample_triton(x, y, g, logb, cy, eps, c2, labels, precision, rk, ck, config)
    else:
        rk, ck = _keys(B, x.shape[1], M, seed, row_offset, col_offset, x.device)
        best, arg = _sample_torch(x, y, g, logb, cy, eps, c2, labels, rk, ck)
    idx = arg + col_offset
    return (idx, best) if return_score else idx


def sample_plan(result, *, seed: int = 0) -> torch.Tensor:
    """For every source point x_i, one target index ``j ~ P_ij / sum_j P_ij`` from the
    entropic plan of a :func:`flashsinkhorn.solve` result: int64 of shape (N,) (or (B, N)).

    Seeded and reproducible: the draw is a function of the plan and ``seed`` only (global
    indices), so a result sharded over a process group gives the same indices as one
    process (up to the rounding of the scores); there each rank gets its own rows' draws,
    indices into the global (rank-ordered) y. Pairs for OT flow matching:
    ``(x_i, y[sample_plan(r)[i]])`` (sharded: :func:`flashsinkhorn.distributed.gather_rows`).
    One streaming pass (the row pass with a running argmax), no N x M matrix.
    """
    # every backend supplies the draw (the sharded problem streams the other ranks' columns)
    idx = result._prob.sample_rows(result._g, result.eps, seed)
    return result._unb(idx)
