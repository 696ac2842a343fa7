"""Gradient release (``release.py``): stepping each parameter inside backward equals the
ordinary step; per-parameter clipping."""

import pytest
import torch

import flashoptim_fused as fo


def _mlp(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    ).to(dtype)


@pytest.mark.parametrize("k", [1, 3])
def test_gradient_release_equals_step(k):
    x, y = torch.randn(3 * 16, 64), torch.randint(0, 10, (3 * 16,))
    m1, m2 = _mlp(0, torch.bfloat16), _mlp(0, torch.bfloat16)
    o1, o2 = fo.FlashAdamW(m1.parameters(), lr=1e-2), fo.FlashAdamW(m2.parameters(), lr=1e-2)
    h = fo.enable_gradient_release(m2, o2, accumulation_steps=k)
    for _it in range(4):
        for j in range(k):
            xb, yb = x[j * 16 : (j + 1) * 16].bfloat16(), y[j * 16 : (j + 1) * 16]
            torch.nn.functional.cross_entropy(m1(xb).float(), yb).backward()
            torch.nn.functional.cross_entropy(m2(xb).float(), yb).backward()
        o1.step()
        o1.zero_grad()
        o2.step()  # no-op: no gradients left
        assert all(p.grad is None for p in m2.parameters())
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    h.remove()
    assert not h.active


def test_gradient_release_per_param_clipping():
    p = torch.zeros(100, requires_grad=True)
    opt = fo.FlashSGD([p], lr=1.0, quantize=False)
    fo.enable_gradient_release([p], opt, max_norm_per_param=1.0)
    (p * 100.0).sum().backward()
    assert abs(p.detach().norm().item() - 1.0) < 1e-3
