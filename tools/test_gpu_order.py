"""tools/gpu_order.py: the slowest GPU tests of the last run first, spread over xdist's
first batches; this run's times written back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gpu_order
import pytest

TOOLS = Path(gpu_order.__file__).resolve().parent


def test_spread_gives_each_worker_one_of_the_slowest_first():
    items = list(range(40))  # slowest first
    out = gpu_order.spread(items, workers=4, chunk=3)
    assert sorted(out) == items
    chunks = [out[w * 3 : w * 3 + 3] for w in range(4)]
    assert [c[0] for c in chunks] == [0, 1, 2, 3]  # the 4 slowest start at once
    assert [c[1] for c in chunks] == [4, 5, 6, 7]
    assert out[12:] == list(range(12, 40))  # the rest as workers ask, slowest first


def test_spread_leaves_small_runs_alone():
    assert gpu_order.spread([3, 2, 1], workers=4, chunk=2) == [3, 2, 1]
    assert gpu_order.spread(list(range(9)), workers=1, chunk=2) == list(range(9))


def test_chunk_follows_xdist_load_scheduler():
    assert gpu_order.xdist_chunk(111, 4, None) == 6  # 111 // 4 // 4
    assert gpu_order.xdist_chunk(111, 4, 1) == 2  # at least 2 pending per worker
    assert gpu_order.xdist_chunk(10, 8, None) == 2


def test_order_slowest_first_unknown_in_between_ties_stable():
    ids = ["fast", "new1", "slow", "mid", "new2", "tie"]
    times = {"fast": 0.1, "slow": 50.0, "mid": 5.0, "tie": 5.0}
    got = [ids[i] for i in gpu_order.order(ids, times, workers=0, chunk=2)]
    assert got == ["slow", "mid", "tie", "new1", "new2", "fast"]


def test_times_file_unreadable_or_malformed_is_empty(tmp_path):
    assert gpu_order.load_times(tmp_path / "missing.json") == {}
    for text in ("not json", "[]", '{"tests": 3}', '{"other": {}}'):
        (tmp_path / "bad.json").write_text(text)
        assert gpu_order.load_times(tmp_path / "bad.json") == {}
    (tmp_path / "ok.json").write_text('{"tests": {"a::t": 3, "b::t": 0.5}}')
    assert gpu_order.load_times(tmp_path / "ok.json") == {"a::t": 3.0, "b::t": 0.5}


def test_order_matches_xdist_first_batches():
    """The spread order against xdist's own LoadScheduling (its first sends)."""
    load = pytest.importorskip("xdist.scheduler.load")

    class Node:
        def __init__(self, name):
            self.gateway = type("G", (), {"id": name})()
            self.sent = []

        def send_runtest_some(self, idx):
            self.sent += idx

        def shutdown(self):
            pass

    class Config:
        def getoption(self, name):
            return {"maxschedchunk": None}.get(name, 0)

        def getvalue(self, name):
            return [f"{workers}*popen"] if name == "tx" else 0

    n, workers = 50, 4
    names = [f"t{i}" for i in range(n)]
    times = {name: float(i) for i, name in enumerate(names)}  # t49 slowest
    chunk = gpu_order.xdist_chunk(n, workers, None)
    order = [names[i] for i in gpu_order.order(names, times, workers, chunk)]
    sched = load.LoadScheduling(Config())
    nodes = [Node(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, order)
    sched.schedule()
    first = sorted(order[node.sent[0]] for node in nodes)
    assert first == sorted(names[-workers:])


def test_only_finished_tests_are_written(tmp_path, monkeypatch):
    """A test cut off before its teardown keeps its old time; a finished one gets the sum
    of its setup, call and teardown."""
    times = tmp_path / "t.json"
    times.write_text(json.dumps({"tests": {"cut::t": 300.0, "done::t": 50.0, "other::t": 7.0}}))
    monkeypatch.setenv(gpu_order.ENV, str(times))
    monkeypatch.setattr(gpu_order, "_partial", gpu_order.defaultdict(float))
    monkeypatch.setattr(gpu_order, "_seconds", {})

    class Report:
        def __init__(self, nodeid, when, duration):
            self.nodeid, self.when, self.duration = nodeid, when, duration

    for r in [("done::t", "setup", 0.5), ("done::t", "call", 1.0), ("done::t", "teardown", 0.25)]:
        gpu_order.pytest_runtest_logreport(Report(*r))
    gpu_order.pytest_runtest_logreport(Report("cut::t", "setup", 0.1))
    session = type("S", (), {"config": object()})()
    gpu_order.pytest_sessionfinish(session, exitstatus=2)
    assert gpu_order.load_times(times) == {"cut::t": 300.0, "done::t": 1.75, "other::t": 7.0}


SUITE = """
import pytest

@pytest.mark.parametrize("i", range(6))
def test_t(i):
    pass
"""


def _pytest(tmp_path, times, *args):
    (tmp_path / "test_suite.py").write_text(SUITE)
    # no entry-point plugins (hypothesis, ...): a faster start; xdist named where needed
    env = dict(os.environ, PYTHONPATH=str(TOOLS), GPU_TEST_TIMES=str(times))
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "gpu_order", "-p", "no:cacheprovider"]
        + ["-q", "--rootdir", str(tmp_path), "-c", os.devnull, *args, "test_suite.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_plugin_end_to_end(tmp_path):
    """A first run writes every test's time; the next collects the slowest first; a run of
    some tests updates theirs and keeps the others'."""
    times = tmp_path / "times" / "pkg.json"
    out = _pytest(tmp_path, times)
    assert "6 passed" in out
    recorded = gpu_order.load_times(times)
    assert sorted(recorded) == [f"test_suite.py::test_t[{i}]" for i in range(6)]
    assert all(v >= 0 for v in recorded.values())

    recorded = {f"test_suite.py::test_t[{i}]": float(i % 3) for i in range(6)}
    times.write_text(json.dumps({"tests": recorded}))
    out = _pytest(tmp_path, times, "--collect-only")
    collected = [line for line in out.splitlines() if line.startswith("test_suite.py::")]
    assert collected == [f"test_suite.py::test_t[{i}]" for i in (2, 5, 1, 4, 0, 3)]

    _pytest(tmp_path, times, "-k", "t[0] or t[1]")
    after = gpu_order.load_times(times)
    assert sorted(after) == sorted(recorded)
    for i in (2, 3, 4, 5):
        assert after[f"test_suite.py::test_t[{i}]"] == recorded[f"test_suite.py::test_t[{i}]"]
    assert after["test_suite.py::test_t[1]"] < 1.0  # rewritten with this run's time


def test_plugin_under_xdist_controller_writes(tmp_path):
    """Under xdist the workers sort alike (else xdist aborts the run) and the controller
    writes the times of every test."""
    pytest.importorskip("xdist")
    times = tmp_path / "pkg.json"
    old = {f"test_suite.py::test_t[{i}]": 100.0 + i for i in range(6)}
    times.write_text(json.dumps({"tests": old}))
    out = _pytest(tmp_path, times, "-p", "xdist.plugin", "-n", "2")
    assert "6 passed" in out
    new = gpu_order.load_times(times)
    assert sorted(new) == sorted(old)
    assert all(v < 100.0 for v in new.values())
