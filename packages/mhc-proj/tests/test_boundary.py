"""hyper_connection_stack / HyperConnectionStack (the fused layer boundary): against the
float64 chain ``hyper_connection_stack_ref`` and the unfused layers (forward and every
gradient: the stream, every layer's phi, b, alphas and sublayer parameters), the CUDA
kernels against the C++ CPU path, batch invariance of the deterministic mode (permuted and
re-batched tokens give bitwise the same maps, outputs and stream gradients), autocast,
gradient checkpointing, CUDA graphs, torch.compile(fullgraph=True) and input checking.

Kernels under test (``csrc/boundary_kernels.cuh``, ``csrc/boundary_cpu.cpp``): the fused
forward (x1 = post-mix, written once and multiplied by the next layer's phi) and backward
(all of dL/dx1, the post-mix's backward, dL/dH and dL/dphi in one pass), with the layer's
pre kernel and the projection around them.

Bounds. float32 stream: max |ours - ref| / max |ref| <= 1e-4 per output and gradient, the
alphas' gradients relative to the sum of the magnitudes of their per-token parts (the
layer's test_hyper_connection.py bound; the CPU path multiplies by float32 phi, CUDA by phi
split into bf16 hi + lo, 16 significant bits). bfloat16 stream: every output and gradient
at most twice the unfused layers' own error against float64 (flash-attention's rule) plus
2^-8, and the output and dL/dx within 2^-6: the fused backward keeps dL/dx1 in float32
inside a boundary where the unfused layers round it to bf16 between their post and pre
ops, so the two differ by a few bf16 roundings (measured on the CPU, 18 to 37 tokens: both
up to 2.0e-2, the fused error at most 1.12x the unfused one plus 2^-8).
"""

import copy
import types

import pytest
import torch

from mhc_proj import (
    HyperConnection,
    HyperConnectionStack,
    hyper_connection_stack,
    hyper_connection_stack_ref,
    marginal_error,
)
from mhc_proj import boundary as bnd

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
F32_BOUND, BF16_BOUND = 1e-4, 2.0**-6
# the maps (float32, entries O(1)) against float64: CUDA multiplies by phi split into bf16
# hi + lo; that rounding alone moves these tests' maps by up to 6.9e-6 (the CPU path with a
# rounded phi), the tensor cores' sums add to it
MAPS_BOUND = 3e-5


class Diag(torch.nn.Module):
    """y * weight + bias: a token-wise sublayer (the invariance tests need one whose output
    for a token does not depend on the others; a Linear's GEMM may block by batch size)."""

    def __init__(self, c):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(c))
        self.bias = torch.nn.Parameter(torch.zeros(c))

    def forward(self, y):
        return y * self.weight + self.bias


def _layers(n, c, count, seed, *, sub="linear", projection="birkhoff", **kw):
    """``count`` HyperConnection layers with random parameters (alphas O(1), so every map
    varies) around Linear (or Diag) sublayers."""
    g = torch.Generator().manual_seed(seed)
    m = n * n + 2 * n
    out = []
    for _ in range(count):
        lin = {"linear": torch.nn.Linear(c, c), "diag": Diag(c), "identity": torch.nn.Identity()}
        lin = lin[sub]
        hc = HyperConnection(lin, hc=n, c=c, projection=projection, **kw)
        with torch.no_grad():
            if sub == "linear":
                lin.weight.copy_(torch.randn(c, c, generator=g) / c**0.5)
            elif sub == "diag":
                lin.weight.copy_(1 + 0.5 * torch.randn(c, generator=g))
            if sub != "identity":
                lin.bias.copy_(torch.randn(c, generator=g) * 0.1)
            hc.phi.copy_(torch.randn(n * c, m, generator=g) / (n * c) ** 0.5 * 2)
            hc.b.copy_(torch.randn(m, generator=g) * 0.5)
            for name, v in (("alpha_pre", 0.8), ("alpha_post", 1.3), ("alpha_res", 2.0)):
                getattr(hc, name).fill_(v)
        out.append(hc)
    return out


PARAMS = ("phi", "b", "alpha_pre", "alpha_post", "alpha_res")


def _grads(x, mods):
    """dL/dx, then per layer phi, b, alphas and the sublayer's weight and bias."""
    out = [x.grad]
    for hc in mods:
        out += [getattr(hc, k).grad for k in PARAMS]
        out += [hc.layer.weight.grad, hc.layer.bias.grad]
    return [t.detach().cpu().double() for t in out]


