"""Turn benchmark JSON files (schema kernel-bench/1) into markdown tables and PNG plots.

    python tools/report.py results/gpu/bench-*.json            # rewrite docs/benchmarks.md
    python tools/report.py --stdout results/gpu/bench-*.json   # print the tables only
    python tools/report.py --plots docs/img results/gpu/*.json # also write PNG plots

Rows are grouped by package, bench, mode and params; each provider gets a time column,
and every peer gets the ratio peer_time / ours_time (above 1 means ours is faster).
The environment (GPU, versions) and the command that produced each file head its section.
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


def _time_cell(row: dict) -> str:
    if row.get("status") != "ok":
        return row.get("status", "?")
    return _fmt(row.get("time_ms"))


def tables_for(doc: dict) -> str:
    """Markdown for one JSON file: an environment line, then one table per (bench, mode)."""
    env = doc.get("env", {})
    peers = env.get("peers") or {}
    lines = [f"## {doc.get('package', '?')} {doc.get('package_version', '')}".rstrip(), ""]
    env_bits = [
        f"GPU: {env.get('gpu', 'none (CPU)')}",
        f"torch {env.get('torch', '?')}",
        f"triton {env.get('triton', '?')}",
        f"CUDA {env.get('cuda', '?')}",
        f"Python {env.get('python', '?')}",
        f"date {env.get('date', '?')}",
    ]
    if peers:
        env_bits.append("peers: " + ", ".join(f"{k} {v}" for k, v in peers.items()))
    lines += ["; ".join(env_bits) + ".", "", f"Command: `{doc.get('command', '?')}`", ""]

    groups: OrderedDict[tuple, list[dict]] = OrderedDict()
    for row in doc.get("results", []):
        groups.setdefault((row.get("bench"), row.get("mode")), []).append(row)

    for (bench, mode), rows in groups.items():
        providers = list(OrderedDict.fromkeys(r.get("provider") for r in rows))
        peers_here = [p for p in providers if p != OURS]
        metric_keys = list(
            OrderedDict.fromkeys(
                k for r in rows if r.get("provider") == OURS for k in (r.get("metrics") or {})
            )
        )
        by_params: OrderedDict[str, dict[str, dict]] = OrderedDict()
        for r in rows:
            by_params.setdefault(_params_key(r.get("params", {})), {})[r.get("provider")] = r
        title = f"### {bench}" + (f" ({mode})" if mode else "")
        header = ["params"] + [f"{p} ms" for p in providers]
        if OURS in providers:
            header += [f"{p} / ours" for p in peers_here]
            header += [f"ours {k}" for k in metric_keys]
        lines += [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for params, by_provider in by_params.items():
            cells = [params] + [
                _time_cell(by_provider[p]) if p in by_provider else "—" for p in providers
            ]
            ours = by_provider.get(OURS)
            if OURS in providers:
                for p in peers_here:
                    peer = by_provider.get(p)
                    ok = (
                        ours
                        and peer
                        and ours.get("status") == "ok"
                        and peer.get("status") == "ok"
                        # accuracy-only rows (e.g. hvp_accuracy) are "ok" without a time
                        and ours.get("time_ms") is not None
                        and peer.get("time_ms") is not None
                    )
                    cells.append(f"{peer['time_ms'] / ours['time_ms']:.2f}x" if ok else "—")
                metrics = (ours or {}).get("metrics") or {}
                cells += [_fmt(metrics.get(k)) for k in metric_keys]
            lines.append("| " + " | ".join(cells) + " |")
        errors = [r for r in rows if r.get("status") == "error"]
        for r in errors:
            where = _params_key(r.get("params", {}))
            lines.append(f"\n- error, {r.get('provider')} {where}: {r.get('error')}")
        lines.append("")
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
        if row.get("status") == "ok" and row.get("time_ms"):
            groups.setdefault((row.get("bench"), row.get("mode")), []).append(row)
    for (bench, mode), rows in groups.items():
        params = list(OrderedDict.fromkeys(_params_key(r.get("params", {})) for r in rows))
        # tick labels name only the parameters that vary within this plot
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
        gpu = doc.get("env", {}).get("gpu", "CPU")
        ax.set_title(f"{doc.get('package')} {bench} {mode or ''} — {gpu}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"{doc.get('package')}-{bench}-{mode or 'all'}.png".replace(" ", "_")
        path = outdir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


HEADER = """# Benchmarks

Generated by `python tools/report.py {files}` from the JSON written by each package's
benchmark CLI on the GPU host (`tools/gpu_run.sh OUTDIR`, see docs/architecture.md).
Times are medians of CUDA-event timings in milliseconds; `peer / ours` above 1 means ours
is faster. Each section names its GPU, versions and the command that produced it.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--stdout", action="store_true", help="print tables, write nothing")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--plots", type=Path, default=None, help="folder for PNG plots")
    parser.add_argument("--note", default="", help="markdown paragraph put under the header")
    args = parser.parse_args(argv)
    docs = load(args.files)
    body = "\n".join(tables_for(d) for d in docs)
    if args.stdout:
        print(body)
        return 0
    names = " ".join(Path(d["_path"]).name for d in docs)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
