"""The disk tier's recency is a sequence kept beside its entries, not a clock: entries written or hit
within one tick of a coarse clock (here: a wall clock that never moves) are still evicted oldest first,
across two handles on one directory as across processes, and an index written with unix-time stamps
(version 1) is read back in its order."""

from __future__ import annotations

import json
import time

import pytest

from rag_promptcache.store import DiskStore
from rag_promptcache.store.codecs import encode
from rag_promptcache.store.serialize import dumps
from tests.store_helpers import key_of, make_kv


@pytest.fixture
def frozen_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)


def budget(entries: float) -> int:
    kv = make_kv(0)
    return int(entries * len(dumps(key_of(kv), encode(kv, "native"))))


def kept(store: DiskStore, kvs: list) -> list[int]:
    return [i for i, kv in enumerate(kvs) if store.contains(key_of(kv))]


def test_writes_and_hits_in_one_tick_evict_the_least_recent(tmp_path, frozen_wall_clock) -> None:
    kvs = [make_kv(i) for i in range(5)]
    store = DiskStore(tmp_path, max_bytes=budget(3.5))
    for kv in kvs[:3]:
        store.put(key_of(kv), kv)
    assert store.get(key_of(kvs[1])) is not None and store.get(key_of(kvs[0])) is not None  # 2 is now the oldest
    store.put(key_of(kvs[3]), kvs[3])
    assert kept(store, kvs) == [0, 1, 3]
    store.put(key_of(kvs[4]), kvs[4])
    assert kept(store, kvs) == [0, 3, 4]


def test_two_handles_on_one_directory_share_one_sequence(tmp_path, frozen_wall_clock) -> None:
    kvs = [make_kv(i) for i in range(4)]
    a, b = DiskStore(tmp_path, max_bytes=budget(3.5)), DiskStore(tmp_path, max_bytes=budget(3.5))
    a.put(key_of(kvs[0]), kvs[0])
    b.put(key_of(kvs[1]), kvs[1])
    a.put(key_of(kvs[2]), kvs[2])
    assert b.get(key_of(kvs[0])) is not None  # b's hit, made after a's write of 2
    b.put(key_of(kvs[3]), kvs[3])  # 1 is the least recent in both handles' numbers
    assert kept(a, kvs) == [0, 2, 3]
    index = json.loads((tmp_path / "index.json").read_text())
    stamps = sorted(e[2] for e in index["entries"].values())
    assert len(set(stamps)) == len(stamps) and index["seq"] >= stamps[-1]


def test_an_index_of_unix_times_is_read_in_its_order(tmp_path) -> None:
    kvs = [make_kv(i) for i in range(3)]
    store = DiskStore(tmp_path)
    for kv in kvs:
        store.put(key_of(kv), kv)
    store.close()
    index = json.loads((tmp_path / "index.json").read_text())
    used = {key_of(kvs[0]): 30.5, key_of(kvs[1]): 10.25, key_of(kvs[2]): 20.0}  # 1, then 2, then 0
    entries = {k: [b, t, used[k], h] for k, (b, t, _, h, _) in index["entries"].items()}
    (tmp_path / "index.json").write_text(json.dumps({"version": 1, "entries": entries}))
    again = DiskStore(tmp_path)
    assert again.evict_to(budget(1.5)) == [key_of(kvs[1]), key_of(kvs[2])]
