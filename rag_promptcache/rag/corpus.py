"""A corpus: documents → chunks → prompt modules (KV in a store) + vectors (FAISS), and `ask`.

Directory layout: `manifest.json` (model, fingerprint, embedder, chunking, versions),
`chunks.sqlite` (documents, chunks with offsets, module texts and vectors: the source of truth),
`index.faiss` + `index.json` (a saved index and the table generation it reflects; rebuilt from the
table when they disagree), `store/` (module KV, memory → disk → an optional shared Redis, see
`corpus_store.py`). Ingest can run its embedding and encoding on a Ray cluster (`distributed.py`).

The schema is union-free: the instructions, then one module per chunk, all inside the system turn.
A question imports the retrieved modules in retrieval order and adds the user turn.

Not here: how KV is computed or reused (the engine), nor file formats (`loaders.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sqlite3
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rag_promptcache.engine.errors import ContextWindowExceeded
from rag_promptcache.pml import ast
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.rag import corpus_store
from rag_promptcache.rag.chunker import Chunk, Chunker, ChunkParams
from rag_promptcache.rag.embed import EmbedderLike, resolve
from rag_promptcache.rag.index import VectorIndex, faiss_id
from rag_promptcache.rag.ingest import check_budget, collect, progress_bar, stale
from rag_promptcache.rag.loaders import Document, LoadReport
from rag_promptcache.rag.records import Answer, AnswerStream, IngestReport, Manifest
from rag_promptcache.rag.table import ChunkRow, ChunkTable, DocumentRow, Dropped, ModuleRow

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag.distributed import RayOptions
    from rag_promptcache.store.base import Store

DEFAULT_MODEL = "smollm2-135m-instruct"  # = model.loading.DEFAULT_MODEL, without importing torch
DEFAULT_INSTRUCTIONS = (
    "You are a helpful assistant. Answer the user's question using only the documents below. "
    "If they do not contain the answer, say so. Be concise."
)
DEFAULT_TOKEN_BUDGET = 2_000_000  # new tokens per ingest; beyond it KV runs to tens of GB
BATCH_CHUNKS = 16
# The small default model can repeat a sentence until max_new_tokens; no 6-token run of an answer
# twice stops that verbatim loop and leaves ordinary answers as they were (README: Limits).
DEFAULT_NO_REPEAT_NGRAM = 6
TEMPLATE_TOKENS = 32  # room for the chat template's role markup around the turns

OnBatch = Callable[[int, int], None]  # (modules committed so far, tokens so far)
Batch = list[tuple[str, int, Chunk]]  # (source, seq, chunk)


def _load_engine(model: str, store: Store | None, mode: str | None, dtype: str | None = None) -> PromptCache:
    from rag_promptcache.engine import PromptCache

    return PromptCache.from_pretrained(model, store=store, dtype=dtype, **({} if mode is None else {"mode": mode}))


def _dtype_of(engine: PromptCache) -> str:
    model = getattr(engine, "model", None)  # an engine-like object without a torch model computes no KV dtype
    return str(model.dtype).removeprefix("torch.") if model is not None else "float32"


def _check_dtype(dtype: str | None, manifest: Manifest, path: Path) -> None:
    """A dtype asked for when opening must be the corpus's: its modules' KV was computed in that one."""
    from rag_promptcache.model.loading import dtype_name, parse_dtype

    wanted = parse_dtype(dtype)
    if wanted is not None and dtype_name(wanted) != manifest.dtype:
        raise ValueError(f"corpus {path} was encoded in {manifest.dtype}, not {dtype_name(wanted)}; open it with "
                         f"dtype {manifest.dtype!r} (or auto), or ingest into a new corpus to use {dtype_name(wanted)}")


def _load_embedder(name: str | None) -> EmbedderLike:
    from rag_promptcache.rag.embed import Embedder

    return Embedder(name)


def _package_version() -> str:
    try:
        return version("rag-promptcache")
    except PackageNotFoundError:
        return "0+unknown"


class CorpusWarning(UserWarning):
    """A corpus file was damaged and has been rebuilt from the others (nothing was lost)."""


def is_corpus(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / "manifest.json").is_file()


class Corpus:
    def __init__(
        self,
        path: Path,
        manifest: Manifest,
        *,
        engine: PromptCache | None = None,
        embedder: EmbedderLike | None = None,
        memory_bytes: int = 1 << 30,
        redis_url: str | None = None,
        disk_tier: bool = True,
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.table = _open_table(path / "chunks.sqlite")
        self.memory_bytes = memory_bytes
        self.redis_url = redis_url
        self.disk_tier = disk_tier
        self._engine = engine
        self._owns_engine = False  # a caller's engine (and its store) is the caller's to close
        self._embedder = embedder
        self._registered = -1  # table generation of the schema the engine holds
        self._compiled = False  # whether the engine has compiled that schema
        self._lock = threading.RLock()  # the engine slot, the schema registration, the FAISS index
        self._ingest_lock = threading.RLock()  # one add or remove at a time
        self.last_report: IngestReport | None = None
        self.index = self._load_index()
        self._index_generation = self.table.generation

    # -- opening and creating ----------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        engine: PromptCache | None = None,
        *,
        model: str | None = None,
        embedder: str | EmbedderLike | None = None,
        memory_bytes: int = 1 << 30,
        redis_url: str | None = None,
        disk_tier: bool = True,
        dtype: str | None = None,
    ) -> Corpus:
        """Open an existing corpus. A model, engine or embedder other than the one it was built
        with raises `ValueError` naming both, and so does a dtype other than the recorded one (the model
        loads in the corpus's recorded dtype). `redis_url` (else `$RAG_PROMPTCACHE_REDIS_URL`) adds a
        shared Redis tier below memory and disk (`disk_tier=False`: memory → Redis); it applies to
        the engine the corpus loads, not to a caller's `engine`."""
        path = Path(path)
        redis_url = corpus_store.redis_url(redis_url)
        if not is_corpus(path):
            what = "does not exist" if not path.exists() else "is not a corpus (no manifest.json)"
            raise ValueError(f"{path} {what}; create one with: rag-promptcache ingest PATH --corpus {path}")
        manifest = _read_manifest(path / "manifest.json")
        if model is not None and model != manifest.model:
            raise ValueError(f"corpus {path} was built with model {manifest.model!r}, not {model!r}")
        _check_dtype(dtype, manifest, path)
        if engine is not None:
            _check_engine(engine, manifest, path)
        emb_obj = None
        if embedder is not None:
            name = resolve(embedder)[0] if isinstance(embedder, str) else embedder.name
            if name != manifest.embedder:
                raise ValueError(f"corpus {path} was built with embedder {manifest.embedder!r}, not {name!r}")
            emb_obj = None if isinstance(embedder, str) else embedder
        return cls(path, manifest, engine=engine, embedder=emb_obj, memory_bytes=memory_bytes, redis_url=redis_url, disk_tier=disk_tier)

    @classmethod
    def build(
        cls,
        inputs: Iterable[str | os.PathLike[str] | object],
        path: str | os.PathLike[str],
        *,
        model: str | None = None,
        embedder: str | EmbedderLike | None = None,
        engine: PromptCache | None = None,
        chunk_tokens: int | None = None,
        overlap: int | None = None,
        max_tokens: int | None = None,
        index: str | None = None,
        instructions: str | None = None,
        mode: str | None = None,
        dtype: str | None = None,
        field: str = "text",
        id_field: str = "id",
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        on_batch: OnBatch | None = None,
        progress: bool | None = None,
        redis_url: str | None = None,
        ray: RayOptions | None = None,
    ) -> Corpus:
        """Create a corpus at `path` from `inputs`, or update the one there (its settings must match).
        `ray` runs the embedding and encoding on a Ray cluster (`rag.distributed`). `dtype` ("auto"/None:
        the device's default) is recorded in the manifest; later opens use it."""
        path = Path(path)
        inputs = list(inputs)
        redis_url = corpus_store.redis_url(redis_url)
        if is_corpus(path):
            corpus = cls.open(path, engine, model=model, embedder=embedder, redis_url=redis_url, dtype=dtype)
            m = corpus.manifest
            asked = {"chunk_tokens": chunk_tokens, "overlap": overlap, "max_tokens": max_tokens, "index": index}
            for key, value in asked.items():
                if value is not None and value != getattr(m, key):
                    raise ValueError(f"corpus {path} uses {key}={getattr(m, key)!r}, not {value!r}; ingest into a new corpus to change it")
            corpus.add(inputs, field=field, id_field=id_field, token_budget=token_budget, on_batch=on_batch,
                       progress=progress, ray=ray)
            return corpus
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ValueError(f"{path} exists and is not a corpus; pass an empty or new directory to --corpus")
        chunk_tokens = chunk_tokens or 256
        params = ChunkParams(chunk_tokens, min(32, chunk_tokens // 8) if overlap is None else overlap, max_tokens)
        VectorIndex(1, index or "flat")  # validates the kind before anything is loaded
        docs, report = collect(inputs, field, id_field)
        check_budget(docs, token_budget)
        owns = engine is None
        name = "rag_" + uuid.uuid4().hex[:12]  # before the store: it keys the Redis tier
        existed = path.exists()
        try:
            if engine is None:
                store = corpus_store.open_store(path / "store", 1 << 30, redis_url, name)
                engine = _load_engine(model or DEFAULT_MODEL, store, mode, dtype)
            emb = _load_embedder(embedder) if embedder is None or isinstance(embedder, str) else embedder
        except BaseException:
            # Nothing is a corpus yet (no manifest): leave no half-made directory for the next run to trip over.
            shutil.rmtree(path if not existed else path / "store", ignore_errors=True)
            raise
        now = time.time()
        manifest = Manifest(
            name=name, model=model or engine.model_name, fingerprint=engine.fingerprint,
            mode=getattr(engine, "mode", mode), embedder=emb.name, dim=emb.dim, chunk_tokens=params.chunk_tokens,
            overlap=params.overlap, max_tokens=params.hard_max, index=index or "flat",
            instructions=instructions or DEFAULT_INSTRUCTIONS, package_version=_package_version(), created=now, updated=now,
            dtype=_dtype_of(engine),
        )
        path.mkdir(parents=True, exist_ok=True)
        _write_atomic(path / "manifest.json", manifest.to_json())
        corpus = cls(path, manifest, engine=engine, embedder=emb, redis_url=redis_url)
        corpus._owns_engine = owns
        corpus._ingest(docs, report, inputs, token_budget=token_budget, on_batch=on_batch, progress=progress, ray=ray)
        return corpus

    # -- lazily loaded parts -------------------------------------------------------------------------

    @property
    def engine(self) -> PromptCache:
        """The engine, with the corpus schema registered (once per table change), so that
        `c.engine.generate(c.prompt(q, ids))` works without `prepare()`."""
        return self._register(compile_schema=False)

    def _loaded_engine(self) -> PromptCache:
        """The engine without registering the schema: what ingest uses, whose batches change the table."""
        with self._lock:
            if self._engine is None:
                engine = _load_engine(self.manifest.model, self.open_store(), self.manifest.mode, self.manifest.dtype)
                _check_engine(engine, self.manifest, self.path)
                self._engine, self._owns_engine = engine, True
            return self._engine

    def _register(self, compile_schema: bool) -> PromptCache:
        engine = self._loaded_engine()
        with self._lock:
            generation = self.table.generation  # read first: a concurrent add only makes it re-register
            if self._registered != generation:
                engine.add_schema(self.schema, replace=True)
                self._registered, self._compiled = generation, False
            if compile_schema and not self._compiled:
                engine.encode(self.manifest.name, [])  # compiles the schema; encodes nothing
                self._compiled = True
        return engine

    def open_store(self) -> Store:
        """A new handle on this corpus's KV store (memory → disk → Redis, as configured)."""
        disk = self.path / "store" if self.disk_tier else None
        return corpus_store.open_store(disk, self.memory_bytes, self.redis_url, self.manifest.name)

    @property
    def embedder(self) -> EmbedderLike:
        with self._lock:
            if self._embedder is None:
                self._embedder = _load_embedder(self.manifest.embedder)
                assert self._embedder.dim == self.manifest.dim, f"{self._embedder.dim=} {self.manifest.dim=}"
            return self._embedder

    @property
    def schema(self) -> ast.Schema:
        return _schema(self.manifest, self.table.modules())

    def __len__(self) -> int:
        return len(self.index)

    # -- ingest ------------------------------------------------------------------------------------

    def add(
        self,
        inputs: Iterable[str | os.PathLike[str] | object],
        *,
        field: str = "text",
        id_field: str = "id",
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        on_batch: OnBatch | None = None,
        progress: bool | None = None,
        ray: RayOptions | None = None,
    ) -> IngestReport:
        """Ingest new and changed documents; unchanged ones cost a hash. Files gone from an ingested
        directory are removed. Each .jsonl/.json record is a document named by its `id_field`, its
        text in `field`, its other fields kept as metadata. `on_batch` runs after each committed batch.
        `ray` runs the embedding and encoding on a Ray cluster (`rag.distributed`); the result is the
        same corpus."""
        inputs = list(inputs)
        docs, report = collect(inputs, field, id_field)
        with self._ingest_lock:
            return self._ingest(docs, report, inputs, token_budget=token_budget, on_batch=on_batch, progress=progress, ray=ray)

    def remove(self, source: str | os.PathLike[str]) -> int:
        """Forget a document (by source path, id, or the name `ask` shows in its sources); returns the
        number of modules dropped. Their vectors and their stored KV go too, unless another document
        shares the module."""
        with self._ingest_lock:
            key = self._document_key(source)
            try:
                dropped = self.table.remove_document(key)
                self._forget(dropped)
            finally:
                self._save_index()
            return len(dropped)

    def _document_key(self, source: str | os.PathLike[str]) -> str:
        key = str(source)
        if self.table.document(key) is not None:
            return key
        if Path(key).exists() and self.table.document(str(Path(key).resolve())) is not None:
            return str(Path(key).resolve())
        by_label = [d.source for d in self.table.documents() if d.label == key]
        if len(by_label) == 1:
            return by_label[0]
        if len(by_label) > 1:
            raise ValueError(f"{key!r} names {len(by_label)} documents in corpus {self.path}: {', '.join(by_label)}; pass one of these")
        raise ValueError(f"no document {key!r} in corpus {self.path}; `rag-promptcache info --corpus {self.path} --documents` lists them by name")

    def _forget(self, dropped: Dropped) -> None:
        """Drop modules no document references any more: vectors now, KV from every tier of the store."""
        with self._lock:
            self.index.remove(np.array(dropped.faiss_ids, dtype=np.int64))
            self._index_generation = self.table.generation
        if not dropped.store_keys:
            return
        if self._engine is not None:
            for k in dropped.store_keys:
                self._engine.store.delete(k)
        if self._engine is None or not self._owns_engine:
            # KV this corpus wrote with its own store (an earlier ingest), not the caller's engine's
            disk = self.path / "store" if self.disk_tier and (self.path / "store").is_dir() else None
            if disk is None and self.redis_url is None:
                return
            store = corpus_store.open_store(disk, None, self.redis_url, self.manifest.name)
            try:
                for k in dropped.store_keys:
                    store.delete(k)
            finally:
                store.close()

    def _ingest(
        self,
        docs: list[Document],
        report: LoadReport,
        inputs: list[object],
        *,
        token_budget: int,
        on_batch: OnBatch | None,
        progress: bool | None,
        ray: RayOptions | None = None,
    ) -> IngestReport:
        t0 = time.perf_counter()
        todo = [d for d in docs if not self._unchanged(d)]
        check_budget(todo, token_budget)
        gone = stale(self.table.documents(), inputs, {d.source for d in docs}, {s for s, _ in report.skipped})
        stats = {"modules": 0, "tokens": 0, "reused": 0, "encode_s": 0.0}
        extra: dict[str, object] = {}
        bar = progress_bar(progress)
        try:
            for source in gone:
                self._forget(self.table.remove_document(source))
            batches = self._batches(todo)
            if ray is None:
                for batch, finished in batches:
                    self._flush(batch, finished, stats, bar, on_batch)
            elif todo:
                from rag_promptcache.rag.distributed import ingest_batches

                commit = lambda b, f, new, vectors: self._commit(b, f, new, vectors, stats, bar, on_batch)  # noqa: E731
                run = ingest_batches(self, batches, ray, commit)
                stats["encode_s"] += run.encode_seconds
                extra = {"workers": run.num_workers, "kv_written_by": run.kv_written_by, "failed": run.failed,
                         "worker_start_seconds": run.start_seconds}
        finally:
            bar.close()
            self._save_index()
        seconds = time.perf_counter() - t0
        self.last_report = IngestReport(
            num_documents=len(docs), num_unchanged=len(docs) - len(todo), num_ingested=len(todo), num_removed=len(gone),
            num_modules=stats["modules"], num_tokens=stats["tokens"], num_reused=stats["reused"], seconds=seconds,
            encode_seconds=stats["encode_s"], skipped=tuple(report.skipped), **extra,
        )
        return self.last_report

    def _unchanged(self, doc: Document) -> bool:
        row = self.table.document(doc.source)
        return row is not None and row.complete and row.content_hash == doc.content_hash

    def _store_keys(self, new: dict[str, Chunk]) -> dict[str, str]:
        """The store key of each new module's KV (recorded so that forgetting the module drops its KV),
        from the driver's engine on both paths: registering the batch's schema only tokenizes."""
        if not new:
            return {}
        engine = self._loaded_engine()
        engine.add_schema(_schema(self.manifest, ((m, c.module_text) for m, c in new.items()), suffix=".ingest"), replace=True)
        return _store_keys(engine, self.manifest.name + ".ingest", list(new))

    def _batches(self, todo: list[Document]) -> Iterator[tuple[Batch, list[str]]]:
        """(chunks to embed and encode, documents complete once they are committed), in order.
        Starts each document in the table as it reaches it; skips chunks an interrupted ingest committed."""
        if not todo:
            yield [], []
            return
        params = ChunkParams(self.manifest.chunk_tokens, self.manifest.overlap, self.manifest.max_tokens)
        chunker = Chunker(self._loaded_engine().tokenizer, params)
        batch: Batch = []
        finished: list[str] = []
        for doc in todo:
            self._forget(self.table.begin_document(DocumentRow(doc.source, doc.label, doc.content_hash, False, doc.num_bytes),
                                                   doc.metadata))
            done = self.table.chunk_ids(doc.source)  # non-empty when resuming an interrupted ingest
            for seq, chunk in enumerate(chunker.chunks(doc.blocks(), doc.label)):
                if chunk.module_id not in done:
                    batch.append((doc.source, seq, chunk))
                if len(batch) >= BATCH_CHUNKS:
                    yield batch, finished
                    batch, finished = [], []
            finished.append(doc.source)
        yield batch, finished

    def new_modules(self, batch: Batch) -> dict[str, Chunk]:
        """The batch's modules the table does not hold yet (identical chunks share one module)."""
        return {c.module_id: c for _, _, c in batch if not self.table.has_module(c.module_id)}

    def _flush(self, batch: Batch, finished: list[str], stats: dict, bar, on_batch: OnBatch | None) -> None:
        """Embed and encode one batch here, then commit it."""
        if not batch and not finished:
            return
        new = self.new_modules(batch)
        vectors = self.embedder.embed([c.module_text for c in new.values()]) if new else np.zeros((0, self.manifest.dim), np.float32)
        if new:
            t = time.perf_counter()
            engine = self._loaded_engine()
            # Only this batch's modules: a module's KV key depends on the text before it in the
            # schema (the instructions), not on its siblings, so this matches the full schema.
            engine.add_schema(_schema(self.manifest, ((m, c.module_text) for m, c in new.items()), suffix=".ingest"), replace=True)
            # All units: the batch's modules and the root (instructions), so no question pays for them.
            engine.encode(self.manifest.name + ".ingest")
            stats["encode_s"] += time.perf_counter() - t
        self._commit(batch, finished, new, vectors, stats, bar, on_batch)

    def _commit(self, batch: Batch, finished: list[str], new: dict[str, Chunk], vectors: np.ndarray, stats: dict, bar,
                on_batch: OnBatch | None) -> None:
        """Commit one batch whose modules' KV is stored: its rows and vectors in one transaction,
        then the index. `vectors` [len(new), dim] are the rows of `new`, in order. Shared by the
        local and the Ray paths, so both build the same corpus."""
        if not batch and not finished:
            return
        assert len(vectors) == len(new), f"{len(vectors)=} {len(new)=}"
        # With batches in flight on a cluster, another batch may have committed the same module since.
        modules = [ModuleRow(m, faiss_id(m), c.module_text, c.num_tokens, v)
                   for (m, c), v in zip(new.items(), vectors) if not self.table.has_module(m)]
        chunks = [ChunkRow(s, c.module_id, seq, c.start, c.end) for s, seq, c in batch]
        self.table.commit_batch(modules, chunks, finished, self._store_keys(new))
        with self._lock:
            self.index.add(np.array([m.faiss_id for m in modules], dtype=np.int64), vectors)
            self._index_generation = self.table.generation
        stats["modules"] += len(modules)
        stats["tokens"] += sum(m.num_tokens for m in modules)
        stats["reused"] += len(batch) - len(modules)
        bar.update(len(modules))
        bar.set_postfix(tok_s=f"{stats['tokens'] / max(bar.format_dict['elapsed'], 1e-9):.0f}")
        if on_batch is not None:
            on_batch(stats["modules"], stats["tokens"])

    # -- the index -----------------------------------------------------------------------------------

    def _load_index(self) -> VectorIndex:
        file, meta = self.path / "index.faiss", self.path / "index.json"
        if file.exists() and meta.exists():
            try:
                saved = json.loads(meta.read_text())
                if saved.get("generation") == self.table.generation and saved.get("kind") == self.manifest.index:
                    return VectorIndex.load(file, self.manifest.dim, self.manifest.index)
            except (ValueError, RuntimeError, AssertionError) as e:  # faiss raises RuntimeError on a damaged file
                # the index is derived data: the table holds every vector, so rebuild rather than fail
                warnings.warn(f"{file} or {meta.name} is damaged ({str(e).strip().splitlines()[0]}); "
                              "rebuilding the index from chunks.sqlite", CorpusWarning, stacklevel=2)
        # Missing or behind the table (an ingest stopped between commit and save): rebuild.
        index = VectorIndex(self.manifest.dim, self.manifest.index)
        index.add(*self.table.vectors(self.manifest.dim))
        return index

    def _save_index(self) -> None:
        with self._lock:
            self.index.save(self.path / "index.faiss")
            meta = {"generation": self._index_generation, "kind": self.index.kind, "num_vectors": len(self.index)}
            _write_atomic(self.path / "index.json", json.dumps(meta) + "\n")
            self.manifest = dataclasses.replace(self.manifest, updated=time.time())
            _write_atomic(self.path / "manifest.json", self.manifest.to_json())

    # -- retrieval and answers -------------------------------------------------------------------------

    def search(self, question: str, k: int = 4) -> list[tuple[str, float]]:
        """The k modules nearest to the question: (module id, cosine score), best first. No text."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if not len(self.index):
            raise ValueError(f"corpus {self.path} is empty; add documents with: rag-promptcache ingest PATH --corpus {self.path}")
        if not question.strip():
            raise ValueError("the question is empty")
        vector = self.embedder.embed([question])
        with self._lock:  # FAISS indexes are not safe to search while another thread adds or removes
            hits = self.index.search(vector, k)[0]
        names = self.table.module_ids_for([i for i, _ in hits])
        return [(names[i], s) for i, s in hits if i in names]

    def text(self, module_id: str) -> str:
        """The chunk's text (without the source label the module carries)."""
        found = self.table.module(module_id)
        if found is None:
            raise ValueError(f"no module {module_id!r} in corpus {self.path}")
        text = found[0]
        return text.split("\n", 1)[1].strip() if text.startswith("[") and "\n" in text else text.strip()

    def source(self, module_id: str) -> str:
        """The document a module came from (the first, when identical chunks came from several)."""
        rows = self.table.sources(module_id)
        if not rows:
            raise ValueError(f"no module {module_id!r} in corpus {self.path}")
        return rows[0][0]

    def has_module(self, module_id: str) -> bool:
        return self.table.has_module(module_id)

    def prompt(self, question: str, module_ids: Sequence[str], history: Sequence[tuple[str, str]] = ()) -> str:
        """The PML prompt: retrieved modules in order, earlier turns, then the question."""
        turns = [t for u, a in history for t in (("user", u), ("assistant", a))]
        return prompt_pml(self.manifest.name, module_ids, [*turns, ("user", question)])

    def order(self, module_ids: Sequence[str]) -> list[str]:
        """Retrieved modules (best first) in the order the prompt imports them: best last, next to
        the question, where recovery `last:N` recomputes it (docs/FIDELITY.md)."""
        return list(module_ids)[::-1]

    def ask(
        self,
        question: str,
        k: int = 4,
        *,
        history: Sequence[tuple[str, str]] = (),
        stream: bool = False,
        max_new_tokens: int = 256,
        **sampling: object,
    ) -> Answer | AnswerStream:
        """Retrieve, import the modules' cached KV, and generate. `stream=True` returns an
        `AnswerStream` (iterate for text; `.answer` when done). `sampling`: the engine's (temperature,
        stop, recovery, repetition_penalty, ...); no_repeat_ngram defaults to DEFAULT_NO_REPEAT_NGRAM."""
        sampling.setdefault("no_repeat_ngram", DEFAULT_NO_REPEAT_NGRAM)
        hits = self._fit(self.search(question, k), question, history, max_new_tokens)
        sources = [self._label(m) for m, _ in hits]
        prompt = self.prompt(question, self.order([m for m, _ in hits]), history)
        engine = self.prepare()
        out = AnswerStream(engine.stream(prompt, max_new_tokens=max_new_tokens, **sampling), hits, sources, prompt)
        return out if stream else out.consume()

    def prepare(self) -> PromptCache:
        """Load the engine and register and compile the corpus schema (once per process and change),
        so that the first question's TTFT does not pay for tokenizing every module."""
        return self._register(compile_schema=True)

    def ask_stream(self, question: str, k: int = 4, **kwargs: object) -> AnswerStream:
        out = self.ask(question, k, stream=True, **kwargs)
        assert isinstance(out, AnswerStream)
        return out

    def _label(self, module_id: str) -> str:
        doc = self.table.document(self.source(module_id))
        return doc.label if doc else self.source(module_id)

    def _fit(self, hits: list[tuple[str, float]], question: str, history: Sequence[tuple[str, str]], max_new: int) -> list[tuple[str, float]]:
        """Drop the lowest-scoring modules until the prompt and the answer fit the context window."""
        engine = self._loaded_engine()
        window = getattr(engine, "context_window", 0) or 1 << 30
        count = lambda t: len(engine.tokenizer.encode(t, add_special_tokens=False))  # noqa: E731
        parts = {"instructions": count(self.manifest.instructions), "question": count(question),
                 "history": sum(count(u) + count(a) for u, a in history), "chat template (about)": TEMPLATE_TOKENS}
        fixed = sum(parts.values())
        sizes = [self.table.module(m)[1] for m, _ in hits]
        best = sizes[0] if sizes else 0
        while hits and fixed + sum(sizes) + max_new > window:
            hits, sizes = hits[:-1], sizes[:-1]
        if not hits and fixed + best + max_new > window:
            named = ", ".join(f"{n} {what}" for what, n in [("for the best retrieved chunk", best), *parts.items()] if n or what != "history")
            raise ContextWindowExceeded(
                f"the prompt needs {fixed + best} tokens ({named}) plus max_new_tokens {max_new}: "
                f"{fixed + best + max_new}, more than the model's {window}-token window; "
                + (f"lower max_new_tokens to at most {window - fixed - best}" if window > fixed + best else "shorten the question")
            )
        return hits

    # -- facts -------------------------------------------------------------------------------------

    def info(self) -> dict[str, object]:
        store = self.path / "store"
        store_bytes = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) if store.exists() else 0
        m = self.manifest
        return {
            "path": str(self.path), **self.table.counts(), "num_vectors": len(self.index), "store_bytes": store_bytes,
            "model": m.model, "fingerprint": m.fingerprint, "mode": m.mode, "dtype": m.dtype, "embedder": m.embedder, "dim": m.dim,
            "index": m.index, "chunk_tokens": m.chunk_tokens, "overlap": m.overlap, "max_tokens": m.max_tokens,
            "package_version": m.package_version, "created": m.created, "updated": m.updated,
            "redis_url": self.redis_url,
        }

    def documents(self) -> list[dict[str, object]]:
        """Each document: `name` (what `ask` shows in its sources and `remove` accepts), `source`,
        `num_chunks`, `num_bytes`, `complete` (False: an interrupted ingest; run it again) and
        `metadata` (a record's other fields)."""
        return [{"name": d.label, "source": d.source, "num_chunks": n, "num_bytes": d.num_bytes, "complete": d.complete,
                 "metadata": meta} for d, n, meta in self.table.document_chunks()]

    def close(self) -> None:
        self.table.close()
        if self._owns_engine and self._engine is not None:
            self._engine.store.close()


class ModelMismatchError(ValueError):
    """The corpus's modules were encoded by another model (or other weights) than the engine's."""


def _check_engine(engine: PromptCache, manifest: Manifest, path: Path) -> None:
    if engine.fingerprint == manifest.fingerprint:
        return
    if engine.model_name == manifest.model and _dtype_of(engine) != manifest.dtype:
        raise ModelMismatchError(
            f"corpus {path} was encoded in {manifest.dtype}; this engine runs {manifest.model!r} in "
            f"{_dtype_of(engine)}: load it with dtype {manifest.dtype!r}, or ingest into a new corpus"
        )
    if engine.model_name == manifest.model:
        raise ModelMismatchError(
            f"corpus {path} was built with model {manifest.model!r} whose fingerprint was "
            f"{manifest.fingerprint[:16]}; it is now {engine.fingerprint[:16]} (other weights, or a "
            "rag-promptcache upgrade changed it); re-ingest into a new corpus"
        )
    if engine.fingerprint != manifest.fingerprint:
        raise ModelMismatchError(
            f"corpus {path} was built with model {manifest.model!r} (fingerprint {manifest.fingerprint[:16]}), "
            f"not {engine.model_name!r} (fingerprint {engine.fingerprint[:16]})"
        )


def _schema(manifest: Manifest, modules: Iterable[tuple[str, str]], suffix: str = "") -> ast.Schema:
    """The union-free corpus schema: instructions, then every module, inside the system turn."""
    mods = {m: ast.Module(m, (ast.Text(text),)) for m, text in modules}
    system = ast.Role("system", (ast.Text(manifest.instructions + "\n\n"), *mods.values()))
    return ast.Schema(manifest.name + suffix, (system,), modules=mods, parents={m: None for m in mods}, union_of={})


def _store_keys(engine: PromptCache, schema_name: str, module_ids: Sequence[str]) -> dict[str, str]:
    """The store key of each module's KV, as the engine computes it (the corpus schema is a chat
    schema: its modules sit in the system turn)."""
    return engine.store_keys(schema_name, module_ids)


def _read_manifest(file: Path) -> Manifest:
    try:
        return Manifest.from_json(file.read_text(), str(file))
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        if str(file) in str(e):
            raise  # already names the file and the fix (a format from another version)
        raise ValueError(f"{file} is damaged ({e}); it records the corpus's model and settings and cannot be "
                         "rebuilt: re-ingest the documents into a new corpus") from e


def _open_table(file: Path) -> ChunkTable:
    try:
        return ChunkTable(file)
    except sqlite3.DatabaseError as e:
        raise ValueError(f"{file} is damaged ({e}); it holds the corpus's chunks and vectors: re-ingest the "
                         "documents into a new corpus (a damaged module store is checked with "
                         "`rag-promptcache store verify`)") from e


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
