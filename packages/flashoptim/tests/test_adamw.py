"""FlashAdamW and FlashAdam (``adamw.py``): torch.optim semantics, the quantized run against
the unquantized one, training parity on scikit-learn's digits."""

import pytest
import torch
from _checks import assert_matches_torch_unquantized, assert_quantized_tracks_unquantized

import flashoptim as fo


@pytest.mark.parametrize(
    "Flash,Torch",
    [(fo.FlashAdamW, torch.optim.AdamW), (fo.FlashAdam, torch.optim.Adam)],
    ids=["adamw", "adam"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_without_quantization(Flash, Torch, dtype):
    assert_matches_torch_unquantized(Flash, Torch, dict(lr=1e-2, weight_decay=0.1), dtype)


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
