"""The benchmark harness shared by the three packages' bench CLIs.

This file is the single source. Each package vendors a byte-identical copy as
``<package>/_harness.py`` (a package installs alone, so it cannot import tools/);
``python tools/sync_harness.py`` writes the copies and ``tools/test_harness.py`` fails
when one differs. Edit only ``tools/harness.py``.

What it gives a bench CLI:

- :func:`parser`: the common flags (``--smoke``, ``--json``, ``--providers``, ``--mode``,
  ``--warmup``, ``--reps``, ``--device``) that every ``<pkg>-bench`` accepts;
- :func:`time_fn`: median / 20th / 80th percentile in ms (CUDA events on a GPU, the wall
  clock on a CPU) after warm-up, and the peak memory the timed calls allocated beyond what
  was held before them;
- :func:`copy_ceiling_gbps`: the device-to-device copy rate measured in this process
  (bytes read + written), the ceiling memory-bound rows are a fraction of;
- :class:`Results`: collects kernel-bench/1 rows; ``results.run(...)`` times one case,
  turns out-of-memory into ``skipped`` and any other exception into ``error`` (the run goes
  on), fills ``gbps`` / ``frac_ceiling`` from a byte count and ``frac_floor`` from a floor
  time, and ``results.save()`` rewrites the JSON after every row, so a run killed at its
  time limit keeps what it measured;
- :func:`environment`: GPU, versions, date and the peers' versions;
- :func:`markdown`: the table printed at the end of a run, one line per row with the
  ratio of each provider's time to ``ours``.

Row fields (schema ``kernel-bench/1``, docs/architecture.md): ``bench``, ``provider``
(``ours``, or the peer's distribution name), ``mode`` (``fwd``, ``bwd``, ``fwd_bwd``,
``step``, ...), ``params``, ``status``, ``time_ms``, ``time_ms_p20``, ``time_ms_p80``,
``metrics``, ``accuracy``, ``error`` and, on the ``ours`` row of a case that belongs in
the package's headline table, ``headline``: the label of that line (``tools/report.py``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

SCHEMA = "kernel-bench/1"
OURS = "ours"


# ----------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _percentiles(times: list[float]) -> tuple[float, float, float]:
    if len(times) == 1:
        return times[0], times[0], times[0]
    q = statistics.quantiles(times, n=5, method="inclusive")
    return statistics.median(times), q[0], q[-1]


def time_fn(
    fn: Callable[[], object], device: torch.device, *, warmup: int = 3, reps: int = 20
) -> dict:
    """Time ``fn()``: ``{"time_ms", "time_ms_p20", "time_ms_p80", "peak_mem_mib"}``.

    Each of ``reps`` calls is timed alone (CUDA events around it on a GPU, so launch gaps
    inside ``fn`` count and the host's queueing ahead of it does not); ``warmup`` calls
    first keep compilation, autotuning and allocator growth out of the numbers.
    ``peak_mem_mib`` is the most memory the timed calls held beyond what was allocated
    before them (None on a CPU).
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1; got {reps}")
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    peak = None
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    median, p20, p80 = _percentiles(times)
    return {"time_ms": median, "time_ms_p20": p20, "time_ms_p80": p80, "peak_mem_mib": peak}


def cuda_graph(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """Capture ``fn()`` in a CUDA graph (after two warm-up calls on a side stream, where
    lazy initialisation and autotuning happen) and return its replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay() -> None:
        replay.graph.replay()

    replay.graph = graph  # the graph and its memory pool live as long as the replay
    return replay


def copy_ceiling_gbps(device: torch.device, nbytes: int = 2**31) -> float | None:
    """Device-to-device copy rate in GB/s (bytes read + written), measured here; the
    ceiling that memory-bound rows report a fraction of. None on a CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device, warmup=3, reps=20)
    return 2 * nbytes / (timing["time_ms"] * 1e-3) / 1e9


# ----------------------------------------------------------------------------------------
# environment
# ----------------------------------------------------------------------------------------


def distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name`` (e.g. ``flash-sinkhorn``), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device, peers: Iterable[str] = ()) -> dict:
    """GPU, library versions, date, and the installed version of each peer distribution."""
    env = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "triton": distribution_version("triton"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "peers": {p: v for p in peers if (v := distribution_version(p)) is not None},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["sm_count"] = props.multi_processor_count
    return env


# ----------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


class Skip(Exception):
    """Raise inside a case to record it as ``skipped`` with this message."""


class Results:
    """The rows of one bench run, saved as kernel-bench/1 JSON after every row."""

    def __init__(self, package: str, version: str, device: torch.device, peers=()):
        self.package = package
        self.version = version
        self.device = device
        self.rows: list[dict] = []
        self.path: Path | None = None
        self.env = environment(device, peers)
        self.command = " ".join(["python -m", f"{package.replace('-', '_')}.bench"] + sys.argv[1:])

    def add(
        self,
        bench: str,
        provider: str,
        mode: str,
        params: dict,
        *,
        timing: dict | None = None,
        metrics: dict | None = None,
        accuracy: dict | None = None,
        status: str = "ok",
        error: str | None = None,
        headline: str | None = None,
    ) -> dict:
        """Append one row (and rewrite the JSON if :meth:`save` named a path)."""
        if status not in ("ok", "skipped", "error"):
            raise ValueError(f"status must be ok, skipped or error; got {status!r}")
        timing = timing or {}
        metrics = dict(metrics or {})
        if timing.get("peak_mem_mib") is not None:
            metrics.setdefault("peak_mem_mib", timing["peak_mem_mib"])
        row = {
            "bench": bench,
            "provider": provider,
            "mode": mode,
            "params": params,
            "status": status,
            "time_ms": timing.get("time_ms"),
            "time_ms_p20": timing.get("time_ms_p20"),
            "time_ms_p80": timing.get("time_ms_p80"),
            "metrics": metrics,
            "accuracy": accuracy or {},
            "error": error,
        }
        if headline is not None:
            row["headline"] = headline
        self.rows.append(row)
        if self.path is not None:
            self._write()
        return row

    def run(
        self,
        bench: str,
        provider: str,
        mode: str,
        params: dict,
        make: Callable[[], Callable[[], object]],
        *,
        warmup: int = 3,
        reps: int = 20,
        bytes_moved: float | None = None,
        ceiling_gbps: float | None = None,
        floor_ms: float | None = None,
        metrics: Callable[[], dict] | dict | None = None,
        accuracy: Callable[[], dict] | dict | None = None,
        headline: str | None = None,
    ) -> dict:
        """Time one case and record it.

        ``make()`` builds the inputs and returns the callable to time (so allocation and
        set-up are not timed and a failure there is recorded too). ``bytes_moved`` (the
        ideal kernel's bytes per call) gives ``gbps`` and, with ``ceiling_gbps``,
        ``frac_ceiling``; ``floor_ms`` (the hardware floor of the case) gives
        ``frac_floor = floor_ms / time_ms``. ``metrics`` / ``accuracy`` may be callables
        evaluated after timing. Out of memory is recorded as ``skipped``, a :class:`Skip`
        with its message, any other exception as ``error``; the run goes on.
        """
        fn = None
        try:
            fn = make()
            timing = time_fn(fn, self.device, warmup=warmup, reps=reps)
            m = dict(metrics() if callable(metrics) else (metrics or {}))
            t = timing["time_ms"]
            if bytes_moved is not None and t:
                m["gbps"] = bytes_moved / (t * 1e-3) / 1e9
                if ceiling_gbps:
                    m["frac_ceiling"] = m["gbps"] / ceiling_gbps
            if floor_ms is not None and t:
                m["floor_ms"] = floor_ms
                m["frac_floor"] = floor_ms / t
            acc = accuracy() if callable(accuracy) else accuracy
            return self.add(
                bench,
                provider,
                mode,
                params,
                timing=timing,
                metrics=m,
                accuracy=acc,
                headline=headline,
            )
        except Skip as e:
            return self.add(bench, provider, mode, params, status="skipped", error=str(e))
        except Exception as e:  # record and go on: one failing case must not end the run
            status = "skipped" if _is_oom(e) else "error"
            message = f"{type(e).__name__}: {e}"[:500]
            return self.add(bench, provider, mode, params, status=status, error=message)
        finally:
            del fn
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def document(self) -> dict:
        return {
            "schema": SCHEMA,
            "package": self.package,
            "package_version": self.version,
            "command": self.command,
            "env": self.env,
            "results": self.rows,
        }

    def save(self, path: str | Path | None) -> None:
        """Write the JSON to ``path`` now and after every later row (None: do nothing)."""
        if path is None:
            return
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.document(), indent=1, default=str))
        tmp.replace(self.path)


