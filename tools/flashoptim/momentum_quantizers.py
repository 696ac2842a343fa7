"""Which 8-bit storage of Muon's momentum keeps FlashMuon at parity with torch.optim.Muon
(issue #31; docs/design/flashoptim.md, FlashMuon: the tables). Two measurements:

    PYTHONPATH=packages/flashoptim/src python tools/flashoptim/momentum_quantizers.py replay
    PYTHONPATH=packages/flashoptim/src python tools/flashoptim/momentum_quantizers.py parity \\
        --schemes torch_muon,q_paper,q_ours --seeds 3 --out DIR

``replay``: trains the CPU parity GPT (``flashoptim_fused.parity``'s ``cpu`` model) with
torch.optim.Muon for 220 steps and keeps the bf16 gradients of four matrices over steps
100-219 (cached in ``--cache``); replays the Muon momentum on them with each storage and
prints the error against the fp32 momentum over the last 80 steps: of the momentum, of the
Newton-Schulz output per step (float64 Newton-Schulz, the kernels' quintic), and of that
output summed over the 80 steps (what moves the weights).

``parity``: the CPU parity run (0.87M GPT, 400 steps, ``parity.run``) per run and seed:
``torch_muon`` (torch.optim.Muon + AdamW), ``q_<scheme>`` (the same, its momentum buffer
quantized and decoded after every step: the stored value the next step reads, exactly what
an 8-bit state holds; the storage alone), ``flash_<scheme>`` (FlashMuon with the scheme on
its fp32 Muon momentum, the AdamW part at the package's defaults; ``flash_fp32``: none).
Paired by seed (same init and data). Writes ``DIR/schemes.json``.

A scheme is ``block``, ``scale`` (``bf16``: the absmax rounded up to bf16, as the package's;
``fp32``), ``code`` (``linear``: ``127 x / s``; ``softsign``: the package's ``127 2y / (1 +
|y|)``), ``rounding`` (``nearest`` / ``stochastic``; the draws here come from torch's
generator, the kernels hash the same distribution), ``form`` (``ema``: the stored value is
torch's ``m = mu m + (1 - mu) g``; ``sum``: the paper's ``m = mu m + g``, 1 / (1 - mu) times
it). The paper (arXiv 2509.23106): block 2048, fp32 scale, linear, nearest, sum.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.nn.functional as F

import flashoptim_fused as fo
from flashoptim_fused import parity
from flashoptim_fused.muon import default_use_muon
from flashoptim_fused.reference import NS_COEFFICIENTS, _ceil_scale_ref, newton_schulz_ref

MU = 0.95
SKIP = 40  # replay steps before the errors are counted (the momentum's start-up)

# name: (block, scale, code, rounding, form); bytes per element: 1 + scale bytes / block
SCHEMES = {
    "ours": (32, "bf16", "softsign", "stochastic", "ema"),  # the package's default of #24
    "ours_nearest": (32, "bf16", "softsign", "nearest", "ema"),
    "paper": (2048, "fp32", "linear", "nearest", "sum"),
    "paper_ema": (2048, "fp32", "linear", "nearest", "ema"),
    "paper_stochastic": (2048, "fp32", "linear", "stochastic", "sum"),
    "paper_softsign": (2048, "fp32", "softsign", "nearest", "sum"),
    "linear_32_nearest": (32, "bf16", "linear", "nearest", "ema"),
    "linear_32_stochastic": (32, "bf16", "linear", "stochastic", "ema"),
    "linear_128_fp32_nearest": (128, "fp32", "linear", "nearest", "ema"),
    "linear_2048_bf16_nearest": (2048, "bf16", "linear", "nearest", "ema"),
    "softsign_32_fp32_nearest": (32, "fp32", "softsign", "nearest", "ema"),
    "softsign_256_fp32_nearest": (256, "fp32", "softsign", "nearest", "ema"),
    "softsign_64_fp32_nearest": (64, "fp32", "softsign", "nearest", "ema"),
    "linear_64_fp32_nearest": (64, "fp32", "linear", "nearest", "ema"),
    # 2 bytes, above the 6.1 B/param budget: how close a finer storage gets (calibration)
    "bf16_nearest": (1, "none", "bf16", "nearest", "ema"),
    "bf16_stochastic": (1, "none", "bf16", "stochastic", "ema"),
}


# low rank + residual (GRASP, Wu et al., ICLR 2026): "lr<k>_<scheme>" keeps a rank-k part
# P R^T of the momentum in bf16 (P: rows x k, R: cols x k, tracked by one power iteration
# per step warm-started from the last R) and stores the residual m - P R^T with <scheme>


def scheme_bytes(name: str, shape=(512, 2048)) -> float:
    """Bytes per element of the momentum (a low-rank part counted on ``shape``)."""
    k, name = _rank_of(name)
    block, scale, code = SCHEMES[name][:3]
    per = 2.0 if code == "bf16" else 1 + (4 if scale == "fp32" else 2) / block
    return per + 2 * k * (shape[0] + shape[1]) / (shape[0] * shape[1])


def _rank_of(name: str) -> tuple[int, str]:
    """(rank, residual scheme) of a name: ``lr<k>_<scheme>``, ``lag<k>_<scheme>`` (the
    residual taken against the factors of the step before: ``Storage.lag``) or
    ``lu<k>_<scheme>`` (P from the step's direction: ``Storage.from_u``)."""
    for prefix in ("lr", "lag", "lu"):
        if name.startswith(prefix) and "_" in name:
            head, rest = name.split("_", 1)
            if head[len(prefix) :].isdigit():
                return int(head[len(prefix) :]), rest
    return 0, name


class Storage:
    """A momentum storage by name (``SCHEMES``, optionally ``lr<k>_`` before it): called on
    a buffer, returns what the next step reads back. Keeps the low-rank factors per buffer
    (keyed by the tensor's identity) and its rounding generator."""

    def __init__(self, name: str, seed: int = 0):
        self.rank, base = _rank_of(name)
        # lag: the residual is taken against the factors of the last step (estimated from
        # its momentum), the new ones are estimated after: what a kernel that quantizes in
        # the same pass as it forms the momentum can do
        self.lag = name.startswith("lag")
        # lu: P follows the step's direction u (Nesterov: mu m + (1 - mu) g) instead of m,
        # R = m^T P: what the shipped step computes (``_muon_lowrank.update_factors``: u is
        # what its workspace holds, m is recovered from u and g)
        self.from_u = name.startswith("lu")
        self.scheme = SCHEMES[base]
        self.seed = seed
        self.gen = None
        self.factors: dict = {}

    def __call__(self, m: torch.Tensor, key=None, u: torch.Tensor | None = None) -> torch.Tensor:
        """``m`` stored and read back; ``key``: whose factors (default: ``m``'s identity);
        ``u``: the step's direction (``lu`` schemes: P follows it)."""
        key = id(m) if key is None else key
        if self.gen is None:
            self.gen = torch.Generator(device=m.device).manual_seed(10_000 + self.seed)
        if not self.rank or m.ndim != 2:
            return fake_quantize(m, self.scheme, self.gen)
        md = m.double()
        old = self.factors.get(key)
        if old is None:  # a fixed random start, no low-rank part yet
            g = torch.Generator(device=m.device).manual_seed(1)
            r = torch.randn(m.shape[1], self.rank, generator=g, device=m.device).double()
            old = (torch.zeros(m.shape[0], self.rank, device=m.device).double(), r)
        src = u.double() if self.from_u and u is not None else md
        p, _ = torch.linalg.qr(src @ old[1])
        p = p.bfloat16().double()
        r = (md.T @ p).bfloat16().double()
        self.factors[key] = (p, r)
        low = old[0] @ old[1].T if self.lag else p @ r.T
        return (low + fake_quantize(md - low, self.scheme, self.gen)).to(m.dtype)


def fake_quantize(m: torch.Tensor, scheme: tuple, gen: torch.Generator | None = None):
    """``m`` stored with ``scheme`` and read back (float64 arithmetic, ``m``'s dtype out)."""
    block, scale, code, rounding, form = scheme
    if code == "bf16":
        if rounding == "nearest":
            return m.bfloat16().to(m.dtype)
        bits = m.float().view(torch.int32)
        noise = torch.randint(
            0, 1 << 16, m.shape, generator=gen, dtype=torch.int32, device=gen.device
        ).to(m.device)
        return ((bits + noise) & ~0xFFFF).view(torch.float32).to(m.dtype)
    x = m.reshape(-1).double()
    if form == "sum":  # the paper's m = mu m + g: the same values 1 / (1 - mu) larger
        x = x / (1 - MU)
    pad = (-x.numel()) % block
    xg = torch.cat([x, x.new_zeros(pad)]).view(-1, block)
    amax = xg.abs().amax(1)
    s = (_ceil_scale_ref(amax, torch.bfloat16) if scale == "bf16" else amax.float()).double()
    s = s.clamp(min=2.0**-126)
    y = xg / s[:, None]
    t = (2 * y / (1 + y.abs()) if code == "softsign" else y) * 127
    if rounding == "nearest":
        c = torch.round(t)
    else:
        u = torch.rand(t.shape, generator=gen, dtype=torch.float64, device=gen.device)
        c = torch.floor(t + u.to(t.device))
    c = c.clamp(-127, 127) / 127
    y = c / (2 - c.abs()) if code == "softsign" else c
    out = (y * s[:, None]).view(-1)[: x.numel()]
    if form == "sum":
        out = out * (1 - MU)
    return out.to(m.dtype).view(m.shape)


# ----------------------------------------------------------------------------- replay


def record_gradients(steps=220, keep_from=100):
    cfg = dict(parity.CONFIGS["cpu"])
    corpus = parity.load_corpus(4_000_000)
    train = corpus[: int(corpus.numel() * 0.95)]
    torch.manual_seed(0)
    model = parity.GPT(cfg["d"], cfg["layers"], cfg["heads"], cfg["ctx"])
    opt, sched_opts, autocast = parity._optimizer("torch_muon", model, cfg, torch.device("cpu"))
    scheds = [parity.lr_schedule(o, cfg["steps"]) for o in sched_opts]
    mats = [(n, p) for n, p in model.named_parameters() if default_use_muon(n, p)]
    picked = [mats[i] for i in (0, 1, len(mats) // 2, len(mats) - 1)]
    grads = {n: [] for n, _ in picked}
    gen = torch.Generator().manual_seed(1000)
    B, T = cfg["batch"], cfg["ctx"]
    for s in range(steps):
        ix = torch.randint(0, train.numel() - T - 1, (B,), generator=gen)
        xb = torch.stack([train[i : i + T + 1] for i in ix])
        with autocast:
            logits = model(xb[:, :-1]).float()
        F.cross_entropy(logits.view(-1, 256), xb[:, 1:].reshape(-1)).backward()
        if s >= keep_from:
            for n, p in picked:
                grads[n].append(p.grad.detach().bfloat16().float().clone())
        opt.step()
        for sch in scheds:
            sch.step()
        opt.zero_grad(set_to_none=True)
    return grads


def ns_bf16(u):
    """Newton-Schulz in bf16, as torch.optim.Muon runs it."""
    a, b, c = NS_COEFFICIENTS
    X = u.bfloat16()
    X = X / (X.norm() + 1e-7)
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    for _ in range(5):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return (X.T if tall else X).float()


def replay(grads, name, nesterov=True, seed=0):
    """Mean over the matrices of (momentum, per-step, summed) relative errors of storage
    ``name``; None: the exact momentum through the bf16 Newton-Schulz (for scale)."""
    store = None if name is None else Storage(name, seed)
    errs = [[], [], []]
    for key, gs in grads.items():
        ref = torch.zeros_like(gs[0])
        m = torch.zeros_like(gs[0])
        sum_ref = sum_q = 0
        per = []
        for t, g in enumerate(gs):
            ref = ref + (g - ref) * (1 - MU)
            u_ref = ref + (g - ref) * (1 - MU) if nesterov else ref
            if store is None:
                u = u_ref
            else:
                m = m + (g - m) * (1 - MU)
                u = m + (g - m) * (1 - MU) if nesterov else m
                m = store(m, key)
            if t >= SKIP:
                o_ref = newton_schulz_ref(u_ref.double()).float()
                o = ns_bf16(u) if store is None else newton_schulz_ref(u.double()).float()
                sum_ref, sum_q = sum_ref + o_ref, sum_q + o
                per.append(((o - o_ref).norm() / o_ref.norm()).item())
                errs[0].append(((m - ref).norm() / ref.norm()).item() if store else 0.0)
        errs[1].append(sum(per) / len(per))
        errs[2].append(((sum_q - sum_ref).norm() / sum_ref.norm()).item())
    return [sum(e) / len(e) for e in errs]


def main_replay(a) -> None:
    if a.cache and os.path.exists(a.cache):
        grads = torch.load(a.cache)
    else:
        grads = record_gradients()
        if a.cache:
            torch.save(grads, a.cache)
    names = a.schemes.split(",") if a.schemes else list(SCHEMES)
    print("| momentum storage | bytes | momentum | NS(u), per step | NS(u), summed |")
    print("|---|---|---|---|---|")
    for name in names:
        m, per, summed = replay(grads, name, nesterov=not a.no_nesterov)
        row = f"| {name} | {scheme_bytes(name):.3f} | {100 * m:.2f} % |"
        print(f"{row} {100 * per:.1f} % | {100 * summed:.1f} % |", flush=True)
    m, per, summed = replay(grads, None, nesterov=not a.no_nesterov)
    print(f"| fp32, bf16 Newton-Schulz | 4 | 0 | {100 * per:.1f} % | {100 * summed:.1f} % |")


# ----------------------------------------------------------------------------- cosine


def _cosine_run(name, seed, batches, steps=20, nesterov=True):
    """torch.optim.Muon (fp32, no weight decay) on a 2-layer d = 64 GPT for ``steps`` steps,
    its momentum stored through ``name`` (None: not), then the update of one more step."""
    torch.manual_seed(seed)
    model = parity.GPT(d=64, layers=2, heads=2, ctx=32)
    mats = [p for n, p in model.named_parameters() if default_use_muon(n, p)]
    opt = torch.optim.Muon(mats, lr=0.02, weight_decay=0.0, nesterov=nesterov)
    store = None if name is None else Storage(name, seed)
    for xb in batches[: steps + 1]:
        logits = model(xb[:, :-1]).reshape(-1, 256)
        F.cross_entropy(logits, xb[:, 1:].reshape(-1)).backward()
        before = [p.detach().clone() for p in mats]
        opt.step()
        if store is not None:
            for p, st in opt.state.items():
                m = st["momentum_buffer"]
                u = p.grad.lerp(m, MU) if nesterov else m
                m.copy_(store(m, u=u))
        opt.zero_grad()
    return torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(mats, before)])


def main_cosine(a) -> None:
    """The cosine between the update after 20 steps with each storage and with the fp32
    momentum (same init and data), mean of seeds 0, 1, 2: a seconds-long proxy."""
    corpus = parity.load_corpus(300_000)
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, corpus.numel() - 40, (21, 8), generator=g)
    batches = [torch.stack([corpus[i : i + 33] for i in row]) for row in starts]
    nest = not a.no_nesterov
    refs = {sd: _cosine_run(None, sd, batches, nesterov=nest) for sd in range(3)}
    print("| momentum storage | bytes (512 x 2048) | cosine, seeds 0 / 1 / 2 | mean |")
    print("|---|---|---|---|")
    for name in a.schemes.split(","):
        cs = [
            F.cosine_similarity(
                _cosine_run(name, sd, batches, nesterov=nest), refs[sd], dim=0
            ).item()
            for sd in refs
        ]
        vals = " / ".join(f"{c:.4f}" for c in cs)
        print(f"| {name} | {scheme_bytes(name):.3f} | {vals} | {sum(cs) / 3:.4f} |", flush=True)


