"""The store that stores nothing: caching off. Every get is a miss; puts are dropped."""

from __future__ import annotations

import threading

from .base import ModuleKV, StoreStats


class NullStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_misses = 0

    def get(self, key: str) -> ModuleKV | None:
        with self._lock:
            self._num_misses += 1
        return None

    def put(self, key: str, kv: ModuleKV) -> None:
        return None

    def contains(self, key: str) -> bool:
        return False

    def delete(self, key: str) -> bool:
        return False

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(0, 0, 0, self._num_misses)

    def close(self) -> None:
        return None
