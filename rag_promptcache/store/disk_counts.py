"""The disk tier's counters kept across processes in `stats.json`: hits, misses, and the entries found
corrupt (counted, the last `MAX_CORRUPT_KEPT` named with why and when), so `store info` and `store
verify` in another process see what a request found. Pure Python: a record, its sum, and reading and
writing the file (atomically). Not here: when to write it, or the lock around it (disk.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

STATS_VERSION = 1
MAX_CORRUPT_KEPT = 100  # corrupt entries stats.json names (its count covers all of them)


@dataclass(slots=True)
class Counts:
    num_hits: int = 0
    num_misses: int = 0
    num_corrupt: int = 0
    corrupt: list[dict[str, object]] = field(default_factory=list)  # {"key", "why", "at" (unix time)}, oldest first

    def __bool__(self) -> bool:
        return bool(self.num_hits or self.num_misses or self.num_corrupt)

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.num_hits + other.num_hits, self.num_misses + other.num_misses,
                      self.num_corrupt + other.num_corrupt, [*self.corrupt, *other.corrupt][-MAX_CORRUPT_KEPT:])


def read(path: Path) -> Counts:
    """The counts in `path`; zeros when it does not exist. ValueError (or KeyError, TypeError) when it is
    not a stats file of this version."""
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        return Counts()
    if raw.get("version") != STATS_VERSION:
        raise ValueError(f"stats version {raw.get('version')!r}, expected {STATS_VERSION}")
    # files written before corrupt entries were counted have neither field
    return Counts(int(raw["num_hits"]), int(raw["num_misses"]), int(raw.get("num_corrupt", 0)), list(raw.get("corrupt", [])))


def write(path: Path, counts: Counts) -> None:
    """Replace `path` with `counts` atomically; OSError when the directory refuses (nothing left behind)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    data = {"version": STATS_VERSION, "num_hits": counts.num_hits, "num_misses": counts.num_misses,
            "num_corrupt": counts.num_corrupt, "corrupt": counts.corrupt}
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
