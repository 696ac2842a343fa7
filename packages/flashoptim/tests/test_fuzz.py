"""Property-based fuzzing of the optimizers (hypothesis): random shapes and layouts
(empty, one element, odd sizes, transposed, channels_last, storage offsets, expanded and
strided views), parameter dtypes (the gradient's is the parameter's: torch refuses others),
gradient values over the whole float range (zeros, subnormals, huge, inf, NaN) and
hyperparameters at their edges, on the CPU path and the kernel (the interpreter on CPU;
CUDA in the ``gpu`` variant).

The contract every example is held to (README, "Bad input"):

* a step returns, or raises ``ValueError`` naming the argument (a non-dense layout);
* a gradient holding inf/NaN (``check_finite=True``) skips the step: parameters, states and
  step counts unchanged bit for bit, ``skipped_steps`` one higher; otherwise nothing is
  skipped (the count never lies);
* after a step, a weight is finite wherever the float64 reference's is (a weight beyond its
  dtype's range becomes inf, as torch's does);
* contiguous parameters match the float64 reference within the bounds of tests/_checks.py.

Adam gradients stay in [1e-18, 1e19) for the reference check: above ~1.8e20, (1 - b2) g^2
leaves fp32's range, v is inf and the element's update is 0, as in torch AdamW (fp32), while
the float64 reference keeps a finite v (test_step_kernel.py holds that case); below ~1e-19,
g^2 is an fp32 subnormal with a few significant bits, so its variance code is as imprecise
as fp32 (torch's too; the update is eps-dominated there). Lion's gradients stay normal:
sign((1 - b1) g) of a subnormal g underflows to 0 in fp32 where float64 keeps its sign.
"""

from __future__ import annotations

import math

import pytest
import torch
from _checks import (
    INTERP,
    _bits,
    assert_step_matches_reference,
    group_of,
    needs_kernel,
    snapshot,
    state_view,
)

import flashoptim_fused as fo

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402

# rows under 32 elements keep fp32 states (grid.py: every 1-D tensor); rows of 32 or more
# take 8-bit states, on the flat grid (3, 32), (2, 8, 2, 2) or per row (2, 33), (1, 70),
# (2, 9, 2, 2) (channels_last: rows of dim 0 in its memory order)
SHAPES = [(0,), (1,), (7,), (33,), (5, 7), (3, 4, 5), (2, 3, 3, 3), (65,)]
SHAPES += [(2, 33), (3, 32), (1, 70), (2, 8, 2, 2), (2, 9, 2, 2)]
LAYOUTS = ["contiguous", "transposed", "channels_last", "offset", "expanded", "strided"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OPTIMIZERS = [
    (fo.FlashAdamW, dict(weight_decay=0.1)),
    (fo.FlashAdam, dict(weight_decay=0.01)),
    (fo.FlashSGD, dict(momentum=0.9)),
    (fo.FlashSGD, dict(momentum=0.9, nesterov=True)),
    (fo.FlashSGDW, dict(momentum=0.5, dampening=0.5, weight_decay=0.1)),
    (fo.FlashLion, dict(weight_decay=0.1)),
]
OPTIONS = [
    {},
    dict(stochastic_rounding=False),
    dict(master_weight_bits=32),
    dict(master_weight_bits=None),
    dict(quantize=False),
    dict(scale_dtype=torch.float32),
    dict(maximize=True),
]


def _layout(base: torch.Tensor, layout: str) -> torch.Tensor:
    """A view of ``base``'s values in ``layout`` (same logical values where possible)."""
    if layout == "transposed" and base.dim() >= 2:
        return base.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "channels_last" and base.dim() == 4:
        return base.contiguous(memory_format=torch.channels_last)
    if layout == "offset":
        buf = torch.empty(base.numel() + 3, dtype=base.dtype)
        v = buf[3:].view(base.shape)
        v.copy_(base)
        return v
    if layout == "expanded" and base.numel() > 1:
        return base.reshape(-1)[:1].expand(base.shape)
    if layout == "strided" and base.dim() >= 1 and base.shape[-1] > 1:
        buf = torch.empty(*base.shape[:-1], 2 * base.shape[-1], dtype=base.dtype)
        v = buf[..., ::2]
        v.copy_(base)
        return v
    return base.clone()


@hs.composite
def cases(draw, kernel: bool, optimizers=tuple(OPTIMIZERS)):
    shape = draw(hs.sampled_from(SHAPES))
    layout = draw(hs.sampled_from(LAYOUTS))
    pdtype = draw(hs.sampled_from(DTYPES))
    gdtype = pdtype  # torch refuses a .grad of another dtype
    Opt, kw = draw(hs.sampled_from(optimizers))
    okw = draw(hs.sampled_from(OPTIONS))
    adam = Opt in (fo.FlashAdamW, fo.FlashAdam)
    hp = dict(lr=draw(hs.sampled_from([0.0, 1e-8, 1e-3, 0.5])))
    if adam:
        hp["betas"] = (
            draw(hs.sampled_from([0.0, 0.9])),
            draw(hs.sampled_from([0.0, 0.999, 1 - 1e-7])),
        )
        hp["eps"] = draw(hs.sampled_from([1e-12, 1e-8, 1.0]))
    elif Opt is fo.FlashLion:
        hp["betas"] = (
            draw(hs.sampled_from([0.0, 0.9, 1.0])),
            draw(hs.sampled_from([0.0, 0.99, 1 - 1e-7])),  # b2 = 1 is refused (frozen m)
        )
    # gradient magnitudes over the range of the gradient dtype (fp16: 6e-8 .. 6e4); bf16
    # subnormals not under the interpreter (it converts them wrongly)
    if gdtype == torch.float16:
        lo, hi = -7, 4
    else:
        lo = -37 if kernel and gdtype == torch.bfloat16 else -44
        # Adam: (1 - b2) g^2 a normal fp32 (>= ~1e-36) and below fp32's range
        # (+6: the "mixed" gradients reach 1e-6 of the scale)
        lo = math.ceil(math.log10(1e-18 / math.sqrt(1 - hp["betas"][1]))) + 6 if adam else lo
        lo = -37 if Opt is fo.FlashLion else lo
        hi = 18 if adam else 36
    scale = 10.0 ** draw(hs.integers(lo, hi))
    special = draw(hs.sampled_from(["none", "none", "zero", "inf", "nan", "mixed"]))
    seed = draw(hs.integers(0, 2**16))
    return shape, layout, pdtype, gdtype, Opt, dict(kw, **okw, **hp), scale, special, seed


def _grad(shape, dtype, scale, special, seed) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen) * scale
    if special == "zero":
        g.zero_()
    elif special == "mixed" and g.numel():
        g = g * torch.logspace(-6, 0, g.numel()).reshape(shape)
    g = g.to(dtype)
    if special in ("inf", "nan") and g.numel():
        g.reshape(-1)[seed % g.numel()] = float(special)
    return g


