"""Training parity on a real run: a byte-level GPT on the Python standard library's sources.

    python -m flashoptim_fused.parity --out DIR    # GPU: ~25M params, 3 seeds x 2 optimizers
    python -m flashoptim_fused.parity --optimizers torch_muon,flash_muon --out DIR   # Muon
    python -m flashoptim_fused.parity --cpu --optimizers torch_muon,flash_muon --out DIR
                                                    # CPU, ~0.9M params, minutes per run
    python -m flashoptim_fused.parity --smoke --out DIR  # CPU, tiny model, seconds

FlashAdamW (defaults: bf16 weights, 24-bit master, companded 8-bit states) against
torch.optim.AdamW (fp32 weights, bf16 autocast, fused on CUDA), same init, data order and
schedule per seed; FlashMuon (Muon for the blocks' matrices, AdamW for embeddings, head,
norms and biases: ``muon.default_use_muon``) against torch.optim.Muon + torch.optim.AdamW
on the same split, both with Moonlight's ``adjust_lr_fn="match_rms_adamw"`` so the AdamW
learning rate and weight decay carry over. Writes ``parity.json`` (loss curves, final
losses, whole-step peak memory, tokens/s) and ``flashoptim-parity.png`` into DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import flashoptim_fused as fo
from flashoptim_fused.muon import default_use_muon


def load_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's .py files (sorted walk: the same on every host)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for d, dirs, files in os.walk(root):
        dirs.sort()
        if "site-packages" in d or "test" in os.path.basename(d):
            continue
        for f in sorted(files):
            if f.endswith(".py"):
                try:
                    b = open(os.path.join(d, f), "rb").read()
                except OSError:
                    continue
                chunks.append(b)
                total += len(b)
                if total >= max_bytes:
                    break
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, D // self.h).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d=512, layers=8, heads=8, ctx=256, vocab=256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def lr_schedule(opt, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the peak."""
    warm = max(1, steps // 20)
    return torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
        ),
    )


# FlashAdamW runs: the defaults, and variants that each change one thing (diagnostics:
# which part of the method a loss difference comes from)
FLASH_VARIANTS = {
    "flash_adamw": {},
    "flash_adamw_torch": {"backend": "torch"},  # the plain-torch path (same arithmetic)
    "flash_adamw_fp32_states": {"quantize": False},  # fp32 moments instead of 8-bit codes
    "flash_adamw_bits32": {"master_weight_bits": 32},  # int16 correction (lossless fp32)
    # the fp32 init rounded to bf16 with zero corrections (before load_master_weights): every
    # master starts on a bf16 value and updates under half an ulp stay invisible
    "flash_adamw_bf16_init": {"bf16_init": True},
}
# FlashMuon with fp32 states (``quantize=False``: the Muon momentum and the AdamW part's
# moments): the control that separates the 8-bit states from the bf16 weights and compute
OPTIMIZERS = ("torch_adamw", *FLASH_VARIANTS, "torch_muon", "flash_muon", "flash_muon_fp32_states")
# (peer, ours) pairs a verdict compares: summary key "verdict" (AdamW), "verdict_muon"
PAIRS = {"verdict": ("torch_adamw", "flash_adamw"), "verdict_muon": ("torch_muon", "flash_muon")}


# model and run sizes: "gpu" 25.6M parameters (600 steps, ~24 MB of text), "gpt2s" 127M
# (GPT-2 small's width and heads, 18 layers; 1,000 steps of 16 x 512 bytes), "cpu" 0.87M
# (400 steps, minutes per run on a CPU), "smoke" a tiny model for tests
CONFIGS = {
    "gpu": dict(d=512, layers=8, heads=8, ctx=256, batch=64, steps=600, lr=1e-3, val_batches=20),
    "gpt2s": dict(
        d=768, layers=18, heads=12, ctx=512, batch=16, steps=1000, lr=6e-4, val_batches=20
    ),
    "cpu": dict(d=128, layers=4, heads=4, ctx=64, batch=16, steps=400, lr=3e-3, val_batches=20),
    "smoke": dict(d=32, layers=1, heads=2, ctx=32, batch=8, steps=30, lr=3e-3, val_batches=2),
}


