"""Assembly: stored module KV → one relocated KV cache, plus the new tokens to prefill against it.

Cached tokens go into the cache first (in sequence order); new tokens are prefilled after them. When
a new token comes *before* some cached token in the sequence (a parameter value inside a module, text
between modules, a recovered token), a 4D mask keeps it from attending to what follows it, so the
single prefill sees what a causal prefill of the same sequence would.

The cache has room reserved up front for the prompt and the answer (`ReservedLayer`): module KV is
written straight into it, relocated on the way, and prefill and decode write in place. A plain
`DynamicCache` would copy the whole cache on every update, about 100 MB per generated token at 2k
context on SmolLM2. Models with sliding-window layers keep transformers' own layers.

The reserved buffers come from a small pool (`_POOL`) and go back to it when their cache is garbage
collected (or `release`d by its owner, as the engine does when a generation ends): a fresh 2k-context buffer pair is ~190 MB in fp32, and first-touch page faults on it were
two thirds of assembly time. Capacities are rounded up to a multiple of `CAPACITY_STEP` so that
requests of similar length share buffers. A view of a cache layer must not outlive its cache.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from rag_promptcache.engine.prompt.compiler import Piece
from rag_promptcache.model.positions import KVGeometry, Relocator
from rag_promptcache.store.base import ModuleKV


class ReservedLayer(DynamicLayer):
    """One layer's KV in a buffer with room to spare; `update` writes in place, as gpt-fast's KVCache."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self._keys, self._values = keys, values  # [B, H, capacity, D]
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        # called once before the first write: this layer's KV still on its way in (engine/kv/stream.py)
        self.pending: Callable[[], None] | None = None
        self.set_length(length)

    def set_length(self, n: int) -> None:
        self.length = n
        self.keys, self.values = self._keys[..., :n, :], self._values[..., :n, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending()
        n, s = self.length, key_states.shape[-2]
        if n + s > self._keys.shape[-2]:  # out of room: double it
            grow = max(n + s, 2 * self._keys.shape[-2]) - self._keys.shape[-2]
            pad = (*self._keys.shape[:-2], grow, self._keys.shape[-1])
            self._keys = torch.cat([self._keys, self._keys.new_empty(pad)], dim=-2)
            self._values = torch.cat([self._values, self._values.new_empty(pad)], dim=-2)
        self._keys[..., n : n + s, :] = key_states
        self._values[..., n : n + s, :] = value_states
        self.set_length(n + s)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # validates the argument as transformers does
        self.set_length(self.keys.shape[-2])


def reserved_cache(
    config: PretrainedConfig, g: KVGeometry, capacity: int, dtype: torch.dtype, device: torch.device
) -> tuple[DynamicCache, torch.Tensor, torch.Tensor] | None:
    """An empty cache with `capacity` tokens reserved, and its key/value buffers [L, H, capacity, D];
    None when the model's cache needs transformers' own layer types (sliding windows)."""
    cache = DynamicCache(config=config)
    if len(cache.layers) != g.num_layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    keys, values = _POOL.take((g.num_layers, g.num_kv_heads, g.head_dim), capacity, dtype, device)
    cache.layers[:] = [ReservedLayer(k[None], v[None], 0) for k, v in zip(keys, values)]
    _RELEASE[cache] = weakref.finalize(cache, _POOL.give, keys, values)
    return cache, keys, values


_RELEASE: weakref.WeakKeyDictionary[DynamicCache, weakref.finalize] = weakref.WeakKeyDictionary()


def release(cache: DynamicCache) -> None:
    """Give a reserved cache's buffers back to the pool now (its owner is done with it) rather than
    when the garbage collector finds it: a finalizer may run at any moment, even inside a Ctrl-C
    handler, and swallow the interrupt. Idempotent; a cache not from `reserved_cache` is left alone."""
    fin = _RELEASE.pop(cache, None)
    if fin is not None:
        fin()


CAPACITY_STEP = 256


class _BufferPool:
    """Free KV buffer pairs [L, H, capacity, D], at most `per_shape` kept per (L, H, D, dtype, device).

    Bookkeeping only: a buffer is handed out to one cache at a time and comes back when that cache
    is collected (`weakref.finalize`); a request finding none free allocates a new pair.
    """

    def __init__(self, per_shape: int = 2) -> None:
        self.per_shape = per_shape
        self._free: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, int, int], capacity: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # an inference tensor cannot be written outside inference mode (nor saved for autograd inside
        # it): a buffer is only handed back to a caller in the mode it was made in
        key = (*shape, dtype, str(device), torch.is_inference_mode_enabled())
        with self._lock:
            free = self._free.get(key, [])
            fits = [i for i, (k, _) in enumerate(free) if k.shape[2] >= capacity]
            if fits:
                return free.pop(min(fits, key=lambda i: free[i][0].shape[2]))
        capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        num_layers, num_heads, head_dim = shape
        keys = torch.empty(num_layers, num_heads, capacity, head_dim, dtype=dtype, device=device)
        return keys, torch.empty_like(keys)

    def give(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        key = (keys.shape[0], keys.shape[1], keys.shape[3], keys.dtype, str(keys.device), keys.is_inference())
        with self._lock:
            free = self._free.setdefault(key, [])
            free.append((keys, values))
            if len(free) > self.per_shape:  # keep the largest: they fit every request the others fit
                free.sort(key=lambda kv: kv[0].shape[2], reverse=True)
                del free[self.per_shape:]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


_POOL = _BufferPool()


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
    geometry: KVGeometry,
    device: torch.device,
    dtype: torch.dtype,
    extra: int = 0,
) -> Assembled:
    """`extra`: tokens to reserve beyond the prompt (the answer). No new piece only for an exact repeat
    from the prefix cache, whose last token's logits are kept (engine/prefix/prefix_cache.py)."""
    cached = [p for p in pieces if p.cached]
    new = [p for p in pieces if not p.cached]
    new_ids = torch.tensor([[t for p in new for t in p.token_ids]], device=device)
    new_pos = torch.tensor([[p.position + i for p in new for i in range(len(p.token_ids))]], device=device)
    num_cached = sum(len(p.token_ids) for p in cached)
    reserved = reserved_cache(config, geometry, num_cached + new_ids.shape[1] + extra, dtype, device)
    if reserved is None:
        cache = _concatenated(cached, kvs, relocator, config, device, dtype)
    else:
        cache, keys, values = reserved
        at = 0
        for p in cached:  # keys, values: [L, H, capacity, D]; each piece written once, relocated on the way
            kv, n = kvs[p.unit], len(p.token_ids)
            k = kv.keys[:, :, p.offset : p.offset + n].to(device=device)
            relocator.rotate_into(k, p.position - (kv.start + p.offset), keys[:, :, at : at + n])
            values[:, :, at : at + n] = kv.values[:, :, p.offset : p.offset + n]
            at += n
        for layer in cache.layers:
            layer.set_length(num_cached)
    return Assembled(cache, new_ids, new_pos, assembly_mask(pieces, dtype, device), num_cached)


