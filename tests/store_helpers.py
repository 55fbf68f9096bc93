"""Helpers shared by the store tests: a real redis-server on a free loopback port (the bench's own,
`rag_promptcache.bench.redis_server`), and random ModuleKVs."""

from __future__ import annotations

import pytest
import torch

from rag_promptcache.bench.redis_server import LocalRedis, free_port, installed
from rag_promptcache.store import ModuleKV, module_key

__all__ = ["LocalRedis", "free_port", "installed", "key_of", "make_kv", "needs_redis"]


needs_redis = pytest.mark.skipif(not installed(), reason="redis-server binary not found (apt-get install redis-server)")


def make_kv(seed: int, num_tokens: int = 16, fingerprint: str = "model-a", shape=(2, 2, 8)) -> ModuleKV:
    g = torch.Generator().manual_seed(seed)
    L, H, D = shape
    keys = torch.randn(L, H, num_tokens, D, generator=g)
    values = torch.randn(L, H, num_tokens, D, generator=g)
    token_ids = tuple(range(seed, seed + num_tokens))
    return ModuleKV(keys, values, start=seed % 7, token_ids=token_ids, fingerprint=fingerprint, mode="alone")


def key_of(kv: ModuleKV) -> str:
    return module_key(kv.fingerprint, kv.mode, kv.token_ids, kv.start)