def _names(count):
    names = ["x"]
    for i in range(count):
        names += [f"{i}.{k}" for k in (*PARAMS, "W", "bias_F")]
    return names


def _run(layers, x, device, *, fused=True, deterministic=False, gout=None):
    """Our stack (or the unfused layers) on ``device``: output, maps, gradients of
    <out, gout> and gout."""
    mods = [copy.deepcopy(hc).to(device) for hc in layers]
    if x.dtype == torch.bfloat16:
        for hc in mods:
            hc.layer.to(torch.bfloat16)
    xs = x.detach().clone().to(device).requires_grad_(True)
    if fused:
        out, maps = hyper_connection_stack(xs, mods, deterministic=deterministic, return_maps=True)
    else:
        out, maps = xs, []
        for hc in mods:
            out, mp = hc(out, return_maps=True)
            maps.append(mp)
    if gout is None:
        g = torch.Generator().manual_seed(123)
        gout = torch.randn(out.shape, generator=g).to(out.dtype)
    out.backward(gout.to(device))
    return out.detach(), maps, _grads(xs, mods), gout


def _ref(layers, x, gout):
    """The float64 chain; each alpha enters per token (broadcast over the token's maps)
    so that its gradient comes with the per-token parts: their sum is dL/dalpha, the sum of
    their magnitudes the scale a float32 sum over tokens is accurate to."""
    lead = x.shape[:-2]
    xs = x.detach().double().requires_grad_(True)
    mods, per_token = [], []
    for hc in layers:
        sub = copy.deepcopy(hc.layer)
        if x.dtype == torch.bfloat16:  # the fused run's sublayer: the same bf16 values
            sub = sub.to(torch.bfloat16)
        sub = sub.double()
        opts = ("projection", "formulation", "tmax", "sinkhorn_eps", "rms_eps", "pre_eps")
        opts += ("post_mult",)
        ns = types.SimpleNamespace(**{k: getattr(hc, k) for k in opts})
        ns.layer = sub
        ns.phi = hc.phi.detach().double().requires_grad_(True)
        ns.b = hc.b.detach().double().requires_grad_(True)
        al = []
        for k in PARAMS[2:]:
            a = getattr(hc, k).detach().double().expand(*lead, 1).clone().requires_grad_(True)
            setattr(ns, k, a)
            al.append(a)
        per_token.append(al)
        mods.append(ns)
    out, maps = hyper_connection_stack_ref(xs, mods, return_maps=True)
    out.backward(gout.detach().cpu().double())
    grads, scales = [xs.grad], [None]
    for ns, al in zip(mods, per_token):
        grads += [ns.phi.grad, ns.b.grad] + [a.grad.sum() for a in al]
        scales += [None, None] + [a.grad.abs().sum() for a in al]
        grads += [ns.layer.weight.grad, ns.layer.bias.grad]
        scales += [None, None]
    return out.detach(), maps, grads, scales


def _errors(out, grads, ref_out, ref_grads, scales):
    """max |ours - ref| / max |ref| per output and gradient (the alphas: / their scale)."""
    count = (len(grads) - 1) // (len(PARAMS) + 2)
    errs = {}
    names = ["out", *_names(count)]
    ours = [out.cpu().double(), *grads]
    for name, a, r, s in zip(names, ours, [ref_out, *ref_grads], [None, *scales]):
        den = s if s is not None else r.abs().max()
        errs[name] = float((a - r).abs().max() / den.clamp_min(1e-30))
    return errs


# ---------------------------------------------------------------- against float64
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("projection", ["birkhoff", "sinkhorn"])
@pytest.mark.parametrize(
    "lead,n,c,count",
    [
        ((7,), 4, 16, 3),
        ((3, 5), 4, 33, 2),
        ((5,), 2, 1, 3),
        ((9,), 3, 7, 2),
        ((4,), 8, 9, 2),
        ((3,), 5, 24, 1),
        ((2, 3), 6, 40, 2),
        ((1,), 7, 5, 2),
    ],
)
def test_float32_vs_reference(device, projection, lead, n, c, count):
    layers = _layers(n, c, count, seed=n * 100 + c + count, projection=projection)
    x = torch.randn(*lead, n, c, generator=torch.Generator().manual_seed(c))
    out, _maps, grads, gout = _run(layers, x, device)
    assert out.shape == x.shape and out.dtype == torch.float32
    ref_out, _rm, ref_grads, scales = _ref(layers, x, gout)
    errs = _errors(out, grads, ref_out, ref_grads, scales)
    assert max(errs.values()) <= F32_BOUND, errs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("projection", ["birkhoff", "sinkhorn"])
