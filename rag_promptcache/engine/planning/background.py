"""Encoding missed modules off the request's path.

A request whose module is missing from the store does not wait for it to be encoded: the planner
computes the module's tokens in the request's own prefill (against the modules before it, as a full
prefill would) and hands the module here. `BackgroundEncoder` encodes it later, the way an ingest
would (alone after the schema's context, or after its neighbours where the corpus says so), and
writes it to the store, so the next question that retrieves it reads it as stored (a by-product entry,
engine/kv/byproduct.py, comes ready-made: only the write).

- One forward at a time, and only while no request is in flight (`Activity`). A request that
  arrives during a background forward stops it before the next decoder layer (`yield_between`: a
  pre-hook on each layer, live only in the encoder's thread) and the job goes back to the head
  of the queue (`num_yielded`), as does a job whose turn comes as a request arrives: a request
  waits for at most one layer of a background forward, never for the queue. Idle steps' forwards give
  way the same, and `close` (also at the interpreter's exit) stops a forward at its next layer.
- `EncodeQueue` (no torch): duplicates coalesce by store key; a full queue drops the newest job rather than
  grow; `Admission` says which misses are worth storing (one retrieved once is not worth one retrieved often).
- A job that fails (a store that cannot write, a model error) is counted and dropped: the question
  was answered already, and a store entry is written whole or not at all (each tier's `put`).
- `drain` encodes what is queued in the caller's thread (the CLI's `ask`, after the answer is out).
- `start_idle`: a server's idle time: when the queue is empty and no request is in flight, the thread asks
  each step it was given for one piece of other work (a corpus warms what its retrieval log says is hot,
  rag/lazy.py) until it says there is none, and again after later questions.

Out of scope: what a module's KV is (engine/planning/encoder.py), where it is stored (store/), which
modules are hot across restarts (rag/lazy.py's retrieval log, which `warm` reads).
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from rag_promptcache.engine.prompt.compiler import Unit
from rag_promptcache.store.base import ModuleKV, Store, is_full


class Yielded(Exception):
    """A background forward stopped between two layers: a request arrived, or the encoder is closing."""


_running = threading.local()  # `encoder`: set in the encoder's thread for the forward of a job or idle step
_hooked: weakref.WeakSet[object] = weakref.WeakSet()
_hooking = threading.Lock()
_live: weakref.WeakSet[BackgroundEncoder] = weakref.WeakSet()


def _give_way(*_: object) -> None:
    encoder = getattr(_running, "encoder", None)
    if encoder is not None and (encoder.activity.busy or encoder.closed):
        raise Yielded


@atexit.register
def _close_all() -> None:
    """A forward still running in a daemon thread at the interpreter's end aborts it: stop each at its next layer."""
    for encoder in list(_live):
        encoder.close()


def yield_between(layers: Sequence[object]) -> None:
    """Let background forwards stop between `layers` (a model's decoder layers, as transformers runs them)
    once a request is in flight: one pre-hook per layer, once per process (every engine on the model
    shares it), live only in a thread running a background job (a request's forward passes through)."""
    with _hooking:
        for layer in layers:
            if layer not in _hooked:
                layer.register_forward_pre_hook(_give_way)  # type: ignore[attr-defined]
                _hooked.add(layer)


ADMISSION_ENV = "RAG_PROMPTCACHE_ENCODER_ADMISSION"
AUTO_WINDOW = 20
DEFAULT_MAX_QUEUE = 256  # modules waiting; past it a new miss is dropped (it is computed again when next retrieved)
MISSES = ("defer", "encode")


def misses_policy(spec: str | None, default: str = "encode") -> str:
    """An engine's misses policy: `spec`, else $RAG_PROMPTCACHE_MISSES, else `default` (a bare engine encodes
    a miss where it is asked; a corpus's engine, `rag.models.load_engine`, defers it)."""
    spec = spec or os.environ.get("RAG_PROMPTCACHE_MISSES") or default
    if spec not in MISSES:
        raise ValueError(f"unknown misses policy {spec!r}; valid: {', '.join(MISSES)}")
    return spec


