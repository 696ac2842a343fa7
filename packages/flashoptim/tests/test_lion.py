"""FlashLion (``lion.py``): the Lion update against a float64 transcription of the paper's
rule, the quantized run against the unquantized one."""

import pytest
import torch
from _checks import assert_quantized_tracks_unquantized, small_grads, small_params

import flashoptim_fused as fo


def _lion_ref(p, g, m, lr, b1, b2, wd):
    p = p * (1 - lr * wd)
    p = p - lr * torch.sign(b1 * m + (1 - b1) * g)
    return p, b2 * m + (1 - b2) * g


def test_lion_matches_reference():
    ps = small_params()
    ref = [p.detach().double().clone() for p in ps]
    ms = [torch.zeros_like(r) for r in ref]
    opt = fo.FlashLion(ps, lr=1e-3, weight_decay=0.1, quantize=False)
    for s in range(10):
        gs = small_grads(ps, s)
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()
        for i, g in enumerate(gs):
            ref[i], ms[i] = _lion_ref(ref[i], g.double(), ms[i], 1e-3, 0.9, 0.99, 0.1)
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)


def test_quantized_tracks_unquantized():
    assert_quantized_tracks_unquantized(fo.FlashLion)


def test_clear_errors():
    with pytest.raises(ValueError, match="betas"):
        fo.FlashLion([torch.zeros(3, requires_grad=True)], betas=(1.5, 0.99))
