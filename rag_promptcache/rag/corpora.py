"""Several corpora in one process: `open_corpora` opens each, and corpora whose modules one model computes
share that model, loaded once.

Corpora share an engine when their manifests record the same model, weights fingerprint, dtype, adapter
digest, encoding mode and recovery (`share_key`): the KV one of them stores is what the other's engine
would compute. The first of each group loads the engine with its own store; the others open on it with
`own_store=True`, so the engine keeps each one's modules in that corpus's own tiers (memory, disk, Redis)
within that corpus's own budget (`PromptCache.attach_store`, by schema name). Retrieval (index, table,
embedder) stays each corpus's own.

Not here: serving them (server/), one batcher per engine (the engine's scheduler).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from rag_promptcache.rag import layout

if TYPE_CHECKING:
    from rag_promptcache.rag.corpus import Corpus
    from rag_promptcache.rag.records import Manifest


def share_key(manifest: Manifest) -> tuple[str, ...]:
    """What must be equal for two corpora to share one loaded model."""
    return (manifest.model, manifest.fingerprint, manifest.dtype, manifest.adapter_digest or "", manifest.mode,
            manifest.recovery or "")


def open_corpora(paths: Iterable[str | os.PathLike[str]], *, redis_url: str | None = None, dtype: str | None = None,
                 adapter: str | os.PathLike[str] | None = "default", disk_tier: bool = True,
                 memory_bytes: int | None = None) -> list[Corpus]:
    """Open the corpora `paths` name (`layout.find_corpora`: corpora, or folders of them), one engine per
    model they need, loaded now where two share it. Two with one schema name (a copied directory) are
    refused: the engine tells their stores apart by it. `close_corpora` closes them."""
    from rag_promptcache.rag.corpus import Corpus

    found = layout.find_corpora(paths)
    opened: list[Corpus] = []
    leads: dict[tuple[str, ...], Corpus] = {}
    names: dict[str, Corpus] = {}
    try:
        for path in found:
            manifest = layout.read_manifest(path)
            if manifest.name in names:
                raise ValueError(f"corpora {names[manifest.name].path} and {path} are one corpus (schema "
                                 f"{manifest.name!r}; a copied directory?): serve one of them")
            lead = leads.get(share_key(manifest))
            if lead is None:
                c = Corpus.open(path, redis_url=redis_url, dtype=dtype, adapter=adapter, disk_tier=disk_tier,
                                memory_bytes=memory_bytes)
                leads[share_key(manifest)] = c
            else:
                c = Corpus.open(path, lead.engine, own_store=True, redis_url=redis_url, dtype=dtype,
                                disk_tier=disk_tier, memory_bytes=memory_bytes)
            opened.append(c)
            names[manifest.name] = c
    except BaseException:
        close_corpora(opened)
        raise
    return opened


def close_corpora(corpora: Sequence[Corpus]) -> None:
    """Close corpora `open_corpora` opened: those on a shared engine before the one that loaded it."""
    for c in reversed(corpora):
        c.close()