class Ticket:
    """One request's place in `Activity`; `end` is idempotent (the request's end, or its stream collected)."""
    __slots__ = ("_activity", "_open")

    def __init__(self, activity: Activity) -> None:
        self._activity, self._open = activity, True

    def end(self) -> None:
        if self._open:
            self._open = False
            self._activity.exit()


class Activity:
    """Requests in flight, from planning to their result: the background encoder runs only at zero."""

    def __init__(self) -> None:
        self._num = 0
        self._cv = threading.Condition()

    @property
    def busy(self) -> bool:
        return self._num > 0

    def enter(self) -> None:
        with self._cv:
            self._num += 1

    def exit(self) -> None:
        with self._cv:
            assert self._num > 0, f"{self._num=}"
            self._num -= 1
            if not self._num:
                self._cv.notify_all()

    def begin(self) -> Ticket:
        self.enter()
        return Ticket(self)

    @contextmanager
    def request(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.exit()

    def wait_idle(self, stopped: Callable[[], bool], poll_s: float = 0.05) -> bool:
        """Block until no request is in flight (True) or `stopped()` (False)."""
        with self._cv:
            while self._num and not stopped():
                self._cv.wait(poll_s)
            return not stopped()


@dataclass(frozen=True, slots=True)
class Admission:
    """Which missed modules are queued: `first` every miss; `second:W` a module missed (retrieved and not
    held) at least twice within the last W requests that missed anything; `auto` (`auto:W`, the default) every
    miss while the store has room, `second:W` once it is full (`store.base.is_full`: where a write evicts, a module
    retrieved once is not worth one retrieved often; W = 20 by default)."""

    min_misses: int = 1
    window: int = 0
    until_full: bool = False  # `auto`: `first` until the store is full

    @classmethod
    def parse(cls, spec: str | Admission | None) -> Admission:
        """`spec`, else $RAG_PROMPTCACHE_ENCODER_ADMISSION, else "auto". (Not $RAG_PROMPTCACHE_ADMISSION:
        that is how `serve` admits prefills into its batch.)"""
        if isinstance(spec, Admission):
            return spec
        spec = spec or os.environ.get(ADMISSION_ENV) or "auto"
        if spec == "first":
            return cls()
        head, _, window = str(spec).partition(":")
        window = window or (str(AUTO_WINDOW) if head == "auto" else "")
        if head in ("second", "auto") and window.isdigit() and int(window) >= 1:
            return cls(2, int(window), until_full=head == "auto")
        raise ValueError(f"bad admission {spec!r}: write first (every miss), second:W (a module missed twice "
                         "within the last W requests) or auto (first until the store is full, then second:20)")

    def __str__(self) -> str:
        tail = "" if self.until_full and self.window == AUTO_WINDOW else f":{self.window}"
        return "first" if self.min_misses <= 1 else ("auto" if self.until_full else "second") + tail


@dataclass(frozen=True, slots=True)
class Job:
    key: str  # the module's store key: what coalesces
    unit: Unit
    num_tokens: int
    store: Store | None = None  # where it goes (its schema's, `PromptCache.store_of`); None: the encoder's own
    kv: ModuleKV | None = None  # made already (a by-product entry, engine/kv/byproduct.py): written, not encoded


@dataclass(frozen=True, slots=True)
class BackgroundStats:
    num_queued: int  # waiting now
    num_encoded: int  # written: encoded by a forward, or a by-product entry made already
    num_tokens: int  # tokens of those
    num_coalesced: int  # misses of a module already queued, or found stored when its turn came
    num_dropped: int  # not queued: the queue was full
    num_deferred: int  # misses the admission rule did not queue yet
    num_failed: int  # encodes or writes that failed (the question was answered; the store is unchanged)
    last_error: str = ""  # the latest failure, `Type: message`
    num_yielded: int = 0  # jobs put back unencoded because a request arrived as their forward was due
    num_kept: int = 0  # of `num_encoded`, by-product entries (engine/kv/byproduct.py): written with no forward


class EncodeQueue:
    """The background encoder's bookkeeping: jobs in arrival order, one per store key, bounded, with
    the admission rule's recent misses. Pure Python (tested without tensors); not thread-safe alone."""

    def __init__(self, max_jobs: int = DEFAULT_MAX_QUEUE, admission: Admission | None = None) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self.max_jobs = max_jobs
        self.admission = admission or Admission()
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._recent: deque[tuple[str, ...]] = deque()  # the keys each of the last W missing requests missed
        self._counts: Counter[str] = Counter()
        self.num_coalesced = self.num_dropped = self.num_deferred = 0

    def __len__(self) -> int:
        return len(self._jobs)

    def offer(self, jobs: Sequence[Job], full: Callable[[Job], bool] = lambda job: True) -> list[Job]:
        """One request's misses → the jobs newly queued. `full(job)`: whether the job's store is full (what
        `auto` asks; it counts the misses either way, so it has a window's history when the store fills)."""
        rule = self.admission
        if rule.min_misses > 1:
            keys = tuple(dict.fromkeys(j.key for j in jobs))
            self._recent.append(keys)
            self._counts.update(keys)
            if len(self._recent) > rule.window:
                self._counts.subtract(self._recent.popleft())
        queued = []
        for job in jobs:
            if job.key in self._jobs:
                self.num_coalesced += 1
            elif rule.min_misses > 1 and self._counts[job.key] < rule.min_misses and (not rule.until_full or full(job)):
                self.num_deferred += 1
            elif len(self._jobs) >= self.max_jobs:
                self.num_dropped += 1
            else:
                self._jobs[job.key] = job
                queued.append(job)
        return queued

    def take(self) -> Job | None:
        """The oldest job, removed; None when empty."""
        return self._jobs.popitem(last=False)[1] if self._jobs else None

    def put_back(self, job: Job) -> None:
        """A job taken and not run, at the head again (unless its key was queued since)."""
        if job.key not in self._jobs:
            self._jobs[job.key] = job
            self._jobs.move_to_end(job.key, last=False)


class BackgroundEncoder:
    """A daemon thread that encodes queued misses one at a time while no request is in flight and writes
    them to `store`. `encode(units)` is the planner's (it takes the model lock); started on first use."""

    def __init__(self, encode: Callable[[Sequence[Unit]], list[ModuleKV]], store: Store, activity: Activity,
                 *, max_queue: int = DEFAULT_MAX_QUEUE, admission: str | Admission | None = None) -> None:
        self.encode, self.store, self.activity = encode, store, activity
        self.queue = EncodeQueue(max_queue, Admission.parse(admission))
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._working = False
        self.num_encoded = self.num_tokens = self.num_failed = self.num_yielded = self.num_kept = 0
        self.last_error = ""
        # steps of work for idle time, each → whether it did any (`start_idle`: a corpus's warming each)
        self.idle_steps: list[Callable[[], bool]] = []
        self._idle_due = False  # questions came since the idle steps last said it had nothing to do
        self._full: dict[int, bool] = {}  # id(store) → whether it was full after this encoder's last write to it
        _live.add(self)

    def submit(self, jobs: Sequence[Job]) -> int:
        """Queue one request's misses → how many were queued (the rest coalesced, deferred or dropped)."""
        with self._cv:
            if self._closed:
                return 0
            queued = self.queue.offer(jobs, lambda job: self._full.get(id(job.store or self.store), False))
            self._idle_due = bool(self.idle_steps) and not self._closed
            if queued or self._idle_due:
                self._start()
        return len(queued)

    def start_idle(self, step: Callable[[], bool]) -> None:
        """Spend idle time on `step()` too from now on (a server at start-up; one step per corpus on this engine)."""
        with self._cv:
            self.idle_steps.append(step)
            self._idle_due = not self._closed
            if not self._closed:
                self._start()

    def wake(self) -> None:
        """An idle step has work again (a cost model to measure anew): run the steps once no request runs."""
        with self._cv:
            if self.idle_steps and not self._closed:
                self._idle_due = True
                self._start()

    @property
    def closed(self) -> bool:
        return self._closed

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rag-promptcache-encoder", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def stats(self) -> BackgroundStats:
        with self._cv:
            q = self.queue
            return BackgroundStats(len(q) + self._working, self.num_encoded, self.num_tokens,
                                   q.num_coalesced, q.num_dropped, q.num_deferred, self.num_failed, self.last_error,
                                   self.num_yielded, self.num_kept)

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or being encoded and idle work has no more to do (True), or `timeout`
        seconds pass (False)."""
        with self._cv:
            return self._cv.wait_for(lambda: not (len(self.queue) or self._working or self._idle_due), timeout)

    def drain(self, stopped: Callable[[], bool] = lambda: False) -> int:
        """Encode every queued job now, in this thread, until the queue is empty or `stopped()` → how many
        were written (by this thread). The encoder's thread finishes the job it holds before this returns,
        so what was queued is stored when it does."""
        done = 0
        while not stopped():
            with self._cv:
                job = self.queue.take()
            if job is None:
                break
            done += self._run(job)
        with self._cv:
            self._cv.notify_all()
            self._cv.wait_for(lambda: not self._working or self._closed)
        return done

    def close(self) -> None:
        """Stop the forward in hand at its next layer and end the thread; what is queued is dropped (it is a
        miss again next time). Every live encoder is closed so at the interpreter's exit."""
        with self._cv:
            self._closed, self._idle_due = True, False
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._closed or len(self.queue) or self._idle_due):
                    self._cv.wait()
                if self._closed:
                    return
            if not self.activity.wait_idle(lambda: self._closed):
                return
            with self._cv:
                job = self.queue.take()
                idle = self._idle_once if job is None and self._idle_due else None
                self._working = job is not None or idle is not None
            if job is not None:
                self._run(job, yielding=True)
            elif idle is not None and not self._idle_step(idle):
                with self._cv:
                    self._idle_due = False
            with self._cv:
                self._working = False
                self._cv.notify_all()

    def _idle_once(self) -> bool:
        """The first idle step with work to do does one piece of it → whether any did."""
        return any(step() for step in list(self.idle_steps))

    def _idle_step(self, idle: Callable[[], bool]) -> bool:
        _running.encoder = self  # its forwards give way as a job's do
        try:
            return idle()
        except Yielded:  # what the step was encoding is encoded again on its next turn
            with self._cv:
                self.num_yielded += 1
            return True
        except Exception as e:  # noqa: BLE001 - idle work is a bonus: a failure ends it until the next questions
            with self._cv:
                self.num_failed += 1
                self.last_error = f"{type(e).__name__}: {e}"
            return False
        finally:
            _running.encoder = None

    def _run(self, job: Job, yielding: bool = False) -> int:
        """Encode and write one job → 1 if written, 0 if it was stored meanwhile, failed, or (`yielding`, the
        encoder's thread) put back because a request arrived before or during its forward."""
        store = job.store or self.store
        try:
            if store.contains(job.key):  # another process or an ingest wrote it meanwhile
                with self._cv:
                    self.queue.num_coalesced += 1
                return 0
            if yielding and self.activity.busy and job.kv is None:  # it came while the store was asked
                raise Yielded
            _running.encoder = self if yielding else None
            try:
                kv = job.kv if job.kv is not None else self.encode([job.unit])[0]
            finally:
                _running.encoder = None
            store.put(job.key, kv)
            if self.queue.admission.until_full:
                full = is_full(store)
                with self._cv:
                    self._full[id(store)] = full
        except Yielded:
            with self._cv:
                self.queue.put_back(job)
                self.num_yielded += 1
            return 0
        except Exception as e:  # noqa: BLE001 - the question was answered; a failed write leaves the store as it was
            with self._cv:
                self.num_failed += 1
                self.last_error = f"{type(e).__name__}: {e}"
            return 0
        with self._cv:
            self.num_encoded += 1
            self.num_kept += job.kv is not None
            self.num_tokens += job.num_tokens
        return 1
