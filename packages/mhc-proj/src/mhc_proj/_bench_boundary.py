"""The fused-boundary benches of mhc-proj-bench (``bench.py`` runs them).

- ``hc_boundary``: one fused boundary alone (the ``mhc_proj::bnd_fwd`` op with both halves
  on, and its backward op ``bnd_bwd``) on saved inputs, T tokens of n = 4 bf16 streams,
  C = 4096 and 7168: ``frac_floor`` against its HBM floor (:func:`floor_bytes`, the copy
  ceiling measured in the same process), in the default and the deterministic mode
  (params ``deterministic``), at 32K tokens and at 2K (where the two modes split rows
  differently).
- ``hc_chain``: L = 2 and L = 4 hyper-connections with identity sublayers, forward +
  backward, bf16 stream (8, 4096, 4, C): ``ours`` (:class:`mhc_proj.HyperConnectionStack`,
  fused boundaries), ``ours-unfused`` (the same HyperConnection modules one after the
  other) and ``liger-kernel`` (a chain of ``LigerMHC``, Sinkhorn-20, phi in bf16). The
  difference of the L = 4 and L = 2 rows over 2 is the cost of one more boundary (unfused:
  one more layer), which :func:`summary` prints.
"""

from __future__ import annotations

import torch

from mhc_proj import _harness as H
from mhc_proj.birkhoff import birkhoff_project
from mhc_proj.boundary import HyperConnectionStack
from mhc_proj.nn import HyperConnection

CHAIN_PROVIDERS = ["ours", "ours-unfused", "liger-kernel"]
WIDTHS = (4096, 7168)
TOKENS, SMALL_TOKENS = 32768, 2048
CHAIN_SHAPE = (8, 4096)  # B, S: 32K tokens
SMOKE = dict(widths=(64,), tokens=64, small=32, shape=(2, 16))


def floor_bytes(part: str, n: int, c: int, elem: int = 2) -> int:
    """HBM bytes per token of the ideal kernels, every stream tensor read or written once:
    ``boundary_fwd`` reads x, f and writes x1, y; ``boundary_bwd`` reads dL/dx1, dL/dy, x, f
    and writes dL/dx, dL/df (x1 recomputed from x and f); ``first_*`` (the first layer's
    pre-mix) and ``last_*`` (the last layer's post-mix) likewise."""
    k = n * c
    per = {
        "boundary_fwd": 2 * k + 2 * c,
        "boundary_bwd": 3 * k + 3 * c,
        "first_fwd": k + c,
        "first_bwd": 2 * k + c,
        "last_fwd": 2 * k + c,
        "last_bwd": 3 * k + 2 * c,
    }
    return elem * per[part]


def chain_floor_bytes(layers: int, mode: str, n: int, c: int) -> int:
    """A chain of ``layers`` fused layers: the first pre-mix, layers - 1 boundaries, the
    last post-mix (``mode`` fwd or fwd_bwd)."""
    parts = ["fwd"] if mode == "fwd" else ["fwd", "bwd"]
    total = 0
    for p in parts:
        total += floor_bytes(f"first_{p}", n, c) + floor_bytes(f"last_{p}", n, c)
        total += (layers - 1) * floor_bytes(f"boundary_{p}", n, c)
    return total


def _floor_ms(nbytes: float, ceiling: float | None) -> float | None:
    return nbytes / (ceiling * 1e9) * 1e3 if ceiling else None


# ---------------------------------------------------------------- one boundary
def _boundary_inputs(tokens, n, c, device):
    g = torch.Generator(device=device).manual_seed(0)
    m = n * n + 2 * n
    bf = torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=g)

    st = dict(
        x=rnd(tokens, n, c).to(bf),
        f=rnd(tokens, c).to(bf),
        maps_prev=torch.sigmoid(rnd(tokens, 2 * n)),
        hres_prev=birkhoff_project(rnd(tokens, n, n)),
        phi=rnd(n * c, m) * 0.02,
        bias=torch.zeros(m, device=device),
        alpha=torch.ones(3, device=device),
    )
    st["g_next"], st["g_y"] = rnd(tokens, n, c).to(bf), rnd(tokens, c).to(bf)
    st["g_maps"], st["g_hres"] = rnd(tokens, 2 * n), rnd(tokens, n, n)
    return st


