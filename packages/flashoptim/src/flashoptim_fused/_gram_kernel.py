"""The symmetric Gram product of Newton-Schulz: ``C = alpha Y Y^T + beta Z`` for a matrix or
a batch ``Y`` (k, M, K) and a symmetric ``Z`` (k, M, M), computing only the tiles that touch
the upper triangle (about half of a general matmul's) and writing each one twice, as itself
and mirrored (float64 reference: ``gram_ref``; the loop that calls it: ``muon.newton_schulz``).

Both products of a Newton-Schulz iteration are of this form: ``A = X X^T`` (``beta = 0``)
and ``B = b A + c A A`` (``A A = A A^T``, ``Y = Z = A``); only the third, ``a X + B X``, is a
general matmul. Tiles are BM x BN (any pair of sizes): tile row ``i`` runs from tile column
``i BM // BN``, a tile that crosses the diagonal stores its elements with ``col >= row`` and
mirrors those with ``col > row``, so every element of C is written once. Programs walk the
tiles in bands of ``GROUP`` tile rows, column by column inside a band (the rows of Y a wave
of programs reads stay in L2). Operands in their dtype (bf16 on the GPU), fp32 accumulation,
the result rounded once to C's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import _config


def gram_ref(y: torch.Tensor, alpha: float = 1.0, z: torch.Tensor | None = None, beta=0.0):
    """float64 reference: ``alpha y y^T + beta z`` over the last two dimensions."""
    y64 = y.to(torch.float64)
    out = alpha * (y64 @ y64.mT)
    if z is not None:
        out = out + beta * z.to(torch.float64)
    return out


@triton.jit
def _tile_of(pid, M, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """(tile row, tile column) of program ``pid``: the tiles with a column tile of at least
    ``row * BM // BN`` (those that touch the upper triangle), in bands of GROUP tile rows,
    column-major inside a band."""
    tm = tl.cdiv(M, BM)
    tn = tl.cdiv(M, BN)
    band = pid * 0
    rem = pid
    count = pid * 0  # tiles in the current band
    for r in range(0, GROUP):
        ti = band * GROUP + r
        count += tl.where(ti < tm, tn - (ti * BM) // BN, 0)
    while rem >= count:
        rem -= count
        band += 1
        count = pid * 0
        for r in range(0, GROUP):
            ti = band * GROUP + r
            count += tl.where(ti < tm, tn - (ti * BM) // BN, 0)
    top = band * GROUP
    rows = tl.minimum(GROUP, tm - top)
    tj = (top * BM) // BN  # the band's first column holds its first row only
    # rows of the band whose first column is <= tj: ((tj + 1) BN - 1) // BM - top + 1
    height = tl.minimum(rows, ((tj + 1) * BN - 1) // BM - top + 1)
    while rem >= height:
        rem -= height
        tj += 1
        height = tl.minimum(rows, ((tj + 1) * BN - 1) // BM - top + 1)
    # the column's rows are the band's first `height` rows
    return top + rem, tj


@triton.jit
def _gram_kernel(
    y_ptr,
    z_ptr,
    c_ptr,
    M,
    K,
    sy_b,
    sy_m,
    sy_k,
    sz_b,
    sz_m,
    sz_n,
    sc_b,
    sc_m,
    sc_n,
    alpha,
    beta,
    HAS_Z: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
):
    ti, tj = _tile_of(tl.program_id(0), M, BM, BN, GROUP)
    b = tl.program_id(1).to(tl.int64)
    rm = ti * BM + tl.arange(0, BM)
    rn = tj * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    # rows past M read row (r mod M) instead of a masked load: their products are never
    # stored, and the loads stay unmasked (only K's tail is masked, when K % BK != 0)
    ya = y_ptr + b * sy_b + (rm % M)[:, None] * sy_m + rk[None, :] * sy_k
    yb = y_ptr + b * sy_b + (rn % M)[:, None] * sy_m + rk[None, :] * sy_k
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(ya)
            bt = tl.load(yb)
        else:
            kmask = rk[None, :] < K - k * BK
            a = tl.load(ya, mask=kmask, other=0.0)
            bt = tl.load(yb, mask=kmask, other=0.0)
        if IEEE:  # fp32 operands (the interpreter's tests): no tf32
            acc = tl.dot(a, tl.trans(bt), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(bt), acc)
        ya += BK * sy_k
        yb += BK * sy_k
    acc = acc * alpha
    inside = (rm[:, None] < M) & (rn[None, :] < M)
    if HAS_Z:  # Z symmetric: its tile serves the mirrored store too
        zt = tl.load(z_ptr + b * sz_b + rm[:, None] * sz_m + rn[None, :] * sz_n, mask=inside)
        acc += beta * zt.to(tl.float32)
    out = acc.to(c_ptr.dtype.element_ty)
    cb = c_ptr + b * sc_b
    upper = rn[None, :] >= rm[:, None]
    tl.store(cb + rm[:, None] * sc_m + rn[None, :] * sc_n, out, mask=inside & upper)
    # the mirror: element (r, c), c > r, also at (c, r); stored from the transposed tile so
    # that the writes stay along rows of C
    strict_t = rn[:, None] > rm[None, :]
    inside_t = (rn[:, None] < M) & (rm[None, :] < M)
    tl.store(cb + rn[:, None] * sc_m + rm[None, :] * sc_n, tl.trans(out), mask=inside_t & strict_t)


@triton.jit
def _gram_tma_kernel(
    y_desc,
    z_desc,
    c_desc,
    M,
    K,
    alpha,
    beta,
    HAS_Z: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
):
    """The same product through TMA descriptors of (k, M, K) / (k, M, M) (rows and columns
    past the matrix read as zeros and are not stored), square tiles only: an off-diagonal
    tile is stored whole twice (itself and its transpose), a diagonal one once, whole."""
    ti, tj = _tile_of(tl.program_id(0), M, BM, BM, GROUP)
    b = tl.program_id(1)
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        a = y_desc.load([b, ti * BM, k * BK]).reshape(BM, BK)
        bt = y_desc.load([b, tj * BM, k * BK]).reshape(BM, BK)
        if IEEE:
            acc = tl.dot(a, tl.trans(bt), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(bt), acc)
    acc = acc * alpha
    if HAS_Z:
        acc += beta * z_desc.load([b, ti * BM, tj * BM]).reshape(BM, BM).to(tl.float32)
    out = acc.to(c_desc.dtype)
    c_desc.store([b, ti * BM, tj * BM], out.reshape(1, BM, BM))
    if ti != tj:
        c_desc.store([b, tj * BM, ti * BM], tl.trans(out).reshape(1, BM, BM))


# (BM, BN, BK, num_warps, num_stages): square and 2:1 tiles for sm_90 wgmma; the tuner picks
# per (M, K) on the first launch. GROUP 8: a band of 8 tile rows
CONFIGS = [
    (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 128, 8, 3),
]
# under the interpreter (tests: small matrices, a few programs) and without autotuning
INTERP_CONFIG = (16, 32, 16, 4, 1)
DEFAULT_CONFIG = CONFIGS[0]
GROUP = 8


def _triton_configs() -> list:
    return [
        triton.Config(dict(BM=bm, BN=bn, BK=bk), num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in CONFIGS
    ]


def _prune(configs, named_args, **kwargs) -> list:
    """Below M = 2048 only the square 128 x 128 x 64 configs of 8 warps (4 and 3 stages)
    are timed: a few dozen tiles per matrix, where the first launch's compiles (one per
    config) cost more than a better tile could win back."""
    if named_args["M"] >= 2048:
        return configs
    return [
        c
        for c in configs
        if c.kwargs["BM"] == c.kwargs["BN"] == 128 and c.kwargs["BK"] == 64 and c.num_warps == 8
    ]


_gram_kernel_tuned = triton.autotune(
    configs=_triton_configs(),
    key=["M", "K", "HAS_Z", "IEEE"],
    prune_configs_by=dict(early_config_prune=_prune),
)(triton.heuristics(dict(EVEN_K=lambda a: a["K"] % a["BK"] == 0))(_gram_kernel))


# the TMA kernel's (BM, BK, num_warps, num_stages), square tiles
# (3 stages: 96 KiB of ring, two programs per SM, one's epilogue under the other's loads)
TMA_CONFIGS = [(128, 64, 8, 4), (128, 64, 8, 3), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 4)]
TMA_INTERP_CONFIG = (16, 16, 4, 1)


def _tma_blocks(nargs) -> None:
    """The descriptors' block shapes for the config being launched (autotuning's pre-hook)."""
    bm, bk = nargs["BM"], nargs["BK"]
    nargs["y_desc"].block_shape = [1, bm, bk]
    nargs["z_desc"].block_shape = [1, bm, bm]
    nargs["c_desc"].block_shape = [1, bm, bm]


def _prune_tma(configs, named_args, **kwargs) -> list:
    """As ``_prune``: below M = 2048 the first three (128 x 64, 8 warps, 4 / 3 stages; 4
    warps)."""
    if named_args["M"] >= 2048:
        return configs
    return configs[:3]


_gram_tma_kernel_tuned = triton.autotune(
    configs=[
        triton.Config(dict(BM=bm, BK=bk), num_warps=w, num_stages=st, pre_hook=_tma_blocks)
        for bm, bk, w, st in TMA_CONFIGS
    ],
    key=["M", "K", "HAS_Z", "IEEE"],
    prune_configs_by=dict(early_config_prune=_prune_tma),
)(_gram_tma_kernel)


def _tiles(m: int, bm: int, bn: int) -> int:
    """Tiles of BM x BN touching the upper triangle of an m x m matrix."""
    tn = -(-m // bn)
    return sum(tn - (i * bm) // bn for i in range(-(-m // bm)))


def _check(y, z, out):
    """The (k, M, K) / (k, M, M) views of ``y``, ``z`` (``out`` where None) and ``out``
    (allocated where None), after the checks of ``gram``."""
    if y.ndim not in (2, 3):
        raise ValueError(f"y must be (M, K) or (k, M, K); got shape {tuple(y.shape)}")
    if y.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"y must be bf16, fp16 or fp32; got {y.dtype}")
    m = y.shape[-2]
    want = (*y.shape[:-2], m, m)
    if z is not None and tuple(z.shape) != want:
        raise ValueError(f"z must have shape {want}; got {tuple(z.shape)}")
    if out is None:
        out = torch.empty(want, dtype=y.dtype, device=y.device)
    elif tuple(out.shape) != want or out.dtype != y.dtype:
        raise ValueError(f"out must be {want} of {y.dtype}; got {tuple(out.shape)} {out.dtype}")
    y3 = y if y.ndim == 3 else y.unsqueeze(0)
    c3 = out if out.ndim == 3 else out.unsqueeze(0)
    z3 = c3 if z is None else (z if z.ndim == 3 else z.unsqueeze(0))
    return y3, z3, c3, out


def _tma_ready(*ts) -> bool:
    """TMA descriptors need a unit last stride, 16-byte aligned other strides and base."""
    return all(
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
        for t in ts
    )


def gram(
    y: torch.Tensor,
    alpha: float = 1.0,
    z: torch.Tensor | None = None,
    beta: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``alpha y y^T + beta z`` for ``y`` (M, K) or (k, M, K) (any strides) and a symmetric
    ``z`` of the result's shape (None: ``beta`` unused), in ``y``'s dtype (bf16 on the GPU:
    fp32 accumulation; fp32 operands multiply in IEEE fp32). ``out``: where the result goes
    (the result's shape and dtype; not ``y`` or ``z``). Through TMA descriptors where the
    operands allow them (``gram_tma``), else by pointers (``gram_ptr``)."""
    y3, z3, c3, out = _check(y, z, out)
    if _tma_ready(y3, z3, c3):
        return _launch_tma(y3, z3, c3, out, alpha, z is not None, beta)
    return _launch_ptr(y3, z3, c3, out, alpha, z is not None, beta)