@pytest.mark.parametrize(
    "lead,n,c,count", [((2, 9), 4, 64, 3), ((37,), 4, 35, 2), ((23,), 8, 16, 2)]
)
def test_bf16_stream_vs_reference_and_unfused(device, projection, lead, n, c, count):
    layers = _layers(n, c, count, seed=7 * n + c, projection=projection)
    x = torch.randn(*lead, n, c, generator=torch.Generator().manual_seed(1)).bfloat16()
    out, _maps, grads, gout = _run(layers, x, device)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    ref = _ref(layers, x, gout)
    errs = _errors(out, grads, ref[0], ref[2], ref[3])
    u_out, _um, u_grads, _ = _run(layers, x, device, fused=False, gout=gout)
    u_errs = _errors(u_out, u_grads, ref[0], ref[2], ref[3])
    assert max(errs["out"], errs["x"]) <= BF16_BOUND, errs
    worse = {k: (errs[k], u_errs[k]) for k in errs if errs[k] > 2 * u_errs[k] + 2.0**-8}
    assert not worse, worse


@pytest.mark.parametrize("device", DEVICES)
def test_options_and_maps(device):
    """Non-default eps / post_mult / Sinkhorn iterations reach the kernels; the returned
    maps are the float64 chain's (H_res doubly stochastic to 5.5e-6 with the exact
    projection)."""
    kw = dict(rms_eps=1e-2, pre_eps=0.05, post_mult=1.5, tmax=7, sinkhorn_eps=1e-3)
    layers = _layers(4, 12, 2, seed=5, projection="sinkhorn", **kw)
    layers += _layers(4, 12, 1, seed=6)
    x = torch.randn(9, 4, 12, generator=torch.Generator().manual_seed(2)) * 0.1
    out, maps, grads, gout = _run(layers, x, device)
    ref_out, ref_maps, ref_grads, scales = _ref(layers, x, gout)
    errs = _errors(out, grads, ref_out, ref_grads, scales)
    assert max(errs.values()) <= F32_BOUND, errs
    for ours, ref in zip(maps, ref_maps):
        for a, r in zip(ours, ref):
            assert a.dtype == torch.float32 and a.shape == r.shape
            assert float((a.detach().cpu().double() - r.detach()).abs().max()) <= MAPS_BOUND
    assert float(marginal_error(maps[-1].h_res.detach()).max()) <= 5.5e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("projection", ["birkhoff", "sinkhorn"])
def test_deepseek_formulation(device, projection):
    """formulation="deepseek" (x_next = P^T x, hc_eps on H_pre), mixed with "mhc" layers:
    the float64 chain, and the maps in the layer's convention (P itself)."""
    layers = _layers(4, 20, 2, seed=31, projection=projection, formulation="deepseek")
    layers.insert(1, _layers(4, 20, 1, seed=32)[0])
    x = torch.randn(11, 4, 20, generator=torch.Generator().manual_seed(8))
    out, maps, grads, gout = _run(layers, x, device)
    ref_out, ref_maps, ref_grads, scales = _ref(layers, x, gout)
    errs = _errors(out, grads, ref_out, ref_grads, scales)
    assert max(errs.values()) <= F32_BOUND, errs
    for ours, ref in zip(maps, ref_maps):
        err = float((ours.h_res.detach().cpu().double() - ref[2].detach()).abs().max())
        assert err <= MAPS_BOUND, err
    _u_out, u_maps, _ug, _ = _run(layers, x, device, fused=False, gout=gout)
    for ours, unf in zip(maps, u_maps):
        assert float((ours.h_res - unf.h_res).abs().max()) <= MAPS_BOUND


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_stream_float32_sublayer(device):
    """A bf16 stream around float32 sublayers: y enters them in float32, as in the layer;
    the same results as the unfused layers to bf16 rounding."""
    layers = _layers(4, 32, 2, seed=41)
    x = torch.randn(9, 4, 32, generator=torch.Generator().manual_seed(9)).bfloat16()
    mods = [copy.deepcopy(hc).to(device) for hc in layers]  # float32 sublayers
    out = hyper_connection_stack(x.to(device), mods)
    ref = x.to(device)
    for hc in mods:
        ref = hc(ref)
    assert out.dtype == torch.bfloat16
    err = float((out.double() - ref.double()).abs().max() / ref.double().abs().max())
    assert err <= BF16_BOUND, err


