"""The device tier (store/device.py): its byte budget, eviction order, copies and place in a tiered
store, run on the CPU; on the `device` tier with CUDA, held in GPU memory and filled by promotion."""

from __future__ import annotations

import pytest
import torch

from rag_promptcache.store import DeviceStore, MemoryStore, TieredStore, make_store
from rag_promptcache.store.base import ModuleKV


def _kv(n: int, seed: int = 0) -> ModuleKV:
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 2, n, 4, generator=gen), torch.randn(2, 2, n, 4, generator=gen)
    return ModuleKV(k, v, 0, tuple(range(n)), "fp", "isolated")


def test_budget_evicts_least_recently_used_and_never_keeps_what_cannot_fit():
    one = _kv(8).num_bytes  # 2 tensors x 2 x 2 x 8 x 4 fp32
    store = DeviceStore(max_bytes=2 * one, device="cpu")
    store.put("a", _kv(8, 1))
    store.put("b", _kv(8, 2))
    assert store.get("a") is not None  # a is now the more recent
    store.put("c", _kv(8, 3))
    assert store.keys() == ["a", "c"] and store.stats().num_bytes == 2 * one
    store.put("huge", _kv(24))  # more than the whole budget: not copied in, nothing evicted
    assert store.keys() == ["a", "c"] and not store.contains("huge")
    assert store.evict_to(one) == ["a"] and store.keys() == ["c"]
    s = store.stats()
    assert (s.num_entries, s.num_hits, s.num_misses) == (1, 1, 0)
    assert store.get("b") is None and store.stats().num_misses == 1
    assert store.delete("c") and not store.delete("c")


def test_the_memory_and_device_tiers_keep_their_budget_with_one_piece_of_bookkeeping():
    """One `BudgetedTier` serves both (it was written twice): the same puts, gets and evictions leave the
    same keys and counts in each, the memory tier handing what it evicts to `on_evict` besides."""
    from rag_promptcache.store.budgeted import BudgetedTier

    assert issubclass(DeviceStore, BudgetedTier) and issubclass(MemoryStore, BudgetedTier)
    one = _kv(8).num_bytes
    handed: list[str] = []
    tiers = [DeviceStore(max_bytes=2 * one, device="cpu"), MemoryStore(max_bytes=2 * one, on_evict=lambda k, kv: handed.append(k))]
    for store in tiers:
        for i, key in enumerate("abc"):
            store.put(key, _kv(8, i))
            store.get("a")  # a stays the most recent
        assert store.keys() == ["a", "c"] and store.evict_to(one) == ["c"] and not store.contains("c")
    assert [t.stats() for t in tiers][0] == tiers[1].stats() and handed == ["b", "c"]


def test_put_copies_and_get_returns_the_held_tensors_on_the_tiers_device():
    kv = _kv(5)
    store = DeviceStore(max_bytes=None, device="cpu")
    store.put("k", kv)
    kv.keys.add_(1.0)  # the caller changes its tensors afterwards
    got = store.get("k")
    assert torch.equal(got.keys, _kv(5).keys) and got.token_ids == kv.token_ids and got.start == 0


def test_spec_puts_the_gpu_tier_in_front_and_refuses_cuda_without_it():
    store = make_store("gpu:cpu+memory", env={}, gpu_max_bytes="1MiB")
    assert isinstance(store, TieredStore) and isinstance(store.tiers[0], DeviceStore)
    assert store.tiers[0].max_bytes == 2**20 and store.tiers[0].device == torch.device("cpu")
    store.tiers[1].put("m", _kv(6))
    assert store.get("m") is not None and store.tiers[0].contains("m")  # promoted on the hit
    with pytest.raises(ValueError, match="valid tiers: gpu"):
        make_store("vram", env={})
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            DeviceStore(device="cuda")


def test_on_cuda_the_tier_holds_promoted_modules_in_device_memory(device):
    if not device.startswith("cuda"):
        pytest.skip("GPU memory: CUDA only; the CPU tests above run the tier's bookkeeping")
    gpu = DeviceStore(device=device)
    assert gpu.max_bytes is not None and gpu.max_bytes > 0  # a share of the device's memory
    tiered = TieredStore([gpu, MemoryStore()])
    tiered.tiers[1].put("m", _kv(6))
    got = tiered.get("m")  # from the memory tier (pinned where CUDA is present), promoted
    held = gpu.get("m")
    assert held.keys.device.type == "cuda" and torch.equal(held.keys.cpu(), got.keys.cpu())
