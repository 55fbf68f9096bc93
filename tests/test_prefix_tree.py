"""The prefix tree's bookkeeping, without tensors: payloads are strings, one character per token, so a
match's spans show exactly which stored data it returns, and eviction orders are exact."""

from __future__ import annotations

import random
import threading

import pytest

from rag_promptcache.engine.prefix.prefix_tree import Node, PrefixTree

NS = "model-a"


def data(keys: str) -> str:
    return keys.upper()  # the payload of a run: one character per token, told apart from the keys


def add(tree: PrefixTree, keys: str, start: int = 0, ns: str = NS) -> int:
    return tree.insert(ns, keys, data(keys[start:]), len(keys) - start, start=start)


def joined(match) -> str:
    return "".join(p[:n] for p, n in match.spans)


def test_empty_tree_matches_nothing():
    tree = PrefixTree(100)
    m = tree.match(NS, "abc")
    assert (m.num_tokens, m.spans, m.handle) == (0, (), None)
    assert tree.stats().num_queries == 1 and tree.stats().num_hits == 0


def test_match_returns_the_longest_prefix_with_its_data():
    tree = PrefixTree(100)
    assert add(tree, "abcdef") == 6
    m = tree.match(NS, "abcxyz")
    assert m.num_tokens == 3 and joined(m) == "ABC"
    assert tree.match(NS, "abcdefgh").num_tokens == 6
    assert tree.match(NS, "ab").num_tokens == 2
    assert tree.match(NS, "xabc").num_tokens == 0
    s = tree.stats()
    assert (s.num_queries, s.num_hits, s.num_tokens_reused) == (4, 3, 3 + 6 + 2)


def test_insert_that_diverges_inside_a_run_splits_it():
    tree = PrefixTree(100)
    add(tree, "abcdef")
    assert add(tree, "abcxy") == 2  # only the new tail is stored
    s = tree.stats()
    assert (s.num_nodes, s.num_tokens, s.num_bytes) == (3, 8, 8)
    m = tree.match(NS, "abcdef")
    assert [(p, n) for p, n in m.spans] == [("ABC", 3), ("DEF", 3)]
    m = tree.match(NS, "abcxyz")
    assert [(p, n) for p, n in m.spans] == [("ABC", 3), ("XY", 2)]


def test_insert_with_start_takes_the_payload_of_the_rest_only():
    tree = PrefixTree(100)
    add(tree, "abc")
    m = tree.match(NS, "abcdef", lock=True)
    assert m.num_tokens == 3
    # the request computed "def" after reusing "abc"; meanwhile another one stored "abcd"
    add(tree, "abcd")
    assert tree.insert(NS, "abcdef", "DEF", 3, start=3) == 2
    assert joined(tree.match(NS, "abcdef")) == "ABCDEF"
    assert tree.stats().num_bytes == 6
    tree.release(m.handle)


def test_insert_after_a_path_that_is_gone_stores_nothing():
    tree = PrefixTree(100)
    assert tree.insert(NS, "abcdef", "DEF", 3, start=3) == 0
    add(tree, "ab")
    assert tree.insert(NS, "abcdef", "DEF", 3, start=3) == 0
    assert tree.stats().num_tokens == 2


def test_namespaces_never_share():
    tree = PrefixTree(100)
    add(tree, "abc", ns="model-a")
    assert tree.match("model-b", "abc").num_tokens == 0
    add(tree, "abd", ns="model-b")
    assert joined(tree.match("model-a", "abd")) == "AB"
    assert tree.stats().num_nodes == 2


def test_lru_evicts_least_recently_used_leaves_in_order():
    tree = PrefixTree(100)
    add(tree, "aa")  # t=2 (each insert and match ticks the clock)
    add(tree, "bb")
    add(tree, "cc")
    add(tree, "dd")
    tree.match(NS, "aa")  # aa is now the most recent
    assert tree.evict(0) == [tuple("bb"), tuple("cc"), tuple("dd"), tuple("aa")]
    assert tree.stats().num_evictions == 4 and tree.stats().num_bytes == 0


def test_budget_evicts_on_insert_and_keeps_what_was_used():
    tree = PrefixTree(6)
    add(tree, "aa")
    add(tree, "bb")
    add(tree, "cc")
    tree.match(NS, "aa")
    add(tree, "dddd")  # needs 4 of 6 bytes: bb, then cc go
    assert [tree.match(NS, k).num_tokens for k in ("aa", "bb", "cc", "dddd")] == [2, 0, 0, 4]
    s = tree.stats()
    assert (s.num_bytes, s.num_evictions, s.num_bytes_evicted) == (6, 2, 4)


def test_a_branch_goes_from_its_tips_to_the_fork():
    tree = PrefixTree(100)
    add(tree, "abcd")
    add(tree, "abef")  # splits "abcd" at "ab"
    add(tree, "xy")
    tree.match(NS, "xy")
    # leaves cd (oldest), ef; then "ab" becomes a leaf, older than xy
    assert tree.evict(0) == [tuple("cd"), tuple("ef"), tuple("ab"), tuple("xy")]


