"""The finiteness pre-pass: one launch per bucket reads its gradients through the step
kernel's chunk table and writes ``atomic_max(flag, epoch)`` if any element is inf or NaN.

With ``CHECK_SKIP`` the step kernel (``_step_kernel.py``) returns at once when the flag holds
this step's epoch, so the pre-pass and the step kernels are enqueued back to back and the
host syncs once after them (a skipped step writes nothing; one persistent flag per device,
no memset per step). Launch: ``_plan.launch_prepass``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._step_kernel import _array_ptr, _chunk

PREPASS_SUB = 2048  # elements per trip of the pre-pass's persistent loop (load balance)
PREPASS_BLOCK = 1024
# pre-pass programs per SM: 12 x 4 warps of <= 40 registers (sm_90, triton 3.6) stay
# resident together, ~48 KB of gradient loads in flight per SM
PREPASS_PER_SM = 12


@triton.jit(do_not_specialize=["nunits", "mark"])
def _nonfinite_kernel(
    units,
    nunits,
    tab,
    g_base,
    flag,  # int32 [1]: atomic_max(flag, mark) if any gradient element is inf or NaN
    mark,  # the step's epoch (eager) or 1 (zeroed flags: capturable, host-side check)
    ALIGNED: tl.constexpr,
    N16: tl.constexpr,
    G_DTYPE: tl.constexpr,  # 0 fp32, 1 bf16, 2 fp16
    UNIT: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK: tl.constexpr,
    INDEX64: tl.constexpr,
):
    """Finiteness pre-pass over a bucket's gradients (the step kernel's chunk table), SUB
    elements per trip of a persistent loop (chunk ``w // (UNIT / SUB)``, part
    ``w % (UNIT / SUB)``: fine load balance). An element is inf/NaN iff its exponent field
    is all ones, which is also the largest value the masked field can take: per element one
    AND and one (packed 16-bit) max, one reduction and at most one atomic per program."""
    S: tl.constexpr = UNIT // SUB
    if G_DTYPE == 0:
        EXP: tl.constexpr = 0x7F800000
    elif G_DTYPE == 1:
        EXP: tl.constexpr = 0x7F80
    else:
        EXP: tl.constexpr = 0x7C00
    if G_DTYPE == 0:
        acc = tl.zeros([BLOCK], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.int16)
    for w in range(tl.program_id(0), nunits * S, tl.num_programs(0)):
        row, lu, n = _chunk(units, w // S, tab, N16, INDEX64)
        gp = _array_ptr(g_base, row, 1, ALIGNED)
        for k in tl.static_range(SUB // BLOCK):
            off = lu * UNIT + (w % S) * SUB + k * BLOCK + tl.arange(0, BLOCK)
            g = tl.load(gp + off, mask=off < n, other=0.0)
            if G_DTYPE == 0:
                e = g.to(tl.int32, bitcast=True) & EXP
            else:
                e = g.to(tl.int16, bitcast=True) & EXP
            acc = tl.maximum(acc, e)
    if tl.max(acc, axis=0) == EXP:
        tl.atomic_max(flag, mark)
