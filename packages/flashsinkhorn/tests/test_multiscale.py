"""The multiscale backend's pieces against dense float64 oracles: the tile-pair bound, the
block-sparse passes, the ladder and the certificate (never below the dense truth, on
uniform, clustered, anisotropic and duplicated clouds, balanced and unbalanced)."""

import math

import pytest
import torch
from _helpers import BACKENDS, needs_interpreter
from hypothesis import given, settings
from hypothesis import strategies as st

import flashsinkhorn as fs
from flashsinkhorn import _config, _loop
from flashsinkhorn._multiscale_tiles import fit_potential, morton_codes, pair_bound, sort_clouds
from flashsinkhorn.multiscale import MultiscaleProblem
from flashsinkhorn.reference import damping_factor

D64 = torch.float64


def cloud(kind, n, d, gen, dtype=D64):
    """Point clouds of the families that stall clustering schemes."""
    if kind == "uniform":
        p = torch.rand(n, d, generator=gen, dtype=D64)
    elif kind == "clustered":  # a few tight blobs far apart
        k = 5
        c = torch.rand(k, d, generator=gen, dtype=D64) * 4
        lab = torch.randint(0, k, (n,), generator=gen)
        p = c[lab] + 0.01 * torch.randn(n, d, generator=gen, dtype=D64)
    elif kind == "anisotropic":  # a thin needle: 1 x 0.01 x ...
        scale = torch.tensor([1.0] + [0.01] * (d - 1), dtype=D64)
        p = torch.rand(n, d, generator=gen, dtype=D64) * scale
    elif kind == "duplicated":  # every point repeated (ties in the Morton order)
        base = torch.rand(max(1, n // 6), d, generator=gen, dtype=D64)
        p = base[torch.randint(0, base.shape[0], (n,), generator=gen)]
    elif kind == "sphere":
        p = torch.randn(n, d, generator=gen, dtype=D64)
        p = p / p.norm(dim=1, keepdim=True)
    else:
        raise ValueError(kind)
    return p.to(dtype)


def weights(n, gen, zeros=False, dtype=D64):
    w = torch.rand(n, generator=gen, dtype=D64) + 0.05
    if zeros:
        w[torch.rand(n, generator=gen) < 0.2] = 0.0
        w[0] = 1.0
    return (w / w.sum()).to(dtype)


def dense_truth(x, y, a, b, f, g, eps, s, rx=None, ry=None):
    """The marginal error of (f, g) from the dense float64 plan (the certificate's oracle):
    balanced ``|P 1 - a|_1 + |P^T 1 - b|_1``; unbalanced the residual of the optimality
    conditions in the same units (as flashsinkhorn.result.certificate)."""
    x, y, a, b, f, g = (t.to(D64) for t in (x, y, a, b, f, g))
    C = s * torch.cdist(x, y) ** 2
    P = a[:, None] * b[None, :] * torch.exp((f[:, None] + g[None, :] - C) / eps)
    out = 0.0
    for w, pot, marg, rho in ((a, f, P.sum(1), rx), (b, g, P.sum(0), ry)):
        k = damping_factor(eps, rho)
        pos = w > 0
        z = (1 - k) * pot[pos] / eps + k * torch.log(marg[pos] / w[pos])
        out += float((w[pos] * torch.expm1(z).abs()).sum())
    return out


def sinkhorn_dense(x, y, a, b, eps, s, n_iter, rx=None, ry=None):
    """Plain alternating log-domain Sinkhorn in float64 (potentials along the way)."""
    x, y, a, b = (t.to(D64) for t in (x, y, a, b))
    C = s * torch.cdist(x, y) ** 2
    f, g = torch.zeros_like(a), torch.zeros_like(b)
    kx, ky = damping_factor(eps, rx), damping_factor(eps, ry)
    la, lb = torch.log(a), torch.log(b)
    for _ in range(n_iter):
        f = -kx * eps * torch.logsumexp(lb[None, :] + (g[None, :] - C) / eps, 1)
        g = -ky * eps * torch.logsumexp(la[:, None] + (f[:, None] - C) / eps, 0)
    return f, g


# ----------------------------------------------------------------------------------------
# sorting, tiles, the bound
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["uniform", "clustered", "duplicated", "anisotropic"])
def test_sorted_cloud_tiles_cover_their_points(kind):
    gen = torch.Generator().manual_seed(1)
    n, T = 1000, _config.MULTISCALE_TILE
    x, y = cloud(kind, n, 3, gen), cloud("uniform", 130, 3, gen)
    xc, yc = sort_clouds(x, y, weights(n, gen, zeros=True), weights(130, gen))
    assert torch.equal(torch.sort(xc.order).values, torch.arange(n))
    assert torch.equal(xc.codes, morton_codes(x, xc.lo, xc.side, xc.bits))
    assert torch.equal(xc.pts, x[xc.order])
    v = torch.randn(n, 2, dtype=D64, generator=gen)
    assert torch.equal(xc.user_values(xc.sorted_values(v)), v)
    act = xc.active()
    P = xc.pts_pad.view(xc.K, T, 3)
    dist = (P - xc.center[:, None, :]).norm(dim=-1)
    assert bool((dist[act] <= xc.radius[:, None].expand_as(dist)[act] * (1 + 1e-12)).all())
    # every tree node's ball holds its tiles' balls
    for lvl in range(1, len(xc.tree)):
        c, r = xc.tree[lvl][0], xc.tree[lvl][1]
        parent = torch.arange(xc.K) // _config.MULTISCALE_GROUP**lvl
        reach = (xc.center - c[parent]).norm(dim=-1) + xc.radius
        assert bool((reach <= r[parent] * (1 + 1e-12) + 1e-15).all())


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["uniform", "clustered", "duplicated", "anisotropic", "sphere"]),
    n=st.integers(1, 300),
    m=st.integers(1, 300),
    d=st.integers(1, 4),
    amp=st.floats(1e-3, 10.0),
    s=st.sampled_from([0.5, 1.0, 3.0]),
)
def test_pair_bound_never_below_the_exponents(seed, kind, n, m, d, amp, s):
    """For every pair of nodes at every level of both trees, the bound is at least every
    exponent ``f_i + g_j - s |x_i - y_j|^2`` of their active points, whatever the
    potentials (smooth, or arbitrary noise)."""
    gen = torch.Generator().manual_seed(seed)
    x, y = cloud(kind, n, d, gen), cloud("uniform", m, d, gen) * 1.5
    xc, yc = sort_clouds(x, y, weights(n, gen, zeros=True), weights(m, gen, zeros=True))
    f = amp * torch.randn(n, dtype=D64, generator=gen) + (x**2).sum(1)
    g = amp * torch.randn(m, dtype=D64, generator=gen) - y[:, 0]
    fx = fit_potential(xc, xc.sorted_values(f))
    gy = fit_potential(yc, yc.sorted_values(g))
    T, G = _config.MULTISCALE_TILE, _config.MULTISCALE_GROUP
    E = xc.sorted_values(f)[:, None] + yc.sorted_values(g)[None, :]
    E = E - s * torch.cdist(xc.pts_pad, yc.pts_pad) ** 2
    mask = xc.active().reshape(-1)[:, None] & yc.active().reshape(-1)[None, :]
    E = torch.where(mask, E, torch.tensor(-math.inf, dtype=D64))
    for lx in range(len(xc.tree)):
        for ly in range(len(yc.tree)):
            kx, ky = xc.tree[lx][0].shape[0], yc.tree[ly][0].shape[0]
            i, j = torch.arange(kx).repeat_interleave(ky), torch.arange(ky).repeat(kx)
            bound = pair_bound(
                xc.tree[lx][0][i],
                xc.tree[lx][1][i],
                tuple(t[i] for t in fx[lx]),
                yc.tree[ly][0][j],
                yc.tree[ly][1][j],
                tuple(t[j] for t in gy[ly]),
                s,
            ).view(kx, ky)
            # the true maximum per node pair
            bx, by = T * G**lx, T * G**ly
            pad = (0, ky * by - E.shape[1], 0, kx * bx - E.shape[0])
            Ep = torch.nn.functional.pad(E, pad, value=-math.inf)
            true = Ep.view(kx, bx, ky, by).amax(dim=(1, 3))
            slack = 1e-9 * (1 + true.abs())
            ok = (bound >= true - slack) | (true == -math.inf)
            assert bool(ok.all()), (lx, ly, float((true - bound).max()))


