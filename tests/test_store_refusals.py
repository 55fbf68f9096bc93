"""Stores that refuse writes never fail the request: real redis-servers that refuse (maxmemory with
noeviction, a read-only replica, an ACL user without write permission) and real directories that
refuse (a read-only bind mount, a full tmpfs). The answer equals an engine's with a healthy store,
the failure is counted in `num_write_errors` and logged once, and stored entries are still read."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

from rag_promptcache.engine import PromptCache
from rag_promptcache.store import DiskStore, MemoryStore, RedisStore
from tests.store_helpers import LocalRedis, needs_redis
from tests.tiny import build

SCHEMA = """<schema name="s">
  <module name="a">The quick brown fox jumps over the lazy dog near the river bank.</module>
  <module name="b">Paris is the capital of France, and the Seine runs through it.</module>
</schema>"""
ONLY_A = '<prompt schema="s"><a/> What jumps?</prompt>'
BOTH = '<prompt schema="s"><a/><b/> Where?</prompt>'


@pytest.fixture(scope="module")
def model(tokenizer):
    return build("llama", vocab_size=len(tokenizer))


@pytest.fixture(scope="module")
def expected(model, tokenizer):
    pc = PromptCache(model, tokenizer, store=MemoryStore(), recovery="none", fallback="never")
    pc.add_schema(SCHEMA)
    return pc.generate(BOTH, max_new_tokens=4).token_ids


def engine(model, tokenizer, store) -> PromptCache:
    pc = PromptCache(model, tokenizer, store=store, recovery="none", fallback="never")
    pc.add_schema(SCHEMA)
    return pc


def check_refused(pc: PromptCache, expected, caplog, logged: str) -> None:
    """`a` is stored, writes are refused now: `b` is computed each time, never stored, logged once."""
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            res = pc.generate(BOTH, max_new_tokens=4)
            assert res.token_ids == expected
            assert res.hit_modules == ("a",) and res.missed_modules == ("b",)  # reads keep working
    stats = pc.store.stats()
    assert stats.num_write_errors >= 2 and stats.num_hits >= 2
    assert len([r for r in caplog.records if logged in r.getMessage()]) == 1, caplog.text


@contextlib.contextmanager
def server(*extra: str):
    with LocalRedis("--dir", tempfile.mkdtemp(prefix="rpc-redis-"), *extra) as s:  # a replica saves its copy
        yield s


@needs_redis
def test_redis_at_maxmemory_with_noeviction(model, tokenizer, expected, caplog):
    with server("--maxmemory-policy", "noeviction") as s:
        pc = engine(model, tokenizer, RedisStore(s.url))
        pc.generate(ONLY_A, max_new_tokens=1)  # stores the root and `a`
        redis.Redis.from_url(s.url).config_set("maxmemory", 1)  # now full: every write is OOM
        check_refused(pc, expected, caplog, "refuses writes (OutOfMemoryError)")


@needs_redis
def test_redis_read_only_replica(model, tokenizer, expected, caplog):
    with server() as primary:
        writer = engine(model, tokenizer, RedisStore(primary.url))
        writer.generate(ONLY_A, max_new_tokens=1)
        with server("--replicaof", "127.0.0.1", str(primary.port)) as replica:
            store = RedisStore(replica.url)
            deadline = time.monotonic() + 20
            while store.stats().num_entries < 1 and time.monotonic() < deadline:  # `a`, replicated
                time.sleep(0.1)
            assert store.stats().num_entries == 1, "the replica did not sync"
            check_refused(engine(model, tokenizer, store), expected, caplog, "refuses writes (ReadOnlyError)")


@needs_redis
def test_redis_user_without_write_permission(model, tokenizer, expected, caplog):
    with server() as s:
        engine(model, tokenizer, RedisStore(s.url)).generate(ONLY_A, max_new_tokens=1)
        redis.Redis.from_url(s.url).acl_setuser("reader", enabled=True, passwords=["+pw"], keys=["*"],
                                                 commands=["+@read", "+@connection"])
        url = f"redis://reader:pw@127.0.0.1:{s.port}/0"
        check_refused(engine(model, tokenizer, RedisStore(url)), expected, caplog, "refuses writes (NoPermissionError)")
        # a user who may not even read: every read is a miss, and the answer is still the same
        redis.Redis.from_url(s.url).acl_setuser("nobody", enabled=True, passwords=["+pw"], keys=["*"],
                                                 commands=["+@connection"])
        blind = engine(model, tokenizer, RedisStore(f"redis://nobody:pw@127.0.0.1:{s.port}/0"))
        res = blind.generate(BOTH, max_new_tokens=4)
        assert res.token_ids == expected and set(res.missed_modules) == {"a", "b"}
        assert blind.store.stats().num_misses >= 2


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount here ({done.stderr.strip()}); a read-only or full directory needs a mount, "
                    "since root writes through chmod")


def test_disk_read_only_directory(model, tokenizer, expected, caplog, tmp_path):
    root = tmp_path / "store"
    engine(model, tokenizer, DiskStore(root)).generate(ONLY_A, max_new_tokens=1)
    _mount("--bind", str(root), str(root))
    try:
        _mount("-o", "remount,bind,ro", str(root))
        with pytest.raises(OSError):
            (root / "probe").write_text("x")  # really read-only, even for root
        check_refused(engine(model, tokenizer, DiskStore(root)), expected, caplog, "cannot write")
    finally:
        subprocess.run(["umount", str(root)], check=True)


def test_disk_full(model, tokenizer, expected, caplog, tmp_path):
    root = tmp_path / "small"
    root.mkdir()
    _mount("-t", "tmpfs", "-o", "size=512k", "tmpfs", str(root))
    try:
        pc = engine(model, tokenizer, DiskStore(root / "store"))
        pc.generate(ONLY_A, max_new_tokens=1)
        with contextlib.suppress(OSError), open(root / "filler", "wb", buffering=0) as f:
            while True:  # take every byte left
                f.write(b"\0" * 4096)
        check_refused(pc, expected, caplog, "disk full")
        assert DiskStore(root / "store").get(pc.store_keys("s", ["a"])["a"])
    finally:
        subprocess.run(["umount", str(root)], check=True)
