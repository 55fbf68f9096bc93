"""The memory tier: encoded entries in a dict, within a byte budget, on CPU or on the model's device.

Entries are held *encoded*, so `codec="int8"` really holds about a quarter of fp32's bytes, and the
budget counts what is held. A get decodes; for "native" that is free (the stored tensors come back
as they are; callers must treat them as read-only). Put always copies, so the store never aliases a
caller's tensors. CPU entries go to pinned memory when CUDA is present, so copies to the GPU are
asynchronous-capable and fast.

`on_evict(key, kv)` is called, outside the lock, for every entry the budget pushes out (and for an
entry too big to keep at all): TieredStore's write-back uses it to flush dirty entries downward.

The dict, the budget and the protocol's lookups are `BudgetedTier`'s, shared with the device tier.

Out of scope: persistence (disk.py) and sharing between processes (redis.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .base import ModuleKV
from .budgeted import BudgetedTier
from .codecs import EncodedKV, check_codec, decode, encode
from .eviction import Policy


class MemoryStore(BudgetedTier[EncodedKV]):
    def __init__(
        self,
        max_bytes: int | None = None,
        codec: str = "native",
        device: str | torch.device = "cpu",
        policy: str | Policy = "lru",
        on_evict: Callable[[str, ModuleKV], None] | None = None,
    ) -> None:
        super().__init__(max_bytes, policy)
        self.codec = check_codec(codec)
        self.device = torch.device(device)
        self._pin = self.device.type == "cpu" and torch.cuda.is_available()
        self.on_evict = on_evict

    def get(self, key: str) -> ModuleKV | None:
        enc = self._lookup(key)
        return None if enc is None else decode(enc)

    def put(self, key: str, kv: ModuleKV) -> None:
        enc = encode(kv, self.codec, device=self.device, pin=self._pin)
        self._hold(key, enc, enc.num_bytes, enc.num_tokens)

    def put_encoded(self, key: str, enc: EncodedKV) -> bool:
        """Hold a copy of an entry another tier encoded in this tier's codec (a promotion from disk): no
        encoding again, and a later get returns what that tier's get did, not a re-quantized copy of it.
        False, holding nothing, for another codec (`put` then)."""
        if enc.codec != self.codec:
            return False
        tensors = {n: t.to(self.device, copy=True) for n, t in enc.tensors.items()}
        if self._pin:
            tensors = {n: t.pin_memory() for n, t in tensors.items()}
        held = dataclasses.replace(enc, tensors=tensors)
        self._hold(key, held, held.num_bytes, held.num_tokens)
        return True

    def _evicted(self, evicted: list[tuple[str, EncodedKV]]) -> None:
        if self.on_evict is not None:
            for key, enc in evicted:
                self.on_evict(key, decode(enc))
