"""The disk tier's hit and miss counts survive the process: `store info` (a new process) reports the
lookups of every process that used the store, added up safely when processes run at the same time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rag_promptcache.store import DiskStore, describe
from tests.store_helpers import key_of, make_kv

ROOT = Path(__file__).resolve().parents[1]

LOOKUPS = """
import sys
from rag_promptcache.store import disk
from tests.store_helpers import key_of, make_kv
path, hits, misses, close, flush_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "close", float(sys.argv[5])
disk.STATS_FLUSH_S = flush_s
store = disk.DiskStore(path)
for i in range(hits):
    assert store.get(key_of(make_kv(1))) is not None
for i in range(misses):
    assert store.get(key_of(make_kv(1000 + i))) is None
if close:
    store.close()
"""


def lookups(path: Path, hits: int, misses: int, close: bool = True, flush_s: float = 5.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOOKUPS, str(path), str(hits), str(misses),
                             "close" if close else "no", str(flush_s)], cwd=ROOT)


def test_counts_of_finished_processes_add_up(tmp_path):
    store = DiskStore(tmp_path)
    store.put(key_of(make_kv(1)), make_kv(1))
    for p in [lookups(tmp_path, 3, 2), lookups(tmp_path, 4, 1)]:
        assert p.wait() == 0
    info = describe(DiskStore(tmp_path))  # what `store info` prints, from a process that looked nothing up
    assert (info["num_hits"], info["num_misses"]) == (7, 3) and info["hit_rate"] == 0.7
    assert store.get(key_of(make_kv(1))) is not None
    assert store.stats().num_hits == 8  # this process's own lookup, not yet flushed, counts too


def test_concurrent_processes_lose_no_counts(tmp_path):
    DiskStore(tmp_path).put(key_of(make_kv(1)), make_kv(1))
    # flush on every lookup, without close: every count goes through the merge under the lock
    procs = [lookups(tmp_path, 40, 10, close=False, flush_s=0.0) for _ in range(4)]
    assert [p.wait() for p in procs] == [0] * 4
    stats = DiskStore(tmp_path).stats()
    assert (stats.num_hits, stats.num_misses) == (160, 40)


def test_unreadable_stats_file_restarts_from_zero(tmp_path):
    store = DiskStore(tmp_path)
    (tmp_path / "stats.json").write_text("{not json")
    assert store.stats().num_hits == 0
    store.get(key_of(make_kv(5)))
    store.close()
    assert DiskStore(tmp_path).stats().num_misses == 1


def test_counts_are_flushed_once_the_clock_passes_the_interval(tmp_path):
    from rag_promptcache.store import disk

    now = [0.0]
    store = DiskStore(tmp_path, clock=lambda: now[0])
    reader = DiskStore(tmp_path)  # another process's view: stats.json plus its own (zero) counts
    assert store.get(key_of(make_kv(1))) is None
    now[0] += disk.STATS_FLUSH_S - 0.01
    assert store.get(key_of(make_kv(2))) is None
    assert reader.stats().num_misses == 0  # not yet: lookups are counted in memory between flushes
    now[0] += 0.02
    assert store.get(key_of(make_kv(3))) is None
    assert reader.stats().num_misses == 3
