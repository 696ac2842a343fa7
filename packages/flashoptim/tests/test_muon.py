"""FlashMuon (``muon.py``, ``_muon_kernel.py``): the split into Muon and AdamW groups, the
Newton-Schulz iteration against torch.optim.Muon's and the float64 reference, one step
against ``muon_step_ref``, the CPU path bit for bit the interpreted kernels, the unquantized
run against torch.optim.Muon, lost updates, non-finite gradients, checkpoints, bytes per
parameter; on the GPU the kernels against the CPU path and the allocator's bytes per
parameter. Several processes: test_muon_sharded.py."""

import copy

import pytest
import torch
from _checks import DEV, _bits, assert_bitwise, needs_interp, needs_kernel

import flashoptim_fused as fo
from flashoptim_fused import _muon_lowrank, reference
from flashoptim_fused.muon import LOWRANK_P as LOW_P
from flashoptim_fused.muon import LOWRANK_R as LOW_R
from flashoptim_fused.muon import default_use_muon, lr_ratio, matrix_shape, newton_schulz

torch_muon = getattr(torch.optim, "Muon", None)
needs_torch_muon = pytest.mark.skipif(torch_muon is None, reason="torch.optim.Muon (torch 2.9+)")
# odd shapes: wide, tall, two of one shape (batched), a vector and a 4-D tensor (AdamW by
# the default rule)
SHAPES = [(40, 64), (64, 32), (40, 64), (36, 33), (33, 7), (50,), (4, 3, 2, 2)]
# (both sides >= 32: a low-rank momentum part; 36 x 33: rows ending inside a group (a
# table entry per row) and a numel not a multiple of 16; 33 x 7: rows under a group, fp32
# momentum; the others rows of whole groups: few programs under the interpreter)


def _params(dtype=torch.bfloat16, seed=0, shapes=SHAPES, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in shapes]


def _grads(ps, seed, dtype=None, scale=1.0):
    g = torch.Generator().manual_seed(1000 + seed)
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.device, dtype or p.dtype)


def _train(opt, ps, steps, first=0, **kw):
    for s in range(first, first + steps):
        _grads(ps, s, **kw)
        opt.step()


# ------------------------------------------------------------------------- param groups


def test_default_split_by_dimension_and_name():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = torch.nn.Embedding(16, 8)
            self.wpe = torch.nn.Embedding(4, 8)
            self.fc = torch.nn.Linear(8, 8)
            self.norm = torch.nn.LayerNorm(8)
            self.lm_head = torch.nn.Linear(8, 16, bias=False)
            self.conv = torch.nn.Conv2d(2, 2, 3)

    net = Net()
    opt = fo.FlashMuon(net.named_parameters(), lr=0.02, adamw_lr=3e-4, adamw_weight_decay=0.0)
    muon, adam = opt.param_groups
    assert muon["use_muon"] and not adam["use_muon"]
    assert muon["param_names"] == ["fc.weight"]
    assert set(adam["param_names"]) == {n for n, _ in net.named_parameters()} - {"fc.weight"}
    assert (muon["lr"], adam["lr"], muon["weight_decay"], adam["weight_decay"]) == (
        0.02,
        3e-4,
        0.1,
        0.0,
    )
    assert adam["betas"] == (0.9, 0.95) and adam["eps"] == 1e-8 and muon["eps"] == 1e-7
    # without names every 2-D parameter takes Muon; explicit groups are kept as given
    assert default_use_muon(None, net.tok_embeddings.weight)
    assert not default_use_muon("transformer.wte.weight", net.wpe.weight)
    opt = fo.FlashMuon(
        [
            {"params": [net.fc.weight, net.conv.weight], "use_muon": True},
            {"params": [net.fc.bias], "use_muon": False, "lr": 1e-3, "eps": 1e-6},
        ],
        lr=0.05,
    )
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert opt.param_groups[1]["lr"] == 1e-3 and opt.param_groups[1]["eps"] == 1e-6
    assert matrix_shape(net.conv.weight) == (2, 18)


def test_clear_errors():
    w, b = torch.zeros(4, 4, requires_grad=True), torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match="2 or more dimensions"):
        fo.FlashMuon([{"params": [b], "use_muon": True}])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        fo.FlashMuon([w], adjust_lr_fn="rms")
    with pytest.raises(ValueError, match="ns_steps"):
        fo.FlashMuon([w], ns_steps=-1)
    with pytest.raises(ValueError, match="momentum"):
        fo.FlashMuon([w], momentum=-0.5)
    with pytest.raises(ValueError, match="betas"):
        fo.FlashMuon([w, b], adamw_betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="capturable"):
        fo.FlashMuon([w], capturable=True)


@needs_torch_muon
def test_lr_ratio_matches_torch():
    from torch.optim._muon import _adjust_lr

    for shape in [(40, 24), (24, 40), (7, 7), (1, 3000)]:
        for fn in (None, "original", "match_rms_adamw"):
            assert lr_ratio(shape, fn) == pytest.approx(_adjust_lr(1.0, fn, torch.Size(shape)))


# ------------------------------------------------------------------------- Newton-Schulz


