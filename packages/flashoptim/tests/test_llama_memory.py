"""tools/flashoptim/llama_memory.py (the 8B memory row, issue #32) in its CPU form: the
Llama-3.2-1B layout with two tiny layers, every configuration in its own subprocess; a
configuration that crashes is reported and loses none of the others."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "tools" / "flashoptim" / "llama_memory.py"


@pytest.mark.skipif(not SCRIPT.exists(), reason="needs the repository's tools/")
def test_llama_memory_smoke(tmp_path):
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    configs = "torch_adamw_bf16,not_a_config,flash_adamw,flash_adamw_release"
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--steps", "2", "--configs", configs]
    r = subprocess.run(cmd + ["--out", str(tmp_path)], env=env, capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr  # the crashed configuration fails the run
    res = json.loads((tmp_path / "llama-memory.json").read_text())
    rows = {row["config"]: row for row in res["rows"]}
    assert rows["not_a_config"]["status"].startswith("crashed")
    for c in ("torch_adamw_bf16", "flash_adamw", "flash_adamw_release"):
        assert rows[c]["status"] == "ok", rows[c]
        assert len(rows[c]["step_ms_all"]) == 2 and rows[c]["loss"] > 0
    # the checkpoint on disk: bf16 weights + bf16 AdamW states ~ 6 bytes/param; FlashAdamW's
    # 8-bit states, corrections and fp32 states of the 1-D norms: less
    assert (
        rows["flash_adamw"]["ckpt_bytes_per_param"]
        < rows["torch_adamw_bf16"]["ckpt_bytes_per_param"]
    )
    assert (
        res["meta"]["arch"]["kv_heads"] == 1
        and res["meta"]["params"] == rows["flash_adamw"]["params"]
    )
    assert "| flash_adamw |" in (tmp_path / "llama-memory.md").read_text()
