"""The corpus's chunk table: documents, chunks and modules (text, token count, vector) in SQLite.

It is the source of truth for what a corpus holds. Every ingest batch is one transaction, so an
interrupted ingest leaves whole batches or nothing, and a `generation` counter lets the corpus tell
whether the saved FAISS index reflects the table. Pure bookkeeping: no tokenizers, no tensors.
"""

from __future__ import annotations

import functools
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, TypeVar

import numpy as np

from rag_promptcache.rag.chunker import search_text

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS documents(
    source TEXT PRIMARY KEY, label TEXT NOT NULL, content_hash TEXT NOT NULL,
    complete INTEGER NOT NULL, num_bytes INTEGER NOT NULL, updated REAL NOT NULL, name TEXT);
CREATE TABLE IF NOT EXISTS modules(
    module_id TEXT PRIMARY KEY, faiss_id INTEGER UNIQUE NOT NULL, text TEXT NOT NULL,
    num_tokens INTEGER NOT NULL, vector BLOB NOT NULL, context TEXT, neighbours TEXT);
CREATE TABLE IF NOT EXISTS chunks(
    source TEXT NOT NULL, module_id TEXT NOT NULL, seq INTEGER NOT NULL,
    start INTEGER NOT NULL, end INTEGER NOT NULL, PRIMARY KEY(source, module_id));