# ----------------------------------------------------------------------------------------
# the passes
# ----------------------------------------------------------------------------------------


def _problem(x, y, a, b, s, backend, truncate=5.0):
    return MultiscaleProblem(
        X=x[None],
        Y=y[None],
        a=a[None],
        b=b[None],
        cx=a.new_zeros(1, a.shape[0]),
        cy=b.new_zeros(1, b.shape[0]),
        c2=2 * s,
        cost_scale=s,
        truncate=truncate,
        backend=backend,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_pass_without_truncation_is_the_dense_softmin(backend):
    gen = torch.Generator().manual_seed(2)
    n, m, d, s, eps = 333, 200, 3, 0.5, 0.003
    dt = D64 if backend == "torch" else torch.float32
    x, y = cloud("clustered", n, d, gen, dt), cloud("uniform", m, d, gen, dt)
    a, b = weights(n, gen, zeros=True, dtype=dt), weights(m, gen, dtype=dt)
    g = 0.05 * torch.randn(m, generator=gen, dtype=D64).to(dt)
    P = _problem(x, y, a, b, s, backend, truncate=None)
    f, lse2, vbar = P.sm_x(g[None], eps, damping=0.9, v=y[None], guess=torch.zeros(1, n, dtype=dt))
    ref, ref_v, ref_g = _dense_updates(x, y, a, b, f[0], g, eps, s, 0.9, D64)
    gn = P.sm_y(f, eps, guess=g[None])[0]
    if dt == D64:
        errs = [1e-13 * (1 + r.abs().max()) for r in (ref, ref_v, ref_g)]
    else:  # flash-attention's rule: at most twice plain torch's float32 error (+ rounding)
        t32 = _dense_updates(x, y, a, b, f[0], g, eps, s, 0.9, torch.float32)
        errs = [
            2 * (u.double() - r).abs().max() + 1e-6 * r.abs().max()
            for u, r in zip(t32, (ref, ref_v, ref_g))
        ]
    assert (f[0].double() - ref).abs().max() <= errs[0]
    assert (vbar[0].double() - ref_v).abs().max() <= errs[1]
    assert (gn[0].double() - ref_g).abs().max() <= errs[2]


def _dense_updates(x, y, a, b, f, g, eps, s, damping, dt):
    """Dense softmin updates and softmax average in dtype dt (float64: the oracle)."""
    x, y, a, b, f, g = (t.to(dt) for t in (x, y, a, b, f, g))
    C = s * torch.cdist(x, y) ** 2
    S = torch.log(b)[None, :] + (g[None, :] - C) / eps
    Sy = torch.log(a)[:, None] + (f[:, None] - C) / eps
    return (
        -damping * eps * torch.logsumexp(S, 1),
        torch.softmax(S, 1) @ y,
        -eps * torch.logsumexp(Sy, 0),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["uniform", "sphere", "anisotropic"])
def test_truncated_pass_is_close_to_the_dense_softmin(backend, kind):
    """Near the fixed point the skipped mass is below exp(-truncate^2 / 2) per row: the
    updates move by at most that times eps."""
    gen = torch.Generator().manual_seed(3)
    n, m, d, s, eps = 1500, 1200, 2, 0.5, 2e-4
    x, y = cloud(kind, n, d, gen), cloud(kind, m, d, gen) * 1.05
    a, b = weights(n, gen), weights(m, gen)
    f, g = sinkhorn_dense(x, y, a, b, eps, s, 12)
    dt = D64 if backend == "torch" else torch.float32
    P = _problem(x.to(dt), y.to(dt), a.to(dt), b.to(dt), s, backend)
    fn = P.sm_x(g[None].to(dt), eps, guess=f[None].to(dt))[0][0].double()
    C = s * torch.cdist(x, y) ** 2
    ref = -eps * torch.logsumexp(torch.log(b)[None, :] + (g[None, :] - C) / eps, 1)
    kept = P.pairs()[0] / (P.parts[0][0].K * P.parts[0][1].K)
    assert kept < 0.9  # the pass skipped something
    atol = eps * (2 * math.exp(-12.5) * 10 + (1e-12 if dt == D64 else 1e-3))
    assert (fn - ref).abs().max() <= atol


# ----------------------------------------------------------------------------------------
# the certificate
# ----------------------------------------------------------------------------------------

FAMILIES = ["uniform", "clustered", "anisotropic", "duplicated", "sphere"]


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("rho", [None, 0.3])
def test_certificate_is_an_upper_bound_of_the_dense_truth(kind, rho):
    gen = torch.Generator().manual_seed(4)
    n, m, d, s, eps = 600, 500, 3, 0.5, 1e-3 if kind != "clustered" else 2e-5
    x, y = cloud(kind, n, d, gen), cloud(kind, m, d, gen)
    y = y + 0.02
    a, b = weights(n, gen, zeros=kind == "duplicated"), weights(m, gen)
    P = _problem(x, y, a, b, s, "torch")
    for it in (2, 12):
        f, g = sinkhorn_dense(x, y, a, b, eps, s, it, rx=rho, ry=rho)
        for ff, gg in ((f, g), (f + 0.3 * eps * torch.randn(n, dtype=D64, generator=gen), g)):
            err = float(P.certificate(ff[None], gg[None], eps, rho, rho)[0])
            truth = dense_truth(x, y, a, b, ff, gg, eps, s, rho, rho)
            assert err >= truth
            assert err <= truth * (1 + 1e-6) + 4 * math.exp(-12.5) + 1e-12  # and tight


def test_certificate_with_heavy_truncation_stays_above_the_truth():
    """truncate=1 skips pairs of density up to exp(-1/2): the certificate is loose but
    never below the truth, and float32 potentials are measured as they are."""
    gen = torch.Generator().manual_seed(5)
    n, m, s, eps = 600, 500, 1.0, 5e-3
    x, y = cloud("uniform", n, 2, gen), cloud("uniform", m, 2, gen)
    a, b = weights(n, gen), weights(m, gen)
    f, g = sinkhorn_dense(x, y, a, b, eps, s, 20)
    for trunc in (1.0, 3.0, 5.0):
        P = _problem(x, y, a, b, s, "torch", truncate=trunc)
        f32, g32 = f.float().double(), g.float().double()
        err = float(P.certificate(f32[None].float(), g32[None].float(), eps, None, None)[0])
        assert err >= dense_truth(x, y, a, b, f32, g32, eps, s)


@needs_interpreter
def test_certificate_float64_triton_pass_is_the_torch_one():
    """The certificate's float64 Triton pass (scale read in float64, base-e exp) against the
    torch path: the same bound to float64 rounding."""
    gen = torch.Generator().manual_seed(9)
    n, m, s, eps = 400, 300, 0.5, 1e-3
    x, y = cloud("uniform", n, 3, gen), cloud("uniform", m, 3, gen)
    a, b = weights(n, gen), weights(m, gen)
    f, g = sinkhorn_dense(x, y, a, b, eps, s, 10)
    errs = [
        float(_problem(x, y, a, b, s, be).certificate(f[None], g[None], eps, None, None)[0])
        for be in ("torch", "triton")
    ]
    assert abs(errs[0] - errs[1]) <= 1e-12 * errs[0]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(FAMILIES),
    n=st.integers(1, 260),
    m=st.integers(1, 260),
    d=st.integers(1, 3),
    log_eps=st.floats(-9.0, 0.0),
    rho=st.sampled_from([None, 0.05, 2.0]),
    trunc=st.sampled_from([0.5, 2.0, 5.0]),
    noise=st.floats(0.0, 3.0),
)
def test_certificate_property(seed, kind, n, m, d, log_eps, rho, trunc, noise):
    """Random problems, temperatures, truncations and potentials (a few Sinkhorn
    iterations plus noise of up to 3 eps): the certificate is never below the truth."""
    gen = torch.Generator().manual_seed(seed)
    eps = math.exp(log_eps)
    x, y = cloud(kind, n, d, gen), cloud("uniform", m, d, gen)
    a, b = weights(n, gen, zeros=True), weights(m, gen, zeros=True)
    f, g = sinkhorn_dense(x, y, a, b, eps, 0.5, 3, rx=rho, ry=rho)
    f = f + noise * eps * torch.randn(n, dtype=D64, generator=gen)
    P = _problem(x, y, a, b, 0.5, "torch", truncate=trunc)
    err = float(P.certificate(f[None], g[None], eps, rho, rho)[0])
    truth = dense_truth(x, y, a, b, f, g, eps, 0.5, rho, rho)
    assert err >= truth or (math.isinf(err) and math.isinf(truth)) or math.isnan(truth)


