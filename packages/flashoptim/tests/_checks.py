"""Shared test helpers: where the kernel runs, gradient kinds, the optimizer cases, and the
two comparisons every path is held to (the CPU path, the float64 reference).

Under ``TRITON_INTERPRET=1`` the Triton kernel runs on CPU tensors with numpy's correctly
rounded fp32 arithmetic, and so does the CPU path (plain torch, fp32, op for op the
kernel's math): the two agree bit for bit. On a GPU the kernel's approximate reciprocals,
sqrt and fused multiply-adds move values by an ulp, which flips ties (``assert_ties``).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import flashoptim_fused as fo
from flashoptim_fused import _plan, reference

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP else "cuda"
needs_kernel = pytest.mark.skipif(
    not INTERP and not torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 or CUDA"
)
needs_interp = pytest.mark.skipif(not INTERP, reason="interpreter check (bitwise)")

# every optimizer and its modes: decoupled / coupled decay, momentum, dampening, Nesterov
OPTS = [
    (fo.FlashAdamW, dict(weight_decay=0.1)),
    (fo.FlashAdam, dict(weight_decay=0.1)),
    (fo.FlashSGD, dict(momentum=0.9, weight_decay=0.01)),
    (fo.FlashSGD, dict(momentum=0.9, nesterov=True)),
    (fo.FlashSGD, dict(momentum=0.0)),
    (fo.FlashSGDW, dict(momentum=0.9, dampening=0.1, weight_decay=0.1)),
    (fo.FlashLion, dict(weight_decay=0.1)),
]
OPT_IDS = ["adamw", "adam", "sgd", "sgd_nesterov", "sgd_plain", "sgdw_damp", "lion"]

# the storage options besides the defaults (24-bit master, 8-bit states, stochastic
# rounding, bf16 scales)
OPTIONS = [
    dict(stochastic_rounding=False),
    dict(master_weight_bits=32),
    dict(master_weight_bits=None),
    dict(quantize=False),
    dict(scale_dtype=torch.float32),
]
OPTION_IDS = ["nearest", "bits32", "no_master", "fp32_states", "fp32_scales"]


def shape_of(n: int) -> tuple:
    """A parameter shape of ``n`` elements for the kernel tests: one row of ``n`` for n >= 32
    (8-bit states on the grid of 32 of that row, the flat grid; a row of n % 32 != 0 is one
    per-row table entry), 1-D below (fp32 states: rows under a group, ``grid.py``). A 1-D
    tensor of any size keeps fp32 states, so 1-D sizes would leave the 8-bit path
    untested."""
    return (1, n) if n >= 32 else (n,)


def grad(kind: str, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A gradient of ``kind``: randn; zero; subnormal (in ``dtype``); huge (finite, and so is
    every square and sum the step forms in fp32); mixed (1e-30 .. 1e10 within every group
    of 32, every 7th element zero)."""
    g = torch.randn(n, generator=gen)
    if kind == "zero":
        g = torch.zeros(n)
    elif kind == "subnormal":
        g = g * (1e-39 if dtype != torch.float16 else 1e-6)
    elif kind == "huge":
        g = g * (1e18 if dtype != torch.float16 else 1e4)
    elif kind == "mixed":
        top = 10 if dtype != torch.float16 else 4
        g = g * torch.logspace(-30, top, n)[torch.randperm(n, generator=gen)]
        g[::7] = 0.0
    return g.to(dtype)


