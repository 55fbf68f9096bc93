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
    index = BudgetIndex(max_bytes=100, policy="cost")
    index.add("cheap", 40, 10)  # 0.25 tokens/byte
    index.add("dense", 20, 10)  # 0.5 (int8-like)
    index.add("hot", 40, 10)  # 0.25, but hit twice -> 0.75
    index.touch("hot")
    index.touch("hot")
    assert keys(index.add("new", 40, 10)) == ["cheap"]
    # Ties (new vs nothing cheaper) fall back to LRU then key: "new" (0.25) goes before "dense".
    assert keys(index.evict_to(50)) == ["new", "dense"]
    assert list(index.entries) == ["hot"]


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
    assert CostAwarePolicy().priority(e) == 1.0
    with pytest.raises(ValueError, match="valid policies: lru, cost"):
        make_policy("fifo")
    with pytest.raises(ValueError):
        BudgetIndex(max_bytes=-1)
