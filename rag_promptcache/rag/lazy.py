"""Lazy module KV: a corpus whose modules are chunked, embedded and indexed at ingest and whose KV is
computed when a question first retrieves them (the planner's miss path: encoded once however many
requests miss it at once, written back through every tier within its budget).

- `ingest --kv lazy` (`Corpus.build(kv="lazy")`): ingest costs what chunking and embedding cost, and the
  store starts at zero bytes; `eager` (the default) computes every module's KV at ingest, so no first
  question pays for it. Where the line is: docs/stores.md ("Lazy or eager").
- `coverage`: how much of the corpus's KV is held now (what `info` and the server's `/metrics` show).
- `RetrievalLog`: how often each module was retrieved, kept in the corpus's table (`warm` reads it).
- `warm`: encode the N modules questions retrieve most (from a question log, or from that record),
  skipping those held already, so an interrupted warm resumes where it stopped.

Not here: the miss path itself (engine/planning/plan.py), the budget (budget.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from rag_promptcache.rag import budget as budgeting
from rag_promptcache.rag import corpus_store, layout
from rag_promptcache.rag.budget import KV_MODES, StoreBudget, check_kv, module_bytes  # noqa: F401 - KV_MODES, check_kv: re-exported

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag.corpus import Corpus
    from rag_promptcache.rag.engine_slot import EngineSlot
    from rag_promptcache.rag.records import Manifest
    from rag_promptcache.rag.table import ChunkTable
    from rag_promptcache.store.base import Store

T = TypeVar("T")
FLUSH_EVERY = 32  # retrievals noted between writes of their counts


@dataclass(frozen=True, slots=True)
class Coverage:
    """How much of a corpus's module KV the store holds now (in any tier)."""

    num_modules: int
    num_encoded: int  # modules with an entry held (either, where the corpus keeps two: `--neighbours-present`)
    num_tokens: int
    num_encoded_tokens: int
    # where the corpus keeps two entries, the modules whose entry encoded after their neighbours is held
    # (ingest writes the plain ones; these follow in idle time, `Upgrades`); None: it keeps one
    num_after_neighbours: int | None = None

    @property
    def share(self) -> float:
        """Of the corpus's module tokens, the share whose KV is held."""
        return self.num_encoded_tokens / self.num_tokens if self.num_tokens else 0.0


def held_keys(corpus: Corpus) -> set[str]:
    """Store keys the corpus's tiers hold: its engine's store where it loaded one, else the disk tier's
    files and the Redis tier's index (no model is loaded for this)."""
    if corpus.loaded:
        store = corpus.store
        tiers = getattr(store, "tiers", None) or [store]
        return {k for t in tiers if hasattr(t, "keys") for k in t.keys()}
    held = layout.store_keys(corpus.path) if corpus.disk_tier else set()
    if corpus.redis_url is not None:
        from rag_promptcache.store import RedisStore

        redis = RedisStore(corpus.redis_url, prefix=corpus_store.redis_prefix(corpus.manifest.name))
        try:
            held |= set(redis.keys())
        finally:
            redis.close()
    return held


def coverage(corpus: Corpus) -> Coverage:
    rows = corpus.table.module_keys()
    held = held_keys(corpus)
    after = {m for m, key, _ in rows if key in held}
    if not corpus.manifest.neighbours_present:
        encoded = [n for m, _, n in rows if m in after]
        return Coverage(len(rows), len(encoded), sum(n for _, _, n in rows), sum(encoded))
    plain = {m for m, key, _ in corpus.table.module_keys(plain=True) if key in held}
    encoded = [n for m, _, n in rows if m in after or m in plain]
    return Coverage(len(rows), len(encoded), sum(n for _, _, n in rows), sum(encoded), len(after))