def run_boundary_case(R, mode, tokens, n, c, deterministic, device, ceiling, warmup, reps):
    opts = (0, 20, 1e-6, 1e-6, 0.0, 2.0, False, deterministic)

    def make():
        st = _boundary_inputs(tokens, n, c, device)
        args = (st["x"], st["f"], st["maps_prev"], st["hres_prev"], st["phi"], st["bias"])
        args = (*args, st["alpha"], True, True, *opts)
        fwd = torch.ops.mhc_proj.bnd_fwd
        if mode == "fwd":
            return lambda: fwd(*args)

        def step():
            x_next, _y, maps, h_res, mix, inv_r, lres = fwd(*args)
            grads = (st["g_next"], st["g_y"], st["g_maps"], st["g_hres"])
            saved = (st["x"], st["f"], st["maps_prev"], st["hres_prev"], x_next, st["phi"])
            saved = (*saved, st["alpha"], maps, h_res, mix, inv_r, lres)
            bwd_opts = (True, True, 0, 20, 1e-6, 0.0, 2.0, False, deterministic, True)
            return torch.ops.mhc_proj.bnd_bwd(*grads, *saved, *bwd_opts)

        return step

    nbytes = floor_bytes("boundary_fwd", n, c)
    if mode == "fwd_bwd":
        nbytes += floor_bytes("boundary_bwd", n, c)
    params = {"T": tokens, "n": n, "C": c, "dtype": "bfloat16", "deterministic": deterministic}
    headline = None
    if tokens == TOKENS and mode == "fwd_bwd" and not deterministic:
        headline = f"fused boundary fwd+bwd, 32K tokens, C={c}, n={n}, bf16"
    return R.run(
        "hc_boundary",
        "ours",
        mode,
        params,
        make,
        warmup=warmup if warmup is not None else 3,
        reps=reps if reps is not None else 10,
        bytes_moved=nbytes * tokens,
        ceiling_gbps=ceiling,
        floor_ms=_floor_ms(nbytes * tokens, ceiling),
        headline=headline,
    )


# ---------------------------------------------------------------- chains of layers
def _chain(provider, layers, n, c, device):
    if provider == "liger-kernel":
        try:
            from liger_kernel.transformers import LigerMHC
        except ImportError as e:
            raise H.Skip(f"liger-kernel not importable: {e}") from e
        if device.type != "cuda":
            raise H.Skip("liger-kernel runs on CUDA only")
        mods = [
            LigerMHC(torch.nn.Identity(), hc=n, c=c, phi_dtype=torch.bfloat16).to(device)
            for _ in range(layers)
        ]
    else:
        mods = [
            HyperConnection(torch.nn.Identity(), hc=n, c=c, alpha_init=1.0, device=device)
            for _ in range(layers)
        ]
    if provider == "ours":
        return HyperConnectionStack(mods)

    def chain(x):
        for m in mods:
            x = m(x)
        return x

    return chain


def run_chain_case(R, provider, layers, c, shape, device, ceiling, warmup, reps):
    b, s = shape
    n, tokens = 4, b * s

    def make():
        fn = _chain(provider, layers, n, c, device)
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(b, s, n, c, device=device, generator=g).to(torch.bfloat16)
        x.requires_grad_(True)
        gout = torch.randn(b, s, n, c, device=device, generator=g).to(torch.bfloat16)

        def step():
            x.grad = None
            fn(x).backward(gout)

        return step

    nbytes = chain_floor_bytes(layers, "fwd_bwd", n, c) * tokens
    params = {"B": b, "S": s, "n": n, "C": c, "L": layers, "dtype": "bfloat16"}
    params["sublayer"] = "identity"
    return R.run(
        "hc_chain",
        provider,
        "fwd_bwd",
        params,
        make,
        warmup=warmup if warmup is not None else 3,
        reps=reps if reps is not None else 10,
        bytes_moved=nbytes,
        ceiling_gbps=ceiling,
        floor_ms=_floor_ms(nbytes, ceiling),
    )


