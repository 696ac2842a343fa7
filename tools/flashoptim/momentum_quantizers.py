"""How much each way of storing Muon's momentum perturbs the orthogonalised update, on the
real gradients of the CPU parity GPT (docs/design/flashoptim.md, FlashMuon: the table).

    PYTHONPATH=packages/flashoptim/src python tools/flashoptim/momentum_quantizers.py

1. trains the CPU parity GPT (``flashoptim_fused.parity``'s --cpu model) with
   torch.optim.Muon for 220 steps and keeps the bf16 gradients of four matrices over steps
   100-219 (about 2 minutes on 2 cores);
2. replays the Nesterov EMA (mu 0.95) on them with each storage, and prints the error
   against the fp32 EMA over the last 80 steps: of the momentum, of the Newton-Schulz output
   per step (float64 Newton-Schulz, the kernels' quintic), and of that output summed over
   the 80 steps (what moves the weights); last, the error of the bf16 Newton-Schulz that
   torch runs on the exact momentum, for scale.

Stochastic rounding here draws from torch's generator (the kernels use a hash: the same
distribution).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashoptim_fused import parity
from flashoptim_fused.muon import default_use_muon
from flashoptim_fused.reference import (
    MOM_SCALE_MIN,
    NS_COEFFICIENTS,
    _ceil_scale_ref,
    dequantize_momentum_ref,
    newton_schulz_ref,
    quantize_momentum_ref,
)

MU = 0.95
SKIP = 40  # replay steps before the errors are counted (the EMA's start-up)


def record_gradients(steps=220, keep_from=100):
    cfg = dict(d=128, layers=4, heads=4, ctx=64, batch=16, steps=400, lr=3e-3)
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


def package_codes(m, stochastic=True):
    """The package's int8 momentum (its float64 reference quantizer and decoder)."""
    flat = m.reshape(-1)
    u = torch.rand(flat.shape, dtype=torch.float64) if stochastic else None
    code, s = quantize_momentum_ref(flat, u=u)
    return dequantize_momentum_ref(code, s).float().reshape(m.shape)


def other_codes(m, group=32, compand="uniform"):
    """Alternatives to the package's code at the same byte count (stochastic rounding; the
    scale as the package's: the group's absmax rounded up to bf16)."""
    x = m.reshape(-1, group).double()
    s = _ceil_scale_ref(x.abs().amax(1), torch.bfloat16).double().clamp(min=MOM_SCALE_MIN)
    y = x / s[:, None]
    if compand == "frac":  # the package's 2y / (1 + |y|), decoded c / (2 - |c|)
        enc, dec = (lambda v: 2 * v / (1 + v.abs())), (lambda c: c / (2 - c.abs()))
    elif compand == "uniform":
        enc, dec = (lambda v: v), (lambda c: c)
    else:  # a power law
        p = float(compand)
        enc, dec = (lambda v: v.sign() * v.abs() ** p), (lambda c: c.sign() * c.abs() ** (1 / p))
    t = enc(y) * 127
    code = torch.floor(t + torch.rand_like(t)).clamp(-127, 127)
    return (dec(code / 127) * s[:, None]).float().reshape(m.shape)


def bf16_value(m, stochastic=True):
    if not stochastic:
        return m.bfloat16().float()
    bits = m.view(torch.int32) + torch.randint(0, 1 << 16, m.shape, dtype=torch.int32)
    return (bits & ~0xFFFF).view(torch.float32)


STORAGES = {
    "int8, 2x/(1+|x|), scale per 32, stochastic (ours)": package_codes,
    "the same, rounded to nearest": lambda m: package_codes(m, stochastic=False),
    "int8 uniform, stochastic": lambda m: other_codes(m, compand="uniform"),
    "int8 |x|^0.7, stochastic": lambda m: other_codes(m, compand="0.7"),
    "ours with a scale per 16": lambda m: other_codes(m, group=16, compand="frac"),
    "bf16, stochastic": bf16_value,
    "bf16, nearest": lambda m: bf16_value(m, stochastic=False),
}


def ns64(u):
    return newton_schulz_ref(u.double()).float()


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


def replay(grads, store):
    """Mean over the matrices of (momentum, per-step, summed) relative errors."""
    errs = [[], [], []]
    for gs in grads.values():
        ref = torch.zeros_like(gs[0])
        m = torch.zeros_like(gs[0])
        sum_ref = sum_q = 0
        per = []
        for t, g in enumerate(gs):
            ref = ref + (g - ref) * (1 - MU)
            u_ref = ref + (g - ref) * (1 - MU)
            if store is None:
                u = u_ref
            else:
                m = m + (g - m) * (1 - MU)
                u = m + (g - m) * (1 - MU)
                m = store(m)
            if t >= SKIP:
                o_ref = ns64(u_ref)
                o = ns_bf16(u) if store is None else ns64(u)
                sum_ref, sum_q = sum_ref + o_ref, sum_q + o
                per.append(((o - o_ref).norm() / o_ref.norm()).item())
                errs[0].append(((m - ref).norm() / ref.norm()).item() if store else 0.0)
        errs[1].append(sum(per) / len(per))
        errs[2].append(((sum_q - sum_ref).norm() / sum_ref.norm()).item())
    return [sum(e) / len(e) for e in errs]


def main():
    torch.manual_seed(0)
    grads = record_gradients()
    print("| momentum storage | momentum | NS(u), per step | NS(u), summed |")
    print("|---|---|---|---|")
    for name, store in list(STORAGES.items()) + [("fp32, bf16 Newton-Schulz", None)]:
        m, per, summed = replay(grads, store)
        print(f"| {name} | {100 * m:.2f} % | {100 * per:.1f} % | {100 * summed:.1f} % |")


if __name__ == "__main__":
    main()