def test_locked_paths_are_never_evicted_and_release_restores_the_budget():
    tree = PrefixTree(4)
    add(tree, "abc")
    m = tree.match(NS, "abcz", lock=True)
    assert m.handle is not None and tree.stats().num_locked == 1
    assert add(tree, "xyz") == 0  # over budget, but abc is in use: only xyz itself could go
    assert tree.match(NS, "abc").num_tokens == 3
    assert tree.stats().num_bytes == 3  # xyz was the only unlocked leaf
    tree.lock(m.handle)  # a second user of the same prefix
    tree.release(m.handle)
    assert tree.evict(0) == []
    tree.release(m.handle)
    assert tree.stats().num_locked == 0
    assert tree.evict(0) == [tuple("abc")]


def test_release_evicts_what_a_lock_kept_above_the_budget():
    tree = PrefixTree(4)
    add(tree, "abc")
    m = tree.match(NS, "abc", lock=True)
    tree.insert(NS, "abcdef", "DEF", 3, start=3)  # 6 bytes: def is the newest leaf, abc is locked
    assert tree.stats().num_bytes == 3  # def could not stay
    add(tree, "ab")  # nothing new
    tree.release(m.handle)
    assert tree.stats().num_bytes == 3


def test_a_split_keeps_the_locks_of_the_path():
    tree = PrefixTree(100)
    add(tree, "abcd")
    m = tree.match(NS, "abcd", lock=True)
    add(tree, "abxy")  # splits the locked run "abcd" into "ab" + "cd"
    assert tree.evict(0) == [tuple("xy")]  # ab and cd are both on the locked path
    tree.release(m.handle)
    assert tree.evict(0) == [tuple("cd"), tuple("ab")]


def test_a_run_larger_than_the_budget_is_not_stored():
    tree = PrefixTree(3)
    add(tree, "ab")
    assert add(tree, "wxyz") == 0
    assert tree.match(NS, "ab").num_tokens == 2  # and nothing was evicted for it
    zero = PrefixTree(0)
    assert add(zero, "a") == 0 and zero.stats().num_nodes == 0


def test_bytes_split_in_proportion_and_add_up():
    tree = PrefixTree(1000)
    tree.insert(NS, "abcd", "ABCD", 400)
    tree.insert(NS, "abxy", "XY", 60, start=2)
    tree.insert(NS, "abcq", "Q", 7, start=3)
    s = tree.stats()
    assert s.num_bytes == 467 and s.num_tokens == 7
    assert tree.evict(0) == [tuple("d"), tuple("xy"), tuple("q"), tuple("c"), tuple("ab")]
    assert tree.stats().num_bytes_evicted == 467


def test_a_policy_is_one_object_with_one_method():
    class LargestFirst:
        def priority(self, node: Node) -> float:
            return -node.num_bytes

    tree = PrefixTree(100, policy=LargestFirst())
    add(tree, "a")
    add(tree, "bbb")
    add(tree, "cc")
    assert tree.evict(0) == [tuple("bbb"), tuple("cc"), tuple("a")]


def test_split_payload_callback_is_used():
    calls = []

    def split(payload: tuple, at: int) -> tuple[tuple, tuple]:
        calls.append((payload, at))
        return payload[:at], payload[at:]

    tree = PrefixTree(100, split=split)
    tree.insert(NS, [1, 2, 3], (10, 20, 30), 3)
    tree.insert(NS, [1, 9], (10, 90), 2)
    # the stored run [1 2 3] splits at 1; the new payload's head (key 1, held already) is cut off
    assert calls == [((10, 20, 30), 1), ((10, 90), 1)]
    assert tree.match(NS, [1, 9]).spans == (((10,), 1), ((90,), 1))


def test_misuse_raises_naming_what_is_valid():
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixTree(-1)
    with pytest.raises(ValueError, match="valid policies: lru"):
        PrefixTree(10, policy="mru")
    tree = PrefixTree(10)
    with pytest.raises(ValueError, match=r"start must be within the keys \(0 .. 3\)"):
        tree.insert(NS, "abc", "", 0, start=4)
    with pytest.raises(ValueError, match="num_bytes"):
        tree.insert(NS, "abc", "ABC", -1)
    add(tree, "abc")
    m = tree.match(NS, "abc")
    with pytest.raises(ValueError, match="not locked"):
        tree.release(m.handle)
    tree.release(None)  # nothing matched, nothing to release


def test_threads_keep_the_books_straight():
    """Requests on several threads match (locked), insert their rest and release, under a small budget:
    every match returns the data of exactly its keys, and the counters add up at the end."""
    tree = PrefixTree(60)
    prompts = ["abcdefgh", "abcdxyz", "abqrst", "mnopq", "abcdefij", "mnoz"]
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            keys = rng.choice(prompts) + rng.choice(["", "1", "12", "123"])
            m = tree.match(NS, keys, lock=True)
            if joined(m) != data(keys[: m.num_tokens]):
                errors.append(f"{keys=} got {joined(m)!r}")
            tree.insert(NS, keys, data(keys[m.num_tokens:]), len(keys) - m.num_tokens, start=m.num_tokens)
            tree.release(m.handle)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = tree.stats()
    assert s.num_locked == 0 and s.num_bytes <= 60
    assert s.num_bytes == s.num_tokens  # one byte per token, however the runs were split
    assert s.num_tokens_inserted - s.num_tokens == s.num_bytes_evicted
