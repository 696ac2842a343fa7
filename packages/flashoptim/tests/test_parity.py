"""The parity script (``parity.py``) end to end on CPU for the Muon pair: a tiny GPT, 3 steps
of torch.optim.Muon + AdamW and of FlashMuon from the same init and data."""

import json

import pytest

from flashoptim_fused import parity


def test_parity_muon_smoke(tmp_path):
    names = "torch_muon,flash_muon,flash_muon_fp32_states"
    parity.main(
        ["--smoke", "--steps", "3", "--seeds", "1", "--out", str(tmp_path), "--optimizers", names]
    )
    r = json.loads((tmp_path / "parity.json").read_text())
    runs = {x["optimizer"]: x for x in r["runs"]}
    assert set(runs) == {"torch_muon", "flash_muon", "flash_muon_fp32_states"}
    assert "verdict_muon" in r["summary"] and "verdict" not in r["summary"]
    # same weights, same first batch: the first loss agrees (bf16 weights vs fp32)
    assert abs(runs["torch_muon"]["losses"][0] - runs["flash_muon"]["losses"][0]) < 1e-2
    assert runs["flash_muon"]["memory_report"]["bytes_per_param"] < 7.2
    # the control keeps fp32 momentum: 3 bytes per Muon parameter more
    assert runs["flash_muon_fp32_states"]["memory_report"]["bytes_per_param"] > 9


def test_parity_rejects_an_incomplete_pair(tmp_path):
    with pytest.raises(SystemExit, match="torch_muon and flash_muon"):
        parity.main(["--smoke", "--out", str(tmp_path), "--optimizers", "torch_adamw,flash_muon"])
