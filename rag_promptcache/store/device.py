"""The device tier: hot modules' KV held in accelerator memory, within its own byte budget.

On a GPU, a module assembled from host memory crosses the host link on every request that imports it
(an 8B model's KV is 128 KiB per token: a 16k-token context is 2 GiB). Held here, assembly is a copy
inside device memory instead. Put first in a `TieredStore` (`make_store("gpu+memory")`), it fills by
promotion: a hit in a lower tier is put here, and the budget evicts the coldest entries back out
(write-through keeps them below). Entries are held as the model wrote them (the `native` codec only):
a quantized entry would be decoded on every get.

The budget is `max_bytes`, or where None a fraction (`DEFAULT_FRACTION`) of the device's total memory,
read when the tier is made: the model's weights and the requests' caches need the rest. The dict, the
budget and the lookups are `BudgetedTier`'s, as the memory tier's. Any device works, so the tests run it on the CPU; it is meant for
CUDA.

Out of scope: codecs, persistence, sharing between processes (each process holds its own).
"""

from __future__ import annotations

import torch

from .base import ModuleKV
from .budgeted import BudgetedTier
from .eviction import Policy

DEFAULT_FRACTION = 0.1  # of the device's memory, where no budget is given


def default_budget(device: torch.device) -> int | None:
    """`DEFAULT_FRACTION` of a CUDA device's total memory; None (unbounded) elsewhere."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory * DEFAULT_FRACTION)


class DeviceStore(BudgetedTier[ModuleKV]):
    name = "device"

    def __init__(self, max_bytes: int | None = None, device: str | torch.device = "cuda",
                 policy: str | Policy = "lru") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"a device tier on {self.device} needs CUDA, which torch does not see here; "
                             "valid: a CUDA device where one is present, or 'cpu'")
        super().__init__(default_budget(self.device) if max_bytes is None else max_bytes, policy)

    def get(self, key: str) -> ModuleKV | None:
        return self._lookup(key)

    def put(self, key: str, kv: ModuleKV) -> None:
        if not self._index.fits(kv.num_bytes):  # never copied in: it could not be kept
            return
        # a copy on the device, never a view of the caller's tensors; from pinned memory without a host stall
        keys = kv.keys.detach().to(self.device, copy=True, non_blocking=kv.keys.is_pinned())
        values = kv.values.detach().to(self.device, copy=True, non_blocking=kv.values.is_pinned())
        held = ModuleKV(keys, values, kv.start, tuple(kv.token_ids), kv.fingerprint, kv.mode)
        self._hold(key, held, held.num_bytes, held.num_tokens)
