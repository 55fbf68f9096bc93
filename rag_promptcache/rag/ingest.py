"""Ingest planning, apart from the corpus: gather inputs, refuse absurd ones, find deleted files.

Bookkeeping over `Document`s and table rows; nothing here embeds or encodes (`count_tokens` runs the
chunker over a sample).
"""

from __future__ import annotations

import os
from pathlib import Path

from rag_promptcache.rag.chunker import Chunker
from rag_promptcache.rag.loaders import Document, LoadReport, is_site_copy, load
from rag_promptcache.rag.records_loader import RECORD_SEPARATOR
from rag_promptcache.rag.table import DocumentRow

LARGE_INGEST_TOKENS = 10_000  # an ingest about this large (new tokens) is told the store's size per codec first
GUESS_MARGIN = 1.5  # the byte guess refuses only this far over the budget; the chunker's count decides the rest
SAMPLE_BYTES = 256 * 1024  # of each kind of document, chunked to estimate an ingest's tokens (`count_tokens`)
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
    (PDF) are not guessed. A first guess, before a tokenizer is loaded; `count_tokens` is the estimate."""
    return {d.source: d.num_bytes // 4 for d in docs if d.kind in _TEXT_KINDS}


def count_tokens(docs: list[Document], chunker: Chunker) -> int:
    """About how many module tokens `docs` become (what their KV costs): the real chunker run over a
    sample of each kind of document (whole documents, spread over the list, at least `SAMPLE_BYTES` of
    each kind, or all of it), scaled by that kind's bytes. Overlap and source labels are counted, as the
    store will hold them; identical chunks shared by documents are not subtracted."""
    by_kind: dict[str, list[Document]] = {}
    for d in docs:
        by_kind.setdefault(d.kind, []).append(d)
    total = 0
    for group in by_kind.values():
        size = sum(d.num_bytes for d in group)
        wanted = -(-SAMPLE_BYTES * len(group) // max(size, 1))  # documents of average size in SAMPLE_BYTES
        sample = group[::max(1, len(group) // wanted)]
        tokens = sum(c.num_tokens for d in sample for c in chunker.chunks(d.blocks(), d.label))
        total += round(tokens * size / max(sum(d.num_bytes for d in sample), 1))
    return total


def check_budget(docs: list[Document], budget: int | None, num_tokens: int | None = None) -> None:
    """Refuse, before anything is computed, an ingest whose KV would be absurd (a 50 MB log, say):
    `num_tokens` (`count_tokens`) over `budget`; without it, before a tokenizer is loaded, the 4-bytes-a-
    token guess over `GUESS_MARGIN` times the budget (the guess ran 20% high on HTML manuals). None: no
    limit (a lazy ingest's KV is bounded by the store's budget instead)."""
    if budget is None:
        return
    estimate = estimate_tokens(docs)
    total = sum(estimate.values()) if num_tokens is None else num_tokens
    if total > (budget * GUESS_MARGIN if num_tokens is None else budget):
        biggest = max(estimate or {d.source: d.num_bytes for d in docs}, key=lambda s: estimate.get(s, 0))
        raise ValueError(
            f"about {total:,} tokens of new text (largest: {biggest}) exceeds the ingest budget of {budget:,} "
            "tokens, each of which becomes stored KV now; ingest with --kv lazy (KV computed when a question first "
            "retrieves a chunk, the store held to --store-budget), raise --max-ingest-tokens, or ingest less"
        )


def stale(rows: list[DocumentRow], inputs: list[object], seen: set[str], skipped: list[tuple[str, str]]) -> list[str]:
    """Documents under an ingested directory whose files are gone, records gone from an ingested .jsonl/.json
    file (or the whole-file document an older version made of it), and pages an earlier ingest read that the
    walk now skips as its site's copies (a noindex page, a Sphinx source: a fresh ingest holds none).
    `skipped`: the load's (source, why) pairs."""
    paths = [Path(i).resolve() for i in inputs if isinstance(i, (str, os.PathLike))]
    roots = [str(p) + os.sep for p in paths if p.is_dir()] + [str(p) + RECORD_SEPARATOR for p in paths if p.is_file()]
    split = {s.split(RECORD_SEPARATOR, 1)[0] for s in seen if RECORD_SEPARATOR in s}  # files now read as records
    copies = {str(Path(s).resolve()) for s, why in skipped if is_site_copy(why)}
    kept = {s for s, _ in skipped}
    return [r.source for r in rows if r.source in copies or (r.source not in seen and r.source not in kept and (
        r.source in split or (any(r.source.startswith(p) for p in roots) and not Path(r.source).exists())))]
