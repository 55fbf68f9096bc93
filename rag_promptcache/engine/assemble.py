"""Assembly: stored module KV → one relocated KV cache, plus the new tokens to prefill against it.

Cached tokens go into the cache first (in sequence order); new tokens are prefilled after them. When
a new token comes *before* some cached token in the sequence (a parameter value inside a module, text
between modules), a 4D mask keeps it from attending to what follows it, so the result is what a
causal prefill of the same sequence would see.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PretrainedConfig

from rag_promptcache.engine.compiler import Piece
from rag_promptcache.model.positions import Relocator
from rag_promptcache.store.base import ModuleKV


@dataclass(slots=True)
class Assembled:
    cache: DynamicCache
    new_ids: torch.Tensor  # [1, N]
    new_positions: torch.Tensor  # [1, N]
    mask: torch.Tensor | None  # [1, 1, N, C + N] additive, or None when plain causal is exact
    num_cached: int


def assemble(
    pieces: Sequence[Piece],
    kvs: Mapping[str, ModuleKV],
    relocator: Relocator,
    config: PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> Assembled:
    cached = [p for p in pieces if p.cached]
    new = [p for p in pieces if not p.cached]
    assert new, "the last token must be computed: the compiler guarantees a new piece"
    new_ids = torch.tensor([[t for p in new for t in p.token_ids]], device=device)
    new_pos = torch.tensor([[p.position + i for p in new for i in range(len(p.token_ids))]], device=device)
    if not cached:
        return Assembled(DynamicCache(config=config), new_ids, new_pos, None, 0)

    # keys, values: [L, H, C, D], the cached pieces in sequence order
    slices = [(kvs[p.unit], p.offset, p.offset + len(p.token_ids)) for p in cached]
    keys = torch.cat([kv.keys[:, :, a:b] for kv, a, b in slices], dim=2).to(device=device, dtype=dtype)
    values = torch.cat([kv.values[:, :, a:b] for kv, a, b in slices], dim=2).to(device=device, dtype=dtype)
    shifts = [p.position - (kvs[p.unit].start + p.offset) for p in cached]
    if any(shifts):
        deltas = torch.cat([torch.full((len(p.token_ids),), s, dtype=torch.long) for p, s in zip(cached, shifts)])
        keys = relocator.rotate(keys, deltas.to(device))
    cache = DynamicCache(ddp_cache_data=[(k[None], v[None]) for k, v in zip(keys, values)], config=config)
    return Assembled(cache, new_ids, new_pos, _mask(pieces, dtype, device), keys.shape[2])


def _mask(pieces: Sequence[Piece], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """None when every new token follows every cached one; else the additive mask for the new tokens."""
    last_cached = max((i for i, p in enumerate(pieces) if p.cached), default=-1)
    first_new = min(i for i, p in enumerate(pieces) if not p.cached)
    if first_new > last_cached:
        return None
    cached_seq: list[int] = []  # sequence index of each cached token, in cache order
    new_seq: list[int] = []
    seq = 0
    for p in pieces:
        (cached_seq if p.cached else new_seq).extend(range(seq, seq + len(p.token_ids)))
        seq += len(p.token_ids)
    c = torch.tensor(cached_seq, device=device)
    n = torch.tensor(new_seq, device=device)
    allowed = torch.cat([c[None, :] < n[:, None], n[None, :] <= n[:, None]], dim=1)  # [N, C + N]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