# ---------------------------------------------------------------- suite
def cases(providers, modes, smoke: bool) -> list[tuple]:
    """("hc_boundary", mode, T, n, C, deterministic) and ("hc_chain", provider, L, C, shape)."""
    widths = SMOKE["widths"] if smoke else WIDTHS
    tokens = SMOKE["tokens"] if smoke else TOKENS
    small = SMOKE["small"] if smoke else SMALL_TOKENS
    shape = SMOKE["shape"] if smoke else CHAIN_SHAPE
    out = []
    if "ours" in providers:
        for c in widths:
            for mode in ("fwd", "fwd_bwd"):
                if mode in modes:
                    out += [("hc_boundary", mode, tokens, 4, c, d) for d in (False, True)]
            if "fwd_bwd" in modes:
                out += [("hc_boundary", "fwd_bwd", small, 4, c, d) for d in (False, True)]
    if "fwd_bwd" in modes:
        for c in widths:
            for p in CHAIN_PROVIDERS:
                if p in providers:
                    out += [("hc_chain", p, layers, c, shape) for layers in (2, 4)]
    return out


def run(R, case, device, ceiling, warmup, reps):
    if case[0] == "hc_boundary":
        _, mode, tokens, n, c, det = case
        return run_boundary_case(R, mode, tokens, n, c, det, device, ceiling, warmup, reps)
    _, p, layers, c, shape = case
    return run_chain_case(R, p, layers, c, shape, device, ceiling, warmup, reps)


def summary(rows: list[dict]) -> str:
    """Per C: the cost of one more boundary ((L = 4) - (L = 2)) / 2 for each provider and
    ours' ratio to the others; the deterministic mode's cost; the boundary's floor share."""
    chain, bnd = {}, {}
    for r in rows:
        if r["status"] != "ok":
            continue
        p = r["params"]
        if r["bench"] == "hc_chain":
            chain[(r["provider"], p["C"], p["L"])] = r["time_ms"]
        elif r["bench"] == "hc_boundary":
            bnd[(r["mode"], p["T"], p["C"], p["deterministic"])] = r
    lines = [
        "| C | one more boundary: ours | ours-unfused | liger-kernel | unfused / ours "
        "| liger / ours |",
        "|" + "---|" * 6,
    ]
    for c in sorted({k[1] for k in chain}):
        per = {}
        for prov in CHAIN_PROVIDERS:
            if (prov, c, 2) in chain and (prov, c, 4) in chain:
                per[prov] = (chain[(prov, c, 4)] - chain[(prov, c, 2)]) / 2
        ours = per.get("ours")

        def ratio(p, ours=ours, per=per):
            return f"{per[p] / ours:.2f}x" if ours and p in per else "—"

        cells = [str(c)] + [H.fmt(per.get(p)) for p in CHAIN_PROVIDERS]
        lines.append(
            "| " + " | ".join(cells + [ratio("ours-unfused"), ratio("liger-kernel")]) + " |"
        )
    lines += ["", "| boundary | T | C | default ms | deterministic ms | cost | default of floor |"]
    lines.append("|" + "---|" * 7)
    for mode, t, c, det in sorted(bnd):
        if det or (mode, t, c, True) not in bnd:
            continue
        d, dd = bnd[(mode, t, c, False)], bnd[(mode, t, c, True)]
        cost = dd["time_ms"] / d["time_ms"] - 1
        frac = d["metrics"].get("frac_floor")
        cells = [mode, str(t), str(c), H.fmt(d["time_ms"]), H.fmt(dd["time_ms"]), f"{cost:+.1%}"]
        lines.append("| " + " | ".join(cells + [H.fmt(frac)]) + " |")
    return "\n".join(lines)