# ----------------------------------------------------------------------------------------
# the ladder
# ----------------------------------------------------------------------------------------


def test_ladder_levels_cells_and_prolongation():
    gen = torch.Generator().manual_seed(6)
    n, m, s = 3000, 2500, 0.5
    x, y = cloud("uniform", n, 3, gen), cloud("sphere", m, 3, gen) * 0.4 + 0.5
    a, b = weights(n, gen), weights(m, gen, zeros=True)
    P = _problem(x, y, a, b, s, "torch")
    eps_list = [2.0, 0.5, 0.1, 0.02, 0.004, 0.001]
    levels = P.stage_levels(eps_list)
    assert levels[-1] == (0,)
    shifts = [k[0] for k in levels]
    assert shifts == sorted(shifts, reverse=True)
    for key in set(levels):
        Q = P.at_level(key)
        assert torch.allclose(Q.a.sum(-1), a.sum()[None])
        assert torch.allclose(Q.b.sum(-1), b.sum()[None])
        if key != (0,):  # centroids of the mass inside each cloud's hull
            assert Q.X.shape[1] < n
    # a coarse solution carried to the points is already a fair fine one
    coarse = [k for k in levels if k != (0,)][-1]
    Q = P.at_level(coarse)
    eps = 0.01
    f = torch.zeros(1, Q.X.shape[1], dtype=D64)
    g = torch.zeros(1, Q.Y.shape[1], dtype=D64)
    for _ in range(40):
        f = Q.sm_x(g, eps, guess=f)[0]
        g = Q.sm_y(f, eps, guess=g)[0]
    fp, gp = P.prolong(coarse, (0,), f, g, eps)
    err = float(P.certificate(fp, gp, eps, None, None)[0])
    zero = float(P.certificate(0 * fp, 0 * gp, eps, None, None)[0])
    assert math.isfinite(err) and err < 0.3 * zero


