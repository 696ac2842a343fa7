"""The package's examples run at their smoke sizes on the CPU (seconds)."""

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpt_mhc_smoke(tmp_path):
    """The training example at a tiny size on the CPU, under bf16 autocast as on the GPU:
    both runs record a loss and H_res's marginal error every step; the exact projection's
    stays below 1e-5 on every token of every layer."""
    doc = _load("gpt_mhc").main(["--smoke", "--out", str(tmp_path), "--device", "cpu"])
    saved = json.loads((tmp_path / "gpt_mhc.json").read_text())
    assert set(saved["runs"]) == {"birkhoff", "sinkhorn"} and saved["config"]["autocast"]
    for run in doc["runs"].values():
        assert len(run["loss"]) == len(run["marginal_max"]) == doc["config"]["steps"]
        assert run["loss"][-1] < run["loss"][0]
    assert max(doc["runs"]["birkhoff"]["marginal_max"]) <= 1e-5  # exact: every token, every step
    pytest.importorskip("matplotlib")
    _load("plot_gpt_mhc").main([str(tmp_path / "gpt_mhc.json"), str(tmp_path / "gpt.png")])
    assert (tmp_path / "gpt.png").stat().st_size > 10_000


def test_gpt_mhc_time_budget(tmp_path):
    """--time-budget sets one step count for both runs from timed calibration steps."""
    args = ["--smoke", "--out", str(tmp_path), "--device", "cpu", "--time-budget", "0.5"]
    args += ["--projections", "birkhoff"]
    doc = _load("gpt_mhc").main(args)
    steps = doc["calibration"]["steps"]
    assert steps >= 20 and len(doc["runs"]["birkhoff"]["loss"]) == steps
    assert doc["calibration"]["seconds_per_step"] > 0