# ----------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------


def fmt(value, digits: int = 3) -> str:
    """A number for a table: 3 significant digits, scientific when tiny or huge."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, float | int):
        return str(value)
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.2e}"
    return f"{value:.{digits}g}"


def _case_key(row: dict) -> tuple:
    return row["bench"], row["mode"], json.dumps(row["params"], sort_keys=True)


def markdown(rows: list[dict], accuracy_key: str | None = None) -> str:
    """One line per row: time, the ratio provider / ours in the same case (above 1: ours is
    faster), fraction of the floor or of the copy ceiling, peak memory, one accuracy value."""
    ours = {_case_key(r): r["time_ms"] for r in rows if r["provider"] == OURS and r["time_ms"]}
    head = ["bench", "mode", "params", "provider", "ms", "/ ours", "of floor", "peak MiB"]
    if accuracy_key:
        head.append(accuracy_key)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t = r["time_ms"]
        base = ours.get(_case_key(r))
        ratio = f"{t / base:.2f}x" if (t and base and r["provider"] != OURS) else "-"
        m = r.get("metrics") or {}
        frac = m.get("frac_floor", m.get("frac_ceiling"))
        params = " ".join(f"{k}={v}" for k, v in r["params"].items())
        cells = [
            r["bench"],
            r["mode"],
            params,
            r["provider"],
            fmt(t) if r["status"] == "ok" else r["status"],
            ratio,
            fmt(frac),
            fmt(m.get("peak_mem_mib")),
        ]
        if accuracy_key:
            cells.append(fmt((r.get("accuracy") or {}).get(accuracy_key)))
        lines.append("| " + " | ".join(cells) + " |")
    errors = [r for r in rows if r["status"] != "ok" and r.get("error")]
    lines += [f"- {r['status']}: {r['bench']} {r['provider']}: {r['error']}" for r in errors]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------


def parser(prog: str, description: str, providers: list[str], modes: list[str]):
    """The flags every bench CLI shares; a package adds its own size flags to the result.

    ``--providers`` defaults to all of ``providers`` (those not importable are recorded as
    skipped); ``--mode`` to all of ``modes``.
    """
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes that run on a CPU (CI)")
    ap.add_argument("--json", metavar="PATH", help="write kernel-bench/1 JSON here")
    ap.add_argument(
        "--providers",
        nargs="+",
        default=list(providers),
        choices=providers,
        metavar="NAME",
        help=f"which to run (default: all): {' '.join(providers)}",
    )
    ap.add_argument(
        "--mode",
        nargs="+",
        default=list(modes),
        choices=modes,
        metavar="MODE",
        help=f"which to run (default: all): {' '.join(modes)}",
    )
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls before timing")
    ap.add_argument("--reps", type=int, default=None, help="timed calls (median reported)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    return ap


def device_of(args) -> torch.device:
    if args.device:
        return torch.device(args.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