# ----------------------------------------------------------------------------------------
# the one loop on the ladder
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("rho", [None, 0.5])
def test_loop_on_the_ladder_reaches_the_dense_solution(rho):
    """The one loop (annealing on the cell ladder, then alternating iterations to a float64
    certified tolerance) on a batch of two problems: the potentials are certified below tol
    and the dual value is the dense float64 one."""
    gen = torch.Generator().manual_seed(7)
    n, m, s, eps, tol = 300, 260, 0.5, 4e-3, 1e-6
    xs = torch.stack([cloud("uniform", n, 2, gen), cloud("clustered", n, 2, gen) * 0.3])
    ys = torch.stack([cloud("sphere", m, 2, gen) * 0.4 + 0.5, cloud("uniform", m, 2, gen)])
    a = torch.stack([weights(n, gen), weights(n, gen, zeros=True)])
    b = torch.stack([weights(m, gen), weights(m, gen)])
    P = MultiscaleProblem(
        X=xs, Y=ys, a=a, b=b, cx=a * 0, cy=b * 0, c2=2 * s, cost_scale=s, backend="torch"
    )
    stages = _loop.annealing(P, eps, 0.5, None)
    levels = P.stage_levels((*stages, eps))
    assert len(set(levels)) > 2  # the annealing visits coarse levels
    sched = _loop.Schedule(
        eps=eps, stages=stages, rho_x=rho, rho_y=rho, max_iter=1500, tol=tol, check_every=10
    )
    out = _loop.run(P, sched, P.float64_certifier(eps, rho, rho))
    assert out.converged and bool((out.err < tol).all())
    for k in range(2):
        truth = dense_truth(xs[k], ys[k], a[k], b[k], out.f[k], out.g[k], eps, s, rho, rho)
        assert truth <= float(out.err[k])
        if rho is None:  # the dual value <a, f> + <b, g>, against the dense float64 solve
            ref = fs.solve(
                xs[k],
                ys[k],
                a[k],
                b[k],
                eps=eps,
                cost_scale=s,
                tol=1e-9,
                max_iter=5000,
                eps_scaling=0.5,
                backend="dense",
            )
            assert ref.converged
            v = (a[k] * out.f[k]).sum() + (b[k] * out.g[k]).sum()
            v_ref = (a[k] * ref.f).sum() + (b[k] * ref.g).sum()
            assert abs(float(v - v_ref)) <= 10 * tol * eps + 1e-12


