"""`.jsonl` and `.json` files as one document per record.

A record is a JSON object with a text field (`text` unless told otherwise) and, optionally, an id
field (`id`): the id is the document's name in answers' sources and in `remove`; a record without
one is named `<file>:<line>` (JSON Lines) or `<file>[<index>]` (a JSON array). Its other fields are
kept as the document's metadata. A bare string is a record with only text. A malformed line, a
record without the text field or a repeated id is reported (with its line number) and skipped; the
rest of the file is ingested.

A JSON Lines file is scanned once for ids and offsets; a record's text is read again, from its
offset, when it is chunked, so memory stays bounded by one line. Not here: what changed since the
last ingest (the corpus compares content hashes).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

RECORD_SEPARATOR = "#"  # a record's source is `<resolved file>#<id>`


def record_documents(
    path: Path, label: str, text_field: str, id_field: str, skip: Callable[[str, str], None], make: Callable[..., object]
) -> list[object]:
    """Documents of the records in `path`. `skip(where, why)` reports one bad record;
    `make(source, label, content_hash, blocks, num_bytes, kind, metadata, name=)` builds a `Document`;
    a record's name (its identity in a corpus) is `<label of the file>#<id>`."""
    found = _jsonl(path, label, text_field, id_field, skip) if path.suffix.lower() == ".jsonl" else _json(path, label, text_field, id_field, skip)
    docs: list[object] = []
    first: dict[str, str] = {}
    resolved = str(path.resolve())
    for where, name, digest, blocks, num_bytes, metadata in found:
        if name in first:
            skip(where, f"repeated {id_field} {name!r} (first at {first[name]})")
            continue
        first[name] = where
        docs.append(make(f"{resolved}{RECORD_SEPARATOR}{name}", name, digest, blocks, num_bytes, "record", metadata,
                         name=f"{label}{RECORD_SEPARATOR}{name}"))
    return docs


Found = tuple[str, str, str, Callable[[], Iterator[str]], int, dict[str, object]]


def _record(record: object, where: str, default_name: str, text_field: str, id_field: str,
            skip: Callable[[str, str], None]) -> tuple[str, str, dict[str, object]] | None:
    """(name, text, metadata) of one record, or None after reporting why it is skipped."""
    if isinstance(record, str):
        record = {text_field: record}
    if not isinstance(record, dict):
        skip(where, f"a record must be a JSON object or string, not {type(record).__name__}")
        return None
    text = record.get(text_field)
    if not isinstance(text, str) or not text.strip():
        fields = ", ".join(sorted(map(str, record))) or "none"
        skip(where, f"no text in field {text_field!r} (fields: {fields}; choose another with --field)")
        return None
    raw_id = record.get(id_field)
    name = str(raw_id).strip() if raw_id is not None and str(raw_id).strip() else default_name
    metadata = {k: v for k, v in record.items() if k not in (text_field, id_field)}
    return name, text, metadata


def _digest(text: str, name: str, metadata: dict[str, object], extra: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in (extra, name, text, json.dumps(metadata, sort_keys=True, default=str)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _jsonl(path: Path, label: str, text_field: str, id_field: str, skip: Callable[[str, str], None]) -> Iterator[Found]:
    with path.open("rb") as f:
        offset = 0
        for number, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as e:
                skip(where, f"not valid JSON: {e.msg} at column {e.colno}")
                continue
            got = _record(record, where, f"{label}:{number}", text_field, id_field, skip)
            if got is not None:
                name, text, metadata = got
                yield (where, name, _digest(text, name, metadata, text_field + "\0" + id_field),
                       _reread(path, start, len(raw), text_field), len(text.encode()), metadata)


def _reread(path: Path, start: int, length: int, text_field: str) -> Callable[[], Iterator[str]]:
    def blocks() -> Iterator[str]:
        with path.open("rb") as f:
            f.seek(start)
            record = json.loads(f.read(length))
        yield record if isinstance(record, str) else record[text_field]

    return blocks


def _json(path: Path, label: str, text_field: str, id_field: str, skip: Callable[[str, str], None]) -> Iterator[Found]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        skip(str(path), f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}")
        return
    records = data if isinstance(data, list) else [data]
    for index, record in enumerate(records):
        where = f"{path}[{index}]" if isinstance(data, list) else str(path)
        got = _record(record, where, f"{label}[{index}]" if isinstance(data, list) else label, text_field, id_field, skip)
        if got is not None:
            name, text, metadata = got
            yield where, name, _digest(text, name, metadata, text_field + "\0" + id_field), (lambda t=text: iter([t])), len(text.encode()), metadata
