"""Neighbour-aware module encoding for a corpus (`ingest --neighbours M`, `Corpus.build(neighbours=M)`).

Each new module's KV is encoded after the M modules nearest its text (inner product on the corpus's own
embeddings, through its FAISS index, among what is indexed and the batch being ingested), least similar
first so that the most similar sits right before it, keeping only the module's own KV moved back to its
usual position (engine/planning/encoder.py). A question retrieves look-alikes together, so the stored
KV has already read much of what will sit before it: research/module_probe.py's `nbr:3+none` kept 0.97
of the answers against 0.91 for `none` at k=8, at no question-time cost. Ingest costs (M+1)x the encoding.

The chosen ids are kept in the chunk table (`modules.neighbours`), so every process compiles the same
schema and the same store keys (`Corpus.schema`, the lazy path's misses, a later open).

A neighbour removed later (its document removed or changed): the modules that named it lose it from
their lists (the others stay, in order), their old KV is dropped, and their KV is encoded again with
the neighbours left (`rekey`: now for an eager corpus, at its first retrieval for a lazy one). The removed
text is not kept: a corpus holds only what its documents say.

On Ray (rag/distributed.py) the driver embeds and chooses, batch by batch in order, as a local ingest does;
the batches it has sent but not committed yet are searched beside the index (`Unindexed`), since a local
ingest has indexed them by then, so both choose the same lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rag_promptcache.rag.encoding import Neighbours, encode_kv, store_keys
from rag_promptcache.rag.index import VectorIndex, faiss_id
from rag_promptcache.rag.records import Manifest
from rag_promptcache.rag.table import ChunkTable

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache

Search = Callable[[np.ndarray, int], list[list[tuple[int, float]]]]  # the index's: per row, (faiss id, score)
MAX = 16  # neighbours a module reads: each one costs its tokens again at ingest, per module


@dataclass(frozen=True, slots=True)
class Unindexed:
    """Modules embedded and being encoded, not committed yet: a Ray ingest's batches in flight. A local
    ingest has indexed them by the time it chooses for a later batch, so `choose` searches them as indexed."""

    texts: dict[str, str]  # module id -> module text
    vectors: np.ndarray  # [len(texts), dim] float32, in the order of `texts`


NOTHING = Unindexed({}, np.zeros((0, 0), np.float32))


def check(neighbours: int | None, present: int | None = None) -> int | None:
    """`neighbours` as asked (None: not asked, an existing corpus's), refused unless it is a valid setting; so is
    `present` (how many of a module's neighbours a prompt must hold for it to read the KV encoded after them)."""
    if neighbours is not None and (isinstance(neighbours, bool) or not isinstance(neighbours, int)
                                   or not 0 <= neighbours <= MAX):
        raise ValueError(f"neighbours must be a whole number from 0 (off) to {MAX}, got {neighbours!r}")
    if present is not None and (isinstance(present, bool) or not isinstance(present, int) or present < 0
                                or (neighbours is not None and present > neighbours)):  # None: the corpus's
        raise ValueError(f"neighbours_present (--neighbours-present) must be a whole number from 0 (always read "
                         f"the KV encoded after the neighbours) to the corpus's neighbours (M, given with it: "
                         f"{neighbours or 0}), got {present!r}")
    return neighbours


def choose(search: Search, table: ChunkTable, ids: Sequence[str], vectors: np.ndarray, m: int,
           texts: Sequence[str], unindexed: Unindexed = NOTHING) -> Neighbours:
    """The m nearest modules of each of `ids` (new modules, `texts` theirs, `vectors` [n, dim] their
    embeddings) among the indexed modules (and `unindexed`, as if indexed) and each other, least similar
    first; with the text of the earlier ones they name."""
    if not m or not len(ids):
        return Neighbours({})
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    indexed = search(vectors, m)
    names = table.module_ids_for(sorted({f for row in indexed for f, _ in row})) if any(indexed) else {}
    if unindexed.texts:  # searched the way the index searches (a flat FAISS index), so the scores are the same
        extra = VectorIndex(vectors.shape[1])
        extra.add(np.array([faiss_id(u) for u in unindexed.texts], np.int64), unindexed.vectors)
        # the m nearest of the index and the m nearest of these hold the m nearest of both
        indexed = [a + b for a, b in zip(indexed, extra.search(vectors, m))]
        names |= {faiss_id(u): u for u in unindexed.texts}
    within = vectors @ vectors.T
    of: dict[str, tuple[str, ...]] = {}
    own = dict(zip(ids, texts))
    for i, module in enumerate(ids):
        found = {names[f]: s for f, s in indexed[i] if f in names and names[f] != module}
        for j, other in enumerate(ids):
            if other != module and own[other] != own[module]:
                found[other] = max(found.get(other, -np.inf), float(within[i, j]))
        # the most similar m, ties by id so every run picks the same; then least similar first
        best = sorted(found.items(), key=lambda kv: (-kv[1], kv[0]))[:m]
        of[module] = tuple(n for n, _ in reversed(best))
    earlier = sorted({n for ns in of.values() for n in ns if n not in own})
    return Neighbours(of, [(n, unindexed.texts[n] if n in unindexed.texts else _text(table, n)) for n in earlier])


def recorded(table: ChunkTable, ids: Sequence[str], of: dict[str, tuple[str, ...]] | None = None) -> Neighbours:
    """The neighbours the table records for `ids` (`of`: all of them, read once by the caller), with the text
    of those outside `ids`."""
    of = table.neighbours() if of is None else of
    mine = {m: of[m] for m in ids if m in of}
    inside = set(ids)
    earlier = sorted({n for ns in mine.values() for n in ns if n not in inside})
    return Neighbours(mine, [(n, _text(table, n)) for n in earlier])


def rekey(engine: PromptCache, manifest: Manifest, table: ChunkTable, changed: Sequence[str]) -> None:
    """After a neighbour was removed: record the new store key of each module in `changed` (the table
    already lists the neighbours left) and, for an eager corpus, encode its KV again."""
    if not changed:
        return
    modules = [(m, _text(table, m)) for m in changed if table.has_module(m)]
    nbrs = recorded(table, [m for m, _ in modules])
    table.set_keys(store_keys(engine, manifest, modules, nbrs))
    encode_kv(engine, manifest, modules, nbrs)


def _text(table: ChunkTable, module_id: str) -> str:
    row = table.module(module_id)
    assert row is not None, f"{module_id=} is named as a neighbour but not in the table"
    return row[0]
