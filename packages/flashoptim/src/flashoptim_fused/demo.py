"""python -m flashoptim_fused.demo: a short CPU tour (well under a minute).

1. Train a small 2-D convnet on scikit-learn's digits (8x8 images) with FlashAdamW (bf16
   weights, 24-bit master weights, 8-bit companded states) and with torch AdamW (fp32).
2. Print the memory report of each flashoptim optimizer.
3. Show the lost-update effect: 100 steps of -1e-5 on a weight of 1.0.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import flashoptim_fused as fo


def _digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # pragma: no cover - sklearn is in the [test] extra
        g = torch.Generator().manual_seed(0)
        X = torch.rand(1797, 64, generator=g)
        return X, (X[:, :10].argmax(1))
    X, y = load_digits(return_X_y=True)
    return torch.tensor(X / 16.0, dtype=torch.float32), torch.tensor(y)


def _convnet():
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 64, 10),
    )


def train(make_opt, dtype, epochs=3, seed=0):
    X, y = _digits()
    X = X.view(-1, 1, 8, 8)
    torch.manual_seed(seed)
    model = _convnet()
    masters = [p.detach().clone() for p in model.parameters()]
    model = model.to(dtype)
    opt = make_opt(model.parameters())
    if isinstance(opt, fo.FlashOptimizer):  # keep the fp32 init in the corrections
        opt.load_master_weights(masters)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(1500, generator=g)
        for i in range(0, 1500, 100):
            b = perm[i : i + 100]
            F.cross_entropy(model(X[b].to(dtype)).float(), y[b]).backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        logits = model(X[1500:].to(dtype)).float()
        return F.cross_entropy(logits, y[1500:]).item(), (
            logits.argmax(1) == y[1500:]
        ).float().mean().item()


def main() -> None:
    t0 = time.perf_counter()
    print("1) digits convnet, 3 epochs, held-out 297 images")
    for name, mk, dt in [
        ("torch AdamW fp32", lambda p: torch.optim.AdamW(p, lr=4e-3), torch.float32),
        ("FlashAdamW bf16 ", lambda p: fo.FlashAdamW(p, lr=4e-3), torch.bfloat16),
    ]:
        loss, acc = train(mk, dt)
        print(f"   {name}: test loss {loss:.3f}, accuracy {acc:.3f}")
    print("2) memory report (bf16 params and grads, 1M params)")
    for Opt, kw in [(fo.FlashAdamW, {}), (fo.FlashSGD, {"momentum": 0.9}), (fo.FlashLion, {})]:
        p = torch.zeros(1024, 1024, dtype=torch.bfloat16, requires_grad=True)
        opt = Opt([p], **kw)
        p.grad = torch.zeros_like(p)
        opt.step()
        r = fo.memory_report(opt)
        parts = ", ".join(
            f"{k} {r[k] / r['params']:.3f}"
            for k in ("param", "grad", "master_correction", "state_codes", "state_scales")
            if r[k]
        )
        print(f"   {Opt.__name__}: {r['bytes_per_param']:.3f} bytes/param ({parts})")
    print("3) lost updates: weight 1.0, 100 SGD steps of -1e-5 each (bf16 + int8 correction)")
    for sr in (False, True):
        p = torch.ones(1000, dtype=torch.bfloat16, requires_grad=True)
        opt = fo.FlashSGD([p], lr=1e-5, stochastic_rounding=sr)
        for _ in range(100):
            p.grad = torch.ones_like(p)
            opt.step()
        w = fo.master_weight(p, opt).double().mean().item()
        label = "stochastic" if sr else "nearest   "
        print(f"   {label} rounding: mean master weight {w:.6f} (exact: 0.999000)")
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