def _shipped_run(kind, seed, batches, steps=20):
    """``_cosine_run``'s model and data with the package's FlashMuon (its Muon group only):
    ``bf16`` (bf16 weights and forward, the defaults; the fp32 init as masters),
    ``bf16_fp32_momentum`` (the same, ``quantize=False``), ``fp32`` (fp32 weights, the
    defaults); the master weights' update of the last step."""
    torch.manual_seed(seed)
    model = parity.GPT(d=64, layers=2, heads=2, ctx=32)
    mats = [p for n, p in model.named_parameters() if default_use_muon(n, p)]
    masters = {p: p.detach().clone() for p in mats}
    if kind != "fp32":
        model.to(torch.bfloat16)
    opt = fo.FlashMuon(
        [dict(params=mats, use_muon=True)],
        lr=0.02,
        weight_decay=0.0,
        quantize=kind != "bf16_fp32_momentum",
    )
    opt.load_master_weights(masters)
    for xb in batches[: steps + 1]:
        logits = model(xb[:, :-1]).float().reshape(-1, 256)
        F.cross_entropy(logits, xb[:, 1:].reshape(-1)).backward()
        before = [fo.master_weight(p, opt) for p in mats]
        opt.step()
        opt.zero_grad()
    return torch.cat([(fo.master_weight(p, opt) - b).reshape(-1) for p, b in zip(mats, before)])


