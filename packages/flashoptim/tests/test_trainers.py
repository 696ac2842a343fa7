"""The trainer recipes of ``examples/trainers.py`` (docs/flashoptim.md, "Trainers"): each
trains, saves a checkpoint mid-run through its trainer's own mechanism, and fresh objects
resumed from that checkpoint end bit for bit where the uninterrupted run ended: weights,
8-bit codes, scales, corrections and step counts. A trainer that dropped or re-initialised
any optimizer state on the way (a restarted step count, fresh moments) would differ.
Each test is skipped when its library is not installed."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import flashoptim_fused as fo

_PATH = os.path.join(os.path.dirname(__file__), "..", "examples", "trainers.py")
_spec = importlib.util.spec_from_file_location("flashoptim_trainers_example", _PATH)
recipes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipes)


def _flash(opt):
    """The FlashAdamW inside a trainer's wrapper (accelerate's AcceleratedOptimizer)."""
    inner = getattr(opt, "optimizer", opt)
    assert isinstance(inner, fo.FlashAdamW), type(inner)
    return inner


def _states(opt) -> list[dict]:
    return [dict(opt.state[p]) for g in opt.param_groups for p in g["params"]]


def _assert_same_run(first, resumed, steps):
    (wa, oa, na), (wb, ob, nb) = first, resumed
    oa, ob = _flash(oa), _flash(ob)
    assert na == nb == steps
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].dtype == torch.bfloat16 and torch.equal(wa[k], wb[k]), k
    sa, sb = _states(oa), _states(ob)
    assert len(sa) == len(sb) and any("exp_avg_codes" in s for s in sa)  # 8-bit states ran
    for a, b in zip(sa, sb):
        assert a.keys() == b.keys()
        assert a["step"] == b["step"] == steps
        for k, v in a.items():
            assert torch.equal(v, b[k]) if torch.is_tensor(v) else v == b[k], k


@pytest.mark.parametrize("cls", [False, True], ids=["object", "optimizer_cls_and_kwargs"])
def test_hugging_face_trainer_resumes_bitwise(tmp_path, cls):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = str(tmp_path)
    first = recipes.hf_trainer(out, steps=6, save_every=3, cls=cls)
    groups = _flash(first[1]).param_groups
    if cls:  # the Trainer's own groups: weight decay off for the biases
        assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.1]
    resumed = recipes.hf_trainer(out, steps=6, resume=os.path.join(out, "checkpoint-3"), cls=cls)
    _assert_same_run(first, resumed, 6)


def test_lightning_resumes_bitwise(tmp_path):
    pytest.importorskip("lightning")
    out = str(tmp_path)
    first = recipes.lightning(out, epochs=2)
    ckpts = sorted(f for f in os.listdir(out) if f.endswith(".ckpt"))
    assert ckpts[0].startswith("epoch=0-step=3")
    resumed = recipes.lightning(out, epochs=2, resume=os.path.join(out, ckpts[0]))
    _assert_same_run(first, resumed, 6)


def test_accelerate_resumes_bitwise(tmp_path):
    pytest.importorskip("accelerate")
    out = str(tmp_path)
    first = recipes.accelerate(out, steps=6, save_at=3)
    resumed = recipes.accelerate(out, steps=6, save_at=3, resume=True)
    _assert_same_run(first, resumed, 6)


def test_torchtitan_optimizer_builder_resumes_bitwise(tmp_path):
    pytest.importorskip("torchtitan")
    out = str(tmp_path)
    first = recipes.torchtitan(out, steps=6, save_at=3)
    assert [g["weight_decay"] for g in first[1].param_groups] == [0.0, 0.1]
    resumed = recipes.torchtitan(out, steps=6, save_at=3, resume=True)
    _assert_same_run(first, resumed, 6)
