"""The paper's memory row at scale: a Llama-3.1-8B-shaped model (plain torch, the public
architecture numbers, random init, synthetic tokens, activation checkpointing) trained for a
few steps on one GPU with each optimizer configuration; peak memory, step time and the
checkpoint's size on disk. Each configuration runs in its own subprocess, so an OOM or a
crash in one loses none of the others.

    python tools/flashoptim/llama_memory.py --out $OUT              # 8B, one GPU
    python tools/flashoptim/llama_memory.py --size 1b --out $OUT    # Llama-3.2-1B shape
    python tools/flashoptim/llama_memory.py --smoke --out DIR       # CPU: 1B's shape, tiny

Configurations: ``torch_adamw_fp32`` (fp32 parameters = master weights, bf16 autocast,
fused AdamW: 16 bytes/param before activations; 8B needs ~128 GB: expected OOM on an 80 GB
H100), ``torch_adamw_bf16`` (bf16 parameters, fused AdamW, bf16 states: no master copy),
``flash_adamw`` (FlashAdamW on bf16 parameters), ``flash_adamw_release`` (FlashAdamW with
gradient release). Writes ``llama-memory.json`` and ``llama-memory.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CONFIGS = ["torch_adamw_fp32", "torch_adamw_bf16", "flash_adamw", "flash_adamw_release"]


@dataclass(frozen=True)
class Shape:
    """Llama architecture numbers (Meta's published configs)."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5


SHAPES = {
    # Llama-3.1-8B: 32 layers, d 4096, 32 heads (8 KV), SwiGLU 14336, vocab 128256: 8.03B
    "8b": Shape(dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    # Llama-3.2-1B: 16 layers, d 2048, 32 heads (8 KV), SwiGLU 8192, vocab 128256: 1.50B
    # (untied here, as 8B's head; Meta ties 1B's)
    "1b": Shape(dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256),
}
# the CPU form of the 1B shape: its layout (GQA 4:1, SwiGLU 4x), a few tiny layers
SMOKE = Shape(dim=64, layers=2, heads=4, kv_heads=1, ffn=256, vocab=512)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        ) * self.weight.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on (batch, heads, seq, head_dim), halves rotated (Llama's layout)."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)


class Block(torch.nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        hd = s.dim // s.heads
        self.s = s
        self.attn_norm = RMSNorm(s.dim, s.norm_eps)
        self.wq = torch.nn.Linear(s.dim, s.heads * hd, bias=False)
        self.wk = torch.nn.Linear(s.dim, s.kv_heads * hd, bias=False)
        self.wv = torch.nn.Linear(s.dim, s.kv_heads * hd, bias=False)
        self.wo = torch.nn.Linear(s.heads * hd, s.dim, bias=False)
        self.ffn_norm = RMSNorm(s.dim, s.norm_eps)
        self.w1 = torch.nn.Linear(s.dim, s.ffn, bias=False)
        self.w3 = torch.nn.Linear(s.dim, s.ffn, bias=False)
        self.w2 = torch.nn.Linear(s.ffn, s.dim, bias=False)

    def forward(self, x, cos, sin):
        s = self.s
        b, t, _ = x.shape
        hd = s.dim // s.heads
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, s.heads, hd).transpose(1, 2)
        k = self.wk(h).view(b, t, s.kv_heads, hd).transpose(1, 2)
        v = self.wv(h).view(b, t, s.kv_heads, hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = s.heads // s.kv_heads  # grouped-query attention: KV heads shared
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, s.dim))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(torch.nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        self.tok_embeddings = torch.nn.Embedding(s.vocab, s.dim)
        self.layers = torch.nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.dim, s.norm_eps)
        self.output = torch.nn.Linear(s.dim, s.vocab, bias=False)

    def forward(self, tokens):
        s = self.s
        t = tokens.shape[1]
        hd = s.dim // s.heads
        inv = 1.0 / s.rope_theta ** (torch.arange(0, hd, 2, device=tokens.device) / hd)
        ang = torch.arange(t, device=tokens.device)[:, None].float() * inv[None, :]
        cos, sin = ang.cos(), ang.sin()
        x = self.tok_embeddings(tokens)
        for layer in self.layers:  # activation checkpointing: one block's input kept
            x = checkpoint(layer, x, cos, sin, use_reentrant=False)
        return self.output(self.norm(x))


def init_(model: Llama, seed: int) -> None:
    """Random init (std 0.02; norms 1), generated on the model's device."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def run_one(config, shape: Shape, steps: int, seq: int, batch: int, save: bool, dev: str, result):
    """One configuration in this process: build, train ``steps`` steps, save, measure. The
    result is written to ``result`` before the checkpoint is saved too (a save that runs past
    the time limit keeps the step's numbers)."""
    import flashoptim_fused as fo

    if config not in CONFIGS:
        raise ValueError(f"config must be one of {CONFIGS}; got {config!r}")
    cuda = dev == "cuda"
    out = dict(config=config, status="ok")
    fp32 = config == "torch_adamw_fp32"
    with torch.device(dev):
        model = Llama(shape)
    if not fp32:
        model = model.bfloat16()
    init_(model, 0)
    out["params"] = _n_params(model)
    if config.startswith("torch"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1, fused=cuda)
    else:
        opt = fo.FlashAdamW(model.parameters(), lr=1e-5, weight_decay=0.1)
    if config == "flash_adamw_release":
        fo.enable_gradient_release(model, opt)
    g = torch.Generator(device=dev).manual_seed(1)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, shape.vocab, (batch, seq + 1), device=dev, generator=g)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=fp32):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        out["loss"] = float(loss)
        del logits, loss
    out["step_ms_all"] = [round(t * 1e3, 2) for t in times]
    out["step_ms"] = round(statistics.median(times[1:] if len(times) > 1 else times) * 1e3, 2)
    if cuda:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        out["device"] = torch.cuda.get_device_name()
    if save:
        Path(result).write_text(json.dumps(dict(out, ckpt="not finished")))
        with tempfile.TemporaryDirectory(dir=os.environ.get("LLAMA_CKPT_DIR")) as d:
            path = Path(d) / "ckpt.pt"
            t0 = time.perf_counter()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
            out["save_s"] = round(time.perf_counter() - t0, 1)
            out["ckpt_gib"] = round(path.stat().st_size / 2**30, 3)
            out["ckpt_bytes_per_param"] = round(path.stat().st_size / out["params"], 3)
    return out


