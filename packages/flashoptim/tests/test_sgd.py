"""FlashSGD and FlashSGDW (``sgd.py``): torch.optim.SGD semantics (momentum, dampening,
Nesterov, coupled decay), decoupled decay, the quantized run against the unquantized one."""

import pytest
import torch
from _checks import assert_matches_torch_unquantized, assert_quantized_tracks_unquantized

import flashoptim_fused as fo


@pytest.mark.parametrize(
    "kw",
    [
        dict(lr=1e-2, momentum=0.9, weight_decay=0.01),
        dict(lr=1e-2, momentum=0.9, nesterov=True),
        dict(lr=1e-2, momentum=0.5, dampening=0.3),
        dict(lr=1e-2),
    ],
    ids=["momentum_wd", "nesterov", "dampening", "plain"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_without_quantization(kw, dtype):
    assert_matches_torch_unquantized(fo.FlashSGD, torch.optim.SGD, kw, dtype)


def test_sgdw_decoupled_decay():
    p = torch.ones(40, requires_grad=True)
    opt = fo.FlashSGDW([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(40)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((40,), 0.95))


def test_quantized_tracks_unquantized():
    assert_quantized_tracks_unquantized(fo.FlashSGD, momentum=0.9)


def test_clear_errors():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="nesterov"):
        fo.FlashSGD([p], nesterov=True)
    with pytest.raises(ValueError, match="momentum"):
        fo.FlashSGD([p], momentum=-0.1)
