"""The corpus schema, and the one encoding of an ingest batch: run by a local ingest and by every
Ray worker alike, so both store the same KV under the same keys.

The schema is union-free: the instructions, then one module per chunk, all inside the system turn.
A batch is encoded as the schema's `.ingest` twin holding only that batch's modules: a module's KV
key depends on the text before it in the schema (the instructions), not on its siblings, so this
matches the full schema a question is planned against. With neighbours (`ingest --neighbours M`,
rag/neighbours.py) the batch's schema also declares the earlier modules its modules are encoded after,
each module names them in `Schema.neighbours`, and only the batch's own modules (and the root) are encoded.

Not here: which modules are new or where rows go (`ingestor.py`), loading the model (`models.py`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rag_promptcache.engine.prompt.compiler import ROOT
from rag_promptcache.pml import ast
from rag_promptcache.rag.chunker import Chunk
from rag_promptcache.rag.embed import EmbedderLike
from rag_promptcache.rag.records import Manifest

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache

INGEST_SUFFIX = ".ingest"
PLAIN = "#plain"  # the table's key row of a module's plain KV, beside its KV encoded after its neighbours
Batch = list[tuple[str, int, Chunk]]  # (document source, chunk seq, chunk)


@dataclass(frozen=True, slots=True)
class Encoded:
    vectors: np.ndarray  # [modules, dim] float32, in the order given
    encode_seconds: float  # KV encoding only, not embedding


@dataclass(frozen=True, slots=True)
class Neighbours:
    """Which modules each module's KV is encoded after (module id -> ids, least similar first), and the
    (id, text) of those among them outside the modules at hand (earlier batches'): what a schema needs."""

    of: Mapping[str, tuple[str, ...]]
    earlier: Sequence[tuple[str, str]] = ()


NONE = Neighbours({})


def corpus_schema(manifest: Manifest, modules: Iterable[tuple[str, str]], suffix: str = "",
                  neighbours: Neighbours = NONE) -> ast.Schema:
    """The union-free corpus schema over (module id, text): instructions, then every module, inside the system
    turn; `neighbours`' earlier modules declared after them."""
    mods = {m: ast.Module(m, (ast.Text(text),)) for m, text in (*modules, *neighbours.earlier)}
    system = ast.Role("system", (ast.Text(manifest.instructions + "\n\n"), *mods.values()))
    return ast.Schema(manifest.name + suffix, (system,), modules=mods, parents={m: None for m in mods}, union_of={},
                      neighbours={m: tuple(n) for m, n in neighbours.of.items() if n and m in mods},
                      neighbours_present=manifest.neighbours_present,
                      byproduct=manifest.byproduct)


def encode_modules(engine: PromptCache, embedder: EmbedderLike, manifest: Manifest,
                   modules: Sequence[tuple[str, str]], embed_texts: Sequence[str] | None = None) -> Encoded:
    """Embed `embed_texts` (what retrieval reads of each module, `chunker.search_text`; default: the
    modules' text) and store the modules' KV through the engine's store (a lazy corpus's: not now; its
    first question to retrieve a module encodes it, rag/lazy.py)."""
    if not modules:
        return Encoded(np.zeros((0, manifest.dim), np.float32), 0.0)
    assert embed_texts is None or len(embed_texts) == len(modules), f"{len(modules)=}"
    vectors = embedder.embed(list(embed_texts) if embed_texts is not None else [text for _, text in modules])
    return Encoded(vectors, encode_kv(engine, manifest, modules))


def encode_kv(engine: PromptCache, manifest: Manifest, modules: Sequence[tuple[str, str]],
              neighbours: Neighbours = NONE) -> float:
    """Store the modules' KV through the engine's store (none for a lazy corpus); the seconds it took."""
    if not modules or manifest.kv == "lazy":
        return 0.0
    t = time.perf_counter()
    # A corpus that keeps both entries writes the plain one now, the other in idle time (rag/lazy.py `Upgrades`)
    # or when a question reads its plain entry in its place (engine/planning/plan.py).
    near = NONE if manifest.neighbours_present else neighbours
    # The batch's modules and the root (instructions), so no question pays for them; not the earlier
    # modules declared as neighbours.
    engine.encode(_ingest_schema(engine, manifest, modules, near), [ROOT, *(m for m, _ in modules)] if near.earlier else None)
    return time.perf_counter() - t


def store_keys(engine: PromptCache, manifest: Manifest, modules: Sequence[tuple[str, str]],
               neighbours: Neighbours = NONE) -> dict[str, str]:
    """The store key of each module's KV, as the engine computes it (registering the batch's schema
    only tokenizes), so that forgetting a module can drop its KV; a plain entry kept beside the one encoded
    after the neighbours (`--neighbours-present`) under "<module>#plain", dropped with the module."""
    keys: dict[str, str] = {}
    for near in encodings(manifest, neighbours) if modules else ():
        got = engine.store_keys(_ingest_schema(engine, manifest, modules, near), [m for m, _ in modules])
        keys |= got if near is neighbours else {m + PLAIN: k for m, k in got.items()}
    return keys


def encodings(manifest: Manifest, neighbours: Neighbours) -> tuple[Neighbours, ...]:
    """The encodings a corpus keeps of a batch: after `neighbours`, and plain too where a prompt without
    enough of them reads that (`Manifest.neighbours_present`; ingest writes only that one, `encode_kv`)."""
    return (NONE, neighbours) if manifest.neighbours_present and neighbours.of else (neighbours,)


def _ingest_schema(engine: PromptCache, manifest: Manifest, modules: Sequence[tuple[str, str]],
                   neighbours: Neighbours) -> str:
    """Register the batch's schema (its modules after `neighbours`) for ingest; its name."""
    engine.add_schema(corpus_schema(manifest, modules, INGEST_SUFFIX, neighbours), replace=True)
    return manifest.name + INGEST_SUFFIX
