"""Assembly: stored module KV → one relocated KV cache, plus the new tokens to prefill against it.

Cached tokens go into the cache first (in sequence order); new tokens are prefilled after them. When
a new token comes *before* some cached token in the sequence (a parameter value inside a module, text
between modules, a recovered token), a 4D mask keeps it from attending to what follows it, so the
single prefill sees what a causal prefill of the same sequence would.

The cache has room reserved up front for the prompt and the answer (`ReservedLayer`): module KV is
written straight into it, relocated on the way, and prefill and decode write in place. A plain
`DynamicCache` would copy the whole cache on every update, about 100 MB per generated token at 2k
context on SmolLM2.

Sliding-window layers (Gemma 2/3, Mistral, Qwen2 with a window) are reserved like the others and
keep every token: what a token may see is the mask's business, not the cache's. transformers builds
each layer type's mask itself while the cache is in sequence order; assembly's own mask, where new
tokens come before cached ones, is one per layer type (`Mask`), the sliding layers' also hiding what
lies a window or more behind. After such a prefill, `Assembled.to_sequence_order` puts the sliding
layers' cache in sequence order, so that transformers' window is right for every later token.
A cache of other layer types (chunked or linear attention, shared KV) keeps transformers' own
layers, and a prompt that needs assembly's mask over it is refused by name.

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
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

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


SLIDING = "sliding_attention"
_HELD = {"full_attention": DynamicLayer, SLIDING: DynamicSlidingWindowLayer}  # layer type -> transformers' layer


def holds_every_layer(cache: DynamicCache, g: KVGeometry) -> bool:
    """Whether each of `cache`'s layers (transformers' own, for this model) is one a reserved layer can
    stand for: full attention, or a sliding window of the model's one `sliding_window`."""
    return len(cache.layers) == g.num_layers and all(
        type(layer) is _HELD.get(kind) and getattr(layer, "sliding_window", g.sliding_window) == g.sliding_window
        for layer, kind in zip(cache.layers, g.layer_types))