class RetrievalLog:
    """Counts of retrieved modules, added into the table every `FLUSH_EVERY` retrievals and on `flush`.
    A table that cannot be written (a read-only corpus) keeps nothing, and questions go on."""

    def __init__(self, table: ChunkTable) -> None:
        self.table = table
        self._counts: Counter[str] = Counter()
        self._pending = 0
        self._lock = threading.Lock()

    def note(self, module_ids: Iterable[str]) -> None:
        with self._lock:
            self._counts.update(module_ids)
            self._pending += 1
            due = self._pending >= FLUSH_EVERY
        if due:
            self.flush()

    def flush(self) -> None:
        import sqlite3

        with self._lock:
            counts, self._counts, self._pending = dict(self._counts), Counter(), 0
        if counts:
            try:
                self.table.count_retrievals(counts)
            except sqlite3.Error:
                pass  # read-only or busy: frequencies are a hint for `warm`, never worth a failed answer


@dataclass(frozen=True, slots=True)
class WarmReport:
    num_wanted: int  # the top modules asked for (capped by what the budget holds)
    num_held: int  # of those, already held (a resumed or repeated warm)
    num_encoded: int
    num_tokens: int  # encoded now
    seconds: float
    capped: str = ""  # why fewer than asked, if so


def read_questions(path: Path) -> list[str]:
    """A question log: one question a line, or JSON lines with a "question" (or "text") field."""
    if not path.is_file():
        raise ValueError(f"no such question log: {path}")
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                row = json.loads(line)
                out.append(str(row.get("question") or row["text"]))
            except (ValueError, KeyError) as e:
                raise ValueError(f"{path}:{number}: a JSON line needs a \"question\" or \"text\" field") from e
        else:
            out.append(line.strip())
    if not out:
        raise ValueError(f"{path} holds no questions")
    return out


def ranked(corpus: Corpus, questions: Sequence[str] | None, k: int) -> list[str]:
    """Module ids, most retrieved first: by `questions` (each searched for its `k` nearest), else by the
    corpus's record of what questions retrieved."""
    if questions is None:
        return [m for m, _ in corpus.table.retrieval_counts()]
    counts: Counter[str] = Counter()
    for q in questions:
        counts.update(m for m, _ in corpus.search(q, k))
    order = {m: i for i, (m, _, _) in enumerate(corpus.table.module_keys())}
    return sorted(counts, key=lambda m: (-counts[m], order.get(m, 0)))


def warm(corpus: Corpus, top: int | None, questions: Sequence[str] | None = None, k: int = 4,
         progress: Callable[[int], None] | None = None) -> WarmReport:
    """Encode the `top` most retrieved modules not held yet (None: every module, the most retrieved first;
    resumable: what is held is skipped), capped at what the store's budget holds; `progress(n)` after each
    batch encoded. Where the corpus keeps two entries of each module, this encodes the ones after their
    neighbours (the plain ones are written at ingest) and the budget counts both."""
    import time

    if top is not None and top < 1:
        raise ValueError(f"--top must be at least 1, got {top}")
    t0 = time.perf_counter()
    order = ranked(corpus, questions, k)
    tokens = {m: n for m, _, n in corpus.table.module_keys()}
    if top is None:
        order = list(dict.fromkeys([*order, *tokens]))
        top = len(order)
    if not order:
        raise ValueError("nothing to warm from: no question has retrieved a module of this corpus yet; "
                         "pass a question log (--questions FILE)" if tokens else "the corpus holds no modules")
    engine = corpus.prepare()
    wanted = list(within_budget(corpus, engine, ((m, tokens.get(m, 0)) for m in order[:top])))
    capped = ""
    if len(wanted) < len(order[:top]):
        capped = (f"the store budget holds about {len(wanted)} of the {min(top, len(order))} modules asked "
                  f"for ({corpus.budget.describe()})")
    elif len(order) < top:
        capped = f"only {len(order)} modules were ever retrieved"
    report = engine.encode(corpus.manifest.name, wanted, progress=progress)
    return WarmReport(len(wanted), report.num_skipped, report.num_modules, report.num_tokens,
                      time.perf_counter() - t0, capped)


HOT = 2  # retrievals that make a module worth warming in idle time


