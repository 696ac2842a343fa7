"""A small byte-level GPT with mHC residual streams, trained twice: the exact Birkhoff
projection against Sinkhorn-20, same seed, same batches.

    python packages/mhc-proj/examples/gpt_mhc.py --smoke --out /tmp/gpt   # CPU, seconds
    python packages/mhc-proj/examples/gpt_mhc.py --out OUT                # H200: ~1 min
    python packages/mhc-proj/examples/plot_gpt_mhc.py OUT/gpt_mhc.json OUT/gpt_mhc.png

Text: the Python standard library's own source (the ``.py`` files next to ``os.py``,
sorted by name, concatenated up to ``--text-bytes``), so it runs on a host without
network; the last 10% is the validation split. Every block wraps attention and the MLP
(each with its own RMSNorm) in :class:`mhc_proj.HyperConnection` with n = 4 streams; the
embedding is copied into the n streams, the output is their mean. The stream is bf16 on
CUDA (float32 on the CPU), the maps float32.

Recorded per step (JSON): the training loss; every ``--eval-every`` steps the validation
loss; and H_res's doubly-stochastic error over every token of every layer of the step
(the L1 marginal error of :func:`mhc_proj.marginal_error`): its max and median.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mhc_proj import HyperConnection, marginal_error


def stdlib_text(limit: int) -> bytes:
    root = Path(os.__file__).parent
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= limit:
            break
    return bytes(out[:limit])


class RMSNorm(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(c))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), eps=1e-6)


class Attention(torch.nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.norm, self.heads = RMSNorm(c), heads
        self.qkv = torch.nn.Linear(c, 3 * c, bias=False)
        self.proj = torch.nn.Linear(c, c, bias=False)

    def forward(self, y):
        b, s, c = y.shape
        q, k, v = self.qkv(self.norm(y)).view(b, s, 3, self.heads, c // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(o.transpose(1, 2).reshape(b, s, c))


class MLP(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = RMSNorm(c)
        self.up, self.down = (
            torch.nn.Linear(c, 4 * c, bias=False),
            torch.nn.Linear(4 * c, c, bias=False),
        )

    def forward(self, y):
        return self.down(F.gelu(self.up(self.norm(y))))


class GPT(torch.nn.Module):
    def __init__(self, c, layers, heads, seq, n, projection):
        super().__init__()
        self.n = n
        self.emb = torch.nn.Embedding(256, c)
        self.pos = torch.nn.Parameter(torch.randn(seq, c) * 0.02)
        hc = dict(hc=n, c=c, projection=projection)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(HyperConnection(Attention(c, heads), **hc))
            self.blocks.append(HyperConnection(MLP(c), **hc))
        self.norm = RMSNorm(c)
        self.head = torch.nn.Linear(c, 256, bias=False)

    def forward(self, idx, stream_dtype):
        h = self.emb(idx) + self.pos[: idx.shape[1]]
        x = h.to(stream_dtype).unsqueeze(-2).expand(*h.shape[:2], self.n, h.shape[-1])
        x = x.contiguous()
        errs = []
        for block in self.blocks:
            x, maps = block(x, return_maps=True)
            errs.append(marginal_error(maps.h_res.detach()).flatten())
        logits = self.head(self.norm(x.float().mean(-2)))
        return logits, torch.cat(errs)


def train(args, projection, data, val, device, stream_dtype):
    torch.manual_seed(args.seed)
    model = GPT(args.width, args.layers, args.heads, args.seq, args.streams, projection).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed + 1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def batch(src):
        starts = torch.randint(0, len(src) - args.seq - 1, (args.batch,), generator=gen)
        chunk = torch.stack([src[s : s + args.seq + 1] for s in starts]).to(device)
        return chunk[:, :-1], chunk[:, 1:]

    rec = {"loss": [], "val_step": [], "val_loss": [], "marginal_max": [], "marginal_median": []}
    losses, err_max, err_med = [], [], []
    t0 = time.time()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        lr *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        xb, yb = batch(data)
        with autocast:
            logits, errs = model(xb, stream_dtype)
        loss = F.cross_entropy(logits.float().view(-1, 256), yb.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())
        err_max.append(errs.max())
        err_med.append(errs.median())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with torch.no_grad(), autocast:
                vx, vy = batch(val)
                vl = F.cross_entropy(
                    model(vx, stream_dtype)[0].float().view(-1, 256), vy.reshape(-1)
                )
            rec["val_step"].append(step + 1)
            rec["val_loss"].append(vl.item())
            worst = torch.stack(err_max[-args.eval_every :]).max().item()
            print(f"  {projection:8s} step {step + 1:5d}  loss {loss.item():.4f}  "
                  f"val {vl.item():.4f}  H_res marginal max {worst:.2e}  "
                  f"({time.time() - t0:.1f} s)", flush=True)  # fmt: skip
    rec["loss"] = torch.stack(losses).tolist()
    rec["marginal_max"] = torch.stack(err_max).tolist()
    rec["marginal_median"] = torch.stack(err_med).tolist()
    rec["seconds"] = time.time() - t0
    rec["params"] = sum(p.numel() for p in model.parameters())
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpt_mhc_out", help="folder for gpt_mhc.json")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps (CPU CI)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--text-bytes", type=int, default=4 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--projections", nargs="+", default=["birkhoff", "sinkhorn"])
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.seq, args.width, args.layers, args.heads = 6, 4, 32, 32, 1, 2
        args.warmup, args.eval_every, args.text_bytes = 2, 3, 200_000
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    stream_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    text = torch.frombuffer(bytearray(stdlib_text(args.text_bytes)), dtype=torch.uint8).long()
    split = int(0.9 * len(text))
    data, val = text[:split], text[split:]
    print(f"gpt_mhc: {len(text)} bytes of stdlib source, {device}, stream {stream_dtype}")
    runs = {p: train(args, p, data, val, device, stream_dtype) for p in args.projections}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": name}
    doc = {"config": vars(args), "env": env, "text_bytes": len(text), "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpt_mhc.json").write_text(json.dumps(doc))
    print("\n| projection | final loss | final val | H_res marginal max (all steps) | s |")
    print("|---|---|---|---|---|")
    for p, r in runs.items():
        print(f"| {p} | {r['loss'][-1]:.4f} | {r['val_loss'][-1]:.4f} | "
              f"{max(r['marginal_max']):.2e} | {r['seconds']:.1f} |")  # fmt: skip
    return doc


if __name__ == "__main__":
    main()
