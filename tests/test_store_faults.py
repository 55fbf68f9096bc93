"""Faults each tier must survive: every one ends in a miss or a clear error, never wrong KV."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from tests.store_helpers import LocalRedis, free_port, key_of, make_kv, needs_redis

from rag_promptcache.store import DiskStore, ModuleKV, RedisStore, Store, verify
from rag_promptcache.store import disk as disk_module

REPO = Path(__file__).resolve().parents[1]


# -- disk faults ----------------------------------------------------------------------------------


@pytest.fixture
def disk_entry(tmp_path: Path):
    store = DiskStore(tmp_path / "s")
    kv = make_kv(3)
    store.put(key_of(kv), kv)
    return store, kv, store.path_for(key_of(kv))


def test_truncated_file_is_a_miss_and_removed(disk_entry) -> None:
    store, kv, path = disk_entry
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert store.get(key_of(kv)) is None
    assert not path.exists() and store.stats().num_errors == 1
    store.put(key_of(kv), kv)
    assert torch.equal(store.get(key_of(kv)).keys, kv.keys)


@pytest.mark.parametrize("where", ["tensor data", "header"])
def test_flipped_byte_is_a_miss(disk_entry, where: str, caplog) -> None:
    store, kv, path = disk_entry
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    pos = len(data) - 5 if where == "tensor data" else 8 + header_len - 40  # inside the metadata JSON
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert store.get(key_of(kv)) is None
        assert store.get(key_of(kv)) is None
    assert sum("bad entry" in r.message for r in caplog.records) == 1  # once per key


def test_file_from_another_model_is_a_miss(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    ours, theirs = make_kv(5), make_kv(5, fingerprint="model-b")
    store.put(key_of(theirs), theirs)
    target = store.path_for(key_of(ours))
    target.parent.mkdir(exist_ok=True)
    shutil.copy(store.path_for(key_of(theirs)), target)
    assert store.get(key_of(ours)) is None
    assert store.get(key_of(theirs)) is not None


def test_missing_or_corrupt_index_is_rebuilt(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    kvs = [make_kv(i) for i in range(3)]
    for kv in kvs:
        store.put(key_of(kv), kv)
    before = store.stats()
    store.close()
    (tmp_path / "index.json").unlink()
    again = DiskStore(tmp_path)
    assert again.stats().num_entries == 3 and again.stats().num_bytes == before.num_bytes
    (tmp_path / "index.json").write_text("{not json")
    third = DiskStore(tmp_path)
    assert third.stats().num_entries == 3
    assert torch.equal(third.get(key_of(kvs[1])).values, kvs[1].values)


def test_full_disk_drops_the_put_and_logs_once(tmp_path: Path, monkeypatch, caplog) -> None:
    def write_half_then_fail(path: Path, data: bytes) -> None:
        with open(path, "xb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    store = DiskStore(tmp_path)
    monkeypatch.setattr(disk_module, "_write_bytes", write_half_then_fail)
    kvs = [make_kv(i) for i in range(3)]
    with caplog.at_level(logging.WARNING):
        for kv in kvs:
            store.put(key_of(kv), kv)  # no exception into generation
    assert sum("disk full" in r.message for r in caplog.records) == 1
    assert not list(tmp_path.glob("??/.tmp-*")) and not list(tmp_path.glob("??/*.safetensors"))
    assert store.get(key_of(kvs[0])) is None and store.stats().num_errors == 3
    monkeypatch.undo()
    store.put(key_of(kvs[0]), kvs[0])
    assert store.get(key_of(kvs[0])) is not None


def test_verify_reports_and_removes_bad_entries(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    kvs = [make_kv(i) for i in range(3)]
    for kv in kvs:
        store.put(key_of(kv), kv)
    path = store.path_for(key_of(kvs[1]))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    report = verify(store)
    assert report.num_checked == 3 and report.bad_keys == (key_of(kvs[1]),)
    assert store.stats().num_entries == 2


def _run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=timeout)


def test_a_second_process_reads_what_the_first_wrote(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, codec="int8")
    kvs = [make_kv(i) for i in range(3)]
    for kv in kvs:
        store.put(key_of(kv), kv)
    store.close()
    out = _run_python(f"""
        import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from tests.store_helpers import key_of, make_kv
        from rag_promptcache.store import DiskStore, MemoryStore, TieredStore
        store = TieredStore([MemoryStore(), DiskStore({str(tmp_path)!r}, codec="int8")])
        for i in range(3):
            kv = make_kv(i)
            got = store.get(key_of(kv))
            assert got is not None and got.token_ids == kv.token_ids, i
            assert ((got.keys - kv.keys).norm() / kv.keys.norm()) < 0.02
        print("hits", store.tiers[1].stats().num_hits, "entries", store.tiers[1].stats().num_entries)
    """)
    assert out.returncode == 0, out.stderr
    assert "hits 3 entries 3" in out.stdout


def race_writer(kind: str, where: str, seed: int, key: str, n: int) -> None:
    store = racing_store(kind, where)
    kv = make_kv(seed, num_tokens=64)
    kv = ModuleKV(kv.keys, kv.values, 0, tuple(range(64)), "model-a", "alone")
    for _ in range(n):
        store.put(key, kv)


def racing_store(kind: str, where: str) -> Store:
    if kind == "disk":
        return DiskStore(where)
    return RedisStore(where, prefix="race", chunk_bytes=4096)


@pytest.mark.parametrize("kind", ["disk", pytest.param("redis", marks=needs_redis)])
def test_two_writers_racing_on_one_key(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    where = str(tmp_path) if kind == "disk" else request.getfixturevalue("redis_server").url
    variants = []
    for seed in (11, 12):
        kv = make_kv(seed, num_tokens=64)
        variants.append(ModuleKV(kv.keys, kv.values, 0, tuple(range(64)), "model-a", "alone"))
    key = key_of(variants[0])
    assert key == key_of(variants[1])
    # fork: the writers start at once. Their tensors are far below torch's parallel grain size,
    # so no OpenMP pool is touched in the children.
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=race_writer, args=(kind, where, seed, key, 60)) for seed in (11, 12)]
    for p in procs:
        p.start()
    reader = racing_store(kind, where)
    num_seen = 0
    while any(p.is_alive() for p in procs):
        got = reader.get(key)
        if got is None:
            time.sleep(0.001)
        else:
            num_seen += 1
            assert any(torch.equal(got.keys, v.keys) and torch.equal(got.values, v.values) for v in variants)
    for p in procs:
        p.join()
        assert p.exitcode == 0
    final = reader.get(key)
    assert final is not None and any(torch.equal(final.keys, v.keys) for v in variants)
    assert reader.stats().num_errors == 0
    if kind == "disk":
        assert reader.stats().num_entries == 1 and not list(tmp_path.glob("??/.tmp-*"))
    assert num_seen > 0, "the reader never overlapped the writers"
    request.node.user_properties.append(("reads_during_race", num_seen))


# -- redis faults ---------------------------------------------------------------------------------


@needs_redis
def test_redis_down_before_the_request(caplog) -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", retry_after_s=30)
    kv = make_kv(1)
    with caplog.at_level(logging.WARNING):
        for _ in range(20):
            assert store.get(key_of(kv)) is None
            store.put(key_of(kv), kv)
            assert not store.contains(key_of(kv))
    assert sum("unreachable" in r.message for r in caplog.records) == 1
    # one attempt failed (fast: a refused connection), then the back-off: the count says so, not a clock
    assert store.stats().num_misses == 20 and store.stats().num_errors == 1


@needs_redis
def test_redis_down_during_the_request_then_back(own_redis: LocalRedis, caplog) -> None:
    now = [0.0]  # the store's clock: the backoff passes when the test says so, not after a sleep
    store = RedisStore(own_redis.url, prefix="p", retry_after_s=0.2, chunk_bytes=1000, clock=lambda: now[0])
    kvs = [make_kv(i) for i in range(2)]
    store.put(key_of(kvs[0]), kvs[0])
    assert store.get(key_of(kvs[0])) is not None
    own_redis.stop()
    with caplog.at_level(logging.WARNING):
        assert store.get(key_of(kvs[0])) is None
        store.put(key_of(kvs[1]), kvs[1])  # dropped, not raised
        assert store.get(key_of(kvs[1])) is None
        own_redis.start()  # empty: no persistence
        assert store.get(key_of(kvs[1])) is None and not store.available  # still backing off: not even asked
        now[0] += 0.25
        assert store.get(key_of(kvs[0])) is None  # back, but the server lost its data
        store.put(key_of(kvs[1]), kvs[1])
        assert torch.equal(store.get(key_of(kvs[1])).keys, kvs[1].keys)
    messages = [r.message for r in caplog.records]
    assert sum("unreachable" in m for m in messages) == 1 and sum("is back" in m for m in messages) == 1


def frozen(server: LocalRedis, seconds: float) -> threading.Timer:
    """Stop `server` now (as a stalled virtual machine stops every process) and resume it after `seconds`."""
    server.proc.send_signal(signal.SIGSTOP)
    timer = threading.Timer(seconds, lambda: server.proc.send_signal(signal.SIGCONT))
    timer.start()
    return timer


@needs_redis
def test_redis_one_stall_past_the_timeout_is_not_an_outage(own_redis: LocalRedis) -> None:
    # a stall longer than the timeout, then the server answers: the call is tried again once, so the
    # stall (a clock that leaps past the deadline) is neither a miss nor a back-off
    store = RedisStore(own_redis.url, prefix="stall", timeout_s=1.0, retry_after_s=30)
    kv = make_kv(5)
    store.put(key_of(kv), kv)
    timer = frozen(own_redis, 1.3)
    got = store.get(key_of(kv))
    timer.join()
    assert got is not None and store.available and store.stats().num_errors == 0
    timer = frozen(own_redis, 3.5)  # hung for two waits in a row: a failure, then the back-off
    assert store.get(key_of(kv)) is None and not store.available
    timer.join()


@needs_redis
def test_redis_foreign_or_broken_values_are_misses(redis_server: LocalRedis) -> None:
    import redis

    store = RedisStore(redis_server.url, prefix="faults", chunk_bytes=1000)
    ours, theirs = make_kv(2), make_kv(2, fingerprint="model-b")
    store.put(key_of(theirs), theirs)
    client = redis.Redis.from_url(redis_server.url)
    client.set(f"faults:kv:{key_of(ours)}", client.get(f"faults:kv:{key_of(theirs)}"))
    assert store.get(key_of(ours)) is None  # manifest points at the other key's chunks, header names it
    client.set(f"faults:kv:{key_of(ours)}", b"Mnot json")
    assert store.get(key_of(ours)) is None
    head = client.get(f"faults:kv:{key_of(theirs)}")
    chunk = f"faults:chunk:{key_of(theirs)}:{__import__('json').loads(head[1:])['nonce']}:1"
    client.set(chunk, b"x" * 1000)
    assert store.get(key_of(theirs)) is None
    assert store.verify().bad_keys == (key_of(theirs),)
    assert not store.contains(key_of(theirs))


@needs_redis
def test_redis_ttl_expires_entries(redis_server: LocalRedis) -> None:
    store = RedisStore(redis_server.url, prefix=uuid.uuid4().hex, ttl_s=0.2)
    kv = make_kv(4)
    store.put(key_of(kv), kv)
    assert store.get(key_of(kv)) is not None
    time.sleep(0.3)  # the server's own clock expires entries: nothing to inject here
    assert store.get(key_of(kv)) is None and store.stats().num_entries == 0


def test_a_corrupt_entry_found_when_read_is_counted_for_later_processes(tmp_path: Path, capsys) -> None:
    """Another process (`store info`, `store verify`) sees what a read found corrupt and removed."""
    from test_cli import run

    from rag_promptcache.store import describe, verify

    store = DiskStore(tmp_path / "store")
    kv = make_kv(5)
    store.put(key_of(kv), kv)
    path = store.path_for(key_of(kv))
    data = bytearray(path.read_bytes())
    data[-40:] = bytes(40)  # part of the tensor data zeroed
    path.write_bytes(bytes(data))
    assert store.get(key_of(kv)) is None and not path.exists()
    later = DiskStore(tmp_path / "store")  # a new process's view: only the files
    facts = describe(later)
    assert facts["num_errors"] == 1 and [c["key"] for c in facts["corrupt"]] == [key_of(kv)]
    assert "checksum" in facts["corrupt"][0]["why"]
    report = verify(later)
    assert report.bad_keys == () and [c["key"] for c in report.found_earlier] == [key_of(kv)]
    assert describe(store)["num_errors"] == 1  # the reader's own count is not doubled by its flush
    (tmp_path / "manifest.json").write_text("{}")  # `store` commands only check that a corpus is there
    code, out, _ = run(capsys, "store", "info", "--corpus", tmp_path)
    assert code == 0 and "1 errors" in out and f"1 entry found corrupt and removed (recomputed on use); last: {key_of(kv)}" in out
    code, out, _ = run(capsys, "store", "verify", "--corpus", tmp_path)
    assert code == 0 and f"removed earlier, when read: {key_of(kv)}" in out