def full_cache(config: PretrainedConfig, g: KVGeometry,
               data: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
    """transformers' cache for the model, its sliding-window layers keeping every token as full ones do
    (transformers still builds their window into the mask), optionally filled with `data` per layer
    ([B, H, S, D] keys and values). Every layer then covers the same tokens: module encoding reads a
    module longer than the window from each layer, recovery's probes index them by sequence."""
    cache = DynamicCache(config=config)
    if holds_every_layer(cache, g):
        cache.layers[:] = [DynamicLayer() for _ in cache.layers]
    for layer, (k, v) in zip(cache.layers, data or ()):
        layer.update(k, v)
    return cache


def reserved_cache(
    config: PretrainedConfig, g: KVGeometry, capacity: int, dtype: torch.dtype, device: torch.device
) -> tuple[DynamicCache, torch.Tensor, torch.Tensor] | None:
    """An empty cache with `capacity` tokens reserved, and its key/value buffers [L, H, capacity, D];
    None when the model's cache needs transformers' own layer types (chunked or linear attention)."""
    cache = DynamicCache(config=config)
    if not holds_every_layer(cache, g):
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


# [1, 1, N, C + N] additive; per layer type ("full_attention", "sliding_attention") where the model
# mixes sliding-window and full layers, as transformers' models with both take it
Mask = torch.Tensor | dict[str, torch.Tensor]


def mask_rows(mask: Mask | None, start: int, end: int, columns: int) -> Mask | None:
    """Rows start..end-1 (new tokens) and the first `columns` columns of each of a mask's tensors."""
    if mask is None:
        return None
    if isinstance(mask, dict):
        return {kind: m[:, :, start:end, :columns] for kind, m in mask.items()}
    return mask[:, :, start:end, :columns]


@dataclass(slots=True)
class Assembled:
    cache: DynamicCache
    new_ids: torch.Tensor  # [1, N]
    new_positions: torch.Tensor  # [1, N]
    mask: Mask | None  # None when plain causal (and transformers' own window) is exact
    num_cached: int
    # [C + N]: the sequence index of each token the cache holds once the new ones are in, where the
    # model has sliding-window layers and the mask puts new tokens before cached ones; else None
    order: torch.Tensor | None = None
    sliding: tuple[int, ...] = ()  # the sliding-window layers

    @torch.inference_mode()  # the reserved buffers may be inference tensors
    def to_sequence_order(self) -> None:
        """Once every new token has run: put the sliding layers' KV in sequence order, so that a later
        token's window (transformers': the last `sliding_window` tokens of the cache) is the right one.
        Full layers see every token and are left as they are. Idempotent."""
        if self.order is None:
            return
        num = self.order.shape[0]
        perm = torch.argsort(self.order)
        for i in self.sliding:
            layer = self.cache.layers[i]
            assert layer.keys.shape[-2] == num, f"{layer.keys.shape=} {num=}: run every new token first"
            layer.keys[...] = layer.keys[..., perm, :]  # the view writes through to the reserved buffer
            layer.values[...] = layer.values[..., perm, :]
        self.order = None


@dataclass(frozen=True, slots=True)
class Reservation:
    """Where an assembly starts, plain or streamed (engine/kv/stream.py): the cached pieces, the new tokens'
    ids and positions [1, N], and a cache reserved for all of them and `extra` more (None where the
    model's cache needs transformers' own layers: chunked or linear attention)."""

    cached: list[Piece]
    new_ids: torch.Tensor
    new_positions: torch.Tensor
    num_cached: int
    reserved: tuple[DynamicCache, torch.Tensor, torch.Tensor] | None

    @classmethod
    def of(cls, pieces: Sequence[Piece], config: PretrainedConfig, g: KVGeometry, device: torch.device,
           dtype: torch.dtype, extra: int = 0) -> Reservation:
        cached = [p for p in pieces if p.cached]
        new = [p for p in pieces if not p.cached]
        new_ids = torch.tensor([[t for p in new for t in p.token_ids]], device=device)
        new_pos = torch.tensor([[p.position + i for p in new for i in range(len(p.token_ids))]], device=device)
        num_cached = sum(len(p.token_ids) for p in cached)
        reserved = reserved_cache(config, g, num_cached + new_ids.shape[1] + extra, dtype, device)
        return cls(cached, new_ids, new_pos, num_cached, reserved)

    def assembled(self, cache: DynamicCache, pieces: Sequence[Piece], g: KVGeometry, *, mask: Mask | None) -> Assembled:
        """The `Assembled` of `cache` holding this layout's cached tokens (or about to: engine/kv/stream.py),
        with `mask` (`assembly_mask`), and where sliding-window layers need it the order that
        `to_sequence_order` puts them back in once the new tokens have run."""
        sliding = tuple(i for i, kind in enumerate(g.layer_types) if kind == SLIDING)
        order = _sequence_order(pieces, self.new_ids.device) if mask is not None and sliding else None
        return Assembled(cache, self.new_ids, self.new_positions, mask, self.num_cached, order, sliding)


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
    lay = Reservation.of(pieces, config, geometry, device, dtype, extra)
    mask = assembly_mask(pieces, geometry, dtype, device)
    if lay.reserved is None:
        if mask is not None:
            kinds = ", ".join(sorted(set(geometry.layer_types)))
            raise ValueError(f"this model's cache has layer types {kinds}: only full_attention and sliding_attention "
                             "layers (one window) can hold tokens recomputed before cached ones; use recovery none or "
                             "last:N, or full prefill (use_cache=False)")
        cache = _concatenated(lay.cached, kvs, relocator, config, device, dtype)
    else:
        cache, keys, values = lay.reserved
        at = 0
        for p in lay.cached:  # keys, values: [L, H, capacity, D]; each piece written once, relocated on the way
            kv, n = kvs[p.unit], len(p.token_ids)
            k = kv.keys[:, :, p.offset : p.offset + n].to(device=device)
            relocator.rotate_into(k, p.position - (kv.start + p.offset), keys[:, :, at : at + n])
            values[:, :, at : at + n] = kv.values[:, :, p.offset : p.offset + n]
            at += n
        for layer in cache.layers:
            layer.set_length(lay.num_cached)
    return lay.assembled(cache, pieces, geometry, mask=mask)


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


def _sequence_order(pieces: Sequence[Piece], device: torch.device) -> torch.Tensor:
    """[C + N]: the sequence index of each token in cache order (the cached pieces', then the new ones')."""
    cached_seq: list[int] = []
    new_seq: list[int] = []
    seq = 0
    for p in pieces:
        (cached_seq if p.cached else new_seq).extend(range(seq, seq + len(p.token_ids)))
        seq += len(p.token_ids)
    return torch.tensor(cached_seq + new_seq, device=device)


def assembly_mask(pieces: Sequence[Piece], g: KVGeometry, dtype: torch.dtype, device: torch.device) -> Mask | None:
    """None when every new token follows every cached one; else the additive mask for the new tokens:
    one tensor where every layer sees the same, else one per layer type."""
    last_cached = max((i for i, p in enumerate(pieces) if p.cached), default=-1)
    first_new = min((i for i, p in enumerate(pieces) if not p.cached), default=len(pieces))
    if first_new > last_cached:
        return None
    kv = _sequence_order(pieces, device)  # [C + N]
    q = kv[sum(len(p.token_ids) for p in pieces if p.cached):]  # [N]
    # a new token sees the cached tokens before it in the sequence and the new ones up to itself; the cache
    # holds the new tokens in sequence order, so for them both rules are the same
    allowed = kv[None, :] <= q[:, None]  # [N, C + N]
    kinds = set(g.layer_types)
    if SLIDING not in kinds or not g.sliding_window:
        return _additive(allowed, dtype)
    # as transformers' sliding_window_overlay: the last `sliding_window` tokens, itself included
    near = allowed & (kv[None, :] > q[:, None] - g.sliding_window)
    if kinds == {SLIDING}:
        return _additive(near, dtype)
    return {kind: _additive(near if kind == SLIDING else allowed, dtype) for kind in kinds}


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
