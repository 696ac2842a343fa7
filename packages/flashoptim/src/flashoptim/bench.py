"""flashoptim-bench: optimizer step time, achieved bandwidth and bytes/param vs peers.

    python -m flashoptim.bench                    # GPU suite (CUDA): large + small layouts, ~2 min
    python -m flashoptim.bench --smoke            # tiny, CPU, seconds
    python -m flashoptim.bench --layout large --providers ours,torch_fused_fp32 --json out.json

Layouts: ``large`` (8 x 8192^2 bf16, 537M params), ``small`` (2,050 tensors, 54.6M params),
``gpt`` (the parameter list of a 12-layer d=768 GPT). The peer ``flashoptim 0.1.4`` has our
import name; it is loaded from its own folder under the name ``flashoptim_peer``
(``--peer-flashoptim-path DIR`` where DIR/flashoptim/__init__.py is the peer; default: the
first such folder on sys.path that is not this package).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import time

import torch

import flashoptim as fo

CEILING_TBPS = 4.21  # H200 device-to-device copy, read + write
GPU_PROVIDERS = [
    "ours",  # FlashAdamW, defaults (finiteness check on)
    "ours_nocheck",  # check_finite=False
    "ours_graph",  # capturable=True, the step captured in a CUDA graph and replayed
    "torch_fused_fp32",
    "torch_fused_bf16",
    "flashoptim_0.1.4",
    "ours_sgd",
    "flashoptim_0.1.4_sgd",
    "ours_lion",
    "bnb_adamw8bit",
    "torchao_adamw8bit",  # last: torch.compile on its first step
]
# bytes the step must move per parameter (read + write), bf16 params unless noted
MOVED = {
    "ours": 2 + 2 + 1 + 1 + 1 + 0.125 + 2 + 1 + 1 + 1 + 0.125 + 2,  # + grad finiteness read
    "ours_nocheck": 12.25,
    "torch_fused_fp32": 28.0,
    "torch_fused_bf16": 14.0,
    "torch_foreach_fp32": 28.0,
    "flashoptim_0.1.4": 12.25,
    "bnb_adamw8bit": 10.0,
    "torchao_adamw8bit": 10.0,
    # read p 2, g 2, rho 1, m 1, scale 1/16; write p 2, rho 1, m 1, scale 1/16
    "ours_sgd": 2 + 2 + 1 + 1 + 0.0625 + 2 + 1 + 1 + 0.0625,
    "flashoptim_0.1.4_sgd": 2 + 2 + 1 + 1 + 0.0625 + 2 + 1 + 1 + 0.0625,
    "ours_lion": 2 + 2 + 1 + 1 + 0.0625 + 2 + 1 + 1 + 0.0625,
}
MOVED["ours_graph"] = MOVED["ours"]  # same kernels (+ a few scalar ops), no host time


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
    cands = [path] if path else [p for p in sys.path if p]
    for base in cands:
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


def make_optimizer(provider: str, params, peer_path=None):
    lr = 1e-4
    if provider.startswith("ours"):
        return _make_ours(provider, params, lr)
    if provider.startswith("torch_fused"):
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if provider.startswith("torch_foreach"):
        return torch.optim.AdamW(params, lr=lr, foreach=True)
    if provider.startswith("flashoptim_0.1.4"):
        peer = load_peer_flashoptim(peer_path)
        if peer is None:
            raise ImportError("peer flashoptim 0.1.4 not found (--peer-flashoptim-path)")
        if provider.endswith("_sgd"):
            return peer.FlashSGD(params, lr=lr, momentum=0.9)
        return peer.FlashAdamW(params, lr=lr)
    if provider == "bnb_adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr)
    if provider == "torchao_adamw8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=lr)
    raise ValueError(f"unknown provider {provider!r}")


def _make_ours(provider, params, lr):
    if provider == "ours":
        return fo.FlashAdamW(params, lr=lr)
    if provider == "ours_nocheck":
        return fo.FlashAdamW(params, lr=lr, check_finite=False)
    if provider == "ours_graph":  # a tensor lr on device, as an LR schedule would need
        lr_t = torch.tensor(lr, dtype=torch.float64, device=params[0].device)
        return fo.FlashAdamW(params, lr=lr_t, capturable=True)
    if provider == "ours_sgd":
        return fo.FlashSGD(params, lr=lr, momentum=0.9, check_finite=False)
    if provider == "ours_lion":
        return fo.FlashLion(params, lr=lr, check_finite=False)
    raise ValueError(f"unknown provider {provider!r}")


def _tuned_config() -> str | None:
    """The config the step kernel's autotuner picked for its latest launch (None: not tuned)."""
    from . import _step_kernel

    cfg = getattr(_step_kernel._step_kernel_tuned, "best_config", None)
    if cfg is None:
        return None
    return f"{cfg.kwargs} warps={cfg.num_warps}"


def param_dtype(provider: str) -> torch.dtype:
    return torch.float32 if provider.endswith("fp32") else torch.bfloat16


def _timeit(fn, device, warmup, reps):
    for _ in range(warmup):
        fn()
    ts = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    q = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]
    return q(0.5), q(0.2), q(0.8)


class _Skip(Exception):
    pass


