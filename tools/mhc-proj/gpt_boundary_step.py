"""A 12-layer GPT training step with mHC residual streams: the fused layer boundaries
(mhc_proj.HyperConnectionStack) against the same HyperConnection modules run one after
the other. Tokens per second (forward, backward and a fused AdamW step) and peak memory.

    python tools/mhc-proj/gpt_boundary_step.py --json OUT/gpt-step.json   # a GPU: ~30 s
    python tools/mhc-proj/gpt_boundary_step.py --smoke                    # CPU, seconds

Every block wraps attention and the MLP (each with its own RMSNorm) in a HyperConnection
(n = 4 streams, exact projection), so 12 layers are 24 hyper-connections and 23 fused
boundaries. bf16 stream, the sublayers under bf16 autocast, float32 parameters. Both
variants start from the same weights and batch; the first step's losses are compared
(they differ only by summation order).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mhc_proj import HyperConnection, hyper_connection_stack


def _example_module():
    # the sublayers are the GPT example's (packages/mhc-proj/examples is not a package)
    path = Path(__file__).resolve().parents[2] / "packages/mhc-proj/examples/gpt_mhc.py"
    spec = importlib.util.spec_from_file_location("gpt_mhc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_example = _example_module()
Attention, MLP, RMSNorm = _example.Attention, _example.MLP, _example.RMSNorm


class GPT(torch.nn.Module):
    def __init__(self, *, width, layers, heads, seq, streams, vocab=256):
        super().__init__()
        self.n = streams
        self.emb = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(torch.randn(seq, width) * 0.02)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(HyperConnection(Attention(width, heads), hc=streams, c=width))
            self.blocks.append(HyperConnection(MLP(width), hc=streams, c=width))
        self.norm = RMSNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, idx, *, fused, stream_dtype):
        h = self.emb(idx) + self.pos[: idx.shape[1]]
        x = h.to(stream_dtype).unsqueeze(-2).expand(*h.shape[:2], self.n, h.shape[-1])
        x = x.contiguous()
        if fused:
            x = hyper_connection_stack(x, list(self.blocks))
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(self.norm(x.float().mean(-2)))


def measure(model, fused, idx, target, args, device, stream_dtype):
    """(first loss, step times in ms, peak memory in MiB) of ``args.steps`` timed steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step():
        with autocast:
            logits = model(idx, fused=fused, stream_dtype=stream_dtype)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    first = float(step())
    for _ in range(args.warmup - 1):
        step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    return first, times, peak


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.heads, args.seq, args.batch = 2, 64, 4, 32, 2
        args.warmup, args.steps = 1, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    stream_dtype = torch.bfloat16
    torch.manual_seed(0)
    model = GPT(
        width=args.width, layers=args.layers, heads=args.heads, seq=args.seq, streams=args.streams
    ).to(device)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g).to(device)
    idx, target = idx[:, :-1], idx[:, 1:]
    tokens = args.batch * args.seq
    results = {}
    for name, fused in (("unfused", False), ("fused", True)):
        model.load_state_dict(state)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        first, times, peak = measure(model, fused, idx, target, args, device, stream_dtype)
        med = sorted(times)[len(times) // 2]
        results[name] = {
            "first_loss": first,
            "step_ms_median": med,
            "step_ms": times,
            "tokens_per_s": tokens / (med * 1e-3),
            "peak_mem_mib": peak,
        }
    f, u = results["fused"], results["unfused"]
    summary = {
        "speedup": u["step_ms_median"] / f["step_ms_median"],
        "first_loss_diff": abs(f["first_loss"] - u["first_loss"]),
    }
    if f["peak_mem_mib"] and u["peak_mem_mib"]:
        summary["peak_mem_ratio"] = f["peak_mem_mib"] / u["peak_mem_mib"]
    env = {"torch": torch.__version__, "python": platform.python_version()}
    env["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    doc = {"config": vars(args), "tokens_per_step": tokens, "env": env, "results": results}
    doc["summary"] = summary
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(
        f"GPT {args.layers} layers x 2 hyper-connections, width {args.width}, n = "
        f"{args.streams}, {tokens} tokens per step, {env['device']}"
    )
    print("| variant | step ms (median) | tokens/s | peak MiB | first loss |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        peak = f"{r['peak_mem_mib']:.0f}" if r["peak_mem_mib"] else "-"
        print(
            f"| {name} | {r['step_ms_median']:.2f} | {r['tokens_per_s']:.0f} | {peak} | "
            f"{r['first_loss']:.5f} |"
        )
    print(
        f"fused / unfused: {summary['speedup']:.3f}x faster; first-step loss difference "
        f"{summary['first_loss_diff']:.2e}"
    )
    return doc


if __name__ == "__main__":
    main()
