"""`Batcher`: one thread that decodes every running request together, one forward per token.

    with engine.scheduler(max_batch=8) as batcher:
        h = batcher.submit(prompt, max_new_tokens=64)   # plans now: bad prompts raise here
        for piece in h: ...                              # or `async for`, or h.consume()
        h.result                                         # the engine's `Result`

A submitted request waits in a bounded queue (`QueueFull` past `max_queue`). Between decode steps
the thread admits waiting requests while rows are free: each is prefilled alone through the
engine's own plan → assemble → forward path, its KV copied into a free row of the `BatchCache`,
and its first token sampled. Then one `decode_step` advances every running row by one token. A
request running alone with nothing waiting decodes as `PromptCache.generate` does, checking prompt
lookup drafts (engine/lookup.py) in a forward of its row (`decode_row`). A
row that ends (EOS, stop string, max tokens) or is cancelled leaves before the next step. Each
request keeps its own `Sampling`, seeded generator and `TextStream`, so a request decoded in a batch
gets the tokens it gets alone (up to float rounding of the batched matmuls).

Not here: retrieval or HTTP (rag/, server/); the bookkeeping itself (`scheduler.py`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rag_promptcache.engine.assemble import release
from rag_promptcache.engine.batch import BatchCache, decode_row, decode_step
from rag_promptcache.engine.decode import Sampling, TextStream, sample, verify
from rag_promptcache.engine.lookup import NgramDrafter
from rag_promptcache.engine.result import FinishReason, Result
from rag_promptcache.engine.scheduler import QueueFull, Rows

if TYPE_CHECKING:
    from rag_promptcache.engine.engine import Plan, PromptCache
    from rag_promptcache.engine.recovery import Recovery
    from rag_promptcache.pml import ast

__all__ = ["Batcher", "Handle", "QueueFull"]


class Cancelled(Exception):
    """The request was cancelled before it finished."""


class Handle:
    """One submitted request: iterate (sync or async) for text pieces; `.result` once finished.

    `cancel()` frees its row before the next decode step. A failure in this request (only) is
    re-raised by the iterator."""

    def __init__(self, id: int, plan: Plan, sampling: Sampling, ignore_eos: bool, t0: float) -> None:
        self.id = id
        self.plan = plan
        self.sampling = sampling
        self.ignore_eos = ignore_eos
        self.t0 = t0
        self.result: Result | None = None
        self.cancelled = False
        self._items: deque[object] = deque()  # str pieces, then a Result or an exception
        self._cv = threading.Condition()
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._batcher: Batcher | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def cached_tokens(self) -> int:
        return self.plan.num_from_store

    def cancel(self) -> None:
        self.cancelled = True
        if self._batcher is not None:
            self._batcher._wake()

    def _put(self, item: object) -> None:
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


@dataclass(slots=True)
class _Running:
    handle: Handle
    text: TextStream
    generator: torch.Generator | None
    position: int  # of the next token fed
    ids: list[int] = field(default_factory=list)
    ttft: float = 0.0
    num_forwards: int = 0  # decode forwards this request took part in
    drafter: NgramDrafter | None = None  # prompt lookup, built when it first runs alone


class Batcher:
    def __init__(self, engine: PromptCache, *, max_batch: int = 8, max_queue: int = 64) -> None:
        self.engine = engine
        self.rows = Rows(max_batch, max_queue)
        model = engine.model
        self.batch = BatchCache(model.config, engine.geometry, max_batch, 256, model.dtype, model.device)
        self._handles: dict[int, Handle] = {}
        self._running: dict[int, _Running] = {}
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rag-promptcache-batcher", daemon=True)
        self._thread.start()

    # -- callers -----------------------------------------------------------------------------------

    def submit(self, prompt: str | ast.Prompt, *, recovery: str | Recovery | None = None, ignore_eos: bool = False,
               use_cache: bool = True, **sampling) -> Handle:
        """Plan `prompt` (raising here on bad input) and queue it; `QueueFull` when the queue is full."""
        s = Sampling(**sampling)
        t0 = time.perf_counter()
        if self._closed:
            raise RuntimeError("this scheduler is closed")
        # planning may encode missing modules (forward passes under engine.model_lock); raises on a
        # prompt past the context window
        plan = self.engine.plan(prompt, use_cache=use_cache, recovery=recovery, max_new_tokens=s.max_new_tokens)
        handle = Handle(next(self._ids), plan, s, ignore_eos, t0)
        handle._batcher = self
        with self._cv:
            self.rows.submit(handle.id)  # raises QueueFull
            self._handles[handle.id] = handle
            self._cv.notify()
        return handle

    def generate(self, prompts: Sequence[str | ast.Prompt], **kwargs) -> list[Result]:
        handles = [self.submit(p, **kwargs) for p in prompts]
        return [h.consume() for h in handles]

    @property
    def num_running(self) -> int:
        return self.rows.num_running

    @property
    def num_waiting(self) -> int:
        return self.rows.num_waiting

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # -- the thread --------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self.rows.num_waiting and not self.rows.num_running:
                    self._cv.wait()
                if self._closed:
                    break
            self._drop_cancelled()
            self._admit()
            if self.rows.num_running:
                self._step()
        with self._cv:
            pending = [*self.rows.running, *[self.rows.next_waiting() for _ in range(self.rows.num_waiting)]]
        for rid in pending:
            self._handles.pop(rid)._put(Cancelled("the scheduler was closed"))

    def _drop_cancelled(self) -> None:
        with self._cv:
            gone = [rid for rid, h in self._handles.items() if h.cancelled]
        for rid in gone:
            self._finish(rid, Cancelled(f"request {rid} was cancelled"))

    def _admit(self) -> None:
        while True:
            with self._cv:
                if not self.rows.has_room():
                    return
                rid = self.rows.next_waiting()
            handle = self._handles[rid]
            s = handle.sampling
            try:
                with self.engine.model_lock:
                    cache, logits, position = self.engine._prefill(handle.plan, 0)
            except Exception as e:  # noqa: BLE001 - this request fails; the others go on
                self._finish(rid, e)
                continue
            generator = None
            if s.seed is not None and s.temperature > 0:
                generator = torch.Generator(device=logits.device).manual_seed(s.seed)
            with self._cv:
                row = self.rows.join(rid)
            self.batch.load(row, cache, s.max_new_tokens)
            release(cache)  # copied into the batch: its buffers go back to the pool now
            self._running[rid] = _Running(handle, TextStream(self.engine.tokenizer, s.stop), generator, position)
            self._emit(rid, sample(logits, s, generator))

    def _step(self) -> None:
        order = self.rows.running
        if len(order) == 1 and not self.rows.num_waiting and self._step_alone(order[0]):
            return
        ids = [self._running[rid].ids[-1] for rid in order]
        positions = [self._running[rid].position for rid in order]
        try:
            with self.engine.model_lock:
                logits = decode_step(self.engine.model, self.batch, ids, positions)  # [n, V]
        except Exception as e:  # noqa: BLE001 - the step's requests fail; the thread serves the next ones
            for rid in order:
                self._finish(rid, e)
            return
        for r, rid in enumerate(order):
            run = self._running[rid]
            run.position += 1
            run.num_forwards += 1
            self._emit(rid, sample(logits[r], run.handle.sampling, run.generator, run.ids))  # ids: for the repetition controls

    def _step_alone(self, rid: int) -> bool:
        """The one running request, greedy: check a prompt lookup draft (engine/lookup.py) in a forward
        of its row alone, as `PromptCache.generate` does. False where there is no draft to check."""
        run = self._running[rid]
        s = run.handle.sampling
        if not self.engine.prompt_lookup or s.temperature > 0:
            return False
        if run.drafter is None:
            run.drafter = NgramDrafter(t for p in run.handle.plan.pieces for t in p.token_ids)
        draft = run.drafter.draft_after(run.ids, min(self.engine.prompt_lookup, s.max_new_tokens - len(run.ids) - 1))
        if not draft:
            return False
        try:
            with self.engine.model_lock:
                rows = decode_row(self.engine.model, self.batch, 0, [run.ids[-1], *draft], run.position)
        except Exception as e:  # noqa: BLE001 - this request fails; the thread serves the next ones
            self._finish(rid, e)
            return True
        run.num_forwards += 1
        accepted = 0
        for token, kept in verify(rows, draft, s, run.generator, run.ids):
            accepted += kept
            run.position += 1
            self._emit(rid, token)  # appends to run.ids
            if rid not in self._running:  # finished: EOS, a stop string, max tokens, or cancelled
                return True
        self.batch.lengths[0] -= len(draft) - accepted  # the rejected rest of the draft
        return True

    def _emit(self, rid: int, token: int) -> None:
        """Record one sampled token of `rid`; finish it when it ends."""
        run = self._running[rid]
        h = run.handle
        if not run.ids:
            run.ttft = time.perf_counter() - h.t0
        run.ids.append(token)
        finish: FinishReason | None = None
        if token in self.engine.eos_ids and not h.ignore_eos:
            finish = "eos"
        else:
            piece = run.text.push(token)
            if piece:
                h._put(piece)
            if run.text.stopped:
                finish = "stop"
            elif len(run.ids) >= h.sampling.max_new_tokens:
                finish = "length"
        if finish is not None:
            tail = run.text.finish()
            if tail:
                h._put(tail)
            self._finish(rid, _result(run, finish))

    def _finish(self, rid: int, outcome: Result | BaseException) -> None:
        with self._cv:
            move = self.rows.leave(rid)
            handle = self._handles.pop(rid)
        self._running.pop(rid, None)
        if move is not None:
            self.batch.move(move.src, move.dst)
        handle._put(outcome)


def _result(run: _Running, finish: FinishReason) -> Result:
    return run.handle.plan.result(run.text.text, run.ids, finish, run.ttft, time.perf_counter() - run.handle.t0,
                                  run.num_forwards)
