"""A GPT block stack with mHC residual streams (n = 4), trained in bf16 autocast twice with
the same seed and batches: the exact Birkhoff projection against Sinkhorn-20.

    python packages/mhc-proj/examples/gpt_mhc.py --smoke --out /tmp/gpt      # CPU, seconds
    python packages/mhc-proj/examples/gpt_mhc.py --out OUT --time-budget 180 # GPU, GPT-2 small
    python packages/mhc-proj/examples/plot_gpt_mhc.py OUT/gpt_mhc.json OUT/gpt_mhc.png

The default size is GPT-2 small's block stack (12 blocks, width 768, 12 heads, 4x MLP,
sequences of 512 bytes, 16 sequences a step): 24 hyper-connections, each wrapping one
attention or MLP sublayer (with its own RMSNorm). The embedding is copied into the n
streams, the output is their mean. Parameters are float32, every step runs under
``torch.autocast(dtype=bfloat16)`` (on the CPU too), the residual stream is bf16 on CUDA
(float32 on the CPU; ``--stream``). ``--time-budget S`` fits the two runs into about S
seconds of training: a few timed calibration steps fix the step count (the same for both
runs: the learning-rate schedule needs it up front).

Text: the Python standard library's own source (the ``.py`` files under the folder of
``os.py``, site-packages left out, sorted, concatenated up to ``--text-bytes``), so it
runs on a host without network; the last 10% is the validation split.

Recorded per step (JSON): the training loss; every ``--eval-every`` steps the validation
loss; and H_res's doubly-stochastic error over every token of every layer of the step (the
L1 marginal error of :func:`mhc_proj.marginal_error`): its max and median.
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
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            out += path.read_bytes()
        except OSError:
            continue
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
        self.up = torch.nn.Linear(c, 4 * c, bias=False)
        self.down = torch.nn.Linear(4 * c, c, bias=False)

    def forward(self, y):
        return self.down(F.gelu(self.up(self.norm(y))))


class GPT(torch.nn.Module):
    def __init__(self, c, layers, heads, seq, n, projection):
        super().__init__()
        self.n = n
        self.emb = torch.nn.Embedding(256, c)
        self.pos = torch.nn.Parameter(torch.randn(seq, c) * 0.02)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            for sub in (Attention(c, heads), MLP(c)):
                self.blocks.append(HyperConnection(sub, hc=n, c=c, projection=projection))
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


class Trainer:
    """One run: the model, AdamW, the batches (its own generator: every run sees the same
    ones) and the step."""

    def __init__(self, args, projection, device, stream_dtype):
        torch.manual_seed(args.seed)
        self.args, self.device, self.stream_dtype = args, device, stream_dtype
        self.model = GPT(args.width, args.layers, args.heads, args.seq, args.streams, projection)
        self.model.to(device)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95)
        )
        self.gen = torch.Generator().manual_seed(args.seed + 1)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.autocast)

    def batch(self, src):
        a = self.args
        starts = torch.randint(0, len(src) - a.seq - 1, (a.batch,), generator=self.gen)
        chunk = torch.stack([src[s : s + a.seq + 1] for s in starts]).to(self.device)
        return chunk[:, :-1], chunk[:, 1:]

    def step(self, data, lr):
        for g in self.opt.param_groups:
            g["lr"] = lr
        xb, yb = self.batch(data)
        with self.autocast():
            logits, errs = self.model(xb, self.stream_dtype)
        loss = F.cross_entropy(logits.float().view(-1, 256), yb.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.detach(), errs

    def val_loss(self, val):
        with torch.no_grad(), self.autocast():
            vx, vy = self.batch(val)
            logits = self.model(vx, self.stream_dtype)[0]
            return F.cross_entropy(logits.float().view(-1, 256), vy.reshape(-1)).item()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrate_steps(args, projection, data, device, stream_dtype) -> tuple[int, float]:
    """Steps that fit both runs into --time-budget seconds, from 3 timed steps (after 2
    warm-up steps) of a throwaway model."""
    tr = Trainer(args, projection, device, stream_dtype)
    for _ in range(2):
        tr.step(data, 0.0)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(3):
        tr.step(data, 0.0)
    _sync(device)
    per_step = (time.perf_counter() - t0) / 3
    runs = len(args.projections)
    # evaluation and the per-step bookkeeping: ~5% on top
    return max(20, int(args.time_budget / (runs * per_step * 1.05))), per_step


def train(args, projection, data, val, device, stream_dtype):
    tr = Trainer(args, projection, device, stream_dtype)
    rec = {"loss": [], "val_step": [], "val_loss": [], "marginal_max": [], "marginal_median": []}
    losses, err_max, err_med = [], [], []
    t0 = time.time()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        lr *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))
        loss, errs = tr.step(data, lr)
        losses.append(loss)
        err_max.append(errs.max())
        err_med.append(errs.median())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            vl = tr.val_loss(val)
            rec["val_step"].append(step + 1)
            rec["val_loss"].append(vl)
            worst = torch.stack(err_max[-args.eval_every :]).max().item()
            print(
                f"  {projection:8s} step {step + 1:5d}  loss {loss.item():.4f}  val {vl:.4f}  "
                f"H_res marginal max {worst:.2e}  ({time.time() - t0:.1f} s)",
                flush=True,
            )
    rec["loss"] = torch.stack(losses).tolist()
    rec["marginal_max"] = torch.stack(err_max).tolist()
    rec["marginal_median"] = torch.stack(err_med).tolist()
    rec["seconds"] = time.time() - t0
    rec["params"] = sum(p.numel() for p in tr.model.parameters())
    if device.type == "cuda":
        rec["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpt_mhc_out", help="folder for gpt_mhc.json")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps (CPU CI)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds of training for all runs together: sets --steps",
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--text-bytes", type=int, default=16 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument(
        "--stream",
        choices=["bf16", "fp32"],
        default=None,
        help="the residual stream's dtype (default: bf16 on CUDA, fp32 on CPU)",
    )
    ap.add_argument("--no-autocast", dest="autocast", action="store_false")
    ap.add_argument("--projections", nargs="+", default=["birkhoff", "sinkhorn"])
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.seq, args.width, args.layers, args.heads = 8, 4, 32, 32, 1, 2
        args.warmup, args.eval_every, args.text_bytes, args.lr = 2, 4, 200_000, 5e-3
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.stream is None:
        args.stream = "bf16" if device.type == "cuda" else "fp32"
    stream_dtype = torch.bfloat16 if args.stream == "bf16" else torch.float32
    text = torch.frombuffer(bytearray(stdlib_text(args.text_bytes)), dtype=torch.uint8).long()
    split = int(0.9 * len(text))
    data, val = text[:split], text[split:]
    print(
        f"gpt_mhc: {len(text)} bytes of stdlib source, {device}, stream {stream_dtype}, "
        f"autocast bf16 {args.autocast}",
        flush=True,
    )
    calibration = None
    if args.time_budget is not None:
        args.steps, per_step = calibrate_steps(
            args, args.projections[0], data, device, stream_dtype
        )
        calibration = {"seconds_per_step": per_step, "steps": args.steps}
        print(f"  calibration: {per_step * 1e3:.1f} ms per step -> {args.steps} steps per run")
    runs = {p: train(args, p, data, val, device, stream_dtype) for p in args.projections}
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else (platform.processor() or "cpu")
    )
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": name}
    doc = {"config": vars(args), "env": env, "text_bytes": len(text), "runs": runs}
    if calibration:
        doc["calibration"] = calibration
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpt_mhc.json").write_text(json.dumps(doc))
    print("\n| projection | steps | final loss | final val | H_res marginal max (all steps) | s |")
    print("|---|---|---|---|---|---|")
    for p, r in runs.items():
        print(
            f"| {p} | {len(r['loss'])} | {r['loss'][-1]:.4f} | {r['val_loss'][-1]:.4f} | "
            f"{max(r['marginal_max']):.2e} | {r['seconds']:.1f} |"
        )
    return doc


if __name__ == "__main__":
    main()
