"""Running an ingest: documents → chunk batches → embedded and encoded (here, or on Ray) → committed
to the table and the index, in order, with typed counts (`IngestStats`) → an `IngestReport`.

A batch is committed whole (its rows, vectors and the documents it completes in one transaction,
then the index), so an interrupted ingest leaves whole batches and the next one resumes after them,
with or without Ray. The corpus hands the ingestor what it owns as callables (the engine, the
embedder, adding vectors to its index, forgetting dropped modules), so this module does not import it.

Not here: gathering inputs and the budget (`ingest.py`), the encoding itself (`encoding.py`), Ray
(`distributed.py`), saving the index (the corpus, after `run`).
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rag_promptcache.rag.budget import StoreBudget
from rag_promptcache.rag.chunker import Chunk, Chunker, ChunkParams, search_text
from rag_promptcache.rag.embed import EmbedderLike, one_thread
from rag_promptcache.rag.encoding import NONE, Batch, Neighbours, encode_kv, encode_modules, store_keys
from rag_promptcache.rag.index import faiss_id
from rag_promptcache.rag import ingest, neighbours as nbr
from rag_promptcache.rag.loaders import Document, LoaderWarning, LoadReport
from rag_promptcache.rag.progress import progress
from rag_promptcache.rag.records import IngestReport, Manifest, StoreEstimate
from rag_promptcache.rag.table import ChunkRow, ChunkTable, DocumentRow, Dropped, ModuleRow

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.engine.planning.costmodel import Costs
    from rag_promptcache.rag.distributed import RayOptions, RayTarget

OnBatch = Callable[[int, int], None]  # (modules committed so far, tokens so far)
# Embedding beside encoding (`Ingestor.flush`): measured in `bench --scenarios ingest` (docs/benchmarks.md).
OVERLAP = True
OnEstimate = Callable[[StoreEstimate], None]
# why a page gave no chunks: only navigation, a table of contents or an index (`html.main_text`)
NO_MAIN_TEXT = "no main text (navigation, a table of contents or an index only)"


@dataclass(slots=True)
class IngestStats:
    """What one ingest has committed so far."""

    num_modules: int = 0  # new modules, embedded and encoded
    num_tokens: int = 0  # their tokens
    num_reused: int = 0  # chunks whose module already existed (identical text)
    encode_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class CorpusParts:
    """What the ingestor writes through; the corpus owns each of them."""

    table: ChunkTable
    manifest: Manifest
    engine: Callable[[], PromptCache]  # loaded on first use; its schema is not the corpus's during ingest
    embedder: Callable[[], EmbedderLike]
    add_vectors: Callable[[np.ndarray, np.ndarray], None]  # (faiss ids [n], vectors [n, dim]) into the index
    forget: Callable[[Dropped], None]  # drop modules no document references any more: vectors and KV
    search: nbr.Search | None = None  # the index's search, for `--neighbours` (rag/neighbours.py)


def document_row(doc: Document) -> DocumentRow:
    """The table's row of a document about to be ingested (incomplete until its last batch commits)."""
    return DocumentRow(doc.source, doc.label, doc.content_hash, False, doc.num_bytes, doc.identity, doc.kind, doc.title,
                       doc.modified)


def _json(metadata: dict[str, object]) -> str:
    return json.dumps(metadata, sort_keys=True, default=str)