def _captured_step(opt):
    """Capture ``opt.step()`` (capturable, tables built by an eager step) in a CUDA graph
    after warm-up steps on a side stream (autotuning happens there); returns its replay.
    The timed replays keep stepping the same static gradients, as the eager rows do."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    opt._bench_graph = graph  # keep it (and its memory pool) alive with the optimizer
    return graph.replay


def bench_one(provider, layout, device, warmup, reps, peer_path=None) -> dict:
    shapes = layout_shapes(layout)
    dtype = param_dtype(provider)
    n = sum(torch.Size(s).numel() for s in shapes)
    res = dict(
        bench="optimizer_step",
        provider=provider,
        mode="step",
        params=dict(layout=layout, n_params=n, n_tensors=len(shapes), dtype=str(dtype)[6:]),
        status="ok",
        time_ms=None,
        time_ms_p20=None,
        time_ms_p80=None,
        metrics={},
        accuracy={},
        error=None,
    )
    params = opt = None
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
        gen = torch.Generator(device=device).manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(s, device=device, generator=gen).to(dtype) * 0.02)
            for s in shapes
        ]
        for p in params:
            p.grad = (torch.randn(p.shape, device=device, generator=gen) * 1e-3).to(dtype)
        if provider == "ours_graph" and device.type != "cuda":
            raise _Skip("CUDA graphs: GPU only")
        opt = make_optimizer(provider, params, peer_path)
        opt.step()  # allocates the states
        fn = opt.step
        if provider == "ours_graph":
            fn = _captured_step(opt)
        if device.type == "cuda":
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
        med, p20, p80 = _timeit(fn, device, warmup, reps)
        res.update(time_ms=med, time_ms_p20=p20, time_ms_p80=p80)
        moved = MOVED.get(provider)
        m = {"bytes_moved_per_param": moved}
        if moved is not None:
            gbps = moved * n / (med * 1e-3) / 1e9
            m.update(gbps=gbps, frac_ceiling=gbps / (CEILING_TBPS * 1e3))
        if device.type == "cuda":
            m["bytes_per_param"] = held / n  # params + grads + states, measured
            m["step_peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base - held) / 2**20
        if isinstance(opt, fo.FlashOptimizer):
            m["bytes_per_param_counted"] = fo.memory_report(opt)["bytes_per_param"]
            if device.type == "cuda":
                m["tuned_config"] = _tuned_config()
        res["metrics"] = m
    except ImportError as e:
        res.update(status="skipped", error=f"not importable: {e}")
    except _Skip as e:
        res.update(status="skipped", error=str(e))
    except Exception as e:  # report, keep going
        res.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
    finally:
        del params, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return res


def env_info() -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "flashoptim_path": os.path.dirname(fo.__file__),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    peers = {}
    for name, getter in [
        ("flashoptim", lambda: load_peer_flashoptim()),
        ("bitsandbytes", lambda: __import__("bitsandbytes")),
        ("torchao", lambda: __import__("torchao")),
    ]:
        try:
            mod = getter()
            if mod is not None:
                peers[name] = getattr(mod, "__version__", "?")
        except Exception:
            pass
    env["peers"] = peers
    return env


def markdown(results: list[dict]) -> str:
    lines = [
        "| layout | provider | step ms (p20-p80) | GB/s | frac ceiling | bytes/param | vs ours |",
        "|---|---|---|---|---|---|---|",
    ]
    ours = {
        r["params"]["layout"]: r["time_ms"]
        for r in results
        if r["provider"] == "ours" and r["status"] == "ok"
    }
    for r in results:
        lay = r["params"]["layout"]
        if r["status"] != "ok":
            lines.append(f"| {lay} | {r['provider']} | {r['status']}: {r['error'][:60]} | | | | |")
            continue
        m = r["metrics"]
        bpp = m.get("bytes_per_param", m.get("bytes_per_param_counted"))
        ratio = r["time_ms"] / ours[lay] if lay in ours else None
        lines.append(
            f"| {lay} | {r['provider']} | {r['time_ms']:.3f} ({r['time_ms_p20']:.3f}-"
            f"{r['time_ms_p80']:.3f}) | {m.get('gbps', 0):.0f} | {m.get('frac_ceiling', 0):.2f} | "
            f"{'' if bpp is None else f'{bpp:.3f}'} | {'' if ratio is None else f'{ratio:.2f}x'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="flashoptim-bench", description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (seconds)")
    ap.add_argument("--layout", action="append", help="large, small, gpt (repeatable)")
    ap.add_argument("--providers", help="comma-separated; default: all importable")
    ap.add_argument("--mode", default="step", choices=["step"])
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--json", help="write kernel-bench/1 JSON here")
    ap.add_argument("--peer-flashoptim-path", default=None)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if a.smoke or not cuda:
        layouts = a.layout or ["smoke"]
        providers = a.providers.split(",") if a.providers else ["ours", "torch_foreach_fp32"]
        warmup, reps = 1, a.reps or 3
    else:
        layouts = a.layout or ["large", "small"]
        providers = a.providers.split(",") if a.providers else GPU_PROVIDERS
        warmup, reps = 3, a.reps or 15
    results = []
    env = env_info()
    only_large = ("ours_sgd", "ours_lion", "flashoptim_0.1.4_sgd", "torchao_adamw8bit")
    for lay in layouts:
        for prov in providers:
            if lay != "large" and prov in only_large and not a.providers:
                continue  # SGD/Lion and torchao (compiles per shape) on the large layout only
            r = bench_one(prov, lay, device, warmup, reps, a.peer_flashoptim_path)
            results.append(r)
            cfg = r["metrics"].get("tuned_config")
            print(
                f"# {lay} {prov}: {r['status']} {r['time_ms']} ms {r['error'] or ''}"
                + (f" config {cfg}" if cfg else ""),
                flush=True,
            )
            if a.json:  # written after every row: a timeout keeps what was measured
                out = {
                    "schema": "kernel-bench/1",
                    "package": "flashoptim",
                    "package_version": fo.__version__,
                    "command": "python -m flashoptim.bench " + " ".join(argv or sys.argv[1:]),
                    "env": env,
                    "results": results,
                }
                with open(a.json, "w") as f:
                    json.dump(out, f, indent=1)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
