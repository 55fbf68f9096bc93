"""The store contract, over every tier × codec, and the faults each tier must survive.

Redis tests start their own `redis-server` on a free loopback port; they skip only if the binary
is missing. Tensors are random; no model is needed.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rag_promptcache.store import (
    CODECS,
    DiskStore,
    MemoryStore,
    ModuleKV,
    NullStore,
    RedisStore,
    Store,
    TieredStore,
    describe,
    dumps,
    encode,
    evict_to,
    module_key,
    verify,
)
from rag_promptcache.store import disk as disk_module

REDIS_BIN = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS_BIN is None, reason="redis-server binary not found (apt-get install redis-server)")
REPO = Path(__file__).resolve().parents[1]


def make_kv(seed: int, num_tokens: int = 16, fingerprint: str = "model-a", shape=(2, 2, 8)) -> ModuleKV:
    g = torch.Generator().manual_seed(seed)
    L, H, D = shape
    keys = torch.randn(L, H, num_tokens, D, generator=g)
    values = torch.randn(L, H, num_tokens, D, generator=g)
    token_ids = tuple(range(seed, seed + num_tokens))
    return ModuleKV(keys, values, start=seed % 7, token_ids=token_ids, fingerprint=fingerprint, mode="alone")


def key_of(kv: ModuleKV) -> str:
    return module_key(kv.fingerprint, kv.mode, kv.token_ids, kv.start)


# -- a real redis-server --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [REDIS_BIN, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="session")
def redis_server():
    if REDIS_BIN is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_redis():
    """A server this test may kill and restart."""
    if REDIS_BIN is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()


# -- the contract ---------------------------------------------------------------------------------

# name -> (factory(tmp_path, redis_url, codec, memory_budget, disk_budget), needs redis, bounded)
Factory = Callable[[Path, str, str, "int | None", "int | None"], Store]
TIERS: dict[str, tuple[Factory, bool, bool]] = {
    "memory": (lambda p, url, c, mb, db: MemoryStore(mb, codec=c), False, True),
    "disk": (lambda p, url, c, mb, db: DiskStore(p / "store", db, codec=c), False, True),
    "redis": (lambda p, url, c, mb, db: RedisStore(url, prefix=uuid.uuid4().hex, codec=c, chunk_bytes=1000), True, False),
    "memory+disk": (
        lambda p, url, c, mb, db: TieredStore([MemoryStore(mb, codec=c), DiskStore(p / "store", db, codec=c)]),
        False,
        True,
    ),
    "memory+redis": (
        lambda p, url, c, mb, db: TieredStore([MemoryStore(mb, codec=c), RedisStore(url, prefix=uuid.uuid4().hex, codec=c)]),
        True,
        False,
    ),
}
# Relative Frobenius error allowed per codec (measured: fp16 2e-4, bf16 2e-3, int8 ~6e-3, int4 ~0.1).
TOLERANCE = {"native": 0.0, "fp16": 1e-3, "bf16": 5e-3, "int8": 2e-2, "int4": 0.2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def build(name: str, tmp_path: Path, request: pytest.FixtureRequest, codec: str, mb=None, db=None) -> Store:
    factory, uses_redis, _ = TIERS[name]
    url = request.getfixturevalue("redis_server").url if uses_redis else ""
    return factory(tmp_path, url, codec, mb, db)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("tier", list(TIERS))
def test_contract(tier: str, codec: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    store = build(tier, tmp_path, request, codec)
    assert isinstance(store, Store)
    kv = make_kv(1)
    key = key_of(kv)
    assert store.get(key) is None
    assert not store.contains(key)
    store.put(key, kv)
    assert store.contains(key)
    got = store.get(key)
    assert got is not None
    assert (got.start, got.token_ids, got.fingerprint, got.mode) == (kv.start, kv.token_ids, kv.fingerprint, kv.mode)
    assert got.keys.dtype == kv.keys.dtype and got.keys.shape == kv.keys.shape
    err = max(rel_err(got.keys, kv.keys), rel_err(got.values, kv.values))
    request.node.user_properties.append(("rel_err", err))
    if codec == "native":
        assert torch.equal(got.keys, kv.keys) and torch.equal(got.values, kv.values)
    else:
        assert err <= TOLERANCE[codec], f"{codec=} {err=}"
    # put copies: mutating the caller's tensors afterwards does not reach the store
    kv.keys.add_(1.0)
    assert torch.allclose(store.get(key).keys, got.keys)
    stats = store.stats()
    assert stats.num_entries >= 1 and stats.num_bytes > 0 and stats.num_hits == 2 and stats.num_misses == 1
    assert stats.num_tokens >= kv.num_tokens
    assert describe(store)["num_hits"] == 2
    assert store.delete(key)
    assert not store.delete(key)
    assert store.get(key) is None and not store.contains(key)
    store.close()


@pytest.mark.parametrize("codec", ["native", "int8"])
@pytest.mark.parametrize("tier", [t for t, (_, _, bounded) in TIERS.items() if bounded])
def test_budgets_evict_oldest(tier: str, codec: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    kvs = [make_kv(i) for i in range(4)]
    enc = encode(kvs[0], codec)
    file_bytes = len(dumps(key_of(kvs[0]), enc))
    store = build(tier, tmp_path, request, codec, mb=int(2.5 * enc.num_bytes), db=int(2.5 * file_bytes))
    for kv in kvs:
        store.put(key_of(kv), kv)
    assert store.get(key_of(kvs[0])) is None and store.get(key_of(kvs[1])) is None
    assert store.get(key_of(kvs[2])) is not None and store.get(key_of(kvs[3])) is not None
    tiers = store.tiers if isinstance(store, TieredStore) else [store]
    for t in tiers:
        assert t.stats().num_bytes <= t.max_bytes and t.stats().num_entries == 2
    assert len(evict_to(store, 0)) >= 2
    assert store.get(key_of(kvs[3])) is None


def test_null_store_is_always_a_miss() -> None:
    store = NullStore()
    kv = make_kv(0)
    store.put("k", kv)
    assert store.get("k") is None and not store.contains("k") and not store.delete("k")
    assert store.stats().num_misses == 1 and isinstance(store, Store)


def test_tiered_promotes_and_writes_back(tmp_path: Path) -> None:
    kvs = [make_kv(i) for i in range(3)]
    one = encode(kvs[0], "native").num_bytes
    memory, disk = MemoryStore(max_bytes=int(1.5 * one)), DiskStore(tmp_path / "d")
    store = TieredStore([memory, disk], write="back")
    store.put(key_of(kvs[0]), kvs[0])
    assert not disk.contains(key_of(kvs[0])) and store.num_dirty == 1
    store.put(key_of(kvs[1]), kvs[1])  # evicts kvs[0] from memory: written back
    assert disk.contains(key_of(kvs[0])) and not memory.contains(key_of(kvs[0]))
    assert torch.equal(store.get(key_of(kvs[0])).keys, kvs[0].keys)  # hit in disk, promoted
    assert memory.contains(key_of(kvs[0])) and disk.contains(key_of(kvs[1]))
    store.put(key_of(kvs[2]), kvs[2])
    store.flush()
    assert all(disk.contains(key_of(kv)) for kv in kvs) and store.num_dirty == 0
    assert [s.num_entries for s in store.tier_stats()] == [1, 3]
    store.close()


def test_tiered_validates_write_policy(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="valid policies: through, back"):
        TieredStore([MemoryStore()], write="around")
    with pytest.raises(ValueError, match="on_evict"):
        TieredStore([DiskStore(tmp_path), MemoryStore()], write="back")


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
    shutil.copy(store.path_for(key_of(theirs)), store.path_for(key_of(ours)).parent.mkdir(exist_ok=True) or store.path_for(key_of(ours)))
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
        from test_store import make_kv, key_of
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


WRITER = """
    import sys; sys.path.insert(0, {tests!r})
    from test_store import make_kv, racing_store
    store = racing_store({kind!r}, {where!r})
    kv = make_kv({seed}, num_tokens=64)
    kv = type(kv)(kv.keys, kv.values, 0, tuple(range(64)), "model-a", "alone")
    for _ in range({n}):
        store.put({key!r}, kv)
