"""hyper_connection / nn.HyperConnection: the CPU path and, on a GPU, the CUDA kernels
against the float64 layer ``hyper_connection_ref`` (forward and every gradient: the stream
x, the sublayer's parameters through y = H_pre x and f, phi, b and the alphas) and the
CUDA results against the CPU path; torch.compile, determinism, input checking.

Kernels under test (``csrc/hc_kernels.cuh``, ``csrc/hc_cpu.h``): pre (sum of squares,
maps, y = H_pre x), post (H_res x + H_post^T f), post backward (dL/dH_res, dL/dH_post,
g_f), pre backward reduce (dL/dH_pre, the maps' backward) and the stream gradient; the
GEMMs run in torch, the projection in the package's Birkhoff / Sinkhorn kernels.

Bounds. float32 stream: max |ours - ref| / max |ref| <= 1e-4 per output and gradient; the
alphas' gradients (sums over tokens) relative to the sum of the magnitudes of their
per-token parts. phi enters the GEMM rounded to 16 significant bits (2^-17 ~ 7.6e-6
relative), H_res meets the marginal tolerance 4e-6, sums run in float32; the largest error
measured on the CPU grid below is 6.4e-6, except the 1 x 1 sublayer weight's gradient at
C = 1 (a 5-term sum with cancellation): 3.8e-5. bfloat16 stream (x, y, f, out and dL/dx
in bf16; the reference runs in float64 on the same bf16 values and a bf16-valued
sublayer): 2^-6 ~ 1.6e-2, two bf16 roundings (2^-8 each) on every path into an output
plus the sublayer seeing a rounded y; measured on the CPU <= 5.1e-3. The GPU's bf16 GEMM
for dL/dx (bf16 operands g_h and phi_hi) stays inside the same bound.
"""

import copy
import os

import pytest
import torch

import mhc_proj
from mhc_proj import HyperConnection, hyper_connection, hyper_connection_ref, marginal_error

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
F32_BOUND, BF16_BOUND = 1e-4, 2.0**-6


class Diag(torch.nn.Module):
    """y * weight + bias: the sublayer of the wide-row cases (a C x C Linear at C = 7168
    costs the CPU reference seconds and tests nothing the narrow cases do not)."""

    def __init__(self, c):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(c))
        self.bias = torch.nn.Parameter(torch.zeros(c))

    def forward(self, y):
        return y * self.weight + self.bias


def _problem(lead, n, c, seed, dtype=torch.float32, scale=1.0):
    """x, a sublayer (Linear up to C = 256, else Diag) and the layer's parameters (alphas
    O(1) so every map varies)."""
    g = torch.Generator().manual_seed(seed)
    m = n * n + 2 * n
    x = (torch.randn(*lead, n, c, generator=g) * scale).to(dtype)
    lin = torch.nn.Linear(c, c) if c <= 256 else Diag(c)
    with torch.no_grad():
        w = torch.randn(c, c, generator=g) / c**0.5 if c <= 256 else 1 + torch.randn(c, generator=g)
        lin.weight.copy_(w)
        lin.bias.copy_(torch.randn(c, generator=g) * 0.1)
    phi = torch.randn(n * c, m, generator=g) / (n * c) ** 0.5 * 2
    b = torch.randn(m, generator=g) * 0.5
    alphas = [torch.tensor(v) for v in (0.8, 1.3, 2.0)]
    return x, lin, phi, b, alphas


def _run(x, lin, phi, b, alphas, device, projection="birkhoff", keep_sublayer_dtype=False, **kw):
    """Our layer on ``device``: output, grad of <out, G> for x, phi, b, alphas, lin (a bf16
    stream gets a bf16 sublayer unless keep_sublayer_dtype)."""
    lin = copy.deepcopy(lin).to(device)
    if x.dtype == torch.bfloat16 and not keep_sublayer_dtype:
        lin = lin.to(torch.bfloat16)
    xs = x.detach().to(device).requires_grad_(True)
    ps = phi.detach().to(device).requires_grad_(True)
    bs = b.detach().to(device).requires_grad_(True)
    al = [a.detach().to(device).requires_grad_(True) for a in alphas]
    out = hyper_connection(xs, lin, ps, bs, *al, projection=projection, **kw)
    g = torch.Generator().manual_seed(123)
    gout = torch.randn(out.shape, generator=g).to(device=device, dtype=out.dtype)
    out.backward(gout)
    grads = [xs.grad, ps.grad, bs.grad, *[a.grad for a in al], lin.weight.grad, lin.bias.grad]
    return out, [t.detach().cpu().double() for t in grads], gout