def test_newton_schulz_against_torch_and_float64():
    """Ours is torch.optim.Muon's iteration (bitwise for one matrix on the CPU), batched; both
    are within 2% (Frobenius, relative) of the float64 iteration; the float64 iteration maps
    a random matrix's singular values into [0.68, 1.14] (not exactly 1: the quintic's
    coefficients trade convergence for slope at 0)."""
    g = torch.Generator().manual_seed(0)
    for shape in [(64, 48), (48, 64), (7, 33)]:
        x = torch.randn(shape, generator=g).bfloat16()
        ref = reference.newton_schulz_ref(x)
        ours = newton_schulz(x)
        err = ((ours.double() - ref).norm() / ref.norm()).item()
        assert err < 0.02, err
        sv = torch.linalg.svdvals(ref)
        assert 0.6 < sv.min() and sv.max() < 1.2, sv.aminmax()
        if torch_muon is not None:
            from torch.optim._muon import _zeropower_via_newtonschulz

            theirs = _zeropower_via_newtonschulz(x, reference.NS_COEFFICIENTS, 5, 1e-7)
            terr = ((theirs.double() - ref).norm() / ref.norm()).item()
            assert err <= 2 * terr
            assert torch.equal(ours, theirs)
        batch = torch.stack([x, -2 * x]).contiguous()
        out = batch.clone()
        newton_schulz(out, out=out)  # in place, as the step writes the workspace
        for i in range(2):
            bref = reference.newton_schulz_ref(batch[i])
            assert ((out[i].double() - bref).norm() / bref.norm()) < 0.02


# ------------------------------------------------------------------------- one step


def _state_snapshot(opt, ps):
    for group in opt.param_groups:
        for p in group["params"]:
            opt._init_state(p, group)
    out = []
    for p in ps:
        st = opt.state[p]
        sv = {"c": st.get("correction")}
        if "momentum_buffer_codes" in st:  # 8-bit codes, (rows, groups per row) scales
            sv["m"], sv["ms"] = st["momentum_buffer_codes"], st["momentum_buffer_scale"]
            if LOW_P in st:  # the low-rank part's factors
                sv["P"], sv["R"] = st[LOW_P], st[LOW_R]
        elif "momentum_buffer" in st:  # fp32 (rows under 32 elements: grid.py)
            sv["m"] = st["momentum_buffer"]
        out.append((p.detach().clone(), {k: v.clone() for k, v in sv.items() if v is not None}))
    return out


def _ref_u(p0, g, st0, hp):
    """The direction u of ``muon_step_ref``'s step (bf16, the matrix's shape)."""
    _, _, u, _ = reference.muon_step_ref(p0, g, st0, hp, 2, 0, orthogonalize=lambda x: x)
    return u.to(torch.bfloat16).view(matrix_shape(p0))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
def test_step_matches_float64_reference(backend, adjust):
    """Two steps; the second against ``muon_step_ref`` from the stored state, with O from
    the float64 Newton-Schulz of the reference's own direction: codes within one, scales
    within a bf16 step, the update direction within the bf16 iteration's 2%, and (with O
    taken as ours) the master weights within two correction codes."""
    dev = DEV if backend == "triton" else "cpu"
    ps = _params(device=dev)[:4]
    opt = fo.FlashMuon(ps, lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust, backend=backend)
    _train(opt, ps, 1)
    before = _state_snapshot(opt, ps)
    _grads(ps, 1)
    opt.step()
    group = opt.param_groups[0]
    for p, (p0, st0) in zip(ps, before):
        hp = dict(opt._hp(group, p), ratio=lr_ratio(matrix_shape(p), adjust))
        hp["ns"] = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        st = opt.state[p]
        # the new factors as ours: the reference's (float64) power iteration differs by
        # roundings, and the residual codes are taken against the stored factors
        fac = None
        if LOW_P in st:
            assert "P" in st0 and not torch.equal(st0["R"], st[LOW_R])  # they moved
            fac = lambda u, g, R, st=st: (st[LOW_P].cpu(), st[LOW_R].cpu())  # noqa: E731
            want = reference.lowrank_factors_ref(
                _ref_u(p0, p.grad, st0, hp),
                p.grad.double().view(matrix_shape(p)),
                st0["R"].cpu(),
                hp["mu"],
                hp["nesterov"],
            )
            low_ref = reference.lowrank_ref(*want)
            low = reference.lowrank_ref(st[LOW_P].cpu(), st[LOW_R].cpu())
            assert (low - low_ref).norm() <= 0.02 * low_ref.norm()
        ref_p, ref_st, u, o_ref = reference.muon_step_ref(
            p0, p.grad, st0, hp, 2, st["seed"], factors=fac
        )
        if "momentum_buffer_codes" in st:
            codes = st["momentum_buffer_codes"].reshape(-1).int()
            assert (ref_st["m"].int() - codes).abs().max() <= 1
            scales = st["momentum_buffer_scale"].double().reshape(-1)
            assert torch.allclose(ref_st["ms"].double(), scales, rtol=2e-2)
        else:  # fp32 momentum (rows under 32 elements): the fp32 EMA of the float64 one
            m = st["momentum_buffer"].reshape(-1)
            torch.testing.assert_close(ref_st["m"], m, rtol=1e-5, atol=1e-7)
        th0 = reference.join_ref(p0.reshape(-1), st0["c"].reshape(-1), 8) * (
            1 - hp["lr"] * hp["wd"]
        )
        th1 = reference.join_ref(p.detach().reshape(-1), st["correction"].reshape(-1), 8)
        o_ours = (th0 - th1) / (hp["lr"] * hp["ratio"])
        q = reference.ulp_ref(p.detach().reshape(-1)) / 256
        rel = (o_ours - o_ref).norm() / o_ref.norm()
        assert rel < 0.02, rel.item()
        # the same step with O = ours: the split is the reference's to two codes
        _, _, _, o_same = reference.muon_step_ref(
            p0,
            p.grad,
            st0,
            hp,
            2,
            st["seed"],
            orthogonalize=lambda x, o=o_ours: o.view(x.shape),
            factors=fac,
        )
        ref_th = th0 - hp["lr"] * hp["ratio"] * o_same
        assert ((th1 - ref_th).abs() <= 2 * q + 2.0**-21 * th1.abs()).all()
        del ref_p, u


