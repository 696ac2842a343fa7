"""Tests of tools/report.py (run by `nox -s lint`)."""

import json

import pytest
from report import load, tables_for


def _doc(tmp_path, results, schema="kernel-bench/1"):
    path = tmp_path / "bench.json"
    path.write_text(
        json.dumps(
            {
                "schema": schema,
                "package": "pkg",
                "package_version": "0.1",
                "command": "python -m pkg.bench",
                "env": {"gpu": "NVIDIA H200", "torch": "2.11"},
                "results": results,
            }
        )
    )
    return path


def _row(provider, time_ms, status="ok", **params):
    return {
        "bench": "op",
        "mode": "fwd",
        "provider": provider,
        "params": params,
        "status": status,
        "time_ms": time_ms,
        "metrics": {"gbps": 100.0} if provider == "ours" else {},
        "error": None if status == "ok" else "out of memory",
    }


def test_ratio_and_errors(tmp_path):
    path = _doc(
        tmp_path, [_row("ours", 2.0, n=8), _row("peer", 5.0, n=8), _row("peer", None, "error", n=9)]
    )
    text = tables_for(load([path])[0])
    assert "| n=8 | 2 | 5 | 2.50x | 100 |" in text
    assert "| n=9 | — | error | — | — |" in text
    assert "out of memory" in text
    assert "NVIDIA H200" in text and "python -m pkg.bench" in text


def test_rejects_other_schema(tmp_path):
    with pytest.raises(ValueError, match="schema"):
        load([_doc(tmp_path, [], schema="other")])
