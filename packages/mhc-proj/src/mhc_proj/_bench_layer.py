"""The hyper-connection benches of mhc-proj-bench (``bench.py`` runs them).

- ``hc_layer``: the whole layer around an identity sublayer (so only the mHC work is
  timed), bf16 stream (B, S, n, C) = (8, 4096, 4, 7168) by default, LigerMHC's init (phi
  N(0, 0.02^2), alphas 1, biases 0; logits of std ~3.4): ``ours``
  (:class:`mhc_proj.HyperConnection`, exact projection), ``liger-kernel`` (``LigerMHC``,
  Sinkhorn-20, phi in bf16; skipped when not importable) and ``torch-compile``
  (``torch.compile`` of :func:`mhc_proj.reference.hyper_connection_ref` with a bf16 GEMM,
  float32 maps and Sinkhorn-20), all in one case; ``ours`` with Sinkhorn-20 is its own
  case (params ``projection: sinkhorn20``). Modes ``fwd`` and ``fwd_bwd``.
- ``hc_kernels``: the fused kernels alone on saved inputs (provider ``ours``): ``pre``
  (sum of squares, maps, y = H_pre x), ``post`` (H_res x + H_post^T f), ``post_bwd``,
  ``pre_bwd`` (the stream gradient), and the stages around them (``pre_stage``: GEMM +
  pre + projection; ``pre_bwd_stage``: projection backward, reduce, the two GEMMs, the
  stream gradient). ``floor_ms`` is the ideal fused stage's bytes (docs/mhc-proj-layer.md)
  at the copy ceiling measured in the process; ``gbps`` the kernel's own bytes per time.
"""

from __future__ import annotations

import torch

from mhc_proj import _harness as H
from mhc_proj import layer as hc
from mhc_proj.reference import hyper_connection_ref

LAYER_PROVIDERS = ["ours", "liger-kernel", "torch-compile"]
KERNELS = ["pre", "post", "post_bwd", "pre_bwd", "pre_stage", "pre_bwd_stage"]
LAYER_SHAPE = (8, 4096, 4, 7168)  # B, S, n, C: 32K tokens
KERNEL_TOKENS, KERNEL_WIDTHS = 32768, (4096, 7168)
SMOKE_SHAPE = (2, 16, 4, 64)


def floor_bytes(stage: str, n: int, c: int, elem: int = 2) -> int:
    """HBM bytes per token of the ideal fused stage: every stream tensor read or written
    once (the maps, tens of bytes, left out)."""
    k = n * c
    per = {
        "pre": k + c,  # read x, write y
        "post": 2 * k + c,  # read x, f; write out
        "post_bwd": 2 * k + 2 * c,  # read g_out, x, f; write g_f
        "pre_bwd": 3 * k + c,  # read g_y, x, g_out; write g_x
    }
    per["fwd"] = per["pre"] + per["post"]
    per["bwd"] = per["post_bwd"] + per["pre_bwd"]
    per["fwd_bwd"] = per["fwd"] + per["bwd"]
    return elem * per[stage]


def kernel_bytes(kernel: str, n: int, c: int, elem: int = 2) -> int:
    """Bytes per token that our kernel itself moves (its streams plus its maps)."""
    k, m = n * c, n * n + 2 * n
    maps = 4 * (2 * n + n * n + 1)
    return {
        "pre": elem * (k + c) + 4 * 2 * m + maps,
        "post": elem * (2 * k + c) + maps,
        "post_bwd": elem * (2 * k + 2 * c) + maps,
        "pre_bwd": elem * (4 * k + c) + maps,  # g_out, g_y, the GEMM's share, x; g_x
    }.get(kernel)


def _floor_ms(nbytes_per_token: int, tokens: int, ceiling: float | None) -> float | None:
    return nbytes_per_token * tokens / (ceiling * 1e9) * 1e3 if ceiling else None


def _params(shape, projection=None):
    b, s, n, c = shape
    p = {"B": b, "S": s, "n": n, "C": c, "dtype": "bfloat16", "sublayer": "identity"}
    if projection:
        p["projection"] = projection
    return p


def _liger_layer(n, c, device):
    try:
        from liger_kernel.transformers import LigerMHC
    except ImportError as e:
        raise H.Skip(f"liger-kernel not importable: {e}") from e
    if device.type != "cuda":
        raise H.Skip("liger-kernel runs on CUDA only")
    layer = LigerMHC(torch.nn.Identity(), hc=n, c=c, phi_dtype=torch.bfloat16)
    return layer.to(device)


_compiled = {}