# ------------------------------------------------------------------------- CPU path


MODES = [
    dict(),
    dict(nesterov=False, stochastic_rounding=False),
    dict(quantize=False, master_weight_bits=32),
    dict(scale_dtype=torch.float32, master_weight_bits=None),
]
MODE_IDS = ["default", "plain_nearest", "fp32_states_bits32", "fp32_scales_no_master"]


@needs_interp
@pytest.mark.parametrize("kw", MODES, ids=MODE_IDS)
def test_cpu_path_is_the_interpreted_kernel(kw):
    """The kernels under the interpreter and the CPU path, 3 steps: parameters, codes,
    scales, corrections and steps equal bit for bit (Muon and AdamW groups, bf16 and fp32
    parameters)."""
    out = []
    for backend in ("torch", "triton"):
        ps = _params() + _params(torch.float32, seed=1, shapes=[(24, 16)])
        opt = fo.FlashMuon(fo_named(ps), lr=0.02, backend=backend, **kw)
        _train(opt, ps, 3)
        out.append((opt, ps))
    (a, pa), (b, pb) = out
    assert_bitwise(a, pa, b, pb)


def fo_named(ps):
    return [(f"layer{i}.weight", p) for i, p in enumerate(ps)]


@needs_torch_muon
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_muon_without_quantization(dtype):
    """quantize=False and 32-bit master weights: torch.optim.Muon's trajectory (fp32) over
    20 steps of lr 0.02 (a mean movement of ~0.05 per element) to 1e-3: the bf16 direction's
    rounding ties (torch's lerp and ours differ by an fp32 ulp) move single bf16 ulps of O."""
    ps = _params(dtype)[:4]
    ref = [p.detach().float().clone().requires_grad_() for p in ps]
    a = fo.FlashMuon(ps, lr=0.02, quantize=False, master_weight_bits=32)
    b = torch_muon(ref, lr=0.02)
    init = [r.detach().clone() for r in ref]
    for s in range(20):
        _grads(ps, s)
        for p, r in zip(ps, ref):
            r.grad = p.grad.float()
        a.step()
        b.step()
    for p, r, i in zip(ps, ref, init):
        assert (r.detach() - i).abs().mean() > 0.02
        torch.testing.assert_close(fo.master_weight(p, a), r.detach(), rtol=0, atol=1e-3)


def test_quantized_tracks_unquantized():
    ps = _params()
    ref = [p.detach().float().clone().requires_grad_() for p in ps]
    a = fo.FlashMuon(fo_named(ps), lr=0.01)
    b = fo.FlashMuon(fo_named(ref), lr=0.01, quantize=False)
    init = [r.detach().clone() for r in ref]
    for s in range(20):
        _grads(ps, s)
        for p, r in zip(ps, ref):
            r.grad = p.grad.float()
        a.step()
        b.step()
    for p, r, i in zip(ps, ref, init):
        da, db = fo.master_weight(p, a) - i, r.detach() - i
        cos = torch.nn.functional.cosine_similarity(da.flatten(), db.flatten(), dim=0)
        assert cos > 0.97, (tuple(p.shape), cos)


