"""The leaner v4 tile math (``LEAN``, the default; ``FLASHOPTIM_LEAN=0`` / ``opt._lean = False``
selects the previous math).

Same bits as v4's default (v3's) tile math: under the interpreter on odd sizes, edge-case
gradients, every storage option, fp16/fp32 parameters, AdamW/Adam/SGD/Lion, a skipped step
with a non-finite gradient, and both rounding-stream cases (LEAN 2: every tensor's global
index base is a multiple of 8, LEAN 1: not). On the GPU the inline-PTX parts (byte
decodes, packed bf16 conversions, group-scale stores) run too: bitwise against the default
with the same ``LEAN_PIN`` bit (explicit fma: without it LLVM orders the two products of
``v * b2 + one_m_b2 * g * g`` and alike differently in the two codes, so a different product
is fused: the 1-ulp fp32 differences the H200 found on 2026-12-01).
"""

import pytest
import torch
from test_v3 import DEV, STORAGE_OPTIONS, _assert_bitwise, _grad, needs_interp

import flashoptim as fo
from flashoptim import _core
from flashoptim import optimizers as fopt

U = _core.V4_UNIT

OPTS = [
    (fo.FlashAdamW, dict(weight_decay=0.1)),
    (fo.FlashAdam, dict(weight_decay=0.1, eps=0.0)),
    (fo.FlashSGD, dict(momentum=0.9, nesterov=True)),
    (fo.FlashSGD, dict(momentum=0.0)),
    (fo.FlashLion, dict(weight_decay=0.1)),
]


def _pair(Opt, kw, sizes, dtype, kinds, steps=3, dev=DEV, nan_step=None, parts=None, **okw):
    """Two v4 optimizers on the same parameters and gradients, default and lean tile math.
    ``parts``: the lean side's GPU parts (default FLASHOPTIM_LEAN_PARTS or all); the default
    side gets their ``LEAN_PIN`` bit (the explicit fma both sides need to agree bitwise)."""
    parts = fopt._lean_parts(True, parts)
    gen = torch.Generator().manual_seed(0)
    ps = [(torch.randn(n, generator=gen) * 0.1).to(dtype).to(dev) for n in sizes]
    out = []
    for lean in (False, True):
        qs = [p.clone().requires_grad_() for p in ps]
        opt = Opt(qs, lr=1e-2, backend="triton", kernel="v4", **kw, **okw)
        opt._lean = lean
        opt._lean_parts = parts if lean else parts & _core.LEAN_PIN
        out.append((opt, qs))
    for s in range(steps):
        grads = [
            _grad(kinds[(s + i) % len(kinds)], n, dtype, gen).to(dev) for i, n in enumerate(sizes)
        ]
        if s == nan_step:
            grads[-1][-1] = float("nan")
        for opt, qs in out:
            for q, g in zip(qs, grads):
                q.grad = g.clone()
            opt.step()
    return out


SIZES = (1, 31, 33, U + 1, 2049, 1)
EDGE = [("randn",), ("zero", "randn"), ("subnormal", "huge", "mixed")]


@needs_interp
@pytest.mark.parametrize("Opt,kw", OPTS)
@pytest.mark.parametrize("kinds", EDGE)
def test_lean_equals_default_bitwise(Opt, kw, kinds):
    out = _pair(Opt, kw, SIZES, torch.bfloat16, kinds, check_finite=False)
    _assert_bitwise(out)


@needs_interp
@pytest.mark.parametrize(
    "okw",
    STORAGE_OPTIONS,
)
def test_lean_equals_default_bitwise_options(okw):
    out = _pair(fo.FlashAdamW, {}, (7, 300, 2 * U + 33), torch.bfloat16, ("mixed",), **okw)
    _assert_bitwise(out)


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("Opt,kw", OPTS[:1] + OPTS[2:3] + OPTS[4:])
def test_lean_equals_default_bitwise_other_dtypes(dtype, Opt, kw):
    out = _pair(Opt, kw, (5, U + 100), dtype, ("randn", "mixed"), steps=2)
    _assert_bitwise(out)


