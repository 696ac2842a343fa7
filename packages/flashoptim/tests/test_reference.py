"""The float64 reference (``reference.py``): quantizer and weight-splitting error bounds, edge
cases, the rounding draws, and properties over any fp32 value (hypothesis)."""

import pytest
import torch

from flashoptim_fused import _cpu
from flashoptim_fused import reference as R


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_error_bound(bits, dtype):
    torch.manual_seed(0)
    theta = torch.randn(10000) * torch.exp2(torch.randint(-12, 6, (10000,)).float())
    p, c = R.split_ref(theta, dtype, bits)
    back = R.join_ref(p, c, bits)
    q = R.ulp_ref(p) / 2.0**bits
    err = (back - theta.double()).abs()
    assert (err <= q / 2 + 1e-30).all() or (err <= q).all()
    if bits == 16 and dtype == torch.bfloat16:
        # 8 + 16 bits cover fp32's 24-bit significand: reconstruction is exact
        # except where the +ulp/2 tie clamps (one fp32 ulp)
        assert (err <= q).all()
        assert (err == 0).float().mean() > 0.99


def test_split_stochastic_unbiased():
    theta = torch.full((200000,), 1.0 + 1e-5)
    u = R.uniform_ref(7, 3, torch.arange(theta.numel()))
    p, c = R.split_ref(theta, torch.bfloat16, 8, u)
    back = R.join_ref(p, c, 8)
    q = R.ulp_ref(p)[0] / 256
    assert abs(back.mean().item() - (1.0 + 1e-5)) < 0.02 * q  # unbiased in expectation
    rn = R.join_ref(*R.split_ref(theta, torch.bfloat16, 8), 8)
    assert (rn == 1.0).all()  # round to nearest loses it


def test_uniform_draws():
    u = R.uniform_ref(1, 1, torch.arange(100000))
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    u2 = R.uniform_ref(1, 2, torch.arange(100000))
    assert (u != u2).float().mean() > 0.99


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_momentum_quantizer_error_bound(scale_dtype):
    torch.manual_seed(1)
    m = (torch.randn(32 * 500) * torch.exp2(torch.randint(-30, 3, (32 * 500,)).float())).double()
    code, s = R.quantize_momentum_ref(m, scale_dtype)
    back = R.dequantize_momentum_ref(code, s)
    sg = s.double().repeat_interleave(32)
    x = (m / sg).abs()
    # half a code h in phi space, through the inverse map's slope 2 / (2 - |y|)^2 at the
    # largest |y| within h of phi(|x|)
    h = 0.5 / 127
    ymax = torch.clamp(2 * x / (1 + x) + h, max=1.0)
    bound = sg * h * 2 / (2 - ymax) ** 2 * 1.0001
    assert ((back - m).abs() <= bound).all()
    assert (s.double() >= m.abs().view(-1, 32).amax(1)).all()  # scale never below absmax


def test_tiny_momentum_does_not_underflow():
    m = torch.full((64,), 1e-30, dtype=torch.float64)
    m[32:] = -3e-39  # subnormal in fp32
    code, s = R.quantize_momentum_ref(m)
    back = R.dequantize_momentum_ref(code, s)
    assert (back[:32] > 0).all() and (back[32:] < 0).all()
    assert torch.allclose(back[:32], m[:32], rtol=0.02)
    # fp16 scales would have flushed 1e-30 to 0
    assert torch.tensor(1e-30).half().item() == 0


def test_variance_never_decodes_to_zero():
    v = torch.tensor([1.0] + [1e-12] * 31 + [0.0] * 32, dtype=torch.float64)
    code, s = R.quantize_variance_ref(v)
    back = R.dequantize_variance_ref(code, s)
    assert (back[:32] > 0).all() and (back[32:] == 0).all()
    torch.manual_seed(2)
    v = torch.rand(32 * 100, dtype=torch.float64) ** 4
    code, s = R.quantize_variance_ref(v)
    back = R.dequantize_variance_ref(code, s)
    sg = s.double().repeat_interleave(32)
    half = torch.where(code == 1, 1.0, 0.5)  # code 1 may be a clamped 0
    assert ((back.sqrt() - v.sqrt()).abs() <= sg * (half / 255) * 1.0001).all()


try:
    from hypothesis import given, settings
    from hypothesis import strategies as hs
except ImportError:  # pragma: no cover - hypothesis is in the [test] extra
    given = None

if given is not None:
    _finite32 = hs.floats(
        min_value=-(2.0**127), max_value=2.0**127, allow_nan=False, allow_infinity=False, width=32
    )

    @settings(max_examples=200, deadline=None)
    @given(hs.lists(_finite32, min_size=1, max_size=64), hs.integers(0, 2**32 - 1))
    def test_split_join_property(values, seed):
        """Any fp32 value: nearest split within q/2, stochastic split within q, of the value;
        the CPU path's integer bf16 rounding equals torch's round-to-nearest-even cast."""
        theta = torch.tensor(values, dtype=torch.float32)
        assert torch.equal(_cpu._to_narrow_t(theta, True), theta.to(torch.bfloat16))
        big = theta.abs() > 2.0**-100  # below, q is clamped at 2**-126 (documented)
        for u in (None, R.uniform_ref(seed, 1, torch.arange(theta.numel()))):
            p, c = R.split_ref(theta, torch.bfloat16, 8, u)
            back = R.join_ref(p, c, 8)
            q = R.ulp_ref(p) / 256
            err = (back - theta.double()).abs()
            bound = q / 2 if u is None else q
            # the +ulp/2 tie clamps at code 127: one more code there
            assert (err[big] <= bound[big] + q[big] * (c[big] == 127)).all()

    @settings(max_examples=100, deadline=None)
    @given(hs.lists(_finite32.filter(lambda x: abs(x) < 1e30), min_size=1, max_size=96))
    def test_momentum_quantizer_property(values):
        m = torch.tensor(values, dtype=torch.float32).double()
        code, s = R.quantize_momentum_ref(m)
        back = R.dequantize_momentum_ref(code, s)
        sg = s.double().repeat_interleave(32)[: m.numel()]
        assert ((back - m).abs() <= sg * 2 / 127 + 1e-300).all()
        assert ((back == 0) <= (m.abs() <= sg / 200)).all()  # zero only for tiny entries