def _concatenated(
    cached: list[Piece],
    kvs: Mapping[str, ModuleKV],
    relocator: Relocator,
    config: PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> DynamicCache:
    if not cached:
        return DynamicCache(config=config)
    # keys, values: [L, H, C, D], the cached pieces in sequence order
    slices = [(kvs[p.unit], p.offset, p.offset + len(p.token_ids)) for p in cached]
    keys = torch.cat([kv.keys[:, :, a:b] for kv, a, b in slices], dim=2).to(device=device, dtype=dtype)
    values = torch.cat([kv.values[:, :, a:b] for kv, a, b in slices], dim=2).to(device=device, dtype=dtype)
    shifts = [p.position - (kvs[p.unit].start + p.offset) for p in cached]
    if any(shifts):
        deltas = torch.cat([torch.full((len(p.token_ids),), s, dtype=torch.long) for p, s in zip(cached, shifts)])
        keys = relocator.rotate(keys, deltas.to(device))
    return DynamicCache(ddp_cache_data=[(k[None], v[None]) for k, v in zip(keys, values)], config=config)


def assembly_mask(pieces: Sequence[Piece], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """None when every new token follows every cached one; else the additive mask for the new tokens."""
    last_cached = max((i for i, p in enumerate(pieces) if p.cached), default=-1)
    first_new = min((i for i, p in enumerate(pieces) if not p.cached), default=len(pieces))
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