def test_lowrank_momentum_is_finer_than_whole_codes():
    """Gradients with a strong rank-2 part (as real ones have) plus noise, 20 steps: the
    stored momentum (P R^T + residual codes) against the fp32 momentum of a quantize=False
    twin is several times closer than the whole momentum in the same int8 codes would be
    (the codes' scale is set by the top directions), and so is the orthogonalised update."""
    g = torch.Generator().manual_seed(4)
    shape = (64, 96)
    p = torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True)
    q = torch.zeros(shape, requires_grad=True)
    a = fo.FlashMuon([p], lr=0.0)  # lr 0: the momentum alone
    b = fo.FlashMuon([q], lr=0.0, quantize=False)
    left, right = torch.randn(64, 2, generator=g), torch.randn(2, 96, generator=g)
    for _ in range(20):
        grad = left @ torch.diag(torch.randn(2, generator=g)) @ right
        grad = grad + 0.05 * torch.randn(shape, generator=g)
        p.grad, q.grad = grad.bfloat16(), grad.bfloat16().float()
        a.step()
        b.step()
    st = a.state[p]
    m_ref = b.state[q]["momentum_buffer"].double()
    codes, scales = st["momentum_buffer_codes"], st["momentum_buffer_scale"]
    m = reference.dequantize_momentum_ref(codes.reshape(-1), scales).view(shape)
    m = m + reference.lowrank_ref(st[LOW_P], st[LOW_R])
    whole = reference.dequantize_momentum_ref(*reference.quantize_momentum_ref(m_ref)).view(shape)
    err = ((m - m_ref).norm() / m_ref.norm()).item()
    err_whole = ((whole - m_ref).norm() / m_ref.norm()).item()
    assert err < err_whole / 4, (err, err_whole)
    ns = reference.newton_schulz_ref
    d = ((ns(m) - ns(m_ref)).norm() / ns(m_ref).norm()).item()
    d_whole = ((ns(whole) - ns(m_ref)).norm() / ns(m_ref).norm()).item()
    assert d < d_whole / 4, (d, d_whole)


