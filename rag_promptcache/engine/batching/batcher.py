"""`Batcher`: one thread that decodes every running request together, one forward per token.

    with engine.scheduler(max_batch=8) as batcher:
        h = batcher.submit(prompt, max_new_tokens=64)   # plans now: bad prompts raise here
        for piece in h: ...                              # or `async for`, or h.consume()
        h.result                                         # the engine's `Result`

A submitted request waits in a bounded queue (`QueueFull` past `max_queue`). Between decode steps
the thread admits waiting requests while rows are free (an admitted request holds its row while it
prefills). Prefills run whole by default, admitted as `admission` says (`ADMISSIONS`): "all" (the
default) runs every admitted request's prefill, one after another, before the next decode step, so a
running stream waits for all of them; "one" runs one admitted prefill between two decode steps while
rows decode, so a running stream waits for one at most, and with no row decoding runs the prefills
waiting together in one batched forward (`batch.mixed_step` with no rows, Llama's lean forward; other
models one after another), stalling nobody. With `prefill_chunk=N` it is chunked
(engine/planning/prefill.py `start` → `Prefilling`, as vLLM and SGLang schedule it): while rows decode, each of their steps carries the next N new tokens of the oldest
admitted request in the same forward (`batch.mixed_step`, Llama's lean forward), or, for other
models, runs them in a forward of their own just before the step; with no row decoding, the oldest
prefill runs whole (nobody waits on it). A running stream then waits one chunk per step instead of
whole prefills. A finished prefill's KV is copied into its row of the `BatchCache` and its first
token chosen; then one `decode_step` advances every running row by one token. A request running
alone with nothing waiting decodes as `PromptCache.generate` does, checking prompt lookup drafts
(engine/decoding/lookup.py) in a forward of its row (`decode_row`). A row that ends (EOS, stop string, max
tokens) or is cancelled leaves before the next step. Each request keeps its own `DecodeState`
(engine/decoding/state.py: sampling, seeded generator, text, finish, drafts), the one the engine's own loop
uses, so a request decoded in a batch gets the tokens it gets alone (up to float rounding of the
batched matmuls).

The batcher knows the engine only through the `Engine` protocol below: engine.py imports this
module, never the other way round.

Not here: retrieval or HTTP (rag/, server/); the bookkeeping itself (`scheduler.py`); chunks of
several prefills in one decode step (the oldest prefill's chunk only), an admission policy for chunked
prefills (their chunk bounds the stall), a budget in seconds rather than tokens.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from rag_promptcache.engine.kv.assemble import release
from rag_promptcache.engine.batching.batch import BatchCache, can_mix, decode_row, decode_step, mixed_step
from rag_promptcache.engine.batching.handle import Cancelled, Handle
from rag_promptcache.engine.result import Result
from rag_promptcache.engine.decoding.sampling import Sampling
from rag_promptcache.engine.batching.scheduler import QueueFull, Rows
from rag_promptcache.engine.planning.background import Activity, Ticket

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rag_promptcache.engine.decoding.grammar import Grammar
    from rag_promptcache.engine.planning.plan import Plan
    from rag_promptcache.engine.planning.prefill import Chunk, Prefilled, Prefilling
    from rag_promptcache.engine.prefix.prefix_cache import PrefixUse
    from rag_promptcache.engine.planning.recovery import Recovery
    from rag_promptcache.engine.decoding.state import DecodeState
    from rag_promptcache.model.positions import KVGeometry
    from rag_promptcache.pml import ast

__all__ = ["Batcher", "Cancelled", "Handle", "QueueFull"]


class Engine(Protocol):
    """What the batcher uses of its engine (`PromptCache`): its public request path, model and lock."""

    model: PreTrainedModel
    geometry: KVGeometry
    model_lock: AbstractContextManager[object]  # held around every forward
    activity: Activity  # requests in flight (engine/planning/background.py)

    def plan(self, prompt: str | ast.Prompt, *, use_cache: bool = ..., recovery: str | Recovery | None = ...,
             max_new_tokens: int = ...) -> Plan: ...

    def start_prefill(self, plan: Plan, room: int = ...) -> Prefilling: ...

    def keep_kv(self, plan: Plan, prefix: PrefixUse | None, state: DecodeState, keys: Sequence[torch.Tensor],
                values: Sequence[torch.Tensor], length: int) -> int: ...

    def decode_state(self, plan: Plan, sampling: Sampling, *, t0: float | None = ..., lookup: bool = ...) -> DecodeState: ...

    def grammar(self, sampling: Sampling) -> Grammar | None: ...


@dataclass(slots=True)
class _Running:
    handle: Handle
    state: DecodeState
    prefix: PrefixUse | None  # what the prefill reused from the prefix cache; its row is kept there at the end


# Whole prefills by default: on a CPU a prefill is compute-bound at any chunk size, so chunking moves its
# time between the steps rather than hiding it. It bounds the longest stall of a running stream but costs
# burst throughput and median time between tokens (docs/serving.md, "Mixed batches": run_serve.py).
DEFAULT_PREFILL_CHUNK: int | None = None
# How whole prefills are admitted between decode steps (the module docstring): "all", the batcher as it
# was, stays the default until `rag-promptcache bench --scenarios serve --serve-admission one` measures better
ADMISSIONS = ("all", "one")
DEFAULT_ADMISSION = "all"


class Batcher:
    def __init__(self, engine: Engine, *, max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, admission: str = DEFAULT_ADMISSION) -> None:
        """`prefill_chunk`: new tokens of prefill run with each decode step (None: whole prefills, run as
        `admission` says: one of `ADMISSIONS`, the module docstring)."""
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be a number of tokens >= 1, or None for whole prefills; "
                             f"got {prefill_chunk!r}")
        if admission not in ADMISSIONS:
            raise ValueError(f"unknown admission {admission!r}; valid: {', '.join(ADMISSIONS)}")
        if admission != DEFAULT_ADMISSION and prefill_chunk is not None:
            raise ValueError(f"admission={admission!r} admits whole prefills: it needs prefill_chunk=None, got "
                             f"{prefill_chunk!r} (a chunk already bounds a running stream's stall)")
        self.engine = engine
        self.prefill_chunk = prefill_chunk
        self.admission = admission
        self.rows = Rows(max_batch, max_queue)
        model = engine.model
        self.batch = BatchCache(model.config, engine.geometry, max_batch, 256, model.dtype, model.device)
        self._handles: dict[int, Handle] = {}
        self._tickets: dict[int, Ticket] = {}  # each request's place in engine.activity
        self._running: dict[int, _Running] = {}
        self._prefilling: deque[int] = deque()  # admitted (each holds a row), oldest first, not yet prefilled
        self._partial: dict[int, Prefilling] = {}  # the ones whose prefill has started: KV assembled
        # chunks ride in the decode step's forward, or waiting prefills share one (batch.mixed_step), where
        # the model allows it
        self._mix = can_mix(model) and (prefill_chunk is not None or admission == "one")
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rag-promptcache-batcher", daemon=True)
        self._thread.start()

    # -- callers -----------------------------------------------------------------------------------

    def submit(self, prompt: str | ast.Prompt, *, recovery: str | Recovery | None = None, ignore_eos: bool = False,
               use_cache: bool = True, **sampling) -> Handle:
        """Plan `prompt` (raising here on bad input) and queue it; `QueueFull` when the queue is full."""
        s = Sampling(ignore_eos=ignore_eos, **sampling)
        t0 = time.perf_counter()
        if self._closed:
            raise RuntimeError("this scheduler is closed")
        self.engine.grammar(s)  # a response_format schema that cannot be used raises here, not in the loop
        ticket = self.engine.activity.begin()  # in flight until `_finish`: the background encoder waits for it
        try:
            # planning may encode missing modules (forward passes under engine.model_lock); raises on a
            # prompt past the context window
            plan = self.engine.plan(prompt, use_cache=use_cache, recovery=recovery, max_new_tokens=s.max_new_tokens)
            handle = Handle(next(self._ids), plan, s, t0)
            handle.on_cancel = self._wake
            with self._cv:
                self.rows.submit(handle.id)  # raises QueueFull
                self._handles[handle.id] = handle
                self._tickets[handle.id] = ticket
                self._cv.notify()
        except BaseException:
            ticket.end()
            raise
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
        with self._cv:  # requests left unanswered no longer hold the engine busy
            for ticket in self._tickets.values():
                ticket.end()
            self._tickets.clear()

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
                while not (self._closed or self.rows.num_waiting or self.rows.num_running or self._prefilling):
                    self._cv.wait()
                if self._closed:
                    break
            self._drop_cancelled()
            self._admit()
            if self._mix and self._prefilling:
                if self.prefill_chunk is not None and self.rows.num_running:
                    self._step(carry=1)
                    continue
                if self.admission == "one" and not self.rows.num_running and len(self._prefilling) > 1:
                    self._step(carry=len(self._prefilling))  # nobody decodes: the waiting prefills in one forward
                    continue
            self._prefill()
            if self.rows.num_running:
                self._step()
        with self._cv:
            pending = [*self.rows.running, *self._prefilling,
                       *[self.rows.next_waiting() for _ in range(self.rows.num_waiting)]]
        for rid in self._partial:
            release(self._partial[rid].cache)
        for rid in pending:
            self._handles.pop(rid).put(Cancelled("the scheduler was closed"))

    def _drop_cancelled(self) -> None:
        with self._cv:
            gone = [rid for rid, h in self._handles.items() if h.cancelled]
        for rid in gone:
            self._finish(rid, Cancelled(f"request {rid} was cancelled"))

    def _admit(self) -> None:
        """Waiting requests take the free rows; their prefills queue, oldest first."""
        with self._cv:
            while self.rows.has_room():
                self._prefilling.append(self.rows.next_waiting())

    def _prefill(self) -> None:
        """Run up to `prefill_chunk` new tokens of the queued prefills while rows decode (their streams
        wait for this), else whole ones: every queued one (`admission` "all"), or the oldest (chunked, or
        "one": the rows step before another whole prefill runs); a request whose prefill ends joins the batch."""
        budget = self.prefill_chunk if self.rows.num_running else None
        while budget is None or budget > 0:
            head = self._head_prefill()
            if head is None:
                return
            rid, todo = head
            try:
                tokens = None if budget is None else min(budget, todo.num_left)
                with self.engine.model_lock:
                    first = todo.run(self.engine.model, tokens)
            except Exception as e:  # noqa: BLE001 - this request fails; the others go on
                self._finish(rid, e)
                continue
            if first is None:
                return  # the budget is spent mid-prefill
            self._join(rid, first)
            if budget is None:
                if self.prefill_chunk is not None or self.admission == "one":
                    return  # a row decodes now: it steps before the next prefill, so it waits for one at most
                continue  # "all": every admitted one before the next step
            budget -= tokens

    def _head_prefill(self) -> tuple[int, Prefilling] | None:
        """The oldest admitted request's prefill (`_ready`), None when no prefill waits."""
        ready = self._ready(1)
        return ready[0] if ready else None

    def _ready(self, limit: int) -> list[tuple[int, Prefilling]]:
        """The prefills of up to `limit` of the oldest admitted requests, oldest first, each one's KV
        assembled now if it was not yet (a request whose assembly fails fails, and the next one is
        tried; a repeat joins the batch at once)."""
        out: list[tuple[int, Prefilling]] = []
        for rid in list(self._prefilling):
            if len(out) == limit:
                break
            todo = self._partial.get(rid)
            if todo is None:  # assembly copies module KV, runs no model: outside the lock
                try:
                    todo = self._partial[rid] = self.engine.start_prefill(self._handles[rid].plan)
                except Exception as e:  # noqa: BLE001 - this request fails; the others go on
                    self._finish(rid, e)
                    continue
            if todo.repeat:  # an exact repeat: its first token's logits are known, no forward to run
                self._join(rid, todo.prefilled())
                continue
            out.append((rid, todo))
        return out

    def _join(self, rid: int, first: Prefilled) -> None:
        """The prefill of `rid` is done: into its row, and its first token."""
        assert rid in self._prefilling, f"{self._prefilling=} {rid=}"
        self._prefilling.remove(rid)
        del self._partial[rid]
        handle = self._handles[rid]
        with self._cv:
            row = self.rows.join(rid)
        self.batch.load(row, first.cache, handle.sampling.max_new_tokens)
        release(first.cache)  # copied into the batch: its buffers go back to the pool now
        # a row's KV is dropped by setting its length back: drafts can always be rolled back here
        self._running[rid] = _Running(handle, self.engine.decode_state(handle.plan, handle.sampling, t0=handle.t0),
                                      first.prefix)
        self._advance(rid, first.logits[None])

    def _step(self, carry: int = 0) -> None:
        """One token for every running row; `carry`: with the next chunk (`prefill_chunk` tokens, or
        all that are left) of up to that many of the oldest prefills in the same forward (`mixed_step`);
        a prefill whose chunk was its last joins the batch."""
        heads = self._ready(carry) if carry else []
        order = self.rows.running
        if not order and not heads:
            return
        # only a request decoding alone checks a prompt lookup draft
        alone = len(order) == 1 and not self.rows.num_waiting and not heads
        fed = [self._running[rid].state.next_input(draft=alone) for rid in order]
        if alone and len(fed[0]) > 1:
            self._step_row(order[0], fed[0])
            return
        ids = [f[0] for f in fed]
        positions = [self._running[rid].state.position for rid in order]
        contexts = [todo.asm.num_cached + todo.num_done for _, todo in heads]
        chunks = [todo.take(self.prefill_chunk) for _, todo in heads]
        rows = self.batch.lengths[: len(order)]  # the KV each running row attends to, before this step
        try:
            with self.engine.model_lock:
                t0 = time.perf_counter()
                if not heads:
                    logits = decode_step(self.engine.model, self.batch, ids, positions)  # [n, V]
                else:
                    logits, lasts = mixed_step(self.engine.model, self.batch, ids, positions,
                                               [(todo.cache, chunk) for (_, todo), chunk in zip(heads, chunks)])
                    _ran_together(heads, chunks, contexts, rows, t0)
        except Exception as e:  # noqa: BLE001 - the step's requests fail; the thread serves the next ones
            for rid in [*order, *(rid for rid, _ in heads)]:
                self._finish(rid, e)
            return
        for r, rid in enumerate(order):
            self._advance(rid, logits[r : r + 1])
        for (rid, todo), chunk, last in zip(heads, chunks, lasts if heads else []):
            if chunk.last:
                self._join(rid, todo.prefilled(last))

    def _step_row(self, rid: int, fed: list[int]) -> None:
        """The one running request with a prompt lookup draft: check it in a forward of its row alone
        (row 0), as `PromptCache.generate` does, and drop the KV of the draft's rejected rest."""
        state = self._running[rid].state
        try:
            with self.engine.model_lock:
                rows = decode_row(self.engine.model, self.batch, 0, fed, state.position)
        except Exception as e:  # noqa: BLE001 - this request fails; the thread serves the next ones
            self._finish(rid, e)
            return
        rejected = self._advance(rid, rows)
        self.batch.lengths[0] -= rejected

    def _advance(self, rid: int, rows: torch.Tensor) -> int:
        """Hand `rid`'s state the logits of its forward; emit its text, finish it when it ends → the
        draft tokens it rejected."""
        run = self._running[rid]
        try:  # sampling, the grammar, stop conditions: the request's own code, in this thread
            step = run.state.advance(rows)
        except Exception as e:  # noqa: BLE001 - this request fails; the others go on
            self._finish(rid, e)
            return 0
        for piece in step.pieces:
            run.handle.put(piece)
        if run.state.finished:
            row = self.rows.row(rid)
            self.engine.keep_kv(run.handle.plan, run.prefix, run.state, self.batch.keys[:, row],
                                self.batch.values[:, row], self.batch.lengths[row])
            num_prefix = run.prefix.num_tokens if run.prefix is not None else 0
            self._finish(rid, run.handle.plan.result(run.state, time.perf_counter() - run.handle.t0, num_prefix,
                                                     self.engine.adapter_name))
        return step.num_rejected

    def _finish(self, rid: int, outcome: Result | BaseException) -> None:
        with self._cv:
            move = self.rows.leave(rid)
            handle = self._handles.pop(rid)
            ticket = self._tickets.pop(rid, None)
        if ticket is not None:
            ticket.end()
        self._running.pop(rid, None)
        if rid in self._prefilling:
            self._prefilling.remove(rid)
        todo = self._partial.pop(rid, None)
        if todo is not None:
            release(todo.cache)
        if move is not None:
            self.batch.move(move.src, move.dst)
        handle.put(outcome)


def _ran_together(heads: Sequence[tuple[int, Prefilling]], chunks: Sequence[Chunk], contexts: Sequence[int],
                  rows: Sequence[int], t0: float) -> None:
    """Prefills that shared one forward, with the decode rows `rows` (each by the KV it attended to) or
    none, report it to the engine's pace (`Prefilling.on_ran`, as `Prefilling.run` does for one alone).
    The pace meter sums a span of forwards before it takes a sample, so only the totals count: each
    prefill reports its chunk with the forward's seconds split by tokens, the first also the rows and
    their tokens' share (the cost model puts the rows beside its chunk: `Costs.carrying`)."""
    if chunks and chunks[0].ids.device.type == "cuda":
        torch.cuda.synchronize(chunks[0].ids.device)
    seconds = time.perf_counter() - t0
    sizes = [chunk.ids.shape[1] for chunk in chunks]
    total = sum(sizes) + len(rows)
    for j, ((_, todo), size, context) in enumerate(zip(heads, sizes, contexts)):
        carried = rows if j == 0 else ()
        if todo.on_ran is not None:
            todo.on_ran(size, context, seconds * (size + len(carried)) / total, carried)
