"""The hyper-connection layer as training uses it (#29): under autocast, twice
differentiable and under torch.func, full float32 where the stream is float32, validated
options, a bf16 stream around a float32 sublayer, a stream near FLT_MAX, and n beyond the
kernels' 8 (torch ops). Each test failed before its fix (the defect is named).

Bounds as in test_hyper_connection.py (F32_BOUND 1e-4 of the largest entry against the
float64 layer); autocast runs are compared bit for bit with the same layer whose sublayer
is written in bf16 by hand (what autocast does to it), so they cannot pass by tolerance.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from test_hyper_connection import F32_BOUND, _errors, _problem, _ref, _run

from mhc_proj import HyperConnection, hyper_connection, hyper_connection_ref, marginal_error

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class ExplicitBf16(torch.nn.Module):
    """The float32 Linear ``lin`` run as autocast runs it: input, weight and bias cast to
    bf16 inside the call (so the weight gradient is the float32 one autocast gives)."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, y):
        w, b = self.lin.weight, self.lin.bias
        return F.linear(y.bfloat16(), w.bfloat16(), b.bfloat16())


def _grads(x, lin, phi, b, al, device, autocast, wrap, projection, formulation):
    """out and the gradients of <out, G> (x, phi, b, alphas, the Linear's weight, bias)."""
    lin = copy.deepcopy(lin).to(device)
    sub = ExplicitBf16(lin) if wrap else lin
    xs = x.detach().to(device).requires_grad_(True)
    ps = phi.detach().to(device).requires_grad_(True)
    bs = b.detach().to(device).requires_grad_(True)
    als = [a.detach().to(device).requires_grad_(True) for a in al]
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        out = hyper_connection(
            xs, sub, ps, bs, *als, projection=projection, formulation=formulation
        )
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(device, out.dtype)
    out.backward(g)
    return [out, xs.grad, ps.grad, bs.grad, *[a.grad for a in als], lin.weight.grad, lin.bias.grad]


# ---------------------------------------------------------------- defect 1: autocast
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stream", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("projection", ["birkhoff", "sinkhorn"])
@pytest.mark.parametrize("formulation", ["mhc", "deepseek"])
def test_autocast_equals_explicit_bf16(device, stream, projection, formulation):
    """#29 defect 1: under autocast the layer returned garbage / NaN that changed every
    call (the float32 mixing GEMM came back bf16 and the pre kernel read it as float32).
    Now the layer's own ops ignore autocast: output and every gradient equal, bit for bit,
    the run without autocast whose sublayer is written in bf16 by hand."""
    x, lin, phi, b, al = _problem((3, 5), 4, 24, seed=41, dtype=stream)
    args = (x, lin, phi, b, al, device)
    auto = _grads(*args, True, False, projection, formulation)
    again = _grads(*args, True, False, projection, formulation)
    explicit = _grads(*args, False, True, projection, formulation)
    assert auto[0].dtype == stream and bool(torch.isfinite(auto[0]).all())
    for a, r, e in zip(auto, again, explicit):
        assert torch.equal(a, r)  # the same every call
        assert torch.equal(a, e)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_training_steps(device):
    """#29 defect 1: a bf16 autocast training run of a wrapped block had NaN loss from step
    0. Eight AdamW steps of a two-layer stack under autocast: finite, decreasing loss and
    doubly stochastic H_res at every step."""
    torch.manual_seed(0)
    c, n = 32, 4
    blocks = torch.nn.ModuleList(
        HyperConnection(torch.nn.Sequential(torch.nn.Linear(c, c), torch.nn.GELU()), hc=n, c=c)
        for _ in range(2)
    ).to(device)
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-2)
    x = torch.randn(8, 16, n, c, device=device)
    target = torch.randn(8, 16, c, device=device)
    losses = []
    for _ in range(8):
        with torch.autocast(device, dtype=torch.bfloat16):
            h = x
            for blk in blocks:
                h, maps = blk(h, return_maps=True)
                assert float(marginal_error(maps.h_res.detach()).max()) <= 5.5e-6
            loss = F.mse_loss(h.mean(-2).float(), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


# ---------------------------------------------------------------- defect 6: higher order
@pytest.mark.parametrize("projection", ["birkhoff", "sinkhorn"])
@pytest.mark.parametrize("formulation", ["mhc", "deepseek"])
def test_double_backward_vs_reference(projection, formulation):
    """#29 defect 6: no double backward ("no autograd formula registered for hc_pre_bwd").
    A gradient penalty |d<out, G>/dx . V| differentiated again, against the float64 layer
    (whose exact projection's VJP is itself differentiable)."""
    x, lin, phi, b, al = _problem((5,), 4, 6, seed=17)
    gen = torch.Generator().manual_seed(3)
    g_out, v = torch.randn(5, 4, 6, generator=gen), torch.randn(5, 4, 6, generator=gen)
    kw = dict(projection=projection, formulation=formulation)

    def penalty_grads(dtype, layer_fn):
        sub = copy.deepcopy(lin).to(dtype)
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, phi, b, *al)]
        xs, ps, bs, *als = leaves
        out = layer_fn(xs, sub, ps, bs, *als, **kw)
        (gx,) = torch.autograd.grad((out * g_out.to(dtype)).sum(), xs, create_graph=True)
        pen = (gx * v.to(dtype)).sum().square()
        params = [*leaves, sub.weight, sub.bias]
        return [t.double() for t in torch.autograd.grad(pen, params)]

    ours = penalty_grads(torch.float32, hyper_connection)
    ref = penalty_grads(torch.float64, hyper_connection_ref)
    for o, r in zip(ours, ref):
        assert float((o - r).abs().max() / r.abs().max()) <= 1e-3