def _ref(x, lin, phi, b, alphas, gout, projection="birkhoff", **kw):
    """The float64 layer; each alpha enters per token (broadcast over the token's maps) so
    that its gradient comes with the per-token contributions: their sum is dL/dalpha and
    the sum of their magnitudes the scale a float32 sum over tokens is accurate to."""
    lin = copy.deepcopy(lin).double()
    xs = x.detach().double().requires_grad_(True)
    ps = phi.detach().double().requires_grad_(True)
    bs = b.detach().double().requires_grad_(True)
    lead = x.shape[:-2]
    al = [a.detach().double().expand(*lead, 1).clone().requires_grad_(True) for a in alphas]
    out = hyper_connection_ref(xs, lin, ps, bs, *al, projection=projection, **kw)
    out.backward(gout.detach().cpu().double())
    scales = [a.grad.abs().sum() for a in al]
    grads = [xs.grad, ps.grad, bs.grad, *[a.grad.sum() for a in al], lin.weight.grad]
    grads.append(lin.bias.grad)
    return out.detach(), grads, scales


NAMES = ["out", "x", "phi", "b", "alpha_pre", "alpha_post", "alpha_res", "W", "bias_F"]


def _errors(out, grads, ref_out, ref_grads, scales=None):
    """max |ours - ref| / max |ref| per output and gradient (the alphas: / their scale)."""
    errs = {}
    for i, (name, a, r) in enumerate(
        zip(NAMES, [out.detach().cpu().double(), *grads], [ref_out, *ref_grads])
    ):
        den = r.abs().max()
        if scales is not None and name.startswith("alpha"):
            den = scales[i - 4]
        errs[name] = float((a - r).abs().max() / den.clamp_min(1e-30))
    return errs


# ---------------------------------------------------------------- against float64
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("projection", ["birkhoff", "sinkhorn"])
@pytest.mark.parametrize(
    "lead,n,c",
    [
        ((7,), 4, 16),
        ((2, 3), 4, 33),
        ((5,), 2, 1),
        ((3,), 3, 7),
        ((4,), 5, 24),
        ((2, 2), 8, 9),
        ((6,), 6, 40),
        ((3,), 7, 5),
    ],
)
def test_float32_vs_reference(device, projection, lead, n, c):
    x, lin, phi, b, al = _problem(lead, n, c, seed=n * 100 + c)
    out, grads, gout = _run(x, lin, phi, b, al, device, projection)
    assert out.shape == x.shape and out.dtype == torch.float32
    errs = _errors(out, grads, *_ref(x, lin, phi, b, al, gout, projection))
    assert max(errs.values()) <= F32_BOUND, errs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("projection", ["birkhoff", "sinkhorn"])
@pytest.mark.parametrize("lead,n,c", [((2, 8), 4, 64), ((5,), 4, 35), ((3,), 8, 16)])
def test_bf16_stream_vs_reference(device, projection, lead, n, c):
    x, lin, phi, b, al = _problem(lead, n, c, seed=7 * n + c, dtype=torch.bfloat16)
    out, grads, gout = _run(x, lin, phi, b, al, device, projection)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    lin_bf = copy.deepcopy(lin).to(torch.bfloat16)  # the reference's sublayer: the same values
    errs = _errors(out, grads, *_ref(x, lin_bf, phi, b, al, gout, projection))
    assert max(errs.values()) <= BF16_BOUND, errs


@pytest.mark.parametrize("device", DEVICES)
def test_options_vs_reference(device):
    """Non-default eps / post_mult / Sinkhorn iterations reach the kernels."""
    kw = dict(rms_eps=1e-2, pre_eps=0.05, post_mult=1.5, sinkhorn_iters=7, sinkhorn_eps=1e-3)
    x, lin, phi, b, al = _problem((9,), 4, 12, seed=5, scale=0.1)
    out, grads, gout = _run(x, lin, phi, b, al, device, "sinkhorn", **kw)
    errs = _errors(out, grads, *_ref(x, lin, phi, b, al, gout, "sinkhorn", **kw))
    assert max(errs.values()) <= F32_BOUND, errs


