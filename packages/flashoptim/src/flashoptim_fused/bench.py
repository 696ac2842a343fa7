"""flashoptim-fused-bench: optimizer step time, bandwidth and bytes per parameter against peers.

    python -m flashoptim_fused.bench                     # GPU suite (CUDA): the headline cases
    python -m flashoptim_fused.bench --smoke             # tiny, CPU, seconds (CI)
    python -m flashoptim_fused.bench --layout large --providers ours torch-fused --json out.json

Cases (bench ``adamw`` / ``sgd`` / ``lion`` / ``muon``, mode ``step`` eager, ``graph``
replayed in a CUDA graph (``capturable=True``; torch.compile's mode="reduce-overhead" runs the step
outside its graphs: docs/design/flashoptim.md); ``muon_fused``: FlashMuon's two fused passes alone,
without the Newton-Schulz matmuls), each on a layout (Muon: its 2-D
tensors): ``large`` (8 x 8192^2 bf16, 537M params), ``small`` (2,050 tensors, 54.6M params),
``gpt`` (the parameter list of a 12-layer d=768 GPT). Providers: ``ours``; ``torch-fused``
(torch AdamW, fused, bf16 params: no master weights), ``torch-fused-fp32`` (fp32 params),
``flashoptim-0.1.4`` (the published flashoptim, loaded from its own folder under the name
``flashoptim_peer``: ``--peer-flashoptim-path DIR`` with DIR/flashoptim/__init__.py, default
the first such folder on sys.path that is not this package), ``bitsandbytes`` and
``torchao`` (AdamW8bit, bf16 params); ``torch-muon`` / ``torch-muon-fp32`` (torch.optim.Muon,
torch 2.9+, bf16 / fp32 params). ``frac_ceiling``: the bytes the step must move over the
device copy rate measured in the same process; ``frac_floor`` of a Muon step: its
Newton-Schulz FLOPs at the bf16 matmul rate measured in the same process, over its time.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

import flashoptim_fused as fo

from . import _harness as H
from . import grid

PROVIDERS = [
    "ours",
    "torch-fused",
    "torch-fused-fp32",
    "flashoptim-0.1.4",
    "bitsandbytes",
    "torchao",
    "torch-muon",
    "torch-muon-fp32",
]
MODES = ["step", "graph"]
LR = 1e-4
# bytes a step must move per parameter (read + write), bf16 parameters and gradients
_OURS_ADAMW = 2 + 2 + 1 + 1 + 1 + 0.125 + 2 + 1 + 1 + 1 + 0.125  # p, g, rho, m, v, scales
_OURS_MOM = 2 + 2 + 1 + 1 + 0.0625 + 2 + 1 + 1 + 0.0625  # p, g, rho, m, scale (SGD, Lion)
BYTES = {
    ("adamw", "ours", True): _OURS_ADAMW + 2,  # + the finiteness pre-pass's read of g
    ("adamw", "ours", False): _OURS_ADAMW,
    ("adamw", "torch-fused", True): 14.0,
    ("adamw", "torch-fused-fp32", True): 28.0,
    ("adamw", "flashoptim-0.1.4", True): _OURS_ADAMW,
    ("adamw", "bitsandbytes", True): 10.0,
    ("adamw", "torchao", True): 10.0,
    ("sgd", "ours", False): _OURS_MOM,
    ("sgd", "flashoptim-0.1.4", False): _OURS_MOM,
    ("lion", "ours", False): _OURS_MOM,
    # FlashMuon's passes over low-rank momenta: g, codes, scales, the old low-rank part
    # read, u written; then p, rho read and written, O read, and the momentum formed again
    # (g, codes, scales, old part) minus the new part, codes and scales written
    ("muon_fused", "ours", False): (2 + 1 + 0.0625 + 2 + 2)
    + (2 + 2 + 1 + 1 + 2 + 2 + 1 + 1 + 0.125 + 2 + 2),
}
# ours on a tensor whose rows hold under 32 elements (1-D ones: fp32 states, grid.py)
_FP32_STATES = {"adamw": 2 + 2 + 1 + 4 + 4 + 2 + 1 + 4 + 4, "sgd": 2 + 2 + 1 + 4 + 2 + 1 + 4}
_FP32_STATES["lion"] = _FP32_STATES["sgd"]
MUON_REPS = (1, 5)  # warm-up and timed steps of a Muon case (~0.2 s each at 537M)


def bytes_moved(bench: str, provider: str, check: bool, shapes) -> float | None:
    """Bytes a step must move over ``shapes``: ``BYTES`` per parameter; for ours, tensors
    whose rows hold under 32 elements keep fp32 states and move ``_FP32_STATES``."""
    per_param = BYTES.get((bench, provider, check))
    if per_param is None:
        return None
    total = 0.0
    for s in shapes:
        n = torch.Size(s).numel()
        quantized = grid.quantizable(torch.empty(s, device="meta"))
        if provider == "ours" and bench in _FP32_STATES and not quantized:
            total += (_FP32_STATES[bench] + 2 * (check and bench == "adamw")) * n
        else:
            total += per_param * n
    return total


def layout_shapes(name: str) -> list[tuple[int, ...]]:
    if name == "large":
        return [(8192, 8192)] * 8
    if name == "small":
        return [(128, 384)] * 1025 + [(4096,)] * 1025
    if name == "gpt":
        d, L, V = 768, 12, 50304
        per = [(d,), (d,), (3 * d, d), (d, d), (d,), (d,), (4 * d, d), (d, 4 * d)]
        return [(V, d), (1024, d)] + per * L + [(d,), (d,)]
    if name == "smoke":
        return [(64, 33), (1000,), (7,)]
    raise ValueError(f"unknown layout {name!r}")


def load_peer_flashoptim(path: str | None = None):
    """Import the peer flashoptim (same import name as ours) as ``flashoptim_peer``."""
    if "flashoptim_peer" in sys.modules:
        return sys.modules["flashoptim_peer"]
    ours = os.path.dirname(os.path.abspath(fo.__file__))
    for base in [path] if path else [p for p in sys.path if p]:
        init = os.path.join(base, "flashoptim", "__init__.py")
        if os.path.isfile(init) and os.path.dirname(os.path.abspath(init)) != ours:
            spec = importlib.util.spec_from_file_location(
                "flashoptim_peer", init, submodule_search_locations=[os.path.dirname(init)]
            )
            mod = importlib.util.module_from_spec(spec)
            sys.modules["flashoptim_peer"] = mod
            try:
                spec.loader.exec_module(mod)
            except Exception:
                del sys.modules["flashoptim_peer"]
                raise
            return mod
    return None


def make_optimizer(bench: str, provider: str, params, check: bool, graph: bool, peer_path=None):
    lr = LR
    if bench.startswith("muon"):
        if provider == "ours":
            return fo.FlashMuon(params, lr=0.02, check_finite=check)
        if not hasattr(torch.optim, "Muon"):
            raise H.Skip(f"torch {torch.__version__} has no torch.optim.Muon (2.9+)")
        return torch.optim.Muon(params, lr=0.02)
    if provider == "ours":
        if graph:  # a tensor lr on device, as an LR schedule needs under graph replay
            lr = torch.tensor(LR, dtype=torch.float64, device=params[0].device)
        kw = dict(lr=lr, check_finite=check, capturable=graph)
        if bench == "adamw":
            return fo.FlashAdamW(params, **kw)
        if bench == "sgd":
            return fo.FlashSGD(params, momentum=0.9, **kw)
        return fo.FlashLion(params, **kw)
    if provider.startswith("torch-fused"):
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if provider == "flashoptim-0.1.4":
        peer = load_peer_flashoptim(peer_path)
        if peer is None:
            raise H.Skip("flashoptim 0.1.4 not found (--peer-flashoptim-path)")
        if bench == "sgd":
            return peer.FlashSGD(params, lr=lr, momentum=0.9)
        return peer.FlashAdamW(params, lr=lr)
    try:
        if provider == "bitsandbytes":
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, lr=lr)
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=lr)
    except ImportError as e:
        raise H.Skip(f"not importable: {e}") from e


def _tuned_config() -> str | None:
    """The config the step kernel's autotuner picked for its latest launch (None: not tuned)."""
    from . import _step_kernel

    cfg = getattr(_step_kernel._step_kernel_tuned, "best_config", None)
    return None if cfg is None else f"{cfg.kwargs} warps={cfg.num_warps}"


