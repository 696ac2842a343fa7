"""Tests of tools/harness.py and of its vendored copies (run by `nox -s lint`)."""

import json

import pytest
import torch
from harness import Results, Skip, fmt, markdown, parser, time_fn
from sync_harness import stale_copies

CPU = torch.device("cpu")


def test_copies_are_identical():
    stale = stale_copies()
    assert not stale, f"run `python tools/sync_harness.py`: {stale}"


def test_time_fn_counts_calls_and_orders_percentiles():
    calls = []
    timing = time_fn(lambda: calls.append(1), CPU, warmup=2, reps=7)
    assert len(calls) == 9
    assert timing["time_ms_p20"] <= timing["time_ms"] <= timing["time_ms_p80"]
    assert timing["peak_mem_mib"] is None
    with pytest.raises(ValueError, match="reps"):
        time_fn(lambda: None, CPU, reps=0)


def test_run_records_ok_skip_error_and_oom(tmp_path):
    res = Results("pkg", "0.1", CPU)
    path = tmp_path / "out.json"
    res.save(path)
    res.run(
        "op",
        "ours",
        "fwd",
        {"n": 8},
        lambda: lambda: None,
        reps=3,
        bytes_moved=1e6,
        ceiling_gbps=100.0,
        floor_ms=1e-9,
        headline="op n=8",
    )
    res.run("op", "peer", "fwd", {"n": 8}, lambda: lambda: None, reps=3)

    def skip():
        raise Skip("peer not importable")

    def fail():
        raise RuntimeError("boom")

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")

    res.run("op", "peer2", "fwd", {"n": 8}, skip)
    res.run("op", "peer3", "fwd", {"n": 8}, fail)
    res.run("op", "peer4", "fwd", {"n": 8}, oom)
    doc = json.loads(path.read_text())  # rewritten after every row
    assert doc["schema"] == "kernel-bench/1" and doc["package"] == "pkg"
    rows = doc["results"]
    assert [r["status"] for r in rows] == ["ok", "ok", "skipped", "error", "skipped"]
    assert rows[0]["headline"] == "op n=8" and "headline" not in rows[1]
    m = rows[0]["metrics"]
    assert m["gbps"] > 0 and m["frac_ceiling"] == pytest.approx(m["gbps"] / 100.0)
    assert m["frac_floor"] == pytest.approx(1e-9 / rows[0]["time_ms"])
    assert rows[3]["error"] == "RuntimeError: boom" and rows[3]["time_ms"] is None
    table = markdown(rows)
    assert "| op | fwd | n=8 | peer |" in table and "x |" in table
    assert "- error: op peer3: RuntimeError: boom" in table


def test_add_rejects_unknown_status():
    with pytest.raises(ValueError, match="status"):
        Results("pkg", "0.1", CPU).add("op", "ours", "fwd", {}, status="fine")


def test_fmt():
    assert fmt(None) == "-" and fmt(1.23456) == "1.23" and fmt(1e-5) == "1.00e-05"
    assert fmt(float("nan")) == "nan" and fmt("x") == "x" and fmt(3) == "3"


def test_parser_common_flags():
    ap = parser("pkg-bench", "d", ["ours", "peer"], ["fwd", "bwd"])
    args = ap.parse_args(["--smoke", "--providers", "ours", "--json", "a.json"])
    assert args.smoke and args.providers == ["ours"] and args.mode == ["fwd", "bwd"]
    with pytest.raises(SystemExit):
        ap.parse_args(["--providers", "nobody"])
