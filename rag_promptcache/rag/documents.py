"""The documents of a corpus as a user names them: which stored document(s) a name means (for
`remove`), and the listing `info --documents` shows.

A document's name is its identity (the path relative to the directory ingested; see
`loaders.Document.name`); it is stored under its source: an absolute file path, or `file#record id` for a record of a
.jsonl/.json file (`records_loader.py`), or the id a caller gave an object. Naming a .jsonl/.json
file (its path, or its bare file name) means every record of it. Its label is what the model reads
above each chunk (a record's: its id alone); listings and answers' sources show the name.

Not here: adding or dropping rows (`table.py`, `ingestor.py`).
"""

from __future__ import annotations

import os
from pathlib import Path

from rag_promptcache.rag.records_loader import RECORD_SEPARATOR
from rag_promptcache.rag.table import ChunkTable


def resolve(table: ChunkTable, name: str | os.PathLike[str], corpus: Path) -> list[str]:
    """The sources of the document(s) `name` means: a source, a path to an ingested file (relative or
    absolute; a .jsonl/.json file means all its records), a label, or the bare name of a records file.
    `ValueError` naming the candidates when it means several documents, or how to list them when none."""
    key = str(name)
    if table.document(key) is not None:
        return [key]
    path = str(Path(key).resolve())
    if table.document(path) is not None:
        return [path]
    if named := table.named(key):
        return [d.source for d in named]
    rows = table.documents()
    records = [d.source for d in rows if _file_of(d.source) == path]
    records = records or [d.source for d in rows if (d.name or "").startswith(key + RECORD_SEPARATOR)]
    if records:
        return records
    by_label = [d.source for d in rows if d.label == key]
    if len(by_label) == 1:
        return by_label
    if len(by_label) > 1:
        raise ValueError(f"{key!r} names {len(by_label)} documents in corpus {corpus}: {', '.join(by_label)}; pass one of these")
    # A records file by its bare file name, wherever it was ingested from: all its records.
    files: dict[str, list[str]] = {}
    for d in rows:
        if (file := _file_of(d.source)) is not None and Path(file).name == key:
            files.setdefault(file, []).append(d.source)
    if len(files) == 1:
        return next(iter(files.values()))
    if len(files) > 1:
        raise ValueError(f"{key!r} names {len(files)} records files in corpus {corpus}: {', '.join(files)}; pass one of these paths")
    raise ValueError(f"no document {key!r} in corpus {corpus}; `rag-promptcache info --corpus {corpus} --documents` lists them by name")


def _file_of(source: str) -> str | None:
    """The file of a record's source (`<resolved file>#<id>`), None for any other document."""
    file, sep, _ = source.partition(RECORD_SEPARATOR)
    return file if sep and Path(file).is_absolute() else None


def listing(table: ChunkTable) -> list[dict[str, object]]:
    """Each document: `name` (what `ask` shows in its sources and `remove` accepts), `source`,
    `num_chunks`, `num_bytes`, `complete` (False: an interrupted ingest; run it again) and
    `metadata` (a record's other fields)."""
    return [{"name": d.shown, "source": d.source, "num_chunks": n, "num_bytes": d.num_bytes, "complete": d.complete,
             "metadata": meta} for d, n, meta in table.document_chunks()]
