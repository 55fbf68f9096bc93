"""What the memory and device tiers share: entries held in a dict within a byte budget (`BudgetIndex`), hit
and miss counts, one lock, and the protocol methods that only look entries up or drop them.

A tier says what it holds (`MemoryStore`: encoded entries, `DeviceStore`: device copies) and how an entry
is made on put and read on get; `_evicted` is where a tier hears of entries the budget pushed out (the
memory tier's write-back). Nothing here touches a tensor.

Out of scope: the disk and Redis tiers, whose entries live elsewhere and are indexed their own way.
"""

from __future__ import annotations

import logging
import threading
from typing import Generic, TypeVar

from .base import StoreStats
from .eviction import BudgetIndex, Policy
from .serialize import WarnOnce

log = logging.getLogger(__name__)
T = TypeVar("T")


class BudgetedTier(Generic[T]):
    name = "memory"  # in what the tier logs

    def __init__(self, max_bytes: int | None, policy: str | Policy) -> None:
        self._index = BudgetIndex(max_bytes, policy)
        self._entries: dict[str, T] = {}
        self._lock = threading.Lock()
        self._num_hits = 0
        self._num_misses = 0
        self._warn = WarnOnce(log)

    @property
    def max_bytes(self) -> int | None:
        return self._index.max_bytes

    def _lookup(self, key: str) -> T | None:
        """The entry held under `key` (counted as a hit, and used now), or None (a miss)."""
        with self._lock:
            held = self._entries.get(key)
            if held is None:
                self._num_misses += 1
                return None
            self._num_hits += 1
            self._index.touch(key)
            return held

    def _hold(self, key: str, held: T, num_bytes: int, num_tokens: int) -> None:
        """Keep `held` under `key`; what the budget evicts for it (itself where it is larger than the whole
        budget) goes to `_evicted`, outside the lock."""
        with self._lock:
            self._entries[key] = held
            victims = self._index.add(key, num_bytes, num_tokens)
            evicted = [(v.key, self._entries.pop(v.key)) for v in victims]
        if victims and victims[0].key == key and not self._index.fits(num_bytes):
            self._warn("too-big", "%s store: an entry of %d bytes is larger than the whole budget of %d bytes; "
                       "entries this size are not cached (recomputed or read from a lower tier on every use): raise "
                       "the budget", self.name, num_bytes, self._index.max_bytes)
        self._evicted(evicted)

    def _evicted(self, evicted: list[tuple[str, T]]) -> None:
        """Entries the budget pushed out, already dropped; a tier that must hand them on says so here."""

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def delete(self, key: str) -> bool:
        with self._lock:
            self._index.remove(key)
            return self._entries.pop(key, None) is not None

    def evict_to(self, num_bytes: int) -> list[str]:
        """Evict (lowest priority first) until at most `num_bytes` are held; returns the evicted keys."""
        with self._lock:
            evicted = [(v.key, self._entries.pop(v.key)) for v in self._index.evict_to(num_bytes)]
        self._evicted(evicted)
        return [key for key, _ in evicted]

    def resize(self, max_bytes: int | None) -> list[str]:
        """A new budget (None: unbounded), held now: returns the keys evicted to fit it."""
        with self._lock:
            self._index.max_bytes = max_bytes
        return self.evict_to(max_bytes) if max_bytes is not None else []

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(len(self._entries), self._index.num_bytes, self._num_hits, self._num_misses,
                              self._index.num_tokens)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._index = BudgetIndex(self._index.max_bytes, self._index.policy)  # aging starts over too