# ---------------------------------------------------------------- the CUDA path vs the CPU path
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 6e-5), (torch.bfloat16, BF16_BOUND)])
@pytest.mark.parametrize(
    "lead,n,c",
    [
        ((3, 5), 4, 1024),
        ((2, 300), 4, 64),
        ((3,), 4, 7168),
        ((7,), 2, 48),
        ((5,), 8, 136),
        ((9,), 4, 37),
        ((4,), 3, 100),
        ((3, 100), 5, 40),
    ],
)
def test_cuda_vs_cpu(dtype, bound, lead, n, c):
    """Wide rows (C = 7168: many chunks and splits), several token groups (600 tokens),
    C not a multiple of the chunk or of the vector (the scalar path), every n class.
    float32 bound: CUDA multiplies by phi split into bf16 hi + lo (16 significant bits),
    the CPU by float32 phi; that rounding alone moves these cases by up to 1.8e-5 (the CPU
    path with a rounded phi), the g_h split and the tensor cores' sums add to it."""
    layers = _layers(n, c, 2, seed=c + n, sub="linear" if c <= 256 else "diag")
    x = torch.randn(*lead, n, c, generator=torch.Generator().manual_seed(3)).to(dtype)
    out_c, maps_c, g_c, gout = _run(layers, x, "cuda")
    out_h, maps_h, g_h, _ = _run(layers, x, "cpu", gout=gout)
    scales = _ref(layers, x, gout)[3]  # the alphas' per-token scale
    errs = _errors(out_c, g_c, out_h.double(), g_h, scales)
    assert max(errs.values()) <= bound, errs
    for mc, mh in zip(maps_c, maps_h):
        assert float((mc.h_res.detach().cpu() - mh.h_res.detach()).abs().max()) <= 1e-4


# ---------------------------------------------------------------- batch invariance
def _token_rows(layers, x, gout, device, deterministic):
    """Per token: the output, every layer's maps and dL/dx (Diag sublayers: nothing else
    mixes tokens)."""
    out, maps, grads, _ = _run(layers, x, device, deterministic=deterministic, gout=gout)
    rows = [out.cpu(), grads[0]]
    for m in maps:
        rows += [m.h_pre.detach().cpu(), m.h_post.detach().cpu(), m.h_res.detach().cpu()]
    return rows