def test_torch_func_grad():
    """#29 defect 6: torch.func.grad(layer) failed ("must override setup_context"). Under
    a transform the layer runs its torch-ops path; its gradients equal the kernels'."""
    torch.manual_seed(1)
    layer = HyperConnection(torch.nn.Linear(12, 12), hc=4, c=12, alpha_init=0.7)
    with torch.no_grad():
        layer.b.normal_()
    x = torch.randn(3, 7, 4, 12)
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def loss(p):
        return torch.func.functional_call(layer, p, (x,)).square().sum()

    got = torch.func.grad(loss)(params)
    layer(x).square().sum().backward()
    for k, p in layer.named_parameters():
        err = float((got[k] - p.grad).abs().max() / p.grad.abs().max())
        assert err <= 1e-4, (k, err)


# ---------------------------------------------------------------- defect 7: float32 phi
@pytest.mark.parametrize("formulation", ["mhc", "deepseek"])
def test_float32_stream_keeps_float32_phi(formulation):
    """#29 defect 7: a float32 layer on the CPU rounded phi to 16 significant bits (bf16
    hi + lo): 3.3e-6 against float64 where Liger's float32 gives 3.2e-7. Now float32 phi
    in a float32 GEMM: measured ~3e-7."""
    torch.manual_seed(0)
    c = 256
    layer = HyperConnection(torch.nn.Identity(), hc=4, c=c, alpha_init=1.0, formulation=formulation)
    with torch.no_grad():
        layer.phi.normal_(0, 0.05)
        layer.b.normal_(0, 1)
    x = torch.randn(64, 4, c)
    params = (layer.phi, layer.b, layer.alpha_pre, layer.alpha_post, layer.alpha_res)
    out = layer(x).detach().double()
    ref = hyper_connection_ref(x.double(), torch.nn.Identity(), *params, formulation=formulation)
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-6


# ---------------------------------------------------------------- defect 8: options
@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(sinkhorn_eps=2.0, projection="sinkhorn"), "sinkhorn_eps"),
        (dict(sinkhorn_eps=-1e-3), "sinkhorn_eps"),
        (dict(post_mult=float("nan")), "post_mult"),
        (dict(post_mult=float("inf")), "post_mult"),
        (dict(pre_eps=float("nan")), "pre_eps"),
        (dict(rms_eps=-1.0), "rms_eps"),
        (dict(rms_eps=float("inf")), "rms_eps"),
        (dict(tmax=100_000), "tmax"),
        (dict(tmax=0), "tmax"),
        (dict(tmax=2.5), "tmax"),
        (dict(alpha_init=float("nan")), "alpha_init"),
        (dict(phi_std=-1.0), "phi_std"),
        (dict(projection="exact"), "projection"),
        (dict(formulation="v4"), "formulation"),
    ],
)
def test_options_validated(kw, match):
    """#29 defect 8: sinkhorn_eps=2 (the op rejects eps > 1: H_res stopped being doubly
    stochastic), post_mult=nan (NaN output) and tmax=100000 (the op caps at 10000) were
    accepted. Every option is checked when the module is built, and by the function."""
    with pytest.raises(ValueError, match=match):
        HyperConnection(torch.nn.Identity(), hc=4, c=8, **kw)
    fn_kw = {("sinkhorn_iters" if k == "tmax" else k): v for k, v in kw.items()}
    if any(k in fn_kw for k in ("alpha_init", "phi_std")):
        return
    x, lin, phi, b, al = _problem((2,), 4, 8, seed=0)
    with pytest.raises(ValueError, match=match.replace("tmax", "sinkhorn_iters")):
        hyper_connection(x, lin, phi, b, *al, **fn_kw)