# ----------------------------------------------------------------------------------------
# GPU: the Triton passes in float32 and float64 against the float64 torch path
# ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["uniform", "sphere", "clustered"])
def test_gpu_passes_and_certificate(kind):
    gen = torch.Generator().manual_seed(8)
    n, m, s, eps = 8000, 6000, 0.5, 1e-4
    x, y = cloud(kind, n, 3, gen), cloud(kind, m, 3, gen) * 1.02
    a, b = weights(n, gen, zeros=True), weights(m, gen)
    dev = torch.device("cuda")
    P64 = _problem(x, y, a, b, s, "torch")  # the float64 oracle (same tiles, same keep sets)
    P32 = _problem(*(t.float().to(dev) for t in (x, y, a, b)), s, "triton")
    f = torch.zeros(1, n, dtype=D64)
    g = torch.zeros(1, m, dtype=D64)
    # a few symmetric iterations on the oracle from its ladder's coarse start
    for e in (3e-3, 1e-3, 3e-4, 1e-4):
        ft, gt = P64.sym_update(f, g, e)
        f, g = 0.5 * (f + ft), 0.5 * (g + gt)
    ref_f, _, ref_v = P64.sm_x(g, eps, v=y[None], guess=f)
    ref_g = P64.sm_y(f, eps, guess=g)[0]
    got_f, _, got_v = P32.sm_x(
        g.float().to(dev), eps, v=y[None].float().to(dev), guess=f.float().to(dev)
    )
    got_g = P32.sm_y(f.float().to(dev), eps, guess=g.float().to(dev))[0]
    # float32: potentials of magnitude |f| carry 2^-24 |f| of rounding; exponents / eps
    tol_f = 8 * 2.0**-24 * (float(ref_f.abs().max()) + float(g.abs().max()) + 3 * s)
    assert (got_f.cpu().double() - ref_f).abs().max() <= tol_f
    assert (got_g.cpu().double() - ref_g).abs().max() <= tol_f
    assert (got_v.cpu().double() - ref_v).abs().max() <= 1e-4
    # the certificate on the GPU (the float64 Triton pass) against the CPU's
    err_gpu = float(P32.certificate(f.float().to(dev), g.float().to(dev), eps, None, None)[0])
    err_cpu = float(P64.certificate(f.float().double(), g.float().double(), eps, None, None)[0])
    assert abs(err_gpu - err_cpu) <= 1e-9 * err_cpu + 1e-12


