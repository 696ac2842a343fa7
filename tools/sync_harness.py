"""Write tools/harness.py into each package as <package>/_harness.py (byte-identical).

python tools/sync_harness.py           # write the copies
python tools/sync_harness.py --check   # exit 1 if a copy differs (tools/test_harness.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tools" / "harness.py"
COPIES = [
    ROOT / "packages" / "flashsinkhorn" / "src" / "flashsinkhorn" / "_harness.py",
    ROOT / "packages" / "mhc-proj" / "src" / "mhc_proj" / "_harness.py",
    ROOT / "packages" / "flashoptim" / "src" / "flashoptim_fused" / "_harness.py",
]


def stale_copies() -> list[Path]:
    text = SOURCE.read_bytes()
    return [p for p in COPIES if not p.exists() or p.read_bytes() != text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="report differing copies, write none")
    args = ap.parse_args(argv)
    stale = stale_copies()
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} differs from tools/harness.py")
        return 1 if stale else 0
    for path in stale:
        path.write_bytes(SOURCE.read_bytes())
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