def warm_one(corpus: Corpus, engine: PromptCache, warmed: set[str]) -> bool:
    """One step of idle warming (`StoreAccess.warm_when_idle`): encode the most retrieved module, among those
    the budget holds, that is not held and not warmed before by `warmed`'s owner → whether one was."""
    tokens, name = {m: n for m, _, n in corpus.table.module_keys()}, corpus.manifest.name
    hot = itertools.takewhile(lambda mc: mc[1] >= HOT, corpus.table.retrieval_counts())
    for m in within_budget(corpus, engine, ((m, tokens.get(m, 0)) for m, _ in hot)):
        if m in warmed or engine.is_cached(name, m):
            continue
        warmed.add(m)
        try:
            engine.encode(name, [m])
        except BaseException:  # a request stopped its forward (the encoder's `Yielded`), or it failed: not warmed
            warmed.discard(m)
            raise
        return True
    return False


class Upgrades:
    """Idle steps of a corpus that keeps two entries of each module (`--neighbours-present`): encode the entries
    encoded after their neighbours, which ingest leaves for later (rag/encoding.py `encode_kv`), one module a
    step in ingest order, while the budget holds both entries of each. A module a question read plain in the
    meantime is queued by that question (engine/planning/plan.py) and found held here; one ingested while the
    server runs is found on the next step."""

    def __init__(self, corpus: Corpus) -> None:
        self.corpus = corpus
        self.done: set[str] = set()  # entry keys found held or encoded here: not looked up again

    def __call__(self) -> bool:
        c, name = self.corpus, self.corpus.manifest.name
        engine = c.prepare()  # the schema as the table is now (an ingest meanwhile re-registers it)
        store = engine.store_of(name)
        for m, key in within_budget(c, engine, (((m, key), n) for m, key, n in c.table.module_keys())):
            if key in self.done:
                continue
            if not store.contains(key):
                engine.encode(name, [m])  # a forward a request stops (the encoder's `Yielded`) is tried again next step
                self.done.add(key)
                return True
            self.done.add(key)
        return False


def within_budget(corpus: Corpus, engine: PromptCache, items: Iterable[tuple[T, int]]) -> Iterator[T]:
    """The items of `items` ((item, its module's tokens), in the order given) while the store's budget holds
    every entry the corpus keeps of each of their modules, summed in that order (both entries where it keeps
    two: `--neighbours-present`); the walk `warm`, `warm_one` and `Upgrades` share."""
    room, used = _room(corpus), 0
    entries = 2 if corpus.manifest.neighbours_present else 1
    for item, tokens in items:
        used += entries * module_bytes(engine, tokens, corpus.manifest.codec)
        if room is not None and used > room:
            return
        yield item


def _room(corpus: Corpus) -> int | None:
    """The bytes the corpus's persistent tiers hold (writes go through to each, so the largest of disk and
    Redis where both are used); the memory tier's where it is the only one. None: unbounded."""
    b = corpus.budget
    limits = [v for use, v in ((corpus.disk_tier, b.disk), (corpus.redis_url is not None, b.redis)) if use]
    if not limits:
        return b.memory
    return None if any(v is None for v in limits) else max(limits)  # type: ignore[type-var]


