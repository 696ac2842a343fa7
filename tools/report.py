"""Turn benchmark JSON (schema kernel-bench/1) into docs/benchmarks.md and README tables.

    python tools/report.py docs/results/*/*.json              # rewrite docs/benchmarks.md
    python tools/report.py --readmes docs/results/*/*.json    # also the package READMEs
    python tools/report.py --stdout OUTDIR/bench-*.json       # print, write nothing
    python tools/report.py --plots docs/img docs/results/*/*.json

Per package, first a headline table: one line per case whose ``ours`` row carries a
``headline`` label (the bench CLI chooses them), with ours, the fastest peer measured in
the same run, their ratio (above 1: ours is faster), the fraction of the hardware floor
or copy ceiling, peak memory and the first accuracy figure. Then one detail table per
(bench, mode): one time column per provider and the ratio of each peer to ours.
``--readmes`` writes the headline table of each package between the lines
``<!-- headline-table:begin -->`` and ``<!-- headline-table:end -->`` of its README.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import OrderedDict
from pathlib import Path

SCHEMA = "kernel-bench/1"
OURS = "ours"
ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- headline-table:begin -->", "<!-- headline-table:end -->"
# Metrics worth a detail-table column, in this order (others stay in the JSON).
DETAIL_METRICS = ["frac_floor", "frac_ceiling", "gbps", "peak_mem_mib"]


def load(paths: list[Path]) -> list[dict]:
    docs = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"{path}: schema must be {SCHEMA!r}, got {doc.get('schema')!r}")
        doc["_path"] = str(path)
        docs.append(doc)
    return docs


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.2e}"
        return f"{value:.{digits}g}"
    return str(value)


def _params_key(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _ok_time(row: dict | None) -> float | None:
    if row and row.get("status") == "ok" and row.get("time_ms"):
        return row["time_ms"]
    return None


def _time_cell(row: dict) -> str:
    if row.get("status") != "ok":
        return row.get("status", "?")
    return _fmt(row.get("time_ms"))


def _cases(doc: dict) -> OrderedDict:
    """(bench, mode, params key) -> {provider: row}, in first-seen order."""
    cases: OrderedDict[tuple, dict] = OrderedDict()
    for row in doc.get("results", []):
        key = (row.get("bench"), row.get("mode"), _params_key(row.get("params", {})))
        cases.setdefault(key, {})[row.get("provider")] = row
    return cases


def environment_line(doc: dict) -> str:
    env = doc.get("env", {})
    bits = [
        f"GPU: {env.get('gpu') or 'none (CPU)'}",
        f"torch {env.get('torch', '?')}",
        f"triton {env.get('triton', '?')}",
        f"CUDA {env.get('cuda', '?')}",
        f"Python {env.get('python', '?')}",
        f"date {env.get('date', '?')}",
    ]
    peers = env.get("peers") or {}
    if peers:
        bits.append("peers: " + ", ".join(f"{k} {v}" for k, v in peers.items()))
    return "; ".join(bits) + "."


def headline_table(doc: dict) -> str:
    """The package's headline cases: ours, the best peer, ratio, fraction of the floor."""
    header = ["case", "ours ms", "best peer", "peer ms", "peer / ours", "of floor", "peak MiB"]
    header.append("accuracy")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    cases = [c for c in _cases(doc).values() if (c.get(OURS) or {}).get("headline")]
    labels = [c[OURS]["headline"] for c in cases]
    for by_provider in cases:
        ours = by_provider[OURS]
        # our own variants (ours-bf16, ...) are not peers
        peers = [(p, _ok_time(r)) for p, r in by_provider.items() if not p.startswith(OURS)]
        timed = [(t, p) for p, t in peers if t is not None]
        best_t, best = min(timed) if timed else (None, None)
        ours_t = _ok_time(ours)
        ratio = f"{best_t / ours_t:.2f}x" if (best_t and ours_t) else "—"
        if best is None:
            best = "(none ran)" if peers else "—"
        metrics = ours.get("metrics") or {}
        frac = metrics.get("frac_floor", metrics.get("frac_ceiling"))
        acc = ours.get("accuracy") or {}
        acc_cell = "; ".join(f"{k} {_fmt(v)}" for k, v in list(acc.items())[:1]) or "—"
        label = ours["headline"]
        if labels.count(label) > 1 and ours.get("mode"):  # the same case in several modes
            label = f"{label}, {ours['mode'].replace('_', '+')}"
        cells = [
            label,
            _time_cell(ours),
            best,
            _fmt(best_t),
            ratio,
            _fmt(frac, 2),
            _fmt(metrics.get("peak_mem_mib")),
            acc_cell,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if len(lines) == 2:
        return ""
    return "\n".join(lines)


def detail_tables(doc: dict) -> str:
    """One table per (bench, mode): a time column per provider, each peer's ratio to ours."""
    groups: OrderedDict[tuple, list[dict]] = OrderedDict()
    for (bench, mode, _), by_provider in _cases(doc).items():
        groups.setdefault((bench, mode), []).append(by_provider)
    out = []
    for (bench, mode), cases in groups.items():
        providers = list(OrderedDict.fromkeys(p for c in cases for p in c))
        peers = [p for p in providers if p != OURS]
        has_ours = OURS in providers
        present = {k for c in cases for k in ((c.get(OURS) or {}).get("metrics") or {})}
        metric_keys = [k for k in DETAIL_METRICS if k in present]
        header = ["params"] + [f"{p} ms" for p in providers]
        if has_ours:
            header += [f"{p} / ours" for p in peers] + [f"ours {k}" for k in metric_keys]
        lines = [f"### {bench}" + (f" ({mode})" if mode else ""), ""]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        errors = []
        for by_provider in cases:
            any_row = next(iter(by_provider.values()))
            cells = [_params_key(any_row.get("params", {}))]
            cells += [_time_cell(by_provider[p]) if p in by_provider else "—" for p in providers]
            if has_ours:
                ours_t = _ok_time(by_provider.get(OURS))
                for p in peers:
                    peer_t = _ok_time(by_provider.get(p))
                    cells.append(f"{peer_t / ours_t:.2f}x" if (peer_t and ours_t) else "—")
                metrics = (by_provider.get(OURS) or {}).get("metrics") or {}
                cells += [_fmt(metrics.get(k)) for k in metric_keys]
            lines.append("| " + " | ".join(cells) + " |")
            errors += [r for r in by_provider.values() if r.get("status") == "error"]
        for r in errors:
            where = _params_key(r.get("params", {}))
            lines.append(f"\n- error, {r.get('provider')} {where}: {r.get('error')}")
        out.append("\n".join(lines) + "\n")
    return "\n".join(out)


def tables_for(doc: dict) -> str:
    """The section of one JSON file: package, environment, command, headline, details."""
    title = f"## {doc.get('package', '?')} {doc.get('package_version', '')}".rstrip()
    lines = [title, "", environment_line(doc), "", f"Command: `{doc.get('command', '?')}`", ""]
    head = headline_table(doc)
    if head:
        lines += ["Headline:", "", head, ""]
    lines += [detail_tables(doc)]
    return "\n".join(lines)


def plot(doc: dict, outdir: Path) -> list[Path]:
    """One PNG per (package, bench, mode): time per params set, one bar per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    groups: OrderedDict[tuple, list[dict]] = OrderedDict()
    for row in doc.get("results", []):
        if _ok_time(row):
            groups.setdefault((row.get("bench"), row.get("mode")), []).append(row)
    for (bench, mode), rows in groups.items():
        params = list(OrderedDict.fromkeys(_params_key(r.get("params", {})) for r in rows))
        keys = OrderedDict.fromkeys(k for r in rows for k in r.get("params", {}))
        varying = [k for k in keys if len({str(r.get("params", {}).get(k)) for r in rows}) > 1]
        labels = {
            _params_key(r.get("params", {})): ", ".join(
                f"{k}={r['params'].get(k)}" for k in varying
            )
            or _params_key(r.get("params", {}))
            for r in rows
        }
        providers = list(OrderedDict.fromkeys(r.get("provider") for r in rows))
        width = 0.8 / max(len(providers), 1)
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(params) + 3), 4))
        for i, provider in enumerate(providers):
            times = {
                _params_key(r.get("params", {})): r["time_ms"]
                for r in rows
                if r.get("provider") == provider
            }
            xs = [j + i * width for j, p in enumerate(params) if p in times]
            ys = [times[p] for p in params if p in times]
            ax.bar(xs, ys, width=width, label=provider)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(params))])
        ax.set_xticklabels([labels[p] for p in params], rotation=20, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("time (ms, log scale)")
        gpu = doc.get("env", {}).get("gpu") or "CPU"
        ax.set_title(f"{doc.get('package')} {bench} {mode or ''} — {gpu}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"{doc.get('package')}-{bench}-{mode or 'all'}.png".replace(" ", "_")
        path = outdir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def replace_between_markers(text: str, table: str) -> str | None:
    """``text`` with the lines between the headline markers replaced by ``table``, or None
    when the markers are missing."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return None
    return text[: start + len(BEGIN)] + "\n" + table.rstrip() + "\n" + text[end:]


def write_readmes(docs: list[dict]) -> list[Path]:
    written = []
    for doc in docs:
        package = doc.get("package", "")
        readme = ROOT / "packages" / package / "README.md"
        table = headline_table(doc)
        if not table or not readme.exists():
            continue
        note = f"\n\n{environment_line(doc)} Command: `{doc.get('command', '?')}`."
        new = replace_between_markers(readme.read_text(), table + note)
        if new is not None:
            readme.write_text(new)
            written.append(readme)
    return written


def _display_path(path: str) -> str:
    """A path relative to the repository root where it lies inside it."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


HEADER = """# Benchmarks

Generated by `python tools/report.py {files}` from the JSON that each package's benchmark
CLI wrote on the GPU host (`tools/gpu_run.sh OUTDIR`, see docs/architecture.md). Times are
medians of CUDA-event timings in milliseconds; `peer / ours` above 1 means ours is faster;
"of floor" is the hardware floor of the case (bytes at the measured copy rate, or the
operations at the measured tensor-core and special-function rates) over our time. Each
package's headline table comes first, then its detail tables.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--stdout", action="store_true", help="print tables, write nothing")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--readmes", action="store_true", help="update the package READMEs")
    parser.add_argument("--plots", type=Path, default=None, help="folder for PNG plots")
    parser.add_argument("--note", default="", help="markdown paragraph put under the header")
    args = parser.parse_args(argv)
    docs = load(args.files)
    body = "\n".join(tables_for(d) for d in docs)
    if args.stdout:
        print(body)
        return 0
    names = " ".join(_display_path(d["_path"]) for d in docs)
    text = HEADER.format(files=names) + ("\n" + args.note + "\n" if args.note else "")
    text += "\n" + body
    if args.plots:
        images = [p for d in docs for p in plot(d, args.plots)]
        if images:
            text += "\n## Plots\n\n"
            for image in images:
                rel = Path("img") / image.name if args.plots.name == "img" else image
                text += f"![{image.stem}]({rel})\n\n"
    args.out.write_text(text)
    print(f"wrote {args.out}")
    if args.readmes:
        for readme in write_readmes(docs):
            print(f"wrote {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