# ----------------------------------------------------------------------------------------
# backend="multiscale" in solve and SamplesLoss, and backend="auto"
# ----------------------------------------------------------------------------------------


def needles(n, m, gen, dtype=D64):
    """Odd-sized clouds along a needle 3 x 0.3 x 0.1 (tiles of 64 points are short segments
    of it: at blur 0.1 most tile pairs are skipped), y a shifted sample of x's law."""
    scale = torch.tensor([3.0, 0.3, 0.1], dtype=D64)
    x = torch.rand(n, 3, generator=gen, dtype=D64) * scale
    y = torch.rand(m, 3, generator=gen, dtype=D64) * scale + 0.05
    return x.to(dtype), y.to(dtype)


def dense64(x, y, a, b, eps, rho, tol=1e-9):
    """The same problem solved densely in float64 (the reference), with its x-gradient."""
    xg = x.detach().double().requires_grad_(True)
    r = fs.solve(
        xg,
        y.double(),
        a.double(),
        b.double(),
        eps=eps,
        rho=rho,
        cost_scale=0.5,
        tol=tol,
        max_iter=20000,
        eps_scaling=0.5,
        backend="dense",
    )
    (gx,) = torch.autograd.grad(r.value, xg)
    assert r.converged
    return r, gx


@pytest.mark.parametrize("rho", [None, 0.5])
def test_solve_multiscale_against_the_float64_dense_solve(rho):
    """solve(backend="multiscale") of float64 clouds of odd sizes (zero weights included),
    balanced and unbalanced: converged, its certificate at least the dense float64 truth of
    the returned potentials and within 2 tau of it, and the value, potentials and gradient
    of the same problem solved densely in float64."""
    gen = torch.Generator().manual_seed(10)
    n, m, eps, tol = 203, 157, 0.01, 1e-4
    x, y = needles(n, m, gen)
    a, b = weights(n, gen, zeros=True), weights(m, gen)
    xg = x.clone().requires_grad_(True)
    r = fs.solve(
        xg,
        y,
        a,
        b,
        eps=eps,
        rho=rho,
        cost_scale=0.5,
        tol=tol,
        max_iter=2000,
        check_every=5,
        backend="multiscale",
    )
    (gx,) = torch.autograd.grad(r.value, xg)
    assert r.backend == "multiscale" and r.converged and float(r.marginal_error) < tol
    truth = dense_truth(x, y, a, b, r.f, r.g, eps, 0.5, rho, rho)
    err = float(r.marginal_error)
    assert truth <= err <= truth + 2 * math.exp(-(5.0**2) / 2) + 1e-12
    ref, gref = dense64(x, y, a, b, eps, rho)
    # a marginal error e moves the dual value by at most about e times the cost's range
    cmax = 0.5 * float(torch.cdist(x, y).max()) ** 2
    assert abs(float(r.value.detach()) - float(ref.value.detach())) <= 2 * tol * cmax
    df = (r.f - ref.f)[a > 0]
    if rho is None:  # balanced potentials are defined up to a constant (f + c, g - c)
        df = df - df.mean()
    assert float(df.abs().max()) <= 20 * tol * cmax
    assert float((gx - gref).abs().max()) <= 20 * tol * float(gref.abs().max()) + 1e-3 * tol