@pytest.mark.parametrize(
    "device,deterministic",
    [("cpu", True), ("cpu", False), pytest.param("cuda", True, marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance(device, deterministic, dtype):
    """13 tokens alone, then the same tokens at random places among 287 others: bitwise
    the same maps, outputs and stream gradients. C = 1100 is 35 chunks in 2 splits; 300
    tokens span several of the CUDA kernels' tiles and groups. On the CPU the default mode
    is the deterministic one."""
    n, c = 4, 1100
    layers = _layers(n, c, 3, seed=21, sub="diag")
    g = torch.Generator().manual_seed(4)
    x_small = torch.randn(13, n, c, generator=g).to(dtype)
    g_small = torch.randn(13, n, c, generator=g).to(dtype)
    x_big = torch.randn(300, n, c, generator=g).to(dtype)
    g_big = torch.randn(300, n, c, generator=g).to(dtype)
    where = torch.randperm(300, generator=g)[:13]
    x_big[where], g_big[where] = x_small, g_small
    small = _token_rows(layers, x_small, g_small, device, deterministic)
    big = _token_rows(layers, x_big, g_big, device, deterministic)
    for a, b in zip(small, big):
        assert torch.equal(a, b[where])


@pytest.mark.gpu
def test_cuda_default_mode_close_to_deterministic():
    """At few tokens the default mode splits rows more finely than the deterministic one
    (a different summation order): the same results to float32 rounding."""
    layers = _layers(4, 4096, 2, seed=8, sub="diag")
    x = torch.randn(40, 4, 4096, generator=torch.Generator().manual_seed(5))
    assert (
        bnd.splits(40, 4, 4096, deterministic=False, device=torch.device("cuda"))[0]
        > (bnd.splits(40, 4, 4096, deterministic=True, device=torch.device("cuda"))[0])
    )
    out_d, _m, g_d, gout = _run(layers, x, "cuda", deterministic=True)
    out_f, _m, g_f, _ = _run(layers, x, "cuda", gout=gout)
    errs = _errors(out_f, g_f, out_d.double(), g_d, [None] * len(g_d))
    assert max(errs.values()) <= 1e-5, errs


def test_splits(monkeypatch):
    """Deterministic splits depend on (n, C) only and cover every chunk; the CUDA default
    narrows them when the tokens alone would not fill the GPU, and keeps them at 32K."""
    for n, c in ((4, 7168), (4, 4096), (2, 100), (8, 16), (3, 1)):
        w = bnd._width(n)
        nchunks = -(-c // w)
        for t in (1, 7, 4096, 32768):
            s, cps = bnd.splits(t, n, c, deterministic=True, device=torch.device("cpu"))
            assert (s, cps) == bnd.splits(1, n, c, deterministic=True, device=torch.device("cpu"))
            assert s * cps >= nchunks > (s - 1) * cps
    monkeypatch.setattr(bnd, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    det = bnd.splits(32768, 4, 7168, deterministic=True, device=cuda)
    assert bnd.splits(32768, 4, 7168, deterministic=False, device=cuda) == det == (7, 32)
    assert bnd.splits(32768, 4, 7168, deterministic=False, device=cuda, backward=True) == det
    s, cps = bnd.splits(64, 4, 7168, deterministic=False, device=cuda)
    assert s > det[0] and s * cps >= 224 > (s - 1) * cps
    assert bnd.splits(64, 4, 7168, deterministic=False, device=torch.device("cpu")) == det


# ---------------------------------------------------------------- torch features
def _stack(n=4, c=16, count=3, sub="linear", device="cpu"):
    return HyperConnectionStack(_layers(n, c, count, seed=9, sub=sub)).to(device)


def _step(fn, stack, x, gout):
    xin = x.clone().requires_grad_(True)
    stack.zero_grad(set_to_none=True)
    out = fn(xin)
    out.backward(gout)
    grads = [p.grad.clone() for p in stack.parameters()]
    return [out.detach(), xin.grad] + grads


def test_torch_compile_fullgraph():
    """The custom ops with their fake implementations trace without a graph break; the
    compiled forward and backward equal the eager ones bitwise."""
    torch._dynamo.reset()
    stack = _stack()
    x = torch.randn(2, 5, 4, 16)
    gout = torch.randn_like(x)
    eager = _step(stack, stack, x, gout)
    compiled = _step(torch.compile(stack, fullgraph=True, backend="aot_eager"), stack, x, gout)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.gpu
def test_torch_compile_fullgraph_cuda():
    """Identity sublayers: Inductor may fuse a sublayer's own arithmetic (one rounding
    where eager has two); the boundary ops are opaque to it and must agree bitwise."""
    torch._dynamo.reset()
    stack = _stack(c=64, sub="identity", device="cuda")
    x = torch.randn(3, 7, 4, 64, device="cuda").bfloat16()
    gout = torch.randn_like(x)
    eager = _step(stack, stack, x, gout)
    compiled = _step(torch.compile(stack, fullgraph=True), stack, x, gout)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_checkpointing(device):
    """Recomputing the stack in the backward (torch.utils.checkpoint) gives bitwise the
    same output and gradients."""
    stack = _stack(c=24, sub="diag", device=device)
    x = torch.randn(11, 4, 24, device=device)
    gout = torch.randn_like(x)
    plain = _step(stack, stack, x, gout)

    def ckpt(xin):
        return torch.utils.checkpoint.checkpoint(stack, xin, use_reentrant=False)

    again = _step(ckpt, stack, x, gout)
    for a, b in zip(plain, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast(device):
    """A float32 stream under bf16 autocast: the sublayers run in bf16, the boundary ops
    in float32 (autocast does not reach inside them): the float64 chain around the same
    autocast sublayers, to 2^-6; two calls agree bitwise."""
    layers = _layers(4, 32, 3, seed=12)
    x = torch.randn(3, 6, 4, 32, generator=torch.Generator().manual_seed(6))
    gout = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))

    def run():
        with torch.autocast(device, dtype=torch.bfloat16):
            return _run(layers, x, device, gout=gout)

    out, _maps, grads, _ = run()
    again = run()
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert torch.equal(out, again[0]) and all(torch.equal(a, b) for a, b in zip(grads, again[2]))

    class UnderAutocast(torch.nn.Module):  # the reference's sublayer: the same bf16 math
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, y):
            with torch.autocast(device, dtype=torch.bfloat16):
                return self.lin.to(device)(y.float().to(device)).cpu().double()

    wrapped = []
    for hc in layers:
        hc = copy.deepcopy(hc)
        hc.layer = UnderAutocast(hc.layer)
        wrapped.append(hc)
    ref = hyper_connection_stack_ref(x.double(), wrapped).detach()
    err = float((out.cpu().double() - ref).abs().max() / ref.abs().max())
    assert err <= BF16_BOUND, err


@pytest.mark.gpu
def test_cuda_graph():
    """Forward and backward captured in a CUDA graph: replays equal the eager step
    bitwise, also after new data is copied into the captured input."""
    stack = _stack(c=128, sub="diag", device="cuda")
    x = torch.randn(5, 9, 4, 128, device="cuda").bfloat16().requires_grad_(True)
    gout = torch.randn_like(x)

    def step():
        x.grad = None
        stack.zero_grad(set_to_none=True)
        out = stack(x)
        out.backward(gout)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    x.grad = None
    stack.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        out = stack(x)
        out.backward(gout)
    for _ in range(2):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        got = [out.clone(), x.grad.clone()] + [p.grad.clone() for p in stack.parameters()]
        xin = x.detach().clone().requires_grad_(True)
        stack.zero_grad(set_to_none=True)
        ref_out = stack(xin)
        ref_out.backward(gout)
        want = [ref_out.detach(), xin.grad] + [p.grad for p in stack.parameters()]
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_opcheck():
    n, c, t = 4, 8, 6
    m = n * n + 2 * n
    g = torch.Generator().manual_seed(0)
    x, f = torch.randn(t, n, c, generator=g), torch.randn(t, c, generator=g)
    maps = torch.rand(t, 2 * n, generator=g)
    hres = torch.rand(t, n, n, generator=g)
    phi, bias = torch.randn(n * c, m, generator=g) * 0.1, torch.randn(m, generator=g)
    alpha = torch.tensor([0.5, 1.0, 1.5])
    opts = (0, 20, 1e-6, 1e-6, 0.0, 2.0, False, True)
    e = torch.empty(0)
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    op = torch.ops.mhc_proj.bnd_fwd.default
    for has_post, has_pre in ((True, True), (False, True), (True, False)):
        post = (f, maps, hres) if has_post else (e, e, e)
        pre = (phi, bias, alpha) if has_pre else (e, e, e)
        args = (x, *post, *pre, has_post, has_pre, *opts)
        torch.library.opcheck(op, args, test_utils=tests)
        # the backward op on this forward's outputs: its real outputs match its fake ones
        x_next, y, mp, h_res, mix, inv_r, lres = op(*args)
        grads = (
            torch.randn_like(x) if has_post else e,
            torch.randn_like(y),
            torch.randn_like(mp),
            torch.randn_like(h_res),
        )
        saved = (x, *post, x_next, pre[0], pre[2], mp, h_res, mix, inv_r, lres)
        bwd_args = (*grads, *saved, has_post, has_pre, 0, 20, 1e-6, 0.0, 2.0, False, True, has_pre)
        torch.library.opcheck(torch.ops.mhc_proj.bnd_bwd.default, bwd_args, test_utils=tests)


def test_module_and_bad_input():
    stack = _stack(c=8, count=2)
    assert "deterministic=False" in repr(stack) and len(stack.layers) == 2
    assert sum(p.numel() for p in stack.parameters()) == sum(
        p.numel() for hc in stack.layers for p in hc.parameters()
    )
    x = torch.randn(3, 4, 8)
    layers = list(stack.layers)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        hyper_connection_stack(x.double(), layers)
    with pytest.raises(TypeError, match="torch.Tensor"):
        hyper_connection_stack([1.0], layers)
    with pytest.raises(ValueError, match="at least one"):
        hyper_connection_stack(x, [])
    with pytest.raises(TypeError, match=r"layers\[1\] must be a mhc_proj.HyperConnection"):
        hyper_connection_stack(x, [layers[0], torch.nn.Linear(8, 8)])
    with pytest.raises(TypeError, match=r"layers\[0\] must be a mhc_proj.HyperConnection"):
        HyperConnectionStack([torch.nn.Identity()])
    other = HyperConnection(torch.nn.Identity(), hc=4, c=16)
    with pytest.raises(ValueError, match="same hc and c"):
        hyper_connection_stack(x, [layers[0], other])
    with pytest.raises(ValueError, match=r"x must have shape \(..., 4, 8\)"):
        hyper_connection_stack(torch.randn(3, 4, 9), layers)
    bad = HyperConnection(torch.nn.Linear(8, 5), hc=4, c=8)
    with pytest.raises(ValueError, match=r"layers\[0\].layer must map"):
        hyper_connection_stack(x, [bad])
