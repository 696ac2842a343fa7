"""Compare the SASS of the kernels in two builds of mhc_proj._cuda, kernel by kernel.

    python tools/mhc-proj/sass_diff.py OLD.so NEW.so [--rename OLD_REGEX=NEW ...]

Dumps each module with ``cuobjdump -sass`` (the one in the triton wheel, or CUOBJDUMP=path)
and compares every kernel's instructions and their 128-bit encodings (control bits
included), ignoring only the instruction addresses. Kernels are matched by their demangled
names after the ``--rename`` substitutions (Python regular expressions applied to the old
build's names, in order), so a kernel whose template parameters were renamed can be matched
to its successor. Prints one line per kernel (identical / DIFFERENT / only in one build) and
exits 1 if a matched kernel differs. The check that a refactor left the compiled default
kernels unchanged (docs/design/mhc-proj.md, "Keeping the kernels unchanged").
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


def cuobjdump() -> str:
    env = os.environ.get("CUOBJDUMP")
    if env:
        return env
    try:
        import triton

        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if not found:
        sys.exit("cuobjdump not found: set CUOBJDUMP or install triton")
    return found


def demangle(names: list[str]) -> list[str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return out.stdout.splitlines() if out.returncode == 0 else names


def kernels(so: str) -> dict[str, list[str]]:
    """Demangled kernel name -> its instructions with their encodings, addresses stripped."""
    text = subprocess.run([cuobjdump(), "-sass", so], capture_output=True, text=True, check=True)
    funcs: dict[str, list[str]] = {}
    current = None
    for line in text.stdout.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = m.group(1)
            funcs[current] = []
            continue
        if current is None:
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*/\* (0x[0-9a-f]+) \*/", line)
        if m:
            funcs[current].append(f"{m.group(1)} {m.group(2)}")
            continue
        m = re.match(r"\s*/\* (0x[0-9a-f]+) \*/\s*$", line)  # second encoding word
        if m and funcs[current]:
            funcs[current][-1] += " " + m.group(1)
    names = list(funcs)
    return dict(zip(demangle(names), (funcs[n] for n in names)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD_REGEX=NEW")
    args = ap.parse_args(argv)
    old, new = kernels(args.old), kernels(args.new)
    renamed = {}
    for name, code in old.items():
        for rule in args.rename:
            pattern, repl = rule.split("=", 1)
            name = re.sub(pattern, repl, name)
        renamed[name] = code
    status = 0
    for name in sorted(set(renamed) | set(new)):
        if name not in new:
            print(f"only in old: {name} ({len(renamed[name])} instructions)")
        elif name not in renamed:
            print(f"only in new: {name} ({len(new[name])} instructions)")
        elif renamed[name] == new[name]:
            print(f"identical:   {name} ({len(new[name])} instructions)")
        else:
            status = 1
            print(f"DIFFERENT:   {name} ({len(renamed[name])} -> {len(new[name])} instructions)")
    return status


if __name__ == "__main__":
    sys.exit(main())
