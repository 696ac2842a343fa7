"""formulation="deepseek" end to end: a small model whose every hyper-connection is loaded
from DeepSeek-V4-style parameters (fn, base, scale) through HyperConnection.from_deepseek,
against a plain torch chain of DeepSeek-V4's published formulas (its inference code and
TileKernels' torch references state them; written here from the formulas):

    mixes = (vec(x) @ fn^T) * rsqrt(mean(vec(x)^2) + rms_eps)
    pre   = sigmoid(mixes[:n] scale[0] + base[:n]) + hc_eps
    post  = 2 sigmoid(mixes[n:2n] scale[1] + base[n:2n])
    comb  = Sinkhorn(mixes[2n:] scale[2] + base[2n:], as n x n, iters, eps = hc_eps)
            (row softmax + eps, a column normalisation, then iters - 1 row / column pairs)
    y     = sum_i pre[i] x[i];   x_next[j] = post[j] F(y) + sum_i comb[i, j] x[i]

with V4's config (n = 4, 20 iterations, hc_eps = rms_eps = 1e-6). The model: an embedding
copied into the n streams, three blocks of (attention-like, MLP) sublayers each wrapped in
a hyper-connection, a weighted head over the streams (V4's hc_head form), a linear readout.
Output and every parameter's gradient are compared with the chain run in float64.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from mhc_proj import HyperConnection, birkhoff_project

N, C, VOCAB, LAYERS, HC_EPS, ITERS = 4, 16, 37, 3, 1e-6, 20
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _sinkhorn(logits, iters, eps):
    p = logits.softmax(-1) + eps
    p = p / (p.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        p = p / (p.sum(-1, keepdim=True) + eps)
        p = p / (p.sum(-2, keepdim=True) + eps)
    return p


def _ds_hyper_connection(x, sublayer, fn, base, scale, projection):
    """One DeepSeek-V4 hyper-connection (hc_pre, the sublayer, hc_post) in torch ops."""
    xf = x.flatten(-2)
    mixes = (xf @ fn.t()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(mixes[..., :N] * scale[0] + base[:N]) + HC_EPS
    post = 2 * torch.sigmoid(mixes[..., N : 2 * N] * scale[1] + base[N : 2 * N])
    logits = (mixes[..., 2 * N :] * scale[2] + base[2 * N :]).unflatten(-1, (N, N))
    if projection == "sinkhorn":
        comb = _sinkhorn(logits, ITERS, HC_EPS)
    else:  # the exact projection in float64 (differentiable; tested against its oracle)
        comb = birkhoff_project(logits)
    y = (pre.unsqueeze(-1) * x).sum(-2)
    f = sublayer(y)
    return post.unsqueeze(-1) * f.unsqueeze(-2) + (comb.unsqueeze(-1) * x.unsqueeze(-2)).sum(-3)


class Sub(torch.nn.Module):
    """A sublayer with its own RMSNorm, as in V4's blocks (norm, then attention / FFN)."""

    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(C))
        self.up = torch.nn.Linear(C, width)
        self.down = torch.nn.Linear(width, C)

    def forward(self, y):
        y = F.rms_norm(y, (C,), self.norm.to(y.dtype), eps=1e-6)
        return self.down(F.gelu(self.up(y)))


def _checkpoint(seed):
    """A 'checkpoint': per hyper-connection (fn, base, scale) in V4's shapes and dtypes,
    the sublayers, the embedding, the head's (fn, base, scale) and the readout."""
    g = torch.Generator().manual_seed(seed)
    m = N * (N + 2)
    hcs = [
        (
            torch.randn(m, N * C, generator=g) / math.sqrt(N * C),
            torch.randn(m, generator=g) * 0.5,
            torch.rand(3, generator=g) + 0.5,
        )
        for _ in range(2 * LAYERS)
    ]
    torch.manual_seed(seed)
    subs = [Sub(2 * C if i % 2 else C) for i in range(2 * LAYERS)]
    emb = torch.randn(VOCAB, C, generator=g)
    head = (torch.randn(N, N * C, generator=g) / math.sqrt(N * C), torch.randn(N, generator=g))
    readout = torch.randn(VOCAB, C, generator=g) / math.sqrt(C)
    return hcs, subs, emb, head, readout


