"""The Redis tier: module KV shared between inference workers on many machines.

Keys under `prefix`:
- `{prefix}:kv:{key}`: b"V" + the entry's bytes (serialize.py), or, for entries over `chunk_bytes`,
  b"M" + a JSON manifest naming chunk keys `{prefix}:chunk:{key}:{nonce}:{i}`. Chunks are written
  first under a fresh nonce and the manifest last, so a reader never assembles a half-written
  value; an overwritten or expired chunk set reads as a miss, and the entry's checksum catches the rest.
- `{prefix}:index`: a hash key -> "bytes,tokens", for stats. With a TTL it can hold expired keys
  until a get finds them gone.

Redis being down is a miss, not an error: the first failure is logged once, then Redis is skipped
for `retry_after_s` (so a dead server costs nothing per request), then tried again; its return is
logged too. A refused connection is not retried within a request. A timeout is, once, before it counts
as a failure: a virtual machine that stalls (its processes and the server's frozen alike) sees its
clock leap past the deadline on waking, with no reply late at all. A stall eats one wait, not two
in a row; a server that is really hung costs `timeout_s` twice, then the back-off.

A server that answers but refuses a command (`maxmemory` reached under `noeviction`, a read-only
replica, an ACL user without write permission) is not down: a refused write is a lost cache entry,
counted in `num_write_errors` and logged once per kind of refusal, and reads go on; a refused read
is a miss.

`max_bytes` bounds this prefix's entries (redis_budget.py: ranked by `policy`, shared by every process
writing under the prefix); None leaves the bound to Redis' own `maxmemory` and eviction policy.

Out of scope: cleaning chunks orphaned by a writer that died between its chunks and its manifest (use a TTL).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable

from .base import ModuleKV, StoreStats, VerifyReport
from .codecs import CodecError, check_codec, decode, encode
from .eviction import Policy
from .link import Link, LinkMeter
from .redis_budget import RedisBudget, parse_row
from .serialize import CorruptEntry, WarnOnce, dumps, loads

log = logging.getLogger(__name__)
INSTALL_HINT = "RedisStore needs the redis client: pip install 'rag-promptcache[redis]'"


class RedisStore:
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "rpc",
        ttl_s: float | None = None,
        codec: str = "native",
        chunk_bytes: int = 8 * 2**20,
        retry_after_s: float = 2.0,
        timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int | None = None,
        policy: str | Policy = "lru",
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.exceptions import TimeoutError as RedisTimeout
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError(INSTALL_HINT) from e
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        self.url, self.prefix, self.ttl_s = url, prefix, ttl_s
        self.codec = check_codec(codec)
        self.chunk_bytes = chunk_bytes
        self.retry_after_s = retry_after_s
        self._clock = clock  # seconds, for the backoff; tests pass a fake one instead of sleeping
        # No back-off, and only a timeout is tried again (see the module docstring): a dead server must
        # cost one fast failure, not seconds.
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisTimeout, TimeoutError))
        self._client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=retry,
                                            retry_on_error=[RedisTimeout])  # redis-py 5 asks for both
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._refused = redis.exceptions.RedisError  # the server answered with an error: OOM, READONLY, NOPERM
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down = False
        self._num_hits = 0
        self._num_misses = 0
        self._num_errors = 0
        self._num_write_errors = 0
        self._warn = WarnOnce(log)
        self.meter = LinkMeter()  # this process's measure of the link to the server
        self.budget = None if max_bytes is None else RedisBudget(self._client, prefix, max_bytes, policy)
        self._lock_error = redis.exceptions.LockError

    @property
    def max_bytes(self) -> int | None:
        return None if self.budget is None else self.budget.max_bytes

    def _k(self, key: str) -> str:
        return f"{self.prefix}:kv:{key}"

    @property
    def _index_key(self) -> str:
        return f"{self.prefix}:index"

    @property
    def available(self) -> bool:
        """False while backing off after a connection failure."""
        with self._lock:
            return self._clock() >= self._down_until

    def _failed(self, e: Exception) -> None:
        with self._lock:
            self._down_until = self._clock() + self.retry_after_s
            first, self._down = not self._down, True
            self._num_errors += 1
        if first:
            log.warning(
                "redis store %s unreachable (%s): treating it as empty, retrying every %.1fs", self.url, e, self.retry_after_s
            )

    def _refusal(self, e: Exception, write: bool) -> None:
        with self._lock:
            self._num_errors += 1
            self._num_write_errors += write
        what = "writes" if write else "reads"
        self._warn(f"{what}:{type(e).__name__}", "redis store %s refuses %s (%s): %s", self.url, what,
                   type(e).__name__, e)

    def _ok(self) -> None:
        if self._down:
            with self._lock:
                back, self._down = self._down, False
            if back:
                log.warning("redis store %s is back", self.url)

    def _count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self._num_hits += 1
            else:
                self._num_misses += 1

    # -- protocol ------------------------------------------------------------------------------

    def get(self, key: str) -> ModuleKV | None:
        fetched = self._fetch(key) if self.available else None
        if fetched is None:
            self._count(False)
            return None
        blob, transfer_s = fetched
        try:
            enc = loads(blob, key)
            t0 = time.perf_counter()
            kv = decode(enc)
            self.meter.decoded(kv.num_tokens, time.perf_counter() - t0)
            self.meter.fetch(len(blob), kv.num_tokens, transfer_s)
        except (CorruptEntry, CodecError) as e:
            self._warn(key, "redis store %s: ignoring bad entry %s: %s", self.url, key, e)
            with self._lock:
                self._num_errors += 1
            self._count(False)
            return None
        self._count(True)
        if self.budget is not None:
            try:
                self.budget.used(key)
            except self._errors as e:
                self._failed(e)
            except self._refused as e:
                self._refusal(e, write=True)
        return kv

    def _fetch(self, key: str) -> tuple[bytes, float] | None:
        """The entry's bytes and the seconds its transfer took (one round trip included)."""
        try:
            if self.meter.wants_round_trip():
                t0 = time.perf_counter()
                self._client.ping()
                self.meter.round_trip(time.perf_counter() - t0)
            t0 = time.perf_counter()
            head = self._client.get(self._k(key))
            t1 = time.perf_counter()
            if head is None or head[:1] == b"V":
                self._ok()
                if head is None and self.ttl_s is not None:  # expired or deleted elsewhere
                    self.budget.removed(key) if self.budget is not None else self._client.hdel(self._index_key, key)
                return None if head is None else (head[1:], t1 - t0)
            self.meter.round_trip(t1 - t0)  # a manifest: a few hundred bytes
            chunk_keys = self._chunk_keys(key, head)
            if chunk_keys is None:
                return b"", 0.0  # malformed head: loads() reports it as a bad entry
            chunks = self._client.mget(chunk_keys)
            t2 = time.perf_counter()
        except self._errors as e:
            self._failed(e)
            return None
        except self._refused as e:  # answered, but refused: a miss
            self._refusal(e, write=False)
            return None
        self._ok()
        if any(c is None for c in chunks):
            return None  # overwritten or expired under us: a miss
        return b"".join(chunks), t2 - t1

    def _chunk_keys(self, key: str, head: bytes) -> list[str] | None:
        if head[:1] != b"M":
            return None
        try:
            manifest = json.loads(head[1:])
            nonce, num_chunks = str(manifest["nonce"]), int(manifest["num_chunks"])
        except (ValueError, KeyError, TypeError):
            return None
        return [f"{self.prefix}:chunk:{key}:{nonce}:{i}" for i in range(num_chunks)]

    def put(self, key: str, kv: ModuleKV) -> None:
        if not self.available:
            return
        data = dumps(key, encode(kv, self.codec))
        px = None if self.ttl_s is None else max(1, round(self.ttl_s * 1000))
        if self.budget is not None and not self.budget.fits(len(data)):
            self._warn("too-big", "redis store %s: an entry of %d bytes is larger than the whole budget of %d bytes; "
                       "entries this size are not cached (recomputed on every use): raise the budget",
                       self.url, len(data), self.budget.max_bytes)
            return
        try:
            self._make_room(key, len(data))
            if len(data) <= self.chunk_bytes:
                head = b"V" + data
                old = self._client.set(self._k(key), head, px=px, get=True)
            else:
                nonce = secrets.token_hex(8)
                n = -(-len(data) // self.chunk_bytes)
                pipe = self._client.pipeline(transaction=False)
                view = memoryview(data)
                for i in range(n):
                    # Chunks outlive their manifest a little, so a live manifest never points at expired chunks.
                    chunk_px = None if px is None else px + 60_000
                    part = bytes(view[i * self.chunk_bytes : (i + 1) * self.chunk_bytes])
                    pipe.set(f"{self.prefix}:chunk:{key}:{nonce}:{i}", part, px=chunk_px)
                pipe.execute()
                manifest = json.dumps({"nonce": nonce, "num_chunks": n, "num_bytes": len(data)}).encode()
                head = b"M" + manifest
                old = self._client.set(self._k(key), head, px=px, get=True)
            if self.budget is None:
                self._client.hset(self._index_key, key, f"{len(data)},{kv.num_tokens}")
            else:
                self.budget.added(key, len(data), kv.num_tokens)
            # a SET tried again after a timeout may return what its first try wrote: not stale
            stale = self._chunk_keys(key, old) if old and old != head else None
            if stale:
                self._client.delete(*stale)
            self._make_room(key, 0)  # concurrent writers may each have made room for themselves only
        except self._errors as e:
            self._failed(e)
            with self._lock:
                self._num_write_errors += 1
            return
        except self._refused as e:
            self._refusal(e, write=True)
            return
        self._ok()

    def resize(self, max_bytes: int | None) -> None:
        """A new budget for this prefix's entries (None: Redis' own maxmemory), held now."""
        if max_bytes is None:
            self.budget = None
            return
        if self.budget is None:
            self.budget = RedisBudget(self._client, self.prefix, max_bytes, "lru")
        self.budget.max_bytes = max_bytes
        try:
            self._make_room("", 0)
        except self._errors as e:
            self._failed(e)
        except self._refused as e:
            self._refusal(e, write=True)

    def _make_room(self, key: str, num_bytes: int) -> None:
        if self.budget is None:
            return
        try:
            self.budget.make_room(key, num_bytes, self.delete)
        except self._lock_error as e:  # another writer held the lock for 10 s: its eviction stands for ours
            self._warn("lock", "redis store %s: could not take the eviction lock (%s); the next write evicts",
                       self.url, e)

    def link(self) -> Link:
        """Latency, bandwidth and decode time measured by this process's calls."""
        return self.meter.link()

    def contains(self, key: str) -> bool:
        if not self.available:
            return False
        try:
            t0 = time.perf_counter()
            found = bool(self._client.exists(self._k(key)))
            self.meter.round_trip(time.perf_counter() - t0)
        except self._errors as e:
            self._failed(e)
            return False
        except self._refused as e:
            self._refusal(e, write=False)
            return False
        self._ok()
        return found

    def delete(self, key: str) -> bool:
        if not self.available:
            return False
        try:
            old = self._client.getdel(self._k(key))
            self.budget.removed(key) if self.budget is not None else self._client.hdel(self._index_key, key)
            stale = self._chunk_keys(key, old) if old else None
            if stale:
                self._client.delete(*stale)
        except self._errors as e:
            self._failed(e)
            return False
        except self._refused as e:
            self._refusal(e, write=True)
            return False
        self._ok()
        return old is not None

    def stats(self) -> StoreStats:
        num_entries = num_bytes = num_tokens = 0
        if self.available:
            try:
                rows = self._client.hvals(self._index_key)
                self._ok()
            except self._errors as e:
                self._failed(e)
                rows = []
            except self._refused as e:
                self._refusal(e, write=False)
                rows = []
            for row in rows:
                b, t, _ = parse_row(row)
                num_entries, num_bytes, num_tokens = num_entries + 1, num_bytes + b, num_tokens + t
        with self._lock:
            return StoreStats(num_entries, num_bytes, self._num_hits, self._num_misses, num_tokens, self._num_errors,
                              self._num_write_errors)

    def close(self) -> None:
        self._client.close()

    # -- management ----------------------------------------------------------------------------

    def keys(self) -> list[str]:
        try:
            return [k.decode() for k in self._client.hkeys(self._index_key)]
        except self._errors as e:
            self._failed(e)
            return []
        except self._refused as e:
            self._refusal(e, write=False)
            return []

    def verify(self) -> VerifyReport:
        """Fetch and check every indexed entry; delete the bad ones."""
        bad = []
        keys = self.keys()
        for key in keys:
            blob = self._fetch(key)
            if blob is None:
                continue
            try:
                loads(blob, key)
            except CorruptEntry:
                bad.append(key)
                self.delete(key)
        return VerifyReport(len(keys), tuple(bad))