def test_solve_multiscale_unconverged_says_so():
    """Too few iterations for tol: converged is False, a warning says why, and the reported
    error (float32 clouds) is still at least the dense float64 truth."""
    gen = torch.Generator().manual_seed(13)
    x, y = needles(131, 97, gen, dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="not converged"):
        r = fs.solve(x, y, eps=0.01, cost_scale=0.5, tol=1e-9, max_iter=3, backend="multiscale")
    assert not r.converged and r.backend == "multiscale"
    a, b = torch.full((131,), 1 / 131, dtype=D64), torch.full((97,), 1 / 97, dtype=D64)
    assert dense_truth(x, y, a, b, r.f, r.g, 0.01, 0.5) <= float(r.marginal_error)


@pytest.mark.parametrize("reach", [None, 0.5])
def test_samples_loss_multiscale_against_the_float64_dense_loss(reach):
    """SamplesLoss(backend="multiscale", tol=...) of float64 clouds, balanced and unbalanced
    (``reach``; masses 1 and 1.3): the debiased value and gradients in the points and
    weights of the dense float64 loss iterated to the same tol, and (balanced) the double
    backward; without debias, the reported error bounds the dense float64 error of the
    returned potentials."""
    gen = torch.Generator().manual_seed(11)
    x, y = needles(181, 143, gen)
    a, b = weights(181, gen), torch.full((143,), 1 / 143, dtype=D64)
    if reach is not None:
        b = 1.3 * b
    blur, tol = 0.1, 1e-6
    out = []
    for backend in ("multiscale", "dense"):
        xg, ag = x.clone().requires_grad_(True), a.clone().requires_grad_(True)
        loss = fs.SamplesLoss(blur=blur, reach=reach, debias=True, backend=backend, tol=tol)
        v = loss(ag, xg, b, y)
        gx, ga = torch.autograd.grad(v, (xg, ag))
        terms = [gx, ga - ga.mean() if reach is None else ga]
        if reach is None:  # double backward (SamplesLoss has it for balanced problems)
            (gx2,) = torch.autograd.grad(loss(a, xg, b, y), xg, create_graph=True)
            terms.append(torch.autograd.grad((gx2**2).sum(), xg)[0])
        out.append((float(v.detach()), *terms))
    (v1, *d1), (v2, *d2) = out
    assert abs(v1 - v2) <= 1e-5 * abs(v2) + 1e-9
    for t1, t2 in zip(d1, d2):  # x-gradient, a-gradient (balanced: up to a constant), Hessian
        assert float((t1 - t2).abs().max()) <= 1e-4 * float(t2.abs().max())
    kw = dict(blur=blur, reach=reach, debias=False, backend="multiscale", potentials=True)
    loss = fs.SamplesLoss(**kw)
    F, G = loss(a, x, b, y)
    rho = None if reach is None else reach**2  # GeomLoss's reach for the cost |x - y|^2 / 2
    truth = dense_truth(x, y, a, b, F[0], G[0], blur**2, 0.5, rho, rho)
    assert truth <= float(loss.last_marginal_error)


