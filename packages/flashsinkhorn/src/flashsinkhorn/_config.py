"""flashsinkhorn's configuration: every environment switch and every kernel tile config.

The switches are read when a kernel is launched, never at import, so they can be changed
between calls (tests do). The package README's configuration table lists them:

- ``TRITON_INTERPRET=1`` (Triton's own switch, it must be set before Python starts for
  Triton to build interpreted kernels): run the Triton kernels on CPU tensors. CI does.
- ``FLASHSINKHORN_NO_AUTOTUNE=1``: launch every kernel at its one fixed config instead of
  autotuning (always so under the interpreter, which crashes on multi-config autotune).
  Use it where compile time matters more than speed (tests, a first call in a short job).

Tile configs are ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; ``BLOCK_D`` (the feature
chunk) is chosen by the launcher from D. Their numbers are in docs/design/flashsinkhorn.md.
"""

from __future__ import annotations

import os


def interpret() -> bool:
    """True when Triton kernels run in the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def no_autotune() -> bool:
    """True when every kernel launches at its fixed config (interpreter, or opted out)."""
    return interpret() or os.environ.get("FLASHSINKHORN_NO_AUTOTUNE", "0") == "1"


# The one config of every streaming softmin launch without autotuning.
FIXED = (64, 64, 4, 2)

# Autotune space of the iteration passes (running-max and shift kernels, no V), Hopper
# (H200) sized. D <= 128 is one tl.dot per tile (K = BLOCK_D); larger D loops over 64-wide
# feature chunks and needs 128 x 128 tiles to stay tensor-core bound.
TUNE_SMALL_D = [
    (128, 64, 4, 3),
    (128, 128, 8, 3),
    (128, 64, 8, 4),
    (64, 128, 4, 4),
    (256, 64, 8, 3),
]
TUNE_LARGE_D = [(128, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2)]

# The plan application (the pass with V: once per solve, not autotuned: no compile storm).
# DV <= 64: one chunk of BLOCK_DV = next_pow2(DV) output columns per program.
PLAN_APPLY = (128, 64, 8, 3)
# DV > 64: 256-wide output chunks on 64 x 64 tiles (each chunk recomputes the scores, so
# wide chunks mean fewer score passes; the 64 x 256 accumulator fits in registers at 8 warps).
PLAN_APPLY_WIDE = (64, 64, 8, 3)
WIDE_DV = 256

# The symmetric self-transport kernel (debiasing terms): (BLOCK, num_warps, num_stages).
SELF_FIXED = (64, 4, 2)
SELF_TUNE = [(128, 8, 2), (128, 8, 3), (64, 4, 3)]

# The shift kernel aims each row's shifted sum at 2^SHIFT_CENTER: the guess may be off by
# -92 .. +95 log2 units (about -64 .. +66 eps in potential units) before the row is
# recomputed with the running max. A row is kept when its shifted sum is in
# [SHIFT_LO, float32 max]: above is an overflowed term (inf) or NaN; below, the terms
# flushed to zero (< 2^-126 each, at most M of them) could matter (relative <= M 2^-66).
SHIFT_CENTER = 32.0
SHIFT_LO = 2.0**-60

# backend="auto" runs a pass on the sm_90 Gluon kernel (_softmin_hopper) only from this many
# scores (B N M) on: below, a pass is a few microseconds of GPU work and launch overhead
# decides, and the Gluon pass has more host work (a padded bias buffer, two TMA descriptors,
# a second launch for the shift fallback) than the Triton kernel's one launch. Not measured:
# the H200 runs timed 50k x 50k (2.5e9 scores, 1.26x faster at d = 64); 2^22 scores take
# about 2 us at that rate.
SM90_MIN_SCORES = 1 << 22

# The symmetric iteration in one pass (_symmetric_triton, _symmetric_hopper): each row block
# writes the column partial sums of a chunk of columns into a (B, row_blocks, W) fp32
# buffer of at most SYM_PARTIAL_BYTES (50k x 50k: 2 launches), but every
# launch covers at least SYM_MIN_CHUNK_TILES column tiles (each reloads its rows and refills
# its pipeline). On CUDA a symmetric update of fewer than ONE_PASS_MIN_SCORES scores runs
# the two ordinary passes instead (2 launches against ~10 for the one pass and its
# reductions; below ~4M scores the launches decide; not measured).
SYM_PARTIAL_BYTES = 64 << 20
SYM_MIN_CHUNK_TILES = 32
ONE_PASS_MIN_SCORES = 1 << 22
# the Triton one-pass kernel, (BLOCK_M, BLOCK_N, warps, stages): one feature chunk (D <= 128):
# autotuned over these; larger D: this one config (static sm_90 compile, triton 3.6: at
# d = 512 every 4-warp or 128-row config spills 136-1920 bytes, (64, 64, 8, 3) none; 4 warps
# at d = 64 take 254 registers)
SYM_TUNE_SMALL_D = [(128, 64, 8, 3), (128, 64, 8, 2)]
SYM_LARGE_D = (64, 64, 8, 3)

# Plan sampling (flashsinkhorn.sampling): the first level draws a block of SAMPLE_BLOCK
# global columns per row (a tile of the pass is a block), the second a column inside it.
# The Triton pass's tiles are (BLOCK_M, SAMPLE_BLOCK); its autotune space (BLOCK_M, _,
# warps, stages) (the BLOCK_N entry is replaced by SAMPLE_BLOCK).
SAMPLE_BLOCK = 128
SAMPLE_TUNE = [(64, 128, 4, 3), (128, 128, 8, 3), (64, 128, 8, 3), (128, 128, 8, 2)]

# Sharded passes (flashsinkhorn.distributed): the column operands of the other ranks stream
# past this rank's rows in chunks of at most this many bytes (kernel operands, the column
# vector and V), two chunks alive at a time; problems whose operands of both clouds fit in
# one chunk gather them once instead. 32 MiB: at n = m = 1M, d = 64 (fp32) and 2 ranks a
# rank holds its 256 MiB of inputs and 256 MiB of kernel operands plus 64 MiB in flight,
# 0.56 of one GPU's 1 GiB; one chunk is 131k rows, a kernel of 500k x 131k scores.
SHARD_CHUNK_BYTES = 32 << 20

# The symmetric self kernel uses fixed offsets per tile: safe while the spread of
# log a + f / eps (log2 units) over a problem stays below this (else two plain passes).
SELF_SPREAD_MAX = 30.0


def plan_apply_config(dv: int) -> tuple[int, int, int, int]:
    """Tile config of the pass with V of width ``dv`` (the fixed config without autotune)."""
    if no_autotune():
        return FIXED
    return PLAN_APPLY_WIDE if dv > 64 else PLAN_APPLY


# backend="auto" (flashsinkhorn.backends.auto_backend): the dense backend (-C in memory) on
# the CPU while one cost matrix takes at most DENSE_MAX_BYTES (a debiased loss holds three,
# plus one score matrix per pass), and on CUDA up to DENSE_MAX_SCORES_CUDA scores (B N M),
# where a pass is launch-bound. The CPU number: docs/design/flashsinkhorn.md ("The dense
# backend"); the CUDA one is not measured yet (tools/flashsinkhorn/gpu_check.sh measures
# both backends at 512, 2048 and 8192 points).
DENSE_MAX_BYTES = 1 << 28
DENSE_MAX_SCORES_CUDA = 1 << 22

# The multiscale backend (_multiscale_tiles, _multiscale_pass): points per tile (the
# block of its kernels, rows and columns), tiles per node of the tree that finds the tile
# pairs to compute, and the most nodes at the top of that tree (all their pairs examined).
MULTISCALE_TILE = 64
MULTISCALE_GROUP = 8
MULTISCALE_TOP = 256
# backend="auto" runs the multiscale problem (flashsinkhorn.multiscale.auto_reason) for
# clouds of at most 3 coordinates where the exact rule picks the streaming problem, when the
# kernel's width sqrt(eps / c2) is at most MULTISCALE_MAX_WIDTH of the clouds' diameter and,
# on CUDA, from MULTISCALE_MIN_SCORES_CUDA scores (B N M). CPU (tools/flashsinkhorn/
# multiscale_sweep.py, GeomLoss's schedule, d = 3, unit cube, one thread of a loaded 2-core
# host): at n = m = 8192 the multiscale loop took 4.6 s / 2.6 s (blur 0.01 / 0.1) against
# 16.6 s / 14.5 s for the streaming torch path, and lost to the dense problem below that
# (2048: 1.04 s against 0.075 s): so past the dense budget. The CUDA threshold is
# provisional (not measured): tools/flashsinkhorn/multiscale_bench.py on the GPU informs it.
MULTISCALE_MAX_WIDTH = 0.125
MULTISCALE_MIN_SCORES_CUDA = 1 << 32