def ns_flops(shapes, steps: int = 5) -> float:
    """FLOPs of Muon's Newton-Schulz on these matrices: per iteration on the wide (A, B),
    A <= B, orientation 2 A^2 B (X X^T) + 2 A^3 (S S) + 2 A^2 B (the update)."""
    total = 0.0
    for s in shapes:
        a, b = sorted((s[0], torch.Size(s[1:]).numel()))
        total += steps * (4 * a * a * b + 2 * a**3)
    return total


def matmul_ceiling_tflops(device: torch.device) -> float | None:
    """bf16 matmul rate (8192^3, TFLOP/s) measured here; None on a CPU."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = H.time_fn(lambda: a @ a, device, warmup=3, reps=10)["time_ms"]
    return 2 * 8192**3 / (t * 1e-3) / 1e12


def muon_fused_passes(opt) -> callable:
    """FlashMuon's two fused passes over every wave of its (cached) plan, without the
    orthogonalisation between them: the non-matmul part of the step, timed alone."""
    from . import _muon_kernel

    group = opt.param_groups[0]
    plan = opt._plans.get(id(group))
    if plan is None:
        raise H.Skip("the fused passes are the Triton path's (CUDA)")
    hp = opt._hp(group, plan["ps"][0])
    waves = plan["buckets"]
    dev = plan["ps"][0].device
    wss = [
        torch.zeros((3 if w["lowrank"] else 1) * w["ws_numel"], dtype=torch.bfloat16, device=dev)
        for w in waves
    ]

    def fn():
        for w, ws in zip(waves, wss):
            n = w["ws_numel"]
            lo, ln = (ws[n : 2 * n], ws[2 * n :]) if w["lowrank"] else (None, None)
            _muon_kernel.launch_momentum(w["ent"], ws[:n], lo, hp)
            _muon_kernel.launch_update(w["ent"], ws[:n], lo, ln, hp, 0x9E3779B9)

    return fn


def run_case(res, bench, mode, layout, provider, check, device, args, ceiling, headline=None):
    shapes = layout_shapes(layout)
    if bench.startswith("muon"):
        shapes = [s for s in shapes if len(s) == 2]
    n = sum(torch.Size(s).numel() for s in shapes)
    dtype = torch.float32 if provider.endswith("-fp32") else torch.bfloat16
    params = dict(layout=layout, n_params=n, n_tensors=len(shapes), check_finite=check)
    state: dict = {}

    def make():
        if mode == "graph" and device.type != "cuda":
            raise H.Skip("CUDA graphs: GPU only")
        if device.type == "cuda":
            torch.cuda.empty_cache()
            state["base"] = torch.cuda.memory_allocated(device)
        gen = torch.Generator(device=device).manual_seed(0)
        ps = [
            torch.nn.Parameter(torch.randn(s, device=device, generator=gen).to(dtype) * 0.02)
            for s in shapes
        ]
        for p in ps:
            p.grad = (torch.randn(p.shape, device=device, generator=gen) * 1e-3).to(dtype)
        graph = mode == "graph"  # capturable, a tensor lr
        opt = make_optimizer(bench, provider, ps, check, graph, args.peer_flashoptim_path)
        opt.step()  # allocates the states (and autotunes)
        state["opt"] = opt
        if device.type == "cuda":
            H.sync(device)
            state["held"] = torch.cuda.memory_allocated(device) - state["base"]
        if bench == "muon_fused":
            return muon_fused_passes(opt)
        return H.cuda_graph(opt.step, device) if mode == "graph" else opt.step

    def metrics():
        m = {}
        opt = state.pop("opt", None)
        if "held" in state:
            m["bytes_per_param"] = state["held"] / n  # params + grads + states, measured
        if isinstance(opt, fo.FlashOptimizer):
            m["bytes_per_param_counted"] = fo.memory_report(opt)["bytes_per_param"]
            if device.type == "cuda":
                m["tuned_config"] = _tuned_config()
        return m

    moved = bytes_moved(bench, provider, check, shapes)
    muon = bench == "muon"
    tflops = getattr(args, "matmul_tflops", None)
    row = res.run(
        bench,
        provider,
        mode,
        params,
        make,
        warmup=min(args.warmup, MUON_REPS[0]) if muon else args.warmup,
        reps=min(args.reps, MUON_REPS[1]) if muon else args.reps,
        bytes_moved=moved,
        floor_ms=ns_flops(shapes) / (tflops * 1e12) * 1e3 if muon and tflops else None,
        ceiling_gbps=ceiling,
        metrics=metrics,
        headline=headline if provider == "ours" else None,
    )
    state.clear()
    t = row["time_ms"]
    print(
        f"# {bench} {mode} {layout} check={check} {provider}: {row['status']} "
        f"{'' if t is None else f'{t:.3f} ms'} {row['error'] or ''}",
        flush=True,
    )
    return row


def cases(layouts, modes, providers, cuda: bool):
    """(bench, mode, layout, check_finite, providers of the case, headline label) of the
    suite, the headline rows first."""
    peers_adamw = [p for p in PROVIDERS[1:] if p in providers and "muon" not in p]
    out = []
    for lay in layouts:
        big = lay == "large"
        small_peers = [p for p in peers_adamw if p != "torchao"]  # torch.compile per shape
        label = {"large": "537M params (8 x 8192^2)", "small": "2,050 tensors (54.6M params)"}
        name = label.get(lay, lay)
        if "step" in modes:
            out.append(
                (
                    "adamw",
                    "step",
                    lay,
                    True,
                    peers_adamw if big else small_peers,
                    f"AdamW step, {name}",
                )
            )
            out.append(("adamw", "step", lay, False, [], None))
        if "graph" in modes and cuda:
            out.append(("adamw", "graph", lay, True, [], f"AdamW step, CUDA graph, {name}"))
        if "step" in modes and big:
            sgd_peers = [p for p in ("flashoptim-0.1.4",) if p in providers]
            out.append(("sgd", "step", lay, False, sgd_peers, f"SGD momentum step, {name}"))
            out.append(("lion", "step", lay, False, [], f"Lion step, {name}"))
        if "step" in modes and (big or lay == "smoke"):
            muon_peers = [p for p in ("torch-muon", "torch-muon-fp32") if p in providers]
            out.append(("muon", "step", lay, True, muon_peers, f"Muon step, {name}"))
            out.append(
                (
                    "muon_fused",
                    "step",
                    lay,
                    False,
                    [],
                    f"Muon fused passes (no Newton-Schulz), {name}",
                )
            )
    return out


def main(argv=None) -> int:
    ap = H.parser("flashoptim-fused-bench", __doc__.split("\n")[0], PROVIDERS, MODES)
    ap.add_argument("--layout", action="append", help="large, small, gpt, smoke (repeatable)")
    ap.add_argument("--peer-flashoptim-path", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cpu") if args.smoke else H.device_of(args)
    cuda = device.type == "cuda"
    layouts = args.layout or (["large", "small"] if cuda else ["smoke"])
    if args.smoke:
        layouts = args.layout or ["smoke"]
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    args.reps = args.reps if args.reps is not None else (20 if cuda else 3)
    res = H.Results("flashoptim", fo.__version__, device, peers=("bitsandbytes", "torchao"))
    try:
        peer = load_peer_flashoptim(args.peer_flashoptim_path)
    except Exception:  # recorded by its rows
        peer = None
    if peer is not None:
        res.env["peers"]["flashoptim"] = getattr(peer, "__version__", "?")
    res.save(args.json)
    ceiling = H.copy_ceiling_gbps(device)
    res.env["copy_ceiling_gbps"] = ceiling
    plan = cases(layouts, args.mode, args.providers, cuda)
    if any(c[0] == "muon" for c in plan):
        args.matmul_tflops = matmul_ceiling_tflops(device)
        res.env["matmul_ceiling_tflops_bf16"] = args.matmul_tflops
    for bench, mode, lay, check, peers, headline in plan:
        if "ours" in args.providers:
            run_case(res, bench, mode, lay, "ours", check, device, args, ceiling, headline)
        for prov in peers:
            if device.type != "cuda" and not prov.startswith(("torch-fused", "torch-muon")):
                continue  # the other peers' optimizers are CUDA-only
            run_case(res, bench, mode, lay, prov, check, device, args, ceiling)
    print(H.markdown(res.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