class _Both:
    """torch.optim.Muon for the matrices and torch.optim.AdamW for the rest, stepped as one."""

    def __init__(self, *opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def _optimizer(opt_name, model, cfg, device):
    """(optimizer, its LR schedulers' optimizers, autocast context) of a run."""
    hp = dict(lr=cfg["lr"], weight_decay=0.1)
    if opt_name.startswith("flash_"):
        masters = {p: p.detach().clone() for p in model.parameters()}
        model.to(torch.bfloat16)  # in place: the same parameter objects
        if opt_name in ("flash_muon", "flash_muon_fp32_states"):
            opt = fo.FlashMuon(
                model.named_parameters(),
                adjust_lr_fn="match_rms_adamw",
                adamw_betas=(0.9, 0.95),
                quantize=opt_name == "flash_muon",
                **hp,
            )
            bf16_init = False
        else:
            kw = dict(FLASH_VARIANTS[opt_name])
            bf16_init = kw.pop("bf16_init", False)
            opt = fo.FlashAdamW(model.parameters(), betas=(0.9, 0.95), **hp, **kw)
        if not bf16_init:  # the fp32 init stays the master weights (see load_master_weights)
            opt.load_master_weights(masters)
        return opt, [opt], contextlib.nullcontext()
    fused = {"fused": True} if device.type == "cuda" else {}
    # bf16 autocast on the CPU too: the flash runs compute in bf16 (their weights are
    # bf16), so an fp32 CPU baseline would credit torch with fp32 activations
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    if opt_name == "torch_muon":
        named = list(model.named_parameters())
        mats = [p for n, p in named if default_use_muon(n, p)]
        rest = [p for n, p in named if not default_use_muon(n, p)]
        muon = torch.optim.Muon(mats, adjust_lr_fn="match_rms_adamw", **hp)
        adamw = torch.optim.AdamW(rest, betas=(0.9, 0.95), **hp, **fused)
        return _Both(muon, adamw), [muon, adamw], autocast
    opt = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95), **hp, **fused)
    return opt, [opt], autocast


