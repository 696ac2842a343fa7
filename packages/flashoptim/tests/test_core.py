"""Quantizers and weight splitting: error bounds, edge cases, float64 reference vs CPU path."""

import pytest
import torch

from flashoptim import _core
from flashoptim._core import ADAM, LION, SGD


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_error_bound(bits, dtype):
    torch.manual_seed(0)
    theta = torch.randn(10000) * torch.exp2(torch.randint(-12, 6, (10000,)).float())
    p, c = _core.split_ref(theta, dtype, bits)
    back = _core.join_ref(p, c, bits)
    q = _core._ulp_ref(p) / 2.0**bits
    err = (back - theta.double()).abs()
    assert (err <= q / 2 + 1e-30).all() or (err <= q).all()
    if bits == 16 and dtype == torch.bfloat16:
        # 8 + 16 bits cover fp32's 24-bit significand: reconstruction is exact
        # except where the +ulp/2 tie clamps (one fp32 ulp)
        assert (err <= q).all()
        assert (err == 0).float().mean() > 0.99


def test_split_stochastic_unbiased():
    theta = torch.full((200000,), 1.0 + 1e-5)
    u = _core.uniform_ref(7, 3, torch.arange(theta.numel()))
    p, c = _core.split_ref(theta, torch.bfloat16, 8, u)
    back = _core.join_ref(p, c, 8)
    q = _core._ulp_ref(p)[0] / 256
    assert abs(back.mean().item() - (1.0 + 1e-5)) < 0.02 * q  # unbiased in expectation
    rn = _core.join_ref(*_core.split_ref(theta, torch.bfloat16, 8), 8)
    assert (rn == 1.0).all()  # round to nearest loses it


def test_uniform_draws():
    u = _core.uniform_ref(1, 1, torch.arange(100000))
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    u2 = _core.uniform_ref(1, 2, torch.arange(100000))
    assert (u != u2).float().mean() > 0.99


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_momentum_quantizer_error_bound(scale_dtype):
    torch.manual_seed(1)
    m = (torch.randn(32 * 500) * torch.exp2(torch.randint(-30, 3, (32 * 500,)).float())).double()
    code, s = _core.quantize_momentum_ref(m, scale_dtype)
    back = _core.dequantize_momentum_ref(code, s)
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
    code, s = _core.quantize_momentum_ref(m)
    back = _core.dequantize_momentum_ref(code, s)
    assert (back[:32] > 0).all() and (back[32:] < 0).all()
    assert torch.allclose(back[:32], m[:32], rtol=0.02)
    # fp16 scales would have flushed 1e-30 to 0
    assert torch.tensor(1e-30).half().item() == 0


def test_variance_never_decodes_to_zero():
    v = torch.tensor([1.0] + [1e-12] * 31 + [0.0] * 32, dtype=torch.float64)
    code, s = _core.quantize_variance_ref(v)
    back = _core.dequantize_variance_ref(code, s)
    assert (back[:32] > 0).all() and (back[32:] == 0).all()
    torch.manual_seed(2)
    v = torch.rand(32 * 100, dtype=torch.float64) ** 4
    code, s = _core.quantize_variance_ref(v)
    back = _core.dequantize_variance_ref(code, s)
    sg = s.double().repeat_interleave(32)
    half = torch.where(code == 1, 1.0, 0.5)  # code 1 may be a clamped 0
    assert ((back.sqrt() - v.sqrt()).abs() <= sg * (half / 255) * 1.0001).all()


def _hp(kind, **kw):
    hp = dict(
        ecc=8,
        quant=True,
        sr=True,
        scale_dtype=torch.bfloat16,
        lr=1e-2,
        wd=0.01,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        decoupled=True,
        dampening=0.0,
        nesterov=False,
    )
    if kind == LION:
        hp.update(b2=0.99, lr=1e-3)
    hp.update(kw)
    return hp


def _state(kind, p, hp):
    n = p.numel()
    ng = (n + 31) // 32
    st = {}
    if hp["quant"]:
        st["m"], st["ms"] = (
            torch.zeros(n, dtype=torch.int8),
            torch.zeros(ng, dtype=hp["scale_dtype"]),
        )
        if kind == ADAM:
            st["v"] = torch.zeros(n, dtype=torch.uint8)
            st["vs"] = torch.zeros(ng, dtype=hp["scale_dtype"])
    else:
        st["m"] = torch.zeros(n)
        if kind == ADAM:
            st["v"] = torch.zeros(n)
    if hp["ecc"] and p.dtype != torch.float32:
        st["c"] = torch.zeros(n, dtype=torch.int8 if hp["ecc"] == 8 else torch.int16)
    return st


@pytest.mark.parametrize("kind", [ADAM, SGD, LION])
@pytest.mark.parametrize("n", [1, 33, 1000])
@pytest.mark.parametrize("ecc", [8, 16])
def test_cpu_path_matches_float64_reference(kind, n, ecc):
    """Per step: feed the same stored state to the fp32 CPU path and the float64 reference;
    codes agree within one (ties), weights within a correction code."""
    torch.manual_seed(n + kind)
    hp = _hp(kind, ecc=ecc, b1=0.9 if kind != SGD else 0.9)
    p = torch.randn(n).to(torch.bfloat16)
    st = _state(kind, p, hp)
    for step in range(1, 6):
        g = torch.randn(n)
        ref_p, ref_st = _core.step_ref(
            kind, p, g, {k: v.clone() for k, v in st.items()}, hp, step, 5
        )
        _core.cpu_step(kind, p, g, st, hp, step, 5)
        for k in ref_st:
            d = (ref_st[k].double() - st[k].double()).abs()
            if k in ("ms", "vs"):
                assert torch.allclose(ref_st[k].double(), st[k].double(), rtol=2e-2), k
            elif k == "c":
                th_ref = _core.join_ref(ref_p, ref_st["c"], ecc)
                th = _core.join_ref(p, st["c"], ecc)
                q = torch.maximum(_core._ulp_ref(p), _core._ulp_ref(ref_p)) / 2.0**ecc
                tol = 2 * q + 2.0**-21 * (th.abs() + hp["lr"])  # fp32 rounding of th and update
                assert ((th_ref - th).abs() <= tol).all()
            else:
                assert d.max() <= 1, (k, d.max())


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
        assert torch.equal(_core._to_narrow_t(theta, True), theta.to(torch.bfloat16))
        big = theta.abs() > 2.0**-100  # below, q is clamped at 2**-126 (documented)
        for u in (None, _core.uniform_ref(seed, 1, torch.arange(theta.numel()))):
            p, c = _core.split_ref(theta, torch.bfloat16, 8, u)
            back = _core.join_ref(p, c, 8)
            q = _core._ulp_ref(p) / 256
            err = (back - theta.double()).abs()
            bound = q / 2 if u is None else q
            # the +ulp/2 tie clamps at code 127: one more code there
            assert (err[big] <= bound[big] + q[big] * (c[big] == 127)).all()

    @settings(max_examples=100, deadline=None)
    @given(hs.lists(_finite32.filter(lambda x: abs(x) < 1e30), min_size=1, max_size=96))
    def test_momentum_quantizer_property(values):
        m = torch.tensor(values, dtype=torch.float32).double()
        code, s = _core.quantize_momentum_ref(m)
        back = _core.dequantize_momentum_ref(code, s)
        sg = s.double().repeat_interleave(32)[: m.numel()]
        assert ((back - m).abs() <= sg * 2 / 127 + 1e-300).all()
        assert ((back == 0) <= (m.abs() <= sg / 200)).all()  # zero only for tiny entries
