"""What every store tier shares: the `ModuleKV` record, the `Store` protocol, stats and keys.

A tier stores and returns `ModuleKV`s by key and knows nothing of models, prompts or positions.
Keys are content addresses (`module_key`): an entry made by another model, encoding mode or codec
version can never be looked up for this one.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

# Bumped whenever the meaning of stored KV changes; it is part of every key and every file header.
FORMAT_VERSION = 2  # 2: CRC-32 entry checksums


@dataclass(frozen=True, slots=True)
class ModuleKV:
    """The KV cache of one prompt module, for every layer.

    keys, values: [layers, kv_heads, tokens, head_dim]. Keys are stored as the model left them
    (post-RoPE) for tokens at positions `start .. start + tokens - 1`.
    """

    keys: torch.Tensor
    values: torch.Tensor
    start: int
    token_ids: tuple[int, ...]
    fingerprint: str
    mode: str

    def __post_init__(self) -> None:
        assert self.keys.dim() == 4 and self.values.dim() == 4, f"{self.keys.shape=} {self.values.shape=}"
        assert self.keys.shape[:3] == self.values.shape[:3], f"{self.keys.shape=} {self.values.shape=}"
        assert self.keys.shape[2] == len(self.token_ids), f"{self.keys.shape=} {len(self.token_ids)=}"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_bytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@dataclass(frozen=True, slots=True)
class StoreStats:
    num_entries: int
    num_bytes: int
    num_hits: int
    num_misses: int
    num_tokens: int = 0
    num_errors: int = 0  # entries found bad, or writes that failed (each one a lost cache entry)
    num_write_errors: int = 0  # of those, writes the tier refused (full, read-only, no permission)

    @property
    def hit_rate(self) -> float:
        total = self.num_hits + self.num_misses
        return self.num_hits / total if total else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.num_bytes / self.num_tokens if self.num_tokens else 0.0


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What a tier's `verify()` found: entries checked, and the bad ones (already removed)."""

    num_checked: int
    bad_keys: tuple[str, ...]
    # found corrupt earlier, when read (and removed then): {"key", "why", "at"}, as `DiskStore.corrupt_entries`
    found_earlier: tuple[dict[str, object], ...] = ()


@runtime_checkable
class Store(Protocol):
    """A tier. `get` returns None on a miss (or on an entry it cannot trust, or a read that failed);
    it never raises for one. `put` never raises for a write the backend refuses (full, read-only,
    no permission, unreachable): the entry is not cached, the failure is counted in
    `stats().num_write_errors` and logged once, and the request goes on.

    Tensors returned by `get` may be shared with the tier: treat them as read-only. `put` copies.
    """

    def get(self, key: str) -> ModuleKV | None: ...

    def put(self, key: str, kv: ModuleKV) -> None: ...

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool: ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...


def module_key(
    fingerprint: str,
    mode: str,
    token_ids: tuple[int, ...] | list[int],
    start: int,
    context_ids: tuple[int, ...] | list[int] = (),
    neighbour_ids: tuple[int, ...] | list[int] = (),
    byproduct: bool = False,
) -> str:
    """The content address of a module's KV: model, encoding mode, tokens, position, context, the
    neighbours' tokens it was encoded after (engine/prompt/compiler.py `Unit.neighbour_ids`) and whether
    it is kept from the prefills of the questions that retrieve it (`Unit.byproduct`). Without
    either the address is what it always was: stores made before them keep their entries."""
    h = hashlib.blake2b(digest_size=20)
    h.update(f"v{FORMAT_VERSION}|{fingerprint}|{mode}|{start}|".encode())
    h.update(struct.pack(f"<{len(context_ids)}q", *context_ids))
    h.update(b"|")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if neighbour_ids:  # a marker, then the count: no other tokens can hash the same as these
        h.update(f"|nbr{len(neighbour_ids)}|".encode())
        h.update(struct.pack(f"<{len(neighbour_ids)}q", *neighbour_ids))
    if byproduct:
        h.update(b"|byproduct")
    return h.hexdigest()


FULL_SHARE = 0.95  # a store holding this share of its budget is full: its next writes evict


def is_full(store: Store) -> bool:
    """Whether `store` is full: its last tier (a `TieredStore`'s largest, where an entry lives longest) holds
    `FULL_SHARE` of its budget. An unbounded tier never is."""
    last = (getattr(store, "tiers", None) or [store])[-1]
    cap = getattr(last, "max_bytes", None)
    return cap is not None and last.stats().num_bytes >= FULL_SHARE * cap