def test_auto_picks_multiscale_by_its_rule(monkeypatch, capsys):
    """backend="auto" runs the multiscale problem for clouds of at most 3 coordinates and a
    kernel of width at most MULTISCALE_MAX_WIDTH of the diameter past the dense budget
    (CPU); wider kernels and 4 coordinates stay exact. The result records the choice and
    verbose=True prints the rule."""
    monkeypatch.setattr(_config, "DENSE_MAX_BYTES", 1 << 16)
    gen = torch.Generator().manual_seed(12)
    x, y = cloud("uniform", 201, 3, gen).float(), cloud("uniform", 150, 3, gen).float()
    r = fs.solve(x, y, eps=1e-3, cost_scale=0.5, tol=None, max_iter=2, verbose=True)
    assert r.backend == "multiscale"
    assert "backend multiscale (auto: 3-D clouds, kernel width" in capsys.readouterr().out
    r = fs.solve(x, y, eps=0.5, cost_scale=0.5, tol=None, max_iter=2)  # width 1 > diameter / 8
    assert r.backend == "streaming"
    x4, y4 = cloud("uniform", 201, 4, gen).float(), cloud("uniform", 150, 4, gen).float()
    assert fs.solve(x4, y4, eps=1e-3, tol=None, max_iter=2).backend == "streaming"
    loss = fs.SamplesLoss(blur=0.03, verbose=True)
    loss(x, y)
    assert "SamplesLoss: backend multiscale (auto:" in capsys.readouterr().out
    monkeypatch.setattr(_config, "DENSE_MAX_BYTES", 1 << 28)
    assert fs.solve(x, y, eps=1e-3, tol=None, max_iter=2).backend == "dense"


def test_multiscale_bad_input_names_the_argument():
    x, y = torch.rand(50, 9), torch.rand(40, 9)
    with pytest.raises(ValueError, match="at most 8 coordinates"):
        fs.solve(x, y, eps=0.1, backend="multiscale")
    x, y = torch.rand(50, 3), torch.rand(40, 3)
    with pytest.raises(ValueError, match="cost 'sqeuclidean' or 'cosine'"):
        fs.solve(x, y, eps=0.1, cost="dot", backend="multiscale")
    for kw, name in (
        (dict(truncate=-1.0), "truncate"),
        (dict(truncate="5"), "truncate"),
        (dict(cluster_scale=0.0), "cluster_scale"),
        (dict(cluster_scale=float("inf")), "cluster_scale"),
        (dict(tol=-1e-3), "tol"),
    ):
        with pytest.raises(ValueError, match=name):
            fs.SamplesLoss(backend="multiscale", **kw)
    with pytest.raises(ValueError, match="backend must be"):
        fs.SamplesLoss(backend="multiscal")
    with pytest.raises(NotImplementedError, match="process_group= or a ragged batch"):
        fs.solve([x, x[:7]], [y, y[:5]], eps=0.1, backend="multiscale")
    with pytest.raises(NotImplementedError, match="sample_plan"):
        fs.sample_plan(fs.solve(x, y, eps=0.1, backend="multiscale"), seed=0)
