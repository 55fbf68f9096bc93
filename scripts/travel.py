#!/usr/bin/env python3
"""What a call of the device tool carries, in bytes, against its limit.

A call sends the working tree (tracked files and untracked files git does not ignore) plus the ignored
paths it names in `carry`, 64 MiB in all. The tree itself takes a share of every call, so what may be
carried is the limit less the tree, and it shrinks as the repository grows.

    python scripts/travel.py [--carry PATH ...] [--limit-mib 64]
    python scripts/travel.py split FILE DIR [--limit-mib 64]

The first prints the tree's bytes, each carried path's and what is left, and exits 1 when they do not
fit (`make gpu-wheels` runs it on .whl). `split` cuts FILE into parts that each fit one call beside the
tree, DIR/c1/part_1, DIR/c2/part_2, ..., the first part sized to fit beside what DIR/c1 already holds
(`scripts/tune_on_gpu.sh prep`: the model file is larger than one call carries).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

LIMIT = 64 * 2**20
# what the call's own files, a log or two and a change made during the session may add
MARGIN = 2 * 2**20


def tree_bytes(root: Path) -> int:
    """Tracked files plus untracked files that git does not ignore, as they are on disk."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout
    total = 0
    for name in {n for n in out.decode().split("\0") if n}:
        path = root / name
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def room(root: Path, limit: int = LIMIT, margin: int = MARGIN) -> int:
    """Bytes a call can carry beside this tree."""
    return limit - margin - tree_bytes(root)


def split(path: Path, into: Path, root: Path, limit: int = LIMIT, margin: int = MARGIN) -> list[Path]:
    """Cut `path` into `into`/cN/part_N so that each cN fits one call beside the tree (c1 beside what it
    holds already). Parts joined in order give the file back."""
    free = room(root, limit, margin)
    first = free - (path_bytes(into / "c1") if (into / "c1").exists() else 0)
    if first <= 0 or free <= 0:
        raise SystemExit(f"travel: no room for a part beside the tree ({free / 2**20:.1f} MiB free a call)")
    parts, n = [], 0
    with path.open("rb") as src:
        while chunk := src.read(first if n == 0 else free):
            n += 1
            part = into / f"c{n}" / f"part_{n}"
            part.parent.mkdir(parents=True, exist_ok=True)
            part.write_bytes(chunk)
            parts.append(part)
    return parts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["split"]:
        sp = argparse.ArgumentParser(prog="python scripts/travel.py split")
        sp.add_argument("file", type=Path)
        sp.add_argument("into", type=Path)
        sp.add_argument("--limit-mib", type=float, default=LIMIT / 2**20)
        sp.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
        a = sp.parse_args(argv[1:])
        for part in split(a.file, a.into, a.root, int(a.limit_mib * 2**20)):
            print(part)
        return 0
    ap = argparse.ArgumentParser(prog="python scripts/travel.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--carry", nargs="*", default=[], help="paths the call carries, relative to the root")
    ap.add_argument("--limit-mib", type=float, default=LIMIT / 2**20)
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = ap.parse_args(argv)
    limit = int(args.limit_mib * 2**20)
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    tree = tree_bytes(args.root)
    print(f"tree: {mib(tree)}")
    total = tree
    for name in args.carry:
        path = args.root / name
        if not path.exists():
            print(f"{name}: missing", file=sys.stderr)
            return 2
        size = path_bytes(path)
        total += size
        print(f"{name}: {mib(size)}")
    left = limit - MARGIN - total
    print(f"in all: {mib(total)} of {mib(limit)} ({mib(MARGIN)} kept spare): {mib(left)} left")
    if left < 0:
        print(f"travel: a call would carry {mib(total)}, over the device tool's {mib(limit)} less "
              f"{mib(MARGIN)} spare: carry less or shrink the tree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GIT_OPTIONAL_LOCKS", "0")
    sys.exit(main())