# ---------------------------------------------------------------- the CUDA path vs the CPU path
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 2e-5), (torch.bfloat16, BF16_BOUND)])
@pytest.mark.parametrize("projection", ["birkhoff", "sinkhorn"])
@pytest.mark.parametrize("n,c", [(4, 1024), (4, 7168), (2, 48), (8, 136), (4, 37)])
def test_cuda_vs_cpu(dtype, bound, projection, n, c):
    """Large rows too: C = 7168 stages 56 KB of bf16 stream per token in shared memory."""
    x, lin, phi, b, al = _problem((3, 5), n, c, seed=c + n, dtype=dtype)
    out_c, g_c, gout = _run(x, lin, phi, b, al, "cuda", projection)
    out_h, g_h, _ = _run(x, lin, phi, b, al, "cpu", projection)
    scales = _ref(x, lin, phi, b, al, gout, projection)[2]  # the alphas' per-token scale
    errs = _errors(out_c, g_c, out_h.detach().double(), g_h, scales)
    assert max(errs.values()) <= bound, errs


@pytest.mark.gpu
def test_cuda_unstaged_rows():
    """n C sizeof(E) above the shared-memory staging limit (112 KB): the second pass of the
    pre kernel reads global memory; same results as the CPU path."""
    x, lin, phi, b, al = _problem((3,), 8, 8192, seed=3, dtype=torch.bfloat16)
    out_c, g_c, gout = _run(x, lin, phi, b, al, "cuda")
    out_h, g_h, _ = _run(x, lin, phi, b, al, "cpu")
    scales = _ref(x, lin, phi, b, al, gout)[2]
    errs = _errors(out_c, g_c, out_h.detach().double(), g_h, scales)
    assert max(errs.values()) <= BF16_BOUND, errs


# ---------------------------------------------------------------- properties
@pytest.mark.parametrize("device", DEVICES)
def test_deterministic(device):
    x, lin, phi, b, al = _problem((4, 8), 4, 40, seed=11, dtype=torch.bfloat16)
    r1 = _run(x, lin, phi, b, al, device)
    r2 = _run(x, lin, phi, b, al, device)
    assert torch.equal(r1[0], r2[0])
    assert all(torch.equal(p, q) for p, q in zip(r1[1], r2[1]))


@pytest.mark.parametrize("device", DEVICES)
def test_maps_doubly_stochastic(device):
    x, lin, phi, b, al = _problem((64,), 4, 32, seed=2, scale=3.0)
    lin = lin.to(device)
    args = (x.to(device), lin, phi.to(device), b.to(device) * 8, *[a.to(device) for a in al])
    out, maps = hyper_connection(*args, return_maps=True)
    assert maps.h_res.shape == (64, 4, 4) and maps.h_res.dtype == torch.float32
    assert float(marginal_error(maps.h_res).max()) <= 5.5e-6
    assert bool((maps.h_pre > 0).all() and (maps.h_pre < 1).all())
    assert bool((maps.h_post > 0).all() and (maps.h_post < 2).all())
    _, sk = hyper_connection(*args, projection="sinkhorn", return_maps=True)
    assert float(marginal_error(sk.h_res).max()) > 1e-4  # Sinkhorn-20 at these logits: far