def gram_ptr(y, alpha=1.0, z=None, beta=0.0, out=None) -> torch.Tensor:
    """``gram`` by the pointer kernel whatever the operands (square and 2:1 tiles)."""
    y3, z3, c3, out = _check(y, z, out)
    return _launch_ptr(y3, z3, c3, out, alpha, z is not None, beta)


def _launch_ptr(y3, z3, c3, out, alpha, has_z: bool, beta) -> torch.Tensor:
    k, m, kk = y3.shape
    if k == 0 or m == 0:
        return out
    args = (
        y3,
        z3,
        c3,
        m,
        kk,
        *y3.stride(),
        *z3.stride(),
        *c3.stride(),
        float(alpha),
        float(beta),
    )
    flags = dict(HAS_Z=has_z, IEEE=y3.dtype == torch.float32, GROUP=GROUP)
    if _config.autotune(y3.device):

        def grid(meta):
            return (_tiles(m, meta["BM"], meta["BN"]), k)

        _gram_kernel_tuned[grid](*args, **flags)
        return out
    bm, bn, bk, warps, stages = INTERP_CONFIG if _config.interpret() else DEFAULT_CONFIG
    _gram_kernel[(_tiles(m, bm, bn), k)](
        *args,
        EVEN_K=kk % bk == 0,
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=warps,
        num_stages=stages,
        **flags,
    )
    return out


def _launch_tma(y3, z3, c3, out, alpha, has_z: bool, beta) -> torch.Tensor:
    k, m, kk = y3.shape
    if k == 0 or m == 0:
        return out
    tuned = _config.autotune(y3.device)
    bm, bk, warps, stages = TMA_INTERP_CONFIG if _config.interpret() else TMA_CONFIGS[0]
    descs = [
        TensorDescriptor.from_tensor(t, block_shape=shape)
        for t, shape in ((y3, [1, bm, bk]), (z3, [1, bm, bm]), (c3, [1, bm, bm]))
    ]
    args = (*descs, m, kk, float(alpha), float(beta))
    flags = dict(HAS_Z=has_z, IEEE=y3.dtype == torch.float32, GROUP=GROUP)
    if tuned:
        _gram_tma_kernel_tuned[lambda meta: (_tiles(m, meta["BM"], meta["BM"]), k)](*args, **flags)
        return out
    _gram_tma_kernel[(_tiles(m, bm, bm), k)](
        *args, BM=bm, BK=bk, num_warps=warps, num_stages=stages, **flags
    )
    return out