def _compiled_ref(n, c, device):
    """torch.compile of the reference layer as a bf16 training step writes it."""
    key = (n, c, device.type)
    if key not in _compiled:
        m = n * n + 2 * n
        phi = torch.nn.Parameter(torch.randn(n * c, m, device=device) * 0.02)
        b = torch.nn.Parameter(torch.zeros(m, device=device))
        al = [torch.nn.Parameter(torch.ones((), device=device)) for _ in range(3)]

        def layer(x):
            out = hyper_connection_ref(
                x,
                torch.nn.Identity(),
                phi,
                b,
                *al,
                projection="sinkhorn",
                dtype=torch.float32,
                gemm_dtype=torch.bfloat16,
            )
            return out.to(x.dtype)

        _compiled[key] = torch.compile(layer, dynamic=False)
    return _compiled[key]


def _layer_fn(provider, projection, n, c, device):
    if provider == "ours":
        from mhc_proj.nn import HyperConnection

        layer = HyperConnection(
            torch.nn.Identity(), hc=n, c=c, projection=projection, alpha_init=1.0, device=device
        )
        return layer
    if provider == "liger-kernel":
        return _liger_layer(n, c, device)
    return _compiled_ref(n, c, device)


def run_layer_case(R, provider, mode, shape, projection, device, ceiling, warmup, reps):
    b, s, n, c = shape
    tokens = b * s

    def make():
        fn = _layer_fn(
            provider, "sinkhorn" if projection == "sinkhorn20" else "birkhoff", n, c, device
        )
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(shape, device=device, generator=g).to(torch.bfloat16)
        if mode == "fwd":
            return lambda: fn(x)
        xg = x.clone().requires_grad_(True)
        gout = torch.randn(shape, device=device, generator=g).to(torch.bfloat16)
        return lambda: fn(xg).backward(gout)

    exact = provider == "ours" and projection is None
    headline = f"mHC layer {mode.replace('_', '+')}, {tokens // 1024}K tokens, C={c}, n={n}, bf16"
    return R.run(
        "hc_layer",
        provider,
        mode,
        _params(shape, projection),
        make,
        warmup=warmup if warmup is not None else 3,
        reps=reps if reps is not None else 10,
        bytes_moved=floor_bytes(mode, n, c) * tokens,
        ceiling_gbps=ceiling,
        floor_ms=_floor_ms(floor_bytes(mode, n, c), tokens, ceiling),
        headline=headline if exact and shape == LAYER_SHAPE else None,
    )


def _kernel_state(tokens, n, c, device):
    """Saved inputs of every kernel: a forward and the backward's intermediates."""
    g = torch.Generator(device=device).manual_seed(1)
    bf = torch.bfloat16
    m = n * n + 2 * n
    x = torch.randn(tokens, n, c, device=device, generator=g).to(bf)
    phi = torch.randn(n * c, m, device=device, generator=g) * 0.02
    alpha = torch.ones(3, device=device)
    bias = torch.zeros(m, device=device)
    args = (0, 20, 1e-6, 1e-6, 0.0, 2.0, False)  # layer.LayerOptions
    y, maps, h_res, _token, mix, inv_r, lres = hc._pre_forward(x, phi, alpha, bias, *args)
    rnd = lambda *sz: torch.randn(*sz, device=device, generator=g).to(bf)  # noqa: E731
    st = dict(
        x=x,
        phi=phi,
        alpha=alpha,
        bias=bias,
        args=args,
        y=y,
        maps=maps,
        h_res=h_res,
        mix=mix,
        inv_r=inv_r,
        lres=lres,
        f=rnd(tokens, c),
        g_out=rnd(tokens, n, c),
        g_y=rnd(tokens, c),
        gx=rnd(tokens, n, c),
        coef=torch.zeros(tokens, device=device),
    )
    st["g_maps"] = torch.randn(tokens, 2 * n, device=device, generator=g)
    st["g_hres"] = torch.randn(tokens, n, n, device=device, generator=g)
    return st


