"""What each chunk carries for filters, and which chunks a filter lets a search return.

A chunk's metadata is its document's, plus its section:

- `source`: the document's name, as listings and answers' sources show it (a file: its path relative to
  the folder ingested; a record: `<file>#<id>`; an object: its `source` or id);
- `path`: the resolved file it was read from (a record's: its .jsonl/.json file); objects have none;
- `type`: what it was read as (`md`, `html`, `pdf`, `txt`, ..., `record`, `object`);
- `title`: what the document calls itself (`""` when it names nothing);
- `modified`: the file's modification time, ISO-8601 in UTC (`2026-11-30T09:15:02Z`);
- `section`: the chunk's heading path under the title (`"Configuration › Options"`; `""` before the
  first heading);
- the document's own fields: a JSONL/JSON record's other fields, a Markdown file's front matter, a
  LangChain or LlamaIndex object's metadata; they take precedence over `title` and `modified`, never over
  `source`, `path` or `type`.

A corpus ingested before metadata was kept opens as it is: `source`, `path`, `type` and `section` are
derived from what its table holds, its records' fields were kept already, and a filter naming `title`
or `modified` is refused by name until an `ingest` of the same paths records them (nothing is encoded
again: unchanged documents only get their metadata).

`Catalog` reads the table once per change of it (`ChunkTable.metadata_version`) and answers, per
filter, the FAISS ids of the modules with a matching chunk: what the search is restricted to
(`retrieval.search`). A module several documents share matches when any of its chunks does.

Not here: the filter language (`filters.py`), the search (`retrieval.py`).
"""

from __future__ import annotations

import datetime as dt
import threading
from pathlib import Path

import numpy as np

from rag_promptcache.rag.chunker import SEPARATOR
from rag_promptcache.rag.filters import Filter
from rag_promptcache.rag.records_loader import RECORD_SEPARATOR
from rag_promptcache.rag.table import ChunkTable, DocumentRow

KEYS = ("source", "path", "type", "title", "modified", "section")  # what every chunk carries (module docstring)
FIXED = ("source", "path", "type")  # a document's own field of one of these names does not replace it
RECORDED = ("title", "modified")  # missing from documents ingested before metadata was kept
FILTERS_KEPT = 64  # filters whose matching modules are remembered until the table changes (oldest out first)


def document_fields(row: DocumentRow, own: dict[str, object]) -> dict[str, object]:
    """A document's metadata (the module docstring), without `section`."""
    out: dict[str, object] = {}
    if row.title is not None:
        out["title"] = row.title
    if row.modified is not None:
        out["modified"] = iso(row.modified)
    out.update(own)
    file, sep, _ = row.source.partition(RECORD_SEPARATOR)
    path = file if sep else row.source
    if Path(path).is_absolute():
        out["path"] = path
    out["source"] = row.shown
    kind = row.kind or ("record" if sep and Path(file).is_absolute() else Path(path).suffix.lower().lstrip("."))
    out["type"] = kind or "object"
    return out


def section_of(context: str) -> str:
    """A chunk's heading path under its document's title, from its context (`chunker.context_of`)."""
    return context.partition(SEPARATOR)[2]


def iso(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


class Catalog:
    """The chunks' metadata of one corpus, read from its table when the table changed, and the modules a
    filter matches. Thread-safe."""

    def __init__(self, table: ChunkTable) -> None:
        self.table = table
        self._lock = threading.Lock()
        self._version: tuple[int, int] | None = None
        self._documents: dict[str, dict[str, object]] = {}
        self._chunks: list[tuple[int, str, str]] = []  # (FAISS id, source, section)
        self._keys: frozenset[str] = frozenset()
        self._num_old = 0  # documents from before metadata was kept
        self._first: dict[int, tuple[str, str]] = {}  # FAISS id -> (its first source, its section)
        self._matched: dict[str, np.ndarray] = {}  # a filter's canonical form -> its modules, until the table changes

    def _read(self) -> None:
        version = self.table.metadata_version
        if version == self._version:
            return
        rows = self.table.document_metadata()
        self._documents = {row.source: document_fields(row, own) for row, own in rows}
        self._chunks = [(f, s, section_of(c)) for f, s, c in self.table.chunk_contexts()]
        self._first = {}
        for f, s, section in sorted(self._chunks, key=lambda c: c[1], reverse=True):
            self._first[f] = (s, section)  # the first source by name, as `Corpus.source` names it
        self._keys = frozenset(k for d in self._documents.values() for k in d) | {"section"}
        self._num_old = sum(row.kind is None for row, _ in rows)
        self._matched = {}
        self._version = version

    def keys(self) -> frozenset[str]:
        """Every key some chunk carries."""
        with self._lock:
            self._read()
            return self._keys

    def check(self, spec: Filter | dict[str, object] | None) -> Filter | None:
        """The parsed filter; `ValueError` naming an unknown key (and the valid ones) or a bad shape."""
        flt = Filter.parse(spec)
        if flt is None:
            return None
        with self._lock:
            self._read()
            missing = [k for k in RECORDED if k not in self._keys]
            note = (f"{', '.join(missing)}: not recorded for the {self._num_old} document(s) ingested before metadata "
                    "was kept; `ingest` the same paths again to record them, nothing is encoded again"
                    if missing and self._num_old else "")
            flt.check_keys(self._keys, note)
        return flt

    def matching(self, spec: Filter | dict[str, object] | None) -> np.ndarray | None:
        """The FAISS ids [n] int64 of the modules with a chunk the filter matches (sorted); None for no
        filter. `ValueError` as `check` says."""
        flt = self.check(spec)
        if flt is None:
            return None
        with self._lock:
            self._read()
            if (found := self._matched.get(str(flt))) is not None:
                return found
            seen: dict[tuple[str, str], bool] = {}  # a document's sections share one test
            ids = set()
            for faiss_id, source, section in self._chunks:
                key = (source, section)
                if key not in seen:
                    seen[key] = flt.matches({**self._documents.get(source, {}), "section": section})
                if seen[key]:
                    ids.add(faiss_id)
            if len(self._matched) >= FILTERS_KEPT:
                self._matched.pop(next(iter(self._matched)))
            found = self._matched[str(flt)] = np.array(sorted(ids), dtype=np.int64)
            return found

    def of(self, faiss_id: int) -> dict[str, object]:
        """A module's metadata: its first chunk's (the first document by source, as `Corpus.source` names
        it); {} for a module the table does not hold."""
        with self._lock:
            self._read()
            if faiss_id not in self._first:
                return {}
            source, section = self._first[faiss_id]
            return {**self._documents.get(source, {}), "section": section}