class Ingestor:
    """One ingest run over a corpus's parts; `batch_chunks` chunks are embedded and encoded at a time."""

    def __init__(self, parts: CorpusParts, *, batch_chunks: int, on_batch: OnBatch | None = None,
                 progress: bool | None = None, on_estimate: OnEstimate | None = None, overlap: bool | None = None) -> None:
        self.parts = parts
        self.overlap = OVERLAP if overlap is None else overlap
        self._embedding: ThreadPoolExecutor | None = None
        self.batch_chunks = batch_chunks
        self.on_batch = on_batch
        self.on_estimate = on_estimate
        self.progress = progress
        self.stats = IngestStats()
        self.empty: list[tuple[str, str]] = []  # (source, why) of documents that gave no chunk
        self._bar = None

    def run(self, docs: list[Document], report: LoadReport, inputs: list[object], *, token_budget: int,
            ray: RayOptions | None = None, ray_target: RayTarget | None = None) -> IngestReport:
        """Ingest new and changed documents, drop those gone from an ingested directory or file."""
        t0 = time.perf_counter()
        table = self.parts.table
        todo = [d for d in docs if not self.unchanged(d)]
        self.update_metadata([d for d in docs if d.source not in {t.source for t in todo}])
        lazy = self.parts.manifest.kv == "lazy"
        left = guess = sum(ingest.estimate_tokens(todo).values())
        if todo and (not lazy or (self.on_estimate is not None and guess >= ingest.LARGE_INGEST_TOKENS)):
            tokens = ingest.count_tokens(todo, self.chunker())
            ingest.check_budget(todo, None if lazy else token_budget, tokens)
            left = max(0, tokens - self.committed(todo))  # a resumed ingest: what is left of it
            if self.on_estimate is not None and tokens >= ingest.LARGE_INGEST_TOKENS:
                self.on_estimate(self.estimate(left))
        # One document per name: the same one read from another place (a copied folder) replaces it.
        replaced = [(d.identity, r.source) for d in docs for r in table.named(d.identity) if r.source != d.source]
        gone = ingest.stale(table.documents(), inputs, {d.source for d in docs}, report.skipped)
        gone = [s for s in gone if s not in {old for _, old in replaced}]
        extra: dict[str, object] = {}
        self._bar = progress(self.progress, left if todo else 0)
        try:
            for source in [*(old for _, old in replaced), *gone]:
                self.parts.forget(table.remove_document(source))
            batches = self.batches(todo)
            if ray is None:
                for item in batches:
                    if item is not None:
                        self.flush(*item)
            elif todo:
                from rag_promptcache.rag.distributed import ingest_batches

                assert ray_target is not None, f"{ray_target=}"
                run = ingest_batches(ray_target, batches, ray, self.new_modules, self.commit,
                                     self.choose if self.parts.manifest.neighbours else None)
                self.stats.encode_seconds += run.encode_seconds
                extra = {"workers": run.num_workers, "kv_written_by": run.kv_written_by, "failed": run.failed,
                         "worker_start_seconds": run.start_seconds}
        finally:
            self._bar.close()
            if self._embedding is not None:
                self._embedding.shutdown()
                self._embedding = None
        s = self.stats
        return IngestReport(
            num_documents=len(docs), num_unchanged=len(docs) - len(todo), num_ingested=len(todo), num_removed=len(gone),
            num_modules=s.num_modules, num_tokens=s.num_tokens, num_reused=s.num_reused,
            seconds=time.perf_counter() - t0, encode_seconds=s.encode_seconds, skipped=(*report.skipped, *self.empty),
            replaced=tuple(replaced), **extra,
        )

    def estimate(self, tokens: int) -> StoreEstimate:
        """The store's expected growth from about `tokens` new tokens, per codec, for this corpus's model, as
        this ingest encodes (its manifest's `kv`), with the budget a lazy corpus's store grows to. A corpus
        keeping two entries of each module (`neighbours_present`) grows by both, the second in idle time."""
        from rag_promptcache.store.codecs import CODECS, bytes_per_token

        engine, m = self.parts.engine(), self.parts.manifest
        g, entries = engine.geometry, 2 if m.neighbours_present else 1
        sizes = {c: round(entries * tokens * bytes_per_token(c, (g.num_layers, g.num_kv_heads, g.head_dim),
                                                             engine.model.dtype, m.chunk_tokens)) for c in CODECS}
        return StoreEstimate(tokens, m.codec, tuple(sorted(sizes.items(), key=lambda kv: -kv[1])), m.kv,
                             StoreBudget.of(m).describe(), m.disk_budget if m.disk_budget is not None else m.redis_budget,
                             encode_seconds(engine.fallback.costs, tokens, m.chunk_tokens,
                                            0 if m.neighbours_present else m.neighbours),  # plain only: the rest idle
                             entries == 2)

    def committed(self, todo: list[Document]) -> int:
        """Tokens an interrupted ingest of the same documents committed already (resumed, not redone)."""
        table, total = self.parts.table, 0
        for d in todo:
            row = table.document(d.source)
            if row is not None and not row.complete and row.content_hash == d.content_hash:
                total += table.num_chunk_tokens(d.source)
        return total

    def chunker(self) -> Chunker:
        m = self.parts.manifest
        return Chunker(self.parts.engine().tokenizer, ChunkParams(m.chunk_tokens, m.overlap, m.max_tokens))

    def unchanged(self, doc: Document) -> bool:
        row = self.parts.table.document(doc.source)
        return row is not None and row.complete and row.content_hash == doc.content_hash

    def update_metadata(self, unchanged: list[Document]) -> None:
        """Record the metadata of unchanged documents where it moved (a file touched; a table from before
        metadata was kept: an ingest of the same paths records it without encoding anything)."""
        stored = {row.source: (row.kind, row.title, row.modified, _json(meta)) for row, meta in self.parts.table.document_metadata()}
        moved = [(document_row(d), d.metadata) for d in unchanged
                 if stored.get(d.source) != (d.kind, d.title, d.modified, _json(d.metadata))]
        if moved:
            self.parts.table.update_metadata(moved)

    def batches(self, todo: list[Document]) -> Iterator[tuple[Batch, list[str]] | None]:
        """(chunks to embed and encode, documents complete once they are committed), in order.
        Starts each document in the table as it reaches it; skips chunks an interrupted ingest committed.
        None before a changed document starts: it drops its old modules then, which batches sent before
        (on Ray, maybe not committed yet) may share or name as neighbours, so those must be committed first."""
        if not todo:
            yield [], []
            return
        table, chunker = self.parts.table, self.chunker()
        batch: Batch = []
        finished: list[str] = []
        for doc in todo:
            if (old := table.document(doc.source)) is not None and old.content_hash != doc.content_hash:
                yield None
            self.parts.forget(table.begin_document(document_row(doc), doc.metadata))
            done = table.chunk_ids(doc.source)  # non-empty when resuming an interrupted ingest
            seq = -1
            for seq, chunk in enumerate(chunker.chunks(doc.blocks(), doc.label, title=doc.title or doc.label,
                                                       headings=doc.headings)):
                if chunk.module_id not in done:
                    batch.append((doc.source, seq, chunk))
                if len(batch) >= self.batch_chunks:
                    yield batch, finished
                    batch, finished = [], []
            if seq < 0:
                self.empty.append((doc.source, NO_MAIN_TEXT if doc.kind in ("html", "htm") else "no text"))
                warnings.warn(f"{doc.source}: {self.empty[-1][1]}; nothing of it is searched", LoaderWarning, stacklevel=2)
            finished.append(doc.source)
        yield batch, finished

    def new_modules(self, batch: Batch) -> dict[str, Chunk]:
        """The batch's modules the table does not hold yet (identical chunks share one module)."""
        return {c.module_id: c for _, _, c in batch if not self.parts.table.has_module(c.module_id)}

    def flush(self, batch: Batch, finished: list[str]) -> None:
        """Embed and encode one batch here, then commit it. With `overlap`, the embedder runs in a thread of
        its own (one torch thread) while the model encodes the same batch: each leaves the other's idle
        moments (tokenizing, Python, writes) to fill."""
        if not batch and not finished:
            return
        new = self.new_modules(batch)
        modules = [(m, c.module_text) for m, c in new.items()]
        engine, embedder, manifest = self.parts.engine(), self.parts.embedder(), self.parts.manifest
        if manifest.neighbours and modules:  # the neighbours come from the embeddings: first embed, then encode
            vectors, near = self.choose(new)
            self.stats.encode_seconds += encode_kv(engine, manifest, modules, near)
            self.commit(batch, finished, new, vectors, near)
            return
        texts = [search_text(c.context, c.module_text) for c in new.values()]  # what retrieval reads
        if not self.overlap or not modules:
            out = encode_modules(engine, embedder, manifest, modules, texts)
            self.stats.encode_seconds += out.encode_seconds
            self.commit(batch, finished, new, out.vectors)
            return
        if self._embedding is None:
            self._embedding = ThreadPoolExecutor(1, thread_name_prefix="embed", initializer=one_thread)
        vectors = self._embedding.submit(embedder.embed, texts)
        try:
            self.stats.encode_seconds += encode_kv(engine, manifest, modules)
        finally:
            done = vectors.result()  # waited for even when encoding failed: no thread outlives the batch's error
        self.commit(batch, finished, new, done)

    def choose(self, new: dict[str, Chunk], unindexed: nbr.Unindexed = nbr.NOTHING) -> tuple[np.ndarray, Neighbours]:
        """Embed `new` (vectors [len(new), dim]) and choose the neighbours each is encoded after (`--neighbours`)
        among the indexed modules, `unindexed` (a Ray ingest's batches in flight) and each other."""
        assert self.parts.search is not None, "a corpus with neighbours hands its index's search to ingest"
        vectors = self.parts.embedder().embed([search_text(c.context, c.module_text) for c in new.values()])
        near = nbr.choose(self.parts.search, self.parts.table, list(new), vectors, self.parts.manifest.neighbours,
                          [c.module_text for c in new.values()], unindexed)
        return vectors, near

    def commit(self, batch: Batch, finished: list[str], new: dict[str, Chunk], vectors: np.ndarray,
               near: Neighbours = NONE) -> None:
        """Commit one batch whose modules' KV is stored: its rows and vectors in one transaction,
        then the index. `vectors` [len(new), dim] are the rows of `new`, in order; `near`, the neighbours
        they were encoded after. The local and the Ray paths both commit here, so both build the same corpus."""
        if not batch and not finished:
            return
        assert len(vectors) == len(new), f"{len(vectors)=} {len(new)=}"
        table = self.parts.table
        # With batches in flight on a cluster, another batch may have committed the same module since.
        modules = [ModuleRow(m, faiss_id(m), c.module_text, c.num_tokens, v, c.context, near.of.get(m, ()))
                   for (m, c), v in zip(new.items(), vectors) if not table.has_module(m)]
        chunks = [ChunkRow(s, c.module_id, seq, c.start, c.end) for s, seq, c in batch]
        keys = store_keys(self.parts.engine(), self.parts.manifest, [(m, c.module_text) for m, c in new.items()], near)
        table.commit_batch(modules, chunks, finished, keys)
        kept = np.array([m.vector for m in modules], np.float32).reshape(len(modules), self.parts.manifest.dim)
        self.parts.add_vectors(np.array([m.faiss_id for m in modules], dtype=np.int64), kept)
        s = self.stats
        s.num_modules += len(modules)
        s.num_tokens += sum(m.num_tokens for m in modules)
        s.num_reused += len(batch) - len(modules)
        if self._bar is not None:
            self._bar.update(sum(m.num_tokens for m in modules), len(modules))
        if self.on_batch is not None:
            self.on_batch(s.num_modules, s.num_tokens)


def encode_seconds(costs: Costs | None, tokens: int, chunk_tokens: int, neighbours: int = 0) -> float | None:
    """About how long encoding `tokens` in modules of `chunk_tokens` takes on this machine, by the engine's
    cost model at its present pace (None: not modelled, e.g. with the fallback policy off). A module
    encoded after M neighbours runs M+1 modules' tokens through the model."""
    if costs is None or tokens <= 0:
        return None if costs is None else 0.0
    num_modules = -(-tokens // max(chunk_tokens, 1))
    return num_modules * costs.full(round(tokens / num_modules) * (1 + (neighbours or 0)))