CREATE INDEX IF NOT EXISTS chunks_by_module ON chunks(module_id);
CREATE TABLE IF NOT EXISTS module_keys(module_id TEXT PRIMARY KEY, store_key TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS document_meta(source TEXT PRIMARY KEY, metadata TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS retrievals(module_id TEXT PRIMARY KEY, count INTEGER NOT NULL);
"""


P = ParamSpec("P")
R = TypeVar("R")


def _serialized(method: Callable[P, R]) -> Callable[P, R]:
    """One statement or transaction at a time on the shared connection: a Python sqlite3 connection
    used by several threads at once mixes their transactions (a reader would see, or break, a
    writer's open BEGIN)."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with args[0]._lock:  # type: ignore[attr-defined]
            return method(*args, **kwargs)

    return wrapper


@dataclass(frozen=True, slots=True)
class ModuleRow:
    module_id: str
    faiss_id: int
    text: str
    num_tokens: int
    vector: np.ndarray  # [dim] float32
    context: str = ""  # its document's title and heading path (`chunker.Chunk.context`), which retrieval reads too
    # the modules its KV was encoded after (`ingest --neighbours`, rag/neighbours.py), least similar first
    neighbours: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ChunkRow:
    source: str
    module_id: str
    seq: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Dropped:
    """Modules no longer referenced by any document: their FAISS ids and the store keys of their KV."""

    faiss_ids: tuple[int, ...] = ()
    store_keys: tuple[str, ...] = ()  # theirs, and the old keys of the modules in `changed`
    # modules kept that named a dropped one as a neighbour: it is gone from their lists, their KV is to be
    # encoded again with the neighbours left (rag/neighbours.py `rekey`)
    changed: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.faiss_ids)


@dataclass(frozen=True, slots=True)
class DocumentRow:
    source: str
    label: str
    content_hash: str
    complete: bool
    num_bytes: int
    name: str | None = None  # the identity (`loaders.Document.name`); None in tables older than it: the label
    # what filters read (rag/metadata.py); None in tables from before they were kept
    kind: str | None = None  # `loaders.Document.kind`: md, html, pdf, txt, record, object, ...
    title: str | None = None
    modified: float | None = None  # the file's modification time, epoch seconds

    @property
    def shown(self) -> str:
        """The name listings and answers' sources show (and `remove` takes): a file's label; a record with an
        id, `<file>#<id>` (its label, what the model reads, is the id alone: a bare "1" in a listing says
        nothing); a record without one, its label, `<file>:<line>`, which names its file already."""
        name, label = self.name or self.label, self.label
        if name == label or not name.endswith("#" + label):
            return name
        return label if label.startswith(name[: -len(label) - 1]) else name


_DOCUMENT = "source, label, content_hash, complete, num_bytes, name, kind, title, modified"  # a `DocumentRow`'s columns


def _document(row: Sequence[object]) -> DocumentRow:
    return DocumentRow(row[0], row[1], row[2], bool(row[3]), row[4], row[5], row[6], row[7], row[8])  # type: ignore[arg-type]
_COLUMNS = {"name", "context", "neighbours", "kind", "title", "modified"}  # the newest columns: a table without them is opened writable once


class ChunkTable:
    def __init__(self, path: Path, *, read_only: bool = False) -> None:
        """`read_only`: a connection that cannot write, so closing it does not checkpoint an interrupted ingest's
        write-ahead log into the file (`info` writes nothing); a table from before the newest columns is opened
        writable once to add them. A read-only view is for a moment's reading: a later ingest may not show."""
        self._lock = threading.RLock()
        if read_only:
            # No log beside the file: nothing is uncheckpointed, and `immutable` keeps SQLite from creating
            # one (a read-only connection cannot delete the files it creates).
            logged = any(path.with_name(path.name + end).exists() for end in ("-wal", "-shm"))
            self.db = sqlite3.connect(f"{path.resolve().as_uri()}?{'mode=ro' if logged else 'immutable=1'}", uri=True,
                                      isolation_level=None, check_same_thread=False)
            if _COLUMNS <= {r[1] for t in ("documents", "modules") for r in self.db.execute(f"PRAGMA table_info({t})")}:
                return
            self.db.close()
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        have = {t: {r[1] for r in self.db.execute(f"PRAGMA table_info({t})")} for t in ("documents", "modules")}
        for table, column, kind in (("documents", "name", "TEXT"), ("modules", "context", "TEXT"),
                                    ("modules", "neighbours", "TEXT"), ("documents", "kind", "TEXT"),
                                    ("documents", "title", "TEXT"), ("documents", "modified", "REAL")):
            if column not in have[table]:  # a table from before it: NULL (metadata: derived or refused, metadata.py)
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    @_serialized
    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def _bump(self, db: sqlite3.Connection) -> None:
        db.execute(
            "INSERT INTO meta VALUES('generation', '1') "
            "ON CONFLICT(key) DO UPDATE SET value = CAST(value AS INTEGER) + 1"
        )

    # -- reads -----------------------------------------------------------------------------------

    @property
    @_serialized
    def generation(self) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()
        return int(row[0]) if row else 0

    @_serialized
    def document(self, source: str) -> DocumentRow | None:
        row = self.db.execute(
            f"SELECT {_DOCUMENT} FROM documents WHERE source = ?", (source,)
        ).fetchone()
        return _document(row) if row else None

    @_serialized
    def named(self, name: str) -> list[DocumentRow]:
        """The documents whose identity is `name` (rows from before names: their label)."""
        rows = self.db.execute(f"SELECT {_DOCUMENT} FROM documents WHERE COALESCE(name, label) = ? ORDER BY source", (name,))
        return [_document(r) for r in rows]

    @_serialized
    def documents(self) -> list[DocumentRow]:
        rows = self.db.execute(f"SELECT {_DOCUMENT} FROM documents ORDER BY source")
        return [_document(r) for r in rows]

    @_serialized
    def document_chunks(self) -> list[tuple[DocumentRow, int, dict[str, object]]]:
        """Every document with its number of chunks and its metadata, by source."""
        rows = self.db.execute(
            "SELECT d.source, d.label, d.content_hash, d.complete, d.num_bytes, COUNT(c.module_id), m.metadata, d.name "
            "FROM documents d LEFT JOIN chunks c USING(source) LEFT JOIN document_meta m USING(source) "
            "GROUP BY d.source ORDER BY d.source"
        )
        return [(DocumentRow(r[0], r[1], r[2], bool(r[3]), r[4], r[7]), r[5], json.loads(r[6] or "{}")) for r in rows]

    @_serialized
    def document_metadata(self) -> list[tuple[DocumentRow, dict[str, object]]]:
        """Every document with its own metadata (a record's other fields, front matter), by source."""
        rows = self.db.execute(f"SELECT {', '.join('d.' + c for c in _DOCUMENT.split(', '))}, m.metadata FROM documents d "
                               "LEFT JOIN document_meta m USING(source) ORDER BY d.source")
        return [(_document(r), json.loads(r[-1] or "{}")) for r in rows]

    @_serialized
    def chunk_contexts(self) -> list[tuple[int, str, str]]:
        """(FAISS id, source, the module's context: title and heading path) of every chunk."""
        rows = self.db.execute("SELECT m.faiss_id, c.source, COALESCE(m.context, '') FROM chunks c JOIN modules m USING(module_id)")
        return rows.fetchall()

    @property
    @_serialized
    def metadata_version(self) -> tuple[int, int]:
        """Changes with what filters read: (the generation, metadata updated without a change of contents)."""
        rows = dict(self.db.execute("SELECT key, value FROM meta WHERE key IN ('generation', 'metadata')").fetchall())
        return int(rows.get("generation", 0)), int(rows.get("metadata", 0))

    @_serialized
    def update_metadata(self, docs: Sequence[tuple[DocumentRow, dict[str, object]]]) -> None:
        """New metadata of documents whose contents are unchanged (a file touched, a table from before
        metadata was kept); not a change of the contents, so the generation stays."""
        with self._tx() as db:
            db.executemany("UPDATE documents SET kind = ?, title = ?, modified = ? WHERE source = ?",
                           [(d.kind, d.title, d.modified, d.source) for d, _ in docs])
            db.executemany("DELETE FROM document_meta WHERE source = ?", [(d.source,) for d, _ in docs])
            db.executemany("INSERT INTO document_meta VALUES(?, ?)",
                           [(d.source, json.dumps(m, default=str)) for d, m in docs if m])
            db.execute("INSERT INTO meta VALUES('metadata', '1') "
                       "ON CONFLICT(key) DO UPDATE SET value = CAST(value AS INTEGER) + 1")

    @_serialized
    def chunk_ids(self, source: str) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT module_id FROM chunks WHERE source = ?", (source,))}

    @_serialized
    def num_chunk_tokens(self, source: str) -> int:
        """Tokens of the modules `source`'s chunks hold so far: what an interrupted ingest committed of it."""
        row = self.db.execute("SELECT COALESCE(SUM(m.num_tokens), 0) FROM chunks c JOIN modules m USING(module_id) "
                              "WHERE c.source = ?", (source,)).fetchone()
        return int(row[0])

    @_serialized
    def has_module(self, module_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM modules WHERE module_id = ?", (module_id,)).fetchone() is not None

    @_serialized
    def module_ids_for(self, faiss_ids: Sequence[int]) -> dict[int, str]:
        marks = ",".join("?" * len(faiss_ids))
        rows = self.db.execute(f"SELECT faiss_id, module_id FROM modules WHERE faiss_id IN ({marks})", list(faiss_ids))
        return dict(rows.fetchall())

    @_serialized
    def module(self, module_id: str) -> tuple[str, int] | None:
        """(module text, token count)."""
        row = self.db.execute("SELECT text, num_tokens FROM modules WHERE module_id = ?", (module_id,)).fetchone()
        return (row[0], row[1]) if row else None

    @_serialized
    def context(self, module_id: str) -> str:
        """The module's title and heading path (`chunker.Chunk.context`); "" where it has none."""
        row = self.db.execute("SELECT context FROM modules WHERE module_id = ?", (module_id,)).fetchone()
        return (row[0] or "") if row else ""

    @_serialized
    def neighbours(self) -> dict[str, tuple[str, ...]]:
        """module id -> the modules its KV was encoded after, of every module that has some."""
        rows = self.db.execute("SELECT module_id, neighbours FROM modules WHERE neighbours IS NOT NULL")
        return {m: tuple(json.loads(n)) for m, n in rows}

    @_serialized
    def set_keys(self, store_keys: dict[str, str]) -> None:
        """New store keys of modules kept (their neighbours changed); not a change of what the corpus holds."""
        with self._tx() as db:
            db.executemany("INSERT OR REPLACE INTO module_keys VALUES(?, ?)", list(store_keys.items()))

    @_serialized
    def sources(self, module_id: str) -> list[tuple[str, int, int]]:
        """(source, start, end) of every chunk that became this module."""
        rows = self.db.execute("SELECT source, start, end FROM chunks WHERE module_id = ? ORDER BY source", (module_id,))
        return [tuple(r) for r in rows]

    @_serialized
    def modules(self) -> list[tuple[str, str]]:
        """(module id, text) in ingest order."""
        return self.db.execute("SELECT module_id, text FROM modules ORDER BY rowid").fetchall()

    @_serialized
    def vectors(self, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(faiss ids [n] int64, vectors [n, dim] float32) of every module."""
        rows = self.db.execute("SELECT faiss_id, vector FROM modules ORDER BY rowid").fetchall()
        ids = np.array([r[0] for r in rows], dtype=np.int64)
        vectors = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), dim)
        return ids, vectors

    @_serialized
    def module_keys(self, plain: bool = False) -> list[tuple[str, str, int]]:
        """(module id, store key of its KV, tokens) of every module, in ingest order; `plain`: of its plain KV,
        where it keeps one beside the KV encoded after its neighbours (rag/encoding.py PLAIN)."""
        on = "k.module_id = m.module_id || '#plain'" if plain else "k.module_id = m.module_id"
        return self.db.execute(f"SELECT m.module_id, k.store_key, m.num_tokens FROM modules m JOIN module_keys k ON {on} ORDER BY m.rowid").fetchall()

    @_serialized
    def retrieval_counts(self) -> list[tuple[str, int]]:
        """(module id, times retrieved) of the modules still in the corpus, most retrieved first."""
        return self.db.execute("SELECT r.module_id, r.count FROM retrievals r JOIN modules m USING(module_id) "
                               "ORDER BY r.count DESC, m.rowid").fetchall()

    @_serialized
    def count_retrievals(self, counts: dict[str, int]) -> None:
        """Add to how often each module was retrieved (what `warm` reads); not a change of the corpus's
        contents, so the generation stays."""
        with self._tx() as db:
            db.executemany("INSERT INTO retrievals VALUES(?, ?) ON CONFLICT(module_id) DO UPDATE SET "
                           "count = count + excluded.count", list(counts.items()))

    @_serialized
    def search_texts(self) -> tuple[np.ndarray, list[str], list[str]]:
        """(faiss ids [n] int64, what retrieval reads: `chunker.search_text`, the context lines) of every module."""
        rows = self.db.execute("SELECT faiss_id, context, text FROM modules ORDER BY rowid").fetchall()
        return np.array([r[0] for r in rows], dtype=np.int64), [search_text(r[1] or "", r[2]) for r in rows], [r[1] or "" for r in rows]

    @_serialized
    def vectors_for(self, faiss_ids: Sequence[int]) -> dict[int, np.ndarray]:
        """The stored vector [dim] float32 of each of these modules that exists."""
        marks = ",".join("?" * len(faiss_ids))
        rows = self.db.execute(f"SELECT faiss_id, vector FROM modules WHERE faiss_id IN ({marks})", list(faiss_ids))
        return {f: np.frombuffer(v, dtype=np.float32) for f, v in rows}

    @_serialized
    def counts(self) -> dict[str, int]:
        one = lambda sql: self.db.execute(sql).fetchone()[0] or 0  # noqa: E731
        return {
            "num_documents": one("SELECT COUNT(*) FROM documents"),
            "num_incomplete": one("SELECT COUNT(*) FROM documents WHERE complete = 0"),
            "num_modules": one("SELECT COUNT(*) FROM modules"),
            "num_tokens": one("SELECT SUM(num_tokens) FROM modules"),
            "num_chunks": one("SELECT COUNT(*) FROM chunks"),
        }

    # -- writes (each one transaction) -----------------------------------------------------------

    @_serialized
    def begin_document(self, doc: DocumentRow, metadata: dict[str, object] | None = None) -> Dropped:
        """Record that `doc` is being ingested (with its metadata, e.g. a record's other fields). A
        changed document loses its old chunks first; returns the modules no longer referenced."""
        with self._tx() as db:
            db.execute("DELETE FROM document_meta WHERE source = ?", (doc.source,))
            if metadata:
                db.execute("INSERT INTO document_meta VALUES(?, ?)", (doc.source, json.dumps(metadata, default=str)))
            old = self.document(doc.source)
            dropped = self._drop_chunks(db, doc.source) if old is not None and old.content_hash != doc.content_hash else Dropped()
            db.execute(
                "INSERT INTO documents(source, label, content_hash, complete, num_bytes, updated, name, kind, title, modified) "
                "VALUES(?, ?, ?, 0, ?, ?, ?, ?, ?, ?) ON CONFLICT(source) DO UPDATE SET "
                "label = excluded.label, content_hash = excluded.content_hash, complete = 0, "
                "num_bytes = excluded.num_bytes, updated = excluded.updated, name = excluded.name, "
                "kind = excluded.kind, title = excluded.title, modified = excluded.modified",
                (doc.source, doc.label, doc.content_hash, doc.num_bytes, time.time(), doc.name, doc.kind, doc.title, doc.modified),
            )
            self._bump(db)
        return dropped

    @_serialized
    def commit_batch(
        self, modules: Iterable[ModuleRow], chunks: Iterable[ChunkRow], completed: Iterable[str], store_keys: dict[str, str] | None = None
    ) -> None:
        """One ingest batch; `store_keys` maps a module id to the store key of its KV, so that
        forgetting the module can drop its KV too."""
        with self._tx() as db:
            db.executemany("INSERT OR REPLACE INTO module_keys VALUES(?, ?)", list((store_keys or {}).items()))
            db.executemany(
                "INSERT OR IGNORE INTO modules(module_id, faiss_id, text, num_tokens, vector, context, neighbours) "
                "VALUES(?, ?, ?, ?, ?, ?, ?)",
                [(m.module_id, m.faiss_id, m.text, m.num_tokens, np.asarray(m.vector, np.float32).tobytes(), m.context or None,
                  json.dumps(list(m.neighbours)) if m.neighbours else None) for m in modules],
            )
            db.executemany(
                "INSERT OR IGNORE INTO chunks VALUES(?, ?, ?, ?, ?)",
                [(c.source, c.module_id, c.seq, c.start, c.end) for c in chunks],
            )
            db.executemany("UPDATE documents SET complete = 1 WHERE source = ?", [(s,) for s in completed])
            self._bump(db)

    @_serialized
    def remove_document(self, source: str) -> Dropped:
        """Forget a document; returns the modules no longer referenced."""
        with self._tx() as db:
            dropped = self._drop_chunks(db, source)
            db.execute("DELETE FROM documents WHERE source = ?", (source,))
            db.execute("DELETE FROM document_meta WHERE source = ?", (source,))
            self._bump(db)
        return dropped

    def _drop_chunks(self, db: sqlite3.Connection, source: str) -> Dropped:
        db.execute("DELETE FROM chunks WHERE source = ?", (source,))
        orphans = db.execute(  # with a module's own key, its plain KV's where it keeps one (rag/encoding.py PLAIN)
            "SELECT m.module_id, m.faiss_id, k.store_key, p.store_key FROM modules m LEFT JOIN module_keys k USING(module_id) "
            "LEFT JOIN module_keys p ON p.module_id = m.module_id || '#plain' WHERE m.module_id NOT IN (SELECT module_id FROM chunks)"
        ).fetchall()
        db.executemany("DELETE FROM modules WHERE module_id = ?", [(m,) for m, *_ in orphans])
        db.executemany("DELETE FROM module_keys WHERE module_id IN (?, ? || '#plain')", [(m, m) for m, *_ in orphans])
        gone, changed = {m for m, *_ in orphans}, []
        if gone:  # modules encoded after a dropped one lose it from their neighbours (rag/neighbours.py)
            rows = db.execute("SELECT m.module_id, m.neighbours, k.store_key FROM modules m LEFT JOIN module_keys k "
                              "USING(module_id) WHERE m.neighbours IS NOT NULL").fetchall()
            for m, names, key in rows:
                names = json.loads(names)
                if gone & set(names):
                    left = [n for n in names if n not in gone]
                    db.execute("UPDATE modules SET neighbours = ? WHERE module_id = ?",
                               (json.dumps(left) if left else None, m))
                    changed.append((m, key))
        keys = tuple(k for *_, own, plain in orphans for k in (own, plain) if k) + tuple(k for _, k in changed if k)
        return Dropped(tuple(f for _, f, *_ in orphans), keys, tuple(m for m, _ in changed))
