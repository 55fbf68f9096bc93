"""Continuous-batching bookkeeping: a bounded wait queue and the rows of the running batch. No torch.

Requests are opaque ids. `submit` queues one, or raises `QueueFull` when `max_batch` + `max_queue`
requests are already in (running, being admitted, or waiting); `next_waiting` hands out the oldest
waiting id for admission (its prefill), `join` gives it a row, and `leave` frees a finished,
failed or cancelled id wherever it is. Running rows stay packed
in `0 .. num_running-1`, so the batched decode step can use a view of the first rows of its cache
instead of gathering: when a row other than the last leaves, the last row moves into the hole and
`leave` says so, and the caller copies that row's KV once.

Not here: tensors, sampling, threads (`engine/batching/batcher.py` runs this under its lock).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass


class QueueFull(Exception):
    """Too many requests waiting: the caller should retry later (HTTP 429 / 503)."""


@dataclass(frozen=True, slots=True)
class Move:
    """The request `request` moved from row `src` to row `dst`: copy its KV."""

    request: Hashable
    src: int
    dst: int


class Rows:
    def __init__(self, max_batch: int, max_queue: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_batch = max_batch
        self.max_queue = max_queue
        self._waiting: deque[Hashable] = deque()
        self._running: list[Hashable] = []  # index = row
        self._admitting: set[Hashable] = set()  # out of the queue, not yet in a row (prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def running(self) -> tuple[Hashable, ...]:
        return tuple(self._running)

    def submit(self, request: Hashable) -> None:
        if len(self._waiting) + len(self._admitting) + len(self._running) >= self.max_batch + self.max_queue:
            raise QueueFull(f"{self.max_batch + self.max_queue} requests in already (max_batch={self.max_batch} "
                            f"running, max_queue={self.max_queue} waiting); retry later")
        self._waiting.append(request)

    def has_room(self) -> bool:
        return bool(self._waiting) and len(self._running) + len(self._admitting) < self.max_batch

    def next_waiting(self) -> Hashable | None:
        """Pop the oldest waiting request, or None. It holds no row until `join`."""
        if not self._waiting:
            return None
        request = self._waiting.popleft()
        self._admitting.add(request)
        return request

    def join(self, request: Hashable) -> int:
        """Give `request` the next free row; → that row."""
        assert len(self._running) < self.max_batch, f"{self._running=} is full"
        assert request in self._admitting, f"{request=} was not handed out by next_waiting"
        self._admitting.remove(request)
        self._running.append(request)
        return len(self._running) - 1

    def row(self, request: Hashable) -> int:
        return self._running.index(request)

    def leave(self, request: Hashable) -> Move | None:
        """Free `request`'s row (running) or drop it from the queue (waiting); → the move that keeps
        the rows packed, if any."""
        if request in self._waiting:
            self._waiting.remove(request)
            return None
        if request in self._admitting:
            self._admitting.remove(request)
            return None
        row = self._running.index(request)
        last = self._running.pop()
        if row == len(self._running):
            return None
        self._running[row] = last
        return Move(last, len(self._running), row)