@pytest.mark.parametrize("device", DEVICES)
def test_maps_used_outside(device):
    """A loss on the returned maps (a regulariser, say) adds to their gradients: the same
    gradients as the float64 layer's."""
    x, lin, phi, b, al = _problem((6,), 4, 12, seed=8)
    w = torch.randn(3, generator=torch.Generator().manual_seed(0))

    def loss(out, maps):
        h_pre, h_post, h_res = maps
        return (
            out.sum()
            + w[0] * h_pre.square().sum()
            + w[1] * h_post.sum()
            + w[2] * (h_res * torch.arange(16.0, device=h_res.device).view(4, 4)).sum()
        )

    xs, ps = x.clone().to(device).requires_grad_(True), phi.clone().to(device).requires_grad_(True)
    args = (lin.to(device), ps, b.to(device), *[a.to(device) for a in al])
    w = w.to(device)
    loss(*hyper_connection(xs, *args, return_maps=True)).backward()
    w = w.cpu()
    xr, pr = x.double().requires_grad_(True), phi.double().requires_grad_(True)
    lin64 = copy.deepcopy(lin).cpu().double()
    loss(*hyper_connection_ref(xr, lin64, pr, b, *al, return_maps=True)).backward()
    for ours, ref in ((xs.grad, xr.grad), (ps.grad, pr.grad)):
        err = float((ours.cpu().double() - ref).abs().max() / ref.abs().max())
        assert err <= F32_BOUND, err


def test_frozen_phi_and_no_grad():
    x, lin, phi, b, al = _problem((5,), 4, 8, seed=1)
    with torch.no_grad():
        out = hyper_connection(x, lin, phi, b, *al)
    ref = hyper_connection_ref(x, copy.deepcopy(lin).double(), phi, b, *al)
    assert float((out.double() - ref.detach()).abs().max() / ref.abs().max()) <= F32_BOUND
    xs = x.clone().requires_grad_(True)  # phi, b, alphas without grad
    hyper_connection(xs, lin, phi, b, *al).sum().backward()
    assert xs.grad is not None and torch.isfinite(xs.grad).all()


def test_module():
    torch.manual_seed(0)
    layer = HyperConnection(torch.nn.Linear(24, 24), hc=4, c=24)
    assert layer.phi.shape == (96, 24) and layer.b.shape == (24,)
    assert float(layer.alpha_res) == pytest.approx(0.01)
    assert "hc=4, c=24" in repr(layer)
    x = torch.randn(2, 3, 4, 24)
    out, maps = layer(x, return_maps=True)
    assert out.shape == x.shape and maps.h_res.shape == (2, 3, 4, 4)
    out.square().mean().backward()
    for p in (layer.phi, layer.b, layer.alpha_pre, layer.alpha_post, layer.alpha_res):
        assert p.grad is not None and torch.isfinite(p.grad).all()
    sk = HyperConnection(torch.nn.Identity(), hc=2, c=8, projection="sinkhorn", tmax=5)
    assert "tmax=5" in repr(sk) and sk(torch.randn(3, 2, 8)).shape == (3, 2, 8)
    assert isinstance(mhc_proj.nn.BirkhoffProjection(), torch.nn.Module)


def test_torch_compile_fullgraph():
    """The custom ops with their fake implementations trace without a graph break; the
    compiled forward and backward equal the eager ones bitwise."""
    torch._dynamo.reset()
    x, lin, phi, b, al = _problem((2, 3), 4, 16, seed=9)
    layer = HyperConnection(lin, hc=4, c=16)
    with torch.no_grad():
        layer.phi.copy_(phi)
        layer.b.copy_(b)

    def step(fn):
        xin = x.clone().requires_grad_(True)
        layer.zero_grad()
        out = fn(xin)
        out.square().sum().backward()
        return out.detach(), xin.grad, layer.phi.grad.clone(), layer.alpha_res.grad.clone()

    eager = step(layer)
    compiled = step(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_opcheck():
    x, _lin, phi, b, _al = _problem((6,), 4, 8, seed=4)
    alpha = torch.tensor([0.5, 1.0, 1.5])
    args = (x, phi, alpha, b, 0, 20, 1e-6, 1e-6, 0.0, 2.0, False)
    # the token output is a zero-storage view: the schema / aliasing checks do not apply
    tests = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.mhc_proj.hc_pre.default, args, test_utils=tests)
    y, maps, h_res, token, *_ = torch.ops.mhc_proj.hc_pre(*args)
    f = torch.randn(6, 8)
    torch.library.opcheck(torch.ops.mhc_proj.hc_post.default, (token, x, f, maps, h_res))
    torch.library.opcheck(torch.ops.mhc_proj.hc_post_bwd.default, (torch.randn_like(x), x, f, maps))