def _check_case(case, backend: str, dev: str) -> None:
    shape, layout, pdtype, gdtype, Opt, kw, scale, special, seed = case
    gen = torch.Generator().manual_seed(seed + 1)
    base = torch.randn(shape, generator=gen).to(pdtype)
    p = _layout(base, layout).to(dev).requires_grad_()
    if layout in ("expanded", "strided") and p.numel() > 1 and not p.is_contiguous():
        try:
            fo.FlashAdamW([p], backend=backend)
        except ValueError as e:
            assert "parameter 0 of param group 0" in str(e) and "dense" in str(e)
            return
    opt = Opt([p], backend=backend, **kw)
    for step in range(2):
        g = _grad(shape, gdtype, scale, special if step == 1 else "none", seed + step)
        p.grad = g.to(dev)
        before = snapshot(opt, [p])
        st_before = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
        steps_before = opt.state[p]["step"]
        skipped = opt.skipped_steps
        bad = not bool(torch.isfinite(g).all())
        opt.step()
        if bad:  # skipped: nothing changed, counted once
            assert opt.skipped_steps == skipped + 1
            assert torch.equal(_bits(p.detach()), _bits(before[0][0]))
            for k, v in st_before.items():
                assert torch.equal(_bits(opt.state[p][k]), _bits(v)), k
            assert opt.state[p]["step"] == steps_before
            continue
        assert opt.skipped_steps == skipped
        if not p.is_contiguous():
            assert torch.isfinite(fo.master_weight(p, opt)).all() or not torch.isfinite(p).all()
            continue
        hp = opt._hp(group_of(opt, p), p)
        p0, st0 = before[0]
        ref_p, _ = fo.reference.step_ref(
            opt._kind,
            p0.cpu(),
            g,
            {k: v.cpu() for k, v in st0.items()},
            hp,
            opt.state[p]["step"],
            opt.state[p]["seed"],
        )
        fin = torch.isfinite(ref_p.reshape(-1).double())
        assert torch.isfinite(p.detach().cpu().reshape(-1).double())[fin].all()
        if bool(fin.all()) and p.numel():
            assert_step_matches_reference(
                opt._kind,
                hp,
                opt.state[p]["step"],
                opt.state[p]["seed"],
                p0.cpu(),
                g,
                {k: v.cpu() for k, v in st0.items()},
                p.detach().cpu(),
                {k: v.cpu() for k, v in state_view(opt, p).items()},
                ties=dev != "cpu",
                fuzz=True,
            )


def fuzz(n: int):
    """A bounded, reproducible example budget (seconds on the CPU path)."""
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# the H200 run of 2026-12-02's falsifying example (test_gpu_fuzz_kernel): g + wd th of a
# group's maximum lies a hair above a bf16 value in float64, so the reference's scale is
# one bf16 step higher and all the group's codes move (4 of 33 v codes differ)
GPU_EXAMPLE = (
    (1, 33),
    "contiguous",
    torch.bfloat16,
    torch.bfloat16,
    fo.FlashAdam,
    {"weight_decay": 0.01, "lr": 0.0, "betas": (0.0, 0.0), "eps": 1e-12},
    1e11,
    "none",
    11,
)


@fuzz(200)
@given(cases(kernel=False))
@example(GPU_EXAMPLE)
def test_fuzz_cpu_path(case):
    _check_case(case, "torch", "cpu")


@needs_kernel
@pytest.mark.skipif(not INTERP, reason="the CUDA variant is test_gpu_fuzz_kernel")
@fuzz(25)
@given(cases(kernel=True))
def test_fuzz_kernel_interpreted(case):
    _check_case(case, "triton", "cpu")


# One test per optimizer (400 examples in all), so that pytest-xdist spreads the kernel
# compiles of the GPU run over its workers (one item took 314 s on the H200, 2026-12-02).
@pytest.mark.gpu
@pytest.mark.parametrize(
    "optimizer", OPTIMIZERS, ids=lambda o: "-".join([o[0].__name__, *sorted(o[1])])
)
def test_gpu_fuzz_kernel(optimizer):
    @fuzz(400 // len(OPTIMIZERS) + 1)
    @given(cases(kernel=False, optimizers=(optimizer,)))
    def check(case):
        _check_case(case, "triton", "cuda")

    check()
