"""operands.py: round_to_tf32 against an independent float64 rounding, and the kernel
operands (centered, cast, rounded only for tf32) that every Problem prepares once."""

import math

import pytest
import torch
from _helpers import needs_interpreter

from flashsinkhorn.operands import common_center, kernel_operands, round_to_tf32, round_to_tf32_


def _tf32_ref(v: float) -> float:
    """Nearest value with 11 significant bits (ties to even), in float64 arithmetic."""
    if v == 0.0 or not math.isfinite(v):
        return v
    m, e = math.frexp(v)  # v = m 2^e, 0.5 <= |m| < 1
    if e - 1 < -126:  # fp32 subnormal: the tf32 grid keeps the same absolute step 2^-136
        q = v / 2.0**-136
    else:
        q = m * 2.0**11
    r = round(q)  # Python rounds halves to even
    return r * 2.0**-136 if e - 1 < -126 else r * 2.0 ** (e - 11)


def test_round_to_tf32_matches_float64_rounding():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=gen) * torch.exp(8 * torch.randn(20000, generator=gen))
    bits = x.view(torch.int32)
    # exact ties (low 13 bits = 0x1000) with an even and an odd last kept bit, and values
    # one unit either side of a tie
    ties = (bits[:400] & ~0x3FFF) | 0x1000
    odd_ties = (bits[400:800] & ~0x3FFF) | 0x3000
    near = torch.cat([((bits[800:1200] & ~0x1FFF) | 0x0FFF), (bits[1200:1600] & ~0x1FFF) | 0x1001])
    special = torch.tensor(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            1e-40,
            -3e-39,
            3.0e38,
            float("inf"),
            -float("inf"),
            2.0**-126,
            65504.0,
        ]
    )
    x = torch.cat(
        [
            x,
            ties.view(torch.float32),
            odd_ties.view(torch.float32),
            near.view(torch.float32),
            special,
        ]
    )
    before = x.clone()
    got = round_to_tf32(x)
    want = torch.tensor([_tf32_ref(float(v)) for v in x.tolist()], dtype=torch.float64)
    assert torch.equal(got.double(), want)
    assert ((got.view(torch.int32) & 0x1FFF) == 0).all()
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))  # input unchanged


def test_round_to_tf32_rejects_other_dtypes():
    with pytest.raises(TypeError, match="t must be float32"):
        round_to_tf32(torch.zeros(3, dtype=torch.float64))


@needs_interpreter
def test_kernel_operands_round_only_tf32():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.rand(1, 37, 5, generator=gen), torch.rand(1, 29, 5, generator=gen)
    c = common_center(x, y)
    xk, yk = kernel_operands(x, y, c, "tf32", "triton")
    assert torch.equal(xk, round_to_tf32(x - c[:, None, :]))
    assert torch.equal(yk, round_to_tf32(y - c[:, None, :]))
    for prec in ("ieee", "tf32x3"):
        xk, yk = kernel_operands(x, y, c, prec, "triton")
        assert torch.equal(xk, x - c[:, None, :])
    xk, yk = kernel_operands(x, x, c, "tf32", "triton")
    assert xk is yk  # a self problem keeps one operand
    xk, _ = kernel_operands(x, y, c, "tf32", "torch")  # the torch backend computes in fp32
    assert torch.equal(xk, x - c[:, None, :])


def test_round_to_tf32_in_place_chunks_and_errors():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1001, 7, generator=gen)
    want = round_to_tf32(x)
    y = x.clone()
    assert round_to_tf32_(y, chunk=100) is y  # chunks that do not divide the size
    assert torch.equal(y, want)
    with pytest.raises(TypeError, match="contiguous float32"):
        round_to_tf32_(x.t())
    with pytest.raises(TypeError, match="contiguous float32"):
        round_to_tf32_(x.double())


@needs_interpreter
def test_kernel_operands_never_round_the_callers_tensor():
    gen = torch.Generator().manual_seed(3)
    x, y = torch.rand(1, 9, 3, generator=gen), torch.rand(1, 8, 3, generator=gen)
    x0, y0 = x.clone(), y.clone()
    xk, yk = kernel_operands(x, y, None, "tf32", "triton")  # no center: no copy before
    assert torch.equal(x, x0) and torch.equal(y, y0)
    assert torch.equal(xk, round_to_tf32(x0)) and torch.equal(yk, round_to_tf32(y0))