def _child(args) -> int:
    shape = _shape(args)
    try:
        save = not args.no_save
        res = run_one(
            args.one, shape, args.steps, args.seq, args.batch, save, args.dev, args.result
        )
    except torch.cuda.OutOfMemoryError as e:
        res = dict(config=args.one, status="OOM", error=str(e).splitlines()[0][:300])
        if torch.cuda.is_available():
            res["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    Path(args.result).write_text(json.dumps(res))
    return 0


def _shape(args) -> Shape:
    s = SMOKE if args.smoke else SHAPES[args.size]
    if args.layers:
        s = replace(s, layers=args.layers)
    return s


def table(rows: list, meta: dict) -> str:
    """The markdown table of a run (ratios to torch AdamW on bf16 parameters)."""
    base = next((r for r in rows if r["config"] == "torch_adamw_bf16" and r["status"] == "ok"), {})
    lines = [
        f"{meta['shape']} ({meta['params'] / 1e9:.2f}B params), {meta['device']}, batch"
        f" {meta['batch']} x seq {meta['seq']}, {meta['steps']} steps, activation checkpointing",
        "",
        "| configuration | status | peak GiB | step ms | checkpoint GiB | ckpt B/param |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:

        def cell(k, r=r):
            v = r.get(k)
            if v is None:
                return "—"
            if base.get(k) and k in ("peak_gib", "step_ms", "ckpt_gib") and r is not base:
                return f"{v} ({v / base[k]:.2f}x)"
            return str(v)

        lines.append(
            f"| {r['config']} | {r['status']} | {cell('peak_gib')} | {cell('step_ms')} |"
            f" {cell('ckpt_gib')} | {cell('ckpt_bytes_per_param')} |"
        )
    lines.append("")
    lines.append("(ratios: to torch_adamw_bf16)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--smoke", action="store_true", help="CPU: the 1B layout, tiny")
    ap.add_argument("--layers", type=int, default=0, help="override the layer count")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--no-save", action="store_true", help="skip the checkpoint size")
    ap.add_argument("--timeout", type=int, default=110, help="seconds per configuration")
    ap.add_argument("--out", default=".")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--dev", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.seq, args.size = min(args.seq, 32), "1b"
    if args.one:
        return _child(args)
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = _shape(args)
    rows = []
    for config in args.configs.split(","):
        res_path = out / f"llama-{config}.json"
        res_path.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--one", config, "--result", str(res_path)]
        cmd += ["--dev", dev, "--size", args.size, "--steps", str(args.steps)]
        cmd += ["--seq", str(args.seq), "--batch", str(args.batch)]
        cmd += ["--layers", str(args.layers)] + (["--smoke"] if args.smoke else [])
        cmd += ["--no-save"] if args.no_save else []
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
            rc, tail = p.returncode, (p.stdout + p.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", ""
        if res_path.exists():
            r = json.loads(res_path.read_text())
        else:
            r = dict(config=config, status=f"crashed (rc {rc})", log_tail=tail)
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "log_tail"}), flush=True)
    params = next((r["params"] for r in rows if "params" in r), 0)
    if not params:
        with torch.device("meta"):
            params = _n_params(Llama(shape))
    meta = dict(
        shape=f"llama-{args.size}" + ("-smoke" if args.smoke else ""),
        arch=asdict(shape),
        params=params,
        device=next((r["device"] for r in rows if "device" in r), dev),
        torch=torch.__version__,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    (out / "llama-memory.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = table(rows, meta)
    (out / "llama-memory.md").write_text(md + "\n")
    print(md)
    ok = all(r["status"] in ("ok", "OOM") for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
