"""Run every ```python block of the READMEs and docs pages, as a reader would.

    python tools/run_doc_blocks.py flashsinkhorn      # the pages of one package
    python tools/run_doc_blocks.py --all-packages     # pages that use several packages
    python tools/run_doc_blocks.py --list             # which page belongs to which package

A page's blocks run in order in one namespace (later blocks may use earlier names), in a
fresh interpreter per page, from a temporary folder, on the CPU. Pages belong to the
package whose name starts their file name: ``packages/<pkg>/README.md``,
``docs/<pkg>*.md``, ``docs/design/<pkg>*.md``; the root README and the other docs pages
belong to all packages together (``--all-packages``, run where all three are installed).
Blocks fenced as ```text, ```bash or anything but ```python are not run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["flashsinkhorn", "mhc-proj", "flashoptim"]
ALL = "all"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)


def pages() -> list[Path]:
    found = [ROOT / "README.md"]
    found += sorted((ROOT / "packages").glob("*/README.md"))
    found += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "design").glob("*.md"))
    return [p for p in found if p.exists()]


def owner(page: Path) -> str:
    rel = page.relative_to(ROOT)
    if rel.parts[0] == "packages":
        return rel.parts[1]
    for pkg in PACKAGES:
        if page.name.startswith(pkg):
            return pkg
    return ALL


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block."""
    blocks = []
    for match in FENCE.finditer(text):
        info = match.group(1).strip().split()
        if info and info[0] == "python":
            line = text.count("\n", 0, match.start(2)) + 1
            blocks.append((line, match.group(2)))
    return blocks


def program(page: Path) -> str:
    """One script that runs the page's blocks in order and names the failing one."""
    parts = ["import sys, traceback", "__ns = {'__name__': '__main__'}"]
    for line, code in python_blocks(page.read_text()):
        where = f"{page.relative_to(ROOT)}:{line}"
        parts.append(
            "try:\n"
            f"    exec(compile({code!r}, {where!r}, 'exec'), __ns)\n"
            "except BaseException:\n"
            f"    print('block at {where} failed:', file=sys.stderr)\n"
            "    traceback.print_exc()\n"
            "    sys.exit(1)"
        )
    return "\n".join(parts) + "\n"


def run_page(page: Path, timeout: float) -> tuple[bool, float, str]:
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")
    env["CUDA_VISIBLE_DEVICES"] = ""  # as written on a CPU machine, also on a GPU host
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            done = subprocess.run(
                [sys.executable, "-c", program(page)],
                cwd=tmp,
                env=env,
                timeout=timeout,
                capture_output=True,
                text=True,
            )
        except subprocess.TimeoutExpired:
            return False, time.perf_counter() - t0, f"timed out after {timeout:.0f} s"
    return done.returncode == 0, time.perf_counter() - t0, done.stdout + done.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", nargs="?", choices=PACKAGES)
    ap.add_argument("--all-packages", action="store_true", help="the pages of no one package")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per page")
    args = ap.parse_args(argv)
    if args.list:
        for page in pages():
            n = len(python_blocks(page.read_text()))
            print(f"{owner(page):14s} {n:3d} blocks  {page.relative_to(ROOT)}")
        return 0
    want = ALL if args.all_packages else args.package
    if want is None:
        ap.error("name a package or pass --all-packages")
    failed = 0
    for page in pages():
        if owner(page) != want or not python_blocks(page.read_text()):
            continue
        ok, seconds, output = run_page(page, args.timeout)
        print(f"{'ok  ' if ok else 'FAIL'} {seconds:6.1f} s  {page.relative_to(ROOT)}")
        if not ok:
            failed += 1
            print(output[-4000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