def main_shipped(a) -> None:
    """The issue's update-direction target: the 21st update of the package's FlashMuon
    against torch.optim.Muon's (fp32, same init and data; ``_cosine_run``), seeds 0, 1, 2.
    Run it with another checkout's package on PYTHONPATH to compare storages."""
    corpus = parity.load_corpus(300_000)
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, corpus.numel() - 40, (21, 8), generator=g)
    batches = [torch.stack([corpus[i : i + 33] for i in row]) for row in starts]
    refs = {sd: _cosine_run(None, sd, batches) for sd in range(3)}
    print(f"package: {os.path.dirname(fo.__file__)}")
    print("| FlashMuon | cosine to torch.optim.Muon, seeds 0 / 1 / 2 | mean |")
    print("|---|---|---|")
    for kind in a.schemes.split(",") if a.schemes else ["bf16", "bf16_fp32_momentum", "fp32"]:
        cs = [
            F.cosine_similarity(_shipped_run(kind, sd, batches), refs[sd], dim=0).item()
            for sd in refs
        ]
        vals = " / ".join(f"{c:.4f}" for c in cs)
        print(f"| {kind} | {vals} | {sum(cs) / 3:.4f} |", flush=True)


# ----------------------------------------------------------------------------- parity


class _FakeQuantized:
    """An optimizer whose Muon momentum buffers (``bufs()``: (parameter, fp32 buffer) pairs)
    are stored through ``storage`` after each step: the next step reads what that state
    would hold (``lu`` storages get the step's direction from the gradient, still set)."""

    def __init__(self, opt, bufs, storage: Storage, nesterov: bool):
        self.opt, self.bufs, self.storage = opt, bufs, storage
        self.nesterov = nesterov
        self.skipped_steps = 0

    def step(self):
        self.opt.step()
        for p, m in self.bufs():
            g = p.grad.to(m.dtype).view(m.shape)
            m.copy_(self.storage(m, u=g.lerp(m, MU) if self.nesterov else m))

    def zero_grad(self, set_to_none=True):
        self.opt.zero_grad(set_to_none=set_to_none)