"""


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
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(WRITER.format(tests=tests, kind=kind, where=where, seed=s, n=40, key=key))],
            env=env,
            stderr=subprocess.PIPE,
        )
        for s in (11, 12)
    ]
    reader = racing_store(kind, where)
    num_seen = 0
    while any(p.poll() is None for p in procs):
        got = reader.get(key)
        if got is not None:
            num_seen += 1
            assert any(torch.equal(got.keys, v.keys) and torch.equal(got.values, v.values) for v in variants)
    for p in procs:
        assert p.wait() == 0, p.stderr.read().decode()
    final = reader.get(key)
    assert final is not None and any(torch.equal(final.keys, v.keys) for v in variants)
    assert reader.stats().num_errors == 0
    if kind == "disk":
        assert reader.stats().num_entries == 1 and not list(tmp_path.glob("??/.tmp-*"))
    request.node.user_properties.append(("reads_during_race", num_seen))


# -- redis faults ---------------------------------------------------------------------------------


@needs_redis
def test_redis_down_before_the_request(caplog) -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", retry_after_s=30)
    kv = make_kv(1)
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        for _ in range(20):
            assert store.get(key_of(kv)) is None
            store.put(key_of(kv), kv)
            assert not store.contains(key_of(kv))
    assert time.perf_counter() - t0 < 1.0
    assert sum("unreachable" in r.message for r in caplog.records) == 1
    assert store.stats().num_misses == 20


@needs_redis
def test_redis_down_during_the_request_then_back(own_redis: RedisServer, caplog) -> None:
    store = RedisStore(own_redis.url, prefix="p", retry_after_s=0.2, chunk_bytes=1000)
    kvs = [make_kv(i) for i in range(2)]
    store.put(key_of(kvs[0]), kvs[0])
    assert store.get(key_of(kvs[0])) is not None
    own_redis.stop()
    with caplog.at_level(logging.WARNING):
        assert store.get(key_of(kvs[0])) is None
        store.put(key_of(kvs[1]), kvs[1])  # dropped, not raised
        assert store.get(key_of(kvs[1])) is None
        own_redis.start()  # empty: no persistence
        time.sleep(0.25)
        assert store.get(key_of(kvs[0])) is None  # back, but the server lost its data
        store.put(key_of(kvs[1]), kvs[1])
        assert torch.equal(store.get(key_of(kvs[1])).keys, kvs[1].keys)
    messages = [r.message for r in caplog.records]
    assert sum("unreachable" in m for m in messages) == 1 and sum("is back" in m for m in messages) == 1


@needs_redis
def test_redis_foreign_or_broken_values_are_misses(redis_server: RedisServer) -> None:
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
def test_redis_ttl_expires_entries(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, prefix=uuid.uuid4().hex, ttl_s=0.2)
    kv = make_kv(4)
    store.put(key_of(kv), kv)
    assert store.get(key_of(kv)) is not None
    time.sleep(0.3)
    assert store.get(key_of(kv)) is None and store.stats().num_entries == 0
