"""The Triton kernels of plan sampling and their launchers (the math, the reference and
the public functions are in :mod:`flashsinkhorn.sampling`).

- ``_sample_blocks_kernel``: the first level, one streaming pass: per row and block of 128
  global columns (a tile) the block's log2 sum (each tile its own max: exact without a
  guess), perturbed by the block's Gumbel noise, the running best and its tile;
- ``_sample_pick_kernel``: the second level, per row the Gumbel-max over one tile's columns
  (the winning block, or a piece of a block cut by a chunk boundary);
- ``_keys_kernel``: the row, column and block keys of a call in one launch.
"""

from __future__ import annotations

import torch

from flashsinkhorn import _config
from flashsinkhorn._triton_tiles import (
    HAS_TRITON,
    _block_d,
    _bucket,
    _device,
    _label_operands,
    _pick,
    _triton_configs,
)
from flashsinkhorn.reference import LOG2E

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flashsinkhorn._triton_tiles import _load_rows, _row_stationary_dot, _tile_scores

__all__ = ["keys_triton", "sample_operands", "blocks_triton", "pick_triton"]

BLOCK = _config.SAMPLE_BLOCK


if HAS_TRITON:

    @triton.jit
    def _log2_exp(x):
        """``log2 E`` (minus the Gumbel noise in log2 units) for pair keys ``x = rk ^ k``
        (uint32, any shape): the pair hash, W, ``E = -ln(1 - W)``. tl.log2 (exact to fp32):
        a few per (row, block) and 128 per row in the pick, not per score of the pass."""
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        r = x * 0x846CA68B
        w = tl.minimum(
            r.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10, 0.99999994039535522
        )
        series = w * (1.0 + w * (0.5 + w * (0.33333333 + w * (0.25 + w * 0.2))))
        logged = -0.69314718055994531 * tl.log2(1.0 - w)
        return tl.log2(tl.where(w < 0.0625, series, logged))

    @triton.jit
    def _sample_blocks_kernel(
        X,
        Y,
        BIAS,
        LX,
        LY,
        W,
        RK,
        BK,
        VAL,
        TILE,
        LZ0,
        LZL,
        N,
        M,
        D,
        K2,
        N_KEY,
        M_KEY,
        off,
        n_tiles,
        first_in,
        last_in,
        dot_scale,
        inv_eps2,
        w_scale,
        BLOCK_D: tl.constexpr,
        NUM_D: tl.constexpr,
        EVEN_D: tl.constexpr,
        HAS_LABELS: tl.constexpr,
        PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # step 1: per row the best block (perturbed log2 sum), the first and last tiles'
        # log2 sums. RK (B, N), BK (n_tiles,): row and block keys (int32 bits of uint32).
        # A tile is a block (BLOCK_N == BLOCK); each tile's sum takes its own max: exact.
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
        best = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        tile = tl.zeros((BLOCK_M,), dtype=tl.int32)
        lz0 = best
        lz = best
        for t in range(0, n_tiles):
            cols = t * BLOCK_N - off + offs_n
            col_mask = (cols >= 0) & (cols < M)
            s = _row_stationary_dot(
                x0,
                Xb,
                Yb,
                rows,
                cols,
                row_mask,
                col_mask,
                D,
                NUM_D,
                EVEN_D,
                BLOCK_D,
                PREC,
                BLOCK_M,
                BLOCK_N,
            )
            s = _tile_scores(
                s,
                BIASb,
                LYb,
                W,
                lx,
                cols,
                row_mask,
                col_mask,
                K2,
                dot_scale,
                inv_eps2,
                w_scale,
                HAS_LABELS,
            )
            m = tl.max(s, 1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            l_t = tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            lz = m_safe + tl.log2(l_t)  # -inf for a tile without mass
            bk = tl.load(BK + t).to(tl.uint32)
            val = lz - _log2_exp(rk ^ bk)
            take = ((t > 0) | (first_in != 0)) & ((t < n_tiles - 1) | (last_in != 0))
            better = (val > best) & take  # ties keep the earlier block
            best = tl.where(better, val, best)
            tile = tl.where(better, t, tile)
            lz0 = tl.where(t == 0, lz, lz0)
        tl.store(VAL + pid_b64 * N + rows, best, mask=row_mask)
        tl.store(TILE + pid_b64 * N + rows, tile, mask=row_mask)
        tl.store(LZ0 + pid_b64 * N + rows, lz0, mask=row_mask)
        tl.store(LZL + pid_b64 * N + rows, lz, mask=row_mask)

    @triton.jit
    def _sample_pick_kernel(
        X,
        Y,
        BIAS,
        LX,
        LY,
        W,
        RK,
        CK,
        TILES,
        PV,
        PJ,
        N,
        M,
        D,
        K2,
        S,
        off,
        dot_scale,
        inv_eps2,
        w_scale,
        HAS_LABELS: tl.constexpr,
        BLOCK_D: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # step 2: for each of ROWS rows and each of its S tiles (TILES (B, N, S), -1: none)
        # the Gumbel-max over the tile's columns: PV (value, log2 units), PJ (local column).
        # Each row has its own tile: the (ROWS, BLOCK_N, BLOCK_D) gathers of y are L2 hits
        # at the benchmark sizes (y of 50k x 64 fp32 is 12.8 MB)
        pid = tl.program_id(0)
        pid_b64 = tl.program_id(1).to(tl.int64)
        rows = pid * ROWS + tl.arange(0, ROWS)
        rmask = rows < N
        rix = pid_b64 * N + rows
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        rk = tl.load(RK + rix, mask=rmask, other=0).to(tl.uint32)
        lxi = rows  # placeholder, read only with labels
        if HAS_LABELS:
            lxi = tl.load(LX + rix, mask=rmask, other=0)
        for s in range(0, S):
            t = tl.load(TILES + rix * S + s, mask=rmask, other=-1)
            cols = t[:, None] * BLOCK_N - off + offs_n[None, :]  # (ROWS, BLOCK_N)
            cm = (cols >= 0) & (cols < M) & (t >= 0)[:, None]
            acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                dd = d0 + offs_d
                xi = tl.load(
                    X + rix[:, None] * D + dd[None, :],
                    mask=rmask[:, None] & (dd[None, :] < D),
                    other=0.0,
                )
                yt = tl.load(
                    Y + (pid_b64 * M + cols[:, :, None]) * D + dd[None, None, :],
                    mask=cm[:, :, None] & (dd[None, None, :] < D),
                    other=0.0,
                )
                acc += tl.sum(yt.to(tl.float32) * xi.to(tl.float32)[:, None, :], 2)
            v = acc * dot_scale + tl.load(BIAS + pid_b64 * M + cols, mask=cm, other=0.0)
            if HAS_LABELS:
                ly = tl.load(LY + pid_b64 * M + cols, mask=cm, other=0)
                wv = tl.load(W + lxi[:, None] * K2 + ly, mask=cm, other=0.0)
                v = v - (w_scale * inv_eps2) * wv
            ck = tl.load(CK + cols, mask=cm, other=0).to(tl.uint32)
            v = v - _log2_exp(rk[:, None] ^ ck)
            v = tl.where(cm, v, float("-inf"))
            vmax = tl.max(v, 1)
            big = tl.full((ROWS, BLOCK_N), 2147483647, dtype=tl.int32)
            j = tl.min(tl.where(v == vmax[:, None], cols, big), 1)  # ties: the first column
            live = rmask & (t >= 0)
            tl.store(PV + rix * S + s, vmax, mask=live)
            tl.store(PJ + rix * S + s, j, mask=live)

    @triton.jit
    def _mix(x):
        """lowbias32 on uint32 tensors (wraps mod 2^32), as ``_mix_torch``."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _keys_kernel(RK, CK, BK, ARGS, N, M, NT, BLOCK: tl.constexpr):
        """Row keys (B, N) (program axis 1: the batch), column keys (M,) and block keys
        (NT,) of a chunk, one launch (the torch version is ~100 small kernels). ARGS
        (int64): row offset, column offset, first block, seed low, seed high (a tensor: no
        specialization per value)."""
        pid = tl.program_id(0)
        b = tl.program_id(1)
        row0, col0, blk0 = tl.load(ARGS), tl.load(ARGS + 1), tl.load(ARGS + 2)
        k0, k1 = tl.load(ARGS + 3).to(tl.uint32), tl.load(ARGS + 4).to(tl.uint32)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        hb = _mix(b.to(tl.uint32) ^ k1)
        rk = _mix(_mix((row0 + offs).to(tl.uint32) ^ k0) + hb)
        tl.store(RK + b.to(tl.int64) * N + offs, rk.to(tl.int32, bitcast=True), mask=offs < N)
        if b == 0:
            ck = _mix(_mix((col0 + offs).to(tl.uint32) ^ k1) ^ 0x68E31DA4)
            tl.store(CK + offs, ck.to(tl.int32, bitcast=True), mask=offs < M)
            bk = _mix(_mix((blk0 + offs).to(tl.uint32) ^ k1) ^ 0x2F6B3E55)
            tl.store(BK + offs, bk.to(tl.int32, bitcast=True), mask=offs < NT)

    _sample_blocks_tuned = triton.autotune(
        configs=_triton_configs(_config.SAMPLE_TUNE),
        key=["N_KEY", "M_KEY", "D", "HAS_LABELS", "PREC"],
    )(_sample_blocks_kernel)


def keys_triton(B, N, M, k0, k1, row_offset, col_offset, K0, n_tiles, device):
    """``sampling._keys`` in one Triton launch (seed keys k0, k1; the chunk's first block
    K0 and its tiles): int32 tensors holding the uint32 bits."""
    args = torch.tensor([row_offset, col_offset, K0, k0, k1], dtype=torch.int64, device=device)
    rk = torch.empty((B, N), dtype=torch.int32, device=device)
    ck = torch.empty((M,), dtype=torch.int32, device=device)
    bk = torch.empty((n_tiles,), dtype=torch.int32, device=device)
    block = 1024
    with _device(rk):
        _keys_kernel[(triton.cdiv(max(N, M), block), B)](
            rk, ck, bk, args, N, M, n_tiles, BLOCK=block
        )
    return rk, ck, bk


def sample_operands(x, y, g, logb, cy, eps, labels, precision):
    f32 = torch.float32
    kdt = torch.bfloat16 if precision == "bf16" else f32
    x, y = x.to(kdt).contiguous(), y.to(kdt).contiguous()
    bias = torch.sub(g.to(f32), cy.to(f32)).mul_(LOG2E / eps).add_(logb.to(f32), alpha=LOG2E)
    if labels is not None:
        lx, ly, W, w_scale = labels
        lx, ly, W, K2 = _label_operands(lx, ly, W)
    else:
        lx = ly = W = bias  # placeholders, never read
        K2, w_scale = 1, 0.0
    return x, y, bias.contiguous(), (lx, ly, W, K2, float(w_scale)), labels is not None


def blocks_triton(ops, eps, c2, precision, rk, bk, off, first_in, last_in, config=None):
    """Step 1 on the Triton kernel: ``(val, tile int32, lz0, lzl)`` (B, N)."""
    x, y, bias, (lx, ly, W, K2, w_scale), has_labels = ops
    B, N, D = x.shape
    M = y.shape[1]
    f32 = torch.float32
    val, lz0, lzl = (torch.empty((B, N), device=x.device, dtype=f32) for _ in range(3))
    tile = torch.empty((B, N), device=x.device, dtype=torch.int32)
    BLOCK_D, NUM_D = _block_d(D)
    if config is not None:
        config = (config[0], BLOCK, config[2], config[3])
    kern, cfg = _pick(_sample_blocks_tuned, _sample_blocks_kernel, config)
    if kern is _sample_blocks_kernel:
        cfg["BLOCK_N"] = BLOCK
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B)  # noqa: E731
    with _device(x):
        kern[grid](
            x,
            y,
            bias,
            lx,
            ly,
            W,
            rk,
            bk,
            val,
            tile,
            lz0,
            lzl,
            N,
            M,
            D,
            K2,
            _bucket(N),
            _bucket(M),
            off,
            bk.shape[0],
            int(first_in),
            int(last_in),
            float(c2 * LOG2E / eps),
            float(LOG2E / eps),
            w_scale,
            BLOCK_D=BLOCK_D,
            NUM_D=NUM_D,
            EVEN_D=BLOCK_D * NUM_D == D,
            HAS_LABELS=has_labels,
            PREC="tf32" if precision == "bf16" else precision,
            **cfg,
        )
    return val, tile, lz0, lzl


def pick_triton(ops, eps, c2, rk, ck, tiles, off):
    """Step 2 on the Triton kernel: per row and tile of ``tiles`` (B, N, S) int32 (-1:
    none), the in-tile Gumbel-max ``(value, local column)`` (B, N, S)."""
    x, y, bias, (lx, ly, W, K2, w_scale), has_labels = ops
    B, N, D = x.shape
    S = tiles.shape[2]
    pv = torch.full((B, N, S), float("-inf"), device=x.device, dtype=torch.float32)
    pj = torch.zeros((B, N, S), device=x.device, dtype=torch.int32)
    # registers: a (ROWS, 128, BLOCK_D) gather per feature chunk; the interpreter wants
    # few programs
    rows, bd = (64, 64) if _config.interpret() else (8, 16)
    with _device(x):
        _sample_pick_kernel[(triton.cdiv(N, rows), B)](
            x,
            y,
            bias,
            lx,
            ly,
            W,
            rk,
            ck,
            tiles.contiguous(),
            pv,
            pj,
            N,
            y.shape[1],
            D,
            K2,
            S,
            off,
            float(c2 * LOG2E / eps),
            float(LOG2E / eps),
            w_scale,
            HAS_LABELS=has_labels,
            BLOCK_D=min(bd, max(16, triton.next_power_of_2(D))),
            ROWS=rows,
            BLOCK_N=BLOCK,
            num_warps=4,
        )
    return pv, pj.long()
