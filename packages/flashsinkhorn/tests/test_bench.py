"""bench.py: every case of the GPU suite runs on tiny CPU problems (torch backend) and
writes ok rows with the expected labels, so a GPU run does not find a broken case; the
suite selection; the smoke CLI writes kernel-bench/1 JSON."""

import json

import pytest
import torch

from flashsinkhorn import _harness as H
from flashsinkhorn import bench

CPU = torch.device("cpu")


def _rows(case, providers=("ours", "geomloss")):
    R = H.Results("flashsinkhorn", "test", CPU)
    peers = bench._peers(set(providers))
    bench.run_case(R, case, CPU, set(providers), peers, bench.MODES, 1, 1)
    return R.rows


@pytest.mark.parametrize(
    "case",
    [
        ("iter", 64, 3, "it"),
        ("loss", 60, 3, "loss"),
        ("loss_debias", 60, 3, None),
        ("loss_batched", 40, 2, None),
        ("loss_ref", 60, 3, "ref"),
        ("large", 80, 2, None),
        ("hvp", 50, 3, "hvp"),
        ("passes", 64, 3, None),
        ("sample", 64, 3, "sample"),
    ],
)
def test_every_case_runs_on_cpu(case):
    rows = _rows(case)
    ours = [r for r in rows if r["provider"].startswith("ours")]
    # (time_ms is a difference of two timings in the iteration case: noise on a CPU)
    assert ours and all(r["status"] == "ok" and r["time_ms"] is not None for r in ours), ours
    labelled = [r for r in rows if r.get("headline")]
    assert all(r["provider"] == "ours" for r in labelled)
    if case[3]:
        assert labelled and {r["headline"] for r in labelled} == {case[3]}
    if case[0] == "loss_ref":
        err = ours[0]["accuracy"][bench.ACCURACY_KEY]
        assert 0 <= err < 1e-5  # torch backend, float32 against float64
        geo = next(r for r in rows if r["provider"] == "geomloss")
        assert geo["status"] == "ok" and geo["accuracy"][bench.ACCURACY_KEY] < 1e-5


def test_suite_selection():
    assert bench.select_cases(None) == bench.SUITE
    assert [c[0] for c in bench.select_cases("iter:1024,large")] == ["iter", "large"]
    assert bench.select_cases("iter:1024")[0][1:3] == (50000, 1024)
    assert len(bench.select_cases("iter")) == 3
    assert bench.select_cases("loss:10000:3")[0][1:3] == (10000, 3)
    with pytest.raises(ValueError, match="unknown case"):
        bench.select_cases("sweep")
    kinds = {c[0] for c in bench.SUITE}
    assert kinds == {"iter", "loss", "loss_debias", "loss_batched", "loss_ref", "hvp", "sample"}
    assert all(c[3] for c in bench.SUITE)  # every default case feeds the headline table


def test_smoke_cli_writes_json(tmp_path):
    out = tmp_path / "b.json"
    assert bench.main(["--smoke", "--json", str(out), "--providers", "ours"]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "kernel-bench/1" and doc["package"] == "flashsinkhorn"
    assert {r["bench"] for r in doc["results"]} == {
        "samples_loss",
        "sinkhorn_iteration",
        "plan_sample",
    }
    assert all(r["status"] == "ok" for r in doc["results"])