def make_optimizer(nesterov: bool, seed: int):
    """A ``parity.run`` factory: ``torch_muon`` (torch.optim.Muon + AdamW, bf16 autocast, as
    the parity run's), ``q_<scheme>`` (the same with its momentum stored through the scheme:
    the storage alone), ``flash_<scheme>`` (FlashMuon, bf16 weights, its fp32 Muon momentum
    stored through the scheme; ``flash_fp32``: not quantized); all with ``nesterov``."""

    def make(name, model, cfg, device):
        hp = dict(lr=cfg["lr"], weight_decay=0.1)
        named = list(model.named_parameters())
        mats = [p for n, p in named if default_use_muon(n, p)]
        rest = [p for n, p in named if not default_use_muon(n, p)]
        if name == "torch_muon" or name.startswith("q_"):
            muon = torch.optim.Muon(mats, adjust_lr_fn="match_rms_adamw", nesterov=nesterov, **hp)
            adamw = torch.optim.AdamW(rest, betas=(0.9, 0.95), **hp)
            autocast = torch.autocast(device.type, dtype=torch.bfloat16)
            both = parity._Both(muon, adamw)
            if name.startswith("q_"):
                bufs = lambda: [(p, s["momentum_buffer"]) for p, s in muon.state.items()]  # noqa: E731
                both = _FakeQuantized(both, bufs, Storage(name[2:], seed), nesterov)
            return both, [muon, adamw], autocast
        masters = {p: p.detach().clone() for p in model.parameters()}
        model.to(torch.bfloat16)
        opt = fo.FlashMuon(
            [
                dict(params=mats, use_muon=True, quantize=False),
                dict(params=rest, use_muon=False, betas=(0.9, 0.95)),
            ],
            adjust_lr_fn="match_rms_adamw",
            nesterov=nesterov,
            **hp,
        )
        opt.load_master_weights(masters)
        scheme = name.removeprefix("flash_")
        if scheme == "fp32":
            return opt, [opt], contextlib.nullcontext()

        def bufs():
            return [(p, opt.state[p]["momentum_buffer"]) for p in mats if p in opt.state]

        fake = _FakeQuantized(opt, bufs, Storage(scheme, seed), nesterov)
        return fake, [opt], contextlib.nullcontext()

    return make


