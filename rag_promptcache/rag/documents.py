"""The documents of a corpus as a user names them: which stored document(s) a name means (for
`remove`), and the listing `info --documents` shows.

A document is stored under its source: an absolute file path, or `file#record id` for a record of a
.jsonl/.json file (`records_loader.py`), or the id a caller gave an object. Its label is the shorter
name answers show in their sources.

Not here: adding or dropping rows (`table.py`, `ingestor.py`).
"""

from __future__ import annotations

import os
from pathlib import Path

from rag_promptcache.rag.table import ChunkTable


def resolve(table: ChunkTable, name: str | os.PathLike[str], corpus: Path) -> str:
    """The source of the one document `name` means: a source, a path to an ingested file, or a label.
    `ValueError` naming the candidates when it means several, or how to list them when none."""
    key = str(name)
    if table.document(key) is not None:
        return key
    if Path(key).exists() and table.document(str(Path(key).resolve())) is not None:
        return str(Path(key).resolve())
    by_label = [d.source for d in table.documents() if d.label == key]
    if len(by_label) == 1:
        return by_label[0]
    if len(by_label) > 1:
        raise ValueError(f"{key!r} names {len(by_label)} documents in corpus {corpus}: {', '.join(by_label)}; pass one of these")
    raise ValueError(f"no document {key!r} in corpus {corpus}; `rag-promptcache info --corpus {corpus} --documents` lists them by name")


def listing(table: ChunkTable) -> list[dict[str, object]]:
    """Each document: `name` (what `ask` shows in its sources and `remove` accepts), `source`,
    `num_chunks`, `num_bytes`, `complete` (False: an interrupted ingest; run it again) and
    `metadata` (a record's other fields)."""
    return [{"name": d.label, "source": d.source, "num_chunks": n, "num_bytes": d.num_bytes, "complete": d.complete,
             "metadata": meta} for d, n, meta in table.document_chunks()]
