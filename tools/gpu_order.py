"""pytest plugin of tools/gpu_run.sh: each test's time is recorded, and the slowest of the
last run start first in the next.

    GPU_TEST_TIMES=FILE.json python3 -m pytest -p gpu_order ...   (tools/ on PYTHONPATH)

A GPU test run is compile-bound and pytest-xdist hands tests out in collection order, so a
test that compiles for minutes but is collected last runs alone at the end while the other
workers idle. With ``GPU_TEST_TIMES`` set this plugin

* orders the collected tests by the seconds (setup + call + teardown) that FILE gives each,
  slowest first (ties and tests missing from FILE keep pytest's order after the known ones
  of more than ``DEFAULT`` seconds), and spreads the slowest over xdist's first batches:
  xdist's ``load`` scheduler sends each worker a chunk of consecutive tests to start with
  (``min(N / W / 4, --maxschedchunk)``, at least 2), so the k-th slowest test goes to the
  first slot of worker k's chunk, the next W to the second slots, and so on; the rest follow
  slowest first as workers ask for more;
* writes this run's times back into FILE when the session ends (tests that did not run or
  finish, e.g. cut off by a time limit, keep their old entry), so the next run orders by
  them.

``tools/gpu_run.sh`` keeps one FILE per package with the compile caches (carried between
device calls) and copies it into OUTDIR. Without the variable, or with an unreadable FILE,
the plugin changes nothing.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

ENV = "GPU_TEST_TIMES"
# seconds given to a test FILE does not know (new since it was written): after the tests
# known to be slow, before the known fast ones
DEFAULT = 2.0


def load_times(path: Path) -> dict[str, float]:
    """FILE's ``{"tests": {node id: seconds}}``; empty when absent or unreadable."""
    try:
        tests = json.loads(path.read_text())["tests"]
        return {str(k): float(v) for k, v in tests.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def xdist_chunk(n_items: int, workers: int, maxschedchunk: int | None) -> int:
    """The size of the first batch each worker gets from xdist's ``load`` scheduler."""
    per_node = n_items // workers
    return max(min(per_node // 4, maxschedchunk or n_items), 2)


def spread(items: list, workers: int, chunk: int) -> list:
    """``items`` (slowest first) so that xdist's first batches take them round robin."""
    n = len(items)
    if workers <= 1 or n < 2 * workers:  # xdist then sends one test at a time, in order
        return items
    first = min(chunk * workers, n)
    slots = [None] * first
    it = iter(items)
    for j in range(chunk):  # slot j of every worker's chunk, worker by worker
        for w in range(workers):
            pos = w * chunk + j
            if pos < first:
                slots[pos] = next(it)
    return slots + list(it)


def order(node_ids: list[str], times: dict[str, float], workers: int, chunk: int) -> list[int]:
    """Indices of ``node_ids`` in the order to run them."""
    ranked = sorted(range(len(node_ids)), key=lambda i: (-times.get(node_ids[i], DEFAULT), i))
    return spread(ranked, workers, chunk)


def pytest_collection_modifyitems(session, config, items):
    path = os.environ.get(ENV)
    if not path or not items:
        return
    times = load_times(Path(path))
    if not times:
        return
    # every xdist worker collects and sorts alike (the same FILE, read before any test
    # ran): xdist checks that the collections are identical
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    chunk = 0
    if workers > 1:
        chunk = xdist_chunk(len(items), workers, config.getoption("maxschedchunk", None))
    idx = order([item.nodeid for item in items], times, workers, chunk)
    items[:] = [items[i] for i in idx]


_partial: defaultdict[str, float] = defaultdict(float)  # tests under way
_seconds: dict[str, float] = {}  # this run's finished tests


def pytest_runtest_logreport(report):
    # on the xdist controller too: it replays every worker's reports. Only a test that
    # finished (its teardown reported) counts: one cut off by the time limit would
    # otherwise replace its long time with the seconds it had before the cut.
    _partial[report.nodeid] += report.duration
    if report.when == "teardown":
        _seconds[report.nodeid] = _partial.pop(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(ENV)
    if not path or hasattr(session.config, "workerinput") or not _seconds:
        return  # xdist workers leave the writing to the controller
    path = Path(path)
    times = load_times(path)
    times.update({k: round(v, 2) for k, v in _seconds.items()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"tests": dict(sorted(times.items()))}, indent=0))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable FILE costs the next run its order, not this run its result