# ---------------------------------------------------------------- defect 10
def test_bf16_stream_float32_sublayer():
    """#29 defect 10: a bf16 stream around a float32 sublayer raised a dtype error. The
    sublayer now sees y in its parameters' dtype (as LigerMHC does); the result is the
    bf16-stream layer around the same float32 Linear, against float64 on bf16 values."""
    x, lin, phi, b, al = _problem((4, 3), 4, 32, seed=23, dtype=torch.bfloat16)
    out, grads, gout = _run(x, lin, phi, b, al, "cpu", keep_sublayer_dtype=True)
    assert out.dtype == torch.bfloat16
    errs = _errors(out, grads, *_ref(x, lin, phi, b, al, gout))
    assert max(errs.values()) <= 2.0**-6, errs


@pytest.mark.parametrize("device", DEVICES)
def test_stream_near_float_max(device):
    """#29 defect 10: a finite float32 stream at 3e38 gave NaN / wrong maps (the sum of
    squares overflowed: inv_r = 0). The kernels redo such a token's sum on scaled squares;
    the maps, the output and the gradients match float64 (every true intermediate is
    representable: H_pre small so y = H_pre x is, the output gradient 1e-30)."""
    gen = torch.Generator().manual_seed(8)
    n, c = 4, 16
    x = (torch.rand(6, n, c, generator=gen) * 2 - 1) * 2e38
    lin = torch.nn.Identity()
    phi = torch.randn(n * c, n * n + 2 * n, generator=gen) * 0.02
    b = torch.randn(n * n + 2 * n, generator=gen)
    b[:n] = -4.0  # H_pre ~ 0.02: y = H_pre x stays below FLT_MAX
    al = [torch.tensor(1.0), torch.tensor(1.0), torch.tensor(1.0)]
    leaves = [t.clone().to(device).requires_grad_(True) for t in (x, phi, b, *al)]
    out, maps = hyper_connection(leaves[0], lin, *leaves[1:], return_maps=True)
    g = torch.randn(out.shape, generator=gen) * 1e-30
    out.backward(g.to(device))
    ref_leaves = [t.clone().double().requires_grad_(True) for t in (x, phi, b, *al)]
    ref, ref_maps = hyper_connection_ref(ref_leaves[0], lin, *ref_leaves[1:], return_maps=True)
    ref.backward(g.double())
    assert bool(torch.isfinite(out).all())
    assert float((maps.h_res.cpu().double() - ref_maps[2]).abs().max()) <= 1e-5
    assert float((out.detach().cpu().double() - ref).abs().max() / ref.abs().max()) <= 1e-5
    for ours, r in zip(leaves, ref_leaves):
        err = float((ours.grad.cpu().double() - r.grad).abs().max() / r.grad.abs().max())
        assert err <= F32_BOUND, err


# ---------------------------------------------------------------- n beyond 8
@pytest.mark.parametrize("n,c", [(9, 5), (12, 3), (16, 2)])
@pytest.mark.parametrize("projection", ["birkhoff", "sinkhorn"])
def test_more_than_eight_streams(n, c, projection):
    """Expansion rates beyond 8 run the layer in torch ops (no kernel is instantiated for
    them; the exact projection is the float64 Newton of mhc_proj.reference): output and
    gradients against the float64 layer, and H_res doubly stochastic."""
    x, lin, phi, b, al = _problem((3,), n, c, seed=n)
    out, grads, gout = _run(x, lin, phi, b, al, "cpu", projection)
    errs = _errors(out, grads, *_ref(x, lin, phi, b, al, gout, projection))
    assert max(errs.values()) <= F32_BOUND, errs
    _, maps = hyper_connection(x, lin, phi, b, *al, projection=projection, return_maps=True)
    if projection == "birkhoff":
        assert float(marginal_error(maps.h_res).max()) <= 5.5e-6