def main_parity(a) -> None:
    cfg = dict(parity.CONFIGS[a.config])
    if a.steps:
        cfg["steps"] = a.steps
    device = torch.device("cuda" if a.config != "cpu" and torch.cuda.is_available() else "cpu")
    corpus = parity.load_corpus(4_000_000 if a.config == "cpu" else 24_000_000)
    cut = int(corpus.numel() * 0.95)
    data = (corpus[:cut], corpus[cut:])
    names = a.schemes.split(",")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "schemes.json")
    result = json.load(open(path)) if os.path.exists(path) else {"config": cfg, "runs": []}
    done = {(r["optimizer"], r["seed"], r["nesterov"]) for r in result["runs"]}
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        for name in names:
            if (name, seed, not a.no_nesterov) in done:
                continue
            t0 = time.perf_counter()
            make = make_optimizer(not a.no_nesterov, seed)
            r = parity.run(name, seed, cfg, data, device, make_optimizer=make)
            r.update(nesterov=not a.no_nesterov, seconds=time.perf_counter() - t0)
            r.pop("losses")
            result["runs"].append(r)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
            print(
                f"{name} seed {seed} nesterov {not a.no_nesterov}: val {r['val_loss']:.4f}"
                f" ({r['seconds']:.0f} s)",
                flush=True,
            )
    table(result)