def _kernel_fn(kernel, st, n, c):
    """The call to time; every buffer whose pointer it launches with lives in ``st``."""
    x, tokens = st["x"], st["x"].shape[0]
    if kernel == "pre":
        y, maps, lres, inv_r = st["y"], st["maps"], st["lres"], st["inv_r"]
        ptrs = (
            x.data_ptr(),
            st["mix"].data_ptr(),
            st["mix"].shape[1] // (n * n + 2 * n),
            st["alpha"].data_ptr(),
            st["bias"].data_ptr(),
            y.data_ptr(),
            maps.data_ptr(),
            lres.data_ptr(),
            inv_r.data_ptr(),
            tokens,
            n,
            c,
            2,
            1e-6,
            0.0,
            2.0,
        )
        return lambda: hc._launch("hc_pre_fwd", *ptrs, stream_of=x)
    if kernel == "post":
        return lambda: hc._post_forward(x, st["f"], st["maps"], st["h_res"])
    if kernel == "post_bwd":
        return lambda: hc._post_backward(st["g_out"], x, st["f"], st["maps"])
    if kernel == "pre_bwd":
        g_x = st.setdefault("g_x", torch.empty_like(x))  # kept alive: the launch has its pointer
        ptrs = (
            st["g_out"].data_ptr(),
            st["g_y"].data_ptr(),
            st["gx"].data_ptr(),
            x.data_ptr(),
            st["maps"].data_ptr(),
            st["h_res"].data_ptr(),
            st["coef"].data_ptr(),
            st["inv_r"].data_ptr(),
            g_x.data_ptr(),
            tokens,
            n,
            c,
            2,
        )
        return lambda: hc._launch("hc_pre_bwd", *ptrs, stream_of=x)
    if kernel == "pre_stage":
        return lambda: hc._pre_forward(x, st["phi"], st["alpha"], st["bias"], *st["args"])
    a = st["args"]
    return lambda: hc._pre_backward(
        st["g_y"],
        st["g_maps"],
        st["g_hres"],
        st["g_out"],
        x,
        st["phi"],
        st["alpha"],
        st["maps"],
        st["h_res"],
        st["mix"],
        st["inv_r"],
        st["lres"],
        a[0],
        a[1],
        a[2],
        a[4],
        a[5],
        a[6],
        True,
    )


_STAGE_OF = {"pre_stage": "pre", "pre_bwd_stage": "pre_bwd"}


def run_kernel_case(R, kernel, tokens, n, c, device, ceiling, warmup, reps, state):
    mode = "bwd" if "bwd" in kernel else "fwd"
    stage = _STAGE_OF.get(kernel, kernel)
    own = kernel_bytes(kernel, n, c)

    def make():
        if (tokens, n, c) not in state:
            state.clear()
            state[(tokens, n, c)] = _kernel_state(tokens, n, c, device)
        return _kernel_fn(kernel, state[(tokens, n, c)], n, c)

    headline = None
    if kernel in ("pre", "post", "post_bwd", "pre_bwd") and c == 7168:
        headline = f"mHC {kernel} kernel, 32K tokens, C=7168, n=4, bf16 (fraction of HBM floor)"
    params = {"kernel": kernel, "T": tokens, "n": n, "C": c, "dtype": "bfloat16"}
    return R.run(
        "hc_kernels",
        "ours",
        mode,
        params,
        make,
        warmup=warmup if warmup is not None else 3,
        reps=reps if reps is not None else 20,
        bytes_moved=own * tokens if own else None,
        ceiling_gbps=ceiling,
        floor_ms=_floor_ms(floor_bytes(stage, n, c), tokens, ceiling),
        headline=headline,
    )


def cases(providers, modes, smoke: bool) -> list[tuple]:
    """("hc_layer", provider, mode, shape, projection) and ("hc_kernels", kernel, T, n, C)."""
    shape = SMOKE_SHAPE if smoke else LAYER_SHAPE
    out = []
    for mode in ("fwd", "fwd_bwd"):
        if mode not in modes:
            continue
        for p in LAYER_PROVIDERS:
            # torch-compile: one compile (fwd+bwd graph, ~tens of seconds), not on a CPU
            if p == "torch-compile" and (smoke or mode != "fwd_bwd"):
                continue
            if p in providers:
                out.append(("hc_layer", p, mode, shape, None))
        if "ours" in providers:
            out.append(("hc_layer", "ours", mode, shape, "sinkhorn20"))
    if "ours" in providers:
        widths = (64,) if smoke else KERNEL_WIDTHS
        tokens = 32 if smoke else KERNEL_TOKENS
        for c in widths:
            out += [("hc_kernels", k, tokens, 4, c) for k in KERNELS]
    return out


def run(R, case, device, ceiling, warmup, reps, state):
    if case[0] == "hc_layer":
        _, p, mode, shape, proj = case
        return run_layer_case(R, p, mode, shape, proj, device, ceiling, warmup, reps)
    _, kernel, tokens, n, c = case
    return run_kernel_case(R, kernel, tokens, n, c, device, ceiling, warmup, reps, state)
