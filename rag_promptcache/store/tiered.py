"""Tiers composed: reads go fastest-first with promotion, writes go through or back.

- Read: ask each tier in order; on a hit in tier i, put the entry into tiers 0..i-1 (promotion), as tier i
  stored it where both hold one codec (disk to memory: no encoding again).
- write="through": a put goes to every tier, so any tier can serve the entry after a crash.
- write="back": a put goes to the first tier only and is marked dirty; a dirty entry is written
  down to the lower tiers when the first tier evicts it (through the first tier's `on_evict` hook,
  which MemoryStore has), on `flush()` and on `close()`. Cheaper puts, but dirty entries are lost
  if the process dies before a flush. Promoted entries are clean (the lower tier already holds them).
  `flush()` reads dirty entries back through the first tier's `get`, so they count as its hits.

Concurrent gets of one key share one load: the first caller fetches, the others wait for its result
(`num_shared_loads` counts them). `load_s` estimates how long a get would take, from the first tier
with a measured link (link.py), for the planner to weigh against recomputing.

stats() counts hits and misses at this level (a hit in any tier is one hit) and sums entries and
bytes over the tiers (a promoted entry counts in each tier that holds it); `tier_stats()` gives each
tier's own.

Out of scope: anything a single tier does (budgets, codecs, serialization).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

from .base import ModuleKV, Store, StoreStats

WRITE_POLICIES = ("through", "back")


class TieredStore:
    def __init__(self, tiers: Sequence[Store], write: str = "through") -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        if write not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write!r}; valid policies: {', '.join(WRITE_POLICIES)}")
        self.tiers = list(tiers)
        self.write = write
        self._lock = threading.Lock()
        self._dirty: set[str] = set()
        self._num_hits = 0
        self._num_misses = 0
        self._inflight: dict[str, Future[ModuleKV | None]] = {}
        self.num_shared_loads = 0
        if write == "back":
            if not hasattr(self.tiers[0], "on_evict"):
                raise ValueError(
                    f"write='back' needs a first tier with an on_evict hook (MemoryStore), "
                    f"got {type(self.tiers[0]).__name__}"
                )
            self.tiers[0].on_evict = self._write_back  # type: ignore[attr-defined]

    def get(self, key: str) -> ModuleKV | None:
        with self._lock:
            pending = self._inflight.get(key)
            if pending is None:
                mine: Future[ModuleKV | None] = Future()
                self._inflight[key] = mine
            else:
                self.num_shared_loads += 1
        if pending is not None:
            kv = pending.result()
            with self._lock:
                self._num_hits += kv is not None
                self._num_misses += kv is None
            return kv
        try:
            kv = self._load(key)
        except BaseException as e:
            mine.set_exception(e)
            raise
        finally:
            with self._lock:
                del self._inflight[key]
        mine.set_result(kv)
        return kv

    def load_s(self, key: str, num_tokens: int) -> float | None:
        """Seconds a get of `key` (`num_tokens` tokens) is expected to take: 0.0 where a tier without a
        link (memory, disk) holds it, else the first linked tier's estimate; None when unmeasured."""
        for tier in self.tiers:
            link = getattr(tier, "link", None)
            if link is not None:
                return link().load_s(num_tokens)
            if tier.contains(key):
                return 0.0
        return None

    def _load(self, key: str) -> ModuleKV | None:
        for i, tier in enumerate(self.tiers):
            read_encoded = getattr(tier, "get_encoded", None) if i else None
            if read_encoded is not None:
                kv, enc = read_encoded(key) or (None, None)
            else:
                kv, enc = tier.get(key), None
            if kv is not None:
                for upper in self.tiers[:i]:  # as stored where the upper tier holds that codec: no encoding again
                    keep_encoded = getattr(upper, "put_encoded", None) if enc is not None else None
                    if keep_encoded is None or not keep_encoded(key, enc):
                        upper.put(key, kv)
                with self._lock:
                    self._num_hits += 1
                return kv
        with self._lock:
            self._num_misses += 1
        return None

    def put(self, key: str, kv: ModuleKV) -> None:
        if self.write == "through":
            for tier in self.tiers:
                tier.put(key, kv)
            return
        with self._lock:
            self._dirty.add(key)
        self.tiers[0].put(key, kv)

    def contains(self, key: str) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def delete(self, key: str) -> bool:
        with self._lock:
            self._dirty.discard(key)
        return any([tier.delete(key) for tier in self.tiers])  # a list: delete from every tier

    def stats(self) -> StoreStats:
        per_tier = self.tier_stats()
        with self._lock:
            return StoreStats(
                sum(s.num_entries for s in per_tier),
                sum(s.num_bytes for s in per_tier),
                self._num_hits,
                self._num_misses,
                sum(s.num_tokens for s in per_tier),
                sum(s.num_errors for s in per_tier),
                sum(s.num_write_errors for s in per_tier),
            )

    def tier_stats(self) -> list[StoreStats]:
        return [tier.stats() for tier in self.tiers]

    @property
    def num_dirty(self) -> int:
        with self._lock:
            return len(self._dirty)

    def flush(self) -> None:
        """Write every dirty entry of the first tier down to the lower tiers."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        for key in dirty:
            kv = self.tiers[0].get(key)
            if kv is not None:
                for tier in self.tiers[1:]:
                    tier.put(key, kv)

    def close(self) -> None:
        self.flush()
        for tier in self.tiers:
            tier.close()

    def _write_back(self, key: str, kv: ModuleKV) -> None:
        with self._lock:
            if key not in self._dirty:
                return
            self._dirty.discard(key)
        for tier in self.tiers[1:]:
            tier.put(key, kv)
