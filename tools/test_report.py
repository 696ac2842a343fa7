"""Tests of tools/report.py (run by `nox -s lint`)."""

import json

import pytest
from report import BEGIN, END, headline_table, load, replace_between_markers, tables_for


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


def _row(provider, time_ms, status="ok", headline=None, **params):
    row = {
        "bench": "op",
        "mode": "fwd",
        "provider": provider,
        "params": params,
        "status": status,
        "time_ms": time_ms,
        "metrics": {"gbps": 100.0, "frac_floor": 0.5} if provider == "ours" else {},
        "accuracy": {"rel_err_vs_f64": 1e-7} if provider == "ours" else {},
        "error": None if status == "ok" else "out of memory",
    }
    if headline:
        row["headline"] = headline
    return row


def test_detail_ratio_and_errors(tmp_path):
    rows = [_row("ours", 2.0, n=8), _row("peer", 5.0, n=8), _row("peer", None, "error", n=9)]
    text = tables_for(load([_doc(tmp_path, rows)])[0])
    assert "| n=8 | 2 | 5 | 2.50x | 0.5 | 100 |" in text
    assert "| n=9 | — | error | — | — | — |" in text
    assert "out of memory" in text
    assert "NVIDIA H200" in text and "python -m pkg.bench" in text


def test_headline_picks_fastest_peer(tmp_path):
    rows = [
        _row("ours", 2.0, headline="op at n=8", n=8),
        _row("slow", 9.0, n=8),
        _row("fast", 4.0, n=8),
        _row("broken", None, "error", n=8),
        _row("ours", 1.0, n=9),  # no headline label: not in the headline table
    ]
    table = headline_table(load([_doc(tmp_path, rows)])[0])
    assert "| op at n=8 | 2 | fast | 4 | 2.00x | 0.5 | — | rel_err_vs_f64 1.00e-07 |" in table
    assert "n=9" not in table


def test_headline_without_peers(tmp_path):
    rows = [_row("ours", 2.0, headline="alone", n=8), _row("peer", None, "skipped", n=8)]
    table = headline_table(load([_doc(tmp_path, rows)])[0])
    assert "| alone | 2 | (none ran) | — | — |" in table
    assert headline_table(load([_doc(tmp_path, [_row("ours", 1.0, n=1)])])[0]) == ""


def test_readme_markers():
    text = f"intro\n{BEGIN}\nold\n{END}\nrest\n"
    assert replace_between_markers(text, "| new |") == f"intro\n{BEGIN}\n| new |\n{END}\nrest\n"
    assert replace_between_markers("no markers", "x") is None


def test_rejects_other_schema(tmp_path):
    with pytest.raises(ValueError, match="schema"):
        load([_doc(tmp_path, [], schema="other")])