def state_view(opt, p) -> dict:
    """The stored state of ``p`` under the names of ``reference.step_ref``."""
    st = opt.state[p]
    out = {}
    for key, a in ((opt._m_key, "m"), (opt._v_key, "v")):
        if key is None:
            continue
        if key + "_codes" in st:  # quantized: codes and the grid's scales (grid.py)
            out[a] = st[key + "_codes"]
            out[a + "s"] = st[key + "_scale"]
        elif key in st:
            out[a] = st[key]
    if "correction" in st:
        out["c"] = st["correction"]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of ``t`` (NaN-safe equality)."""
    if t.is_floating_point():
        return t.view(
            {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        )
    return t


def assert_bitwise(a, pa, b, pb) -> None:
    """Parameters, every state tensor and the step counts equal bit for bit."""
    for p, q in zip(pa, pb, strict=True):
        assert torch.equal(_bits(p.detach()), _bits(q.detach())), "param"
        assert a.state[p].keys() == b.state[q].keys()
        for k, v in a.state[p].items():
            w = b.state[q][k]
            if torch.is_tensor(v):
                assert torch.equal(_bits(v), _bits(w)), k
            else:
                assert v == w, k


def _few(mask: torch.Tensor, frac: float) -> bool:
    """At most ``frac`` of the elements, or two (small tensors), are set in ``mask``."""
    return int(mask.sum()) <= max(2, frac * mask.numel())


def assert_ties(a, pa, b, pb) -> None:
    """GPU against the CPU path after one step from identical inputs: fused multiply-adds
    and approximate reciprocals move values by an ulp, which flips ties: an element's own
    code (one), or its group's bf16 scale by one step (2**-8 relative: one more code for the
    whole group); for Lion a flipped tie can flip sign(c) of an element with c ~ 0, moving
    that weight by 2 lr."""
    lr = float(a.param_groups[0]["lr"])
    for p, q in zip(pa, pb, strict=True):
        sa, sb = a.state[p], b.state[q]
        for k, v in sa.items():
            if not torch.is_tensor(v):
                assert v == sb[k], k
                continue
            w = sb[k].to(v.device)
            d = (v.double() - w.double()).abs()
            if k.endswith("_scale") or v.is_floating_point():
                assert torch.allclose(v.double(), w.double(), rtol=2e-2), k
            elif k == "correction":  # the weight check below bounds what it encodes
                continue
            else:
                assert d.max() <= 2, k
                assert _few(d > 0, 0.02), k
        ma, mb = fo.master_weight(p, a), fo.master_weight(q, b).to(p.device)
        close = torch.isclose(ma, mb, rtol=1e-4, atol=1e-5)  # one int8 code: 2**-15 relative
        assert _few(~close, 0.01)
        assert (ma - mb).abs().max() <= 2 * lr * 1.01 + 1e-4 * ma.abs().max()


def copy_state(src, ps, dst, qs) -> None:
    """Make ``dst``'s parameters and states those of ``src`` (the next GPU step then starts
    from identical inputs again: ties taken differently must not compound)."""
    with torch.no_grad():
        for p, q in zip(ps, qs, strict=True):
            q.copy_(p.to(q.device))
            for k, v in src.state[p].items():
                if torch.is_tensor(v):
                    dst.state[q][k].copy_(v.to(q.device))


def snapshot(opt, ps) -> list:
    """(parameter, stored state) of each of ``ps`` before a step; the first step's zero
    states are created here, as the step would create them."""
    for p in ps:
        if p not in opt.state:
            opt._init_state(p, group_of(opt, p))
    return [(p.detach().clone(), {k: v.clone() for k, v in state_view(opt, p).items()}) for p in ps]


def group_of(opt, p) -> dict:
    return next(g for g in opt.param_groups if any(q is p for q in g["params"]))


def assert_matches_reference(opt, ps, before, ties: bool = False) -> None:
    """One step of ``opt`` (taken after ``before = snapshot(opt, ps)``) against the float64
    reference from the same stored state (``assert_step_matches_reference``), each tensor's
    rounding stream at its index base (``_plan.global_index_base``, as the step draws it)."""
    for p, (p0, st0) in zip(ps, before, strict=True):
        hp = opt._hp(group_of(opt, p), p)
        step, seed = opt.state[p]["step"], opt.state[p]["seed"]
        got = state_view(opt, p)
        ib = _plan.global_index_base(p)
        assert_step_matches_reference(
            opt._kind, hp, step, seed, p0, p.grad, st0, p.detach(), got, ib, ties=ties
        )


def assert_step_matches_reference(
    kind,
    hp,
    step,
    seed,
    p0,
    g,
    st0,
    p1,
    st1,
    idx_base: int = 0,
    ties: bool = False,
    fuzz: bool = False,
) -> None:
    """A step from (``p0``, stored state ``st0``) with gradient ``g`` that gave (``p1``,
    ``st1``), against ``reference.step_ref`` from the same inputs (rounding stream at
    ``idx_base``): group scales within 2% (a bf16 scale rounds up once), codes within one
    (``ties``: a GPU tie on top, two) on at most 2% of the elements (the stochastic
    rounding draws are the reference's: a code differs only where fp32 and float64 fall on
    either side of its threshold), fp32 states within a few fp32 roundings of the
    magnitudes involved, master weights within two correction codes plus
    ``_update_rounding`` (Lion with ``ties``: sign(c ~ 0) may flip on < 1% of the elements,
    moving a weight by 2 lr). fp32 rounding may move a group's ceil-rounded scale one bf16
    step (2**-7 relative: its codes move by up to 255 * 2**-7 < 2) off the float64 one
    where the group maximum lies on a bf16 value (Lion's first m = fp32(0.01) g: 0.01 *
    2.34375 is 3/128 in fp32, a hair above in float64): that group's codes agree within
    two (a shift of the whole group, not counted in the 2%); a v below fp32's normal range
    (2**-126: (1 - b2) g^2 of |g| < ~1e-18 underflows) codes 0, not float64's 1, and is not
    counted either. ``fuzz`` (inputs anywhere in
    the float range): fp32 states carry subnormal round-off (2**-149 absolute).

    Every input is copied to the CPU first: the reference keeps its inputs' device, and one
    device for all of them makes the GPU tests' check the code the CPU suite runs (with
    CUDA inputs the moved-scale check subtracted a ``.cpu()`` kernel scale from a CUDA
    reference one: a device mismatch in every quantized ``_gpu_steps`` test)."""
    p0, g, p1 = (t.detach().cpu() for t in (p0, g, p1))
    st0, st1 = ({k: v.detach().cpu() for k, v in st.items()} for st in (st0, st1))
    gd = g.reshape(-1).to(torch.float64)
    bits = hp["ecc"]
    if bits:
        th0 = reference.join_ref(p0.reshape(-1), st0["c"].reshape(-1), bits)
    else:
        th0 = p0.reshape(-1).double()
    ref_p, ref_st = reference.step_ref(
        kind, p0, g, {k: v.clone() for k, v in st0.items()}, hp, step, seed, idx_base
    )
    for k, ref in ref_st.items():
        v = st1[k].reshape(-1)
        ref = ref.reshape(-1)
        if k in ("ms", "vs"):
            assert torch.allclose(ref.double(), v.double(), rtol=2e-2), k
        elif k == "c":
            continue  # checked through the master weight below
        elif v.is_floating_point():  # fp32 states (quantize=False)
            old = st0[k].reshape(-1).double().abs()
            tol = 2.0**-20 * (ref.double().abs() + old + gd.abs() + gd * gd)
            if fuzz:
                tol = tol + 2.0**-147
            assert ((ref.double() - v.double()).abs() <= tol).all(), k
        else:
            d = (ref.int() - v.int()).abs()
            # groups whose scale fp32 moved one bf16 step (2**-8 .. 2**-7 relative; an fp32
            # scale's ulp is no step): within 2 (ties 3), not counted
            sr, sg = ref_st[k + "s"].double(), st1[k + "s"].reshape(-1).double()
            rel = (sr - sg).abs() / sr.clamp(min=2.0**-149)
            moved = (rel > 2.0**-9) & (rel <= 2.0**-7 * (1 + 2.0**-20))
            same = ~moved[_group_index(p0)]
            d = torch.where(same, d, (d - 1).clamp(min=0))
            if k == "v":  # a float64 v below fp32's normal range is 0 in fp32: code 0, not 1
                v64 = _adam_mv(hp, gd, th0, st0)[1]
                same = same & (v64 >= 2.0**-126)
            assert d.max() <= (2 if ties else 1), (k, int(d.max()))
            assert _few((d > 0) & same, 0.02), k
    lr = float(hp["lr"])
    pn = p1.reshape(-1)
    ref_pn = ref_p.reshape(-1)
    if bits:
        th = reference.join_ref(pn, st1["c"].reshape(-1), bits)
        th_ref = reference.join_ref(ref_pn, ref_st["c"].reshape(-1), bits)
        q = torch.maximum(reference.ulp_ref(pn), reference.ulp_ref(ref_pn)) / 2.0**bits
        step_q = 2 * q
    else:  # the narrow (or fp32) parameter is the only copy: one rounding step of it
        th, th_ref = pn.double(), ref_pn.double()
        step_q = reference.ulp_ref(pn) if pn.dtype != torch.float32 else 0.0
    tol = step_q + _update_rounding(kind, hp, step, gd, th0, th_ref, st0)
    bad = (th - th_ref).abs() > tol
    if ties and kind == reference.LION:
        assert _few(bad, 0.01)
        assert ((th - th_ref).abs() <= 2 * lr * 1.01 + tol).all()
    else:
        assert not bad.any(), float(((th - th_ref).abs() / tol).max())


def _update_rounding(kind, hp, step, g, th0, th1, st0) -> torch.Tensor:
    """Per element, what fp32 arithmetic may move the new master weight off the float64
    ``th1`` (from ``th0``, gradient ``g``, the stored states ``st0``). Two kinds of error:

    * every fp32 operation rounds at the magnitude of its operands and result: the old
      weight, the update and the new weight, 2**-21 (8 roundings of 2**-24) of
      ``|th0| + |th1| + |th0 - th1|``. (The update is not ~lr: SGD's is lr * |m| with
      mixed gradients up to 1e10, and th1 ~ 0 where th0 and the update cancel.)
    * Adam's update ``m / (sqrt(v) / sqrt(bc2) + eps)`` is ill-conditioned where it is
      eps-dominated. The coupled decay's ``g' = g + wd th`` carries an absolute error E_g =
      2**-23 wd |th0| + 2**-24 |g'| (wd is the fp32 scalar, 2**-24 relative off; its
      product rounds, by 2**-24, on the CPU path, not in the GPU's fused multiply-add; the
      sum rounds), m = b1 m0 + (1 - b1) g' one of E_m = 2**-23 (b1 |m0| + (1 - b1) |g'|)
      + (1 - b1) E_g, and the update moves by step_size (E_m + |m| isb sqrt(1 - b2) E_g /
      D) / D (D the float64 denominator, isb = 1 / sqrt(bc2); the second term is v's
      share: |dD/dg'| <= isb sqrt(1 - b2)). Where g' cancels to 0 in float64 (g = -wd th
      exactly in bf16) the update is 0 there, and the GPU's fma keeps g' = 4.5e-10 (wd =
      fp32(0.1)): lr * 0.043 (the H200 run of 2026-12-02: 38.97 times the first bound
      alone; this term allows lr * 0.36 at that element)."""
    tol = 2.0**-21 * (th0.abs() + th1.abs() + (th0 - th1).abs())
    if kind != reference.ADAM:
        return tol
    b1, b2, eps, wd = hp["b1"], hp["b2"], hp["eps"], hp["wd"]
    m0 = _decoded(st0, "m", hp)
    m, v = _adam_mv(hp, g, th0, st0)
    isb = 1 / math.sqrt(1 - b2**step)
    step_size = hp["lr"] / (1 - b1**step)
    denom = v.sqrt() * isb + eps
    e_g = 0.0  # the gradient is stored exactly; the coupled decay's sum is not
    if not hp["decoupled"]:
        e_g = 2.0**-23 * wd * th0.abs() + 2.0**-24 * ((m - b1 * m0) / (1 - b1)).abs()
    e_m = 2.0**-23 * (b1 * m0.abs() + (m - b1 * m0).abs()) + (1 - b1) * e_g
    return tol + step_size * (e_m + m.abs() * isb * math.sqrt(1 - b2) * e_g / denom) / denom


def _adam_mv(hp, g, th0, st0) -> tuple:
    """This Adam step's float64 m and v (``reference.step_ref``'s) from the stored states."""
    m0, v0 = _decoded(st0, "m", hp), _decoded(st0, "v", hp)
    gc = -g if hp.get("maximize") else g
    if not hp["decoupled"]:
        gc = gc + hp["wd"] * th0
    return m0 * hp["b1"] + (1 - hp["b1"]) * gc, v0 * hp["b2"] + (1 - hp["b2"]) * gc * gc


def _decoded(st, k, hp) -> torch.Tensor:
    """The float64 value of state ``k`` (``m`` or ``v``) of a stored state dict (codes of
    the parameter's shape: their grid is its rows', ``grid.py``)."""
    v = st[k].reshape(-1)
    if not hp["quant"]:
        return v.double()
    dq = reference.dequantize_momentum_ref if k == "m" else reference.dequantize_variance_ref
    return dq(v, st[k + "s"].reshape(-1), reference.state_row(st[k], True))


def _group_index(p: torch.Tensor) -> torch.Tensor:
    """Per element of ``p`` (flat, memory order) the index of its group scale: groups of 32
    within rows where rows end inside a group (``grid.split``), else over the flat tensor."""
    i = torch.arange(p.numel())
    r = reference.state_row(p, True)
    if r is None:
        return i // reference.GROUP
    return (i // r) * -(-r // reference.GROUP) + (i % r) // reference.GROUP


# (7, 5), (33,), (300,): rows under 32 (fp32 states, grid.py); (3, 40): quantized rows of
# 40 (groups of 32 and 8 per row)
def small_params(dtype=torch.float32, seed=0, sizes=((7, 5), (33,), (300,), (3, 40))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in sizes]


def small_grads(ps, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in ps]


def assert_matches_torch_unquantized(Flash, Torch, kw, dtype) -> None:
    """quantize=False + 32-bit master weights: the same trajectory as torch.optim on fp32
    (fp32 round-off over 20 steps; the int16 correction keeps the full fp32 value)."""
    ps = small_params(dtype)
    ref = [p.detach().float().clone().requires_grad_() for p in ps]
    a = Flash(ps, quantize=False, master_weight_bits=32, **kw)
    b = Torch(ref, foreach=False, **kw)
    for s in range(20):
        for p, r, g in zip(ps, ref, small_grads(ps, s)):
            p.grad, r.grad = g.to(dtype), g.to(dtype).float()
        a.step()
        b.step()
    for p, r in zip(ps, ref):
        torch.testing.assert_close(fo.master_weight(p, a), r.detach(), rtol=1e-5, atol=1e-5)


def assert_quantized_tracks_unquantized(Opt, **kw) -> None:
    """Default (quantized, 24-bit) vs unquantized fp32: same direction, small deviation."""
    ps = small_params(torch.bfloat16)
    ref = [p.detach().float().clone().requires_grad_() for p in ps]
    a, b = Opt(ps, lr=1e-3, **kw), Opt(ref, lr=1e-3, quantize=False, **kw)
    init = [r.detach().clone() for r in ref]
    for s in range(20):
        for p, r, g in zip(ps, ref, small_grads(ps, s)):
            p.grad, r.grad = g.bfloat16(), g
        a.step()
        b.step()
    for p, r, i in zip(ps, ref, init):
        da, db = fo.master_weight(p, a) - i, r.detach() - i
        cos = torch.nn.functional.cosine_similarity(da.flatten(), db.flatten(), dim=0)
        assert cos > 0.97
        assert (da - db).norm() < 0.2 * db.norm()
