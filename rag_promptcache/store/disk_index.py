"""The disk tier's `index.json`: its entries' sizes, last use and hits, the use sequence and the
greedy-dual aging value, read into a `BudgetIndex` and written back. Pure Python. Not here: when to
read or write it, the lock around it, or rebuilding it from the files (disk.py).

Versions: 1 numbered uses by unix time (read, renumbered in that order); 2 by a sequence; 3 adds the
aging value (`Entry.inflation`, `BudgetIndex.inflation`; read from 1 and 2 as zero).
"""

from __future__ import annotations

import json

from .eviction import BudgetIndex, Entry, Policy

INDEX_VERSION = 3


def parse(raw: dict, max_bytes: int | None, policy: str | Policy) -> BudgetIndex:
    """The index from index.json's contents; ValueError (KeyError, TypeError) when it is not one."""
    version = raw.get("version")
    if version not in (1, 2, INDEX_VERSION):
        raise ValueError(f"index version {version!r}, expected {INDEX_VERSION}")
    rows = [(key, int(row[0]), int(row[1]), float(row[2]), int(row[3]), float(row[4]) if version == 3 else 0.0)
            for key, row in raw["entries"].items()]
    if version == 1:  # unix-time stamps: renumbered in their order, ties by key
        rows = [(k, b, t, i, h, a) for i, (k, b, t, _, h, a) in enumerate(sorted(rows, key=lambda r: (r[3], r[0])), 1)]
    index = BudgetIndex(max_bytes, policy, seq=int(raw.get("seq", 0)), inflation=float(raw.get("inflation", 0.0)))
    for key, num_bytes, num_tokens, last_used, num_hits, inflation in rows:
        index.load(Entry(key, num_bytes, num_tokens, int(last_used), num_hits, inflation))
    return index


def dumps(index: BudgetIndex) -> str:
    entries = {e.key: [e.num_bytes, e.num_tokens, e.last_used, e.num_hits, e.inflation] for e in index.entries.values()}
    return json.dumps({"version": INDEX_VERSION, "seq": index.seq, "inflation": index.inflation, "entries": entries})