# ---------------------------------------------------------------- bad input
def test_bad_input():
    x, lin, phi, b, al = _problem((3,), 4, 8, seed=0)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        hyper_connection(x.double(), lin, phi, b, *al)
    with pytest.raises(TypeError, match="torch.Tensor"):
        hyper_connection([1.0], lin, phi, b, *al)
    with pytest.raises(ValueError, match="must be in 2..16"):
        hyper_connection(torch.randn(3, 17, 8), lin, torch.randn(136, 323), torch.randn(323), *al)
    with pytest.raises(ValueError, match=r"phi must have shape \(n\*C, n\*n \+ 2n\) = \(32, 24\)"):
        hyper_connection(x, lin, phi[:, :20], b, *al)
    with pytest.raises(ValueError, match=r"b must have shape \(24,\)"):
        hyper_connection(x, lin, phi, b[:5], *al)
    with pytest.raises(ValueError, match="projection must be one of"):
        hyper_connection(x, lin, phi, b, *al, projection="sk")
    with pytest.raises(ValueError, match="alpha_res must be a scalar"):
        hyper_connection(x, lin, phi, b, al[0], al[1], torch.ones(2))
    with pytest.raises(ValueError, match=r"layer must map \(..., C\) to \(..., C\)"):
        hyper_connection(x, torch.nn.Linear(8, 5), phi, b, *al)
    with pytest.raises(ValueError, match=r"sinkhorn_iters must be an integer in 1..10000"):
        hyper_connection(x, lin, phi, b, *al, projection="sinkhorn", sinkhorn_iters=0)
    with pytest.raises(ValueError, match=r"x must have shape \(..., 4, 8\)"):
        HyperConnection(lin, hc=4, c=8)(torch.randn(3, 4, 9))
    with pytest.raises(ValueError, match="hc"):
        HyperConnection(lin, hc=17, c=8)


# ---------------------------------------------------------------- the peer's conventions
@pytest.mark.parametrize(
    "device,dtype,bound",
    [
        ("cpu", torch.float32, 5e-5),
        pytest.param("cuda", torch.bfloat16, BF16_BOUND, marks=pytest.mark.gpu),
    ],
)
def test_matches_liger_kernel(device, dtype, bound):
    """With projection="sinkhorn" the layer is Liger-Kernel's LigerMHC (same parameters,
    same formulas): output and every gradient agree. CPU: LigerMHC's Triton kernels under
    TRITON_INTERPRET=1 in float32 (measured <= 6.1e-6); GPU: bf16 stream, phi bf16-valued."""
    lk = pytest.importorskip("liger_kernel.transformers")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("LigerMHC runs on the CPU only under TRITON_INTERPRET=1")
    torch.manual_seed(0)
    n, c = 4, 32 if device == "cpu" else 256
    phi_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    lig = lk.LigerMHC(
        torch.nn.Identity(), hc=n, c=c, phi_dtype=phi_dtype, allow_fp32=dtype == torch.float32
    ).to(device)
    ours = HyperConnection(torch.nn.Identity(), hc=n, c=c, projection="sinkhorn", device=device)
    names = ("alpha_pre", "alpha_post", "alpha_res")
    with torch.no_grad():
        lig.phi.copy_(torch.randn_like(lig.phi) * 0.05)
        lig.b.copy_(torch.randn_like(lig.b))
        ours.phi.copy_(lig.phi.float())
        ours.b.copy_(lig.b)
        for k in names:
            getattr(lig, k).fill_(0.7)
            getattr(ours, k).fill_(0.7)
    x = torch.randn(3, 8, n, c, device=device).to(dtype)
    xl, xo = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_l, out_o = lig(xl), ours(xo)
    g = torch.randn_like(out_l)
    out_l.backward(g)
    out_o.backward(g)
    pairs = [
        (out_o, out_l),
        (xo.grad, xl.grad),
        (ours.phi.grad, lig.phi.grad),
        (ours.b.grad, lig.b.grad),
    ]
    pairs += [(getattr(ours, k).grad, getattr(lig, k).grad) for k in names]
    for a, r in pairs:
        a, r = a.detach().double(), r.detach().double()
        assert float((a - r).abs().max() / r.abs().max()) <= bound
