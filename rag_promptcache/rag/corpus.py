"""`Corpus`: the facade that opens or builds a corpus, owns its engine, embedder, table, index and
store, and answers: `search`, `retrieve` (search fitted to the context window, as `Hit`s), `ask`.

The jobs behind it, one file each: the directory and the saved index (`layout.py`), which model and
embedder and their checks (`models.py`), the corpus schema and the one batch encoding shared with
Ray workers (`encoding.py`), running an ingest (`ingestor.py`, on Ray: `distributed.py`), retrieval
and window fitting (`retrieval.py`), the KV tiers (`corpus_store.py`).

A question imports the retrieved modules (best last, next to the question) and adds the user turn.

Not here: how KV is computed or reused (the engine), nor file formats (`loaders.py`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rag_promptcache.pml import ast
from rag_promptcache.rag import budget as budgeting
from rag_promptcache.rag import corpus_store, documents, layout, lazy, neighbours as nbr, retrieval
from rag_promptcache.rag.budget import StoreBudget
from rag_promptcache.rag.chunker import Chunker, ChunkParams
from rag_promptcache.rag.embed import EmbedderLike
from rag_promptcache.rag.engine_slot import EngineSlot
from rag_promptcache.rag.encoding import Neighbours, corpus_schema
from rag_promptcache.rag.index import VectorIndex
from rag_promptcache.rag.ingest import check_budget, collect, count_tokens
from rag_promptcache.rag.ingestor import CorpusParts, Ingestor, OnBatch, OnEstimate
from rag_promptcache.rag.layout import CorpusWarning, is_corpus
from rag_promptcache.rag.loaders import Document, LoadReport
from rag_promptcache.rag.models import (DEFAULT_MODEL, ModelMismatchError, adapter_fields, adapter_to_load,
                                         check_caller_engine, check_engine, check_open, check_settings, dtype_of,
                                         untuned_notice)
# The facade's loaders are module globals so that tests swap in a fake engine or embedder here.
from rag_promptcache.rag.models import load_embedder as _load_embedder
from rag_promptcache.rag.models import load_engine as _load_engine
from rag_promptcache.rag.asking import Answering
from rag_promptcache.rag.lazy import StoreAccess
from rag_promptcache.rag.records import IngestReport, Manifest
from rag_promptcache.rag.repetition import DEFAULT_NO_REPEAT_NGRAM, repeated_sentence
from rag_promptcache.rag.retrieval import Conversations, Hit
from rag_promptcache.rag.table import Dropped
from rag_promptcache.store.codecs import CODEC_WARNINGS, check_codec

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag.distributed import RayOptions, RayTarget
    from rag_promptcache.store.base import Store

__all__ = ["BATCH_CHUNKS", "DEFAULT_INSTRUCTIONS", "DEFAULT_MODEL", "DEFAULT_NO_REPEAT_NGRAM", "Corpus", "CorpusWarning", "Hit",
           "Manifest", "ModelMismatchError", "is_corpus"]

DEFAULT_INSTRUCTIONS = (
    "You are a helpful assistant. Answer the user's question using only the documents below. "
    "If they do not contain the answer, say so. Be concise."
)
DEFAULT_TOKEN_BUDGET = 2_000_000  # new tokens per ingest; beyond it KV runs to tens of GB
BATCH_CHUNKS = 16  # chunks embedded, encoded and committed at a time


class Corpus(Answering, StoreAccess):
    def __init__(self, path: Path, manifest: Manifest, *, engine: PromptCache | None = None,
                 embedder: EmbedderLike | None = None, memory_bytes: int | None = None, redis_url: str | None = None,
                 disk_tier: bool = True, adapter: str | os.PathLike[str] | None = "default", read_only: bool = False) -> None:
        self.path = path
        self.manifest = manifest
        self.table = layout.open_table(path, read_only=read_only)
        self.memory_bytes = memory_bytes
        self.redis_url = redis_url
        self.disk_tier = disk_tier
        self.lock = threading.RLock()  # the engine slot, the schema registration, the FAISS index
        self.engine_slot = EngineSlot(self._open_engine, engine, lock=self.lock)  # the one owner of the engine
        self._own_store: Store | None = None  # this corpus's tiers on another corpus's engine (`attach_own_store`)
        self._embedder = embedder
        self._adapter_asked = adapter
        self._adapter_path: tuple[str | None] | None = None  # resolved on first use (`adapter_path`)
        self._registered = -1  # table generation of the schema the engine holds
        self._compiled = False  # whether the engine has compiled that schema
        self._ingest_lock = threading.RLock()  # one add or remove at a time
        self.conversations = Conversations()  # each user turn's retrieval, for the turns after it (under `lock`)
        self.retrievals = lazy.RetrievalLog(self.table)  # what questions retrieved, for `warm`
        self.last_report: IngestReport | None = None
        self._index_generation = self.table.generation
        self.index, self.lexical, self._lexical_generation = layout.load_indexes(path, manifest, self.table,
                                                                                 writable=not read_only)

    # -- opening and creating ----------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], engine: PromptCache | None = None, *, model: str | None = None,
             embedder: str | EmbedderLike | None = None, memory_bytes: int | None = None, redis_url: str | None = None,
             disk_tier: bool = True, dtype: str | None = None, adapter: str | os.PathLike[str] | None = "default",
             read_only: bool = False, own_store: bool = False) -> Corpus:
        """Open an existing corpus. A model, engine or embedder other than the one it was built
        with raises `ValueError` naming both, and so does a dtype other than the recorded one (the model
        loads in the corpus's recorded dtype), and an adapter other than the recorded one ("default": the
        one it was encoded with; a corpus encoded before adapters shipped opens with the base model, and
        a `CorpusWarning` says how to re-encode it). `redis_url` (else `$RAG_PROMPTCACHE_REDIS_URL`) adds a
        shared Redis tier below memory and disk (`disk_tier=False`: memory → Redis); it applies to
        the engine the corpus loads, not to a caller's `engine`. The tiers hold the corpus's recorded budget
        (`set_budget`); `memory_bytes` (this process's memory tier) overrides its memory budget. `read_only`
        (`info`): a missing or damaged derived index is rebuilt in memory, not saved, and said (`layout.py`).
        `own_store` with `engine` (another corpus's): the model is shared, this corpus's KV kept in its own
        tiers (`rag.corpora`)."""
        path = layout.check_corpus(path)
        redis_url = corpus_store.redis_url(redis_url)
        manifest = layout.read_manifest(path)
        layout.check_files(path)
        emb_obj = check_open(manifest, path, model=model, dtype=dtype, engine=engine, embedder=embedder, adapter=adapter)
        corpus = cls(path, manifest, engine=engine, embedder=emb_obj, memory_bytes=memory_bytes, redis_url=redis_url,
                     disk_tier=disk_tier, adapter=adapter, read_only=read_only)
        if own_store and engine is not None:
            corpus.attach_own_store(engine)
        if engine is None and str(adapter).lower() != "default":
            try:
                corpus.adapter_path  # noqa: B018 - an adapter named by the caller is checked now, not at the first question
            except BaseException:
                corpus.close()
                raise
        if engine is None and (notice := untuned_notice(manifest, path, [d.source for d in corpus.table.documents()])):
            warnings.warn(notice, CorpusWarning, stacklevel=2)
        return corpus

    @classmethod
    def build(cls, inputs: Iterable[str | os.PathLike[str] | object], path: str | os.PathLike[str], *,
              model: str | None = None, embedder: str | EmbedderLike | None = None, engine: PromptCache | None = None,
              chunk_tokens: int | None = None, overlap: int | None = None, max_tokens: int | None = None,
              index: str | None = None, instructions: str | None = None, mode: str | None = None,
              dtype: str | None = None, field: str = "text", id_field: str = "id",
              token_budget: int = DEFAULT_TOKEN_BUDGET, on_batch: OnBatch | None = None, progress: bool | None = None,
              redis_url: str | None = None, ray: RayOptions | None = None,
              adapter: str | os.PathLike[str] | None = "default", codec: str | None = None,
              on_estimate: OnEstimate | None = None, kv: str | None = None, budget: StoreBudget | None = None,
              neighbours: int | None = None, byproduct: bool | None = None, neighbours_present: int | None = None) -> Corpus:
        """Create a corpus at `path` from `inputs`, or update the one there (its settings must match).
        `codec` (None: k6v6, `corpus_store.DEFAULT_CODEC`; `store.CODECS` lists the valid ones) is how the
        corpus's memory, disk and Redis tiers hold module KV, recorded in the manifest. `on_estimate` is
        called once the model is loaded and before anything is encoded, with the store's expected size
        per codec (`StoreEstimate`).
        `ray` runs the embedding and encoding on a Ray cluster (`rag.distributed`). `dtype` ("auto"/None:
        the device's default) and the tuned adapter merged into the model (`adapter`: "default", the one
        shipped for the model if one ships; "none"/None, the base model; or an adapter directory) are
        recorded in the manifest; later opens use them. `kv`: "eager" (None, a new corpus's default: every
        module's KV computed now) or "lazy" (chunked, embedded and indexed now, KV computed when a question
        first retrieves a module: rag/lazy.py), recorded for later ingests. `budget`: the store's bytes per
        tier and its eviction policy (rag/budget.py), recorded; an existing corpus's changes to it. `neighbours`
        (None: 0, off, for a new corpus): each module encoded after its this many nearest (rag/neighbours.py);
        `neighbours_present` C (None: 0): a prompt reads that KV where C of them are retrieved with it, else plain KV.
        `byproduct` (None: off for a new corpus; only with kv="lazy"): each module's KV kept from the prefill of
        the first question that retrieves it (engine/kv/byproduct.py)."""
        path = Path(path)
        inputs = list(inputs)
        redis_url = corpus_store.redis_url(redis_url)
        check_caller_engine(engine, adapter)
        if codec is not None:
            check_codec(codec)
        lazy.check_kv(kv)
        nbr.check(neighbours, neighbours_present)
        if is_corpus(path):
            corpus = cls.open(path, engine, model=model, embedder=embedder, redis_url=redis_url, dtype=dtype, adapter=adapter)
            check_settings(corpus.manifest, path, {"chunk_tokens": chunk_tokens, "overlap": overlap,
                                                   "max_tokens": max_tokens, "index": index, "codec": codec, "neighbours": neighbours,
                                                   "byproduct": byproduct, "neighbours_present": neighbours_present})
            corpus.set_budget(budget, kv=kv)
            corpus.add(inputs, field=field, id_field=id_field, token_budget=token_budget, on_batch=on_batch,
                       progress=progress, ray=ray, on_estimate=on_estimate)
            return corpus
        codec = codec or corpus_store.DEFAULT_CODEC
        nbr.check(neighbours or 0, neighbours_present)
        budgeting.check_byproduct(byproduct, kv, neighbours)
        if codec in CODEC_WARNINGS:
            warnings.warn(f"codec {codec!r} {CODEC_WARNINGS[codec]}", CorpusWarning, stacklevel=2)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ValueError(f"{path} exists and is not a corpus; pass an empty or new directory to --corpus")
        chunk_tokens = chunk_tokens or 256
        params = ChunkParams(chunk_tokens, min(32, chunk_tokens // 8) if overlap is None else overlap, max_tokens)
        VectorIndex(1, index or "flat")  # validates the kind before anything is loaded
        docs, report = collect(inputs, field, id_field)
        check_budget(docs, token_budget if kv != "lazy" else None)  # a first guess, before any model loads
        asked, budget = budget, budget or StoreBudget()
        owns = engine is None
        name = "rag_" + uuid.uuid4().hex[:12]  # before the store: it keys the Redis tier
        existed = path.exists()
        try:
            if engine is None:
                store = corpus_store.open_store(path / layout.STORE, True, redis_url, name, codec, budget)
                engine = _load_engine(model or DEFAULT_MODEL, store, mode, dtype, adapter)
            if kv != "lazy":  # refused before anything is written (the real chunker's count: rag/ingest.py)
                check_budget(docs, token_budget, count_tokens(docs, Chunker(engine.tokenizer, params)))
            if asked is not None:
                budgeting.check_fits(budget, lazy.module_bytes(engine, params.hard_max, codec))
            emb = _load_embedder(embedder) if embedder is None or isinstance(embedder, str) else embedder
        except BaseException:
            # Nothing is a corpus yet (no manifest): leave no half-made directory for the next run to trip over.
            shutil.rmtree(path if not existed else path / layout.STORE, ignore_errors=True)
            raise
        now = time.time()
        manifest = Manifest(
            name=name, model=model or engine.model_name, fingerprint=engine.fingerprint,
            mode=getattr(engine, "mode", mode), embedder=emb.name, dim=emb.dim, chunk_tokens=params.chunk_tokens,
            overlap=params.overlap, max_tokens=params.hard_max, index=index or "flat",
            instructions=instructions or DEFAULT_INSTRUCTIONS, package_version=layout.package_version(), created=now,
            updated=now, dtype=dtype_of(engine), codec=codec, kv=kv or "eager", neighbours=neighbours or 0,
            neighbours_present=neighbours_present or 0, byproduct=bool(byproduct), **budget.manifest_fields(),
            **adapter_fields(engine),
        )
        path.mkdir(parents=True, exist_ok=True)
        layout.write_manifest(path, manifest)
        corpus = cls(path, manifest, engine=engine, embedder=emb, redis_url=redis_url,
                     adapter=manifest.adapter_path or "none")
        if owns:
            corpus.engine_slot.adopt()
        corpus._ingest(docs, report, inputs, token_budget=token_budget, on_batch=on_batch, progress=progress, ray=ray,
                       on_estimate=on_estimate)
        return corpus

    # -- lazily loaded parts -------------------------------------------------------------------------

    @property
    def engine(self) -> PromptCache:
        """The engine, with the corpus schema registered (once per table change), so that
        `c.engine.generate(c.prompt(q, ids))` works without `prepare()`."""
        return self._register(compile_schema=False)

    def prepare(self, pack: bool = True) -> PromptCache:
        """Load the engine and register and compile the corpus schema (once per process and change),
        so that the first question's TTFT does not pay for tokenizing every module, nor for packing the
        answering forward's weights (0.2-0.45 s for SmolLM2 on 2 cores: engine/compute/forward.py), which
        a process that answers one question (`pack=False`: the `ask` command) skips."""
        return self._register(compile_schema=True, pack=pack)

    def _open_engine(self) -> PromptCache:
        """The engine this corpus was built with, loaded over its store (`engine_slot` calls it once)."""
        engine = _load_engine(self.manifest.model, self.open_store(), self.manifest.mode, self.manifest.dtype,
                              self.adapter_path or "none")
        check_engine(engine, self.manifest, self.path)
        if self.manifest.recovery is not None:  # the server and the adapters call the engine: it is its default
            engine.recovery = self.manifest.recovery
        return engine

    @property
    def adapter_path(self) -> str | None:
        """The adapter directory the engine loads: the one the modules were encoded with (None: the
        base model). `AdapterError` where that adapter is not available here (`models.adapter_to_load`)."""
        with self.lock:
            if self._adapter_path is None:
                load = adapter_to_load(self.manifest, self.path, self._adapter_asked)
                self._adapter_path = (None if load == "none" else load,)
            return self._adapter_path[0]

    def _register(self, compile_schema: bool, pack: bool = True) -> PromptCache:
        engine = self.engine_slot.get()  # without the schema: what ingest uses, whose batches change the table
        with self.lock:
            generation = self.table.generation  # read first: a concurrent add only makes it re-register
            if self._registered != generation:
                engine.add_schema(self.schema, replace=True)
                self._registered, self._compiled = generation, False
            if compile_schema and not self._compiled:
                engine.encode(self.manifest.name, [])  # compiles the schema; encodes nothing
                engine.ready_to_answer(pack)
                self._compiled = True
        return engine

    def refresh(self) -> bool:
        """Catch up with an ingest another process made since this corpus was opened: the manifest and
        the vector index reloaded when the table's generation (the corpus's version) moved. True when
        it did. Call it between requests: a search meanwhile waits for the lock, never sees half."""
        with self.lock:
            generation = self.table.generation
            if generation == self._index_generation:
                return False
            self.manifest = layout.read_manifest(self.path)
            self.index, _ = layout.load_index(self.path, self.manifest, self.table)
            self.lexical, self._lexical_generation, _ = layout.load_lexical(self.path, self.table)
            self._index_generation = generation
            return True

    @property
    def embedder(self) -> EmbedderLike:
        with self.lock:
            if self._embedder is None:
                self._embedder = _load_embedder(self.manifest.embedder)
                assert self._embedder.dim == self.manifest.dim, f"{self._embedder.dim=} {self.manifest.dim=}"
            return self._embedder

    @property
    def schema(self) -> ast.Schema:
        return corpus_schema(self.manifest, self.table.modules(), neighbours=Neighbours(self.table.neighbours()))

    def __len__(self) -> int:
        return len(self.index)

    # -- ingest ------------------------------------------------------------------------------------

    def add(self, inputs: Iterable[str | os.PathLike[str] | object], *, field: str = "text", id_field: str = "id",
            token_budget: int = DEFAULT_TOKEN_BUDGET, on_batch: OnBatch | None = None, progress: bool | None = None,
            ray: RayOptions | None = None, on_estimate: OnEstimate | None = None) -> IngestReport:
        """Ingest new and changed documents; unchanged ones cost a hash. Files gone from an ingested
        directory are removed. Each .jsonl/.json record is a document named by its `id_field`, its
        text in `field`, its other fields kept as metadata. `on_batch` runs after each committed batch;
        `on_estimate` once before any is encoded, with the store's expected growth per codec.
        `ray` runs the embedding and encoding on a Ray cluster (`rag.distributed`); the result is the
        same corpus."""
        inputs = list(inputs)
        docs, report = collect(inputs, field, id_field)
        with self._ingest_lock:
            return self._ingest(docs, report, inputs, token_budget=token_budget, on_batch=on_batch, progress=progress, ray=ray,
                                on_estimate=on_estimate)

    def remove(self, source: str | os.PathLike[str]) -> int:
        """Forget a document (by source path, id, or the name `ask` shows in its sources; a .jsonl/.json
        file by its path or bare file name: all its records); returns the number of modules dropped.
        Their vectors and their stored KV go too, unless another document shares the module."""
        with self._ingest_lock:
            keys = documents.resolve(self.table, source, self.path)
            num_dropped = 0
            try:
                for key in keys:
                    dropped = self.table.remove_document(key)
                    self._forget(dropped)
                    num_dropped += len(dropped)
            finally:
                self._save_index()
            return num_dropped

    def set_recovery(self, spec: str | None) -> str | None:
        """Record `spec` ("last:1"; None: the engine's default) as this corpus's recovery, which `ask`,
        `chat`, `serve` and the adapters use where none is given (a caller's engine keeps its own
        default). A bad spec is `Recovery.parse`'s `ValueError`. Returns the canonical form."""
        from rag_promptcache.engine.planning.recovery import Recovery

        chosen = None if spec is None else Recovery.parse(spec)
        with self.lock:
            self.manifest = dataclasses.replace(self.manifest, recovery=None if chosen is None else str(chosen),
                                                updated=time.time())
            layout.write_manifest(self.path, self.manifest)
            if (owned := self.engine_slot.owned) is not None:
                owned.recovery = chosen  # None: the engine's own default (its adapter's, else DEFAULT_RECOVERY)
        return self.manifest.recovery

    def _ingest(self, docs: list[Document], report: LoadReport, inputs: list[object], *, token_budget: int,
                on_batch: OnBatch | None, progress: bool | None, ray: RayOptions | None = None,
                on_estimate: OnEstimate | None = None) -> IngestReport:
        parts = CorpusParts(self.table, self.manifest, self.engine_slot.get, lambda: self.embedder, self._add_vectors, self._forget,
                            lambda v, k: self.index.search(v, k))  # no lock: ingest is the index's one writer
        ingestor = Ingestor(parts, batch_chunks=BATCH_CHUNKS, on_batch=on_batch, progress=progress, on_estimate=on_estimate)
        try:
            self.last_report = ingestor.run(docs, report, inputs, token_budget=token_budget, ray=ray,
                                            ray_target=None if ray is None else self._ray_target())
        finally:
            self._save_index()
        return self.last_report

    def _ray_target(self) -> RayTarget:
        from rag_promptcache.rag.distributed import RayTarget

        store_dir = self.path.resolve() / layout.STORE if self.disk_tier else None
        return RayTarget(self.manifest, store_dir, self.redis_url, lambda: self.store)

    def _add_vectors(self, faiss_ids: np.ndarray, vectors: np.ndarray) -> None:
        with self.lock:
            self.index.add(faiss_ids, vectors)
            self._index_generation = self.table.generation

    def _forget(self, dropped: Dropped) -> None:
        """Drop modules no document references any more (vectors, KV in every tier); encode again those that named one."""
        with self.lock:
            self.index.remove(np.array(dropped.faiss_ids, dtype=np.int64))
            self._index_generation = self.table.generation
        for k in dropped.store_keys if self.loaded else ():
            self.store.delete(k)
        if dropped.store_keys and not self.owns_store:
            # KV this corpus wrote with its own store (an earlier ingest), not the caller's engine's
            disk = self.path / layout.STORE if self.disk_tier and (self.path / layout.STORE).is_dir() else None
            corpus_store.delete(list(dropped.store_keys), disk, self.redis_url, self.manifest.name)
        if dropped.changed:
            nbr.rekey(self.engine_slot.get(), self.manifest, self.table, dropped.changed)

    def _save_index(self) -> None:
        """Save the vector index, and the lexical one rebuilt from the table when the table has moved
        since it was built (bm25s indexes are built whole: `lexical.py`)."""
        lexical = None
        if self.table.generation != self._lexical_generation:
            lexical = layout.build_lexical(self.table)  # outside the lock: searches go on meanwhile
        with self.lock:
            layout.save_index(self.path, self.index, self._index_generation)
            if lexical is not None:
                self.lexical, self._lexical_generation = lexical
                layout.save_lexical(self.path, self.lexical, self._lexical_generation)
            self.manifest = dataclasses.replace(self.manifest, updated=time.time())
            layout.write_manifest(self.path, self.manifest)

    # -- facts -------------------------------------------------------------------------------------

    def info(self) -> dict[str, object]:
        m = self.manifest
        return {
            "path": str(self.path), **self.table.counts(), "num_vectors": len(self.index), "store_bytes": layout.store_bytes(self.path),
            "model": m.model, "fingerprint": m.fingerprint, "mode": m.mode, "dtype": m.dtype, "embedder": m.embedder, "dim": m.dim,
            "codec": m.codec, "kv": m.kv, "neighbours": m.neighbours, "neighbours_present": m.neighbours_present, "byproduct": m.byproduct, "budget": dataclasses.asdict(StoreBudget.of(m)),
            "encoded": dataclasses.asdict(self.coverage()), "recovery": m.recovery, "adapter": m.adapter, "adapter_digest": m.adapter_digest, "instructions": m.instructions,
            "index": m.index, "chunk_tokens": m.chunk_tokens, "overlap": m.overlap, "max_tokens": m.max_tokens,
            "package_version": m.package_version, "created": m.created, "updated": m.updated, "redis_url": self.redis_url,
        }

    def documents(self) -> list[dict[str, object]]:  # name, source, num_chunks, num_bytes, complete, metadata
        return documents.listing(self.table)

    def close(self) -> None:
        self.retrievals.flush()
        self.table.close()
        self.close_own_store()  # before the engine's store: a shared engine outlives this corpus
        self.engine_slot.close()