def run(opt_name, seed, cfg, data, device, make_optimizer=None) -> dict:
    """One training run. ``make_optimizer(opt_name, model, cfg, device)``: (optimizer, the
    optimizers its LR schedulers take, autocast context); default: the runs of
    ``OPTIMIZERS`` (other factories: the momentum-storage search of
    tools/flashoptim/momentum_quantizers.py)."""
    torch.manual_seed(seed)
    model = GPT(cfg["d"], cfg["layers"], cfg["heads"], cfg["ctx"]).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt, sched_opts, autocast = (make_optimizer or _optimizer)(opt_name, model, cfg, device)
    steps = cfg["steps"]
    scheds = [lr_schedule(o, steps) for o in sched_opts]
    train, val = data
    g = torch.Generator().manual_seed(1000 + seed)  # same data order for both optimizers
    B, T = cfg["batch"], cfg["ctx"]
    losses, peak, t_tok = [], 0, 0.0
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = None
    for s in range(steps):
        ix = torch.randint(0, train.numel() - T - 1, (B,), generator=g)
        xb = torch.stack([train[i : i + T + 1] for i in ix]).to(device, non_blocking=True)
        if s == 5:  # skip warm-up steps in the throughput
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        with autocast:
            logits = model(xb[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, 256), xb[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        for sched in scheds:
            sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    if t0 is not None:
        t_tok = (steps - 5) * B * T / (time.perf_counter() - t0)
    losses = [x.item() for x in losses]
    model.eval()
    gv = torch.Generator().manual_seed(7)
    vl = []
    with torch.no_grad(), autocast:
        for _ in range(cfg["val_batches"]):
            ix = torch.randint(0, val.numel() - T - 1, (B,), generator=gv)
            xb = torch.stack([val[i : i + T + 1] for i in ix]).to(device)
            vl.append(
                F.cross_entropy(
                    model(xb[:, :-1]).float().view(-1, 256), xb[:, 1:].reshape(-1)
                ).item()
            )
    mem = fo.memory_report(opt) if isinstance(opt, fo.FlashOptimizer) else None
    return dict(
        optimizer=opt_name,
        seed=seed,
        n_params=n_params,
        losses=losses,
        final_train_loss=sum(losses[-50:]) / len(losses[-50:]),
        val_loss=sum(vl) / len(vl),
        peak_mem_mib=peak / 2**20,
        tokens_per_s=t_tok,
        skipped_steps=getattr(opt, "skipped_steps", 0),
        memory_report=mem and {k: v for k, v in mem.items() if isinstance(v, (int, float))},
    )


def add_optimizers_option(ap: argparse.ArgumentParser, allowed) -> None:
    """``--optimizers``: the runs per seed (parse the value with ``parse_optimizers``)."""
    ap.add_argument(
        "--optimizers",
        default="torch_adamw,flash_adamw",
        help=f"comma-separated runs per seed, from {', '.join(allowed)}",
    )


def parse_optimizers(text: str, allowed) -> list[str]:
    """The ``--optimizers`` list: comma-separated names from ``allowed``, including both of
    at least one pair a verdict compares (``PAIRS`` within ``allowed``)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    pairs = [p for p in PAIRS.values() if set(p) <= set(allowed)]
    if any(n not in allowed for n in names) or not any(set(p) <= set(names) for p in pairs):
        need = " or ".join(" and ".join(p) for p in pairs)
        raise SystemExit(
            f"--optimizers must include {need} and name only {', '.join(allowed)}; got {text!r}"
        )
    return names


def summarize(runs: list[dict], peak_key: str) -> dict:
    """Per optimizer (in the order the runs name them), the lists over seeds of the final
    losses, peak memory (``peak_key``) and tokens/s; and per pair of ``PAIRS`` that ran the
    verdict: is our mean validation loss inside the torch optimizer's seed range."""
    summary = {}
    for name in dict.fromkeys(r["optimizer"] for r in runs):
        rs = [r for r in runs if r["optimizer"] == name]
        summary[name] = {
            k: [r[k] for r in rs]
            for k in ("final_train_loss", "val_loss", peak_key, "tokens_per_s")
        }
    mean = lambda x: sum(x) / len(x)
    for key, (peer, ours) in PAIRS.items():
        if peer not in summary or ours not in summary:
            continue
        ta, fa = summary[peer]["val_loss"], summary[ours]["val_loss"]
        summary[key] = {
            "torch_val_range": [min(ta), max(ta)],
            "flash_val_mean": mean(fa),
            "flash_mean_within_torch_range": min(ta) <= mean(fa) <= max(ta),
            "flash_minus_torch_val_mean": mean(fa) - mean(ta),
        }
    return summary


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {
        "flash_adamw": "tab:red",
        "torch_adamw": "tab:blue",
        "flash_muon": "tab:orange",
        "torch_muon": "tab:green",
        "flash_muon_fp32_states": "tab:purple",
    }
    for r in result["runs"]:
        ls = r["losses"]
        k = max(1, len(ls) // 100)
        sm = [sum(ls[i : i + k]) / len(ls[i : i + k]) for i in range(0, len(ls), k)]
        ax.plot(
            [i * k for i in range(len(sm))],
            sm,
            color=colors.get(r["optimizer"]),  # None: matplotlib's next color
            alpha=0.7,
            label=f"{r['optimizer']} seed {r['seed']}",
        )
    c = result["config"]
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/byte)")
    ax.set_title(
        f"byte-level GPT {result['runs'][0]['n_params'] / 1e6:.1f}M params, "
        f"{c['batch']}x{c['ctx']} tokens/step, {result['env'].get('gpu', 'cpu')}"
    )
    ax.legend(fontsize=7, ncol=2)
    v = result["summary"]
    lines = [
        f"val loss: {peer} "
        + ", ".join(f"{x:.3f}" for x in v[peer]["val_loss"])
        + f" | {ours} "
        + ", ".join(f"{x:.3f}" for x in v[ours]["val_loss"])
        for key, (peer, ours) in PAIRS.items()
        if key in v
    ]
    ax.text(0.02, 0.03, "\n".join(lines), transform=ax.transAxes, fontsize=7)
    lo = min(min(r["losses"][len(r["losses"]) // 3 :]) for r in result["runs"])
    hi = max(r["losses"][len(r["losses"]) // 20] for r in result["runs"])
    ax.set_ylim(lo * 0.95, hi)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashoptim_fused.parity")
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="a small model long enough to compare optimizers on a CPU (minutes per run)",
    )
    ap.add_argument(
        "--config",
        choices=sorted(CONFIGS),
        default=None,
        help="a size of CONFIGS (default: gpu on CUDA, else smoke; --cpu: cpu)",
    )
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    add_optimizers_option(ap, OPTIMIZERS)
    a = ap.parse_args(argv)
    names = parse_optimizers(a.optimizers, OPTIMIZERS)
    size = a.config or ("smoke" if a.smoke else "cpu" if a.cpu else None)
    cuda = torch.cuda.is_available() and size not in ("smoke", "cpu")
    device = torch.device("cuda" if cuda else "cpu")
    size = size or ("gpu" if cuda else "smoke")
    cfg = dict(CONFIGS[size])
    corpus = load_corpus({"smoke": 300_000, "cpu": 4_000_000}.get(size, 24_000_000))
    if a.steps:
        cfg["steps"] = a.steps
    cut = int(corpus.numel() * 0.95)
    data = (corpus[:cut], corpus[cut:])
    os.makedirs(a.out, exist_ok=True)
    runs = []
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        for name in names:
            t0 = time.perf_counter()
            r = run(name, seed, cfg, data, device)
            runs.append(r)
            print(
                f"{name} seed {seed}: final train {r['final_train_loss']:.4f}"
                f" val {r['val_loss']:.4f}"
                f" peak {r['peak_mem_mib']:.0f} MiB {r['tokens_per_s']:.0f} tok/s"
                f" ({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
    env = {"torch": torch.__version__, "corpus_bytes": corpus.numel()}
    if cuda:
        env["gpu"] = torch.cuda.get_device_name(0)
    summary = summarize(runs, "peak_mem_mib")
    result = {"config": cfg, "env": env, "summary": summary, "runs": runs}
    with open(os.path.join(a.out, "parity.json"), "w") as f:
        json.dump(result, f)
    print(json.dumps(summary, indent=1))
    try:
        plot(result, os.path.join(a.out, "flashoptim-parity.png"))
    except ImportError:
        print("matplotlib not available: no PNG")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
