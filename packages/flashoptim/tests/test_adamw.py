"""FlashAdamW and FlashAdam (``adamw.py``): torch.optim semantics, the quantized run against
the unquantized one, training parity on scikit-learn's digits."""

import pytest
import torch
from _checks import assert_matches_torch_unquantized, assert_quantized_tracks_unquantized

import flashoptim_fused as fo


@pytest.mark.parametrize(
    "Flash,Torch",
    [(fo.FlashAdamW, torch.optim.AdamW), (fo.FlashAdam, torch.optim.Adam)],
    ids=["adamw", "adam"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_without_quantization(Flash, Torch, dtype):
    assert_matches_torch_unquantized(Flash, Torch, dict(lr=1e-2, weight_decay=0.1), dtype)


def _drift(make, noisy: bool, dev: str, dtype=torch.float32, steps: int = 1000) -> float:
    """Mean distance the weights move in ``steps`` AdamW steps of lr 1e-5 (no decay) on a
    gradient 1 (``noisy``: 1 + 0.5 N(0, 1), the same draws for every optimizer)."""
    # rows of 32: 8-bit states (a 1-D tensor would keep fp32 states, grid.py)
    p = torch.zeros(8, 32, device=dev, dtype=dtype, requires_grad=True)
    opt = make([p])
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        g = torch.ones(8, 32)
        if noisy:
            g = g + 0.5 * torch.randn(8, 32, generator=gen)
        p.grad = g.to(device=dev, dtype=dtype)
        opt.step()
    w = fo.master_weight(p, opt) if isinstance(opt, fo.FlashOptimizer) else p.detach()
    return -w.double().mean().item()


DRIFT_OPTIONS = [{}, dict(scale_dtype=torch.float32), dict(quantize=False)]


def _check_drift(dev, backend, dtype):
    kw = dict(lr=1e-5, weight_decay=0.0)
    for noisy in (False, True):
        want = _drift(lambda ps: torch.optim.AdamW(ps, **kw), noisy, dev)
        for okw in DRIFT_OPTIONS:
            got = _drift(
                lambda ps, okw=okw: fo.FlashAdamW(ps, backend=backend, **kw, **okw),
                noisy,
                dev,
                dtype,
            )
            # before the codes were rounded stochastically: +36 % (constant) / +3.7 % (noisy)
            # with bf16 scales; now +0.1 % each (CPU path, fp32 parameters)
            assert abs(got / want - 1) < 0.01, (noisy, okw, got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_states_do_not_drift(dtype):
    """1,000 steps on a constant and on a noisy gradient move the weights as far as torch
    AdamW's (within 1 %) with 8-bit states and bf16 scales (the default), fp32 scales and fp32
    states: the 8-bit EMA states are unbiased (CPU path; the kernel is bitwise the CPU path
    under the interpreter, tests/test_step_kernel.py)."""
    _check_drift("cpu", "torch", dtype)


@pytest.mark.gpu
def test_gpu_quantized_states_do_not_drift():
    """The same on the CUDA kernel (bf16 parameters and gradients, the default layout)."""
    _check_drift("cuda", "auto", torch.bfloat16)


def test_quantized_tracks_unquantized():
    assert_quantized_tracks_unquantized(fo.FlashAdamW)


def test_clear_errors():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="betas"):
        fo.FlashAdamW([p], betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="eps"):
        fo.FlashAdamW([p], eps=-1.0)


def _mlp(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    ).to(dtype)


def _digits_run(make_opt, seed, dtype):
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(X), generator=g)
    Xtr, ytr = X[perm[:1500]], y[perm[:1500]]
    model = _mlp(seed).to(dtype)
    opt = make_opt(model.parameters())
    for _ep in range(8):
        idx = torch.randperm(1500, generator=g)
        for i in range(0, 1500, 64):
            b = idx[i : i + 64]
            loss = torch.nn.functional.cross_entropy(model(Xtr[b].to(dtype)).float(), ytr[b])
            loss.backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(Xtr.to(dtype)).float(), ytr).item()


def test_digits_mlp_parity():
    """FlashAdamW (bf16 weights, defaults) final loss within torch AdamW's seed spread."""
    tl = [_digits_run(lambda p: torch.optim.AdamW(p, lr=3e-3), s, torch.float32) for s in range(3)]
    fl = [_digits_run(lambda p: fo.FlashAdamW(p, lr=3e-3), s, torch.bfloat16) for s in range(3)]
    spread = max(tl) - min(tl)
    mean_f, mean_t = sum(fl) / 3, sum(tl) / 3
    assert max(tl) < 0.2  # it trained
    assert abs(mean_f - mean_t) <= max(spread, 0.1 * mean_t), (tl, fl)
