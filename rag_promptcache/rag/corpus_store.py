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
    from rag_promptcache.rag.budget import StoreBudget
    from rag_promptcache.store.base import Store

ENV_REDIS_URL = "RAG_PROMPTCACHE_REDIS_URL"
# A corpus's codec (`Manifest.codec`, `ingest --codec`) applies to every tier it opens. The default, k6v6
# (6-bit keys per channel, 6-bit values per token), is the smallest codec that kept the default model's
# answers as int8 did (0.97 or more of fp16 modules' right answers in every cell: three splits, k = 4, 8
# and 12, two draws; docs/stores.md, "Codecs and answers"): 2.5x fewer bytes than fp16 (int8 1.9x); k8v4,
# the same size, lost answers on the manuals split and k5v5 (3x) kept 0.87 there in one draw. Entries are
# decoded back to the model's dtype, and the codec is in each entry's header.
DEFAULT_CODEC = "k6v6"
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


def open_store(disk: Path | None, memory: bool, redis: str | None, corpus_name: str, codec: str = DEFAULT_CODEC,
               budget: StoreBudget | None = None) -> Store:
    """The tiers, fastest first: memory (when `memory`), disk (unless `disk` is None), Redis (when `redis`
    names one), each holding entries in `codec` within its `budget` (the corpus's: rag/budget.py), under
    its eviction policy. Writes go through to every tier."""
    from rag_promptcache.rag.budget import StoreBudget
    from rag_promptcache.store import DiskStore, MemoryStore, RedisStore, TieredStore

    b = budget or StoreBudget()
    tiers: list[Store] = []
    if memory:
        tiers.append(MemoryStore(max_bytes=b.memory, codec=codec, policy=b.policy))
    if disk is not None:
        tiers.append(DiskStore(disk, max_bytes=b.disk, codec=codec, policy=b.policy))
    if redis is not None:
        tiers.append(RedisStore(redis, prefix=redis_prefix(corpus_name), codec=codec, max_bytes=b.redis,
                                policy=b.policy))
    if not tiers:
        raise ValueError("a corpus store needs at least one tier: memory, disk or redis")
    return tiers[0] if len(tiers) == 1 else TieredStore(tiers)


def resize(store: Store, budget: StoreBudget) -> None:
    """Hold a corpus's open tiers to a new `budget` now (each evicts what is over it)."""
    from rag_promptcache.store import DiskStore, MemoryStore, RedisStore

    for tier in getattr(store, "tiers", None) or [store]:
        for kind, limit in ((MemoryStore, budget.memory), (DiskStore, budget.disk), (RedisStore, budget.redis)):
            if isinstance(tier, kind):
                tier.resize(limit)


def delete(keys: list[str], disk: Path | None, redis: str | None, corpus_name: str) -> None:
    """Delete module KV from a corpus's own tiers (those that outlive a process: disk, Redis)."""
    if not keys or (disk is None and redis is None):
        return
    store = open_store(disk, False, redis, corpus_name)
    try:
        for k in keys:
            store.delete(k)
    finally:
        store.close()
