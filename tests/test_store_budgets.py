"""Byte budgets on every tier: Redis' per-prefix budget shared by replicas, a disk budget lowered between
runs, an entry larger than a tier's whole budget (a clear log line, never an error)."""

from __future__ import annotations

import logging
import uuid

import pytest

from rag_promptcache.store import DiskStore, MemoryStore, RedisStore
from rag_promptcache.store.serialize import dumps
from rag_promptcache.store.codecs import encode
from store_helpers import key_of, make_kv


def size(kv, codec: str = "native") -> int:
    return len(dumps(key_of(kv), encode(kv, codec)))


def test_redis_budget_holds_across_two_replicas_and_evicts_least_recent(redis_server) -> None:
    kvs = [make_kv(i) for i in range(6)]
    one = size(kvs[0])
    prefix = uuid.uuid4().hex[:8]
    a = RedisStore(redis_server.url, prefix=prefix, max_bytes=3 * one + one // 2)
    b = RedisStore(redis_server.url, prefix=prefix, max_bytes=3 * one + one // 2)  # another replica
    try:
        a.put(key_of(kvs[0]), kvs[0])
        b.put(key_of(kvs[1]), kvs[1])
        a.put(key_of(kvs[2]), kvs[2])
        assert b.get(key_of(kvs[0])) is not None  # 0 used again: 1 is now the least recent
        b.put(key_of(kvs[3]), kvs[3])
        assert not a.contains(key_of(kvs[1])) and all(a.contains(key_of(kvs[i])) for i in (0, 2, 3))
        assert a.stats().num_bytes == a.budget.total() <= a.max_bytes
        a.put(key_of(kvs[3]), kvs[3])  # the same entry again: counted once
        assert a.budget.total() == 3 * one and a.stats().num_entries == 3
        assert a.delete(key_of(kvs[2])) and a.budget.total() == 2 * one
    finally:
        a.close()
        b.close()


def test_redis_cost_policy_keeps_the_entry_used_most(redis_server) -> None:
    kvs = [make_kv(i) for i in range(4)]
    one = size(kvs[0])
    store = RedisStore(redis_server.url, prefix=uuid.uuid4().hex[:8], max_bytes=2 * one, policy="cost")
    try:
        store.put(key_of(kvs[0]), kvs[0])
        store.put(key_of(kvs[1]), kvs[1])
        for _ in range(3):
            assert store.get(key_of(kvs[0])) is not None  # hot, but written first
        store.put(key_of(kvs[2]), kvs[2])
        assert store.contains(key_of(kvs[0])) and not store.contains(key_of(kvs[1]))
    finally:
        store.close()


def test_an_entry_larger_than_a_tiers_budget_is_logged_and_not_cached(redis_server, tmp_path, caplog) -> None:
    kv = make_kv(1)
    small = size(kv) // 2
    stores = [MemoryStore(max_bytes=small), DiskStore(tmp_path, max_bytes=small),
              RedisStore(redis_server.url, prefix=uuid.uuid4().hex[:8], max_bytes=small)]
    with caplog.at_level(logging.WARNING):
        for store in stores:
            store.put(key_of(kv), kv)
            store.put(key_of(kv), kv)
            assert store.get(key_of(kv)) is None and store.stats().num_bytes == 0
            store.close()
    lines = [r.getMessage() for r in caplog.records if "larger than the whole budget" in r.getMessage()]
    assert len(lines) == 3, lines  # once per tier, not once per put


def test_a_disk_budget_lowered_between_runs_is_held_when_opened(tmp_path) -> None:
    kvs = [make_kv(i) for i in range(5)]
    one = size(kvs[0])
    store = DiskStore(tmp_path)
    for kv in kvs:
        store.put(key_of(kv), kv)
    assert store.get(key_of(kvs[0])) is not None  # 0 is the most recent now
    store.close()
    smaller = DiskStore(tmp_path, max_bytes=2 * one)
    assert smaller.stats().num_bytes <= 2 * one
    assert sorted(smaller.keys()) == sorted([key_of(kvs[0]), key_of(kvs[4])])
    smaller.close()
    assert DiskStore(tmp_path).stats().num_entries == 2  # the files went too, not only the index rows


def test_redis_budget_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="at least 1 byte"):
        RedisStore("redis://127.0.0.1:1/0", max_bytes=0)