def _head(x, fn, base, dtype):
    """V4's hc_head form: pre-like weights over the streams, then their weighted sum."""
    xf = x.to(dtype).flatten(-2)
    mixes = (xf @ fn.to(dtype).t()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
    w = torch.sigmoid(mixes + base.to(dtype)) + HC_EPS
    return (w.unsqueeze(-1) * x.to(dtype)).sum(-2)


def _forward(tokens, emb, blocks, head, readout, stream_dtype):
    x = emb[tokens].to(stream_dtype).unsqueeze(-2).expand(*tokens.shape, N, C)
    for block in blocks:
        x = block(x)
    h = _head(x, *head, dtype=torch.float64 if stream_dtype == torch.float64 else torch.float32)
    return h @ readout.to(h.dtype).t()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("projection", ["sinkhorn", "birkhoff"])
@pytest.mark.parametrize("stream", [torch.float32, torch.bfloat16])
def test_deepseek_model_end_to_end(device, projection, stream):
    hcs, subs, emb, head, readout = _checkpoint(seed=4)
    tokens = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    g_logits = torch.randn(3, 9, VOCAB, generator=torch.Generator().manual_seed(2))

    # ours: each hyper-connection built from the checkpoint's (fn, base, scale)
    ours_subs = [copy.deepcopy(s).to(device) for s in subs]
    if stream == torch.bfloat16:
        ours_subs = [s.to(torch.bfloat16) for s in ours_subs]
    blocks = [
        HyperConnection.from_deepseek(
            sub,
            fn=fn.to(device),
            base=base.to(device),
            scale=scale.to(device),
            projection=projection,
        )
        for sub, (fn, base, scale) in zip(ours_subs, hcs)
    ]
    assert all(b.formulation == "deepseek" and b.pre_eps == HC_EPS for b in blocks)
    logits = _forward(
        tokens.to(device),
        emb.to(device),
        blocks,
        [h.to(device) for h in head],
        readout.to(device),
        stream,
    )
    logits.backward(g_logits.to(device, logits.dtype))

    # the reference chain in float64 (a bf16 stream: the same bf16 sublayer weights)
    ref_hcs = [tuple(t.double().requires_grad_(True) for t in hc) for hc in hcs]
    ref_subs = [copy.deepcopy(s) for s in subs]
    if stream == torch.bfloat16:
        ref_subs = [s.to(torch.bfloat16) for s in ref_subs]
    ref_subs = [s.double() for s in ref_subs]

    def ref_block(sub, hc):
        return lambda x: _ds_hyper_connection(x, sub, *hc, projection)

    ref_blocks = [ref_block(s, hc) for s, hc in zip(ref_subs, ref_hcs)]
    ref = _forward(
        tokens,
        emb.double(),
        ref_blocks,
        [h.double() for h in head],
        readout.double(),
        torch.float64,
    )
    ref.backward(g_logits.double())

    bound = 1e-4 if stream == torch.float32 else 5e-2
    err = float((logits.detach().cpu().double() - ref).abs().max() / ref.abs().max())
    assert err <= bound, err
    # scale's gradients are sums over tokens that cancel (in the first block, whose n
    # streams are equal copies, dL/dscale[2] is 0): measured against the largest of them
    scale_ref = max(float(hc[2].grad.abs().max()) for hc in ref_hcs)
    for block, (fn, base, scale) in zip(blocks, ref_hcs):
        pairs = [(block.phi.grad.t(), fn.grad, fn.grad.abs().max())]
        pairs.append((block.b.grad, base.grad, base.grad.abs().max()))
        alphas = (block.alpha_pre, block.alpha_post, block.alpha_res)
        pairs += [(a.grad.reshape(()), s, scale_ref) for a, s in zip(alphas, scale.grad)]
        for name, (o, r, den) in zip(("fn", "base", "scale0", "scale1", "scale2"), pairs):
            e = float((o.cpu().double() - r).abs().max() / den)
            assert e <= bound * 10, (name, e)  # summed over every token: a looser bound
    for sub, ref_sub in zip(ours_subs, ref_subs):
        o, r = sub.up.weight.grad.cpu().double(), ref_sub.up.weight.grad
        assert float((o - r).abs().max() / r.abs().max()) <= bound * 10


def test_from_deepseek_maps_parameters_and_validates():
    m = N * (N + 2)
    fn, base, scale = torch.randn(m, N * C), torch.randn(m), torch.tensor([0.5, 1.5, 2.5])
    hc = HyperConnection.from_deepseek(torch.nn.Identity(), fn=fn, base=base, scale=scale)
    assert (hc.hc, hc.c, hc.projection, hc.tmax) == (N, C, "sinkhorn", 20)
    assert hc.formulation == "deepseek"
    assert torch.equal(hc.phi, fn.t()) and torch.equal(hc.b, base)
    assert [float(a) for a in (hc.alpha_pre, hc.alpha_post, hc.alpha_res)] == [0.5, 1.5, 2.5]
    assert hc.sinkhorn_eps == hc.pre_eps == HC_EPS
    assert "formulation='deepseek'" in repr(hc)
    with pytest.raises(ValueError, match="fn must have shape"):
        HyperConnection.from_deepseek(torch.nn.Identity(), fn=fn[:-1], base=base, scale=scale)
    with pytest.raises(ValueError, match="base must have shape"):
        HyperConnection.from_deepseek(torch.nn.Identity(), fn=fn, base=base[:3], scale=scale)
    with pytest.raises(ValueError, match="hc_eps"):
        HyperConnection.from_deepseek(
            torch.nn.Identity(), fn=fn, base=base, scale=scale, hc_eps=-1.0
        )


def test_deepseek_maps_convention():
    """maps.h_res is P in DeepSeek's convention (x_next[j] = sum_i P[i, j] x[i]): the mix
    applied is its transpose, and for the exact projection P(L)^T = P(L^T)."""
    torch.manual_seed(3)
    x = torch.randn(5, N, C)
    a = HyperConnection(torch.nn.Identity(), hc=N, c=C, formulation="deepseek", alpha_init=1.0)
    with torch.no_grad():
        a.b.normal_()
    out, maps = a(x, return_maps=True)
    y = (maps.h_pre.unsqueeze(-1) * x).sum(-2)
    expect = maps.h_post.unsqueeze(-1) * y.unsqueeze(-2) + maps.h_res.transpose(-1, -2) @ x
    assert float((out - expect).abs().max()) <= 1e-5
    # the same weights with the res block of phi / b transposed, in the "mhc" convention
    b = HyperConnection(torch.nn.Identity(), hc=N, c=C, alpha_init=1.0, pre_eps=HC_EPS)
    with torch.no_grad():
        perm = torch.arange(N * N).view(N, N).t().reshape(-1) + 2 * N
        cols = torch.cat([torch.arange(2 * N), perm])
        b.phi.copy_(a.phi[:, cols])
        b.b.copy_(a.b[cols])
    out_b, maps_b = b(x, return_maps=True)
    assert float((out - out_b).abs().max()) <= 1e-5
    assert float((maps.h_res.transpose(-1, -2) - maps_b.h_res).abs().max()) <= 1e-5
