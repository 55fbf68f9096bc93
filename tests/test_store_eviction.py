"""Eviction bookkeeping without tensors: exact expected eviction orders."""

import pytest

from rag_promptcache.store.eviction import BudgetIndex, CostAwarePolicy, Entry, LRUPolicy, make_policy


def keys(entries: list[Entry]) -> list[str]:
    return [e.key for e in entries]


def test_eviction_module_does_not_import_torch():
    import ast

    import rag_promptcache.store.eviction as ev

    tree = ast.parse(open(ev.__file__).read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.startswith(("torch", "numpy", ".")) for m in imported), imported


def test_lru_evicts_least_recently_used_first():
    index = BudgetIndex(max_bytes=30, policy="lru")
    assert index.add("a", 10, 5) == []
    assert index.add("b", 10, 5) == []
    assert index.add("c", 10, 5) == []
    assert index.touch("a")
    assert keys(index.add("d", 10, 5)) == ["b"]
    assert keys(index.add("e", 20, 5)) == ["c", "a"]
    assert list(index.entries) == ["d", "e"]
    assert index.num_bytes == 30 and index.num_tokens == 10


def test_replacing_an_entry_does_not_evict_itself():
    index = BudgetIndex(max_bytes=20)
    index.add("a", 10, 1)
    index.add("b", 10, 1)
    assert keys(index.add("a", 10, 1)) == []
    assert keys(index.add("c", 10, 1)) == ["b"]


def test_entry_larger_than_budget_is_its_own_victim():
    index = BudgetIndex(max_bytes=15)
    index.add("a", 10, 1)
    assert keys(index.add("big", 16, 1)) == ["big"]
    assert list(index.entries) == ["a"]


def test_cost_aware_keeps_expensive_per_byte_and_hot_entries():
    # GDSF: priority = L + (1 + hits) * tokens * 1024 / bytes, L the aging value at the entry's last use
    index = BudgetIndex(max_bytes=100, policy="cost")
    index.add("cheap", 40, 10)  # 256
    index.add("dense", 20, 10)  # 512 (int8-like)
    index.add("hot", 40, 10)  # 256, but hit twice -> 768
    index.touch("hot")
    index.touch("hot")
    assert keys(index.add("new", 40, 10)) == ["cheap"]
    assert index.inflation == 256  # L rose to the evicted priority; "new" was added at L = 256: 512
    # "dense" (0 + 512) and "new" (256 + 256) tie: the least recently used goes first
    assert keys(index.evict_to(50)) == ["dense", "new"]
    assert list(index.entries) == ["hot"] and index.inflation == 512


def test_cost_aware_ages_out_entries_that_stop_being_used():
    # LFU alone would keep "old" forever for its early hits; GDSF's L overtakes them once it stops being used
    index = BudgetIndex(max_bytes=30, policy="cost")
    index.add("old", 10, 10)
    for _ in range(3):
        index.touch("old")  # 4 * 1024 = 4096
    evicted = []
    for i in range(12):  # a stream of new entries, each used once more right away
        evicted += keys(index.add(f"n{i}", 10, 10))
        index.touch(f"n{i}")
    assert "old" in evicted and "old" not in index.entries
    lru = BudgetIndex(max_bytes=30, policy="lru")
    lru.add("old", 10, 10)
    assert keys(lru.add("a", 10, 10) + lru.add("b", 10, 10) + lru.add("c", 10, 10)) == ["old"]


def test_evict_to_and_victims_order():
    index = BudgetIndex()
    for i, k in enumerate("abcde"):
        index.add(k, 10 + i, 1)
    index.touch("a")
    assert keys(index.victims(30)) == ["b", "c", "d"]  # 60 - (11+12+13) = 24 <= 30
    assert len(index) == 5  # victims() does not remove
    assert keys(index.evict_to(0)) == ["b", "c", "d", "e", "a"]
    assert index.num_bytes == 0


def test_uses_are_numbered_after_every_loaded_one():
    # recency is a sequence, not a clock: a loaded entry's number moves the sequence past it, so a
    # later use never ties with it, and an index started from a saved `seq` continues it
    index = BudgetIndex(max_bytes=20, seq=3)
    index.load(Entry("old", 10, 1, last_used=5))
    index.add("x", 10, 1)
    assert index.entries["x"].last_used == 6 and index.seq == 6
    assert keys(index.add("y", 10, 1)) == ["old"]
    assert index.touch("x") and index.entries["x"].last_used == 8
    assert keys(index.add("z", 10, 1)) == ["y"]


def test_policies_are_one_method_objects_and_names_are_validated():
    e = Entry("k", 100, 50, last_used=3, num_hits=1)
    assert LRUPolicy().priority(e) == 3
    assert CostAwarePolicy().priority(e) == 1024.0
    assert CostAwarePolicy().priority(Entry("k", 100, 50, last_used=3, num_hits=1, inflation=7.0)) == 1031.0
    with pytest.raises(ValueError, match="valid policies: lru, cost"):
        make_policy("fifo")
    with pytest.raises(ValueError):
        BudgetIndex(max_bytes=-1)