@needs_interp
def test_lean_skips_nonfinite_step_like_default():
    out = _pair(fo.FlashAdamW, {}, (33, 4100), torch.bfloat16, ("randn",), steps=4, nan_step=1)
    assert out[0][0].skipped_steps == out[1][0].skipped_steps == 1
    _assert_bitwise(out)


@needs_interp
@pytest.mark.parametrize("base,lean", [(5, 1), (8 * 12345, 2), (2**32 - 8, 2), (2**32 - 3, 1)])
def test_lean_rounding_stream_index_bases(monkeypatch, base, lean):
    """Sharded tensors' rounding streams start at their global index (``_global_index_base``):
    a base that is not a multiple of 8 takes LEAN 1 (v3's first hash round), one that is
    takes LEAN 2; both equal the default bit for bit, wrapping mod 2**32 included."""
    monkeypatch.setattr(fopt, "_global_index_base", lambda p: base + p.numel())
    seen = []
    run = fopt.FlashOptimizer._run_kernel_v3

    def spy(self, ent, *a, **k):
        seen.append((self._lean, ent["ib8"]))
        return run(self, ent, *a, **k)

    monkeypatch.setattr(fopt.FlashOptimizer, "_run_kernel_v3", spy)
    out = _pair(fo.FlashAdamW, {}, (16, 48, 2064), torch.bfloat16, ("mixed",), steps=2)
    _assert_bitwise(out)
    assert (True, lean == 2) in seen


def test_lean_parts_resolution(monkeypatch):
    """PARTS: all by default when lean, none at LEAN 0; FLASHOPTIM_LEAN_PARTS (read at every
    launch) or ``opt._lean_parts``; at LEAN 0 only the PIN bit survives."""
    monkeypatch.delenv("FLASHOPTIM_LEAN_PARTS", raising=False)
    assert fopt._lean_parts(True, None) == _core.LEAN_ALL == 31
    assert fopt._lean_parts(False, None) == 0
    monkeypatch.setenv("FLASHOPTIM_LEAN_PARTS", "0x12")
    assert fopt._lean_parts(True, None) == 0x12
    assert fopt._lean_parts(False, None) == _core.LEAN_PIN
    assert fopt._lean_parts(True, 5) == 5 and fopt._lean_parts(False, 5) == 0


@needs_interp
@pytest.mark.parametrize("parts", [0, _core.LEAN_PIN, _core.LEAN_ALL])
def test_lean_parts_interpreter_bitwise(parts):
    """Under the interpreter every PARTS value runs the same (ASM-free) code: bitwise equal."""
    out = _pair(
        fo.FlashSGD,
        dict(momentum=0.9, nesterov=True),
        (33, 2049),
        torch.bfloat16,
        ("randn", "mixed"),
        steps=2,
        parts=parts,
    )
    _assert_bitwise(out)


def test_lean_env_default_off():
    opt = fo.FlashAdamW([torch.nn.Parameter(torch.zeros(4))])
    assert opt._lean == fopt._LEAN


