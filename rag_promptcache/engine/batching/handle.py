"""`Handle`: what a caller holds for one request submitted to the batcher (engine/batching/batcher.py): text
pieces to iterate, sync or async, the `Result` once finished, and `cancel()`.

The batcher thread `put`s pieces and the outcome; the caller's thread or event loop takes them. Not
here: scheduling or decoding (the batcher's).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from rag_promptcache.engine.result import Result

if TYPE_CHECKING:
    from rag_promptcache.engine.planning.plan import Plan
    from rag_promptcache.engine.decoding.sampling import Sampling


class Cancelled(Exception):
    """The request was cancelled before it finished."""


class Handle:
    """One submitted request: iterate (sync or async) for text pieces; `.result` once finished.

    `cancel()` frees its row before the next decode step. A failure in this request (only) is
    re-raised by the iterator."""

    def __init__(self, id: int, plan: Plan, sampling: Sampling, t0: float) -> None:
        self.id = id
        self.plan = plan
        self.sampling = sampling
        self.t0 = t0
        self.result: Result | None = None
        self.cancelled = False
        self._items: deque[object] = deque()  # str pieces, then a Result or an exception
        self._cv = threading.Condition()
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self.on_cancel: Callable[[], None] | None = None  # the batcher's wake-up, set at submit

    @property
    def prompt_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def cached_tokens(self) -> int:
        return self.plan.num_from_store

    def cancel(self) -> None:
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel()

    def put(self, item: object) -> None:
        """The batcher's side: a text piece, then the `Result` or the exception that ends the request."""
        with self._cv:
            self._items.append(item)
            self._cv.notify_all()
            waker = self._waker
        if waker is not None:
            loop, event = waker
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass

    def _take(self, item: object) -> str:
        if isinstance(item, str):
            return item
        if isinstance(item, Result):
            self.result = item
            self._items.append(item)  # iterating again stays exhausted
            raise StopIteration
        assert isinstance(item, BaseException), f"{item=}"
        self._items.append(item)
        raise item

    def __iter__(self) -> Handle:
        return self

    def __next__(self) -> str:
        with self._cv:
            while not self._items:
                self._cv.wait()
            item = self._items.popleft()
        return self._take(item)

    def __aiter__(self) -> Handle:
        return self

    async def __anext__(self) -> str:
        while True:
            with self._cv:
                if self._waker is None:
                    self._waker = (asyncio.get_running_loop(), asyncio.Event())
                if self._items:
                    item = self._items.popleft()
                    break
                self._waker[1].clear()
                event = self._waker[1]
            await event.wait()
        try:
            return self._take(item)
        except StopIteration:
            raise StopAsyncIteration from None

    def consume(self) -> Result:
        for _ in self:
            pass
        assert self.result is not None
        return self.result