class StoreAccess:
    """Mixed into `Corpus` (which sets these): its store's tiers and budget, how much of its KV they hold,
    warming them."""

    path: Path
    manifest: Manifest
    table: ChunkTable
    memory_bytes: int | None
    disk_tier: bool
    redis_url: str | None
    lock: threading.RLock
    retrievals: RetrievalLog
    engine_slot: EngineSlot  # the corpus's engine, loaded on first use
    _own_store: Store | None  # this corpus's tiers, attached to a shared engine for its schema (`attach_own_store`)

    @property
    def loaded(self) -> bool:
        """Whether the corpus has its engine (loaded, or a caller's)."""
        return self.engine_slot.loaded is not None

    @property
    def store(self) -> Store:
        """Where this corpus's module KV is read and written: the engine's store for its schema (its own
        tiers where it loaded the engine or shares one, else the caller's engine's store)."""
        return self.engine_slot.get().store_of(self.manifest.name)

    @property
    def owns_store(self) -> bool:
        """Whether the store holding this corpus's KV is its own (its tiers, its budget, closed with it)."""
        return self._own_store is not None or self.engine_slot.owned is not None

    def attach_own_store(self, engine: PromptCache) -> None:
        """Open this corpus's own tiers and have `engine` (another corpus's) keep this corpus's modules in
        them: corpora on one model, each within its own budget (`Corpus.open(..., own_store=True)`)."""
        if self._own_store is None:
            self._own_store = self.open_store()
            engine.attach_store(self.manifest.name, self._own_store)

    def close_own_store(self) -> None:
        if self._own_store is not None:
            if (engine := self.engine_slot.loaded) is not None:
                engine.detach_store(self.manifest.name)
            self._own_store.close()
            self._own_store = None

    def open_store(self) -> Store:
        """A new handle on this corpus's KV store (memory → disk → Redis, as configured), within its budget."""
        disk = self.path / layout.STORE if self.disk_tier else None
        return corpus_store.open_store(disk, True, self.redis_url, self.manifest.name, self.manifest.codec, self.budget)

    @property
    def budget(self) -> StoreBudget:
        """The store budget this process holds its tiers to: the recorded one, `memory_bytes` over its memory."""
        recorded = StoreBudget.of(self.manifest)
        return recorded if self.memory_bytes is None else dataclasses.replace(recorded, memory=self.memory_bytes)

    def set_budget(self, budget: StoreBudget | None, kv: str | None = None) -> list[str]:
        """Record a new store budget (None: keep it) and how later ingests encode (`kv`; None: keep it);
        returns what changed ("disk 4.0 GiB -> 2.0 GiB"). A tier budget smaller than one module is a
        ValueError. Tiers already open keep the old budget until reopened (a lowered disk budget is held
        when the store opens: store/disk.py)."""
        with self.lock:
            self.manifest, changed = budgeting.record(self.manifest, budget, kv, self.engine_slot.get)
            if changed:
                layout.write_manifest(self.path, self.manifest)
                if budget is not None and self.owns_store:
                    corpus_store.resize(self.store, self.budget)
            return changed

    def coverage(self) -> Coverage:
        """How much of the corpus's module KV its store holds now (`ingest --kv lazy` starts at none)."""
        return coverage(self)  # type: ignore[arg-type]

    def store_deferred(self, stopped: Callable[[], bool] = lambda: False) -> int:
        """Encode and store now, in this thread, the modules earlier answers computed without waiting for
        their encoding (the engine's background queue) → how many were written. The CLI's `ask` calls it
        once the answer is out, so the next process reads them as stored; a server leaves it to the
        background encoder, which works while no request is in flight."""
        engine = self.engine_slot.loaded
        return 0 if engine is None else engine.background.drain(stopped)

    def warm_when_idle(self) -> None:
        """Spend the engine's idle time (no request in flight, no missed module queued) encoding the modules
        the retrieval log says are hot (retrieved at least twice) and the store does not hold, most retrieved
        first, within what the budget holds, each at most once per process: a restarted server refills what
        its questions come back to before they do; then, where an eager corpus keeps two entries of each module,
        the entries encoded after their neighbours not held yet (`Upgrades`). What `serve` and the Ray replicas
        call at start-up."""
        engine = self.engine_slot.get()
        warmed: set[str] = set()
        # a lazy corpus's store grows with what questions retrieve: its entries after the neighbours too
        both = self.manifest.neighbours_present and self.manifest.kv == "eager"
        upgrades = Upgrades(self) if both else lambda: False  # type: ignore[arg-type]

        def step() -> bool:
            self.retrievals.flush()  # this process's latest retrievals count too
            return warm_one(self, engine, warmed) or upgrades()  # type: ignore[arg-type]

        engine.background.start_idle(step)

    def warm(self, top: int | None, questions: Sequence[str] | None = None, k: int = 4) -> WarmReport:
        """Encode the `top` modules questions retrieve most (from `questions`, else from what questions
        retrieved so far; None: every module, those first), those not held yet, within the store's budget."""
        self.retrievals.flush()
        return warm(self, top, questions, k)  # type: ignore[arg-type]
