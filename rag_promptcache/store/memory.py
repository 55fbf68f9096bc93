"""The memory tier: encoded entries in a dict, within a byte budget, on CPU or on the model's device.

Entries are held *encoded*, so `codec="int8"` really holds about a quarter of fp32's bytes, and the
budget counts what is held. A get decodes; for "native" that is free (the stored tensors come back
as they are; callers must treat them as read-only). Put always copies, so the store never aliases a
caller's tensors. CPU entries go to pinned memory when CUDA is present, so copies to the GPU are
asynchronous-capable and fast.

`on_evict(key, kv)` is called, outside the lock, for every entry the budget pushes out (and for an
entry too big to keep at all): TieredStore's write-back uses it to flush dirty entries downward.

Out of scope: persistence (disk.py) and sharing between processes (redis.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from .base import ModuleKV, StoreStats
from .codecs import EncodedKV, check_codec, decode, encode
from .eviction import BudgetIndex, Policy
from .serialize import WarnOnce

log = logging.getLogger(__name__)


class MemoryStore:
    def __init__(
        self,
        max_bytes: int | None = None,
        codec: str = "native",
        device: str | torch.device = "cpu",
        policy: str | Policy = "lru",
        on_evict: Callable[[str, ModuleKV], None] | None = None,
    ) -> None:
        self.codec = check_codec(codec)
        self.device = torch.device(device)
        self._pin = self.device.type == "cpu" and torch.cuda.is_available()
        self._index = BudgetIndex(max_bytes, policy)
        self._entries: dict[str, EncodedKV] = {}
        self._lock = threading.Lock()
        self._num_hits = 0
        self._num_misses = 0
        self.on_evict = on_evict
        self._warn = WarnOnce(log)

    @property
    def max_bytes(self) -> int | None:
        return self._index.max_bytes

    def get(self, key: str) -> ModuleKV | None:
        with self._lock:
            enc = self._entries.get(key)
            if enc is None:
                self._num_misses += 1
                return None
            self._num_hits += 1
            self._index.touch(key)
        return decode(enc)

    def put(self, key: str, kv: ModuleKV) -> None:
        enc = encode(kv, self.codec, device=self.device, pin=self._pin)
        with self._lock:
            self._entries[key] = enc
            victims = self._index.add(key, enc.num_bytes, enc.num_tokens)
            evicted = [(v.key, self._entries.pop(v.key)) for v in victims]
        if victims and victims[0].key == key and not self._index.fits(enc.num_bytes):
            self._warn("too-big", "memory store: an entry of %d bytes is larger than the whole budget of %d bytes; "
                       "entries this size are not cached (recomputed or read from a lower tier on every use): raise "
                       "the budget", enc.num_bytes, self._index.max_bytes)
        self._evicted(evicted)

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
            return StoreStats(
                len(self._entries), self._index.num_bytes, self._num_hits, self._num_misses, self._index.num_tokens
            )

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._index = BudgetIndex(self._index.max_bytes, self._index.policy)  # aging starts over too

    def _evicted(self, evicted: list[tuple[str, EncodedKV]]) -> None:
        if self.on_evict is not None:
            for key, enc in evicted:
                self.on_evict(key, decode(enc))