GPU_SIZES = (1_000_003, 4097, 31, 3 * U, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("Opt,kw", OPTS)
def test_gpu_lean_equals_default(monkeypatch, Opt, kw):
    """GPU, inline PTX, default config: lean vs default tile math, bf16, 3 steps of 1M + odd
    elements and whole chunks with zero / randn / mixed-magnitude gradients; bitwise. AdamW
    also with a NaN in step 1 (skipped by both)."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    out = _pair(Opt, kw, GPU_SIZES, torch.bfloat16, ("randn", "mixed", "zero"), dev="cuda")
    _assert_bitwise(out)
    if Opt is fo.FlashAdamW:
        out = _pair(Opt, kw, GPU_SIZES, torch.bfloat16, ("randn",), dev="cuda", nan_step=1)
        assert out[0][0].skipped_steps == out[1][0].skipped_steps == 1
        _assert_bitwise(out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_lean_other_dtypes(monkeypatch, dtype):
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    out = _pair(fo.FlashAdamW, {}, GPU_SIZES, dtype, ("randn", "mixed"), dev="cuda")
    _assert_bitwise(out)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "okw",
    [
        dict(master_weight_bits=32),  # int16 corrections: the ECC 16 constants of _q_bf16x2
        dict(scale_dtype=torch.float32),  # st.global.b32 of the scales
        dict(stochastic_rounding=False),
        dict(master_weight_bits=None),
        dict(quantize=False),
    ],
)
def test_gpu_lean_equals_default_options(monkeypatch, okw):
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    sizes = (7, 300, 2 * U + 33, 100_000)
    out = _pair(fo.FlashAdamW, {}, sizes, torch.bfloat16, ("mixed", "randn"), dev="cuda", **okw)
    _assert_bitwise(out)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    _core._v4_configs(),
    ids=lambda c: "B{BLOCK}_W{WAVES}_PF{PF}".format(**c.kwargs) + f"_w{c.num_warps}",
)
def test_gpu_lean_every_config(monkeypatch, cfg):
    """Every tuning config (BLOCK 2048 on 4 / 8 warps, PF 0 / 2 / 4, persistent) as the
    single default config: lean vs default, AdamW, bitwise."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    monkeypatch.setattr(_core, "V4_DEFAULT", dict(cfg.kwargs))
    monkeypatch.setattr(_core, "V4_DEFAULT_WARPS", cfg.num_warps)
    out = _pair(fo.FlashAdamW, {}, GPU_SIZES, torch.bfloat16, ("mixed", "randn"), dev="cuda")
    _assert_bitwise(out)


@needs_interp
@pytest.mark.parametrize("ib,lean", [(0, 2), (8 * 977, 2), (2**32 - 8, 2), (3, 1), (2**32 - 5, 1)])
def test_lean_draw_equals_uniform_ref(ib, lean):
    """The lean rounding draw equals ``uniform_ref`` (v3's draw) bit for bit on 64K indices,
    across 2**16 boundaries of the index (where the first hash round's shift matters)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _k(out, ib, key, LEAN: tl.constexpr, BLOCK: tl.constexpr):
        off = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out + off, _core._draw_lean(off, ib.to(tl.uint32), key.to(tl.uint32), LEAN))

    n, seed, step = 1 << 16, 12345, 7
    out = torch.empty(n, dtype=torch.float32)
    key = _core._mix32_t(torch.tensor([(seed + step * _core._GOLDEN) & 0xFFFFFFFF])).item()
    _k[(n // 4096,)](out, ib, key, LEAN=lean, BLOCK=4096)
    ref = _core.uniform_ref(seed, step, torch.arange(n, dtype=torch.int64) + ib)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


@pytest.mark.gpu
def test_gpu_lean_unaligned_grads(monkeypatch):
    """Gradients as views into one flat buffer at an odd element offset (the bucket's
    vectorized path off, ALIGNED False): lean vs default, AdamW and Lion, bitwise."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")
    sizes = (64, 4096, 48, 1000)
    for Opt in (fo.FlashAdamW, fo.FlashLion):
        torch.manual_seed(1)
        ps = [torch.randn(n, device="cuda").bfloat16() for n in sizes]
        out = []
        for lean in (False, True):
            qs = [p.clone().requires_grad_() for p in ps]
            opt = Opt(qs, lr=1e-2, weight_decay=0.1, kernel="v4", backend="triton")
            opt._lean = lean
            out.append((opt, qs))
        for _ in range(3):
            buf = torch.randn(sum(sizes) + 64, device="cuda").bfloat16()
            for opt, qs in out:
                off = 1
                for q in qs:
                    q.grad = buf[off : off + q.numel()]
                    off += q.numel() + 3
                opt.step()
        assert not next(iter(out[1][0]._plans.values()))["buckets"][0]["ent"]["aligned"]
        _assert_bitwise(out)