def _low_err(P, R, P_ref, R_ref) -> float:
    low, ref = reference.lowrank_ref(P, R), reference.lowrank_ref(P_ref, R_ref)
    return ((low - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("nesterov", [True, False])
def test_lowrank_factors_match_float64_on_hostile_inputs(nesterov):
    """``update_factors`` (fp32 thin products) against ``lowrank_factors_ref`` (float64) on
    odd shapes, a rank-2 direction (fewer directions than k), 1e30 values (Y^T Y overflowed
    fp32: NaN weights before) and a zero direction (P = 0 and R kept: a zero first gradient
    left R = 0 and the low-rank part off for good before); then row shards of 2, 0, 1 and
    34 rows (fewer rows than k, an empty one) summed as the ranks' all-reduce sums them."""
    g = torch.Generator().manual_seed(7)
    update, ref = _muon_lowrank.update_factors, reference.lowrank_factors_ref
    for a, b in [(37, 45), (45, 37)]:
        R = _muon_lowrank.init_factors(a, b, 3, "cpu")[1]
        grad = torch.randn(a, b, generator=g)
        rank2 = torch.randn(a, 2, generator=g) @ torch.randn(2, b, generator=g)
        for u, scale in [(torch.randn(a, b, generator=g), 1.0), (rank2, 1.0), (rank2, 1e30)]:
            u, gs = (u * scale).bfloat16(), grad * scale
            P, Rn = update(u, gs, R, 0.95, nesterov)
            want = ref(u, gs.double(), R, 0.95, nesterov)
            assert torch.isfinite(P.float()).all() and torch.isfinite(Rn.float()).all()
            assert _low_err(P, Rn, *want) < 1e-2
        zero = torch.zeros(a, b)
        P, Rn = update(zero.bfloat16(), zero, R, 0.95, nesterov)
        P_ref, R_ref = ref(zero.bfloat16(), zero.double(), R, 0.95, nesterov)
        assert not P.any() and not P_ref.any()
        assert torch.equal(Rn, R) and torch.equal(R_ref, R)
    # row shards: the Gram matrix and m^T P are sums over rows; two rounds as two collectives
    u, grad = torch.randn(37, 45, generator=g).bfloat16(), torch.randn(37, 45, generator=g)
    R = _muon_lowrank.init_factors(37, 45, 3, "cpu")[1]
    cuts = [0, 2, 2, 3, 37]
    shards = [(u[i:j], grad[i:j]) for i, j in zip(cuts, cuts[1:])]
    sums = []
    for _ in range(3):  # each round records the shards' next sum and returns the ones known
        seen = [[] for _ in shards]
        got = []
        for (us, gs), rec in zip(shards, seen):

            def reduce(t, rec=rec):
                rec.append(t)
                return sum(sums[len(rec) - 1]) if len(sums) >= len(rec) else t

            got.append(update(us, gs, R, 0.95, nesterov, reduce))
        if len(sums) < 2:
            sums.append([rec[len(sums)] for rec in seen])
    P = torch.cat([p for p, _ in got])
    whole = update(u, grad, R, 0.95, nesterov)
    assert all(torch.equal(r, got[0][1]) for _, r in got)  # R: the same on every rank
    assert _low_err(P, got[0][1], *whole) < 1e-2


def test_lowrank_momentum_zero_then_hostile_gradients():
    """A zero first gradient, then ordinary ones: the low-rank part comes up (R survived);
    1e30 gradients: every state finite and the stored momentum (P R^T + residual codes)
    that of a quantize=False twin to the codes' resolution; the weights do not move, as
    torch.optim.Muon's do not (Newton-Schulz's bf16 norm overflows to inf)."""
    g = torch.Generator().manual_seed(5)
    shape = (40, 48)
    p = torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True)
    q = torch.zeros(shape, requires_grad=True)
    hp = dict(lr=0.01, weight_decay=0.0)
    a, b = fo.FlashMuon([p], **hp), fo.FlashMuon([q], quantize=False, **hp)
    for s, scale in enumerate([0.0, 1.0, 1.0, 1e30, 1e30]):
        grad = torch.randn(shape, generator=g) * scale
        p.grad, q.grad = grad.bfloat16(), grad.bfloat16().float()
        before = fo.master_weight(p, a).clone() if s else None
        a.step()
        b.step()
        st = a.state[p]
        low = reference.lowrank_ref(st[LOW_P], st[LOW_R])
        assert (low.abs().max() > 0) == (s > 0)
        codes, scales = st["momentum_buffer_codes"], st["momentum_buffer_scale"]
        row = reference.state_row(p, True)
        m = reference.dequantize_momentum_ref(codes.reshape(-1), scales, row).view(shape) + low
        m_ref = b.state[q]["momentum_buffer"].double()
        assert torch.isfinite(m).all() and torch.isfinite(p.float()).all()
        assert (m - m_ref).abs().max() <= 2 / 127 * m_ref.abs().max()
        if scale > 1:  # (the stochastic split may move the bf16 part by an ulp)
            torch.testing.assert_close(fo.master_weight(p, a), before, rtol=2**-15, atol=0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
def test_lost_update(backend):
    """Weight 1.0, gradient a 64 x 64 Hadamard matrix H (orthogonal rows: O = s H every
    step): 30 updates of 1.4e-5 (0.46 of a correction code at 1.0) on every element: nearest
    rounding loses them all, stochastic rounding lands them in expectation."""
    dev = DEV if backend == "triton" else "cpu"
    h = torch.ones(1, 1)
    while h.shape[0] < 64:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    s = newton_schulz(h.bfloat16())[0, 0].item()
    out = {}
    for sr in (False, True):
        p = torch.ones(64, 64, dtype=torch.bfloat16, device=dev, requires_grad=True)
        lr = 1.4e-5 / s  # ratio 1 for a square matrix: |update| = 1.4e-5
        opt = fo.FlashMuon([p], lr=lr, weight_decay=0.0, stochastic_rounding=sr, backend=backend)
        for _ in range(30):
            p.grad = h.to(dev, torch.bfloat16)
            opt.step()
        out[sr] = fo.master_weight(p, opt).double().cpu()
    assert (out[False] == 1.0).all()  # the published scheme loses every update
    moved = ((out[True] - 1.0) * h.double()).mean().item()  # each element's own direction
    assert abs(moved + 4.2e-4) < 2e-5, moved  # lands in expectation: 30 * 1.4e-5
    assert ((out[True] - 1.0) * h < 0).float().mean() > 0.99


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
def test_transposed_matrix_matches_contiguous(backend):
    """A parameter stored transposed (the passes run over its storage) is orthogonalised in
    its logical shape: fp32 states, nearest rounding, 3 steps equal the contiguous
    parameter's run up to the matmul's rounding (different memory layouts)."""
    dev = DEV if backend == "triton" else "cpu"
    base = torch.randn(24, 40, generator=torch.Generator().manual_seed(3)).bfloat16()
    a = base.t().to(dev).requires_grad_()  # (40, 24), strides (1, 40)
    b = base.t().contiguous().to(dev).requires_grad_()
    kw = dict(lr=0.02, quantize=False, stochastic_rounding=False, backend=backend)
    oa, ob = fo.FlashMuon([a], **kw), fo.FlashMuon([b], **kw)
    for s in range(3):
        g = torch.randn(40, 24, generator=torch.Generator().manual_seed(s)).bfloat16().to(dev)
        a.grad, b.grad = g.t().contiguous().t(), g.clone()
        oa.step()
        ob.step()
    assert a.stride() == (1, 40) and oa.state[a]["momentum_buffer"].stride() == (1, 40)
    ma, mb = fo.master_weight(a, oa), fo.master_weight(b, ob)
    assert (ma - base.t().to(dev).float()).abs().mean() > 1e-3
    torch.testing.assert_close(ma, mb, rtol=0, atol=2e-4)


# ------------------------------------------------------------------------- robustness


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
def test_nonfinite_skip_and_raise(backend):
    """A NaN in a matrix's gradient at step 3 (a cached plan: the kernels read the device
    flag) or at step 1: nothing changes, the step counts stay, the skip is counted."""
    dev = DEV if backend == "triton" else "cpu"
    ps = _params(device=dev)
    opt = fo.FlashMuon(fo_named(ps), lr=0.02, backend=backend)
    _train(opt, ps, 2)
    before = copy.deepcopy((ps, opt.state_dict()))
    _grads(ps, 2)
    ps[1].grad[3, 5] = float("nan")
    opt.step()
    assert opt.skipped_steps == 1
    for p, q in zip(ps, before[0]):
        assert torch.equal(_bits(p.detach()), _bits(q.detach()))
    for k, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            w = before[1]["state"][k][name]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, name
    fresh = _params(device=dev)
    opt2 = fo.FlashMuon(fresh, on_nonfinite="raise", backend=backend)
    _grads(fresh, 0)
    fresh[0].grad[0, 0] = float("inf")
    with pytest.raises(fo.NonFiniteGradError):
        opt2.step()


def test_load_master_weights_refuses_a_list_in_model_order():
    """Issue #31's defect: the split puts the Muon group first, so a list of masters in the
    model's order (an embedding first) fitted the wrong parameters of equal shape without an
    error. Such a list is now refused; a dict fits each parameter; a list is still taken
    where the optimizer kept the given order."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(16, 16)  # AdamW, listed first by the model
            self.a = torch.nn.Linear(16, 16, bias=False)
            self.b = torch.nn.Linear(16, 16, bias=False)

    net = Net()
    masters = [p.detach().clone() for p in net.parameters()]
    net.bfloat16()
    opt = fo.FlashMuon(net.named_parameters(), lr=0.02)
    with pytest.raises(ValueError, match="pass a dict"):
        opt.load_master_weights(masters)
    opt.load_master_weights(dict(zip(net.parameters(), masters)))
    for p, m in zip(net.parameters(), masters):
        torch.testing.assert_close(fo.master_weight(p, opt), m, rtol=2**-15, atol=0)
    ordered = fo.FlashMuon([net.a.weight, net.b.weight], lr=0.02)  # one group, given order
    ordered.load_master_weights(masters[1:])
    for p, m in zip((net.a.weight, net.b.weight), masters[1:]):
        torch.testing.assert_close(fo.master_weight(p, ordered), m, rtol=2**-15, atol=0)


def test_checkpoint_resume_is_bit_exact_and_loads_torch_muon():
    """Train 2 steps, save, train 2 more; a fresh optimizer loading the save trains the same
    2 steps to the same bits. A torch.optim.Muon state dict (fp32 momentum) loads
    quantized."""
    ps = _params()
    opt = fo.FlashMuon(fo_named(ps), lr=0.02)
    _train(opt, ps, 2)
    saved = copy.deepcopy((ps, opt.state_dict()))
    _train(opt, ps, 2, first=2)
    qs = [p.detach().clone().requires_grad_() for p in saved[0]]
    opt2 = fo.FlashMuon(fo_named(qs), lr=0.02)
    opt2.load_state_dict(saved[1])
    _train(opt2, qs, 2, first=2)
    assert_bitwise(opt, ps, opt2, qs)
    if torch_muon is None:
        return
    ws = _params(torch.float32)[:2]
    tm = torch_muon(ws, lr=0.02)
    _train(tm, ws, 2)
    ours = fo.FlashMuon([w.detach().bfloat16().requires_grad_() for w in ws], lr=0.02)
    ours.load_state_dict(tm.state_dict())
    for w, p in zip(ws, ours.param_groups[0]["params"]):
        st = ours.state[p]
        if "momentum_buffer_codes" in st:  # 8-bit on the grid of p's rows (grid.py)
            m = reference.dequantize_momentum_ref(
                st["momentum_buffer_codes"].reshape(-1),
                st["momentum_buffer_scale"],
                reference.state_row(p, True),
            )
            if LOW_P in st:  # the whole momentum split into a low-rank part and codes
                m = m + reference.lowrank_ref(st[LOW_P], st[LOW_R]).reshape(-1)
        else:  # rows under 32 elements: fp32, torch's buffer exactly
            m = st["momentum_buffer"].reshape(-1).double()
        buf = tm.state[w]["momentum_buffer"].reshape(-1).double()
        assert st["step"] == 1  # torch.optim.Muon keeps no step: loaded as stepped (#32)
        assert (m - buf).abs().max() <= buf.abs().max() * 2 / 127


def _whole_momentum(opt, p) -> torch.Tensor:
    """A low-rank momentum as a whole (float64, p's shape): P R^T plus the residual codes."""
    st = opt.state[p]
    codes, scales = st["momentum_buffer_codes"].reshape(-1), st["momentum_buffer_scale"]
    m = reference.dequantize_momentum_ref(codes, scales, reference.state_row(p, True))
    return m.view(p.shape) + reference.lowrank_ref(st[LOW_P], st[LOW_R]).view(p.shape)


def test_lowrank_checkpoint_forms_round_trip():
    """Low-rank momenta through the checkpoint forms: ``torch_state_dict`` holds the whole
    momentum (P R^T + decoded residual) and loads into torch.optim.Muon; that dict loads
    back into a fresh FlashMuon (the factors found again by power iterations) to the codes'
    resolution; so does a state dict of ours without the factors (before issue #31: codes of
    the whole momentum); factors of the wrong shape are refused by name."""
    ps = _params()[:4]  # (40, 64), (64, 32), (40, 64), (36, 33): all low-rank
    opt = fo.FlashMuon(fo_named(ps), lr=0.02)
    _train(opt, ps, 3)
    order = opt.param_groups[0]["params"]
    whole = [_whole_momentum(opt, p) for p in order]
    tsd = opt.torch_state_dict()
    for i, m in enumerate(whole):
        buf = tsd["state"][i]["momentum_buffer"].double()
        # (fp32 sums of the two parts: rounding of the larger one)
        torch.testing.assert_close(buf, m, rtol=0, atol=2**-22 * m.abs().max().item())
    if torch_muon is not None:
        tm = torch_muon([p.detach().float().requires_grad_() for p in order], lr=0.02)
        tm.load_state_dict(tsd)
    old = copy.deepcopy(opt.state_dict())
    for st, m, p in zip(old["state"].values(), whole, order):
        del st[LOW_P], st[LOW_R]
        codes, scales = reference.quantize_momentum_ref(
            m.reshape(-1), torch.bfloat16, None, reference.state_row(p, True)
        )
        st["momentum_buffer_codes"] = codes.view_as(st["momentum_buffer_codes"])
        st["momentum_buffer_scale"] = scales.view_as(st["momentum_buffer_scale"])
    for sd in (tsd, old):
        qs = [p.detach().clone().requires_grad_() for p in ps]
        back = fo.FlashMuon(fo_named(qs), lr=0.02)
        back.load_state_dict(sd)
        for q, m in zip(back.param_groups[0]["params"], whole):
            assert back.state[q][LOW_P].any()  # a low-rank part again
            assert (_whole_momentum(back, q) - m).abs().max() <= 2 / 127 * m.abs().max()
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][0][LOW_R] = bad["state"][0][LOW_R][:, :2]
    with pytest.raises(ValueError, match="low-rank factors of shapes"):
        fo.FlashMuon(fo_named(ps), lr=0.02).load_state_dict(bad)


@pytest.mark.parametrize("shape", [(512, 512), (512, 2048), (16, 2048)])
def test_memory_report_matrices(shape):
    """bf16 matrices: weight 2 + correction 1 + momentum codes 1 + scales 1/16 + bf16
    gradient 2 = 6.0625 bytes per parameter, plus the low-rank factors' 2 k (A + B) / (A B)
    where both sides are >= 32 (k = 4: 0.031 at 512 x 512, 0.0195 at 512 x 2048); under 6.1
    (torch.optim.Muon on fp32 parameters: 12)."""
    ps = [torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    opt = fo.FlashMuon(ps)
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt.step()
    rep = fo.memory_report(opt)
    a, b = shape
    low = 2 * reference.MUON_RANK * (a + b) / (a * b) if min(shape) >= 32 else 0.0
    assert rep["bytes_per_param"] == pytest.approx(6.0625 + low)
    assert rep["state_lowrank"] == pytest.approx(low * 2 * a * b)
    assert rep["bytes_per_param"] <= 6.1


def test_scheduler_and_gradient_release():
    """An LR scheduler scales the Muon and the AdamW group; gradient release steps each
    matrix in its hook as ``step()`` would."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).bfloat16()
    twin = copy.deepcopy(net)
    opt = fo.FlashMuon(net.named_parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt2 = fo.FlashMuon(twin.named_parameters(), lr=0.02)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    fo.enable_gradient_release(twin, opt2)
    x = torch.randn(5, 8).bfloat16()
    for _ in range(3):
        for m, o, s in ((net, opt, sched), (twin, opt2, sched2)):
            m(x).float().square().mean().backward()
            o.step()
            o.zero_grad()
            s.step()
    assert [g["lr"] for g in opt.param_groups] == [0.02 / 8, 0.02 / 8]
    for a, b in zip(net.parameters(), twin.parameters()):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_kernels_match_cpu_path():
    """The two CUDA kernels against the CPU path from the same inputs, pass by pass (the
    GPU's and the CPU's bf16 matmuls differ, so pass 2 gets the same random O on both, and
    both passes the same low-rank parts): codes within one at ties, u within one bf16 ulp,
    the master weights within one correction code plus the fp32 rounding (fma and
    approximate reciprocals move ties)."""
    from flashoptim_fused import _cpu, _muon_kernel

    shapes = [(96, 80), (33, 7), (640, 128), (128, 640)]
    ps = _params(shapes=shapes, device="cuda")
    opt = fo.FlashMuon(ps, lr=0.02)
    _train(opt, ps, 2)  # states that are not zero
    group = opt.param_groups[0]
    _grads(ps, 9)
    # the optimizer's own waves: low-rank momenta (rows of a multiple of 32, and rows of 80:
    # a table entry per row), fp32 rows of 7 (grid.py); numel % 16 == 0 or not
    waves = opt._prepare(group, ps, cache=False)["buckets"]
    assert {w["lowrank"] for w in waves} == {True, False}
    for wave in waves:
        bucket, n = wave["ps"], wave["ws_numel"]
        hp = opt._hp(group, bucket[0])
        sts = [opt._state_view(opt.state[p], group) for p in bucket]
        cpu = [{k: v.cpu().clone() for k, v in st.items() if v is not None} for st in sts]
        ws = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        lo = ln = None
        if wave["lowrank"]:
            lo = (torch.randn(n, device="cuda") * 0.01).bfloat16()
            ln = (torch.randn(n, device="cuda") * 0.01).bfloat16()
        mix = (3 * reference.GOLDEN) & reference.M32  # step 3's rounding stream
        _muon_kernel.launch_momentum(wave["ent"], ws, lo, hp)

        def part(t, off, p):
            return None if t is None else t[off : off + p.numel()].cpu()

        for p, st, c, off in zip(bucket, sts, cpu, wave["offs"]):
            u = torch.empty(p.numel(), dtype=torch.bfloat16)
            _cpu.muon_momentum_cpu(p.grad.cpu(), c, hp, u, part(lo, off, p))
            if "ms" in c and lo is None:  # 8-bit codes stored in pass 1
                d = (st["m"].cpu().int() - c["m"].int()).abs()
                assert d.max() <= 1 and (d > 0).float().mean() < 0.02
            elif "ms" not in c:  # fp32 momentum: fma moves an ulp
                tol = 2.0**-22 * c["m"].abs().max().item()
                torch.testing.assert_close(st["m"].cpu(), c["m"], rtol=2.0**-20, atol=tol)
            ug = ws[off : off + p.numel()].cpu().float()
            tol = 1e-6 * u.float().abs().max().item()
            torch.testing.assert_close(ug, u.float(), rtol=2**-7, atol=tol)
        o = torch.randn(n, device="cuda").bfloat16()
        ws.copy_(o)
        before = [
            (p.detach().cpu().clone(), opt.state[p]["correction"].cpu().clone()) for p in bucket
        ]
        _muon_kernel.launch_update(wave["ent"], ws, lo, ln, hp, mix)
        for i, (p, (pc, cc), off) in enumerate(zip(bucket, before, wave["offs"])):
            seed = opt.state[p]["seed"]
            oc = o[off : off + p.numel()].cpu()
            _cpu.muon_update_cpu(pc, cc, oc, hp, wave["ratios"][i], 3, seed)
            cg = opt.state[p]["correction"].reshape(-1).cpu()
            a = reference.join_ref(p.detach().reshape(-1).cpu(), cg, 8)
            b = reference.join_ref(pc.reshape(-1), cc.reshape(-1), 8)
            q = reference.ulp_ref(pc.reshape(-1)) / 256
            bad = (a - b).abs() > q * 1.01 + 2.0**-22 * b.abs()
            assert int(bad.sum()) <= max(2, 0.001 * bad.numel())
            if lo is not None:  # pass 2 stored the residual codes
                c = cpu[i]
                _cpu.muon_requantize_cpu(p.grad.cpu(), c, hp, part(lo, off, p), part(ln, off, p))
                d = (sts[i]["m"].cpu().int() - c["m"].int()).abs()
                assert d.max() <= 1 and (d > 0).float().mean() < 0.02
                ms, ms_cpu = sts[i]["ms"].cpu().float(), c["ms"].float()
                torch.testing.assert_close(ms, ms_cpu, rtol=1e-2, atol=0)


@pytest.mark.gpu
def test_gpu_step_matches_cpu_path(monkeypatch):
    """Whole steps on CUDA against the CPU path from the same state each step: the bf16
    matmuls differ between devices (other blockings), so O moves by bf16 ulps; the master
    weights agree to the update's 2**-6 plus two correction codes, the codes within one on
    almost all elements."""
    monkeypatch.setenv("FLASHOPTIM_NO_AUTOTUNE", "1")  # the AdamW compiles shared with others
    shapes = [(96, 80), (33, 7), (640, 128), (128, 640), (300,)]
    pg = _params(shapes=shapes, device="cuda")
    pc = _params(shapes=shapes)
    a = fo.FlashMuon(fo_named(pg), lr=0.02)
    b = fo.FlashMuon(fo_named(pc), lr=0.02)
    for s in range(3):
        _grads(pg, s)
        _grads(pc, s)
        a.step()
        b.step()
        for p, q in zip(pg, pc):
            ma, mb = fo.master_weight(p, a).cpu(), fo.master_weight(q, b)
            qv = reference.ulp_ref(q.detach().reshape(-1)).view(q.shape) / 256
            assert ((ma - mb).abs() <= 0.02 * 2 * 2.0**-6 * 3 + 2 * qv + 1e-6).all()
            for k, v in a.state[p].items():
                if torch.is_tensor(v) and not v.is_floating_point() and k != "correction":
                    d = (v.cpu().int() - b.state[q][k].int()).abs()
                    assert d.max() <= 2 and (d > 0).float().mean() < 0.05, k
        with torch.no_grad():  # same inputs for the next step
            for p, q in zip(pg, pc):
                p.copy_(q.to("cuda"))
                for k, v in b.state[q].items():
                    if torch.is_tensor(v):
                        a.state[p][k].copy_(v.to("cuda"))


@pytest.mark.gpu
def test_gpu_measured_bytes_per_param():
    """Allocator bytes held between steps by 16 bf16 matrices of 2048 x 2048 with their bf16
    gradients, FlashMuon: <= 6.1 (6.0625 + the low-rank factors' 0.0078 counted, + tables);
    the Newton-Schulz workspace and temporaries are freed after the step."""
    w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    (w @ w).sum().backward()  # cuBLAS workspaces exist before the baseline
    del w
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    ps = [
        torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for _ in range(16)
    ]
    n = sum(p.numel() for p in ps)
    opt = fo.FlashMuon(ps, lr=0.02)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - base) / n
    print(f"FlashMuon held {held:.4f} bytes/param")
    assert held <= 6.1, held
    low = 2 * reference.MUON_RANK * 4096 / 2048**2
    assert fo.memory_report(opt)["bytes_per_param"] == pytest.approx(6.0625 + low)
