"""Ingest planning, apart from the corpus: gather inputs, refuse absurd ones, find deleted files.

Pure bookkeeping over `Document`s and table rows; nothing here tokenizes, embeds or encodes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rag_promptcache.rag.loaders import Document, LoadReport, load
from rag_promptcache.rag.records_loader import RECORD_SEPARATOR
from rag_promptcache.rag.table import DocumentRow

LARGE_INGEST_TOKENS = 10_000  # an ingest about this large (new tokens) is told the store's size per codec first
_TEXT_KINDS = ("txt", "md", "markdown", "rst", "text", "json", "jsonl", "html", "htm", "object", "record")


def collect(inputs: list[object], field: str, id_field: str = "id") -> tuple[list[Document], LoadReport]:
    if not inputs:
        raise ValueError("nothing to ingest: no paths or documents given")
    report = LoadReport()
    for item in inputs:
        if isinstance(item, (str, os.PathLike)) and Path(item).is_dir() and not any(Path(item).iterdir()):
            raise ValueError(f"{item} is an empty directory")
    docs = list(load(inputs, field_name=field, id_field=id_field, report=report))
    if not docs:
        raise ValueError(f"nothing to ingest: {report.summary() or 'no supported files found'}")
    check_names(docs)
    return docs, report


def check_names(docs: list[Document]) -> None:
    """A corpus keeps one document per name (`Document.name`): two places in one ingest that give
    the same name (`a/README.md` and `b/README.md` passed as `a/ b/`) are refused before any work,
    with how to keep both. The same source twice (objects sharing an id) is not refused here."""
    first: dict[str, str] = {}
    for d in docs:
        other = first.setdefault(d.identity, d.source)
        if other != d.source:
            raise ValueError(
                f"{other} and {d.source} are both named {d.identity!r}, and a corpus keeps one document per name "
                "(a path relative to the directory ingested); to keep both, ingest a directory above both so that "
                "their names differ, or ingest them into separate corpora")


def estimate_tokens(docs: list[Document]) -> dict[str, int]:
    """About how many tokens each text document holds (4 bytes a token), by source; binary kinds
    (PDF) are not guessed."""
    return {d.source: d.num_bytes // 4 for d in docs if d.kind in _TEXT_KINDS}


def check_budget(docs: list[Document], budget: int) -> None:
    """Refuse, before anything is computed, an ingest whose KV would be absurd (a 50 MB log, say)."""
    estimate = estimate_tokens(docs)
    if (total := sum(estimate.values())) > budget:
        biggest = max(estimate, key=estimate.__getitem__)
        raise ValueError(
            f"about {total:,} tokens of new text (largest: {biggest}, {estimate[biggest] * 4 / 1e6:.1f} MB) "
            f"exceeds the ingest budget of {budget:,} tokens, each of which becomes stored KV; "
            "raise it with --max-ingest-tokens or ingest less"
        )


def stale(rows: list[DocumentRow], inputs: list[object], seen: set[str], skipped: set[str]) -> list[str]:
    """Documents under an ingested directory whose files are gone, and records gone from an
    ingested .jsonl/.json file (or the whole-file document an older version made of it)."""
    paths = [Path(i).resolve() for i in inputs if isinstance(i, (str, os.PathLike))]
    roots = [str(p) + os.sep for p in paths if p.is_dir()] + [str(p) + RECORD_SEPARATOR for p in paths if p.is_file()]
    split = {s.split(RECORD_SEPARATOR, 1)[0] for s in seen if RECORD_SEPARATOR in s}  # files now read as records
    return [r.source for r in rows if r.source not in seen and r.source not in skipped
            and (r.source in split or (any(r.source.startswith(p) for p in roots) and not Path(r.source).exists()))]


class _NoBar:
    format_dict = {"elapsed": 0.0}

    def update(self, n: int) -> None: ...
    def set_postfix(self, **kw: object) -> None: ...
    def close(self) -> None: ...


def progress_bar(progress: bool | None):
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(unit=" modules", desc="ingest", dynamic_ncols=True)