def table(result) -> None:
    """Mean validation loss per (scheme, nesterov) and its difference to torch's."""
    rows = {}
    for r in result["runs"]:
        rows.setdefault((r["optimizer"], r["nesterov"]), {})[r["seed"]] = r["val_loss"]
    print("| run | nesterov | val loss per seed | mean | minus torch (same seeds) |")
    print("|---|---|---|---|---|")
    for (name, nest), v in sorted(rows.items()):
        t = rows.get(("torch_muon", nest), {})
        common = [s for s in v if s in t]
        diff = sum(v[s] - t[s] for s in common) / len(common) if common else float("nan")
        vals = " / ".join(f"{v[s]:.4f}" for s in sorted(v))
        print(f"| {name} | {nest} | {vals} | {sum(v.values()) / len(v):.4f} | {diff:+.4f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["replay", "parity", "cosine", "shipped"])
    ap.add_argument("--schemes", default="", help="comma-separated names of SCHEMES")
    ap.add_argument("--no-nesterov", action="store_true")
    ap.add_argument("--cache", default="", help="replay: the recorded gradients (.pt)")
    ap.add_argument("--out", default="momentum-schemes")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--config", default="cpu", help="parity: a size of parity.CONFIGS")
    a = ap.parse_args(argv)
    modes = dict(replay=main_replay, parity=main_parity, cosine=main_cosine, shipped=main_shipped)
    modes[a.mode](a)


if __name__ == "__main__":
    main()
