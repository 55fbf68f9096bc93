"""Where a corpus keeps its module KV: memory → disk (`<corpus>/store`) → an optional shared Redis.

The Redis tier is what lets several serving replicas (and Ray ingest workers on other machines)
share modules: one encodes, the others read. It is keyed under `rpc:<corpus name>`, so corpora in
one Redis never mix their key indexes. Its URL comes from an argument, else the environment
variable `RAG_PROMPTCACHE_REDIS_URL` (so any command that opens a corpus honours it unchanged).
Redis being down is a miss, never an error (`store/redis.py`): requests recompute.

Not here: the tiers themselves (`rag_promptcache.store`), or what is stored (the engine).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rag_promptcache.store.base import Store

ENV_REDIS_URL = "RAG_PROMPTCACHE_REDIS_URL"
# A corpus's codec (`Manifest.codec`, `ingest --codec`) applies to every tier it opens. The default, fp16,
# halves an fp32 model's bytes and keeps its answers; entries are decoded back to the model's dtype, and
# the codec is in each entry's header.
DEFAULT_CODEC = "fp16"
_SCHEMES = ("redis://", "rediss://", "unix://")


def redis_url(explicit: str | None = None) -> str | None:
    """The Redis URL to use: `explicit`, else `$RAG_PROMPTCACHE_REDIS_URL`, else None (no Redis tier).
    An empty string, as either, means no Redis tier."""
    url = (explicit if explicit is not None else os.environ.get(ENV_REDIS_URL, "")).strip() or None
    if url is not None and not url.startswith(_SCHEMES):
        where = "redis_url" if explicit is not None else f"${ENV_REDIS_URL}"
        raise ValueError(f"{where} {url!r} is not a Redis URL; valid forms: redis://host:6379/0, rediss://…, unix:///path.sock")
    return url


def redis_prefix(corpus_name: str) -> str:
    return f"rpc:{corpus_name}"


def open_store(disk: Path | None, memory_bytes: int | None, redis: str | None, corpus_name: str,
               codec: str = DEFAULT_CODEC) -> Store:
    """The tiers, fastest first: memory (unless `memory_bytes` is None), disk (unless `disk` is None),
    Redis (when `redis` names one), each holding entries in `codec`. Writes go through to every tier."""
    from rag_promptcache.store import DiskStore, MemoryStore, RedisStore, TieredStore

    tiers: list[Store] = []
    if memory_bytes is not None:
        tiers.append(MemoryStore(max_bytes=memory_bytes, codec=codec))
    if disk is not None:
        tiers.append(DiskStore(disk, codec=codec))
    if redis is not None:
        tiers.append(RedisStore(redis, prefix=redis_prefix(corpus_name), codec=codec))
    if not tiers:
        raise ValueError("a corpus store needs at least one tier: memory, disk or redis")
    return tiers[0] if len(tiers) == 1 else TieredStore(tiers)


def delete(keys: list[str], disk: Path | None, redis: str | None, corpus_name: str) -> None:
    """Delete module KV from a corpus's own tiers (those that outlive a process: disk, Redis)."""
    if not keys or (disk is None and redis is None):
        return
    store = open_store(disk, None, redis, corpus_name)
    try:
        for k in keys:
            store.delete(k)
    finally:
        store.close()
